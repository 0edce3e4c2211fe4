//! Config from the environment: `SANDPOOL__SECTION__KEY=value` sets `[section] key = value`,
//! for every key of the file, by one rule (so a container or a second process on the same
//! machine needs no edited copy of the file).
//!
//! The rule: strip `SANDPOOL__`, split the rest at `__`, lower-case each part: that is the
//! key's path (`SANDPOOL__TEMPLATES__DEBIAN__WARM` is `[templates.debian] warm`). The value
//! is read as a TOML value when it is exactly one (`8`, `2.5`, `true`, `["a", "b"]`,
//! `"quoted"`), otherwise as a string (`127.0.0.1:9465`, `2h`, `redis://r:6379`); quote a
//! string that would read as something else (`SANDPOOL__NODE__ID='"7"'`). An empty value sets
//! nothing (so a compose file or a unit can pass `${VAR:-}` through; `'""'` is the empty
//! string). The environment
//! overrides the file; flags and the older single-key variables (`SANDPOOL_REDIS_URL`, ...)
//! override both.

use crate::ConfigError;

/// What every variable of this layer starts with. Two underscores, so the older
/// `SANDPOOL_REDIS_URL`-style variables (and `SANDPOOL_TEST_REDIS` and the like) never match.
pub const PREFIX: &str = "SANDPOOL__";

/// Sets the keys that `vars` name in `table` (a parsed config file). Answers the variables it
/// applied, sorted, for error messages; a variable that names no key path is an error naming it.
pub fn apply(
    table: &mut toml::Table,
    vars: impl IntoIterator<Item = (String, String)>,
) -> Result<Vec<String>, ConfigError> {
    let mut applied: Vec<(String, String)> =
        vars.into_iter().filter(|(k, v)| k.starts_with(PREFIX) && !v.is_empty()).collect();
    // Sorted, so a run is the same whatever order the environment lists them in.
    applied.sort();
    for (var, value) in &applied {
        let path = key_path(var)?;
        set(table, var, &path, parse_value(value))?;
    }
    Ok(applied.into_iter().map(|(k, _)| k).collect())
}

/// `SANDPOOL__A__B_C` -> `["a", "b_c"]`.
fn key_path(var: &str) -> Result<Vec<String>, ConfigError> {
    let rest = &var[PREFIX.len()..];
    let parts: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
    if parts.iter().any(String::is_empty) {
        return Err(ConfigError::Invalid {
            field: var.to_string(),
            message: "names no key: write SANDPOOL__SECTION__KEY (parts joined by two underscores)".into(),
        });
    }
    Ok(parts)
}

/// A TOML value if the text is exactly one, else the text as a string.
fn parse_value(text: &str) -> toml::Value {
    // As the right-hand side of one assignment: a value that smuggles in a second line
    // (`1\nother = 2`) parses to two keys and is taken as the plain string it is.
    match toml::from_str::<toml::Table>(&format!("v = {text}")) {
        Ok(t) if t.len() == 1 => t.into_iter().next().map(|(_, v)| v).unwrap_or_else(|| text.into()),
        _ => toml::Value::String(text.to_string()),
    }
}

fn set(table: &mut toml::Table, var: &str, path: &[String], value: toml::Value) -> Result<(), ConfigError> {
    let (last, parents) = path.split_last().expect("key_path answers at least one part");
    let mut at = table;
    for (i, part) in parents.iter().enumerate() {
        let entry = at.entry(part.clone()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        at = match entry {
            toml::Value::Table(t) => t,
            _ => {
                return Err(ConfigError::Invalid {
                    field: var.to_string(),
                    message: format!("{} is a value in the config, not a section", path[..=i].join(".")),
                });
            }
        };
    }
    at.insert(last.clone(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn values_are_toml_when_they_are_one_and_strings_otherwise() {
        let mut t: toml::Table = toml::from_str("[gateway]\nmax_queue = 5\n").unwrap();
        let applied = apply(
            &mut t,
            vars(&[
                ("SANDPOOL__GATEWAY__MAX_QUEUE", "9"),
                ("SANDPOOL__TELEMETRY__METRICS_LISTEN", "127.0.0.1:9465"),
                ("SANDPOOL__TEMPLATES__DEBIAN__CPUS", "2.5"),
                ("SANDPOOL__QUOTAS__ENABLED", "false"),
                ("SANDPOOL__IMAGES__BASES", r#"["busybox", "debian"]"#),
                ("SANDPOOL__NODE__ID", r#""7""#),
                ("SANDPOOL__NODE__DOWN_AFTER", "20s"),
                ("SANDPOOL__AUTH__KEY", "1\nsneaky = 2"),
                ("SANDPOOL_REDIS_URL", "redis://elsewhere:6379"),
                ("SANDPOOL__REDIS__PREFIX", ""),
                ("OTHER", "x"),
            ]),
        )
        .unwrap();
        assert_eq!(applied.len(), 8, "only SANDPOOL__ variables: {applied:?}");
        assert_eq!(t["gateway"]["max_queue"].as_integer(), Some(9));
        assert_eq!(t["telemetry"]["metrics_listen"].as_str(), Some("127.0.0.1:9465"));
        assert_eq!(t["templates"]["debian"]["cpus"].as_float(), Some(2.5));
        assert_eq!(t["quotas"]["enabled"].as_bool(), Some(false));
        assert_eq!(t["images"]["bases"].as_array().map(Vec::len), Some(2));
        assert_eq!(t["node"]["id"].as_str(), Some("7"), "a quoted value is a string");
        assert_eq!(t["node"]["down_after"].as_str(), Some("20s"));
        assert_eq!(t["auth"]["key"].as_str(), Some("1\nsneaky = 2"), "one value, never two keys");
        assert!(
            t.get("redis").is_none(),
            "single-underscore variables are the flags' (clap) business; empty ones set nothing"
        );
    }

    #[test]
    fn a_variable_that_names_no_key_path_is_refused_by_name() {
        let mut t: toml::Table = toml::from_str("[gateway]\nlisten = \"127.0.0.1:1\"\n").unwrap();
        let e = apply(&mut t, vars(&[("SANDPOOL__GATEWAY__LISTEN__PORT", "2")])).unwrap_err().to_string();
        assert!(e.contains("SANDPOOL__GATEWAY__LISTEN__PORT") && e.contains("gateway.listen"), "{e}");
        let e = apply(&mut t, vars(&[("SANDPOOL__GATEWAY____LISTEN", "x")])).unwrap_err().to_string();
        assert!(e.contains("two underscores"), "{e}");
    }
}

//! Size bounds on what a tenant stores (templates' and functions' env, handlers, definitions):
//! every node and gateway keeps these in memory and re-reads them, so none may grow without
//! bound. One helper per shape, so every route that takes one checks it the same way.

use std::collections::BTreeMap;

/// Environment variables of one template or function.
pub const MAX_ENV_VARS: usize = 128;
/// One variable, name and value: a path list or a small config blob fits, a file does not.
pub const MAX_ENV_VAR_BYTES: usize = 4096;
/// All variables of one template or function, names and values: 16 full-size variables (a
/// template of 128 variables of 4 KiB each was 512 KiB, re-read by every node on every change).
pub const MAX_ENV_TOTAL_BYTES: usize = 64 * 1024;
/// A template's `workdir`: a path, at most Linux's `PATH_MAX`.
pub const MAX_WORKDIR_BYTES: usize = 4096;
/// A function's whole definition as stored (handler, env and settings): the keeper of every
/// gateway reads every function every second.
pub const MAX_FUNCTION_DEFINITION_BYTES: usize = 128 * 1024;

/// Why an env or a definition is refused: `too_large` (413: a size) or not (400: a name or a
/// count).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvProblem {
    /// True when a size is over its bound (413); false for a bad name or count (400).
    pub too_large: bool,
    /// Names the field and the bound (`env: ...`).
    pub message: String,
}

/// Checks an env: names (non-empty, no '=' or NUL), no NUL in values, at most
/// `MAX_ENV_VARS` variables of at most `MAX_ENV_VAR_BYTES` each and `MAX_ENV_TOTAL_BYTES`
/// in all.
pub fn env_problem(env: &BTreeMap<String, String>) -> Option<EnvProblem> {
    let bad = |too_large, message: String| Some(EnvProblem { too_large, message });
    if let Some((k, _)) = env.iter().find(|(k, v)| k.is_empty() || k.contains(['=', '\0']) || v.contains('\0')) {
        return bad(false, format!("env: {k:?} is not a variable name (or its value holds NUL)"));
    }
    if env.len() > MAX_ENV_VARS {
        return bad(false, format!("env: at most {MAX_ENV_VARS} variables ({} given)", env.len()));
    }
    if let Some((k, v)) = env.iter().find(|(k, v)| k.len() + v.len() > MAX_ENV_VAR_BYTES) {
        let n = k.len() + v.len();
        return bad(
            true,
            format!("env.{k}: at most {MAX_ENV_VAR_BYTES} bytes per variable, name and value ({n} given)"),
        );
    }
    let total: usize = env.iter().map(|(k, v)| k.len() + v.len()).sum();
    if total > MAX_ENV_TOTAL_BYTES {
        return bad(true, format!("env: at most {MAX_ENV_TOTAL_BYTES} bytes in all, names and values ({total} given)"));
    }
    None
}

/// Checks what a tenant's `POST /v1/templates` stores beyond fields bounded by their own
/// rules (name, image reference, base): its env (`env_problem`) and its workdir's length.
pub fn template_problem(t: &crate::images::CreateTemplate) -> Option<EnvProblem> {
    if let Some(w) = &t.workdir
        && w.len() > MAX_WORKDIR_BYTES
    {
        let message = format!("workdir: at most {MAX_WORKDIR_BYTES} bytes ({} given)", w.len());
        return Some(EnvProblem { too_large: true, message });
    }
    env_problem(&t.env)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, usize)]) -> BTreeMap<String, String> {
        vars.iter().map(|(k, n)| (k.to_string(), "x".repeat(*n))).collect()
    }

    #[test]
    fn env_bounds_name_the_field_and_the_bound() {
        assert_eq!(env_problem(&env(&[("A", 10)])), None);
        let at_total: Vec<(String, usize)> = (0..16).map(|i| (format!("V{i:02}"), MAX_ENV_VAR_BYTES - 3)).collect();
        let at_total: Vec<(&str, usize)> = at_total.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        assert_eq!(env_problem(&env(&at_total)), None, "16 full variables fit");
        let one_big = env_problem(&env(&[("BIG", 30 << 20)])).unwrap();
        assert!(one_big.too_large && one_big.message.contains("env.BIG") && one_big.message.contains("4096"));
        let over: Vec<(String, usize)> = (0..17).map(|i| (format!("V{i:02}"), MAX_ENV_VAR_BYTES - 3)).collect();
        let over: Vec<(&str, usize)> = over.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        let total = env_problem(&env(&over)).unwrap();
        assert!(total.too_large && total.message.contains("65536"), "{total:?}");
        let many: Vec<(String, usize)> = (0..129).map(|i| (format!("V{i}"), 1)).collect();
        let many: Vec<(&str, usize)> = many.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        assert!(!env_problem(&env(&many)).unwrap().too_large);
        assert!(!env_problem(&env(&[("A=B", 1)])).unwrap().too_large);
    }

    #[test]
    fn a_template_bounds_its_workdir_and_env() {
        let mut t = crate::images::CreateTemplate { image: "r/x".into(), ..Default::default() };
        assert_eq!(template_problem(&t), None);
        t.workdir = Some(format!("/{}", "w".repeat(MAX_WORKDIR_BYTES)));
        assert!(template_problem(&t).is_some_and(|p| p.too_large && p.message.starts_with("workdir:")));
        t.workdir = Some("/work".into());
        t.env = env(&[("BIG", 5000)]);
        assert!(template_problem(&t).is_some_and(|p| p.too_large && p.message.starts_with("env.BIG")));
    }
}

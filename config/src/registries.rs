//! Which images a tenant may name in `POST /v1/templates`, and whose credentials a node uses to
//! ask a registry for one. `images.allowed_registries` holds for everyone; a scope
//! (`[images.scopes."acme"]`) adds entries and credentials for a principal path and everything
//! under it. An entry is a whole registry (`host[:port]`) or the repositories under a path
//! (`host[:port]/path/*`), where `{tenant}` stands for the caller's top-level tenant: with
//! `127.0.0.1:5000/{tenant}/*`, `acme/rl` names `127.0.0.1:5000/acme/...` and nothing of
//! `other`'s.

use std::collections::BTreeMap;

use serde::Deserialize;

/// What `{tenant}` in an entry's path stands for.
pub const TENANT_PLACEHOLDER: &str = "{tenant}";

/// One entry of an allow-list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryPattern {
    /// `host[:port]`.
    pub host: String,
    /// The repositories' path prefix (without the `/*`); `None`: the whole registry.
    pub prefix: Option<String>,
}

impl RegistryPattern {
    /// Parses `host[:port]` or `host[:port]/path/*`.
    pub fn parse(s: &str) -> Result<RegistryPattern, String> {
        let (host, prefix) = match s.split_once('/') {
            None => (s, None),
            Some((host, rest)) => {
                let prefix = rest.strip_suffix("/*").ok_or("a path must end in /* (the repositories under it)")?;
                let ok = |seg: &str| {
                    seg == TENANT_PLACEHOLDER
                        || (!seg.is_empty()
                            && seg.bytes().all(|b| {
                                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
                            }))
                };
                if prefix.is_empty() || !prefix.split('/').all(ok) {
                    return Err("the path must be lower-case components (or {tenant}) ending in /*".into());
                }
                (host, Some(prefix.to_string()))
            }
        };
        if host.is_empty() || !host.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':')) {
            return Err("must start with a registry host[:port]".into());
        }
        Ok(RegistryPattern { host: host.to_string(), prefix })
    }

    /// Whether `principal` may name `reference` under this entry.
    pub fn matches(&self, reference: &str, principal: &str) -> bool {
        if wire::images::registry_of(reference) != self.host {
            return false;
        }
        let Some(prefix) = &self.prefix else { return true };
        let prefix = prefix.replace(TENANT_PLACEHOLDER, wire::quotas::top(principal));
        let path = wire::images::path_of(reference);
        path.len() > prefix.len() && path.starts_with(&prefix) && path.as_bytes()[prefix.len()] == b'/'
    }
}

/// Whether registry `host` (`host[:port]`, as in a reference) is on the node's loopback:
/// `localhost`, `127.0.0.0/8` or `[::1]`, with any port.
pub fn is_loopback(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split_once(']').map_or(v6, |(addr, _)| addr),
        None => host.split_once(':').map_or(host, |(name, _)| name),
    };
    name == "localhost" || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// A registry's credentials (Docker's `X-Registry-Auth`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryAuth {
    /// The registry user.
    pub username: String,
    /// Its password or token (never printed: `Config::redacted`).
    pub password: String,
}

/// A principal path's own registry entries and credentials (for it and its descendants).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RegistryScope {
    /// The registries it may make templates from, beside the global ones.
    pub allowed: Vec<RegistryPattern>,
    /// Its credentials by registry host.
    pub registries: BTreeMap<String, RegistryAuth>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawScope {
    allowed: Vec<String>,
    registries: BTreeMap<String, RegistryAuth>,
}

/// Checks a list of entries (`field` names it in errors).
pub(crate) fn patterns(field: &str, raw: &[String]) -> Result<Vec<RegistryPattern>, crate::ConfigError> {
    raw.iter().map(|p| RegistryPattern::parse(p).map_err(|m| crate::invalid(format!("{field}: {p:?}"), m))).collect()
}

pub(crate) fn scopes(raw: BTreeMap<String, RawScope>) -> Result<BTreeMap<String, RegistryScope>, crate::ConfigError> {
    let mut out = BTreeMap::new();
    for (path, s) in raw {
        let field = format!("images.scopes.{path}");
        if let Some(p) = wire::quotas::path_problem(&path) {
            return Err(crate::invalid(field, format!("must be a principal path: {p}")));
        }
        if wire::quotas::top(&path) == wire::images::PUBLIC_NAMESPACE {
            return Err(crate::invalid(field, "public is a reserved principal"));
        }
        for host in s.registries.keys() {
            if host.is_empty() || host.contains('/') {
                return Err(crate::invalid(format!("{field}.registries.{host}"), "must be a registry host[:port]"));
            }
        }
        let allowed = patterns(&format!("{field}.allowed"), &s.allowed)?;
        out.insert(path, RegistryScope { allowed, registries: s.registries });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_match_a_registry_or_the_repositories_under_a_path() {
        let any = RegistryPattern::parse("127.0.0.1:5000").unwrap();
        let own = RegistryPattern::parse("127.0.0.1:5000/{tenant}/*").unwrap();
        let shared = RegistryPattern::parse("127.0.0.1:5000/corpus/*").unwrap();
        assert!(any.matches("127.0.0.1:5000/other/x:latest", "acme"));
        assert!(!any.matches("127.0.0.2:5000/acme/x:latest", "acme"));
        assert!(own.matches("127.0.0.1:5000/acme/x:latest", "acme/rl/ppo"));
        assert!(own.matches("127.0.0.1:5000/acme/deep/x@sha256:00", "acme"));
        assert!(!own.matches("127.0.0.1:5000/acme-2/x:latest", "acme"));
        assert!(!own.matches("127.0.0.1:5000/other/x:latest", "acme"));
        assert!(!own.matches("127.0.0.1:5000/acme:latest", "acme"), "the path itself is no repository under it");
        assert!(shared.matches("127.0.0.1:5000/corpus/task-0001:latest", "anyone"));
        for bad in ["", "127.0.0.1:5000/acme", "127.0.0.1:5000/*", "127.0.0.1:5000/Acme/*", "/x/*"] {
            assert!(RegistryPattern::parse(bad).is_err(), "{bad:?}");
        }
    }
}

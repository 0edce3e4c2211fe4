//! Principals and quotas: a principal is a path (`acme`, `acme/rl`, `acme/rl/ppo-7`); a quota
//! may be set on any path, and usage of a path counts against the path and every ancestor.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The deepest principal path.
pub const MAX_DEPTH: usize = 8;
/// The longest principal path, in bytes.
pub const MAX_PATH_LEN: usize = 128;

/// Why `path` is not a principal path, or `None` when it is one: 1-8 segments of 1-64
/// letters, digits, '-', '_', '.', '@', joined by '/', at most 128 bytes; `.` and `..` are
/// not segments.
pub fn path_problem(path: &str) -> Option<&'static str> {
    if path.is_empty() || path.len() > MAX_PATH_LEN {
        return Some("must be 1-128 characters");
    }
    let mut depth = 0;
    for seg in path.split('/') {
        depth += 1;
        if seg.is_empty() || seg.len() > 64 {
            return Some("every '/'-separated segment must be 1-64 characters");
        }
        if seg == "." || seg == ".." {
            return Some("'.' and '..' are not segments");
        }
        if !seg.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'@')) {
            return Some("segments are letters, digits, '-', '_', '.', '@'");
        }
    }
    (depth > MAX_DEPTH).then_some("at most 8 segments")
}

/// The top-level tenant of a path (`acme` for `acme/rl/ppo-7`).
pub fn top(path: &str) -> &str {
    path.split_once('/').map_or(path, |(t, _)| t)
}

/// The parent of a path (`None` for a top-level tenant).
pub fn parent(path: &str) -> Option<&str> {
    path.rsplit_once('/').map(|(p, _)| p)
}

/// True when `path` is the reserved principal `public` (where admin-made public templates live,
/// `images::PUBLIC_NAMESPACE`) or lies under it: no tenant token may name it.
pub fn is_reserved(path: &str) -> bool {
    top(path) == crate::images::PUBLIC_NAMESPACE
}

/// True when `path` is `ancestor` or lies under it (`acme/rl` is within `acme`; `acme-2` is not).
pub fn within(path: &str, ancestor: &str) -> bool {
    path == ancestor
        || (path.len() > ancestor.len() && path.starts_with(ancestor) && path.as_bytes()[ancestor.len()] == b'/')
}

/// What a quota limits.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash, PartialOrd, Ord, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Dimension {
    /// Live sessions (a queued create counts from the moment it is admitted).
    Sessions,
    /// CPUs held by live sessions (their templates' `cpus`).
    Cpus,
    /// Memory held by live sessions (their templates' `memory_mb`).
    MemoryMb,
    /// Session creates per second (GCRA, with `create_burst`).
    CreateRate,
    /// Create requests waiting in queues for a sandbox.
    Queued,
    /// Sandboxes declared by live reservations.
    Reserved,
    /// Private templates (snapshots and forks).
    PrivateTemplates,
    /// Disk held by private templates, in MiB (the snapshot's own layer).
    PrivateTemplateMb,
    /// Calls per second (exec, files, WebSocket opens), per gateway.
    CallRate,
    /// Functions defined (`PUT /v1/functions/{name}` of a new name).
    Functions,
    /// Asynchronous invocations accepted and not finished (each holds its payload in a gateway).
    AsyncInFlight,
    /// Asynchronous invocations whose record (and result) is kept in the ledger.
    AsyncResults,
    /// The bytes of those records, in MiB.
    AsyncResultMb,
    /// Reservation requests whose hold has not ended.
    Reservations,
    /// Templates named by live reservations (one ledger entry each, read by the autoscaler).
    ReservationItems,
}

impl Dimension {
    /// Every dimension (the metrics' `dimension` label set).
    pub const ALL: [Dimension; 15] = [
        Dimension::Sessions,
        Dimension::Cpus,
        Dimension::MemoryMb,
        Dimension::CreateRate,
        Dimension::Queued,
        Dimension::Reserved,
        Dimension::PrivateTemplates,
        Dimension::PrivateTemplateMb,
        Dimension::CallRate,
        Dimension::Functions,
        Dimension::AsyncInFlight,
        Dimension::AsyncResults,
        Dimension::AsyncResultMb,
        Dimension::Reservations,
        Dimension::ReservationItems,
    ];

    /// As the API and the metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::Sessions => "sessions",
            Dimension::Cpus => "cpus",
            Dimension::MemoryMb => "memory_mb",
            Dimension::CreateRate => "create_rate",
            Dimension::Queued => "queued",
            Dimension::Reserved => "reserved",
            Dimension::PrivateTemplates => "private_templates",
            Dimension::PrivateTemplateMb => "private_template_mb",
            Dimension::CallRate => "call_rate",
            Dimension::Functions => "functions",
            Dimension::AsyncInFlight => "async_in_flight",
            Dimension::AsyncResults => "async_results",
            Dimension::AsyncResultMb => "async_result_mb",
            Dimension::Reservations => "reservations",
            Dimension::ReservationItems => "reservation_items",
        }
    }
}

/// Limits of one path; every field is optional (absent: bounded by the ancestors only).
/// `PUT /v1/quotas/{path}` takes this object.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QuotaLimits {
    /// Live sessions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<u64>,
    /// CPUs held by live sessions (their templates' `cpus`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Memory held by live sessions (their templates' `memory_mb`), MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Session creates per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_rate: Option<f64>,
    /// Creates allowed at once above the rate (default: 1 second's worth, at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_burst: Option<u64>,
    /// Create requests waiting in queues for a sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued: Option<u64>,
    /// Sandboxes declared by live reservations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved: Option<u64>,
    /// Private templates (snapshots and forks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_templates: Option<u64>,
    /// Disk held by private templates (each snapshot's own layer), MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_template_mb: Option<u64>,
    /// Functions defined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub functions: Option<u64>,
    /// Asynchronous invocations in flight (accepted, not finished).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub async_in_flight: Option<u64>,
    /// Asynchronous invocations whose record is kept (`gateway.invocation_ttl`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub async_results: Option<u64>,
    /// The bytes of the kept records, in MiB (a result that would go over is kept as a 429).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub async_result_mb: Option<u64>,
    /// Reservation requests whose hold has not ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservations: Option<u64>,
    /// Templates named by live reservations, over all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_items: Option<u64>,
    /// The isolation classes (OCI runtimes: `runc`, `runsc`, ...) this path's sessions and
    /// reservations may use. Absent: whatever its ancestors allow; every level that sets a
    /// list must name the class. A path's list must lie within its ancestors'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<Vec<String>>,
}

impl QuotaLimits {
    /// Why these limits are not valid, naming the field.
    pub fn problem(&self) -> Option<String> {
        if let Some(c) = self.cpus
            && !(c.is_finite() && c >= 0.0)
        {
            return Some("cpus: must be a non-negative number".into());
        }
        if let Some(r) = self.create_rate
            && !(r.is_finite() && r > 0.0 && r <= 1e6)
        {
            return Some("create_rate: must be in (0, 1000000] per second".into());
        }
        if self.create_burst == Some(0) {
            return Some("create_burst: must be at least 1".into());
        }
        if self.create_burst.is_some() && self.create_rate.is_none() {
            return Some("create_burst: needs create_rate".into());
        }
        if let Some(classes) = &self.isolation
            && let Some(bad) = classes.iter().find(|c| !is_class_name(c))
        {
            return Some(format!("isolation: {bad:?} is not a runtime name (1-64 of letters, digits, '-', '_', '.')"));
        }
        None
    }

    /// True when nothing is set.
    pub fn is_empty(&self) -> bool {
        self == &QuotaLimits::default()
    }
}

/// An OCI runtime's name as Docker takes it.
pub fn is_class_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// What a path holds now.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct QuotaUsage {
    /// Live sessions.
    pub sessions: u64,
    /// CPUs held by live sessions.
    pub cpus: f64,
    /// Memory held by live sessions, MiB.
    pub memory_mb: u64,
    /// Create requests waiting in queues for a sandbox.
    pub queued: u64,
    /// Sandboxes declared by live reservations.
    pub reserved: u64,
    /// Private templates (snapshots and forks).
    pub private_templates: u64,
    /// Disk held by private templates, MiB.
    pub private_template_mb: u64,
    /// Functions defined.
    pub functions: u64,
    /// Asynchronous invocations accepted and not finished.
    pub async_in_flight: u64,
    /// Asynchronous invocations whose record is kept.
    pub async_results: u64,
    /// The bytes of those records, in MiB.
    pub async_result_mb: f64,
    /// Reservation requests whose hold has not ended.
    pub reservations: u64,
    /// Templates named by live reservations.
    pub reservation_items: u64,
}

/// `GET /v1/quotas/{path}`: a path's own limits (as set), the limits that bind it (its own,
/// else the default for a top-level tenant), its usage, and the same for its children.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct QuotaView {
    /// The principal path.
    pub path: String,
    /// As set on this path (empty when none).
    pub limits: QuotaLimits,
    /// The limits an admin set on this path (empty when none): only an admin may loosen or
    /// remove them; a tenant may restate or tighten them, so `limits` stays within them.
    #[serde(default, skip_serializing_if = "QuotaLimits::is_empty")]
    pub admin_set: QuotaLimits,
    /// A top-level tenant without its own value of a dimension gets `[quotas.default]`'s.
    #[serde(default, skip_serializing_if = "QuotaLimits::is_empty")]
    pub defaults: QuotaLimits,
    /// What the path holds now, its descendants' included.
    pub usage: QuotaUsage,
    /// The same view of each child path (none with `?children=false`).
    #[schema(no_recursion)]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<QuotaView>,
}

/// `GET /v1/usage`: the caller's limits and usage at every level of its path, its own first.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct UsageView {
    /// The caller's principal path.
    pub path: String,
    /// The view of each level of the path, the caller's own first.
    pub levels: Vec<QuotaView>,
}

/// `sandpool quota verify` and `POST /v1/quotas:verify`: usage as counted against usage
/// recomputed from what is live, per path and dimension.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct QuotaDrift {
    /// Leases of sessions and requests that no longer exist (given back by this run).
    pub orphans_released: u64,
    /// (path, dimension, counted, recomputed) where they differ.
    pub drift: Vec<DriftEntry>,
    /// True when the counted usage was corrected to the recomputed one.
    pub fixed: bool,
}

/// One path and dimension whose counted usage differs from the recomputed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct DriftEntry {
    /// The principal path.
    pub path: String,
    /// A usage field (`sessions`, `cpus`, ...), or `live_sessions`: sessions leased against those
    /// live on the nodes.
    pub dimension: String,
    /// Usage as counted (`live_sessions`: the sessions leased).
    pub counted: f64,
    /// Usage recomputed from the leases held (`live_sessions`: the sessions live on the nodes).
    pub recomputed: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_their_relations() {
        for ok in ["acme", "acme/rl", "acme/rl/ppo-7", "a@b.c/x_y", "a/b/c/d/e/f/g/h"] {
            assert_eq!(path_problem(ok), None, "{ok}");
        }
        for bad in ["", "/acme", "acme/", "acme//rl", "acme/../x", "acme/.", "a b", "a/b/c/d/e/f/g/h/i", "a{b}"] {
            assert!(path_problem(bad).is_some(), "{bad}");
        }
        assert_eq!(top("acme/rl/x"), "acme");
        assert_eq!(parent("acme/rl/x"), Some("acme/rl"));
        assert_eq!(parent("acme"), None);
        assert!(within("acme/rl", "acme") && within("acme", "acme"));
        assert!(!within("acme-2", "acme") && !within("acme", "acme/rl") && !within("acmex/rl", "acme"));
        assert!(
            is_reserved("public") && is_reserved("public/x") && !is_reserved("publicity") && !is_reserved("a/public")
        );
    }

    #[test]
    fn limits_are_checked_and_strict() {
        assert!(serde_json::from_str::<QuotaLimits>(r#"{"sesions": 3}"#).is_err());
        let l: QuotaLimits = serde_json::from_str(r#"{"sessions": 3, "create_rate": 2.5}"#).unwrap();
        assert_eq!((l.sessions, l.create_rate), (Some(3), Some(2.5)));
        assert!(QuotaLimits { create_burst: Some(3), ..Default::default() }.problem().is_some());
        assert!(QuotaLimits { create_rate: Some(-1.0), ..Default::default() }.problem().is_some());
        let l: QuotaLimits = serde_json::from_str(r#"{"isolation": ["runsc"]}"#).unwrap();
        assert_eq!((l.isolation.as_deref(), l.problem()), (Some(&["runsc".to_string()][..]), None));
        assert!(QuotaLimits { isolation: Some(vec!["run c".into()]), ..Default::default() }.problem().is_some());
    }
}

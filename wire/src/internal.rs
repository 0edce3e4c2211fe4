//! The internal API between gateways and pool-managers (shared secret, never exposed to tenants).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Header carrying the shared secret on every internal call.
pub const SECRET_HEADER: &str = "x-sandpool-secret";
/// Header carrying the caller's lease fencing token on exec and file calls.
pub const FENCE_HEADER: &str = "x-sandpool-fence";

/// What a new session asks of the ledger; the gateway fills it in after auth and validation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LeaseSpec {
    pub session_id: String,
    pub tenant: String,
    pub template: String,
    pub ttl_ms: u64,
    pub idle_ms: u64,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub session_key: Option<String>,
}

/// `POST /internal/v1/sandboxes/{id}/snapshot`: commit the sandbox as a private template.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    pub tenant: String,
}

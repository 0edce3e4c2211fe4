//! The internal API between gateways and pool-managers (shared secret, never exposed to tenants).

use serde::{Deserialize, Serialize};

/// Header carrying the shared secret on every internal call.
pub const SECRET_HEADER: &str = "x-sandpool-secret";
/// Header carrying the caller's lease fencing token on exec and file calls.
pub const FENCE_HEADER: &str = "x-sandpool-fence";

/// `POST /internal/v1/sandboxes/{id}/snapshot`: commit the sandbox as a private template.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    pub tenant: String,
    /// The random part of the template's name (16 hex digits), chosen by the gateway, whose
    /// quota lease is named by it; absent: the node picks one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// Answer of `POST /internal/v1/sandboxes/{id}/snapshot`: a tenant's private template, a
/// snapshot of a session's filesystem on the node that took it (the ledger stores it as is).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PrivateTemplate {
    /// `<node>.<hex>`: names its node, like sandbox and session ids.
    pub name: String,
    pub tenant: String,
    /// The configured template it derives from (limits, network, workdir, lifetimes).
    pub base: String,
    /// The node-local image holding the snapshot.
    pub image: String,
    pub created_ms: u64,
    /// Disk the snapshot holds beyond its base image (its own layer), in MiB, rounded up.
    #[serde(default)]
    pub size_mb: u64,
}

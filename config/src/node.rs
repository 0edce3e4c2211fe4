//! `[node]`: the node's identity and how long silence means down, then lost.

use std::time::Duration;

use serde::Deserialize;

use crate::{ConfigError, Overrides, invalid, is_name};

/// A node silent this long is down: nothing is placed on it and its sessions answer 503
/// `node_unavailable`. Five heartbeats (2 s apart): a GC pause or a slow Redis is not a death.
pub const DEFAULT_NODE_DOWN_AFTER: Duration = Duration::from_secs(10);

/// A node down this long is given up: its sessions end (`node_lost`), their quota returns.
/// Long enough for a pool-manager restart or a Docker restart; short beside a session's hours.
pub const DEFAULT_NODE_LOST_AFTER: Duration = Duration::from_secs(300);

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawNode {
    id: Option<String>,
    #[serde(with = "humantime_serde", default)]
    down_after: Option<Duration>,
    #[serde(with = "humantime_serde", default)]
    lost_after: Option<Duration>,
}

/// Node identity and liveness.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The node's id; `None`: derived at start from the host name and Docker's engine id.
    pub id: Option<String>,
    /// Silent this long (no heartbeat): down.
    pub down_after: Duration,
    /// Down this long: given up (its sessions end with `node_lost`).
    pub lost_after: Duration,
}

/// A node id: 1-32 characters of a-z, 0-9 and '-' (it starts every sandbox and session id,
/// before a '.').
pub fn valid_node_id(id: &str) -> bool {
    is_name(id, 32) && !id.contains('_')
}

/// `[node]`, with the `--node-id` override.
pub(crate) fn validate_node(raw: RawNode, o: &Overrides) -> Result<NodeConfig, ConfigError> {
    let node = NodeConfig {
        id: o.node_id.clone().or(raw.id),
        down_after: raw.down_after.unwrap_or(DEFAULT_NODE_DOWN_AFTER),
        lost_after: raw.lost_after.unwrap_or(DEFAULT_NODE_LOST_AFTER),
    };
    if let Some(id) = &node.id
        && !valid_node_id(id)
    {
        return Err(invalid("node.id", "must be 1-32 characters of a-z, 0-9 and '-'"));
    }
    if node.down_after < Duration::from_secs(3) {
        return Err(invalid("node.down_after", "must be at least 3s (heartbeats are 2 s apart)"));
    }
    if node.lost_after < node.down_after {
        return Err(invalid("node.lost_after", "must be at least node.down_after"));
    }
    Ok(node)
}

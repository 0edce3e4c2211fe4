//! What nodes report of themselves (`GET /v1/pools`, and the self-report every gateway places
//! sessions by): pools, create rate, and the sandbox budget.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// One pool (template) on one node, as `GET /v1/pools` shows it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct PoolStats {
    /// Sandboxes ready and not leased.
    pub idle: u64,
    /// Sandboxes leased to sessions (paused ones included).
    pub leased: u64,
    /// Sandboxes being created.
    pub creating: u64,
    /// Create requests waiting in the node's queue for a sandbox of this template.
    pub waiting: u64,
    /// The idle count the node is steering to now.
    pub target: u64,
    /// Why the template cannot start sandboxes, while it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unhealthy: Option<String>,
    /// Creates per second of this template the node can sustain, as its own recent creates
    /// measured (never above the node's `sustainable_create_rate`); 0 before its first create
    /// on this node. A Debian create costs the node several busybox ones, so the reservation
    /// planner fills each template at its own rate.
    #[serde(default)]
    pub create_rate: f64,
    /// Mean latency of this template's recent creates on the node (EWMA), ms; 0 before its first.
    #[serde(default)]
    pub create_ms: f64,
}

/// A node's self-report, refreshed about twice a second.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct NodeStats {
    /// When the node wrote this report: the ledger's clock, Unix milliseconds.
    pub at_ms: u64,
    /// Creates per second the node has sustained recently (EWMA).
    pub create_rate: f64,
    /// Mean create latency (EWMA), milliseconds.
    pub create_ms: f64,
    /// The node's configured cap on its sandboxes (`pool_manager.max_sandboxes`).
    pub max_sandboxes: u64,
    /// Memory the node offers sandboxes, MiB: the host's times `pool_manager.memory_overcommit`.
    pub memory_mb: u64,
    /// Its pools, by template name.
    pub pools: BTreeMap<String, PoolStats>,
    /// How many sandboxes the node can hold, and what binds it.
    #[serde(default)]
    pub budget: NodeBudget,
    /// Creates the node keeps in flight now: its create window, adapted to what Docker
    /// sustains (0 from a node that does not report it).
    #[serde(default)]
    pub create_window: u64,
}

impl NodeStats {
    /// Creates per second the node can sustain: its create budget (`create_rate`), unless its
    /// create window and measured create latency cap it lower (Little's law). A node that does
    /// not report a window counts at `max_in_flight`.
    pub fn sustainable_create_rate(&self, create_rate: f64, max_in_flight: usize) -> f64 {
        let window = if self.create_window > 0 { self.create_window as f64 } else { max_in_flight as f64 };
        create_rate.min(window * 1000.0 / self.create_ms.max(1.0))
    }
}

/// A node's sandbox budget: for each resource that can run out, how many sandboxes it leaves
/// room for (after a reserve for the system); the least of them is the node's capacity.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct NodeBudget {
    /// Sandboxes the node can hold: the least capacity of its resources.
    pub capacity: u64,
    /// Sandboxes the node holds now (idle, leased or paused; its plan counts creates in
    /// flight on top).
    pub sandboxes: u64,
    /// The resource that sets `capacity`.
    pub binding: String,
    /// Each resource that can run out, with its limit, use and cost per sandbox.
    pub resources: Vec<BudgetResource>,
}

impl NodeBudget {
    /// True when the node may not start another sandbox.
    pub fn full(&self) -> bool {
        !self.resources.is_empty() && self.sandboxes >= self.capacity
    }
}

/// One resource of a node's budget: its limit, its use, and how many sandboxes it leaves room for.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct BudgetResource {
    /// `threads` (process ids), `memory_mb`, `open_files`, `max_sandboxes` (the config's cap).
    pub name: String,
    /// How much of it the machine has (the reserve for the system not taken off).
    pub limit: f64,
    /// In use on the whole machine now.
    pub used: f64,
    /// What one more sandbox costs (measured where the node can, else an estimate).
    pub per_sandbox: f64,
    /// Sandboxes this resource allows in all, the reserve kept.
    pub capacity: u64,
}

/// One node in `GET /v1/pools`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct NodeView {
    /// The node's id.
    pub node: String,
    /// Its self-report (its fields sit beside `node`).
    #[serde(flatten)]
    pub stats: NodeStats,
}

/// Answer of `GET /v1/pools` (admin).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct PoolsView {
    /// Every node that reports, one entry each.
    pub nodes: Vec<NodeView>,
}

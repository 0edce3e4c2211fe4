//! What a node publishes about itself every few pool ticks: its stats in the ledger (the
//! gateway's placement reads them) and its metrics.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ledger::{NodeStats, PoolStats};
use telemetry::metrics::template_label;
use telemetry::names;

use super::Node;
use super::pools::Observed;
use crate::sync::lock;

/// How long the node's `room` (node-side admission) stands without a refresh (stats are
/// written twice a second).
const ROOM_TTL: Duration = Duration::from_secs(3);

impl Node {
    pub(super) async fn publish_stats(&self, views: &[Observed]) {
        let now = Instant::now();
        let held = self.counts_by_template();
        let unhealthy: HashMap<String, String> =
            lock(&self.pools.backoff).iter().filter_map(|(t, b)| Some((t.clone(), b.cause.clone()?))).collect();
        let pools: BTreeMap<String, PoolStats> = views
            .iter()
            .map(|v| {
                let name = &v.template.name;
                let held = held.get(name).copied().unwrap_or(0);
                let creating = self.pools.creating(name);
                // Sandboxes in the map are idle or leased (creating ones join it when ready).
                let leased = held.saturating_sub(v.idle);
                let stats = PoolStats {
                    idle: v.idle,
                    leased,
                    creating,
                    waiting: v.waiting,
                    target: v.target,
                    unhealthy: unhealthy.get(name).cloned(),
                    ..PoolStats::default()
                };
                (name.clone(), stats)
            })
            .collect();
        let mut stats = NodeStats {
            at_ms: self.ledger.now_ms().await.unwrap_or(0),
            create_rate: self.pools.rate(now),
            create_ms: self.pools.create_ms.load(Ordering::Relaxed) as f64,
            max_sandboxes: self.config.pool_manager.max_sandboxes,
            memory_mb: (host_memory_mb() as f64 * self.config.pool_manager.memory_overcommit) as u64,
            pools,
            budget: self.budget(),
            create_window: self.pools.window(),
        };
        // Each template at its own rate, within what the node sustains of any.
        let pm = &self.config.pool_manager;
        let node_rate = stats.sustainable_create_rate(pm.create_rate, pm.max_creates_in_flight);
        {
            let mut rates = lock(&self.pools.per_template);
            rates.retain(&views.iter().map(|v| v.template.name.as_str()).collect());
            for (name, p) in &mut stats.pools {
                if let Some(c) = rates.get(name) {
                    p.create_rate = c.rate(node_rate);
                    p.create_ms = c.ms;
                }
            }
        }
        self.remeasure().await;
        self.export_metrics(&stats).await;
        if let Err(e) = self.ledger.write_stats(&self.id, &stats).await {
            tracing::warn!(error = %e, "publish node stats");
        }
        // Node-side admission: the queueing script refuses requests beyond this room, so a
        // full node sends them to the next choice (a node that measured nothing admits).
        if !stats.budget.resources.is_empty() {
            let room = stats.budget.capacity.saturating_sub(stats.budget.sandboxes + self.pools.in_flight());
            if let Err(e) = self.ledger.set_room(&self.id, room, ROOM_TTL.as_millis() as u64).await {
                tracing::warn!(error = %e, "publish the node's room");
            }
        }
    }

    /// Sets the node's and its pools' gauges from the stats just gathered (private templates
    /// summed under `private`), and the live sessions by top-level tenant from the ledger.
    async fn export_metrics(&self, stats: &NodeStats) {
        #[derive(Default)]
        struct Sum {
            idle: u64,
            leased: u64,
            paused: u64,
            creating: u64,
            target: u64,
            waiting: u64,
            healthy: bool,
        }
        let paused = self.paused_by_template();
        let mut pools: BTreeMap<&str, Sum> = BTreeMap::new();
        for (name, p) in &stats.pools {
            let s = pools.entry(template_label(name)).or_insert_with(|| Sum { healthy: true, ..Sum::default() });
            let paused = paused.get(name).copied().unwrap_or(0).min(p.leased);
            s.idle += p.idle;
            s.leased += p.leased - paused;
            s.paused += paused;
            s.creating += p.creating;
            s.target += p.target;
            s.waiting += p.waiting;
            s.healthy &= p.unhealthy.is_none();
        }
        let mut tenants: BTreeMap<&str, u64> = BTreeMap::new();
        let active = match self.ledger.active_sessions(&self.id).await {
            Ok(a) => Some(a),
            Err(e) => {
                tracing::debug!(error = %e, "read active sessions");
                None
            }
        };
        for (tenant, n) in active.iter().flatten() {
            *tenants.entry(wire::quotas::top(tenant)).or_insert(0) += n;
        }

        let node = || self.id.clone();
        let mut now_reported = HashSet::new();
        for (&t, s) in &pools {
            for (state, v) in [("idle", s.idle), ("leased", s.leased), ("paused", s.paused), ("creating", s.creating)] {
                metrics::gauge!(names::POOL_SANDBOXES, "node" => node(), "template" => t.to_owned(), "state" => state)
                    .set(v as f64);
            }
            metrics::gauge!(names::POOL_TARGET, "node" => node(), "template" => t.to_owned()).set(s.target as f64);
            metrics::gauge!(names::POOL_WAITING, "node" => node(), "template" => t.to_owned()).set(s.waiting as f64);
            metrics::gauge!(names::TEMPLATE_HEALTHY, "node" => node(), "template" => t.to_owned()).set(if s.healthy {
                1.0
            } else {
                0.0
            });
            now_reported.insert(("template", t.to_owned()));
        }
        if active.is_some() {
            for (&tenant, n) in &tenants {
                metrics::gauge!(names::SESSIONS_ACTIVE, "node" => node(), "tenant" => tenant.to_owned()).set(*n as f64);
                now_reported.insert(("tenant", tenant.to_owned()));
            }
        }
        let mut reported = lock(&self.pools.reported);
        for (kind, v) in reported.iter() {
            if now_reported.contains(&(*kind, v.clone())) {
                continue;
            }
            match *kind {
                "template" => {
                    for state in ["idle", "leased", "paused", "creating"] {
                        metrics::gauge!(names::POOL_SANDBOXES, "node" => node(), "template" => v.clone(), "state" => state)
                            .set(0.0);
                    }
                    metrics::gauge!(names::POOL_TARGET, "node" => node(), "template" => v.clone()).set(0.0);
                    metrics::gauge!(names::POOL_WAITING, "node" => node(), "template" => v.clone()).set(0.0);
                }
                // Kept if the ledger could not be read this time.
                _ if active.is_none() => {
                    now_reported.insert((*kind, v.clone()));
                }
                _ => metrics::gauge!(names::SESSIONS_ACTIVE, "node" => node(), "tenant" => v.clone()).set(0.0),
            }
        }
        *reported = now_reported;
        drop(reported);

        let pm = &self.config.pool_manager;
        metrics::gauge!(names::NODE_CAPACITY, "node" => node()).set(stats.budget.capacity as f64);
        for r in &stats.budget.resources {
            metrics::gauge!(names::NODE_BUDGET, "node" => node(), "resource" => r.name.clone()).set(r.capacity as f64);
        }
        // Held (idle, leased, paused) and being created.
        let creating: u64 = stats.pools.values().map(|p| p.creating).sum();
        metrics::gauge!(names::NODE_SANDBOXES, "node" => node()).set((self.sandbox_count() as u64 + creating) as f64);
        metrics::gauge!(names::NODE_CREATE_BUDGET, "node" => node()).set(pm.create_rate);
        metrics::gauge!(names::NODE_CREATE_WINDOW, "node" => node()).set(stats.create_window as f64);
        metrics::gauge!(names::NODE_CREATE_RATE, "node" => node()).set(stats.create_rate);
    }
}

/// Total memory of the host (0 if unreadable). (Published times `memory_overcommit`: what
/// the node offers to sandboxes' memory limits.)
fn host_memory_mb() -> u64 {
    use crate::budget::Probe as _;
    crate::budget::Proc { thread_cap: None }.memory_mb().map_or(0, |(total, _)| total as u64)
}

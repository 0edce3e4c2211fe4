//! The node's periodic work: the reaper, the heartbeat (the node id's lease) and giving up
//! nodes that went silent.

use std::sync::Arc;
use std::time::Duration;

use telemetry::names;
use tokio_util::sync::CancellationToken;

use super::Node;

/// How often expired sessions are reaped (lookups also reap on the spot).
const REAP_INTERVAL: Duration = Duration::from_millis(500);
/// How often a node sweeps the quota leases of every tenant for holders that are gone (any
/// node may; each does, so the sweep survives any node's loss).
const QUOTA_SWEEP_INTERVAL: Duration = Duration::from_secs(30);
const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// How often a node looks for nodes silent past `node.lost_after`, to give them up (any node
/// may; each does, so it survives any node's loss), and retries its unfinished destroys.
const LOST_SWEEP_INTERVAL: Duration = Duration::from_secs(5);
/// How often a running node compares its containers, its map and the ledger (`Node::sweep`):
/// the containers Docker reported created since the last sweep and one record count, so its
/// cost follows the creates, not the sandboxes.
const ORPHAN_SWEEP_INTERVAL: Duration = Duration::from_secs(20);

impl Node {
    /// Ends expired sessions; their sandboxes are then destroyed by `destroy_loop`.
    pub async fn reap_loop(self: Arc<Self>, cancel: CancellationToken) {
        let mut last_sweep = tokio::time::Instant::now();
        let mut last_lost = tokio::time::Instant::now();
        let mut last_orphans = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(REAP_INTERVAL) => {}
            }
            // A span per tick only at debug level: the reaper runs twice a second, and the work
            // it causes (destroying sandboxes) has spans of its own (`pool.destroy`).
            let tick = tracing::debug_span!("pool.reap");
            match tracing::Instrument::instrument(self.ledger.reap_expired(&self.id, 256), tick).await {
                Ok(ended) => {
                    for e in ended {
                        metrics::counter!(names::SESSIONS_ENDED, "reason" => e.reason.as_str()).increment(1);
                        tracing::info!(session = %e.session_id, tenant = %e.tenant, "session expired");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "reap expired sessions"),
            }
            // Waiting counts that still count vanished waiters are put right.
            let templates = self.template_names();
            let templates: Vec<&str> = templates.iter().map(String::as_str).collect();
            if let Err(e) = self.ledger.recount_waiters(&self.id, &templates).await {
                tracing::warn!(error = %e, "recount the queues");
            }
            // The quota leases of sessions that ended here (reaped, failed, removed).
            if let Err(e) = self.ledger.quota_drain_returns(&self.id, 256).await {
                tracing::warn!(error = %e, "give quota leases back");
            }
            if last_orphans.elapsed() >= ORPHAN_SWEEP_INTERVAL {
                last_orphans = tokio::time::Instant::now();
                if let Err(e) = self.sweep().await {
                    tracing::warn!(error = format!("{e:#}"), "compare containers with the ledger");
                }
            }
            if last_lost.elapsed() >= LOST_SWEEP_INTERVAL {
                last_lost = tokio::time::Instant::now();
                self.retry_leftovers().await;
                if let Err(e) = self.give_up_lost_nodes().await {
                    tracing::warn!(error = %e, "give up lost nodes");
                }
            }
            if last_sweep.elapsed() >= QUOTA_SWEEP_INTERVAL {
                last_sweep = tokio::time::Instant::now();
                match self.ledger.quota_sweep(&self.config.quotas.default).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(leases = n, "quota sweep gave back leases whose holder is gone"),
                    Err(e) => tracing::warn!(error = %e, "quota sweep"),
                }
            }
        }
    }

    /// Renews the node id's lease every 2 s (the node is live while it holds it) and records
    /// the heartbeat. A lease found vacant means the node was down (Redis unreachable past
    /// `node.down_after`) or the ledger lost its data: the node registers again, and rebuilds
    /// its part of the ledger from what it runs if the ledger forgot it. A lease another
    /// process took stops this one: two pool-managers must never act as one node. On shutdown
    /// the lease is given back, so the node is down at once rather than `down_after` later.
    pub async fn heartbeat_loop(self: Arc<Self>, cancel: CancellationToken) {
        let lease_ms = self.config.node.down_after.as_millis() as u64;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(HEARTBEAT_INTERVAL) => {}
            }
            match self.ledger.claim_node(&self.id, &self.holder, lease_ms, false).await {
                Ok(ledger::NodeClaim::Claimed { fresh, known }) => {
                    if fresh {
                        self.rejoin(known).await;
                    }
                    let beat = async { self.ledger.heartbeat(&self.id, self.ledger.now_ms().await?).await };
                    if let Err(e) = beat.await {
                        tracing::warn!(error = %e, "heartbeat");
                    }
                }
                Ok(ledger::NodeClaim::Held { by, .. }) => {
                    tracing::error!(node = %self.id, holder = %by, "another pool-manager took this node's id; this one stops");
                    self.cancel.cancel();
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "renew the node's lease"),
            }
        }
        if let Err(e) = self.ledger.release_node(&self.id, &self.holder).await {
            tracing::warn!(error = %e, "give the node's lease back");
        }
    }

    /// The node's lease had lapsed: register again (a node given up was removed from the
    /// registry) and bring back what the ledger forgot of this node's sandboxes (all of it,
    /// when Redis came back empty; `known` says whether it still had any record of them).
    async fn rejoin(self: &Arc<Self>, known: bool) {
        tracing::warn!(node = %self.id, known, "the node's lease had lapsed (it was down, or the ledger lost it); rejoining");
        if let Err(e) = self.register().await {
            tracing::warn!(error = %e, "register the node again");
        }
        if let Err(e) = self.rebuild().await {
            tracing::warn!(error = %e, "rebuild the node's part of the ledger");
        }
    }

    /// Gives up every other node silent past `node.lost_after`: its sessions end (`node_lost`)
    /// and their quota leases return; its idle sandboxes leave the pools; it leaves the
    /// registry. Idempotent: any number of nodes may do it at once.
    pub async fn give_up_lost_nodes(&self) -> Result<(), ledger::LedgerError> {
        let lost_ms = self.config.node.lost_after.as_millis() as u64;
        for n in self.ledger.node_states().await? {
            if n.info.id == self.id || n.silent_ms < lost_ms {
                continue;
            }
            let (mut ended, mut doomed) = (0usize, 0u64);
            loop {
                match self.ledger.give_up_node(&n.info.id, 256).await? {
                    ledger::NodeLost::Live => break,
                    ledger::NodeLost::GivenUp { ended: e, doomed: d, more } => {
                        for s in &e {
                            metrics::counter!(names::SESSIONS_ENDED, "reason" => s.reason.as_str()).increment(1);
                        }
                        ended += e.len();
                        doomed += d;
                        while self.ledger.quota_drain_returns(&n.info.id, 256).await? == 256 {}
                        if !more {
                            self.ledger.forget_node(&n.info.id).await?;
                            metrics::counter!(names::NODES_LOST).increment(1);
                            tracing::warn!(node = %n.info.id, silent_s = n.silent_ms / 1000, sessions = ended, idle = doomed, "gave up a lost node");
                            break;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

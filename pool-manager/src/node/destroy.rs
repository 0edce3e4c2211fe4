//! Destroying a sandbox, retrying what did not finish, and the loop that destroys what the
//! ledger dooms.

use std::sync::Arc;
use std::time::Duration;

use ledger::GoneReason;
use telemetry::names;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::{Leftover, Node};
use crate::sync::lock;

/// How long one pop of the doomed list waits for an id: also how long the destroy loop may take
/// to notice that it is told to stop.
const DOOMED_POP_WAIT: Duration = Duration::from_secs(1);

impl Node {
    /// Removes a sandbox's container and ledger record; a session on it ends with `reason`.
    #[tracing::instrument(name = "pool.destroy", skip_all, fields(sandbox = %id, reason = reason.as_str()))]
    pub async fn destroy(&self, id: &str, reason: GoneReason) {
        let sb = self.take(id);
        if let Some(a) = sb.as_ref().and_then(|s| s.agent.as_ref()) {
            a.close();
        }
        // Its last CPU use, into the per-template totals (a sandbox that ends unread counts too).
        if let Some(sb) = &sb
            && let Err(e) = self.cpu_use(sb).await
        {
            tracing::debug!(sandbox = %id, error = %e, "read the CPU use of an ending sandbox");
        }
        let container = match &sb {
            Some(s) => Some(s.container.clone()),
            None => match self.ledger.sandbox_container(&self.id, id).await {
                Ok(c) => c,
                // The ledger did not answer: Docker's labels say which container it is (a
                // record whose container is unknown would leave the container behind).
                Err(_) => {
                    self.engine.list().await.ok().and_then(|l| l.into_iter().find(|c| c.sandbox == id).map(|c| c.id))
                }
            },
        };
        if container.is_some() {
            metrics::counter!(names::DESTROYS, "node" => self.id.clone(), "reason" => reason.as_str()).increment(1);
        }
        self.agent_files.remove_run_dir(id);
        let left = Leftover { sandbox: id.to_string(), container, forget: Some(reason) };
        self.finish_or_retry(left).await;
    }

    /// Finishes a destroy now, or leaves what failed to the reaper's retries.
    pub(super) async fn finish_or_retry(&self, left: Leftover) {
        if let Some(left) = self.finish_destroy(left).await {
            lock(&self.leftovers).push(left);
        }
    }

    /// Removes the container and forgets the record; what failed is given back.
    async fn finish_destroy(&self, mut left: Leftover) -> Option<Leftover> {
        if let Some(c) = &left.container {
            match self.engine.remove(c).await {
                Ok(()) => left.container = None,
                Err(e) => tracing::warn!(sandbox = %left.sandbox, error = %e, "remove container (will retry)"),
            }
        }
        if let Some(reason) = left.forget {
            match self.ledger.sandbox_remove(&self.id, &left.sandbox, reason).await {
                Ok(ended) => {
                    if let Some(ended) = ended {
                        metrics::counter!(names::SESSIONS_ENDED, "reason" => ended.reason.as_str()).increment(1);
                    }
                    left.forget = None;
                }
                Err(e) => tracing::warn!(sandbox = %left.sandbox, error = %e, "forget sandbox (will retry)"),
            }
        }
        (left.container.is_some() || left.forget.is_some()).then_some(left)
    }

    /// Retries the destroys that did not finish.
    pub(super) async fn retry_leftovers(&self) {
        let todo = std::mem::take(&mut *lock(&self.leftovers));
        if todo.is_empty() {
            return;
        }
        let mut still = Vec::new();
        for left in todo {
            still.extend(self.finish_destroy(left).await);
        }
        if !still.is_empty() {
            tracing::info!(left = still.len(), "destroys still unfinished; retrying");
        }
        lock(&self.leftovers).extend(still);
    }

    /// Destroys sandboxes the ledger dooms (released or expired sessions): up to
    /// `config::MAX_DESTROYS_IN_FLIGHT` at once, `destroys_beside_creates` while creates run.
    pub async fn destroy_loop(self: Arc<Self>, cancel: CancellationToken) {
        let slots = Arc::new(Semaphore::new(config::MAX_DESTROYS_IN_FLIGHT));
        loop {
            // Yield to creates: wait (polling; a create takes hundreds of milliseconds) until
            // the destroys in flight are under what the creates running now leave them.
            while config::MAX_DESTROYS_IN_FLIGHT - slots.available_permits() >= self.destroy_allowance() {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
            }
            if cancel.is_cancelled() {
                return;
            }
            // The pop is never dropped half-way, not even to stop: Redis may hand it an id a
            // moment after, on the pooled connection that outlives the dropped future, and that
            // id would be lost (its container running, its record doomed until the next start's
            // reconcile). It lasts at most `DOOMED_POP_WAIT`; an id it brings is destroyed.
            let popped = self.ledger.pop_doomed(&self.id, DOOMED_POP_WAIT).await;
            match popped {
                Ok(Some(id)) => {
                    let Ok(permit) = slots.clone().acquire_owned().await else { return };
                    let node = self.clone();
                    self.tracker.spawn(async move {
                        node.destroy(&id, GoneReason::Removed).await;
                        drop(permit);
                    });
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "pop doomed sandbox");
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
    }

    /// Destroys that may be in flight now: all slots while no create runs, a few beside creates.
    fn destroy_allowance(&self) -> usize {
        if self.pools.in_flight() > 0 {
            self.config.pool_manager.destroys_beside_creates
        } else {
            config::MAX_DESTROYS_IN_FLIGHT
        }
    }
}

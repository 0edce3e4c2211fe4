//! The gateway's background work: what a request starts that may outlive it (asynchronous
//! invocations, the retried undo of a grant nobody saw, what a dropped request gives back,
//! retiring function environments) and the function keeper. All of it runs on one tracker,
//! which shutdown drains within `gateway.drain_timeout`: work still running near the end is
//! cancelled (`cancelled`) and given `record_grace` to record how it ended, so nothing is
//! cut mid-write by the process's exit.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tokio_util::task::TaskTracker;

/// The longest a cancelled task gets to record how it ended (an asynchronous invocation's
/// record and its lease: a few ledger calls).
const RECORD_GRACE: Duration = Duration::from_secs(1);

/// The tracker of the gateway's background tasks and the token that cancels them; cheap to
/// clone (both are shared handles).
#[derive(Clone, Default)]
pub(crate) struct Background {
    tracker: TaskTracker,
    cancel: CancellationToken,
}

impl Background {
    /// Runs `task` on the tracker. A task that may run long selects on `cancelled` and, when
    /// it fires, records how it ended and returns.
    pub(crate) fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tracker.spawn(task);
    }

    /// Runs `task` on the tracker when called inside a runtime (a drop guard may be dropped
    /// outside one, as a runtime shuts down: then there is nothing left to run it).
    pub(crate) fn spawn_from_drop<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if tokio::runtime::Handle::try_current().is_ok() {
            self.tracker.spawn(task);
        }
    }

    /// Fires when the gateway stops waiting for background work.
    pub(crate) fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }

    /// Tasks still running.
    pub(crate) fn len(&self) -> usize {
        self.tracker.len()
    }

    /// How long before `cut_at` the work still running is cancelled, out of a drain bound of
    /// `timeout`: a quarter of it, at most `RECORD_GRACE`.
    pub(crate) fn record_grace(timeout: Duration) -> Duration {
        RECORD_GRACE.min(timeout / 4)
    }

    /// Waits for the background work (new requests have stopped): until `cut_at` less the
    /// record grace; then cancels what is left and waits until `cut_at` for it to record how
    /// it ended. Answers how many tasks were still running at `cut_at` (0 when drained).
    pub(crate) async fn drain(&self, cut_at: tokio::time::Instant, timeout: Duration) -> usize {
        self.tracker.close();
        let cancel_at = cut_at.checked_sub(Background::record_grace(timeout)).unwrap_or(cut_at);
        if tokio::time::timeout_at(cancel_at, self.tracker.wait()).await.is_ok() {
            return 0;
        }
        tracing::info!(tasks = self.len(), "background work still running at the drain deadline: cancelled");
        self.cancel.cancel();
        if tokio::time::timeout_at(cut_at, self.tracker.wait()).await.is_ok() {
            return 0;
        }
        self.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[tokio::test]
    async fn drain_waits_then_cancels_and_counts_what_is_left() {
        let work = Background::default();
        // One ends by itself, one ends when cancelled, one ignores the cancel.
        work.spawn(tokio::time::sleep(Duration::from_millis(50)));
        let (w, recorded) = (work.clone(), Arc::new(AtomicBool::new(false)));
        let r = recorded.clone();
        work.spawn(async move {
            w.cancelled().await;
            r.store(true, Ordering::SeqCst);
        });
        work.spawn(tokio::time::sleep(Duration::from_secs(3600)));
        let timeout = Duration::from_millis(400);
        let t0 = tokio::time::Instant::now();
        let left = work.drain(t0 + timeout, timeout).await;
        assert_eq!(left, 1, "the task that ignores its cancel is left");
        assert!(recorded.load(Ordering::SeqCst), "the cancelled task ran to its end");
        let took = t0.elapsed();
        assert!(took >= timeout && took < timeout * 2, "the drain takes its whole bound, no more: {took:?}");

        let idle = Background::default();
        idle.spawn(tokio::time::sleep(Duration::from_millis(50)));
        let t0 = tokio::time::Instant::now();
        assert_eq!(idle.drain(t0 + Duration::from_secs(60), Duration::from_secs(60)).await, 0);
        assert!(t0.elapsed() < Duration::from_secs(5), "drained work does not wait for the bound");
    }
}

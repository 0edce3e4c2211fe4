//! How long a chunk fetch may wait for the registry: each attempt bounded, a few retries with
//! backoff inside one total bound, and a memory of an outage, so that while the registry is
//! known to be gone each fetch makes one attempt and fails at once instead of every page a
//! reader touches waiting the whole bound. A fetch that gives up answers its reader EIO; the
//! first success ends the outage (nothing stays poisoned).
//!
//! Pure decisions ([`FetchPolicy::next_attempt`]) over an [`Outage`] cell; `blob.rs` carries them
//! out against the registry.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The default total bound of one chunk fetch (`sandpool-lazyd --fetch-timeout-s`): a chunk
/// takes milliseconds on loopback and well under a second across a WAN, so ten seconds without
/// one is "the registry is gone"; a reader then gets EIO instead of hanging.
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// One attempt's bound (connect, headers and body): a stalled registry is retried, not waited on.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(4);
/// The first pause between attempts, doubled after each, up to [`BACKOFF_MAX`]: a registry that
/// restarts (or a dropped pooled connection) is back within a few of them.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// The bounds of one chunk fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchPolicy {
    /// The most one fetch may take, retries included; then the reader gets EIO.
    pub total: Duration,
    /// The most one attempt may take (never more than what is left of `total`).
    pub attempt: Duration,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        FetchPolicy::with_total(DEFAULT_FETCH_TIMEOUT)
    }
}

/// What a fetch does after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Try again.
    Retry {
        /// The pause before the next attempt.
        after: Duration,
        /// The next attempt's bound.
        within: Duration,
    },
    /// Give up: the reader gets EIO.
    GiveUp,
}

impl FetchPolicy {
    /// A policy whose fetches give up after `total` (attempts bounded by the smaller of it and
    /// the default attempt bound).
    pub fn with_total(total: Duration) -> Self {
        FetchPolicy { total, attempt: ATTEMPT_TIMEOUT.min(total) }
    }

    /// The bound of a fetch's first attempt.
    pub fn first_attempt(&self) -> Duration {
        self.attempt.min(self.total)
    }

    /// After `failed` failed attempts, `elapsed` into the fetch: retry (when and within what),
    /// or give up. A known outage (`registry_down`) gives up at once: one attempt per fetch
    /// while the registry is gone, so readers get EIO promptly, and the next fetch tries again.
    pub fn next_attempt(&self, failed: u32, elapsed: Duration, registry_down: bool) -> Next {
        if registry_down {
            return Next::GiveUp;
        }
        let after = BACKOFF_FIRST.saturating_mul(1 << failed.saturating_sub(1).min(8)).min(BACKOFF_MAX);
        let left = self.total.saturating_sub(elapsed + after);
        // An attempt shorter than this could not even connect to a registry across a network.
        if left < Duration::from_millis(50) {
            return Next::GiveUp;
        }
        Next::Retry { after, within: self.attempt.min(left) }
    }
}

/// Whether the registry of a blob is known to be gone: set when a fetch gives up, cleared by
/// the next fetch that succeeds. Transitions are returned so the caller logs each once.
#[derive(Debug, Default)]
pub struct Outage {
    since: Mutex<Option<Instant>>,
}

impl Outage {
    /// Whether an outage is on.
    pub fn is_down(&self) -> bool {
        self.since.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// A fetch gave up; `true` when this starts the outage.
    pub fn failed(&self) -> bool {
        let mut since = self.since.lock().unwrap_or_else(|e| e.into_inner());
        let started = since.is_none();
        since.get_or_insert_with(Instant::now);
        started
    }

    /// A fetch succeeded; how long the outage it ends lasted, if one was on.
    pub fn succeeded(&self) -> Option<Duration> {
        self.since.lock().unwrap_or_else(|e| e.into_inner()).take().map(|t| t.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_within_the_total_bound_then_give_up() {
        let p = FetchPolicy::with_total(Duration::from_secs(10));
        assert_eq!(p.first_attempt(), Duration::from_secs(4));
        assert_eq!(
            p.next_attempt(1, Duration::from_millis(10), false),
            Next::Retry { after: Duration::from_millis(100), within: Duration::from_secs(4) }
        );
        assert_eq!(
            p.next_attempt(3, Duration::from_secs(1), false),
            Next::Retry { after: Duration::from_millis(400), within: Duration::from_secs(4) }
        );
        // The backoff stops growing, and the last attempt gets only what is left.
        assert_eq!(
            p.next_attempt(9, Duration::from_secs(7), false),
            Next::Retry { after: Duration::from_secs(2), within: Duration::from_secs(1) }
        );
        assert_eq!(p.next_attempt(10, Duration::from_millis(7_980), false), Next::GiveUp);
        // Adding up every wait and attempt bound never passes the total.
        let (mut elapsed, mut failed) = (p.first_attempt(), 1);
        while let Next::Retry { after, within } = p.next_attempt(failed, elapsed, false) {
            elapsed += after + within;
            failed += 1;
        }
        assert!(elapsed <= p.total, "{elapsed:?}");
    }

    #[test]
    fn a_known_outage_makes_one_attempt_per_fetch() {
        let p = FetchPolicy::default();
        assert_eq!(p.next_attempt(1, Duration::ZERO, true), Next::GiveUp);
        let short = FetchPolicy::with_total(Duration::from_secs(2));
        assert_eq!(short.first_attempt(), Duration::from_secs(2), "an attempt is never longer than the total");
    }

    #[test]
    fn an_outage_starts_once_and_ends_with_the_first_success() {
        let o = Outage::default();
        assert!(!o.is_down());
        assert!(o.failed(), "the first failure starts it");
        assert!(!o.failed(), "later ones do not start it again");
        assert!(o.is_down());
        assert!(o.succeeded().is_some());
        assert!(!o.is_down() && o.succeeded().is_none());
    }
}

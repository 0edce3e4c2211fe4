//! Refused egress connections are logged at a bounded rate: a sandbox that opens thousands of
//! refused connections must not flood the node's log. At most one line per sandbox per
//! `EVERY`, carrying how many refusals went unlogged since the previous one; every refusal is
//! counted in `sandpool_egress_connections_total` all the same.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// At most one log line per sandbox this often.
pub(super) const EVERY: Duration = Duration::from_secs(10);

#[derive(Default)]
pub(super) struct RefusalLog {
    by_sandbox: HashMap<String, Slot>,
}

struct Slot {
    last: Instant,
    suppressed: u64,
}

impl RefusalLog {
    /// Whether a refusal of `sandbox`'s at `now` is logged: `Some(n)` with the `n` refusals
    /// left unlogged since its last line, `None` (counted) if it had a line within `EVERY`.
    pub(super) fn admit(&mut self, sandbox: &str, now: Instant) -> Option<u64> {
        match self.by_sandbox.get_mut(sandbox) {
            Some(slot) if now.saturating_duration_since(slot.last) < EVERY => {
                slot.suppressed += 1;
                None
            }
            Some(slot) => {
                let n = std::mem::take(&mut slot.suppressed);
                slot.last = now;
                Some(n)
            }
            None => {
                self.by_sandbox.insert(sandbox.to_string(), Slot { last: now, suppressed: 0 });
                Some(0)
            }
        }
    }

    /// Forgets a sandbox (it left the network).
    pub(super) fn forget(&mut self, sandbox: &str) {
        self.by_sandbox.remove(sandbox);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_sandbox_per_window_with_the_count_it_left_out() {
        let mut log = RefusalLog::default();
        let t0 = Instant::now();
        assert_eq!(log.admit("a", t0), Some(0));
        for i in 1..=1000 {
            assert_eq!(log.admit("a", t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(log.admit("b", t0 + Duration::from_secs(1)), Some(0), "another sandbox has its own window");
        assert_eq!(log.admit("a", t0 + EVERY), Some(1000));
        assert_eq!(log.admit("a", t0 + EVERY + Duration::from_secs(1)), None);
        log.forget("a");
        assert_eq!(log.admit("a", t0 + EVERY + Duration::from_secs(2)), Some(0));
    }
}

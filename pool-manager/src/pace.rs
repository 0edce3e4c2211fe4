//! The create window: how many sandbox creates the node keeps in flight, adapted to what
//! Docker sustains instead of a fixed number.
//!
//! Docker's create path is mostly serial on a node (dockerd and containerd do much of the
//! work one container at a time), and it slows as the node fills. Past the point where Docker
//! is busy, more creates in flight add no throughput, only latency, and that latency is taken
//! from everything else that goes through dockerd: the tenants' execs, the destroys, the node's
//! health checks.
//!
//! The rule is TCP Vegas' applied to creates. `base` is the latency of a create that did not
//! queue inside Docker; a create that took `latency` with `w` in flight means about
//! `w * (1 - base / latency)` creates were queued behind others. The window grows by one per
//! window's worth of creates while fewer than `LOW` queue (additive increase, as long as the
//! latency holds), shrinks by a tenth per create while more than `HIGH` queue (back off when it
//! grows), and halves on a failed create. A window the pools do not fill does not grow: it has
//! not shown that Docker sustains more.
//!
//! The node slows as it fills, so `base` cannot be the least latency ever seen: every
//! `PROBE_EVERY` creates the window is halved for one window's worth of creates, and `base` is
//! measured afresh from what they take (BBR's "probe RTT"). Pure arithmetic, no clock: the
//! pools loop feeds it; the token bucket (`create_rate`) still caps the rate on top, and
//! `max_creates_in_flight` the window.

use std::time::Duration;

/// Creates queued inside Docker below which the window grows.
const LOW: f64 = 1.0;
/// Creates queued inside Docker above which it shrinks.
const HIGH: f64 = 3.0;
/// Creates between two measures of the unqueued latency.
const PROBE_EVERY: u64 = 200;
/// Weight of a new sample in the latency average the rule reads (about the last 4 creates).
const WEIGHT: f64 = 0.25;

/// The adaptive in-flight limit of a node's creates.
#[derive(Debug, Clone)]
pub struct Window {
    limit: f64,
    max: f64,
    /// The latency of an unqueued create (ms): the least seen since the last probe began.
    base: Option<f64>,
    /// Recent latency (ms, moving average).
    recent: Option<f64>,
    /// Creates finished, ever.
    done: u64,
    /// While probing: the window to go back to, and the creates the probe still waits for.
    probe: Option<(f64, u64)>,
}

impl Window {
    /// A window of at most `max` creates in flight, starting at half of it (the node does not
    /// know yet what Docker sustains).
    pub fn new(max: usize) -> Window {
        let max = max.max(1) as f64;
        Window { limit: (max / 2.0).max(1.0), max, base: None, recent: None, done: 0, probe: None }
    }

    /// Creates that may be in flight now.
    pub fn limit(&self) -> u64 {
        self.limit.floor() as u64
    }

    /// A create finished in `latency` while `in_flight` creates (itself included) were running.
    pub fn done(&mut self, latency: Duration, in_flight: u64) {
        let ms = latency.as_secs_f64() * 1000.0;
        self.done += 1;
        self.base = Some(self.base.map_or(ms, |b| b.min(ms)));
        self.recent = Some(self.recent.map_or(ms, |r| r * (1.0 - WEIGHT) + ms * WEIGHT));
        if let Some((back, left)) = self.probe {
            // The creates started before the probe drain first; the last ones ran alone.
            if left > 1 {
                self.probe = Some((back, left - 1));
            } else {
                self.probe = None;
                self.limit = back;
            }
            return;
        }
        if self.done.is_multiple_of(PROBE_EVERY) {
            let back = self.limit;
            self.limit = (self.limit / 2.0).floor().max(1.0);
            // The creates in flight finish first, then one window's worth at the halved size.
            self.probe = Some((back, in_flight + self.limit as u64));
            self.base = None;
            return;
        }
        let (Some(base), Some(recent)) = (self.base, self.recent) else { return };
        let queued = self.limit * (1.0 - base / recent).max(0.0);
        if queued < LOW {
            if in_flight as f64 >= self.limit - 1.0 {
                self.limit += 1.0 / self.limit;
            }
        } else if queued > HIGH {
            self.limit *= 0.9;
        }
        self.limit = self.limit.clamp(1.0, self.max);
    }

    /// A create failed: halve the window.
    pub fn failed(&mut self) {
        self.limit = (self.limit / 2.0).max(1.0);
        if let Some((back, left)) = self.probe {
            self.probe = Some(((back / 2.0).max(1.0), left));
        }
    }

    /// Whether the window is halved now to measure the unqueued latency again.
    pub fn probing(&self) -> bool {
        self.probe.is_some()
    }

    /// The unqueued and recent create latency (ms), for the node's stats.
    pub fn latency_ms(&self) -> (f64, f64) {
        (self.base.unwrap_or(0.0), self.recent.unwrap_or(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Docker whose creates take `floor` ms while at most `parallel` run, and queue past
    /// that: the time of a create with `in_flight` running.
    fn docker(in_flight: u64, floor: f64, parallel: u64) -> Duration {
        let queued = in_flight.saturating_sub(parallel) as f64;
        Duration::from_secs_f64(floor * (1.0 + queued / parallel as f64) / 1000.0)
    }

    /// Runs `n` creates through the window, keeping it full, with `latency(i, in_flight)`;
    /// returns the window after each create that did not end inside a probe.
    fn run(w: &mut Window, n: u64, latency: impl Fn(u64, u64) -> Duration) -> Vec<u64> {
        let mut seen = Vec::new();
        for i in 0..n {
            let in_flight = w.limit();
            w.done(latency(i, in_flight), in_flight);
            if !w.probing() {
                seen.push(w.limit());
            }
        }
        seen
    }

    #[test]
    fn grows_while_latency_holds_up_to_its_max() {
        let mut w = Window::new(16);
        assert_eq!(w.limit(), 8);
        let seen = run(&mut w, 400, |_, _| Duration::from_millis(500));
        assert_eq!(seen.last(), Some(&16));
    }

    #[test]
    fn an_unused_window_does_not_grow() {
        let mut w = Window::new(16);
        for _ in 0..350 {
            w.done(Duration::from_millis(500), 1);
            assert!(w.limit() <= 8);
        }
        assert!(!w.probing());
        assert_eq!(w.limit(), 8);
    }

    #[test]
    fn settles_near_what_docker_sustains() {
        // Docker runs 4 creates at once; beyond that every create waits for the others. The
        // window should hover a few creates above 4 (LOW..HIGH queued), not run to 32 or collapse.
        let mut w = Window::new(32);
        let seen = run(&mut w, 3000, |_, n| docker(n, 500.0, 4));
        let last = &seen[seen.len() - 1000..];
        let (lo, hi) = (*last.iter().min().unwrap(), *last.iter().max().unwrap());
        assert!(lo >= 3, "the window collapsed: {lo}");
        assert!(hi <= 9, "the window ran past what docker sustains (4): {hi}");
    }

    #[test]
    fn a_node_slowing_as_it_fills_keeps_its_window() {
        // The latency rises with the sandboxes held, not with the window: 500 ms at first,
        // 1,500 ms after 3,000 creates. A fuller node, not an overloaded one.
        let mut w = Window::new(8);
        let seen = run(&mut w, 3000, |i, _| Duration::from_secs_f64((500.0 + i as f64 / 3.0) / 1000.0));
        assert!(seen[seen.len() - 1000..].iter().all(|&l| l == 8), "{:?}", &seen[seen.len() - 50..]);
    }

    #[test]
    fn a_slowing_node_that_also_queues_still_finds_its_level() {
        // Both at once: the node slows as it fills and queues past 4 in flight.
        let mut w = Window::new(32);
        let seen = run(&mut w, 3000, |i, n| docker(n, 500.0 + i as f64 / 3.0, 4));
        let last = &seen[seen.len() - 1000..];
        assert!(last.iter().all(|&l| (3..=9).contains(&l)), "{:?}", &last[..50]);
    }

    #[test]
    fn a_failure_halves_it_and_it_recovers() {
        let mut w = Window::new(16);
        run(&mut w, 150, |_, _| Duration::from_millis(500));
        assert_eq!(w.limit(), 16);
        w.failed();
        assert_eq!(w.limit(), 8);
        for _ in 0..5 {
            w.failed();
        }
        assert_eq!(w.limit(), 1, "never below one");
        let seen = run(&mut w, 400, |_, _| Duration::from_millis(500));
        assert_eq!(seen.last(), Some(&16));
    }

    #[test]
    fn a_latency_spike_shrinks_it_at_once() {
        let mut w = Window::new(16);
        run(&mut w, 150, |_, _| Duration::from_millis(500));
        assert_eq!(w.limit(), 16);
        run(&mut w, 8, |_, _| Duration::from_millis(5000));
        assert!(w.limit() <= 8, "eight creates at 10x the latency: {}", w.limit());
    }
}

//! The create window: how many sandbox creates the node keeps in flight, adapted to what
//! Docker sustains instead of a fixed number.
//!
//! Docker's create path is partly serial on a node (dockerd and containerd do much of the work
//! one container at a time) and partly parallel (runc, the kernel, our agent's start), and it
//! slows as the node fills. Measured here early in a fill (BENCHMARKS.md, Density): one create
//! alone ~190 ms, 4 in flight ~400-450 ms each (~9 creates/s), 8 ~650-700 ms (~12/s); by 2,400
//! sandboxes 8 in flight took over a second each (~5/s). Past the point where more in flight buys no
//! more creates per second, a bigger window only adds latency, taken from whoever waits for a
//! sandbox and from everything else that goes through dockerd.
//!
//! So the window climbs the node's throughput curve: it keeps a latency average per window
//! size and reads throughput from it by Little's law (`w / latency(w)`). After each window's
//! worth of creates at a full window it moves to the neighbour that does more per second:
//! - down when the size below does at least 95 % as much (less in flight for the same rate);
//! - else up while the size above is unmeasured or at least 5 % faster (additive increase
//!   while latency holds: a size whose latency grew in proportion is no faster);
//! - else down to explore a size below not measured lately;
//! - halved at once when Docker errs or times out.
//!
//! Averages are forgotten after four decisions' worth of creates: the node slows as it fills,
//! and an older measure would flatter the size it was taken at. So the window keeps exploring
//! its neighbours (at a plateau, about one create in five runs one size off) and follows the
//! curve as it moves. A window the pools do not fill decides nothing: it has not shown what
//! Docker sustains. Pure arithmetic with creates as its clock (no time): the pools loop feeds
//! it; the token bucket (`create_rate`) still caps the rate, `max_creates_in_flight` the window.

use std::time::Duration;

/// How much faster the size above must be to move up, and how close the size below to move down.
const GAIN: f64 = 1.05;
/// Weight of a new sample in a size's latency average.
const WEIGHT: f64 = 0.2;
/// A size's average is forgotten after this many creates per unit of the current window (four
/// decisions): the node slows as it fills, and an older measure would flatter the size it was
/// taken at.
const STALE_PER_LIMIT: u64 = 8;

#[derive(Debug, Clone, Copy)]
struct Level {
    /// Latency average (ms) of creates that finished with this many in flight.
    ms: f64,
    /// The create count when it was last fed.
    at: u64,
}

/// The adaptive in-flight limit of a node's creates.
#[derive(Debug, Clone)]
pub(crate) struct Window {
    limit: usize,
    max: usize,
    /// Index `w - 1`: what creates take with `w` in flight.
    levels: Vec<Option<Level>>,
    /// Creates finished, ever (the clock of staleness).
    done: u64,
    /// Creates finished at a full window since the last move.
    since_move: u64,
}

impl Window {
    /// A window of at most `max` creates in flight, starting at half of it (the node does not
    /// know yet what Docker sustains).
    pub(crate) fn new(max: usize) -> Window {
        let max = max.max(1);
        Window { limit: max.div_ceil(2), max, levels: vec![None; max], done: 0, since_move: 0 }
    }

    /// Creates that may be in flight now.
    pub(crate) fn limit(&self) -> u64 {
        self.limit as u64
    }

    /// A create finished in `latency` while `in_flight` creates (itself included) were running.
    pub(crate) fn done(&mut self, latency: Duration, in_flight: u64) {
        let ms = latency.as_secs_f64() * 1000.0;
        self.done += 1;
        let w = (in_flight as usize).clamp(1, self.max);
        let level = &mut self.levels[w - 1];
        let fresh = level.filter(|l| self.done - l.at <= STALE_PER_LIMIT * self.limit as u64);
        *level = Some(Level { ms: fresh.map_or(ms, |l| l.ms * (1.0 - WEIGHT) + ms * WEIGHT), at: self.done });
        if w < self.limit {
            return;
        }
        self.since_move += 1;
        if self.since_move < 2 * self.limit as u64 {
            return;
        }
        // `Some(None)`: a neighbour not measured lately, worth exploring.
        let here = self.throughput(self.limit).unwrap_or(0.0);
        let up = (self.limit < self.max).then(|| self.throughput(self.limit + 1));
        let down = (self.limit > 1).then(|| self.throughput(self.limit - 1));
        match (down, up) {
            (Some(Some(d)), _) if d * GAIN >= here => self.move_to(self.limit - 1),
            (_, Some(u)) if u.is_none_or(|u| u >= here * GAIN) => self.move_to(self.limit + 1),
            (Some(None), _) => self.move_to(self.limit - 1),
            _ => {}
        }
    }

    /// A create failed: halve the window.
    pub(crate) fn failed(&mut self) {
        self.move_to((self.limit / 2).max(1));
    }

    /// Creates per second with `w` in flight, by Little's law, if known and fresh.
    fn throughput(&self, w: usize) -> Option<f64> {
        let l = self.levels[w - 1]?;
        (self.done - l.at <= STALE_PER_LIMIT * self.limit as u64).then(|| w as f64 * 1000.0 / l.ms.max(1.0))
    }

    fn move_to(&mut self, w: usize) {
        self.limit = w;
        self.since_move = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `n` creates through the window, keeping it full, with `latency(i, in_flight)`;
    /// returns the window after each.
    fn run(w: &mut Window, n: u64, latency: impl Fn(u64, u64) -> f64) -> Vec<u64> {
        (0..n)
            .map(|i| {
                let in_flight = w.limit();
                w.done(Duration::from_secs_f64(latency(i, in_flight) / 1000.0), in_flight);
                w.limit()
            })
            .collect()
    }

    /// A Docker that runs `parallel` creates at once in `floor` ms, and queues the rest.
    fn queueing(in_flight: u64, floor: f64, parallel: u64) -> f64 {
        floor * (in_flight.max(parallel) as f64 / parallel as f64)
    }

    fn last(seen: &[u64], n: usize) -> (u64, u64) {
        let tail = &seen[seen.len() - n..];
        (*tail.iter().min().unwrap(), *tail.iter().max().unwrap())
    }

    #[test]
    fn grows_while_latency_holds_up_to_its_max() {
        let mut w = Window::new(16);
        assert_eq!(w.limit(), 8);
        let seen = run(&mut w, 400, |_, _| 500.0);
        assert_eq!(last(&seen, 100).1, 16);
        assert!(last(&seen, 100).0 >= 15);
    }

    #[test]
    fn an_unused_window_does_not_grow() {
        let mut w = Window::new(16);
        for _ in 0..400 {
            w.done(Duration::from_millis(500), 1);
        }
        assert_eq!(w.limit(), 8);
    }

    #[test]
    fn settles_where_more_in_flight_buys_no_more_creates() {
        // Docker runs 4 at once: 5 in flight take 5/4 as long each, the same creates a second.
        let mut w = Window::new(32);
        let seen = run(&mut w, 4000, |_, n| queueing(n, 500.0, 4));
        let (lo, hi) = last(&seen, 2000);
        assert!(lo >= 3 && hi <= 5, "the window left 4 and its neighbours: {lo}..={hi}");
    }

    #[test]
    fn climbs_a_pipeline_while_each_step_pays() {
        // Roughly this machine's Docker early in a fill: 450 ms at 4, 700 at 8; each step
        // up pays less: +7 % from 5 to 6, +5 % from 6 to 7, +4 % from 7 to 8.
        let mut w = Window::new(16);
        let seen = run(&mut w, 4000, |_, n| 190.0 + 64.0 * n as f64);
        let (lo, hi) = last(&seen, 2000);
        assert!(lo >= 5 && hi <= 8, "{lo}..={hi}");
    }

    #[test]
    fn a_node_slowing_as_it_fills_keeps_its_window() {
        // The latency rises with the sandboxes held, not with the window: 500 ms at first,
        // 1,500 ms after 3,000 creates. A fuller node, not an overloaded one.
        let mut w = Window::new(8);
        let seen = run(&mut w, 3000, |i, _| 500.0 + i as f64 / 3.0);
        let tail = &seen[100..];
        assert_eq!(last(&seen, 2900), (7, 8), "at its max, exploring one below now and then");
        let at_max = tail.iter().filter(|&&l| l == 8).count() as f64 / tail.len() as f64;
        assert!(at_max > 0.75, "at its max {:.0} % of the time", at_max * 100.0);
    }

    #[test]
    fn a_failure_halves_it_and_it_recovers() {
        let mut w = Window::new(16);
        run(&mut w, 300, |_, _| 500.0);
        assert!(w.limit() >= 15);
        w.limit = 16;
        w.failed();
        assert_eq!(w.limit(), 8);
        for _ in 0..5 {
            w.failed();
        }
        assert_eq!(w.limit(), 1, "never below one");
        let seen = run(&mut w, 400, |_, _| 500.0);
        assert!(last(&seen, 50).1 == 16, "recovered: {:?}", &seen[350..]);
    }

    #[test]
    fn when_docker_slows_down_under_it_the_window_comes_down() {
        // Fine at 16 in flight, then Docker starts queueing past 4 (another tenant of the
        // machine, a slow disk): the window walks down to what still pays.
        let mut w = Window::new(16);
        run(&mut w, 300, |_, _| 500.0);
        assert!(w.limit() >= 15);
        let seen = run(&mut w, 2000, |_, n| queueing(n, 500.0, 4));
        let (lo, hi) = last(&seen, 1000);
        assert!(lo >= 3 && hi <= 5, "{lo}..={hi}");
    }
}

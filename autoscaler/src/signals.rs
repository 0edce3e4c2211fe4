//! The autoscaler's inputs: what it observes about pools, templates, nodes and reservations at one instant.
//!
//! An [`Observation`] is plain data. The live autoscaler builds one from the Redis ledger every tick;
//! the simulator builds one from its virtual state. Policies read nothing else, and never a clock:
//! the time is [`Observation::now_ms`].

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

/// Width of one arrival-history bucket: one second, the autoscaler's tick.
pub const BUCKET_MS: u64 = 1_000;

/// How much arrival history is kept: 30 minutes, enough to see six bursts of a 5-minute training step.
pub const HISTORY_HORIZON_MS: u64 = 30 * 60 * 1_000;

/// A pool: the sandboxes of one template on one node.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PoolKey {
    /// Template name.
    pub template: String,
    /// Node id.
    pub node: String,
}

impl PoolKey {
    /// The pool of `template` on `node`.
    pub fn new(template: impl Into<String>, node: impl Into<String>) -> Self {
        Self { template: template.into(), node: node.into() }
    }
}

/// Counts of one pool's sandboxes by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSignals {
    /// Warm sandboxes ready to be checked out.
    pub idle: u32,
    /// Sandboxes held by a session.
    pub leased: u32,
    /// Creates in flight (refill and on-demand); they count as incoming capacity.
    pub creating: u32,
}

/// Per-template signals (summed over nodes where that is what the ledger keeps).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TemplateSignals {
    /// Session requests waiting in the template's queue for a sandbox being created.
    pub waiting: u32,
    /// Memory one sandbox of this template is charged on its node, MiB (its expected footprint).
    pub memory_mib: u32,
    /// Session requests per second over the recent past.
    pub arrivals: ArrivalHistory,
    /// Monotonic count of session requests that found no idle sandbox (cold starts), since any origin.
    pub cold_starts: u64,
    /// The template's configured warm floor (config `warm`), over all nodes; [`crate::Combined`] never goes
    /// below it.
    #[serde(default)]
    pub min_idle: u32,
    /// Creates per second of this template over all nodes, as the nodes' creates of it measured
    /// (`None`: unmeasured; the planner uses the nodes' rate over every template).
    #[serde(default)]
    pub create_rate_per_s: Option<f64>,
    /// The slowest node's create latency for this template, ms (`None`: unmeasured).
    #[serde(default)]
    pub create_latency_ms: Option<u64>,
    /// How far the template's create rate has fallen below its recent best ([`crate::RateMemory`]):
    /// 1 while it holds, 2 when it has halved. Values below 1 count as 1.
    #[serde(default)]
    pub create_slowdown: f64,
}

/// A node's capacity and its measured create performance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeSignals {
    /// Node id.
    pub node: String,
    /// Most sandboxes (any state) the node may hold.
    pub max_sandboxes: u32,
    /// Memory the node offers to sandboxes, MiB.
    pub memory_mib: u64,
    /// Creates per second the node sustains (measured; also its create budget).
    pub create_rate_per_s: f64,
    /// Time from create start to an idle sandbox, ms (measured).
    pub create_latency_ms: u64,
}

/// A declared upcoming burst: `count` idle sandboxes of `template` by `ready_by_ms`, kept `hold_s` after.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// Template name.
    pub template: String,
    /// Idle sandboxes wanted.
    pub count: u32,
    /// When they must be idle, ms since the epoch of [`Observation::now_ms`].
    pub ready_by_ms: u64,
    /// How long after `ready_by_ms` the remainder is held before it is released, seconds.
    pub hold_s: u64,
}

impl Reservation {
    /// When the reservation stops counting: `ready_by + hold`.
    pub fn expires_ms(&self) -> u64 {
        self.ready_by_ms.saturating_add(self.hold_s.saturating_mul(1_000))
    }
}

/// Everything a policy may look at for one decision.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// The decision's time, ms (any fixed epoch; the simulator starts at 0).
    pub now_ms: u64,
    /// All nodes that can host sandboxes, in a stable order.
    pub nodes: Vec<NodeSignals>,
    /// All templates the autoscaler sizes pools for, by name.
    pub templates: BTreeMap<String, TemplateSignals>,
    /// Pools with any sandbox; a missing pool has all counts zero.
    pub pools: BTreeMap<PoolKey, PoolSignals>,
    /// Declared reservations that have not expired.
    pub reservations: Vec<Reservation>,
}

impl Observation {
    /// An observation at `now_ms` with the given nodes and nothing else.
    pub fn new(now_ms: u64, nodes: Vec<NodeSignals>) -> Self {
        Self { now_ms, nodes, ..Self::default() }
    }

    /// The pool's counts (zero if it has no sandbox).
    pub fn pool(&self, template: &str, node: &str) -> PoolSignals {
        self.pools_of(template).find(|(n, _)| *n == node).map(|(_, p)| p).unwrap_or_default()
    }

    /// The pools of one template, as `(node, counts)` (a range of the map: pools of a template are adjacent).
    pub fn pools_of<'a>(&'a self, template: &'a str) -> impl Iterator<Item = (&'a str, PoolSignals)> + 'a {
        let start = PoolKey { template: template.to_owned(), node: String::new() };
        self.pools.range(start..).take_while(move |(k, _)| k.template == template).map(|(k, p)| (k.node.as_str(), *p))
    }

    /// The template's counts summed over nodes.
    pub fn template_totals(&self, template: &str) -> PoolSignals {
        self.pools_of(template).fold(PoolSignals::default(), |acc, (_, p)| PoolSignals {
            idle: acc.idle + p.idle,
            leased: acc.leased + p.leased,
            creating: acc.creating + p.creating,
        })
    }

    /// Every template's counts summed over nodes, in one pass (templates without sandboxes are absent).
    pub fn totals_by_template(&self) -> BTreeMap<&str, PoolSignals> {
        let mut out: BTreeMap<&str, PoolSignals> = BTreeMap::new();
        for (k, p) in &self.pools {
            let acc = out.entry(k.template.as_str()).or_default();
            acc.idle = acc.idle.saturating_add(p.idle);
            acc.leased = acc.leased.saturating_add(p.leased);
            acc.creating = acc.creating.saturating_add(p.creating);
        }
        out
    }

    /// Creates per second over all nodes (the cluster's create budget).
    pub fn total_create_rate(&self) -> f64 {
        self.nodes.iter().map(|n| n.create_rate_per_s.max(0.0)).sum()
    }

    /// The slowest node's create latency, ms (a safe bound for lead times).
    pub fn max_create_latency_ms(&self) -> u64 {
        self.nodes.iter().map(|n| n.create_latency_ms).max().unwrap_or(0)
    }
}

/// Session requests per second of one template over the last [`HISTORY_HORIZON_MS`], in 1-second buckets.
///
/// Stored sparsely (only seconds with arrivals), so a template seen three times costs three entries.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrivalHistory {
    /// `(second, arrivals in it)`, seconds strictly increasing.
    buckets: VecDeque<(u64, u32)>,
}

impl ArrivalHistory {
    /// An empty history.
    pub fn new() -> Self {
        Self::default()
    }

    /// A history from `(second, count)` pairs (e.g. per-second counters read from the ledger); order is fixed up.
    pub fn from_buckets(buckets: impl IntoIterator<Item = (u64, u32)>) -> Self {
        let mut v: Vec<(u64, u32)> = buckets.into_iter().filter(|(_, c)| *c > 0).collect();
        v.sort_by_key(|(s, _)| *s);
        let mut out = Self::default();
        for (s, c) in v {
            out.record(s * BUCKET_MS, c);
        }
        out
    }

    /// Count `n` arrivals at `at_ms`; drops buckets older than the horizon.
    pub fn record(&mut self, at_ms: u64, n: u32) {
        if n == 0 {
            return;
        }
        let sec = at_ms / BUCKET_MS;
        match self.buckets.back_mut() {
            Some((last, c)) if *last == sec => *c = c.saturating_add(n),
            Some((last, _)) if *last > sec => {
                // Out of order (a late counter read): merge into its place.
                match self.buckets.binary_search_by_key(&sec, |(s, _)| *s) {
                    Ok(i) => self.buckets[i].1 = self.buckets[i].1.saturating_add(n),
                    Err(i) => self.buckets.insert(i, (sec, n)),
                }
            }
            _ => self.buckets.push_back((sec, n)),
        }
        self.prune(at_ms);
    }

    /// Drop buckets older than the horizon before `now_ms`.
    pub fn prune(&mut self, now_ms: u64) {
        let oldest = now_ms.saturating_sub(HISTORY_HORIZON_MS) / BUCKET_MS;
        while self.buckets.front().is_some_and(|(s, _)| *s < oldest) {
            self.buckets.pop_front();
        }
    }

    /// Arrivals in buckets whose second starts in `[from_ms, to_ms)`.
    pub fn count_between(&self, from_ms: u64, to_ms: u64) -> u64 {
        let (from, to) = (from_ms.div_ceil(BUCKET_MS), to_ms.div_ceil(BUCKET_MS));
        self.buckets
            .iter()
            .rev()
            .skip_while(|(s, _)| *s >= to)
            .take_while(|(s, _)| *s >= from)
            .map(|(_, c)| u64::from(*c))
            .sum()
    }

    /// Arrivals in buckets starting at or after `from_ms` (including the current, partial second).
    pub fn count_since(&self, from_ms: u64) -> u64 {
        self.count_between(from_ms, u64::MAX - BUCKET_MS)
    }

    /// Start of the last second with an arrival.
    pub fn last_arrival_ms(&self) -> Option<u64> {
        self.buckets.back().map(|(s, _)| s * BUCKET_MS)
    }

    /// The non-empty buckets as `(second, count)`, oldest first.
    pub fn buckets(&self) -> impl DoubleEndedIterator<Item = (u64, u32)> + '_ {
        self.buckets.iter().copied()
    }

    /// Whether no arrival is held.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }
}

/// Half-life of a template's best create rate in [`RateMemory`]: a rate that fell and holds there
/// is the new normal after some minutes.
pub const RATE_MEMORY_HALF_LIFE_MS: u64 = 5 * 60 * 1_000;
/// The most [`RateMemory::slowdown`] reports: beyond it the margin would start a reservation's
/// creates so early that they crowd out everything else for little gain.
pub const MAX_SLOWDOWN: f64 = 4.0;

/// Each template's best create rate of the recent past (it decays by half every
/// [`RATE_MEMORY_HALF_LIFE_MS`]), so a rate can be told apart from a rate that has just fallen:
/// a machine that slows once may slow further during a fill. One entry per template.
#[derive(Clone, Debug, Default)]
pub struct RateMemory {
    /// Template → (best rate seen, decayed to `at_ms`; `at_ms`).
    best: BTreeMap<String, (f64, u64)>,
}

impl RateMemory {
    /// Records `rate` (creates per second) of `template` at `now_ms` and answers how far it has
    /// fallen below the recent best: `best / rate`, within `[1, MAX_SLOWDOWN]`.
    pub fn slowdown(&mut self, template: &str, rate: f64, now_ms: u64) -> f64 {
        if rate.is_nan() || rate <= 0.0 {
            return 1.0;
        }
        let best = match self.best.get(template) {
            Some(&(best, at)) => {
                let age = now_ms.saturating_sub(at) as f64;
                (best * 0.5f64.powf(age / RATE_MEMORY_HALF_LIFE_MS as f64)).max(rate)
            }
            None => rate,
        };
        self.best.insert(template.to_string(), (best, now_ms));
        (best / rate).clamp(1.0, MAX_SLOWDOWN)
    }

    /// Forgets templates not in `keep` (deleted ones).
    pub fn retain(&mut self, keep: impl Fn(&String) -> bool) {
        self.best.retain(|t, _| keep(t));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fallen_rate_reads_as_a_slowdown_that_fades_as_it_holds() {
        let mut m = RateMemory::default();
        assert_eq!(m.slowdown("deb", 4.0, 0), 1.0);
        assert_eq!(m.slowdown("deb", 4.0, 1_000), 1.0, "a steady rate");
        // The machine is loaded: Debian creates halve, busybox is another template.
        assert!((m.slowdown("deb", 2.0, 2_000) - 2.0).abs() < 0.01);
        assert_eq!(m.slowdown("bb", 10.0, 2_000), 1.0);
        // Held at the lower rate, the slowdown fades: after a half-life the best has decayed to it.
        let later = 2_000 + RATE_MEMORY_HALF_LIFE_MS;
        assert!((m.slowdown("deb", 2.0, later) - 1.0).abs() < 0.01, "4 halved to 2: the rate itself");
        // A collapse is capped; no measure (0) is no slowdown.
        assert_eq!(m.slowdown("deb", 0.1, later + 1), MAX_SLOWDOWN);
        assert_eq!(m.slowdown("deb", 0.0, later + 2), 1.0);
        m.retain(|t| t == "bb");
        assert_eq!(m.slowdown("deb", 1.0, later + 3), 1.0, "forgotten");
    }

    #[test]
    fn history_counts_windows_and_prunes() {
        let mut h = ArrivalHistory::new();
        h.record(500, 1);
        h.record(900, 2);
        h.record(5_000, 4);
        h.record(4_200, 1); // late, kept in order
        assert_eq!(h.buckets().collect::<Vec<_>>(), vec![(0, 3), (4, 1), (5, 4)]);
        assert_eq!(h.count_since(0), 8);
        assert_eq!(h.count_since(4_000), 5);
        assert_eq!(h.count_between(1_000, 5_000), 1);
        assert_eq!(h.last_arrival_ms(), Some(5_000));
        h.record(HISTORY_HORIZON_MS + 4_500, 1);
        assert_eq!(h.buckets().next(), Some((4, 1)));
        let rebuilt = ArrivalHistory::from_buckets([(5, 4), (0, 3), (4, 1)]);
        assert_eq!(rebuilt.count_since(0), 8);
    }

    #[test]
    fn observation_sums_pools_of_a_template() {
        let mut obs = Observation::default();
        obs.pools.insert(PoolKey::new("a", "n1"), PoolSignals { idle: 1, leased: 2, creating: 3 });
        obs.pools.insert(PoolKey::new("a", "n2"), PoolSignals { idle: 1, leased: 0, creating: 0 });
        obs.pools.insert(PoolKey::new("ab", "n1"), PoolSignals { idle: 9, leased: 9, creating: 9 });
        assert_eq!(obs.template_totals("a"), PoolSignals { idle: 2, leased: 2, creating: 3 });
        assert_eq!(obs.totals_by_template()["a"], obs.template_totals("a"));
        assert_eq!(obs.pool("a", "n2").idle, 1);
        assert_eq!(obs.pool("b", "n2"), PoolSignals::default());
    }
}

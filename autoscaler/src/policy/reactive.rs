//! The reactive policy: Knative KPA's stable and panic windows, applied to single-use sandbox pools.
//!
//! Demand is `leased + waiting`. The KPA sizes capacity as windowed demand ÷ target utilization. A sandbox
//! is single-use (a finished episode's sandbox is destroyed, not reused), so the spare part of that
//! capacity, demand × (1/utilization − 1), is what the pool must hold idle; on top of it the pool covers
//! the arrivals expected while replacements are created (Little's law: windowed arrival rate × `cover_s`).
//! The output is an idle target, so creates in flight count as incoming capacity when the pool reconciles
//! `idle + creating` to it, and they count as capacity in the panic test. Panic mode (the panic window
//! wants at least `panic_threshold` × the capacity that exists or is coming) never scales down until a
//! stable window passes without panic; every decision is held for `scale_down_delay_s`; after
//! `keep_alive_s` without arrivals the pool drops to `min_idle` (zero allowed).

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::{PerTemplate, Policy, Targets, TemplateTargets, spread, sync_states};
use crate::signals::Observation;

/// Knative's stable window: long enough to ride out noise.
pub(super) const STABLE_WINDOW_S: u64 = 60;
/// Knative's panic window: 10 % of the stable window.
pub(super) const PANIC_WINDOW_S: u64 = 6;
/// Knative's panic threshold: the short window wants twice what exists.
pub(super) const PANIC_THRESHOLD: f64 = 2.0;
/// Knative's default target utilization (container-concurrency-target-percentage = 70 %).
pub(super) const KNATIVE_UTILIZATION: f64 = 0.7;
/// Seconds of arrivals to keep warm: a create's latency (~0.5 s here) plus a tick and a token wait.
pub(super) const COVER_S: f64 = 2.0;
/// Hold a decision this long before scaling down, so a pause between steps does not drain the pool.
pub(super) const SCALE_DOWN_DELAY_S: u64 = 30;
/// Knative's scale-to-zero grace period: one warm sandbox stays this long after the last arrival.
pub(super) const KEEP_ALIVE_S: u64 = 30;

/// Tuning of [`Reactive`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReactiveConfig {
    /// Stable window, seconds.
    pub stable_window_s: u64,
    /// Panic window, seconds.
    pub panic_window_s: u64,
    /// Panic when the panic window's desired capacity is at least this multiple of current capacity.
    pub panic_threshold: f64,
    /// Demand ÷ capacity to aim for, in (0, 1]; 1.0 adds no headroom over demand.
    pub target_utilization: f64,
    /// Seconds of the windowed arrival rate kept warm on top of demand.
    pub cover_s: f64,
    /// A decision is held this long before a lower one takes effect, seconds.
    pub scale_down_delay_s: u64,
    /// One sandbox stays warm this long after the last arrival, seconds.
    pub keep_alive_s: u64,
    /// The floor after the keep-alive (zero allowed).
    pub min_idle: u32,
    /// The ceiling of the idle target.
    pub max_idle: u32,
}

impl Default for ReactiveConfig {
    fn default() -> Self {
        Self::knative()
    }
}

impl ReactiveConfig {
    /// Knative's defaults (70 % target utilization): the stand-alone reactive baseline.
    pub fn knative() -> Self {
        Self {
            stable_window_s: STABLE_WINDOW_S,
            panic_window_s: PANIC_WINDOW_S,
            panic_threshold: PANIC_THRESHOLD,
            target_utilization: KNATIVE_UTILIZATION,
            cover_s: COVER_S,
            scale_down_delay_s: SCALE_DOWN_DELAY_S,
            keep_alive_s: KEEP_ALIVE_S,
            min_idle: 0,
            max_idle: u32::MAX,
        }
    }

    /// No headroom over demand, only the arrival cover: the last tier of [`super::Combined`], where bursts
    /// are handled by forecasts and reservations and this tier only keeps steady traffic warm.
    pub fn lean() -> Self {
        Self { target_utilization: 1.0, ..Self::knative() }
    }
}

#[derive(Debug, Default)]
struct TemplateState {
    /// `(at_ms, demand)` within the stable window, and their sum.
    samples: VecDeque<(u64, u32)>,
    sum: u64,
    /// Panic lasts until this time (exclusive).
    panic_until_ms: u64,
    /// Highest desired capacity during the current panic.
    panic_high: u32,
    /// Recent desired capacities, decreasing from front to back (a sliding-window maximum).
    held: VecDeque<(u64, u32)>,
}

/// Knative-KPA-like reactive scaling of each template's pool (see the module docs).
#[derive(Debug, Default)]
pub struct Reactive {
    cfg: ReactiveConfig,
    state: BTreeMap<String, TemplateState>,
}

impl Reactive {
    /// A reactive policy with this tuning.
    pub fn new(cfg: ReactiveConfig) -> Self {
        Self { cfg, state: BTreeMap::new() }
    }

    /// Desired idle sandboxes per template (before spreading over nodes). Updates the windows.
    pub fn desired_idle(&mut self, obs: &Observation) -> TemplateTargets {
        let cfg = &self.cfg;
        let now = obs.now_ms;
        let util = cfg.target_utilization.clamp(0.01, 1.0);
        sync_states(&mut self.state, obs);
        let pools = PerTemplate::new(obs);
        let mut out = Vec::new();
        for (i, ((name, tmpl), (_, st))) in obs.templates.iter().zip(self.state.iter_mut()).enumerate() {
            let totals = pools.totals(i);
            let demand = totals.leased.saturating_add(tmpl.waiting);

            st.samples.push_back((now, demand));
            st.sum += u64::from(demand);
            let stable_from = now.saturating_sub(cfg.stable_window_s * 1_000);
            while st.samples.front().is_some_and(|(t, _)| *t + cfg.stable_window_s * 1_000 <= now) {
                if let Some((_, d)) = st.samples.pop_front() {
                    st.sum -= u64::from(d);
                }
            }
            let panic_from = now.saturating_sub(cfg.panic_window_s * 1_000);
            let (mut psum, mut pn) = (0u64, 0u64);
            for (_, d) in st.samples.iter().rev().take_while(|(t, _)| *t + cfg.panic_window_s * 1_000 > now) {
                psum += u64::from(*d);
                pn += 1;
            }
            let stable_avg = st.sum as f64 / st.samples.len().max(1) as f64;
            let panic_avg = psum as f64 / pn.max(1) as f64;
            let stable_rate = tmpl.arrivals.count_since(stable_from) as f64 / cfg.stable_window_s.max(1) as f64;
            let panic_rate = tmpl.arrivals.count_since(panic_from) as f64 / cfg.panic_window_s.max(1) as f64;

            // Spare capacity a single-use pool must hold as idle sandboxes: the KPA's headroom over demand
            // (capacity = demand / utilization), plus cover for the arrivals of the next `cover_s`.
            let headroom = 1.0 / util - 1.0;
            let stable_spare = (stable_avg * headroom + stable_rate * cfg.cover_s).ceil() as u32;
            let panic_spare = (panic_avg * headroom + panic_rate * cfg.cover_s).ceil() as u32;
            // KPA's panic test: the panic window wants `threshold` × the capacity that exists or is coming.
            let capacity = totals.idle.saturating_add(totals.leased).saturating_add(totals.creating).max(1);
            let panic_desired = panic_avg + f64::from(panic_spare);
            if panic_desired >= cfg.panic_threshold * f64::from(capacity) {
                if now >= st.panic_until_ms {
                    st.panic_high = 0;
                }
                st.panic_until_ms = now + cfg.stable_window_s * 1_000;
            }
            let desired = if now < st.panic_until_ms {
                st.panic_high = st.panic_high.max(panic_spare).max(stable_spare);
                st.panic_high
            } else {
                stable_spare
            };

            // Sliding-window maximum over the scale-down delay.
            while st.held.back().is_some_and(|(_, d)| *d <= desired) {
                st.held.pop_back();
            }
            st.held.push_back((now, desired));
            let held_from = now.saturating_sub(cfg.scale_down_delay_s * 1_000);
            while st.held.front().is_some_and(|(t, _)| *t < held_from) {
                st.held.pop_front();
            }
            let mut idle = st.held.front().map_or(desired, |(_, d)| *d);
            let recent = tmpl.arrivals.last_arrival_ms().is_some_and(|t| now < t + cfg.keep_alive_s * 1_000);
            if recent {
                idle = idle.max(1);
            }
            let idle = idle.max(cfg.min_idle).min(cfg.max_idle);
            if idle > 0 {
                out.push((name.clone(), idle));
            }
        }
        out.into_iter().collect()
    }
}

impl Policy for Reactive {
    fn name(&self) -> String {
        "reactive".into()
    }

    fn decide(&mut self, obs: &Observation) -> Targets {
        let totals = self.desired_idle(obs);
        Targets { idle: spread(obs, &totals), reservations: Vec::new() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::node;
    use crate::signals::{PoolKey, PoolSignals, TemplateSignals};

    fn get(t: &TemplateTargets) -> u32 {
        t.get("t").copied().unwrap_or(0)
    }

    fn obs(now_ms: u64, idle: u32, leased: u32, waiting: u32) -> Observation {
        let mut o = Observation::new(now_ms, vec![node("n1", 10_000, 4.0)]);
        o.templates.insert("t".into(), TemplateSignals { waiting, ..TemplateSignals::default() });
        o.pools.insert(PoolKey::new("t", "n1"), PoolSignals { idle, leased, creating: 0 });
        o
    }

    #[test]
    fn panics_up_at_once_and_scales_down_only_after_the_delay() {
        let cfg =
            ReactiveConfig { target_utilization: 0.5, cover_s: 0.0, keep_alive_s: 0, ..ReactiveConfig::knative() };
        let mut p = Reactive::new(cfg);
        // Quiet: 10 leased, 10 idle (utilization 0.5 wants 20 total).
        let mut t = 0;
        for _ in 0..60 {
            t += 1_000;
            assert_eq!(get(&p.desired_idle(&obs(t, 10, 10, 0))), 10);
        }
        // A surge: 100 requests wait for 6 s. The stable window barely moves; the panic window reacts.
        let mut surge = 0;
        for _ in 0..6 {
            t += 1_000;
            surge = get(&p.desired_idle(&obs(t, 0, 10, 100)));
        }
        assert!(surge > 100, "panic should scale up within the panic window, got {surge}");
        // The waiters are served and leave: demand is back to 10 leased. In panic the target never shrinks.
        for _ in 0..10 {
            t += 1_000;
            let d = get(&p.desired_idle(&obs(t, surge, 10, 0)));
            assert!(d >= surge, "no scale-down in panic: {d} < {surge}");
        }
        // Panic ends 60 s after its last signal, the surge leaves the stable window 60 s after it ended,
        // and the 30 s scale-down delay holds the old target on top: back to steady ~90 s after the surge.
        let mut last = u32::MAX;
        let mut fell_at = None;
        for i in 0..200u64 {
            t += 1_000;
            let d = get(&p.desired_idle(&obs(t, 10, 10, 0)));
            assert!(d <= last, "scale-down is monotone here");
            if d == 10 && fell_at.is_none() {
                fell_at = Some(i + 11);
            }
            last = d;
        }
        let fell_at = fell_at.expect("scales down eventually");
        assert!((88..=92).contains(&fell_at), "scaled down {fell_at} s after the surge, expected ~90 s");
    }

    #[test]
    fn keeps_one_warm_then_scales_to_zero_after_keep_alive() {
        let cfg = ReactiveConfig { scale_down_delay_s: 0, ..ReactiveConfig::lean() };
        let mut p = Reactive::new(cfg);
        let mut o = obs(1_000, 0, 0, 0);
        if let Some(t) = o.templates.get_mut("t") {
            t.arrivals.record(1_000, 1);
        }
        assert_eq!(get(&p.desired_idle(&o)), 1);
        o.now_ms = 20_000;
        assert_eq!(get(&p.desired_idle(&o)), 1);
        o.now_ms = 31_001;
        assert_eq!(get(&p.desired_idle(&o)), 1, "still within the stable window's arrival cover");
        o.now_ms = 62_000;
        assert_eq!(get(&p.desired_idle(&o)), 0);
    }
}

//! OpenWhisk-style reactive prewarm: a small fixed prewarm count, replenished on use, expanded in
//! proportion to the cold starts of the last check interval and shrunk back after a TTL.
//!
//! Modelled on OpenWhisk's `ContainerPool` stem cells with a `reactive` section: every
//! `check_interval_s` the desired count becomes `cold_starts / threshold × increment` (within
//! `[prewarm_count, max_count]`) if there were at least `threshold` cold starts, else `prewarm_count`; an
//! expansion is kept for `ttl_s`. "Replenish on use" is the pool reconciling to a target that stays put.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::{Policy, Targets, TemplateTargets, spread, sync_states};
use crate::signals::Observation;

/// OpenWhisk's example stem-cell `initialCount`/`minCount`: two warm containers per kind.
pub(super) const PREWARM_COUNT: u32 = 2;
/// OpenWhisk's example `threshold` and `increment`: one more prewarm per cold start.
pub(super) const THRESHOLD: u32 = 1;
/// See [`THRESHOLD`].
pub(super) const INCREMENT: u32 = 1;
/// Sized to one training burst so the baseline is limited by its reaction, not by its cap.
pub(super) const MAX_COUNT: u32 = 1_000;
/// OpenWhisk's `prewarmExpirationCheckInterval`: one minute.
pub(super) const CHECK_INTERVAL_S: u64 = 60;
/// OpenWhisk's example `ttl`: unused prewarms expire after two minutes.
pub(super) const TTL_S: u64 = 120;

/// Tuning of [`OpenWhiskPrewarm`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenWhiskConfig {
    /// Prewarms kept at all times per template.
    pub prewarm_count: u32,
    /// Cold starts per `increment` prewarms.
    pub threshold: u32,
    /// Prewarms added per `threshold` cold starts.
    pub increment: u32,
    /// Most prewarms per template.
    pub max_count: u32,
    /// How often cold starts are counted and the desired count recomputed, seconds.
    pub check_interval_s: u64,
    /// How long an expansion is kept, seconds.
    pub ttl_s: u64,
}

impl Default for OpenWhiskConfig {
    fn default() -> Self {
        Self {
            prewarm_count: PREWARM_COUNT,
            threshold: THRESHOLD,
            increment: INCREMENT,
            max_count: MAX_COUNT,
            check_interval_s: CHECK_INTERVAL_S,
            ttl_s: TTL_S,
        }
    }
}

#[derive(Debug)]
struct TemplateState {
    next_check_ms: u64,
    cold_at_check: u64,
    /// `(decided_at_ms, desired)` within the TTL.
    expansions: VecDeque<(u64, u32)>,
}

/// OpenWhisk-style reactive prewarm (see the module docs).
#[derive(Debug, Default)]
pub struct OpenWhiskPrewarm {
    cfg: OpenWhiskConfig,
    /// `None` until the template is first seen (its first check is one interval later).
    state: BTreeMap<String, Option<TemplateState>>,
}

impl OpenWhiskPrewarm {
    /// A prewarm policy with this tuning.
    pub fn new(cfg: OpenWhiskConfig) -> Self {
        Self { cfg, state: BTreeMap::new() }
    }

    /// Desired idle sandboxes per template.
    pub fn desired_idle(&mut self, obs: &Observation) -> TemplateTargets {
        let cfg = &self.cfg;
        let now = obs.now_ms;
        sync_states(&mut self.state, obs);
        let mut out = Vec::new();
        for ((name, tmpl), (_, st)) in obs.templates.iter().zip(self.state.iter_mut()) {
            let st = st.get_or_insert_with(|| TemplateState {
                next_check_ms: now + cfg.check_interval_s * 1_000,
                cold_at_check: tmpl.cold_starts,
                expansions: VecDeque::new(),
            });
            if now >= st.next_check_ms {
                let cold = tmpl.cold_starts.saturating_sub(st.cold_at_check);
                st.cold_at_check = tmpl.cold_starts;
                st.next_check_ms = now + cfg.check_interval_s * 1_000;
                let threshold = u64::from(cfg.threshold.max(1));
                if cold >= threshold {
                    let want = (cold / threshold).saturating_mul(u64::from(cfg.increment));
                    let want =
                        want.clamp(u64::from(cfg.prewarm_count), u64::from(cfg.max_count.max(cfg.prewarm_count)));
                    st.expansions.push_back((now, u32::try_from(want).unwrap_or(u32::MAX)));
                }
            }
            let ttl_from = now.saturating_sub(cfg.ttl_s * 1_000);
            while st.expansions.front().is_some_and(|(t, _)| *t < ttl_from) {
                st.expansions.pop_front();
            }
            let expanded = st.expansions.iter().map(|(_, d)| *d).max().unwrap_or(0);
            out.push((name.clone(), expanded.max(cfg.prewarm_count)));
        }
        out.into_iter().collect()
    }
}

impl Policy for OpenWhiskPrewarm {
    fn name(&self) -> String {
        "openwhisk-prewarm".into()
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
    use crate::signals::TemplateSignals;

    #[test]
    fn expands_after_cold_starts_and_expires() {
        let mut p = OpenWhiskPrewarm::new(OpenWhiskConfig::default());
        let mut o = Observation::new(0, vec![node("n1", 10_000, 4.0)]);
        o.templates.insert("t".into(), TemplateSignals::default());
        assert_eq!(p.desired_idle(&o)["t"], PREWARM_COUNT);
        if let Some(t) = o.templates.get_mut("t") {
            t.cold_starts = 300;
        }
        o.now_ms = 30_000;
        assert_eq!(p.desired_idle(&o)["t"], PREWARM_COUNT, "waits for the check interval");
        o.now_ms = 60_000;
        assert_eq!(p.desired_idle(&o)["t"], 300);
        o.now_ms = 120_000;
        assert_eq!(p.desired_idle(&o)["t"], 300, "kept for the TTL");
        o.now_ms = 181_000;
        assert_eq!(p.desired_idle(&o)["t"], PREWARM_COUNT);
    }
}

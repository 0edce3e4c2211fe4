//! Learned bursts: find periodic spikes in a template's arrival history and prewarm the predicted size
//! shortly before the predicted next one, with no declaration.
//!
//! Spikes: a completed 1-second bucket is spiky when it holds at least `min_spike_per_s` arrivals and
//! `spike_factor` × the trailing rate; spiky buckets closer than `merge_gap_s` form one burst, whose size is
//! its arrivals above the trailing rate. Period: the median interval between bursts (at least half of the
//! intervals must lie within `regularity` of it), refined with three or more bursts by a least-squares fit
//! of burst time against burst index, whose residuals estimate the jitter. Size: the larger of the median
//! of recent sizes and the last size (a trainer that grows its batch is followed at once). Lead time: the
//! creates of every burst due no later than this one, at the cluster's create rate, plus the create
//! latency, a margin that grows with the jitter, and one tick.
//!
//! One burst already says how big the next may be, though not when: until a period is known, the last
//! burst's size is held ready for `first_burst_hold_s` after it ended, consumed by later arrivals like a
//! forecast, so a trainer's second burst starts warm instead of waiting for the third.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::{Policy, Targets, TemplateTargets, median, spread, sync_states};
use crate::signals::{ArrivalHistory, BUCKET_MS, HISTORY_HORIZON_MS, Observation};

/// A bucket below this is never a spike: Poisson noise at a few requests/s stays under it.
pub(super) const MIN_SPIKE_PER_S: u32 = 10;
/// A spike is at least this multiple of the trailing rate.
pub(super) const SPIKE_FACTOR: f64 = 5.0;
/// Trailing window for the background rate, seconds.
pub(super) const TRAILING_S: u64 = 60;
/// Bursts smaller than this are not worth forecasting.
pub(super) const MIN_BURST: u32 = 20;
/// Spiky seconds closer than this belong to one burst (a gateway may admit a burst over a few seconds).
pub(super) const MERGE_GAP_S: u64 = 5;
/// Shorter "periods" are one burst's texture, not a training loop.
pub(super) const MIN_PERIOD_S: u64 = 20;
/// Intervals within ±25 % of the median count as regular.
pub(super) const REGULARITY: f64 = 0.25;
/// Bursts remembered per template (within the history horizon).
pub(super) const MAX_SPIKES: usize = 8;
/// Burst sizes the size estimate looks at.
pub(super) const SIZE_WINDOW: usize = 5;
/// Fixed margin before the predicted time, seconds: tick rounding and token-bucket jitter.
pub(super) const MARGIN_S: f64 = 5.0;
/// Margin per second of estimated jitter: about three deviations.
pub(super) const JITTER_FACTOR: f64 = 3.0;
/// Jitter assumed while only one interval is known, as a fraction of the period.
pub(super) const JITTER_PRIOR: f64 = 0.03;
/// The forecast burst is waited for at least this long past its predicted time, seconds.
pub(super) const GRACE_MIN_S: u64 = 30;
/// ...or this fraction of the period, if longer.
pub(super) const GRACE_FRACTION: f64 = 0.1;
/// With no period known, the last burst's size is held ready this long after it ended, seconds: a
/// training loop's next step comes within minutes (an RL rollout step is typically 0.5-5 minutes); a
/// one-off burst costs its size in idle sandboxes for this long.
pub(super) const FIRST_BURST_HOLD_S: u64 = 300;

/// Tuning of [`LearnedBursts`] (see the module docs; defaults are this module's constants).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LearnedConfig {
    /// Least arrivals in a spiky second.
    pub min_spike_per_s: u32,
    /// Least ratio of a spiky second to the trailing rate.
    pub spike_factor: f64,
    /// Trailing window, seconds.
    pub trailing_s: u64,
    /// Least burst size.
    pub min_burst: u32,
    /// Spiky seconds closer than this merge, seconds.
    pub merge_gap_s: u64,
    /// Least period, seconds.
    pub min_period_s: u64,
    /// Relative tolerance of a regular interval.
    pub regularity: f64,
    /// Bursts remembered.
    pub max_spikes: usize,
    /// Sizes looked at.
    pub size_window: usize,
    /// Fixed margin, seconds.
    pub margin_s: f64,
    /// Margin per second of jitter.
    pub jitter_factor: f64,
    /// Jitter prior, fraction of the period.
    pub jitter_prior: f64,
    /// Least grace, seconds.
    pub grace_min_s: u64,
    /// Grace as a fraction of the period.
    pub grace_fraction: f64,
    /// How long the last burst's size is held ready while no period is known, seconds (0: never).
    pub first_burst_hold_s: u64,
}

impl Default for LearnedConfig {
    fn default() -> Self {
        Self {
            min_spike_per_s: MIN_SPIKE_PER_S,
            spike_factor: SPIKE_FACTOR,
            trailing_s: TRAILING_S,
            min_burst: MIN_BURST,
            merge_gap_s: MERGE_GAP_S,
            min_period_s: MIN_PERIOD_S,
            regularity: REGULARITY,
            max_spikes: MAX_SPIKES,
            size_window: SIZE_WINDOW,
            margin_s: MARGIN_S,
            jitter_factor: JITTER_FACTOR,
            jitter_prior: JITTER_PRIOR,
            grace_min_s: GRACE_MIN_S,
            grace_fraction: GRACE_FRACTION,
            first_burst_hold_s: FIRST_BURST_HOLD_S,
        }
    }
}

/// A template's predicted next burst.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BurstForecast {
    /// Predicted start of the next burst, ms.
    pub next_ms: u64,
    /// Estimated period, ms.
    pub period_ms: u64,
    /// Predicted size (arrivals above background).
    pub size: u32,
    /// Estimated jitter of burst times, ms.
    pub jitter_ms: u64,
}

#[derive(Clone, Copy, Debug)]
struct Group {
    start_s: u64,
    last_s: u64,
    sum: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Spike {
    start_ms: u64,
    /// End of its last spiky second.
    end_ms: u64,
    size: u32,
}

#[derive(Debug, Default)]
struct TemplateState {
    /// First second not yet looked at.
    next_s: u64,
    open: Option<Group>,
    spikes: VecDeque<Spike>,
}

/// Burst forecasting from arrival history (see the module docs).
#[derive(Debug, Default)]
pub struct LearnedBursts {
    cfg: LearnedConfig,
    state: BTreeMap<String, TemplateState>,
    forecasts: BTreeMap<String, BurstForecast>,
}

impl LearnedBursts {
    /// A learned-bursts policy with this tuning.
    pub fn new(cfg: LearnedConfig) -> Self {
        Self { cfg, state: BTreeMap::new(), forecasts: BTreeMap::new() }
    }

    /// The forecasts made by the last decision, by template (for logs and metrics).
    pub fn forecasts(&self) -> &BTreeMap<String, BurstForecast> {
        &self.forecasts
    }

    /// Desired idle sandboxes per template (only templates with a forecast). Learns from new history.
    pub fn desired_idle(&mut self, obs: &Observation) -> TemplateTargets {
        let now = obs.now_ms;
        sync_states(&mut self.state, obs);
        self.forecasts.clear();
        for ((name, tmpl), (_, st)) in obs.templates.iter().zip(self.state.iter_mut()) {
            learn(&self.cfg, st, &tmpl.arrivals, now);
            if let Some(f) = forecast(&self.cfg, &st.spikes, now) {
                self.forecasts.insert(name.clone(), f);
            }
        }

        let rate = obs.total_create_rate();
        let latency_s = obs.max_create_latency_ms() as f64 / 1_000.0;
        // Bursts due no later than a given one share the create budget before it.
        let mut due: Vec<(u64, &str, BurstForecast)> =
            self.forecasts.iter().map(|(t, f)| (f.next_ms, t.as_str(), *f)).collect();
        due.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(b.1)));
        let mut out = TemplateTargets::new();
        // Arrivals of a template since `from` beyond its background rate (measured over the trailing window
        // before `quiet`, a time before any burst counted): what consumes an ask.
        let consumed_since = |name: &str, from: u64, quiet: u64| -> u32 {
            obs.templates
                .get(name)
                .map_or(0.0, |t| {
                    let trailing = self.cfg.trailing_s.max(1);
                    let bg = t.arrivals.count_between(quiet.saturating_sub(trailing * BUCKET_MS), quiet) as f64;
                    t.arrivals.count_since(from) as f64
                        - bg / trailing as f64 * now.saturating_sub(from) as f64 / 1_000.0
                })
                .max(0.0) as u32
        };
        // No period known yet: the last burst's size stays ready for a while after it (see the module docs).
        let hold_ms = self.cfg.first_burst_hold_s.saturating_mul(1_000);
        for (name, st) in &self.state {
            let Some(last) = st.spikes.back().filter(|_| !self.forecasts.contains_key(name)) else { continue };
            if st.open.is_none() && now < last.end_ms.saturating_add(hold_ms) {
                let want = last.size.saturating_sub(consumed_since(name, last.end_ms, last.start_ms));
                if want > 0 {
                    out.insert(name.clone(), want);
                }
            }
        }
        for (i, (next, name, f)) in due.iter().enumerate() {
            let ahead: u64 =
                due[..=i].iter().filter(|(n, _, _)| *n + f.period_ms > *next).map(|(_, _, g)| u64::from(g.size)).sum();
            let fill_s = if rate > 0.0 { ahead as f64 / rate } else { 0.0 };
            let margin_s = self.cfg.margin_s + self.cfg.jitter_factor * f.jitter_ms as f64 / 1_000.0;
            let lead_ms = ((fill_s + latency_s + margin_s + BUCKET_MS as f64 / 1_000.0) * 1_000.0) as u64;
            let margin_ms = (margin_s * 1_000.0) as u64;
            let grace_ms = grace_ms(&self.cfg, f.period_ms);
            let want = if now + lead_ms < *next {
                0
            } else if now + margin_ms < *next {
                f.size
            } else if now < next + grace_ms {
                // Arrivals since the window opened consume the forecast, beyond the background rate.
                let from = next.saturating_sub(margin_ms);
                f.size.saturating_sub(consumed_since(name, from, from))
            } else {
                0
            };
            if want > 0 {
                out.insert((*name).to_owned(), want);
            }
        }
        out
    }
}

impl Policy for LearnedBursts {
    fn name(&self) -> String {
        "learned-bursts".into()
    }

    fn decide(&mut self, obs: &Observation) -> Targets {
        let totals = self.desired_idle(obs);
        Targets { idle: spread(obs, &totals), reservations: Vec::new() }
    }
}

fn grace_ms(cfg: &LearnedConfig, period_ms: u64) -> u64 {
    (cfg.grace_min_s * 1_000).max((cfg.grace_fraction * period_ms as f64) as u64)
}

/// Fold the completed seconds of `history` not seen yet into the template's bursts.
fn learn(cfg: &LearnedConfig, st: &mut TemplateState, history: &ArrivalHistory, now_ms: u64) {
    let now_s = now_ms / BUCKET_MS;
    let mut new: Vec<(u64, u32)> =
        history.buckets().rev().skip_while(|(s, _)| *s >= now_s).take_while(|(s, _)| *s >= st.next_s).collect();
    new.reverse();
    for (s, c) in new {
        if let Some(g) = st.open.filter(|g| s > g.last_s + cfg.merge_gap_s) {
            close(cfg, st, g, history);
        }
        let open_sum = st.open.map_or(0, |g| g.sum);
        let trailing = history.count_between(s.saturating_sub(cfg.trailing_s) * BUCKET_MS, s * BUCKET_MS);
        let rate = trailing.saturating_sub(open_sum) as f64 / cfg.trailing_s.max(1) as f64;
        if c >= cfg.min_spike_per_s && f64::from(c) >= cfg.spike_factor * rate {
            st.open = Some(match st.open {
                Some(g) => Group { last_s: s, sum: g.sum + u64::from(c), ..g },
                None => Group { start_s: s, last_s: s, sum: u64::from(c) },
            });
        }
    }
    st.next_s = st.next_s.max(now_s);
    if let Some(g) = st.open.filter(|g| now_s > g.last_s + cfg.merge_gap_s) {
        close(cfg, st, g, history);
    }
    let oldest = now_ms.saturating_sub(HISTORY_HORIZON_MS);
    while st.spikes.front().is_some_and(|s| s.start_ms < oldest) {
        st.spikes.pop_front();
    }
}

fn close(cfg: &LearnedConfig, st: &mut TemplateState, g: Group, history: &ArrivalHistory) {
    st.open = None;
    let start_ms = g.start_s * BUCKET_MS;
    let before = history.count_between(start_ms.saturating_sub(cfg.trailing_s * BUCKET_MS), start_ms);
    let background = before as f64 / cfg.trailing_s.max(1) as f64 * (g.last_s - g.start_s + 1) as f64;
    let size = (g.sum as f64 - background).max(0.0) as u32;
    if size >= cfg.min_burst {
        st.spikes.push_back(Spike { start_ms, end_ms: (g.last_s + 1) * BUCKET_MS, size });
        while st.spikes.len() > cfg.max_spikes.max(2) {
            st.spikes.pop_front();
        }
    }
}

/// The next burst after `now_ms` predicted from `spikes`, if they are regular enough.
fn forecast(cfg: &LearnedConfig, spikes: &VecDeque<Spike>, now_ms: u64) -> Option<BurstForecast> {
    if spikes.len() < 2 {
        return None;
    }
    let times: Vec<f64> = spikes.iter().map(|s| s.start_ms as f64).collect();
    let intervals: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    let p_med = median(&intervals);
    if p_med < (cfg.min_period_s * 1_000) as f64 {
        return None;
    }
    let regular = intervals.iter().filter(|i| (*i - p_med).abs() <= cfg.regularity * p_med).count();
    if regular * 2 < intervals.len() {
        return None;
    }
    // Index each burst on the lattice of the median period; fit time = a + b·k.
    let ks: Vec<f64> = times.iter().map(|t| ((t - times[0]) / p_med).round()).collect();
    let n = times.len() as f64;
    let (mk, mt) = (ks.iter().sum::<f64>() / n, times.iter().sum::<f64>() / n);
    let skk: f64 = ks.iter().map(|k| (k - mk) * (k - mk)).sum();
    let (period, anchor, jitter) = if spikes.len() >= 3 && skk > 0.0 {
        let b = ks.iter().zip(&times).map(|(k, t)| (k - mk) * (t - mt)).sum::<f64>() / skk;
        let a = mt - b * mk;
        let residuals: Vec<f64> = ks.iter().zip(&times).map(|(k, t)| (t - (a + b * k)).abs()).collect();
        let last_k = ks.last().copied().unwrap_or(0.0);
        (b, a + b * last_k, median(&residuals))
    } else {
        (p_med, times[times.len() - 1], cfg.jitter_prior * p_med)
    };
    if period < (cfg.min_period_s * 1_000) as f64 {
        return None;
    }
    let sizes: Vec<f64> = spikes.iter().rev().take(cfg.size_window.max(1)).map(|s| f64::from(s.size)).collect();
    let size = median(&sizes).max(sizes[0]) as u32;
    let grace = grace_ms(cfg, period as u64) as f64;
    // The first predicted time whose grace has not passed.
    let j = (((now_ms as f64 - grace - anchor) / period).floor() + 1.0).max(1.0);
    let next = anchor + j * period;
    Some(BurstForecast { next_ms: next.max(0.0) as u64, period_ms: period as u64, size, jitter_ms: jitter as u64 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::node;
    use crate::signals::TemplateSignals;

    /// 2/s background plus `size` arrivals at each burst time, fed second by second to the policy.
    fn run(bursts: &[u64], size: u32, until_s: u64, mut each: impl FnMut(u64, &TemplateTargets, &LearnedBursts)) {
        let mut p = LearnedBursts::new(LearnedConfig::default());
        let mut obs = Observation::new(0, vec![node("n1", 10_000, 4.0), node("n2", 10_000, 4.0)]);
        obs.templates.insert("t".into(), TemplateSignals::default());
        for s in 0..until_s {
            obs.now_ms = s * 1_000;
            let out = p.desired_idle(&obs);
            each(s, &out, &p);
            if let Some(t) = obs.templates.get_mut("t") {
                t.arrivals.record(s * 1_000, 2);
                if bursts.contains(&s) {
                    t.arrivals.record(s * 1_000 + 300, size);
                }
            }
        }
    }

    #[test]
    fn detects_the_period_and_prewarms_before_the_third_burst() {
        // Bursts of 800 at 100 s and 400 s (period 300 s); the third is due at 700 s.
        let mut seen_at = None;
        let mut at_699 = 0;
        run(&[100, 400], 800, 701, |s, out, p| {
            let want = out.get("t").copied().unwrap_or(0);
            if s < 400 {
                assert!(p.forecasts().is_empty(), "no forecast from one burst (at {s} s)");
            }
            if want > 0 && seen_at.is_none() && s > 400 {
                seen_at = Some(s);
                let f = p.forecasts()["t"];
                assert_eq!((f.next_ms, f.period_ms, f.size), (700_000, 300_000, 800));
            }
            if s == 699 {
                at_699 = want;
            }
        });
        // Lead: 800 creates at 8/s = 100 s, + 0.5 s latency + 5 s + 3 × 9 s (jitter prior) margin + 1 s tick.
        let seen_at = seen_at.expect("a forecast before the third burst");
        assert_eq!(seen_at, 567, "prewarm starts 133.5 s ahead");
        assert_eq!(at_699, 800, "the predicted size is held up to the burst; background does not consume it");
    }

    #[test]
    fn one_burst_is_held_ready_for_the_next_until_a_period_is_known() {
        // One burst of 64 at 100 s (2/s background): from when it closes its size is wanted, untouched by the
        // background, until a second burst at 250 s takes it; that burst gives the period.
        let mut seen = Vec::new();
        run(&[100, 250], 64, 260, |s, out, p| {
            seen.push((s, out.get("t").copied().unwrap_or(0), p.forecasts().contains_key("t")));
        });
        let at = |s: u64| seen[s as usize];
        assert_eq!(at(100).1, 0, "nothing before the burst");
        let held_from = seen.iter().find(|(s, w, _)| *s > 100 && *w > 0).map(|x| x.0);
        assert!(held_from.is_some_and(|s| s <= 107), "held once the burst closes: {held_from:?}");
        assert_eq!(at(250).1, 64, "the whole burst is ready when the next one comes");
        assert!(!at(250).2, "from one burst: no forecast, only the hold");
        assert_eq!(at(252).1, 0, "the second burst consumed it");
        assert!(at(259).2, "two bursts: a forecast");

        // A one-off burst is forgotten after the hold (300 s after it ended).
        let mut last = Vec::new();
        run(&[100], 64, 420, |s, out, _| last.push((s, out.get("t").copied().unwrap_or(0))));
        assert_eq!(last[390].1, 64);
        assert_eq!(last[410].1, 0, "{:?}", &last[395..410]);
    }

    #[test]
    fn consumes_the_forecast_and_ignores_noise() {
        let mut after = Vec::new();
        run(&[100, 400, 700], 800, 760, |s, out, p| {
            if s > 702 {
                after.push((s, out.get("t").copied().unwrap_or(0), p.forecasts().get("t").map(|f| f.next_ms)));
            }
        });
        // Once the third burst has arrived nothing more is wanted, and the next one is forecast at 1,000 s.
        assert!(after.iter().all(|(_, w, _)| *w == 0), "{after:?}");
        assert_eq!(after.last().and_then(|a| a.2), Some(1_000_000));
        // Background alone (2/s) is never a burst.
        run(&[], 0, 900, |_, out, p| assert!(out.is_empty() && p.forecasts().is_empty()));
    }
}

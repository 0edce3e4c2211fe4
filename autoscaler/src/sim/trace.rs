//! Workload traces for the simulator and their seeded generators: periodic RL bursts, Poisson background
//! and a long-tail image mix.

use serde::{Deserialize, Serialize};

use super::rng::SimRng;
use crate::signals::Reservation;

/// DSec's reported episode length, median: 17 minutes.
pub const EPISODE_P50_S: f64 = 17.0 * 60.0;
/// DSec's reported episode length, 99th percentile: 231 minutes.
pub const EPISODE_P99_S: f64 = 231.0 * 60.0;
/// The standard normal's 99th percentile, to turn a p99 into a log-normal sigma.
const Z99: f64 = 2.326_347_874;

/// A template as the trace uses it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateSpec {
    /// Template name.
    pub name: String,
    /// Memory charged per sandbox on its node, MiB.
    pub memory_mib: u32,
    /// When the template becomes known to the autoscaler (registered), ms; 0 for configured templates.
    #[serde(default)]
    pub appears_ms: u64,
}

/// One session request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrival {
    /// When it arrives, ms.
    pub at_ms: u64,
    /// Index into [`Trace::templates`].
    pub template: usize,
    /// How long the episode holds its sandbox once it has one, ms.
    pub duration_ms: u64,
}

/// A reservation the trainer declares at `announce_ms` (used only when a run declares reservations).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Declared {
    /// When it becomes visible to the autoscaler, ms.
    pub announce_ms: u64,
    /// What is declared.
    pub reservation: Reservation,
}

/// A workload: templates, arrivals in time order, optional declarations, and the scored window.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trace {
    /// Short name for reports.
    pub name: String,
    /// Templates; each is shown to the autoscaler from its `appears_ms`.
    pub templates: Vec<TemplateSpec>,
    /// Session requests, sorted by time.
    pub arrivals: Vec<Arrival>,
    /// Reservations a trainer would declare for this workload.
    pub declared: Vec<Declared>,
    /// Arrivals before this are replayed (policies learn from them) but not scored, ms.
    pub warmup_ms: u64,
    /// End of the scored window; all arrivals are before it, ms.
    pub end_ms: u64,
}

/// Log-normal episode lengths given a median and a 99th percentile, seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpisodeLengths {
    /// Median, seconds.
    pub p50_s: f64,
    /// 99th percentile, seconds.
    pub p99_s: f64,
}

impl Default for EpisodeLengths {
    fn default() -> Self {
        Self { p50_s: EPISODE_P50_S, p99_s: EPISODE_P99_S }
    }
}

impl EpisodeLengths {
    /// One episode length, ms (at least one second).
    pub fn sample_ms(&self, rng: &mut SimRng) -> u64 {
        let sigma = (self.p99_s / self.p50_s).ln() / Z99;
        let s = (self.p50_s.ln() + sigma * rng.normal()).exp();
        (s * 1_000.0).max(1_000.0) as u64
    }
}

/// Periodic RL training bursts: `burst` episodes every `period_s`, one template.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeriodicSpec {
    /// Seconds between training steps.
    pub period_s: u64,
    /// Episodes per step.
    pub burst: u32,
    /// A step's arrivals are spread uniformly over this long, ms.
    pub spread_ms: u64,
    /// Each step starts uniformly within ± this of its nominal time, seconds.
    pub jitter_s: f64,
    /// Steps in the trace (the first at `period_s`).
    pub bursts: u32,
    /// Steps replayed before scoring starts (a forecast needs two).
    pub warmup_bursts: u32,
    /// The scored window ends this long after the last step, seconds.
    pub tail_s: u64,
    /// Memory per sandbox, MiB.
    pub memory_mib: u32,
    /// `hold_s` of the declared reservations.
    pub hold_s: u64,
    /// Episode lengths.
    pub lengths: EpisodeLengths,
}

impl Default for PeriodicSpec {
    /// The trace: 1,000 episodes every 5 minutes, 12 scored steps (about an hour) after 2 of warm-up.
    fn default() -> Self {
        Self {
            period_s: 300,
            burst: 1_000,
            spread_ms: 1_000,
            jitter_s: 5.0,
            bursts: 14,
            warmup_bursts: 2,
            tail_s: 60,
            memory_mib: 4,
            hold_s: 60,
            lengths: EpisodeLengths::default(),
        }
    }
}

/// Generate a periodic trace. Declared reservations ask for each step at its nominal start (the trainer's
/// plan; the actual start jitters around it), announced one period ahead, when the previous step starts.
pub fn periodic(seed: u64, spec: &PeriodicSpec) -> Trace {
    let mut rng = SimRng::new(seed);
    let period_ms = spec.period_s * 1_000;
    let jitter_ms = (spec.jitter_s * 1_000.0) as u64;
    let mut arrivals = Vec::new();
    let mut declared = Vec::new();
    for k in 1..=u64::from(spec.bursts) {
        let nominal = k * period_ms;
        let start = (nominal as f64 + rng.range(-1.0, 1.0) * spec.jitter_s * 1_000.0) as u64;
        for _ in 0..spec.burst {
            let at_ms = start + rng.below(spec.spread_ms.max(1));
            arrivals.push(Arrival { at_ms, template: 0, duration_ms: spec.lengths.sample_ms(&mut rng) });
        }
        declared.push(Declared {
            announce_ms: nominal.saturating_sub(period_ms),
            reservation: Reservation {
                template: "rl".into(),
                count: spec.burst,
                ready_by_ms: nominal,
                hold_s: spec.hold_s,
            },
        });
    }
    arrivals.sort_by_key(|a| a.at_ms);
    let first_scored = (u64::from(spec.warmup_bursts) + 1) * period_ms;
    Trace {
        name: "periodic".into(),
        templates: vec![TemplateSpec { name: "rl".into(), memory_mib: spec.memory_mib, appears_ms: 0 }],
        arrivals,
        declared,
        warmup_ms: first_scored - period_ms / 2,
        end_ms: u64::from(spec.bursts) * period_ms + jitter_ms + spec.tail_s * 1_000,
    }
}

/// Poisson background: independent session requests at a constant rate, one template.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoissonSpec {
    /// Requests per second.
    pub rate_per_s: f64,
    /// Scored duration, seconds.
    pub duration_s: u64,
    /// Unscored warm-up before it, seconds.
    pub warmup_s: u64,
    /// Memory per sandbox, MiB.
    pub memory_mib: u32,
    /// Episode lengths.
    pub lengths: EpisodeLengths,
}

impl Default for PoissonSpec {
    /// 2 requests/s for an hour after 10 minutes of warm-up.
    fn default() -> Self {
        Self { rate_per_s: 2.0, duration_s: 3_600, warmup_s: 600, memory_mib: 4, lengths: EpisodeLengths::default() }
    }
}

/// Generate a Poisson trace.
pub fn poisson(seed: u64, spec: &PoissonSpec) -> Trace {
    let mut rng = SimRng::new(seed);
    let end_ms = (spec.warmup_s + spec.duration_s) * 1_000;
    let mut arrivals = Vec::new();
    let mut t = 0.0;
    loop {
        t += rng.exp(1_000.0 / spec.rate_per_s.max(1e-9));
        if t >= end_ms as f64 {
            break;
        }
        arrivals.push(Arrival { at_ms: t as u64, template: 0, duration_ms: spec.lengths.sample_ms(&mut rng) });
    }
    Trace {
        name: "poisson".into(),
        templates: vec![TemplateSpec { name: "bg".into(), memory_mib: spec.memory_mib, appears_ms: 0 }],
        arrivals,
        declared: Vec::new(),
        warmup_ms: spec.warmup_s * 1_000,
        end_ms,
    }
}

/// A long-tail image mix: every task brings its own template and a few sandboxes of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LongtailSpec {
    /// Sandbox requests per second over all templates.
    pub rate_per_s: f64,
    /// Mean sandboxes per template (1 + Poisson(mean − 1)).
    pub per_template: f64,
    /// A task's sandboxes arrive uniformly within this long of its start, seconds.
    pub spread_s: f64,
    /// Scored duration, seconds.
    pub duration_s: u64,
    /// Unscored warm-up, seconds.
    pub warmup_s: u64,
    /// Memory per sandbox, MiB, chosen uniformly per template.
    pub memory_choices_mib: Vec<u32>,
    /// Episode lengths.
    pub lengths: EpisodeLengths,
}

impl Default for LongtailSpec {
    /// 1 sandbox/s, about 3 per image, for 30 minutes after 10 minutes of warm-up (about 800 images; every
    /// policy sizes every live image every tick, so this trace costs the most to simulate).
    fn default() -> Self {
        Self {
            rate_per_s: 1.0,
            per_template: 3.0,
            spread_s: 30.0,
            duration_s: 1_800,
            warmup_s: 600,
            memory_choices_mib: vec![4, 8, 16],
            lengths: EpisodeLengths::default(),
        }
    }
}

/// Generate a long-tail trace.
pub fn longtail(seed: u64, spec: &LongtailSpec) -> Trace {
    let mut rng = SimRng::new(seed);
    let end_ms = (spec.warmup_s + spec.duration_s) * 1_000;
    let per = spec.per_template.max(1.0);
    let task_mean_ms = 1_000.0 * per / spec.rate_per_s.max(1e-9);
    let spread_ms = spec.spread_s * 1_000.0;
    let mut templates = Vec::new();
    let mut arrivals = Vec::new();
    let mut t = 0.0;
    loop {
        t += rng.exp(task_mean_ms);
        if t >= end_ms as f64 - spread_ms {
            break;
        }
        let idx = templates.len();
        let choices = &spec.memory_choices_mib;
        let memory_mib = choices.get(rng.below(choices.len() as u64) as usize).copied().unwrap_or(4);
        // A task's image is registered when the task starts, just before its first sandbox is asked for.
        templates.push(TemplateSpec { name: format!("img-{idx:05}"), memory_mib, appears_ms: t as u64 });
        for _ in 0..1 + rng.poisson(per - 1.0) {
            let at_ms = (t + rng.range(0.0, spread_ms)) as u64;
            arrivals.push(Arrival { at_ms, template: idx, duration_ms: spec.lengths.sample_ms(&mut rng) });
        }
    }
    arrivals.sort_by_key(|a| (a.at_ms, a.template));
    Trace {
        name: "longtail".into(),
        templates,
        arrivals,
        declared: Vec::new(),
        warmup_ms: spec.warmup_s * 1_000,
        end_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generators_are_seeded_and_shaped() {
        let a = periodic(1, &PeriodicSpec::default());
        assert_eq!(a, periodic(1, &PeriodicSpec::default()));
        assert_ne!(a, periodic(2, &PeriodicSpec::default()));
        assert_eq!(a.arrivals.len(), 14_000);
        assert!(a.arrivals.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        assert!(a.arrivals.iter().all(|x| x.at_ms < a.end_ms));
        let mut d: Vec<u64> = a.arrivals.iter().map(|x| x.duration_ms).collect();
        d.sort_unstable();
        let p50 = d[d.len() / 2] as f64 / 60_000.0;
        let p99 = d[d.len() * 99 / 100] as f64 / 60_000.0;
        assert!((15.0..19.0).contains(&p50) && (190.0..280.0).contains(&p99), "p50 {p50} p99 {p99}");

        let p = poisson(1, &PoissonSpec::default());
        let rate = p.arrivals.len() as f64 / (p.end_ms as f64 / 1_000.0);
        assert!((1.9..2.1).contains(&rate));

        let l = longtail(1, &LongtailSpec::default());
        let per = l.arrivals.len() as f64 / l.templates.len() as f64;
        assert!((2.8..3.2).contains(&per), "{per} sandboxes per template");
    }
}

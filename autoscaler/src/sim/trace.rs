//! Workload traces for the simulator and their seeded generators: periodic RL bursts, Poisson background
//! and a long-tail image mix (whose templates are made from registry images that nodes pull on first
//! need, and whose arrivals a trainer can declare step by step).

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
    /// Index into [`Trace::images`] of the registry image the template is made from (nodes pull it on first
    /// need); `None` for a configured template, whose image every node holds already.
    #[serde(default)]
    pub image: Option<usize>,
}

/// A registry image that templates are made from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageSpec {
    /// Image reference (for reports).
    pub name: String,
    /// How long one pull of it takes on a node that pulls nothing else, ms. Pulls in flight on one node share
    /// it (see [`super::NodeSpec::max_pulls_in_flight`]).
    pub pull_ms: u64,
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
    /// Reservations a trainer would declare for this workload. Several with the same `announce_ms` and
    /// `ready_by_ms` are one multi-template reservation (the gateway stores one per template, too).
    pub declared: Vec<Declared>,
    /// Images of templates made from images (empty when no template pulls one).
    #[serde(default)]
    pub images: Vec<ImageSpec>,
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

/// Pulling a small corpus image (`scripts/corpus`: busybox's layers, present already, plus 64 KiB of its
/// own) from the local registry, median: `docker pull` of 20 such images, 5 rounds one at a time, here.
pub const LOCAL_PULL_P50_MS: f64 = 250.0;
/// ...and their 99th percentile (4 at once took 930 ms each at the median: the pulls share the node).
pub const LOCAL_PULL_P99_MS: f64 = 360.0;
/// A SWE-style task image (a repository, its environment and its dependencies), median size, MB.
pub const SWE_IMAGE_P50_MB: f64 = 1_000.0;
/// ...and its 99th percentile, MB.
pub const SWE_IMAGE_P99_MB: f64 = 3_000.0;
/// What one node pulls at, MB/s, shared by its pulls in flight: about a 1 Gbit/s link's payload, with the
/// registry and layer extraction keeping up (pulling from Docker Hub is slower still).
pub const NODE_PULL_MB_PER_S: f64 = 100.0;

/// Log-normal pull times of images, given a median and a 99th percentile, ms (time on a node pulling
/// nothing else).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PullTimes {
    /// Median, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
}

impl Default for PullTimes {
    fn default() -> Self {
        Self::local()
    }
}

impl PullTimes {
    /// Small corpus images from the registry on this machine (measured here).
    pub fn local() -> Self {
        Self { p50_ms: LOCAL_PULL_P50_MS, p99_ms: LOCAL_PULL_P99_MS }
    }

    /// SWE-style images (median 1 GB, p99 3 GB) at [`NODE_PULL_MB_PER_S`]: 10 s median, 30 s p99.
    pub fn swe() -> Self {
        Self::sized(SWE_IMAGE_P50_MB, SWE_IMAGE_P99_MB, NODE_PULL_MB_PER_S)
    }

    /// Images of log-normal size (median and p99, MB) pulled at `mb_per_s`.
    pub fn sized(p50_mb: f64, p99_mb: f64, mb_per_s: f64) -> Self {
        let ms_per_mb = 1_000.0 / mb_per_s.max(1e-9);
        Self { p50_ms: p50_mb * ms_per_mb, p99_ms: p99_mb * ms_per_mb }
    }

    /// One pull time, ms.
    pub fn sample_ms(&self, rng: &mut SimRng) -> u64 {
        if self.p50_ms <= 0.0 {
            return 0;
        }
        let sigma = (self.p99_ms.max(self.p50_ms) / self.p50_ms).ln() / Z99;
        (self.p50_ms.ln() + sigma * rng.normal()).exp().round() as u64
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
        templates: vec![TemplateSpec { name: "rl".into(), memory_mib: spec.memory_mib, appears_ms: 0, image: None }],
        arrivals,
        declared,
        images: Vec::new(),
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
        templates: vec![TemplateSpec { name: "bg".into(), memory_mib: spec.memory_mib, appears_ms: 0, image: None }],
        arrivals,
        declared: Vec::new(),
        images: Vec::new(),
        warmup_ms: spec.warmup_s * 1_000,
        end_ms,
    }
}

/// A long-tail image mix: every task brings its own template (made from an image of its own) and a few
/// sandboxes of it.
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
    /// Pull times of the templates' images; `None`: images are not modelled (every node holds them).
    #[serde(default)]
    pub pulls: Option<PullTimes>,
    /// The trainer's step, seconds: step `k` is the tasks that start in `[k·step, (k+1)·step)`, and at the
    /// start of step `k` the trainer declares step `k+1` (one multi-template reservation, ready by its start,
    /// held until its last task's sandboxes can have arrived). 0: nothing is declared.
    #[serde(default)]
    pub step_s: u64,
}

/// The trainer's step of the long-tail trace, seconds: 20 tasks (about 60 sandboxes) at a time.
pub const LONGTAIL_STEP_S: u64 = 60;

impl Default for LongtailSpec {
    /// 1 sandbox/s, about 3 per image, for 30 minutes after 10 minutes of warm-up (about 800 images; every
    /// policy sizes every live image every tick, so this trace costs the most to simulate); images pulled from
    /// the local registry, steps of a minute declared.
    fn default() -> Self {
        Self {
            rate_per_s: 1.0,
            per_template: 3.0,
            spread_s: 30.0,
            duration_s: 1_800,
            warmup_s: 600,
            memory_choices_mib: vec![4, 8, 16],
            lengths: EpisodeLengths::default(),
            pulls: Some(PullTimes::local()),
            step_s: LONGTAIL_STEP_S,
        }
    }
}

impl LongtailSpec {
    /// The trace as it was before images and steps: no pulls, nothing declared.
    pub fn without_images() -> Self {
        Self { pulls: None, step_s: 0, ..Self::default() }
    }
}

/// Pull times come from a stream of their own, so a seed's arrivals do not depend on whether images are
/// modelled.
const PULL_STREAM: u64 = 0x1A6E_5EED_0000_0001;

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
        templates.push(TemplateSpec { name: format!("img-{idx:05}"), memory_mib, appears_ms: t as u64, image: None });
        for _ in 0..1 + rng.poisson(per - 1.0) {
            let at_ms = (t + rng.range(0.0, spread_ms)) as u64;
            arrivals.push(Arrival { at_ms, template: idx, duration_ms: spec.lengths.sample_ms(&mut rng) });
        }
    }
    arrivals.sort_by_key(|a| (a.at_ms, a.template));
    let mut images = Vec::new();
    if let Some(pulls) = &spec.pulls {
        let mut rng = SimRng::new(seed ^ PULL_STREAM);
        for (i, t) in templates.iter_mut().enumerate() {
            images.push(ImageSpec { name: format!("registry/task-{i:05}"), pull_ms: pulls.sample_ms(&mut rng) });
            t.image = Some(i);
        }
    }
    let declared = declare_steps(&templates, &arrivals, spec.step_s, spec.spread_s);
    Trace { name: "longtail".into(), templates, arrivals, declared, images, warmup_ms: spec.warmup_s * 1_000, end_ms }
}

/// The trainer's declarations of a long-tail trace (see [`LongtailSpec::step_s`]): for each step `k ≥ 1`,
/// one reservation per template of a task starting in it, for all of that task's sandboxes, announced at the
/// start of step `k−1` and ready by the start of step `k`.
fn declare_steps(templates: &[TemplateSpec], arrivals: &[Arrival], step_s: u64, spread_s: f64) -> Vec<Declared> {
    if step_s == 0 {
        return Vec::new();
    }
    let step_ms = step_s * 1_000;
    let hold_s = step_s + spread_s.max(0.0).ceil() as u64;
    let mut count = vec![0u32; templates.len()];
    for a in arrivals {
        count[a.template] += 1;
    }
    let mut declared: Vec<Declared> = templates
        .iter()
        .zip(&count)
        .filter_map(|(t, &count)| {
            let k = t.appears_ms / step_ms;
            (k >= 1 && count > 0).then(|| Declared {
                announce_ms: (k - 1) * step_ms,
                reservation: Reservation { template: t.name.clone(), count, ready_by_ms: k * step_ms, hold_s },
            })
        })
        .collect();
    declared
        .sort_by(|a, b| a.announce_ms.cmp(&b.announce_ms).then(a.reservation.template.cmp(&b.reservation.template)));
    declared
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

    #[test]
    fn longtail_images_and_steps_leave_the_arrivals_alone() {
        let with = longtail(3, &LongtailSpec::default());
        let without = longtail(3, &LongtailSpec::without_images());
        assert_eq!(with.arrivals, without.arrivals, "pull times draw from a stream of their own");
        assert!(without.images.is_empty() && without.declared.is_empty());
        assert!(without.templates.iter().all(|t| t.image.is_none()));
        // One image per template, pull times around the measured ones.
        assert_eq!(with.images.len(), with.templates.len());
        assert!(with.templates.iter().enumerate().all(|(i, t)| t.image == Some(i)));
        let mut pulls: Vec<u64> = with.images.iter().map(|i| i.pull_ms).collect();
        pulls.sort_unstable();
        let p50 = pulls[pulls.len() / 2];
        assert!((220..=280).contains(&p50), "pull p50 {p50} ms");

        // Every task of step k is declared at the start of step k-1, ready by the start of step k, for all
        // of its sandboxes, and held until the last of them can have arrived.
        let step_ms = LONGTAIL_STEP_S * 1_000;
        let mut declared = 0;
        for (i, t) in with.templates.iter().enumerate() {
            let n = with.arrivals.iter().filter(|a| a.template == i).count() as u32;
            let k = t.appears_ms / step_ms;
            let d: Vec<&Declared> = with.declared.iter().filter(|d| d.reservation.template == t.name).collect();
            if k == 0 {
                assert!(d.is_empty());
                continue;
            }
            assert_eq!(d.len(), 1);
            let (d, r) = (d[0], &d[0].reservation);
            assert_eq!((d.announce_ms, r.ready_by_ms, r.count), ((k - 1) * step_ms, k * step_ms, n));
            assert!(with.arrivals.iter().filter(|a| a.template == i).all(|a| a.at_ms < r.expires_ms()));
            declared += 1;
        }
        assert!(declared > 700, "{declared} tasks declared");
        assert!(with.declared.windows(2).all(|w| w[0].announce_ms <= w[1].announce_ms));
    }

    #[test]
    fn pull_times_are_log_normal_by_median_and_p99() {
        let mut rng = SimRng::new(5);
        let swe = PullTimes::swe();
        assert_eq!((swe.p50_ms, swe.p99_ms), (10_000.0, 30_000.0));
        let mut v: Vec<u64> = (0..20_000).map(|_| swe.sample_ms(&mut rng)).collect();
        v.sort_unstable();
        let (p50, p99) = (v[v.len() / 2] as f64, v[v.len() * 99 / 100] as f64);
        assert!((9_500.0..10_500.0).contains(&p50) && (27_000.0..33_000.0).contains(&p99), "{p50} {p99}");
        assert_eq!(PullTimes { p50_ms: 0.0, p99_ms: 0.0 }.sample_ms(&mut rng), 0);
    }
}

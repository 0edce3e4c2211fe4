//! Load scenarios: the TOML file (raw serde structs, validated into [`Scenario`]) and the
//! schedule it expands into, deterministically for a seed.
//!
//! A scenario is a list of phases (bursts: at offset `at_s`, `episodes` episodes of one
//! template, started uniformly within `spread_s`) plus optional Poisson background arrivals.
//! Each episode is: create a session, `steps` exec steps separated by think time, delete.
//! `loadtest/scenarios/smoke.toml` is the documented example.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde::Deserialize;
use wire::Cmd;

/// Image of a template that the scenario's `[templates]` table does not name (baseline mode).
/// The same default image as the shipped `busybox` template.
pub const DEFAULT_IMAGE: &str = "sandpool/busybox:latest";
/// Per-request deadline when the scenario sets none: long enough for a cold create on a busy
/// 2-core node (~0.5 s each, 4 at a time), short enough that a hung request ends the run.
pub const DEFAULT_DEADLINE_MS: u64 = 60_000;
/// A request sent more than this after its intended time counts as "sent late": the generator
/// itself fell behind (concurrency cap, runtime stall). Its latency still counts from the
/// intended time; this only flags that the generator, not the target, may be the cause.
pub const DEFAULT_LATE_MS: u64 = 10;
/// Default seed: runs are reproducible unless asked otherwise.
pub const DEFAULT_SEED: u64 = 1;
/// Default spread of a burst: "1,000 episodes within a second".
pub const DEFAULT_SPREAD_S: f64 = 1.0;
/// Guard against a typo turning a scenario into millions of episodes.
pub const MAX_EPISODES: usize = 1_000_000;
/// Guard against runaway step counts per episode.
pub const MAX_STEPS: u32 = 100_000;

// ---------------------------------------------------------------------------------------------
// Raw file format

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    name: Option<String>,
    url: Option<String>,
    token: Option<String>,
    seed: Option<u64>,
    deadline_ms: Option<u64>,
    create_deadline_ms: Option<u64>,
    late_ms: Option<u64>,
    #[serde(default)]
    templates: BTreeMap<String, String>,
    #[serde(default)]
    phase: Vec<RawPhase>,
    background: Option<RawBackground>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPhase {
    at_s: f64,
    episodes: u64,
    spread_s: Option<f64>,
    template: String,
    steps: u32,
    cmd: Option<Cmd>,
    cmds: Option<Vec<Cmd>>,
    think_ms: Option<RawThink>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBackground {
    rate_per_s: f64,
    from_s: Option<f64>,
    until_s: f64,
    template: String,
    steps: u32,
    cmd: Option<Cmd>,
    cmds: Option<Vec<Cmd>>,
    think_ms: Option<RawThink>,
}

/// `think_ms = 200` (fixed) or `think_ms = [100, 500]` (uniform in the range).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawThink {
    Fixed(u64),
    Range([u64; 2]),
}

// ---------------------------------------------------------------------------------------------
// Validated scenario

/// A validated scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    pub name: String,
    pub url: Option<String>,
    pub token: Option<String>,
    pub seed: u64,
    /// Deadline of each exec and delete request.
    pub deadline: Duration,
    /// Deadline of each create request.
    pub create_deadline: Duration,
    pub late: Duration,
    /// Template → image, for the Docker baseline.
    pub templates: BTreeMap<String, String>,
    pub phases: Vec<Phase>,
    pub background: Option<Background>,
}

/// Think time between two exec steps of an episode (the model's inference, in RL terms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Think {
    Fixed(Duration),
    Uniform(Duration, Duration),
}

/// What one episode does once it has a session.
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeShape {
    pub template: String,
    pub steps: u32,
    /// Step `i` runs `cmds[i % cmds.len()]`.
    pub cmds: Vec<Cmd>,
    pub think: Think,
}

/// A burst: `episodes` episodes starting uniformly at random within `[at, at + spread)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    pub at: Duration,
    pub episodes: usize,
    pub spread: Duration,
    pub shape: EpisodeShape,
}

/// Poisson arrivals at `rate_per_s` between `from` and `until`.
#[derive(Debug, Clone, PartialEq)]
pub struct Background {
    pub rate_per_s: f64,
    pub from: Duration,
    pub until: Duration,
    pub shape: EpisodeShape,
}

impl Scenario {
    /// Read and validate a scenario file.
    pub fn load(path: &Path) -> anyhow::Result<Scenario> {
        let text = std::fs::read_to_string(path).with_context(|| format!("read scenario {}", path.display()))?;
        let fallback = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        Scenario::parse(&text, &fallback).with_context(|| format!("load scenario {}", path.display()))
    }

    /// Parse and validate scenario TOML; `default_name` names it when the file does not.
    pub fn parse(text: &str, default_name: &str) -> anyhow::Result<Scenario> {
        let raw: RawScenario = toml::from_str(text).context("parse TOML")?;
        raw.validate(default_name)
    }

    /// Image for a template in baseline mode.
    pub fn image_for(&self, template: &str) -> &str {
        self.templates.get(template).map(String::as_str).unwrap_or(DEFAULT_IMAGE)
    }

    /// Every template the scenario uses, once.
    pub fn used_templates(&self) -> Vec<String> {
        let mut t: Vec<String> = self.phases.iter().map(|p| p.shape.template.clone()).collect();
        t.extend(self.background.iter().map(|b| b.shape.template.clone()));
        t.sort();
        t.dedup();
        t
    }
}

fn secs(field: &str, v: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(v.is_finite() && (0.0..=1.0e6).contains(&v), "{field}: must be a number of seconds in [0, 1e6]");
    Ok(Duration::from_secs_f64(v))
}

fn shape(
    field: &str,
    template: String,
    steps: u32,
    cmd: Option<Cmd>,
    cmds: Option<Vec<Cmd>>,
    think: Option<RawThink>,
) -> anyhow::Result<EpisodeShape> {
    anyhow::ensure!(!template.trim().is_empty(), "{field}.template: must not be empty");
    anyhow::ensure!(steps <= MAX_STEPS, "{field}.steps: at most {MAX_STEPS}");
    let cmds = match (cmd, cmds) {
        (Some(_), Some(_)) => anyhow::bail!("{field}: set `cmd` or `cmds`, not both"),
        (Some(c), None) => vec![c],
        (None, Some(v)) => {
            anyhow::ensure!(!v.is_empty(), "{field}.cmds: must not be empty");
            v
        }
        (None, None) => vec![Cmd::Argv(vec!["true".into()])],
    };
    for (i, c) in cmds.iter().enumerate() {
        let empty = match c {
            Cmd::Argv(v) => v.is_empty() || v[0].is_empty(),
            Cmd::Shell(s) => s.trim().is_empty(),
        };
        anyhow::ensure!(!empty, "{field}.cmds[{i}]: empty command");
    }
    let think = match think {
        None => Think::Fixed(Duration::ZERO),
        Some(RawThink::Fixed(ms)) => Think::Fixed(Duration::from_millis(ms)),
        Some(RawThink::Range([lo, hi])) => {
            anyhow::ensure!(lo <= hi, "{field}.think_ms: [low, high] with low <= high");
            Think::Uniform(Duration::from_millis(lo), Duration::from_millis(hi))
        }
    };
    Ok(EpisodeShape { template, steps, cmds, think })
}

impl RawScenario {
    fn validate(self, default_name: &str) -> anyhow::Result<Scenario> {
        let name = self.name.unwrap_or_else(|| default_name.to_string());
        if let Some(url) = &self.url {
            anyhow::ensure!(
                url.starts_with("http://") || url.starts_with("https://"),
                "url: must start with http:// or https://"
            );
        }
        let deadline_ms = self.deadline_ms.unwrap_or(DEFAULT_DEADLINE_MS);
        anyhow::ensure!(deadline_ms > 0, "deadline_ms: must be > 0");
        let create_deadline_ms = self.create_deadline_ms.unwrap_or(deadline_ms);
        anyhow::ensure!(create_deadline_ms > 0, "create_deadline_ms: must be > 0");
        for (t, image) in &self.templates {
            anyhow::ensure!(!image.trim().is_empty(), "templates.{t}: image must not be empty");
        }

        let mut phases = Vec::new();
        let mut total = 0usize;
        for (i, p) in self.phase.into_iter().enumerate() {
            let f = format!("phase[{i}]");
            let at = secs(&format!("{f}.at_s"), p.at_s)?;
            let spread = secs(&format!("{f}.spread_s"), p.spread_s.unwrap_or(DEFAULT_SPREAD_S))?;
            anyhow::ensure!(p.episodes >= 1, "{f}.episodes: must be >= 1");
            let episodes = usize::try_from(p.episodes).unwrap_or(usize::MAX);
            total = total.saturating_add(episodes);
            anyhow::ensure!(total <= MAX_EPISODES, "{f}.episodes: more than {MAX_EPISODES} episodes in all");
            let shape = shape(&f, p.template, p.steps, p.cmd, p.cmds, p.think_ms)?;
            phases.push(Phase { at, episodes, spread, shape });
        }
        let background = match self.background {
            None => None,
            Some(b) => {
                let f = "background";
                anyhow::ensure!(
                    b.rate_per_s.is_finite() && b.rate_per_s > 0.0 && b.rate_per_s <= 100_000.0,
                    "{f}.rate_per_s: must be in (0, 100000]"
                );
                let from = secs("background.from_s", b.from_s.unwrap_or(0.0))?;
                let until = secs("background.until_s", b.until_s)?;
                anyhow::ensure!(until > from, "{f}.until_s: must be after from_s");
                let expected = b.rate_per_s * (until - from).as_secs_f64();
                anyhow::ensure!(
                    total as f64 + expected <= MAX_EPISODES as f64,
                    "{f}: rate_per_s × (until_s − from_s) gives more than {MAX_EPISODES} episodes in all"
                );
                let shape = shape(f, b.template, b.steps, b.cmd, b.cmds, b.think_ms)?;
                Some(Background { rate_per_s: b.rate_per_s, from, until, shape })
            }
        };
        anyhow::ensure!(
            !phases.is_empty() || background.is_some(),
            "scenario: needs at least one [[phase]] or a [background]"
        );
        Ok(Scenario {
            name,
            url: self.url,
            token: self.token,
            seed: self.seed.unwrap_or(DEFAULT_SEED),
            deadline: Duration::from_millis(deadline_ms),
            create_deadline: Duration::from_millis(create_deadline_ms),
            late: Duration::from_millis(self.late_ms.unwrap_or(DEFAULT_LATE_MS)),
            templates: self.templates,
            phases,
            background,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Schedule

/// Where an episode of the schedule came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Phase(usize),
    Background,
}

/// One exec step: wait `think` after the previous answer (zero for the first step, which runs
/// as soon as the session exists), then run `cmd`.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPlan {
    pub think: Duration,
    pub cmd: Cmd,
}

/// One episode of the schedule; `start` is its intended create time, from the run's start.
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodePlan {
    pub id: usize,
    pub start: Duration,
    pub source: Source,
    pub template: String,
    pub steps: Vec<StepPlan>,
}

fn draw(rng: &mut StdRng, lo: Duration, width: Duration) -> Duration {
    if width.is_zero() { lo } else { lo + width.mul_f64(rng.random::<f64>()) }
}

fn steps(rng: &mut StdRng, shape: &EpisodeShape) -> Vec<StepPlan> {
    (0..shape.steps as usize)
        .map(|i| {
            let think = if i == 0 {
                Duration::ZERO
            } else {
                match shape.think {
                    Think::Fixed(d) => d,
                    Think::Uniform(lo, hi) => draw(rng, lo, hi - lo),
                }
            };
            StepPlan { think, cmd: shape.cmds[i % shape.cmds.len()].clone() }
        })
        .collect()
}

/// Expand a scenario into its episodes, sorted by intended start; the same seed gives the
/// same schedule (start times, think times and commands alike).
pub fn schedule(s: &Scenario, seed: u64) -> Vec<EpisodePlan> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for (i, p) in s.phases.iter().enumerate() {
        for _ in 0..p.episodes {
            let start = draw(&mut rng, p.at, p.spread);
            let steps = steps(&mut rng, &p.shape);
            out.push(EpisodePlan { id: 0, start, source: Source::Phase(i), template: p.shape.template.clone(), steps });
        }
    }
    if let Some(b) = &s.background {
        let mut t = b.from.as_secs_f64();
        let until = b.until.as_secs_f64();
        loop {
            // Exponential inter-arrival times make a Poisson process.
            let u: f64 = rng.random::<f64>();
            t += -(1.0 - u).ln() / b.rate_per_s;
            if t >= until {
                break;
            }
            let steps = steps(&mut rng, &b.shape);
            out.push(EpisodePlan {
                id: 0,
                start: Duration::from_secs_f64(t),
                source: Source::Background,
                template: b.shape.template.clone(),
                steps,
            });
        }
    }
    out.sort_by_key(|e| e.start);
    for (i, e) in out.iter_mut().enumerate() {
        e.id = i;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
        name = "t"
        url = "http://127.0.0.1:8080"
        seed = 7
        deadline_ms = 5000
        create_deadline_ms = 9000
        [templates]
        debian = "sandpool/debian:bookworm"
        [[phase]]
        at_s = 0
        episodes = 8
        template = "busybox"
        steps = 5
        cmds = [["true"], "echo hi | wc -c"]
        think_ms = [100, 300]
        [[phase]]
        at_s = 20
        episodes = 2
        spread_s = 0.5
        template = "debian"
        steps = 3
        cmd = "python3 -c 'print(1)'"
        think_ms = 50
        [background]
        rate_per_s = 2.0
        until_s = 10
        template = "busybox"
        steps = 1
    "#;

    #[test]
    fn parses_the_example() {
        let s = Scenario::parse(EXAMPLE, "x").unwrap();
        assert_eq!(s.name, "t");
        assert_eq!(s.seed, 7);
        assert_eq!(s.deadline, Duration::from_secs(5));
        assert_eq!(s.create_deadline, Duration::from_secs(9));
        assert_eq!(s.late, Duration::from_millis(DEFAULT_LATE_MS));
        assert_eq!(s.phases.len(), 2);
        let p = &s.phases[0];
        assert_eq!((p.at, p.episodes, p.spread), (Duration::ZERO, 8, Duration::from_secs(1)));
        assert_eq!(p.shape.cmds, vec![Cmd::Argv(vec!["true".into()]), Cmd::Shell("echo hi | wc -c".into())]);
        assert_eq!(p.shape.think, Think::Uniform(Duration::from_millis(100), Duration::from_millis(300)));
        assert_eq!(s.phases[1].shape.think, Think::Fixed(Duration::from_millis(50)));
        let b = s.background.as_ref().unwrap();
        assert_eq!(b.shape.cmds, vec![Cmd::Argv(vec!["true".into()])], "cmd defaults to true");
        assert_eq!(s.image_for("debian"), "sandpool/debian:bookworm");
        assert_eq!(s.image_for("busybox"), DEFAULT_IMAGE);
        assert_eq!(s.used_templates(), ["busybox", "debian"]);
    }

    #[test]
    fn shipped_scenarios_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let s = Scenario::load(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
                assert!(!schedule(&s, s.seed).is_empty(), "{}", path.display());
                n += 1;
            }
        }
        assert!(n >= 1, "no scenario in {}", dir.display());
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            ("[[phase]]\nat_s = 0\nepisodes = 0\ntemplate = \"b\"\nsteps = 1", "phase[0].episodes"),
            ("[[phase]]\nat_s = -1\nepisodes = 1\ntemplate = \"b\"\nsteps = 1", "phase[0].at_s"),
            ("[[phase]]\nat_s = 0\nepisodes = 1\ntemplate = \"b\"\nsteps = 1\nthink_ms = [5, 1]", "phase[0].think_ms"),
            ("[[phase]]\nat_s = 0\nepisodes = 1\ntemplate = \"b\"\nsteps = 1\ncmd = []", "phase[0].cmds[0]"),
            ("[[phase]]\nat_s = 0\nepisodes = 1\ntemplate = \"\"\nsteps = 1", "phase[0].template"),
            (
                "[[phase]]\nat_s = 0\nepisodes = 1\ntemplate = \"b\"\nsteps = 1\ncmd = \"x\"\ncmds = [\"y\"]",
                "phase[0]: set `cmd` or `cmds`",
            ),
            ("[background]\nrate_per_s = 0\nuntil_s = 1\ntemplate = \"b\"\nsteps = 1", "background.rate_per_s"),
            ("[background]\nrate_per_s = 1\nfrom_s = 5\nuntil_s = 1\ntemplate = \"b\"\nsteps = 1", "until_s"),
            ("url = \"localhost:8080\"\n[[phase]]\nat_s = 0\nepisodes = 1\ntemplate = \"b\"\nsteps = 1", "url"),
            ("seed = 1", "needs at least one"),
            ("bogus = 1", "bogus"),
        ];
        for (text, want) in cases {
            let e = format!("{:#}", Scenario::parse(text, "x").unwrap_err());
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn schedule_is_deterministic_for_a_seed() {
        let s = Scenario::parse(EXAMPLE, "x").unwrap();
        let a = schedule(&s, 42);
        assert_eq!(a, schedule(&s, 42));
        assert_ne!(a, schedule(&s, 43));
    }

    #[test]
    fn schedule_respects_bursts_steps_and_think_times() {
        let s = Scenario::parse(EXAMPLE, "x").unwrap();
        let plan = schedule(&s, s.seed);
        assert!(plan.windows(2).all(|w| w[0].start <= w[1].start), "sorted by start");
        assert!(plan.iter().enumerate().all(|(i, e)| e.id == i));
        let burst0: Vec<_> = plan.iter().filter(|e| e.source == Source::Phase(0)).collect();
        let burst1: Vec<_> = plan.iter().filter(|e| e.source == Source::Phase(1)).collect();
        assert_eq!((burst0.len(), burst1.len()), (8, 2));
        for e in &burst0 {
            assert!(e.start < Duration::from_secs(1));
            assert_eq!(e.template, "busybox");
            assert_eq!(e.steps.len(), 5);
            assert_eq!(e.steps[0].think, Duration::ZERO, "first command right after create");
            for st in &e.steps[1..] {
                assert!((Duration::from_millis(100)..=Duration::from_millis(300)).contains(&st.think));
            }
            // Commands cycle.
            assert_eq!(e.steps[2].cmd, e.steps[0].cmd);
            assert_eq!(e.steps[3].cmd, e.steps[1].cmd);
        }
        for e in &burst1 {
            assert!(e.start >= Duration::from_secs(20) && e.start < Duration::from_millis(20_500));
            assert!(e.steps[1..].iter().all(|st| st.think == Duration::from_millis(50)));
        }
        let bg: Vec<_> = plan.iter().filter(|e| e.source == Source::Background).collect();
        assert!(bg.iter().all(|e| e.start < Duration::from_secs(10)));
        // 2/s for 10 s: 20 expected; a Poisson count this far off would be a bug.
        assert!((5..=40).contains(&bg.len()), "{}", bg.len());
    }

    #[test]
    fn poisson_rate_is_about_right() {
        let text = "[background]\nrate_per_s = 50\nuntil_s = 200\ntemplate = \"b\"\nsteps = 0";
        let s = Scenario::parse(text, "x").unwrap();
        let n = schedule(&s, 3).len() as f64;
        assert!((n - 10_000.0).abs() < 500.0, "{n}");
    }
}

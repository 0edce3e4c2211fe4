//! The open-loop runner: starts every episode of a schedule at its intended time whatever the
//! target is doing, runs many episodes at once, times each request from its intended send
//! time, and the `sandpool-load` driver around it (sandpool run, Docker baseline, compare).
//!
//! Intended send times: an episode's create is due at its scheduled start; its first exec as
//! soon as the create is answered; every later exec `think` after the previous answer (an
//! episode is a chain: the model needs the answer before its next command); the delete right
//! after the last answer. A request that waits for a concurrency permit or a late timer is
//! sent late, and that wait is part of its latency and counted as a late send.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::record::{EpisodeLog, Failure, OpLog, Recorder, Report, Timing};
use crate::scenario::{EpisodePlan, Scenario, schedule};
use crate::target::{DockerCli, Sandpool, Target, remove_run_containers};

/// Lead time between building the run and its first intended send, so that setup work does
/// not make the first requests late.
pub const LEAD: Duration = Duration::from_millis(200);
/// How often a running load prints progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// How one schedule is driven.
#[derive(Debug, Clone)]
pub struct RunOpts {
    /// Requests in flight at most; beyond it requests wait (and are counted late).
    pub max_in_flight: usize,
    pub create_deadline: Duration,
    pub deadline: Duration,
    pub late: Duration,
    /// Print progress lines to stderr.
    pub progress: bool,
}

struct Ctx<T> {
    target: T,
    opts: RunOpts,
    permits: Semaphore,
    recorder: Mutex<Recorder>,
    in_flight: AtomicUsize,
    cancel: CancellationToken,
}

/// Send one request at (or, when held up, after) `intended` and time it.
async fn timed<T, F>(permits: &Semaphore, intended: Instant, deadline: Duration, call: F) -> OpLog<T>
where
    F: Future<Output = Result<T, Failure>>,
{
    // The semaphore is never closed; a closed one would only mean "no cap".
    let _permit = permits.acquire().await.ok();
    let sent = Instant::now();
    let result = match tokio::time::timeout(deadline, call).await {
        Ok(r) => r,
        Err(_) => Err(Failure::Timeout),
    };
    OpLog { timing: Timing { intended, sent, done: Instant::now() }, result }
}

async fn episode<T: Target>(ctx: Arc<Ctx<T>>, plan: EpisodePlan, intended: Instant) {
    let mut log = EpisodeLog::default();
    let c = timed(&ctx.permits, intended, ctx.opts.create_deadline, ctx.target.create(&plan.template)).await;
    let mut prev_done = c.timing.done;
    let handle = c.result.as_ref().ok().map(|c| c.handle.clone());
    log.create = Some(OpLog { timing: c.timing, result: c.result.map(|c| c.start) });
    if let Some(handle) = handle {
        for step in &plan.steps {
            let due = prev_done + step.think;
            tokio::select! {
                biased;
                _ = ctx.cancel.cancelled() => { log.cancelled = true; break; }
                _ = tokio::time::sleep_until(due) => {}
            }
            let e = timed(&ctx.permits, due, ctx.opts.deadline, ctx.target.exec(&handle, &step.cmd)).await;
            prev_done = e.timing.done;
            let ok = e.result.is_ok();
            log.execs.push(e);
            if !ok {
                break;
            }
        }
        // Always end the session, even when stopped or after a failed step.
        log.delete = Some(timed(&ctx.permits, prev_done, ctx.opts.deadline, ctx.target.delete(&handle)).await);
    }
    ctx.in_flight.fetch_sub(1, Ordering::Relaxed);
    // Poisoning needs a panic while recording, which holds no invariant we rely on.
    let mut rec = ctx.recorder.lock().unwrap_or_else(|p| p.into_inner());
    rec.record(&log);
}

/// Drive `plan` against `target`, open loop, until done or `cancel`led (then episodes not yet
/// started are skipped and started ones end their session). `name` labels the report.
pub async fn run_schedule<T: Target>(
    name: &str,
    target: T,
    plan: &[EpisodePlan],
    opts: RunOpts,
    cancel: CancellationToken,
) -> Report {
    let ctx = Arc::new(Ctx {
        target,
        permits: Semaphore::new(opts.max_in_flight.max(1)),
        recorder: Mutex::new(Recorder::new(opts.late)),
        in_flight: AtomicUsize::new(0),
        cancel: cancel.clone(),
        opts,
    });
    let tracker = TaskTracker::new();
    let t0 = Instant::now() + LEAD;
    let mut next_progress = Instant::now() + PROGRESS_EVERY;
    for (i, ep) in plan.iter().enumerate() {
        let at = t0 + ep.start;
        loop {
            if ctx.opts.progress && Instant::now() >= next_progress {
                next_progress += PROGRESS_EVERY;
                eprintln!(
                    "[{name}] t={:.0}s: {i}/{} episodes started, {} in flight",
                    t0.elapsed().as_secs_f64(),
                    plan.len(),
                    ctx.in_flight.load(Ordering::Relaxed)
                );
            }
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep_until(if ctx.opts.progress { at.min(next_progress) } else { at }) => {}
            }
            if Instant::now() >= at {
                break;
            }
        }
        if cancel.is_cancelled() {
            break;
        }
        ctx.in_flight.fetch_add(1, Ordering::Relaxed);
        tracker.spawn(episode(ctx.clone(), ep.clone(), at));
    }
    tracker.close();
    if ctx.opts.progress && !tracker.is_empty() {
        let what = if cancel.is_cancelled() { "stopped starting episodes" } else { "all episodes started" };
        eprintln!("[{name}] {what}; waiting for {} in flight", tracker.len());
    }
    tracker.wait().await;
    let wall = t0.elapsed();
    let rec = ctx.recorder.lock().unwrap_or_else(|p| p.into_inner());
    rec.report(name, plan.len(), wall)
}

// ---------------------------------------------------------------------------------------------
// The driver of the `sandpool-load` binary

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Against sandpool only.
    Sandpool,
    /// The plain-Docker baseline only.
    Docker,
    /// sandpool, then the baseline on the same schedule, then the ratios.
    Compare,
}

/// A validated `sandpool-load` invocation.
#[derive(Debug, Clone)]
pub struct Config {
    pub scenario: Scenario,
    pub mode: Mode,
    pub url: Option<String>,
    pub token: Option<String>,
    pub seed: u64,
    pub json: Option<PathBuf>,
    pub max_in_flight: usize,
    pub docker_max_in_flight: usize,
    /// Pause between the sandpool run and the baseline, so pool refills and destroys of the
    /// first run do not load the machine during the second.
    pub settle: Duration,
    /// Labels baseline containers; the driver removes them by it at the end.
    pub run_id: String,
}

/// What `--json` writes.
#[derive(Debug, Clone, Serialize)]
pub struct Output {
    pub scenario: String,
    pub seed: u64,
    pub episodes: usize,
    pub sandpool: Option<Report>,
    pub docker: Option<Report>,
    pub comparison: Option<Vec<crate::record::Ratio>>,
}

fn opts(s: &Scenario, max_in_flight: usize) -> RunOpts {
    RunOpts { max_in_flight, create_deadline: s.create_deadline, deadline: s.deadline, late: s.late, progress: true }
}

async fn run_sandpool(cfg: &Config, plan: &[EpisodePlan], cancel: &CancellationToken) -> anyhow::Result<Report> {
    let s = &cfg.scenario;
    let url =
        cfg.url.clone().or_else(|| s.url.clone()).context("no target URL: pass --url or set `url` in the scenario")?;
    let token = cfg
        .token
        .clone()
        .or_else(|| s.token.clone())
        .context("no token: pass --token, set SANDPOOL_TOKEN or set `token` in the scenario")?;
    let labels = BTreeMap::from([("loadtest".to_string(), s.name.chars().take(256).collect())]);
    let target = Sandpool::new(&url, &token, labels)?;
    target.preflight(&s.used_templates()).await.context("check the target")?;
    eprintln!("[sandpool] {} episodes against {url}", plan.len());
    Ok(run_schedule("sandpool", target, plan, opts(s, cfg.max_in_flight), cancel.clone()).await)
}

async fn run_docker(cfg: &Config, plan: &[EpisodePlan], cancel: &CancellationToken) -> anyhow::Result<Report> {
    let s = &cfg.scenario;
    let images = s.used_templates().into_iter().map(|t| (t.clone(), s.image_for(&t).to_string())).collect();
    let target = DockerCli::new(&cfg.run_id, images);
    target.preflight().await.context("check docker")?;
    eprintln!("[docker] {} episodes with the docker CLI (run id {})", plan.len(), cfg.run_id);
    let report = run_schedule("docker", target, plan, opts(s, cfg.docker_max_in_flight), cancel.clone()).await;
    Ok(report)
}

/// Run what `cfg` asks, print the summaries (stdout) and write the JSON. Baseline containers
/// are removed before returning, whether the run succeeded, failed or was cancelled.
pub async fn run(cfg: Config, cancel: CancellationToken) -> anyhow::Result<Output> {
    let plan = schedule(&cfg.scenario, cfg.seed);
    let mut out = Output {
        scenario: cfg.scenario.name.clone(),
        seed: cfg.seed,
        episodes: plan.len(),
        sandpool: None,
        docker: None,
        comparison: None,
    };
    if matches!(cfg.mode, Mode::Sandpool | Mode::Compare) {
        let r = run_sandpool(&cfg, &plan, &cancel).await?;
        println!("{}", r.render());
        out.sandpool = Some(r);
    }
    if cfg.mode == Mode::Compare && !cancel.is_cancelled() {
        eprintln!("[compare] settling {:.0} s before the baseline", cfg.settle.as_secs_f64());
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = tokio::time::sleep(cfg.settle) => {}
        }
    }
    if matches!(cfg.mode, Mode::Docker | Mode::Compare) && !cancel.is_cancelled() {
        let r = run_docker(&cfg, &plan, &cancel).await;
        // Clean up whatever happened above.
        match remove_run_containers(&cfg.run_id).await {
            Ok(0) => {}
            Ok(n) => eprintln!("[docker] removed {n} leftover baseline containers"),
            Err(e) => eprintln!("[docker] cleanup by label {}={}: {e:#}", crate::target::RUN_LABEL, cfg.run_id),
        }
        let r = r?;
        println!("{}", r.render());
        out.docker = Some(r);
    }
    if let (Some(a), Some(b)) = (&out.sandpool, &out.docker) {
        let rows = crate::record::compare(a, b);
        println!("{}", crate::record::render_ratios(&rows));
        out.comparison = Some(rows);
    }
    if let Some(path) = &cfg.json {
        let text = serde_json::to_string_pretty(&out).context("serialize the report")?;
        std::fs::write(path, text).with_context(|| format!("write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Metric, StartKind};
    use crate::target::Created;
    use wire::Cmd;

    /// A target whose calls take fixed (virtual) times.
    struct Fake {
        create: Duration,
        exec: Duration,
        delete: Duration,
        warm_left: AtomicUsize,
    }

    impl Target for Fake {
        async fn create(&self, _template: &str) -> Result<Created, Failure> {
            tokio::time::sleep(self.create).await;
            let warm = self.warm_left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok();
            Ok(Created { handle: "h".into(), start: if warm { StartKind::Warm } else { StartKind::Cold } })
        }
        async fn exec(&self, _handle: &str, cmd: &Cmd) -> Result<i32, Failure> {
            tokio::time::sleep(self.exec).await;
            match cmd {
                Cmd::Shell(s) if s == "fail" => {
                    Err(Failure::Status { code: 502, retry_after: false, message: "boom".into() })
                }
                _ => Ok(0),
            }
        }
        async fn delete(&self, _handle: &str) -> Result<(), Failure> {
            tokio::time::sleep(self.delete).await;
            Ok(())
        }
    }

    fn fake(create: u64, exec: u64, warm: usize) -> Fake {
        Fake {
            create: Duration::from_millis(create),
            exec: Duration::from_millis(exec),
            delete: Duration::from_millis(1),
            warm_left: AtomicUsize::new(warm),
        }
    }

    fn opts(max_in_flight: usize) -> RunOpts {
        RunOpts {
            max_in_flight,
            create_deadline: Duration::from_secs(10),
            deadline: Duration::from_secs(10),
            late: Duration::from_millis(5),
            progress: false,
        }
    }

    fn plan(text: &str) -> Vec<EpisodePlan> {
        let s = Scenario::parse(text, "t").unwrap();
        schedule(&s, s.seed)
    }

    fn near_ms(got: f64, want: f64) -> bool {
        (got - want).abs() <= want * 0.002 + 0.05
    }

    #[tokio::test(start_paused = true)]
    async fn queueing_in_the_generator_counts_as_latency() {
        // Four creates due at t=0, one request at a time, 10 ms each: a closed-loop tool would
        // report 10 ms four times; the caller actually waited 10, 20, 30 and 40 ms.
        let p = plan("[[phase]]\nat_s = 0\nspread_s = 0\nepisodes = 4\ntemplate = \"b\"\nsteps = 0");
        let r = run_schedule("fake", fake(10, 1, 4), &p, opts(1), CancellationToken::new()).await;
        let c = r.get(Metric::Create);
        assert_eq!(c.n, 4);
        assert!(near_ms(c.max_ms, 40.0), "{c:?}");
        assert!(near_ms(c.mean_ms, 25.0), "{c:?}");
        assert!(near_ms(c.p50_ms, 20.0), "{c:?}");
        assert_eq!(r.late_sends, 3 + 3, "three creates and the three deletes queued behind them");
        assert_eq!(r.episodes.started, 4);
        assert_eq!(r.warm_pct, Some(100.0));
    }

    #[tokio::test(start_paused = true)]
    async fn steps_are_due_think_time_after_the_previous_answer() {
        let p = plan("[[phase]]\nat_s = 0\nspread_s = 0.5\nepisodes = 10\ntemplate = \"b\"\nsteps = 4\nthink_ms = 100");
        let r = run_schedule("fake", fake(3, 2, 6), &p, opts(1000), CancellationToken::new()).await;
        assert_eq!(r.late_sends, 0);
        let exec = r.get(Metric::Exec);
        assert_eq!(exec.n, 40);
        assert!(near_ms(exec.max_ms, 2.0), "think time is not latency: {exec:?}");
        let first = r.get(Metric::FirstCommand);
        assert_eq!(first.n, 10);
        // 3 + 2 ms, plus under 1 ms per sleep for the timer's millisecond ticks.
        assert!(first.p50_ms >= 5.0 && first.max_ms < 7.0, "{first:?}");
        assert_eq!((r.creates_warm, r.creates_cold), (6, 4));
        let cold = r.get(Metric::CreateCold);
        assert!(cold.p50_ms >= 3.0 && cold.max_ms < 4.0, "{cold:?}");
        // 0.5 s spread + 3 ms + 4 × 2 ms + 3 × 100 ms + 1 ms, after the lead.
        assert!(r.wall_s < 0.82, "{}", r.wall_s);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_step_ends_the_episode_but_the_session_is_deleted() {
        let p = plan("[[phase]]\nat_s = 0\nepisodes = 2\ntemplate = \"b\"\nsteps = 4\ncmds = [[\"true\"], \"fail\"]");
        let r = run_schedule("fake", fake(1, 1, 2), &p, opts(100), CancellationToken::new()).await;
        assert_eq!(r.episodes.failed, 2);
        assert_eq!(r.get(Metric::Exec).n, 2, "one good step each, then the failure");
        assert_eq!(r.get(Metric::Delete).n, 2);
        assert_eq!(r.errors.len(), 1);
        assert_eq!((r.errors[0].op.as_str(), r.errors[0].kind.as_str(), r.errors[0].count), ("exec", "http 502", 2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_is_a_failure_not_a_hang() {
        let p = plan("[[phase]]\nat_s = 0\nspread_s = 0\nepisodes = 1\ntemplate = \"b\"\nsteps = 1");
        let mut o = opts(10);
        o.create_deadline = Duration::from_millis(50);
        let r = run_schedule("fake", fake(10_000, 1, 0), &p, o, CancellationToken::new()).await;
        assert_eq!(r.errors[0].kind, "deadline");
        assert_eq!(r.episodes.failed, 1);
        assert!(r.wall_s < 1.0);
    }

    #[tokio::test(start_paused = true)]
    async fn cancel_skips_unstarted_episodes_and_ends_started_ones() {
        let p = plan(
            "[[phase]]\nat_s = 0\nspread_s = 0\nepisodes = 3\ntemplate = \"b\"\nsteps = 5\nthink_ms = 1000\n\
             [[phase]]\nat_s = 100\nepisodes = 3\ntemplate = \"b\"\nsteps = 1",
        );
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        let run = run_schedule("fake", fake(1, 1, 3), &p, opts(100), cancel);
        let (r, ()) = tokio::join!(run, async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            stop.cancel();
        });
        assert_eq!((r.episodes.planned, r.episodes.started, r.episodes.cancelled), (6, 3, 3));
        assert_eq!(r.get(Metric::Exec).n, 3 * 2);
        assert_eq!(r.get(Metric::Delete).n, 3);
        assert!(r.wall_s < 3.0);
    }
}

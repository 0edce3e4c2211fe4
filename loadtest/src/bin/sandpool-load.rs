//! sandpool-load: an open-loop generator of RL-shaped load (bursts of episodes, each a session
//! with exec steps and think time) for a live sandpool stack, with a plain-Docker baseline.
//!
//!     sandpool-load --scenario loadtest/scenarios/smoke.toml --url http://127.0.0.1:8080 --token $TOKEN
//!     sandpool-load --scenario loadtest/scenarios/smoke.toml --compare --json /tmp/smoke.json
//!     sandpool-load --scenario loadtest/scenarios/smoke.toml --baseline docker
//!
//! Latency is measured from each request's intended send time (no coordinated omission).
//! Ctrl-C stops starting episodes, lets started ones end their sessions, removes the baseline's
//! containers and still prints the summary; a second Ctrl-C removes the containers and exits.

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use loadtest::load::{self, Config, Mode};
use loadtest::scenario::{Scenario, schedule};
use loadtest::target::remove_run_containers;
use tokio_util::sync::CancellationToken;

/// Requests in flight at most against sandpool: generous, so the generator is not the limit.
const DEFAULT_MAX_IN_FLIGHT: usize = 4096;
/// Docker CLI calls in flight at most in baseline mode: each is a process of ~30 MB on a
/// 2-core machine; waits beyond it count as late sends and as latency, as they should.
const DEFAULT_DOCKER_MAX_IN_FLIGHT: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Baseline {
    Docker,
}

#[derive(Debug, Parser)]
#[command(about = "Open-loop RL-shaped load for sandpool, beside a plain-Docker baseline")]
struct Args {
    /// Scenario file (TOML); see loadtest/scenarios/smoke.toml.
    #[arg(long)]
    scenario: PathBuf,
    /// Gateway base URL (overrides the scenario's `url`).
    #[arg(long)]
    url: Option<String>,
    /// Bearer token (overrides the scenario's `token`).
    #[arg(long, env = "SANDPOOL_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Seed of the schedule (overrides the scenario's `seed`).
    #[arg(long)]
    seed: Option<u64>,
    /// Run only the naive baseline instead of sandpool.
    #[arg(long, value_enum, conflicts_with = "compare")]
    baseline: Option<Baseline>,
    /// Run sandpool, then the Docker baseline on the same schedule, and print the ratios.
    #[arg(long)]
    compare: bool,
    /// Write the reports as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Requests in flight at most against sandpool.
    #[arg(long, default_value_t = DEFAULT_MAX_IN_FLIGHT)]
    max_in_flight: usize,
    /// Docker CLI calls in flight at most in the baseline.
    #[arg(long, default_value_t = DEFAULT_DOCKER_MAX_IN_FLIGHT)]
    docker_max_in_flight: usize,
    /// Seconds to wait between the sandpool run and the baseline with --compare.
    #[arg(long, default_value_t = 10.0)]
    settle_s: f64,
    /// Print the schedule's shape and exit.
    #[arg(long)]
    dry_run: bool,
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn config(args: Args) -> anyhow::Result<Config> {
    let scenario = Scenario::load(&args.scenario)?;
    anyhow::ensure!(args.max_in_flight >= 1, "--max-in-flight: must be >= 1");
    anyhow::ensure!(args.docker_max_in_flight >= 1, "--docker-max-in-flight: must be >= 1");
    anyhow::ensure!(
        args.settle_s.is_finite() && (0.0..=3600.0).contains(&args.settle_s),
        "--settle-s: must be in [0, 3600]"
    );
    if let Some(url) = &args.url {
        anyhow::ensure!(url.starts_with("http://") || url.starts_with("https://"), "--url: must be http(s)://…");
    }
    let mode = match (args.compare, args.baseline) {
        (true, _) => Mode::Compare,
        (false, Some(Baseline::Docker)) => Mode::Docker,
        (false, None) => Mode::Sandpool,
    };
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    Ok(Config {
        seed: args.seed.unwrap_or(scenario.seed),
        scenario,
        mode,
        url: args.url,
        token: args.token,
        json: args.json,
        max_in_flight: args.max_in_flight,
        docker_max_in_flight: args.docker_max_in_flight,
        settle: Duration::from_secs_f64(args.settle_s),
        run_id: format!("{}-{:x}", std::process::id(), nanos & 0xffff_ffff),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dry_run = args.dry_run;
    let cfg = config(args).context("configure sandpool-load")?;
    if dry_run {
        let plan = schedule(&cfg.scenario, cfg.seed);
        let steps: usize = plan.iter().map(|e| e.steps.len()).sum();
        let last = plan.last().map(|e| e.start.as_secs_f64()).unwrap_or(0.0);
        println!(
            "scenario {:?}, seed {}: {} episodes, {steps} exec steps, last start at {last:.2} s",
            cfg.scenario.name,
            cfg.seed,
            plan.len()
        );
        return Ok(());
    }

    let cancel = CancellationToken::new();
    let run_id = cfg.run_id.clone();
    let baseline = cfg.mode != Mode::Sandpool;
    let run = load::run(cfg, cancel.clone());
    tokio::pin!(run);
    let result = tokio::select! {
        r = &mut run => r,
        _ = shutdown_signal() => {
            eprintln!("stopping: no new episodes; started ones end their sessions (Ctrl-C again to quit now)");
            cancel.cancel();
            tokio::select! {
                r = &mut run => r,
                _ = shutdown_signal() => {
                    if baseline {
                        match remove_run_containers(&run_id).await {
                            Ok(n) => eprintln!("removed {n} baseline containers"),
                            Err(e) => eprintln!("remove baseline containers (label sandpool.loadtest.run={run_id}): {e:#}"),
                        }
                    }
                    std::process::exit(130);
                }
            }
        }
    };
    result.map(|_| ())
}

//! `sandpool-sim`: replay a trace against every autoscaler policy and the oracle; print a markdown table or JSON.

use anyhow::{Context, bail};
use autoscaler::sim::bench::{self, TraceKind};
use autoscaler::sim::trace::{self, LongtailSpec, PullTimes};
use autoscaler::sim::{NodeSpec, SimConfig};
use clap::Parser;
use serde::Serialize;

/// Compare autoscaler policies on a simulated trace.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Trace: periodic (RL bursts), poisson (background) or longtail (image mix).
    #[arg(long, default_value = "periodic")]
    trace: String,
    /// Seed of the trace; with --runs N, seeds seed..seed+N.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Runs over consecutive seeds; the table shows per-column medians.
    #[arg(long, default_value_t = 1)]
    runs: u64,
    /// Nodes in the cluster.
    #[arg(long, default_value_t = autoscaler::sim::NODES)]
    nodes: usize,
    /// Most sandboxes per node.
    #[arg(long, default_value_t = autoscaler::sim::NODE_MAX_SANDBOXES)]
    capacity: u32,
    /// Creates per second per node.
    #[arg(long, default_value_t = autoscaler::sim::CREATE_RATE_PER_S)]
    create_rate: f64,
    /// Create latency, ms.
    #[arg(long, default_value_t = autoscaler::sim::CREATE_LATENCY_MS)]
    create_latency_ms: u64,
    /// Long-tail images' pull times: local (small corpus images from the local registry, measured: p50 250 ms,
    /// p99 360 ms), swe (1 GB median, 3 GB p99 at 100 MB/s per node: 10 s / 30 s) or none (not modelled).
    #[arg(long, default_value = "local")]
    pulls: String,
    /// Pull time median, ms (with --pull-p99-ms, instead of --pulls' distribution).
    #[arg(long, requires = "pull_p99_ms")]
    pull_p50_ms: Option<f64>,
    /// Pull time 99th percentile, ms.
    #[arg(long, requires = "pull_p50_ms")]
    pull_p99_ms: Option<f64>,
    /// Pulls one node runs at once (they share it).
    #[arg(long, default_value_t = autoscaler::sim::MAX_PULLS_IN_FLIGHT)]
    max_pulls: usize,
    /// Long-tail trainer step, seconds (its arrivals declared a step ahead); 0: nothing declared.
    #[arg(long, default_value_t = trace::LONGTAIL_STEP_S)]
    step_s: u64,
    /// Leave image templates' idle targets where the policy puts them (each node pulls what lands on it)
    /// instead of moving them onto a node that holds the image.
    #[arg(long)]
    spread_images: bool,
    /// Print JSON instead of a markdown table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Output<'a> {
    trace: &'a str,
    seeds: Vec<u64>,
    config: &'a SimConfig,
    /// The long-tail trace's parameters (images, steps), on that trace.
    #[serde(skip_serializing_if = "Option::is_none")]
    longtail: Option<&'a LongtailSpec>,
    rows: Vec<autoscaler::sim::RunReport>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let kind = match args.trace.as_str() {
        "periodic" => TraceKind::Periodic,
        "poisson" => TraceKind::Poisson,
        "longtail" => TraceKind::Longtail,
        other => bail!("--trace: unknown trace {other:?} (periodic, poisson, longtail)"),
    };
    if args.nodes == 0 || args.runs == 0 || args.create_rate.is_nan() || args.create_rate <= 0.0 {
        bail!("--nodes, --runs and --create-rate must be positive");
    }
    if args.max_pulls == 0 {
        bail!("--max-pulls must be positive");
    }
    let pulls = match (args.pulls.as_str(), args.pull_p50_ms, args.pull_p99_ms) {
        (_, Some(p50_ms), Some(p99_ms)) if p50_ms >= 0.0 && p99_ms >= p50_ms => Some(PullTimes { p50_ms, p99_ms }),
        (_, Some(_), Some(_)) => bail!("--pull-p50-ms and --pull-p99-ms: need 0 <= p50 <= p99"),
        ("local", ..) => Some(PullTimes::local()),
        ("swe", ..) => Some(PullTimes::swe()),
        ("none", ..) => None,
        (other, ..) => bail!("--pulls: unknown setting {other:?} (local, swe, none)"),
    };
    let longtail = LongtailSpec { pulls, step_s: args.step_s, ..LongtailSpec::default() };
    let node = NodeSpec {
        max_sandboxes: args.capacity,
        create_rate_per_s: args.create_rate,
        create_burst: args.create_rate.max(1.0),
        create_latency_ms: args.create_latency_ms,
        max_pulls_in_flight: args.max_pulls,
        ..NodeSpec::default()
    };
    let cfg = SimConfig { place_by_image: !args.spread_images, ..SimConfig::with_nodes(args.nodes, node) };
    let seeds: Vec<u64> = (args.seed..args.seed + args.runs).collect();
    let rows = bench::rows_for(kind);
    let generate = |seed: u64| match kind {
        TraceKind::Longtail => trace::longtail(seed, &longtail),
        other => other.generate(seed),
    };
    let suites: Vec<_> = seeds.iter().map(|s| bench::run_rows(&cfg, &generate(*s), &rows)).collect();
    let rows = bench::medians(&suites);
    if args.json {
        let longtail = (kind == TraceKind::Longtail).then_some(&longtail);
        let out = Output { trace: &args.trace, seeds, config: &cfg, longtail, rows };
        println!("{}", serde_json::to_string_pretty(&out).context("encode the report")?);
    } else {
        let seeds = seeds.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
        let what = if args.runs > 1 { "medians over seeds" } else { "seed" };
        let images = match (kind, pulls) {
            (TraceKind::Longtail, Some(p)) => format!(
                ", image pulls p50 {:.0} ms / p99 {:.0} ms (≤ {} in flight per node), steps of {} s declared",
                p.p50_ms, p.p99_ms, args.max_pulls, args.step_s
            ),
            (TraceKind::Longtail, None) => format!(", images not modelled, steps of {} s declared", args.step_s),
            _ => String::new(),
        };
        println!("trace `{}`, {what} {seeds}, {} node(s){images}\n", args.trace, args.nodes);
        print!("{}", bench::markdown(&rows));
    }
    Ok(())
}

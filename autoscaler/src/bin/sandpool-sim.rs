//! `sandpool-sim`: replay a trace against every autoscaler policy and the oracle; print a markdown table or JSON.

use anyhow::{Context, bail};
use autoscaler::sim::bench::{self, TraceKind};
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
    /// Print JSON instead of a markdown table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Output<'a> {
    trace: &'a str,
    seeds: Vec<u64>,
    config: &'a SimConfig,
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
    let node = NodeSpec {
        max_sandboxes: args.capacity,
        create_rate_per_s: args.create_rate,
        create_burst: args.create_rate.max(1.0),
        create_latency_ms: args.create_latency_ms,
        ..NodeSpec::default()
    };
    let cfg = SimConfig::with_nodes(args.nodes, node);
    let seeds: Vec<u64> = (args.seed..args.seed + args.runs).collect();
    let entries = bench::standard_entries();
    let suites: Vec<_> = seeds.iter().map(|s| bench::run_suite(&cfg, &kind.generate(*s), &entries)).collect();
    let rows = bench::medians(&suites);
    if args.json {
        let out = Output { trace: &args.trace, seeds, config: &cfg, rows };
        println!("{}", serde_json::to_string_pretty(&out).context("encode the report")?);
    } else {
        let seeds = seeds.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
        let what = if args.runs > 1 { "medians over seeds" } else { "seed" };
        println!("trace `{}`, {what} {seeds}, {} node(s)\n", args.trace, args.nodes);
        print!("{}", bench::markdown(&rows));
    }
    Ok(())
}

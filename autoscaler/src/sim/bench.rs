//! The benchmark suite: every policy (and the oracle) on one trace, medians over seeds, and the table.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::trace::{self, Trace};
use super::{Declare, RunReport, SimConfig, oracle, simulate_declaring};
use crate::policy::{
    Combined, Fixed, LearnedBursts, LearnedConfig, OpenWhiskPrewarm, Policy, Reactive, ReactiveConfig, Reservations,
};

/// The traces the simulator knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceKind {
    /// 1,000 episodes every 5 minutes ([`trace::PeriodicSpec::default`]).
    Periodic,
    /// 2 requests/s ([`trace::PoissonSpec::default`]).
    Poisson,
    /// Many templates, about 3 sandboxes each, each made from an image of its own, declared step by step
    /// ([`trace::LongtailSpec::default`]).
    Longtail,
}

impl TraceKind {
    /// The trace of this kind for `seed`, with default parameters.
    pub fn generate(self, seed: u64) -> Trace {
        match self {
            Self::Periodic => trace::periodic(seed, &trace::PeriodicSpec::default()),
            Self::Poisson => trace::poisson(seed, &trace::PoissonSpec::default()),
            Self::Longtail => trace::longtail(seed, &trace::LongtailSpec::default()),
        }
    }
}

/// One row of the suite: a label, a fresh policy, and whether the trace's reservations are declared.
pub struct Entry {
    /// Row label.
    pub label: &'static str,
    /// Builds the policy (fresh state per run).
    pub make: fn() -> Box<dyn Policy>,
    /// Show the trace's declared reservations to the policy.
    pub declare: bool,
}

/// A row of a suite that says what the trainer's declarations do in it (an [`Entry`] says only whether
/// reservations are declared).
pub struct Row {
    /// Row label.
    pub label: &'static str,
    /// Builds the policy (fresh state per run).
    pub make: fn() -> Box<dyn Policy>,
    /// What the trace's declarations do.
    pub declare: Declare,
}

impl From<&Entry> for Row {
    fn from(e: &Entry) -> Self {
        Self { label: e.label, make: e.make, declare: if e.declare { Declare::Reservations } else { Declare::Nothing } }
    }
}

/// The rows of BENCHMARKS.md's table for a trace kind: the standard entries, and on the long-tail trace,
/// whose declarations are the trainer's steps, also combined with only the steps' images prefetched.
pub fn rows_for(kind: TraceKind) -> Vec<Row> {
    let mut rows: Vec<Row> = standard_entries().iter().map(Row::from).collect();
    if kind == TraceKind::Longtail {
        for r in &mut rows {
            r.label = match r.label {
                "reservations only" => "declared steps only",
                "combined + reservations" => "combined + declared steps",
                other => other,
            };
        }
        let at = rows.len() - 1;
        rows.insert(
            at,
            Row {
                label: "combined + image prefetch",
                make: || Box::new(Combined::default()),
                declare: Declare::Prefetch,
            },
        );
    }
    rows
}

/// The policies compared in BENCHMARKS.md, in table order.
pub fn standard_entries() -> Vec<Entry> {
    vec![
        Entry { label: "fixed pool 100", make: || Box::new(Fixed(100)), declare: false },
        Entry { label: "fixed pool 1000", make: || Box::new(Fixed(1_000)), declare: false },
        Entry {
            label: "reactive (KPA-like)",
            make: || Box::new(Reactive::new(ReactiveConfig::knative())),
            declare: false,
        },
        Entry { label: "openwhisk prewarm", make: || Box::new(OpenWhiskPrewarm::default()), declare: false },
        Entry {
            label: "learned bursts",
            make: || Box::new(LearnedBursts::new(LearnedConfig::default())),
            declare: false,
        },
        Entry { label: "reservations only", make: || Box::new(Reservations::default()), declare: true },
        Entry { label: "combined", make: || Box::new(Combined::default()), declare: false },
        Entry { label: "combined + reservations", make: || Box::new(Combined::default()), declare: true },
    ]
}

/// Run every entry and the oracle on `trace`; rows in table order, the oracle last, ratios filled in.
pub fn run_suite(cfg: &SimConfig, trace: &Trace, entries: &[Entry]) -> Vec<RunReport> {
    run_rows(cfg, trace, &entries.iter().map(Row::from).collect::<Vec<_>>())
}

/// [`run_suite`] for [`Row`]s.
pub fn run_rows(cfg: &SimConfig, trace: &Trace, rows: &[Row]) -> Vec<RunReport> {
    let floor = oracle(trace, &cfg.nodes);
    let mut rows: Vec<RunReport> = rows
        .iter()
        .map(|e| {
            let mut policy = (e.make)();
            let mut r = simulate_declaring(cfg, trace, policy.as_mut(), e.declare);
            r.policy = e.label.to_owned();
            r
        })
        .collect();
    rows.push(floor);
    let base = rows.last().map_or(0.0, |o| o.idle_sandbox_s);
    for r in &mut rows {
        r.idle_vs_oracle = (base > 0.0).then(|| r.idle_sandbox_s / base);
    }
    rows
}

/// Per-row, per-column medians over several suites of the same rows (e.g. one per seed).
pub fn medians(suites: &[Vec<RunReport>]) -> Vec<RunReport> {
    let Some(first) = suites.first() else { return Vec::new() };
    (0..first.len())
        .map(|i| {
            let col = |f: &dyn Fn(&RunReport) -> f64| -> f64 {
                let v: Vec<f64> = suites.iter().filter_map(|s| s.get(i)).map(f).collect();
                crate::policy::median(&v)
            };
            RunReport {
                policy: first[i].policy.clone(),
                arrivals: col(&|r| r.arrivals as f64) as u64,
                warm_pct: col(&|r| r.warm_pct),
                wait_p50_ms: col(&|r| r.wait_p50_ms as f64) as u64,
                wait_p99_ms: col(&|r| r.wait_p99_ms as f64) as u64,
                idle_sandbox_s: col(&|r| r.idle_sandbox_s),
                idle_vs_oracle: first[i].idle_vs_oracle.map(|_| col(&|r| r.idle_vs_oracle.unwrap_or(0.0))),
                peak_sandboxes: col(&|r| r.peak_sandboxes as f64) as u64,
                creates: col(&|r| r.creates as f64) as u64,
                unserved: col(&|r| r.unserved as f64) as u64,
                infeasible_reservations: col(&|r| r.infeasible_reservations as f64) as u64,
                pulls: col(&|r| r.pulls as f64) as u64,
                late_reservations: col(&|r| r.late_reservations as f64) as u64,
            }
        })
        .collect()
}

/// The suite as a markdown table (with image pulls and late declared reservations when anything pulled).
pub fn markdown(rows: &[RunReport]) -> String {
    let images = rows.iter().any(|r| r.pulls > 0);
    let mut s = String::from(
        "| policy | warm % | wait p50 | wait p99 | idle sandbox-s | × oracle | peak sandboxes | creates |",
    );
    s.push_str(if images { " pulls | late reservations |\n" } else { "\n" });
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|");
    s.push_str(if images { "---:|---:|\n" } else { "\n" });
    for r in rows {
        let ratio = match r.idle_vs_oracle {
            None => "n/a".to_owned(),
            Some(x) if x > 1_000.0 => "> 1000".to_owned(),
            Some(x) => format!("{x:.2}"),
        };
        let unserved = if r.unserved > 0 { format!(" ({} unserved)", r.unserved) } else { String::new() };
        let _ = write!(
            s,
            "| {} | {:.2} | {} | {}{} | {:.0} | {} | {} | {} |",
            r.policy,
            r.warm_pct,
            fmt_ms(r.wait_p50_ms),
            fmt_ms(r.wait_p99_ms),
            unserved,
            r.idle_sandbox_s,
            ratio,
            r.peak_sandboxes,
            r.creates
        );
        if images {
            let _ = write!(s, " {} | {} |", r.pulls, r.late_reservations);
        }
        s.push('\n');
    }
    s
}

fn fmt_ms(ms: u64) -> String {
    if ms == 0 {
        "0".into()
    } else if ms < 10_000 {
        format!("{ms} ms")
    } else {
        format!("{:.1} s", ms as f64 / 1_000.0)
    }
}

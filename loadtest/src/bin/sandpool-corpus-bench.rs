//! sandpool-corpus-bench: the image corpus, in one run.
//!
//! Pushes a corpus of `--images` small distinct images to the local registry (`scripts/corpus`;
//! kept between runs under `bench-corpus/`), makes a public template of each, and measures with
//! a whole stack in this process on the real Redis and Docker:
//! - the cold create with the template's image absent (pulled from the local registry) against
//!   the same create with it present, in pairs;
//! - a long-tail trace of `--per-image` sessions of every image (one image per task, as
//!   SWE-style benchmarks ship them), arriving in `--steps` training steps of
//!   `--step-s` seconds, each session opened, asked `cat /task/id`, kept `--hold-ms`, deleted;
//!   replayed (a) on demand (a node pulls an image when a session needs it) and (b) with a
//!   multi-template reservation of each step's templates declared one step ahead (the trainer
//!   knows its next tasks), which pulls their images and creates their sandboxes by the
//!   step's start. Reported: share of sessions warm, time to first command p50/p99 (from each
//!   session's intended start), errors.
//!
//! Before each part the corpus's local copies are removed, so every image starts absent.
//!
//!     cargo run --release -p loadtest --bin sandpool-corpus-bench -- --json corpus.json

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use loadtest::{Samples, Summary};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tests::corpus::Corpus;
use tests::{Client, Stack, StackOpts};

#[derive(Parser)]
struct Args {
    /// Distinct images (one task each).
    #[arg(long, default_value_t = 200)]
    images: usize,
    /// Sessions of each image in the trace.
    #[arg(long, default_value_t = 3)]
    per_image: usize,
    /// Training steps the trace's tasks are spread over.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Seconds of one step (its sessions arrive spread over it).
    #[arg(long, default_value_t = 30)]
    step_s: u64,
    /// How long each session is kept after its first command, ms.
    #[arg(long, default_value_t = 2000)]
    hold_ms: u64,
    /// Pairs of cold creates (image absent, then present).
    #[arg(long, default_value_t = 10)]
    colds: usize,
    /// KiB of each image's own layer.
    #[arg(long, default_value_t = 64)]
    layer_kb: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the results as JSON here too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// Removes every local copy of the corpus's images (they start absent).
fn forget_local(corpus: &Corpus) {
    for local in corpus.local() {
        let _ = std::process::Command::new("docker").args(["rmi", "-f", &local]).output();
    }
}

fn opts(autoscaler: bool) -> StackOpts {
    StackOpts {
        warm: 0,
        autoscaler,
        create_rate: 50.0,
        default_wait: "120s",
        // The whole corpus fits: this run measures pulls, not eviction.
        extra_toml: "[images]\ndisk_budget_mb = 0\n".into(),
        ..Default::default()
    }
}

/// Makes `public/task-NNNN` of every image of the corpus.
async fn templates(admin: &Client, corpus: &Corpus) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for (i, img) in corpus.images.iter().enumerate() {
        let name = format!("task-{i:04}");
        let a =
            admin.call(reqwest::Method::POST, "/v1/templates", Some(json!({"name": name, "image": img.image}))).await;
        anyhow::ensure!(a.status == 201, "make {name}: {:?}", a.body);
        names.push(format!("public/{name}"));
    }
    Ok(names)
}

/// One session: open (waiting as long as it takes), first command, hold, delete. Its time to
/// first command from `t0` and whether it started warm.
async fn episode(c: &Client, template: &str, t0: Instant, hold: Duration) -> anyhow::Result<(Duration, bool)> {
    let body = json!({"template": template, "max_wait_s": 120});
    let a = c.call(reqwest::Method::POST, "/v1/sessions", Some(body)).await;
    anyhow::ensure!(a.status == 201, "create {template}: {} {:?}", a.status, a.body);
    let sid = a.body["session_id"].as_str().unwrap_or_default().to_string();
    let warm = a.body["start"] == "warm";
    let e = c.exec(&sid, json!({"cmd": ["cat", "/task/id"]})).await;
    let ttfc = t0.elapsed();
    anyhow::ensure!(e.status == 200 && e.body["exit_code"] == 0, "first command: {:?}", e.body);
    tokio::time::sleep(hold).await;
    c.delete(&sid).await;
    Ok((ttfc, warm))
}

/// The cold create of a template with its image absent (a pull first) and present, in pairs.
async fn cold_creates(args: &Args, corpus: &Corpus) -> anyhow::Result<Value> {
    forget_local(corpus);
    let stack = Stack::start(opts(false)).await;
    let admin = stack.admin_client();
    let names = templates(&admin, corpus).await?;
    let c = stack.client("bench");
    let (mut absent, mut present) = (Samples::default(), Samples::default());
    for name in names.iter().take(args.colds) {
        for samples in [&mut absent, &mut present] {
            let t0 = Instant::now();
            let a =
                c.call(reqwest::Method::POST, "/v1/sessions", Some(json!({"template": name, "max_wait_s": 120}))).await;
            anyhow::ensure!(a.status == 201 && a.body["start"] == "cold", "cold create {name}: {:?}", a.body);
            samples.push(t0.elapsed());
            c.delete(a.body["session_id"].as_str().unwrap_or_default()).await;
        }
    }
    let (a, p) = (absent.summary(), present.summary());
    println!("cold create, image absent (pull + create): p50 {:.0} ms  p99 {:.0} ms  (n={})", a.p50_ms, a.p99_ms, a.n);
    println!("cold create, image present:                p50 {:.0} ms  p99 {:.0} ms  (n={})", p.p50_ms, p.p99_ms, p.n);
    println!("  ratio of p50s: {:.2}", a.p50_ms / p.p50_ms.max(0.001));
    stack.shutdown().await;
    Ok(json!({"absent": a, "present": p, "ratio_p50": a.p50_ms / p.p50_ms.max(0.001)}))
}

/// The trace: per step, its templates (each `per_image` times) at seeded random offsets.
fn trace(args: &Args, names: &[String]) -> Vec<Vec<(Duration, String)>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let mut order: Vec<&String> = names.iter().collect();
    order.shuffle(&mut rng);
    let per_step = order.len().div_ceil(args.steps.max(1));
    order
        .chunks(per_step.max(1))
        .map(|tasks| {
            let mut step: Vec<(Duration, String)> = tasks
                .iter()
                .flat_map(|t| std::iter::repeat_n((*t).clone(), args.per_image))
                .map(|t| (Duration::from_millis(rng.random_range(0..args.step_s * 1000)), t))
                .collect();
            step.sort();
            step
        })
        .collect()
}

#[derive(serde::Serialize)]
struct TraceResult {
    mode: &'static str,
    sessions: usize,
    warm_pct: f64,
    errors: usize,
    first_command: Summary,
    seconds: f64,
}

/// Replays the trace; with `reserve`, each step's templates are reserved one step ahead.
async fn replay(args: &Args, corpus: &Corpus, reserve: bool) -> anyhow::Result<TraceResult> {
    forget_local(corpus);
    let stack = Stack::start(opts(true)).await;
    let admin = stack.admin_client();
    let names = templates(&admin, corpus).await?;
    let steps = trace(args, &names);
    let c = Arc::new(stack.client("trainer"));
    let step = Duration::from_secs(args.step_s);
    let reserve_step = |k: usize, ready_in: Duration| {
        let c = c.clone();
        let mut counts: std::collections::BTreeMap<String, u64> = Default::default();
        for (_, t) in steps.get(k).into_iter().flatten() {
            *counts.entry(t.clone()).or_insert(0) += 1;
        }
        let items: Vec<Value> = counts.into_iter().map(|(t, n)| json!({"template": t, "count": n})).collect();
        let ready_by = humantime::format_rfc3339(std::time::SystemTime::now() + ready_in).to_string();
        let hold_s = args.step_s;
        async move {
            if items.is_empty() {
                return Ok(());
            }
            let body = json!({"items": items, "ready_by": ready_by, "hold_s": hold_s});
            let r = c.call(reqwest::Method::POST, "/v1/reservations", Some(body)).await;
            anyhow::ensure!(r.status == 201, "reserve step {k}: {:?}", r.body);
            if r.body["feasible"] != true {
                println!("  step {k}: not feasible by ready_by (earliest {})", r.body["earliest_ready_at"]);
            }
            Ok(())
        }
    };
    if reserve {
        // The first step is declared one step ahead too.
        reserve_step(0, step).await?;
        tokio::time::sleep(step).await;
    }
    let started = Instant::now();
    let hold = Duration::from_millis(args.hold_ms);
    let mut tasks = Vec::new();
    for (k, sessions) in steps.iter().enumerate() {
        let step_start = started + step * k as u32;
        tokio::time::sleep_until(step_start.into()).await;
        if reserve {
            reserve_step(k + 1, step).await?;
        }
        for (at, template) in sessions {
            let t0 = step_start + *at;
            let (c, template) = (c.clone(), template.clone());
            let offset = *at;
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(t0.into()).await;
                episode(&c, &template, t0, hold).await.map(|(d, warm)| (d, warm, offset))
            }));
        }
    }
    let (mut ttfc, mut warm, mut errors) = (Samples::default(), 0usize, 0usize);
    // Cold sessions by when in their step they came (tenths of the step): late readiness shows
    // at the start, pools retired early at the end.
    let mut cold_at = [0usize; 10];
    for t in tasks {
        match t.await? {
            Ok((d, w, offset)) => {
                ttfc.push(d);
                warm += usize::from(w);
                if !w {
                    let tenth = (offset.as_secs_f64() / step.as_secs_f64() * 10.0) as usize;
                    cold_at[tenth.min(9)] += 1;
                }
            }
            Err(e) => {
                errors += 1;
                eprintln!("  error: {e:#}");
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    println!("  cold sessions by tenth of their step: {cold_at:?}");
    stack.shutdown().await;
    let sessions = ttfc.len() + errors;
    let r = TraceResult {
        mode: if reserve { "prefetch (multi-template reservations)" } else { "pull on demand" },
        sessions,
        warm_pct: 100.0 * warm as f64 / sessions.max(1) as f64,
        errors,
        first_command: ttfc.summary(),
        seconds,
    };
    println!(
        "{:<40} sessions {:>4}  warm {:>5.1} %  first command p50 {:>7.1} ms  p99 {:>7.1} ms  errors {}  ({:.0} s)",
        r.mode, r.sessions, r.warm_pct, r.first_command.p50_ms, r.first_command.p99_ms, r.errors, r.seconds
    );
    Ok(r)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let t = Instant::now();
    let corpus = Corpus::build_named("bench-corpus", args.images, args.layer_kb);
    // The bench keeps its corpus in the registry for the next run: only local copies go.
    let corpus = std::mem::ManuallyDrop::new(corpus);
    println!(
        "corpus: {} images of {} KiB each, ready in {:.1} s",
        corpus.images.len(),
        args.layer_kb,
        t.elapsed().as_secs_f64()
    );
    let colds = cold_creates(&args, &corpus).await?;
    let on_demand = replay(&args, &corpus, false).await?;
    let prefetch = replay(&args, &corpus, true).await?;
    forget_local(&corpus);
    if let Some(path) = &args.json {
        let v = json!({"images": args.images, "per_image": args.per_image, "steps": args.steps, "step_s": args.step_s,
                       "cold_create": colds, "on_demand": on_demand, "prefetch": prefetch});
        std::fs::write(path, serde_json::to_vec_pretty(&v)?)?;
    }
    Ok(())
}

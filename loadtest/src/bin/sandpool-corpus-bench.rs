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
//! With `--lazy`, the corpus's images are converted to lazy images too (`sandpool images
//! convert`; kept in the registry under `bench-corpus-lazy/`) and measured in the same run
//! against the plain ones: the cold create of a cached lazy image (mounted, its stub loaded)
//! against a present Docker image; `exec true` round trips on a lazy sandbox and a plain one,
//! alternating; and the on-demand trace on lazy templates, each image unmounted and its stub
//! removed before (its chunks stay in the node's cache: the daemon's cache is not ours to
//! empty). Needs the lazy runtime installed and `sandpool-lazyd` beside this binary or running.
//!
//!     cargo run --release -p loadtest --bin sandpool-corpus-bench -- --json corpus.json
//!     cargo run --release -p loadtest --bin sandpool-corpus-bench -- --lazy --no-prefetch --images 60

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
    /// Measure the corpus's lazy forms against it too (see the top of this file).
    #[arg(long)]
    lazy: bool,
    /// `exec true` round trips on each of a lazy and a plain sandbox (`--lazy`).
    #[arg(long, default_value_t = 500)]
    execs: usize,
    /// Leave out the trace with declared steps (prefetch).
    #[arg(long)]
    no_prefetch: bool,
}

/// The images a part runs on: the corpus's plain images, or their lazy forms.
struct ImageSet<'a> {
    corpus: &'a Corpus,
    /// Template names are `public/<kind>-NNNN`: `task`, or `lazy`.
    kind: &'static str,
    /// Each image as its template is made from it.
    images: Vec<String>,
}

impl ImageSet<'_> {
    fn plain(corpus: &Corpus) -> ImageSet<'_> {
        ImageSet { corpus, kind: "task", images: corpus.images.iter().map(|i| i.image.clone()).collect() }
    }

    /// The corpus's lazy forms, converted unless the registry has them (kept like the corpus).
    async fn lazy(corpus: &Corpus) -> anyhow::Result<ImageSet<'_>> {
        let t = Instant::now();
        let (mut images, mut converted) = (Vec::new(), 0);
        for img in &corpus.images {
            let task = img.image.rsplit('/').next().and_then(|n| n.split(':').next()).unwrap_or_default();
            let dst = lazy_image::Reference::parse(&format!(
                "{}/{}-lazy/{task}:lazy",
                tests::corpus::registry(),
                corpus.prefix
            ))?;
            let registry = lazy_image::Registry::for_reference(&dst)?;
            let have = registry.manifest(&dst.repository, dst.manifest_reference()).await.ok().filter(|m| {
                serde_json::from_slice::<lazy_image::manifest::ImageManifest>(&m.bytes)
                    .is_ok_and(|m| m.config.media_type == lazy_image::manifest::LAZY_CONFIG_MEDIA_TYPE)
            });
            let pinned = match have {
                Some(m) => format!("{}/{}@{}", dst.registry, dst.repository, m.digest),
                None => {
                    let work_dir = std::env::temp_dir().join(format!("corpus-bench-convert-{task}"));
                    std::fs::create_dir_all(&work_dir)?;
                    let options = lazy_image::ConvertOptions { work_dir: work_dir.clone(), ..Default::default() };
                    let src = lazy_image::Reference::parse(&img.reference)?;
                    let done = lazy_image::convert(&src, &dst, &options).await;
                    let _ = std::fs::remove_dir_all(&work_dir);
                    converted += 1;
                    done?.destination.to_string()
                }
            };
            images.push(pinned);
        }
        println!(
            "lazy corpus: {} images ({converted} converted now) in {:.1} s",
            images.len(),
            t.elapsed().as_secs_f64()
        );
        Ok(ImageSet { corpus, kind: "lazy", images })
    }

    /// Every image starts absent: plain ones removed from Docker; lazy ones unmounted by the
    /// node's `sandpool-lazyd` and their stub images removed.
    async fn forget(&self) {
        if self.kind == "task" {
            forget_local(self.corpus);
            return;
        }
        let socket = std::path::Path::new(lazy_image::lazyd::DEFAULT_SOCKET);
        for image in &self.images {
            let hex = image.rsplit_once("@sha256:").map(|(_, h)| h).unwrap_or_default();
            let _ = std::process::Command::new("docker").args(["rmi", "-f", &format!("sandpool-lazy:{hex}")]).output();
            let unmount = lazy_image::lazyd::Request::Unmount { image: image.clone() };
            let _ = lazy_image::lazyd::call(socket, &unmount).await;
        }
    }
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

/// Makes `public/<kind>-NNNN` of every image of the set.
async fn templates(admin: &Client, set: &ImageSet<'_>) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for (i, image) in set.images.iter().enumerate() {
        let name = format!("{}-{i:04}", set.kind);
        let a = admin.call(reqwest::Method::POST, "/v1/templates", Some(json!({"name": name, "image": image}))).await;
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
    let names = templates(&admin, &ImageSet::plain(corpus)).await?;
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

/// One cold create of `template` (its pool is empty: templates from images keep none), deleted
/// after; how long the create took.
async fn cold_create(c: &Client, template: &str) -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    let a = c.call(reqwest::Method::POST, "/v1/sessions", Some(json!({"template": template, "max_wait_s": 120}))).await;
    anyhow::ensure!(a.status == 201 && a.body["start"] == "cold", "cold create {template}: {:?}", a.body);
    let took = t0.elapsed();
    c.delete(a.body["session_id"].as_str().unwrap_or_default()).await;
    Ok(took)
}

/// `--lazy`: the cold create of a cached lazy image against a present plain one, and `exec
/// true` on a sandbox of each, in pairs (the same machine at the same moment).
async fn lazy_against_plain(args: &Args, plain: &ImageSet<'_>, lazy: &ImageSet<'_>) -> anyhow::Result<Value> {
    plain.forget().await;
    lazy.forget().await;
    let stack = Stack::start(opts(false)).await;
    let admin = stack.admin_client();
    let (plain_names, lazy_names) = (templates(&admin, plain).await?, templates(&admin, lazy).await?);
    let c = stack.client("bench");
    // First creates: the plain image pulled, the lazy one mounted and its stub loaded.
    let (mut pulled, mut mounted) = (Samples::default(), Samples::default());
    for (p, l) in plain_names.iter().zip(&lazy_names).take(args.colds) {
        pulled.push(cold_create(&c, p).await?);
        mounted.push(cold_create(&c, l).await?);
    }
    // Then both cached on the node, alternating.
    let (mut present, mut cached) = (Samples::default(), Samples::default());
    for (p, l) in plain_names.iter().zip(&lazy_names).take(args.colds) {
        present.push(cold_create(&c, p).await?);
        cached.push(cold_create(&c, l).await?);
    }
    let (pu, mo, pr, ca) = (pulled.summary(), mounted.summary(), present.summary(), cached.summary());
    println!(
        "cold create, first on the node: plain (pull) p50 {:.0} ms, lazy (mount + stub) p50 {:.0} ms",
        pu.p50_ms, mo.p50_ms
    );
    println!(
        "cold create, cached: plain (present) p50 {:.0} ms p99 {:.0} ms; lazy (mounted) p50 {:.0} ms p99 {:.0} ms; lazy / plain p50 {:.2}",
        pr.p50_ms,
        pr.p99_ms,
        ca.p50_ms,
        ca.p99_ms,
        ca.p50_ms / pr.p50_ms.max(0.001)
    );
    // Exec round trips, alternating between a plain and a lazy sandbox of the same image.
    let open = |t: &str| {
        let (c, t) = (c.clone(), t.to_string());
        async move {
            let a =
                c.call(reqwest::Method::POST, "/v1/sessions", Some(json!({"template": t, "max_wait_s": 120}))).await;
            anyhow::ensure!(a.status == 201, "open {t}: {:?}", a.body);
            Ok::<_, anyhow::Error>(a.body["session_id"].as_str().unwrap_or_default().to_string())
        }
    };
    let (ps, ls) = (open(&plain_names[0]).await?, open(&lazy_names[0]).await?);
    let true_ = json!({"cmd": ["true"]});
    for sid in [&ps, &ls] {
        for _ in 0..20 {
            c.exec(sid, true_.clone()).await;
        }
    }
    let (mut pe, mut le) = (Samples::default(), Samples::default());
    for _ in 0..args.execs {
        for (sid, samples) in [(&ps, &mut pe), (&ls, &mut le)] {
            let t0 = Instant::now();
            let r = c.exec(sid, true_.clone()).await;
            anyhow::ensure!(r.status == 200 && r.body["exit_code"] == 0, "exec true: {:?}", r.body);
            samples.push(t0.elapsed());
        }
    }
    let (pe, le) = (pe.summary(), le.summary());
    println!(
        "exec true: plain p50 {:.2} ms p99 {:.2} ms; lazy p50 {:.2} ms p99 {:.2} ms; lazy / plain p50 {:.2} p99 {:.2}",
        pe.p50_ms,
        pe.p99_ms,
        le.p50_ms,
        le.p99_ms,
        le.p50_ms / pe.p50_ms.max(0.001),
        le.p99_ms / pe.p99_ms.max(0.001)
    );
    c.delete(&ps).await;
    c.delete(&ls).await;
    stack.shutdown().await;
    Ok(json!({
        "first_create": {"plain_pull": pu, "lazy_mount": mo},
        "cached_create": {"plain_present": pr, "lazy_mounted": ca, "ratio_p50": ca.p50_ms / pr.p50_ms.max(0.001)},
        "exec_true": {"plain": pe, "lazy": le, "ratio_p50": le.p50_ms / pe.p50_ms.max(0.001), "ratio_p99": le.p99_ms / pe.p99_ms.max(0.001)},
    }))
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
    /// `task` (plain images) or `lazy`.
    images: &'static str,
    sessions: usize,
    warm_pct: f64,
    /// First commands answered within 1 s of the session's intended start (issue 32's aim).
    under_1s_pct: f64,
    errors: usize,
    first_command: Summary,
    seconds: f64,
}

/// Replays the trace; with `reserve`, each step's templates are reserved one step ahead.
async fn replay(args: &Args, set: &ImageSet<'_>, reserve: bool) -> anyhow::Result<TraceResult> {
    set.forget().await;
    let stack = Stack::start(opts(true)).await;
    let admin = stack.admin_client();
    let names = templates(&admin, set).await?;
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
        images: set.kind,
        sessions,
        warm_pct: 100.0 * warm as f64 / sessions.max(1) as f64,
        under_1s_pct: ttfc.pct_under(Duration::from_secs(1)),
        errors,
        first_command: ttfc.summary(),
        seconds,
    };
    println!(
        "{:<40} {:<5} sessions {:>4}  warm {:>5.1} %  under 1 s {:>5.1} %  first command p50 {:>7.1} ms  p99 {:>7.1} ms  errors {}  ({:.0} s)",
        r.mode,
        r.images,
        r.sessions,
        r.warm_pct,
        r.under_1s_pct,
        r.first_command.p50_ms,
        r.first_command.p99_ms,
        r.errors,
        r.seconds
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
    let plain = ImageSet::plain(&corpus);
    let lazy = if args.lazy { Some(ImageSet::lazy(&corpus).await?) } else { None };
    let colds = cold_creates(&args, &corpus).await?;
    let lazy_colds = match &lazy {
        Some(l) => Some(lazy_against_plain(&args, &plain, l).await?),
        None => None,
    };
    let on_demand = replay(&args, &plain, false).await?;
    let lazy_on_demand = match &lazy {
        Some(l) => Some(replay(&args, l, false).await?),
        None => None,
    };
    let prefetch = if args.no_prefetch { None } else { Some(replay(&args, &plain, true).await?) };
    plain.forget().await;
    if let Some(l) = &lazy {
        l.forget().await;
    }
    if let Some(path) = &args.json {
        let v = json!({"images": args.images, "per_image": args.per_image, "steps": args.steps, "step_s": args.step_s,
                       "cold_create": colds, "on_demand": on_demand, "prefetch": prefetch,
                       "lazy_against_plain": lazy_colds, "lazy_on_demand": lazy_on_demand});
        std::fs::write(path, serde_json::to_vec_pretty(&v)?)?;
    }
    Ok(())
}

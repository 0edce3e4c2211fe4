//! How many sandboxes one node holds, and what holding them costs: fills the node to a
//! target of idle busybox sandboxes through its own pool (the autoscaler's target, refreshed),
//! recording the fill rate as it goes; measures memory and threads per sandbox from the
//! machine's own counters; samples warm create + `exec true` at 10 idle and again at the
//! target; and times the teardown through the node's own retirement. The node's budget (what it
//! says it can hold, and what binds it) is printed at the start and at the end.
//!
//!     cargo build --release -p loadtest --bin sandpool-density
//!     ./target/release/sandpool-density [--target 3000] [--samples 100] [--image <lazy image@sha256:...>]
//!
//! Needs Redis (SANDPOOL_TEST_REDIS), Docker, the busybox image, and the node tuning of
//! `scripts/lib.sh ensure_node_tuning` (or it stops where the budget does).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use clap::Parser;
use loadtest::Samples;
use serde_json::json;
use tests::{Client, Stack, StackOpts};

#[derive(Parser)]
struct Args {
    /// Idle sandboxes to fill the node to.
    #[arg(long, default_value_t = 3000)]
    target: u64,
    /// Warm create + exec samples at each level.
    #[arg(long, default_value_t = 100)]
    samples: usize,
    /// Give up filling after this long.
    #[arg(long, default_value = "25m")]
    fill_timeout: humantime::Duration,
    /// Keep `max_creates_in_flight` creates in flight throughout (the fixed window of old, the
    /// baseline of the adaptive one).
    #[arg(long)]
    fixed_window: bool,
    /// Destroys in flight while creates run (config `destroys_beside_creates`; 8: the old
    /// behaviour, destroys never yield).
    #[arg(long, default_value_t = config::DEFAULT_DESTROYS_BESIDE_CREATES)]
    destroys_beside_creates: usize,
    /// The sandboxes' image: busybox by default; a lazy image pinned by digest
    /// (`host/repo@sha256:...`, made by `sandpool images convert`) fills the node with lazy
    /// sandboxes (the `sandpool-lazy` runtime over one mount of it).
    #[arg(long, default_value = tests::BUSYBOX_IMAGE)]
    image: String,
    /// The sandboxes' OCI runtime (runc, crun, runsc).
    #[arg(long, default_value = "runc")]
    runtime: String,
    /// The sandboxes' memory limit (gVisor's sentry runs inside it: give runsc 256).
    #[arg(long, default_value_t = 32)]
    memory_mb: u64,
    /// Sandboxes per containerd shim (config `docker.shim_group`; 1: a shim each, Docker's
    /// way, the baseline).
    #[arg(long, default_value_t = config::DEFAULT_SHIM_GROUP)]
    shim_group: usize,
    /// How long the idle node's CPU is measured at each level.
    #[arg(long, default_value = "30s")]
    idle_window: humantime::Duration,
}

const TEMPLATE: &str = "dense";
/// A template with no warm pool: its sessions are creates the caller waits for.
const COLD: &str = "cold";
/// Sessions released at once in the release burst, and cold creates started beside it.
const BURST: usize = 200;
const COLD_CREATES: usize = 10;

/// `n` cold sessions requested at once: the time each took to be granted.
async fn cold_creates(c: &Client, n: usize) -> anyhow::Result<Samples> {
    let one = || async {
        let t = Instant::now();
        let s = c.call(reqwest::Method::POST, "/v1/sessions", Some(json!({"template": COLD, "max_wait_s": 120}))).await;
        anyhow::ensure!(s.status == 201, "cold create: {:?}", s.body);
        Ok((t.elapsed(), s.body["session_id"].as_str().unwrap_or_default().to_string()))
    };
    let done = futures::future::join_all((0..n).map(|_| one())).await;
    let mut took = Samples::default();
    for r in done {
        let (t, sid) = r?;
        took.push(t);
        c.delete(&sid).await;
    }
    Ok(took)
}

/// Cold creates on a quiet node, then the same beside the release of `BURST` sessions at once
/// (their sandboxes are destroyed while the creates run, and refilled after).
async fn release_burst(c: &Client) -> anyhow::Result<(Samples, Samples)> {
    let quiet = cold_creates(c, COLD_CREATES).await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut held = Vec::new();
    for _ in 0..BURST {
        held.push(c.create(TEMPLATE).await["session_id"].as_str().unwrap_or_default().to_string());
    }
    let release = futures::future::join_all(held.iter().map(|sid| c.delete(sid)));
    let (_, beside) = tokio::join!(release, cold_creates(c, COLD_CREATES));
    Ok((quiet, beside?))
}

/// Threads alive and memory available on the machine, as the node's budget reads them.
fn machine() -> (f64, f64) {
    use pool_manager::budget::Probe as _;
    let probe = pool_manager::budget::Proc { thread_cap: None };
    let (total, used) = probe.memory_mb().unwrap_or_default();
    (probe.threads_used().unwrap_or_default(), total - used)
}

async fn set_target(ledger: &ledger::Ledger, node: &str, n: u64) -> anyhow::Result<()> {
    let now = ledger.now_ms().await?;
    ledger.set_targets(node, &HashMap::from([(TEMPLATE.to_string(), n)]), now).await?;
    Ok(())
}

/// Warm creates then `exec true` in the new session, paced so the pool refills between them.
/// A refused create is counted, not fatal: a node at its limits is what this measures.
async fn sample(c: &Client, n: usize) -> anyhow::Result<(Samples, Samples, usize, usize)> {
    let (mut create, mut exec, mut cold, mut refused) = (Samples::default(), Samples::default(), 0, 0);
    for _ in 0..n {
        let t0 = Instant::now();
        let s = c.call(reqwest::Method::POST, "/v1/sessions", Some(json!({"template": TEMPLATE}))).await;
        if s.status != 201 {
            refused += 1;
            tokio::time::sleep(Duration::from_millis(150)).await;
            continue;
        }
        create.push(t0.elapsed());
        if s.body["start"] != "warm" {
            cold += 1;
        }
        let sid = s.body["session_id"].as_str().unwrap_or_default().to_string();
        let t1 = Instant::now();
        let r = c.exec(&sid, json!({"cmd": ["true"]})).await;
        anyhow::ensure!(r.status == 200, "exec: {:?}", r.body);
        exec.push(t1.elapsed());
        c.delete(&sid).await;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    Ok((create, exec, cold, refused))
}

/// CPU seconds this process has used (user + system, all threads). The stack runs in this
/// process (pool-manager, gateway, the ledger's clients), so over a window where nothing calls
/// it, this is what the node's control loops cost at that sandbox count.
fn process_cpu_s() -> f64 {
    // SAFETY: getrusage only writes the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The node's CPU while idle: milliseconds of this process's CPU per second over `window`,
/// with no request in flight (only the node's own timers, and the target refresher's one
/// Redis call every 2 s).
async fn idle_cpu_ms_per_s(window: Duration) -> f64 {
    let (c0, s0, t0) = (process_cpu_s(), shims(), Instant::now());
    tokio::time::sleep(window).await;
    let (c1, s1, elapsed) = (process_cpu_s(), shims(), t0.elapsed().as_secs_f64());
    // Shims that ended during the window are not counted: an idle node ends none.
    let shim_ms: f64 = s1.iter().map(|(pid, cpu)| cpu - s0.get(pid).copied().unwrap_or(*cpu)).sum();
    let threads: usize =
        s1.keys().filter_map(|pid| std::fs::read_dir(format!("/proc/{pid}/task")).ok()).map(Iterator::count).sum();
    println!(
        "  containerd shims on the machine: {} ({threads} threads), their CPU while idle: {:.1} ms/s",
        s1.len(),
        shim_ms / elapsed
    );
    (c1 - c0) * 1e3 / elapsed
}

/// Every containerd shim on the machine, by pid, with the CPU it has used (ms).
fn shims() -> HashMap<u32, f64> {
    // SAFETY: sysconf has no preconditions.
    let tick_ms = 1e3 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let Ok(dir) = std::fs::read_dir("/proc") else { return HashMap::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let (name, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
            if !name.starts_with("containerd-shim") {
                return None;
            }
            // After the name: state is field 3, utime 14 and stime 15.
            let f: Vec<&str> = rest.split(' ').collect();
            let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some((pid, ticks * tick_ms))
        })
        .collect()
}

fn print_budget(stack: &Stack, when: &str) {
    let b = stack.node.budget();
    let per: Vec<String> = b.resources.iter().map(|r| format!("{} {}", r.name, r.capacity)).collect();
    println!("budget {when}: capacity {} (bound by {}); {}", b.capacity, b.binding, per.join(", "));
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _logs = telemetry::trace::init_with("sandpool-density", None, "warn");
    let extra_toml = format!(
        "[templates.{TEMPLATE}]\nimage = \"{0}\"\nruntime = \"{1}\"\nworkdir = \"/work\"\nmemory_mb = {2}\ncpus = 0.25\npids = {3}\nwarm = 10\n\
         [templates.{COLD}]\nimage = \"{0}\"\nruntime = \"{1}\"\nworkdir = \"/work\"\nmemory_mb = {2}\ncpus = 0.25\npids = {3}\nwarm = 0\n\
         [docker]\nshim_group = {4}\n",
        args.image,
        args.runtime,
        args.memory_mb,
        // gVisor's sentry and gofer threads count against the sandbox's pids limit.
        if args.runtime == "runsc" { 1024 } else { 64 },
        args.shim_group
    );
    let opts = StackOpts {
        warm: 0,
        extra_toml,
        max_creates_in_flight: 8,
        create_rate: 40.0,
        pool_manager_toml: format!(
            "max_sandboxes = {}\nadaptive_create_window = {}\ndestroys_beside_creates = {}",
            args.target + 100,
            !args.fixed_window,
            args.destroys_beside_creates
        ),
        ..Default::default()
    };
    let (threads0, mem0) = machine();
    let mut stack = Stack::start(opts).await;
    let c = stack.client("density");
    stack.wait_idle(TEMPLATE, 10, Duration::from_secs(120)).await;
    print_budget(&stack, "at 10");
    let idle_cpu_10 = idle_cpu_ms_per_s(*args.idle_window).await;
    println!("the node's own CPU while idle at 10: {idle_cpu_10:.1} ms/s");
    let (create_10, exec_10, cold_10, refused_10) = sample(&c, args.samples).await?;

    // The target is refreshed all along (targets older than 10 s fall back to the template's
    // `warm`, which would retire the fill in the middle of the samples).
    let target = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(args.target));
    let refresher = {
        let (target, ledger, node) = (target.clone(), stack.node.ledger.clone(), stack.node.id.clone());
        tokio::spawn(async move {
            loop {
                let n = target.load(std::sync::atomic::Ordering::Relaxed);
                if let Err(e) = set_target(&ledger, &node, n).await {
                    eprintln!("set the pool target: {e}");
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        })
    };

    // A tenant working through the fill: `exec true` every 200 ms in one session.
    let s = c.call(reqwest::Method::POST, "/v1/sessions", Some(json!({"template": TEMPLATE}))).await;
    anyhow::ensure!(s.status == 201, "the prober's session: {:?}", s.body);
    let prober_sid = s.body["session_id"].as_str().unwrap_or_default().to_string();
    let filling = tokio_util::sync::CancellationToken::new();
    let prober = {
        let (c, sid, stop) = (stack.client("density"), prober_sid.clone(), filling.clone());
        tokio::spawn(async move {
            let mut lat = Samples::default();
            let mut failed = 0;
            while !stop.is_cancelled() {
                let t = Instant::now();
                let r = c.exec(&sid, json!({"cmd": ["true"]})).await;
                if r.status == 200 {
                    lat.push(t.elapsed());
                } else {
                    failed += 1;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            (lat, failed)
        })
    };

    // Fill.
    let started = Instant::now();
    // (seconds, sandboxes, create window, create latency EWMA ms) every 30 s.
    let stats = || async {
        let st = stack.node.ledger.stats(&stack.node.id).await.ok().flatten().unwrap_or_default();
        (st.create_window, st.create_ms)
    };
    let (w0, ms0) = stats().await;
    let mut marks: Vec<(f64, usize, u64, f64)> = vec![(0.0, stack.node.sandbox_count(), w0, ms0)];
    let mut next_mark = Duration::from_secs(30);
    while stack.node.sandbox_count() < args.target as usize && started.elapsed() < *args.fill_timeout {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let n = stack.node.sandbox_count();
        if started.elapsed() >= next_mark || n >= args.target as usize {
            let (w, ms) = stats().await;
            marks.push((started.elapsed().as_secs_f64(), n, w, ms));
            next_mark += Duration::from_secs(30);
        }
        if stack.node.budget().full() {
            println!("the budget stopped the fill at {n}");
            break;
        }
    }
    let filled = stack.node.sandbox_count();
    let fill_s = started.elapsed().as_secs_f64();
    filling.cancel();
    let (exec_fill, exec_fill_failed) = prober.await?;
    c.delete(&prober_sid).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (threads1, mem1) = machine();
    let docker_ok =
        std::process::Command::new("docker").args(["info", "-f", "{{.ServerVersion}}"]).output()?.status.success();
    print_budget(&stack, &format!("at {filled}"));
    let idle_cpu_full = idle_cpu_ms_per_s(*args.idle_window).await;
    println!("the node's own CPU while idle at {filled}: {idle_cpu_full:.1} ms/s");
    let (create_full, exec_full, cold_full, refused_full) = sample(&c, args.samples).await?;
    // The figures the aims are about, as soon as they are known (the release burst, the
    // restart and the teardown below take as long again on a loaded machine).
    for (idle, cr, ex) in [(10, &create_10, &exec_10), (filled, &create_full, &exec_full)] {
        let (cr, ex) = (cr.summary(), ex.summary());
        println!(
            "at {idle} idle: warm create p50 {:.2} ms, p99 {:.2} ms; exec p50 {:.2} ms, p99 {:.2} ms",
            cr.p50_ms, cr.p99_ms, ex.p50_ms, ex.p99_ms
        );
    }
    let (cold_quiet, cold_burst) = release_burst(&c).await?;

    // A restart of the node agent: reconcile reattaches and pings every sandbox.
    let before = stack.node.sandbox_count();
    let t0 = Instant::now();
    stack.restart_pool_manager().await;
    let restart_s = t0.elapsed().as_secs_f64();
    let kept = stack.node.sandbox_count();

    // Teardown through the node's own retirement.
    let t0 = Instant::now();
    target.store(0, std::sync::atomic::Ordering::Relaxed);
    while stack.node.sandbox_count() > 0 && t0.elapsed() < Duration::from_secs(900) {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    refresher.abort();
    let teardown_s = t0.elapsed().as_secs_f64();
    let left = stack.node.sandbox_count();

    println!("\nfilled to {filled} idle sandboxes in {fill_s:.0} s (docker info answers after: {docker_ok})");
    println!(
        "runtime {}, shim group {}, window {}, destroys beside creates {}",
        args.runtime,
        args.shim_group,
        if args.fixed_window { "fixed" } else { "adaptive" },
        args.destroys_beside_creates
    );
    println!(
        "fill ({} window): seconds → sandboxes, creates/s over the interval, create window, create latency (EWMA)",
        if args.fixed_window { "fixed" } else { "adaptive" }
    );
    for w in marks.windows(2) {
        let ((t0, n0, ..), (t1, n1, win, ms)) = (w[0], w[1]);
        let rate = (n1 as f64 - n0 as f64) / (t1 - t0).max(1.0);
        println!("  {t1:>6.0} s  {n1:>5}  {rate:>5.1}/s  window {win:>2}  {ms:>6.0} ms");
    }
    let ef = exec_fill.summary();
    println!(
        "a tenant's `exec true` during the fill: p50 {:.2} ms, p99 {:.2} ms ({} execs, {exec_fill_failed} failed)",
        ef.p50_ms, ef.p99_ms, ef.n
    );
    let n = filled.max(1) as f64;
    println!(
        "per sandbox: {:.1} threads, {:.1} MiB of memory (machine counters, before/after)",
        (threads1 - threads0) / n,
        (mem0 - mem1) / n
    );
    println!("\n| idle | warm create p50 ms | p99 ms | exec `true` p50 ms | p99 ms | cold starts | refused |");
    println!("|---|---|---|---|---|---|---|");
    let levels =
        [(10, &create_10, &exec_10, cold_10, refused_10), (filled, &create_full, &exec_full, cold_full, refused_full)];
    for (idle, cr, ex, cold, refused) in levels {
        let (cr, ex) = (cr.summary(), ex.summary());
        println!(
            "| {idle} | {:.2} | {:.2} | {:.2} | {:.2} | {cold}/{} | {refused} |",
            cr.p50_ms, cr.p99_ms, ex.p50_ms, ex.p99_ms, args.samples
        );
    }
    let (c10, cf, e10, ef) = (create_10.summary(), create_full.summary(), exec_10.summary(), exec_full.summary());
    println!(
        "ratios at {filled} / at 10: warm create p50 {:.2}, p99 {:.2}; exec p50 {:.2}, p99 {:.2}",
        cf.p50_ms / c10.p50_ms,
        cf.p99_ms / c10.p99_ms,
        ef.p50_ms / e10.p50_ms,
        ef.p99_ms / e10.p99_ms
    );
    println!(
        "the node's own CPU while idle (this process, {}): {idle_cpu_10:.1} ms/s at 10, {idle_cpu_full:.1} ms/s at {filled} ({:.2}x)",
        humantime::format_duration(*args.idle_window),
        idle_cpu_full / idle_cpu_10.max(1e-3)
    );
    let (q, b) = (cold_quiet.summary(), cold_burst.summary());
    println!(
        "{COLD_CREATES} cold creates at once: p50 {:.0} ms, max {:.0} ms on a quiet node; p50 {:.0} ms, max {:.0} ms while {BURST} sessions are released ({:.2}x)",
        q.p50_ms,
        q.max_ms,
        b.p50_ms,
        b.max_ms,
        b.p50_ms / q.p50_ms
    );
    println!("restart of the pool-manager with {before} sandboxes: ready in {restart_s:.1} s, {kept} kept");
    println!("teardown of {filled} through the node's retirement: {teardown_s:.0} s ({left} left)");
    stack.shutdown().await;
    Ok(())
}

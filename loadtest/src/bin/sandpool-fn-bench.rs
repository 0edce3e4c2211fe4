//! sandpool-fn-bench: functions against the ways to run the same work without them, in one run.
//!
//! Starts a whole stack in this process on the real Redis and Docker (as the end-to-end tests
//! do) and measures, for an echo function:
//! - warm invocation latency, one at a time: runtime mode (a Python worker) and exec mode
//!   (`cat` per invocation), each alternating with `exec true` in a session, so the two are
//!   compared at the same moments;
//! - sustained throughput, closed loop: `--connections` clients over `--envs` environments
//!   (the function's `max_concurrency` and `min_warm`; the clients ask to wait up to a second
//!   for a slot, `max_wait_ms`), against the same clients running `exec true` over as many
//!   sessions;
//! - cold invocations (a new version of the function each time: no environment), and the
//!   first burst of a new function (`--burst` invocations at once);
//! - the baselines: a fresh session per call (create, exec, delete through the gateway) and a
//!   fresh `docker run --rm` per call (CLI).
//!
//!     cargo run --release -p loadtest --bin sandpool-fn-bench -- --json fn.json

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use loadtest::{Samples, Summary, docker};
use serde_json::{Value, json};
use tests::{Stack, StackOpts};

#[derive(Parser)]
struct Args {
    /// Sequential warm invocations of each mode (and as many `exec true` beside them).
    #[arg(long, default_value_t = 2000)]
    invokes: usize,
    /// Environments (and sessions) of the throughput runs.
    #[arg(long, default_value_t = 8)]
    envs: u32,
    /// Closed-loop clients of the throughput runs.
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// Seconds of each throughput run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Cold invocations of each mode.
    #[arg(long, default_value_t = 20)]
    colds: usize,
    /// The first burst of a new function: invocations at once.
    #[arg(long, default_value_t = 32)]
    burst: usize,
    /// Fresh-session and `docker run` baseline calls.
    #[arg(long, default_value_t = 40)]
    baseline: usize,
    /// Write the results as JSON here too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// The echo handler, as a module the runtime imports (written from the function's env: the
/// image holds no module of ours).
const ECHO: &str = "def echo(event):\n    return event\n";

fn runtime_echo(envs: u32) -> Value {
    let boot = "import os,sys,runpy; open('/tmp/h.py','w').write(os.environ['SRC']); sys.path.insert(0,'/tmp'); \
                sys.argv=['sandpool_runtime','h:echo']; runpy.run_module('sandpool_runtime', run_name='__main__')";
    json!({"template": "deb", "mode": "runtime", "handler": ["python3", "-c", boot], "env": {"SRC": ECHO},
           "max_concurrency": envs.max(1), "min_warm": envs.min(64)})
}

fn exec_echo(envs: u32) -> Value {
    json!({"template": "bb", "mode": "exec", "handler": ["cat"], "max_concurrency": envs.max(1), "min_warm": envs.min(64)})
}

struct Bench {
    http: reqwest::Client,
    url: String,
    token: String,
}

impl Bench {
    async fn deploy(&self, name: &str, def: &Value) -> anyhow::Result<()> {
        let r = self
            .http
            .put(format!("{}/v1/functions/{name}", self.url))
            .bearer_auth(&self.token)
            .json(def)
            .send()
            .await?;
        anyhow::ensure!(r.status().is_success(), "deploy {name}: {} {}", r.status(), r.text().await?);
        Ok(())
    }

    /// One invocation: its status, its `x-sandpool-start`, and its latency.
    async fn invoke(&self, name: &str, payload: &'static [u8]) -> anyhow::Result<(u16, String, Duration)> {
        self.invoke_at(&format!("{name}/invoke"), payload).await
    }

    /// One invocation that waits up to a second for a slot (the throughput runs' clients).
    async fn invoke_waiting(&self, name: &str, payload: &'static [u8]) -> anyhow::Result<(u16, String, Duration)> {
        self.invoke_at(&format!("{name}/invoke?max_wait_ms=1000"), payload).await
    }

    async fn invoke_at(&self, path: &str, payload: &'static [u8]) -> anyhow::Result<(u16, String, Duration)> {
        let t0 = Instant::now();
        let r = self
            .http
            .post(format!("{}/v1/functions/{path}", self.url))
            .bearer_auth(&self.token)
            .body(payload)
            .send()
            .await?;
        let status = r.status().as_u16();
        let start = r.headers().get("x-sandpool-start").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        let body = r.bytes().await?;
        let took = t0.elapsed();
        anyhow::ensure!(
            status != 200 || body.as_ref() == payload,
            "echo answered {:?}",
            String::from_utf8_lossy(&body)
        );
        Ok((status, start, took))
    }

    async fn exec_true(&self, sid: &str) -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        let r = self
            .http
            .post(format!("{}/v1/sessions/{sid}/exec", self.url))
            .bearer_auth(&self.token)
            .json(&json!({"cmd": ["true"]}))
            .send()
            .await?;
        anyhow::ensure!(r.status() == 200, "exec: {}", r.status());
        r.bytes().await?;
        Ok(t0.elapsed())
    }

    async fn environments(&self, name: &str) -> anyhow::Result<Value> {
        let r = self.http.get(format!("{}/v1/functions/{name}", self.url)).bearer_auth(&self.token).send().await?;
        Ok(r.json::<Value>().await?["environments"].clone())
    }
}

/// Waits until `name` has `n` idle environments (the keeper makes `min_warm` of them).
async fn wait_envs(b: &Bench, name: &str, n: u64) -> anyhow::Result<()> {
    let ok = tests::eventually(Duration::from_secs(120), || async {
        let e = b.environments(name).await.ok()?;
        (e["idle"].as_u64() >= Some(n)).then_some(())
    })
    .await;
    anyhow::ensure!(ok.is_some(), "{name}: {n} environments never became idle");
    Ok(())
}

/// Closed loop: `clients` tasks, each calling `call` back to back for `secs`; answers
/// (completed, refused with 429).
async fn closed_loop<F, Fut>(clients: usize, secs: u64, call: F) -> (u64, u64)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<u16>> + Send,
{
    let call = Arc::new(call);
    let (done, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let until = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let (call, done, refused) = (call.clone(), done.clone(), refused.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    match call(i).await {
                        Ok(200) => done.fetch_add(1, Ordering::Relaxed),
                        Ok(429) => refused.fetch_add(1, Ordering::Relaxed),
                        Ok(s) => panic!("status {s}"),
                        Err(e) => panic!("{e}"),
                    };
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("a client");
    }
    (done.load(Ordering::Relaxed), refused.load(Ordering::Relaxed))
}

/// CPU seconds used so far by the processes named `comm` (all of them), or by this process
/// (`"self"`: the stack and the clients), from `/proc/*/stat` (utime + stime, 100 ticks/s);
/// `"machine"`: every CPU's busy time, from `/proc/stat`.
fn cpu_seconds(comm: &str) -> f64 {
    let ticks = |stat: &str| -> Option<f64> {
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split(' ').collect();
        Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / 100.0)
    };
    if comm == "machine" {
        // Every CPU's busy time: all but idle and iowait.
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let f: Vec<f64> =
            stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
        return (f.iter().sum::<f64>() - f.get(3).unwrap_or(&0.0) - f.get(4).unwrap_or(&0.0)) / 100.0;
    }
    if comm == "self" {
        return std::fs::read_to_string("/proc/self/stat").ok().and_then(|s| ticks(&s)).unwrap_or(0.0);
    }
    let mut total = 0.0;
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let dir = e.path();
        let named = std::fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.trim() == comm);
        if named && let Some(t) = std::fs::read_to_string(dir.join("stat")).ok().and_then(|s| ticks(&s)) {
            total += t;
        }
    }
    total
}

/// Cores each component used while `f` ran (`agent`: the sandboxes' agents, `/.sandpool/agent`).
async fn cores_used<F: std::future::Future<Output = T>, T>(f: F) -> (T, Vec<(&'static str, f64)>) {
    const WHO: [&str; 7] = ["machine", "self", "dockerd", "containerd-shim", "agent", "redis-server", "python3"];
    let before: Vec<f64> = WHO.iter().map(|w| cpu_seconds(w)).collect();
    let t0 = Instant::now();
    let out = f.await;
    let secs = t0.elapsed().as_secs_f64();
    let used = WHO.iter().zip(before).map(|(w, b)| (*w, (cpu_seconds(w) - b) / secs)).collect();
    (out, used)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _logs = telemetry::trace::init_with("sandpool-fn-bench", None, "warn");
    let warm_bb = args.envs * 2 + 8;
    let extra = format!(
        "[quotas]\ncall_rate = 1000000.0\ncall_burst = 1000000\n\
         [templates.deb]\nimage = \"sandpool/debian:bookworm\"\nexec = \"agent\"\nworkdir = \"/work\"\n\
         cpus = 1.0\nmemory_mb = 256\npids = 1024\nwarm = {}\nidle_timeout = \"10m\"\nmax_lifetime = \"1h\"\n",
        args.envs + 4
    );
    let opts = StackOpts {
        extra_toml: extra,
        warm: warm_bb,
        max_creates_in_flight: 4,
        cpus: 1.0,
        metrics: true,
        ..Default::default()
    };
    let stack = Stack::start(opts).await;
    let fill = Duration::from_secs(600);
    let c = stack.client("bench");
    let b = Bench { http: reqwest::Client::new(), url: stack.url.clone(), token: stack.token("bench") };
    stack.wait_idle("bb", warm_bb as usize, fill).await;
    stack.wait_idle("deb", args.envs as usize + 4, fill).await;

    // Latency, one at a time, each mode beside `exec true` in a session.
    b.deploy("rt", &runtime_echo(1)).await?;
    b.deploy("ex", &exec_echo(1)).await?;
    let sid = c.create("bb").await["session_id"].as_str().unwrap_or_default().to_string();
    let payload: &'static [u8] = br#"{"reward":1.0}"#;
    for name in ["rt", "ex"] {
        wait_envs(&b, name, 1).await?;
        b.invoke(name, payload).await?;
    }
    let (mut rt, mut ex, mut exec_true) = (Samples::default(), Samples::default(), Samples::default());
    // An invocation that found no idle environment (one retired, the keeper's race) is cold:
    // counted, not in the warm figures.
    let mut cold_in_warm = 0;
    for _ in 0..args.invokes {
        for (name, samples) in [("rt", &mut rt), ("ex", &mut ex)] {
            let (s, start, took) = b.invoke(name, payload).await?;
            anyhow::ensure!(s == 200, "{name} invoke: {s}");
            if start == "warm" {
                samples.push(took);
            } else {
                cold_in_warm += 1;
            }
        }
        exec_true.push(b.exec_true(&sid).await?);
    }
    eprintln!("latency done");

    // Throughput: the clients over `envs` environments, then over `envs` sessions.
    b.deploy("rt8", &runtime_echo(args.envs)).await?;
    wait_envs(&b, "rt8", u64::from(args.envs)).await?;
    let b = Arc::new(b);
    let bb = b.clone();
    let ((rt_done, rt_refused), rt_cpu) = cores_used(closed_loop(args.connections, args.seconds, move |_| {
        let b = bb.clone();
        async move { Ok(b.invoke_waiting("rt8", payload).await?.0) }
    }))
    .await;
    eprintln!("runtime throughput done");
    b.deploy("ex8", &exec_echo(args.envs)).await?;
    wait_envs(&b, "ex8", u64::from(args.envs)).await?;
    let bb = b.clone();
    let ((ex_done, ex_refused), ex_cpu) = cores_used(closed_loop(args.connections, args.seconds, move |_| {
        let b = bb.clone();
        async move { Ok(b.invoke_waiting("ex8", payload).await?.0) }
    }))
    .await;
    eprintln!("exec-mode throughput done");
    let mut sessions = Vec::new();
    for _ in 0..args.envs {
        sessions.push(c.create("bb").await["session_id"].as_str().unwrap_or_default().to_string());
    }
    let sessions = Arc::new(sessions);
    let (bb, ss) = (b.clone(), sessions.clone());
    let ((exec_done, _), exec_cpu) = cores_used(closed_loop(args.connections, args.seconds, move |i| {
        let (b, ss) = (bb.clone(), ss.clone());
        async move {
            b.exec_true(&ss[i % ss.len()]).await?;
            Ok(200)
        }
    }))
    .await;
    eprintln!("exec throughput done");
    for s in sessions.iter() {
        c.delete(s).await;
    }

    // Cold invocations: a new version each time retires the environment.
    stack.wait_idle("bb", warm_bb as usize, fill).await;
    let (mut rt_cold, mut ex_cold) = (Samples::default(), Samples::default());
    for i in 0..args.colds {
        for (name, def, samples) in [("rtc", runtime_echo(0), &mut rt_cold), ("exc", exec_echo(0), &mut ex_cold)] {
            let mut def = def;
            def["env"]["ROUND"] = json!(i.to_string());
            def["min_warm"] = json!(0);
            b.deploy(name, &def).await?;
            let (s, start, took) = b.invoke(name, payload).await?;
            anyhow::ensure!(s == 200 && start == "cold", "cold invoke: {s} {start}");
            samples.push(took);
        }
        stack.wait_idle("deb", args.envs as usize + 4, fill).await;
    }
    eprintln!("cold done");

    // The first burst of a new function: everything at once, nothing warm.
    stack.wait_idle("deb", args.envs as usize + 4, fill).await;
    let mut def = runtime_echo(0);
    def["max_concurrency"] = json!(args.burst);
    def["min_warm"] = json!(0);
    b.deploy("burst", &def).await?;
    let t0 = Instant::now();
    let calls: Vec<_> = (0..args.burst)
        .map(|_| {
            let b = b.clone();
            tokio::spawn(async move { b.invoke("burst", payload).await })
        })
        .collect();
    let (mut burst, mut burst_cold, mut burst_failed) = (Samples::default(), 0, 0);
    for call in calls {
        match call.await? {
            Ok((200, start, took)) => {
                burst.push(took);
                burst_cold += usize::from(start == "cold");
            }
            _ => burst_failed += 1,
        }
    }
    let burst_all = t0.elapsed();
    eprintln!("burst done");

    // Baselines: a fresh session per call; a fresh container per call.
    let mut per_session = Samples::default();
    for _ in 0..args.baseline {
        stack.wait_idle("bb", 1, fill).await;
        let t0 = Instant::now();
        let s = c.create("bb").await["session_id"].as_str().unwrap_or_default().to_string();
        let r = c.exec(&s, json!({"cmd": ["cat"], "stdin": String::from_utf8_lossy(payload)})).await;
        anyhow::ensure!(r.status == 200, "exec: {:?}", r.body);
        c.delete(&s).await;
        per_session.push(t0.elapsed());
    }
    let label = format!("sandpool.prefix={}", stack.ledger_prefix());
    let mut docker_run = Samples::default();
    for _ in 0..args.baseline / 2 {
        let t0 = Instant::now();
        docker(&["run", "--rm", "--network", "none", "--label", &label, tests::BUSYBOX_IMAGE, "echo", "{}"])?;
        docker_run.push(t0.elapsed());
    }

    let rows: Vec<(&str, Summary)> = vec![
        ("runtime mode warm invoke (gateway, Python echo)", rt.summary()),
        ("exec mode warm invoke (gateway, `cat`)", ex.summary()),
        ("exec `true` in a session (gateway), same moments", exec_true.summary()),
        ("runtime mode cold invoke (no environment)", rt_cold.summary()),
        ("exec mode cold invoke (no environment)", ex_cold.summary()),
        ("first burst of a new function, each call", burst.summary()),
        ("baseline: fresh session per call (create + exec + delete)", per_session.summary()),
        ("baseline: fresh `docker run --rm` per call (CLI)", docker_run.summary()),
    ];
    println!("| what | n | p50 ms | p90 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|---|");
    for (name, s) in &rows {
        println!("| {name} | {} | {:.2} | {:.2} | {:.2} | {:.2} |", s.n, s.p50_ms, s.p90_ms, s.p99_ms, s.max_ms);
    }
    let secs = args.seconds as f64;
    let (rt_rate, ex_rate, exec_rate) = (rt_done as f64 / secs, ex_done as f64 / secs, exec_done as f64 / secs);
    println!();
    println!(
        "throughput, {} clients closed loop over {} environments/sessions, {} s each:",
        args.connections, args.envs, args.seconds
    );
    println!("  runtime-mode invocations {rt_rate:.0}/s ({rt_refused} answered 429 after waiting 1 s)");
    println!("  exec-mode invocations {ex_rate:.0}/s ({ex_refused} answered 429 after waiting 1 s)");
    println!("  exec `true` on sessions {exec_rate:.0}/s");
    let show = |cpu: &[(&str, f64)]| cpu.iter().map(|(w, c)| format!("{w} {c:.2}")).collect::<Vec<_>>().join(", ");
    println!("cores used (of 2; machine: all busy time; self: the stack and the clients in this process):");
    println!("  runtime mode: {}", show(&rt_cpu));
    println!("  exec mode: {}", show(&ex_cpu));
    println!("  exec true: {}", show(&exec_cpu));
    if cold_in_warm > 0 {
        println!("note: {cold_in_warm} of the sequential invocations were cold (not in the warm figures)");
    }
    let p50 = |s: &Samples| s.summary().p50_ms;
    println!("exec mode p50 - exec true p50 = {:+.3} ms", p50(&ex) - p50(&exec_true));
    println!("fresh session per call / runtime warm invoke (p50) = {:.0}x", p50(&per_session) / p50(&rt));
    println!("docker run per call / runtime warm invoke (p50) = {:.0}x", p50(&docker_run) / p50(&rt));
    println!(
        "first burst: {} invocations of a new function, {burst_cold} cold, {burst_failed} failed, all done in {:.0} ms",
        args.burst,
        burst_all.as_secs_f64() * 1000.0
    );
    if let Some(path) = args.json {
        let mut map: serde_json::Map<String, Value> =
            rows.iter().map(|(k, s)| (k.to_string(), serde_json::to_value(s).unwrap_or_default())).collect();
        map.insert("throughput_runtime_per_s".into(), rt_rate.into());
        map.insert("throughput_exec_mode_per_s".into(), ex_rate.into());
        map.insert("throughput_exec_true_per_s".into(), exec_rate.into());
        map.insert("refused_runtime".into(), rt_refused.into());
        map.insert("burst_all_ms".into(), (burst_all.as_secs_f64() * 1000.0).into());
        map.insert("burst_cold".into(), burst_cold.into());
        map.insert("burst_failed".into(), burst_failed.into());
        let cpu = |c: &[(&str, f64)]| -> Value { c.iter().map(|(w, v)| (w.to_string(), json!(v))).collect() };
        map.insert("cores_runtime".into(), cpu(&rt_cpu));
        map.insert("cores_exec_mode".into(), cpu(&ex_cpu));
        map.insert("cores_exec_true".into(), cpu(&exec_cpu));
        std::fs::write(path, serde_json::to_string_pretty(&map)?)?;
    }
    drop(b);
    stack.shutdown().await;
    Ok(())
}

//! sandpool-nodes-bench: the many-nodes numbers.
//!
//! (a) A reserved burst on 3 nodes: a whole stack in this process (gateway, autoscaler, three
//!     pool-managers on the real Redis and Docker), `POST /v1/reservations` for N sandboxes,
//!     then N creates spread over one second; reports warm %, latency and how evenly the
//!     sessions spread over the nodes.
//! (b) A node killed under load: `sandpool up --nodes 2` and a third node as its own
//!     `sandpool pool-manager` process (default liveness: down after 10 s), an open-loop
//!     stream of episodes (create, exec, delete); the third node is killed with SIGKILL and
//!     the run reports when the last create was placed on it and the share of episodes that
//!     still succeeded around the kill.
//! (c) Warm create on a Redis Cluster vs a single Redis: one node's stack on each, alternating
//!     rounds in one run (`scripts/lib.sh ensure_redis_cluster` starts the local cluster).
//!
//!     cargo build --release -p sandpool -p loadtest
//!     ./target/release/sandpool-nodes-bench --n 1000 --json nodes.json

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use clap::Parser;
use loadtest::Samples;
use reqwest::Method;
use serde_json::{Value, json};
use tests::{Cleanup, Client, Stack, StackOpts, eventually, rand_hex};

#[derive(Parser)]
struct Args {
    /// Sessions in the reserved burst of (a).
    #[arg(long, default_value_t = 1000)]
    n: usize,
    /// The creates per second (a) expects the three nodes to sustain on this machine's one
    /// Docker engine, for its `ready_by` (1,000 filled in 119-157 s here).
    #[arg(long, default_value_t = 8.0)]
    fill_rate: f64,
    /// Episodes per second in (b).
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Length of (b), seconds; the node is killed a quarter of the way in.
    #[arg(long, default_value_t = 40)]
    duration_s: u64,
    /// The `sandpool` binary for (b) (default: next to this one).
    #[arg(long)]
    sandpool: Option<std::path::PathBuf>,
    /// Skip (a), (b) or (c).
    #[arg(long)]
    skip_burst: bool,
    #[arg(long)]
    skip_kill: bool,
    #[arg(long)]
    skip_cluster: bool,
    /// The cluster's seeds for (c).
    #[arg(
        long,
        env = "SANDPOOL_CLUSTER_URL",
        default_value = "redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003"
    )]
    cluster_url: String,
    /// Rounds of (c) on each topology.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Write the results as JSON.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut out = serde_json::Map::new();
    if !args.skip_burst {
        out.insert("reserved_burst".into(), reserved_burst(args.n, args.fill_rate).await?);
        // Let the removal of the burst's sandboxes finish before (b) measures anything.
        tokio::time::sleep(Duration::from_secs(20)).await;
    }
    if !args.skip_kill {
        out.insert("node_killed".into(), node_killed(&args).await?);
    }
    if !args.skip_cluster {
        out.insert("cluster_vs_single".into(), cluster_vs_single(&args).await?);
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&Value::Object(out))?)?;
    }
    Ok(())
}

/// (a): N reserved sandboxes on 3 nodes, then N creates within one second.
async fn reserved_burst(n: usize, fill_rate: f64) -> anyhow::Result<Value> {
    let opts = StackOpts {
        warm: 0,
        autoscaler: true,
        create_rate: 12.0,
        max_creates_in_flight: 8,
        max_queue: n * 2,
        cpus: 1.0,
        ..Default::default()
    };
    let stack = Stack::start(opts).await;
    let others = [stack.add_node().await, stack.add_node().await];
    let nodes: Vec<String> =
        std::iter::once(stack.node.id.clone()).chain(others.iter().map(|g| g.node.id.clone())).collect();
    let c = stack.client("trainer");
    // A trainer declares the burst for when the machine can have it ready, and starts it then:
    // the autoscaler paces the creates to be done just before (`reservations`), not as fast
    // as the nodes can, and the burst does not land on a machine still busy filling.
    let fill_s = (n as f64 / fill_rate * 1.3) as u64 + 20;
    let ready_by = SystemTime::now() + Duration::from_secs(fill_s);
    let ready_at = tokio::time::Instant::now() + Duration::from_secs(fill_s);
    let body = json!({
        "template": "bb", "count": n, "hold_s": 600,
        "ready_by": humantime::format_rfc3339(ready_by).to_string(),
    });
    let r = c.call(Method::POST, "/v1/reservations", Some(body)).await;
    anyhow::ensure!(r.status == 201, "reservation: {:?}", r.body);
    let t_fill = Instant::now();
    let ledger = stack.node.ledger.clone();
    let idle = eventually(Duration::from_secs(fill_s * 3), || async {
        let mut per = Vec::new();
        for node in &nodes {
            per.push(ledger.idle_counts(node, &["bb"]).await.ok()?[0]);
        }
        (per.iter().sum::<usize>() >= n).then_some(per)
    })
    .await
    .ok_or_else(|| anyhow::anyhow!("the pools did not reach {n} idle"))?;
    let filled = t_fill.elapsed();
    eprintln!("{n} idle on 3 nodes after {:.0} s: {idle:?}", filled.as_secs_f64());
    let early_s = ready_at.saturating_duration_since(tokio::time::Instant::now()).as_secs_f64();
    tokio::time::sleep_until(ready_at).await;

    // Creates the nodes start while the burst runs (refills beside the checkouts) share the
    // machine's two cores with them: counted, to tell their cost from the checkouts' own.
    let started = || stack.node.creates_started() + others.iter().map(|g| g.node.creates_started()).sum::<u64>();
    let started_before = started();
    let t0 = tokio::time::Instant::now() + Duration::from_millis(200);
    let calls: Vec<_> = (0..n)
        .map(|i| {
            let c = c.clone();
            let at = t0 + Duration::from_millis(1000 * i as u64 / n as u64);
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
                (a, at.elapsed())
            })
        })
        .collect();
    let (mut lat, mut warm, mut errors, mut sids) = (Samples::default(), 0, 0, Vec::new());
    let mut per_node: BTreeMap<String, usize> = nodes.iter().map(|n| (n.clone(), 0)).collect();
    for call in calls {
        let (a, took) = call.await?;
        if a.status == 201 {
            lat.push(took);
            warm += (a.body["start"] == "warm") as usize;
            *per_node.entry(a.body["node"].as_str().unwrap_or_default().to_string()).or_default() += 1;
            sids.push(a.body["session_id"].as_str().unwrap_or_default().to_string());
        } else {
            errors += 1;
        }
    }
    let creates_during = started() - started_before;
    let s = lat.summary();
    let even = n as f64 / nodes.len() as f64;
    let spread = per_node.values().map(|&k| (k as f64 - even).abs() / even).fold(0.0, f64::max);
    println!(
        "| reserved burst on 3 nodes | n | warm % | errors | p50 ms | p99 ms | max ms | per node | max off even |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    println!(
        "| 1 s spread | {n} | {:.1} | {errors} | {:.2} | {:.2} | {:.2} | {:?} | {:.1} % |",
        100.0 * warm as f64 / n as f64,
        s.p50_ms,
        s.p99_ms,
        s.max_ms,
        per_node.values().collect::<Vec<_>>(),
        100.0 * spread
    );
    println!(
        "pools idle per node before the burst: {idle:?} (filled in {:.0} s, {early_s:.0} s before ready_by = {fill_s} s)",
        filled.as_secs_f64()
    );
    println!("creates the nodes started during the burst: {creates_during}");
    for sid in sids {
        c.delete(&sid).await;
    }
    drop(others);
    stack.shutdown().await;
    Ok(json!({
        "n": n, "warm": warm, "errors": errors, "latency": s, "per_node": per_node,
        "max_off_even": spread, "idle_before": idle, "fill_s": filled.as_secs_f64(),
        "ready_by_s": fill_s, "full_before_ready_by_s": early_s,
        "creates_during": creates_during,
    }))
}

/// A child process killed (SIGKILL) and reaped when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Removes the test state's socket directories of these node ids when dropped.
struct RunDirs(Vec<String>);

impl Drop for RunDirs {
    fn drop(&mut self) {
        let run = std::path::Path::new(tests::TEST_STATE_DIR).join("run");
        for e in std::fs::read_dir(&run).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if self.0.iter().any(|n| name.starts_with(&format!("{n}."))) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

/// One episode of (b): when it was sent, where its session landed, and whether it worked.
struct Episode {
    sent_s: f64,
    node: Option<String>,
    /// `None` when it worked; else which call failed and how (`create 503 unavailable`).
    failure: Option<String>,
}

/// (b): a node killed with SIGKILL under a stream of episodes.
async fn node_killed(args: &Args) -> anyhow::Result<Value> {
    let bin = match &args.sandpool {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("sandpool"),
    };
    anyhow::ensure!(bin.exists(), "no sandpool binary at {} (cargo build --release -p sandpool)", bin.display());
    let prefix = format!("sptest-{}", rand_hex(10));
    let node = format!("n{}", rand_hex(6));
    let _cleanup = Cleanup { prefix: prefix.clone(), redis: tests::redis_url(), node: node.clone() };
    let victim = format!("{node}-c");
    let _dirs = RunDirs(vec![format!("{node}-1"), format!("{node}-2"), victim.clone()]);
    let opts = StackOpts { warm: 4, max_queue: 10_000, ..Default::default() };
    let dir = std::env::temp_dir().join(&prefix);
    std::fs::create_dir_all(&dir)?;
    struct RemoveDir(std::path::PathBuf);
    impl Drop for RemoveDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _dir = RemoveDir(dir.clone());
    let cfg = dir.join("sandpool.toml");
    std::fs::write(&cfg, tests::config_toml(&prefix, &node, &opts))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let log = std::fs::File::create(dir.join("sandpool.log"))?;
    let spawn = |args: &[&str]| -> anyhow::Result<Proc> {
        Ok(Proc(
            Command::new(&bin)
                .arg("--config")
                .arg(&cfg)
                .args(args)
                .env("RUST_LOG", "warn")
                .stdout(Stdio::from(log.try_clone()?))
                .stderr(Stdio::from(log.try_clone()?))
                .spawn()?,
        ))
    };
    let _up = spawn(&["--gateway-listen", &format!("127.0.0.1:{port}"), "up", "--nodes", "2"])?;
    let mut c_node = spawn(&["--node-id", &victim, "pool-manager"])?;
    let config = tests::config_for(&prefix, &node, &opts);
    let token = gateway::mint(&config.auth, "trainer", false, Duration::from_secs(3600))?;
    let c = Client { http: reqwest::Client::new(), url: format!("http://127.0.0.1:{port}"), token };
    let ready = eventually(Duration::from_secs(90), || async {
        let r = c.http.get(format!("{}/readyz", c.url)).send().await.ok()?;
        (r.status().as_u16() == 204).then_some(())
    });
    ready.await.ok_or_else(|| anyhow::anyhow!("sandpool up did not become ready (log: {})", dir.display()))?;
    // Every node serves before the clock starts.
    let mut seen = std::collections::HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    while seen.len() < 3 {
        anyhow::ensure!(Instant::now() < deadline, "three nodes did not all serve within 90 s (saw {seen:?})");
        let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
        if a.status == 201 {
            seen.insert(a.body["node"].as_str().unwrap_or_default().to_string());
            c.delete(a.body["session_id"].as_str().unwrap_or_default()).await;
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    let total = Duration::from_secs(args.duration_s);
    let kill_at = total / 4;
    let n = (args.rate * total.as_secs_f64()) as usize;
    let t0 = tokio::time::Instant::now() + Duration::from_millis(100);
    let episodes: Vec<_> = (0..n)
        .map(|i| {
            let c = c.clone();
            let at = t0 + Duration::from_secs_f64(i as f64 / args.rate);
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let sent_s = (at - t0).as_secs_f64();
                let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb", "max_wait_s": 15}))).await;
                if a.status != 201 {
                    let message: String = a.body["message"].as_str().unwrap_or("").chars().take(48).collect();
                    let failure =
                        Some(format!("create {} {}: {message}", a.status, a.body["code"].as_str().unwrap_or("?")));
                    return Episode { sent_s, node: None, failure };
                }
                let sid = a.body["session_id"].as_str().unwrap_or_default().to_string();
                let node = a.body["node"].as_str().map(String::from);
                let e = c.exec(&sid, json!({"cmd": "echo ok"})).await;
                let failure = if e.status == 200 && e.body["stdout"] == "ok\n" {
                    None
                } else {
                    Some(format!("exec {} {}", e.status, e.body["code"].as_str().unwrap_or("?")))
                };
                c.delete(&sid).await;
                Episode { sent_s, node, failure }
            })
        })
        .collect();
    tokio::time::sleep_until(t0 + kill_at).await;
    c_node.0.kill()?;
    c_node.0.wait()?;
    let killed_s = kill_at.as_secs_f64();
    let mut all = Vec::new();
    for e in episodes {
        all.push(e.await?);
    }
    let last_on_victim =
        all.iter().filter(|e| e.node.as_deref() == Some(victim.as_str())).map(|e| e.sent_s).fold(f64::MIN, f64::max);
    let share = |from: f64, to: f64| {
        let w: Vec<&Episode> = all.iter().filter(|e| e.sent_s >= from && e.sent_s < to).collect();
        let ok = w.iter().filter(|e| e.failure.is_none()).count();
        (ok, w.len())
    };
    let mut on_node: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    for e in &all {
        let slot = on_node.entry(e.node.clone().unwrap_or_else(|| "-".into())).or_default();
        if e.sent_s < killed_s {
            slot.0 += 1
        } else {
            slot.1 += 1
        }
        if let Some(f) = &e.failure {
            *failures.entry(format!("{f} ({})", if e.sent_s < killed_s { "before" } else { "after" })).or_default() +=
                1;
        }
    }
    let (b_ok, b_n) = share(0.0, killed_s);
    let (d_ok, d_n) = share(killed_s, killed_s + 15.0);
    let (a_ok, a_n) = share(killed_s + 15.0, f64::MAX);
    let placed_after = (last_on_victim - killed_s).max(0.0);
    println!("| node killed (SIGKILL) under {} episodes/s | episodes | succeeded |", args.rate);
    println!("|---|---|---|");
    println!("| before the kill | {b_n} | {:.1} % |", 100.0 * b_ok as f64 / b_n.max(1) as f64);
    println!("| the 15 s after it | {d_n} | {:.1} % |", 100.0 * d_ok as f64 / d_n.max(1) as f64);
    println!("| after that | {a_n} | {:.1} % |", 100.0 * a_ok as f64 / a_n.max(1) as f64);
    println!("last create placed on the killed node: {placed_after:.1} s after the kill (down_after 10 s)");
    println!("episodes per node (before, after the kill): {on_node:?}");
    println!("failures: {failures:?}");
    Ok(json!({
        "rate": args.rate, "kill_at_s": killed_s, "last_placed_after_kill_s": placed_after,
        "before": {"ok": b_ok, "n": b_n}, "during_15s": {"ok": d_ok, "n": d_n}, "after": {"ok": a_ok, "n": a_n},
        "per_node": on_node, "failures": failures, "victim": victim,
    }))
}

/// (c): warm creates on one node's stack over a single Redis and over the Redis Cluster,
/// alternating rounds: each round fills a pool of 30 and opens 25 sessions one after another.
async fn cluster_vs_single(args: &Args) -> anyhow::Result<Value> {
    const SESSIONS: usize = 25;
    let topologies = [("single Redis", tests::redis_url()), ("Redis Cluster (3 masters)", args.cluster_url.clone())];
    let mut p50s: Vec<Vec<f64>> = vec![Vec::new(); topologies.len()];
    let mut all: Vec<Samples> = (0..topologies.len()).map(|_| Samples::default()).collect();
    for round in 0..args.rounds {
        for (i, (name, url)) in topologies.iter().enumerate() {
            let opts = StackOpts { warm: 30, redis_url: Some(url.clone()), ..Default::default() };
            let stack = Stack::start(opts).await;
            stack.wait_idle("bb", 30, Duration::from_secs(120)).await;
            let c = stack.client("trainer");
            let (mut lat, mut sids) = (Samples::default(), Vec::new());
            for _ in 0..SESSIONS {
                let t = Instant::now();
                let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
                let took = t.elapsed();
                anyhow::ensure!(a.status == 201 && a.body["start"] == "warm", "{name}: {:?}", a.body);
                lat.push(took);
                all[i].push(took);
                sids.push(a.body["session_id"].as_str().unwrap_or_default().to_string());
            }
            for sid in sids {
                c.delete(&sid).await;
            }
            let p50 = lat.summary().p50_ms;
            eprintln!("round {round}: {name}: warm create p50 {p50:.2} ms");
            p50s[i].push(p50);
            stack.shutdown().await;
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("| warm create, one node | rounds | p50 ms (median of rounds) | p99 ms (all) |");
    println!("|---|---|---|---|");
    let mut rows = Vec::new();
    for (i, (name, _)) in topologies.iter().enumerate() {
        let s = all[i].summary();
        println!("| {name} | {} | {:.2} | {:.2} |", args.rounds, median(&p50s[i]), s.p99_ms);
        rows.push(json!({"topology": name, "p50_ms_rounds": p50s[i], "p50_ms": median(&p50s[i]), "all": s}));
    }
    println!("cluster / single, median p50: {:.2}x", median(&p50s[1]) / median(&p50s[0]).max(0.001));
    Ok(json!(rows))
}

//! sandpool-chaos: faults injected under load, then the invariants checked.
//!
//! Starts a deployment of its own from the `sandpool` binary: a Redis of its own (AOF on; with
//! `--cluster` a 3-master Redis Cluster of its own), two gateways, three pool-managers (two on
//! the host's dockerd, the third on the second dockerd that `scripts/lib.sh ensure_dockerd2`
//! runs), each a process; with the `autoscaler` fault, an autoscaler process sizes their pools
//! (without it, each node keeps its templates' `warm` sizes). Drives seeded open-loop load through the gateways (episodes that
//! create, exec, write and read files, pause and resume, delete; a few long ones; and
//! "survivor" sessions that live through the whole run with state in them), and kills with
//! SIGKILL at seeded moments, one fault at a time:
//!
//! - `gateway`: one gateway, restarted after a few seconds (clients fail over to the other, as
//!   a load balancer would);
//! - `pool-manager`: one node's process, restarted within or just past `down_after`;
//! - `node-lost`: one node's process, restarted after `lost_after` has passed;
//! - `redis`: the Redis (with `--cluster`, one master), restarted from its AOF;
//! - `autoscaler`: the autoscaler, restarted after a few seconds (the nodes keep its last
//!   targets, then fall back to their `warm` sizes);
//! - `dockerd2`: the second dockerd, under the third node, restarted by `ensure_dockerd2`;
//! - `registry`: the registry of the run's lazy image (`lazy.rs`: a registry of its own, and a
//!   `lazy` template per tenant that some episodes use), restarted after a few seconds: reads
//!   of blocks not yet fetched fail with an I/O error inside the sandbox meanwhile (an answered
//!   call), and work again after.
//!
//! After the last fault everything is restored and the run checks:
//! - no sandbox granted twice (sandbox ids across sessions, and an owner file in each sandbox);
//! - no request past its deadline (every call has one);
//! - every answer is right (an echo echoes, a file reads back what was written) or a clear
//!   refusal: 429/503 carry Retry-After; an ended session is 404 `session_gone` / 502 saying
//!   why; never a 500, never an unknown session;
//! - every survivor session is usable with its state intact, or ended with a reason;
//! - no leaked quota usage (every tenant's usage back to 0, `quotas:verify` finds no drift);
//! - no orphan container: each node's containers are exactly the ledger's sandboxes of it.
//!
//! Prints a summary, writes JSON with `--json`, and exits 1 when an invariant broke. Everything
//! it started is killed and removed at the end, pass or fail (the second dockerd is left
//! running). RELIABILITY.md records a long run.
//!
//!     cargo build --release -p sandpool -p loadtest
//!     ./target/release/sandpool-chaos --seed 7 --duration-s 600 --json chaos.json

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use reqwest::Method;
use serde::Serialize;
use serde_json::{Value, json};

mod api;
mod faults;
mod lazy;
mod load;
mod world;

use api::{Api, Outcome, Record};
use faults::{Injected, inject};
use load::{episode, open_survivors};
use world::{World, wait_for};

#[derive(Parser)]
struct Args {
    /// Seeds the load and the faults (default: random, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Length of the load, seconds (faults are injected only while it runs).
    #[arg(long, default_value_t = 120)]
    duration_s: u64,
    /// Episodes started per second (Poisson arrivals).
    #[arg(long, default_value_t = 3.0)]
    rate: f64,
    /// The faults to inject, in a seeded order that repeats.
    #[arg(long, value_delimiter = ',', default_values = ["gateway", "pool-manager", "node-lost", "redis", "dockerd2", "registry"])]
    faults: Vec<Fault>,
    /// Seconds between one fault's recovery and the next fault (the gap is drawn from 1x-2x).
    #[arg(long, default_value_t = 4.0)]
    fault_gap_s: f64,
    /// The ledger on a 3-master Redis Cluster of this run's own (`redis` then kills one master).
    #[arg(long)]
    cluster: bool,
    /// Sessions that live through the whole run.
    #[arg(long, default_value_t = 6)]
    survivors: usize,
    /// Nodes' liveness: down after this many seconds of silence...
    #[arg(long, default_value_t = 3)]
    down_after_s: u64,
    /// ...and given up (sessions `node_lost`) after this many.
    #[arg(long, default_value_t = 15)]
    lost_after_s: u64,
    /// The `sandpool` binary (default: next to this one).
    #[arg(long)]
    sandpool: Option<PathBuf>,
    /// scripts/lib.sh (for `ensure_dockerd2`).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/lib.sh"))]
    lib_sh: PathBuf,
    /// Keep the run's directory (config, logs, Redis data) instead of removing it.
    #[arg(long)]
    keep: bool,
    /// Write the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
enum Fault {
    Gateway,
    PoolManager,
    NodeLost,
    Redis,
    Autoscaler,
    Dockerd2,
    Registry,
}

/// The second dockerd's socket (`scripts/lib.sh`).
const DOCKER2_SOCKET: &str = "/run/sandpool-docker2.sock";
const DOCKER2_PIDFILE: &str = "/run/sandpool-docker2.pid";
/// Tenants of the episodes; survivors belong to a tenant of their own.
const TENANTS: [&str; 3] = ["chaos-a", "chaos-b", "chaos-c"];
const SURVIVOR_TENANT: &str = "chaos-keep";
/// How long a create may wait for a sandbox, and every call's deadline beyond what it asks for.
const MAX_WAIT_S: u64 = 10;
const CALL_DEADLINE: Duration = Duration::from_secs(20);
/// The processes' log filter (`SANDPOOL_CHAOS_LOG` overrides): warnings, and the access log,
/// whose request ids the run's violations name.
const PROCESS_LOG: &str = "warn,sandpool::access=info";
/// Targets stamped longer ago than this are stale: the autoscaler decides once a second, and
/// stamps a decision with the last second it has complete arrival counts for (a few back).
const AUTOSCALER_FRESH_MS: u64 = 10_000;
/// A restarted part must serve again within this, or the run reports it.
const RECOVERY_BOUND: Duration = Duration::from_secs(90);

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    // Interrupted, the run is dropped, and with it the deployment (`World`'s Drop removes its
    // processes and containers), as at the end of a run.
    let interruptible = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = run(args) => r,
            _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted (SIGINT); the deployment is removed"),
            _ = term.recv() => anyhow::bail!("interrupted (SIGTERM); the deployment is removed"),
        }
    };
    match rt.block_on(interruptible) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("sandpool-chaos: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    anyhow::ensure!(!args.faults.is_empty(), "--faults names none");
    anyhow::ensure!(args.rate > 0.0, "--rate must be positive");
    let seed = args.seed.unwrap_or_else(rand::random);
    eprintln!("sandpool-chaos: seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut w = World::start(&args, args.cluster).await?;
    let http = reqwest::Client::builder().connect_timeout(Duration::from_secs(3)).build()?;
    wait_for(Duration::from_secs(120), || async { w.healthy(&http).await.then_some(()) })
        .await
        .with_context(|| format!("the deployment did not come up (logs: {}; --keep keeps them)", w.dir.display()))?;

    let mut tokens = HashMap::new();
    for t in TENANTS.iter().chain([&SURVIVOR_TENANT]) {
        tokens.insert(t.to_string(), gateway::mint(&w.config.auth, t, false, Duration::from_secs(86_400))?);
    }
    tokens.insert("admin".into(), gateway::mint(&w.config.auth, "chaos-admin", true, Duration::from_secs(86_400))?);
    let rec = Arc::new(Mutex::new(Record::default()));
    let api = Api {
        http: http.clone(),
        gateways: Arc::new(w.gateways.iter().map(|g| g.0.clone()).collect()),
        tokens: Arc::new(tokens),
        rec: rec.clone(),
    };
    let host_nodes: Vec<String> = w.nodes.iter().filter(|n| n.socket.is_none()).map(|n| n.id.clone()).collect();
    if let Some(lazy) = &mut w.lazy {
        lazy.templates(&api, &TENANTS, &host_nodes).await?;
        lazy.open_probe(&api, TENANTS[0]).await?;
    }
    let lazy = w.lazy.is_some();
    let survivors = open_survivors(&api, args.survivors, &mut rng).await?;
    rec.lock().unwrap().t0 = Some(Instant::now());
    let t0 = Instant::now();
    let total = Duration::from_secs(args.duration_s);

    // Open-loop load: Poisson arrivals, each episode on a task of its own.
    let load = {
        let api = api.clone();
        let mut rng = StdRng::seed_from_u64(rng.random());
        let rate = args.rate;
        tokio::spawn(async move {
            let mut tasks = Vec::new();
            let mut at = Duration::ZERO;
            loop {
                at += Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() / rate);
                if at >= total {
                    break;
                }
                tokio::time::sleep_until(tokio::time::Instant::from_std(t0 + at)).await;
                tasks.push(tokio::spawn(episode(api.clone(), rng.random(), lazy)));
            }
            for t in tasks {
                let _ = t.await;
            }
        })
    };
    // The survivors' heartbeat: an echo in each every few seconds.
    let stop = tokio_util::sync::CancellationToken::new();
    let beat = {
        let (api, stop) = (api.clone(), stop.clone());
        let ids: Vec<String> = survivors.iter().map(|s| s.sid.clone()).collect();
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.is_cancelled() {
                for (i, sid) in ids.iter().enumerate() {
                    api.echo("survivor_exec", i, SURVIVOR_TENANT, sid, &format!("beat-{n}")).await;
                }
                n += 1;
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_secs(4)) => {}
                }
            }
        })
    };

    // Faults, one at a time, in a seeded order that repeats, while the load runs.
    let mut order = args.faults.clone();
    let mut injected = Vec::new();
    tokio::time::sleep(Duration::from_secs(3)).await;
    'faults: loop {
        order.shuffle(&mut rng);
        for &fault in &order {
            let gap = Duration::from_secs_f64(args.fault_gap_s * rng.random_range(1.0..2.0));
            if t0.elapsed() + gap >= total {
                break 'faults;
            }
            tokio::time::sleep(gap).await;
            let at_s = t0.elapsed().as_secs_f64();
            injected.push(inject(&mut w, &api, &http, fault, &mut rng, at_s).await);
        }
    }
    let _ = load.await;
    stop.cancel();
    let _ = beat.await;
    let load_s = t0.elapsed().as_secs_f64();
    eprintln!("[{load_s:.1} s] load done; checking");

    // Every part of the deployment is up (and none crashed on its own).
    let mut crashed = Vec::new();
    let parts = w.gateways.iter_mut().map(|g| &mut g.1).chain(w.nodes.iter_mut().map(|n| &mut n.proc));
    for p in parts.chain(w.autoscaler.as_mut()) {
        if let Some(status) = p.exited() {
            crashed.push(format!("{} exited by itself: {status}", p.name));
            p.start()?;
        }
    }
    for c in crashed {
        rec.lock().unwrap().violation("crash", c);
    }
    if wait_for(RECOVERY_BOUND, || async { w.healthy(&http).await.then_some(()) }).await.is_err() {
        rec.lock().unwrap().violation("recovery", "the deployment was not healthy 90 s after the load".into());
    }

    // Survivors: usable with their state, or ended with a reason.
    let mut survivor_report = Vec::new();
    for (i, s) in survivors.iter().enumerate() {
        let (o, r) = api.echo("survivor_final", i, SURVIVOR_TENANT, &s.sid, "final").await;
        let state = match o {
            Outcome::Ok => match api.read_back(i, SURVIVOR_TENANT, &s.sid, "/work/state.bin", &s.data).await {
                Outcome::Ok => "usable, state intact".to_string(),
                o => {
                    rec.lock().unwrap().violation("survivor", format!("{} answered exec but its file: {o:?}", s.sid));
                    format!("state {o:?}")
                }
            },
            Outcome::Ended => {
                rec.lock().unwrap().open.remove(&s.sid);
                format!(
                    "ended: {}",
                    r.map(|r| r.body["message"].as_str().unwrap_or("").to_string()).unwrap_or_default()
                )
            }
            o => {
                rec.lock().unwrap().violation("survivor", format!("{} neither usable nor ended: {o:?}", s.sid));
                format!("{o:?}")
            }
        };
        survivor_report.push(json!({"session": s.sid, "node": s.node, "end": state}));
    }

    // Every session this client still holds is deleted; then nothing is left counted.
    let open: Vec<(String, String)> = rec.lock().unwrap().open.iter().map(|(s, t)| (s.clone(), t.clone())).collect();
    for (sid, tenant) in &open {
        let o = api.delete(0, tenant, sid).await;
        if !matches!(o, Outcome::Ok | Outcome::Ended) {
            rec.lock().unwrap().violation("cleanup", format!("delete {sid}: {o:?}"));
        }
    }
    // A create whose gateway died under it may have left a session nobody heard of: as many
    // as such creates are told apart (listed, then deleted so the quota check below holds);
    // any more is a violation.
    let mut unheard = 0;
    for t in TENANTS.iter().chain([&SURVIVOR_TENANT]) {
        let r = api.call(0, t, Method::GET, "/v1/sessions", None, CALL_DEADLINE).await;
        let left: Option<Vec<String>> = r.ok().map(|r| {
            let list = r.body["sessions"].as_array().cloned().unwrap_or_default();
            list.iter().filter_map(|s| s["session_id"].as_str().map(String::from)).collect()
        });
        let lost = rec.lock().unwrap().lost_creates.get(*t).copied().unwrap_or(0);
        match left {
            Some(left) if left.len() <= lost => {
                for sid in &left {
                    eprintln!("  {t}: session {sid} of a create whose gateway died (the client never heard of it)");
                    if !matches!(api.delete(0, t, sid).await, Outcome::Ok | Outcome::Ended) {
                        rec.lock().unwrap().violation("cleanup", format!("delete {sid}"));
                    }
                }
                unheard += left.len();
            }
            left => {
                let n = left.map(|l| l.len());
                rec.lock().unwrap().violation("sessions", format!("{t} still lists {n:?} sessions after deleting all"));
            }
        }
    }
    let quota = check_quota(&api).await;
    if let Err(e) = &quota {
        rec.lock().unwrap().violation("quota", format!("{e:#}"));
    }
    let orphans = check_containers(&w).await;
    if let Err(e) = &orphans {
        rec.lock().unwrap().violation("containers", format!("{e:#}"));
    }

    // The report.
    let r = rec.lock().unwrap();
    let mut recovery: BTreeMap<Fault, Vec<f64>> = BTreeMap::new();
    for f in &injected {
        if let Some(s) = f.recovered_s {
            recovery.entry(f.fault).or_default().push(s);
        }
    }
    let not_recovered: Vec<&Injected> = injected.iter().filter(|f| f.recovered_s.is_none()).collect();
    let mut violations = r.violations.clone();
    for f in &not_recovered {
        violations.push(json!({"at_s": f.at_s, "what": "recovery", "detail": format!("{:?} {} did not serve again within {:?}", f.fault, f.target, RECOVERY_BOUND)}));
    }
    // A run too short for every fault it was asked for has not tested them: not a pass.
    for f in args.faults.iter().collect::<HashSet<_>>() {
        if !injected.iter().any(|i| i.fault == *f) {
            let detail = format!("{f:?} was asked for and never injected: lengthen --duration-s");
            violations.push(json!({"at_s": load_s, "what": "coverage", "detail": detail}));
        }
    }
    let requests: u64 = r.calls.values().flat_map(|m| m.values()).sum();
    println!(
        "## sandpool-chaos, seed {seed}: {} s of load at {} episodes/s, {}",
        args.duration_s,
        args.rate,
        if args.cluster { "Redis Cluster (3 masters)" } else { "single Redis" }
    );
    println!();
    println!(
        "| call | {} |",
        [Outcome::Ok, Outcome::Refused, Outcome::Ended, Outcome::ConnectionLost, Outcome::Failed]
            .map(|o| format!("{o:?}"))
            .join(" | ")
    );
    println!("|---|---|---|---|---|---|");
    for (kind, m) in &r.calls {
        let n = |o| m.get(&o).copied().unwrap_or(0);
        println!(
            "| {kind} | {} | {} | {} | {} | {} |",
            n(Outcome::Ok),
            n(Outcome::Refused),
            n(Outcome::Ended),
            n(Outcome::ConnectionLost),
            n(Outcome::Failed)
        );
    }
    println!();
    println!("episodes: {:?}", r.episodes);
    println!();
    println!("| fault | target | at s | down s | serves again after restart, s |");
    println!("|---|---|---|---|---|");
    for f in &injected {
        println!(
            "| {:?} | {} | {:.1} | {:.1} | {} |",
            f.fault,
            f.target,
            f.at_s,
            f.down_s,
            f.recovered_s.map(|s| format!("{s:.1}")).unwrap_or("not within 90".into())
        );
    }
    println!();
    println!(
        "survivors: {}",
        survivor_report.iter().map(|s| s["end"].as_str().unwrap_or("").to_string()).collect::<Vec<_>>().join("; ")
    );
    println!(
        "requests: {requests}; faults: {}; violations: {}; sessions of creates whose gateway died: {unheard}",
        injected.len(),
        violations.len()
    );
    for v in &violations {
        println!("  VIOLATION {v}");
    }
    let out = json!({
        "seed": seed,
        "duration_s": args.duration_s,
        "rate": args.rate,
        "topology": {
            "redis": if args.cluster { "cluster of 3 masters" } else { "single" },
            "gateways": w.gateways.len(),
            "nodes": w.nodes.iter().map(|n| json!({"id": n.id, "docker": n.socket.unwrap_or("/var/run/docker.sock")})).collect::<Vec<_>>(),
            "down_after_s": args.down_after_s, "lost_after_s": args.lost_after_s,
        },
        "requests": requests,
        "calls": r.calls,
        "episodes": r.episodes,
        "sessions_of_lost_creates": unheard,
        "faults": injected,
        "recovery_s": recovery,
        "survivors": survivor_report,
        "quota": quota.as_ref().map(|v| v.clone()).unwrap_or(Value::Null),
        "containers": orphans.as_ref().map(|v| v.clone()).unwrap_or(Value::Null),
        "violations": violations,
        "load_s": load_s,
    });
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
    }
    Ok(violations.is_empty())
}

/// Every tenant's usage back to zero within a minute, and `quotas:verify` finds no drift.
async fn check_quota(api: &Api) -> anyhow::Result<Value> {
    let mut usage = serde_json::Map::new();
    for t in TENANTS.iter().chain([&SURVIVOR_TENANT]) {
        let u = wait_for(Duration::from_secs(60), || async {
            let r = api.call(0, t, Method::GET, "/v1/usage", None, CALL_DEADLINE).await.ok()?;
            let u = r.body["levels"][0]["usage"].clone();
            let zero = ["sessions", "cpus", "memory_mb", "queued"].iter().all(|k| u[k].as_f64() == Some(0.0));
            zero.then_some(u)
        })
        .await;
        match u {
            Ok(u) => usage.insert(t.to_string(), u),
            Err(_) => {
                let r = api.call(0, t, Method::GET, "/v1/usage", None, CALL_DEADLINE).await;
                anyhow::bail!("{t}'s usage did not return to 0 within 60 s: {}", r.map(|r| r.body).unwrap_or_default());
            }
        };
    }
    let r = api
        .call(0, "admin", Method::POST, "/v1/quotas:verify", None, CALL_DEADLINE)
        .await
        .map_err(|o| anyhow::anyhow!("quotas:verify: {o:?}"))?;
    anyhow::ensure!(r.status == 200, "quotas:verify: {} {}", r.status, r.body);
    let drift = r.body["drift"].as_array().cloned().unwrap_or_default();
    anyhow::ensure!(drift.is_empty(), "quotas:verify found drift: {}", r.body);
    Ok(json!({"usage": usage, "verify": r.body}))
}

/// Each node's containers are exactly the ledger's sandboxes of it (within 90 s of settling:
/// removals in flight finish), and no container of the run names an unknown node.
async fn check_containers(w: &World) -> anyhow::Result<Value> {
    let ids: HashSet<&str> = w.nodes.iter().map(|n| n.id.as_str()).collect();
    let end = Instant::now() + Duration::from_secs(90);
    loop {
        let mut problems = Vec::new();
        let mut counts = BTreeMap::new();
        let l = w.ledger().await?;
        for socket in [None, Some(DOCKER2_SOCKET)] {
            for (c, (_, node)) in w.containers(socket) {
                if !ids.contains(node.as_str()) {
                    problems.push(format!("container {c} names node {node:?}, which is not one of this run's"));
                }
            }
        }
        for n in &w.nodes {
            let docker: Vec<(String, String)> = w
                .containers(n.socket)
                .into_iter()
                .filter(|(_, (_, node))| node == &n.id)
                .map(|(id, (name, _))| (id, name))
                .collect();
            let ledger: Vec<String> = l.sandboxes(&n.id).await?.into_iter().filter_map(|s| s.container).collect();
            // The ledger names a container by id (or a prefix of it) or by name.
            let same = |c: &str, (id, name): &(String, String)| id.starts_with(c) || name == c;
            for d in &docker {
                if !ledger.iter().any(|c| same(c, d)) {
                    problems.push(format!("{}: container {} ({}) is not in the ledger (orphan)", n.id, d.1, d.0));
                }
            }
            for c in &ledger {
                if !docker.iter().any(|d| same(c, d)) {
                    problems.push(format!("{}: the ledger's container {c} does not exist", n.id));
                }
            }
            counts.insert(n.id.clone(), docker.len());
        }
        if problems.is_empty() {
            return Ok(json!({"per_node": counts}));
        }
        if Instant::now() >= end {
            anyhow::bail!("{}", problems.join("; "));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

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
//! - `dockerd2`: the second dockerd, under the third node, restarted by `ensure_dockerd2`.
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
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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
use tests::{StackOpts, rand_hex};

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
    #[arg(long, value_delimiter = ',', default_values = ["gateway", "pool-manager", "node-lost", "redis", "dockerd2"])]
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

// ---------------------------------------------------------------------------------------------
// The deployment

/// A process of the deployment: how to start it, and the running child.
struct Proc {
    name: String,
    program: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

impl Proc {
    fn new(name: &str, program: &Path, args: Vec<String>, dir: &Path) -> Proc {
        Proc { name: name.into(), program: program.into(), args, log: dir.join(format!("{name}.log")), child: None }
    }

    fn start(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let child = Command::new(&self.program)
            .args(&self.args)
            .env("RUST_LOG", std::env::var("SANDPOOL_CHAOS_LOG").unwrap_or_else(|_| PROCESS_LOG.to_string()))
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("start {} ({})", self.name, self.program.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL, and reap.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Exited by itself (a crash): the run reports it.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

struct NodeProc {
    id: String,
    /// The dockerd socket it runs on (`None`: the host's).
    socket: Option<&'static str>,
    proc: Proc,
}

struct World {
    dir: PathBuf,
    keep: bool,
    prefix: String,
    redis_url: String,
    redis_ports: Vec<u16>,
    redis: Vec<Proc>,
    gateways: Vec<(String, Proc)>,
    nodes: Vec<NodeProc>,
    /// Run only for the `autoscaler` fault.
    autoscaler: Option<Proc>,
    lib_sh: PathBuf,
    config: config::Config,
}

impl World {
    async fn start(args: &Args, cluster: bool) -> anyhow::Result<World> {
        let bin = match &args.sandpool {
            Some(p) => p.clone(),
            None => std::env::current_exe()?.with_file_name("sandpool"),
        };
        anyhow::ensure!(bin.exists(), "no sandpool binary at {} (cargo build -p sandpool)", bin.display());
        let redis_server = which("redis-server")?;
        anyhow::ensure!(
            docker(Some(DOCKER2_SOCKET), &["info", "-f", "{{.ID}}"]).is_ok(),
            "the second dockerd does not answer on {DOCKER2_SOCKET} (scripts/lib.sh: ensure_dockerd2)"
        );
        let prefix = format!("spchaos-{}", rand_hex(8));
        let dir = std::env::temp_dir().join(&prefix);
        std::fs::create_dir_all(&dir)?;
        let mut w = World {
            dir: dir.clone(),
            keep: args.keep,
            prefix: prefix.clone(),
            redis_url: String::new(),
            redis_ports: Vec::new(),
            redis: Vec::new(),
            gateways: Vec::new(),
            nodes: Vec::new(),
            autoscaler: None,
            lib_sh: args.lib_sh.clone(),
            config: tests::config_for(&prefix, "x", &StackOpts::default()),
        };
        // Redis: one server, or three cluster masters; AOF on, each in a directory of its own.
        for i in 0..if cluster { 3 } else { 1 } {
            let port = free_port()?;
            let data = dir.join(format!("redis-{i}"));
            std::fs::create_dir_all(&data)?;
            let mut a: Vec<String> = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--dir",
                &data.to_string_lossy(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            if cluster {
                a.extend(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"].map(String::from));
            }
            let mut p = Proc::new(&format!("redis-{i}"), &redis_server, a, &dir);
            p.start()?;
            w.redis.push(p);
            w.redis_ports.push(port);
        }
        for &port in &w.redis_ports {
            wait_for(Duration::from_secs(20), || redis_ping(port)).await.with_context(|| format!("redis on {port}"))?;
        }
        if cluster {
            let mut a = vec!["--cluster".to_string(), "create".into()];
            a.extend(w.redis_ports.iter().map(|p| format!("127.0.0.1:{p}")));
            a.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
            let out = Command::new("redis-cli").args(&a).output()?;
            anyhow::ensure!(
                out.status.success(),
                "redis-cli --cluster create: {}",
                String::from_utf8_lossy(&out.stdout)
            );
            let ports = w.redis_ports.clone();
            wait_for(Duration::from_secs(30), || async { cluster_ok(&ports) })
                .await
                .context("the cluster did not reach cluster_state:ok")?;
        }
        w.redis_url = w.redis_ports.iter().map(|p| format!("redis://127.0.0.1:{p}")).collect::<Vec<_>>().join(",");

        let node = format!("c{}", rand_hex(6));
        let opts = StackOpts {
            warm: 3,
            max_queue: 10_000,
            default_wait: "10s",
            redis_url: Some(w.redis_url.clone()),
            node_toml: format!("down_after = \"{}s\"\nlost_after = \"{}s\"", args.down_after_s, args.lost_after_s),
            ..Default::default()
        };
        let cfg = dir.join("sandpool.toml");
        std::fs::write(&cfg, tests::config_toml(&prefix, &node, &opts))?;
        w.config = tests::config_for(&prefix, &node, &opts);
        let cfg = cfg.to_string_lossy().into_owned();
        for i in 0..2 {
            let port = free_port()?;
            let a = ["--config", &cfg, "--gateway-listen", &format!("127.0.0.1:{port}"), "gateway"];
            let mut p = Proc::new(&format!("gateway-{i}"), &bin, a.map(String::from).to_vec(), &dir);
            p.start()?;
            w.gateways.push((format!("http://127.0.0.1:{port}"), p));
        }
        for (i, socket) in [None, None, Some(DOCKER2_SOCKET)].into_iter().enumerate() {
            let id = format!("{node}-{i}");
            let port = free_port()?;
            let mut a = vec!["--config".to_string(), cfg.clone(), "--node-id".into(), id.clone()];
            a.extend(["--pool-manager-listen".into(), format!("127.0.0.1:{port}")]);
            if let Some(s) = socket {
                a.extend(["--docker-socket".into(), s.into()]);
            }
            a.push("pool-manager".into());
            let mut p = Proc::new(&format!("node-{i}"), &bin, a, &dir);
            p.start()?;
            w.nodes.push(NodeProc { id, socket, proc: p });
        }
        if args.faults.contains(&Fault::Autoscaler) {
            let mut p = Proc::new("autoscaler", &bin, vec!["--config".into(), cfg, "autoscaler".into()], &dir);
            p.start()?;
            w.autoscaler = Some(p);
        }
        Ok(w)
    }

    async fn ledger(&self) -> anyhow::Result<ledger::Ledger> {
        Ok(ledger::Ledger::connect(&self.redis_url, &self.prefix).await?)
    }

    /// Every node live (heard within `down_after`) with a warm sandbox, every gateway ready, and
    /// the autoscaler deciding.
    async fn healthy(&self, http: &reqwest::Client) -> bool {
        for (url, _) in &self.gateways {
            let r = http.get(format!("{url}/readyz")).timeout(Duration::from_secs(5)).send().await;
            if !matches!(r, Ok(r) if r.status().as_u16() == 204) {
                return false;
            }
        }
        for n in &self.nodes {
            if self.node_serves(&n.id).await.is_none() {
                return false;
            }
        }
        self.autoscaler.is_none() || self.autoscaler_decides(0).await.is_some()
    }

    /// Redis's clock now, and the stamp of each node's pool targets (the autoscaler's last
    /// decision for it: the last complete second of the same clock).
    async fn target_stamps(&self) -> Option<(u64, Vec<u64>)> {
        let read = async {
            let l = self.ledger().await.ok()?;
            let now = l.now_ms().await.ok()?;
            let mut stamps = Vec::new();
            for n in &self.nodes {
                stamps.push(l.targets(&n.id).await.ok()?.0);
            }
            Some((now, stamps))
        };
        tokio::time::timeout(Duration::from_secs(5), read).await.ok().flatten()
    }

    /// Every node's pool targets were written by the autoscaler lately, and later than `after`
    /// (a stamp of [`World::autoscaler_stamp`]).
    async fn autoscaler_decides(&self, after: u64) -> Option<()> {
        let (now, stamps) = self.target_stamps().await?;
        stamps.iter().all(|&at| at > after && now.saturating_sub(at) <= AUTOSCALER_FRESH_MS).then_some(())
    }

    /// The latest stamp of the autoscaler's targets on any node (0 if none can be read).
    async fn autoscaler_stamp(&self) -> u64 {
        self.target_stamps().await.and_then(|(_, stamps)| stamps.into_iter().max()).unwrap_or(0)
    }

    /// The node holds its lease, heard within `down_after`, and has a warm `bb` sandbox (unless
    /// the autoscaler's fresh targets keep none there: it keeps a small pool whole on one node).
    async fn node_serves(&self, id: &str) -> Option<()> {
        let check = async {
            let l = self.ledger().await.ok()?;
            let states = l.node_states().await.ok()?;
            let s = states.iter().find(|s| s.info.id == id)?;
            let live = s.silent_ms < self.config.node.down_after.as_millis() as u64;
            let idle = l.idle_counts(id, &["bb"]).await.ok()?[0];
            let (at, targets) = l.targets(id).await.ok()?;
            let none_wanted = self.autoscaler.is_some()
                && l.now_ms().await.ok()?.saturating_sub(at) <= AUTOSCALER_FRESH_MS
                && targets.get("bb").copied().unwrap_or(0) == 0;
            (live && (idle > 0 || none_wanted)).then_some(())
        };
        tokio::time::timeout(Duration::from_secs(5), check).await.ok().flatten()
    }

    fn restore_dockerd2(&self) -> anyhow::Result<()> {
        let out = Command::new("bash")
            .arg("-c")
            .arg("source \"$0\" && ensure_dockerd2")
            .arg(&self.lib_sh)
            .output()
            .context("run ensure_dockerd2")?;
        anyhow::ensure!(out.status.success(), "ensure_dockerd2: {}", String::from_utf8_lossy(&out.stderr));
        Ok(())
    }

    /// The containers of this run on `socket`'s engine: id -> (name, node label).
    fn containers(&self, socket: Option<&str>) -> BTreeMap<String, (String, String)> {
        let filter = format!("label=sandpool.prefix={}", self.prefix);
        let format = "{{.ID}} {{.Names}} {{.Label \"sandpool.node\"}}";
        let out =
            docker(socket, &["ps", "-a", "--no-trunc", "--filter", &filter, "--format", format]).unwrap_or_default();
        out.lines()
            .filter_map(|l| {
                let mut f = l.split(' ');
                Some((f.next()?.to_string(), (f.next()?.to_string(), f.next().unwrap_or("").to_string())))
            })
            .collect()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for (_, g) in &mut self.gateways {
            g.kill();
        }
        for n in &mut self.nodes {
            n.proc.kill();
        }
        if let Some(a) = &mut self.autoscaler {
            a.kill();
        }
        for r in &mut self.redis {
            r.kill();
        }
        if docker(Some(DOCKER2_SOCKET), &["info", "-f", "{{.ID}}"]).is_err()
            && let Err(e) = self.restore_dockerd2()
        {
            eprintln!("sandpool-chaos: could not restart the second dockerd: {e:#}");
        }
        for socket in [None, Some(DOCKER2_SOCKET)] {
            let ids: Vec<String> = self.containers(socket).into_keys().collect();
            if !ids.is_empty() {
                let mut a = vec!["rm", "-f"];
                a.extend(ids.iter().map(String::as_str));
                let _ = docker(socket, &a);
            }
        }
        let run = Path::new(tests::TEST_STATE_DIR).join("run");
        for e in std::fs::read_dir(&run).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if self.nodes.iter().any(|n| name.starts_with(&format!("{}.", n.id))) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        if self.keep {
            eprintln!("sandpool-chaos: kept {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn which(program: &str) -> anyhow::Result<PathBuf> {
    let out = Command::new("sh").arg("-c").arg(format!("command -v {program}")).output()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    anyhow::ensure!(!p.is_empty(), "{program} not found (scripts/lib.sh installs it)");
    Ok(p.into())
}

fn docker(socket: Option<&str>, args: &[&str]) -> anyhow::Result<String> {
    let mut c = Command::new("docker");
    if let Some(s) = socket {
        c.arg("-H").arg(format!("unix://{s}"));
    }
    let out = c.args(args).output()?;
    anyhow::ensure!(out.status.success(), "docker {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn redis_ping(port: u16) -> Option<()> {
    let out = tokio::process::Command::new("redis-cli").args(["-p", &port.to_string(), "ping"]).output().await.ok()?;
    (String::from_utf8_lossy(&out.stdout).trim() == "PONG").then_some(())
}

fn cluster_ok(ports: &[u16]) -> Option<()> {
    for p in ports {
        let out = Command::new("redis-cli").args(["-p", &p.to_string(), "cluster", "info"]).output().ok()?;
        if !String::from_utf8_lossy(&out.stdout).contains("cluster_state:ok") {
            return None;
        }
    }
    Some(())
}

/// Polls `f` every 250 ms until it gives `Some`, for at most `within`.
async fn wait_for<T, F, Fut>(within: Duration, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let end = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        anyhow::ensure!(Instant::now() < end, "not within {within:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Calls and what they are counted as

/// What a call came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
enum Outcome {
    Ok,
    /// 429 or 503 with Retry-After: the platform said "not now".
    Refused,
    /// The session ended, and the answer says why (404 `session_gone`, 502 `sandbox_failed`).
    Ended,
    /// The gateway died while the call was in flight (no answer): expected of a killed gateway.
    ConnectionLost,
    /// Any other error answer (4xx/5xx) that is not an invariant broken.
    Failed,
    // Violations:
    /// Past its deadline.
    Hung,
    /// 429/503 without Retry-After.
    NoRetryAfter,
    /// 500: a bug.
    Internal,
    /// 404 `not_found` for a session this client holds: the platform forgot it.
    UnknownSession,
    /// 200 with the wrong content (an echo that does not echo, a file that differs).
    WrongAnswer,
    /// No gateway could be reached (only one is ever killed at a time).
    NoGateway,
}

impl Outcome {
    fn violation(self) -> bool {
        self >= Outcome::Hung
    }
}

struct Reply {
    status: u16,
    body: Value,
    bytes: Vec<u8>,
    retry_after: Option<f64>,
}

/// Counters and findings, shared by every task of the run.
#[derive(Default)]
struct Record {
    t0: Option<Instant>,
    calls: BTreeMap<String, BTreeMap<Outcome, u64>>,
    violations: Vec<Value>,
    /// sandbox id -> the session it was granted to.
    grants: HashMap<String, String>,
    /// Episodes: started, completed (every step answered, deleted), and the rest.
    episodes: BTreeMap<&'static str, u64>,
    /// Sessions this client opened and has not seen end: id -> tenant.
    open: HashMap<String, String>,
    /// Creates whose gateway died under them, per tenant: each may have left a session the
    /// client never heard of (it lives until its idle timeout; RELIABILITY.md, open).
    lost_creates: HashMap<String, usize>,
}

impl Record {
    fn at_s(&self) -> f64 {
        self.t0.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0)
    }

    fn violation(&mut self, what: &str, detail: String) {
        let at_s = (self.at_s() * 10.0).round() / 10.0;
        eprintln!("VIOLATION at {at_s} s: {what}: {detail}");
        self.violations.push(json!({"at_s": at_s, "what": what, "detail": detail}));
    }
}

/// The outcome of an answer that is not the call's success.
fn classify(r: &Reply) -> Outcome {
    let code = r.body["code"].as_str().unwrap_or("");
    match r.status {
        429 | 503 if r.retry_after.is_some() => Outcome::Refused,
        429 | 503 => Outcome::NoRetryAfter,
        404 if code == "session_gone" => Outcome::Ended,
        // The session ended (its record says why), or its sandbox is gone and the ending is
        // on its way (the node saw the container die before the record was written).
        502 if code == "sandbox_failed" => Outcome::Ended,
        404 if code == "not_found" => Outcome::UnknownSession,
        500 => Outcome::Internal,
        _ => Outcome::Failed,
    }
}

#[derive(Clone)]
struct Api {
    http: reqwest::Client,
    gateways: Arc<Vec<String>>,
    tokens: Arc<HashMap<String, String>>,
    rec: Arc<Mutex<Record>>,
}

impl Api {
    /// One call through gateway `gw` (the other if `gw` cannot be connected to), bounded by
    /// `deadline`. `Err` carries the outcome when there is no answer.
    async fn call(
        &self,
        gw: usize,
        tenant: &str,
        method: Method,
        path: &str,
        body: Option<Body>,
        deadline: Duration,
    ) -> Result<Reply, Outcome> {
        // The request id the gateways' access logs (and the nodes') carry: a hang names it.
        let request_id = rand_hex(8);
        let tried = Mutex::new(Vec::new());
        let attempt = async {
            for i in 0..self.gateways.len() {
                let url = &self.gateways[(gw + i) % self.gateways.len()];
                tried.lock().unwrap().push(url.clone());
                let mut req = self
                    .http
                    .request(method.clone(), format!("{url}{path}"))
                    .bearer_auth(&self.tokens[tenant])
                    .header("x-request-id", &request_id);
                match &body {
                    Some(Body::Json(v)) => req = req.json(v),
                    Some(Body::Bytes(b)) => req = req.body(b.clone()),
                    None => {}
                }
                match req.send().await {
                    Ok(resp) => {
                        let status = resp.status().as_u16();
                        let retry_after = resp
                            .headers()
                            .get(reqwest::header::RETRY_AFTER)
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.parse::<f64>().ok());
                        let bytes = match resp.bytes().await {
                            Ok(b) => b.to_vec(),
                            Err(_) => return Err(Outcome::ConnectionLost),
                        };
                        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                        return Ok(Reply { status, body, bytes, retry_after });
                    }
                    // Nothing listens there: the next gateway, as a load balancer would.
                    Err(e) if e.is_connect() => continue,
                    Err(_) => return Err(Outcome::ConnectionLost),
                }
            }
            Err(Outcome::NoGateway)
        };
        match tokio::time::timeout(deadline, attempt).await {
            Ok(r) => r,
            Err(_) => {
                let tried = tried.lock().unwrap().join(", then ");
                eprintln!("  no answer within {deadline:?}: {method} {path}, request {request_id}, via {tried}");
                Err(Outcome::Hung)
            }
        }
    }

    /// Counts a call's outcome under `kind`; a violation is recorded with `detail`.
    fn count(&self, kind: &str, outcome: Outcome, detail: impl FnOnce() -> String) {
        let mut r = self.rec.lock().unwrap();
        *r.calls.entry(kind.to_string()).or_default().entry(outcome).or_default() += 1;
        if outcome.violation() {
            r.violation(&format!("{kind}: {outcome:?}"), detail());
        } else if outcome == Outcome::Failed {
            // Not an invariant broken, but not an answer a fault explains either: say which.
            eprintln!("[{:.1} s] {kind} failed: {}", r.at_s(), detail());
        }
    }

    /// A call on a session: its outcome, counted, with the reply when it was a success.
    #[allow(clippy::too_many_arguments)]
    async fn session_call(
        &self,
        kind: &str,
        gw: usize,
        tenant: &str,
        method: Method,
        path: &str,
        body: Option<Body>,
        ok: u16,
    ) -> (Outcome, Option<Reply>) {
        self.checked_call(kind, gw, tenant, method, path, body, ok, |_| None).await
    }

    /// `session_call` whose success is also checked: `wrong` names what is wrong with a reply
    /// of status `ok` (then the outcome is `WrongAnswer`), or `None` when it is right.
    #[allow(clippy::too_many_arguments)]
    async fn checked_call(
        &self,
        kind: &str,
        gw: usize,
        tenant: &str,
        method: Method,
        path: &str,
        body: Option<Body>,
        ok: u16,
        wrong: impl FnOnce(&Reply) -> Option<String>,
    ) -> (Outcome, Option<Reply>) {
        match self.call(gw, tenant, method.clone(), path, body, CALL_DEADLINE).await {
            Ok(r) if r.status == ok => {
                let wrong = wrong(&r);
                let o = if wrong.is_some() { Outcome::WrongAnswer } else { Outcome::Ok };
                self.count(kind, o, || format!("{method} {path}: {}", wrong.unwrap_or_default()));
                (o, Some(r))
            }
            Ok(r) => {
                let o = classify(&r);
                self.count(kind, o, || format!("{method} {path}: {} {}", r.status, r.body));
                (o, Some(r))
            }
            Err(o) => {
                self.count(kind, o, || format!("{method} {path}"));
                (o, None)
            }
        }
    }

    /// Runs `echo <word>` and checks the answer: Ok only when it echoed.
    async fn echo(&self, kind: &str, gw: usize, tenant: &str, sid: &str, word: &str) -> (Outcome, Option<Reply>) {
        let path = format!("/v1/sessions/{sid}/exec");
        let body = Body::Json(json!({"cmd": format!("echo {word}"), "timeout_ms": 10_000}));
        let wrong = |r: &Reply| {
            let right = r.body["stdout"].as_str() == Some(&format!("{word}\n")) && r.body["exit_code"] == 0;
            (!right).then(|| format!("echo {word} answered {}", r.body))
        };
        self.checked_call(kind, gw, tenant, Method::POST, &path, Some(body), 200, wrong).await
    }

    /// Writes `data` to `path` in the session and reads it back.
    async fn file_roundtrip(&self, gw: usize, tenant: &str, sid: &str, path: &str, data: Vec<u8>) -> Outcome {
        let url = format!("/v1/sessions/{sid}/files/{path}");
        let (o, _) =
            self.session_call("put_file", gw, tenant, Method::PUT, &url, Some(Body::Bytes(data.clone())), 204).await;
        if o != Outcome::Ok {
            return o;
        }
        self.read_back(gw, tenant, sid, path, &data).await
    }

    async fn read_back(&self, gw: usize, tenant: &str, sid: &str, path: &str, data: &[u8]) -> Outcome {
        let url = format!("/v1/sessions/{sid}/files/{path}");
        match self.call(gw, tenant, Method::GET, &url, None, CALL_DEADLINE).await {
            Ok(r) if r.status == 200 => {
                let o = if r.bytes == data { Outcome::Ok } else { Outcome::WrongAnswer };
                self.count("get_file", o, || {
                    format!("{sid}: {path} read back {} bytes, {} written", r.bytes.len(), data.len())
                });
                o
            }
            Ok(r) => {
                let o = classify(&r);
                self.count("get_file", o, || format!("{sid}: {} {}", r.status, r.body));
                o
            }
            Err(o) => {
                self.count("get_file", o, || format!("{sid}: get {path}"));
                o
            }
        }
    }

    /// Opens a session; `(session, sandbox, node)` on success. A sandbox granted before is
    /// recorded as a double grant.
    async fn create(&self, gw: usize, tenant: &str) -> Option<(String, String)> {
        let body = json!({"template": "bb", "max_wait_s": MAX_WAIT_S, "labels": {"chaos": "1"}});
        let deadline = CALL_DEADLINE + Duration::from_secs(MAX_WAIT_S);
        let r = match self.call(gw, tenant, Method::POST, "/v1/sessions", Some(Body::Json(body)), deadline).await {
            Ok(r) => r,
            Err(o) => {
                self.count("create", o, || format!("{tenant}: create"));
                if o == Outcome::ConnectionLost {
                    *self.rec.lock().unwrap().lost_creates.entry(tenant.to_string()).or_default() += 1;
                }
                return None;
            }
        };
        if r.status != 201 {
            let o = match classify(&r) {
                // Creates have no session to be unknown: a 404 is some other failure.
                Outcome::UnknownSession | Outcome::Ended => Outcome::Failed,
                o => o,
            };
            self.count("create", o, || format!("{tenant}: {} {}", r.status, r.body));
            return None;
        }
        self.count("create", Outcome::Ok, String::new);
        let sid = r.body["session_id"].as_str().unwrap_or_default().to_string();
        let sandbox = r.body["sandbox_id"].as_str().unwrap_or_default().to_string();
        let node = r.body["node"].as_str().unwrap_or_default().to_string();
        let mut rec = self.rec.lock().unwrap();
        rec.open.insert(sid.clone(), tenant.to_string());
        if let Some(before) = rec.grants.insert(sandbox.clone(), sid.clone()) {
            rec.violation("double grant", format!("sandbox {sandbox} on {node} went to {before} and to {sid}"));
        }
        Some((sid, sandbox))
    }

    /// Claims the sandbox for this session: an owner file that must not exist yet.
    async fn claim(&self, gw: usize, tenant: &str, sid: &str, sandbox: &str) -> Outcome {
        let cmd = format!(
            "if [ -e /tmp/.chaos-owner ]; then cat /tmp/.chaos-owner; exit 3; fi; echo {sid} > /tmp/.chaos-owner; echo {sid}"
        );
        let path = format!("/v1/sessions/{sid}/exec");
        let body = Body::Json(json!({"cmd": cmd, "timeout_ms": 10_000}));
        match self.call(gw, tenant, Method::POST, &path, Some(body), CALL_DEADLINE).await {
            Ok(r) if r.status == 200 && r.body["exit_code"] == 3 => {
                self.count("claim", Outcome::WrongAnswer, String::new);
                let owner = r.body["stdout"].as_str().unwrap_or("").trim().to_string();
                self.rec.lock().unwrap().violation(
                    "double grant",
                    format!("sandbox {sandbox} of session {sid} was already claimed by {owner}"),
                );
                Outcome::WrongAnswer
            }
            Ok(r) if r.status == 200 => {
                let right = r.body["stdout"].as_str() == Some(&format!("{sid}\n"));
                let o = if right { Outcome::Ok } else { Outcome::WrongAnswer };
                self.count("claim", o, || format!("{sid}: claim answered {}", r.body));
                o
            }
            Ok(r) => {
                let o = classify(&r);
                self.count("claim", o, || format!("{sid}: {} {}", r.status, r.body));
                o
            }
            Err(o) => {
                self.count("claim", o, || format!("{sid}: claim"));
                o
            }
        }
    }

    /// Ends a session, retrying while the platform says "not now" (for up to a minute).
    async fn delete(&self, gw: usize, tenant: &str, sid: &str) -> Outcome {
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let path = format!("/v1/sessions/{sid}");
            let (o, r) = self.session_call("delete", gw, tenant, Method::DELETE, &path, None, 204).await;
            match o {
                Outcome::Ok | Outcome::Ended => {
                    self.rec.lock().unwrap().open.remove(sid);
                    return o;
                }
                Outcome::Refused | Outcome::ConnectionLost if Instant::now() < until => {
                    let wait = r.and_then(|r| r.retry_after).unwrap_or(1.0).clamp(0.2, 3.0);
                    tokio::time::sleep(Duration::from_secs_f64(wait)).await;
                }
                o => return o,
            }
        }
    }
}

enum Body {
    Json(Value),
    Bytes(Vec<u8>),
}

// ---------------------------------------------------------------------------------------------
// Load

/// One episode: create, claim, a few steps (a long episode keeps going for a while), delete.
async fn episode(api: Api, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let tenant = TENANTS[rng.random_range(0..TENANTS.len())];
    let gw = rng.random_range(0..api.gateways.len());
    let bump = |what: &'static str| *api.rec.lock().unwrap().episodes.entry(what).or_default() += 1;
    bump("started");
    let Some((sid, sandbox)) = api.create(gw, tenant).await else {
        bump("create_failed");
        return;
    };
    let long = rng.random_bool(0.1);
    let steps = if long { rng.random_range(6..12) } else { rng.random_range(1..5) };
    let mut outcome = api.claim(gw, tenant, &sid, &sandbox).await;
    for i in 0..steps {
        if matches!(outcome, Outcome::Ended) || outcome.violation() {
            break;
        }
        let pause = if long { rng.random_range(2000..5000) } else { rng.random_range(0..1500) };
        tokio::time::sleep(Duration::from_millis(pause)).await;
        outcome = match rng.random_range(0..3) {
            0 => api.echo("exec", gw, tenant, &sid, &format!("step-{i}-{}", rng.random::<u32>())).await.0,
            1 => {
                let data: Vec<u8> = (0..rng.random_range(1..64 * 1024)).map(|_| rng.random()).collect();
                api.file_roundtrip(gw, tenant, &sid, &format!("/work/f{i}.bin"), data).await
            }
            _ => {
                let base = format!("/v1/sessions/{sid}");
                let (o, _) =
                    api.session_call("pause", gw, tenant, Method::POST, &format!("{base}/pause"), None, 200).await;
                if o == Outcome::Ok {
                    api.session_call("resume", gw, tenant, Method::POST, &format!("{base}/resume"), None, 200).await.0
                } else {
                    o
                }
            }
        };
        if outcome == Outcome::Refused {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    if outcome == Outcome::Ended {
        api.rec.lock().unwrap().open.remove(&sid);
        bump("ended_by_platform");
        return;
    }
    let d = api.delete(gw, tenant, &sid).await;
    bump(if outcome == Outcome::Ok && d == Outcome::Ok { "completed" } else { "incomplete" });
}

/// A session that lives through the whole run: a file written at the start, an echo every few
/// seconds. Returns its id and the file, for the final check.
struct Survivor {
    sid: String,
    node: String,
    data: Vec<u8>,
}

async fn open_survivors(api: &Api, n: usize, rng: &mut StdRng) -> anyhow::Result<Vec<Survivor>> {
    let mut out = Vec::new();
    for i in 0..n {
        let body = json!({"template": "bb", "labels": {"chaos": "survivor"}});
        let r = api
            .call(i, SURVIVOR_TENANT, Method::POST, "/v1/sessions", Some(Body::Json(body)), CALL_DEADLINE)
            .await
            .map_err(|o| anyhow::anyhow!("survivor create: {o:?}"))?;
        anyhow::ensure!(r.status == 201, "survivor create: {} {}", r.status, r.body);
        let sid = r.body["session_id"].as_str().unwrap_or_default().to_string();
        let node = r.body["node"].as_str().unwrap_or_default().to_string();
        let data: Vec<u8> = (0..4096).map(|_| rng.random()).collect();
        anyhow::ensure!(
            api.file_roundtrip(i, SURVIVOR_TENANT, &sid, "/work/state.bin", data.clone()).await == Outcome::Ok,
            "survivor {sid}: could not write its state"
        );
        api.rec.lock().unwrap().open.insert(sid.clone(), SURVIVOR_TENANT.into());
        out.push(Survivor { sid, node, data });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Faults

#[derive(Serialize)]
struct Injected {
    fault: Fault,
    target: String,
    at_s: f64,
    down_s: f64,
    /// From the restart until the part served again (a gateway ready, a node live with a warm
    /// sandbox, the autoscaler writing targets, Redis answering with every part back).
    recovered_s: Option<f64>,
}

async fn inject(w: &mut World, http: &reqwest::Client, fault: Fault, rng: &mut StdRng, at_s: f64) -> Injected {
    let (target, down) = match fault {
        Fault::Gateway => {
            let i = rng.random_range(0..w.gateways.len());
            w.gateways[i].1.kill();
            (w.gateways[i].1.name.clone(), Duration::from_millis(rng.random_range(2000..6000)))
        }
        Fault::PoolManager | Fault::NodeLost => {
            let i = rng.random_range(0..w.nodes.len());
            w.nodes[i].proc.kill();
            let down_ms = w.config.node.down_after.as_millis() as u64;
            let down = if fault == Fault::NodeLost {
                w.config.node.lost_after + Duration::from_secs(5)
            } else {
                Duration::from_millis(rng.random_range(down_ms / 2..down_ms * 3))
            };
            (w.nodes[i].id.clone(), down)
        }
        Fault::Redis => {
            let i = rng.random_range(0..w.redis.len());
            w.redis[i].kill();
            (w.redis[i].name.clone(), Duration::from_millis(rng.random_range(2000..5000)))
        }
        Fault::Autoscaler => {
            let a = w.autoscaler.as_mut().expect("started for the autoscaler fault");
            a.kill();
            (a.name.clone(), Duration::from_millis(rng.random_range(2000..8000)))
        }
        Fault::Dockerd2 => {
            let pid = std::fs::read_to_string(DOCKER2_PIDFILE).unwrap_or_default();
            let _ = Command::new("kill").args(["-9", pid.trim()]).status();
            ("dockerd2".to_string(), Duration::from_millis(rng.random_range(2000..5000)))
        }
    };
    eprintln!("[{at_s:.1} s] fault: {fault:?} {target}, down {:.1} s", down.as_secs_f64());
    tokio::time::sleep(down).await;
    // The autoscaler serves again once it writes targets stamped later than its last before it died.
    let stamp = if fault == Fault::Autoscaler { w.autoscaler_stamp().await } else { 0 };
    let restarted = Instant::now();
    let started = match fault {
        Fault::Gateway => w.gateways.iter_mut().find(|g| g.1.name == target).map(|g| g.1.start()),
        Fault::PoolManager | Fault::NodeLost => w.nodes.iter_mut().find(|n| n.id == target).map(|n| n.proc.start()),
        Fault::Redis => w.redis.iter_mut().find(|r| r.name == target).map(|r| r.start()),
        Fault::Autoscaler => w.autoscaler.as_mut().map(Proc::start),
        Fault::Dockerd2 => Some(w.restore_dockerd2()),
    };
    if let Some(Err(e)) = started {
        eprintln!("restart of {target} failed: {e:#}");
    }
    let recovered = match fault {
        Fault::Gateway => {
            let url = w.gateways.iter().find(|g| g.1.name == target).map(|g| g.0.clone()).unwrap_or_default();
            wait_for(RECOVERY_BOUND, || async {
                let r = http.get(format!("{url}/readyz")).timeout(Duration::from_secs(5)).send().await.ok()?;
                (r.status().as_u16() == 204).then_some(())
            })
            .await
        }
        Fault::PoolManager | Fault::NodeLost => wait_for(RECOVERY_BOUND, || w.node_serves(&target)).await,
        Fault::Dockerd2 => {
            let id = w.nodes[2].id.clone();
            wait_for(RECOVERY_BOUND, || w.node_serves(&id)).await
        }
        Fault::Redis => wait_for(RECOVERY_BOUND, || async { w.healthy(http).await.then_some(()) }).await,
        Fault::Autoscaler => wait_for(RECOVERY_BOUND, || w.autoscaler_decides(stamp)).await,
    };
    let recovered_s = recovered.ok().map(|()| restarted.elapsed().as_secs_f64());
    eprintln!("  {target} serves again: {recovered_s:?} s after its restart");
    Injected { fault, target, at_s, down_s: down.as_secs_f64(), recovered_s }
}

// ---------------------------------------------------------------------------------------------
// The run

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
                tasks.push(tokio::spawn(episode(api.clone(), rng.random())));
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
            injected.push(inject(&mut w, &http, fault, &mut rng, at_s).await);
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

#[cfg(test)]
mod classify_tests {
    use super::*;

    fn reply(status: u16, code: &str, retry_after: Option<f64>) -> Reply {
        let body = json!({"code": code, "message": "m"});
        Reply { status, bytes: body.to_string().into_bytes(), body, retry_after }
    }

    #[test]
    fn refusals_need_retry_after_and_a_500_or_a_forgotten_session_is_a_violation() {
        assert_eq!(classify(&reply(429, "quota_exceeded", Some(1.0))), Outcome::Refused);
        assert_eq!(classify(&reply(503, "unavailable", Some(1.0))), Outcome::Refused);
        assert_eq!(classify(&reply(503, "unavailable", None)), Outcome::NoRetryAfter);
        assert_eq!(classify(&reply(404, "session_gone", None)), Outcome::Ended);
        assert_eq!(classify(&reply(502, "sandbox_failed", None)), Outcome::Ended);
        assert_eq!(classify(&reply(404, "not_found", None)), Outcome::UnknownSession);
        assert_eq!(classify(&reply(500, "internal", None)), Outcome::Internal);
        assert_eq!(classify(&reply(502, "bad_gateway", None)), Outcome::Failed);
        let violations = [
            Outcome::Hung,
            Outcome::NoRetryAfter,
            Outcome::Internal,
            Outcome::UnknownSession,
            Outcome::WrongAnswer,
            Outcome::NoGateway,
        ];
        for o in violations {
            assert!(o.violation(), "{o:?}");
        }
        for o in [Outcome::Ok, Outcome::Refused, Outcome::Ended, Outcome::ConnectionLost, Outcome::Failed] {
            assert!(!o.violation(), "{o:?}");
        }
    }
}

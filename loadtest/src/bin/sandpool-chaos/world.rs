//! The deployment: its processes (Redis, gateways, pool-managers), started, killed, restarted
//! and cleaned up.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tests::{StackOpts, rand_hex};

use crate::lazy::LazyWorld;
use crate::{AUTOSCALER_FRESH_MS, Args, DOCKER2_SOCKET, Fault, PROCESS_LOG};

/// A process of the deployment: how to start it, and the running child.
pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) program: PathBuf,
    pub(crate) args: Vec<String>,
    pub(crate) log: PathBuf,
    pub(crate) child: Option<Child>,
}

impl Proc {
    pub(crate) fn new(name: &str, program: &Path, args: Vec<String>, dir: &Path) -> Proc {
        Proc { name: name.into(), program: program.into(), args, log: dir.join(format!("{name}.log")), child: None }
    }

    pub(crate) fn start(&mut self) -> anyhow::Result<()> {
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
    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Exited by itself (a crash): the run reports it.
    pub(crate) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub(crate) struct NodeProc {
    pub(crate) id: String,
    /// The dockerd socket it runs on (`None`: the host's).
    pub(crate) socket: Option<&'static str>,
    pub(crate) proc: Proc,
}

pub(crate) struct World {
    pub(crate) dir: PathBuf,
    pub(crate) keep: bool,
    pub(crate) prefix: String,
    pub(crate) redis_url: String,
    pub(crate) redis_ports: Vec<u16>,
    pub(crate) redis: Vec<Proc>,
    pub(crate) gateways: Vec<(String, Proc)>,
    pub(crate) nodes: Vec<NodeProc>,
    /// Run only for the `autoscaler` fault.
    pub(crate) autoscaler: Option<Proc>,
    pub(crate) lib_sh: PathBuf,
    pub(crate) config: config::Config,
    /// The lazy image and its registry (for the `registry` fault). A field, so it is dropped
    /// after `drop` has removed the containers that run on its mount.
    pub(crate) lazy: Option<LazyWorld>,
}

impl World {
    pub(crate) async fn start(args: &Args, cluster: bool) -> anyhow::Result<World> {
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
            lazy: None,
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
        if args.faults.contains(&Fault::Registry) {
            // Docker builds, a push and a conversion: seconds of blocking work, once, at setup.
            w.lazy = Some(tokio::task::block_in_place(|| LazyWorld::build(&dir, &bin, &args.lib_sh))?);
        }
        if args.faults.contains(&Fault::Autoscaler) {
            let mut p = Proc::new("autoscaler", &bin, vec!["--config".into(), cfg, "autoscaler".into()], &dir);
            p.start()?;
            w.autoscaler = Some(p);
        }
        Ok(w)
    }

    pub(crate) async fn ledger(&self) -> anyhow::Result<ledger::Ledger> {
        Ok(ledger::Ledger::connect(&self.redis_url, &self.prefix).await?)
    }

    /// Every node live (heard within `down_after`) with a warm sandbox, every gateway ready, and
    /// the autoscaler deciding.
    pub(crate) async fn healthy(&self, http: &reqwest::Client) -> bool {
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
    pub(crate) async fn target_stamps(&self) -> Option<(u64, Vec<u64>)> {
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
    pub(crate) async fn autoscaler_decides(&self, after: u64) -> Option<()> {
        let (now, stamps) = self.target_stamps().await?;
        stamps.iter().all(|&at| at > after && now.saturating_sub(at) <= AUTOSCALER_FRESH_MS).then_some(())
    }

    /// The latest stamp of the autoscaler's targets on any node (0 if none can be read).
    pub(crate) async fn autoscaler_stamp(&self) -> u64 {
        self.target_stamps().await.and_then(|(_, stamps)| stamps.into_iter().max()).unwrap_or(0)
    }

    /// The node holds its lease, heard within `down_after`, and has a warm `bb` sandbox (unless
    /// the autoscaler's fresh targets keep none there: it keeps a small pool whole on one node).
    pub(crate) async fn node_serves(&self, id: &str) -> Option<()> {
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

    pub(crate) fn restore_dockerd2(&self) -> anyhow::Result<()> {
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
    pub(crate) fn containers(&self, socket: Option<&str>) -> BTreeMap<String, (String, String)> {
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

pub(crate) fn which(program: &str) -> anyhow::Result<PathBuf> {
    let out = Command::new("sh").arg("-c").arg(format!("command -v {program}")).output()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    anyhow::ensure!(!p.is_empty(), "{program} not found (scripts/lib.sh installs it)");
    Ok(p.into())
}

pub(crate) fn docker(socket: Option<&str>, args: &[&str]) -> anyhow::Result<String> {
    let mut c = Command::new("docker");
    if let Some(s) = socket {
        c.arg("-H").arg(format!("unix://{s}"));
    }
    let out = c.args(args).output()?;
    anyhow::ensure!(out.status.success(), "docker {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(crate) async fn redis_ping(port: u16) -> Option<()> {
    let out = tokio::process::Command::new("redis-cli").args(["-p", &port.to_string(), "ping"]).output().await.ok()?;
    (String::from_utf8_lossy(&out.stdout).trim() == "PONG").then_some(())
}

pub(crate) fn cluster_ok(ports: &[u16]) -> Option<()> {
    for p in ports {
        let out = Command::new("redis-cli").args(["-p", &p.to_string(), "cluster", "info"]).output().ok()?;
        if !String::from_utf8_lossy(&out.stdout).contains("cluster_state:ok") {
            return None;
        }
    }
    Some(())
}

/// Polls `f` every 250 ms until it gives `Some`, for at most `within`.
pub(crate) async fn wait_for<T, F, Fut>(within: Duration, mut f: F) -> anyhow::Result<T>
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

// One file for now: the Stack with its drop guards (Cleanup, NodeGuard, KillableGateway), then
// the Client and container probes every test uses. Those last 130 lines are a seam (a future
// `client.rs`), left unsplit while several engineers edit this file at once.
//! The harness for end-to-end tests and benchmarks: a whole sandpool stack (pool-manager and
//! gateway, in this process) on the real Redis and Docker, under a key prefix and container
//! label of its own, cleaned up when dropped, pass or fail.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use config::{Config, Overrides};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

pub mod corpus;
pub mod own_registry;

/// The image every test template uses (built by `scripts/test` from images/busybox).
pub const BUSYBOX_IMAGE: &str = "sandpool/busybox:latest";

/// The Redis tests run on: SANDPOOL_TEST_REDIS, one URL or a Redis Cluster's seeds
/// (comma-separated; `scripts/test` runs a subset on a cluster).
pub fn redis_url() -> String {
    std::env::var("SANDPOOL_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A connection to the tests' Redis for commands of a test's own (single Redis or cluster
/// alike: each command goes to its keys' slot).
pub async fn redis_conn() -> ledger::RedisConn {
    ledger::RedisConn::open(&redis_url()).await.expect("connect to the tests' redis")
}

/// What a stack under test looks like; `Default` is one node with two small templates.
#[derive(Debug, Clone)]
pub struct StackOpts {
    /// Extra TOML appended to the generated config (more templates, overrides).
    pub extra_toml: String,
    /// Extra keys of the `[pool_manager]` table (`max_sandboxes = 2`).
    pub pool_manager_toml: String,
    /// Extra keys of the `[node]` table (`down_after = "3s"`).
    pub node_toml: String,
    /// Extra keys of the `[gateway]` table (`max_async_in_flight = 8`).
    pub gateway_toml: String,
    /// The stack's Redis (a URL, or a cluster's seeds); default `redis_url()`.
    pub redis_url: Option<String>,
    /// Warm pool size of the `bb` (agent) and `bbd` (docker exec) templates.
    pub warm: u32,
    pub warm_docker: u32,
    pub max_creates_in_flight: usize,
    /// How long a session request waits for a sandbox by default.
    pub default_wait: &'static str,
    pub create_rate: f64,
    pub max_queue: usize,
    pub max_output_bytes: u64,
    pub max_body_bytes: u64,
    /// CPU limit of the test templates.
    pub cpus: f64,
    /// The agent template's CFS period (`cpu_period`); the config's default when `None`.
    pub cpu_period: Option<std::time::Duration>,
    /// Run the autoscaler too (pools then follow its targets, not `warm`).
    pub autoscaler: bool,
    /// Install the metrics recorder and serve `GET /metrics` on a port of its own
    /// (`Stack::metrics_url`). The recorder is process-wide: tests running in the same process
    /// see each other's series, so filter by the stack's node label.
    pub metrics: bool,
}

impl Default for StackOpts {
    fn default() -> Self {
        StackOpts {
            extra_toml: String::new(),
            pool_manager_toml: String::new(),
            node_toml: String::new(),
            gateway_toml: String::new(),
            redis_url: None,
            warm: 2,
            warm_docker: 0,
            max_creates_in_flight: 4,
            default_wait: "20s",
            create_rate: 50.0,
            max_queue: 4096,
            max_output_bytes: 1 << 20,
            max_body_bytes: 16 << 20,
            cpus: 0.5,
            cpu_period: None,
            autoscaler: false,
            metrics: false,
        }
    }
}

/// Deletes a prefix's Redis keys and Docker containers on drop.
pub struct Cleanup {
    pub prefix: String,
    /// The Redis (or a cluster's seeds) the keys are on: `redis_url()` unless a stack names
    /// its own (`StackOpts::redis_url`).
    pub redis: String,
    /// The stack's node: its sandboxes' socket directories (`<state_dir>/run/<node>.*`) go too.
    pub node: String,
}

/// The state directory of every test stack (`config_toml`).
/// The pool-managers' `state_dir` in tests (agent binary, sockets' directories).
pub const TEST_STATE_DIR: &str = "/tmp/sandpool-test-state";

/// Removes the socket directories of `node`'s sandboxes (`<state_dir>/run/<node>.*`).
fn remove_run_dirs(node: &str) {
    let run = std::path::Path::new(TEST_STATE_DIR).join("run");
    let (mine, record) = (format!("{node}."), format!(".socket-{node}."));
    for e in std::fs::read_dir(&run).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&mine) {
            let _ = std::fs::remove_dir_all(e.path());
        } else if name.starts_with(&record) {
            // The node's record of which socket the agent made.
            let _ = std::fs::remove_file(e.path());
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        remove_run_dirs(&self.node);
        let filter = format!("label=sandpool.prefix={}", self.prefix);
        let remove_containers = || {
            if let Ok(out) = std::process::Command::new("docker").args(["ps", "-aq", "--filter", &filter]).output() {
                let ids: Vec<String> =
                    String::from_utf8_lossy(&out.stdout).split_whitespace().map(String::from).collect();
                if !ids.is_empty() {
                    let _ = std::process::Command::new("docker").arg("rm").arg("-f").args(&ids).output();
                }
            }
        };
        remove_containers();
        // Twice: a create the stack had sent when it stopped is finished by Docker all the
        // same, after the first listing (a CI run left one such container, state `created`).
        std::thread::sleep(std::time::Duration::from_millis(750));
        remove_containers();
        // The prefix's egress networks, and the host rules that name their bridges.
        if let Ok(out) =
            std::process::Command::new("docker").args(["network", "ls", "-q", "--filter", &filter]).output()
        {
            for net in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let bridge = std::process::Command::new("docker")
                    .args(["network", "inspect", "-f", "{{index .Options \"com.docker.network.bridge.name\"}}", net])
                    .output();
                if let Ok(b) = bridge {
                    let iface = String::from_utf8_lossy(&b.stdout).trim().to_string();
                    if !iface.is_empty() {
                        let _ = pool_manager::egress::firewall::remove(&iface);
                    }
                }
                let _ = std::process::Command::new("docker").args(["network", "rm", net]).output();
            }
        }
        // The prefix's keys, on every master when SANDPOOL_TEST_REDIS is a cluster's seeds.
        let _ = ledger::delete_all_keys_blocking(&self.redis, &self.prefix);
    }
}

/// A running stack. Dropping it stops nothing gracefully but removes every trace.
pub struct Stack {
    pub config: Arc<Config>,
    pub url: String,
    pub node: Arc<pool_manager::Node>,
    /// `http://127.0.0.1:<port>/metrics` when started with `StackOpts::metrics`.
    pub metrics_url: Option<String>,
    pm_cancel: CancellationToken,
    gw_cancel: CancellationToken,
    pm: Option<pool_manager::Running>,
    pub http: reqwest::Client,
    // Last, so it runs after the stack's tasks are told to stop.
    pub cleanup: Cleanup,
}

pub fn config_for(prefix: &str, node: &str, o: &StackOpts) -> Config {
    let overrides = Overrides { docker_socket: docker_host_socket(), ..Default::default() };
    Config::from_toml(&config_toml(prefix, node, o), &overrides).expect("test config is valid")
}

/// The engine `DOCKER_HOST` names (`unix://...`), which the harness's `docker` commands use
/// too: tests can run against a second dockerd (one with a bounded data root, say).
pub fn docker_host_socket() -> Option<String> {
    std::env::var("DOCKER_HOST").ok().filter(|h| h.starts_with("unix://"))
}

/// The TOML of a test stack's config (for tests that start the `sandpool` binary).
pub fn config_toml(prefix: &str, node: &str, o: &StackOpts) -> String {
    format!(
        r#"
[node]
id = "{node}"
{node_extra}
[redis]
url = "{redis}"
prefix = "{prefix}"
[gateway]
listen = "127.0.0.1:0"
max_body_bytes = {max_body}
max_queue = {max_queue}
default_wait = "{wait}"
{gw_extra}
[pool_manager]
listen = "127.0.0.1:0"
secret = "test-internal-secret-0123456789"
state_dir = "{state_dir}"
max_creates_in_flight = {mcif}
create_rate = {rate}
max_output_bytes = {mob}
{pm_extra}
[auth]
key = "test-jwt-key-0123456789abcdef"
[telemetry]
metrics_listen = "off"
[templates.bb]
image = "{img}"
exec = "agent"
workdir = "/work"
cpus = {cpus}
{cpu_period}memory_mb = 128
pids = 1024
warm = {warm}
idle_timeout = "10m"
max_lifetime = "1h"
env = {{ SANDPOOL_TEMPLATE = "bb" }}
[templates.bbd]
image = "{img}"
exec = "docker"
workdir = "/work"
cpus = {cpus}
memory_mb = 128
pids = 1024
warm = {warm_docker}
env = {{ SANDPOOL_TEMPLATE = "bbd" }}
{extra}
"#,
        redis = o.redis_url.clone().unwrap_or_else(redis_url),
        max_body = o.max_body_bytes,
        mcif = o.max_creates_in_flight,
        wait = o.default_wait,
        rate = o.create_rate,
        max_queue = o.max_queue,
        mob = o.max_output_bytes,
        img = BUSYBOX_IMAGE,
        warm = o.warm,
        warm_docker = o.warm_docker,
        extra = o.extra_toml,
        pm_extra = o.pool_manager_toml,
        node_extra = o.node_toml,
        gw_extra = o.gateway_toml,
        cpus = o.cpus,
        cpu_period = o.cpu_period.map(|p| format!("cpu_period = \"{}ms\"\n", p.as_millis())).unwrap_or_default(),
        state_dir = TEST_STATE_DIR,
    )
}

pub fn rand_hex(n: usize) -> String {
    (0..n).map(|_| format!("{:x}", rand::random::<u8>() % 16)).collect()
}

impl Stack {
    pub async fn start(opts: StackOpts) -> Stack {
        let prefix = format!("sptest-{}", rand_hex(10));
        let node = format!("n{}", rand_hex(6));
        let redis = opts.redis_url.clone().unwrap_or_else(redis_url);
        let cleanup = Cleanup { prefix: prefix.clone(), redis, node: node.clone() };
        let config = Arc::new(config_for(&prefix, &node, &opts));
        let pm_cancel = CancellationToken::new();
        let gw_cancel = CancellationToken::new();
        // Before the roles start, so everything they record is kept; stops with the stack.
        let metrics_url = if opts.metrics {
            let listen = "127.0.0.1:0".parse().expect("an address");
            let (addr, _task) = telemetry::metrics::serve(listen, gw_cancel.clone()).await.expect("serve /metrics");
            Some(format!("http://{addr}/metrics"))
        } else {
            None
        };
        let pm = pool_manager::start(config.clone(), pm_cancel.clone()).await.expect("start pool-manager");
        let gw = gateway::start(config.clone(), None, gw_cancel.clone()).await.expect("start gateway");
        let url = format!("http://{}", gw.addr);
        let node = pm.node.clone();
        if opts.autoscaler {
            // Runs until the gateway token (the stack's) is cancelled.
            let scaler = autoscaler::live::start(config.clone(), gw_cancel.clone()).await.expect("start autoscaler");
            drop(scaler);
        }
        Stack {
            config,
            url,
            node,
            metrics_url,
            pm_cancel,
            gw_cancel,
            pm: Some(pm),
            http: reqwest::Client::builder().pool_max_idle_per_host(512).build().expect("http client"),
            cleanup,
        }
    }

    /// Stops the pool-manager (its sandboxes keep running) and starts a new one on the same
    /// config, as after a crash and restart of the node agent.
    pub async fn restart_pool_manager(&mut self) {
        self.pm_cancel.cancel();
        if let Some(pm) = self.pm.take() {
            pm.wait().await;
        }
        self.pm_cancel = CancellationToken::new();
        let mut cfg = (*self.config).clone();
        // Keep the old port: gateways cache the node's address.
        let addr = self.node.config.pool_manager.advertise.trim_start_matches("http://").to_string();
        cfg.pool_manager.listen = addr.parse().expect("advertised address");
        cfg.pool_manager.advertise = format!("http://{addr}");
        let pm = pool_manager::start(Arc::new(cfg), self.pm_cancel.clone()).await.expect("restart pool-manager");
        self.node = pm.node.clone();
        self.pm = Some(pm);
    }

    pub fn token(&self, tenant: &str) -> String {
        gateway::mint(&self.config.auth, tenant, false, Duration::from_secs(3600)).expect("mint")
    }

    pub fn client(&self, tenant: &str) -> Client {
        Client { http: self.http.clone(), url: self.url.clone(), token: self.token(tenant) }
    }

    /// A client with the admin scope (sets top-level quotas, reads every pool).
    pub fn admin_client(&self) -> Client {
        let token = gateway::mint(&self.config.auth, "ops", true, Duration::from_secs(3600)).expect("mint");
        Client { http: self.http.clone(), url: self.url.clone(), token }
    }

    pub fn ledger_prefix(&self) -> &str {
        &self.cleanup.prefix
    }

    /// Waits (bounded) until the template's pool has at least `n` idle sandboxes.
    pub async fn wait_idle(&self, template: &str, n: usize, within: Duration) {
        let ledger = &self.node.ledger;
        eventually(within, || async {
            let c = ledger.idle_counts(&self.node.id, &[template]).await.ok()?;
            (c[0] >= n).then_some(())
        })
        .await
        .unwrap_or_else(|| panic!("pool {template} did not reach {n} idle within {within:?}"));
    }

    /// Containers of this stack that Docker has (running or not).
    pub fn containers(&self) -> Vec<String> {
        let filter = format!("label=sandpool.prefix={}", self.cleanup.prefix);
        let out = std::process::Command::new("docker")
            .args(["ps", "-aq", "--no-trunc", "--filter", &filter])
            .output()
            .expect("docker ps");
        String::from_utf8_lossy(&out.stdout).split_whitespace().map(String::from).collect()
    }

    /// Starts a second node (a pool-manager of its own id) on the same Redis, Docker and prefix,
    /// as another host would be. Dropping the guard stops it and waits for it, then removes its
    /// sandboxes' directories; the stack's own cleanup (dropped after it: declare the guard
    /// after the stack) removes every container and key of the prefix, both nodes' alike.
    pub async fn add_node(&self) -> NodeGuard {
        self.add_node_as(&format!("n{}", rand_hex(6))).await
    }

    /// `add_node` with the node id `id` (a node that comes back after it stopped).
    pub async fn add_node_as(&self, id: &str) -> NodeGuard {
        let mut cfg = (*self.config).clone();
        cfg.node.id = Some(id.to_string());
        cfg.pool_manager.listen = "127.0.0.1:0".parse().expect("an address");
        cfg.pool_manager.advertise = "http://127.0.0.1:0".into();
        let cancel = self.pm_cancel.child_token();
        let pm = pool_manager::start(Arc::new(cfg), cancel.clone()).await.expect("start a second pool-manager");
        NodeGuard { node: pm.node.clone(), cancel, pm: Some(pm) }
    }

    /// Starts another gateway replica on the same Redis and nodes; it stops with the stack or
    /// when the returned token is cancelled.
    pub async fn second_gateway(&self) -> (String, CancellationToken) {
        self.gateway_with(self.config.clone()).await
    }

    /// Starts another gateway replica with its own `config` (same Redis and nodes).
    pub async fn gateway_with(&self, config: Arc<Config>) -> (String, CancellationToken) {
        let cancel = self.gw_cancel.child_token();
        let gw = gateway::start(config, None, cancel.clone()).await.expect("start another gateway");
        (format!("http://{}", gw.addr), cancel)
    }

    /// Starts another gateway replica (same Redis and nodes) on a runtime of its own, which
    /// [`KillableGateway::kill`] stops as a killed process would: its tasks stop at their
    /// next await, and what their drop guards spawn never runs (no drain, no clean-up).
    pub async fn killable_gateway(&self) -> KillableGateway {
        let config = self.config.clone();
        let (rt, url) = tokio::task::spawn_blocking(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("a runtime for a killable gateway");
            let gw =
                rt.block_on(gateway::start(config, None, CancellationToken::new())).expect("start a killable gateway");
            (rt, format!("http://{}", gw.addr))
        })
        .await
        .expect("start a killable gateway");
        KillableGateway { url, rt: Some(rt) }
    }

    pub async fn shutdown(mut self) {
        self.gw_cancel.cancel();
        self.pm_cancel.cancel();
        if let Some(pm) = self.pm.take() {
            pm.wait().await;
        }
    }
}

/// A gateway replica that a test can kill (see [`Stack::killable_gateway`]).
pub struct KillableGateway {
    pub url: String,
    rt: Option<tokio::runtime::Runtime>,
}

impl KillableGateway {
    /// Stops the gateway at once, with no drain and no clean-up of what it was doing.
    pub fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for KillableGateway {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.gw_cancel.cancel();
        self.pm_cancel.cancel();
        // Let the stack's tasks stop before `cleanup` runs (it is dropped after this): a
        // create or a ledger write still in flight would otherwise land after the cleanup and
        // be left behind. Only a multi-thread runtime can wait here.
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        if rt.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
            return;
        }
        let pm = self.pm.take();
        tokio::task::block_in_place(|| {
            rt.block_on(async {
                if let Some(pm) = pm {
                    let _ = tokio::time::timeout(Duration::from_secs(15), pm.wait()).await;
                }
                // The gateway's loops and background give-backs see the cancel at once.
                tokio::time::sleep(Duration::from_millis(200)).await;
            })
        });
    }
}

/// A second node of a stack (`Stack::add_node`), stopped when dropped.
pub struct NodeGuard {
    pub node: Arc<pool_manager::Node>,
    cancel: CancellationToken,
    pm: Option<pool_manager::Running>,
}

impl Drop for NodeGuard {
    fn drop(&mut self) {
        self.cancel.cancel();
        let pm = self.pm.take();
        if let Ok(rt) = tokio::runtime::Handle::try_current()
            && rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
            && let Some(pm) = pm
        {
            tokio::task::block_in_place(|| {
                rt.block_on(async {
                    let _ = tokio::time::timeout(Duration::from_secs(15), pm.wait()).await;
                })
            });
        }
        remove_run_dirs(&self.node.id);
    }
}

/// Polls `f` until it yields `Some`, at most `within`.
pub async fn eventually<T, F, Fut>(within: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A tenant's view of the public API.
#[derive(Clone)]
pub struct Client {
    pub http: reqwest::Client,
    pub url: String,
    pub token: String,
}

/// Status and JSON body of an answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
    pub headers: reqwest::header::HeaderMap,
}

impl Client {
    pub async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Answer {
        let mut req = self.http.request(method, format!("{}{}", self.url, path)).bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.expect("gateway answers");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp.bytes().await.expect("body");
        let body = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap_or(Value::Null) };
        Answer { status, body, headers }
    }

    pub async fn create(&self, template: &str) -> Value {
        let a = self.call(reqwest::Method::POST, "/v1/sessions", Some(json!({ "template": template }))).await;
        assert_eq!(a.status, 201, "create session: {:?}", a.body);
        a.body
    }

    pub async fn exec(&self, session: &str, body: Value) -> Answer {
        self.call(reqwest::Method::POST, &format!("/v1/sessions/{session}/exec"), Some(body)).await
    }

    /// Runs a shell command and returns its answer, asserting the call itself succeeded.
    pub async fn sh(&self, session: &str, cmd: &str) -> Value {
        let a = self.exec(session, json!({ "cmd": cmd })).await;
        assert_eq!(a.status, 200, "exec {cmd:?}: {:?}", a.body);
        a.body
    }

    pub async fn delete(&self, session: &str) -> u16 {
        self.call(reqwest::Method::DELETE, &format!("/v1/sessions/{session}"), None).await.status
    }

    pub async fn put_file(&self, session: &str, path: &str, data: Vec<u8>) -> u16 {
        self.http
            .put(format!("{}/v1/sessions/{session}/files/{path}", self.url))
            .bearer_auth(&self.token)
            .body(data)
            .send()
            .await
            .expect("gateway answers")
            .status()
            .as_u16()
    }

    pub async fn get_file(&self, session: &str, path: &str) -> (u16, Vec<u8>) {
        let r = self
            .http
            .get(format!("{}/v1/sessions/{session}/files/{path}", self.url))
            .bearer_auth(&self.token)
            .send()
            .await
            .expect("gateway answers");
        (r.status().as_u16(), r.bytes().await.expect("body").to_vec())
    }
}

/// Labels helper for requests.
/// Docker's state of the container of `sandbox` (`running`, `paused`, ...; empty if none).
pub fn container_state(sandbox: &str) -> String {
    let filter = format!("label=sandpool.sandbox={sandbox}");
    let out = std::process::Command::new("docker")
        .args(["ps", "-a", "--filter", &filter, "--format", "{{.State}}"])
        .output()
        .expect("run docker ps");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

pub fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn bad_data(what: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what)
}

/// The directory of `controller` for process `pid`'s cgroup, and whether it is cgroup v2's
/// unified hierarchy (one directory for every controller).
fn cgroup_dir(pid: u32, controller: &str) -> std::io::Result<(String, bool)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    text.lines()
        .find_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next(), parts.next()?, parts.next()?);
            match controllers {
                "" => Some((format!("/sys/fs/cgroup{path}"), true)),
                c if c.split(',').any(|c| c == controller) => {
                    Some((format!("/sys/fs/cgroup/{controller}{path}"), false))
                }
                _ => None,
            }
        })
        .ok_or_else(|| bad_data(format!("no {controller} cgroup for pid {pid}")))
}

/// A file of one number in `dir`.
fn read_number(dir: &str, name: &str) -> std::io::Result<u64> {
    let file = format!("{dir}/{name}");
    std::fs::read_to_string(&file)?.trim().parse().map_err(|e| bad_data(format!("{file}: {e}")))
}

/// CPU time used so far by the cgroup of process `pid` (a container's init: its whole
/// container), from `cpuacct.usage` on cgroup v1 or `cpu.stat`'s `usage_usec` on v2.
pub fn cgroup_cpu_usage(pid: u32) -> std::io::Result<Duration> {
    let (dir, v2) = cgroup_dir(pid, "cpuacct")?;
    if !v2 {
        return Ok(Duration::from_nanos(read_number(&dir, "cpuacct.usage")?));
    }
    let file = format!("{dir}/cpu.stat");
    let stat = std::fs::read_to_string(&file)?;
    let us = stat
        .lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .ok_or_else(|| bad_data(format!("{file}: no usage_usec")))?;
    Ok(Duration::from_micros(us.trim().parse().map_err(|e| bad_data(format!("{file}: {e}")))?))
}

/// The process ids in use and the limit of the cgroup of process `pid` (a container's init:
/// its whole container), from the pids controller (cgroup v1 or v2); threads count.
pub fn cgroup_pids(pid: u32) -> std::io::Result<(u64, u64)> {
    let (dir, _) = cgroup_dir(pid, "pids")?;
    Ok((read_number(&dir, "pids.current")?, read_number(&dir, "pids.max")?))
}

/// The pid (on the host) of the init of `sandbox`'s container.
pub fn container_pid(sandbox: &str) -> Option<u32> {
    container_inspect(sandbox)["State"]["Pid"].as_u64().filter(|&p| p > 0).map(|p| p as u32)
}

/// The containerd shim serving `sandbox`'s container: its init's parent, pid and name (a
/// shim's name reads `containerd-shim`, cut to the kernel's 15 characters).
pub fn shim_of(sandbox: &str) -> (u32, String) {
    let pid = container_pid(sandbox).expect("the sandbox's container runs");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the container's init");
    let ppid = status.lines().find_map(|l| l.strip_prefix("PPid:")).and_then(|p| p.trim().parse().ok());
    let ppid = ppid.expect("its parent");
    let comm = std::fs::read_to_string(format!("/proc/{ppid}/comm")).unwrap_or_default();
    (ppid, comm.trim().to_string())
}

/// `docker inspect` of the container of `sandbox` (`Value::Null` if there is none).
pub fn container_inspect(sandbox: &str) -> Value {
    let filter = format!("label=sandpool.sandbox={sandbox}");
    let out = std::process::Command::new("docker")
        .args(["ps", "-aq", "--no-trunc", "--filter", &filter])
        .output()
        .expect("run docker ps");
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if id.is_empty() {
        return Value::Null;
    }
    let out = std::process::Command::new("docker").args(["inspect", &id]).output().expect("run docker inspect");
    serde_json::from_slice::<Value>(&out.stdout).ok().map_or(Value::Null, |v| v[0].clone())
}

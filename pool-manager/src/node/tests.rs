//! The node's recovery (reconcile after a restart, rebuild of a forgotten ledger, the orphan
//! sweep, destroys retried) and a sandbox's backend driven through a fake `Runtime`: the engine is the project's own
//! trait, faked here in memory; the ledger is a real Redis (`SANDPOOL_TEST_REDIS`) under a
//! prefix of the test's own, deleted on drop whether the test passes or fails.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use config::{Config, Template};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use ledger::{LeaseSpec, Ledger, SandboxState};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Identity, Node};
use crate::agent_bin::AgentFiles;
use crate::channel::Link;
use crate::runtime::{
    Call, ContainerEvent, CpuUse, DockerExec, DockerExecOutcome, FileCall, FileError, RegistryError, Runtime,
    SandboxContainer, SnapshotImage,
};
use crate::sync::lock;

/// One container of the fake engine.
#[derive(Debug, Clone)]
struct FakeContainer {
    sandbox: String,
    running: bool,
    paused: bool,
}

/// An in-memory engine: containers by id, and a record of the pause calls and removals the
/// node made. `fail_removes` makes that many removals fail (the engine not answering).
#[derive(Default)]
struct Fake {
    containers: Mutex<BTreeMap<String, FakeContainer>>,
    pauses: Mutex<Vec<(String, bool)>>,
    removed: Mutex<Vec<String>>,
    fail_removes: Mutex<u32>,
    /// The docker-exec calls made, on which container.
    execs: Mutex<Vec<(String, DockerExec)>>,
}

impl Fake {
    fn add(&self, id: &str, sandbox: &str, running: bool, paused: bool) {
        lock(&self.containers).insert(id.into(), FakeContainer { sandbox: sandbox.into(), running, paused });
    }

    fn has(&self, id: &str) -> bool {
        lock(&self.containers).contains_key(id)
    }
}

fn ready<'a, T: Send + 'a>(v: anyhow::Result<T>) -> Call<'a, T> {
    Box::pin(async move { v })
}

fn unused<'a, T: Send + 'a>(what: &'static str) -> Call<'a, T> {
    ready(Err(anyhow::anyhow!("the fake runtime does not {what}")))
}

impl Runtime for Fake {
    fn create<'a>(&'a self, sandbox: &'a str, _: &'a Template, _: Option<&'a AgentFiles>) -> Call<'a, String> {
        let id = format!("c-{sandbox}");
        self.add(&id, sandbox, false, false);
        ready(Ok(id))
    }

    fn start<'a>(&'a self, container: &'a str) -> Call<'a, ()> {
        let found = lock(&self.containers).get_mut(container).map(|c| c.running = true);
        ready(found.ok_or_else(|| anyhow::anyhow!("no container {container}")))
    }

    fn attach<'a>(&'a self, _: &'a str) -> Call<'a, Link> {
        unused("attach (these tests use docker-exec templates)")
    }

    fn direct_channel(&self, _: &Template) -> bool {
        false
    }

    fn remove<'a>(&'a self, container: &'a str) -> Call<'a, ()> {
        let mut fail = lock(&self.fail_removes);
        if *fail > 0 {
            *fail -= 1;
            return ready(Err(anyhow::anyhow!("the engine is not answering")));
        }
        lock(&self.containers).remove(container);
        lock(&self.removed).push(container.to_string());
        ready(Ok(()))
    }

    fn list(&self) -> Call<'_, Vec<SandboxContainer>> {
        let list = lock(&self.containers)
            .iter()
            .map(|(id, c)| SandboxContainer {
                id: id.clone(),
                sandbox: c.sandbox.clone(),
                running: c.running,
                paused: c.paused,
            })
            .collect();
        ready(Ok(list))
    }

    fn events(&self) -> BoxStream<'static, anyhow::Result<ContainerEvent>> {
        Box::pin(futures::stream::pending())
    }

    fn set_paused<'a>(&'a self, container: &'a str, pause: bool) -> Call<'a, ()> {
        lock(&self.pauses).push((container.to_string(), pause));
        let found = lock(&self.containers).get_mut(container).map(|c| {
            c.paused = pause;
            c.running = !pause;
        });
        ready(found.ok_or_else(|| anyhow::anyhow!("no container {container}")))
    }

    fn cpu_use<'a>(&'a self, _: &'a str) -> Call<'a, CpuUse> {
        ready(Ok(CpuUse::default()))
    }

    fn container_ip<'a>(&'a self, _: &'a str, _: &'a str) -> Call<'a, Ipv4Addr> {
        unused("give addresses")
    }

    fn exec<'a>(&'a self, container: &'a str, req: DockerExec) -> Call<'a, DockerExecOutcome> {
        lock(&self.execs).push((container.to_string(), req));
        ready(Ok(DockerExecOutcome { exit_code: 3, stdout: b"out".to_vec(), ..Default::default() }))
    }

    fn download<'a>(&'a self, _: &'a str, _: &'a str, _: u64) -> FileCall<'a, Vec<u8>> {
        Box::pin(async { Err(FileError::NotFound) })
    }

    fn read_as<'a>(&'a self, _: &'a str, _: &'a str, _: &'a str, _: u64) -> FileCall<'a, Vec<u8>> {
        Box::pin(async { Err(FileError::NotFound) })
    }

    fn upload<'a>(&'a self, _: &'a str, _: &'a str, _: Bytes) -> FileCall<'a, ()> {
        Box::pin(async { Err(FileError::Refused("read-only fake".into())) })
    }

    fn write_as<'a>(&'a self, _: &'a str, _: &'a str, _: &'a str, _: Bytes) -> FileCall<'a, ()> {
        Box::pin(async { Err(FileError::Refused("read-only fake".into())) })
    }

    fn snapshot_repo(&self) -> String {
        "fake/snapshots".into()
    }

    fn written_bytes<'a>(&'a self, _: &'a str) -> Call<'a, u64> {
        ready(Ok(0))
    }

    fn commit<'a>(&'a self, _: &'a str, _: &'a str, _: &'a str) -> Call<'a, String> {
        unused("commit")
    }

    fn snapshot_images(&self) -> Call<'_, Vec<SnapshotImage>> {
        ready(Ok(Vec::new()))
    }

    fn remove_image<'a>(&'a self, _: &'a str) -> Call<'a, bool> {
        ready(Ok(false))
    }

    fn image_exists<'a>(&'a self, _: &'a str) -> Call<'a, bool> {
        ready(Ok(true))
    }

    fn use_lazy_stub<'a>(&'a self, image: &'a str, _: crate::lazy::Stub) -> Call<'a, ()> {
        ready(Err(anyhow::anyhow!("the fake runtime runs no lazy image ({image})")))
    }

    fn resolve<'a>(
        &'a self,
        reference: &'a str,
        _: Option<&'a config::RegistryAuth>,
    ) -> BoxFuture<'a, Result<String, RegistryError>> {
        Box::pin(async move { Err(RegistryError::NotFound(reference.to_string())) })
    }

    fn pull<'a>(
        &'a self,
        _: &'a str,
        _: Option<&'a config::RegistryAuth>,
        _: Duration,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async { Err("the fake runtime pulls nothing".to_string()) })
    }

    fn digest_image_sizes(&self) -> Call<'_, HashMap<String, u64>> {
        ready(Ok(HashMap::new()))
    }
}

fn redis_url() -> String {
    std::env::var("SANDPOOL_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A node on the fake engine, its ledger under a prefix of its own (deleted on drop), and the
/// tasks it spawned (stopped on drop).
struct World {
    node: Arc<Node>,
    fake: Arc<Fake>,
    ledger: Ledger,
    prefix: String,
    cancel: CancellationToken,
    _dir: TempDir,
}

impl Drop for World {
    fn drop(&mut self) {
        self.cancel.cancel();
        let _ = ledger::delete_all_keys_blocking(&redis_url(), &self.prefix);
    }
}

/// A directory removed on drop.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const CONFIG: &str = r#"
[pool_manager]
secret = "0123456789abcdef"
[auth]
key = "0123456789abcdef"
[templates.plain]
image = "sandpool/busybox:latest"
exec = "docker"
warm = 0
"#;

async fn world() -> World {
    let tag = format!("{:016x}", rand::random::<u64>());
    let prefix = format!("sptest-pm-{tag}");
    let node_id = format!("n{}", &tag[..8]);
    let dir = TempDir(std::env::temp_dir().join(format!("sandpool-{prefix}")));
    let ledger = Ledger::connect(&redis_url(), &prefix).await.expect("redis (SANDPOOL_TEST_REDIS)");
    ledger.claim_node(&node_id, "test|holder", 3_600_000, true).await.unwrap();
    let fake = Arc::new(Fake::default());
    let cancel = CancellationToken::new();
    let node = node_on(&node_id, &ledger, &fake, &dir, &cancel);
    World { node, fake, ledger, prefix, cancel, _dir: dir }
}

/// A node process `node_id` over this ledger and engine (a second one: the node restarted).
fn node_on(node_id: &str, ledger: &Ledger, fake: &Arc<Fake>, dir: &TempDir, cancel: &CancellationToken) -> Arc<Node> {
    let config = Arc::new(Config::from_toml(CONFIG, &config::Overrides::default()).unwrap());
    let agent_files = AgentFiles { agent: dir.0.join("agent"), python: dir.0.join("python"), run: dir.0.join("run") };
    Node::new(
        Identity { id: node_id.to_string(), holder: "test|holder".into() },
        config,
        ledger.clone(),
        fake.clone(),
        agent_files,
        None,
        TaskTracker::new(),
        cancel.clone(),
    )
}

impl World {
    /// A sandbox id of this node.
    fn id(&self, n: u8) -> String {
        wire::ids::make(&self.node.id, &[0xab, n])
    }

    /// A record in state idle (or leased, when `lease`) with container `c-<id>`; returns the
    /// lease's fence (0 when idle).
    async fn record(&self, sandbox: &str, lease: bool) -> u64 {
        let node = &self.node.id;
        self.ledger.sandbox_add(node, sandbox, "plain").await.unwrap();
        self.ledger.sandbox_ready(node, sandbox, &format!("c-{sandbox}")).await.unwrap();
        if !lease {
            return 0;
        }
        let spec = LeaseSpec {
            session_id: format!("s-{sandbox}"),
            tenant: "t".into(),
            template: "plain".into(),
            ttl_ms: 3_600_000,
            idle_ms: 3_600_000,
            labels: BTreeMap::new(),
            session_key: None,
        };
        let grant = self.ledger.checkout(node, &spec).await.unwrap().expect("an idle sandbox to lease");
        assert_eq!(grant.sandbox_id, sandbox, "the only idle sandbox is leased");
        grant.fence
    }

    async fn states(&self) -> BTreeMap<String, SandboxState> {
        self.ledger.sandboxes(&self.node.id).await.unwrap().into_iter().map(|r| (r.id, r.state)).collect()
    }

    /// Waits (up to 5 s) until `done` holds: removals after a reconcile run in the background.
    async fn until(&self, what: &str, done: impl Fn(&World) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !done(self) {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test]
async fn reconcile_readopts_live_sandboxes_and_removes_the_rest() {
    let w = world().await;
    let (leased, idle, paused, gone, creating, stray) = (w.id(1), w.id(2), w.id(3), w.id(4), w.id(5), w.id(6));
    // Leased first: a checkout takes whichever sandbox is idle.
    let fence = w.record(&leased, true).await;
    w.fake.add(&format!("c-{leased}"), &leased, true, false);
    w.record(&idle, false).await;
    w.fake.add(&format!("c-{idle}"), &idle, true, false);
    w.record(&paused, false).await;
    w.fake.add(&format!("c-{paused}"), &paused, false, true);
    // A record whose container is gone, one whose create never finished, and a container
    // whose record is gone.
    w.record(&gone, false).await;
    w.ledger.sandbox_add(&w.node.id, &creating, "plain").await.unwrap();
    w.ledger.sandbox_set_container(&w.node.id, &creating, &format!("c-{creating}")).await.unwrap();
    w.fake.add(&format!("c-{creating}"), &creating, false, false);
    w.fake.add("c-stray", &stray, true, false);

    w.node.reconcile().await.unwrap();

    for id in [&leased, &idle, &paused] {
        assert!(w.node.sandbox(id).is_some(), "{id} is readopted");
    }
    let sb = w.node.sandbox(&leased).unwrap();
    assert!(fence > 0 && !sb.admit(fence - 1) && sb.admit(fence), "the lease's fence still holds");
    let frozen = w.node.sandbox(&paused).unwrap();
    assert!(frozen.paused.load(std::sync::atomic::Ordering::Acquire), "a paused sandbox stays paused");
    let c = format!("c-{paused}");
    assert_eq!(*lock(&w.fake.pauses), [(c.clone(), false), (c, true)], "thawed to check it, then frozen again");
    for id in [&gone, &creating] {
        assert!(w.node.sandbox(id).is_none(), "{id} is not served");
    }
    w.until("the stray and the half-made containers are removed", |w| {
        !w.fake.has("c-stray") && !w.fake.has(&format!("c-{creating}"))
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while w.states().await.len() > 3 {
        assert!(tokio::time::Instant::now() < deadline, "stale records are forgotten: {:?}", w.states().await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let states = w.states().await;
    assert_eq!(states.get(&leased), Some(&SandboxState::Leased));
    assert_eq!(states.get(&idle), Some(&SandboxState::Idle));
    assert_eq!(states.get(&paused), Some(&SandboxState::Idle));
    assert!(w.fake.has(&format!("c-{leased}")) && w.fake.has(&format!("c-{idle}")), "live containers are kept");
}

#[tokio::test]
async fn paused_counts_follow_pause_resume_destroy_and_recovery() {
    use crate::admit::freeze;
    let w = world().await;
    let (a, b, c) = (w.id(1), w.id(2), w.id(3));
    for id in [&a, &b, &c] {
        w.record(id, false).await;
    }
    w.fake.add(&format!("c-{a}"), &a, true, false);
    w.fake.add(&format!("c-{b}"), &b, true, false);
    w.fake.add(&format!("c-{c}"), &c, false, true);
    w.node.reconcile().await.unwrap();
    let paused = |node: &Node| node.paused_by_template().get("plain").copied().unwrap_or(0);
    assert_eq!(paused(&w.node), 1, "a readopted frozen sandbox counts");
    let (sa, sb, sc) = (w.node.sandbox(&a).unwrap(), w.node.sandbox(&b).unwrap(), w.node.sandbox(&c).unwrap());

    freeze(&w.node, &sa, true).await.unwrap();
    assert_eq!(paused(&w.node), 2, "paused");
    freeze(&w.node, &sa, true).await.unwrap();
    assert_eq!(paused(&w.node), 2, "a second pause of a paused sandbox counts once");
    freeze(&w.node, &sc, false).await.unwrap();
    assert_eq!(paused(&w.node), 1, "resumed");

    // A paused sandbox destroyed leaves the count; a late resume of it changes nothing.
    w.node.destroy(&a, ledger::GoneReason::Removed).await;
    assert_eq!(paused(&w.node), 0, "destroyed while paused");
    assert_eq!(w.node.counts_by_template().get("plain"), Some(&2));
    freeze(&w.node, &sb, true).await.unwrap();
    w.node.mark_paused(&sa, false);
    assert_eq!(paused(&w.node), 1, "the destroyed sandbox's resume is not counted");

    // The node restarts: what it readopts frozen is counted again, once.
    let again = node_on(&w.node.id, &w.ledger, &w.fake, &w._dir, &w.cancel);
    again.reconcile().await.unwrap();
    assert_eq!(paused(&again), 1, "recovered: {:?}", again.paused_by_template());
    let walked = |node: &Node| {
        [&b, &c].iter().filter(|id| node.sandbox(id).unwrap().paused.load(std::sync::atomic::Ordering::Relaxed)).count()
    };
    assert_eq!(walked(&again), 1, "the count is what a walk of the map finds");
}

#[tokio::test]
async fn rebuild_pools_pristine_sandboxes_and_removes_used_ones() {
    let w = world().await;
    let (used, pristine) = (w.id(1), w.id(2));
    w.record(&used, true).await;
    w.fake.add(&format!("c-{used}"), &used, true, false);
    w.record(&pristine, false).await;
    w.fake.add(&format!("c-{pristine}"), &pristine, true, false);
    w.node.reconcile().await.unwrap();
    // A call reached the leased one (its fence was admitted), none the other.
    let fence = w.ledger.sandboxes(&w.node.id).await.unwrap().into_iter().find(|r| r.id == used).unwrap().fence;
    assert!(w.node.sandbox(&used).unwrap().admit(fence));

    // Redis comes back empty.
    ledger::delete_all_keys_blocking(&redis_url(), &w.prefix).unwrap();
    assert!(w.states().await.is_empty());
    w.node.rebuild().await.unwrap();

    let states = w.states().await;
    assert_eq!(states.get(&pristine), Some(&SandboxState::Idle), "the untouched sandbox is back in its pool");
    assert!(!states.contains_key(&used), "a sandbox whose session record is lost gets no record back");
    w.until("the used sandbox is destroyed", |w| !w.fake.has(&format!("c-{used}"))).await;
    assert!(w.node.sandbox(&used).is_none());
    assert!(w.node.sandbox(&pristine).is_some() && w.fake.has(&format!("c-{pristine}")));
}

#[tokio::test]
async fn the_sweep_removes_only_containers_nobody_knows() {
    let w = world().await;
    let (served, orphan, in_flight) = (w.id(1), w.id(2), w.id(3));
    w.record(&served, false).await;
    w.fake.add(&format!("c-{served}"), &served, true, false);
    w.node.reconcile().await.unwrap();
    // After the reconcile: a container whose create a killed predecessor had sent (no record,
    // not in the map), and one of a create in flight here (its record comes first).
    w.fake.add("c-orphan", &orphan, true, false);
    w.ledger.sandbox_add(&w.node.id, &in_flight, "plain").await.unwrap();
    w.fake.add(&format!("c-{in_flight}"), &in_flight, false, false);

    let cost = w.node.sweep().await.unwrap();

    assert_eq!(cost.containers_listed, 3, "no event stream yet: the sweep lists every container");
    assert!(!w.fake.has("c-orphan"), "the orphan is removed");
    assert!(w.fake.has(&format!("c-{in_flight}")), "a create in flight is not taken for an orphan");
    assert!(w.fake.has(&format!("c-{served}")) && w.node.sandbox(&served).is_some());
    assert_eq!(*lock(&w.fake.removed), ["c-orphan"]);
}

#[tokio::test]
async fn a_destroy_the_engine_failed_is_retried_and_never_swept_as_an_orphan() {
    let w = world().await;
    let sb = w.id(1);
    w.record(&sb, false).await;
    w.fake.add(&format!("c-{sb}"), &sb, true, false);
    w.node.reconcile().await.unwrap();

    *lock(&w.fake.fail_removes) = 1;
    w.node.destroy(&sb, ledger::GoneReason::Removed).await;
    assert!(w.fake.has(&format!("c-{sb}")), "the engine did not answer: the container is still there");
    assert!(w.states().await.is_empty(), "the record is forgotten all the same");
    assert_eq!(lock(&w.node.leftovers).len(), 1, "the removal is left to retry");

    // The sweep sees a container with neither a record nor a place in the map, but it is a
    // leftover: the reaper's to retry, not an orphan to count.
    w.node.sweep().await.unwrap();
    assert!(lock(&w.fake.removed).is_empty());

    w.node.retry_leftovers().await;
    assert!(!w.fake.has(&format!("c-{sb}")), "the retry removed it");
    assert!(lock(&w.node.leftovers).is_empty());
}

#[tokio::test]
async fn a_sandbox_doomed_as_the_destroy_loop_stops_is_destroyed_not_lost() {
    let w = world().await;
    let sb = w.id(1);
    w.record(&sb, false).await;
    w.fake.add(&format!("c-{sb}"), &sb, true, false);
    w.node.reconcile().await.unwrap();

    // The loop waits in its pop; it is told to stop, and the sandbox is doomed right after,
    // while Redis still holds the pop: Redis hands the id to that pop, so the loop must take
    // the reply, not drop it (a dropped reply leaves the container running, its record doomed).
    let stop = CancellationToken::new();
    // joined: below, before the checks.
    let destroys = tokio::spawn(w.node.clone().destroy_loop(stop.clone()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.cancel();
    assert_eq!(w.ledger.shrink(&w.node.id, "plain", 1).await.unwrap(), 1, "the idle sandbox is doomed");
    destroys.await.unwrap();
    w.until("the doomed sandbox's container is removed", |w| !w.fake.has(&format!("c-{sb}"))).await;
    assert!(w.states().await.is_empty(), "its record is forgotten");
}

#[tokio::test]
async fn a_docker_exec_sandboxs_backend_runs_commands_through_the_runtime_as_its_user() {
    let w = world().await;
    let id = w.id(1);
    w.record(&id, false).await;
    w.fake.add(&format!("c-{id}"), &id, true, false);
    w.node.reconcile().await.unwrap();
    let sb = w.node.sandbox(&id).unwrap();
    assert!(sb.agent.is_none());
    assert_ne!(sb.template.user, config::User::Root, "templates run unprivileged by default");

    let call = crate::backend::Exec {
        fence: 1,
        argv: vec!["id".into()],
        env: vec![("K".into(), "v".into())],
        cwd: String::new(),
        stdin: None,
        timeout: Duration::from_secs(5),
        max_output: 100,
    };
    let ran = sb.backend.exec(call).await.unwrap();

    assert_eq!((ran.exit_code, ran.stdout.as_slice()), (3, b"out".as_slice()), "the runtime's answer");
    assert_eq!(ran.duration_ms, None, "the caller measures a runtime exec");
    let execs = lock(&w.fake.execs);
    let [(container, req)] = execs.as_slice() else { panic!("one exec, not {execs:?}") };
    assert_eq!(container, &format!("c-{id}"));
    assert_eq!(req.argv, ["id"]);
    assert_eq!(req.user, Some(sb.template.user.spec()), "as the template's user");
    assert_eq!(req.env, ["K=v"]);
    assert_eq!(req.cwd, None, "no cwd: the template's workdir");
    assert_eq!((req.timeout, req.max_output), (Duration::from_secs(5), 100));
}

//! The node: its sandboxes, how they are created, warmed, leased cold, failed and destroyed,
//! and the background loops that keep the ledger and Docker in agreement.
//!
//! Why one file of this size: create, destroy, reconcile and the loops share the sandbox
//! map and its invariants; the create plan and the pools loop are already apart (`plan`,
//! `pools`).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use config::{Config, Template, User};
use futures::StreamExt as _;
use ledger::{GoneReason, Ledger, NodeInfo, SandboxState};
use telemetry::names;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use wire::ExecMode;

use crate::agent_bin::SocketCheck;
use crate::channel::AgentConn;
use crate::docker::{Dock, DockerExec};

/// How often expired sessions are reaped (lookups also reap on the spot).
const REAP_INTERVAL: Duration = Duration::from_millis(500);
/// How often a node sweeps the quota leases of every tenant for holders that are gone (any
/// node may; each does, so the sweep survives any node's loss).
const QUOTA_SWEEP_INTERVAL: Duration = Duration::from_secs(30);
const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// How often a node looks for nodes silent past `node.lost_after`, to give them up (any node
/// may; each does, so it survives any node's loss), and retries its unfinished destroys.
const LOST_SWEEP_INTERVAL: Duration = Duration::from_secs(5);
/// How often a running node compares its containers, its map and the ledger (`Node::sweep`):
/// the containers Docker reported created since the last sweep and one record count, so its
/// cost follows the creates, not the sandboxes.
const ORPHAN_SWEEP_INTERVAL: Duration = Duration::from_secs(20);
/// How often the sweep lists every container and reads every record all the same: the net
/// under the event stream and the record count (O(sandboxes), hence rarely).
const FULL_SWEEP_INTERVAL: Duration = Duration::from_secs(600);
/// How long after Docker's event stream is (re)opened the sweep trusts it: dockerd takes the
/// subscription within milliseconds on its local socket, but nothing tells us when, so the
/// listing that covers what came before waits this long.
const EVENTS_SETTLE: Duration = Duration::from_secs(5);
/// How long the node's `room` (node-side admission) stands without a refresh (stats are
/// written twice a second).
pub(crate) const ROOM_TTL: Duration = Duration::from_secs(3);
/// Sandboxes reattached at once by `reconcile` (an attach and a ping each: light for Docker).
const READOPTS_IN_FLIGHT: usize = 16;
/// A new sandbox's agent must answer within this long after start.
const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a new sandbox's agent has to open its direct channel (it binds the socket right
/// after its start) before the attach stream serves instead.
const DIRECT_CONNECT_WAIT: Duration = Duration::from_secs(2);
/// How long a new sandbox's warm-up command may take.
const WARM_UP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long giving a docker-exec sandbox's workdir to its user may take.
const DOCKER_CHOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// One sandbox this node owns and can serve.
pub struct Sandbox {
    pub id: String,
    pub template: Arc<Template>,
    pub container: String,
    /// The agent channel (agent mode), `None` in docker-exec mode.
    pub agent: Option<AgentConn>,
    /// Highest fencing token seen; requests with a lower one are refused.
    pub max_fence: AtomicU64,
    /// Frozen by a pause call (for the pool metrics only).
    pub paused: AtomicBool,
    /// The session's persistent shells (agent mode).
    pub shells: crate::shells::Shells,
    /// Its open port connections (`ports.rs`).
    pub ports: crate::ports::Open,
    /// The function worker when the sandbox is a runtime-mode function's environment.
    pub runtime: crate::functions::Runtime,
    /// Its CPU accounting as last read (`Node::cpu_use`), so each read adds only what is new
    /// to the per-template totals.
    pub cpu_seen: Mutex<crate::docker::CpuUse>,
}

impl Sandbox {
    /// Accepts `fence` if it is not older than any seen before.
    pub fn admit(&self, fence: u64) -> bool {
        self.max_fence.fetch_max(fence, Ordering::AcqRel) <= fence
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("ledger: {0}")]
    Ledger(#[from] ledger::LedgerError),
    #[error("{0:#}")]
    Failed(anyhow::Error),
}

/// How a create's error starts when the template's image could not be pulled (the rest is the
/// registry's reason, which the tenant is told).
pub const PULL_FAILED: &str = "image pull failed: ";

/// Who a node is: its id and the holder string of the id's lease (`identity::holder`).
pub struct Identity {
    pub id: String,
    pub holder: String,
}

/// What a destroy could not finish: the container to remove (Docker did not answer) and the
/// ledger record to forget (Redis did not). Without the retry the first is an orphan container
/// and the second a record of a container that no longer exists, both until the next restart.
#[derive(Debug)]
struct Leftover {
    sandbox: String,
    container: Option<String>,
    forget: Option<GoneReason>,
}

/// What the orphan sweep knows of this node's containers without listing them (`Node::sweep`).
#[derive(Default)]
struct Sightings {
    /// Containers Docker reported created (container id → sandbox) since the sweep last
    /// looked, less those it reported removed.
    created: HashMap<String, String>,
    /// The event stream's connection (a number per connection) and when it opened; `None`
    /// while it is down, when every sweep lists the containers as before.
    up: Option<(u64, std::time::Instant)>,
    /// The connection after whose settling the containers were last listed in full: until
    /// then, what Docker made before the stream opened is unseen.
    listed: Option<u64>,
    /// The last full sweep (every container, every record).
    full_at: Option<std::time::Instant>,
}

/// What one sweep read (`Node::sweep`): how its cost grows is what the tests check.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepCost {
    /// Containers listed from Docker (0 unless the sweep listed them all).
    pub containers_listed: usize,
    /// Containers looked up one by one (those created since the last sweep).
    pub containers_checked: usize,
    /// Sandbox records read (0 unless the record count said the ledger forgot some, or the
    /// sweep was a full one).
    pub records_read: usize,
}

pub struct Node {
    pub id: String,
    /// This process's claim on the id's lease.
    holder: String,
    pub config: Arc<Config>,
    pub ledger: Ledger,
    pub dock: Dock,
    /// Configured templates.
    pub(crate) templates: HashMap<String, Arc<Template>>,
    /// Tenants' private templates (snapshots) on this node, refreshed from the ledger.
    private: Mutex<HashMap<String, Arc<Template>>>,
    /// Templates made from images (every node serves them), and the ledger's version of them.
    from_images: Mutex<(u64, HashMap<String, Arc<Template>>)>,
    /// The corpus's images on this node: pulls, locality, eviction.
    pub images: Arc<crate::images::Images>,
    agent_files: crate::agent_bin::AgentFiles,
    sandboxes: Mutex<HashMap<String, Arc<Sandbox>>>,
    /// Destroys that did not finish (Docker or Redis unreachable): retried by the reaper.
    leftovers: Mutex<Vec<Leftover>>,
    /// Containers Docker reported made since the last sweep (`container_events_loop`).
    sightings: Mutex<Sightings>,
    /// Per template label: CPU seconds used and throttled by its sandboxes as read so far
    /// (`cpu_use`), exported in whole seconds (the recorder's counters are integers).
    cpu_totals: Mutex<HashMap<String, (f64, f64)>>,
    pub(crate) pools: crate::pools::Pools,
    pub(crate) tracker: TaskTracker,
    cancel: CancellationToken,
    /// The egress proxy, when a template uses named egress.
    pub egress: Option<Arc<crate::egress::Egress>>,
}

/// Locks `m`, recovering the guard if a thread panicked while holding it. The node's and its
/// pools' mutexes guard maps, a queue and the token bucket, each changed in steps that leave
/// them consistent, so the data is still good after such a panic; skipping it instead would
/// lose a sandbox or misreport the counts.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn random_hex_id(node: &str, bytes: usize) -> String {
    let r: Vec<u8> = (0..bytes).map(|_| rand::random::<u8>()).collect();
    wire::ids::make(node, &r)
}

impl Node {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        identity: Identity,
        config: Arc<Config>,
        ledger: Ledger,
        dock: Dock,
        agent_files: crate::agent_bin::AgentFiles,
        egress: Option<Arc<crate::egress::Egress>>,
        tracker: TaskTracker,
        cancel: CancellationToken,
    ) -> Arc<Node> {
        let templates = config.templates.iter().map(|(k, v)| (k.clone(), Arc::new(v.clone()))).collect();
        let images = crate::images::Images::new(&identity.id, dock.clone(), ledger.clone(), config.images.clone());
        Arc::new(Node {
            id: identity.id,
            holder: identity.holder,
            images,
            from_images: Mutex::new((0, HashMap::new())),
            pools: crate::pools::Pools::new(&config),
            config,
            ledger,
            dock,
            templates,
            agent_files,
            sandboxes: Mutex::new(HashMap::new()),
            leftovers: Mutex::new(Vec::new()),
            sightings: Mutex::new(Sightings::default()),
            cpu_totals: Mutex::new(HashMap::new()),
            private: Mutex::new(HashMap::new()),
            tracker,
            cancel,
            egress,
        })
    }

    pub fn sandbox(&self, id: &str) -> Option<Arc<Sandbox>> {
        lock(&self.sandboxes).get(id).cloned()
    }

    pub fn sandbox_count(&self) -> usize {
        lock(&self.sandboxes).len()
    }

    /// The containers of the node's sandboxes.
    /// Up to `n` of the node's containers (whichever the map yields first: its order is a
    /// hash's, unrelated to age or template), and how many it holds in all.
    pub(crate) fn container_sample(&self, n: usize) -> (Vec<String>, u64) {
        let map = lock(&self.sandboxes);
        (map.values().take(n).map(|s| s.container.clone()).collect(), map.len() as u64)
    }

    /// The images the node's sandboxes run.
    pub(crate) fn sandbox_images(&self) -> HashSet<String> {
        lock(&self.sandboxes).values().map(|s| s.template.image.clone()).collect()
    }

    /// A configured, private or image template by name.
    pub fn template(&self, name: &str) -> Option<Arc<Template>> {
        if wire::images::is_image_template(name) {
            return lock(&self.from_images).1.get(name).cloned();
        }
        self.templates.get(name).cloned().or_else(|| lock(&self.private).get(name).cloned())
    }

    /// Every template this node serves now: configured ones, private ones, then those made
    /// from images.
    pub fn template_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.templates.keys().cloned().collect();
        names.sort();
        for mut more in [
            lock(&self.private).keys().cloned().collect::<Vec<_>>(),
            lock(&self.from_images).1.keys().cloned().collect(),
        ] {
            more.sort();
            names.extend(more);
        }
        names
    }

    /// Reloads the templates made from images when the ledger's version of them moved (one
    /// small read otherwise; every pool tick).
    pub async fn refresh_image_templates(&self) -> Result<(), ledger::LedgerError> {
        let seen = lock(&self.from_images).0;
        if self.ledger.image_templates_version().await? == seen && seen != 0 {
            return Ok(());
        }
        let (version, list) = self.ledger.image_templates().await?;
        self.images.set_owners(list.iter().filter_map(|t| Some((t.image.clone(), t.owner.clone()?))));
        let map: HashMap<String, Arc<Template>> = list
            .into_iter()
            .filter_map(|t| {
                let base = self.templates.get(&t.base)?;
                Some((t.name.clone(), Arc::new(Template::from_image(base, &t))))
            })
            .collect();
        let deleted: Vec<String> = {
            let mut current = lock(&self.from_images);
            let gone = current.1.keys().filter(|n| !map.contains_key(*n)).cloned().collect();
            *current = (version, map);
            gone
        };
        // A deleted template's idle sandboxes go (its sessions run on), and requests waiting
        // for it hear so now rather than at their deadline.
        for name in deleted {
            let retired = self.ledger.shrink(&self.id, &name, 100_000).await?;
            let (_, told) = self.ledger.set_unhealthy(&self.id, &name, "the template was deleted", None, 1_000).await?;
            tracing::info!(template = %name, retired, told, "template made from an image deleted");
        }
        Ok(())
    }

    /// Reloads the private templates of this node from the ledger.
    pub async fn refresh_private_templates(&self) -> Result<(), ledger::LedgerError> {
        let list = self.ledger.private_templates(&self.id).await?;
        let map: HashMap<String, Arc<Template>> = list
            .into_iter()
            .filter_map(|p| {
                let base = self.templates.get(&p.base)?;
                let t = Template { name: p.name.clone(), image: p.image, warm: 0, ..(**base).clone() };
                Some((p.name, Arc::new(t)))
            })
            .collect();
        *lock(&self.private) = map;
        Ok(())
    }

    /// Snapshots a sandbox's filesystem into a private template of `tenant`, named
    /// `<node>.<id>` (`id`: 16 hex digits, else a random one).
    pub async fn snapshot(
        &self,
        sb: &Sandbox,
        tenant: &str,
        id: Option<&str>,
    ) -> anyhow::Result<ledger::PrivateTemplate> {
        let hex = match id {
            Some(h) if h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()) => h.to_ascii_lowercase(),
            _ => format!("{:016x}", rand::random::<u64>()),
        };
        let written = self.dock.written_bytes(&sb.container).await?;
        // A snapshot of a snapshot derives from the same configured template.
        let base = self.ledger.private_template(&sb.template.name).await?.map(|p| p.base);
        let t = ledger::PrivateTemplate {
            name: wire::ids::make(&self.id, &u64::from_str_radix(&hex, 16)?.to_be_bytes()),
            tenant: tenant.to_string(),
            base: base.unwrap_or_else(|| sb.template.name.clone()),
            image: format!("{}:{hex}", self.dock.snapshot_repo()),
            created_ms: self.ledger.now_ms().await?,
            size_mb: written.div_ceil(1 << 20),
        };
        // The template is recorded before its image exists: the pruner keeps every image a
        // template names, so it can never take an image committed a moment before its
        // template was recorded (the next create of it then failed to start).
        self.ledger.put_private_template(&self.id, &t).await?;
        if let Err(e) = self.dock.commit(&sb.container, &hex, &serde_json::to_string(&t)?).await {
            self.ledger.delete_private_template(&t.name).await?;
            return Err(e);
        }
        self.refresh_private_templates().await?;
        Ok(t)
    }

    /// Removes the snapshot images of private templates deleted on purpose (a positive
    /// record, `ptpl-gone`) that no container uses any more. An image whose template the
    /// ledger has no record of at all (Redis lost it) gets its record back from the image's
    /// label: nothing a tenant owns is deleted because the ledger forgot it.
    pub async fn prune_snapshots(&self) -> anyhow::Result<usize> {
        let live: HashSet<String> =
            self.ledger.private_templates(&self.id).await?.into_iter().map(|p| p.image).collect();
        let mut deleted = self.ledger.deleted_private_templates(&self.id).await?;
        let (mut removed, mut restored) = (0, 0);
        for image in self.dock.snapshot_images().await? {
            if live.contains(&image.reference) {
                continue;
            }
            let record = image.record.as_deref().and_then(|r| serde_json::from_str::<ledger::PrivateTemplate>(r).ok());
            let Some(record) = record else {
                // An image from before records were labelled: kept, as it cannot be told apart.
                continue;
            };
            if deleted.remove(&record.name) {
                if self.dock.remove_image(&image.reference).await? {
                    removed += 1;
                    self.ledger.forget_deleted_private_template(&self.id, &record.name).await?;
                }
            } else {
                tracing::warn!(template = %record.name, tenant = %record.tenant, "restored a private template the ledger had no record of, from its image's label");
                self.ledger.put_private_template(&self.id, &record).await?;
                restored += 1;
            }
        }
        // Deletion records whose image is already gone.
        for name in deleted {
            self.ledger.forget_deleted_private_template(&self.id, &name).await?;
        }
        if restored > 0 {
            self.refresh_private_templates().await?;
        }
        Ok(removed)
    }

    /// Cancelled when the node shuts down (long-lived sockets close with a reason).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.cancel.child_token()
    }

    /// Sandbox creates this node has started since it began (for budget checks).
    pub fn creates_started(&self) -> u64 {
        self.pools.started.load(Ordering::Relaxed)
    }

    /// Sandboxes this node holds, per template.
    pub fn counts_by_template(&self) -> HashMap<String, u64> {
        let mut counts = HashMap::new();
        for sb in lock(&self.sandboxes).values() {
            *counts.entry(sb.template.name.clone()).or_insert(0) += 1;
        }
        counts
    }

    /// Paused sandboxes per template (the pool metrics).
    pub fn paused_by_template(&self) -> HashMap<String, u64> {
        let mut counts = HashMap::new();
        for sb in lock(&self.sandboxes).values().filter(|s| s.paused.load(Ordering::Relaxed)) {
            *counts.entry(sb.template.name.clone()).or_insert(0) += 1;
        }
        counts
    }

    fn insert(&self, sb: Arc<Sandbox>) {
        lock(&self.sandboxes).insert(sb.id.clone(), sb);
    }

    fn take(&self, id: &str) -> Option<Arc<Sandbox>> {
        if let Some(e) = &self.egress {
            e.forget(id);
        }
        lock(&self.sandboxes).remove(id)
    }

    /// Puts an egress sandbox under `policy` (`None`: what the ledger recorded, else its
    /// template's initial policy) and records it.
    async fn join_egress(
        &self,
        id: &str,
        container: &str,
        template: &Template,
        policy: Option<String>,
    ) -> anyhow::Result<()> {
        let (Some(egress), Some(te)) = (&self.egress, &template.egress) else { return Ok(()) };
        let ip = self.dock.container_ip(container, &egress.net.name).await?;
        let policy = match policy {
            Some(p) => p,
            None => self.ledger.sandbox_egress(&self.id, id).await?.unwrap_or_else(|| te.initial.clone()),
        };
        egress.admit(id, ip, &policy)?;
        self.ledger.sandbox_set_egress(&self.id, id, &policy).await?;
        Ok(())
    }

    /// Switches an egress sandbox's policy (the template must allow it: the gateway checks).
    pub async fn switch_egress(&self, sb: &Sandbox, policy: &str) -> anyhow::Result<()> {
        let egress = self.egress.as_ref().context("no egress on this node")?;
        egress.switch(&sb.id, policy)?;
        self.ledger.sandbox_set_egress(&self.id, &sb.id, policy).await?;
        tracing::info!(sandbox = %sb.id, policy, "egress switched");
        Ok(())
    }

    pub async fn register(&self) -> anyhow::Result<()> {
        let now = self.ledger.now_ms().await?;
        self.ledger
            .register_node(&NodeInfo {
                id: self.id.clone(),
                addr: self.config.pool_manager.advertise.clone(),
                started_ms: now,
            })
            .await?;
        Ok(())
    }

    // ---------- create ----------

    /// Creates, starts and readies one sandbox (state `creating` in the ledger). On failure
    /// nothing is left behind.
    pub(crate) async fn create_sandbox(
        self: &Arc<Self>,
        template: &Arc<Template>,
    ) -> Result<Arc<Sandbox>, CreateError> {
        let id = random_hex_id(&self.id, 6);
        tracing::Span::current().record("sandbox", id.as_str());
        self.ledger.sandbox_add(&self.id, &id, &template.name).await?;
        match self.start_container(&id, template).await {
            Ok(sb) => {
                self.insert(sb.clone());
                Ok(sb)
            }
            Err((container, e)) => {
                self.agent_files.remove_run_dir(&id);
                let left = Leftover { sandbox: id, container, forget: Some(GoneReason::CreateFailed) };
                self.finish_or_retry(left).await;
                Err(CreateError::Failed(e))
            }
        }
    }

    async fn start_container(
        self: &Arc<Self>,
        id: &str,
        template: &Arc<Template>,
    ) -> Result<Arc<Sandbox>, (Option<String>, anyhow::Error)> {
        let agent_mode = template.exec == ExecMode::Agent;
        // A template made from an image: the node pulls it on first need (the pull counts
        // toward the create, and so toward the waiting request's time).
        if crate::images::is_pulled(&template.image) {
            self.images
                .ensure(&template.image)
                .await
                .map_err(|e| (None, anyhow::anyhow!("{PULL_FAILED}{}", e.reason)))?;
        }
        let container =
            self.dock.create(id, template, agent_mode.then_some(&self.agent_files)).await.map_err(|e| (None, e))?;
        let fail = |e: anyhow::Error| (Some(container.clone()), e);
        self.ledger.sandbox_set_container(&self.id, id, &container).await.map_err(|e| fail(e.into()))?;
        let join_egress = || async {
            let initial = template.egress.as_ref().map(|e| e.initial.clone());
            self.join_egress(id, &container, template, initial).await.context("join the egress network").map_err(fail)
        };
        let agent = if agent_mode {
            // Attach before start so nothing the agent says is lost.
            let attached = self.dock.attach(&container).await.map_err(fail)?;
            self.dock.start(&container).await.map_err(fail)?;
            join_egress().await?;
            // The direct channel when the agent serves one (dropping the attach: Docker keeps
            // the agent's stdin open and discards what it writes, log driver `none`).
            let direct = match crate::docker::direct_channel(template) {
                true => Dock::connect_agent(&self.agent_files.run_dir(id), DIRECT_CONNECT_WAIT).await,
                false => None,
            };
            if direct.is_some() {
                // Before any tenant code runs: from now on the sandbox cannot touch the directory.
                self.agent_files.seal_run_dir(id).context("seal the agent's socket directory").map_err(fail)?;
            }
            let conn = self.watch(id, direct.unwrap_or(attached));
            conn.ping(AGENT_READY_TIMEOUT).await.map_err(|e| fail(anyhow::anyhow!("agent not ready: {e}")))?;
            warm_up(&conn).await;
            Some(conn)
        } else {
            self.dock.start(&container).await.map_err(fail)?;
            join_egress().await?;
            self.give_workdir(&container, template).await.map_err(fail)?;
            None
        };
        Ok(Arc::new(Sandbox {
            id: id.to_string(),
            template: template.clone(),
            container,
            agent,
            max_fence: AtomicU64::new(0),
            paused: AtomicBool::new(false),
            shells: Default::default(),
            ports: Default::default(),
            runtime: Default::default(),
            cpu_seen: Default::default(),
        }))
    }

    /// A docker-exec sandbox of a non-root template: its user gets the workdir (Docker creates
    /// it as root). The agent does the same for itself at start.
    async fn give_workdir(&self, container: &str, template: &Template) -> anyhow::Result<()> {
        // Never a path the platform mounts (the config and the envelope refuse those already).
        if template.user == User::Root || agent_proto::layout::workdir_problem(&template.workdir).is_some() {
            return Ok(());
        }
        let argv = ["chown", &template.user.spec(), &template.workdir].map(String::from).to_vec();
        let req = DockerExec {
            argv,
            user: None,
            env: vec![],
            cwd: None,
            stdin: None,
            timeout: DOCKER_CHOWN_TIMEOUT,
            max_output: 4096,
        };
        let out = self.dock.exec(container, req).await?;
        anyhow::ensure!(
            out.exit_code == 0,
            "chown {}: {}",
            template.workdir,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(())
    }

    /// Starts the agent channel and a watcher that fails the sandbox if the channel is lost.
    fn watch(self: &Arc<Self>, id: &str, attached: crate::docker::Attached) -> AgentConn {
        let (conn, lost) = AgentConn::start(id, attached, &self.tracker, self.cancel.child_token());
        let node = self.clone();
        let id = id.to_string();
        let cancel = self.cancel.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = lost.cancelled() => node.channel_lost(&id).await,
            }
        });
        conn
    }

    /// The agent channel of a sandbox broke: the sandbox is failed, forgotten and replaced.
    async fn channel_lost(&self, id: &str) {
        // A sandbox we are destroying on purpose is no longer in the map.
        if self.sandbox(id).is_none() {
            return;
        }
        tracing::warn!(sandbox = %id, "agent channel lost; failing the sandbox");
        self.destroy(id, GoneReason::SandboxFailed).await;
    }

    /// `sb`'s CPU accounting so far; what is new since the last read goes into the
    /// per-template totals (`SANDBOX_CPU`, `SANDBOX_CPU_THROTTLED`).
    pub async fn cpu_use(&self, sb: &Sandbox) -> anyhow::Result<crate::docker::CpuUse> {
        let now = self.dock.cpu_use(&sb.container).await?;
        let before = std::mem::replace(&mut *lock(&sb.cpu_seen), now);
        let template = telemetry::metrics::template_label(&sb.template.name).to_string();
        let (used, throttled) = {
            let mut totals = lock(&self.cpu_totals);
            let t = totals.entry(template.clone()).or_default();
            t.0 += now.used.saturating_sub(before.used).as_secs_f64();
            t.1 += now.throttled.saturating_sub(before.throttled).as_secs_f64();
            *t
        };
        let labels = [("node", self.id.clone()), ("template", template)];
        metrics::counter!(names::SANDBOX_CPU, &labels).absolute(used as u64);
        metrics::counter!(names::SANDBOX_CPU_THROTTLED, &labels).absolute(throttled as u64);
        Ok(now)
    }

    /// Removes a sandbox's container and ledger record; a session on it ends with `reason`.
    #[tracing::instrument(name = "pool.destroy", skip_all, fields(sandbox = %id, reason = reason.as_str()))]
    pub async fn destroy(&self, id: &str, reason: GoneReason) {
        let sb = self.take(id);
        if let Some(a) = sb.as_ref().and_then(|s| s.agent.as_ref()) {
            a.close();
        }
        // Its last CPU use, into the per-template totals (a sandbox that ends unread counts too).
        if let Some(sb) = &sb
            && let Err(e) = self.cpu_use(sb).await
        {
            tracing::debug!(sandbox = %id, error = %e, "read the CPU use of an ending sandbox");
        }
        let container = match &sb {
            Some(s) => Some(s.container.clone()),
            None => match self.ledger.sandbox_container(&self.id, id).await {
                Ok(c) => c,
                // The ledger did not answer: Docker's labels say which container it is (a
                // record whose container is unknown would leave the container behind).
                Err(_) => {
                    self.dock.list().await.ok().and_then(|l| l.into_iter().find(|c| c.sandbox == id).map(|c| c.id))
                }
            },
        };
        if container.is_some() {
            metrics::counter!(names::DESTROYS, "node" => self.id.clone(), "reason" => reason.as_str()).increment(1);
        }
        self.agent_files.remove_run_dir(id);
        let left = Leftover { sandbox: id.to_string(), container, forget: Some(reason) };
        self.finish_or_retry(left).await;
    }

    /// Finishes a destroy now, or leaves what failed to the reaper's retries.
    async fn finish_or_retry(&self, left: Leftover) {
        if let Some(left) = self.finish_destroy(left).await {
            lock(&self.leftovers).push(left);
        }
    }

    /// Removes the container and forgets the record; what failed is given back.
    async fn finish_destroy(&self, mut left: Leftover) -> Option<Leftover> {
        if let Some(c) = &left.container {
            match self.dock.remove(c).await {
                Ok(()) => left.container = None,
                Err(e) => tracing::warn!(sandbox = %left.sandbox, error = %e, "remove container (will retry)"),
            }
        }
        if let Some(reason) = left.forget {
            match self.ledger.sandbox_remove(&self.id, &left.sandbox, reason).await {
                Ok(ended) => {
                    if let Some(ended) = ended {
                        metrics::counter!(names::SESSIONS_ENDED, "reason" => ended.reason.as_str()).increment(1);
                    }
                    left.forget = None;
                }
                Err(e) => tracing::warn!(sandbox = %left.sandbox, error = %e, "forget sandbox (will retry)"),
            }
        }
        (left.container.is_some() || left.forget.is_some()).then_some(left)
    }

    /// Retries the destroys that did not finish.
    async fn retry_leftovers(&self) {
        let todo = std::mem::take(&mut *lock(&self.leftovers));
        if todo.is_empty() {
            return;
        }
        let mut still = Vec::new();
        for left in todo {
            still.extend(self.finish_destroy(left).await);
        }
        if !still.is_empty() {
            tracing::info!(left = still.len(), "destroys still unfinished; retrying");
        }
        lock(&self.leftovers).extend(still);
    }

    // ---------- reconcile ----------

    /// Brings Docker and the ledger into agreement after a (re)start: live idle and leased
    /// sandboxes are reattached (16 at once) before this returns; unknown containers and
    /// records without a live container are removed after, in the background (8 at once).
    /// Docker removes ~12 containers a second whatever the parallelism, so a restart right after
    /// a release of 200 sessions waited 16 s for their removal when it came first (BENCHMARKS.md).
    #[tracing::instrument(name = "pool.reconcile", skip_all)]
    pub async fn reconcile(self: &Arc<Self>) -> anyhow::Result<()> {
        let containers = self.dock.list().await?;
        let records = self.ledger.sandboxes(&self.id).await?;
        let by_sandbox: HashMap<&str, &crate::docker::SandboxContainer> =
            containers.iter().map(|c| (c.sandbox.as_str(), c)).collect();
        let known: std::collections::HashSet<&str> = records.iter().map(|r| r.id.as_str()).collect();
        let unknown: Vec<String> =
            containers.iter().filter(|c| !known.contains(c.sandbox.as_str())).map(|c| c.id.clone()).collect();
        let by_sandbox = &by_sandbox;
        // Each record: `None` when reattached, else the sandbox to remove.
        let outcomes: Vec<Option<String>> = futures::stream::iter(records.iter().map(|r| async move {
            let container = by_sandbox.get(r.id.as_str()).filter(|c| c.running || c.paused);
            let template = self.template(&r.template);
            let keep = matches!(r.state, SandboxState::Idle | SandboxState::Leased);
            let (Some(container), Some(template), true) = (container, template, keep) else {
                return Some(r.id.clone());
            };
            match self.readopt(&r.id, r.fence, container, template).await {
                Ok(()) => None,
                Err(e) => {
                    tracing::warn!(sandbox = %r.id, error = %e, "reattach failed");
                    // Out of the map at once: the node must not serve it meanwhile.
                    self.take(&r.id);
                    Some(r.id.clone())
                }
            }
        }))
        .buffer_unordered(READOPTS_IN_FLIGHT)
        .collect()
        .await;
        let stale: Vec<String> = outcomes.into_iter().flatten().collect();
        let kept = records.len() - stale.len();
        // Socket directories of this node's sandboxes that are gone (a crash between a
        // container's removal and its directory's; stale ones go with their `destroy`).
        let mine = format!("{}.", self.id);
        for e in std::fs::read_dir(&self.agent_files.run).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&mine) && self.sandbox(&name).is_none() && !stale.contains(&name) {
                self.agent_files.remove_run_dir(&name);
            }
        }
        tracing::info!(kept, removing = stale.len() + unknown.len(), "reconciled sandboxes");
        enum Removal {
            Container(String),
            Sandbox(String),
        }
        let removals = unknown
            .into_iter()
            .map(Removal::Container)
            .chain(stale.into_iter().map(Removal::Sandbox))
            .map(|what| {
                let node = self.clone();
                async move {
                    match what {
                        Removal::Sandbox(id) => node.destroy(&id, GoneReason::SandboxFailed).await,
                        Removal::Container(c) => {
                            let left = Leftover {
                                sandbox: format!("(unknown, container {c})"),
                                container: Some(c),
                                forget: None,
                            };
                            node.finish_or_retry(left).await;
                        }
                    }
                }
            })
            .collect::<Vec<_>>();
        self.tracker.spawn(async move {
            futures::stream::iter(removals).buffer_unordered(config::MAX_DESTROYS_IN_FLIGHT).collect::<()>().await;
        });
        Ok(())
    }

    /// Takes a sandbox found after a restart back: reattaches its agent and checks that it
    /// answers. A paused one is thawed for that (Docker attaches to no frozen container, and
    /// a frozen agent cannot answer) and frozen again: it stays paused, and its next call
    /// resumes it.
    async fn readopt(
        self: &Arc<Self>,
        id: &str,
        fence: u64,
        container: &crate::docker::SandboxContainer,
        template: Arc<Template>,
    ) -> anyhow::Result<()> {
        if container.paused {
            self.dock.set_paused(&container.id, false).await?;
        }
        let agent = match template.exec {
            ExecMode::Agent => {
                let direct = match crate::docker::direct_channel(&template) {
                    true => {
                        let check = self.agent_files.check_socket(id);
                        // The agent serves its socket only: a sandbox whose socket was tampered
                        // with is not reached another way, it fails (and ends).
                        if let SocketCheck::Tampered(problem) = check {
                            anyhow::bail!("the agent's socket is not the one this node sealed: {problem}");
                        }
                        let direct = Dock::connect_agent(&self.agent_files.run_dir(id), Duration::ZERO).await;
                        if direct.is_some() && check == SocketCheck::Unsealed {
                            self.agent_files.seal_run_dir(id).context("seal the agent's socket directory")?;
                        }
                        direct
                    }
                    false => None,
                };
                let attached = match direct {
                    Some(d) => d,
                    None => self.dock.attach(&container.id).await?,
                };
                Some(self.watch(id, attached))
            }
            ExecMode::Docker => None,
        };
        self.join_egress(id, &container.id, &template, None).await?;
        let sb = Arc::new(Sandbox {
            id: id.to_string(),
            template,
            container: container.id.clone(),
            agent: agent.clone(),
            max_fence: AtomicU64::new(fence),
            paused: AtomicBool::new(container.paused),
            shells: Default::default(),
            ports: Default::default(),
            runtime: Default::default(),
            cpu_seen: Default::default(),
        });
        self.insert(sb);
        if let Some(conn) = agent {
            conn.ping(AGENT_READY_TIMEOUT)
                .await
                .map_err(|e| anyhow::anyhow!("reattached agent does not answer: {e}"))?;
            metrics::counter!(names::AGENT_REATTACHES, "node" => self.id.clone()).increment(1);
        }
        if container.paused {
            self.dock.set_paused(&container.id, true).await?;
        }
        tracing::debug!(sandbox = %id, paused = container.paused, "reattached");
        Ok(())
    }

    // ---------- background loops ----------

    /// Destroys sandboxes the ledger dooms (released or expired sessions): up to
    /// `config::MAX_DESTROYS_IN_FLIGHT` at once, `destroys_beside_creates` while creates run.
    pub async fn destroy_loop(self: Arc<Self>, cancel: CancellationToken) {
        let slots = Arc::new(Semaphore::new(config::MAX_DESTROYS_IN_FLIGHT));
        loop {
            // Yield to creates: wait (polling; a create takes hundreds of milliseconds) until
            // the destroys in flight are under what the creates running now leave them.
            while config::MAX_DESTROYS_IN_FLIGHT - slots.available_permits() >= self.destroy_allowance() {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
            }
            if cancel.is_cancelled() {
                return;
            }
            let popped = tokio::select! {
                _ = cancel.cancelled() => return,
                r = self.ledger.pop_doomed(&self.id, Duration::from_secs(1)) => r,
            };
            match popped {
                Ok(Some(id)) => {
                    let Ok(permit) = slots.clone().acquire_owned().await else { return };
                    let node = self.clone();
                    self.tracker.spawn(async move {
                        node.destroy(&id, GoneReason::Removed).await;
                        drop(permit);
                    });
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "pop doomed sandbox");
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
    }

    /// Destroys that may be in flight now: all slots while no create runs, a few beside creates.
    fn destroy_allowance(&self) -> usize {
        if self.pools.in_flight() > 0 {
            self.config.pool_manager.destroys_beside_creates
        } else {
            config::MAX_DESTROYS_IN_FLIGHT
        }
    }

    /// Ends expired sessions; their sandboxes are then destroyed by `destroy_loop`.
    pub async fn reap_loop(self: Arc<Self>, cancel: CancellationToken) {
        let mut last_sweep = tokio::time::Instant::now();
        let mut last_lost = tokio::time::Instant::now();
        let mut last_orphans = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(REAP_INTERVAL) => {}
            }
            // A span per tick only at debug level: the reaper runs twice a second, and the work
            // it causes (destroying sandboxes) has spans of its own (`pool.destroy`).
            let tick = tracing::debug_span!("pool.reap");
            match tracing::Instrument::instrument(self.ledger.reap_expired(&self.id, 256), tick).await {
                Ok(ended) => {
                    for e in ended {
                        metrics::counter!(names::SESSIONS_ENDED, "reason" => e.reason.as_str()).increment(1);
                        tracing::info!(session = %e.session_id, tenant = %e.tenant, "session expired");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "reap expired sessions"),
            }
            // Waiting counts that still count vanished waiters are put right.
            let templates = self.template_names();
            let templates: Vec<&str> = templates.iter().map(String::as_str).collect();
            if let Err(e) = self.ledger.recount_waiters(&self.id, &templates).await {
                tracing::warn!(error = %e, "recount the queues");
            }
            // The quota leases of sessions that ended here (reaped, failed, removed).
            if let Err(e) = self.ledger.quota_drain_returns(&self.id, 256).await {
                tracing::warn!(error = %e, "give quota leases back");
            }
            if last_orphans.elapsed() >= ORPHAN_SWEEP_INTERVAL {
                last_orphans = tokio::time::Instant::now();
                if let Err(e) = self.sweep().await {
                    tracing::warn!(error = format!("{e:#}"), "compare containers with the ledger");
                }
            }
            if last_lost.elapsed() >= LOST_SWEEP_INTERVAL {
                last_lost = tokio::time::Instant::now();
                self.retry_leftovers().await;
                if let Err(e) = self.give_up_lost_nodes().await {
                    tracing::warn!(error = %e, "give up lost nodes");
                }
            }
            if last_sweep.elapsed() >= QUOTA_SWEEP_INTERVAL {
                last_sweep = tokio::time::Instant::now();
                match self.ledger.quota_sweep(&self.config.quotas.default).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(leases = n, "quota sweep gave back leases whose holder is gone"),
                    Err(e) => tracing::warn!(error = %e, "quota sweep"),
                }
            }
        }
    }

    /// Renews the node id's lease every 2 s (the node is live while it holds it) and records
    /// the heartbeat. A lease found vacant means the node was down (Redis unreachable past
    /// `node.down_after`) or the ledger lost its data: the node registers again, and rebuilds
    /// its part of the ledger from what it runs if the ledger forgot it. A lease another
    /// process took stops this one: two pool-managers must never act as one node. On shutdown
    /// the lease is given back, so the node is down at once rather than `down_after` later.
    pub async fn heartbeat_loop(self: Arc<Self>, cancel: CancellationToken) {
        let lease_ms = self.config.node.down_after.as_millis() as u64;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(HEARTBEAT_INTERVAL) => {}
            }
            match self.ledger.claim_node(&self.id, &self.holder, lease_ms, false).await {
                Ok(ledger::NodeClaim::Claimed { fresh, known }) => {
                    if fresh {
                        self.rejoin(known).await;
                    }
                    let beat = async { self.ledger.heartbeat(&self.id, self.ledger.now_ms().await?).await };
                    if let Err(e) = beat.await {
                        tracing::warn!(error = %e, "heartbeat");
                    }
                }
                Ok(ledger::NodeClaim::Held { by, .. }) => {
                    tracing::error!(node = %self.id, holder = %by, "another pool-manager took this node's id; this one stops");
                    self.cancel.cancel();
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "renew the node's lease"),
            }
        }
        if let Err(e) = self.ledger.release_node(&self.id, &self.holder).await {
            tracing::warn!(error = %e, "give the node's lease back");
        }
    }

    /// The node's lease had lapsed: register again (a node given up was removed from the
    /// registry) and bring back what the ledger forgot of this node's sandboxes (all of it,
    /// when Redis came back empty; `known` says whether it still had any record of them).
    async fn rejoin(self: &Arc<Self>, known: bool) {
        tracing::warn!(node = %self.id, known, "the node's lease had lapsed (it was down, or the ledger lost it); rejoining");
        if let Err(e) = self.register().await {
            tracing::warn!(error = %e, "register the node again");
        }
        if let Err(e) = self.rebuild().await {
            tracing::warn!(error = %e, "rebuild the node's part of the ledger");
        }
    }

    /// Every sandbox the node runs that the ledger has no record of (Redis lost it): one no
    /// tenant call ever reached (no fence admitted, never paused) goes back to its pool; the
    /// others served sessions whose records are gone, so they are removed (their tenants get
    /// 404 for those ids, as for any id the ledger does not know). A sandbox always has its
    /// record before it joins the map and leaves the map before its record goes, so a sandbox
    /// in the map without a record is one the ledger forgot. Private templates come back from
    /// their images' labels (`prune_snapshots`), never deleted for lack of a record.
    ///
    /// Safe while the node works (`sweep` calls it): only a sandbox in the map both before and
    /// after the records are read counts, so one that joined or left the map meanwhile (its
    /// record written before, or removed after) is never taken for forgotten.
    pub async fn rebuild(self: &Arc<Self>) -> Result<(), ledger::LedgerError> {
        let before: HashSet<String> = lock(&self.sandboxes).keys().cloned().collect();
        let records: HashSet<String> = self.ledger.sandboxes(&self.id).await?.into_iter().map(|r| r.id).collect();
        let forgotten: Vec<Arc<Sandbox>> = lock(&self.sandboxes)
            .values()
            .filter(|sb| before.contains(&sb.id) && !records.contains(&sb.id))
            .cloned()
            .collect();
        if forgotten.is_empty() {
            return Ok(());
        }
        let (mut pooled, mut removed) = (0, 0);
        for sb in forgotten {
            let pristine = sb.max_fence.load(Ordering::Acquire) == 0 && !sb.paused.load(Ordering::Acquire);
            if pristine {
                self.ledger.sandbox_add(&self.id, &sb.id, &sb.template.name).await?;
                self.ledger.sandbox_ready(&self.id, &sb.id, &sb.container).await?;
                pooled += 1;
            } else {
                removed += 1;
                let node = self.clone();
                self.tracker.spawn(async move { node.destroy(&sb.id, GoneReason::Removed).await });
            }
        }
        metrics::counter!(names::LEDGER_REBUILDS, "node" => self.id.clone()).increment(1);
        tracing::warn!(
            pooled,
            removed,
            "rebuilt the node's part of the ledger from its sandboxes (the ledger had forgotten them)"
        );
        self.prune_snapshots()
            .await
            .map_err(|e| ledger::LedgerError::Corrupt(format!("restore private templates: {e:#}")))?;
        Ok(())
    }

    /// `reconcile` for a node that runs, every `ORPHAN_SWEEP_INTERVAL`. A container of this
    /// node that neither its map nor the ledger knows is removed: one whose create a killed
    /// pool-manager had sent, which Docker finished after its successor's `reconcile` had
    /// listed the containers and forgotten the half-made record. (A sandbox of this process
    /// has its record before its container exists, so none of its own creates is taken.) Then
    /// sandboxes the ledger forgot while it kept the node's lease (a Redis restart that lost
    /// its last second of writes) are rebuilt, as after a lapsed lease.
    ///
    /// Cost O(creates since the last sweep): the containers looked at are those Docker's event
    /// stream reported created (`container_events_loop`), and the records are read only when
    /// the ledger holds fewer than the map has sandboxes (every sandbox has its record before
    /// it joins the map and until after it leaves, so fewer means forgotten). Every container
    /// is listed when the stream is down or new, and everything is read every
    /// `FULL_SWEEP_INTERVAL`, the net under both.
    pub async fn sweep(self: &Arc<Self>) -> anyhow::Result<SweepCost> {
        let mut cost = SweepCost::default();
        let now = std::time::Instant::now();
        let (full, listing_for, created) = {
            let mut s = lock(&self.sightings);
            let full = s.full_at.is_none_or(|at| now.duration_since(at) >= FULL_SWEEP_INTERVAL);
            let settled = s.up.filter(|(_, at)| now.duration_since(*at) >= EVENTS_SETTLE).map(|(n, _)| n);
            let list = full || settled.is_none() || s.listed != settled;
            (full, list.then_some(settled), std::mem::take(&mut s.created))
        };
        let candidates: Vec<crate::docker::SandboxContainer> = match listing_for {
            Some(settled) => {
                let containers = match self.dock.list().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Looked at next time, listed or not.
                        lock(&self.sightings).created.extend(created);
                        return Err(e);
                    }
                };
                cost.containers_listed = containers.len();
                let mut s = lock(&self.sightings);
                if settled.is_some() && s.up.map(|(n, _)| n) == settled {
                    s.listed = settled;
                }
                containers
            }
            None => created
                .into_iter()
                .map(|(id, sandbox)| crate::docker::SandboxContainer { id, sandbox, running: false, paused: false })
                .collect(),
        };
        // Only those the map does not have, before and after the records are read: one that
        // joined or left it meanwhile has (or had) its record and is never taken for unknown.
        let candidates: Vec<_> = candidates.into_iter().filter(|c| self.sandbox(&c.sandbox).is_none()).collect();
        if listing_for.is_none() {
            cost.containers_checked = candidates.len();
        }
        if !candidates.is_empty() {
            let ids: Vec<&str> = candidates.iter().map(|c| c.sandbox.as_str()).collect();
            let recorded = self.ledger.sandboxes_recorded(&self.id, &ids).await?;
            // Unfinished destroys are the reaper's to retry, not unknown.
            let leftover: HashSet<String> = lock(&self.leftovers).iter().filter_map(|l| l.container.clone()).collect();
            let unknown: Vec<_> = candidates
                .into_iter()
                .zip(recorded)
                .filter(|(c, recorded)| !recorded && self.sandbox(&c.sandbox).is_none() && !leftover.contains(&c.id))
                .map(|(c, _)| c)
                .collect();
            for c in unknown {
                tracing::warn!(sandbox = %c.sandbox, container = %c.id, "removing a container neither the node nor the ledger knows");
                metrics::counter!(names::DESTROYS, "node" => self.id.clone(), "reason" => "orphan").increment(1);
                let left = Leftover { sandbox: c.sandbox, container: Some(c.id), forget: None };
                self.finish_or_retry(left).await;
            }
        }
        // Fewer records than sandboxes in the map (counted before and after) means forgotten
        // ones; a sandbox that left the map and its record meanwhile can only make it look so
        // (a full rebuild that finds nothing), never hide it.
        let in_map = self.sandbox_count();
        let records = self.ledger.sandbox_record_count(&self.id).await?;
        let in_map = in_map.min(self.sandbox_count()) as u64;
        if full || records < in_map {
            cost.records_read = records as usize;
            self.rebuild().await?;
        }
        if full {
            lock(&self.sightings).full_at = Some(now);
        }
        Ok(cost)
    }

    /// Follows Docker's reports of this node's container creates and removals, for the sweep
    /// (`Sightings`); reconnects after a second when the stream ends (a dockerd restart), and
    /// the sweep lists every container until the new stream has settled.
    pub async fn container_events_loop(self: Arc<Self>, cancel: CancellationToken) {
        let mut connection = 0u64;
        while !cancel.is_cancelled() {
            connection += 1;
            lock(&self.sightings).up = Some((connection, std::time::Instant::now()));
            let mut events = std::pin::pin!(self.dock.container_events());
            loop {
                let next = tokio::select! {
                    _ = cancel.cancelled() => return,
                    e = events.next() => e,
                };
                match next {
                    Some(Ok(crate::docker::ContainerEvent::Created { id, sandbox })) => {
                        lock(&self.sightings).created.insert(id, sandbox);
                    }
                    Some(Ok(crate::docker::ContainerEvent::Destroyed { id })) => {
                        lock(&self.sightings).created.remove(&id);
                    }
                    Some(Err(e)) => {
                        tracing::debug!(error = format!("{e:#}"), "docker's event stream failed");
                        break;
                    }
                    None => break,
                }
            }
            lock(&self.sightings).up = None;
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// Gives up every other node silent past `node.lost_after`: its sessions end (`node_lost`)
    /// and their quota leases return; its idle sandboxes leave the pools; it leaves the
    /// registry. Idempotent: any number of nodes may do it at once.
    pub async fn give_up_lost_nodes(&self) -> Result<(), ledger::LedgerError> {
        let lost_ms = self.config.node.lost_after.as_millis() as u64;
        for n in self.ledger.node_states().await? {
            if n.info.id == self.id || n.silent_ms < lost_ms {
                continue;
            }
            let (mut ended, mut doomed) = (0usize, 0u64);
            loop {
                match self.ledger.give_up_node(&n.info.id, 256).await? {
                    ledger::NodeLost::Live => break,
                    ledger::NodeLost::GivenUp { ended: e, doomed: d, more } => {
                        for s in &e {
                            metrics::counter!(names::SESSIONS_ENDED, "reason" => s.reason.as_str()).increment(1);
                        }
                        ended += e.len();
                        doomed += d;
                        while self.ledger.quota_drain_returns(&n.info.id, 256).await? == 256 {}
                        if !more {
                            self.ledger.forget_node(&n.info.id).await?;
                            metrics::counter!(names::NODES_LOST).increment(1);
                            tracing::warn!(node = %n.info.id, silent_s = n.silent_ms / 1000, sessions = ended, idle = doomed, "gave up a lost node");
                            break;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Runs the shell once in a new sandbox (`/bin/sh -c :`), so its binary is in the sandbox's
/// page cache before a tenant's first command: on a btrfs data root (disk bounds on a kernel
/// without XFS quotas) containers do not share the page cache of their image's files, and the
/// first command of each sandbox would read its binary through the loop device (about 3 ms).
/// Every shell-string command starts with this binary (with busybox images, every applet is
/// it). An image without `/bin/sh` simply gains nothing.
async fn warm_up(conn: &AgentConn) {
    let spec = agent_proto::ExecSpec {
        argv: ["/bin/sh", "-c", ":"].map(String::from).to_vec(),
        timeout_ms: WARM_UP_TIMEOUT.as_millis() as u64,
        max_output: 4096,
        ..Default::default()
    };
    if let Err(e) = conn.exec(spec, None, WARM_UP_TIMEOUT).await {
        tracing::debug!(error = %e, "warm-up command");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_keeps_its_data() {
        let m = Arc::new(Mutex::new(HashMap::from([("a".to_string(), 1)])));
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let mut g = m2.lock().unwrap();
            g.insert("b".to_string(), 2);
            panic!("poison the lock");
        })
        .join();
        assert!(r.is_err());
        assert!(m.is_poisoned());
        lock(&m).insert("c".to_string(), 3);
        let mut keys: Vec<String> = lock(&m).keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, ["a", "b", "c"]);
    }
}

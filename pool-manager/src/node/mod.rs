//! The node: its sandboxes, how they are created, warmed, leased cold, failed and destroyed,
//! and the background loops that keep the ledger and Docker in agreement.
//!
//! The struct and its small accessors are here; each of its jobs has a room of its own:
//! `templates` (which templates the node serves, snapshots), `create`, `destroy` (and the
//! destroy loop), `recover` (reconcile after a restart, rebuild of a forgotten ledger, the
//! orphan sweep), `loops` (reaper, heartbeat, lost nodes) and `pools` (the pool loop and its
//! admission). Each is an `impl Node` block, split on purpose: they share the sandbox map and
//! its invariants.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use config::{Config, Template};
use ledger::{GoneReason, Ledger, NodeInfo};
use telemetry::names;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::runtime::Runtime;
use crate::sandbox::Sandbox;
use crate::sync::lock;

mod create;
mod destroy;
mod loops;
pub(crate) mod pools;
mod recover;
mod stats;
mod templates;
#[cfg(test)]
mod tests;

/// Why a sandbox could not be created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The ledger (Redis) failed to record the new sandbox; nothing was created.
    #[error("ledger: {0}")]
    Ledger(#[from] ledger::LedgerError),
    /// The container or its agent failed; its message starts with `PULL_FAILED` when the image
    /// could not be pulled.
    #[error("{0:#}")]
    Failed(anyhow::Error),
}

/// How a create's error starts when the template's image could not be pulled (the rest is the
/// registry's reason, which the tenant is told).
pub const PULL_FAILED: &str = "image pull failed: ";

/// Who a node is: its id and the holder string of the id's lease (`identity::holder`).
pub struct Identity {
    /// The node id (`node.id`, or derived from the host name and Docker's engine id).
    pub id: String,
    /// This process's claim on the id's lease (`identity::holder`).
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

/// One node's state: its sandboxes, templates, images and pools, and the handles (ledger, engine,
/// egress) they are managed through.
pub struct Node {
    /// The node's id, as registered in the ledger.
    pub id: String,
    /// This process's claim on the id's lease.
    holder: String,
    /// The configuration the pool-manager was started with.
    pub config: Arc<Config>,
    /// The Redis ledger the node keeps its sandboxes' records in.
    pub ledger: Ledger,
    /// The container runtime its sandboxes run on.
    pub(crate) engine: Arc<dyn Runtime>,
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
    /// The map's sandboxes counted by template and image; changed only under the map's lock.
    held: Mutex<crate::held::HeldCounts>,
    /// Destroys that did not finish (Docker or Redis unreachable): retried by the reaper.
    leftovers: Mutex<Vec<Leftover>>,
    /// Containers Docker reported made since the last sweep (`container_events_loop`).
    sightings: Mutex<Sightings>,
    /// Per template label: CPU seconds used and throttled by its sandboxes as read so far
    /// (`cpu_use`), exported in whole seconds (the recorder's counters are integers).
    cpu_totals: Mutex<HashMap<String, (f64, f64)>>,
    pub(crate) pools: crate::node::pools::Pools,
    pub(crate) tracker: TaskTracker,
    cancel: CancellationToken,
    /// The egress proxy, when a template uses named egress.
    pub egress: Option<Arc<crate::egress::Egress>>,
}

fn random_hex_id(node: &str, bytes: usize) -> String {
    let r: Vec<u8> = (0..bytes).map(|_| rand::random::<u8>()).collect();
    wire::ids::make(node, &r)
}

/// A new sandbox's agent must answer within this long after start.
pub(super) const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(10);

impl Node {
    /// A node with no sandboxes yet; `start` then reconciles it with the ledger and the engine.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        identity: Identity,
        config: Arc<Config>,
        ledger: Ledger,
        engine: Arc<dyn Runtime>,
        agent_files: crate::agent_bin::AgentFiles,
        egress: Option<Arc<crate::egress::Egress>>,
        tracker: TaskTracker,
        cancel: CancellationToken,
    ) -> Arc<Node> {
        let templates = config.templates.iter().map(|(k, v)| (k.clone(), Arc::new(v.clone()))).collect();
        let images = crate::images::Images::new(
            &identity.id,
            engine.clone(),
            ledger.clone(),
            config.images.clone(),
            tracker.clone(),
            cancel.clone(),
        );
        Arc::new(Node {
            id: identity.id,
            holder: identity.holder,
            images,
            from_images: Mutex::new((0, HashMap::new())),
            pools: crate::node::pools::Pools::new(&config),
            config,
            ledger,
            engine,
            templates,
            agent_files,
            sandboxes: Mutex::new(HashMap::new()),
            held: Mutex::default(),
            leftovers: Mutex::new(Vec::new()),
            sightings: Mutex::new(Sightings::default()),
            cpu_totals: Mutex::new(HashMap::new()),
            private: Mutex::new(HashMap::new()),
            tracker,
            cancel,
            egress,
        })
    }

    /// The node's sandbox `id`, if it holds one.
    pub fn sandbox(&self, id: &str) -> Option<Arc<Sandbox>> {
        lock(&self.sandboxes).get(id).cloned()
    }

    /// How many sandboxes the node holds now.
    pub fn sandbox_count(&self) -> usize {
        lock(&self.sandboxes).len()
    }

    /// Up to `n` of the node's containers (whichever the map yields first: its order is a
    /// hash's, unrelated to age or template), and how many it holds in all.
    pub(crate) fn container_sample(&self, n: usize) -> (Vec<String>, u64) {
        let map = lock(&self.sandboxes);
        (map.values().take(n).map(|s| s.container.clone()).collect(), map.len() as u64)
    }

    /// The images the node's sandboxes run.
    pub(crate) fn sandbox_images(&self) -> HashSet<String> {
        lock(&self.held).images()
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
        lock(&self.held).by_template()
    }

    /// Paused sandboxes per template (the pool metrics): counted as they are frozen and thawed,
    /// O(templates).
    pub fn paused_by_template(&self) -> HashMap<String, u64> {
        lock(&self.held).paused_by_template()
    }

    /// Records that `sb`'s container was frozen (`pause`) or thawed. The flag changes under the
    /// map's lock, with the paused count when `sb` is in the map, so the two never disagree (a
    /// sandbox destroyed meanwhile only has its flag set).
    pub(crate) fn mark_paused(&self, sb: &Arc<Sandbox>, pause: bool) {
        let map = lock(&self.sandboxes);
        let was = sb.paused.swap(pause, Ordering::Relaxed);
        if was != pause && map.get(&sb.id).is_some_and(|held| Arc::ptr_eq(held, sb)) {
            lock(&self.held).pause(&sb.template.name, pause);
        }
    }

    pub(super) fn insert(&self, sb: Arc<Sandbox>) {
        let mut map = lock(&self.sandboxes);
        let mut held = lock(&self.held);
        held.add(&sb.template.name, &sb.template.image, sb.paused.load(Ordering::Relaxed));
        if let Some(old) = map.insert(sb.id.clone(), sb) {
            held.remove(&old.template.name, &old.template.image, old.paused.load(Ordering::Relaxed));
        }
    }

    pub(super) fn take(&self, id: &str) -> Option<Arc<Sandbox>> {
        if let Some(e) = &self.egress {
            e.forget(id);
        }
        let mut map = lock(&self.sandboxes);
        let sb = map.remove(id)?;
        lock(&self.held).remove(&sb.template.name, &sb.template.image, sb.paused.load(Ordering::Relaxed));
        Some(sb)
    }

    /// Puts an egress sandbox under `policy` (`None`: what the ledger recorded, else its
    /// template's initial policy) and records it.
    pub(super) async fn join_egress(
        &self,
        id: &str,
        container: &str,
        template: &Template,
        policy: Option<String>,
    ) -> anyhow::Result<()> {
        let (Some(egress), Some(te)) = (&self.egress, &template.egress) else { return Ok(()) };
        let ip = self.engine.container_ip(container, &egress.net.name).await?;
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

    /// Records the node in the ledger's registry with its advertised address
    /// (`pool_manager.advertise`), so gateways can reach it.
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

    /// `sb`'s CPU accounting so far; what is new since the last read goes into the
    /// per-template totals (`SANDBOX_CPU`, `SANDBOX_CPU_THROTTLED`).
    pub async fn cpu_use(&self, sb: &Sandbox) -> anyhow::Result<crate::runtime::CpuUse> {
        let now = self.engine.cpu_use(&sb.container).await?;
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
}

//! The pool-manager: sandpool's node agent. It alone talks to Docker; it creates, hardens,
//! warms, reaps and removes the sandboxes of its node, serves exec and files for them over
//! an internal HTTP API, and keeps its part of the Redis ledger true after any restart.

mod admit;
pub(crate) mod agent_bin;
mod backend;
pub mod budget;
pub(crate) mod cgroup_cpu;
pub(crate) mod channel;
pub(crate) mod disk;
pub mod docker;
pub mod egress;
mod errors;
pub(crate) mod functions;
mod held;
pub(crate) mod hostnet;
pub(crate) mod http;
pub(crate) mod identity;
pub(crate) mod images;
pub(crate) mod lazy;
pub use lazy::Lazyd;
pub(crate) mod lazy_upkeep;
pub(crate) mod listing;
pub mod node;
pub(crate) mod pace;
pub(crate) mod plan;
pub(crate) mod ports;
pub(crate) mod runtime;
mod sandbox;
pub(crate) mod shells;
pub(crate) mod stream;
mod sync;
mod template_rates;
mod zeros;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use config::Config;
use ledger::Ledger;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use node::Node;

/// A started pool-manager: its bound address and the handle to wait for its shutdown.
pub struct Running {
    /// The internal API's bound address (the real port when `pool_manager.listen` asked for 0).
    pub addr: SocketAddr,
    /// The node it serves.
    pub node: Arc<Node>,
    tracker: TaskTracker,
}

impl Running {
    /// Waits until every task has finished (after `cancel` fired).
    pub async fn wait(self) {
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// The node id `config` gives, or the host's (its name and Docker's engine id).
pub async fn node_id(config: &Config) -> anyhow::Result<String> {
    match &config.node.id {
        Some(id) => Ok(id.clone()),
        None => Ok(identity::derive(&identity::hostname(), &docker::engine_id(&config.docker.socket).await?)),
    }
}

/// Connects to Redis and Docker, installs the agent, reconciles, binds the internal API and
/// starts the background loops. Everything stops when `cancel` fires; await `Running::wait`.
pub async fn start(config: Arc<Config>, cancel: CancellationToken) -> anyhow::Result<Running> {
    let engine = docker::engine_id(&config.docker.socket).await?;
    let host = identity::hostname();
    let node_id = config.node.id.clone().unwrap_or_else(|| identity::derive(&host, &engine));
    let holder = identity::holder(&host, &engine);
    let ledger = Ledger::connect(&config.redis.url, &config.redis.prefix)
        .await
        .with_context(|| format!("connect to redis at {}", config.redis.url))?;
    // The id's lease: a live pool-manager elsewhere with this id keeps it, and this one stops
    // here, before it touches a container or a key of that node.
    let lease_ms = config.node.down_after.as_millis() as u64;
    if let ledger::NodeClaim::Held { by, ttl_ms } = ledger.claim_node(&node_id, &holder, lease_ms, true).await? {
        let host = by.split('|').next().unwrap_or(&by);
        anyhow::bail!(
            "node id {node_id:?} is held by a live pool-manager on {host} (its lease runs {:.1}s more and is renewed while it lives); \
             give this one another id (--node-id / SANDPOOL_NODE_ID / node.id) or stop that one",
            ttl_ms as f64 / 1000.0
        );
    }
    zeros::register(&config, &node_id);
    let dock = docker::Dock::connect(&config.docker.socket, &config.redis.prefix, &node_id).await?;
    for t in config.templates.values() {
        // An image pinned by digest is pulled (or, a lazy one, mounted) on its first need.
        if !images::is_pulled(&t.image) && !dock.image_exists(&t.image).await? {
            tracing::warn!(template = %t.name, image = %t.image, "image not found; creates of this template will fail until it is built");
        }
    }
    // Every network a sandbox can get is filtered from the start, whatever this config's
    // templates use: templates made through the API, an earlier run's sandboxes and another
    // config's may be on the bridge (the rule names its interface, present or not). The
    // network itself is made only for a configured bridge template: a second Docker engine
    // in the same network namespace that made it too would take over the interface (and
    // readdress it) under the first engine's sandboxes.
    hostnet::guard(docker::BRIDGE_IFACE).await.context("keep bridge sandboxes off the host's services")?;
    if config.templates.values().any(|t| t.network == wire::Network::Bridge) {
        dock.ensure_bridge_network().await.context("create the sandboxes' bridge network")?;
    }
    let bin_dir = config.pool_manager.state_dir.join("bin");
    let agent_files =
        agent_bin::install_all(&bin_dir).with_context(|| format!("install agent into {}", bin_dir.display()))?;
    let etc_dir = config.pool_manager.state_dir.join("etc");
    let etc_dir = disk::install_etc(&etc_dir)
        .with_context(|| format!("install sandbox /etc files into {}", etc_dir.display()))?;
    let bounded = if config.templates.values().any(|t| t.disk_mb > 0) {
        let images: Vec<&str> = config.templates.values().map(|t| t.image.as_str()).collect();
        let support = dock.probe_disk_bounds(&images).await.context("ask docker whether it bounds disks")?;
        disk::decide(&config, &support)?
    } else {
        false
    };
    let dock = dock
        .with_disk_bounds(bounded)
        .with_sandbox_etc(etc_dir.clone())
        .with_lazyd(lazy::Lazyd::of(&config.images))
        .with_shim_group(config.docker.shim_group, config.pool_manager.max_creates_in_flight);

    // Bind first: with port 0 (tests) the advertised address is only known now.
    let listener = tokio::net::TcpListener::bind(config.pool_manager.listen)
        .await
        .with_context(|| format!("bind pool_manager.listen {}", config.pool_manager.listen))?;
    let addr = listener.local_addr()?;
    let config = if config.pool_manager.advertise.ends_with(":0") {
        let mut c = (*config).clone();
        c.pool_manager.advertise = format!("http://{addr}");
        Arc::new(c)
    } else {
        config
    };

    let tracker = TaskTracker::new();
    let (dock, egress) = if config.templates.values().any(|t| t.network == wire::Network::Egress) {
        let (name, iface, gateway, subnet) = dock.ensure_egress_network().await.context("create the egress network")?;
        let resolv_conf = etc_dir.join(format!("resolv.{iface}.conf"));
        std::fs::write(&resolv_conf, format!("nameserver {gateway}\noptions ndots:0\n"))
            .with_context(|| format!("write {}", resolv_conf.display()))?;
        let net = egress::EgressNet { node: node_id.clone(), name, iface, gateway, subnet, resolv_conf };
        let bridge = dock.network_ipv4(docker::BRIDGE_NETWORK).await?.map(|(_, subnet)| subnet);
        let egress = egress::Egress::start(
            &config,
            ledger.clone(),
            net.clone(),
            &[addr.port()],
            bridge.as_slice(),
            &tracker,
            cancel.child_token(),
        )
        .await
        .context("start the egress proxy")?;
        (dock.with_egress(Some(net)), Some(egress))
    } else {
        (dock, None)
    };
    // An egress network of an earlier run that this run does not serve: closed (nothing in or
    // out), not left with a previous proxy's rules or none.
    let serving = egress.as_ref().map(|e| e.net.iface.clone());
    for iface in dock.egress_bridges().await.context("list the node's egress networks")? {
        if Some(&iface) != serving.as_ref() {
            egress::firewall::close(&iface).await.with_context(|| format!("close egress bridge {iface}"))?;
        }
    }
    for t in config.templates.values().filter(|t| t.egress.is_some() && t.runtime == "runsc") {
        tracing::warn!(template = %t.name, "named egress under gVisor needs runsc's own network (the scripts register it with --network=none: such sandboxes have loopback only)");
    }
    let node = Node::new(
        node::Identity { id: node_id.clone(), holder },
        config.clone(),
        ledger,
        Arc::new(dock),
        agent_files,
        egress,
        tracker.clone(),
        cancel.clone(),
    );
    node.remeasure().await;
    let budget = node.budget();
    tracing::info!(capacity = budget.capacity, binding = %budget.binding, "node sandbox budget");
    if let Some(advice) = budget::tuning_advice(&budget) {
        tracing::warn!("{advice}");
    }
    // Image templates first: a snapshot of a sandbox of one has it as its base.
    node.refresh_image_templates().await.context("load templates made from images")?;
    node.refresh_private_templates().await.context("load private templates")?;
    node.images.resync().await.context("check the pulled images the ledger lists")?;
    node.reconcile().await.context("reconcile sandboxes")?;
    node.register().await.context("register node")?;

    let app = http::app(node.clone());
    let serve_cancel = cancel.clone();
    tracker.spawn(async move {
        let r = axum::serve(listener, app).with_graceful_shutdown(serve_cancel.cancelled_owned()).await;
        if let Err(e) = r {
            tracing::error!(error = %e, "pool-manager server failed");
        }
    });
    tracker.spawn(node.clone().pool_loop(cancel.child_token()));
    tracker.spawn(node.clone().destroy_loop(cancel.child_token()));
    tracker.spawn(node.clone().reap_loop(cancel.child_token()));
    tracker.spawn(node.clone().container_events_loop(cancel.child_token()));
    tracker.spawn(node.clone().heartbeat_loop(cancel.child_token()));
    tracing::info!(%addr, node = %node_id, "pool-manager ready");
    Ok(Running { addr, node, tracker })
}

//! Everything sandpool asks of Docker: hardened sandbox containers, attach, exec, archives.
//!
//! Architecture invariant: this module (inside the pool-manager) is the only code in the
//! workspace that talks to the Docker API.
//!
//! Why one file of this size: it is the only code that calls Docker (an invariant), and
//! keeping every call in one place is what makes that checkable.

use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bollard::Docker;
use bollard::models::{ContainerCreateBody, ExecConfig, HostConfig, HostConfigLogConfig};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, DownloadFromContainerOptionsBuilder,
    EventsOptionsBuilder, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use bytes::Bytes;
use config::{Template, User};
use futures::{Stream, StreamExt};
use telemetry::names;
use tokio::io::AsyncWrite;
use wire::Network;

use crate::disk::{DiskSupport, ETC_FILES, SANDBOX_HOSTNAME};

/// Where the agent binary appears inside every agent-mode sandbox (read-only bind mount).
pub const AGENT_PATH_IN_SANDBOX: &str = agent_proto::layout::AGENT_PATH;
/// The Docker network of `network = "bridge"` sandboxes, and its Linux bridge's name.
pub const BRIDGE_NETWORK: &str = "sandpool-bridge";
pub const BRIDGE_IFACE: &str = "sp-bridge0";
/// Images whose `VOLUME`s a node remembers (more: it forgets them all and asks again).
const MAX_CACHED_IMAGES: usize = 4096;
/// Timeout on every Docker API call except long streams.
const DOCKER_TIMEOUT: Duration = Duration::from_secs(60);
/// Timeout on a whole file download (docker-exec mode): the files API's bound, like the agent
/// mode's file calls (`http.rs`), and under the gateway's 180 s so the gateway hears why.
const FILE_TIMEOUT: Duration = Duration::from_secs(120);

pub const LABEL_MANAGED: &str = "sandpool.managed";
pub const LABEL_PREFIX: &str = "sandpool.prefix";
pub const LABEL_NODE: &str = "sandpool.node";
pub const LABEL_TEMPLATE: &str = "sandpool.template";
pub const LABEL_SANDBOX: &str = "sandpool.sandbox";
pub const LABEL_SNAPSHOT: &str = "sandpool.snapshot";
/// A snapshot image's private template record (JSON): what restores the record if the ledger
/// loses it.
pub const LABEL_TEMPLATE_RECORD: &str = "sandpool.template-record";

/// A snapshot image of this deployment and node.
pub struct SnapshotImage {
    pub reference: String,
    /// Its template's record, from its label (none on images from before the label).
    pub record: Option<String>,
}

/// Why a registry could not answer for an image.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// It has no such image (or will not show it to these credentials).
    #[error("{0}")]
    NotFound(String),
    /// It (or Docker) failed: down, unreachable, refused.
    #[error("{0}")]
    Failed(String),
}

fn credentials(auth: Option<&config::RegistryAuth>) -> Option<bollard::auth::DockerCredentials> {
    auth.map(|a| bollard::auth::DockerCredentials {
        username: Some(a.username.clone()),
        password: Some(a.password.clone()),
        ..Default::default()
    })
}

/// What a container's CPU accounting says so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuUse {
    /// CPU time its processes used.
    pub used: Duration,
    /// Time CFS held it back for having spent its quota within a period.
    pub throttled: Duration,
}

/// The Docker client plus what identifies this node's containers.
#[derive(Clone)]
pub struct Dock {
    docker: Docker,
    /// The ledger prefix; containers of other deployments (or tests) on the same engine are
    /// never touched.
    prefix: String,
    node: String,
    /// Each sandbox's writable layer is bounded by its template's `disk_mb` (`StorageOpt
    /// size`); only set where the engine can (`probe_disk_bounds`).
    disk_bounds: bool,
    /// Where the read-only `/etc/hosts`, `/etc/hostname` and `/etc/resolv.conf` of sandboxes
    /// are (`disk::install_etc`); `None`: Docker's own, writable and unbounded.
    etc_dir: Option<PathBuf>,
    /// The node's egress network, for `network = "egress"` sandboxes.
    egress: Option<crate::egress::EgressNet>,
    /// Each image's declared `VOLUME`s (read once per image): sandboxes get a bounded tmpfs
    /// there instead of Docker's anonymous volumes, which no disk bound covers.
    volumes: Arc<std::sync::Mutex<HashMap<String, Arc<[String]>>>>,
    /// The bridge network is known to exist (made at start for a configured bridge template,
    /// or at the first create that needs it: an admin's template `beyond_base`).
    bridge_ready: Arc<std::sync::atomic::AtomicBool>,
}

/// A container as the node sees it when reconciling.
#[derive(Debug, Clone)]
pub struct SandboxContainer {
    pub id: String,
    pub sandbox: String,
    pub running: bool,
    /// Frozen by `set_paused` (Docker's state `paused`; `running` is false then).
    pub paused: bool,
}

/// A container of this node that Docker reports made or removed (its event stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContainerEvent {
    Created { id: String, sandbox: String },
    Destroyed { id: String },
}

/// The attached stdio of a container.
pub struct Attached {
    /// The agent's own socket (the direct channel), not Docker's attach stream.
    pub direct: bool,
    pub output: Pin<Box<dyn Stream<Item = Result<bollard::container::LogOutput, bollard::errors::Error>> + Send>>,
    pub input: Pin<Box<dyn AsyncWrite + Send>>,
}

/// Whether a template's sandboxes get the direct agent channel: every runtime that shares the
/// host's kernel (runc, crun); gVisor's sockets live in its own kernel, out of the host's reach.
pub fn direct_channel(template: &Template) -> bool {
    template.runtime != "runsc"
}

/// The `op` label of every Docker call (`timed`, `timed_or`, the pull), so the node can start
/// its `sandpool_docker_*` series at 0 (`telemetry::zeros`); a test checks the calls against it.
pub const DOCKER_OPS: &[&str] = &[
    "attach container",
    "commit container",
    "container stats",
    "create container",
    "create exec",
    "create network",
    "docker info",
    "inspect container",
    "inspect exec",
    "inspect image",
    "inspect network",
    "list containers",
    "list images",
    "list networks",
    "negotiate docker API version",
    "pause container",
    "pull image",
    "remove container",
    "remove image",
    "remove network",
    "start container",
    "start exec",
    "unpause container",
];

/// One Docker call, bounded by `DOCKER_TIMEOUT`, in a span named by its static `op` (when
/// called inside a span).
async fn timed<T>(op: &'static str, fut: impl Future<Output = Result<T, bollard::errors::Error>>) -> anyhow::Result<T> {
    timed_or(op, op, fut, &[]).await?.map_err(|code| anyhow::anyhow!("{op}: docker answered {code}"))
}

/// Like `timed`, but an answer with one of the `expected` HTTP status codes is not an error:
/// it comes back as `Ok(Err(code))` (404 "no such thing", 409 "already so", ...). `what` (the
/// op and its object) is for error messages.
async fn timed_or<T>(
    op: &'static str,
    what: &str,
    fut: impl Future<Output = Result<T, bollard::errors::Error>>,
    expected: &[u16],
) -> anyhow::Result<Result<T, u16>> {
    use tracing::Instrument as _;
    // Only inside a request's or a background job's span: periodic calls start no trace.
    let span = if tracing::Span::current().is_none() {
        tracing::Span::none()
    } else {
        tracing::info_span!(
            "docker",
            otel.name = %format!("docker {op}"),
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            op,
        )
    };
    let started = std::time::Instant::now();
    let r = timed_call(what, fut, expected).instrument(span.clone()).await;
    metrics::histogram!(names::DOCKER_DURATION, "op" => op).record(started.elapsed().as_secs_f64());
    if r.is_err() {
        span.record("otel.status_code", "ERROR");
        metrics::counter!(names::DOCKER_ERRORS, "op" => op).increment(1);
    }
    r
}

async fn timed_call<T>(
    what: &str,
    fut: impl Future<Output = Result<T, bollard::errors::Error>>,
    expected: &[u16],
) -> anyhow::Result<Result<T, u16>> {
    match tokio::time::timeout(DOCKER_TIMEOUT, fut).await {
        Ok(Ok(v)) => Ok(Ok(v)),
        Ok(Err(bollard::errors::Error::DockerResponseServerError { status_code, .. }))
            if expected.contains(&status_code) =>
        {
            Ok(Err(status_code))
        }
        Ok(Err(e)) if unreachable(&e) => Err(Unreachable(format!("{what}: {e}")).into()),
        Ok(Err(e)) => Err(anyhow::anyhow!("{what}: {e}")),
        Err(_) => Err(Unreachable(format!("{what}: docker did not answer within {DOCKER_TIMEOUT:?}")).into()),
    }
}

/// Docker did not answer (its socket refused, the connection broke, or the call timed out), as
/// opposed to answering with a refusal: a caller may retry once the engine is back.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unreachable(String);

impl Unreachable {
    /// Whether `e` (from a call of this module) is Docker not answering.
    pub fn is(e: &anyhow::Error) -> bool {
        e.downcast_ref::<Unreachable>().is_some()
    }
}

fn unreachable(e: &bollard::errors::Error) -> bool {
    use bollard::errors::Error as E;
    matches!(
        e,
        E::IOError { .. }
            | E::RequestTimeoutError
            | E::SocketNotFoundError(_)
            | E::HyperResponseError { .. }
            | E::HttpClientError { .. }
            | E::HyperLegacyError { .. }
    )
}

/// The interface name of a bridge network (its `com.docker.network.bridge.name` option).
fn bridge_iface(net: &bollard::models::NetworkInspect) -> Option<String> {
    net.options.as_ref()?.get("com.docker.network.bridge.name").cloned()
}

/// Docker's engine id at `socket` (`docker info`'s `ID`): with the host name, a node's identity.
pub async fn engine_id(socket: &str) -> anyhow::Result<String> {
    let docker = Docker::connect_with_socket(socket, DOCKER_TIMEOUT.as_secs(), bollard::API_DEFAULT_VERSION)
        .map_err(|e| anyhow::anyhow!("connect to docker at {socket}: {e}"))?;
    let info = timed("docker info", docker.info()).await?;
    info.id.filter(|id| !id.is_empty()).ok_or_else(|| anyhow::anyhow!("docker at {socket} reports no engine id"))
}

impl Dock {
    pub async fn connect(socket: &str, prefix: &str, node: &str) -> anyhow::Result<Dock> {
        let docker = Docker::connect_with_socket(socket, DOCKER_TIMEOUT.as_secs(), bollard::API_DEFAULT_VERSION)
            .map_err(|e| anyhow::anyhow!("connect to docker at {socket}: {e}"))?;
        // The engine here may be older than bollard's default API version; agree on one.
        let docker = timed("negotiate docker API version", docker.negotiate_version()).await?;
        Ok(Dock {
            docker,
            prefix: prefix.into(),
            node: node.into(),
            disk_bounds: false,
            etc_dir: None,
            egress: None,
            volumes: Default::default(),
            bridge_ready: Default::default(),
        })
    }

    /// This client with sandboxes' disks bounded (or not) by their templates' `disk_mb`.
    pub fn with_disk_bounds(self, on: bool) -> Dock {
        Dock { disk_bounds: on, ..self }
    }

    /// This client with `network = "egress"` sandboxes on `net`.
    pub fn with_egress(self, net: Option<crate::egress::EgressNet>) -> Dock {
        Dock { egress: net, ..self }
    }

    /// The name of this node's egress network (one per deployment prefix and node) and of its
    /// bridge interface, which the host rules name: `spe-` and `wire::stable_hash::tag32` of
    /// the prefix and node, the same in every build.
    pub fn egress_network_name(&self) -> (String, String) {
        let tag = wire::stable_hash::tag32(&["egress-bridge", &self.prefix, &self.node]);
        (format!("sandpool-egress-{}-{}", self.prefix, self.node), format!("spe-{tag}"))
    }

    /// Creates, when missing, this node's egress network: a bridge of its own whose sandboxes
    /// cannot reach one another (`enable_icc=false`) nor, through the firewall, anything but
    /// the node's proxy. Returns its name, its bridge interface, gateway and subnet.
    ///
    /// A network of that name whose bridge has another interface name (made by a build that
    /// derived it otherwise) is made anew when no container is on it, its host rules removed;
    /// with containers on it, it is kept and its actual interface returned, so the firewall
    /// always names the interface that exists.
    pub async fn ensure_egress_network(
        &self,
    ) -> anyhow::Result<(String, String, std::net::Ipv4Addr, (std::net::Ipv4Addr, u8))> {
        let (name, mut iface) = self.egress_network_name();
        let mut existing = self.inspect_network(&name).await?;
        if let Some(net) = &existing {
            let actual = bridge_iface(net).unwrap_or_default();
            if actual != iface {
                let in_use = net.containers.as_ref().is_some_and(|c| !c.is_empty());
                if in_use || actual.is_empty() {
                    tracing::warn!(network = %name, %actual, expected = %iface, "egress network keeps its bridge name while containers are on it");
                    if !actual.is_empty() {
                        iface = actual;
                    }
                } else {
                    tracing::info!(network = %name, old = %actual, new = %iface, "egress network's bridge renamed: made anew");
                    let old = actual.clone();
                    tokio::task::spawn_blocking(move || crate::egress::firewall::remove(&old))
                        .await?
                        .context("remove the old egress bridge's host rules")?;
                    timed_or("remove network", "remove network", self.docker.remove_network(&name), &[404]).await?.ok();
                    existing = None;
                }
            }
        }
        if existing.is_none() {
            let options = HashMap::from([
                ("com.docker.network.bridge.name".to_string(), iface.clone()),
                ("com.docker.network.bridge.enable_icc".to_string(), "false".to_string()),
            ]);
            let labels = HashMap::from([
                (LABEL_MANAGED.to_string(), "true".to_string()),
                (LABEL_PREFIX.to_string(), self.prefix.clone()),
                (LABEL_NODE.to_string(), self.node.clone()),
            ]);
            let req = bollard::models::NetworkCreateRequest {
                name: name.clone(),
                driver: Some("bridge".into()),
                options: Some(options),
                labels: Some(labels),
                ..Default::default()
            };
            timed_or("create network", "create network", self.docker.create_network(req), &[409]).await?.ok();
        }
        let (gateway, subnet) = self
            .network_ipv4(&name)
            .await?
            .and_then(|(gw, subnet)| Some((gw?, subnet)))
            .ok_or_else(|| anyhow::anyhow!("network {name} has no IPv4 subnet and gateway"))?;
        Ok((name, iface, gateway, subnet))
    }

    /// A network as Docker describes it, or `None` if there is none of that name.
    async fn inspect_network(&self, name: &str) -> anyhow::Result<Option<bollard::models::NetworkInspect>> {
        let opts = None::<bollard::query_parameters::InspectNetworkOptions>;
        let found =
            timed_or("inspect network", "inspect network", self.docker.inspect_network(name, opts), &[404]).await?;
        Ok(found.ok())
    }

    /// A network's IPv4 gateway (if it names one) and subnet, if the network exists.
    pub async fn network_ipv4(
        &self,
        name: &str,
    ) -> anyhow::Result<Option<(Option<std::net::Ipv4Addr>, (std::net::Ipv4Addr, u8))>> {
        let net = self.inspect_network(name).await?;
        Ok(net.and_then(|n| n.ipam?.config).into_iter().flatten().find_map(|c| {
            let (ip, bits) = c.subnet.as_deref()?.split_once('/')?;
            let subnet = (ip.parse().ok()?, bits.parse().ok()?);
            Some((c.gateway.and_then(|g| g.parse().ok()), subnet))
        }))
    }

    /// A running container's address on `network`.
    pub async fn container_ip(&self, container: &str, network: &str) -> anyhow::Result<std::net::Ipv4Addr> {
        let c = timed("inspect container", self.docker.inspect_container(container, None)).await?;
        let ip = c
            .network_settings
            .and_then(|n| n.networks)
            .and_then(|mut n| n.remove(network))
            .and_then(|e| e.ip_address)
            .filter(|ip| !ip.is_empty())
            .ok_or_else(|| anyhow::anyhow!("container {container} has no address on {network}"))?;
        ip.parse().with_context(|| format!("container {container}: address {ip:?}"))
    }

    /// This client with sandboxes mounting their `/etc` network files read-only from `dir`.
    pub fn with_sandbox_etc(self, dir: PathBuf) -> Dock {
        Dock { etc_dir: Some(dir), ..self }
    }

    /// Whether this engine bounds a container's writable layer (`StorageOpt size`: overlay2 on
    /// XFS mounted with `pquota`, btrfs with quotas). Docker only tells when asked for such a
    /// container, so this creates one (never started) of the first image present, `images`
    /// first, then any, and removes it.
    pub async fn probe_disk_bounds(&self, images: &[&str]) -> anyhow::Result<DiskSupport> {
        use bollard::errors::Error::DockerResponseServerError;
        use bollard::query_parameters::ListImagesOptions;
        let mut candidates: Vec<String> = images.iter().map(|s| s.to_string()).collect();
        let any = timed("list images", self.docker.list_images(None::<ListImagesOptions>)).await?;
        candidates.extend(any.into_iter().flat_map(|i| i.repo_tags).filter(|t| t != "<none>:<none>").take(1));
        let labels = HashMap::from([
            (LABEL_PREFIX.to_string(), self.prefix.clone()),
            (LABEL_NODE.to_string(), self.node.clone()),
        ]);
        for image in candidates {
            let body = ContainerCreateBody {
                image: Some(image.clone()),
                labels: Some(labels.clone()),
                network_disabled: Some(true),
                host_config: Some(HostConfig {
                    network_mode: Some("none".into()),
                    log_config: Some(HostConfigLogConfig { typ: Some("none".into()), config: None }),
                    storage_opt: Some(HashMap::from([("size".to_string(), "64M".to_string())])),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let name = format!("sp-{}-probe-{:08x}", self.prefix, rand::random::<u32>());
            let opts = CreateContainerOptionsBuilder::new().name(&name).build();
            let created = tokio::time::timeout(DOCKER_TIMEOUT, self.docker.create_container(Some(opts), body)).await;
            match created {
                Ok(Ok(c)) => {
                    self.remove(&c.id).await?;
                    return Ok(DiskSupport::Enforced);
                }
                // No such image: try the next.
                Ok(Err(DockerResponseServerError { status_code: 404, .. })) => continue,
                Ok(Err(DockerResponseServerError { message, .. })) => return Ok(DiskSupport::Unsupported(message)),
                Ok(Err(e)) => anyhow::bail!("create a container with a bounded disk: {e}"),
                Err(_) => anyhow::bail!("create a container with a bounded disk: no answer within {DOCKER_TIMEOUT:?}"),
            }
        }
        Ok(DiskSupport::Unsupported("no image on this node to ask Docker with".into()))
    }

    /// The bridge interfaces of this node's egress networks that Docker has (normally one; a
    /// network of an earlier run counts too, whatever this run's config says).
    pub async fn egress_bridges(&self) -> anyhow::Result<Vec<String>> {
        use bollard::query_parameters::ListNetworksOptionsBuilder;
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{LABEL_PREFIX}={}", self.prefix), format!("{LABEL_NODE}={}", self.node)],
        )]);
        let opts = ListNetworksOptionsBuilder::new().filters(&filters).build();
        let nets = timed("list networks", self.docker.list_networks(Some(opts))).await?;
        Ok(nets
            .into_iter()
            .filter(|n| n.name.as_deref().is_some_and(|name| name.starts_with("sandpool-egress-")))
            .filter_map(|n| n.options?.get("com.docker.network.bridge.name").cloned())
            .filter(|i| !i.is_empty())
            .collect())
    }

    /// Creates, when missing, the network `network = "bridge"` sandboxes join: a bridge of its
    /// own (so the host firewall can name it, `hostnet::guard`) on which sandboxes cannot
    /// reach one another (`enable_icc=false`: one tenant's sandbox is no neighbour of
    /// another's). Nodes and test stacks share it; a concurrent create is no error.
    pub async fn ensure_bridge_network(&self) -> anyhow::Result<()> {
        use std::sync::atomic::Ordering;
        if self.bridge_ready.load(Ordering::Relaxed) || self.inspect_network(BRIDGE_NETWORK).await?.is_some() {
            self.bridge_ready.store(true, Ordering::Relaxed);
            return Ok(());
        }
        let options = HashMap::from([
            ("com.docker.network.bridge.name".to_string(), BRIDGE_IFACE.to_string()),
            ("com.docker.network.bridge.enable_icc".to_string(), "false".to_string()),
        ]);
        let req = bollard::models::NetworkCreateRequest {
            name: BRIDGE_NETWORK.into(),
            driver: Some("bridge".into()),
            options: Some(options),
            labels: Some(HashMap::from([(LABEL_MANAGED.to_string(), "true".to_string())])),
            ..Default::default()
        };
        timed_or("create network", "create network", self.docker.create_network(req), &[409]).await?.ok();
        self.bridge_ready.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// The `VOLUME`s `image` declares (cached: an image's config never changes).
    async fn image_volumes(&self, image: &str) -> anyhow::Result<Arc<[String]>> {
        let cached = self.volumes.lock().unwrap_or_else(|e| e.into_inner()).get(image).cloned();
        if let Some(v) = cached {
            return Ok(v);
        }
        let inspect = timed("inspect image", self.docker.inspect_image(image)).await?;
        let v: Arc<[String]> = inspect.config.and_then(|c| c.volumes).unwrap_or_default().into();
        let mut cache = self.volumes.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= MAX_CACHED_IMAGES {
            cache.clear();
        }
        cache.insert(image.to_string(), v.clone());
        Ok(v)
    }

    pub async fn image_exists(&self, image: &str) -> anyhow::Result<bool> {
        Ok(timed_or("inspect image", &format!("inspect image {image}"), self.docker.inspect_image(image), &[404])
            .await?
            .is_ok())
    }

    /// A label filter for this deployment's and node's objects that carry `flag=true`.
    fn own(&self, flag: &str) -> HashMap<&'static str, Vec<String>> {
        HashMap::from([(
            "label",
            vec![
                format!("{flag}=true"),
                format!("{LABEL_PREFIX}={}", self.prefix),
                format!("{LABEL_NODE}={}", self.node),
            ],
        )])
    }

    fn container_name(&self, sandbox: &str) -> String {
        format!("sp-{}-{}", self.prefix, sandbox.replace('.', "-"))
    }

    /// Creates (not starts) a hardened sandbox container for `sandbox` of `template`.
    pub async fn create(
        &self,
        sandbox: &str,
        template: &Template,
        agent_files: Option<&crate::agent_bin::AgentFiles>,
    ) -> anyhow::Result<String> {
        let labels = HashMap::from([
            (LABEL_MANAGED.to_string(), "true".to_string()),
            (LABEL_PREFIX.to_string(), self.prefix.clone()),
            (LABEL_NODE.to_string(), self.node.clone()),
            (LABEL_TEMPLATE.to_string(), template.name.clone()),
            (LABEL_SANDBOX.to_string(), sandbox.to_string()),
        ]);
        let memory = (template.memory_mb * 1024 * 1024) as i64;
        let (cfs_period_us, cfs_quota_us) = template.cfs_period_and_quota_us();
        // A non-root user: the agent (root, PID 1) needs to switch to them (SETUID, SETGID), give
        // them the workdir (CHOWN) and signal their processes (KILL); their processes have no
        // capability at all (a setuid to non-root clears them; no-new-privileges keeps them so).
        let (agent_args, cap_add) = match template.user {
            User::Root => (vec![], vec![]),
            user => (
                vec!["--user".to_string(), user.spec(), "--workdir".to_string(), template.workdir.clone()],
                ["SETUID", "SETGID", "CHOWN", "KILL"].map(String::from).to_vec(),
            ),
        };
        let (entrypoint, cmd, mut binds, init) = match agent_files {
            Some(files) => {
                let mut args = agent_args;
                let mut binds = vec![
                    format!("{}:{}:ro", files.agent.display(), AGENT_PATH_IN_SANDBOX),
                    format!("{}:{}:ro", files.python.display(), crate::agent_bin::PYTHON_DIR_IN_SANDBOX),
                ];
                if direct_channel(template) {
                    let dir = files.make_run_dir(sandbox).context("make the agent's socket directory")?;
                    binds.push(format!("{}:{}", dir.display(), crate::agent_bin::SOCKET_DIR_IN_SANDBOX));
                    let socket =
                        format!("{}/{}", crate::agent_bin::SOCKET_DIR_IN_SANDBOX, crate::agent_bin::SOCKET_NAME);
                    args.extend(["--socket".to_string(), socket]);
                }
                (vec![AGENT_PATH_IN_SANDBOX.to_string()], args, binds, false)
            }
            // docker-exec mode: something must keep the container alive; docker's init reaps.
            None => (
                vec!["/bin/sh".to_string(), "-c".to_string()],
                vec!["trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done".to_string()],
                vec![],
                true,
            ),
        };
        let egress = match template.network {
            Network::Egress => Some(self.egress.as_ref().context("no egress network on this node")?),
            _ => None,
        };
        if template.network == Network::Bridge {
            // Its host rule is installed at every start; the network itself may be new here.
            self.ensure_bridge_network().await.context("create the sandboxes' bridge network")?;
        }
        if let Some(dir) = &self.etc_dir {
            for (file, at) in ETC_FILES {
                // Egress sandboxes ask the node's DNS, on their network's gateway.
                let from = match egress {
                    Some(net) if at == "/etc/resolv.conf" => net.resolv_conf.clone(),
                    _ => dir.join(file),
                };
                binds.push(format!("{}:{at}:ro", from.display()));
            }
        }
        let mut env: Vec<String> = egress.map(|net| net.proxy_env()).unwrap_or_default();
        env.extend(template.env.iter().map(|(k, v)| format!("{k}={v}")));
        // The image's own settings that would reach past the template: its `VOLUME`s become
        // tmpfs mounts bounded by the template's disk and charged to its memory (not anonymous
        // volumes outside every bound), its `HEALTHCHECK` never runs (it would run as the
        // image's user, beside the agent), and its `USER` does not apply to PID 1 (the agent
        // starts as root and runs tenant code as the template's user). Its `ENTRYPOINT` and
        // `CMD` are replaced above; `EXPOSE`d ports stay unpublished (no port is ever published).
        let tmpfs_mb = match template.disk_mb {
            0 => template.memory_mb,
            disk => disk.min(template.memory_mb),
        };
        let tmpfs: HashMap<String, String> = self
            .image_volumes(&template.image)
            .await?
            .iter()
            .filter(|v| v.starts_with('/'))
            .map(|v| (v.clone(), format!("rw,nosuid,nodev,size={tmpfs_mb}m,mode=1777")))
            .collect();
        let storage_opt = (self.disk_bounds && template.disk_mb > 0)
            .then(|| HashMap::from([("size".to_string(), format!("{}M", template.disk_mb))]));
        let host_config = HostConfig {
            storage_opt,
            cap_drop: Some(vec!["ALL".into()]),
            cap_add: Some(cap_add),
            security_opt: Some(vec!["no-new-privileges".into()]),
            pids_limit: Some(template.pids as i64),
            memory: Some(memory),
            memory_swap: Some(memory),
            // Quota and period rather than NanoCpus (Docker's fixed 100 ms period): see
            // `Template::cpu_period`.
            cpu_period: Some(cfs_period_us),
            cpu_quota: Some(cfs_quota_us),
            network_mode: Some(match (template.network, egress) {
                (Network::Bridge, _) => BRIDGE_NETWORK.into(),
                (Network::Egress, Some(net)) => net.name.clone(),
                _ => "none".into(),
            }),
            log_config: Some(HostConfigLogConfig { typ: Some("none".into()), config: None }),
            binds: Some(binds),
            tmpfs: (!tmpfs.is_empty()).then_some(tmpfs),
            init: Some(init),
            runtime: Some(template.runtime.clone()),
            ..Default::default()
        };
        let body = ContainerCreateBody {
            image: Some(template.image.clone()),
            entrypoint: Some(entrypoint),
            cmd: Some(cmd),
            env: Some(env),
            working_dir: Some(template.workdir.clone()),
            user: Some("0:0".into()),
            healthcheck: Some(bollard::models::HealthConfig { test: Some(vec!["NONE".into()]), ..Default::default() }),
            hostname: Some(SANDBOX_HOSTNAME.into()),
            labels: Some(labels),
            open_stdin: Some(true),
            stdin_once: Some(false),
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            network_disabled: Some(template.network == Network::None),
            host_config: Some(host_config),
            ..Default::default()
        };
        let opts = CreateContainerOptionsBuilder::new().name(&self.container_name(sandbox)).build();
        let created = timed("create container", self.docker.create_container(Some(opts), body)).await?;
        Ok(created.id)
    }

    pub async fn start(&self, container: &str) -> anyhow::Result<()> {
        timed("start container", self.docker.start_container(container, None)).await
    }

    /// Attaches to the container's stdin, stdout and stderr (one long-lived connection).
    /// The direct channel to a sandbox's agent: its Unix socket in `dir`, as an `Attached`
    /// (frames arrive as `StdOut` chunks), or `None` when it does not answer within `wait`
    /// (an agent too old to serve one, or a runtime whose sockets the host cannot reach).
    pub async fn connect_agent(dir: &std::path::Path, wait: Duration) -> Option<Attached> {
        use futures::StreamExt as _;
        let path = dir.join(crate::agent_bin::SOCKET_NAME);
        let deadline = tokio::time::Instant::now() + wait;
        let stream = loop {
            match tokio::net::UnixStream::connect(&path).await {
                Ok(s) => break s,
                Err(_) if tokio::time::Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(5)).await,
                Err(e) => {
                    tracing::debug!(path = %path.display(), error = %e, "no direct channel; the attach stream serves");
                    return None;
                }
            }
        };
        // Only root in the sandbox (the agent, PID 1) can have made a socket there.
        match stream.peer_cred() {
            Ok(cred) if cred.uid() == 0 => {}
            other => {
                tracing::warn!(path = %path.display(), peer = ?other, "the socket is not the agent's; not using it");
                return None;
            }
        }
        let (read, write) = stream.into_split();
        let output = tokio_util::io::ReaderStream::with_capacity(read, 64 * 1024).map(|chunk| {
            chunk
                .map(|message| bollard::container::LogOutput::StdOut { message })
                .map_err(|err| bollard::errors::Error::IOError { err })
        });
        Some(Attached { direct: true, output: Box::pin(output), input: Box::pin(write) })
    }

    pub async fn attach(&self, container: &str) -> anyhow::Result<Attached> {
        let opts = AttachContainerOptionsBuilder::new().stream(true).stdin(true).stdout(true).stderr(true).build();
        let r = timed("attach container", self.docker.attach_container(container, Some(opts))).await?;
        Ok(Attached { direct: false, output: r.output, input: r.input })
    }

    /// Removes a container and its anonymous volumes; a missing container is not an error.
    pub async fn remove(&self, container: &str) -> anyhow::Result<()> {
        let opts = RemoveContainerOptionsBuilder::new().force(true).v(true).build();
        // 404: already gone; 409: removal already in progress.
        let what = format!("remove container {container}");
        timed_or("remove container", &what, self.docker.remove_container(container, Some(opts)), &[404, 409])
            .await
            .map(|_| ())
    }

    /// The CPU time `container` has used and the time CFS throttled it, so far (Docker's
    /// one-shot stats: its cgroup's `cpu.stat`, on cgroup v1 and v2 alike).
    pub async fn cpu_use(&self, container: &str) -> anyhow::Result<CpuUse> {
        let options = bollard::query_parameters::StatsOptions { stream: false, one_shot: true };
        let mut stats = self.docker.stats(container, Some(options));
        let first = timed("container stats", async { stats.next().await.transpose() }).await?;
        let cpu = first.and_then(|s| s.cpu_stats).context("docker gave no CPU stats")?;
        let used = cpu.cpu_usage.and_then(|u| u.total_usage).unwrap_or(0);
        let throttled = cpu.throttling_data.and_then(|t| t.throttled_time).unwrap_or(0);
        Ok(CpuUse { used: Duration::from_nanos(used), throttled: Duration::from_nanos(throttled) })
    }

    /// Freezes (`pause`) or thaws every process of a container (cgroup freezer): memory kept,
    /// no CPU. Already in the asked state is success (Docker answers 409).
    pub async fn set_paused(&self, container: &str, pause: bool) -> anyhow::Result<()> {
        let op = if pause { "pause container" } else { "unpause container" };
        let call = async {
            if pause {
                self.docker.pause_container(container).await
            } else {
                self.docker.unpause_container(container).await
            }
        };
        match timed_or(op, &format!("{op} {container}"), call, &[409]).await {
            Ok(_) => Ok(()),
            // dockerd 20.10 sometimes fails an unpause the freezer already undid ("cannot resume
            // a running process", 500) or a pause that took: what counts is the state it left.
            Err(e) => match self.docker.inspect_container(container, None).await {
                Ok(c) if c.state.as_ref().is_some_and(|s| s.paused == Some(pause) && s.running == Some(true)) => {
                    tracing::debug!(container, error = %e, "{op} failed but the container is in that state");
                    Ok(())
                }
                _ => Err(e),
            },
        }
    }

    /// The repository of this deployment's snapshot images (`commit` tags them in it).
    pub fn snapshot_repo(&self) -> String {
        format!("sandpool-snap/{}", self.prefix)
    }

    /// Commits a container's filesystem to a new image `repo:tag` labelled as this
    /// deployment's snapshot. Returns the image reference.
    pub async fn commit(&self, container: &str, tag: &str, record: &str) -> anyhow::Result<String> {
        use bollard::query_parameters::CommitContainerOptionsBuilder;
        let repo = self.snapshot_repo();
        let opts = CommitContainerOptionsBuilder::new().container(container).repo(&repo).tag(tag).pause(true).build();
        let labels = HashMap::from([
            (LABEL_SNAPSHOT.to_string(), "true".to_string()),
            (LABEL_TEMPLATE_RECORD.to_string(), record.to_string()),
            (LABEL_PREFIX.to_string(), self.prefix.clone()),
            (LABEL_NODE.to_string(), self.node.clone()),
        ]);
        let config = bollard::models::ContainerConfig { labels: Some(labels), ..Default::default() };
        timed("commit container", self.docker.commit_container(opts, config)).await?;
        Ok(format!("{repo}:{tag}"))
    }

    /// The bytes a container has written (its writable layer: what a commit of it adds).
    pub async fn written_bytes(&self, container: &str) -> anyhow::Result<u64> {
        let opts = bollard::query_parameters::InspectContainerOptions { size: true };
        let c = timed("inspect container", self.docker.inspect_container(container, Some(opts))).await?;
        Ok(c.size_rw.unwrap_or(0).max(0) as u64)
    }

    /// Removes an image. `Ok(false)` while containers still use it.
    pub async fn remove_image(&self, image: &str) -> anyhow::Result<bool> {
        use bollard::query_parameters::RemoveImageOptionsBuilder;
        let opts = RemoveImageOptionsBuilder::new().force(false).build();
        // 404: already gone (removed); 409: still used by a container (not yet).
        let what = format!("remove image {image}");
        let r = timed_or("remove image", &what, self.docker.remove_image(image, Some(opts), None), &[404, 409]).await?;
        Ok(!matches!(r, Err(409)))
    }

    /// This deployment's snapshot images on this node.
    pub async fn snapshot_images(&self) -> anyhow::Result<Vec<SnapshotImage>> {
        use bollard::query_parameters::ListImagesOptionsBuilder;
        let opts = ListImagesOptionsBuilder::new().filters(&self.own(LABEL_SNAPSHOT)).build();
        let list = timed("list images", self.docker.list_images(Some(opts))).await?;
        Ok(list
            .into_iter()
            .flat_map(|i| {
                let record = i.labels.get(LABEL_TEMPLATE_RECORD).cloned();
                i.repo_tags.into_iter().map(move |reference| SnapshotImage { reference, record: record.clone() })
            })
            .collect())
    }

    // ---------- images of the corpus ----------

    /// `reference` pinned to the digest its registry has for it now (`repository@sha256:...`),
    /// asked of the registry through Docker (its credentials, its TLS and mirror settings).
    pub async fn resolve(&self, reference: &str, auth: Option<&config::RegistryAuth>) -> Result<String, RegistryError> {
        let call = self.docker.inspect_registry_image(reference, credentials(auth));
        match tokio::time::timeout(DOCKER_TIMEOUT, call).await {
            Ok(Ok(d)) => {
                let digest =
                    d.descriptor.digest.ok_or_else(|| RegistryError::Failed("the registry named no digest".into()))?;
                Ok(format!("{}@{digest}", wire::images::repository_of(reference)))
            }
            Ok(Err(bollard::errors::Error::DockerResponseServerError { status_code: 404 | 401 | 403, message })) => {
                Err(RegistryError::NotFound(message))
            }
            // A registry that wants credentials this caller's scope does not hold: to it, the
            // image is not there (Docker answers 500 with the registry's words).
            Ok(Err(bollard::errors::Error::DockerResponseServerError { message, .. }))
                if refused_credentials(&message) =>
            {
                Err(RegistryError::NotFound(message))
            }
            Ok(Err(bollard::errors::Error::DockerResponseServerError { message, .. })) => {
                Err(RegistryError::Failed(message))
            }
            Ok(Err(e)) => Err(RegistryError::Failed(e.to_string())),
            Err(_) => Err(RegistryError::Failed(format!("docker did not answer within {DOCKER_TIMEOUT:?}"))),
        }
    }

    /// Pulls `reference` (a `repository@sha256:...`), within `timeout`. The error is the
    /// registry's (or Docker's) own words.
    pub async fn pull(
        &self,
        reference: &str,
        auth: Option<&config::RegistryAuth>,
        timeout: Duration,
    ) -> Result<(), String> {
        use bollard::query_parameters::CreateImageOptionsBuilder;
        let opts = CreateImageOptionsBuilder::new().from_image(reference).build();
        let started = std::time::Instant::now();
        let mut stream = self.docker.create_image(Some(opts), None, credentials(auth));
        let drain = async {
            while let Some(item) = stream.next().await {
                match item {
                    Ok(info) => {
                        if let Some(e) = info.error_detail.and_then(|d| d.message) {
                            return Err(e);
                        }
                    }
                    Err(bollard::errors::Error::DockerResponseServerError { message, .. }) => return Err(message),
                    Err(e) => return Err(e.to_string()),
                }
            }
            Ok(())
        };
        let r = match tokio::time::timeout(timeout, drain).await {
            Ok(r) => r,
            Err(_) => Err(format!("the pull did not finish within {timeout:?}")),
        };
        metrics::histogram!(names::DOCKER_DURATION, "op" => "pull image").record(started.elapsed().as_secs_f64());
        if r.is_err() {
            metrics::counter!(names::DOCKER_ERRORS, "op" => "pull image").increment(1);
        }
        r
    }

    /// The size of each image named by a `repository@digest` reference (Docker's `Size`: its
    /// layers, shared ones included).
    pub async fn digest_image_sizes(&self) -> anyhow::Result<HashMap<String, u64>> {
        use bollard::query_parameters::ListImagesOptionsBuilder;
        let list = timed("list images", self.docker.list_images(Some(ListImagesOptionsBuilder::new().build()))).await?;
        Ok(list
            .into_iter()
            .flat_map(|i| {
                let size = i.size.max(0) as u64;
                i.repo_digests.into_iter().map(move |d| (d, size))
            })
            .collect())
    }

    /// Every container of this node and prefix, running or not.
    pub async fn list(&self) -> anyhow::Result<Vec<SandboxContainer>> {
        let opts = ListContainersOptionsBuilder::new().all(true).filters(&self.own(LABEL_MANAGED)).build();
        let list = timed("list containers", self.docker.list_containers(Some(opts))).await?;
        Ok(list
            .into_iter()
            .filter_map(|c| {
                let sandbox = c.labels.as_ref()?.get(LABEL_SANDBOX)?.clone();
                let state = c.state.map(|s| s.to_string()).unwrap_or_default();
                let (running, paused) = (state == "running", state == "paused");
                Some(SandboxContainer { id: c.id?, sandbox, running, paused })
            })
            .collect())
    }

    /// This node's container creates and removals as Docker reports them, from the moment
    /// dockerd takes the request on; ends when the connection does (a dockerd restart).
    /// What the orphan sweep reads instead of listing every container (`Node::sweep`).
    pub fn container_events(&self) -> impl Stream<Item = anyhow::Result<ContainerEvent>> + Send + 'static {
        let mut filters = self.own(LABEL_MANAGED);
        filters.insert("type", vec!["container".into()]);
        filters.insert("event", vec!["create".into(), "destroy".into()]);
        let opts = EventsOptionsBuilder::new().filters(&filters).build();
        self.docker.events(Some(opts)).filter_map(|e| async move {
            let e = match e {
                Ok(e) => e,
                Err(e) => return Some(Err(anyhow::Error::new(e).context("docker events"))),
            };
            let actor = e.actor?;
            let id = actor.id?;
            match e.action.as_deref()? {
                "create" => {
                    let sandbox = actor.attributes?.get(LABEL_SANDBOX)?.clone();
                    Some(Ok(ContainerEvent::Created { id, sandbox }))
                }
                "destroy" => Some(Ok(ContainerEvent::Destroyed { id })),
                _ => None,
            }
        })
    }

    // ---------- docker-exec mode ----------

    /// Runs a command through `docker exec`, collecting at most `max_output` bytes of each
    /// stream. Returns (exit code, stdout, stderr, stdout cut, stderr cut, timed out).
    pub async fn exec(&self, container: &str, req: DockerExec) -> anyhow::Result<DockerExecOutcome> {
        use bollard::exec::StartExecResults;
        use tokio::io::AsyncWriteExt;
        let program = req.argv.first().cloned().unwrap_or_default();
        let cfg = ExecConfig {
            attach_stdin: Some(req.stdin.is_some()),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            cmd: Some(req.argv),
            env: Some(req.env),
            working_dir: req.cwd,
            user: req.user,
            ..Default::default()
        };
        let exec = timed("create exec", self.docker.create_exec(container, cfg)).await?;
        let started = timed("start exec", self.docker.start_exec(&exec.id, None)).await?;
        let StartExecResults::Attached { mut output, mut input } = started else {
            anyhow::bail!("start exec: not attached");
        };
        let stdin = req.stdin;
        let feed = async move {
            if let Some(data) = stdin {
                let _ = input.write_all(&data).await;
            }
            let _ = input.shutdown().await;
        };
        let max = req.max_output;
        let collect = async {
            let mut out = DockerExecOutcome::default();
            while let Some(item) = output.next().await {
                let (buf, cut, msg) = match item? {
                    bollard::container::LogOutput::StdOut { message } => {
                        (&mut out.stdout, &mut out.stdout_truncated, message)
                    }
                    bollard::container::LogOutput::StdErr { message } => {
                        (&mut out.stderr, &mut out.stderr_truncated, message)
                    }
                    _ => continue,
                };
                let room = max.saturating_sub(buf.len());
                buf.extend_from_slice(&msg[..room.min(msg.len())]);
                *cut |= msg.len() > room;
            }
            anyhow::Ok(out)
        };
        let run = async { tokio::join!(feed, collect).1 };
        let mut outcome = match tokio::time::timeout(req.timeout, run).await {
            Ok(r) => r?,
            Err(_) => {
                // Docker has no exec kill: kill the exec's process tree from the host.
                match timed("inspect exec", self.docker.inspect_exec(&exec.id)).await {
                    // Only a running exec's pid, and only processes in this container's
                    // cgroup: an exec that ended may have left its pid to an unrelated
                    // host process by now.
                    Ok(info) if info.running == Some(true) => {
                        if let Some(pid) = info.pid {
                            kill_tree(pid as i32, container);
                        }
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(container, error = %e, "timed-out exec not killed"),
                }
                DockerExecOutcome { timed_out: true, exit_code: 137, ..Default::default() }
            }
        };
        if !outcome.timed_out {
            let info = timed("inspect exec", self.docker.inspect_exec(&exec.id)).await?;
            outcome.exit_code = info.exit_code.unwrap_or(-1) as i32;
            runtime_refusal_as_shell(&mut outcome, &program);
        }
        Ok(outcome)
    }

    /// Fetches `path` from the container: a regular file's bytes, or a directory as a tar.
    pub async fn download(&self, container: &str, path: &str, max_bytes: u64) -> Result<Vec<u8>, FileError> {
        let opts = DownloadFromContainerOptionsBuilder::new().path(path).build();
        let fetch = async {
            let mut stream = self.docker.download_from_container(container, Some(opts));
            let mut tar_bytes = Vec::new();
            while let Some(chunk) = stream.next().await {
                match chunk {
                    Ok(b) => tar_bytes.extend_from_slice(&b),
                    Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => {
                        return Err(FileError::NotFound);
                    }
                    Err(e) => return Err(FileError::Other(e.to_string())),
                }
                if max_bytes > 0 && tar_bytes.len() as u64 > max_bytes + 64 * 1024 {
                    return Err(FileError::TooLarge);
                }
            }
            Ok(tar_bytes)
        };
        let tar_bytes = tokio::time::timeout(FILE_TIMEOUT, fetch)
            .await
            .map_err(|_| FileError::Other(format!("download: docker did not finish within {FILE_TIMEOUT:?}")))??;
        let mut archive = tar::Archive::new(&tar_bytes[..]);
        let mut entries = archive.entries().map_err(|e| FileError::Other(e.to_string()))?;
        let Some(first) = entries.next() else { return Err(FileError::NotFound) };
        let mut first = first.map_err(|e| FileError::Other(e.to_string()))?;
        if first.header().entry_type().is_dir() {
            return Ok(tar_bytes);
        }
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut first, &mut data).map_err(|e| FileError::Other(e.to_string()))?;
        Ok(data)
    }

    /// Writes `data` to `path` in the container, creating parent directories.
    /// Reads a file (a directory as a tar of its contents) as `user`, through `docker exec`: the
    /// archive API (`download`) reads as the daemon, past the user's permissions.
    pub async fn read_as(&self, container: &str, user: &str, path: &str, max_bytes: u64) -> Result<Vec<u8>, FileError> {
        const SCRIPT: &str = r#"if [ -d "$1" ]; then cd -- "$1" && exec tar -cf - .; else exec cat -- "$1"; fi"#;
        let out = self.file_exec(container, user, SCRIPT, path, None, max_bytes as usize + 1).await?;
        if out.stdout_truncated {
            return Err(FileError::TooLarge);
        }
        Ok(out.stdout)
    }

    /// Writes a file as `user`, creating its parents, through `docker exec` (see `read_as`).
    pub async fn write_as(&self, container: &str, user: &str, path: &str, data: Bytes) -> Result<(), FileError> {
        const SCRIPT: &str = r#"mkdir -p -- "$(dirname -- "$1")" && exec cat > "$1""#;
        self.file_exec(container, user, SCRIPT, path, Some(data), 64 * 1024).await.map(drop)
    }

    async fn file_exec(
        &self,
        container: &str,
        user: &str,
        script: &str,
        path: &str,
        stdin: Option<Bytes>,
        max_output: usize,
    ) -> Result<DockerExecOutcome, FileError> {
        let argv = ["/bin/sh", "-c", script, "sh", path].map(String::from).to_vec();
        let req = DockerExec {
            argv,
            user: Some(user.into()),
            env: vec![],
            cwd: None,
            stdin,
            timeout: FILE_TIMEOUT,
            max_output,
        };
        let out = self.exec(container, req).await.map_err(|e| FileError::Other(format!("{e:#}")))?;
        if out.exit_code == 0 {
            return Ok(out);
        }
        let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
        Err(if err.contains("No such file") {
            FileError::NotFound
        } else if err.contains("Is a directory") {
            FileError::IsDirectory(err)
        } else {
            FileError::Refused(err)
        })
    }

    pub async fn upload(&self, container: &str, path: &str, data: Bytes) -> Result<(), FileError> {
        let rel = path.trim_start_matches('/');
        let mut builder = tar::Builder::new(Vec::new());
        // Parent directories first: the archive API does not create them.
        let mut parent = String::new();
        let parts: Vec<&str> = rel.split('/').collect();
        for part in &parts[..parts.len().saturating_sub(1)] {
            parent.push_str(part);
            parent.push('/');
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Directory);
            h.set_mode(0o755);
            h.set_size(0);
            builder.append_data(&mut h, &parent, std::io::empty()).map_err(|e| FileError::Other(e.to_string()))?;
        }
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_mtime(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        );
        builder.append_data(&mut h, rel, &data[..]).map_err(|e| FileError::Other(e.to_string()))?;
        let tar_bytes = builder.into_inner().map_err(|e| FileError::Other(e.to_string()))?;
        let opts = UploadToContainerOptionsBuilder::new().path("/").build();
        tokio::time::timeout(
            DOCKER_TIMEOUT,
            self.docker.upload_to_container(container, Some(opts), bollard::body_full(tar_bytes.into())),
        )
        .await
        .map_err(|_| FileError::Other("upload timed out".into()))?
        .map_err(|e| match e {
            bollard::errors::Error::DockerResponseServerError { status_code: 400, message } => {
                FileError::IsDirectory(message)
            }
            e => FileError::Other(e.to_string()),
        })
    }
}

#[derive(Debug)]
pub struct DockerExec {
    pub argv: Vec<String>,
    /// `uid:gid` or a name; `None`: the container's user (root).
    pub user: Option<String>,
    pub env: Vec<String>,
    pub cwd: Option<String>,
    pub stdin: Option<Bytes>,
    pub timeout: Duration,
    pub max_output: usize,
}

/// When the OCI runtime cannot start the program, Docker answers 126 with its own message on
/// stdout. Answer as a shell (and the agent) does: 127 for a program that does not exist, 126
/// for one that cannot run, and a short message on stderr.
fn runtime_refusal_as_shell(outcome: &mut DockerExecOutcome, program: &str) {
    const OCI: &[u8] = b"OCI runtime exec failed";
    if outcome.exit_code != 126 || !outcome.stdout.starts_with(OCI) {
        return;
    }
    let text = String::from_utf8_lossy(&outcome.stdout);
    let (code, why) = if text.contains("not found") || text.contains("no such file") {
        (127, "not found")
    } else {
        (126, "cannot execute")
    };
    outcome.exit_code = code;
    outcome.stdout.clear();
    outcome.stderr = format!("{program}: {why}\n").into_bytes();
}

#[derive(Debug, Default)]
pub struct DockerExecOutcome {
    pub exit_code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub timed_out: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file too large")]
    TooLarge,
    #[error("is a directory: {0}")]
    IsDirectory(String),
    /// The sandbox said no (permissions, a full disk): the caller's to fix.
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Other(String),
}

/// Whether Docker's error says the registry refused the credentials given (or their absence).
fn refused_credentials(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    ["no basic auth credentials", "unauthorized", "authentication required", "denied: requested access"]
        .iter()
        .any(|s| m.contains(s))
}

/// Whether host process `pid` belongs to `container` (its cgroup path names the container's
/// id, under Docker's cgroupfs and systemd drivers alike).
fn in_container(pid: i32, container: &str) -> bool {
    !container.is_empty()
        && std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|cg| cg.contains(container))
}

/// SIGKILLs a host process of `container` and all its descendants in that container
/// (docker-exec mode timeouts, runc only). A pid not in the container is left alone.
fn kill_tree(root: i32, container: &str) {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
            // Fields after the last ')' (the command may contain spaces): state ppid ...
            let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { continue };
            if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|p| p.parse::<i32>().ok()) {
                children.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut stack = vec![root];
    while let Some(pid) = stack.pop() {
        if !in_container(pid, container) {
            continue;
        }
        // SAFETY: kill(2) with a concrete pid and SIGKILL has no memory-safety preconditions.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
        stack.extend(children.get(&pid).into_iter().flatten());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every op this file times (the first argument of `timed`/`timed_or`, an `"op" =>`
    /// label) is in `DOCKER_OPS`.
    #[test]
    fn docker_ops_name_every_timed_call() {
        let text = include_str!("docker.rs");
        let mut ops = std::collections::BTreeSet::new();
        // (Patterns built here, so this test's own text does not match them.)
        let calls = [format!("{}(", "timed"), format!("{}(", "timed_or"), "\"op\" => ".to_string()];
        for call in &calls {
            for (at, _) in text.match_indices(call.as_str()) {
                if let Some(quoted) = text[at + call.len()..].trim_start().strip_prefix('"') {
                    ops.insert(quoted.split('"').next().unwrap_or_default().to_string());
                }
            }
        }
        assert!(ops.len() >= 15, "the scan found only {ops:?}");
        let missing: Vec<&String> = ops.iter().filter(|o| !DOCKER_OPS.contains(&o.as_str())).collect();
        assert!(missing.is_empty(), "DOCKER_OPS lacks {missing:?}");
    }

    #[tokio::test]
    async fn docker_not_answering_is_told_from_docker_refusing() {
        let gone = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let e = timed_call::<()>("pause", async { Err(bollard::errors::Error::IOError { err: gone }) }, &[])
            .await
            .unwrap_err();
        assert!(Unreachable::is(&e), "{e:#}");
        let refused = bollard::errors::Error::DockerResponseServerError { status_code: 500, message: "no".into() };
        let e = timed_call::<()>("pause", async { Err(refused) }, &[]).await.unwrap_err();
        assert!(!Unreachable::is(&e), "{e:#}");
        let gone = bollard::errors::Error::DockerResponseServerError { status_code: 404, message: "gone".into() };
        assert_eq!(timed_call::<()>("remove", async { Err(gone) }, &[404]).await.unwrap(), Err(404));
    }

    #[test]
    fn a_process_outside_the_container_is_never_its_member() {
        let me = std::process::id() as i32;
        assert!(!in_container(me, "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"));
        assert!(!in_container(me, ""), "an empty id matches nothing");
    }
}

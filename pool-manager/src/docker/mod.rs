//! Everything sandpool asks of Docker: hardened sandbox containers, attach, exec, archives.
//!
//! Architecture invariant: this module (inside the pool-manager) is the only code in the
//! workspace that talks to the Docker API.
//!
//! The only code that calls Docker is this directory (an invariant a grep can check):
//! `mod.rs` holds the client, the timed call every request goes through and the container
//! lifecycle; `create`, `networks`, `images`, `exec` and `files` hold the rest, each an
//! `impl Dock` block split on purpose.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bollard::Docker;
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, EventsOptionsBuilder, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder,
};
use config::Template;
use futures::{Stream, StreamExt};
use telemetry::names;

use crate::channel::Link;

mod create;
mod exec;
mod files;
mod images;
mod networks;
mod shim_groups;

mod engine;

// The engine-neutral types this engine's calls speak, where callers found them before the
// `Runtime` seam.
pub use crate::runtime::{
    ContainerEvent, CpuUse, DockerExec, DockerExecOutcome, FileError, RegistryError, SandboxContainer, SnapshotImage,
    Unreachable,
};

/// Where the agent binary appears inside every agent-mode sandbox (read-only bind mount).
pub const AGENT_PATH_IN_SANDBOX: &str = agent_proto::layout::AGENT_PATH;
/// The Docker network of `network = "bridge"` sandboxes, and its Linux bridge's name.
pub const BRIDGE_NETWORK: &str = "sandpool-bridge";
/// The Linux bridge interface of `BRIDGE_NETWORK`, whose packets to this host `hostnet::guard`
/// drops.
pub const BRIDGE_IFACE: &str = "sp-bridge0";
/// Images whose `VOLUME`s a node remembers (more: it forgets them all and asks again).
const MAX_CACHED_IMAGES: usize = 4096;
/// Timeout on every Docker API call except long streams.
const DOCKER_TIMEOUT: Duration = Duration::from_secs(60);
/// Timeout on a whole file download (docker-exec mode): the files API's bound, like the agent
/// mode's file calls (`http.rs`), and under the gateway's 180 s so the gateway hears why.
const FILE_TIMEOUT: Duration = Duration::from_secs(120);

/// Label (`true`) on every container and network this deployment's nodes make.
pub const LABEL_MANAGED: &str = "sandpool.managed";
/// Label holding the ledger prefix of the deployment that made an object.
pub const LABEL_PREFIX: &str = "sandpool.prefix";
/// Label holding the id of the node that made an object.
pub const LABEL_NODE: &str = "sandpool.node";
/// Label holding the template a sandbox container was made from.
pub const LABEL_TEMPLATE: &str = "sandpool.template";
/// Label holding the sandbox id of a container (what `list` and `container_events` report).
pub const LABEL_SANDBOX: &str = "sandpool.sandbox";
/// Label (`true`) on the snapshot images `commit` makes.
pub const LABEL_SNAPSHOT: &str = "sandpool.snapshot";
/// A snapshot image's private template record (JSON): what restores the record if the ledger
/// loses it.
pub const LABEL_TEMPLATE_RECORD: &str = "sandpool.template-record";

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
    /// What creates need of each image (read once per image): its declared `VOLUME`s, where
    /// sandboxes get a bounded tmpfs instead of Docker's anonymous volumes, which no disk bound
    /// covers, and the lazy image a stub stands for.
    image_facts: Arc<std::sync::Mutex<HashMap<String, ImageFacts>>>,
    /// The bridge network is known to exist (made at start for a configured bridge template,
    /// or at the first create that needs it: an admin's template `beyond_base`).
    bridge_ready: Arc<std::sync::atomic::AtomicBool>,
    /// The stub image of each lazy image prepared here (`lazy.rs`).
    lazy: crate::lazy::LazyStubs,
    /// Which containerd shim each sandbox shares (`shim_groups.rs`).
    shims: Arc<shim_groups::ShimGroups>,
}

/// What a create needs of an image: its declared `VOLUME`s, and the lazy image it runs over
/// (the label of a lazy image's stub, kept by snapshots of its sandboxes: `lazy.rs`).
#[derive(Clone)]
struct ImageFacts {
    /// Its `ENV` sets the shim group's variable (which the node then overrides).
    names_shim_group: bool,
    volumes: Arc<[String]>,
    lazy_image: Option<String>,
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
    "load image",
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

/// Docker's engine id at `socket` (`docker info`'s `ID`): with the host name, a node's identity.
pub async fn engine_id(socket: &str) -> anyhow::Result<String> {
    let docker = Docker::connect_with_socket(socket, DOCKER_TIMEOUT.as_secs(), bollard::API_DEFAULT_VERSION)
        .map_err(|e| anyhow::anyhow!("connect to docker at {socket}: {e}"))?;
    let info = timed("docker info", docker.info()).await?;
    info.id.filter(|id| !id.is_empty()).ok_or_else(|| anyhow::anyhow!("docker at {socket} reports no engine id"))
}

impl Dock {
    /// Connects to the engine at `socket` (agreeing on an API version) as node `node` of deployment
    /// `prefix`.
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
            image_facts: Default::default(),
            lazy: Default::default(),
            bridge_ready: Default::default(),
            shims: shim_groups::ShimGroups::new(node, 1, 1),
        })
    }

    /// This client with `size` sandboxes per containerd shim (`config::DockerConfig::shim_group`),
    /// spreading `in_flight` creates at once over as many shims.
    pub fn with_shim_group(self, size: usize, in_flight: usize) -> Dock {
        Dock { shims: shim_groups::ShimGroups::new(&self.node, size, in_flight), ..self }
    }

    /// This client with sandboxes' disks bounded (or not) by their templates' `disk_mb`.
    pub fn with_disk_bounds(self, on: bool) -> Dock {
        Dock { disk_bounds: on, ..self }
    }

    /// This client with lazy images mounted by the `sandpool-lazyd` at `lazyd`.
    pub fn with_lazyd(self, lazyd: crate::lazy::Lazyd) -> Dock {
        let mut lazy = self.lazy.clone();
        lazy.lazyd = lazyd;
        Dock { lazy, ..self }
    }

    /// This client with `network = "egress"` sandboxes on `net`.
    pub fn with_egress(self, net: Option<crate::egress::EgressNet>) -> Dock {
        Dock { egress: net, ..self }
    }

    /// Starts a created container.
    pub async fn start(&self, container: &str) -> anyhow::Result<()> {
        let started = timed("start container", self.docker.start_container(container, None)).await;
        self.shims.start_ended(container, started.is_ok());
        started
    }

    /// Attaches to the container's stdin, stdout and stderr (one long-lived connection), as
    /// the agent's byte stream: its stdout carries the frames; what it writes on stderr is its
    /// log, which goes to this node's log here.
    pub async fn attach(&self, container: &str) -> anyhow::Result<Link> {
        use bollard::container::LogOutput;
        let opts = AttachContainerOptionsBuilder::new().stream(true).stdin(true).stdout(true).stderr(true).build();
        let r = timed("attach container", self.docker.attach_container(container, Some(opts))).await?;
        let container = container.to_string();
        let frames = r.output.filter_map(move |item| {
            futures::future::ready(match item {
                Ok(LogOutput::StdOut { message }) => Some(Ok(message)),
                Ok(LogOutput::StdErr { message }) => {
                    tracing::info!(%container, agent = %String::from_utf8_lossy(&message).trim_end(), "agent log");
                    None
                }
                Ok(_) => None,
                Err(e) => Some(Err(std::io::Error::other(e))),
            })
        });
        Ok(Link { direct: false, reader: Box::pin(tokio_util::io::StreamReader::new(frames)), writer: r.input })
    }

    /// Removes a container and its anonymous volumes; a missing container is not an error.
    pub async fn remove(&self, container: &str) -> anyhow::Result<()> {
        self.shims.leave(container).await;
        let opts = RemoveContainerOptionsBuilder::new().force(true).v(true).build();
        // 404: already gone; 409: removal already in progress.
        let what = format!("remove container {container}");
        timed_or("remove container", &what, self.docker.remove_container(container, Some(opts)), &[404, 409])
            .await
            .map(|_| ())
    }

    /// The CPU time `container` has used and the time CFS throttled it, so far: from its
    /// cgroup's files (`cgroup_cpu`: two small reads), or where they are not found, Docker's
    /// one-shot stats (a Docker call: the same counters, tens of ms later).
    pub async fn cpu_use(&self, container: &str) -> anyhow::Result<CpuUse> {
        if let Some(cpu) = crate::cgroup_cpu::read(&crate::cgroup_cpu::host_root(), container) {
            return Ok(cpu);
        }
        tracing::debug!(container, "no cgroup files for the container's CPU: asking Docker");
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every op this file times (the first argument of `timed`/`timed_or`, an `"op" =>`
    /// label) is in `DOCKER_OPS`.
    #[test]
    fn docker_ops_name_every_timed_call() {
        let text = [
            include_str!("mod.rs"),
            include_str!("create.rs"),
            include_str!("exec.rs"),
            include_str!("files.rs"),
            include_str!("images.rs"),
            include_str!("networks.rs"),
        ]
        .concat();
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
        assert!(!exec::in_container(me, "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"));
        assert!(!exec::in_container(me, ""), "an empty id matches nothing");
    }
}

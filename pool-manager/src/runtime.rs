//! The node's seam to its container runtime: what the node asks of an engine (create, start,
//! attach, remove, list, events, pause, stats, commit, images, and the exec and file calls of
//! docker-exec templates), and the engine-neutral types those calls speak. Docker (`Dock`,
//! `docker/`) is one implementation; the node holds an `Arc<dyn Runtime>`, so its recovery
//! (reconcile, rebuild, the orphan sweep) runs the same against a fake in unit tests
//! (`node/tests.rs`).
//!
//! The trait is object-safe (boxed futures): one engine per node, chosen at start.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use bytes::Bytes;
use config::Template;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

use crate::agent_bin::AgentFiles;
use crate::channel::Link;

/// A runtime call's answer.
pub(crate) type Call<'a, T> = BoxFuture<'a, anyhow::Result<T>>;
/// A file call's answer (docker-exec templates).
pub(crate) type FileCall<'a, T> = BoxFuture<'a, Result<T, FileError>>;

/// What the node needs of a container engine. Container ids are the engine's; a container
/// carries its sandbox id (a label), which `list` and `events` report.
pub trait Runtime: Send + Sync {
    // ---- a sandbox's container ----
    /// Creates (not starts) a hardened container for `sandbox` of `template` (with the agent
    /// mounted when `agent` is given); returns its id.
    fn create<'a>(
        &'a self,
        sandbox: &'a str,
        template: &'a Template,
        agent: Option<&'a AgentFiles>,
    ) -> Call<'a, String>;
    fn start<'a>(&'a self, container: &'a str) -> Call<'a, ()>;
    /// The agent's stdio as a byte stream (frames out, its log elsewhere).
    fn attach<'a>(&'a self, container: &'a str) -> Call<'a, Link>;
    /// Whether the agent's own socket reaches the host for `template`'s sandboxes (so the
    /// node prefers it to `attach`).
    fn direct_channel(&self, template: &Template) -> bool;
    /// Removes a container and its anonymous volumes; a missing one is no error.
    fn remove<'a>(&'a self, container: &'a str) -> Call<'a, ()>;
    /// Every container of this node and deployment, running or not.
    fn list(&self) -> Call<'_, Vec<SandboxContainer>>;
    /// This node's container creates and removals as the engine reports them, until the
    /// stream ends (the engine restarted); the node reopens it.
    fn events(&self) -> BoxStream<'static, anyhow::Result<ContainerEvent>>;
    fn set_paused<'a>(&'a self, container: &'a str, pause: bool) -> Call<'a, ()>;
    fn cpu_use<'a>(&'a self, container: &'a str) -> Call<'a, CpuUse>;
    /// A running container's address on `network`.
    fn container_ip<'a>(&'a self, container: &'a str, network: &'a str) -> Call<'a, Ipv4Addr>;

    // ---- docker-exec templates: exec and files without an agent ----
    fn exec<'a>(&'a self, container: &'a str, req: DockerExec) -> Call<'a, DockerExecOutcome>;
    /// A file (or a directory as tar) as root.
    fn download<'a>(&'a self, container: &'a str, path: &'a str, max_bytes: u64) -> FileCall<'a, Vec<u8>>;
    /// A file as `user` (permissions apply).
    fn read_as<'a>(&'a self, container: &'a str, user: &'a str, path: &'a str, max_bytes: u64)
    -> FileCall<'a, Vec<u8>>;
    fn upload<'a>(&'a self, container: &'a str, path: &'a str, data: Bytes) -> FileCall<'a, ()>;
    fn write_as<'a>(&'a self, container: &'a str, user: &'a str, path: &'a str, data: Bytes) -> FileCall<'a, ()>;

    // ---- snapshots ----
    /// The repository snapshot images of this node are tagged in.
    fn snapshot_repo(&self) -> String;
    /// Bytes the container wrote to its own layer.
    fn written_bytes<'a>(&'a self, container: &'a str) -> Call<'a, u64>;
    /// Commits the container as `snapshot_repo():tag`, labelled with `record`.
    fn commit<'a>(&'a self, container: &'a str, tag: &'a str, record: &'a str) -> Call<'a, String>;
    fn snapshot_images(&self) -> Call<'_, Vec<SnapshotImage>>;
    /// Removes an image unless a container uses it; whether it went.
    fn remove_image<'a>(&'a self, image: &'a str) -> Call<'a, bool>;

    // ---- images ----
    fn image_exists<'a>(&'a self, image: &'a str) -> Call<'a, bool>;
    /// `reference` pinned to its registry's digest.
    fn resolve<'a>(
        &'a self,
        reference: &'a str,
        auth: Option<&'a config::RegistryAuth>,
    ) -> BoxFuture<'a, Result<String, RegistryError>>;
    /// Pulls `reference` within `timeout`; the error is the registry's own words.
    fn pull<'a>(
        &'a self,
        reference: &'a str,
        auth: Option<&'a config::RegistryAuth>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), String>>;
    /// The size of each image present, by `repository@digest` reference.
    fn digest_image_sizes(&self) -> Call<'_, HashMap<String, u64>>;
    /// Makes `stub` (a lazy image's stub, `lazy.rs`) present and creates the containers of
    /// lazy `image` from it, on the lazy runtime.
    fn use_lazy_stub<'a>(&'a self, image: &'a str, stub: crate::lazy::Stub) -> Call<'a, ()>;
}

/// A snapshot image of this deployment and node.
pub struct SnapshotImage {
    /// The image's `repository:tag`.
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

pub use crate::cgroup_cpu::CpuUse;

/// A container as the node sees it when reconciling.
#[derive(Debug, Clone)]
pub struct SandboxContainer {
    /// The engine's container id.
    pub id: String,
    /// The sandbox id from the container's label.
    pub sandbox: String,
    /// Whether the container is running (Docker's state `running`).
    pub running: bool,
    /// Frozen by `set_paused` (Docker's state `paused`; `running` is false then).
    pub paused: bool,
}

/// A container of this node that Docker reports made or removed (its event stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContainerEvent {
    /// The engine made a container for a sandbox.
    Created {
        /// The new container's id.
        id: String,
        /// The sandbox id from its label.
        sandbox: String,
    },
    /// The engine removed a container.
    Destroyed {
        /// The removed container's id.
        id: String,
    },
}

/// One command for `Runtime::exec` (docker-exec templates, which have no agent).
#[derive(Debug)]
pub struct DockerExec {
    /// The program and its arguments, run without a shell.
    pub argv: Vec<String>,
    /// `uid:gid` or a name; `None`: the container's user (root).
    pub user: Option<String>,
    /// The environment, as `KEY=VALUE` strings.
    pub env: Vec<String>,
    /// The working directory; `None`: the image's.
    pub cwd: Option<String>,
    /// Bytes written to the command's stdin, which is then closed; `None`: no stdin.
    pub stdin: Option<Bytes>,
    /// How long the command may run before it counts as timed out.
    pub timeout: Duration,
    /// The most bytes kept of each of stdout and stderr; the rest is dropped.
    pub max_output: usize,
}

/// What a `DockerExec` command did.
#[derive(Debug, Default)]
pub struct DockerExecOutcome {
    /// The command's exit code: 137 when it timed out, 127/126 when it could not be found or run.
    pub exit_code: i32,
    /// Its stdout, at most `max_output` bytes.
    pub stdout: Vec<u8>,
    /// Its stderr, at most `max_output` bytes.
    pub stderr: Vec<u8>,
    /// Whether stdout went over `max_output` and was cut.
    pub stdout_truncated: bool,
    /// Whether stderr went over `max_output` and was cut.
    pub stderr_truncated: bool,
    /// Whether the command ran past its timeout (its output is then not kept, and its processes
    /// are killed).
    pub timed_out: bool,
}

/// Why a file call of a docker-exec template failed; each maps to its own API error.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The path does not exist (404).
    #[error("no such file or directory")]
    NotFound,
    /// The file is over the call's `max_bytes` (413).
    #[error("file too large")]
    TooLarge,
    /// The path is a directory where a file is needed, with the sandbox's message.
    #[error("is a directory: {0}")]
    IsDirectory(String),
    /// The sandbox said no (permissions, a full disk): the caller's to fix.
    #[error("{0}")]
    Refused(String),
    /// The call itself failed (Docker, a timeout, a bad archive): 502, not the caller's to fix.
    #[error("{0}")]
    Other(String),
}

/// The engine did not answer (its socket refused, the connection broke, or the call timed
/// out), as opposed to answering with a refusal: a caller may retry once the engine is back.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unreachable(pub String);

impl Unreachable {
    /// Whether `e` (from a runtime's call) is the engine not answering.
    pub fn is(e: &anyhow::Error) -> bool {
        e.downcast_ref::<Unreachable>().is_some()
    }
}

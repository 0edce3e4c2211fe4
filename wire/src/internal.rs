//! The internal API between gateways and pool-managers (shared secret, never exposed to tenants).

use serde::{Deserialize, Serialize};

/// Header carrying the shared secret on every internal call.
pub const SECRET_HEADER: &str = "x-sandpool-secret";
/// Header carrying the caller's lease fencing token on exec and file calls.
pub const FENCE_HEADER: &str = "x-sandpool-fence";
/// The `Upgrade` protocol of a port connection (`/internal/v1/sandboxes/{id}/ports/{port}`):
/// after the 101, the raw bytes of one TCP connection to the port in the sandbox.
pub const PORT_UPGRADE: &str = "sandpool-port";

/// `POST /internal/v1/sandboxes/{id}/snapshot`: commit the sandbox as a private template.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    /// The principal whose private template the snapshot becomes.
    pub tenant: String,
    /// The random part of the template's name (16 hex digits), chosen by the gateway, whose
    /// quota lease is named by it; absent: the node picks one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// Answer of `POST /internal/v1/sandboxes/{id}/snapshot`: a tenant's private template, a
/// snapshot of a session's filesystem on the node that took it (the ledger stores it as is).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PrivateTemplate {
    /// `<node>.<hex>`: names its node, like sandbox and session ids.
    pub name: String,
    /// The principal that owns it; no other may use it.
    pub tenant: String,
    /// The configured template it derives from (limits, network, workdir, lifetimes).
    pub base: String,
    /// The node-local image holding the snapshot.
    pub image: String,
    /// When it was taken, Unix milliseconds (the ledger's clock).
    pub created_ms: u64,
    /// Disk the snapshot holds beyond its base image (its own layer), in MiB, rounded up.
    #[serde(default)]
    pub size_mb: u64,
}

/// `POST /internal/v1/sandboxes/{id}/invoke`: one invocation of a function in the sandbox,
/// its environment. The body is this spec as one JSON line, then the payload's bytes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct InvokeSpec {
    /// Which function (and version) the environment serves: `<owner>|<name>|<version>`. A
    /// runtime worker serves one key; another key is refused (environments are never shared).
    pub function: String,
    /// How the invocation runs (the function's mode).
    pub mode: crate::functions::FunctionMode,
    /// The function's handler: the command (exec mode) or the worker (runtime mode), as argv.
    pub handler: Vec<String>,
    /// The function's environment variables.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// The invocation's time limit, milliseconds (the gateway sets it; the node checks it again).
    pub timeout_ms: u64,
    /// A result larger than this fails the invocation.
    pub max_result_bytes: u64,
}

/// The head of the node's answer to an invocation: this as one JSON line, then the result (or
/// the function's error as JSON). Every outcome of the function is a 200; errors of the node or
/// the sandbox are error answers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct InvokeAnswer {
    /// How the invocation ended.
    pub outcome: Outcome,
    /// The node started the runtime worker for this invocation (runtime mode).
    pub cold_worker: bool,
    /// The handler's own time in milliseconds (the worker's start excluded).
    pub duration_ms: f64,
}

/// How an invocation ended.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// The body is the result.
    Ok,
    /// The function reported an error (runtime mode: the runtime caught an exception).
    Handled,
    /// The handler failed on its own (exec mode: a non-zero exit or a signal).
    Unhandled,
    /// Past its timeout: the handler was killed.
    Timeout,
    /// The runtime worker exited or broke the protocol mid-invocation.
    Crashed,
}

impl Outcome {
    /// Every outcome (the metrics' `outcome` label set of invocations).
    pub const ALL: [Outcome; 5] =
        [Outcome::Ok, Outcome::Handled, Outcome::Unhandled, Outcome::Timeout, Outcome::Crashed];

    /// As JSON and the metrics' `outcome` label spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Handled => "handled",
            Outcome::Unhandled => "unhandled",
            Outcome::Timeout => "timeout",
            Outcome::Crashed => "crashed",
        }
    }

    /// The outcome `as_str` spells as `s`, if any.
    pub fn parse(s: &str) -> Option<Outcome> {
        Outcome::ALL.into_iter().find(|o| o.as_str() == s)
    }
}

/// `POST /internal/v1/images:resolve`: a reference as its registry has it now.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ResolveImage {
    /// The reference to resolve: `[registry/]repository[:tag][@sha256:...]`.
    pub image: String,
    /// Whose registry credentials apply (`images.scopes`); `None`: the deployment's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
}

/// Answer of `POST /internal/v1/images:resolve`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ResolvedImage {
    /// `repository@sha256:...`: the reference pinned to its digest.
    pub image: String,
}

/// `POST /internal/v1/images:pull`: pull these (`repository@sha256:...`) in the background.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PullImages {
    /// Pinned references (`repository@sha256:...`) to pull.
    pub images: Vec<String>,
}

/// Answer of `POST /internal/v1/images:pull`: each image's state on the node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PullStates {
    /// Each image asked for, with its state on the node.
    pub images: Vec<crate::images::ImagePull>,
}

/// Answer of `GET /internal/v1/sandboxes/{sandbox}/cpu`: its cgroup's CPU accounting so far.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct SandboxCpu {
    /// CPU time its processes used, ms.
    pub cpu_ms: f64,
    /// Time CFS held it back for having spent its quota within a period, ms.
    pub cpu_throttled_ms: f64,
}

/// A one-shot file operation, gateway to node (`POST /internal/v1/sandboxes/{id}/fs`): paths
/// as the client gave them (the node resolves them against the workdir).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum FsOp {
    /// Answered by a `PathExists`.
    Exists {
        /// The path to look at.
        path: String,
    },
    /// Removes a file, a symbolic link (never its target) or a directory: an empty one, or any
    /// with `recursive`.
    Remove {
        /// The path to remove.
        path: String,
        /// Remove a directory with its contents (links inside removed, not followed).
        recursive: bool,
    },
    /// Renames `from` to `to`, never over something that exists (a link, not its target).
    Rename {
        /// The path to rename.
        from: String,
        /// The new path; must not exist yet, its directory must.
        to: String,
    },
    /// Makes a directory and its parents (`mkdir -p`: fine if it is there).
    MakeDir {
        /// The directory to make.
        path: String,
    },
}

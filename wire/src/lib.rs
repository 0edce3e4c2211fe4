//! Wire types of sandpool's HTTP APIs: the public v1 API and the internal gateway → pool-manager
//! API. Plain serde data; no tokio, Redis or Docker here, so clients can depend on it cheaply.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

mod errors;
pub mod functions;
pub mod ids;
pub mod images;
pub mod internal;
pub mod limits;
mod nodes;
pub mod paths;
pub mod quotas;
pub mod shells;
pub mod stable_hash;
pub mod timeouts;
pub mod ws;

pub use errors::{ErrorBody, ErrorCode, GoneReason, QuotaDenied};
pub use nodes::{BudgetResource, NodeBudget, NodeStats, NodeView, PoolStats, PoolsView};

/// `POST /v1/sessions`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// The template to start from (`GET /v1/templates` lists those the caller can use).
    pub template: String,
    /// Idempotency key: the same tenant creating with the same key gets the same live session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_key: Option<String>,
    /// Maximum lifetime in seconds (capped by the template's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
    /// Idle timeout in seconds (capped by the template's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    /// Key/value tags to find and act on the session by (`?label=key=value`, `POST /v1/sessions:pause`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// How long to wait for a sandbox when none is idle (default and ceiling: gateway config).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait_s: Option<f64>,
}

/// `POST /v1/reservations`: declare an upcoming burst so the pool is warm for it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateReservation {
    /// One template (with `count`), or `items` for many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Sandboxes of `template` to have idle by `ready_by`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// Many templates, each with its count: a trainer's next step, whose tasks it knows before
    /// it starts them. Their images are pulled at once, their sandboxes created by `ready_by`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub items: Vec<ReservationItem>,
    /// RFC 3339 time by which `count` sandboxes should be idle.
    pub ready_by: String,
    /// How long after `ready_by` to keep them (default 300).
    #[serde(default)]
    pub hold_s: Option<u64>,
}

/// One template of a reservation and how many of its sandboxes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReservationItem {
    /// A template the caller can use.
    pub template: String,
    /// Sandboxes of it to have idle by `ready_by`.
    pub count: u64,
}

/// Answer of `POST /v1/reservations`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ReservationInfo {
    /// Names the reservation.
    pub reservation_id: String,
    /// The template of a one-template reservation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Sandboxes reserved, over all items.
    pub count: u64,
    /// Every template reserved, with its count.
    pub items: Vec<ReservationItem>,
    /// RFC 3339, as asked.
    pub ready_by: String,
    /// Seconds the sandboxes are kept after `ready_by` (the asked or default 300, capped by
    /// the templates' maximum lifetime).
    pub hold_s: u64,
    /// Whether the nodes can have `count` idle by `ready_by` at their measured create rate.
    pub feasible: bool,
    /// The earliest time they can (equal to or before `ready_by` when feasible).
    pub earliest_ready_at: String,
}

/// Whether a session got a sandbox that was already running (`warm`) or one created for it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Start {
    /// An idle sandbox, already running, was leased.
    Warm,
    /// No sandbox was idle: one was created for this session.
    Cold,
}

impl Start {
    /// As it appears in JSON, headers and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Start::Warm => "warm",
            Start::Cold => "cold",
        }
    }
}

/// A session as the API shows it (answer of create and `GET /v1/sessions/{id}`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Session {
    /// Names the session in every later call: `<node>.<hex>`, its node's id first.
    pub session_id: String,
    /// The sandbox the session holds (`<node>.<hex>`, like the session id).
    pub sandbox_id: String,
    /// The node its sandbox runs on.
    pub node: String,
    /// The template it was created from.
    pub template: String,
    /// Present on the create answer only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<Start>,
    /// Time the create waited for its sandbox, in milliseconds (create answer only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<f64>,
    /// RFC 3339; when the session is reaped unless used or kept alive before.
    pub expires_at: String,
    /// RFC 3339; the hard end of the session's lifetime, whatever its activity.
    pub max_expires_at: String,
    /// RFC 3339; when the session was created.
    pub created_at: String,
    /// The idempotency key it was created with, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_key: Option<String>,
    /// The labels it was created with.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Frozen (no CPU, memory kept); the next call resumes it.
    #[serde(default)]
    pub paused: bool,
    /// The egress policy the session's connections are checked against now (templates with
    /// named egress only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<String>,
    /// `GET /v1/sessions/{id}` only: CPU time the sandbox has used so far, ms (its cgroup's;
    /// absent if its node could not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_ms: Option<f64>,
    /// `GET /v1/sessions/{id}` only: time the sandbox has waited so far for having spent its
    /// CPU quota (`cpus` x the template's `cpu_period_ms`) within a period, ms. Throttling is
    /// the quota at work, not the platform's latency.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_throttled_ms: Option<f64>,
}

/// `POST /v1/sessions:pause` and `:resume`: every session of the caller whose labels include
/// all of these.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LabelSelector {
    /// A session is selected when it carries every one of these key/value pairs.
    pub labels: BTreeMap<String, String>,
}

/// Answer of a selector call: the sessions it changed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct SessionIds {
    /// The sessions the call changed.
    pub session_ids: Vec<String>,
}

/// Answer of `DELETE /v1/sessions?label=k=v`: how many sessions the call ended.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct EndedCount {
    /// Sessions ended (at most 10,000 a call: when it is 10,000, call again).
    pub ended: u64,
}

/// `GET /v1/sessions`: the caller's live sessions (with `subtree`, its descendants' too).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct SessionList {
    /// This page's sessions, oldest first.
    pub sessions: Vec<Session>,
    /// Where the next page starts (`?cursor=`); absent on the last page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// Most sessions one fork call creates.
pub const MAX_FORK: u32 = 32;

/// Answer of `POST /v1/sessions/{id}/snapshot`: a private template of the caller.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct Snapshot {
    /// Use as `template` when creating sessions; only its tenant can.
    pub template: String,
    /// The configured template the snapshot derives from (limits, network, workdir, lifetimes).
    pub base_template: String,
    /// Snapshots live on the node that took them; their sessions are placed there.
    pub node: String,
    /// RFC 3339; when the snapshot was taken.
    pub created_at: String,
}

/// `POST /v1/sessions/{id}/fork`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// Sessions to start from the snapshot, 1 ..= 32 (`MAX_FORK`).
    pub count: u32,
    /// How long each new session may wait for a sandbox, as in `POST /v1/sessions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait_s: Option<f64>,
}

/// Answer of a fork: the snapshot template and the new sessions.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Forked {
    /// The snapshot template the new sessions start from (a private template of the caller).
    pub template: String,
    /// The new sessions, `count` of them.
    pub sessions: Vec<Session>,
}

/// What to run: an argv vector, or a string for `/bin/sh -c`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(untagged)]
pub enum Cmd {
    /// An argv vector, spawned as is (no shell).
    Argv(Vec<String>),
    /// A string, run under `/bin/sh -c`.
    Shell(String),
}

impl Cmd {
    /// The argv to spawn; a shell string runs under `/bin/sh -c`.
    pub fn to_argv(&self) -> Vec<String> {
        match self {
            Cmd::Argv(v) => v.clone(),
            Cmd::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        }
    }
}

/// How `stdin`, `stdout` and `stderr` are carried in JSON.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// UTF-8 text; invalid sequences in output are replaced with U+FFFD.
    #[default]
    Utf8,
    /// Standard base64, binary-exact.
    Base64,
}

/// `POST /v1/sessions/{id}/exec`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// What to run.
    pub cmd: Cmd,
    /// Given to the command as its standard input (in `encoding`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Environment variables set for the command.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Working directory (relative: under the template's workdir); default: the workdir.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Milliseconds before the command is killed (default 300,000; at most 3,600,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Encoding of `stdin` in this request and of `stdout`/`stderr` in the answer.
    #[serde(default)]
    pub encoding: Encoding,
}

/// Answer of `POST /v1/sessions/{id}/exec`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExecResponse {
    /// The command's exit status (127: no such program, as in a shell).
    pub exit_code: i32,
    /// What the command wrote to stdout, in `encoding` (at most `pool_manager.max_output_bytes`).
    pub stdout: String,
    /// What the command wrote to stderr, in `encoding` (at most `pool_manager.max_output_bytes`).
    pub stderr: String,
    /// The encoding of `stdout` and `stderr`, as the request asked.
    pub encoding: Encoding,
    /// How long the command ran, in milliseconds.
    pub duration_ms: f64,
    /// The command ran past its timeout (or its client hung up) and was killed.
    pub timed_out: bool,
    /// `stdout` was cut at `pool_manager.max_output_bytes` (1 MiB by default).
    pub stdout_truncated: bool,
    /// `stderr` was cut at `pool_manager.max_output_bytes` (1 MiB by default).
    pub stderr_truncated: bool,
}

/// The kind of a directory entry (a symbolic link is not followed).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum EntryType {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (dangling or not).
    Symlink,
    /// Anything else: a device, a FIFO, a socket.
    Other,
}

/// One entry of a directory listing.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct DirEntry {
    /// The entry's name in its directory.
    pub name: String,
    /// What kind of entry it is.
    #[serde(rename = "type")]
    pub kind: EntryType,
    /// Bytes (of the link itself for a symbolic link).
    pub size: u64,
    /// Permission bits, e.g. 420 (0o644).
    pub mode: u32,
    /// RFC 3339.
    pub modified_at: String,
}

/// Answer of `GET /v1/sessions/{id}/dirs/{path}`: a directory's entries, sorted by name.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct DirListing {
    /// The directory, absolute (a relative path is resolved against the workdir).
    pub path: String,
    /// Its entries, one level, sorted by name (at most 10,000).
    pub entries: Vec<DirEntry>,
    /// Entries in the directory; more than `entries` holds when the listing was cut at 10,000.
    pub total: u64,
}

/// Answer of `GET /v1/sessions/{id}/exists/{path}`. A symbolic link counts as there (dangling
/// or not) and is not followed: `type` is then `symlink`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct PathExists {
    /// The path, absolute (a relative path is resolved against the workdir).
    pub path: String,
    /// Whether anything is at the path (a dangling symbolic link counts).
    pub exists: bool,
    /// What is there; absent when nothing is.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<EntryType>,
}

/// Body of `POST /v1/sessions/{id}/files:rename`. Both paths follow the file calls' rules
/// (relative to the workdir, or absolute after a second slash; `..` refused).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RenameRequest {
    /// The path to rename (a symbolic link is renamed, not its target).
    pub from: String,
    /// Must not exist yet (`conflict` if it does); its directory must.
    pub to: String,
}

/// How a template's sandboxes run commands.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ExecMode {
    /// Through the in-sandbox agent (PID 1) over the container's attached stdio.
    #[default]
    Agent,
    /// Through `docker exec`; for images or runtimes where the agent cannot run.
    Docker,
}

/// Network policy of a template.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Network {
    /// No network interface but loopback.
    #[default]
    None,
    /// Docker's default bridge (outbound access as the host allows).
    Bridge,
    /// A network whose only way out is the node's egress proxy, which allows what the
    /// session's current named policy allows (`PUT /v1/sessions/{id}/egress`).
    Egress,
}

impl Network {
    /// As the API and the config spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Network::None => "none",
            Network::Bridge => "bridge",
            Network::Egress => "egress",
        }
    }
}

/// A template's named egress: the policy its sessions start under and those they may switch to.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct TemplateEgress {
    /// The policy a session starts under.
    pub initial: String,
    /// The policies a session may switch to (`PUT /v1/sessions/{id}/egress`).
    pub allowed: Vec<String>,
}

/// A named egress policy as `GET /v1/egress/policies` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct EgressPolicy {
    /// The policy's name, as templates and `PUT /v1/sessions/{id}/egress` name it.
    pub name: String,
    /// Its rules: `HOST[:PORT]`, HOST a name, `*.domain`, an IPv4 address or CIDR.
    pub allow: Vec<String>,
    /// `config` (the node's config file; read-only here) or `api` (defined by an admin).
    pub source: String,
}

/// Answer of `GET /v1/egress/policies`: the named egress policies, by name, a page at a time.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct EgressPolicyList {
    /// This page's policies, by name.
    pub policies: Vec<EgressPolicy>,
    /// Where the next page starts (`?cursor=`); absent on the last page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// `PUT /v1/egress/policies/{name}` (admin).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EgressPolicyRules {
    /// The policy's rules: `HOST[:PORT]`, HOST a name, `*.domain`, an IPv4 address or CIDR.
    pub allow: Vec<String>,
}

/// `PUT /v1/sessions/{id}/egress`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EgressRequest {
    /// A policy the session's template allows.
    pub policy: String,
}

/// A template as `GET /v1/templates` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct TemplateInfo {
    /// The name sessions are created with.
    pub name: String,
    /// The image its sandboxes run.
    pub image: String,
    /// How its sandboxes run commands.
    pub exec: ExecMode,
    /// The isolation class: the OCI runtime (`runc`, `runsc` for gVisor, `crun`, ...).
    pub runtime: String,
    /// Its network policy.
    pub network: Network,
    /// Named egress (`network = "egress"` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<TemplateEgress>,
    /// CPUs (fractional) a sandbox may use: its CPU quota is this many periods' worth.
    pub cpus: f64,
    /// The CFS period its CPU quota (`cpus` x period) is spent in: a sandbox that used its
    /// quota waits for the next period.
    #[serde(default)]
    pub cpu_period_ms: u64,
    /// Memory limit of a sandbox, MiB.
    pub memory_mb: u64,
    /// Writable disk of a sandbox (its own writes), MiB; 0: no bound. Writes past it fail with
    /// "No space left on device" or "Disk quota exceeded", on nodes that enforce it.
    #[serde(default)]
    pub disk_mb: u64,
    /// Process (pids) limit of a sandbox.
    pub pids: u64,
    /// The sandboxes' working directory; relative file paths and `cwd`s are under it.
    pub workdir: String,
    /// Who commands, terminals and file calls run as: `uid:gid`, or `root`.
    pub user: String,
    /// Ports of the sandbox reachable through `/v1/sessions/{id}/ports/{port}/...`.
    #[serde(default)]
    pub ports: Vec<u16>,
    /// Idle sandboxes each node keeps ready.
    pub warm: u32,
    /// Seconds a session may be idle before it ends (the most a session's `idle_timeout_s` may be).
    pub idle_timeout_s: u64,
    /// Seconds after its start a session ends, busy or not (the most a session's `ttl_s` may be).
    pub max_lifetime_s: u64,
    /// Templates made from images: the principal that owns it (absent: public).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Templates made from images: the reference asked for (`image` is its digest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// `POST /v1/sessions/{id}/urls`: a signed URL of one of the session's ports.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PortUrlRequest {
    /// A port the session's template exposes.
    pub port: u16,
    /// How long the URL works, in seconds (default 600, at most 86400).
    #[serde(default)]
    pub ttl_s: Option<u64>,
}

/// A signed URL of a session's port: anyone holding it reaches the port, without a token,
/// until it expires (or the session ends).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct PortUrl {
    /// The URL's path under the gateway's address, ending in `/` (the port's root); a page's
    /// relative links stay under it.
    pub path: String,
    /// The port it reaches.
    pub port: u16,
    /// RFC 3339; when the URL stops working.
    pub expires_at: String,
}

/// Why a port is refused: the gateway and the node say it in the same words.
pub fn port_not_exposed(template: &str, ports: &[u16], port: u16) -> String {
    let listed = if ports.is_empty() {
        "exposes none".to_string()
    } else {
        let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
        format!("exposes {}", ports.join(", "))
    };
    format!("port {port} is not exposed by template {template:?} (it {listed})")
}

/// Answer of `GET /v1/templates`: the templates the caller can use, by name, a page at a time.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct TemplateList {
    /// This page's templates, by name.
    pub templates: Vec<TemplateInfo>,
    /// Where the next page starts (`?cursor=`); absent on the last page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// Standard base64 (with padding), the one codec the APIs use.
pub fn b64_encode(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Decodes standard base64 (with padding); the error says why it is not.
pub fn b64_decode(s: &str) -> Result<Vec<u8>, String> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.decode(s).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmd_accepts_argv_and_shell() {
        let r: ExecRequest = serde_json::from_str(r#"{"cmd":["ls","-l"]}"#).unwrap();
        assert_eq!(r.cmd.to_argv(), ["ls", "-l"]);
        let r: ExecRequest = serde_json::from_str(r#"{"cmd":"echo hi"}"#).unwrap();
        assert_eq!(r.cmd.to_argv(), ["/bin/sh", "-c", "echo hi"]);
        assert_eq!(r.encoding, Encoding::Utf8);
    }

    #[test]
    fn error_codes_read_as_they_are_written() {
        for code in [ErrorCode::BadRequest, ErrorCode::SessionGone, ErrorCode::StaleFence, ErrorCode::SandboxFailed] {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{code}\""));
            assert_eq!(serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
        }
        assert_eq!(serde_json::from_str::<ErrorCode>("\"from_the_future\"").unwrap(), ErrorCode::Unknown);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<CreateSession>(r#"{"template":"t","bogus":1}"#).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }
}

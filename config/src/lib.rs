//! sandpool's typed configuration: a raw TOML layer with defaults, environment overrides, and
//! validation into the runtime `Config` that every binary uses. Bad config names its field.
//!
//! Why one file of this size: each raw field sits beside its validation and its default;
//! a fifth of it is tests.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use wire::{ExecMode, Network, TemplateEgress, TemplateInfo};

pub mod egress;
pub mod env;
pub mod envelope;
pub mod registries;
pub use egress::EgressConfig;

/// Where `sandpool` looks for its config when no `--config` is given.
pub const DEFAULT_CONFIG_PATH: &str = "config/sandpool.toml";
/// Loopback only by default: exposing the gateway is a deliberate act.
pub const DEFAULT_GATEWAY_LISTEN: &str = "127.0.0.1:8080";
/// The development JWT key and internal secret shipped in `config/sandpool.toml`. Anyone can
/// read them, so a process refuses them unless every listener it opens is on loopback.
pub const DEV_JWT_KEY: &str = "dev-jwt-key-change-me-please";
pub const DEV_INTERNAL_SECRET: &str = "dev-internal-secret-change-me";
/// Prometheus' registry lists 9464 for OpenTelemetry-style exporters; loopback by default.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9464";
pub const DEFAULT_POOL_MANAGER_LISTEN: &str = "127.0.0.1:8081";
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// Every key sandpool writes starts with this, so one Redis can host several deployments.
pub const DEFAULT_REDIS_PREFIX: &str = "sandpool";
pub const DEFAULT_DOCKER_SOCKET: &str = "/var/run/docker.sock";
/// A create is `docker create` + `start` (~0.5 s here); 2 cores sustain about 4 in parallel.
pub const DEFAULT_MAX_CREATES_IN_FLIGHT: usize = 4;
/// Destroys a node runs at once while no create runs. Docker removes ~12 containers a second on
/// 2 cores however many run in parallel; more would only queue inside dockerd.
pub const MAX_DESTROYS_IN_FLIGHT: usize = 8;
/// Destroys beside creates: few, so a released burst does not queue removals inside dockerd
/// ahead of the creates that waiting requests need.
pub const DEFAULT_DESTROYS_BESIDE_CREATES: usize = 2;
/// Output cap per stream of one exec: enough for any tool call, small enough for memory.
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 1 << 20;
/// Open port connections per sandbox: a browser opens about six per host at once, a test
/// harness a few dozen; more is a client leaking connections, which the node should refuse
/// before it costs the sandbox two agent threads each.
pub const DEFAULT_MAX_PORT_CONNECTIONS: u32 = 64;
/// Bytes one port connection carries: 1 GiB, well above a page, an API's answers or a
/// WebSocket session of an episode, and a bound on what one connection can pull out of a
/// sandbox (a long-lived relay is meant for control, not bulk export: files are for that).
pub const DEFAULT_MAX_PORT_BYTES: u64 = 1 << 30;
/// Largest request body the gateway reads (file uploads included).
pub const DEFAULT_MAX_BODY_BYTES: u64 = 64 << 20;
/// A function invocation's payload and result: Lambda's synchronous limit, which RL payloads
/// (a rollout, a candidate solution and its tests) fit in.
pub const DEFAULT_MAX_INVOKE_BYTES: u64 = 6 << 20;
/// Asynchronous invocations' results are kept this long for their caller to collect.
pub const DEFAULT_INVOCATION_TTL: Duration = Duration::from_secs(3600);
pub const MAX_INVOCATION_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// Asynchronous invocations one gateway runs at once (each holds its payload, up to
/// `max_invoke_bytes`, until it ends); more answer 429.
pub const DEFAULT_MAX_ASYNC_IN_FLIGHT: usize = 4096;

// Defaults of `[quotas.default]`: what a top-level tenant may hold without a limit of its own.
// Each bounds state that every node or gateway keeps or re-reads, and each is well above what
// a demanding RL run uses (an admin raises it for a tenant that needs more).
/// Templates a tenant makes (from images, snapshots, forks): a SWE-style corpus of one image
/// per task (SWE-bench Verified is 500 tasks). Every node keeps every template in memory: at
/// most 500 x 64 KiB of env per tenant.
pub const DEFAULT_PRIVATE_TEMPLATES: u64 = 500;
/// Functions a tenant defines: reward models, graders and tools of many runs side by side;
/// every gateway's keeper reads every function every second (at most 128 KiB each).
pub const DEFAULT_FUNCTIONS: u64 = 200;
/// Asynchronous invocations a tenant has in flight, over all gateways (at most a quarter of
/// one gateway's slots): each pins its payload (6 MiB at most) in a gateway, so 256 pin at
/// most 1.5 GiB; a whole batch goes through `map`, which holds no slot.
pub const DEFAULT_ASYNC_IN_FLIGHT: u64 = 256;
/// Asynchronous invocation records a tenant keeps (each lives `gateway.invocation_ttl` after
/// its deadline): 10 accepted a second, every second of the hour.
pub const DEFAULT_ASYNC_RESULTS: u64 = 36_000;
/// The bytes of a tenant's kept asynchronous records, in MiB: an hour of 10 results a second
/// of 28 KiB each, or 170 results of the largest size (6 MiB); Redis holds them.
pub const DEFAULT_ASYNC_RESULT_MB: u64 = 1024;
/// Reservation requests a tenant has live (until `ready_by + hold_s`): one per training
/// step of many runs at once.
pub const DEFAULT_RESERVATIONS: u64 = 100;
/// Templates named by a tenant's live reservations, over all of them: two steps ahead of a
/// corpus of 2,500 task images. The autoscaler reads every live entry every tick.
pub const DEFAULT_RESERVATION_ITEMS: u64 = 5000;
/// Creates per second a node starts at most (token bucket shared by pool refill and on-demand
/// creates): about what 2 cores sustain here, so bursts queue instead of thrashing Docker.
pub const DEFAULT_CREATE_RATE: f64 = 8.0;
/// Sandboxes one node holds at most (idle + leased + being created). The default bridge
/// network tops out near 1,023; with no network a 24 GiB node holds a few thousand.
pub const DEFAULT_MAX_SANDBOXES: u64 = 2000;
/// Memory a node offers to sandboxes, as a multiple of its physical memory. Capacity counts each
/// sandbox at its template's memory *limit*, while an idle sandbox uses a few MiB of it, so
/// limits are overcommitted (DSec packs ~3,200 per node the same way).
pub const DEFAULT_MEMORY_OVERCOMMIT: f64 = 8.0;
/// Requests that may wait for one template on one node before new ones get 429.
pub const DEFAULT_MAX_QUEUE: usize = 4096;
/// How long a session request waits for a sandbox when it names no `max_wait_s`, and the
/// longest it may ask for.
pub const DEFAULT_QUEUE_WAIT: Duration = Duration::from_secs(30);
/// A load balancer polling `/readyz` every second notices a draining gateway within this.
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(2);
/// Long enough for ordinary calls to finish; a longer exec is cut (its client retries).
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(15);
pub const MAX_QUEUE_WAIT: Duration = Duration::from_secs(300);
/// A node silent this long is down: nothing is placed on it and its sessions answer 503
/// `node_unavailable`. Five heartbeats (2 s apart): a GC pause or a slow Redis is not a death.
pub const DEFAULT_NODE_DOWN_AFTER: Duration = Duration::from_secs(10);
/// A node down this long is given up: its sessions end (`node_lost`), their quota returns.
/// Long enough for a pool-manager restart or a Docker restart; short beside a session's hours.
pub const DEFAULT_NODE_LOST_AFTER: Duration = Duration::from_secs(300);
/// Nodes sampled per placement (power of k choices): 2 already balances to within a small
/// constant of the best (Mitzenmacher), and each choice costs a Redis script on a miss.
pub const DEFAULT_PLACEMENT_CHOICES: usize = 2;
/// Default exec timeout when the request names none, and the ceiling a request may ask for.
pub const DEFAULT_EXEC_TIMEOUT: Duration = Duration::from_secs(300);
pub const MAX_EXEC_TIMEOUT: Duration = Duration::from_secs(3600);
/// Writable disk of one sandbox (its own writes, not its image), MiB: room for a repository, a
/// build and a pip install, while 30 sandboxes cannot fill a 64 GiB data root.
pub const DEFAULT_DISK_MB: u64 = 2048;
/// A sandbox's CFS period: short, so a sandbox that spent its quota (0.5 CPU of a closed loop
/// of execs) waits at most a few milliseconds for the next period, not the tens of
/// milliseconds of the kernel's 100 ms default; the node pays a little more scheduler work
/// for it (BENCHMARKS.md, "CFS period").
pub const DEFAULT_CPU_PERIOD: Duration = Duration::from_millis(10);
/// The kernel's bounds on a CFS period.
pub const MIN_CPU_PERIOD: Duration = Duration::from_millis(1);
pub const MAX_CPU_PERIOD: Duration = Duration::from_secs(1);
/// The kernel's smallest CFS quota, in microseconds.
const MIN_CFS_QUOTA_US: f64 = 1000.0;
/// Below this the bound would trip on the few KiB a new container writes when it starts.
pub const MIN_DISK_MB: u64 = 16;
/// 16 TiB: above any disk a node has; a larger value is a typo.
pub const MAX_DISK_MB: u64 = 1 << 24;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("parse config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid config: {field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), message: message.into() }
}

/// Overrides from flags or the environment; `None` keeps the file's value.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub redis_url: Option<String>,
    pub redis_prefix: Option<String>,
    pub docker_socket: Option<String>,
    pub gateway_listen: Option<String>,
    pub pool_manager_listen: Option<String>,
    pub pool_manager_advertise: Option<String>,
    pub node_id: Option<String>,
    pub jwt_key: Option<String>,
    pub jwt_algorithm: Option<String>,
    pub internal_secret: Option<String>,
}

// ---------- raw layer: what the TOML file says ----------

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawConfig {
    node: RawNode,
    redis: RawRedis,
    docker: RawDocker,
    gateway: RawGateway,
    pool_manager: RawPoolManager,
    auth: RawAuth,
    telemetry: RawTelemetry,
    log: RawLog,
    quotas: RawQuotas,
    egress: RawEgress,
    images: RawImages,
    templates: BTreeMap<String, RawTemplate>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawImages {
    /// The configured template a template made from an image starts from when it names none.
    base: Option<String>,
    /// The configured templates a tenant's template may start from (default: `base` only).
    bases: Option<Vec<String>>,
    max_pulls_in_flight: Option<usize>,
    #[serde(with = "humantime_serde", default)]
    pull_timeout: Option<Duration>,
    /// MiB of images a node keeps; unused pulled images beyond it are evicted, least recently
    /// used first. 0: never evict.
    disk_budget_mb: Option<u64>,
    /// Credentials per registry host (`host[:port]`).
    registries: BTreeMap<String, RegistryAuth>,
    /// What every tenant may name (`host[:port]` or `host[:port]/path/*`, `{tenant}` in the
    /// path); empty (and no scope): any. Admins may name any.
    allowed_registries: Vec<String>,
    /// More entries and credentials per principal path (`registries::RegistryScope`).
    scopes: BTreeMap<String, registries::RawScope>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawEgress {
    policies: BTreeMap<String, RawPolicy>,
    /// Names the node resolves itself (before the host's resolver), to IPv4 addresses.
    hosts: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawPolicy {
    allow: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawQuotas {
    /// Off: no limits are checked or counted (benchmarks compare the two).
    enabled: Option<bool>,
    /// Limits of every top-level tenant that has none of its own, per dimension.
    default: wire::quotas::QuotaLimits,
    /// Calls per second per principal and gateway (exec, files, WebSocket opens); none: off.
    call_rate: Option<f64>,
    call_burst: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawTelemetry {
    /// Where this process serves `GET /metrics`; "off" for nowhere.
    metrics_listen: Option<String>,
    /// OTLP/HTTP endpoint for traces (`OTEL_EXPORTER_OTLP_ENDPOINT` overrides); none: no traces.
    otlp_endpoint: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawLog {
    /// "text" (the default) or "json".
    format: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawNode {
    id: Option<String>,
    #[serde(with = "humantime_serde", default)]
    down_after: Option<Duration>,
    #[serde(with = "humantime_serde", default)]
    lost_after: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawRedis {
    url: Option<String>,
    prefix: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawDocker {
    socket: Option<String>,
    /// OCI runtime for templates that name none (runc, crun, runsc).
    runtime: Option<String>,
    /// "required": refuse to start on a node that cannot bound sandbox disks; "best_effort":
    /// start anyway, unbounded, with a warning.
    disk_bounds: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawGateway {
    listen: Option<String>,
    max_body_bytes: Option<u64>,
    max_queue: Option<usize>,
    #[serde(with = "humantime_serde", default)]
    default_wait: Option<Duration>,
    #[serde(with = "humantime_serde", default)]
    drain_grace: Option<Duration>,
    #[serde(with = "humantime_serde", default)]
    drain_timeout: Option<Duration>,
    max_invoke_bytes: Option<u64>,
    #[serde(with = "humantime_serde", default)]
    invocation_ttl: Option<Duration>,
    max_async_in_flight: Option<usize>,
    placement_choices: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawPoolManager {
    listen: Option<String>,
    /// URL gateways use to reach this pool-manager; defaults to http://<listen>.
    advertise: Option<String>,
    secret: Option<String>,
    state_dir: Option<PathBuf>,
    max_creates_in_flight: Option<usize>,
    /// `false`: keep `max_creates_in_flight` in flight always (the fixed window of old).
    adaptive_create_window: Option<bool>,
    /// Destroys in flight while creates run (8 while none does).
    destroys_beside_creates: Option<usize>,
    create_rate: Option<f64>,
    max_sandboxes: Option<u64>,
    /// A cap on the machine's threads below the kernel's (`kernel.pid_max`, `threads-max`).
    max_threads: Option<u64>,
    memory_overcommit: Option<f64>,
    max_output_bytes: Option<u64>,
    /// Open connections to ports (`templates.*.ports`) per sandbox.
    max_port_connections: Option<u32>,
    /// Bytes one port connection may carry, both ways together.
    max_port_bytes: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawAuth {
    algorithm: Option<String>,
    /// HS*: the shared secret. Asymmetric: a PEM public key (verification).
    key: Option<String>,
    key_file: Option<PathBuf>,
    /// Asymmetric only: PEM private key, used by `sandpool token` to mint dev tokens.
    private_key_file: Option<PathBuf>,
    /// If set, tokens must carry this `iss`.
    issuer: Option<String>,
    /// If set, tokens must carry this `aud`.
    audience: Option<String>,
    /// If set, tokens must carry `iat` and live at most this long (`exp - iat`).
    #[serde(with = "humantime_serde", default)]
    max_token_lifetime: Option<Duration>,
    /// A JSON Web Key Set: a file path or an http(s) URL. Tokens whose header names a `kid`
    /// are checked with that key of the set; tokens without one, with `key`.
    jwks: Option<String>,
    /// How often the set is read again (default 5m); an unknown `kid` reads it sooner.
    #[serde(with = "humantime_serde", default)]
    jwks_refresh: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawTemplate {
    image: Option<String>,
    exec: Option<ExecMode>,
    runtime: Option<String>,
    network: Option<Network>,
    /// The egress policy sessions start under (implies `network = "egress"`).
    egress: Option<String>,
    /// The policies sessions may switch to (default: the initial one and `deny-all`).
    egress_allowed: Option<Vec<String>>,
    cpus: Option<f64>,
    /// The CFS period the sandbox's CPU quota (`cpus` x period) is spent in.
    #[serde(with = "humantime_serde", default)]
    cpu_period: Option<Duration>,
    memory_mb: Option<u64>,
    /// Writable disk per sandbox, MiB; 0: no bound.
    disk_mb: Option<u64>,
    pids: Option<u64>,
    env: BTreeMap<String, String>,
    workdir: Option<String>,
    user: Option<String>,
    max_download_mb: Option<u64>,
    /// TCP ports on the sandbox's loopback the gateway may relay to (`/v1/sessions/{id}/ports/{port}`).
    ports: Option<Vec<u16>>,
    warm: Option<u32>,
    #[serde(with = "humantime_serde", default)]
    idle_timeout: Option<Duration>,
    #[serde(with = "humantime_serde", default)]
    max_lifetime: Option<Duration>,
}

// ---------- runtime layer: validated ----------

#[derive(Debug, Clone)]
pub struct Config {
    pub node: NodeConfig,
    pub redis: RedisConfig,
    pub docker: DockerConfig,
    pub gateway: GatewayConfig,
    pub pool_manager: PoolManagerConfig,
    pub auth: AuthConfig,
    pub telemetry: TelemetryConfig,
    pub log: LogConfig,
    pub quotas: QuotasConfig,
    pub egress: EgressConfig,
    pub images: ImagesConfig,
    pub templates: BTreeMap<String, Template>,
}

/// The image corpus: templates made from images, pulls and the node's image disk.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagesConfig {
    /// The configured template a template made from an image starts from by default.
    pub base: String,
    /// The configured templates a tenant's template may start from (their runtime, user and
    /// network are the operator's envelope for tenants' images); admins may start from any.
    pub bases: Vec<String>,
    /// Pulls one node runs at once (more wait their turn).
    pub max_pulls_in_flight: usize,
    /// One pull's bound (it counts toward the create that needs it).
    pub pull_timeout: Duration,
    /// MiB of images a node keeps before it evicts unused pulled ones; 0: never.
    pub disk_budget_mb: u64,
    pub registries: BTreeMap<String, RegistryAuth>,
    /// What every tenant may make templates from; empty (with no scope on a tenant's path):
    /// any (nodes then contact whatever host a tenant names).
    pub allowed_registries: Vec<registries::RegistryPattern>,
    /// More entries and credentials per principal path, for it and its descendants.
    pub scopes: BTreeMap<String, registries::RegistryScope>,
}

/// A registry's credentials (Docker's `X-Registry-Auth`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryAuth {
    pub username: String,
    pub password: String,
}

impl ImagesConfig {
    /// The scopes on `principal`'s path, the most specific first.
    fn scopes_of(&self, principal: &str) -> Vec<&registries::RegistryScope> {
        let mut on_path: Vec<(&String, &registries::RegistryScope)> =
            self.scopes.iter().filter(|(p, _)| wire::quotas::within(principal, p)).collect();
        on_path.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
        on_path.into_iter().map(|(_, s)| s).collect()
    }

    /// The credentials for `reference`'s registry: those of the most specific scope on
    /// `principal`'s path that has some for it, else the deployment's.
    pub fn auth_for(&self, reference: &str, principal: Option<&str>) -> Option<&RegistryAuth> {
        let host = wire::images::registry_of(reference);
        principal
            .and_then(|p| self.scopes_of(p).into_iter().find_map(|s| s.registries.get(host)))
            .or_else(|| self.registries.get(host))
    }

    /// Whether tenant `principal` may name `reference`: an entry of `allowed_registries` or of
    /// a scope on its path matches it; with no entry at all, any reference.
    pub fn may_name(&self, principal: &str, reference: &str) -> bool {
        let scopes = self.scopes_of(principal);
        let mut entries = self.allowed_registries.iter().chain(scopes.iter().flat_map(|s| &s.allowed));
        let mut none = true;
        entries.any(|e| {
            none = false;
            e.matches(reference, principal)
        }) || none
    }
}

/// Tenancy limits that come from the config (per-path quotas live in Redis, set by the API).
#[derive(Debug, Clone, PartialEq)]
pub struct QuotasConfig {
    /// When false, creates are neither checked nor counted (a single-tenant deployment, and
    /// the benchmark's baseline).
    pub enabled: bool,
    /// Applied to a top-level tenant for every dimension it has no limit of its own for.
    /// `queued` defaults to a quarter of `gateway.max_queue`, so one tenant's flood cannot
    /// fill a shared queue; `async_in_flight` to at most a quarter of
    /// `gateway.max_async_in_flight`; the other counts to the `DEFAULT_*` constants.
    pub default: wire::quotas::QuotaLimits,
    /// Calls per second per principal, enforced by each gateway on its own.
    pub call_rate: Option<f64>,
    pub call_burst: u64,
}

#[derive(Debug, Clone)]
pub struct TelemetryConfig {
    /// Where this process serves Prometheus metrics (`GET /metrics`), if anywhere.
    pub metrics_listen: Option<SocketAddr>,
    /// Where traces go (OTLP over HTTP), if anywhere.
    pub otlp_endpoint: Option<String>,
}

#[derive(Debug, Clone)]
pub struct LogConfig {
    pub format: LogFormat,
}

/// How a process writes its log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// `key=value` text: for people.
    Text,
    /// One JSON object a line: for log collectors (Loki, Elasticsearch, Cloud Logging).
    Json,
}

#[derive(Debug, Clone)]
pub struct RedisConfig {
    pub url: String,
    pub prefix: String,
}

#[derive(Debug, Clone)]
pub struct DockerConfig {
    pub socket: String,
    pub runtime: String,
    /// What a node whose Docker cannot bound a container's writable layer does with templates
    /// that ask for a bound (`disk_mb` > 0).
    pub disk_bounds: DiskBounds,
}

/// See `DockerConfig::disk_bounds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskBounds {
    /// The pool-manager refuses to start, naming the templates and the fix.
    Required,
    /// The pool-manager starts and creates sandboxes without the bound, with a warning. The
    /// default: a development machine whose dockerd predates `scripts/lib.sh`'s bounded data
    /// root keeps working.
    BestEffort,
}

#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: u64,
    pub max_queue: usize,
    pub default_wait: Duration,
    /// On shutdown, how long `/readyz` fails before the listener closes.
    pub drain_grace: Duration,
    /// On shutdown, how long in-flight requests and WebSockets may take to finish.
    pub drain_timeout: Duration,
    /// A function invocation's payload, and its result, at most (default 6 MiB, as Lambda).
    pub max_invoke_bytes: u64,
    /// How long an asynchronous invocation's result is kept (default 1 h).
    pub invocation_ttl: Duration,
    /// Asynchronous invocations this gateway runs at once (default 4096); each top-level
    /// tenant gets a share (`[quotas.default] async_in_flight`).
    pub max_async_in_flight: usize,
    /// Live nodes sampled per placement (power of k choices; default 2).
    pub placement_choices: usize,
}

/// Node identity and liveness.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The node's id; `None`: derived at start from the host name and Docker's engine id.
    pub id: Option<String>,
    /// Silent this long (no heartbeat): down.
    pub down_after: Duration,
    /// Down this long: given up (its sessions end with `node_lost`).
    pub lost_after: Duration,
}

#[derive(Debug, Clone)]
pub struct PoolManagerConfig {
    pub listen: SocketAddr,
    pub advertise: String,
    pub secret: String,
    pub state_dir: PathBuf,
    /// The cap of the create window (and the window itself when it does not adapt).
    pub max_creates_in_flight: usize,
    /// Whether the create window adapts to Docker's latency (`pace::Window`); default true.
    pub adaptive_create_window: bool,
    /// Destroys the node keeps in flight while creates run (at most `MAX_DESTROYS_IN_FLIGHT`,
    /// which it keeps while none does); default 2.
    pub destroys_beside_creates: usize,
    pub create_rate: f64,
    pub max_sandboxes: u64,
    /// Threads the node's budget counts the machine as having, if below the kernel's limits
    /// (a machine shared with other work, or a test of the budget).
    pub max_threads: Option<u64>,
    pub memory_overcommit: f64,
    pub max_output_bytes: u64,
    /// Open port connections per sandbox; one more answers 429.
    pub max_port_connections: u32,
    /// Bytes one port connection carries (both ways) before the node closes it.
    pub max_port_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JwtAlgorithm {
    HS256,
    HS384,
    HS512,
    RS256,
    ES256,
    EdDSA,
}

impl JwtAlgorithm {
    pub fn is_symmetric(self) -> bool {
        matches!(self, JwtAlgorithm::HS256 | JwtAlgorithm::HS384 | JwtAlgorithm::HS512)
    }
}

#[derive(Clone)]
pub struct AuthConfig {
    pub algorithm: JwtAlgorithm,
    /// HS*: the secret bytes; otherwise the PEM public key.
    pub key: Vec<u8>,
    /// Asymmetric only: the PEM private key for minting, if configured.
    pub private_key: Option<Vec<u8>>,
    /// Tokens must carry this issuer (`iss`), if set; minted tokens carry it.
    pub issuer: Option<String>,
    /// Tokens must carry this audience (`aud`), if set; minted tokens carry it.
    pub audience: Option<String>,
    /// Tokens may live at most this long from `iat` to `exp`, if set.
    pub max_token_lifetime: Option<Duration>,
    /// Keys by id (`kid`), beside `key`: where the set is read from, if anywhere.
    pub jwks: Option<JwksSource>,
    /// How often the key set is read again.
    pub jwks_refresh: Duration,
}

/// Where a JSON Web Key Set is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JwksSource {
    File(PathBuf),
    Url(String),
}

/// An identity provider rotates keys over days and publishes the next one ahead; five
/// minutes picks a new key up well before tokens signed with it appear, at one small read.
pub const DEFAULT_JWKS_REFRESH: Duration = Duration::from_secs(300);

/// What `sandpool config check` (or a stray `{:?}`) shows: an HMAC secret and a private key
/// are never printed; a public key is, as its PEM text.
impl std::fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let key = if self.algorithm.is_symmetric() {
            HIDDEN.to_string()
        } else {
            String::from_utf8_lossy(&self.key).into_owned()
        };
        f.debug_struct("AuthConfig")
            .field("algorithm", &self.algorithm)
            .field("key", &key)
            .field("private_key", &self.private_key.as_ref().map(|_| HIDDEN))
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("max_token_lifetime", &self.max_token_lifetime)
            .field("jwks", &self.jwks)
            .field("jwks_refresh", &self.jwks_refresh)
            .finish()
    }
}

/// What a secret shows as in printed config.
pub const HIDDEN: &str = "<hidden>";

impl Config {
    /// This config with every secret replaced by `HIDDEN` (the internal secret, registry
    /// passwords; the JWT key hides itself): what `sandpool config check` prints.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        c.pool_manager.secret = HIDDEN.into();
        let hide =
            |auths: &mut BTreeMap<String, RegistryAuth>| auths.values_mut().for_each(|a| a.password = HIDDEN.into());
        hide(&mut c.images.registries);
        c.images.scopes.values_mut().for_each(|s| hide(&mut s.registries));
        c
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    pub name: String,
    pub image: String,
    pub exec: ExecMode,
    /// The OCI runtime, its isolation class: `runc`, `runsc` (gVisor), `crun`, or any other
    /// Docker knows (`docker.runtime` when the template names none).
    pub runtime: String,
    pub network: Network,
    /// Named egress, for `Network::Egress`.
    pub egress: Option<TemplateEgress>,
    pub cpus: f64,
    /// The CFS period of the sandbox's CPU quota: a sandbox that spends `cpus` x this within
    /// one period waits for the next (`DEFAULT_CPU_PERIOD`).
    pub cpu_period: Duration,
    pub memory_mb: u64,
    /// Bound on the sandbox's own writes (its writable layer), MiB; 0: none. Enforced by
    /// Docker's `StorageOpt size` where the node supports it (see `DockerConfig::disk_bounds`).
    pub disk_mb: u64,
    pub pids: u64,
    pub env: BTreeMap<String, String>,
    pub workdir: String,
    /// Who tenant commands, terminals and file calls run as.
    pub user: User,
    /// Most bytes one file read sends (a directory's tar included), in MiB.
    pub max_download_mb: u64,
    /// Ports of the sandbox the gateway relays to (sorted, no duplicates); empty: none.
    pub ports: Vec<u16>,
    pub warm: u32,
    pub idle_timeout: Duration,
    pub max_lifetime: Duration,
}

impl Template {
    pub fn info(&self) -> TemplateInfo {
        TemplateInfo {
            name: self.name.clone(),
            image: self.image.clone(),
            exec: self.exec,
            runtime: self.runtime.clone(),
            network: self.network,
            egress: self.egress.clone(),
            cpus: self.cpus,
            cpu_period_ms: self.cpu_period.as_millis() as u64,
            memory_mb: self.memory_mb,
            disk_mb: self.disk_mb,
            pids: self.pids,
            workdir: self.workdir.clone(),
            user: self.user.spec(),
            ports: self.ports.clone(),
            warm: self.warm,
            idle_timeout_s: self.idle_timeout.as_secs(),
            max_lifetime_s: self.max_lifetime.as_secs(),
            owner: None,
            source: None,
        }
    }
}

impl Template {
    /// The template a sandbox of `t` (made from an image) runs: its base's settings with the
    /// image and whatever it overrides, held to the base's envelope (`envelope::clamp`). No
    /// warm pool of its own: demand and reservations size it.
    pub fn from_image(base: &Template, t: &wire::images::ImageTemplate) -> Template {
        let mut env = base.env.clone();
        env.extend(t.env.clone());
        let g = envelope::clamp(base, t);
        Template {
            name: t.name.clone(),
            image: t.image.clone(),
            network: g.network,
            egress: None,
            cpus: g.cpus,
            cpu_period: g.cpu_period,
            memory_mb: g.memory_mb,
            disk_mb: g.disk_mb,
            pids: g.pids,
            env,
            workdir: g.workdir,
            ports: g.ports,
            warm: 0,
            ..base.clone()
        }
    }

    /// The sandbox's CFS period and quota, in microseconds: `cpus` x `cpu_period`, with the
    /// period lengthened where that quota would be under the kernel's 1 ms minimum (a
    /// template of 0.05 CPU runs in 20 ms periods).
    pub fn cfs_period_and_quota_us(&self) -> (i64, i64) {
        let mut period = self.cpu_period.as_micros() as f64;
        if self.cpus * period < MIN_CFS_QUOTA_US {
            period = (MIN_CFS_QUOTA_US / self.cpus).ceil().min(MAX_CPU_PERIOD.as_micros() as f64);
        }
        let quota = (self.cpus * period).round().max(MIN_CFS_QUOTA_US);
        (period as i64, quota as i64)
    }

    /// Checks a CFS period (`cpu_period`): the kernel takes 1 ms ..= 1 s.
    pub fn check_cpu_period(period: Duration) -> Result<(), (&'static str, String)> {
        if !(MIN_CPU_PERIOD..=MAX_CPU_PERIOD).contains(&period) || !period.subsec_micros().is_multiple_of(1000) {
            return Err(("cpu_period", "must be whole milliseconds in 1ms ..= 1s".into()));
        }
        Ok(())
    }

    /// Checks a template's limits (`field` names the one at fault).
    pub fn check_limits(cpus: f64, memory_mb: u64, disk_mb: u64, pids: u64) -> Result<(), (&'static str, String)> {
        if !(cpus > 0.0 && cpus <= 64.0) {
            return Err(("cpus", "must be in (0, 64]".into()));
        }
        if !(8..=1 << 20).contains(&memory_mb) {
            return Err(("memory_mb", "must be 8 ..= 1048576".into()));
        }
        if disk_mb != 0 && !(MIN_DISK_MB..=MAX_DISK_MB).contains(&disk_mb) {
            return Err(("disk_mb", format!("must be 0 (no bound) or {MIN_DISK_MB} ..= {MAX_DISK_MB}")));
        }
        if !(8..=1 << 20).contains(&pids) {
            return Err(("pids", "must be 8 ..= 1048576".into()));
        }
        Ok(())
    }
}

impl Config {
    /// Reads `path`, applies this process's `SANDPOOL__SECTION__KEY` variables (`env`), then
    /// `overrides`, validates.
    pub fn load(path: &Path, overrides: &Overrides) -> Result<Config, ConfigError> {
        Self::load_with_env(path, overrides, process_env())
    }

    /// `load` with the environment given (tests, and `sandpool config check`).
    pub fn load_with_env(
        path: &Path,
        overrides: &Overrides,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        Self::from_toml_with_env(&text, overrides, vars).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: path.to_path_buf(), message },
            other => other,
        })
    }

    /// Parses and validates config text (file paths inside resolve against the working dir).
    /// The process's environment plays no part: see `from_toml_with_env`.
    pub fn from_toml(text: &str, overrides: &Overrides) -> Result<Config, ConfigError> {
        let raw: RawConfig =
            toml::from_str(text).map_err(|e| ConfigError::Parse { path: PathBuf::new(), message: e.to_string() })?;
        validate(raw, overrides)
    }

    /// `from_toml` with `SANDPOOL__SECTION__KEY` variables applied over the text (`env`).
    pub fn from_toml_with_env(
        text: &str,
        overrides: &Overrides,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let parse = |message: String| ConfigError::Parse { path: PathBuf::new(), message };
        let mut table: toml::Table = toml::from_str(text).map_err(|e| parse(e.to_string()))?;
        let applied = env::apply(&mut table, vars)?;
        if applied.is_empty() {
            // The text alone: its errors keep their line and column.
            return Self::from_toml(text, overrides);
        }
        let raw: RawConfig = toml::Value::Table(table).try_into().map_err(|e| {
            let e = e.to_string().trim_end().replace('\n', " ");
            parse(format!("{e} (with {} from the environment)", applied.join(", ")))
        })?;
        validate(raw, overrides)
    }
}

/// This process's environment, as far as it is text (a variable that is not is no config).
fn process_env() -> impl Iterator<Item = (String, String)> {
    std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
}

fn pick(over: &Option<String>, file: Option<String>, default: &str) -> String {
    over.clone().or(file).unwrap_or_else(|| default.to_string())
}

fn is_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// A node id: 1-32 characters of a-z, 0-9 and '-' (it starts every sandbox and session id,
/// before a '.').
pub fn valid_node_id(id: &str) -> bool {
    is_name(id, 32) && !id.contains('_')
}

fn parse_addr(field: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse().map_err(|e| invalid(field, format!("{s:?} is not an ip:port address ({e})")))
}

fn validate(raw: RawConfig, o: &Overrides) -> Result<Config, ConfigError> {
    let node = NodeConfig {
        id: o.node_id.clone().or(raw.node.id),
        down_after: raw.node.down_after.unwrap_or(DEFAULT_NODE_DOWN_AFTER),
        lost_after: raw.node.lost_after.unwrap_or(DEFAULT_NODE_LOST_AFTER),
    };
    if let Some(id) = &node.id
        && !valid_node_id(id)
    {
        return Err(invalid("node.id", "must be 1-32 characters of a-z, 0-9 and '-'"));
    }
    if node.down_after < Duration::from_secs(3) {
        return Err(invalid("node.down_after", "must be at least 3s (heartbeats are 2 s apart)"));
    }
    if node.lost_after < node.down_after {
        return Err(invalid("node.lost_after", "must be at least node.down_after"));
    }

    let redis = RedisConfig {
        url: pick(&o.redis_url, raw.redis.url, DEFAULT_REDIS_URL),
        prefix: pick(&o.redis_prefix, raw.redis.prefix, DEFAULT_REDIS_PREFIX),
    };
    // One URL is a single Redis; a comma-separated list is a Redis Cluster's seeds (the ledger
    // tells them apart the same way: `ledger::Topology`).
    if redis.url.contains(',') {
        let seeds: Vec<&str> = redis.url.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        if seeds.is_empty() || !seeds.iter().all(|s| s.starts_with("redis://")) {
            return Err(invalid("redis.url", "a cluster's seeds must each start with redis://"));
        }
    } else if !redis.url.starts_with("redis://") && !redis.url.starts_with("unix://") {
        return Err(invalid("redis.url", "must start with redis:// or unix://"));
    }
    if redis.prefix.is_empty() || redis.prefix.contains(['{', '}', ' ']) {
        return Err(invalid("redis.prefix", "must be non-empty without braces or spaces"));
    }

    let docker = DockerConfig {
        socket: pick(&o.docker_socket, raw.docker.socket, DEFAULT_DOCKER_SOCKET),
        runtime: raw.docker.runtime.unwrap_or_else(|| "runc".into()),
        disk_bounds: match raw.docker.disk_bounds.as_deref().unwrap_or("best_effort") {
            "required" => DiskBounds::Required,
            "best_effort" => DiskBounds::BestEffort,
            other => {
                return Err(invalid("docker.disk_bounds", format!("{other:?} is not \"required\" or \"best_effort\"")));
            }
        },
    };

    let max_body_bytes = raw.gateway.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
    let gateway = GatewayConfig {
        listen: parse_addr("gateway.listen", &pick(&o.gateway_listen, raw.gateway.listen, DEFAULT_GATEWAY_LISTEN))?,
        max_body_bytes,
        max_queue: raw.gateway.max_queue.unwrap_or(DEFAULT_MAX_QUEUE),
        default_wait: raw.gateway.default_wait.unwrap_or(DEFAULT_QUEUE_WAIT),
        drain_grace: raw.gateway.drain_grace.unwrap_or(DEFAULT_DRAIN_GRACE),
        drain_timeout: raw.gateway.drain_timeout.unwrap_or(DEFAULT_DRAIN_TIMEOUT),
        // Never over the body limit: a smaller body limit lowers the default too.
        max_invoke_bytes: raw.gateway.max_invoke_bytes.unwrap_or(DEFAULT_MAX_INVOKE_BYTES.min(max_body_bytes)),
        invocation_ttl: raw.gateway.invocation_ttl.unwrap_or(DEFAULT_INVOCATION_TTL),
        max_async_in_flight: raw.gateway.max_async_in_flight.unwrap_or(DEFAULT_MAX_ASYNC_IN_FLIGHT),
        placement_choices: raw.gateway.placement_choices.unwrap_or(DEFAULT_PLACEMENT_CHOICES),
    };
    if !(1..=16).contains(&gateway.placement_choices) {
        return Err(invalid("gateway.placement_choices", "must be 1 ..= 16"));
    }
    if gateway.max_invoke_bytes == 0 || gateway.max_invoke_bytes > gateway.max_body_bytes {
        return Err(invalid("gateway.max_invoke_bytes", "must be 1 ..= gateway.max_body_bytes"));
    }
    if !(1..=1 << 20).contains(&gateway.max_async_in_flight) {
        return Err(invalid("gateway.max_async_in_flight", "must be 1 ..= 1048576"));
    }
    if gateway.invocation_ttl < Duration::from_secs(1) || gateway.invocation_ttl > MAX_INVOCATION_TTL {
        return Err(invalid("gateway.invocation_ttl", format!("must be 1s ..= {MAX_INVOCATION_TTL:?}")));
    }
    if gateway.default_wait > MAX_QUEUE_WAIT {
        return Err(invalid("gateway.default_wait", format!("must be at most {MAX_QUEUE_WAIT:?}")));
    }

    let pm = raw.pool_manager;
    let pm_listen =
        parse_addr("pool_manager.listen", &pick(&o.pool_manager_listen, pm.listen, DEFAULT_POOL_MANAGER_LISTEN))?;
    let advertise = o.pool_manager_advertise.clone().or(pm.advertise).unwrap_or_else(|| format!("http://{pm_listen}"));
    if !advertise.starts_with("http://") {
        return Err(invalid("pool_manager.advertise", "must be an http:// URL"));
    }
    let secret = o.internal_secret.clone().or(pm.secret).unwrap_or_default();
    if secret.len() < 16 {
        return Err(invalid("pool_manager.secret", "must be at least 16 characters (or set SANDPOOL_INTERNAL_SECRET)"));
    }
    let max_creates_in_flight = pm.max_creates_in_flight.unwrap_or(DEFAULT_MAX_CREATES_IN_FLIGHT);
    if !(1..=256).contains(&max_creates_in_flight) {
        return Err(invalid("pool_manager.max_creates_in_flight", "must be 1..=256"));
    }
    let destroys_beside_creates = pm.destroys_beside_creates.unwrap_or(DEFAULT_DESTROYS_BESIDE_CREATES);
    if !(1..=MAX_DESTROYS_IN_FLIGHT).contains(&destroys_beside_creates) {
        return Err(invalid("pool_manager.destroys_beside_creates", format!("must be 1..={MAX_DESTROYS_IN_FLIGHT}")));
    }
    let create_rate = pm.create_rate.unwrap_or(DEFAULT_CREATE_RATE);
    if !(create_rate > 0.0 && create_rate <= 10_000.0) {
        return Err(invalid("pool_manager.create_rate", "must be in (0, 10000] creates per second"));
    }
    let max_sandboxes = pm.max_sandboxes.unwrap_or(DEFAULT_MAX_SANDBOXES);
    if max_sandboxes == 0 {
        return Err(invalid("pool_manager.max_sandboxes", "must be at least 1"));
    }
    let memory_overcommit = pm.memory_overcommit.unwrap_or(DEFAULT_MEMORY_OVERCOMMIT);
    if !(memory_overcommit > 0.0 && memory_overcommit <= 1000.0) {
        return Err(invalid("pool_manager.memory_overcommit", "must be in (0, 1000]"));
    }
    let max_output_bytes = pm.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT_BYTES);
    if !(1..=(256 << 20)).contains(&max_output_bytes) {
        return Err(invalid("pool_manager.max_output_bytes", "must be 1 byte ..= 256 MiB"));
    }
    let max_port_connections = pm.max_port_connections.unwrap_or(DEFAULT_MAX_PORT_CONNECTIONS);
    if !(1..=4096).contains(&max_port_connections) {
        return Err(invalid("pool_manager.max_port_connections", "must be 1 ..= 4096"));
    }
    let max_port_bytes = pm.max_port_bytes.unwrap_or(DEFAULT_MAX_PORT_BYTES);
    if max_port_bytes < 1 << 10 {
        return Err(invalid("pool_manager.max_port_bytes", "must be at least 1024"));
    }
    let pool_manager = PoolManagerConfig {
        listen: pm_listen,
        advertise,
        secret,
        state_dir: pm.state_dir.unwrap_or_else(|| PathBuf::from("/var/lib/sandpool")),
        max_creates_in_flight,
        adaptive_create_window: pm.adaptive_create_window.unwrap_or(true),
        destroys_beside_creates,
        create_rate,
        max_sandboxes,
        max_threads: pm.max_threads,
        memory_overcommit,
        max_output_bytes,
        max_port_connections,
        max_port_bytes,
    };

    let auth = validate_auth(raw.auth, o)?;

    if raw.templates.is_empty() {
        return Err(invalid("templates", "at least one template is needed"));
    }
    let egress = validate_egress(raw.egress)?;
    let mut templates = BTreeMap::new();
    for (name, t) in raw.templates {
        let tpl = validate_template(&name, t, &docker.runtime, &egress)?;
        templates.insert(name, tpl);
    }

    let telemetry = TelemetryConfig {
        metrics_listen: match raw.telemetry.metrics_listen.as_deref().unwrap_or(DEFAULT_METRICS_LISTEN) {
            "off" => None,
            a => Some(parse_addr("telemetry.metrics_listen", a)?),
        },
        otlp_endpoint: std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .or(raw.telemetry.otlp_endpoint)
            .filter(|e| !e.is_empty()),
    };
    let log = LogConfig {
        format: match raw.log.format.as_deref().unwrap_or("text") {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => return Err(invalid("log.format", format!("{other:?} is not \"text\" or \"json\""))),
        },
    };
    let quotas = validate_quotas(raw.quotas, &gateway)?;
    let images = validate_images(raw.images, &templates)?;
    let config =
        Config { node, redis, docker, gateway, pool_manager, auth, telemetry, log, quotas, egress, images, templates };
    refuse_public_dev_secrets(&config)?;
    Ok(config)
}

/// A pull from a registry on this machine takes seconds; 10 minutes is a large image from afar.
pub const DEFAULT_PULL_TIMEOUT: Duration = Duration::from_secs(600);
/// Pulls a node runs at once: each is network and disk bound, and a burst of new images should
/// not starve the creates of images already present.
pub const DEFAULT_MAX_PULLS_IN_FLIGHT: usize = 4;
/// A node's image disk: 20 GiB holds ~100 typical task images (SWE-style, 100-300 MB each).
pub const DEFAULT_IMAGE_DISK_BUDGET_MB: u64 = 20 << 10;

fn validate_images(raw: RawImages, templates: &BTreeMap<String, Template>) -> Result<ImagesConfig, ConfigError> {
    let base = match raw.base {
        Some(b) if templates.contains_key(&b) => b,
        Some(b) => return Err(invalid("images.base", format!("no template named {b:?}"))),
        None if templates.contains_key("busybox") => "busybox".to_string(),
        None => templates.keys().next().cloned().unwrap_or_default(),
    };
    let bases = raw.bases.unwrap_or_else(|| vec![base.clone()]);
    if let Some(b) = bases.iter().find(|b| !templates.contains_key(*b)) {
        return Err(invalid("images.bases", format!("no template named {b:?}")));
    }
    let max_pulls_in_flight = raw.max_pulls_in_flight.unwrap_or(DEFAULT_MAX_PULLS_IN_FLIGHT);
    if !(1..=64).contains(&max_pulls_in_flight) {
        return Err(invalid("images.max_pulls_in_flight", "must be 1..=64"));
    }
    let pull_timeout = raw.pull_timeout.unwrap_or(DEFAULT_PULL_TIMEOUT);
    if pull_timeout < Duration::from_secs(1) {
        return Err(invalid("images.pull_timeout", "must be at least 1s"));
    }
    for host in raw.registries.keys() {
        if host.is_empty() || host.contains('/') {
            return Err(invalid(format!("images.registries.{host}"), "must be a registry host[:port]"));
        }
    }
    let allowed_registries = registries::patterns("images.allowed_registries", &raw.allowed_registries)?;
    let scopes = registries::scopes(raw.scopes)?;
    Ok(ImagesConfig {
        base,
        bases,
        max_pulls_in_flight,
        pull_timeout,
        disk_budget_mb: raw.disk_budget_mb.unwrap_or(DEFAULT_IMAGE_DISK_BUDGET_MB),
        registries: raw.registries,
        allowed_registries,
        scopes,
    })
}

fn validate_quotas(raw: RawQuotas, gateway: &GatewayConfig) -> Result<QuotasConfig, ConfigError> {
    let mut default = raw.default;
    if let Some(p) = default.problem() {
        return Err(invalid("quotas.default", p));
    }
    default.queued = default.queued.or(Some((gateway.max_queue as u64 / 4).max(1)));
    default.private_templates = default.private_templates.or(Some(DEFAULT_PRIVATE_TEMPLATES));
    default.functions = default.functions.or(Some(DEFAULT_FUNCTIONS));
    // A fair share of every gateway's slots, as `queued` is of the queues: one tenant that
    // holds its share leaves the rest to the others.
    let async_share = (gateway.max_async_in_flight as u64 / 4).max(1);
    default.async_in_flight = default.async_in_flight.or(Some(DEFAULT_ASYNC_IN_FLIGHT.min(async_share)));
    default.async_results = default.async_results.or(Some(DEFAULT_ASYNC_RESULTS));
    default.async_result_mb = default.async_result_mb.or(Some(DEFAULT_ASYNC_RESULT_MB));
    default.reservations = default.reservations.or(Some(DEFAULT_RESERVATIONS));
    default.reservation_items = default.reservation_items.or(Some(DEFAULT_RESERVATION_ITEMS));
    if let Some(r) = raw.call_rate
        && !(r.is_finite() && r > 0.0 && r <= 1e6)
    {
        return Err(invalid("quotas.call_rate", "must be in (0, 1000000] calls per second"));
    }
    let call_burst = raw.call_burst.unwrap_or_else(|| raw.call_rate.map_or(1, |r| r.ceil() as u64)).max(1);
    Ok(QuotasConfig { enabled: raw.enabled.unwrap_or(true), default, call_rate: raw.call_rate, call_burst })
}

/// The shipped development secrets are fine for a laptop and fatal on a network: refuse them
/// when any listener is not on loopback, naming the listener and the fix.
fn refuse_public_dev_secrets(c: &Config) -> Result<(), ConfigError> {
    let mut listeners = vec![("gateway.listen", c.gateway.listen), ("pool_manager.listen", c.pool_manager.listen)];
    listeners.extend(c.telemetry.metrics_listen.map(|a| ("telemetry.metrics_listen", a)));
    let Some((name, addr)) = listeners.into_iter().find(|(_, a)| !a.ip().is_loopback()) else { return Ok(()) };
    let why = |what: &str, var: &str| {
        format!(
            "is the shipped development {what}, and {name} = {addr} is not on loopback: anyone could use it. \
             Set {var} to a fresh secret (for example `openssl rand -hex 32`), or listen on 127.0.0.1 only"
        )
    };
    if c.auth.algorithm.is_symmetric() && c.auth.key == DEV_JWT_KEY.as_bytes() {
        return Err(invalid("auth.key", why("JWT key", "SANDPOOL_JWT_KEY")));
    }
    if c.pool_manager.secret == DEV_INTERNAL_SECRET {
        return Err(invalid("pool_manager.secret", why("internal secret", "SANDPOOL_INTERNAL_SECRET")));
    }
    Ok(())
}

fn validate_auth(raw: RawAuth, o: &Overrides) -> Result<AuthConfig, ConfigError> {
    let alg = pick(&o.jwt_algorithm, raw.algorithm, "HS256");
    let algorithm = match alg.as_str() {
        "HS256" => JwtAlgorithm::HS256,
        "HS384" => JwtAlgorithm::HS384,
        "HS512" => JwtAlgorithm::HS512,
        "RS256" => JwtAlgorithm::RS256,
        "ES256" => JwtAlgorithm::ES256,
        "EdDSA" => JwtAlgorithm::EdDSA,
        other => {
            return Err(invalid(
                "auth.algorithm",
                format!("{other:?} is not one of HS256, HS384, HS512, RS256, ES256, EdDSA"),
            ));
        }
    };
    let key = match (o.jwt_key.clone().or(raw.key), raw.key_file) {
        (Some(k), _) => k.into_bytes(),
        (None, Some(path)) => {
            std::fs::read(&path).map_err(|e| invalid("auth.key_file", format!("read {}: {e}", path.display())))?
        }
        (None, None) => return Err(invalid("auth.key", "a key (or auth.key_file, or SANDPOOL_JWT_KEY) is required")),
    };
    if algorithm.is_symmetric() && key.len() < 16 {
        return Err(invalid("auth.key", "an HMAC secret must be at least 16 bytes"));
    }
    let private_key = match raw.private_key_file {
        Some(path) => Some(
            std::fs::read(&path)
                .map_err(|e| invalid("auth.private_key_file", format!("read {}: {e}", path.display())))?,
        ),
        None => None,
    };
    if raw.max_token_lifetime.is_some_and(|d| d.is_zero()) {
        return Err(invalid("auth.max_token_lifetime", "must be more than 0"));
    }
    let jwks = match raw.jwks.filter(|j| !j.is_empty()) {
        Some(u) if u.starts_with("https://") || u.starts_with("http://") => Some(JwksSource::Url(u)),
        Some(u) if u.contains("://") => return Err(invalid("auth.jwks", "a file path or an http(s):// URL")),
        Some(path) => Some(JwksSource::File(PathBuf::from(path))),
        None => None,
    };
    let jwks_refresh = raw.jwks_refresh.unwrap_or(DEFAULT_JWKS_REFRESH);
    if jwks_refresh < Duration::from_secs(1) {
        return Err(invalid("auth.jwks_refresh", "must be at least 1s"));
    }
    Ok(AuthConfig {
        algorithm,
        key,
        private_key,
        issuer: raw.issuer,
        audience: raw.audience,
        max_token_lifetime: raw.max_token_lifetime,
        jwks,
        jwks_refresh,
    })
}

fn validate_egress(raw: RawEgress) -> Result<EgressConfig, ConfigError> {
    use std::sync::Arc;
    let mut policies = BTreeMap::new();
    policies.insert(egress::DENY_ALL.to_string(), Arc::new(egress::Policy::new(egress::DENY_ALL, &[]).expect("empty")));
    for (name, p) in raw.policies {
        let field = format!("egress.policies.{name}");
        if !egress::is_policy_name(&name) {
            return Err(invalid(&field, "policy names are 1-64 characters of a-z, 0-9, '-' and '_'"));
        }
        if name == egress::DENY_ALL {
            return Err(invalid(&field, "deny-all is built in (it allows nothing)"));
        }
        let policy = egress::Policy::new(&name, &p.allow).map_err(|e| invalid(format!("{field}.allow"), e))?;
        policies.insert(name, Arc::new(policy));
    }
    let mut hosts = BTreeMap::new();
    for (name, ip) in raw.hosts {
        let field = format!("egress.hosts.{name}");
        let rule = egress::Rule::parse(&name).map_err(|e| invalid(&field, e))?;
        if !rule.names(&name.to_ascii_lowercase()) || name.contains(['*', ':']) {
            return Err(invalid(&field, "must be a host name"));
        }
        let ip = ip.parse().map_err(|_| invalid(&field, format!("{ip:?} is not an IPv4 address")))?;
        hosts.insert(name.to_ascii_lowercase(), ip);
    }
    Ok(EgressConfig { policies, hosts })
}

/// A template's network and named egress: `egress` implies `network = "egress"`, which needs it.
fn template_egress(
    name: &str,
    network: Option<Network>,
    initial: Option<String>,
    allowed: Option<Vec<String>>,
    egress: &EgressConfig,
) -> Result<(Network, Option<TemplateEgress>), ConfigError> {
    let f = |field: &str| format!("templates.{name}.{field}");
    let Some(initial) = initial else {
        if network == Some(Network::Egress) {
            return Err(invalid(f("egress"), "network = \"egress\" needs the policy sessions start under"));
        }
        if allowed.is_some() {
            return Err(invalid(f("egress_allowed"), "needs egress (the initial policy)"));
        }
        return Ok((network.unwrap_or_default(), None));
    };
    if network.is_some_and(|n| n != Network::Egress) {
        return Err(invalid(f("network"), "must be \"egress\" (or absent) with named egress"));
    }
    let allowed = allowed.unwrap_or_else(|| {
        let mut a = vec![initial.clone()];
        if initial != egress::DENY_ALL {
            a.push(egress::DENY_ALL.to_string());
        }
        a
    });
    // The initial policy must exist now (every sandbox starts under it); the others may be
    // defined later through the admin API (a switch to one not defined yet answers 409).
    if egress.policy(&initial).is_none() {
        return Err(invalid(f("egress"), format!("no policy named {initial:?} in [egress.policies]")));
    }
    if let Some(bad) = allowed.iter().find(|p| !egress::is_policy_name(p)) {
        return Err(invalid(f("egress_allowed"), format!("{bad:?} is not a policy name")));
    }
    if !allowed.contains(&initial) {
        return Err(invalid(f("egress_allowed"), format!("must include the initial policy {initial:?}")));
    }
    Ok((Network::Egress, Some(TemplateEgress { initial, allowed })))
}

fn validate_template(
    name: &str,
    t: RawTemplate,
    default_runtime: &str,
    egress: &EgressConfig,
) -> Result<Template, ConfigError> {
    let (network, template_egress) = template_egress(name, t.network, t.egress, t.egress_allowed, egress)?;
    let f = |field: &str| format!("templates.{name}.{field}");
    if !is_name(name, 64) {
        return Err(invalid(format!("templates.{name}"), "name must be 1-64 characters of a-z, 0-9, '-' and '_'"));
    }
    let image = t.image.ok_or_else(|| invalid(f("image"), "is required"))?;
    let cpus = t.cpus.unwrap_or(1.0);
    let memory_mb = t.memory_mb.unwrap_or(512);
    let disk_mb = t.disk_mb.unwrap_or(DEFAULT_DISK_MB);
    let pids = t.pids.unwrap_or(512);
    Template::check_limits(cpus, memory_mb, disk_mb, pids).map_err(|(field, m)| invalid(f(field), m))?;
    let cpu_period = t.cpu_period.unwrap_or(DEFAULT_CPU_PERIOD);
    Template::check_cpu_period(cpu_period).map_err(|(field, m)| invalid(f(field), m))?;
    let workdir = t.workdir.unwrap_or_else(|| "/".into());
    if let Some(p) = agent_proto::layout::workdir_problem(&workdir) {
        return Err(invalid(f("workdir"), p));
    }
    let user = match t.user.as_deref() {
        None => User::DEFAULT,
        Some(u) => User::parse(u).ok_or_else(|| {
            invalid(f("user"), "must be \"root\", a uid or uid:gid (numbers: the image's user names are not read)")
        })?,
    };
    if matches!(user, User::Id { uid, gid } if uid == SEALED_UID || gid == SEALED_UID) {
        return Err(invalid(f("user"), format!("{SEALED_UID} is the node's own (sealed directories)")));
    }
    let max_download_mb = t.max_download_mb.unwrap_or(1024);
    if !(1..=1 << 20).contains(&max_download_mb) {
        return Err(invalid(f("max_download_mb"), "must be 1 ..= 1048576"));
    }
    let ports = validate_ports(t.ports.unwrap_or_default()).map_err(|m| invalid(f("ports"), m))?;
    let warm = t.warm.unwrap_or(0);
    if warm > 10_000 {
        return Err(invalid(f("warm"), "must be at most 10000"));
    }
    let idle_timeout = t.idle_timeout.unwrap_or(Duration::from_secs(600));
    let max_lifetime = t.max_lifetime.unwrap_or(Duration::from_secs(4 * 3600));
    if idle_timeout < Duration::from_secs(1) {
        return Err(invalid(f("idle_timeout"), "must be at least 1s"));
    }
    if max_lifetime < idle_timeout.min(Duration::from_secs(1)) || max_lifetime < Duration::from_secs(1) {
        return Err(invalid(f("max_lifetime"), "must be at least 1s"));
    }
    for k in t.env.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(invalid(f(&format!("env.{k}")), "is not a valid variable name"));
        }
    }
    Ok(Template {
        name: name.to_string(),
        image,
        exec: t.exec.unwrap_or_default(),
        runtime: t.runtime.unwrap_or_else(|| default_runtime.to_string()),
        network,
        egress: template_egress,
        cpus,
        cpu_period,
        memory_mb,
        disk_mb,
        pids,
        env: t.env,
        workdir,
        user,
        max_download_mb,
        ports,
        warm,
        idle_timeout,
        max_lifetime,
    })
}

/// Most ports one template exposes: a handful of services per sandbox is the use.
pub const MAX_TEMPLATE_PORTS: usize = 32;

/// A template's exposed ports, sorted: each 1 ..= 65535, no duplicates, at most
/// `MAX_TEMPLATE_PORTS`.
pub fn validate_ports(mut ports: Vec<u16>) -> Result<Vec<u16>, String> {
    if ports.contains(&0) {
        return Err("port 0 is not a port (1 ..= 65535)".into());
    }
    if ports.len() > MAX_TEMPLATE_PORTS {
        return Err(format!("at most {MAX_TEMPLATE_PORTS} ports"));
    }
    ports.sort_unstable();
    if let Some(w) = ports.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("port {} is listed twice", w[0]));
    }
    Ok(ports)
}

/// The user a template's tenant code runs as: an unprivileged uid by default; `root` only
/// when the template says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum User {
    Root,
    Id { uid: u32, gid: u32 },
}

/// A uid (and gid) no template may run as: the owner of the node's sealed per-sandbox
/// directories, which no sandbox process may own.
pub const SEALED_UID: u32 = 0xFFFF_FFFE;

impl User {
    pub const DEFAULT: User = User::Id { uid: 1000, gid: 1000 };

    /// `root`, `0`, `uid` (its gid the same) or `uid:gid`.
    pub fn parse(s: &str) -> Option<User> {
        let (uid, gid) = match s.split_once(':') {
            _ if s == "root" => return Some(User::Root),
            Some((u, g)) => (u.parse().ok()?, g.parse().ok()?),
            None => {
                let u = s.parse().ok()?;
                (u, u)
            }
        };
        Some(if uid == 0 && gid == 0 { User::Root } else { User::Id { uid, gid } })
    }

    /// As Docker and the agent take it: `uid:gid`, or `root`.
    pub fn spec(&self) -> String {
        match self {
            User::Root => "root".into(),
            User::Id { uid, gid } => format!("{uid}:{gid}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = r#"
[pool_manager]
secret = "0123456789abcdef"
[auth]
key = "0123456789abcdef"
[templates.busybox]
image = "sandpool/busybox:latest"
"#;

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
        assert_eq!(c.node.id, None, "derived at start from the host");
        assert_eq!(c.node.down_after, DEFAULT_NODE_DOWN_AFTER);
        assert_eq!(c.gateway.placement_choices, 2);
        assert_eq!(c.gateway.listen.to_string(), DEFAULT_GATEWAY_LISTEN);
        assert_eq!(c.templates["busybox"].network, Network::None);
        assert_eq!(c.templates["busybox"].exec, ExecMode::Agent);
    }

    fn env(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn any_key_is_settable_from_the_environment_and_flags_win() {
        let vars = env(&[
            ("SANDPOOL__TELEMETRY__METRICS_LISTEN", "127.0.0.1:9465"),
            ("SANDPOOL__POOL_MANAGER__LISTEN", "127.0.0.1:8091"),
            ("SANDPOOL__POOL_MANAGER__STATE_DIR", "/var/lib/sandpool-2"),
            ("SANDPOOL__NODE__ID", "second"),
            ("SANDPOOL__NODE__DOWN_AFTER", "20s"),
            ("SANDPOOL__GATEWAY__MAX_QUEUE", "100"),
            ("SANDPOOL__QUOTAS__DEFAULT__SESSIONS", "7"),
            ("SANDPOOL__TEMPLATES__BUSYBOX__WARM", "9"),
            ("SANDPOOL__TEMPLATES__EXTRA__IMAGE", "sandpool/bash:latest"),
            ("SANDPOOL__LOG__FORMAT", "json"),
            ("SANDPOOL__REDIS__PREFIX", "from-env"),
        ]);
        let flags = Overrides { redis_prefix: Some("from-flag".into()), ..Overrides::default() };
        let c = Config::from_toml_with_env(MIN, &flags, vars).unwrap();
        assert_eq!(c.telemetry.metrics_listen.map(|a| a.to_string()).as_deref(), Some("127.0.0.1:9465"));
        assert_eq!(c.pool_manager.listen.to_string(), "127.0.0.1:8091");
        assert_eq!(c.pool_manager.advertise, "http://127.0.0.1:8091", "the advertised address follows");
        assert_eq!(c.pool_manager.state_dir, PathBuf::from("/var/lib/sandpool-2"));
        assert_eq!(c.node.id.as_deref(), Some("second"));
        assert_eq!(c.node.down_after, Duration::from_secs(20));
        assert_eq!(c.gateway.max_queue, 100);
        assert_eq!(c.quotas.default.sessions, Some(7));
        assert_eq!(c.templates["busybox"].warm, 9);
        assert_eq!(c.templates["extra"].image, "sandpool/bash:latest", "a whole new template");
        assert_eq!(c.log.format, LogFormat::Json);
        assert_eq!(c.redis.prefix, "from-flag", "a flag (or SANDPOOL_REDIS_PREFIX) wins over the layer");
        // Without the variables, the file as it is.
        let plain = Config::from_toml_with_env(MIN, &Overrides::default(), env(&[])).unwrap();
        assert_eq!(plain.log.format, LogFormat::Text);
        assert_eq!(plain.pool_manager.listen.to_string(), DEFAULT_POOL_MANAGER_LISTEN);
    }

    #[test]
    fn a_bad_value_from_the_environment_names_its_field_and_variable() {
        let bad = |k: &str, v: &str| {
            Config::from_toml_with_env(MIN, &Overrides::default(), env(&[(k, v)])).unwrap_err().to_string()
        };
        let e = bad("SANDPOOL__GATEWAY__MAX_QUEUE", "many");
        assert!(e.contains("max_queue") && e.contains("SANDPOOL__GATEWAY__MAX_QUEUE"), "{e}");
        let e = bad("SANDPOOL__GATEWAY__NO_SUCH_KEY", "1");
        assert!(e.contains("no_such_key") && e.contains("SANDPOOL__GATEWAY__NO_SUCH_KEY"), "{e}");
        let e = bad("SANDPOOL__TELEMETRY__METRICS_LISTEN", "nowhere");
        assert!(e.contains("telemetry.metrics_listen"), "{e}");
        let e = bad("SANDPOOL__LOG__FORMAT", "xml");
        assert!(e.contains("log.format"), "{e}");
    }

    #[test]
    fn a_jwks_is_a_file_or_an_http_url() {
        let with =
            |v: &str| Config::from_toml_with_env(MIN, &Overrides::default(), env(&[("SANDPOOL__AUTH__JWKS", v)]));
        let c = with("https://idp.example/.well-known/jwks.json").unwrap();
        assert_eq!(c.auth.jwks, Some(JwksSource::Url("https://idp.example/.well-known/jwks.json".into())));
        assert_eq!(c.auth.jwks_refresh, DEFAULT_JWKS_REFRESH);
        assert_eq!(
            with("/etc/sandpool/jwks.json").unwrap().auth.jwks,
            Some(JwksSource::File("/etc/sandpool/jwks.json".into()))
        );
        assert!(with("ftp://idp.example/jwks").unwrap_err().to_string().contains("auth.jwks"));
        assert_eq!(Config::from_toml(MIN, &Overrides::default()).unwrap().auth.jwks, None);
    }

    #[test]
    fn redacted_config_shows_no_secret() {
        let text = format!(
            "{MIN}\n[images.registries.\"r.example\"]\nusername = \"u\"\npassword = \"registry-pass-1\"\n\
             [images.scopes.acme.registries.\"s.example\"]\nusername = \"u\"\npassword = \"scope-pass-2\"\n"
        );
        let c = Config::from_toml(&text, &Overrides::default()).unwrap();
        let shown = format!("{:#?}", c.redacted());
        for secret in ["0123456789abcdef", "registry-pass-1", "scope-pass-2"] {
            assert!(!shown.contains(secret), "{secret} shows in {shown}");
        }
        assert!(shown.contains(HIDDEN) && shown.contains("busybox") && shown.contains("max_queue"), "{shown}");
        assert_eq!(c.pool_manager.secret, "0123456789abcdef", "the config itself keeps its secret");
    }

    #[test]
    fn named_egress_is_checked_against_the_policies() {
        let cfg = |tpl: &str| {
            let text = format!(
                "{MIN}\n[egress.policies.mirror]\nallow = [\"deb.debian.org:80\", \"10.0.0.0/8\"]\n[egress.hosts]\n\"task.test\" = \"127.0.0.2\"\n[templates.e]\nimage = \"x\"\n{tpl}\n"
            );
            Config::from_toml(&text, &Overrides::default()).map_err(|e| e.to_string())
        };
        let c = cfg("egress = \"mirror\"").unwrap();
        let e = c.templates["e"].egress.clone().unwrap();
        assert_eq!((c.templates["e"].network, e.initial.as_str()), (Network::Egress, "mirror"));
        assert_eq!(e.allowed, ["mirror", "deny-all"], "deny-all is always there to switch to");
        // A policy the admin API will define may be named ahead.
        let later = cfg("egress = \"mirror\"\negress_allowed = [\"mirror\", \"by-api\"]").unwrap();
        assert_eq!(later.templates["e"].egress.clone().unwrap().allowed, ["mirror", "by-api"]);
        assert_eq!(c.egress.hosts["task.test"].to_string(), "127.0.0.2");
        assert!(c.egress.policy("deny-all").unwrap().rules.is_empty());
        for (tpl, field) in [
            ("egress = \"nope\"", "templates.e.egress"),
            ("network = \"egress\"", "templates.e.egress"),
            ("network = \"bridge\"\negress = \"mirror\"", "templates.e.network"),
            ("egress = \"mirror\"\negress_allowed = [\"deny-all\"]", "templates.e.egress_allowed"),
            ("egress_allowed = [\"mirror\"]", "templates.e.egress_allowed"),
            ("egress = \"mirror\"\negress_allowed = [\"mirror\", \"Bad Name\"]", "templates.e.egress_allowed"),
        ] {
            let e = cfg(tpl).unwrap_err();
            assert!(e.contains(field), "{tpl}: {e}");
        }
        let bad = format!("{MIN}\n[egress.policies.p]\nallow = [\"10.0.0.0/40\"]\n");
        let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("egress.policies.p.allow"), "{e}");
        let bad = format!("{MIN}\n[egress.policies.deny-all]\nallow = []\n");
        assert!(Config::from_toml(&bad, &Overrides::default()).is_err(), "deny-all is built in");
    }

    #[test]
    fn the_create_window_and_destroys_default_and_are_checked() {
        let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
        let pm = &c.pool_manager;
        assert!(pm.adaptive_create_window);
        assert_eq!(pm.destroys_beside_creates, DEFAULT_DESTROYS_BESIDE_CREATES);
        let set = |line: &str| MIN.replace("[pool_manager]", &format!("[pool_manager]\n{line}"));
        let c = Config::from_toml(
            &set("adaptive_create_window = false\ndestroys_beside_creates = 8"),
            &Overrides::default(),
        )
        .unwrap();
        assert!(!c.pool_manager.adaptive_create_window);
        assert_eq!(c.pool_manager.destroys_beside_creates, 8);
        for bad in ["destroys_beside_creates = 0", "destroys_beside_creates = 9"] {
            let e = Config::from_toml(&set(bad), &Overrides::default()).unwrap_err().to_string();
            assert!(e.contains("pool_manager.destroys_beside_creates"), "{bad}: {e}");
        }
    }

    #[test]
    fn overrides_win() {
        let o = Overrides { redis_url: Some("redis://10.0.0.1:7000".into()), ..Default::default() };
        let c = Config::from_toml(MIN, &o).unwrap();
        assert_eq!(c.redis.url, "redis://10.0.0.1:7000");
    }

    #[test]
    fn redis_url_is_one_redis_or_a_clusters_seeds() {
        let with = |url: &str| Overrides { redis_url: Some(url.into()), ..Default::default() };
        for good in
            ["redis://127.0.0.1:7001,redis://127.0.0.1:7002", "redis://a:7001, redis://b:7002", "redis://a:7001,"]
        {
            assert!(Config::from_toml(MIN, &with(good)).is_ok(), "{good}");
        }
        for bad in ["redis://a:7001,unix:///tmp/r.sock", "redis://a:7001,b:7002", ",", "http://a"] {
            let e = Config::from_toml(MIN, &with(bad)).unwrap_err().to_string();
            assert!(e.contains("redis.url"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_cpu_period_defaults_short_is_checked_and_held_to_the_envelope() {
        let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
        let base = &c.templates["busybox"];
        assert_eq!(base.cpu_period, DEFAULT_CPU_PERIOD);
        assert_eq!(base.info().cpu_period_ms, 10);
        let set = |v: &str| MIN.replace("[templates.busybox]", &format!("[templates.busybox]\ncpu_period = \"{v}\""));
        assert_eq!(
            Config::from_toml(&set("25ms"), &Overrides::default()).unwrap().templates["busybox"].cpu_period,
            Duration::from_millis(25)
        );
        for bad in ["0ms", "1500us", "2s"] {
            let e = Config::from_toml(&set(bad), &Overrides::default()).unwrap_err().to_string();
            assert!(e.contains("templates.busybox.cpu_period"), "{bad}: {e}");
        }

        // Quota = cpus x period, the period lengthened where the quota would be under 1 ms.
        let with = |cpus: f64, ms: u64| Template { cpus, cpu_period: Duration::from_millis(ms), ..base.clone() };
        assert_eq!(with(0.5, 10).cfs_period_and_quota_us(), (10_000, 5_000));
        assert_eq!(with(2.0, 100).cfs_period_and_quota_us(), (100_000, 200_000));
        assert_eq!(with(0.05, 10).cfs_period_and_quota_us(), (20_000, 1_000));
        assert_eq!(with(0.0001, 10).cfs_period_and_quota_us(), (1_000_000, 1_000));

        // A tenant may ask for a longer period than the base's, not a shorter one.
        let req = |ms: u64| wire::images::CreateTemplate { cpu_period_ms: Some(ms), ..Default::default() };
        assert_eq!(envelope::grant(base, &req(50), false).unwrap().cpu_period, Duration::from_millis(50));
        assert_eq!(envelope::grant(base, &req(5), false).unwrap_err().field, "cpu_period_ms");
        assert_eq!(envelope::grant(base, &req(5), true).unwrap().cpu_period, Duration::from_millis(5));
        assert_eq!(envelope::grant(base, &req(0), true).unwrap_err().field, "cpu_period");
        let inherited = envelope::grant(base, &wire::images::CreateTemplate::default(), false).unwrap();
        assert_eq!(inherited.cpu_period, base.cpu_period);
    }

    #[test]
    fn errors_name_the_field() {
        let bad = MIN.replace("[templates.busybox]", "[templates.busybox]\ncpus = -1");
        let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("templates.busybox.cpus"), "{e}");
        let bad = format!("{MIN}\n[gateway]\nlisten = \"nope\"\n");
        let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("gateway.listen"), "{e}");
        let bad = format!("{MIN}\n[gateway]\nlisten_typo = 1\n");
        let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("listen_typo"), "{e}");
    }

    #[test]
    fn template_ports_are_sorted_and_checked() {
        let ok = MIN.replace("[templates.busybox]", "[templates.busybox]\nports = [8080, 80]");
        let c = Config::from_toml(&ok, &Overrides::default()).unwrap();
        assert_eq!(c.templates["busybox"].ports, [80, 8080]);
        assert_eq!(c.templates["busybox"].info().ports, [80, 8080]);
        for (ports, why) in [("[80, 80]", "listed twice"), ("[0]", "port 0"), ("[70000]", "70000")] {
            let bad = MIN.replace("[templates.busybox]", &format!("[templates.busybox]\nports = {ports}"));
            let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("ports"), "{ports}: {e}");
        }
        let many: Vec<String> = (1..=33).map(|p| p.to_string()).collect();
        let bad = MIN.replace("[templates.busybox]", &format!("[templates.busybox]\nports = [{}]", many.join(",")));
        let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("templates.busybox.ports") && e.contains("at most 32"), "{e}");
        let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
        assert!(c.templates["busybox"].ports.is_empty(), "no port is exposed unless listed");
        assert_eq!(c.pool_manager.max_port_connections, DEFAULT_MAX_PORT_CONNECTIONS);
        let bad = MIN.replace("[pool_manager]", "[pool_manager]\nmax_port_connections = 0");
        let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("pool_manager.max_port_connections"), "{e}");
    }

    #[test]
    fn the_shipped_dev_secrets_stay_on_loopback() {
        let text = include_str!("../sandpool.toml");
        let public = Overrides { gateway_listen: Some("0.0.0.0:8080".into()), ..Default::default() };
        let e = Config::from_toml(text, &public).unwrap_err().to_string();
        assert!(e.contains("auth.key") && e.contains("0.0.0.0:8080") && e.contains("SANDPOOL_JWT_KEY"), "{e}");
        let fresh_key = Overrides { jwt_key: Some("a-fresh-key-0123456789".into()), ..public.clone() };
        let e = Config::from_toml(text, &fresh_key).unwrap_err().to_string();
        assert!(e.contains("pool_manager.secret") && e.contains("SANDPOOL_INTERNAL_SECRET"), "{e}");
        let both = Overrides { internal_secret: Some("a-fresh-secret-0123456789".into()), ..fresh_key };
        Config::from_toml(text, &both).unwrap();
        // The shipped values match the constants the check compares with.
        assert!(text.contains(DEV_JWT_KEY) && text.contains(DEV_INTERNAL_SECRET));
    }

    #[test]
    fn images_default_and_validate() {
        let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
        assert_eq!(c.images.base, "busybox");
        assert_eq!((c.images.max_pulls_in_flight, c.images.disk_budget_mb), (4, 20 << 10));
        assert_eq!(c.images.pull_timeout, DEFAULT_PULL_TIMEOUT);
        let with = |extra: &str| Config::from_toml(&format!("{MIN}\n[images]\n{extra}\n"), &Overrides::default());
        let e = with("base = \"nope\"").unwrap_err().to_string();
        assert!(e.contains("images.base") && e.contains("nope"), "{e}");
        assert_eq!(c.images.bases, ["busybox"], "only the default base unless the operator names more");
        let e = with("bases = [\"busybox\", \"nope\"]").unwrap_err().to_string();
        assert!(e.contains("images.bases") && e.contains("nope"), "{e}");
        assert!(with("max_pulls_in_flight = 0").unwrap_err().to_string().contains("images.max_pulls_in_flight"));
        assert!(with("pull_timeout = \"0s\"").unwrap_err().to_string().contains("images.pull_timeout"));
        let c =
            with("disk_budget_mb = 0\n[images.registries.\"reg.example:5000\"]\nusername = \"u\"\npassword = \"p\"")
                .unwrap();
        assert_eq!(c.images.disk_budget_mb, 0);
        assert_eq!(c.images.auth_for("reg.example:5000/a/b:1", None).map(|a| a.username.as_str()), Some("u"));
        assert!(c.images.auth_for("other.example/a/b:1", None).is_none());
        assert!(c.images.allowed_registries.is_empty());
        assert!(c.images.may_name("anyone", "other.example/a/b:1"), "no entry at all: any");
        let e = with("allowed_registries = [\"a/b\"]").unwrap_err().to_string();
        assert!(e.contains("images.allowed_registries") && e.contains("/*"), "{e}");
    }

    #[test]
    fn registry_scopes_choose_entries_and_credentials_per_principal() {
        let toml = format!(
            "{MIN}\n[images]\nallowed_registries = [\"reg:5000/{{tenant}}/*\"]\n\
             [images.registries.\"reg:5000\"]\nusername = \"ops\"\npassword = \"p\"\n\
             [images.scopes.\"acme\"]\nallowed = [\"reg:5000/shared/*\"]\n\
             [images.scopes.\"acme\".registries.\"reg:5000\"]\nusername = \"acme\"\npassword = \"p\"\n\
             [images.scopes.\"acme/rl\".registries.\"reg:5000\"]\nusername = \"acme-rl\"\npassword = \"p\"\n"
        );
        let c = Config::from_toml(&toml, &Overrides::default()).unwrap().images;
        let user = |p: Option<&str>| c.auth_for("reg:5000/x/y:1", p).map(|a| a.username.clone());
        assert_eq!(user(Some("acme/rl/ppo")).as_deref(), Some("acme-rl"), "the most specific scope");
        assert_eq!(user(Some("acme/eval")).as_deref(), Some("acme"));
        assert_eq!(user(Some("acme-2")).as_deref(), Some("ops"), "not on acme's path");
        assert_eq!(user(None).as_deref(), Some("ops"));
        assert!(c.may_name("acme/rl", "reg:5000/acme/task:1") && c.may_name("acme/rl", "reg:5000/shared/t:1"));
        assert!(!c.may_name("other", "reg:5000/acme/task:1") && !c.may_name("other", "reg:5000/shared/t:1"));
        assert!(!c.may_name("acme", "elsewhere:5000/acme/task:1"));
        for bad in
            ["[images.scopes.\"public\"]", "[images.scopes.\"a//b\"]", "[images.scopes.\"a\"]\nallowed = [\"r/x\"]"]
        {
            let e = Config::from_toml(&format!("{MIN}\n{bad}\n"), &Overrides::default()).unwrap_err().to_string();
            assert!(e.contains("images.scopes"), "{bad}: {e}");
        }
    }

    #[test]
    fn disk_bounds_default_and_validate() {
        let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
        assert_eq!(c.templates["busybox"].disk_mb, DEFAULT_DISK_MB);
        assert_eq!(c.docker.disk_bounds, DiskBounds::BestEffort);
        let t = |line: &str| MIN.replace("[templates.busybox]", &format!("[templates.busybox]\n{line}"));
        let c = Config::from_toml(&t("disk_mb = 0"), &Overrides::default()).unwrap();
        assert_eq!(c.templates["busybox"].disk_mb, 0, "0 asks for no bound");
        for bad in ["disk_mb = 8", "disk_mb = 99999999"] {
            let e = Config::from_toml(&t(bad), &Overrides::default()).unwrap_err().to_string();
            assert!(e.contains("templates.busybox.disk_mb"), "{e}");
        }
        let c = Config::from_toml(&format!("{MIN}\n[docker]\ndisk_bounds = \"required\"\n"), &Overrides::default());
        assert_eq!(c.unwrap().docker.disk_bounds, DiskBounds::Required);
        let e = Config::from_toml(&format!("{MIN}\n[docker]\ndisk_bounds = \"yes\"\n"), &Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("docker.disk_bounds"), "{e}");
    }

    #[test]
    fn shipped_config_is_valid() {
        let text = include_str!("../sandpool.toml");
        Config::from_toml(text, &Overrides::default()).unwrap();
    }
}

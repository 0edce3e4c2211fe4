//! `[pool_manager]`: a node's listener, internal secret, create and destroy pacing, and the
//! limits of what one sandbox's calls may carry.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use crate::{ConfigError, Overrides, invalid, parse_addr, pick};

/// The node's internal API, on loopback by default.
pub const DEFAULT_POOL_MANAGER_LISTEN: &str = "127.0.0.1:8081";

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

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawPoolManager {
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

/// `[pool_manager]`, validated.
#[derive(Debug, Clone)]
pub struct PoolManagerConfig {
    /// Where the node's internal API listens.
    pub listen: SocketAddr,
    /// The URL gateways reach this node at (default `http://` + `listen`).
    pub advertise: String,
    /// The secret gateways and nodes share for internal calls (at least 16 characters).
    pub secret: String,
    /// Where the node keeps its state (per-sandbox directories, the agent binary).
    pub state_dir: PathBuf,
    /// The cap of the create window (and the window itself when it does not adapt).
    pub max_creates_in_flight: usize,
    /// Whether the create window adapts to Docker's latency (`pace::Window`); default true.
    pub adaptive_create_window: bool,
    /// Destroys the node keeps in flight while creates run (at most `MAX_DESTROYS_IN_FLIGHT`,
    /// which it keeps while none does); default 2.
    pub destroys_beside_creates: usize,
    /// Creates per second the node starts at most (its token bucket).
    pub create_rate: f64,
    /// Sandboxes the node holds at most.
    pub max_sandboxes: u64,
    /// Threads the node's budget counts the machine as having, if below the kernel's limits
    /// (a machine shared with other work, or a test of the budget).
    pub max_threads: Option<u64>,
    /// Memory offered to sandboxes, as a multiple of the node's physical memory.
    pub memory_overcommit: f64,
    /// Output cap per stream of one exec, bytes.
    pub max_output_bytes: u64,
    /// Open port connections per sandbox; one more answers 429.
    pub max_port_connections: u32,
    /// Bytes one port connection carries (both ways) before the node closes it.
    pub max_port_bytes: u64,
}

/// `[pool_manager]`, with the listen, advertise and secret overrides.
pub(crate) fn validate_pool_manager(pm: RawPoolManager, o: &Overrides) -> Result<PoolManagerConfig, ConfigError> {
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
    Ok(PoolManagerConfig {
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
    })
}

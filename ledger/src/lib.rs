//! The Redis ledger: the one crate that knows sandpool's key layout (`keys`) and Lua scripts
//! (`script`, `lua/*.lua`). Everything else calls typed methods on [`Ledger`].
//!
//! The methods are split by topic: `sessions` (checkout, lookup, release, pause, reaping),
//! `queue` (waiting for a sandbox: mail, dequeue, template health), `sandboxes` (the node's
//! side: add, ready, remove, doomed, private templates), `pins` (session keys),
//! `signals` (node registry, stats, targets, arrivals, reservations), and `quotas` (principals'
//! limits, admission and leases, in one top-level tenant's hash tag).
//!
//! Rules kept here: every multi-key change is one Lua script that declares its keys, all under
//! one hash tag; every deadline uses Redis `TIME`, never a client clock; every script answers
//! one JSON document decoded into a typed value in one place (`script::Scripts::run`); a Redis
//! error is `LedgerError::Unavailable`, never mistaken for "no capacity".
//!
//! The ledger runs on one Redis or on a Redis Cluster, as `redis.url` says (`conn`): one URL,
//! or a comma-separated list of a cluster's seeds.

mod conn;
mod egress;
mod functions;
mod images;
pub mod keys;
mod lazy_profiles;
mod pins;
mod queue;
mod quota_sweep;
mod quotas;
mod sandboxes;
mod script;
mod sessions;
mod signals;

use std::sync::Arc;
use std::time::Duration;

pub use conn::{RedisConn, Topology};
pub use functions::{Env, EnvCounts, FunctionDef, Take};
pub use keys::Keys;
pub use lazy_profiles::{LAZY_PROFILE_TTL_S, MAX_LAZY_PROFILE_CHUNKS};
pub use pins::PinClaim;
pub use queue::{Checkout, Mail, QueueSpec};
pub use quotas::{
    Admission, Cost, SetBy, SetLimits, async_kept_lease, async_running_lease, function_lease, image_template_lease,
    reservation_lease, session_lease, template_lease,
};
pub use sandboxes::{Ready, SandboxRecord, SandboxState};
pub use script::SCRIPT_NAMES;
pub use sessions::{Access, Ended, Grant, LeaseSpec, Lookup, SessionRecord};
pub use signals::{MAX_RESERVATION_PRUNE, NodeClaim, NodeInfo, NodeLost, NodeState, Reservation};
pub use wire::internal::PrivateTemplate;
pub use wire::{GoneReason, NodeStats, PoolStats};

/// Bounded response time for ordinary commands; a slower Redis is an outage, not an answer.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a ledger call failed.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// Redis could not be reached or answered with an error (never read as "no capacity").
    #[error("redis unavailable: {0}")]
    Unavailable(#[from] redis::RedisError),
    /// What Redis holds (or a script answered) would not decode or encode: a bug, or edited data.
    #[error("ledger data is inconsistent: {0}")]
    Corrupt(String),
}

/// A ledger call's result; the error is [`LedgerError`] unless said otherwise.
pub type Result<T, E = LedgerError> = std::result::Result<T, E>;

/// Handle to the ledger; cheap to clone (one multiplexed, auto-reconnecting connection, and a
/// small pool of connections without a response timeout for blocking commands), on one Redis
/// or a Redis Cluster alike.
#[derive(Clone)]
pub struct Ledger {
    topology: Arc<Topology>,
    conn: RedisConn,
    blocking: conn::Blocking,
    keys: Keys,
    scripts: Arc<script::Scripts>,
    sweep: Arc<quota_sweep::SweepState>,
}

impl Ledger {
    /// Connects to `url`: one Redis, or a comma-separated list of a Redis Cluster's seeds.
    pub async fn connect(url: &str, prefix: &str) -> Result<Ledger> {
        let topology = Topology::of(url);
        let (conn, blocking) = conn::connect(&topology).await?;
        Ok(Ledger {
            topology: Arc::new(topology),
            conn,
            blocking,
            keys: Keys::new(prefix),
            scripts: Arc::new(script::Scripts::new()),
            sweep: Arc::default(),
        })
    }

    /// Whether the ledger lives on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.conn.is_cluster()
    }

    /// The key prefix of this deployment (`redis.prefix`).
    pub fn prefix(&self) -> &str {
        self.keys.prefix()
    }

    /// The key-name builders under this ledger's prefix.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    fn conn(&self) -> RedisConn {
        self.conn.clone()
    }

    /// The ledger's own connection, for tests and tools that send a command of their own
    /// (single Redis or cluster alike: commands are routed by their keys' slot).
    pub fn connection(&self) -> RedisConn {
        self.conn.clone()
    }

    /// Deletes every key under the ledger's prefix, on every master of a cluster; answers how
    /// many. For tests and for wiping a deployment: nothing else may run on the prefix.
    pub async fn delete_all_keys(&self) -> Result<u64> {
        let mut conn = self.conn();
        let keys = conn.scan_keys(&self.keys.all_pattern()).await?;
        let mut deleted = 0;
        // `DEL` of keys in several slots is split per slot by the cluster connection.
        for batch in keys.chunks(500) {
            let n: u64 = redis::cmd("DEL").arg(batch).query_async(&mut conn).await?;
            deleted += n;
        }
        Ok(deleted)
    }

    /// Round trip to Redis (`PING`): whether it answers at all.
    pub async fn ping(&self) -> Result<()> {
        let _: String = redis::cmd("PING").query_async(&mut self.conn()).await?;
        Ok(())
    }

    /// Redis's clock in milliseconds: the one clock every deadline uses.
    pub async fn now_ms(&self) -> Result<u64> {
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut self.conn()).await?;
        Ok(s * 1000 + us / 1000)
    }
}

/// [`Ledger::delete_all_keys`] from code that cannot await (a test's destructor): on a thread
/// of its own with its own runtime, so it works inside a runtime or outside one.
pub fn delete_all_keys_blocking(url: &str, prefix: &str) -> Result<u64> {
    let (url, prefix) = (url.to_string(), prefix.to_string());
    // joined: right below, before this returns.
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| LedgerError::Unavailable(redis::RedisError::from(e)))?;
        rt.block_on(async { Ledger::connect(&url, &prefix).await?.delete_all_keys().await })
    })
    .join()
    .map_err(|_| LedgerError::Corrupt("deleting the keys panicked".into()))?
}

fn corrupt(what: &str, e: impl std::fmt::Display) -> LedgerError {
    LedgerError::Corrupt(format!("{what}: {e}"))
}

fn to_json<T: serde::Serialize>(what: &str, v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| corrupt(what, e))
}

fn from_json<T: serde::de::DeserializeOwned>(what: &str, s: &str) -> Result<T> {
    serde_json::from_str(s).map_err(|e| corrupt(what, e))
}

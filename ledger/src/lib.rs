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

mod egress;
mod functions;
mod images;
pub mod keys;
mod pins;
mod queue;
mod quotas;
mod sandboxes;
mod script;
mod sessions;
mod signals;

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

pub use functions::{Env, EnvCounts, FunctionDef, Take};
pub use keys::Keys;
pub use pins::PinClaim;
pub use queue::{Checkout, Mail, QueueSpec};
pub use quotas::{Admission, Cost, SetLimits, image_template_lease, reservation_lease, session_lease, template_lease};
pub use sandboxes::{Ready, SandboxRecord, SandboxState};
pub use sessions::{Access, Ended, Grant, LeaseSpec, Lookup, SessionRecord};
pub use signals::{NodeClaim, NodeInfo, NodeLost, NodeState, Reservation};
pub use wire::internal::PrivateTemplate;
pub use wire::{GoneReason, NodeStats, PoolStats};

/// Bounded response time for ordinary commands; a slower Redis is an outage, not an answer.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections for blocking commands (`BLPOP` of doomed sandboxes): one per node loop, plus
/// room for tests that run several nodes in one process.
const BLOCKING_POOL_SIZE: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("redis unavailable: {0}")]
    Unavailable(#[from] redis::RedisError),
    #[error("ledger data is inconsistent: {0}")]
    Corrupt(String),
}

pub type Result<T, E = LedgerError> = std::result::Result<T, E>;

/// Handle to the ledger; cheap to clone (one multiplexed, auto-reconnecting connection, and a
/// small pool of connections without a response timeout for blocking commands).
#[derive(Clone)]
pub struct Ledger {
    client: redis::Client,
    conn: ConnectionManager,
    blocking: deadpool_redis::Pool,
    keys: Keys,
    scripts: Arc<script::Scripts>,
}

impl Ledger {
    pub async fn connect(url: &str, prefix: &str) -> Result<Ledger> {
        let client = redis::Client::open(url)?;
        let cfg = ConnectionManagerConfig::new()
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_number_of_retries(2);
        let conn = tokio::time::timeout(CONNECT_TIMEOUT * 2, client.get_connection_manager_with_config(cfg))
            .await
            .map_err(|_| redis::RedisError::from((redis::ErrorKind::Io, "connect timed out")))??;
        // redis-rs gives async connections a 500 ms response timeout by default, which a
        // blocking pop outlasts by design: these connections have none (the pop itself is bounded).
        let blocking_cfg = redis::AsyncConnectionConfig::new()
            .set_response_timeout(None)
            .set_connection_timeout(Some(CONNECT_TIMEOUT));
        let manager = deadpool_redis::Manager::new_with_config(url, blocking_cfg)?;
        let blocking = deadpool_redis::Pool::builder(manager)
            .max_size(BLOCKING_POOL_SIZE)
            .runtime(deadpool_redis::Runtime::Tokio1)
            .wait_timeout(Some(CONNECT_TIMEOUT))
            .create_timeout(Some(CONNECT_TIMEOUT))
            .build()
            .map_err(|e| LedgerError::Corrupt(format!("build the blocking connection pool: {e}")))?;
        Ok(Ledger { client, conn, blocking, keys: Keys::new(prefix), scripts: Arc::new(script::Scripts::new()) })
    }

    pub fn prefix(&self) -> &str {
        self.keys.prefix()
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    fn conn(&self) -> ConnectionManager {
        self.conn.clone()
    }

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

fn corrupt(what: &str, e: impl std::fmt::Display) -> LedgerError {
    LedgerError::Corrupt(format!("{what}: {e}"))
}

fn to_json<T: serde::Serialize>(what: &str, v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| corrupt(what, e))
}

fn from_json<T: serde::de::DeserializeOwned>(what: &str, s: &str) -> Result<T> {
    serde_json::from_str(s).map_err(|e| corrupt(what, e))
}

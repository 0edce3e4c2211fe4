//! The Redis ledger: the one place that knows sandpool's key layout and Lua scripts.
//!
//! Layout (`P` is the configured prefix, `N` a node id; `{N}` is a hash tag, so every key of
//! one node — its pools, sandboxes and sessions — lives in one Redis Cluster slot and the
//! multi-key scripts stay atomic there):
//!
//! ```text
//! P:nodes                  hash  node id -> NodeInfo JSON
//! P:node-seen              hash  node id -> last heartbeat (ms, Redis clock)
//! P:pin:<tenant>:<key>     str   session id pinned by a tenant's session key (or "pending:<sid>")
//! P:{N}:sbs                set   every sandbox the node owns
//! P:{N}:sb:<sandbox>       hash  template, state, container, created_ms, session, fence
//! P:{N}:idle:<template>    list  idle sandboxes of one pool (LPUSH ready, RPOP checkout)
//! P:{N}:fence              str   fencing counter, INCR on every grant
//! P:{N}:ses:<session>      hash  tenant, sandbox, template, fence, created/last/idle/hard ms, labels
//! P:{N}:expiry             zset  session -> deadline (ms)
//! P:{N}:gone:<session>     hash  tombstone of an ended session (tenant, reason, at_ms), 1 h
//! P:{N}:doomed             list  sandboxes to destroy (the node agent BLPOPs it)
//! ```
//!
//! Every deadline uses Redis `TIME`, never a client clock. Errors talking to Redis are
//! `LedgerError::Unavailable`, never mistaken for "no capacity" (`Ok(None)`).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncCommands, Script};
use serde::{Deserialize, Serialize};
use wire::internal::LeaseSpec;

/// Bounded response time for ordinary commands; a slower Redis is an outage, not an answer.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long an idempotency pin may stay "pending" while its session is being created.
const PIN_PENDING_MS: u64 = 60_000;

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("redis unavailable: {0}")]
    Unavailable(#[from] redis::RedisError),
    #[error("ledger data is inconsistent: {0}")]
    Corrupt(String),
}

pub type Result<T, E = LedgerError> = std::result::Result<T, E>;

/// A node as registered in the ledger.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeInfo {
    pub id: String,
    /// Base URL of the node's pool-manager internal API.
    pub addr: String,
    pub started_ms: u64,
}

/// A granted lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub sandbox_id: String,
    pub fence: u64,
    pub now_ms: u64,
}

/// How a request may wait when no sandbox is idle.
#[derive(Debug, Clone, Copy)]
pub struct QueueSpec<'a> {
    /// Unique id of the waiting request.
    pub request_id: &'a str,
    /// Where its gateway listens for the wake-up (`Ledger::wake_channel`).
    pub channel: &'a str,
    /// Queue no further than this many waiters per template and node; 0: do not queue.
    pub max_len: usize,
    /// How long the waiter's record may outlive a crashed gateway.
    pub waiter_ttl_ms: u64,
}

/// Outcome of `checkout_or_queue`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checkout {
    Granted(Grant),
    /// Waiting for the next ready sandbox; `depth` requests wait for this template.
    Queued {
        depth: u64,
    },
    /// No idle sandbox and queueing was not asked for.
    Empty,
    /// The queue is at its maximum length.
    Full {
        depth: u64,
    },
    /// The template's sandboxes fail to start; no request is queued until `until_ms`.
    Unhealthy {
        cause: String,
        until_ms: u64,
    },
}

/// What a queued request finds in its mailbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mail {
    Granted(Grant),
    /// The template failed to start sandboxes; retry after `until_ms`.
    Failed {
        cause: String,
        until_ms: u64,
    },
}

impl Mail {
    fn parse(m: &str) -> Result<Mail> {
        let bad = || LedgerError::Corrupt(format!("mail {m:?}"));
        let mut parts = m.splitn(4, ' ');
        match parts.next() {
            Some("ok") => {
                let sb = parts.next().ok_or_else(bad)?;
                let fence = parts.next().and_then(|f| f.parse().ok()).ok_or_else(bad)?;
                let now_ms = parts.next().and_then(|f| f.parse().ok()).ok_or_else(bad)?;
                Ok(Mail::Granted(Grant { sandbox_id: sb.to_string(), fence, now_ms }))
            }
            Some("err") => {
                let until_ms = parts.next().and_then(|f| f.parse().ok()).ok_or_else(bad)?;
                let rest: Vec<&str> = parts.collect();
                Ok(Mail::Failed { cause: rest.join(" "), until_ms })
            }
            _ => Err(bad()),
        }
    }
}

/// One pool as its node reports it.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PoolStats {
    pub idle: u64,
    pub leased: u64,
    pub creating: u64,
    pub waiting: u64,
    /// The idle count the node is steering to now.
    pub target: u64,
    /// Why the template cannot start sandboxes, while it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unhealthy: Option<String>,
}

/// A node's self-report, refreshed about twice a second.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct NodeStats {
    pub at_ms: u64,
    /// Creates per second the node has sustained recently (EWMA).
    pub create_rate: f64,
    /// Mean create latency (EWMA), milliseconds.
    pub create_ms: f64,
    pub max_sandboxes: u64,
    pub memory_mb: u64,
    pub pools: BTreeMap<String, PoolStats>,
}

/// A declared upcoming burst.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Reservation {
    pub id: String,
    pub tenant: String,
    pub template: String,
    pub count: u64,
    pub ready_by_ms: u64,
    pub hold_s: u64,
}

/// A tenant's private template: a snapshot of a session's filesystem, on the node that took it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PrivateTemplate {
    /// `<node>.<hex>`: names its node, like sandbox and session ids.
    pub name: String,
    pub tenant: String,
    /// The configured template it derives from (limits, network, workdir, lifetimes).
    pub base: String,
    /// The node-local image holding the snapshot.
    pub image: String,
    pub created_ms: u64,
}

/// A live session as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRecord {
    pub id: String,
    pub tenant: String,
    pub node: String,
    pub sandbox: String,
    pub template: String,
    pub fence: u64,
    pub created_ms: u64,
    pub last_ms: u64,
    pub idle_ms: u64,
    pub hard_ms: u64,
    /// A running call keeps the session busy (not idle) until this time.
    pub busy_ms: u64,
    /// When the session was paused (its container frozen); `None` while it runs.
    pub paused_ms: Option<u64>,
    pub labels: BTreeMap<String, String>,
    pub session_key: Option<String>,
}

impl SessionRecord {
    /// When the session ends unless used before (idle deadline, capped by the hard one).
    pub fn expires_ms(&self) -> u64 {
        if self.paused_ms.is_some() {
            return self.hard_ms;
        }
        (self.last_ms.max(self.busy_ms) + self.idle_ms).min(self.hard_ms)
    }
}

/// Result of looking a session up for a tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Live(SessionRecord),
    /// Ended recently; `reason` is `deleted`, `expired`, `max_lifetime` or `sandbox_failed`.
    Gone {
        reason: String,
        at_ms: u64,
    },
    /// Never existed, or belongs to another tenant (indistinguishable on purpose).
    Missing,
}

/// Sandbox states as the ledger stores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxState {
    Creating,
    Idle,
    Leased,
    Stopping,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRecord {
    pub id: String,
    pub template: String,
    pub state: SandboxState,
    pub container: Option<String>,
    pub session: Option<String>,
    pub fence: u64,
}

/// A session ended by the reaper or by its sandbox's removal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub session_id: String,
    pub tenant: String,
    pub session_key: Option<String>,
}

/// Outcome of claiming a tenant's session key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PinClaim {
    /// The key was free and now points at the given new session id (pending until `pin_set`).
    Claimed,
    /// The key already names this session.
    Existing(String),
    /// Another request is creating the session for this key right now.
    Pending,
}

struct Scripts {
    grant: Script,
    lookup: Script,
    release: Script,
    reap: Script,
    sandbox_add: Script,
    sandbox_ready: Script,
    sandbox_remove: Script,
    dequeue: Script,
    fail_waiters: Script,
    shrink: Script,
    pause: Script,
    del_if_eq: Script,
}

macro_rules! script {
    ($file:literal) => {
        Script::new(concat!(include_str!("lua/prelude.lua"), include_str!(concat!("lua/", $file))))
    };
}

impl Scripts {
    fn new() -> Scripts {
        Scripts {
            grant: script!("grant.lua"),
            lookup: script!("lookup.lua"),
            release: script!("release.lua"),
            reap: script!("reap.lua"),
            sandbox_add: script!("sandbox_add.lua"),
            sandbox_ready: script!("sandbox_ready.lua"),
            sandbox_remove: script!("sandbox_remove.lua"),
            dequeue: script!("dequeue.lua"),
            fail_waiters: script!("fail_waiters.lua"),
            shrink: script!("shrink.lua"),
            pause: script!("pause.lua"),
            del_if_eq: Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            ),
        }
    }
}

/// Handle to the ledger; cheap to clone (one multiplexed, auto-reconnecting connection).
#[derive(Clone)]
pub struct Ledger {
    client: redis::Client,
    conn: ConnectionManager,
    prefix: String,
    scripts: std::sync::Arc<Scripts>,
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
        Ok(Ledger { client, conn, prefix: prefix.to_string(), scripts: std::sync::Arc::new(Scripts::new()) })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A connection without a response timeout, for blocking pops. Dedicated: a blocking
    /// command on the shared multiplexed connection would stall everyone behind it.
    pub async fn blocking_connection(&self) -> Result<MultiplexedConnection> {
        let cfg = redis::AsyncConnectionConfig::new()
            .set_response_timeout(None)
            .set_connection_timeout(Some(CONNECT_TIMEOUT));
        Ok(self.client.get_multiplexed_async_connection_with_config(&cfg).await?)
    }

    fn base(&self, node: &str) -> String {
        format!("{}:{{{}}}:", self.prefix, node)
    }

    fn conn(&self) -> ConnectionManager {
        self.conn.clone()
    }

    pub async fn ping(&self) -> Result<()> {
        let _: String = redis::cmd("PING").query_async(&mut self.conn()).await?;
        Ok(())
    }

    // ---------- nodes ----------

    pub async fn register_node(&self, node: &NodeInfo) -> Result<()> {
        let json = serde_json::to_string(node).map_err(|e| LedgerError::Corrupt(e.to_string()))?;
        let _: () = redis::pipe()
            .atomic()
            .hset(format!("{}:nodes", self.prefix), &node.id, json)
            .hset(format!("{}:node-seen", self.prefix), &node.id, node.started_ms)
            .query_async(&mut self.conn())
            .await?;
        Ok(())
    }

    pub async fn heartbeat(&self, node: &str, now_ms: u64) -> Result<()> {
        let _: () = self.conn().hset(format!("{}:node-seen", self.prefix), node, now_ms).await?;
        Ok(())
    }

    pub async fn nodes(&self) -> Result<Vec<NodeInfo>> {
        let all: HashMap<String, String> = self.conn().hgetall(format!("{}:nodes", self.prefix)).await?;
        all.into_values()
            .map(|j| serde_json::from_str(&j).map_err(|e| LedgerError::Corrupt(format!("node record: {e}"))))
            .collect()
    }

    /// Redis's clock in milliseconds.
    pub async fn now_ms(&self) -> Result<u64> {
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut self.conn()).await?;
        Ok(s * 1000 + us / 1000)
    }

    // ---------- sessions (gateway side) ----------

    /// Leases an idle sandbox of `spec.template` on `node`. `Ok(None)`: the pool is empty.
    pub async fn checkout(&self, node: &str, spec: &LeaseSpec) -> Result<Option<Grant>> {
        let queue = QueueSpec { request_id: "", channel: "", max_len: 0, waiter_ttl_ms: 0 };
        Ok(match self.checkout_or_queue(node, spec, &queue).await? {
            Checkout::Granted(g) => Some(g),
            _ => None,
        })
    }

    /// Leases an idle sandbox, or queues the request for the next one that becomes ready
    /// (FIFO per tenant, round-robin between tenants). A queued request is woken by a
    /// `PUBLISH` of its id on `queue.channel`, then collects its grant with `take_mail`.
    pub async fn checkout_or_queue(&self, node: &str, spec: &LeaseSpec, queue: &QueueSpec<'_>) -> Result<Checkout> {
        let labels = serde_json::to_string(&spec.labels).map_err(|e| LedgerError::Corrupt(e.to_string()))?;
        let reply: Vec<String> = self
            .scripts
            .grant
            .arg(self.base(node))
            .arg(&spec.session_id)
            .arg(&spec.tenant)
            .arg(&spec.template)
            .arg(spec.ttl_ms)
            .arg(spec.idle_ms)
            .arg(labels)
            .arg(spec.session_key.as_deref().unwrap_or(""))
            .arg(node)
            .arg(queue.request_id)
            .arg(queue.channel)
            .arg(queue.max_len)
            .arg(queue.waiter_ttl_ms)
            .invoke_async(&mut self.conn())
            .await?;
        let num = |s: &str| s.parse::<u64>().map_err(|_| LedgerError::Corrupt(format!("checkout reply {reply:?}")));
        Ok(match reply.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
            ["granted", sb, fence, now] => {
                Checkout::Granted(Grant { sandbox_id: sb.to_string(), fence: num(fence)?, now_ms: num(now)? })
            }
            ["queued", depth] => Checkout::Queued { depth: num(depth)? },
            ["empty"] => Checkout::Empty,
            ["full", depth] => Checkout::Full { depth: num(depth)? },
            ["unhealthy", cause, until] => Checkout::Unhealthy { cause: cause.to_string(), until_ms: num(until)? },
            _ => return Err(LedgerError::Corrupt(format!("checkout reply {reply:?}"))),
        })
    }

    /// Collects what was delivered to a queued request, if anything yet.
    pub async fn take_mail(&self, node: &str, request_id: &str) -> Result<Option<Mail>> {
        let v: Option<String> = redis::cmd("GETDEL")
            .arg(format!("{}mail:{request_id}", self.base(node)))
            .query_async(&mut self.conn())
            .await?;
        v.map(|m| Mail::parse(&m)).transpose()
    }

    /// Takes a queued request out of the queue (its deadline passed). If a sandbox was
    /// granted to it meanwhile, that grant is returned instead.
    pub async fn dequeue(&self, node: &str, request_id: &str, template: &str, tenant: &str) -> Result<Option<Mail>> {
        let reply: Vec<String> = self
            .scripts
            .dequeue
            .arg(self.base(node))
            .arg(request_id)
            .arg(template)
            .arg(tenant)
            .invoke_async(&mut self.conn())
            .await?;
        match reply.first().map(String::as_str) {
            Some("mail") if reply.len() == 2 => Mail::parse(&reply[1]).map(Some),
            Some("removed") | Some("missing") => Ok(None),
            _ => Err(LedgerError::Corrupt(format!("dequeue reply {reply:?}"))),
        }
    }

    /// Marks a template unable to start sandboxes on `node` until `until_ms` (or healthy again
    /// with `None`), and tells every request waiting for it now.
    pub async fn set_health(&self, node: &str, template: &str, failing: Option<(&str, u64)>) -> Result<usize> {
        let key = format!("{}health:{template}", self.base(node));
        match failing {
            None => {
                let _: () = self.conn().del(key).await?;
                Ok(0)
            }
            Some((cause, until_ms)) => {
                let _: () = redis::pipe()
                    .hset_multiple(&key, &[("cause", cause.to_string()), ("until_ms", until_ms.to_string())])
                    .pexpire(&key, 3_600_000)
                    .query_async(&mut self.conn())
                    .await?;
                let n: usize = self
                    .scripts
                    .fail_waiters
                    .arg(self.base(node))
                    .arg(template)
                    .arg(cause)
                    .arg(until_ms)
                    .invoke_async(&mut self.conn())
                    .await?;
                Ok(n)
            }
        }
    }

    /// Retires up to `n` idle sandboxes of `template` (doomed, destroyed by the node).
    pub async fn shrink(&self, node: &str, template: &str, n: usize) -> Result<usize> {
        Ok(self.scripts.shrink.arg(self.base(node)).arg(template).arg(n).invoke_async(&mut self.conn()).await?)
    }

    /// Requests waiting for each of the given templates on `node`, in order.
    pub async fn waiting_counts(&self, node: &str, templates: &[&str]) -> Result<Vec<usize>> {
        let base = self.base(node);
        let keys: Vec<String> = templates.iter().map(|t| format!("{base}wcount:{t}")).collect();
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let v: Vec<Option<i64>> = redis::cmd("MGET").arg(&keys).query_async(&mut self.conn()).await?;
        Ok(v.into_iter().map(|n| n.unwrap_or(0).max(0) as usize).collect())
    }

    /// The channel a gateway listens on for wake-ups of its queued requests.
    pub fn wake_channel(&self, gateway_id: &str) -> String {
        format!("{}:wake:{gateway_id}", self.prefix)
    }

    /// A pub/sub connection subscribed to `channel`.
    pub async fn subscribe(&self, channel: &str) -> Result<redis::aio::PubSub> {
        let mut ps = self.client.get_async_pubsub().await?;
        ps.subscribe(channel).await?;
        Ok(ps)
    }

    /// Looks a session up for `tenant`; `touch` counts as activity (extends the idle deadline).
    pub async fn lookup(&self, session_id: &str, tenant: &str, touch: bool) -> Result<Lookup> {
        self.lookup_hold(session_id, tenant, touch, 0).await
    }

    /// Like `lookup`, for a call that may keep the session busy for up to `hold_ms` (an exec
    /// with that timeout): the idle clock starts no earlier than when that call must end.
    pub async fn lookup_hold(&self, session_id: &str, tenant: &str, touch: bool, hold_ms: u64) -> Result<Lookup> {
        let Some(node) = wire::ids::node_of(session_id) else { return Ok(Lookup::Missing) };
        let reply: Vec<String> = self
            .scripts
            .lookup
            .arg(self.base(node))
            .arg(session_id)
            .arg(tenant)
            .arg(if touch { "touch" } else { "peek" })
            .arg(hold_ms)
            .invoke_async(&mut self.conn())
            .await?;
        match reply.first().map(String::as_str) {
            Some("ok") => {
                let fields: HashMap<&str, &str> =
                    reply[2..].chunks_exact(2).map(|kv| (kv[0].as_str(), kv[1].as_str())).collect();
                Ok(Lookup::Live(session_from_fields(session_id, &fields)?))
            }
            Some("gone") if reply.len() == 3 => {
                Ok(Lookup::Gone { reason: reply[1].clone(), at_ms: reply[2].parse().unwrap_or_default() })
            }
            Some("missing") => Ok(Lookup::Missing),
            _ => Err(LedgerError::Corrupt(format!("lookup reply {reply:?}"))),
        }
    }

    /// Ends a session at the tenant's request. Returns the sandbox it held, or `None`.
    pub async fn release(&self, session_id: &str, tenant: &str, reason: &str) -> Result<Option<String>> {
        let Some(node) = wire::ids::node_of(session_id) else { return Ok(None) };
        let reply: Vec<String> = self
            .scripts
            .release
            .arg(self.base(node))
            .arg(session_id)
            .arg(tenant)
            .arg(reason)
            .invoke_async(&mut self.conn())
            .await?;
        match reply.first().map(String::as_str) {
            Some("ok") if reply.len() == 3 => {
                self.unpin(tenant, &reply[2], session_id).await?;
                Ok(Some(reply[1].clone()))
            }
            Some("missing") => Ok(None),
            _ => Err(LedgerError::Corrupt(format!("release reply {reply:?}"))),
        }
    }

    /// Marks a session paused (`pause == true`) or running again. Returns its sandbox and
    /// whether anything changed, or `None` for no such session of this tenant.
    pub async fn set_paused(&self, session_id: &str, tenant: &str, pause: bool) -> Result<Option<(String, bool)>> {
        let Some(node) = wire::ids::node_of(session_id) else { return Ok(None) };
        let reply: Vec<String> = self
            .scripts
            .pause
            .arg(self.base(node))
            .arg(session_id)
            .arg(tenant)
            .arg(if pause { "pause" } else { "resume" })
            .invoke_async(&mut self.conn())
            .await?;
        match reply.as_slice() {
            [ok, sb, changed] if ok == "ok" => Ok(Some((sb.clone(), changed == "1"))),
            [m] if m == "missing" => Ok(None),
            _ => Err(LedgerError::Corrupt(format!("pause reply {reply:?}"))),
        }
    }

    pub async fn put_private_template(&self, node: &str, t: &PrivateTemplate) -> Result<()> {
        let json = serde_json::to_string(t).map_err(|e| LedgerError::Corrupt(e.to_string()))?;
        let _: () = self.conn().hset(format!("{}ptpl", self.base(node)), &t.name, json).await?;
        Ok(())
    }

    /// The private template `name` (its node is in the name), whoever owns it.
    pub async fn private_template(&self, name: &str) -> Result<Option<PrivateTemplate>> {
        let Some(node) = wire::ids::node_of(name) else { return Ok(None) };
        let v: Option<String> = self.conn().hget(format!("{}ptpl", self.base(node)), name).await?;
        v.map(|j| serde_json::from_str(&j).map_err(|e| LedgerError::Corrupt(format!("template {name}: {e}"))))
            .transpose()
    }

    pub async fn private_templates(&self, node: &str) -> Result<Vec<PrivateTemplate>> {
        let all: HashMap<String, String> = self.conn().hgetall(format!("{}ptpl", self.base(node))).await?;
        all.into_iter()
            .map(|(n, j)| serde_json::from_str(&j).map_err(|e| LedgerError::Corrupt(format!("template {n}: {e}"))))
            .collect()
    }

    /// Forgets a private template. `true` if it existed.
    pub async fn delete_private_template(&self, name: &str) -> Result<bool> {
        let Some(node) = wire::ids::node_of(name) else { return Ok(false) };
        let n: i64 = self.conn().hdel(format!("{}ptpl", self.base(node)), name).await?;
        Ok(n > 0)
    }

    /// The live sessions of a tenant on a node.
    pub async fn tenant_sessions(&self, node: &str, tenant: &str) -> Result<Vec<String>> {
        Ok(self.conn().smembers(format!("{}tses:{tenant}", self.base(node))).await?)
    }

    /// Ends up to `limit` sessions of `node` whose deadline has passed.
    pub async fn reap_expired(&self, node: &str, limit: usize) -> Result<Vec<Ended>> {
        let reply: Vec<String> =
            self.scripts.reap.arg(self.base(node)).arg(limit).invoke_async(&mut self.conn()).await?;
        let mut ended = Vec::new();
        for c in reply.chunks_exact(4) {
            let e = Ended {
                session_id: c[0].clone(),
                tenant: c[1].clone(),
                session_key: (!c[2].is_empty()).then(|| c[2].clone()),
            };
            if let Some(key) = &e.session_key {
                self.unpin(&e.tenant, key, &e.session_id).await?;
            }
            ended.push(e);
        }
        Ok(ended)
    }

    // ---------- idempotency pins ----------

    fn pin_key(&self, tenant: &str, key: &str) -> String {
        format!("{}:pin:{}:{}", self.prefix, tenant, key)
    }

    /// Claims `key` for a session about to be created; `claim` is a token unique to the caller.
    pub async fn pin_claim(&self, tenant: &str, key: &str, claim: &str) -> Result<PinClaim> {
        let k = self.pin_key(tenant, key);
        let set: Option<String> = redis::cmd("SET")
            .arg(&k)
            .arg(format!("pending:{claim}"))
            .arg("NX")
            .arg("PX")
            .arg(PIN_PENDING_MS)
            .query_async(&mut self.conn())
            .await?;
        if set.is_some() {
            return Ok(PinClaim::Claimed);
        }
        let cur: Option<String> = self.conn().get(&k).await?;
        Ok(match cur {
            Some(v) if v.starts_with("pending:") => PinClaim::Pending,
            Some(sid) => PinClaim::Existing(sid),
            // Expired between SET and GET: let the caller try again.
            None => PinClaim::Pending,
        })
    }

    /// Points a claimed key at its created session for as long as the session can live.
    /// (A pin is only set by the one caller whose claim succeeded.)
    pub async fn pin_set(&self, tenant: &str, key: &str, session_id: &str, ttl_ms: u64) -> Result<()> {
        let _: () = self.conn().pset_ex(self.pin_key(tenant, key), session_id, ttl_ms.max(1)).await?;
        Ok(())
    }

    /// Drops a pending claim after a failed create.
    pub async fn pin_abandon(&self, tenant: &str, key: &str, claim: &str) -> Result<()> {
        self.del_if_eq(&self.pin_key(tenant, key), &format!("pending:{claim}")).await
    }

    /// Drops a stale pin that names a session which no longer exists.
    pub async fn pin_forget(&self, tenant: &str, key: &str, session_id: &str) -> Result<()> {
        self.del_if_eq(&self.pin_key(tenant, key), session_id).await
    }

    async fn unpin(&self, tenant: &str, key: &str, session_id: &str) -> Result<()> {
        if key.is_empty() {
            return Ok(());
        }
        self.pin_forget(tenant, key, session_id).await
    }

    async fn del_if_eq(&self, key: &str, value: &str) -> Result<()> {
        let _: i64 = self.scripts.del_if_eq.key(key).arg(value).invoke_async(&mut self.conn()).await?;
        Ok(())
    }

    // ---------- sandboxes (node side) ----------

    /// Records a sandbox about to be created (state `creating`).
    pub async fn sandbox_add(&self, node: &str, sandbox: &str, template: &str) -> Result<()> {
        let _: i64 = self
            .scripts
            .sandbox_add
            .arg(self.base(node))
            .arg(sandbox)
            .arg(template)
            .invoke_async(&mut self.conn())
            .await?;
        Ok(())
    }

    /// Records the container of a sandbox still being created.
    pub async fn sandbox_set_container(&self, node: &str, sandbox: &str, container: &str) -> Result<()> {
        let _: () = self.conn().hset(format!("{}sb:{}", self.base(node), sandbox), "container", container).await?;
        Ok(())
    }

    /// Moves a created sandbox into its pool. `false` if it stopped being `creating` meanwhile.
    pub async fn sandbox_ready(&self, node: &str, sandbox: &str, container: &str) -> Result<bool> {
        Ok(self.sandbox_ready_code(node, sandbox, container).await? > 0)
    }

    /// `sandbox_ready`'s full answer: 2 granted to a waiting request, 1 idle in its pool,
    /// 0 no longer `creating` (destroy it).
    pub async fn sandbox_ready_code(&self, node: &str, sandbox: &str, container: &str) -> Result<i64> {
        let n: i64 = self
            .scripts
            .sandbox_ready
            .arg(self.base(node))
            .arg(sandbox)
            .arg(container)
            .invoke_async(&mut self.conn())
            .await?;
        Ok(n)
    }

    /// Forgets a sandbox; a session on it ends with `reason`.
    pub async fn sandbox_remove(&self, node: &str, sandbox: &str, reason: &str) -> Result<Option<Ended>> {
        let reply: Vec<String> = self
            .scripts
            .sandbox_remove
            .arg(self.base(node))
            .arg(sandbox)
            .arg(reason)
            .invoke_async(&mut self.conn())
            .await?;
        let ended = match reply.as_slice() {
            [sid, tenant, key] => Ended {
                session_id: sid.clone(),
                tenant: tenant.clone(),
                session_key: (!key.is_empty()).then(|| key.clone()),
            },
            _ => return Ok(None),
        };
        if let Some(key) = &ended.session_key {
            self.unpin(&ended.tenant, key, &ended.session_id).await?;
        }
        Ok(Some(ended))
    }

    /// Every sandbox the ledger has for `node`.
    pub async fn sandboxes(&self, node: &str) -> Result<Vec<SandboxRecord>> {
        let base = self.base(node);
        let ids: Vec<String> = self.conn().smembers(format!("{base}sbs")).await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in &ids {
            pipe.hgetall(format!("{base}sb:{id}"));
        }
        let hashes: Vec<HashMap<String, String>> = pipe.query_async(&mut self.conn()).await?;
        let mut out = Vec::with_capacity(ids.len());
        for (id, h) in ids.into_iter().zip(hashes) {
            if h.is_empty() {
                continue;
            }
            let state = match h.get("state").map(String::as_str) {
                Some("creating") => SandboxState::Creating,
                Some("idle") => SandboxState::Idle,
                Some("leased") => SandboxState::Leased,
                Some("stopping") => SandboxState::Stopping,
                other => return Err(LedgerError::Corrupt(format!("sandbox {id} state {other:?}"))),
            };
            out.push(SandboxRecord {
                template: h.get("template").cloned().unwrap_or_default(),
                state,
                container: h.get("container").filter(|c| !c.is_empty()).cloned(),
                session: h.get("session").cloned(),
                fence: h.get("fence").and_then(|f| f.parse().ok()).unwrap_or(0),
                id,
            });
        }
        Ok(out)
    }

    /// Idle counts of the given templates' pools on `node`, in order.
    pub async fn idle_counts(&self, node: &str, templates: &[&str]) -> Result<Vec<usize>> {
        let base = self.base(node);
        let mut pipe = redis::pipe();
        for t in templates {
            pipe.llen(format!("{base}idle:{t}"));
        }
        Ok(pipe.query_async(&mut self.conn()).await?)
    }

    /// Waits up to `timeout` for a sandbox to destroy. Use a `blocking_connection`.
    pub async fn pop_doomed(
        &self,
        conn: &mut MultiplexedConnection,
        node: &str,
        timeout: Duration,
    ) -> Result<Option<String>> {
        let reply: Option<(String, String)> =
            conn.blpop(format!("{}doomed", self.base(node)), timeout.as_secs_f64()).await?;
        Ok(reply.map(|(_, sb)| sb))
    }

    // ---------- autoscaling signals ----------

    pub async fn write_stats(&self, node: &str, stats: &NodeStats) -> Result<()> {
        let json = serde_json::to_string(stats).map_err(|e| LedgerError::Corrupt(e.to_string()))?;
        let _: () = self.conn().pset_ex(format!("{}stats", self.base(node)), json, 60_000).await?;
        Ok(())
    }

    pub async fn stats(&self, node: &str) -> Result<Option<NodeStats>> {
        let v: Option<String> = self.conn().get(format!("{}stats", self.base(node))).await?;
        v.map(|j| serde_json::from_str(&j).map_err(|e| LedgerError::Corrupt(format!("node stats: {e}")))).transpose()
    }

    /// Idle targets the autoscaler set for `node`'s pools, with when it set them.
    pub async fn targets(&self, node: &str) -> Result<(u64, HashMap<String, u64>)> {
        let mut all: HashMap<String, u64> = self.conn().hgetall(format!("{}targets", self.base(node))).await?;
        let at = all.remove("_at_ms").unwrap_or(0);
        Ok((at, all))
    }

    pub async fn set_targets(&self, node: &str, targets: &HashMap<String, u64>, now_ms: u64) -> Result<()> {
        let key = format!("{}targets", self.base(node));
        let mut pipe = redis::pipe();
        pipe.atomic().del(&key).hset(&key, "_at_ms", now_ms);
        for (t, n) in targets {
            pipe.hset(&key, t, *n);
        }
        let _: () = pipe.query_async(&mut self.conn()).await?;
        Ok(())
    }

    /// Adds session requests per second (`(template, unix second, count)`), kept an hour.
    pub async fn add_arrivals(&self, counts: &[(String, u64, u64)]) -> Result<()> {
        if counts.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (t, sec, n) in counts {
            let key = format!("{}:arr:{t}:{sec}", self.prefix);
            pipe.incr(&key, *n).ignore().expire(&key, 3600).ignore();
        }
        let _: () = pipe.query_async(&mut self.conn()).await?;
        Ok(())
    }

    /// Session requests per second of `template` for the seconds `from..to`.
    pub async fn arrivals(&self, template: &str, from: u64, to: u64) -> Result<Vec<u64>> {
        if to <= from {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = (from..to).map(|s| format!("{}:arr:{template}:{s}", self.prefix)).collect();
        let v: Vec<Option<u64>> = redis::cmd("MGET").arg(&keys).query_async(&mut self.conn()).await?;
        Ok(v.into_iter().map(|n| n.unwrap_or(0)).collect())
    }

    pub async fn add_reservation(&self, r: &Reservation) -> Result<()> {
        let json = serde_json::to_string(r).map_err(|e| LedgerError::Corrupt(e.to_string()))?;
        let _: () = self.conn().hset(format!("{}:reservations", self.prefix), &r.id, json).await?;
        Ok(())
    }

    /// Reservations not yet past their hold; expired ones are dropped on the way.
    pub async fn reservations(&self, now_ms: u64) -> Result<Vec<Reservation>> {
        let key = format!("{}:reservations", self.prefix);
        let all: HashMap<String, String> = self.conn().hgetall(&key).await?;
        let mut live = Vec::new();
        for (id, j) in all {
            let r: Reservation =
                serde_json::from_str(&j).map_err(|e| LedgerError::Corrupt(format!("reservation {id}: {e}")))?;
            if r.ready_by_ms + r.hold_s * 1000 < now_ms {
                let _: () = self.conn().hdel(&key, &id).await?;
            } else {
                live.push(r);
            }
        }
        Ok(live)
    }
}

fn session_from_fields(id: &str, f: &HashMap<&str, &str>) -> Result<SessionRecord> {
    let s = |k: &str| -> Result<String> {
        f.get(k).map(|v| v.to_string()).ok_or_else(|| LedgerError::Corrupt(format!("session {id} lacks {k}")))
    };
    let n = |k: &str| -> Result<u64> {
        s(k)?.parse().map_err(|_| LedgerError::Corrupt(format!("session {id} field {k} is not a number")))
    };
    let labels = match f.get("labels") {
        Some(j) if !j.is_empty() => {
            serde_json::from_str(j).map_err(|e| LedgerError::Corrupt(format!("session {id} labels: {e}")))?
        }
        _ => BTreeMap::new(),
    };
    Ok(SessionRecord {
        id: id.to_string(),
        tenant: s("tenant")?,
        node: s("node")?,
        sandbox: s("sandbox")?,
        template: s("template")?,
        fence: n("fence")?,
        created_ms: n("created_ms")?,
        last_ms: n("last_ms")?,
        idle_ms: n("idle_ms")?,
        hard_ms: n("hard_ms")?,
        busy_ms: f.get("busy_ms").and_then(|v| v.parse().ok()).unwrap_or(0),
        paused_ms: f.get("paused_ms").and_then(|v| v.parse().ok()).filter(|p| *p > 0),
        labels,
        session_key: f.get("key").filter(|k| !k.is_empty()).map(|k| k.to_string()),
    })
}

//! The ledger's Redis: one server or a Redis Cluster, chosen by the URL, behind one connection
//! type ([`RedisConn`]) so that no call site knows which.
//!
//! `redis.url` is one `redis://` (or `unix://`) URL for a single Redis, or a comma-separated
//! list of `redis://` seeds for a cluster (one seed followed by a comma is a cluster too). On a
//! cluster:
//! - Commands, pipelines and scripts go through one `ClusterConnection` (multiplexed, one
//!   connection per master; the same 2 s response and connect timeouts as on one Redis), routed
//!   by the slot of their keys. Every script and every `MULTI` pipeline keeps to one slot (hash
//!   tags, `keys.rs`). redis-rs refuses a plain pipeline whose commands span slots (`holding`,
//!   `holder_alive` ask one key per node), so such a pipeline is sent command by command,
//!   concurrently, with the replies in order and each error in its place, as a pipeline answers.
//! - Blocking pops take a cluster connection of their own from a small pool, without a response
//!   timeout: a `BLPOP` holds its connection to its master, and never the shared one.
//! - `SCAN` goes to every master (`RedisConn::scan_keys`); on one Redis it is the plain `SCAN`.
//! - Pub/sub subscribes through the first seed that answers, in the order given: a classic
//!   `PUBLISH` (the scripts' wake-ups) reaches every node of a cluster, so one node hears every
//!   channel. A subscriber that loses its node subscribes again (the gateway's router does),
//!   trying the seeds in order once more.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, ServerError, ServerErrorKind, Value};

use crate::{CONNECT_TIMEOUT, LedgerError, RESPONSE_TIMEOUT, Result};

/// Connections for blocking commands (`BLPOP` of doomed sandboxes): one per node loop, plus
/// room for tests that run several nodes in one process.
const BLOCKING_POOL_SIZE: usize = 8;
/// Keys asked of a server per `SCAN` step.
const SCAN_COUNT: usize = 1000;

/// Where the ledger lives, as `redis.url` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// One Redis: the URL as given.
    Single(String),
    /// A Redis Cluster: its seeds, in the order given (pub/sub tries them in this order).
    Cluster(Vec<String>),
}

impl Topology {
    /// A comma-separated list of URLs is a cluster's seeds; one URL is a single Redis.
    pub fn of(url: &str) -> Topology {
        if !url.contains(',') {
            return Topology::Single(url.trim().to_string());
        }
        Topology::Cluster(url.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect())
    }
}

/// The connection every ordinary command, pipeline and script goes through: cheap to clone,
/// multiplexed, reconnecting, with a 2 s response timeout.
#[derive(Clone)]
pub enum RedisConn {
    /// One Redis, through a reconnecting connection manager.
    Single(ConnectionManager),
    /// A Redis Cluster, routing each command to its slot's master.
    Cluster(ClusterConnection),
}

impl RedisConn {
    /// Connects to `url` (one Redis or a cluster's seeds, see [`Topology`]).
    pub async fn open(url: &str) -> Result<RedisConn> {
        Ok(connect(&Topology::of(url)).await?.0)
    }

    /// Whether this is a cluster connection (`redis.url` named a cluster's seeds).
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConn::Cluster(_))
    }

    /// Every key matching `pattern`, from every master of a cluster. Keys that come or go
    /// during the scan may or may not be listed (as `SCAN` says).
    pub async fn scan_keys(&mut self, pattern: &str) -> Result<Vec<String>> {
        let mut keys = Vec::new();
        match self {
            RedisConn::Single(c) => {
                let mut it: redis::AsyncIter<String> = redis::AsyncCommands::scan_match(c, pattern).await?;
                while let Some(key) = it.next_item().await {
                    keys.push(key?);
                }
            }
            RedisConn::Cluster(c) => {
                let scan = |cursor: u64| {
                    let mut cmd = redis::cmd("SCAN");
                    cmd.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(SCAN_COUNT);
                    cmd
                };
                // The first step goes to every master and answers per master's address; each
                // master's scan goes on at that address until its cursor is back to 0.
                let all_masters = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let Value::Map(per_master) = c.route_command(scan(0), all_masters).await? else {
                    return Err(scan_error("SCAN of every master did not answer per master"));
                };
                for (addr, reply) in per_master {
                    let addr: String = redis::from_redis_value(addr).map_err(RedisError::from)?;
                    let (host, port) = addr
                        .rsplit_once(':')
                        .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
                        .ok_or_else(|| scan_error("a master's address is not host:port"))?;
                    let (mut cursor, batch) = scan_step(reply)?;
                    keys.extend(batch);
                    while cursor != 0 {
                        let at = SingleNodeRoutingInfo::ByAddress { host: host.clone(), port };
                        let (next, batch) =
                            scan_step(c.route_command(scan(cursor), RoutingInfo::SingleNode(at)).await?)?;
                        keys.extend(batch);
                        cursor = next;
                    }
                }
            }
        }
        Ok(keys)
    }
}

fn scan_error(what: &'static str) -> LedgerError {
    LedgerError::Unavailable(RedisError::from((ErrorKind::UnexpectedReturnType, what)))
}

/// One `SCAN` reply: the next cursor and the keys.
fn scan_step(reply: Value) -> Result<(u64, Vec<String>)> {
    if let Value::ServerError(e) = reply {
        return Err(LedgerError::Unavailable(e.into()));
    }
    Ok(redis::from_redis_value(reply).map_err(RedisError::from)?)
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Cluster(c) => Box::pin(cluster_pipeline(c, pipeline, offset, count)),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}

/// A pipeline on a cluster: as one request when its keys share a slot; a plain pipeline whose
/// keys span slots (refused by redis-rs before anything is sent) goes command by command,
/// concurrently. A transaction is never split: across slots it fails, as Redis would.
async fn cluster_pipeline(
    c: &mut ClusterConnection,
    pipeline: &Pipeline,
    offset: usize,
    count: usize,
) -> RedisResult<Vec<Value>> {
    match c.req_packed_commands(pipeline, offset, count).await {
        Err(e) if !pipeline.is_transaction() && e.kind() == ErrorKind::Server(ServerErrorKind::CrossSlot) => {
            let sends = pipeline.cmd_iter().map(|cmd| {
                let mut c = c.clone();
                async move { c.req_packed_command(cmd).await }
            });
            // A command's error stays in its place among the replies, as in a pipeline's.
            futures::future::join_all(sends)
                .await
                .into_iter()
                .map(|r| r.or_else(|e| ServerError::try_from(e).map(Value::ServerError)))
                .collect()
        }
        other => other,
    }
}

/// Connections for blocking commands, without a response timeout (the command itself is
/// bounded): each pop holds one for its duration. Cheap to clone (the pool is shared).
#[derive(Clone)]
pub(crate) enum Blocking {
    Single(deadpool_redis::Pool),
    Cluster(deadpool_redis::cluster::Pool),
}

impl Blocking {
    /// `BLPOP key timeout` on a connection of its own.
    pub(crate) async fn blpop(&self, key: &str, timeout: Duration) -> Result<Option<(String, String)>> {
        let secs = timeout.as_secs_f64();
        Ok(match self {
            Blocking::Single(pool) => {
                let mut conn = pool.get().await.map_err(pool_error)?;
                redis::AsyncCommands::blpop(&mut *conn, key, secs).await?
            }
            Blocking::Cluster(pool) => {
                let mut conn = pool.get().await.map_err(pool_error)?;
                redis::AsyncCommands::blpop(&mut *conn, key, secs).await?
            }
        })
    }
}

fn pool_error(e: deadpool_redis::PoolError) -> LedgerError {
    match e {
        deadpool_redis::PoolError::Backend(e) => LedgerError::Unavailable(e),
        other => {
            LedgerError::Unavailable(RedisError::from((ErrorKind::Io, "no blocking connection", other.to_string())))
        }
    }
}

/// The ordinary connection and the blocking pool for `topology` (the ordinary one connected
/// within a bound; the pool connects when first used).
pub(crate) async fn connect(topology: &Topology) -> Result<(RedisConn, Blocking)> {
    let timed_out = || RedisError::from((ErrorKind::Io, "connect timed out"));
    match topology {
        Topology::Single(url) => {
            let client = redis::Client::open(url.as_str())?;
            let cfg = ConnectionManagerConfig::new()
                .set_response_timeout(Some(RESPONSE_TIMEOUT))
                .set_connection_timeout(Some(CONNECT_TIMEOUT))
                .set_number_of_retries(2);
            let conn = tokio::time::timeout(CONNECT_TIMEOUT * 2, client.get_connection_manager_with_config(cfg))
                .await
                .map_err(|_| timed_out())??;
            // redis-rs gives async connections a 500 ms response timeout by default, which a
            // blocking pop outlasts by design: these connections have none.
            let blocking_cfg = redis::AsyncConnectionConfig::new()
                .set_response_timeout(None)
                .set_connection_timeout(Some(CONNECT_TIMEOUT));
            let manager = deadpool_redis::Manager::new_with_config(url.as_str(), blocking_cfg)?;
            let pool = deadpool_redis::Pool::builder(manager)
                .max_size(BLOCKING_POOL_SIZE)
                .runtime(deadpool_redis::Runtime::Tokio1)
                .wait_timeout(Some(CONNECT_TIMEOUT))
                .create_timeout(Some(CONNECT_TIMEOUT))
                .build()
                .map_err(|e| LedgerError::Corrupt(format!("build the blocking connection pool: {e}")))?;
            Ok((RedisConn::Single(conn), Blocking::Single(pool)))
        }
        Topology::Cluster(seeds) => {
            if seeds.is_empty() {
                return Err(RedisError::from((ErrorKind::InvalidClientConfig, "no cluster seed in the URL")).into());
            }
            // The overall timeout (retries and redirections included) is the response timeout.
            let client = ClusterClientBuilder::new(seeds.iter().map(String::as_str))
                .connection_timeout(CONNECT_TIMEOUT)
                .response_timeout(RESPONSE_TIMEOUT)
                .build()?;
            let conn = tokio::time::timeout(CONNECT_TIMEOUT * 2, client.get_async_connection())
                .await
                .map_err(|_| timed_out())??;
            // deadpool's cluster manager builds its clients without a response timeout (and a
            // 1 s connect timeout per node): what blocking pops need.
            let manager = deadpool_redis::cluster::Manager::new(seeds.clone(), false)?;
            let pool = deadpool_redis::cluster::Pool::builder(manager)
                .max_size(BLOCKING_POOL_SIZE)
                .runtime(deadpool_redis::Runtime::Tokio1)
                .wait_timeout(Some(CONNECT_TIMEOUT))
                .create_timeout(Some(CONNECT_TIMEOUT * 2))
                .build()
                .map_err(|e| LedgerError::Corrupt(format!("build the blocking connection pool: {e}")))?;
            Ok((RedisConn::Cluster(conn), Blocking::Cluster(pool)))
        }
    }
}

/// A pub/sub connection subscribed to `channel`: through the URL's Redis, or the first of a
/// cluster's seeds that answers within the connect timeout.
pub(crate) async fn subscribe(topology: &Topology, channel: &str) -> Result<redis::aio::PubSub> {
    let urls = match topology {
        Topology::Single(url) => std::slice::from_ref(url),
        Topology::Cluster(seeds) => seeds.as_slice(),
    };
    let mut last = RedisError::from((ErrorKind::InvalidClientConfig, "no URL to subscribe through"));
    for url in urls {
        let attempt = async {
            let mut ps = redis::Client::open(url.as_str())?.get_async_pubsub().await?;
            ps.subscribe(channel).await?;
            Ok::<_, RedisError>(ps)
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
            Ok(Ok(ps)) => return Ok(ps),
            Ok(Err(e)) => last = e,
            Err(_) => last = RedisError::from((ErrorKind::Io, "subscribe timed out")),
        }
    }
    Err(last.into())
}

#[cfg(test)]
mod tests {
    use super::Topology;

    #[test]
    fn a_list_of_urls_is_a_cluster() {
        assert_eq!(Topology::of("redis://127.0.0.1:6379"), Topology::Single("redis://127.0.0.1:6379".into()));
        assert_eq!(
            Topology::of("redis://a:7001, redis://b:7002"),
            Topology::Cluster(vec!["redis://a:7001".into(), "redis://b:7002".into()])
        );
        assert_eq!(Topology::of("redis://a:7001,"), Topology::Cluster(vec!["redis://a:7001".into()]));
    }
}

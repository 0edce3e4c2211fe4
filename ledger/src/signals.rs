//! What nodes, gateways and the autoscaler tell each other through the ledger: the node
//! registry and heartbeats, node stats, idle targets, arrival counts and reservations.

use std::collections::HashMap;

use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use wire::NodeStats;

use crate::keys::ARRIVALS_TTL_S;
use crate::{Ledger, Result, from_json, to_json};

/// Ended reservations one add drops beyond as many as it adds.
pub const MAX_RESERVATION_PRUNE: usize = 64;

/// How long a node's stats stay readable without a refresh.
const STATS_TTL_MS: u64 = 60_000;

/// A node as registered in the ledger.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node id (the hash tag of all its keys, and the prefix of its sessions' ids).
    pub id: String,
    /// Base URL of the node's pool-manager internal API.
    pub addr: String,
    /// When the node's pool-manager registered (ms, Redis clock); its first heartbeat.
    pub started_ms: u64,
}

/// What claiming (or renewing) a node id's lease found.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum NodeClaim {
    /// This holder has the lease. `fresh`: it was vacant (the node was down, or the ledger lost
    /// it); `known`: the ledger records sandboxes of this node (false once Redis forgot them).
    Claimed {
        /// The lease was vacant before this claim.
        fresh: bool,
        /// The ledger still records sandboxes of this node.
        known: bool,
    },
    /// Another holder (`host|instance`) has it for `ttl_ms` more.
    Held {
        /// The current holder, `host|instance`.
        by: String,
        /// What is left of its lease, in ms (Redis `PTTL`).
        ttl_ms: i64,
    },
}

/// What giving up a lost node did in one bounded step.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum NodeLost {
    /// One step done: sessions ended, idle sandboxes doomed; call again while `more`.
    GivenUp {
        /// Sessions ended with reason `node_lost` (their quota leases are on the node's `qret`).
        #[serde(deserialize_with = "crate::script::seq")]
        ended: Vec<crate::Ended>,
        /// Idle (or still creating) sandboxes taken out of their pools and doomed.
        doomed: u64,
        /// Whether the step hit its limit: sessions or sandboxes may be left.
        more: bool,
    },
    /// Its lease exists: it came back.
    Live,
}

/// A registered node as placement sees it: whether it is live (its last heartbeat is within
/// `node_down_after`) and how long it has been silent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    /// Its registration.
    pub info: NodeInfo,
    /// Time since its last heartbeat (ms, Redis clock; since registering if none).
    pub silent_ms: u64,
}

/// A declared upcoming burst.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Reservation {
    /// The reservation's id (`r<hex>`, with `.<i>` per item of a multi-template request).
    pub id: String,
    /// The principal path that made it (its top-level tenant's scope holds it).
    pub tenant: String,
    /// The template whose pool it warms.
    pub template: String,
    /// Sandboxes to have warm.
    pub count: u64,
    /// When they should be warm (ms, Redis clock).
    pub ready_by_ms: u64,
    /// How long after `ready_by_ms` they stay held, in seconds.
    pub hold_s: u64,
}

impl Reservation {
    /// When its sandboxes stop being held.
    pub fn ends_ms(&self) -> u64 {
        self.ready_by_ms + self.hold_s * 1000
    }
}

impl Ledger {
    /// Registers (or re-registers) a node and records its start as its first heartbeat.
    pub async fn register_node(&self, node: &NodeInfo) -> Result<()> {
        let _: () = redis::pipe()
            .atomic()
            .hset(self.keys.nodes(), &node.id, to_json("node", node)?)
            .hset(self.keys.node_seen(), &node.id, node.started_ms)
            .query_async(&mut self.conn())
            .await?;
        Ok(())
    }

    /// Claims (`start`) or renews a node id's lease for `holder` (`host|instance`) for `ttl_ms`:
    /// the node is live while it holds it. At start, a holder on the same host is taken over.
    pub async fn claim_node(&self, node: &str, holder: &str, ttl_ms: u64, start: bool) -> Result<NodeClaim> {
        let k = self.keys.node(node);
        let mode = if start { "start" } else { "renew" };
        self.run("node_claim", &self.scripts.node_claim, &[&k.sbs(), &k.lease()], &[holder, &ttl_ms.to_string(), mode])
            .await
    }

    /// Gives the lease up if `holder` still has it (a node that stops cleanly is down at once).
    pub async fn release_node(&self, node: &str, holder: &str) -> Result<()> {
        self.del_if_eq(&self.keys.node(node).lease(), holder).await
    }

    /// How many more sandboxes `node` can hold (its budget), for the queueing script's
    /// node-side admission; kept `ttl_ms` (a node that stops reporting admits again).
    pub async fn set_room(&self, node: &str, room: u64, ttl_ms: u64) -> Result<()> {
        let _: () = self.conn().pset_ex(self.keys.node(node).room(), room, ttl_ms).await?;
        Ok(())
    }

    /// One bounded step of giving up a node that has been down for `node_lost_after`.
    pub async fn give_up_node(&self, node: &str, limit: usize) -> Result<NodeLost> {
        let k = self.keys.node(node);
        self.run(
            "node_lost",
            &self.scripts.node_lost,
            &[&k.sbs(), &k.lease(), &k.expiry(), &k.doomed()],
            &[&limit.to_string()],
        )
        .await
    }

    /// Removes a node from the registry and drops what placement read of it (stats, targets,
    /// the images it held, its room): after `give_up_node` finished.
    pub async fn forget_node(&self, node: &str) -> Result<()> {
        let _: () = redis::pipe()
            .atomic()
            .hdel(self.keys.nodes(), node)
            .hdel(self.keys.node_seen(), node)
            .query_async(&mut self.conn())
            .await?;
        let k = self.keys.node(node);
        let _: () = redis::pipe()
            .atomic()
            .del(&[k.stats(), k.targets(), k.imgs(), k.room()])
            .query_async(&mut self.conn())
            .await?;
        Ok(())
    }

    /// Every registered node with how long it has been silent (Redis's clock), in one round
    /// trip.
    pub async fn node_states(&self) -> Result<Vec<NodeState>> {
        let (nodes, seen, (s, us)): (HashMap<String, String>, HashMap<String, u64>, (u64, u64)) = redis::pipe()
            .hgetall(self.keys.nodes())
            .hgetall(self.keys.node_seen())
            .cmd("TIME")
            .query_async(&mut self.conn())
            .await?;
        let now = s * 1000 + us / 1000;
        let mut out = Vec::with_capacity(nodes.len());
        for (id, j) in nodes {
            let info: NodeInfo = from_json("node record", &j)?;
            let silent_ms = now.saturating_sub(seen.get(&id).copied().unwrap_or(info.started_ms));
            out.push(NodeState { info, silent_ms });
        }
        out.sort_by(|a, b| a.info.id.cmp(&b.info.id));
        Ok(out)
    }

    /// Records a node's heartbeat at `now_ms` (Redis clock) in the registry's `node-seen`.
    pub async fn heartbeat(&self, node: &str, now_ms: u64) -> Result<()> {
        let _: () = self.conn().hset(self.keys.node_seen(), node, now_ms).await?;
        Ok(())
    }

    /// Every node's last heartbeat (ms, Redis clock), by node id.
    pub async fn node_seen(&self) -> Result<HashMap<String, u64>> {
        Ok(self.conn().hgetall(self.keys.node_seen()).await?)
    }

    /// Live sessions on `node` by tenant (kept by the scripts that lease and end sessions).
    pub async fn active_sessions(&self, node: &str) -> Result<HashMap<String, u64>> {
        let all: HashMap<String, i64> = self.conn().hgetall(self.keys.node(node).active()).await?;
        Ok(all.into_iter().filter(|(_, n)| *n > 0).map(|(t, n)| (t, n as u64)).collect())
    }

    /// Every registered node.
    pub async fn nodes(&self) -> Result<Vec<NodeInfo>> {
        let all: HashMap<String, String> = self.conn().hgetall(self.keys.nodes()).await?;
        all.values().map(|j| from_json("node record", j)).collect()
    }

    /// Publishes a node's self-report, readable for 60 s unless refreshed.
    pub async fn write_stats(&self, node: &str, stats: &NodeStats) -> Result<()> {
        let _: () = self.conn().pset_ex(self.keys.node(node).stats(), to_json("stats", stats)?, STATS_TTL_MS).await?;
        Ok(())
    }

    /// A node's latest self-report; `None` once it has gone unrefreshed for 60 s.
    pub async fn stats(&self, node: &str) -> Result<Option<NodeStats>> {
        let v: Option<String> = self.conn().get(self.keys.node(node).stats()).await?;
        v.map(|j| from_json("node stats", &j)).transpose()
    }

    /// Idle targets the autoscaler set for `node`'s pools, with when it set them.
    pub async fn targets(&self, node: &str) -> Result<(u64, HashMap<String, u64>)> {
        let mut all: HashMap<String, u64> = self.conn().hgetall(self.keys.node(node).targets()).await?;
        let at = all.remove("_at_ms").unwrap_or(0);
        Ok((at, all))
    }

    /// Replaces a node's idle targets (template -> sandboxes) with `targets`, stamped `now_ms`.
    pub async fn set_targets(&self, node: &str, targets: &HashMap<String, u64>, now_ms: u64) -> Result<()> {
        let key = self.keys.node(node).targets();
        let mut pipe = redis::pipe();
        pipe.atomic().del(&key).hset(&key, "_at_ms", now_ms);
        for (t, n) in targets {
            pipe.hset(&key, t, *n);
        }
        let _: () = pipe.query_async(&mut self.conn()).await?;
        Ok(())
    }

    /// Counts session requests (`(template, count)`) in the current second of Redis's clock,
    /// kept an hour.
    pub async fn add_arrivals(&self, counts: &[(String, u64)]) -> Result<()> {
        for (template, n) in counts {
            let scope = self.keys.arrivals_base(template);
            let _: serde::de::IgnoredAny = self
                .run(
                    "add_arrivals",
                    &self.scripts.add_arrivals,
                    &[&scope],
                    &[&n.to_string(), &ARRIVALS_TTL_S.to_string()],
                )
                .await?;
        }
        Ok(())
    }

    /// Session requests per second of `template` for the seconds `from..to` (Redis clock).
    pub async fn arrivals(&self, template: &str, from: u64, to: u64) -> Result<Vec<u64>> {
        if to <= from {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = (from..to).map(|s| self.keys.arrivals(template, s)).collect();
        let v: Vec<Option<u64>> = redis::cmd("MGET").arg(&keys).query_async(&mut self.conn()).await?;
        Ok(v.into_iter().map(|n| n.unwrap_or(0)).collect())
    }

    /// Lists the top-level tenant `top` among those with reservations, until `until_ms` at
    /// least (the registry's slot: a step of its own before `add_reservations`, so the
    /// autoscaler may read a tenant with nothing live, never miss one).
    pub async fn reservation_index_add(&self, top: &str, until_ms: u64) -> Result<()> {
        let _: () = redis::cmd("ZADD")
            .arg(self.keys.reservation_tops())
            .arg("GT")
            .arg(until_ms)
            .arg(top)
            .query_async(&mut self.conn())
            .await?;
        Ok(())
    }

    /// Records the reservations of one request of the top-level tenant `top` (or of paths
    /// under it: the reservations' `tenant`s) in its own scope, and drops at most
    /// `MAX_RESERVATION_PRUNE` plus as many as it adds of that tenant's ended ones in the same
    /// script: its cost is bounded by the request, whatever other tenants or the tenant itself
    /// hold. Returns the tenant's entries after it.
    pub async fn add_reservations(&self, top: &str, rs: &[Reservation]) -> Result<u64> {
        if rs.is_empty() {
            return Ok(0);
        }
        let k = self.keys.reservations(top);
        let mut args = vec![(MAX_RESERVATION_PRUNE + rs.len()).to_string()];
        for r in rs {
            args.extend([r.id.clone(), to_json("reservation", r)?, r.ends_ms().to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        #[derive(Deserialize)]
        struct Added {
            live: u64,
        }
        let a: Added = self.run("add_reservation", &self.scripts.add_reservation, &k.all(), &args).await?;
        Ok(a.live)
    }

    /// Both steps of recording a request's reservations: the index, then the tenant's scope.
    pub async fn record_reservations(&self, top: &str, rs: &[Reservation]) -> Result<u64> {
        let Some(last) = rs.iter().map(Reservation::ends_ms).max() else { return Ok(0) };
        self.reservation_index_add(top, last).await?;
        self.add_reservations(top, rs).await
    }

    /// Forgets reservations of the top-level tenant `top` (ones that could not be made whole).
    pub async fn delete_reservations(&self, top: &str, ids: &[String]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let k = self.keys.reservations(top);
        let _: () = redis::pipe().hdel(&k.resv, ids).zrem(&k.ends, ids).query_async(&mut self.conn()).await?;
        Ok(())
    }

    /// Reservations whose hold has not ended at `now_ms`, of every tenant that has one (the
    /// autoscaler's and the nodes' read, off any tenant's path). Tenants whose last hold has
    /// ended leave the index here; their scopes expire by themselves.
    pub async fn reservations(&self, now_ms: u64) -> Result<Vec<Reservation>> {
        let index = self.keys.reservation_tops();
        let _: i64 = redis::cmd("ZREMRANGEBYSCORE")
            .arg(&index)
            .arg("-inf")
            .arg(format!("({now_ms}"))
            .query_async(&mut self.conn())
            .await?;
        let tops: Vec<String> =
            redis::cmd("ZRANGEBYSCORE").arg(&index).arg(now_ms).arg("+inf").query_async(&mut self.conn()).await?;
        let mut live = Vec::new();
        for top in &tops {
            live.extend(self.tenant_reservations(top, now_ms).await?);
        }
        Ok(live)
    }

    /// The reservations of the top-level tenant `top` whose hold has not ended at `now_ms`.
    pub async fn tenant_reservations(&self, top: &str, now_ms: u64) -> Result<Vec<Reservation>> {
        let all: HashMap<String, String> = self.conn().hgetall(self.keys.reservations(top).resv).await?;
        let mut live = Vec::new();
        for j in all.values() {
            let r: Reservation = from_json("reservation", j)?;
            if r.ends_ms() >= now_ms {
                live.push(r);
            }
        }
        Ok(live)
    }

    /// Moves the reservations of the legacy hash (every tenant's in one `{global}` key, before
    /// per-tenant scopes) to their tenants' scopes and deletes it. Idempotent; run at a
    /// gateway's start. Returns how many it moved.
    pub async fn migrate_reservations(&self) -> Result<usize> {
        let legacy = self.keys.reservations_legacy();
        let all: HashMap<String, String> = self.conn().hgetall(&legacy).await?;
        let now = self.now_ms().await?;
        let mut by_top: HashMap<String, Vec<Reservation>> = HashMap::new();
        for j in all.values() {
            let r: Reservation = from_json("reservation", j)?;
            if r.ends_ms() >= now {
                by_top.entry(wire::quotas::top(&r.tenant).to_string()).or_default().push(r);
            }
        }
        let mut moved = 0;
        for (top, rs) in &by_top {
            for chunk in rs.chunks(MAX_RESERVATION_PRUNE) {
                self.record_reservations(top, chunk).await?;
                moved += chunk.len();
            }
        }
        let _: () = self.conn().del(&legacy).await?;
        Ok(moved)
    }
}

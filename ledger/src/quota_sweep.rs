//! The quota sweep: finds leases whose holder is gone by reading an index of what is due,
//! never the keyspace.
//!
//! A lease that ends with a holder (a session, a private template, a template made from an
//! image, a function) is entered in its tenant's `qdue` zset by the admission that creates it,
//! scored by its deadline, and leaves it when it is given back (both in the scope's scripts).
//! The sweep reads, per top-level tenant of the `qtops` index, only the entries whose time has
//! come: a lease whose holder is gone is given back; one whose holder lives is looked at again
//! `RECHECK_MS` later (a live session's lease is given back by its node's `qret` when it
//! ends; the recheck is for the rare end that lost that step). So a tick reads O(tenants with
//! sweepable leases + leases due), not O(all keys) as the `SCAN` it replaces did.
//!
//! `qtops` lives in the registry's slot, a step apart from the tenant's scope: a process notes
//! a tenant (`quota_top.lua`) before admitting for it, at most once a minute per tenant, and
//! the sweep forgets a tenant only after nobody noted it for `TOP_IDLE_MS` and its `qdue` is
//! empty, so no admitted lease is ever outside the index. Leases an older build admitted have
//! no `qdue` entry: the first sweep of each process finds them with one `SCAN` and indexes
//! them (`quota/index.lua`), then never scans again.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use redis::AsyncCommands as _;
use serde::Deserialize;
use wire::quotas::QuotaLimits;

use crate::quotas::LeaseRecord;
use crate::{Ledger, Result, from_json};

/// A lease whose holder lives is looked for again this long after: its end normally gives it
/// back through the node's `qret` list, so this only bounds how long a lost return lingers.
pub(crate) const RECHECK_MS: u64 = 600_000;

/// A process notes a tenant in `qtops` again after this long (one script call per tenant per
/// minute on the admission path, not one per admission).
const NOTE_REFRESH: Duration = Duration::from_secs(60);

/// A tenant leaves `qtops` when nobody noted it for this long and it has nothing due: far
/// longer than `NOTE_REFRESH`, so a process that skips noting never admits for a forgotten
/// tenant (and clocks do not matter: both ends use Redis's).
const TOP_IDLE_MS: u64 = 600_000;

/// Due leases read per tenant per sweep; the rest wait for the next sweep.
const DUE_BATCH: usize = 512;

/// Tenants a process remembers having noted; past this the memory starts over (a tenant is
/// then noted once more, which is harmless).
const MAX_NOTED: usize = 100_000;

/// When this process last noted each tenant, and whether its first sweep indexed the leases
/// of older builds. Shared by the clones of one `Ledger`.
#[derive(Debug, Default)]
pub(crate) struct SweepState {
    noted: std::sync::Mutex<HashMap<String, Instant>>,
    legacy_indexed: tokio::sync::OnceCell<()>,
}

#[derive(Deserialize)]
struct Indexed {
    indexed: u64,
}

impl Ledger {
    /// Lists the top-level tenant `top` in `qtops` before a lease the sweep checks is admitted
    /// for it (at most once a minute per tenant and process; `quota_admit` calls it).
    pub async fn quota_note_top(&self, top: &str) -> Result<()> {
        let fresh = |noted: &HashMap<String, Instant>| noted.get(top).is_some_and(|at| at.elapsed() < NOTE_REFRESH);
        // Poisoned: a panic elsewhere while holding it left a map of instants, still valid.
        if fresh(&self.sweep.noted.lock().unwrap_or_else(|p| p.into_inner())) {
            return Ok(());
        }
        let _: u64 = self.run("quota_top", &self.scripts.quota_top, &[&self.keys.quota_tops()], &["note", top]).await?;
        let mut noted = self.sweep.noted.lock().unwrap_or_else(|p| p.into_inner());
        if noted.len() >= MAX_NOTED {
            noted.clear();
        }
        noted.insert(top.to_string(), Instant::now());
        Ok(())
    }

    /// Gives back the leases whose holder is gone: first every node's queued returns (a dead
    /// node's too), then each due lease (`qdue`) of every indexed tenant: a session lease
    /// past its deadline whose session lives on no node, a private template, image template
    /// or function that no longer exists; a queue slot held past the deadline is left. Returns
    /// how many leases were given back (or left a queue). Safe to run anywhere, any time: a
    /// live session's lease is never touched.
    pub async fn quota_sweep(&self, defaults: &QuotaLimits) -> Result<u64> {
        self.sweep.legacy_indexed.get_or_try_init(|| async { self.quota_index_legacy().await.map(|_| ()) }).await?;
        let nodes = self.known_nodes().await?;
        let mut fixed = 0;
        for n in &nodes {
            while self.quota_drain_returns(n, 256).await? == 256 {}
        }
        let now = self.now_ms().await?;
        let tops: Vec<String> = self.conn().zrange(self.keys.quota_tops(), 0, -1).await?;
        for top in tops {
            let k = self.keys.quota(&top);
            let due: Vec<String> = redis::cmd("ZRANGEBYSCORE")
                .arg(&k.due)
                .arg("-inf")
                .arg(now)
                .arg("LIMIT")
                .arg(0)
                .arg(DUE_BATCH)
                .query_async(&mut self.conn())
                .await?;
            if due.is_empty() {
                let left: u64 = self.conn().zcard(&k.due).await?;
                if left == 0 {
                    let args = ["forget", top.as_str(), &TOP_IDLE_MS.to_string()];
                    let _: u64 =
                        self.run("quota_top", &self.scripts.quota_top, &[&self.keys.quota_tops()], &args).await?;
                }
                continue;
            }
            let records: Vec<Option<String>> =
                redis::cmd("HMGET").arg(&k.lease).arg(&due).query_async(&mut self.conn()).await?;
            let (mut orphans, mut later, mut stale) = (Vec::new(), Vec::new(), Vec::new());
            for (id, raw) in due.iter().zip(records) {
                // Given back between the two reads: its `qdue` entry went with it; one left by
                // a build without the index's upkeep is dropped here.
                let Some(raw) = raw else {
                    stale.push(id.clone());
                    continue;
                };
                if !self.holder_alive(id, &nodes).await? {
                    orphans.push(id.clone());
                    continue;
                }
                let l: LeaseRecord = from_json("quota lease", &raw)?;
                if l.queued == 1 {
                    self.quota_queue(id, &l.path, false, defaults).await?;
                    fixed += 1;
                }
                later.push(id.clone());
            }
            fixed += self.quota_release(&top, &orphans).await?;
            let mut pipe = redis::pipe();
            if !stale.is_empty() {
                pipe.zrem(&k.due, &stale).ignore();
            }
            // `XX`: a lease given back meanwhile (its entry removed) is not entered again.
            for id in &later {
                pipe.cmd("ZADD").arg(&k.due).arg("XX").arg(now + RECHECK_MS).arg(id).ignore();
            }
            if !pipe.is_empty() {
                let _: () = pipe.query_async(&mut self.conn()).await?;
            }
        }
        Ok(fixed)
    }

    /// Indexes the leases an older build admitted without a `qdue` entry: one `SCAN` for the
    /// tenants' lease hashes, then each tenant noted and its leases indexed in one script,
    /// yielding between tenants. Returns how many leases it indexed.
    async fn quota_index_legacy(&self) -> Result<u64> {
        let mut indexed = 0;
        for top in self.quota_tops_scanned().await? {
            // Noted first, so the tenant is listed before any of its leases is indexed.
            let _: u64 =
                self.run("quota_top", &self.scripts.quota_top, &[&self.keys.quota_tops()], &["note", &top]).await?;
            indexed += self.quota_index_tenant(&top).await?;
            tokio::task::yield_now().await;
        }
        if indexed > 0 {
            tracing::info!(leases = indexed, "indexed quota leases admitted by an older build");
        }
        Ok(indexed)
    }

    /// Indexes the leases of the top-level tenant `top` that have no `qdue` entry (admitted by
    /// an older build); returns how many. One script, O(the tenant's leases).
    pub async fn quota_index_tenant(&self, top: &str) -> Result<u64> {
        let k = self.keys.quota(top);
        let r: Indexed = self.run("quota_index", &self.scripts.quota_index, &k.all(), &[]).await?;
        Ok(r.indexed)
    }

    /// Every top-level tenant that holds leases, found by `SCAN` of the whole keyspace: for
    /// the index's migration and the operator's `verify`, never a periodic loop.
    pub(crate) async fn quota_tops_scanned(&self) -> Result<Vec<String>> {
        let pattern = self.keys.quota_lease_pattern();
        // On a cluster the scopes spread over every master: the scan asks each.
        let mut tops = Vec::new();
        for key in self.conn().scan_keys(&pattern).await? {
            if let Some(top) = key.split_once("{q:").and_then(|(_, rest)| rest.split_once('}')).map(|(t, _)| t) {
                tops.push(top.to_string());
            }
        }
        tops.sort();
        tops.dedup();
        Ok(tops)
    }

    /// Every node that may hold sessions: registered, or seen by its heartbeat.
    pub(crate) async fn known_nodes(&self) -> Result<Vec<String>> {
        let mut ids: Vec<String> = self.node_seen().await?.into_keys().collect();
        ids.extend(self.nodes().await?.into_iter().map(|n| n.id));
        ids.sort();
        ids.dedup();
        Ok(ids)
    }

    /// Whether what a lease stands for exists: the session or private template it is named
    /// after (`<node>.<hex>` on whichever of `nodes`), the template made from an image, or the
    /// function; a reservation's and an asynchronous invocation's leases end by themselves.
    pub(crate) async fn holder_alive(&self, lease: &str, nodes: &[String]) -> Result<bool> {
        let mut pipe = redis::pipe();
        if let Some(hex) = lease.strip_prefix("s:") {
            for n in nodes {
                pipe.exists(self.keys.node(n).ses(&format!("{n}.{hex}")));
            }
        } else if let Some(hex) = lease.strip_prefix("t:") {
            for n in nodes {
                pipe.hexists(self.keys.node(n).ptpl(), format!("{n}.{hex}"));
            }
        } else if let Some(name) = lease.strip_prefix("i:") {
            pipe.hexists(self.keys.image_templates(), name);
        } else if let Some((owner, name)) = lease.strip_prefix("f:").and_then(|id| id.rsplit_once('|')) {
            let k = self.keys.function(owner, name);
            pipe.hexists(&k.def, &k.id);
        } else {
            // `r:`, `ai:`, `ak:` (`ends_by_itself`: never indexed), and any other: never an
            // orphan.
            return Ok(true);
        }
        if pipe.is_empty() {
            // No node is known: no session or private template exists (and Redis refuses an
            // empty pipeline).
            return Ok(false);
        }
        let found: Vec<bool> = pipe.query_async(&mut self.conn()).await?;
        Ok(found.into_iter().any(|b| b))
    }
}

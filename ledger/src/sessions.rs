//! Sessions: the warm checkout, lookups (which reap an expired session on the spot), release,
//! pause bookkeeping, and the node's reaper.

use std::collections::BTreeMap;

use serde::Deserialize;
use wire::GoneReason;

use crate::script::{refs, seq};
use crate::{Ledger, Result};

/// What a new session asks of the ledger; the gateway fills it in after auth and validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSpec {
    /// The new session's id (`<node>.<random>`), chosen by the gateway; it names the node.
    pub session_id: String,
    /// The principal that owns the session.
    pub tenant: String,
    /// The template (pool) to take a sandbox from.
    pub template: String,
    /// Maximum lifetime in ms: the hard deadline is the grant's time plus this.
    pub ttl_ms: u64,
    /// Idle timeout in ms: the session ends this long after its last use.
    pub idle_ms: u64,
    /// The caller's labels, stored with the session and shown on reads.
    pub labels: BTreeMap<String, String>,
    /// The idempotency key it was created under, if any (its pin lives at `pin:<tenant>:<key>`).
    pub session_key: Option<String>,
}

/// Whose sessions a principal may act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Its own only (using a session: exec, files, snapshots).
    Owner,
    /// Its own and its descendants' (managing: read, delete, pause, resume).
    Subtree,
}

/// A granted lease, with the session's deadlines as the ledger computed them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Grant {
    /// The sandbox leased to the session.
    pub sandbox_id: String,
    /// The node's fencing token for this grant (`fence`, INCR on every grant).
    pub fence: u64,
    /// Redis's clock at the grant (ms): the session's creation time.
    pub now_ms: u64,
    /// When the session ends unless used.
    pub expires_ms: u64,
    /// The end of its maximum lifetime.
    pub hard_ms: u64,
}

/// A live session as stored. `expires_ms` is computed by the ledger (the one deadline formula
/// is `deadline` in `lua/prelude.lua`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SessionRecord {
    /// The session id.
    pub id: String,
    /// The principal that owns it.
    pub tenant: String,
    /// The node its sandbox runs on.
    pub node: String,
    /// The sandbox leased to it.
    pub sandbox: String,
    /// The template its sandbox came from.
    pub template: String,
    /// The fencing token of its grant.
    pub fence: u64,
    /// When it was granted (ms, Redis clock).
    pub created_ms: u64,
    /// Its last use (ms, Redis clock): a touching lookup moves it; the idle clock counts from it.
    pub last_ms: u64,
    /// Idle timeout in ms.
    pub idle_ms: u64,
    /// The end of its maximum lifetime (ms, Redis clock).
    pub hard_ms: u64,
    /// A running call keeps the session busy (not idle) until this time.
    pub busy_ms: u64,
    /// When the session was paused (its container frozen); `None` while it runs.
    #[serde(default)]
    pub paused_ms: Option<u64>,
    /// When the session ends unless used before (idle deadline, capped by the hard one).
    pub expires_ms: u64,
    /// The labels it was created with.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The idempotency key it was created under, if any.
    #[serde(default)]
    pub session_key: Option<String>,
    /// The egress policy of its sandbox (named-egress templates only).
    #[serde(default)]
    pub egress: Option<String>,
}

/// Result of looking a session up for a tenant.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Lookup {
    /// The session is live (and the caller may act on it).
    Live(Box<SessionRecord>),
    /// Ended within the last hour.
    Gone {
        /// Why it ended.
        reason: GoneReason,
        /// When it ended (ms, Redis clock).
        at_ms: u64,
    },
    /// Never existed, or belongs to another tenant (indistinguishable on purpose).
    Missing,
    /// Its node is down (no heartbeat for `node_down_after`): answered to a use (touch or
    /// settle), never to a read.
    NodeDown,
}

/// A session that ended (released, reaped, or its sandbox removed).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Ended {
    /// The session that ended.
    pub session_id: String,
    /// The principal that owned it.
    pub tenant: String,
    /// The sandbox it held, doomed unless already gone (never reused).
    pub sandbox: String,
    /// The session key that was pinned to it, if any (the pin itself is left alone).
    #[serde(default)]
    pub session_key: Option<String>,
    /// Why it ended (also kept in its tombstone for an hour).
    pub reason: GoneReason,
}

#[derive(Deserialize)]
struct Ungranted {
    undone: bool,
}

#[derive(Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
enum Released {
    Ended(Ended),
    Missing,
}

#[derive(Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
enum Paused {
    Ok { sandbox: String, changed: bool },
    Missing,
}

#[derive(Deserialize)]
struct Reaped {
    #[serde(deserialize_with = "seq")]
    ended: Vec<Ended>,
    /// Grants undone because their waiter never collected them (`script::CLAIM_WINDOW`).
    #[serde(default, deserialize_with = "seq")]
    unclaimed: Vec<String>,
}

impl Ledger {
    /// Looks a session up for `tenant`; `touch` counts as activity (extends the idle deadline).
    pub async fn lookup(&self, session_id: &str, tenant: &str, touch: bool) -> Result<Lookup> {
        self.lookup_hold(session_id, tenant, touch, 0).await
    }

    /// Like `lookup`, for a call that may keep the session busy for up to `hold_ms` (an exec
    /// with that timeout): the idle clock starts no earlier than when that call must end.
    pub async fn lookup_hold(&self, session_id: &str, tenant: &str, touch: bool, hold_ms: u64) -> Result<Lookup> {
        self.lookup_as(session_id, tenant, Access::Owner, touch, hold_ms).await
    }

    /// Activity on one of `tenant`'s sessions that ends any hold on it: the one call that held
    /// it (a function's invocation, in its environment) is over, so its idle timeout counts
    /// from now.
    pub async fn settle(&self, session_id: &str, tenant: &str) -> Result<Lookup> {
        let Some(node) = wire::ids::node_of(session_id) else { return Ok(Lookup::Missing) };
        let k = self.keys.node(node);
        let keys = [
            k.sbs(),
            k.ses(session_id),
            k.gone(session_id),
            k.expiry(),
            k.tses(tenant),
            k.doomed(),
            k.active(),
            k.lease(),
        ];
        self.run("lookup", &self.scripts.lookup, &refs(&keys), &[session_id, tenant, "settle", "0", "owner"]).await
    }

    /// Looks a session up for the principal `caller`: its own, or with `Access::Subtree` also
    /// a descendant's (an ancestor managing its descendants' sessions).
    pub async fn lookup_as(
        &self,
        session_id: &str,
        caller: &str,
        access: Access,
        touch: bool,
        hold_ms: u64,
    ) -> Result<Lookup> {
        let Some(node) = wire::ids::node_of(session_id) else { return Ok(Lookup::Missing) };
        let k = self.keys.node(node);
        let keys = [
            k.sbs(),
            k.ses(session_id),
            k.gone(session_id),
            k.expiry(),
            k.tses(caller),
            k.doomed(),
            k.active(),
            k.lease(),
        ];
        let mode = if touch { "touch" } else { "peek" };
        let scope = match access {
            Access::Owner => "owner",
            Access::Subtree => "subtree",
        };
        let args = [session_id, caller, mode, &hold_ms.to_string(), scope];
        self.run("lookup", &self.scripts.lookup, &refs(&keys), &args).await
    }

    /// Ends a session at the request of its owner or an ancestor of its owner. Returns the
    /// sandbox it held, or `None`. Its quota lease's return is queued on the node's `qret`
    /// (`quota_drain_returns` gives it back).
    ///
    /// A session key pinned to it is not touched: pins are checked on use (`pin_claim` finds
    /// the session gone and the caller replaces the pin), because a pin is looked up before a
    /// node is chosen and so lives outside the node's hash tag.
    pub async fn release(&self, session_id: &str, tenant: &str, reason: GoneReason) -> Result<Option<String>> {
        let Some(node) = wire::ids::node_of(session_id) else { return Ok(None) };
        let k = self.keys.node(node);
        let keys = [k.sbs(), k.ses(session_id), k.expiry(), k.tses(tenant), k.gone(session_id), k.doomed(), k.active()];
        let r: Released =
            self.run("release", &self.scripts.release, &refs(&keys), &[session_id, tenant, reason.as_str()]).await?;
        Ok(match r {
            Released::Ended(e) => Some(e.sandbox),
            Released::Missing => None,
        })
    }

    /// Undoes the grant of a session nobody has seen yet (its create was refused after the
    /// checkout): the sandbox goes back to its pool (or the longest waiter), not to destruction.
    /// False if there was no such session.
    pub async fn ungrant(&self, session_id: &str, tenant: &str) -> Result<bool> {
        let Some(node) = wire::ids::node_of(session_id) else { return Ok(false) };
        let k = self.keys.node(node);
        let keys = [k.sbs(), k.ses(session_id), k.expiry(), k.tses(tenant), k.active(), k.unclaimed()];
        let r: Ungranted = self.run("ungrant", &self.scripts.ungrant, &refs(&keys), &[session_id]).await?;
        Ok(r.undone)
    }

    /// Marks a session paused (`pause == true`) or running again. Returns its sandbox and
    /// whether anything changed, or `None` for no such session of this tenant.
    pub async fn set_paused(&self, session_id: &str, tenant: &str, pause: bool) -> Result<Option<(String, bool)>> {
        let Some(node) = wire::ids::node_of(session_id) else { return Ok(None) };
        let k = self.keys.node(node);
        let keys = [k.sbs(), k.ses(session_id), k.expiry()];
        let op = if pause { "pause" } else { "resume" };
        let r: Paused = self.run("pause", &self.scripts.pause, &refs(&keys), &[session_id, tenant, op]).await?;
        Ok(match r {
            Paused::Ok { sandbox, changed } => Some((sandbox, changed)),
            Paused::Missing => None,
        })
    }

    /// The live sessions of a tenant on a node.
    pub async fn tenant_sessions(&self, node: &str, tenant: &str) -> Result<Vec<String>> {
        use redis::AsyncCommands;
        Ok(self.conn().smembers(self.keys.node(node).tses(tenant)).await?)
    }

    /// Ends up to `limit` sessions of `node` whose deadline has passed. First, up to `limit`
    /// grants that waited in a waiter's mailbox for longer than `script::CLAIM_WINDOW` are
    /// undone: nobody collected them (the waiter is gone), so their sandboxes go back to their
    /// pools (or the next waiters), and their quota leases to the node's return list.
    pub async fn reap_expired(&self, node: &str, limit: usize) -> Result<Vec<Ended>> {
        let k = self.keys.node(node);
        let keys = [k.sbs(), k.expiry(), k.doomed(), k.active(), k.unclaimed(), k.qret()];
        let r: Reaped = self.run("reap", &self.scripts.reap, &refs(&keys), &[&limit.to_string()]).await?;
        if !r.unclaimed.is_empty() {
            tracing::info!(node, sessions = ?r.unclaimed, "grants nobody collected went back to their pools");
        }
        Ok(r.ended)
    }
}

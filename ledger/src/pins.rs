//! Session keys: a tenant's idempotency key pins the session it created.
//!
//! A pin is looked up before a node is chosen, so it lives outside every node's hash tag and
//! is not changed by the scripts that end sessions. It is checked on use instead: a pin naming
//! an ended session is replaced (`pin_forget`, then `pin_claim` again), and it expires with
//! the longest life its session could have had.

use std::time::Duration;

use serde::Deserialize;

use crate::{Ledger, Result};

/// How long a pending pin outlives the longest wait of its request: beyond the wait, a create
/// still takes its admission, a checkout or the dequeue that follows the deadline, and `pin_set`
/// (a few round trips each bounded by `RESPONSE_TIMEOUT`), so a minute is ample.
const PIN_PENDING_SLACK: Duration = Duration::from_secs(60);

/// Outcome of claiming a tenant's session key.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum PinClaim {
    /// The key was free and is now pending for this caller (until `pin_set`).
    Claimed,
    /// The key names this session (which may have ended since: check it).
    Existing {
        /// The session the key is pinned to.
        session_id: String,
    },
    /// Another request is creating the session for this key right now (or was, and its
    /// gateway is gone): `claim` is that request's token. A gateway makes the token the random
    /// part of the session's id, so a retry can find the session the claim made
    /// (`pin_resolve`) when its gateway died before pinning it.
    Pending {
        /// The claiming request's token (the random part of the session id it is creating).
        claim: String,
    },
}

impl Ledger {
    /// Claims `key` for a session about to be created; `claim` is a token unique to the caller,
    /// and `wait` the longest the request may wait for a sandbox. The claim stays pending (a
    /// retry of the key answers `Pending`) until `pin_set` or `pin_abandon`, or at most `wait`
    /// plus a margin: a request that waits its whole `max_wait_s` still holds its key when its
    /// session is made, so a retry can never create a second session.
    pub async fn pin_claim(&self, tenant: &str, key: &str, claim: &str, wait: Duration) -> Result<PinClaim> {
        let k = self.keys.pin(tenant, key);
        let pending_ms = (wait + PIN_PENDING_SLACK).as_millis().to_string();
        self.run("pin_claim", &self.scripts.pin_claim, &[&k], &[claim, &pending_ms]).await
    }

    /// Points a claimed key at its created session for as long as the session can live.
    /// (A pin is only set by the one caller whose claim succeeded.)
    pub async fn pin_set(&self, tenant: &str, key: &str, session_id: &str, ttl_ms: u64) -> Result<()> {
        use redis::AsyncCommands;
        let _: () = self.conn().pset_ex(self.keys.pin(tenant, key), session_id, ttl_ms.max(1)).await?;
        Ok(())
    }

    /// Points a key still pending under `claim` at `session_id`, the session that claim made
    /// (found by a retry: the claimant's gateway died between the grant and `pin_set`).
    /// Returns false if the key no longer holds that claim (pinned or abandoned meanwhile).
    pub async fn pin_resolve(
        &self,
        tenant: &str,
        key: &str,
        claim: &str,
        session_id: &str,
        ttl_ms: u64,
    ) -> Result<bool> {
        let pending = format!("pending:{claim}");
        let (pin, ttl) = (self.keys.pin(tenant, key), ttl_ms.max(1).to_string());
        self.run_flag("pin_resolve", &self.scripts.set_if_eq, &[&pin], &[&pending, session_id, &ttl]).await
    }

    /// Drops a pending claim after a failed create.
    pub async fn pin_abandon(&self, tenant: &str, key: &str, claim: &str) -> Result<()> {
        self.del_if_eq(&self.keys.pin(tenant, key), &format!("pending:{claim}")).await
    }

    /// Drops a pin that names a session which has ended.
    pub async fn pin_forget(&self, tenant: &str, key: &str, session_id: &str) -> Result<()> {
        self.del_if_eq(&self.keys.pin(tenant, key), session_id).await
    }

    pub(crate) async fn del_if_eq(&self, key: &str, value: &str) -> Result<()> {
        self.run_flag("del_if_eq", &self.scripts.del_if_eq, &[key], &[value]).await?;
        Ok(())
    }
}

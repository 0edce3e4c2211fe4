//! Finding a caller's session: every session call starts here. Ended and unknown sessions
//! answer with a clear reason; a paused session is resumed transparently by calls that use it.

use std::time::Duration;

use axum::http::Method;
use http_util::ApiError;
use ledger::{Access, Lookup, SessionRecord};
use wire::Session;

use crate::errors::{self, rfc3339};
use crate::nodes::NodeRequest;
use crate::{AppState, Caller};

const PAUSE_TIMEOUT: Duration = Duration::from_secs(30);

/// The session as the API shows it.
pub(crate) fn view(r: &SessionRecord) -> Session {
    Session {
        session_id: r.id.clone(),
        sandbox_id: r.sandbox.clone(),
        node: r.node.clone(),
        template: r.template.clone(),
        start: None,
        wait_ms: None,
        expires_at: rfc3339(r.expires_ms),
        max_expires_at: rfc3339(r.hard_ms),
        created_at: rfc3339(r.created_ms),
        session_key: r.session_key.clone(),
        labels: r.labels.clone(),
        paused: r.paused_ms.is_some(),
        egress: r.egress.clone(),
        cpu_ms: None,
        cpu_throttled_ms: None,
    }
}

/// Looks one of the caller's own sessions up. `touch` counts as activity; `hold_ms` keeps the
/// session busy that long (a call that may run that long).
pub(crate) async fn live(
    s: &AppState,
    caller: &Caller,
    id: &str,
    touch: bool,
    hold_ms: u64,
) -> Result<SessionRecord, ApiError> {
    live_as(s, caller, id, Access::Owner, touch, hold_ms).await
}

/// Looks a session up for managing it (read, delete, pause, resume): the caller's own or a
/// descendant's. Anyone else's answers 404, exactly like a session that never existed.
pub(crate) async fn managed(s: &AppState, caller: &Caller, id: &str) -> Result<SessionRecord, ApiError> {
    live_as(s, caller, id, Access::Subtree, false, 0).await
}

async fn live_as(
    s: &AppState,
    caller: &Caller,
    id: &str,
    access: Access,
    touch: bool,
    hold_ms: u64,
) -> Result<SessionRecord, ApiError> {
    match s.ledger.lookup_as(id, &caller.tenant, access, touch, hold_ms).await.map_err(errors::ledger)? {
        Lookup::Live(r) => Ok(*r),
        Lookup::Gone { reason, at_ms } => Err(errors::gone(id, reason, at_ms)),
        Lookup::Missing => Err(ApiError::not_found(format!("no session {id}"))),
        Lookup::NodeDown => Err(errors::node_down(wire::ids::node_of(id).unwrap_or("?"))),
    }
}

/// Like `live` (with `access`) with activity, and a paused session is resumed first.
pub(crate) async fn live_active(
    s: &AppState,
    caller: &Caller,
    id: &str,
    access: Access,
    hold_ms: u64,
) -> Result<SessionRecord, ApiError> {
    let r = live_as(s, caller, id, access, true, hold_ms).await?;
    if r.paused_ms.is_none() {
        return Ok(r);
    }
    set_paused(s, caller, &r, false).await?;
    live_as(s, caller, id, access, true, hold_ms).await
}

/// Freezes or thaws a session's sandbox, and records it. Whatever fails between the two, the
/// ledger never says "running" over a frozen sandbox (every call to it would wait out its
/// deadline): a pause is recorded before the freeze (and the record undone if the freeze
/// fails), a resume after the thaw. The other way wrong, "paused" over a running sandbox, only
/// costs the next call a thaw that finds nothing to do.
pub(crate) async fn set_paused(s: &AppState, caller: &Caller, r: &SessionRecord, pause: bool) -> Result<(), ApiError> {
    let op = if pause { "pause" } else { "resume" };
    let path = format!("/internal/v1/sandboxes/{}/{op}", r.sandbox);
    let on_node = s.nodes.call(&r.node, NodeRequest::new(Method::POST, path, PAUSE_TIMEOUT).fence(r.fence));
    if pause {
        s.ledger.set_paused(&r.id, &caller.tenant, true).await.map_err(errors::ledger)?;
        if let Err(e) = on_node.await {
            if let Err(undo) = s.ledger.set_paused(&r.id, &caller.tenant, false).await {
                tracing::warn!(session = %r.id, error = %undo, "a failed pause stays recorded (its next call resumes it)");
            }
            return Err(e);
        }
    } else {
        on_node.await?;
        s.ledger.set_paused(&r.id, &caller.tenant, false).await.map_err(errors::ledger)?;
    }
    tracing::info!(tenant = %caller.tenant, session = %r.id, op, "session");
    Ok(())
}

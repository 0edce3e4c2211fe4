//! A session's life after create: read, keep alive, delete, pause and resume (one session or
//! every session of the caller matching a label selector). An ancestor principal manages its
//! descendants' sessions too (a team lead cleaning up a run); anyone else gets 404.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use http_util::{ApiError, Json};
use wire::{GoneReason, LabelSelector, Session, SessionIds};

use crate::errors;
use ledger::Access;

use crate::lookup::{live_active, managed, set_paused, view};
use crate::{AppState, Caller};

pub async fn get(caller: Caller, State(s): State<AppState>, Path(id): Path<String>) -> Result<Json<Session>, ApiError> {
    Ok(Json(view(&managed(&s, &caller, &id).await?)))
}

/// `keepalive` and `resume`: activity, and any call that uses a paused session resumes it, so
/// the two are one handler.
pub async fn keepalive(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Session>, ApiError> {
    Ok(Json(view(&live_active(&s, &caller, &id, Access::Subtree, 0).await?)))
}

pub async fn delete(caller: Caller, State(s): State<AppState>, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    match s.ledger.release(&id, &caller.tenant, GoneReason::Deleted).await.map_err(errors::ledger)? {
        Some(sandbox) => {
            // Give the session's quota lease back now (the node's queued returns, this one
            // among them), so the caller's usage is down when it gets the answer.
            if let Some(node) = wire::ids::node_of(&id)
                && let Err(e) = s.ledger.quota_drain_returns(node, 256).await
            {
                tracing::warn!(error = %e, "give quota leases back (the pool-manager will)");
            }
            metrics::counter!(telemetry::names::SESSIONS_ENDED, "reason" => GoneReason::Deleted.as_str()).increment(1);
            tracing::info!(tenant = %caller.tenant, session = %id, %sandbox, "session deleted");
            Ok(StatusCode::NO_CONTENT)
        }
        // Not live: say why (ended, or never the caller's).
        None => Err(managed(&s, &caller, &id)
            .await
            .err()
            .unwrap_or_else(|| ApiError::not_found(format!("no session {id}")))),
    }
}

pub async fn pause(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Session>, ApiError> {
    let r = managed(&s, &caller, &id).await?;
    if r.paused_ms.is_none() {
        set_paused(&s, &caller, &r, true).await?;
    }
    Ok(Json(view(&managed(&s, &caller, &id).await?)))
}

/// Pauses (or resumes) every session of the caller whose labels include the selector's.
async fn select_and(s: &AppState, caller: &Caller, sel: &LabelSelector, pause: bool) -> Result<SessionIds, ApiError> {
    if sel.labels.is_empty() {
        return Err(ApiError::bad_request("labels: name at least one label to select by"));
    }
    let mut changed = Vec::new();
    for node in s.nodes.ids().await? {
        for sid in s.ledger.tenant_sessions(&node, &caller.tenant).await.map_err(errors::ledger)? {
            let Ok(r) = managed(s, caller, &sid).await else { continue };
            if !sel.labels.iter().all(|(k, v)| r.labels.get(k) == Some(v)) || r.paused_ms.is_some() == pause {
                continue;
            }
            set_paused(s, caller, &r, pause).await?;
            changed.push(sid);
        }
    }
    changed.sort();
    Ok(SessionIds { session_ids: changed })
}

pub async fn pause_selected(
    caller: Caller,
    State(s): State<AppState>,
    Json(sel): Json<LabelSelector>,
) -> Result<Json<SessionIds>, ApiError> {
    Ok(Json(select_and(&s, &caller, &sel, true).await?))
}

pub async fn resume_selected(
    caller: Caller,
    State(s): State<AppState>,
    Json(sel): Json<LabelSelector>,
) -> Result<Json<SessionIds>, ApiError> {
    Ok(Json(select_and(&s, &caller, &sel, false).await?))
}

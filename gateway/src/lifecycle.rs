//! A session's life after create: read, keep alive, delete, pause and resume (one session or
//! every session of the caller matching a label selector). An ancestor principal manages its
//! descendants' sessions too (a team lead cleaning up a run); anyone else gets 404.

use axum::extract::{Path, State};
use axum::http::Method;
use axum::http::StatusCode;
use futures::{StreamExt as _, TryStreamExt as _};
use http_util::{ApiError, Json, Query};
use wire::{EgressRequest, EndedCount, GoneReason, LabelSelector, Session, SessionIds, SessionList};

use crate::nodes::NodeRequest;

use crate::errors;
use ledger::Access;

use crate::lookup::{live, live_active, managed, set_paused, view};
use crate::page::{Kind, Page};
use crate::{AppState, Caller};

/// A policy switch is a map update on the node.
const EGRESS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Most sessions one listing or delete by label considers (each is a read of its record).
const MAX_SELECTED: usize = 10_000;

/// A read of the sandbox's cgroup through Docker (its one-shot stats).
const CPU_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    /// Include the sessions of the caller's descendants.
    #[serde(default)]
    subtree: bool,
    /// Only sessions carrying this label, `key=value`.
    #[serde(default)]
    label: Option<String>,
    /// Sessions per page, 1-1000 (default 1000).
    #[serde(default)]
    limit: Option<usize>,
    /// The `next_cursor` of the previous page.
    #[serde(default)]
    cursor: Option<String>,
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeleteQuery {
    /// The sessions to end: those carrying this label, `key=value` (required).
    label: String,
    /// Include the sessions of the caller's descendants.
    #[serde(default)]
    subtree: bool,
}

/// A `key=value` label selector.
fn label_selector(label: &str) -> Result<(String, String), ApiError> {
    match label.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(ApiError::bad_request(format!("label: expected key=value, got {label:?}"))),
    }
}

/// The live sessions of the caller (and with `subtree` of its descendants) that carry
/// `label`, at most `MAX_SELECTED`, in no particular order.
async fn select(
    s: &AppState,
    caller: &Caller,
    subtree: bool,
    label: Option<&(String, String)>,
) -> Result<Vec<ledger::SessionRecord>, ApiError> {
    let mut found = Vec::new();
    for node in s.nodes.ids().await? {
        // Every principal with live sessions on the node is in its `active` counts.
        let tenants: Vec<String> = if subtree {
            let active = s.ledger.active_sessions(&node).await.map_err(errors::ledger)?;
            active.into_keys().filter(|t| wire::quotas::within(t, &caller.tenant)).collect()
        } else {
            vec![caller.tenant.clone()]
        };
        for t in tenants {
            for sid in s.ledger.tenant_sessions(&node, &t).await.map_err(errors::ledger)? {
                let Ok(r) = managed(s, caller, &sid).await else { continue };
                if label.is_some_and(|(k, v)| r.labels.get(k) != Some(v)) {
                    continue;
                }
                found.push(r);
                if found.len() >= MAX_SELECTED {
                    return Ok(found);
                }
            }
        }
    }
    Ok(found)
}

/// `GET /v1/sessions`: the caller's live sessions, oldest first (with `?subtree=true` its
/// descendants' too: a team lead finding a run's sessions to clean up), a page at a time.
#[utoipa::path(get, path = "/v1/sessions", tag = "sessions", operation_id = "list_sessions", summary = "List sessions", params(ListQuery), responses((status = 200, description = "A page of the caller's live sessions, oldest first; `next_cursor` when more follow.", body = wire::SessionList)))]
pub(crate) async fn list(
    caller: Caller,
    State(s): State<AppState>,
    Query(q): Query<ListQuery>,
) -> Result<Json<SessionList>, ApiError> {
    let label = q.label.as_deref().map(label_selector).transpose()?;
    let page = Page::parse(Kind::Sessions, q.limit, q.cursor.as_deref())?;
    let found = select(&s, &caller, q.subtree, label.as_ref()).await?;
    // Creation time first (oldest first), the id to order sessions created the same millisecond.
    let (records, next_cursor) = page.take(Kind::Sessions, found, |r| format!("{:020} {}", r.created_ms, r.id));
    Ok(Json(SessionList { sessions: records.iter().map(view).collect(), next_cursor }))
}

/// `DELETE /v1/sessions?label=k=v`: ends every live session of the caller carrying the label
/// (with `?subtree=true` its descendants' too): a preempted job's thousands of sessions in one
/// call. Answers how many ended (one that ended meanwhile by itself is not counted).
#[utoipa::path(delete, path = "/v1/sessions", tag = "sessions", operation_id = "delete_sessions", summary = "End the sessions that carry a label", params(DeleteQuery), responses((status = 200, description = "How many sessions ended.", body = wire::EndedCount)))]
pub(crate) async fn delete_selected(
    caller: Caller,
    State(s): State<AppState>,
    Query(q): Query<DeleteQuery>,
) -> Result<Json<EndedCount>, ApiError> {
    let label = label_selector(&q.label)?;
    let found = select(&s, &caller, q.subtree, Some(&label)).await?;
    // Ends run a few at a time: each is a ledger script and a quota return, and thousands at
    // once would starve the other calls of the gateway's Redis connections.
    let ended = futures::stream::iter(found)
        .map(|r| {
            let s = &s;
            let tenant = caller.tenant.clone();
            async move { end_session(s, &tenant, &r.id).await }
        })
        .buffer_unordered(DELETE_CONCURRENCY)
        .try_fold(0u64, |n, ended| async move { Ok(n + u64::from(ended)) })
        .await?;
    tracing::info!(tenant = %caller.tenant, label = %q.label, subtree = q.subtree, ended, "sessions deleted by label");
    Ok(Json(EndedCount { ended }))
}

/// Sessions a delete by label ends at once.
const DELETE_CONCURRENCY: usize = 16;

#[utoipa::path(get, path = "/v1/sessions/{id}", tag = "sessions", operation_id = "get_session", summary = "Get a session", params(("id" = String, Path, description = "The session id (names its node).")), responses((status = 200, description = "The session.", body = wire::Session)))]
pub(crate) async fn get(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Session>, ApiError> {
    let r = managed(&s, &caller, &id).await?;
    let mut session = view(&r);
    // Its CPU use and throttling, from its node; the session is answered without them if the
    // node cannot say in time (a paused or ending sandbox, a node under load).
    let path = format!("/internal/v1/sandboxes/{}/cpu", r.sandbox);
    let call = NodeRequest::new(Method::GET, path, CPU_TIMEOUT).fence(r.fence);
    match crate::nodes::call_json::<wire::internal::SandboxCpu>(s.nodes.as_ref(), &r.node, call).await {
        Ok(cpu) => (session.cpu_ms, session.cpu_throttled_ms) = (Some(cpu.cpu_ms), Some(cpu.cpu_throttled_ms)),
        Err(e) => tracing::debug!(session = %id, error = %e.message, "read the sandbox's CPU use"),
    }
    Ok(Json(session))
}

/// Moves the session's idle deadline (the activity of any call does the same).
#[utoipa::path(post, path = "/v1/sessions/{id}/keepalive", tag = "sessions", operation_id = "keepalive_session", summary = "Keep a session alive", params(("id" = String, Path, description = "The session id (names its node).")), responses((status = 200, description = "The session with its idle deadline moved.", body = wire::Session)))]
pub(crate) async fn keepalive(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Session>, ApiError> {
    Ok(Json(view(&live_active(&s, &caller, &id, Access::Subtree, 0).await?)))
}

/// Resumes a paused session (any call that uses a paused session resumes it: this is a
/// keepalive under the name a caller looks for).
#[utoipa::path(post, path = "/v1/sessions/{id}/resume", tag = "sessions", operation_id = "resume_session", summary = "Resume a paused session", params(("id" = String, Path, description = "The session id (names its node).")), responses((status = 200, description = "The session, running again.", body = wire::Session)))]
pub(crate) async fn resume(
    caller: Caller,
    state: State<AppState>,
    id: Path<String>,
) -> Result<Json<Session>, ApiError> {
    keepalive(caller, state, id).await
}

#[utoipa::path(delete, path = "/v1/sessions/{id}", tag = "sessions", operation_id = "delete_session", summary = "End a session", params(("id" = String, Path, description = "The session id (names its node).")), responses((status = 204, description = "Deleted; its sandbox is destroyed.")))]
pub(crate) async fn delete(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if end_session(&s, &caller.tenant, &id).await? {
        return Ok(StatusCode::NO_CONTENT);
    }
    // Not live: say why (ended, or never the caller's).
    Err(managed(&s, &caller, &id).await.err().unwrap_or_else(|| ApiError::not_found(format!("no session {id}"))))
}

/// Ends a live session of `tenant` (or one of its descendants') as deleted: `false` if there
/// was none to end.
pub(crate) async fn end_session(s: &AppState, tenant: &str, id: &str) -> Result<bool, ApiError> {
    let Some(sandbox) = s.ledger.release(id, tenant, GoneReason::Deleted).await.map_err(errors::ledger)? else {
        return Ok(false);
    };
    // Give the session's quota lease back now (the node's queued returns, this one among
    // them), so the caller's usage is down when it gets the answer.
    if let Some(node) = wire::ids::node_of(id)
        && let Err(e) = s.ledger.quota_drain_returns(node, 256).await
    {
        tracing::warn!(error = %e, "give quota leases back (the pool-manager will)");
    }
    metrics::counter!(telemetry::names::SESSIONS_ENDED, "reason" => GoneReason::Deleted.as_str()).increment(1);
    tracing::info!(%tenant, session = %id, %sandbox, "session deleted");
    Ok(true)
}

#[utoipa::path(post, path = "/v1/sessions/{id}/pause", tag = "sessions", operation_id = "pause_session", summary = "Pause a session", params(("id" = String, Path, description = "The session id (names its node).")), responses((status = 200, description = "The session, frozen (memory kept, no CPU); any call resumes it.", body = wire::Session)))]
pub(crate) async fn pause(
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

/// Switches the session's egress policy: new connections are checked against it at once, and
/// open ones it refuses are cut. The template names the policies a session may use.
#[utoipa::path(put, path = "/v1/sessions/{id}/egress", tag = "sessions", operation_id = "set_session_egress", summary = "Switch a session's egress policy", params(("id" = String, Path, description = "The session id (names its node).")), request_body = wire::EgressRequest, responses((status = 200, description = "The session under its new policy.", body = wire::Session)))]
pub(crate) async fn set_egress(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Json(req): Json<EgressRequest>,
) -> Result<Json<Session>, ApiError> {
    let r = live(&s, &caller, &id, true, 0).await?;
    // A private template (a snapshot) has its base's egress; one deleted meanwhile has none.
    let base = match crate::create::resolve_template(&s, &caller, &r.template).await {
        Ok((t, _)) => Some(t),
        Err(e) if e.code == wire::ErrorCode::UnknownTemplate => None,
        Err(e) => return Err(e),
    };
    let allowed = base.as_ref().and_then(|t| t.egress.as_ref()).map(|e| e.allowed.clone()).unwrap_or_default();
    if !allowed.contains(&req.policy) {
        return Err(ApiError::forbidden(if allowed.is_empty() {
            format!("template {:?} has no named egress", r.template)
        } else {
            format!(
                "template {:?} allows the egress policies {} only, not {:?}",
                r.template,
                allowed.join(", "),
                req.policy
            )
        }));
    }
    let path = format!("/internal/v1/sandboxes/{}/egress", r.sandbox);
    let call = NodeRequest::new(Method::PUT, path, EGRESS_TIMEOUT).fence(r.fence).json(&req)?;
    s.nodes.call(&r.node, call).await?;
    tracing::info!(tenant = %caller.tenant, session = %id, policy = %req.policy, "egress switched");
    Ok(Json(view(&live(&s, &caller, &id, false, 0).await?)))
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

#[utoipa::path(post, path = "/v1/sessions:pause", tag = "sessions", operation_id = "pause_sessions", summary = "Pause the sessions that carry labels", request_body = wire::LabelSelector, responses((status = 200, description = "The sessions paused.", body = wire::SessionIds)))]
pub(crate) async fn pause_selected(
    caller: Caller,
    State(s): State<AppState>,
    Json(sel): Json<LabelSelector>,
) -> Result<Json<SessionIds>, ApiError> {
    Ok(Json(select_and(&s, &caller, &sel, true).await?))
}

#[utoipa::path(post, path = "/v1/sessions:resume", tag = "sessions", operation_id = "resume_sessions", summary = "Resume the sessions that carry labels", request_body = wire::LabelSelector, responses((status = 200, description = "The sessions resumed.", body = wire::SessionIds)))]
pub(crate) async fn resume_selected(
    caller: Caller,
    State(s): State<AppState>,
    Json(sel): Json<LabelSelector>,
) -> Result<Json<SessionIds>, ApiError> {
    Ok(Json(select_and(&s, &caller, &sel, false).await?))
}

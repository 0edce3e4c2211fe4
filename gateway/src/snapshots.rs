//! Snapshots of a session's filesystem as a tenant's private template, forks into new
//! sessions, and deleting a private template. Each private template holds one unit of its
//! owner's `private_templates` quota; each forked session is a create like any other.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{Method, StatusCode};
use http_util::{ApiError, Json};
use ledger::{Access, Cost};
use wire::internal::{PrivateTemplate, SnapshotRequest};
use wire::{CreateSession, GoneReason};

use crate::errors::{self, rfc3339};
use crate::lookup::{live, live_active};
use crate::nodes::{NodeRequest, call_json};
use crate::quotas;
use crate::{AppState, Caller};

const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(300);

/// `POST /v1/sessions/{id}/snapshot`: the session's filesystem as a new private template.
#[utoipa::path(post, path = "/v1/sessions/{id}/snapshot", tag = "snapshots", operation_id = "snapshot_session", summary = "Snapshot a session's filesystem", params(("id" = String, Path, description = "The session id (names its node).")), responses((status = 201, description = "A private template holding the session's filesystem.", body = wire::Snapshot)))]
pub async fn snapshot(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<wire::Snapshot>), ApiError> {
    Ok((StatusCode::CREATED, Json(take_snapshot(&s, &caller, &id).await?)))
}

async fn take_snapshot(s: &AppState, caller: &Caller, id: &str) -> Result<wire::Snapshot, ApiError> {
    let r = live_active(s, caller, id, Access::Owner, 0).await?;
    // The template's quota lease is taken first, named by the id the gateway picks for it.
    let hex = format!("{:016x}", rand::random::<u64>());
    let lease = ledger::template_lease(&hex);
    let cost = Cost { private_templates: 1, ..Cost::default() };
    quotas::admit(s, caller, &lease, cost, false, SNAPSHOT_TIMEOUT.as_millis() as u64, 0).await?;
    let path = format!("/internal/v1/sandboxes/{}/snapshot", r.sandbox);
    let request = SnapshotRequest { tenant: caller.tenant.clone(), id: Some(hex) };
    let call = NodeRequest::new(Method::POST, path, SNAPSHOT_TIMEOUT).fence(r.fence).json(&request)?;
    let t: PrivateTemplate = match call_json(s.nodes.as_ref(), &r.node, call).await {
        Ok(t) => t,
        Err(e) => {
            quotas::give_back(s, caller, &lease).await;
            return Err(e);
        }
    };
    // Its disk is known now: counted against `private_template_mb`, or the snapshot goes again.
    if s.config.quotas.enabled && t.size_mb > 0 {
        let extra = Cost { private_template_mb: t.size_mb, ..Cost::default() };
        let d = &s.config.quotas.default;
        let grown = s.ledger.quota_extend(&lease, &caller.tenant, extra, d).await.map_err(errors::ledger);
        if let Err(e) = grown.and_then(quotas::refused) {
            forget_template(s, &t.name).await;
            quotas::give_back(s, caller, &lease).await;
            return Err(e);
        }
    }
    tracing::info!(tenant = %caller.tenant, session = %id, template = %t.name, size_mb = t.size_mb, "snapshot");
    Ok(wire::Snapshot { template: t.name, base_template: t.base, node: r.node, created_at: rfc3339(t.created_ms) })
}

/// `POST /v1/sessions/{id}/fork`: `count` new sessions starting from this one's filesystem.
#[utoipa::path(post, path = "/v1/sessions/{id}/fork", tag = "snapshots", operation_id = "fork_session", summary = "Fork a session", params(("id" = String, Path, description = "The session id (names its node).")), request_body = wire::ForkRequest, responses((status = 201, description = "The snapshot template and `count` new sessions from it (all or none).", body = wire::Forked)))]
pub async fn fork(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Json(req): Json<wire::ForkRequest>,
) -> Result<(StatusCode, Json<wire::Forked>), ApiError> {
    if !(1..=wire::MAX_FORK).contains(&req.count) {
        return Err(ApiError::bad_request(format!("count: must be 1 ..= {}", wire::MAX_FORK)));
    }
    let parent = live(&s, &caller, &id, false, 0).await?;
    let snap = take_snapshot(&s, &caller, &id).await?;
    let opens = (0..req.count).map(|_| {
        let create = CreateSession {
            template: snap.template.clone(),
            labels: parent.labels.clone(),
            max_wait_s: req.max_wait_s,
            ..Default::default()
        };
        crate::create::open(&s, &caller, create)
    });
    let (mut sessions, mut failed) = (Vec::new(), None);
    for r in futures::future::join_all(opens).await {
        match r {
            Ok((_, session)) => sessions.push(session),
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    // All or nothing: a fork that cannot open every copy (a quota, no capacity) undoes the
    // copies it opened and the snapshot, and says why.
    if let Some(e) = failed {
        for session in &sessions {
            if let Err(re) = s.ledger.release(&session.session_id, &caller.tenant, GoneReason::Deleted).await {
                tracing::warn!(session = %session.session_id, error = %re, "undo a fork's copy");
            }
            if let Err(re) = s.ledger.quota_drain_returns(&session.node, 256).await {
                tracing::warn!(error = %re, "give quota leases back (the pool-manager will)");
            }
        }
        forget_template(&s, &snap.template).await;
        quotas::give_back(&s, &caller, &ledger::template_lease(&snap.template)).await;
        return Err(e);
    }
    Ok((StatusCode::CREATED, Json(wire::Forked { template: snap.template, sessions })))
}

/// `DELETE /v1/templates/{name}`: a private template; its image goes once no sandbox uses it.
#[utoipa::path(delete, path = "/v1/templates/{*name}", tag = "templates", operation_id = "delete_template", summary = "Delete a template (a snapshot, or one made from an image)", params(("name" = String, Path, description = "A snapshot's name, or `<namespace>/<name>` of a template made from an image (may contain slashes).")), responses((status = 204, description = "Deleted; sessions running it go on, and its image goes once nothing uses it.")))]
pub async fn delete_template(
    caller: Caller,
    State(s): State<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    if s.config.templates.contains_key(&name) {
        return Err(ApiError::forbidden("configured templates are changed in the config file"));
    }
    if wire::images::is_image_template(&name) {
        crate::images::delete(&s, &caller, &name).await?;
        return Ok(StatusCode::NO_CONTENT);
    }
    match s.ledger.private_template(&name).await.map_err(errors::ledger)? {
        Some(t) if t.tenant == caller.tenant => {}
        _ => return Err(ApiError::not_found(format!("no template {name:?}"))),
    }
    if s.ledger.delete_private_template(&name).await.map_err(errors::ledger)? {
        quotas::give_back(&s, &caller, &ledger::template_lease(&name)).await;
    }
    forget_template(&s, &name).await;
    Ok(StatusCode::NO_CONTENT)
}

/// Forgets a private template and asks its node to remove the image now (best effort: the
/// node prunes unused snapshot images on its own too).
async fn forget_template(s: &AppState, name: &str) {
    if let Err(e) = s.ledger.delete_private_template(name).await {
        tracing::warn!(template = %name, error = %e, "forget a private template");
    }
    if let Some(node) = wire::ids::node_of(name) {
        let call = NodeRequest::new(Method::DELETE, format!("/internal/v1/templates/{name}"), Duration::from_secs(60));
        if let Err(e) = s.nodes.call(node, call).await {
            tracing::warn!(template = %name, error = %e, "delete the snapshot image now");
        }
    }
}

//! Snapshots of a session's filesystem as a tenant's private template, forks into new
//! sessions, and deleting a private template. Each private template holds one unit of its
//! owner's `private_templates` quota; each forked session is a create like any other.

use std::sync::{Arc, Mutex};
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
pub(crate) async fn snapshot(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<wire::Snapshot>), ApiError> {
    Ok((StatusCode::CREATED, Json(take_snapshot(&s, &caller, &id, rand::random()).await?)))
}

/// The name of the private template `template_id` on `node` (the node names it so too).
fn template_name(node: &str, template_id: u64) -> String {
    wire::ids::make(node, &template_id.to_be_bytes())
}

/// Snapshots session `id` into the private template `template_id` (the random part of its name,
/// which the gateway picks). On any failure nothing of it is left: its quota lease is given
/// back, and a template the node may have recorded before failing (or before its answer was
/// lost) is forgotten, so the node prunes its image.
async fn take_snapshot(s: &AppState, caller: &Caller, id: &str, template_id: u64) -> Result<wire::Snapshot, ApiError> {
    let r = live_active(s, caller, id, Access::Owner, 0).await?;
    // The template's quota lease is taken first, named by the id the gateway picks for it.
    let hex = format!("{template_id:016x}");
    let lease = ledger::template_lease(&hex);
    let cost = Cost { private_templates: 1, ..Cost::default() };
    quotas::admit(s, caller, &lease, cost, false, SNAPSHOT_TIMEOUT.as_millis() as u64, 0).await?;
    let path = format!("/internal/v1/sandboxes/{}/snapshot", r.sandbox);
    let request = SnapshotRequest { tenant: caller.tenant.clone(), id: Some(hex) };
    let call = NodeRequest::new(Method::POST, path, SNAPSHOT_TIMEOUT).fence(r.fence).json(&request)?;
    let t: PrivateTemplate = match call_json(s.nodes.as_ref(), &r.node, call).await {
        Ok(t) => t,
        Err(e) => {
            let name = template_name(&r.node, template_id);
            if let Err(le) = s.ledger.delete_private_template(&name).await {
                tracing::warn!(template = %name, error = %le, "forget the template of a failed snapshot");
            }
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
pub(crate) async fn fork(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Json(req): Json<wire::ForkRequest>,
) -> Result<(StatusCode, Json<wire::Forked>), ApiError> {
    if !(1..=wire::MAX_FORK).contains(&req.count) {
        return Err(ApiError::bad_request(format!("count: must be 1 ..= {}", wire::MAX_FORK)));
    }
    let parent = live(&s, &caller, &id, false, 0).await?;
    let template_id = rand::random::<u64>();
    let mut made = Made::new(&s, &caller, template_name(&parent.node, template_id));
    let snap = match take_snapshot(&s, &caller, &id, template_id).await {
        Ok(snap) => snap,
        Err(e) => {
            made.disarm(); // the snapshot left nothing behind
            return Err(e);
        }
    };
    made.template.clone_from(&snap.template); // as the node named it
    let opens = (0..req.count).map(|_| {
        let create = CreateSession {
            template: snap.template.clone(),
            labels: parent.labels.clone(),
            max_wait_s: req.max_wait_s,
            ..Default::default()
        };
        let (s, caller, opened) = (&s, &caller, made.sessions.clone());
        async move {
            let r = crate::create::open(s, caller, create).await;
            if let Ok((_, session)) = &r {
                lock(&opened).push(session.session_id.clone());
            }
            r
        }
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
        made.undo().await;
        return Err(e);
    }
    made.disarm();
    Ok((StatusCode::CREATED, Json(wire::Forked { template: snap.template, sessions })))
}

/// What a fork has made so far: its snapshot (a private template and its quota lease) and the
/// sessions opened from it. Unless the fork succeeds (`disarm`), all of it is undone: after a
/// failure, before the answer (`undo`); when the request is dropped midway (its client hung
/// up), in the background, so nothing the client never heard of is left holding sandboxes
/// and quota.
struct Made {
    s: AppState,
    caller: Caller,
    template: String,
    sessions: Arc<Mutex<Vec<String>>>,
    armed: bool,
}

impl Made {
    fn new(s: &AppState, caller: &Caller, template: String) -> Made {
        Made { s: s.clone(), caller: caller.clone(), template, sessions: Default::default(), armed: true }
    }

    fn disarm(&mut self) {
        self.armed = false;
    }

    async fn undo(mut self) {
        self.armed = false;
        let sessions = lock(&self.sessions).clone();
        undo_fork(self.s.clone(), self.caller.clone(), self.template.clone(), sessions).await;
    }
}

impl Drop for Made {
    fn drop(&mut self) {
        if self.armed {
            let sessions = lock(&self.sessions).clone();
            let undo = undo_fork(self.s.clone(), self.caller.clone(), self.template.clone(), sessions);
            self.s.work.spawn_from_drop(undo);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Ends the sessions a fork opened (their quota leases given back) and forgets its template.
async fn undo_fork(s: AppState, caller: Caller, template: String, sessions: Vec<String>) {
    let mut nodes = Vec::new();
    for sid in &sessions {
        if let Err(e) = s.ledger.release(sid, &caller.tenant, GoneReason::Deleted).await {
            tracing::warn!(session = %sid, error = %e, "undo a fork's copy");
        }
        nodes.extend(wire::ids::node_of(sid).map(String::from));
    }
    nodes.sort();
    nodes.dedup();
    for node in nodes {
        if let Err(e) = s.ledger.quota_drain_returns(&node, 256).await {
            tracing::warn!(error = %e, "give quota leases back (the pool-manager will)");
        }
    }
    forget_template(&s, &template).await;
    quotas::give_back(&s, &caller, &ledger::template_lease(&template)).await;
}

/// `DELETE /v1/templates/{name}`: a private template; its image goes once no sandbox uses it.
#[utoipa::path(delete, path = "/v1/templates/{*name}", tag = "templates", operation_id = "delete_template", summary = "Delete a template (a snapshot, or one made from an image)", params(("name" = String, Path, description = "A snapshot's name, or `<namespace>/<name>` of a template made from an image (may contain slashes).")), responses((status = 204, description = "Deleted; sessions running it go on, and its image goes once nothing uses it.")))]
pub(crate) async fn delete_template(
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

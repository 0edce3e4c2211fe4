//! Session handlers: create (warm checkout, else a bounded cold create), inspect, keep alive,
//! delete, and the exec and file calls routed to the session's node.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_util::{ApiError, Json};
use ledger::{Checkout, LedgerError, Lookup, Mail, PinClaim, QueueSpec, SessionRecord};
use reqwest::Method;
use wire::internal::LeaseSpec;
use wire::{CreateSession, ExecRequest, ExecResponse, LabelSelector, Session, SessionIds, Start};

use crate::{AppState, Caller};

/// Extra time the gateway waits for a node beyond the command's own timeout.
const EXEC_GRACE: Duration = Duration::from_secs(15);
const FILE_TIMEOUT: Duration = Duration::from_secs(180);
const MAX_LABELS: usize = 64;

fn ledger_down(e: LedgerError) -> ApiError {
    match e {
        LedgerError::Unavailable(e) => ApiError::unavailable(format!("ledger unavailable: {e}"), 1),
        LedgerError::Corrupt(m) => ApiError::Internal(format!("ledger: {m}")),
    }
}

fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

fn view(r: &SessionRecord) -> Session {
    Session {
        session_id: r.id.clone(),
        sandbox_id: r.sandbox.clone(),
        node: r.node.clone(),
        template: r.template.clone(),
        start: None,
        wait_ms: None,
        expires_at: rfc3339(r.expires_ms()),
        max_expires_at: rfc3339(r.hard_ms),
        created_at: rfc3339(r.created_ms),
        session_key: r.session_key.clone(),
        labels: r.labels.clone(),
        paused: r.paused_ms.is_some(),
    }
}

fn random_id(node: &str) -> String {
    let r: [u8; 16] = rand::random();
    wire::ids::make(node, &r)
}

fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if labels.len() > MAX_LABELS {
        return Err(ApiError::bad_request(format!("labels: at most {MAX_LABELS} labels")));
    }
    for (k, v) in labels {
        let ok_key = !k.is_empty()
            && k.len() <= 63
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/'));
        if !ok_key {
            return Err(ApiError::bad_request(format!(
                "labels: key {k:?} must be 1-63 characters of letters, digits, '-', '_', '.', '/'"
            )));
        }
        if v.len() > 256 {
            return Err(ApiError::bad_request(format!("labels.{k}: value longer than 256 bytes")));
        }
    }
    Ok(())
}

/// Looks a session up for the caller; ended and unknown sessions are 404 with a clear reason.
pub(crate) async fn live(
    s: &AppState,
    caller: &Caller,
    id: &str,
    touch: bool,
    hold_ms: u64,
) -> Result<SessionRecord, ApiError> {
    match s.ledger.lookup_hold(id, &caller.tenant, touch, hold_ms).await.map_err(ledger_down)? {
        Lookup::Live(r) => Ok(r),
        // The platform's failure, not the caller's: 502, with the same clear message.
        Lookup::Gone { reason, at_ms } if reason == "sandbox_failed" => Err(ApiError::BadGateway(format!(
            "session {id} ended at {}: its sandbox failed; open a new session",
            rfc3339(at_ms)
        ))),
        Lookup::Gone { reason, at_ms } => Err(ApiError::NotFound {
            code: "session_gone",
            message: format!(
                "session {id} ended at {} ({})",
                rfc3339(at_ms),
                match reason.as_str() {
                    "deleted" => "deleted",
                    "expired" => "idle timeout passed",
                    "max_lifetime" => "maximum lifetime reached",
                    _ => "ended",
                }
            ),
        }),
        Lookup::Missing => Err(ApiError::not_found(format!("no session {id}"))),
    }
}

pub async fn create(
    caller: Caller,
    State(s): State<AppState>,
    Json(req): Json<CreateSession>,
) -> Result<Response, ApiError> {
    let (status, session) = open(&s, &caller, req).await?;
    Ok((status, Json(session)).into_response())
}

/// Resolves a template name for a caller: a configured template, or one of the caller's
/// private templates (snapshots), which lives on one node.
async fn resolve_template(
    s: &AppState,
    caller: &Caller,
    name: &str,
) -> Result<(config::Template, Option<String>), ApiError> {
    if let Some(t) = s.config.templates.get(name) {
        return Ok((t.clone(), None));
    }
    let unknown =
        || ApiError::BadRequest { code: "unknown_template", message: format!("template: no template named {name:?}") };
    let private = s.ledger.private_template(name).await.map_err(ledger_down)?.ok_or_else(unknown)?;
    if private.tenant != caller.tenant {
        return Err(unknown());
    }
    let base = s.config.templates.get(&private.base).ok_or_else(unknown)?;
    let node = wire::ids::node_of(name).map(String::from);
    Ok((config::Template { name: name.to_string(), image: private.image, ..base.clone() }, node))
}

/// Opens a session: 201 with a new one, or 200 with the live one its `session_key` pins.
pub(crate) async fn open(s: &AppState, caller: &Caller, req: CreateSession) -> Result<(StatusCode, Session), ApiError> {
    let started = Instant::now();
    let (template, pinned) = resolve_template(s, caller, &req.template).await?;
    let template = &template;
    let ttl_ms = match req.ttl_s {
        Some(0) => return Err(ApiError::bad_request("ttl_s: must be at least 1")),
        Some(t) => (t.saturating_mul(1000)).min(template.max_lifetime.as_millis() as u64),
        None => template.max_lifetime.as_millis() as u64,
    };
    let idle_ms = match req.idle_timeout_s {
        Some(0) => return Err(ApiError::bad_request("idle_timeout_s: must be at least 1")),
        Some(t) => (t.saturating_mul(1000)).min(template.idle_timeout.as_millis() as u64),
        None => template.idle_timeout.as_millis() as u64,
    };
    validate_labels(&req.labels)?;
    let wait = wait_for(s, &req)?;
    if let Some(k) = &req.session_key {
        let ok = !k.is_empty()
            && k.len() <= 128
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
        if !ok {
            return Err(ApiError::bad_request(
                "session_key: must be 1-128 characters of letters, digits, '-', '_', '.', ':'",
            ));
        }
    }

    // The pin: the same tenant and key get the same live session.
    let claim = req.session_key.as_ref().map(|_| format!("{:032x}", rand::random::<u128>()));
    if let (Some(key), Some(claim)) = (&req.session_key, &claim) {
        for attempt in 0..2 {
            match s.ledger.pin_claim(&caller.tenant, key, claim).await.map_err(ledger_down)? {
                PinClaim::Claimed => break,
                PinClaim::Existing(sid) => match live(s, caller, &sid, true, 0).await {
                    Ok(r) => return Ok((StatusCode::OK, view(&r))),
                    Err(ApiError::NotFound { .. }) if attempt == 0 => {
                        s.ledger.pin_forget(&caller.tenant, key, &sid).await.map_err(ledger_down)?;
                    }
                    Err(e) => return Err(e),
                },
                PinClaim::Pending => {
                    return Err(ApiError::Conflict {
                        code: "conflict",
                        message: format!("session_key: a session for {key:?} is being created; retry"),
                    });
                }
            }
        }
    }

    let result = checkout(s, caller, &req, pinned.as_deref(), ttl_ms, idle_ms, wait).await;
    let (spec, grant_sandbox, start, now) = match result {
        Ok(v) => v,
        Err(e) => {
            if let (Some(key), Some(claim)) = (&req.session_key, &claim) {
                let _ = s.ledger.pin_abandon(&caller.tenant, key, claim).await;
            }
            return Err(e);
        }
    };
    if let Some(key) = &req.session_key {
        s.ledger.pin_set(&caller.tenant, key, &spec.session_id, ttl_ms).await.map_err(ledger_down)?;
    }
    let node = wire::ids::node_of(&spec.session_id).unwrap_or_default().to_string();
    let body = Session {
        session_id: spec.session_id.clone(),
        sandbox_id: grant_sandbox,
        node,
        template: spec.template.clone(),
        start: Some(start),
        wait_ms: Some(started.elapsed().as_secs_f64() * 1000.0),
        expires_at: rfc3339(now + idle_ms.min(ttl_ms)),
        max_expires_at: rfc3339(now + ttl_ms),
        created_at: rfc3339(now),
        session_key: req.session_key.clone(),
        labels: req.labels.clone(),
        paused: false,
    };
    tracing::info!(tenant = %caller.tenant, session = %body.session_id, sandbox = %body.sandbox_id, ?start, "session created");
    Ok((StatusCode::CREATED, body))
}

/// A warm sandbox from any node's pool; else the request waits (bounded) in one node's queue
/// for the next sandbox of the template that becomes ready there.
async fn checkout(
    s: &AppState,
    caller: &Caller,
    req: &CreateSession,
    pinned: Option<&str>,
    ttl_ms: u64,
    idle_ms: u64,
    wait: Duration,
) -> Result<(LeaseSpec, String, Start, u64), ApiError> {
    let nodes = match pinned {
        Some(node) => vec![node.to_string()],
        None => s.nodes.ids().await?,
    };
    if nodes.is_empty() {
        return Err(ApiError::unavailable("no node has registered yet", 2));
    }
    s.waiters.arrived(&req.template);
    let spec_for = |node: &str| LeaseSpec {
        session_id: random_id(node),
        tenant: caller.tenant.clone(),
        template: req.template.clone(),
        ttl_ms,
        idle_ms,
        labels: req.labels.clone(),
        session_key: req.session_key.clone(),
    };
    // Warm: any node with an idle sandbox (random order spreads the load).
    for node in nodes.iter().skip(1) {
        let spec = spec_for(node);
        if let Some(g) = s.ledger.checkout(node, &spec).await.map_err(ledger_down)? {
            return Ok((spec, g.sandbox_id, Start::Warm, g.now_ms));
        }
    }
    // The last node tried also takes the request into its queue, atomically with the check.
    let node = &nodes[0];
    let spec = spec_for(node);
    let mut reg = s.waiters.register();
    let queue = QueueSpec {
        request_id: &reg.id,
        channel: &s.waiters.channel,
        max_len: s.config.gateway.max_queue,
        waiter_ttl_ms: (wait + Duration::from_secs(60)).as_millis() as u64,
    };
    let depth = match s.ledger.checkout_or_queue(node, &spec, &queue).await.map_err(ledger_down)? {
        Checkout::Granted(g) => return Ok((spec, g.sandbox_id, Start::Warm, g.now_ms)),
        Checkout::Queued { depth } => depth,
        Checkout::Empty => return Err(ApiError::Internal("queueing checkout answered empty".into())),
        Checkout::Full { depth } => {
            return Err(ApiError::TooManyRequests {
                message: format!("{depth} requests already wait for template {:?}; retry later", req.template),
                retry_after_s: 2,
            });
        }
        Checkout::Unhealthy { cause, until_ms } => return Err(unhealthy(s, &req.template, &cause, until_ms).await),
    };
    let mail = match wait_for_mail(s, node, &mut reg, wait).await? {
        Some(mail) => mail,
        // Deadline: give up our place; a sandbox granted meanwhile is still ours.
        None => match s.ledger.dequeue(node, &reg.id, &req.template, &caller.tenant).await.map_err(ledger_down)? {
            Some(mail) => mail,
            None => {
                return Err(ApiError::unavailable(
                    format!(
                        "no sandbox of template {:?} became free within {:.1}s ({depth} were waiting); retry",
                        req.template,
                        wait.as_secs_f64()
                    ),
                    2,
                ));
            }
        },
    };
    match mail {
        Mail::Granted(g) => Ok((spec, g.sandbox_id, Start::Cold, g.now_ms)),
        Mail::Failed { cause, until_ms } => Err(unhealthy(s, &req.template, &cause, until_ms).await),
    }
}

/// How long this request may wait in a queue.
fn wait_for(s: &AppState, req: &CreateSession) -> Result<Duration, ApiError> {
    match req.max_wait_s {
        None => Ok(s.config.gateway.default_wait),
        Some(w) if w.is_finite() && (0.0..=config::MAX_QUEUE_WAIT.as_secs_f64()).contains(&w) => {
            Ok(Duration::from_secs_f64(w))
        }
        Some(_) => {
            Err(ApiError::bad_request(format!("max_wait_s: must be 0 ..= {}", config::MAX_QUEUE_WAIT.as_secs())))
        }
    }
}

/// Waits for this request's wake-up (polling its mailbox too, in case a wake-up was lost),
/// at most `wait`. `None` when the deadline passed first.
async fn wait_for_mail(
    s: &AppState,
    node: &str,
    reg: &mut crate::waiters::Registration<'_>,
    wait: Duration,
) -> Result<Option<Mail>, ApiError> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut woken = false;
    loop {
        tokio::select! {
            _ = &mut reg.woken, if !woken => woken = true,
            _ = tokio::time::sleep(crate::waiters::MAILBOX_POLL) => {}
            _ = tokio::time::sleep_until(deadline) => return Ok(None),
        }
        if let Some(mail) = s.ledger.take_mail(node, &reg.id).await.map_err(ledger_down)? {
            return Ok(Some(mail));
        }
    }
}

async fn unhealthy(s: &AppState, template: &str, cause: &str, until_ms: u64) -> ApiError {
    let now = s.ledger.now_ms().await.unwrap_or(until_ms);
    let retry = until_ms.saturating_sub(now).div_ceil(1000).max(1);
    ApiError::unavailable(format!("template {template:?} cannot start sandboxes right now: {cause}"), retry)
}

/// Like `live` with activity, and a paused session is resumed first (transparently).
pub(crate) async fn live_active(
    s: &AppState,
    caller: &Caller,
    id: &str,
    hold_ms: u64,
) -> Result<SessionRecord, ApiError> {
    let r = live(s, caller, id, true, hold_ms).await?;
    if r.paused_ms.is_none() {
        return Ok(r);
    }
    set_paused(s, caller, &r, false).await?;
    live(s, caller, id, true, hold_ms).await
}

/// Freezes or thaws a session's sandbox, then records it.
async fn set_paused(s: &AppState, caller: &Caller, r: &SessionRecord, pause: bool) -> Result<(), ApiError> {
    let op = if pause { "pause" } else { "resume" };
    let path = format!("/internal/v1/sandboxes/{}/{op}", r.sandbox);
    s.nodes.call(&r.node, Method::POST, &path, None, Some(r.fence), Duration::from_secs(30)).await?;
    s.ledger.set_paused(&r.id, &caller.tenant, pause).await.map_err(ledger_down)?;
    tracing::info!(tenant = %caller.tenant, session = %r.id, op, "session");
    Ok(())
}

pub async fn pause(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Session>, ApiError> {
    let r = live(&s, &caller, &id, false, 0).await?;
    if r.paused_ms.is_none() {
        set_paused(&s, &caller, &r, true).await?;
    }
    Ok(Json(view(&live(&s, &caller, &id, false, 0).await?)))
}

pub async fn resume(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Session>, ApiError> {
    Ok(Json(view(&live_active(&s, &caller, &id, 0).await?)))
}

/// Pauses (or resumes) every session of the caller whose labels include the selector's.
async fn select_and(s: &AppState, caller: &Caller, sel: &LabelSelector, pause: bool) -> Result<SessionIds, ApiError> {
    if sel.labels.is_empty() {
        return Err(ApiError::bad_request("labels: name at least one label to select by"));
    }
    let mut changed = Vec::new();
    for node in s.nodes.ids().await? {
        for sid in s.ledger.tenant_sessions(&node, &caller.tenant).await.map_err(ledger_down)? {
            let Ok(r) = live(s, caller, &sid, false, 0).await else { continue };
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

pub async fn get(caller: Caller, State(s): State<AppState>, Path(id): Path<String>) -> Result<Json<Session>, ApiError> {
    Ok(Json(view(&live(&s, &caller, &id, false, 0).await?)))
}

pub async fn keepalive(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Session>, ApiError> {
    Ok(Json(view(&live_active(&s, &caller, &id, 0).await?)))
}

pub async fn delete(caller: Caller, State(s): State<AppState>, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    match s.ledger.release(&id, &caller.tenant, "deleted").await.map_err(ledger_down)? {
        Some(sandbox) => {
            tracing::info!(tenant = %caller.tenant, session = %id, %sandbox, "session deleted");
            Ok(StatusCode::NO_CONTENT)
        }
        None => {
            live(&s, &caller, &id, false, 0).await?;
            Err(ApiError::not_found(format!("no session {id}")))
        }
    }
}

pub async fn exec(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Json(req): Json<ExecRequest>,
) -> Result<Json<ExecResponse>, ApiError> {
    let timeout_ms = req.timeout_ms.unwrap_or(config::DEFAULT_EXEC_TIMEOUT.as_millis() as u64);
    if timeout_ms == 0 || timeout_ms > config::MAX_EXEC_TIMEOUT.as_millis() as u64 {
        return Err(ApiError::bad_request(format!(
            "timeout_ms: must be 1 ..= {}",
            config::MAX_EXEC_TIMEOUT.as_millis()
        )));
    }
    let r = live_active(&s, &caller, &id, timeout_ms).await?;
    let path = format!("/internal/v1/sandboxes/{}/exec", r.sandbox);
    let timeout = Duration::from_millis(timeout_ms) + EXEC_GRACE;
    let resp = s.nodes.call_json(&r.node, &path, &req, Some(r.fence), timeout).await?;
    Ok(Json(resp))
}

pub async fn read_file(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let r = live_active(&s, &caller, &id, 0).await?;
    let url = format!("/internal/v1/sandboxes/{}/files/{}", r.sandbox, encode_path(&path));
    let bytes = s.nodes.call(&r.node, Method::GET, &url, None, Some(r.fence), FILE_TIMEOUT).await?;
    let mut resp = bytes.into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    Ok(resp)
}

pub async fn write_file(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, path)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let r = live_active(&s, &caller, &id, 0).await?;
    let url = format!("/internal/v1/sandboxes/{}/files/{}", r.sandbox, encode_path(&path));
    s.nodes
        .call(&r.node, Method::PUT, &url, Some((body, "application/octet-stream")), Some(r.fence), FILE_TIMEOUT)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Percent-encodes a file path for the internal URL, keeping '/'.
fn encode_path(p: &str) -> String {
    let mut out = String::with_capacity(p.len());
    for b in p.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `POST /v1/sessions/{id}/snapshot`: the session's filesystem as a new private template.
pub async fn snapshot(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<wire::Snapshot>), ApiError> {
    let t = take_snapshot(&s, &caller, &id).await?;
    Ok((StatusCode::CREATED, Json(t)))
}

async fn take_snapshot(s: &AppState, caller: &Caller, id: &str) -> Result<wire::Snapshot, ApiError> {
    let r = live_active(s, caller, id, 0).await?;
    let body = serde_json::json!({ "tenant": caller.tenant });
    let path = format!("/internal/v1/sandboxes/{}/snapshot", r.sandbox);
    let t: ledger::PrivateTemplate =
        s.nodes.call_json(&r.node, &path, &body, Some(r.fence), Duration::from_secs(300)).await?;
    tracing::info!(tenant = %caller.tenant, session = %id, template = %t.name, "snapshot");
    Ok(wire::Snapshot { template: t.name, base_template: t.base, node: r.node, created_at: rfc3339(t.created_ms) })
}

/// `POST /v1/sessions/{id}/fork`: `count` new sessions starting from this one's filesystem.
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
        open(&s, &caller, create)
    });
    let mut sessions = Vec::new();
    for r in futures::future::join_all(opens).await {
        sessions.push(r?.1);
    }
    Ok((StatusCode::CREATED, Json(wire::Forked { template: snap.template, sessions })))
}

/// `DELETE /v1/templates/{name}`: a private template; its image goes once no sandbox uses it.
pub async fn delete_template(
    caller: Caller,
    State(s): State<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    if s.config.templates.contains_key(&name) {
        return Err(ApiError::Forbidden("configured templates are changed in the config file".into()));
    }
    match s.ledger.private_template(&name).await.map_err(ledger_down)? {
        Some(t) if t.tenant == caller.tenant => {}
        _ => return Err(ApiError::not_found(format!("no template {name:?}"))),
    }
    s.ledger.delete_private_template(&name).await.map_err(ledger_down)?;
    if let Some(node) = wire::ids::node_of(&name) {
        let path = format!("/internal/v1/templates/{name}");
        // Best effort now; the node prunes unused snapshot images on its own too.
        let _ = s.nodes.call(node, Method::DELETE, &path, None, None, Duration::from_secs(60)).await;
    }
    Ok(StatusCode::NO_CONTENT)
}

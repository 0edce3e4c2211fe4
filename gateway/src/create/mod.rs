//! `POST /v1/sessions`: validate, honour the session key, admit the request against the
//! caller's quotas, check a warm sandbox out of any node's pool, or wait (bounded) in one
//! node's queue for the next one to become ready.
//!
//! Rooms: here the route, the request's checks, the session key and the helpers both steps
//! share; `checkout` (placement, admission and the warm pools); `queue` (the wait in a node's
//! queue). The request's quota lease moves through `crate::lease`'s states.

mod checkout;
mod queue;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use http_util::{ApiError, Json};
use ledger::{Cost, LeaseSpec, PinClaim};
use telemetry::metrics::template_label;
use telemetry::names;
use wire::{CreateSession, ErrorCode, Session};

use crate::background::Background;
use crate::errors::{self, rfc3339};
use crate::lookup::{live, view};
use crate::{AppState, Caller};

const MAX_LABELS: usize = 64;

#[utoipa::path(post, path = "/v1/sessions", tag = "sessions", operation_id = "create_session", summary = "Open a session", request_body = wire::CreateSession, responses((status = 201, description = "A new session; `start` says whether its sandbox was warm.", body = wire::Session), (status = 200, description = "The live session that `session_key` already names.", body = wire::Session)))]
pub(crate) async fn create(
    caller: Caller,
    State(s): State<AppState>,
    Json(req): Json<CreateSession>,
) -> Result<Response, ApiError> {
    let (status, session) = open(&s, &caller, req).await?;
    Ok((status, Json(session)).into_response())
}

/// The session id on `node` of the create request with the random part `random` (one per
/// request, whichever node it lands on: the request's quota lease is named by it).
fn session_id(node: &str, random: &[u8; 16]) -> String {
    wire::ids::make(node, random)
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

fn validate_session_key(key: &str) -> Result<(), ApiError> {
    let ok = !key.is_empty()
        && key.len() <= 128
        && key.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request("session_key: must be 1-128 characters of letters, digits, '-', '_', '.', ':'"))
    }
}

/// A lifetime asked in seconds, capped by the template's; 0 is refused.
fn capped_ms(field: &str, asked_s: Option<u64>, max: Duration) -> Result<u64, ApiError> {
    let max = max.as_millis() as u64;
    match asked_s {
        Some(0) => Err(ApiError::bad_request(format!("{field}: must be at least 1"))),
        Some(t) => Ok(t.saturating_mul(1000).min(max)),
        None => Ok(max),
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

/// Resolves a template name for a caller: a configured template, one made from an image that
/// the caller may use, or one of the caller's private templates (snapshots), which lives on
/// one node.
pub(crate) async fn resolve_template(
    s: &AppState,
    caller: &Caller,
    name: &str,
) -> Result<(config::Template, Option<String>), ApiError> {
    if let Some(t) = s.config.templates.get(name) {
        return Ok((t.clone(), None));
    }
    let unknown = || ApiError::new(ErrorCode::UnknownTemplate, format!("template: no template named {name:?}"));
    if wire::images::is_image_template(name) {
        let (_, run) = crate::images::usable(s, caller, name).await?.ok_or_else(unknown)?;
        return Ok((run, None));
    }
    let private = s.ledger.private_template(name).await.map_err(errors::ledger)?.ok_or_else(unknown)?;
    if private.tenant != caller.tenant {
        return Err(unknown());
    }
    // A snapshot's base is the template its first sandbox ran: a configured one, or one made
    // from an image (the caller's own, or public), whose settings its copies keep.
    let base = if wire::images::is_image_template(&private.base) {
        crate::images::usable(s, caller, &private.base).await?.map(|(_, run)| run)
    } else {
        s.config.templates.get(&private.base).cloned()
    };
    let base = base.ok_or_else(unknown)?;
    let node = wire::ids::node_of(name).map(String::from);
    Ok((config::Template { name: name.to_string(), image: private.image, ..base }, node))
}

/// Opens a session: 201 with a new one, or 200 with the live one its `session_key` pins.
pub(crate) async fn open(s: &AppState, caller: &Caller, req: CreateSession) -> Result<(StatusCode, Session), ApiError> {
    let started = Instant::now();
    let (template, pinned) = resolve_template(s, caller, &req.template).await?;
    let ttl_ms = capped_ms("ttl_s", req.ttl_s, template.max_lifetime)?;
    let idle_ms = capped_ms("idle_timeout_s", req.idle_timeout_s, template.idle_timeout)?;
    validate_labels(&req.labels)?;
    let wait = wait_for(s, &req)?;
    if let Some(k) = &req.session_key {
        validate_session_key(k)?;
    }

    // The request's random part: its session's id on whichever node (`<node>.<hex>`), its
    // quota lease's name, and its session key's claim token, so a retry whose claimant's
    // gateway died can find the session that claim made.
    let random = rand::random::<[u8; 16]>();
    let hex = wire::ids::hex(&random);

    // The pin: the same tenant and key get the same live session.
    let claim = req.session_key.as_ref().map(|_| hex.clone());
    if let (Some(key), Some(claim)) = (&req.session_key, &claim) {
        for attempt in 0..2 {
            match s.ledger.pin_claim(&caller.tenant, key, claim, wait).await.map_err(errors::ledger)? {
                PinClaim::Claimed => break,
                PinClaim::Existing { session_id } => match live(s, caller, &session_id, true, 0).await {
                    Ok(r) => return Ok((StatusCode::OK, view(&r))),
                    // The pinned session has ended: replace the pin.
                    Err(e)
                        if attempt == 0
                            && matches!(
                                e.code,
                                ErrorCode::SessionGone | ErrorCode::SandboxFailed | ErrorCode::NotFound
                            ) =>
                    {
                        s.ledger.pin_forget(&caller.tenant, key, &session_id).await.map_err(errors::ledger)?;
                    }
                    Err(e) => return Err(e),
                },
                PinClaim::Pending { claim: theirs } => {
                    if let Some(made) = made_by_claim(s, caller, key, &theirs, ttl_ms).await? {
                        return Ok((StatusCode::OK, made));
                    }
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("session_key: a session for {key:?} is being created; retry"),
                    ));
                }
            }
        }
    }
    // The claim is ours until a session is pinned: any other end gives it up at once, even a
    // client that hangs up mid-create (the pending pin would otherwise refuse the key's
    // retries for the claim's whole life, the request's wait and a minute).
    let mut pin = PinGuard {
        ledger: s.ledger.clone(),
        work: s.work.clone(),
        claim: req.session_key.clone().zip(claim).map(|(key, claim)| (caller.tenant.clone(), key, claim)),
    };

    // Quota: once admitted, the request holds a lease for its session; the session takes it
    // over, and every other outcome gives it back (`lease`).
    let lease = ledger::session_lease(&hex);
    let cost = Cost::session(template.cpus, template.memory_mb).of_isolation(&template.runtime);
    let image = &template.image;
    let at =
        Attempt { req: &req, pinned: pinned.as_deref(), image, random, lease: &lease, cost, ttl_ms, idle_ms, wait };
    let (spec, grant, start) = checkout::checkout(s, caller, &at).await?.owned();
    if let Some(key) = &req.session_key {
        s.ledger.pin_set(&caller.tenant, key, &spec.session_id, ttl_ms).await.map_err(errors::ledger)?;
        pin.claim = None;
    }
    let node = wire::ids::node_of(&spec.session_id).unwrap_or_default().to_string();
    let body = Session {
        session_id: spec.session_id,
        sandbox_id: grant.sandbox_id,
        node,
        template: spec.template,
        start: Some(start),
        wait_ms: Some(started.elapsed().as_secs_f64() * 1000.0),
        expires_at: rfc3339(grant.expires_ms),
        max_expires_at: rfc3339(grant.hard_ms),
        created_at: rfc3339(grant.now_ms),
        session_key: spec.session_key,
        labels: spec.labels,
        paused: false,
        // A fresh sandbox is under its template's initial policy (sandboxes serve one session).
        egress: template.egress.as_ref().map(|e| e.initial.clone()),
        cpu_ms: None,
        cpu_throttled_ms: None,
    };
    let (label, start_label) = (template_label(&body.template).to_owned(), start.as_str());
    metrics::histogram!(names::SESSION_CHECKOUT, "template" => label.clone(), "start" => start_label)
        .record(started.elapsed().as_secs_f64());
    metrics::counter!(names::SESSIONS_CREATED, "template" => label, "start" => start_label).increment(1);
    tracing::info!(tenant = %caller.tenant, session = %body.session_id, sandbox = %body.sandbox_id, ?start, "session created");
    Ok((StatusCode::CREATED, body))
}

/// The live session a pending claim made, if there is one: the claim token is the random part
/// of the session's id (`open`), so the session is `<node>.<claim>` on one of the live nodes.
/// Found, the key is pinned to it (if still pending under that claim) and the retry gets it:
/// its creator's gateway died between the grant and `pin_set`, or is about to pin the same
/// session. Not found: the session is still being made (or never will be, and the claim
/// expires with its wait).
async fn made_by_claim(
    s: &AppState,
    caller: &Caller,
    key: &str,
    claim: &str,
    ttl_ms: u64,
) -> Result<Option<Session>, ApiError> {
    if wire::ids::node_of(&format!("n.{claim}")).is_none() {
        // Not hex, so no session id ends in it: nothing to look up. (A claim an older gateway
        // made, random hex of its own, simply finds no session.)
        return Ok(None);
    }
    for node in s.nodes.ids().await? {
        let id = format!("{node}.{claim}");
        match live(s, caller, &id, true, 0).await {
            Ok(r) => {
                s.ledger.pin_resolve(&caller.tenant, key, claim, &id, ttl_ms).await.map_err(errors::ledger)?;
                tracing::info!(tenant = %caller.tenant, session = %id, "a session key's retry found the session its pending claim made");
                return Ok(Some(view(&r)));
            }
            Err(e) if matches!(e.code, ErrorCode::NotFound) => {}
            // Made and already ended: pinned all the same, so the key's next use finds it ended
            // and claims anew (rather than waiting out the claim).
            Err(e) if matches!(e.code, ErrorCode::SessionGone | ErrorCode::SandboxFailed) => {
                s.ledger.pin_resolve(&caller.tenant, key, claim, &id, ttl_ms).await.map_err(errors::ledger)?;
                return Ok(None);
            }
            // Its node is down, or the ledger did not answer: not found here; the retry is
            // told to retry.
            Err(e) => tracing::debug!(session = %id, error = %e.message, "look for the session of a pending claim"),
        }
    }
    Ok(None)
}

/// A session key's pending claim (tenant, key, claim), abandoned when dropped still armed.
struct PinGuard {
    ledger: ledger::Ledger,
    work: Background,
    claim: Option<(String, String, String)>,
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        let Some((tenant, key, claim)) = self.claim.take() else { return };
        let ledger = self.ledger.clone();
        self.work.spawn_from_drop(async move {
            if let Err(e) = ledger.pin_abandon(&tenant, &key, &claim).await {
                tracing::warn!(error = %e, "abandon a session key claim");
            }
        });
    }
}

/// How long an undo of a grant is retried (a Redis restart, a cluster master's return).
const UNDO_GRANT_FOR: Duration = Duration::from_secs(120);

/// Undoes, retried in the background, a grant nobody will see: its create failed after
/// (or while) it was made. A dropped undo is a session nobody knows of, holding a sandbox
/// outside its tenant's quota count until its idle timeout (`sandpool-chaos` found them with
/// a Redis Cluster master killed). `ungrant` is a no-op when there is no such session, so a
/// checkout whose answer was lost is undone whether it granted or not.
/// The first try is made before the caller answers (its refusal then finds the pool whole).
pub(super) async fn undo_grant(s: &AppState, session_id: &str, tenant: &str) {
    if s.ledger.ungrant(session_id, tenant).await.is_ok() {
        return;
    }
    let (ledger, session_id, tenant) = (s.ledger.clone(), session_id.to_string(), tenant.to_string());
    let work = s.work.clone();
    s.work.spawn(async move {
        let until = Instant::now() + UNDO_GRANT_FOR;
        loop {
            match ledger.ungrant(&session_id, &tenant).await {
                Ok(_) => return,
                Err(e) if Instant::now() >= until => {
                    tracing::warn!(session = %session_id, error = %e, "undo a grant nobody saw: gave up");
                    return;
                }
                Err(_) => {}
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                // Shutdown: the session's idle timeout ends it (and gives its sandbox back).
                _ = work.cancelled() => {
                    tracing::warn!(session = %session_id, "undo a grant nobody saw: the gateway stops; the session's idle timeout ends it");
                    return;
                }
            }
        }
    });
}

/// One create request, as `checkout` tries it.
pub(super) struct Attempt<'a> {
    req: &'a CreateSession,
    /// The node of a private template.
    pinned: Option<&'a str>,
    /// The template's image (a pulled one makes placement prefer the nodes that hold it).
    image: &'a str,
    /// The random part of the session id, on whichever node.
    random: [u8; 16],
    /// The request's quota lease, and what it costs.
    lease: &'a str,
    cost: Cost,
    ttl_ms: u64,
    idle_ms: u64,
    wait: Duration,
}

impl Attempt<'_> {
    /// The lease of this request's session on `node`.
    fn spec(&self, tenant: &str, node: &str) -> LeaseSpec {
        LeaseSpec {
            session_id: session_id(node, &self.random),
            tenant: tenant.to_string(),
            template: self.req.template.clone(),
            ttl_ms: self.ttl_ms,
            idle_ms: self.idle_ms,
            labels: self.req.labels.clone(),
            session_key: self.req.session_key.clone(),
        }
    }
}

pub(super) fn record_wait(template: &str, since: Instant) {
    metrics::histogram!(names::SESSION_QUEUE_WAIT, "template" => template_label(template).to_owned())
        .record(since.elapsed().as_secs_f64());
}

/// Counts a create request refused with `code` (a `SESSION_REJECTIONS` cause).
pub(super) fn rejected(template: &str, code: &'static str) {
    metrics::counter!(names::SESSION_REJECTIONS, "template" => template_label(template).to_owned(), "code" => code)
        .increment(1);
}

/// 503 `unavailable` naming the cause (or the code the node asked for: a failed pull is 502
/// `image_pull_failed`), retry when the template's back-off ends (by Redis's clock).
pub(super) async fn unhealthy(
    s: &AppState,
    template: &str,
    cause: &str,
    until_ms: u64,
    code: Option<ErrorCode>,
) -> ApiError {
    let retry = match s.ledger.now_ms().await {
        Ok(now) => until_ms.saturating_sub(now).div_ceil(1000).max(1),
        Err(_) => 1,
    };
    let message = format!("template {template:?} cannot start sandboxes right now: {cause}");
    ApiError { retry_after_s: Some(retry), ..ApiError::new(code.unwrap_or(ErrorCode::Unavailable), message) }
}

//! `POST /v1/sessions`: validate, honour the session key, admit the request against the
//! caller's quotas, check a warm sandbox out of any node's pool, or wait (bounded) in one
//! node's queue for the next one to become ready.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use http_util::{ApiError, Json};
use ledger::{Checkout, Cost, LeaseSpec, Mail, PinClaim, QueueSpec};
use telemetry::metrics::template_label;
use telemetry::names;
use wire::{CreateSession, ErrorCode, Session, Start};

use crate::errors::{self, rfc3339};
use crate::lookup::{live, view};
use crate::nodes::NodeView;
use crate::placement;
use crate::quotas;
use crate::{AppState, Caller};

const MAX_LABELS: usize = 64;

#[utoipa::path(post, path = "/v1/sessions", tag = "sessions", operation_id = "create_session", summary = "Open a session", request_body = wire::CreateSession, responses((status = 201, description = "A new session; `start` says whether its sandbox was warm.", body = wire::Session), (status = 200, description = "The live session that `session_key` already names.", body = wire::Session)))]
pub async fn create(
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
    let base = s.config.templates.get(&private.base).ok_or_else(unknown)?;
    let node = wire::ids::node_of(name).map(String::from);
    Ok((config::Template { name: name.to_string(), image: private.image, ..base.clone() }, node))
}

/// What `checkout` got: the lease and how.
struct Leased {
    spec: LeaseSpec,
    grant: ledger::Grant,
    start: Start,
}

/// Opens a session: 201 with a new one, or 200 with the live one its `session_key` pins.
pub async fn open(s: &AppState, caller: &Caller, req: CreateSession) -> Result<(StatusCode, Session), ApiError> {
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
        claim: req.session_key.clone().zip(claim).map(|(key, claim)| (caller.tenant.clone(), key, claim)),
    };

    // Quota: once admitted, the request holds a lease for its session; the session takes it
    // over, and every other outcome gives it back.
    let lease = ledger::session_lease(&hex);
    let cost = Cost::session(template.cpus, template.memory_mb).of_isolation(&template.runtime);
    let mut held = quotas::Held::new(s, caller, &lease);
    let image = &template.image;
    let at =
        Attempt { req: &req, pinned: pinned.as_deref(), image, random, lease: &lease, cost, ttl_ms, idle_ms, wait };
    let leased = checkout(s, caller, at, &mut held).await;
    held.disarm();
    if leased.is_err() && held.is_admitted() {
        quotas::give_back(s, caller, &lease).await;
    }
    let Leased { spec, grant, start } = leased?;
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
    claim: Option<(String, String, String)>,
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        let Some((tenant, key, claim)) = self.claim.take() else { return };
        let ledger = self.ledger.clone();
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(async move {
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
async fn undo_grant(s: &AppState, session_id: &str, tenant: &str) {
    if s.ledger.ungrant(session_id, tenant).await.is_ok() {
        return;
    }
    let (ledger, session_id, tenant) = (s.ledger.clone(), session_id.to_string(), tenant.to_string());
    tokio::spawn(async move {
        let until = Instant::now() + UNDO_GRANT_FOR;
        loop {
            match ledger.ungrant(&session_id, &tenant).await {
                Ok(_) => return,
                Err(e) if Instant::now() >= until => {
                    tracing::warn!(session = %session_id, error = %e, "undo a grant nobody saw: gave up");
                    return;
                }
                Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        }
    });
}

/// One create request, as `checkout` tries it.
struct Attempt<'a> {
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

/// A warm sandbox from one of the request's node choices (or a node that reported idle ones);
/// else the request waits (bounded) in the queue of the first choice that admits it, while
/// still taking a sandbox that becomes idle on any other node (`wait_for_mail`): the queue is
/// per template across nodes.
async fn checkout(
    s: &AppState,
    caller: &Caller,
    at: Attempt<'_>,
    held: &mut quotas::Held<'_>,
) -> Result<Leased, ApiError> {
    let Attempt { req, pinned, image, random, lease, cost, ttl_ms, idle_ms, wait } = at;
    let views = match pinned {
        Some(node) => vec![NodeView { id: node.to_string(), stats: None }],
        None => s.nodes.views().await?,
    };
    if views.is_empty() {
        rejected(&req.template, "no_node");
        return Err(ApiError::unavailable("no live node has registered", 2));
    }
    s.waiters.arrived(&req.template);
    let k = s.config.gateway.placement_choices;
    let holders = holders(s, &views, image).await?;
    let order = placement::order(&views, &req.template, &holders, k);
    let spec_for = |node: &str| LeaseSpec {
        session_id: session_id(node, &random),
        tenant: caller.tenant.clone(),
        template: req.template.clone(),
        ttl_ms,
        idle_ms,
        labels: req.labels.clone(),
        session_key: req.session_key.clone(),
    };
    // Warm: the choices, best first. Without quotas the first choice is tried by the queueing
    // script below (which grants an idle sandbox first), so it is skipped here; with quotas
    // on, it is tried warm too, so only a request that will really wait takes a slot of its
    // principal's `queued` quota.
    let quotas_on = s.config.quotas.enabled;
    let wait_ms = wait.as_millis() as u64;
    let warm = placement::warm_candidates(&order, &views, &req.template, k);
    for node in warm.iter().filter(|n| quotas_on || **n != order[0]) {
        let spec = spec_for(node);
        let grant = if held.is_admitted() {
            s.ledger.checkout(node, &spec).await
        } else {
            // The quota admission and the first checkout go out together: one round trip for
            // both. A refused admission undoes the grant it raced (nobody has seen it).
            let admission = quotas::admit(s, caller, lease, cost.clone(), true, wait_ms, 0);
            let (admitted, grant) = tokio::join!(admission, s.ledger.checkout(node, &spec));
            if let Err(e) = admitted {
                // A grant, or a checkout whose answer was lost (it may have granted).
                if !matches!(grant, Ok(None)) {
                    undo_grant(s, &spec.session_id, &caller.tenant).await;
                }
                rejected(&req.template, "quota");
                return Err(e);
            }
            held.admitted();
            grant
        };
        match grant {
            Ok(Some(grant)) => return Ok(Leased { spec, grant, start: Start::Warm }),
            Ok(None) => {}
            Err(e) => {
                undo_grant(s, &spec.session_id, &caller.tenant).await;
                return Err(errors::ledger(e));
            }
        }
    }
    if !held.is_admitted() {
        // No node to try warm first (quotas off, or a single node): admit alone.
        if let Err(e) = quotas::admit(s, caller, lease, cost, true, wait_ms, 0).await {
            rejected(&req.template, "quota");
            return Err(e);
        }
        held.admitted();
    }
    // A waiting request holds a slot of its principal's `queued` quota at every level: one
    // tenant's flood fills its own share, not the queue everyone shares.
    if let Err(e) = quotas::enter_queue(s, caller, lease).await {
        rejected(&req.template, "quota");
        return Err(e);
    }
    let mut reg = s.waiters.register();
    let queued_at = Instant::now();
    let deadline = tokio::time::Instant::now() + wait;
    let mut order = order;
    loop {
        let (node, depth) = match enqueue(s, req, &order, &spec_for, &reg.id, wait).await? {
            Enqueued::Granted(spec, grant) => {
                held.disarm();
                quotas::leave_queue(s, caller, lease).await;
                return Ok(Leased { spec, grant, start: Start::Warm });
            }
            Enqueued::Queued { node, depth } => (node, depth),
        };
        held.queued(&node, &reg.id, &req.template);
        let waited = wait_for_mail(s, req, &node, &spec_for, &mut reg, deadline).await;
        let mail = match waited {
            Ok(Waited::Mail(mail)) => Some((node.clone(), mail)),
            Ok(Waited::Elsewhere(spec, grant)) => {
                held.disarm();
                quotas::leave_queue(s, caller, lease).await;
                record_wait(&req.template, queued_at);
                return Ok(Leased { spec, grant, start: Start::Cold });
            }
            // The node went down: the request moves to the live nodes (its place there is
            // given up first; a grant that raced that is still ours).
            Ok(Waited::NodeDown) => match s.ledger.dequeue(&node, &reg.id, &req.template, &caller.tenant).await {
                Ok(Some(mail)) => Some((node.clone(), mail)),
                Ok(None) => {
                    order = s.nodes.ids().await?;
                    if order.is_empty() {
                        None
                    } else {
                        tracing::info!(node = %node, template = %req.template, "a queued request leaves a node that went down");
                        reg = s.waiters.register();
                        continue;
                    }
                }
                Err(e) => {
                    quotas::leave_queue(s, caller, lease).await;
                    return Err(errors::ledger(e));
                }
            },
            Ok(Waited::Deadline) => None,
            Err(e) => {
                quotas::leave_queue(s, caller, lease).await;
                return Err(e);
            }
        };
        if matches!(mail, Some((_, Mail::Granted(_)))) {
            // The mail is ours: the session it may carry holds the lease from here on.
            held.disarm();
        }
        quotas::leave_queue(s, caller, lease).await;
        record_wait(&req.template, queued_at);
        let (node, mail) = match mail {
            Some(m) => m,
            // Deadline: give up our place; a sandbox granted meanwhile is still ours.
            None => {
                match s.ledger.dequeue(&node, &reg.id, &req.template, &caller.tenant).await.map_err(errors::ledger)? {
                    Some(mail) => (node, mail),
                    None => {
                        rejected(&req.template, "deadline");
                        return Err(ApiError::unavailable(
                            format!(
                                "no sandbox of template {:?} became free within {:.1}s ({depth} were waiting); retry",
                                req.template,
                                wait.as_secs_f64()
                            ),
                            2,
                        ));
                    }
                }
            }
        };
        return match mail {
            Mail::Granted(grant) => Ok(Leased { spec: spec_for(&node), grant, start: Start::Cold }),
            Mail::Failed { cause, until_ms, code } => {
                rejected(&req.template, "unhealthy");
                Err(unhealthy(s, &req.template, &cause, until_ms, code).await)
            }
        };
    }
}

fn record_wait(template: &str, since: Instant) {
    metrics::histogram!(names::SESSION_QUEUE_WAIT, "template" => template_label(template).to_owned())
        .record(since.elapsed().as_secs_f64());
}

/// What queueing a request found.
enum Enqueued {
    /// A sandbox was idle after all.
    Granted(LeaseSpec, ledger::Grant),
    Queued {
        node: String,
        depth: u64,
    },
}

/// Queues the request on the first node of `order` that admits it: a node that is down, or
/// says it has no room (node-side admission), or whose queue is full, sends it to the next.
/// With none left: 503 `unavailable` (every node down), 429 (a queue full) or 503 `node_full`
/// (no room anywhere), now rather than at the deadline.
async fn enqueue(
    s: &AppState,
    req: &CreateSession,
    order: &[String],
    spec_for: &(dyn Fn(&str) -> LeaseSpec + Sync),
    request_id: &str,
    wait: Duration,
) -> Result<Enqueued, ApiError> {
    let queue = QueueSpec {
        request_id,
        channel: &s.waiters.channel,
        max_len: s.config.gateway.max_queue,
        waiter_ttl_ms: (wait + Duration::from_secs(60)).as_millis() as u64,
    };
    let (mut full_depth, mut down) = (None, 0);
    for node in order {
        let spec = spec_for(node);
        match s.ledger.checkout_or_queue(node, &spec, &queue).await.map_err(errors::ledger)? {
            Checkout::Granted(grant) => return Ok(Enqueued::Granted(spec, grant)),
            Checkout::Queued { depth } => return Ok(Enqueued::Queued { node: node.clone(), depth }),
            Checkout::Empty => return Err(ApiError::internal("a queueing checkout answered empty")),
            Checkout::Full { depth } => full_depth = Some(depth),
            Checkout::Down => down += 1,
            Checkout::Refused { .. } => {}
            Checkout::Unhealthy { cause, until_ms, code } => {
                rejected(&req.template, "unhealthy");
                return Err(unhealthy(s, &req.template, &cause, until_ms, code).await);
            }
        }
    }
    if down == order.len() {
        // Every node it could go to stopped heartbeating since this gateway last looked.
        rejected(&req.template, "no_node");
        return Err(ApiError::unavailable("no live node: every node's heartbeat has lapsed; retry", 2));
    }
    if let Some(depth) = full_depth {
        rejected(&req.template, "queue_full");
        return Err(ApiError::too_many_requests(
            format!("{depth} requests already wait for template {:?}; retry later", req.template),
            2,
        ));
    }
    rejected(&req.template, "node_full");
    Err(ApiError {
        retry_after_s: Some(NODE_FULL_RETRY_S),
        ..ApiError::new(
            ErrorCode::NodeFull,
            format!(
                "every node is at its sandbox budget; no sandbox of template {:?} can be created now",
                req.template
            ),
        )
    })
}

/// `Retry-After` of a create refused because every node is full: sandboxes end and are
/// destroyed in seconds.
const NODE_FULL_RETRY_S: u64 = 5;

/// The nodes placement should prefer for `image`: those that hold it, when it is an image
/// nodes pull (a cold create with the image present is a fraction of one with a pull); held by
/// none, the image's rendezvous node, where a prefetch or the autoscaler would put it, so one
/// node pulls it.
async fn holders(s: &AppState, views: &[NodeView], image: &str) -> Result<HashSet<String>, ApiError> {
    if views.len() < 2 || wire::images::digest_of(image).is_none() {
        return Ok(HashSet::new());
    }
    let ids: Vec<String> = views.iter().map(|v| v.id.clone()).collect();
    let holding = s.ledger.holding(&ids, image).await.map_err(errors::ledger)?;
    let mut set: HashSet<String> = ids.iter().zip(holding).filter(|(_, h)| *h).map(|(n, _)| n.clone()).collect();
    if set.is_empty()
        && let Some(home) = wire::images::rendezvous(&ids, image)
    {
        set.insert(home.to_string());
    }
    Ok(set)
}

/// Counts a create request refused with `code` (a `SESSION_REJECTIONS` cause).
fn rejected(template: &str, code: &'static str) {
    metrics::counter!(names::SESSION_REJECTIONS, "template" => template_label(template).to_owned(), "code" => code)
        .increment(1);
}

/// How a wait in a node's queue ended.
enum Waited {
    Mail(Mail),
    /// A sandbox became idle on another node first, and this request took it.
    Elsewhere(LeaseSpec, ledger::Grant),
    /// The queue's node went down.
    NodeDown,
    Deadline,
}

/// Waits for this request's wake-up (polling its mailbox too, in case a wake-up was lost),
/// until `deadline`. Each poll also looks at the other live nodes: one that reports an idle
/// sandbox of the template is tried (the request leaves its queue when it gets one: a grant
/// that raced that is undone), and a queue node that went down ends the wait.
async fn wait_for_mail(
    s: &AppState,
    req: &CreateSession,
    node: &str,
    spec_for: &(dyn Fn(&str) -> LeaseSpec + Sync),
    reg: &mut crate::waiters::Registration<'_>,
    deadline: tokio::time::Instant,
) -> Result<Waited, ApiError> {
    let mut woken = false;
    loop {
        tokio::select! {
            _ = &mut reg.woken, if !woken => woken = true,
            _ = tokio::time::sleep(crate::waiters::MAILBOX_POLL) => {}
            _ = tokio::time::sleep_until(deadline) => return Ok(Waited::Deadline),
        }
        if let Some(mail) = s.ledger.take_mail(node, &reg.id).await.map_err(errors::ledger)? {
            return Ok(Waited::Mail(mail));
        }
        let views = s.nodes.views().await?;
        if !views.iter().any(|v| v.id == node) {
            return Ok(Waited::NodeDown);
        }
        let elsewhere = views
            .iter()
            .filter(|v| v.id != node && placement::idle_of(&views, &v.id, &req.template).is_some_and(|n| n > 0));
        for other in elsewhere {
            let spec = spec_for(&other.id);
            let grant = match s.ledger.checkout(&other.id, &spec).await {
                Ok(Some(grant)) => grant,
                Ok(None) => continue,
                Err(e) => {
                    undo_grant(s, &spec.session_id, &spec.tenant).await;
                    return Err(errors::ledger(e));
                }
            };
            let tenant = &spec.tenant;
            if let Some(Mail::Granted(_)) =
                s.ledger.dequeue(node, &reg.id, &req.template, tenant).await.map_err(errors::ledger)?
            {
                // Two sandboxes for one request: the queue's goes back (nobody has seen it).
                undo_grant(s, &spec_for(node).session_id, tenant).await;
            }
            return Ok(Waited::Elsewhere(spec, grant));
        }
    }
}

/// 503 `unavailable` naming the cause (or the code the node asked for: a failed pull is 502
/// `image_pull_failed`), retry when the template's back-off ends (by Redis's clock).
async fn unhealthy(s: &AppState, template: &str, cause: &str, until_ms: u64, code: Option<ErrorCode>) -> ApiError {
    let retry = match s.ledger.now_ms().await {
        Ok(now) => until_ms.saturating_sub(now).div_ceil(1000).max(1),
        Err(_) => 1,
    };
    let message = format!("template {template:?} cannot start sandboxes right now: {cause}");
    ApiError { retry_after_s: Some(retry), ..ApiError::new(code.unwrap_or(ErrorCode::Unavailable), message) }
}

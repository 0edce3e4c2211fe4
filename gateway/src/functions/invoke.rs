//! One invocation, start to end: a slot and an environment (warm, or a cold one made through
//! the create path), the node's call, and what goes back when it ends or its caller leaves.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::Method;
use http_util::ApiError;
use ledger::{Access, Env, FunctionDef, Lookup, Take};
use telemetry::names;
use wire::functions::{FunctionMode, Invocation, InvocationState};
use wire::internal::{InvokeAnswer, InvokeSpec, Outcome};
use wire::{CreateSession, ErrorBody, ErrorCode, Start};

use super::{ENV_LABEL, MAX_STALE_TRIES, START_ALLOWANCE, retire, unknown};
use crate::errors::{self};
use crate::lookup::live_active;
use crate::nodes::NodeRequest;
use crate::{AppState, Caller};

/// What one invocation produced, for any of the ways to invoke.
pub(crate) struct Invoked {
    pub outcome: Outcome,
    pub body: Bytes,
    pub start: Start,
    pub environment: String,
    pub duration_ms: f64,
}

impl Invoked {
    /// `handled`/`unhandled` for a function error.
    pub(super) fn function_error(&self) -> Option<&'static str> {
        match self.outcome {
            Outcome::Handled => Some("handled"),
            Outcome::Unhandled => Some("unhandled"),
            _ => None,
        }
    }

    /// Timeouts and crashes are errors of the call; the function's own errors are results.
    pub(super) fn as_error(&self) -> Option<ApiError> {
        let detail = || {
            serde_json::from_slice::<serde_json::Value>(&self.body)
                .ok()
                .map(|v| {
                    let msg = v["message"].as_str().unwrap_or_default().to_string();
                    match v["log"].as_str().filter(|l| !l.is_empty()) {
                        Some(log) => format!("{msg}; the end of its log: {log}"),
                        None => msg,
                    }
                })
                .unwrap_or_default()
        };
        match self.outcome {
            Outcome::Timeout => Some(ApiError::new(ErrorCode::FunctionTimeout, detail())),
            Outcome::Crashed => Some(ApiError::new(ErrorCode::FunctionCrashed, detail())),
            _ => None,
        }
    }
}

/// One invocation of the caller's function `name`, start to end (see the module doc), counted.
pub(crate) async fn invoke_one(s: &AppState, caller: &Caller, name: &str, payload: Bytes) -> Result<Invoked, ApiError> {
    let t0 = Instant::now();
    let (done, mode) = run_one(s, caller, name, payload).await;
    let mode = mode.map_or("unknown", FunctionMode::as_str);
    match &done {
        Ok(d) => {
            let start = d.start.as_str();
            metrics::counter!(names::FUNCTION_INVOCATIONS, "mode" => mode, "start" => start, "outcome" => d.outcome.as_str())
                .increment(1);
            metrics::histogram!(names::FUNCTION_DURATION, "mode" => mode, "start" => start)
                .record(t0.elapsed().as_secs_f64());
        }
        Err(e) if e.code != ErrorCode::TooManyRequests && e.code != ErrorCode::NotFound => {
            metrics::counter!(names::FUNCTION_INVOCATIONS, "mode" => mode, "start" => "none", "outcome" => "error")
                .increment(1);
        }
        Err(_) => {}
    }
    done
}

/// `invoke_one` itself; also answers the function's mode once known.
async fn run_one(
    s: &AppState,
    caller: &Caller,
    name: &str,
    payload: Bytes,
) -> (Result<Invoked, ApiError>, Option<FunctionMode>) {
    let mut mode = None;
    let done = run_one_in(s, caller, name, payload, &mut mode).await;
    (done, mode)
}

async fn run_one_in(
    s: &AppState,
    caller: &Caller,
    name: &str,
    payload: Bytes,
    mode: &mut Option<FunctionMode>,
) -> Result<Invoked, ApiError> {
    let inv = format!("{:032x}", rand::random::<u128>());
    let owner = caller.tenant.as_str();
    let extra_ms = START_ALLOWANCE.as_millis() as u64;
    let mut tries = 0;
    // Whatever the invocation holds goes back if its caller leaves (this future is dropped).
    let mut held = Held { s, owner, name, inv: &inv, slot: false, env: None, calling: false };
    let (env, start, answer) = loop {
        let take = s.ledger.env_take(owner, name, &inv, extra_ms).await.map_err(errors::ledger)?;
        let (def, env, stale) = match take {
            Take::Missing => return Err(unknown(name)),
            Take::Busy(def) => {
                metrics::counter!(names::FUNCTION_REFUSALS, "reason" => "concurrency").increment(1);
                return Err(ApiError::too_many_requests(
                    format!("function {name:?} is at its max_concurrency of {}", def.max_concurrency),
                    1,
                ));
            }
            Take::Taken { def, env, stale } => (def, env, stale),
        };
        held.slot = true;
        held.env = env.clone();
        *mode = Some(def.mode);
        retire(s, owner, stale);
        // The session must outlive the invocation: held that long past its idle timeout, and
        // settled after it (so `env_idle_s` counts from the invocation's end).
        let budget_ms = def.timeout_ms + extra_ms;
        let hold_ms = budget_ms.saturating_sub(def.env_idle_s * 1000);
        if let Some(mut env) = env {
            if tries >= MAX_STALE_TRIES {
                // Enough dead ones found: this one goes too, and the invocation starts cold.
                retire(s, owner, vec![env.session.clone()]);
                s.ledger.env_forget(owner, name, &env.session).await.map_err(errors::ledger)?;
                held.env = None;
            } else {
                // Fast: the environment's own sandbox and fence, no lookup first, when its
                // session cannot end before the invocation does (idle so far + the call's
                // longest time within its idle timeout); the session is touched after.
                let fast = !env.sandbox.is_empty() && env.idle_ms + budget_ms < def.env_idle_s * 1000;
                let target = if fast {
                    Some(Target::of(&env))
                } else {
                    live_active(s, caller, &env.session, Access::Owner, hold_ms).await.ok().map(|r| {
                        env.sandbox = r.sandbox.clone();
                        env.fence = r.fence;
                        Target::of(&env)
                    })
                };
                if let Some(t) = target {
                    held.calling = true;
                    let answer = call_node(s, &def, &t, &payload).await;
                    held.calling = false;
                    let gone = matches!(&answer, Err(e) if matches!(
                        e.code,
                        ErrorCode::NotFound | ErrorCode::SessionGone | ErrorCode::SandboxFailed | ErrorCode::StaleFence
                    ));
                    if !gone {
                        break (env, Start::Warm, answer);
                    }
                }
                // Ended behind the function's back (idle timeout, lifetime, a delete, a
                // failed sandbox): forget it and take the next.
                tracing::debug!(session = %env.session, "a function environment has ended");
                s.ledger.env_forget(owner, name, &env.session).await.map_err(errors::ledger)?;
                held.env = None;
                tries += 1;
                continue;
            }
        }
        match cold_environment(s, caller, &def, hold_ms).await {
            Ok(env) => {
                metrics::counter!(names::FUNCTION_ENVIRONMENTS_MADE, "why" => "demand").increment(1);
                (held.env, held.calling) = (Some(env.clone()), true);
                let answer = call_node(s, &def, &Target::of(&env), &payload).await;
                break (env, Start::Cold, answer);
            }
            Err(e) => {
                held.disarm();
                if let Err(le) = s.ledger.env_slot_free(owner, name, &inv).await {
                    tracing::warn!(error = %le, "free an invocation slot (it ends by itself)");
                }
                s.slots.freed(owner, name);
                return Err(e);
            }
        }
    };

    // From here the invocation gives back what it holds itself (a drop during `env_put` is
    // covered by the slot's own expiry).
    held.disarm();
    let used = Env { uses: env.uses + 1, ..env };
    let keep = matches!(&answer, Ok((head, _)) if head.outcome == Outcome::Ok);
    let busy_ms = answer.as_ref().map_or(0.0, |(h, _)| h.duration_ms);
    let put = s.ledger.env_put(owner, name, &inv, &used, keep, busy_ms);
    // A kept environment's session is settled as it goes back: its idle clock restarts at the
    // moment the idle entry's does, which the warm path's check relies on.
    let kept = if keep {
        // Two slots, two scripts, sent together: one round trip.
        let (kept, settled) = tokio::join!(put, s.ledger.settle(&used.session, owner));
        match settled {
            Ok(Lookup::Live(_)) => {}
            Ok(_) => tracing::debug!(session = %used.session, "an environment ended during its invocation"),
            Err(e) => tracing::warn!(error = %e, "settle an environment's session (its hold ends by itself)"),
        }
        kept
    } else {
        put.await
    }
    .map_err(errors::ledger)?;
    s.slots.freed(owner, name);
    if !kept {
        retire(s, owner, vec![used.session.clone()]);
    }
    let (head, result) = answer?;
    // A worker started for a warm sandbox is still a cold invocation.
    let start = if head.cold_worker { Start::Cold } else { start };
    Ok(Invoked { outcome: head.outcome, body: result, start, environment: used.session, duration_ms: head.duration_ms })
}

/// What an invocation holds until it gives it back: its concurrency slot (`env_take`), and the
/// environment it took or made. Dropped still armed (its caller left, so axum dropped the
/// handler), it gives them back at once, in the background: without it the slot stayed taken
/// until the function's timeout and `START_ALLOWANCE` passed, and the environment was neither
/// idle nor retired until its session's idle timeout. An environment whose call was under way
/// is retired (the function may still be running in it; a node call dropped mid-way does not
/// say how far it got); one taken but not yet called goes back to the idle list.
struct Held<'a> {
    s: &'a AppState,
    owner: &'a str,
    name: &'a str,
    inv: &'a str,
    /// `env_take` gave the invocation a slot.
    slot: bool,
    env: Option<Env>,
    /// The node is being called in `env`.
    calling: bool,
}

impl Held<'_> {
    /// The invocation gives back what it holds itself from here.
    fn disarm(&mut self) {
        self.slot = false;
        self.env = None;
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if !self.slot {
            return;
        }
        let (s, owner, name, inv) =
            (self.s.clone(), self.owner.to_string(), self.name.to_string(), self.inv.to_string());
        let (env, keep) = (self.env.take(), !self.calling);
        let work = self.s.work.clone();
        work.spawn_from_drop(async move {
            let r = match &env {
                Some(env) => s.ledger.env_put(&owner, &name, &inv, env, keep, 0.0).await,
                None => s.ledger.env_slot_free(&owner, &name, &inv).await.map(|()| false),
            };
            s.slots.freed(&owner, &name);
            match r {
                Ok(true) => tracing::info!(function = %name, "an invocation's caller left: its slot and environment are back"),
                Ok(false) => {
                    tracing::info!(function = %name, "an invocation's caller left: its slot is back, its environment retired");
                    if let Some(env) = env {
                        retire(&s, &owner, vec![env.session]);
                    }
                }
                Err(e) => tracing::warn!(function = %name, error = %e, "give back what a left invocation held (its slot expires by itself)"),
            }
        });
    }
}

/// Where an invocation runs.
struct Target {
    node: String,
    sandbox: String,
    fence: u64,
}

impl Target {
    fn of(env: &Env) -> Target {
        let node = wire::ids::node_of(&env.session).unwrap_or_default().to_string();
        Target { node, sandbox: env.sandbox.clone(), fence: env.fence }
    }
}

/// The node runs the invocation: its answer's head and the result.
async fn call_node(
    s: &AppState,
    def: &FunctionDef,
    t: &Target,
    payload: &Bytes,
) -> Result<(InvokeAnswer, Bytes), ApiError> {
    let spec = InvokeSpec {
        function: format!("{}|{}|{}", def.owner, def.name, def.version),
        mode: def.mode,
        handler: def.handler.clone(),
        env: def.env.clone(),
        timeout_ms: def.timeout_ms,
        max_result_bytes: s.config.gateway.max_invoke_bytes,
    };
    let mut body = serde_json::to_vec(&spec).map_err(|e| ApiError::internal(format!("encode: {e}")))?;
    body.push(b'\n');
    body.extend_from_slice(payload);
    let path = format!("/internal/v1/sandboxes/{}/invoke", t.sandbox);
    let timeout = Duration::from_millis(def.timeout_ms) + START_ALLOWANCE;
    let call =
        NodeRequest::new(Method::POST, path, timeout).fence(t.fence).body(body.into(), "application/octet-stream");
    let bytes = s.nodes.call(&t.node, call).await?;
    let nl = bytes
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| ApiError::bad_gateway("the node answered badly", "no head line"))?;
    let head: InvokeAnswer = serde_json::from_slice(&bytes[..nl])
        .map_err(|e| ApiError::bad_gateway("the node answered badly", e.to_string()))?;
    Ok((head, bytes.slice(nl + 1..)))
}

/// A new environment: a session of the function's template, labelled as the function's.
pub(super) async fn cold_environment(
    s: &AppState,
    caller: &Caller,
    def: &FunctionDef,
    hold_ms: u64,
) -> Result<Env, ApiError> {
    let req = CreateSession {
        template: def.template.clone(),
        idle_timeout_s: Some(def.env_idle_s),
        labels: BTreeMap::from([(ENV_LABEL.to_string(), def.name.clone())]),
        ..Default::default()
    };
    let (_, session) = crate::create::open(s, caller, req).await?;
    let r = live_active(s, caller, &session.session_id, Access::Owner, hold_ms).await?;
    Ok(Env {
        session: session.session_id,
        version: def.version,
        uses: 0,
        sandbox: r.sandbox,
        fence: r.fence,
        idle_ms: 0,
    })
}

/// `invoke_one`, waiting for a slot of a function at its concurrency until `until`: woken
/// when an invocation of it ends at this gateway, else polling (a slot freed elsewhere).
pub(super) async fn invoke_waiting(
    s: &AppState,
    caller: &Caller,
    name: &str,
    payload: Bytes,
    until: Instant,
) -> Result<Invoked, ApiError> {
    let notify = s.slots.notify(&caller.tenant, name);
    let mut pause = Duration::from_millis(5);
    loop {
        let woken = notify.notified();
        match invoke_one(s, caller, name, payload.clone()).await {
            Err(e) if e.code == ErrorCode::TooManyRequests && Instant::now() < until => {
                let left = until.saturating_duration_since(Instant::now());
                tokio::select! {
                    _ = woken => {}
                    _ = tokio::time::sleep(pause.min(left)) => pause = (pause * 2).min(Duration::from_millis(100)),
                }
            }
            other => return other,
        }
    }
}

/// A result as JSON: itself when it parses as JSON, else a string (base64 if not UTF-8).
pub(super) fn result_value(bytes: &[u8]) -> (serde_json::Value, Option<String>) {
    if let Ok(v) = serde_json::from_slice(bytes) {
        return (v, None);
    }
    match std::str::from_utf8(bytes) {
        Ok(t) => (serde_json::Value::String(t.to_string()), None),
        Err(_) => (serde_json::Value::String(wire::b64_encode(bytes)), Some("base64".into())),
    }
}

/// Fills `inv` with how the invocation ended.
pub(super) fn finish(inv: &mut Invocation, done: Result<Invoked, ApiError>) {
    inv.state = InvocationState::Done;
    match done {
        Ok(d) => match d.as_error() {
            Some(e) => {
                inv.status = Some(http_util::status_of(e.code).as_u16());
                inv.result = Some(serde_json::json!({"code": e.code, "message": e.message}));
            }
            None => {
                inv.status = Some(200);
                inv.function_error = d.function_error().map(String::from);
                inv.start = Some(d.start);
                inv.duration_ms = Some(d.duration_ms);
                let (v, enc) = result_value(&d.body);
                inv.result = Some(v);
                inv.result_encoding = enc;
            }
        },
        Err(e) => {
            inv.status = Some(http_util::status_of(e.code).as_u16());
            let body = ErrorBody { code: e.code, message: e.message, request_id: None, quota: e.quota };
            inv.result = serde_json::to_value(body).ok();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_are_json_when_they_parse() {
        assert_eq!(result_value(br#"{"ok":1}"#), (serde_json::json!({"ok": 1}), None));
        assert_eq!(result_value(b"plain"), (serde_json::json!("plain"), None));
        assert_eq!(result_value(&[0xff, 0x00]), (serde_json::json!("/wA="), Some("base64".into())));
    }
}

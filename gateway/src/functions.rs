//! Functions: definitions, invocations (synchronous, asynchronous, mapped over a batch) and
//! the environments they run in.
//!
//! An invocation takes a concurrency slot and the warmest idle environment of its function in
//! one ledger script (`env_take`); with none idle it opens a session of the function's
//! template (the ordinary create path: quotas, warm pools, queues) as a new environment. The
//! node runs the handler (`pool_manager::functions`) and says how it ended; a result keeps the
//! environment for the next invocation (`env_put`), anything else retires it, so no state of a
//! failed invocation survives. An environment is a session of the function's owner, labelled
//! `sandpool.function`; it ends at the function's `env_idle_s` like any idle session, which is
//! how a function scales to zero.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use http_util::{ApiError, Json};
use ledger::{Access, Cost, Env, FunctionDef, Lookup, Take};
use serde::Deserialize;
use telemetry::names;
use wire::functions::{
    self as f, EnvironmentCounts, Function, FunctionList, FunctionMode, Invocation, InvocationAccepted,
    InvocationState, PutFunction,
};
use wire::internal::{InvokeAnswer, InvokeSpec, Outcome};
use wire::{CreateSession, ErrorBody, ErrorCode, Start};

use crate::errors::{self, rfc3339};
use crate::lookup::live_active;
use crate::nodes::NodeRequest;
use crate::page::{Kind, PageQuery};
use crate::{AppState, Caller};

/// The label that marks a session as a function's environment.
pub const ENV_LABEL: &str = "sandpool.function";
/// Beyond the function's timeout: a cold start (a session, a worker's `READY`) and the relay.
const START_ALLOWANCE: Duration = Duration::from_secs(45);
/// Environments found dead (ended behind the function's back) before an invocation gives up
/// on warm ones and starts a cold one.
const MAX_STALE_TRIES: usize = 4;
/// Payloads one map call may carry.
pub const MAX_MAP_ITEMS: usize = 10_000;
/// How long a mapped payload waits for a free slot of its function before it fails with 429.
const MAP_SLOT_WAIT: Duration = Duration::from_secs(60);

/// How long a function's lease may exist without its function before `sweep` looks.
const LEASE_DEADLINE_MS: u64 = 10_000;
/// `Retry-After` of an asynchronous invocation refused for want of a slot of this gateway.
const ASYNC_RETRY_S: u64 = 1;

/// Gives `lease` back unless what it stands for exists (a store that failed at an unknown
/// point); a failure is left to the sweep.
async fn settle(s: &AppState, caller: &Caller, lease: &str) {
    if !s.config.quotas.enabled {
        return;
    }
    if let Err(e) = s.ledger.quota_settle(wire::quotas::top(&caller.tenant), lease).await {
        tracing::warn!(error = %e, lease, "settle a quota lease (the sweep will)");
    }
}

fn unknown(name: &str) -> ApiError {
    ApiError::not_found(format!("no function {name:?}"))
}

fn check_name(name: &str) -> Result<(), ApiError> {
    match f::name_problem(name) {
        Some(p) => Err(ApiError::bad_request(format!("name: {p}"))),
        None => Ok(()),
    }
}

/// The definition a `PUT` asks for, checked and resolved.
async fn resolve(s: &AppState, caller: &Caller, name: &str, req: PutFunction) -> Result<FunctionDef, ApiError> {
    check_name(name)?;
    let (template, _) = crate::create::resolve_template(s, caller, &req.template).await?;
    if template.exec != wire::ExecMode::Agent {
        return Err(ApiError::bad_request(format!(
            "template: {:?} runs commands by docker exec; functions need an agent-mode template",
            req.template
        )));
    }
    if req.handler.is_empty() || req.handler[0].is_empty() {
        return Err(ApiError::bad_request("handler: must name a program"));
    }
    if req.handler.len() > f::MAX_HANDLER_ARGS {
        return Err(ApiError::bad_request(format!("handler: at most {} arguments", f::MAX_HANDLER_ARGS)));
    }
    crate::limits::size("handler", req.handler.iter().map(String::len).sum(), f::MAX_HANDLER_BYTES)?;
    if req.handler.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::bad_request("handler: may not contain NUL"));
    }
    // Every gateway's keeper reads every function every second: bounded.
    crate::limits::env(&req.env)?;
    let max_timeout = config::MAX_EXEC_TIMEOUT.as_millis() as u64;
    let timeout_ms = req.timeout_ms.unwrap_or(f::DEFAULT_TIMEOUT_MS);
    if timeout_ms == 0 || timeout_ms > max_timeout {
        return Err(ApiError::bad_request(format!("timeout_ms: must be 1 ..= {max_timeout}")));
    }
    let max_concurrency = req.max_concurrency.unwrap_or(f::DEFAULT_MAX_CONCURRENCY);
    if !(1..=f::MAX_CONCURRENCY).contains(&max_concurrency) {
        return Err(ApiError::bad_request(format!("max_concurrency: must be 1 ..= {}", f::MAX_CONCURRENCY)));
    }
    let min_warm = req.min_warm.unwrap_or(0);
    if min_warm > f::MAX_MIN_WARM.min(max_concurrency) {
        return Err(ApiError::bad_request(format!(
            "min_warm: at most {} and at most max_concurrency",
            f::MAX_MIN_WARM
        )));
    }
    let max_env_invocations = req.max_env_invocations.unwrap_or(f::DEFAULT_MAX_ENV_INVOCATIONS);
    if !(1..=1_000_000_000).contains(&max_env_invocations) {
        return Err(ApiError::bad_request("max_env_invocations: must be 1 ..= 1000000000"));
    }
    let env_idle_s = match req.env_idle_s {
        Some(0) => return Err(ApiError::bad_request("env_idle_s: must be at least 1")),
        asked => asked.unwrap_or(f::DEFAULT_ENV_IDLE_S).min(template.idle_timeout.as_secs().max(1)),
    };
    let def = FunctionDef {
        name: name.to_string(),
        owner: caller.tenant.clone(),
        template: req.template,
        mode: req.mode,
        handler: req.handler,
        env: req.env,
        timeout_ms,
        max_concurrency,
        min_warm,
        max_env_invocations,
        env_idle_s,
        version: 0,
        created_ms: 0,
        updated_ms: 0,
    };
    let stored = serde_json::to_vec(&def).map_err(|e| ApiError::internal(format!("encode: {e}")))?;
    crate::limits::size("definition", stored.len(), wire::limits::MAX_FUNCTION_DEFINITION_BYTES)?;
    Ok(def)
}

fn view(d: FunctionDef, environments: Option<EnvironmentCounts>) -> Function {
    Function {
        name: d.name,
        owner: d.owner,
        template: d.template,
        mode: d.mode,
        handler: d.handler,
        env: d.env,
        timeout_ms: d.timeout_ms,
        max_concurrency: d.max_concurrency,
        min_warm: d.min_warm,
        max_env_invocations: d.max_env_invocations,
        env_idle_s: d.env_idle_s,
        version: d.version,
        created_at: rfc3339(d.created_ms),
        updated_at: rfc3339(d.updated_ms),
        environments,
    }
}

/// Ends retired environments' sessions, off the caller's path.
fn retire(s: &AppState, owner: &str, sessions: Vec<String>) {
    if sessions.is_empty() {
        return;
    }
    let (s, owner) = (s.clone(), owner.to_string());
    tokio::spawn(async move {
        for id in sessions {
            if let Err(e) = crate::lifecycle::end_session(&s, &owner, &id).await {
                tracing::warn!(session = %id, error = %e.message, "retire a function environment");
            }
        }
    });
}

#[utoipa::path(put, path = "/v1/functions/{name}", tag = "functions", operation_id = "put_function", summary = "Create or replace a function", params(("name" = String, Path, description = "1-64 lowercase letters, digits, '-', '_'.")), request_body = wire::functions::PutFunction, responses((status = 201, description = "Created (version 1).", body = wire::functions::Function), (status = 200, description = "Replaced: the version is one more; environments of the old one are retired.", body = wire::functions::Function)))]
pub async fn put(
    caller: Caller,
    State(s): State<AppState>,
    Path(name): Path<String>,
    Json(req): Json<PutFunction>,
) -> Result<Response, ApiError> {
    let def = resolve(&s, &caller, &name, req).await?;
    // A function holds one unit of its owner's `functions` quota while it exists (admission
    // is idempotent: a replacement holds the same lease).
    let lease = ledger::function_lease(&caller.tenant, &name);
    let cost = Cost { functions: 1, ..Cost::default() };
    crate::quotas::admit(&s, &caller, &lease, cost, false, LEASE_DEADLINE_MS, 0).await?;
    let (stored, stale) = match s.ledger.function_put(&def).await {
        Ok(put) => put,
        Err(e) => {
            settle(&s, &caller, &lease).await;
            return Err(errors::ledger(e));
        }
    };
    s.ledger.functions_index_add(&stored.owner, &stored.name).await.map_err(errors::ledger)?;
    retire(&s, &caller.tenant, stale);
    tracing::info!(tenant = %caller.tenant, function = %name, version = stored.version, "function stored");
    let status = if stored.version == 1 { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(view(stored, None))).into_response())
}

#[utoipa::path(get, path = "/v1/functions/{name}", tag = "functions", operation_id = "get_function", summary = "Read a function and its environments", params(("name" = String, Path, description = "The function's name.")), responses((status = 200, description = "The function, with its environments right now.", body = wire::functions::Function)))]
pub async fn get(
    caller: Caller,
    State(s): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Function>, ApiError> {
    let def =
        s.ledger.function_get(&caller.tenant, &name).await.map_err(errors::ledger)?.ok_or_else(|| unknown(&name))?;
    let c = s.ledger.env_counts(&caller.tenant, &name).await.map_err(errors::ledger)?;
    let counts = EnvironmentCounts { total: c.total, idle: c.idle, in_flight: c.in_flight };
    Ok(Json(view(def, Some(counts))))
}

#[utoipa::path(get, path = "/v1/functions", tag = "functions", operation_id = "list_functions", summary = "List the caller's functions", params(PageQuery), responses((status = 200, description = "A page of the caller's own functions, by name; `next_cursor` when more follow.", body = wire::functions::FunctionList)))]
pub async fn list(
    caller: Caller,
    State(s): State<AppState>,
    http_util::Query(q): http_util::Query<PageQuery>,
) -> Result<Json<FunctionList>, ApiError> {
    let page = q.page(Kind::Functions)?;
    let defs = s.ledger.function_list(&caller.tenant).await.map_err(errors::ledger)?;
    let (defs, next_cursor) = page.take(Kind::Functions, defs, |d| d.name.clone());
    Ok(Json(FunctionList { functions: defs.into_iter().map(|d| view(d, None)).collect(), next_cursor }))
}

#[utoipa::path(delete, path = "/v1/functions/{name}", tag = "functions", operation_id = "delete_function", summary = "Delete a function", params(("name" = String, Path, description = "The function's name.")), responses((status = 204, description = "Deleted; its environments end (invocations in flight finish first).")))]
pub async fn delete(
    caller: Caller,
    State(s): State<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    let envs =
        s.ledger.function_delete(&caller.tenant, &name).await.map_err(errors::ledger)?.ok_or_else(|| unknown(&name))?;
    crate::quotas::give_back(&s, &caller, &ledger::function_lease(&caller.tenant, &name)).await;
    s.ledger.functions_index_remove(&caller.tenant, &name).await.map_err(errors::ledger)?;
    retire(&s, &caller.tenant, envs);
    tracing::info!(tenant = %caller.tenant, function = %name, "function deleted");
    Ok(StatusCode::NO_CONTENT)
}

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
    fn function_error(&self) -> Option<&'static str> {
        match self.outcome {
            Outcome::Handled => Some("handled"),
            Outcome::Unhandled => Some("unhandled"),
            _ => None,
        }
    }

    /// Timeouts and crashes are errors of the call; the function's own errors are results.
    fn as_error(&self) -> Option<ApiError> {
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
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(async move {
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

/// Invocations of this gateway waiting for a function's slot, woken when one of its
/// invocations here ends (slots freed by other gateways are found by polling).
pub struct Slots {
    by_function: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Notify>>>,
    /// Asynchronous invocations running here (`gateway.max_async_in_flight`).
    running_async: Arc<tokio::sync::Semaphore>,
    max_async: usize,
    /// The slots each top-level tenant holds here: at most `async_share` (a quarter), whatever
    /// its `async_in_flight` quota (counted over all gateways) allows, and with quotas off.
    async_by_tenant: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    async_share: usize,
}

/// Why an asynchronous slot of this gateway was refused.
enum NoSlot {
    /// The tenant holds its share of them.
    Share,
    /// All of them are taken.
    Full,
}

/// One asynchronous invocation's slot of this gateway, counted against its tenant's share
/// until dropped.
struct AsyncSlot {
    slots: Arc<Slots>,
    top: String,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for AsyncSlot {
    fn drop(&mut self) {
        let mut m = self.slots.async_by_tenant.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.top) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.top);
            }
        }
    }
}

impl Slots {
    pub fn new(max_async: usize) -> Slots {
        Slots {
            by_function: Default::default(),
            running_async: Arc::new(tokio::sync::Semaphore::new(max_async)),
            max_async,
            async_by_tenant: Default::default(),
            async_share: (max_async / 4).max(1),
        }
    }

    /// A slot for an asynchronous invocation of the top-level tenant `top`, within its share.
    fn take_async(self: &Arc<Self>, top: &str) -> Result<AsyncSlot, NoSlot> {
        // The lock is held across the try-acquire (no await): count and permit agree.
        let mut m = self.async_by_tenant.lock().unwrap_or_else(|p| p.into_inner());
        let held = m.get(top).copied().unwrap_or(0);
        if held >= self.async_share {
            return Err(NoSlot::Share);
        }
        let permit = self.running_async.clone().try_acquire_owned().map_err(|_| NoSlot::Full)?;
        m.insert(top.to_string(), held + 1);
        Ok(AsyncSlot { slots: self.clone(), top: top.to_string(), _permit: permit })
    }

    fn notify(&self, owner: &str, name: &str) -> Arc<tokio::sync::Notify> {
        let mut m = self.by_function.lock().unwrap_or_else(|p| p.into_inner());
        // Drop the entries nobody waits on, now and then.
        if m.len() > 4096 {
            m.retain(|_, n| Arc::strong_count(n) > 1);
        }
        m.entry(format!("{owner}|{name}")).or_default().clone()
    }

    /// A slot of the function was freed here: one waiter may take it.
    fn freed(&self, owner: &str, name: &str) {
        let n = self.by_function.lock().unwrap_or_else(|p| p.into_inner()).get(&format!("{owner}|{name}")).cloned();
        if let Some(n) = n {
            n.notify_one();
        }
    }
}

/// A new environment: a session of the function's template, labelled as the function's.
async fn cold_environment(s: &AppState, caller: &Caller, def: &FunctionDef, hold_ms: u64) -> Result<Env, ApiError> {
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

/// How often the keeper looks at every function.
const KEEP_EVERY: Duration = Duration::from_secs(1);
/// Environments one function gets per keeper turn (cold starts ahead of demand are spread).
const KEEP_CREATES_PER_TURN: u32 = 4;

/// The keeper: once a second, every function gets the environments its load asks for
/// (`autoscaler::functions`: Little's law on its completions and busy time, at least
/// `min_warm`), made ahead of demand through the ordinary create path, and its idle ones up to
/// that count stay warm (their idle clocks restart); beyond it, idle environments end at
/// `env_idle_s`. Every gateway runs it; a per-function turn in the ledger lets one act per
/// second.
pub async fn keep(s: AppState, cancel: tokio_util::sync::CancellationToken) {
    let mut seen: std::collections::HashMap<String, Measured> = Default::default();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(KEEP_EVERY) => {}
        }
        let all = match s.ledger.functions_all().await {
            Ok(all) => all,
            Err(e) => {
                tracing::debug!(error = %e, "function keeper: list functions");
                continue;
            }
        };
        seen.retain(|id, _| all.iter().any(|(o, n)| format!("{o}|{n}") == *id));
        for (owner, name) in all {
            let m = seen.entry(format!("{owner}|{name}")).or_default();
            if let Err(e) = keep_one(&s, &owner, &name, m).await {
                tracing::debug!(%owner, function = %name, error = %e.message, "function keeper");
            }
        }
    }
}

/// What the keeper measured of one function.
#[derive(Default)]
struct Measured {
    last: Option<(Instant, u64, f64)>,
    rate: Option<f64>,
    duration_s: Option<f64>,
}

impl Measured {
    /// Folds in the function's counters (completions, busy ms) read now.
    fn observe(&mut self, done: u64, busy_ms: f64) -> autoscaler::functions::Load {
        use autoscaler::functions::smooth;
        let now = Instant::now();
        if let Some((t, d0, b0)) = self.last {
            let dt = now.duration_since(t).as_secs_f64().max(0.001);
            let n = done.saturating_sub(d0);
            self.rate = Some(smooth(self.rate, n as f64 / dt, 0.5));
            if n > 0 {
                self.duration_s = Some(smooth(self.duration_s, (busy_ms - b0).max(0.0) / 1000.0 / n as f64, 0.5));
            }
        }
        self.last = Some((now, done, busy_ms));
        autoscaler::functions::Load { rate: self.rate.unwrap_or(0.0), duration_s: self.duration_s.unwrap_or(0.0) }
    }
}

async fn keep_one(s: &AppState, owner: &str, name: &str, m: &mut Measured) -> Result<(), ApiError> {
    let Some(def) = s.ledger.function_get(owner, name).await.map_err(errors::ledger)? else {
        s.ledger.functions_index_remove(owner, name).await.map_err(errors::ledger)?;
        return Ok(());
    };
    let (done, busy_ms) = s.ledger.function_stats(owner, name).await.map_err(errors::ledger)?;
    let load = m.observe(done, busy_ms);
    let turn_ms = KEEP_EVERY.as_millis() as u64 - 100;
    if !s.ledger.keeper_turn(owner, name, turn_ms).await.map_err(errors::ledger)? {
        return Ok(());
    }
    let target = autoscaler::functions::environments(load, def.min_warm, def.max_concurrency);
    let (kept, stale) = s.ledger.env_refresh(owner, name, target).await.map_err(errors::ledger)?;
    retire(s, owner, stale);
    for session in &kept {
        // A touch, not a settle: one taken since the refresh may hold its session for a call.
        if let Err(e) = s.ledger.lookup_hold(session, owner, true, 0).await {
            tracing::debug!(%session, error = %e, "keep an environment warm");
        }
    }
    let counts = s.ledger.env_counts(owner, name).await.map_err(errors::ledger)?;
    // Warm environments serving an invocation are in `total` too; cold ones only in flight.
    let have = counts.total.max(counts.in_flight) as u32;
    let missing = target.saturating_sub(have).min(KEEP_CREATES_PER_TURN);
    if missing == 0 {
        return Ok(());
    }
    let caller = Caller { tenant: owner.to_string(), admin: false };
    let made = futures::future::join_all((0..missing).map(|_| async {
        let env = cold_environment(s, &caller, &def, 0).await?;
        metrics::counter!(names::FUNCTION_ENVIRONMENTS_MADE, "why" => "keeper").increment(1);
        if !s.ledger.env_add(owner, name, &env).await.map_err(errors::ledger)? {
            retire(s, owner, vec![env.session]);
        }
        Ok::<_, ApiError>(())
    }))
    .await;
    let failed = made.iter().filter(|r| r.is_err()).count();
    tracing::info!(%owner, function = %name, target, made = missing as usize - failed, failed, "function environments made ahead");
    Ok(())
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct InvokeQuery {
    /// `true`: answer 202 with an invocation id at once; `GET /v1/invocations/{id}` has the result.
    #[serde(default, rename = "async")]
    pub run_async: bool,
    /// At the function's `max_concurrency`, wait up to this long for a slot before answering
    /// 429 (default 0: at once; at most 60000).
    #[serde(default)]
    pub max_wait_ms: Option<u64>,
}

fn payload_cap(s: &AppState, body: &Bytes) -> Result<(), ApiError> {
    let max = s.config.gateway.max_invoke_bytes;
    if body.len() as u64 > max {
        return Err(ApiError::new(ErrorCode::PayloadTooLarge, format!("the payload is over {max} bytes")));
    }
    Ok(())
}

fn header(v: &str) -> HeaderValue {
    HeaderValue::from_str(v).unwrap_or_else(|_| HeaderValue::from_static("-"))
}

#[utoipa::path(post, path = "/v1/functions/{name}/invoke", tag = "functions", operation_id = "invoke_function", summary = "Invoke a function", params(("name" = String, Path, description = "The function's name."), InvokeQuery), request_body(content = crate::openapi::Binary, content_type = "application/octet-stream", description = "The payload (any bytes; the Python runtime reads JSON), at most `gateway.max_invoke_bytes`."), responses((status = 200, description = "The result as the body; a function error is a JSON body `{type, message, ...}` with `x-sandpool-function-error: handled|unhandled`. Headers: `x-sandpool-start`, `x-sandpool-duration-ms`, `x-sandpool-environment`.", content_type = "application/octet-stream", body = crate::openapi::Binary), (status = 202, description = "Accepted (`?async=true`).", body = wire::functions::InvocationAccepted)))]
pub async fn invoke(
    caller: Caller,
    State(s): State<AppState>,
    Path(name): Path<String>,
    Query(q): Query<InvokeQuery>,
    body: Bytes,
) -> Result<Response, ApiError> {
    payload_cap(&s, &body)?;
    crate::quotas::call(&s, &caller)?;
    let wait = match q.max_wait_ms.unwrap_or(0) {
        w @ 0..=60_000 => Duration::from_millis(w),
        _ => return Err(ApiError::bad_request("max_wait_ms: must be 0 ..= 60000")),
    };
    if q.run_async {
        return invoke_async(s, caller, name, body).await;
    }
    let done = if wait.is_zero() {
        invoke_one(&s, &caller, &name, body).await?
    } else {
        invoke_waiting(&s, &caller, &name, body, Instant::now() + wait).await?
    };
    if let Some(e) = done.as_error() {
        return Err(e);
    }
    let mut resp = done.body.clone().into_response();
    let h = resp.headers_mut();
    let ct = if done.outcome == Outcome::Ok { "application/octet-stream" } else { "application/json" };
    h.insert(axum::http::header::CONTENT_TYPE, HeaderValue::from_static(ct));
    h.insert("x-sandpool-start", header(done.start.as_str()));
    h.insert("x-sandpool-duration-ms", header(&format!("{:.3}", done.duration_ms)));
    h.insert("x-sandpool-environment", header(&done.environment));
    if let Some(fe) = done.function_error() {
        h.insert("x-sandpool-function-error", HeaderValue::from_static(fe));
    }
    Ok(resp)
}

/// A result as JSON: itself when it parses as JSON, else a string (base64 if not UTF-8).
fn result_value(bytes: &[u8]) -> (serde_json::Value, Option<String>) {
    if let Ok(v) = serde_json::from_slice(bytes) {
        return (v, None);
    }
    match std::str::from_utf8(bytes) {
        Ok(t) => (serde_json::Value::String(t.to_string()), None),
        Err(_) => (serde_json::Value::String(wire::b64_encode(bytes)), Some("base64".into())),
    }
}

/// An asynchronous invocation's record as stored: the view, and when it is lost if not done.
#[derive(serde::Serialize, Deserialize)]
struct Stored {
    /// The principal that invoked it (the key is under its top-level tenant only).
    owner: String,
    deadline_ms: u64,
    invocation: Invocation,
}

/// Fills `inv` with how the invocation ended.
fn finish(inv: &mut Invocation, done: Result<Invoked, ApiError>) {
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

async fn invoke_async(s: AppState, caller: Caller, name: String, body: Bytes) -> Result<Response, ApiError> {
    let top = wire::quotas::top(&caller.tenant);
    let permit = match s.slots.take_async(top) {
        Ok(p) => p,
        Err(NoSlot::Share) => {
            return Err(ApiError::too_many_requests(
                format!(
                    "async_in_flight: {top:?} holds its share of this gateway's asynchronous slots ({} of {}); retry",
                    s.slots.async_share, s.slots.max_async
                ),
                ASYNC_RETRY_S,
            ));
        }
        Err(NoSlot::Full) => {
            return Err(ApiError::too_many_requests(
                format!("this gateway runs {} asynchronous invocations already; retry", s.slots.max_async),
                ASYNC_RETRY_S,
            ));
        }
    };
    let def =
        s.ledger.function_get(&caller.tenant, &name).await.map_err(errors::ledger)?.ok_or_else(|| unknown(&name))?;
    let id = format!("{:032x}", rand::random::<u128>());
    let now = s.ledger.now_ms().await.map_err(errors::ledger)?;
    let ttl = s.config.gateway.invocation_ttl.as_secs();
    // Queued behind busy environments, an invocation may wait a while for its slot.
    let run_ms = def.timeout_ms + START_ALLOWANCE.as_millis() as u64 + MAP_SLOT_WAIT.as_millis() as u64;
    let deadline_ms = now + run_ms;
    // The tenant's share of the slots (`async_in_flight`, over all gateways) until it ends or
    // its deadline passes, and its record (`async_results`) as long as the record is kept.
    let (running, kept) = (ledger::async_running_lease(&id), ledger::async_kept_lease(&id));
    // The record's KiB are counted as it is stored: this small one now, its result when done.
    let kept_cost = Cost { async_results: 1, async_result_kb: 1, ..Cost::default() };
    crate::quotas::admit(&s, &caller, &kept, kept_cost, false, 0, run_ms + ttl * 1000).await?;
    let running_cost = Cost { async_in_flight: 1, ..Cost::default() };
    if let Err(e) = crate::quotas::admit(&s, &caller, &running, running_cost, false, 0, run_ms).await {
        crate::quotas::give_back(&s, &caller, &kept).await;
        return Err(e);
    }
    let mut stored = Stored {
        owner: caller.tenant.clone(),
        deadline_ms,
        invocation: Invocation {
            invocation_id: id.clone(),
            function: name.clone(),
            state: InvocationState::Running,
            accepted_at: rfc3339(now),
            status: None,
            function_error: None,
            start: None,
            duration_ms: None,
            result: None,
            result_encoding: None,
        },
    };
    let recorded = match serde_json::to_string(&stored) {
        Ok(json) => s.ledger.invocation_set(&caller.tenant, &id, &json, ttl).await.map_err(errors::ledger),
        Err(e) => Err(ApiError::internal(format!("encode: {e}"))),
    };
    if let Err(e) = recorded {
        crate::quotas::give_back(&s, &caller, &running).await;
        crate::quotas::give_back(&s, &caller, &kept).await;
        return Err(e);
    }
    let task_id = id.clone();
    tokio::spawn(async move {
        let _permit = permit;
        let done = invoke_waiting(&s, &caller, &name, body, Instant::now() + MAP_SLOT_WAIT).await;
        finish(&mut stored.invocation, done);
        match kept_record(&s, &caller, &kept, &mut stored).await {
            Ok(json) => {
                if let Err(e) = s.ledger.invocation_set(&caller.tenant, &task_id, &json, ttl).await {
                    tracing::warn!(invocation = %task_id, error = %e, "store an asynchronous invocation's result");
                }
            }
            Err(e) => tracing::error!(error = %e, "encode an invocation"),
        }
        crate::quotas::give_back(&s, &caller, &running).await;
    });
    Ok((StatusCode::ACCEPTED, Json(InvocationAccepted { invocation_id: id })).into_response())
}

/// A finished invocation's record as it will be kept, its bytes counted against the tenant's
/// `async_result_mb` (on the `kept` lease, which ends with the record): one that would go over
/// is kept as that refusal (status 429 naming the dimension) instead of its result.
async fn kept_record(s: &AppState, caller: &Caller, kept: &str, stored: &mut Stored) -> serde_json::Result<String> {
    let json = serde_json::to_string(stored)?;
    if !s.config.quotas.enabled {
        return Ok(json);
    }
    let extra = Cost { async_result_kb: (json.len() as u64).div_ceil(1024).saturating_sub(1), ..Cost::default() };
    let admitted = s.ledger.quota_extend(kept, &caller.tenant, extra, &s.config.quotas.default).await;
    let refusal = match admitted {
        Ok(a @ ledger::Admission::Denied { .. }) => crate::quotas::refused(a).err(),
        // Admitted; or the lease is gone (the record outlived it: nothing left to count).
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(error = %e, "count an asynchronous result's bytes (kept uncounted)");
            None
        }
    };
    match refusal {
        Some(e) => {
            // It ran (start and duration stay); its result is not kept.
            stored.invocation.function_error = None;
            stored.invocation.result_encoding = None;
            finish(&mut stored.invocation, Err(e));
            serde_json::to_string(stored)
        }
        None => Ok(json),
    }
}

/// `invoke_one`, waiting for a slot of a function at its concurrency until `until`: woken
/// when an invocation of it ends at this gateway, else polling (a slot freed elsewhere).
async fn invoke_waiting(
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

#[utoipa::path(get, path = "/v1/invocations/{id}", tag = "functions", operation_id = "get_invocation", summary = "An asynchronous invocation's state and result", params(("id" = String, Path, description = "The id `?async=true` answered.")), responses((status = 200, description = "Running, done (with the status a synchronous call would have answered and its result), or lost.", body = wire::functions::Invocation)))]
pub async fn get_invocation(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Invocation>, ApiError> {
    let missing = || ApiError::not_found(format!("no invocation {id}"));
    if id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(missing());
    }
    let raw = s.ledger.invocation_get(&caller.tenant, &id).await.map_err(errors::ledger)?.ok_or_else(missing)?;
    let stored: Stored = serde_json::from_str(&raw).map_err(|e| ApiError::internal(format!("invocation: {e}")))?;
    // The key is under the caller's top-level tenant; it must also be the caller's own.
    if stored.owner != caller.tenant {
        return Err(missing());
    }
    let mut inv = stored.invocation;
    if inv.state == InvocationState::Running && s.ledger.now_ms().await.map_err(errors::ledger)? > stored.deadline_ms {
        inv.state = InvocationState::Lost;
    }
    Ok(Json(inv))
}

#[utoipa::path(post, path = "/v1/functions/{name}/map", tag = "functions", operation_id = "map_function", summary = "Invoke a function over a batch", params(("name" = String, Path, description = "The function's name.")), request_body(content = String, content_type = "application/json", description = "A JSON array of payloads, or NDJSON (one JSON payload per line); at most 10,000."), responses((status = 200, description = "NDJSON, one line per payload in input order, streamed as they finish: `{index, status, start?, duration_ms?, function_error?, result}` (an error's `result` is its error body).", content_type = "application/x-ndjson", body = String)))]
pub async fn map(
    caller: Caller,
    State(s): State<AppState>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let items = parse_batch(&body)?;
    for (i, p) in items.iter().enumerate() {
        if p.len() as u64 > s.config.gateway.max_invoke_bytes {
            return Err(ApiError::new(ErrorCode::PayloadTooLarge, format!("payload {i} is over the invocation limit")));
        }
    }
    crate::quotas::call(&s, &caller)?;
    let def =
        s.ledger.function_get(&caller.tenant, &name).await.map_err(errors::ledger)?.ok_or_else(|| unknown(&name))?;
    let width = def.max_concurrency as usize;
    let lines = futures::stream::iter(items.into_iter().enumerate())
        .map(move |(index, payload)| {
            let (s, caller, name) = (s.clone(), caller.clone(), name.clone());
            async move {
                let done = invoke_waiting(&s, &caller, &name, payload, Instant::now() + MAP_SLOT_WAIT).await;
                let mut line = map_line(index, done);
                line.push('\n');
                Ok::<_, std::convert::Infallible>(Bytes::from(line))
            }
        })
        .buffered(width);
    let mut resp = Body::from_stream(lines).into_response();
    resp.headers_mut().insert(axum::http::header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    Ok(resp)
}

/// One payload's line of a map's answer.
fn map_line(index: usize, done: Result<Invoked, ApiError>) -> String {
    let mut inv = Invocation {
        invocation_id: String::new(),
        function: String::new(),
        state: InvocationState::Done,
        accepted_at: String::new(),
        status: None,
        function_error: None,
        start: None,
        duration_ms: None,
        result: None,
        result_encoding: None,
    };
    finish(&mut inv, done);
    let mut v = serde_json::json!({"index": index, "status": inv.status, "result": inv.result});
    let o = v.as_object_mut().expect("an object");
    if let Some(st) = inv.start {
        o.insert("start".into(), st.as_str().into());
    }
    if let Some(d) = inv.duration_ms {
        o.insert("duration_ms".into(), d.into());
    }
    if let Some(fe) = inv.function_error {
        o.insert("function_error".into(), fe.into());
    }
    if let Some(enc) = inv.result_encoding {
        o.insert("result_encoding".into(), enc.into());
    }
    v.to_string()
}

/// A map's payloads: a JSON array, or NDJSON; each becomes the JSON text of one invocation.
fn parse_batch(body: &[u8]) -> Result<Vec<Bytes>, ApiError> {
    let text = std::str::from_utf8(body).map_err(|_| ApiError::bad_request("the batch is not UTF-8"))?;
    let items: Vec<serde_json::Value> = if text.trim_start().starts_with('[') {
        serde_json::from_str(text).map_err(|e| ApiError::bad_request(format!("malformed JSON array: {e}")))?
    } else {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str(l)
                    .map_err(|e| ApiError::bad_request(format!("line {}: malformed JSON: {e}", i + 1)))
            })
            .collect::<Result<_, _>>()?
    };
    if items.is_empty() || items.len() > MAX_MAP_ITEMS {
        return Err(ApiError::bad_request(format!("a batch holds 1 ..= {MAX_MAP_ITEMS} payloads")));
    }
    Ok(items.into_iter().map(|v| Bytes::from(v.to_string())).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_a_json_array_or_ndjson() {
        let a = parse_batch(br#"[1, {"a": 2}, "x"]"#).unwrap();
        assert_eq!(a, vec![Bytes::from("1"), Bytes::from(r#"{"a":2}"#), Bytes::from(r#""x""#)]);
        let n = parse_batch(b"{\"a\":1}\n\n[2]\n").unwrap();
        assert_eq!(n, vec![Bytes::from(r#"{"a":1}"#), Bytes::from("[2]")]);
        assert!(parse_batch(b"[1,").unwrap_err().message.contains("malformed"));
        assert!(parse_batch(b"{\"a\":1}\nnope\n").unwrap_err().message.contains("line 2"));
        assert!(parse_batch(b"[]").is_err());
        assert!(parse_batch(b"").is_err());
    }

    #[test]
    fn results_are_json_when_they_parse() {
        assert_eq!(result_value(br#"{"ok":1}"#), (serde_json::json!({"ok": 1}), None));
        assert_eq!(result_value(b"plain"), (serde_json::json!("plain"), None));
        assert_eq!(result_value(&[0xff, 0x00]), (serde_json::json!("/wA="), Some("base64".into())));
    }
}

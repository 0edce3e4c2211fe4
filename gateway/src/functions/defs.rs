//! Function definitions: `PUT`, `GET`, list and `DELETE` of `/v1/functions`.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use http_util::{ApiError, Json};
use ledger::{Cost, FunctionDef};
use wire::functions::{self as f, EnvironmentCounts, Function, FunctionList, PutFunction};

use super::{retire, unknown};
use crate::errors::{self, rfc3339};
use crate::page::{Kind, PageQuery};
use crate::{AppState, Caller};

/// How long a function's lease may exist without its function before `sweep` looks.
const LEASE_DEADLINE_MS: u64 = 10_000;

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
    let timeout_ms = req.checked_timeout_ms().map_err(ApiError::bad_request)?;
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

#[utoipa::path(put, path = "/v1/functions/{name}", tag = "functions", operation_id = "put_function", summary = "Create or replace a function", params(("name" = String, Path, description = "1-64 lowercase letters, digits, '-', '_'.")), request_body = wire::functions::PutFunction, responses((status = 201, description = "Created (version 1).", body = wire::functions::Function), (status = 200, description = "Replaced: the version is one more; environments of the old one are retired.", body = wire::functions::Function)))]
pub(crate) async fn put(
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
pub(crate) async fn get(
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
pub(crate) async fn list(
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
pub(crate) async fn delete(
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

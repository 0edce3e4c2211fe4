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
//!
//! Rooms: `defs` (the definitions and their routes), `invoke` (one invocation, start to end),
//! `slots` (this gateway's waiters and asynchronous slots), `async_calls` (`?async=true` and
//! its records), `map` (a batch), `keeper` (environments made ahead of demand). The invoke
//! route is here: it hands a call to `invoke` or `async_calls`.

use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use http_util::ApiError;
use serde::Deserialize;
use wire::ErrorCode;
use wire::internal::Outcome;

use crate::{AppState, Caller};
use async_calls::invoke_async;
use invoke::invoke_waiting;

mod async_calls;
mod defs;
mod invoke;
mod keeper;
mod map;
mod slots;

pub(crate) use async_calls::__path_get_invocation;
pub(crate) use async_calls::get_invocation;
pub(crate) use defs::{__path_delete, __path_get, __path_list, __path_put, delete, get, list, put};
pub(crate) use invoke::invoke_one;
pub(crate) use keeper::keep;
pub(crate) use map::{__path_map, map};
pub(crate) use slots::Slots;

/// The label that marks a session as a function's environment.
pub(crate) const ENV_LABEL: &str = "sandpool.function";
/// Beyond the function's timeout: a cold start (a session, a worker's `READY`) and the relay.
const START_ALLOWANCE: Duration = Duration::from_secs(45);
/// Environments found dead (ended behind the function's back) before an invocation gives up
/// on warm ones and starts a cold one.
const MAX_STALE_TRIES: usize = 4;
/// Payloads one map call may carry.
pub(crate) const MAX_MAP_ITEMS: usize = 10_000;
/// How long a mapped payload waits for a free slot of its function before it fails with 429.
const MAP_SLOT_WAIT: Duration = Duration::from_secs(60);

fn unknown(name: &str) -> ApiError {
    ApiError::not_found(format!("no function {name:?}"))
}

/// Ends retired environments' sessions, off the caller's path.
fn retire(s: &AppState, owner: &str, sessions: Vec<String>) {
    if sessions.is_empty() {
        return;
    }
    let (s, owner) = (s.clone(), owner.to_string());
    // Not cancelled at shutdown: each end is one short call, and a session not ended here
    // ends at its idle timeout.
    s.work.clone().spawn(async move {
        for id in sessions {
            if let Err(e) = crate::lifecycle::end_session(&s, &owner, &id).await {
                tracing::warn!(session = %id, error = %e.message, "retire a function environment");
            }
        }
    });
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct InvokeQuery {
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
pub(crate) async fn invoke(
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

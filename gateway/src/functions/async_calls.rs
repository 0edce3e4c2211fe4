//! Asynchronous invocations (`?async=true`): accepted at once, run in the background, their
//! records read with `GET /v1/invocations/{id}`.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use http_util::{ApiError, Json};
use ledger::Cost;
use serde::Deserialize;
use wire::functions::{Invocation, InvocationAccepted, InvocationState};

use super::invoke::{finish, invoke_waiting};
use super::slots::NoSlot;
use super::{MAP_SLOT_WAIT, START_ALLOWANCE, unknown};
use crate::errors::{self, rfc3339};
use crate::{AppState, Caller};

/// `Retry-After` of an asynchronous invocation refused for want of a slot of this gateway.
const ASYNC_RETRY_S: u64 = 1;

/// An asynchronous invocation's record as stored: the view, and when it is lost if not done.
#[derive(serde::Serialize, Deserialize)]
struct Stored {
    /// The principal that invoked it (the key is under its top-level tenant only).
    owner: String,
    deadline_ms: u64,
    invocation: Invocation,
}

pub(super) async fn invoke_async(s: AppState, caller: Caller, name: String, body: Bytes) -> Result<Response, ApiError> {
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
        invocation: Invocation::new(id.clone(), name.clone(), InvocationState::Running, rfc3339(now)),
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
    let work = s.work.clone();
    work.spawn(async move {
        let _permit = permit;
        let run = invoke_waiting(&s, &caller, &name, body, Instant::now() + MAP_SLOT_WAIT);
        // A gateway that stops cuts the invocation (what it held goes back as for a caller that
        // left) and records it as failed, so a caller polling it learns at once, from any
        // gateway, instead of seeing it run until its deadline and then lost.
        let done = tokio::select! {
            done = run => done,
            _ = s.work.cancelled() => {
                tracing::info!(invocation = %task_id, function = %name, "an asynchronous invocation is cut by the gateway's shutdown");
                Err(shut_down())
            }
        };
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

/// How an asynchronous invocation cut by its gateway's shutdown ends.
fn shut_down() -> ApiError {
    ApiError::unavailable(
        "the gateway running this invocation shut down before it finished (the function may have run in part); invoke it again",
        1,
    )
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

#[utoipa::path(get, path = "/v1/invocations/{id}", tag = "functions", operation_id = "get_invocation", summary = "An asynchronous invocation's state and result", params(("id" = String, Path, description = "The id `?async=true` answered.")), responses((status = 200, description = "Running, done (with the status a synchronous call would have answered and its result), or lost.", body = wire::functions::Invocation)))]
pub(crate) async fn get_invocation(
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

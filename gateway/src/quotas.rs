//! Tenancy: quota admission for creates, reservations and snapshots; the quota API
//! (`/v1/quotas/{path}`, `/v1/usage`, `/v1/quotas:verify`); and the per-principal call rate.
//!
//! Who may do what: an admin sets any path's limits; a principal sets limits on its strict
//! descendants only (never itself, an ancestor or a sibling), and reads its own subtree. A
//! limit an admin set on a path (an `isolation` list included) binds its ancestors too: they
//! may restate or tighten it, never loosen or remove it (only an admin may). No tenant sets
//! limits under the reserved principal `public`. A valid token acting outside its rights gets
//! 403 `forbidden`, naming the admin-set fields where those are why.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use http_util::{ApiError, Json, Query};
use ledger::{Admission, Cost, SetBy, SetLimits};
use serde::Deserialize;
use wire::QuotaDenied;
use wire::quotas::{self, Dimension, QuotaDrift, QuotaLimits, QuotaView, UsageView};

use crate::errors;
use crate::{AppState, Caller};

/// How long after admission a session lease may exist without its session before `sweep`
/// treats it as an orphan, beyond the request's own wait: longer than a queued request's
/// waiter lives in a node's queue after its wait (60 s, `create/queue.rs`), since a waiter whose
/// gateway died may still be granted a sandbox until then.
const LEASE_SLACK_MS: u64 = 70_000;

/// `Retry-After` of a create refused for want of a queue slot (as for a full queue).
const QUEUED_RETRY_S: u64 = 2;

/// Takes a quota lease for a request of the caller, or answers 429 `quota_exceeded`.
/// `rate`: a session create (counts against `create_rate`). `wait_ms`: how long the request
/// may take before its session exists; `ends_in_ms` (non-zero): the lease ends by itself.
pub(crate) async fn admit(
    s: &AppState,
    caller: &Caller,
    lease: &str,
    cost: Cost,
    rate: bool,
    wait_ms: u64,
    ends_in_ms: u64,
) -> Result<(), ApiError> {
    if !s.config.quotas.enabled {
        return Ok(());
    }
    let q = &s.config.quotas;
    let deadline_in = wait_ms + LEASE_SLACK_MS;
    let admission = s
        .ledger
        .quota_admit(lease, &caller.tenant, cost, &q.default, rate, deadline_in, ends_in_ms)
        .await
        .map_err(errors::ledger)?;
    refused(admission)
}

/// A held lease enters a wait queue, or the request is refused (`queued` is full somewhere up
/// its path).
pub(crate) async fn enter_queue(s: &AppState, caller: &Caller, lease: &str) -> Result<(), ApiError> {
    if !s.config.quotas.enabled {
        return Ok(());
    }
    let a = s.ledger.quota_queue(lease, &caller.tenant, true, &s.config.quotas.default).await;
    refused(a.map_err(errors::ledger)?)
}

/// The held lease leaves its queue (granted, or given up).
pub(crate) async fn leave_queue(s: &AppState, caller: &Caller, lease: &str) {
    if !s.config.quotas.enabled {
        return;
    }
    if let Err(e) = s.ledger.quota_queue(lease, &caller.tenant, false, &s.config.quotas.default).await {
        tracing::warn!(error = %e, lease, "leave a quota queue slot (the sweep will)");
    }
}

/// Gives a lease back (a request that did not get what it was admitted for). A failure is
/// logged: the sweep gives back leases whose holder is gone.
pub(crate) async fn give_back(s: &AppState, caller: &Caller, lease: &str) {
    if !s.config.quotas.enabled {
        return;
    }
    if let Err(e) = s.ledger.quota_release(quotas::top(&caller.tenant), &[lease.to_string()]).await {
        tracing::warn!(error = %e, lease, "give a quota lease back (the sweep will)");
    }
}

/// An admission's answer as a result: refusals are 429 `quota_exceeded`.
pub(crate) fn refused(a: Admission) -> Result<(), ApiError> {
    match a {
        Admission::Admitted => Ok(()),
        Admission::Missing => Err(ApiError::internal("the quota lease of this request is gone")),
        Admission::Forbidden { path, isolation, allowed } => {
            metrics::counter!(telemetry::names::QUOTA_REFUSALS, "dimension" => "isolation").increment(1);
            Err(ApiError::forbidden(format!(
                "isolation class {isolation:?} is not allowed for {path:?} (allowed: {})",
                if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") }
            )))
        }
        Admission::Denied { dimension, path, limit, used, retry_ms } => {
            // When waiting helps: the rate's next token; a queue slot, like a full queue. The
            // other dimensions free up only when the caller ends something.
            let retry = match dimension {
                Dimension::CreateRate => Some(retry_ms.div_ceil(1000).max(1)),
                Dimension::Queued => Some(QUEUED_RETRY_S),
                // An invocation in flight ends within its timeout.
                Dimension::AsyncInFlight => Some(1),
                _ => None,
            };
            metrics::counter!(telemetry::names::QUOTA_REFUSALS, "dimension" => dimension.as_str()).increment(1);
            Err(ApiError::quota_exceeded(QuotaDenied { dimension, path, limit, used }, retry))
        }
    }
}

/// The path named in a URL, checked.
fn principal(path: &str) -> Result<&str, ApiError> {
    match quotas::path_problem(path) {
        None => Ok(path),
        Some(p) => Err(ApiError::bad_request(format!("path {path:?}: {p}"))),
    }
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct ViewQuery {
    /// Include the children's limits and usage (default true).
    #[serde(default)]
    children: Option<bool>,
}

/// `GET /v1/quotas/{path}`: limits and usage of a path in the caller's subtree and its children.
#[utoipa::path(get, path = "/v1/quotas/{*path}", tag = "quotas", operation_id = "get_quota", summary = "A path's limits and usage", params(("path" = String, Path, description = "A principal path: 1-8 segments of letters, digits, `-`, `_`, `.`, `@` joined by `/`."), ViewQuery), responses((status = 200, description = "The path's limits and usage (and its children's).", body = wire::quotas::QuotaView)))]
pub(crate) async fn get(
    caller: Caller,
    State(s): State<AppState>,
    Path(path): Path<String>,
    Query(q): Query<ViewQuery>,
) -> Result<Json<QuotaView>, ApiError> {
    let path = principal(&path)?;
    if !caller.admin && !quotas::within(path, &caller.tenant) {
        return Err(ApiError::forbidden(format!("{path:?} is outside {:?}'s subtree", caller.tenant)));
    }
    let view = s.ledger.quota_view(path, &s.config.quotas.default, q.children.unwrap_or(true)).await;
    Ok(Json(view.map_err(errors::ledger)?))
}

/// Who may set the limits of `path`: an admin, or a strict ancestor (delegation) outside the
/// reserved `public` (which `auth` already keeps tenants out of). Which limits the ancestor may
/// change is the ledger's answer (`SetLimits::AdminSet`).
fn may_set(caller: &Caller, path: &str) -> Result<SetBy, ApiError> {
    if caller.admin {
        return Ok(SetBy::Admin);
    }
    if quotas::is_reserved(path) {
        return Err(ApiError::forbidden(format!("{path:?}: `public` is a reserved principal")));
    }
    if path != caller.tenant && quotas::within(path, &caller.tenant) {
        return Ok(SetBy::Tenant);
    }
    Err(ApiError::forbidden(format!("{:?} may set limits on its descendants only, not on {path:?}", caller.tenant)))
}

/// 403 for limits an admin set that a tenant would loosen or remove, naming them.
fn admin_set(path: &str, fields: &[String]) -> ApiError {
    ApiError::forbidden(format!(
        "{}: set by an admin on {path:?}; only an admin may loosen or remove it (restate or tighten it instead)",
        fields.join(", ")
    ))
}

/// `PUT /v1/quotas/{path}`: sets a path's limits (all of them: an absent field is no limit).
#[utoipa::path(put, path = "/v1/quotas/{*path}", tag = "quotas", operation_id = "set_quota", summary = "Set a path's limits", params(("path" = String, Path, description = "A principal path: 1-8 segments of letters, digits, `-`, `_`, `.`, `@` joined by `/`.")), request_body = wire::quotas::QuotaLimits, responses((status = 200, description = "The path with its new limits.", body = wire::quotas::QuotaView)))]
pub(crate) async fn put(
    caller: Caller,
    State(s): State<AppState>,
    Path(path): Path<String>,
    Json(limits): Json<QuotaLimits>,
) -> Result<Json<QuotaView>, ApiError> {
    let path = principal(&path)?;
    let by = may_set(&caller, path)?;
    if let Some(p) = limits.problem() {
        return Err(ApiError::bad_request(p));
    }
    let d = &s.config.quotas.default;
    match s.ledger.quota_set_by(path, Some(&limits), d, by).await.map_err(errors::ledger)? {
        SetLimits::Ok => {}
        SetLimits::Above { dimension, path: at, limit } => {
            return Err(ApiError::bad_request(format!(
                "{dimension}: may not exceed the limit of {limit} that {at:?} has"
            )));
        }
        SetLimits::Outside { path: at, allowed } => {
            return Err(ApiError::bad_request(format!(
                "isolation: must lie within what {at:?} allows ({})",
                if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") }
            )));
        }
        SetLimits::AdminSet { path: at, fields } => return Err(admin_set(&at, &fields)),
    }
    tracing::info!(by = %caller.tenant, %path, ?limits, "quota set");
    Ok(Json(s.ledger.quota_view(path, d, false).await.map_err(errors::ledger)?))
}

/// `DELETE /v1/quotas/{path}`: removes a path's own limits (its ancestors' still bind it).
#[utoipa::path(delete, path = "/v1/quotas/{*path}", tag = "quotas", operation_id = "delete_quota", summary = "Remove a path's limits", params(("path" = String, Path, description = "A principal path: 1-8 segments of letters, digits, `-`, `_`, `.`, `@` joined by `/`.")), responses((status = 204, description = "The path's own limits are removed.")))]
pub(crate) async fn delete(
    caller: Caller,
    State(s): State<AppState>,
    Path(path): Path<String>,
) -> Result<StatusCode, ApiError> {
    let path = principal(&path)?;
    let by = may_set(&caller, path)?;
    match s.ledger.quota_set_by(path, None, &s.config.quotas.default, by).await.map_err(errors::ledger)? {
        SetLimits::AdminSet { path: at, fields } => return Err(admin_set(&at, &fields)),
        // Removing checks no ancestor.
        SetLimits::Ok | SetLimits::Above { .. } | SetLimits::Outside { .. } => {}
    }
    tracing::info!(by = %caller.tenant, %path, "quota removed");
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/usage`: the caller's limits and usage at every level of its path, its own first.
#[utoipa::path(get, path = "/v1/usage", tag = "quotas", operation_id = "usage", summary = "The caller's limits and usage", responses((status = 200, description = "The caller's limits and usage at every level of its path.", body = wire::quotas::UsageView)))]
pub(crate) async fn usage(caller: Caller, State(s): State<AppState>) -> Result<Json<UsageView>, ApiError> {
    let mut levels = Vec::new();
    let mut at = Some(caller.tenant.as_str());
    while let Some(p) = at {
        levels.push(s.ledger.quota_view(p, &s.config.quotas.default, false).await.map_err(errors::ledger)?);
        at = quotas::parent(p);
    }
    Ok(Json(UsageView { path: caller.tenant.clone(), levels }))
}

#[derive(Deserialize, Default, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct VerifyQuery {
    #[serde(default)]
    fix: bool,
}

/// `POST /v1/quotas:verify` (admin): gives back orphaned leases and reports drift between the
/// counted usage and the usage recomputed from leases and live sessions; `?fix=true` corrects it.
#[utoipa::path(post, path = "/v1/quotas:verify", tag = "quotas", operation_id = "verify_quotas", summary = "Verify quota accounting (admin)", params(VerifyQuery), responses((status = 200, description = "Orphans released and drift found (admin).", body = wire::quotas::QuotaDrift)))]
pub(crate) async fn verify(
    caller: Caller,
    State(s): State<AppState>,
    Query(q): Query<VerifyQuery>,
) -> Result<Json<QuotaDrift>, ApiError> {
    caller.require_admin()?;
    let drift = s.ledger.quota_verify(&s.config.quotas.default, q.fix).await.map_err(errors::ledger)?;
    Ok(Json(drift))
}

/// Calls per second per principal (exec, files, WebSocket opens), enforced by each gateway in
/// memory: a GCRA per principal, one lock, no Redis round trip.
pub(crate) struct CallRate {
    /// Milliseconds between calls, and how many calls may come at once.
    every_ms: f64,
    burst: f64,
    started: Instant,
    /// Per principal: the theoretical arrival time, in ms since `started`.
    tat: Mutex<HashMap<String, f64>>,
}

/// Principals tracked before idle ones are forgotten.
const CALL_RATE_PRINCIPALS: usize = 10_000;

impl CallRate {
    pub(crate) fn new(per_s: f64, burst: u64) -> CallRate {
        CallRate {
            every_ms: 1000.0 / per_s,
            burst: burst as f64,
            started: Instant::now(),
            tat: Mutex::new(HashMap::new()),
        }
    }

    /// Admits one call of `principal`, or answers 429 with when the next call fits.
    pub(crate) fn admit(&self, principal: &str) -> Result<(), ApiError> {
        let now = self.started.elapsed().as_secs_f64() * 1000.0;
        let mut tat = self.tat.lock().unwrap_or_else(|p| p.into_inner());
        if tat.len() >= CALL_RATE_PRINCIPALS && !tat.contains_key(principal) {
            tat.retain(|_, t| *t > now);
        }
        let t = tat.get(principal).copied().unwrap_or(now).max(now);
        let ahead = t + self.every_ms - now - self.burst * self.every_ms;
        if ahead > 0.0 {
            drop(tat);
            metrics::counter!(telemetry::names::QUOTA_REFUSALS, "dimension" => Dimension::CallRate.as_str())
                .increment(1);
            let denied = QuotaDenied {
                dimension: Dimension::CallRate,
                path: principal.to_string(),
                limit: 1000.0 / self.every_ms,
                used: self.burst,
            };
            return Err(ApiError::quota_exceeded(denied, Some((ahead / 1000.0).ceil().max(1.0) as u64)));
        }
        match tat.get_mut(principal) {
            Some(slot) => *slot = t + self.every_ms,
            None => {
                tat.insert(principal.to_string(), t + self.every_ms);
            }
        }
        Ok(())
    }
}

/// Admits one call of the caller against the configured call rate (if any).
pub(crate) fn call(s: &AppState, caller: &Caller) -> Result<(), ApiError> {
    match &s.call_rate {
        Some(r) => r.admit(&caller.tenant),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_rate_allows_the_burst_then_refuses_with_retry_after() {
        let r = CallRate::new(1.0, 3);
        for _ in 0..3 {
            r.admit("acme").unwrap();
        }
        let e = r.admit("acme").unwrap_err();
        assert_eq!(e.code, wire::ErrorCode::QuotaExceeded);
        assert_eq!(e.retry_after_s, Some(1));
        assert_eq!(e.quota.as_ref().map(|q| q.dimension), Some(Dimension::CallRate));
        // Another principal has its own budget.
        r.admit("acme/rl").unwrap();
    }
}

//! Declared demand and pool visibility: `POST /v1/reservations` (a trainer announces its next
//! burst; the autoscaler warms pools for it, and the count holds the caller's `reserved`
//! quota until the hold ends) and `GET /v1/pools` (admin: every node's pools,
//! queues and health).

use std::time::{Duration, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use http_util::{ApiError, Json};
use ledger::{Cost, Reservation};
use wire::{CreateReservation, ErrorCode, NodeStats, NodeView, PoolsView, ReservationInfo};

use crate::errors::{self, rfc3339};

use crate::quotas;
use crate::{AppState, Caller};

/// How long reserved sandboxes are held after `ready_by` when the request names no `hold_s`.
const DEFAULT_HOLD_S: u64 = 300;
/// A reservation may look at most this far ahead.
const MAX_AHEAD: Duration = Duration::from_secs(24 * 3600);

#[utoipa::path(post, path = "/v1/reservations", tag = "reservations", operation_id = "create_reservation", summary = "Reserve warm sandboxes for a burst", request_body = wire::CreateReservation, responses((status = 201, description = "Accepted; `feasible` says whether the nodes can have them idle by `ready_by`.", body = wire::ReservationInfo)))]
pub async fn create(
    caller: Caller,
    State(s): State<AppState>,
    Json(req): Json<CreateReservation>,
) -> Result<(StatusCode, Json<ReservationInfo>), ApiError> {
    let Some(template) = s.config.templates.get(&req.template) else {
        return Err(ApiError::new(
            ErrorCode::UnknownTemplate,
            format!("template: no template named {:?}", req.template),
        ));
    };
    if req.count == 0 || req.count > 100_000 {
        return Err(ApiError::bad_request("count: must be 1 ..= 100000"));
    }
    let ready_by = humantime::parse_rfc3339_weak(&req.ready_by)
        .map_err(|e| ApiError::bad_request(format!("ready_by: not an RFC 3339 time ({e})")))?;
    let ready_by_ms = ready_by.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    let now = s.ledger.now_ms().await.map_err(errors::ledger)?;
    if ready_by_ms > now + MAX_AHEAD.as_millis() as u64 {
        return Err(ApiError::bad_request("ready_by: at most 24 hours ahead"));
    }
    let hold_s = req.hold_s.unwrap_or(DEFAULT_HOLD_S).min(template.max_lifetime.as_secs());

    // Feasibility at the nodes' create rate, counting what is idle already.
    let stats = node_stats(&s).await?;
    let idle: u64 = stats.iter().filter_map(|(_, st)| st.pools.get(&req.template)).map(|p| p.idle + p.creating).sum();
    // Each registered node creates at its budget, unless its create window and latency cap it
    // lower (a node that has not reported yet counts at its budget).
    let pm = &s.config.pool_manager;
    let nodes = s.nodes.ids().await?;
    let rate: f64 = nodes
        .iter()
        .map(|n| match stats.iter().find(|(id, _)| id == n) {
            Some((_, st)) => st.sustainable_create_rate(pm.create_rate, pm.max_creates_in_flight),
            None => pm.create_rate,
        })
        .sum::<f64>()
        .max(0.1);
    let needed = req.count.saturating_sub(idle);
    let earliest = now + (needed as f64 / rate * 1000.0).ceil() as u64;
    let r = Reservation {
        id: format!("r{:016x}", rand::random::<u64>()),
        tenant: caller.tenant.clone(),
        template: req.template.clone(),
        count: req.count,
        ready_by_ms,
        hold_s,
    };
    // The reserved sandboxes count against `reserved` until the hold ends.
    let lease = ledger::reservation_lease(&r.id);
    let cost = Cost { reserved: r.count, ..Cost::default() }.of_isolation(&template.runtime);
    let ends_in = (ready_by_ms + hold_s * 1000).saturating_sub(now).max(1);
    quotas::admit(&s, &caller, &lease, cost, false, 0, ends_in).await?;
    if let Err(e) = s.ledger.add_reservation(&r).await {
        quotas::give_back(&s, &caller, &lease).await;
        return Err(errors::ledger(e));
    }
    tracing::info!(tenant = %caller.tenant, reservation = %r.id, template = %r.template, count = r.count, "reservation");
    Ok((
        StatusCode::CREATED,
        Json(ReservationInfo {
            reservation_id: r.id,
            template: r.template,
            count: r.count,
            ready_by: rfc3339(ready_by_ms),
            hold_s,
            feasible: earliest <= ready_by_ms,
            earliest_ready_at: rfc3339(earliest.max(now)),
        }),
    ))
}

async fn node_stats(s: &AppState) -> Result<Vec<(String, NodeStats)>, ApiError> {
    let mut out = Vec::new();
    for node in s.nodes.ids().await? {
        if let Some(st) = s.ledger.stats(&node).await.map_err(errors::ledger)? {
            out.push((node, st));
        }
    }
    Ok(out)
}

/// Admin: every node's pools (idle, leased, creating, waiting, target, health).
#[utoipa::path(get, path = "/v1/pools", tag = "operations", operation_id = "pools", summary = "Every node's pools (admin)", responses((status = 200, description = "Every node's pools (admin).", body = wire::PoolsView)))]
pub async fn pools(caller: Caller, State(s): State<AppState>) -> Result<Json<PoolsView>, ApiError> {
    caller.require_admin()?;
    let nodes = node_stats(&s).await?.into_iter().map(|(node, stats)| NodeView { node, stats }).collect();
    Ok(Json(PoolsView { nodes }))
}

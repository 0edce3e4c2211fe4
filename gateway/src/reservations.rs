//! Declared demand and pool visibility: `POST /v1/reservations` (a trainer announces its next
//! burst; the autoscaler warms pools for it, and the count holds the caller's `reserved`
//! quota until the hold ends) and `GET /v1/pools` (admin: every node's pools,
//! queues and health).

use std::time::{Duration, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use http_util::{ApiError, Json};
use ledger::{Cost, Reservation};
use wire::{CreateReservation, ErrorCode, NodeStats, NodeView, PoolsView, ReservationInfo, ReservationItem};

use crate::errors::{self, rfc3339};

use crate::quotas;
use crate::{AppState, Caller};

/// How long reserved sandboxes are held after `ready_by` when the request names no `hold_s`.
const DEFAULT_HOLD_S: u64 = 300;
/// A reservation may look at most this far ahead.
const MAX_AHEAD: Duration = Duration::from_secs(24 * 3600);

/// Most templates one reservation names: a training step over a corpus of task images. Each
/// is one ledger entry the autoscaler reads every tick (a tenant's live ones are bounded by
/// its `reservation_items` quota).
const MAX_ITEMS: usize = 1000;
/// Most sandboxes one reservation asks for, over all its templates.
const MAX_COUNT: u64 = 100_000;

#[utoipa::path(post, path = "/v1/reservations", tag = "reservations", operation_id = "create_reservation", summary = "Reserve warm sandboxes for a burst", request_body = wire::CreateReservation, responses((status = 201, description = "Accepted; `feasible` says whether the nodes can have them idle by `ready_by`. The images of templates made from images start pulling now.", body = wire::ReservationInfo)))]
pub(crate) async fn create(
    caller: Caller,
    State(s): State<AppState>,
    Json(req): Json<CreateReservation>,
) -> Result<(StatusCode, Json<ReservationInfo>), ApiError> {
    let items = match (&req.template, req.count, req.items.is_empty()) {
        (Some(t), Some(count), true) => vec![ReservationItem { template: t.clone(), count }],
        (None, None, false) => req.items.clone(),
        _ => return Err(ApiError::bad_request("either template and count, or items")),
    };
    if items.len() > MAX_ITEMS {
        return Err(ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("items: at most {MAX_ITEMS} templates per reservation ({} given)", items.len()),
        ));
    }
    let total: u64 = items.iter().map(|i| i.count).sum();
    if items.iter().any(|i| i.count == 0) || total > MAX_COUNT {
        return Err(ApiError::bad_request(format!("count: each at least 1, at most {MAX_COUNT} in all")));
    }
    // Each item's template as a session of it would run, and the image to pull, if any.
    let mut resolved = Vec::with_capacity(items.len());
    for item in &items {
        resolved.push(reserved_template(&s, &caller, &item.template).await?);
    }
    let ready_by = humantime::parse_rfc3339_weak(&req.ready_by)
        .map_err(|e| ApiError::bad_request(format!("ready_by: not an RFC 3339 time ({e})")))?;
    let ready_by_ms = ready_by.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    let now = s.ledger.now_ms().await.map_err(errors::ledger)?;
    if ready_by_ms > now + MAX_AHEAD.as_millis() as u64 {
        return Err(ApiError::bad_request("ready_by: at most 24 hours ahead"));
    }
    let longest = resolved.iter().map(|t| t.max_lifetime.as_secs()).min().unwrap_or(0);
    let hold_s = req.hold_s.unwrap_or(DEFAULT_HOLD_S).min(longest);

    // Feasibility at the nodes' create rate for each template, counting what is idle already.
    let stats = node_stats(&s).await?;
    let pm = &s.config.pool_manager;
    let nodes = s.nodes.ids().await?;
    let fill_ms: f64 = items
        .iter()
        .map(|i| {
            let idle: u64 =
                stats.iter().filter_map(|(_, st)| st.pools.get(&i.template)).map(|p| p.idle + p.creating).sum();
            // Each registered node creates a template at the rate its creates of it measured,
            // else at its budget, unless its create window and latency cap it lower (a node that
            // has not reported yet counts at its budget).
            let rate: f64 = nodes
                .iter()
                .map(|n| match stats.iter().find(|(id, _)| id == n) {
                    Some((_, st)) => match st.pools.get(&i.template).map(|p| p.create_rate).filter(|r| *r > 0.0) {
                        Some(r) => r,
                        None => st.sustainable_create_rate(pm.create_rate, pm.max_creates_in_flight),
                    },
                    None => pm.create_rate,
                })
                .sum::<f64>()
                .max(0.1);
            i.count.saturating_sub(idle) as f64 / rate * 1000.0
        })
        .sum();
    let earliest = now + fill_ms.ceil() as u64;
    let id = format!("r{:016x}", rand::random::<u64>());
    // One ledger reservation per template (the autoscaler sizes pools per template), all in
    // the tenant's own scope in one script. The quota is held by one lease per isolation
    // class the items use (each checked against every level's `isolation`): the request's
    // `reservations` unit, and its items' `reserved` sandboxes and `reservation_items`, until
    // the hold ends.
    let ends_in = (ready_by_ms + hold_s * 1000).saturating_sub(now).max(1);
    let reservations: Vec<Reservation> = items
        .iter()
        .enumerate()
        .map(|(i, item)| Reservation {
            id: if items.len() == 1 { id.clone() } else { format!("{id}.{i}") },
            tenant: caller.tenant.clone(),
            template: item.template.clone(),
            count: item.count,
            ready_by_ms,
            hold_s,
        })
        .collect();
    let mut by_class: std::collections::BTreeMap<&str, Cost> = Default::default();
    for (item, template) in items.iter().zip(&resolved) {
        let c = by_class.entry(template.runtime.as_str()).or_default();
        c.reserved += item.count;
        c.reservation_items += 1;
    }
    let mut held: Vec<String> = Vec::new();
    let mut admitted = Ok(());
    for (i, (class, mut cost)) in by_class.into_iter().enumerate() {
        cost.reservations = u64::from(i == 0);
        let lease = ledger::reservation_lease(&format!("{id}/{class}"));
        admitted = quotas::admit(&s, &caller, &lease, cost.of_isolation(class), false, 0, ends_in).await;
        if admitted.is_err() {
            break;
        }
        held.push(lease);
    }
    let top = wire::quotas::top(&caller.tenant);
    let stored = match admitted {
        Ok(()) => s.ledger.record_reservations(top, &reservations).await.map(drop).map_err(errors::ledger),
        Err(e) => Err(e),
    };
    if let Err(e) = stored {
        // All or nothing: what this request reserved goes again.
        let ids: Vec<String> = reservations.into_iter().map(|r| r.id).collect();
        if let Err(de) = s.ledger.delete_reservations(top, &ids).await {
            tracing::warn!(reservation = %id, error = %de, "undo a reservation");
        }
        for lease in &held {
            quotas::give_back(&s, &caller, lease).await;
        }
        return Err(e);
    }
    // Images of templates made from images start pulling now, not when the pools grow.
    let mut images: Vec<String> =
        resolved.iter().map(|t| t.image.clone()).filter(|i| wire::images::digest_of(i).is_some()).collect();
    images.sort();
    images.dedup();
    if !images.is_empty()
        && let Err(e) = crate::images::pull_onto_nodes(&s, &images, None).await
    {
        tracing::warn!(reservation = %id, error = %e, "prefetch the reservation's images");
    }
    tracing::info!(tenant = %caller.tenant, reservation = %id, templates = items.len(), count = total, "reservation");
    Ok((
        StatusCode::CREATED,
        Json(ReservationInfo {
            reservation_id: id,
            template: (items.len() == 1).then(|| items[0].template.clone()),
            count: total,
            items,
            ready_by: rfc3339(ready_by_ms),
            hold_s,
            feasible: earliest <= ready_by_ms,
            earliest_ready_at: rfc3339(earliest.max(now)),
        }),
    ))
}

/// A template a reservation may name: a configured one, or one made from an image that the
/// caller may use.
async fn reserved_template(s: &AppState, caller: &Caller, name: &str) -> Result<config::Template, ApiError> {
    let unknown = || ApiError::new(ErrorCode::UnknownTemplate, format!("template: no template named {name:?}"));
    if let Some(t) = s.config.templates.get(name) {
        return Ok(t.clone());
    }
    if !wire::images::is_image_template(name) {
        return Err(unknown());
    }
    let (_, run) = crate::images::usable(s, caller, name).await?.ok_or_else(unknown)?;
    Ok(run)
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
pub(crate) async fn pools(caller: Caller, State(s): State<AppState>) -> Result<Json<PoolsView>, ApiError> {
    caller.require_admin()?;
    let nodes = node_stats(&s).await?.into_iter().map(|(node, stats)| NodeView { node, stats }).collect();
    Ok(Json(PoolsView { nodes }))
}

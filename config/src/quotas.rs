//! `[quotas]`: the limits a top-level tenant gets when an admin has set none.

use serde::Deserialize;

use crate::gateway::GatewayConfig;
use crate::{ConfigError, invalid};

// Defaults of `[quotas.default]`: what a top-level tenant may hold without a limit of its own.
// Each bounds state that every node or gateway keeps or re-reads, and each is well above what
// a demanding RL run uses (an admin raises it for a tenant that needs more).
/// Templates a tenant makes (from images, snapshots, forks): a SWE-style corpus of one image
/// per task (SWE-bench Verified is 500 tasks). Every node keeps every template in memory: at
/// most 500 x 64 KiB of env per tenant.
pub const DEFAULT_PRIVATE_TEMPLATES: u64 = 500;

/// Functions a tenant defines: reward models, graders and tools of many runs side by side;
/// every gateway's keeper reads every function every second (at most 128 KiB each).
pub const DEFAULT_FUNCTIONS: u64 = 200;

/// Asynchronous invocations a tenant has in flight, over all gateways (at most a quarter of
/// one gateway's slots): each pins its payload (6 MiB at most) in a gateway, so 256 pin at
/// most 1.5 GiB; a whole batch goes through `map`, which holds no slot.
pub const DEFAULT_ASYNC_IN_FLIGHT: u64 = 256;

/// Asynchronous invocation records a tenant keeps (each lives `gateway.invocation_ttl` after
/// its deadline): 10 accepted a second, every second of the hour.
pub const DEFAULT_ASYNC_RESULTS: u64 = 36_000;

/// The bytes of a tenant's kept asynchronous records, in MiB: an hour of 10 results a second
/// of 28 KiB each, or 170 results of the largest size (6 MiB); Redis holds them.
pub const DEFAULT_ASYNC_RESULT_MB: u64 = 1024;

/// Reservation requests a tenant has live (until `ready_by + hold_s`): one per training
/// step of many runs at once.
pub const DEFAULT_RESERVATIONS: u64 = 100;

/// Templates named by a tenant's live reservations, over all of them: two steps ahead of a
/// corpus of 2,500 task images. The autoscaler reads every live entry every tick.
pub const DEFAULT_RESERVATION_ITEMS: u64 = 5000;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawQuotas {
    /// Off: no limits are checked or counted (benchmarks compare the two).
    enabled: Option<bool>,
    /// Limits of every top-level tenant that has none of its own, per dimension.
    default: wire::quotas::QuotaLimits,
    /// Calls per second per principal and gateway (exec, files, WebSocket opens); none: off.
    call_rate: Option<f64>,
    call_burst: Option<u64>,
}

/// Tenancy limits that come from the config (per-path quotas live in Redis, set by the API).
#[derive(Debug, Clone, PartialEq)]
pub struct QuotasConfig {
    /// When false, creates are neither checked nor counted (a single-tenant deployment, and
    /// the benchmark's baseline).
    pub enabled: bool,
    /// Applied to a top-level tenant for every dimension it has no limit of its own for.
    /// `queued` defaults to a quarter of `gateway.max_queue`, so one tenant's flood cannot
    /// fill a shared queue; `async_in_flight` to at most a quarter of
    /// `gateway.max_async_in_flight`; the other counts to the `DEFAULT_*` constants.
    pub default: wire::quotas::QuotaLimits,
    /// Calls per second per principal, enforced by each gateway on its own.
    pub call_rate: Option<f64>,
    /// Calls a principal may make at once above `call_rate` (its token bucket's size).
    pub call_burst: u64,
}

pub(crate) fn validate_quotas(raw: RawQuotas, gateway: &GatewayConfig) -> Result<QuotasConfig, ConfigError> {
    let mut default = raw.default;
    if let Some(p) = default.problem() {
        return Err(invalid("quotas.default", p));
    }
    default.queued = default.queued.or(Some((gateway.max_queue as u64 / 4).max(1)));
    default.private_templates = default.private_templates.or(Some(DEFAULT_PRIVATE_TEMPLATES));
    default.functions = default.functions.or(Some(DEFAULT_FUNCTIONS));
    // A fair share of every gateway's slots, as `queued` is of the queues: one tenant that
    // holds its share leaves the rest to the others.
    let async_share = (gateway.max_async_in_flight as u64 / 4).max(1);
    default.async_in_flight = default.async_in_flight.or(Some(DEFAULT_ASYNC_IN_FLIGHT.min(async_share)));
    default.async_results = default.async_results.or(Some(DEFAULT_ASYNC_RESULTS));
    default.async_result_mb = default.async_result_mb.or(Some(DEFAULT_ASYNC_RESULT_MB));
    default.reservations = default.reservations.or(Some(DEFAULT_RESERVATIONS));
    default.reservation_items = default.reservation_items.or(Some(DEFAULT_RESERVATION_ITEMS));
    if let Some(r) = raw.call_rate
        && !(r.is_finite() && r > 0.0 && r <= 1e6)
    {
        return Err(invalid("quotas.call_rate", "must be in (0, 1000000] calls per second"));
    }
    let call_burst = raw.call_burst.unwrap_or_else(|| raw.call_rate.map_or(1, |r| r.ceil() as u64)).max(1);
    Ok(QuotasConfig { enabled: raw.enabled.unwrap_or(true), default, call_rate: raw.call_rate, call_burst })
}

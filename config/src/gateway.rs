//! `[gateway]`: the public API's listener, body and invocation limits, queueing and draining.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::{ConfigError, Overrides, invalid, parse_addr, pick};

/// Loopback only by default: exposing the gateway is a deliberate act.
pub const DEFAULT_GATEWAY_LISTEN: &str = "127.0.0.1:8080";

/// Largest request body the gateway reads (file uploads included).
pub const DEFAULT_MAX_BODY_BYTES: u64 = 64 << 20;

/// A function invocation's payload and result: Lambda's synchronous limit, which RL payloads
/// (a rollout, a candidate solution and its tests) fit in.
pub const DEFAULT_MAX_INVOKE_BYTES: u64 = 6 << 20;

/// Asynchronous invocations' results are kept this long for their caller to collect.
pub const DEFAULT_INVOCATION_TTL: Duration = Duration::from_secs(3600);

/// The longest `invocation_ttl` may be: a week.
pub const MAX_INVOCATION_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// Asynchronous invocations one gateway runs at once (each holds its payload, up to
/// `max_invoke_bytes`, until it ends); more answer 429.
pub const DEFAULT_MAX_ASYNC_IN_FLIGHT: usize = 4096;

/// Requests that may wait for one template on one node before new ones get 429.
pub const DEFAULT_MAX_QUEUE: usize = 4096;

/// How long a session request waits for a sandbox when it names no `max_wait_s`, and the
/// longest it may ask for.
pub const DEFAULT_QUEUE_WAIT: Duration = Duration::from_secs(30);

/// A load balancer polling `/readyz` every second notices a draining gateway within this.
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Long enough for ordinary calls to finish; a longer exec is cut (its client retries).
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(15);

/// The longest a session request may wait for a sandbox (`max_wait_s`).
pub const MAX_QUEUE_WAIT: Duration = Duration::from_secs(300);

/// Nodes sampled per placement (power of k choices): 2 already balances to within a small
/// constant of the best (Mitzenmacher), and each choice costs a Redis script on a miss.
pub const DEFAULT_PLACEMENT_CHOICES: usize = 2;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawGateway {
    listen: Option<String>,
    max_body_bytes: Option<u64>,
    max_queue: Option<usize>,
    #[serde(with = "humantime_serde", default)]
    default_wait: Option<Duration>,
    #[serde(with = "humantime_serde", default)]
    drain_grace: Option<Duration>,
    #[serde(with = "humantime_serde", default)]
    drain_timeout: Option<Duration>,
    max_invoke_bytes: Option<u64>,
    #[serde(with = "humantime_serde", default)]
    invocation_ttl: Option<Duration>,
    max_async_in_flight: Option<usize>,
    placement_choices: Option<usize>,
}

/// `[gateway]`, validated.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Where the public API listens.
    pub listen: SocketAddr,
    /// Largest request body read (file uploads included).
    pub max_body_bytes: u64,
    /// Requests that may wait for one template on one node before new ones get 429.
    pub max_queue: usize,
    /// How long a session request waits for a sandbox when it names no `max_wait_s`.
    pub default_wait: Duration,
    /// On shutdown, how long `/readyz` fails before the listener closes.
    pub drain_grace: Duration,
    /// On shutdown, how long in-flight requests and WebSockets may take to finish.
    pub drain_timeout: Duration,
    /// A function invocation's payload, and its result, at most (default 6 MiB, as Lambda).
    pub max_invoke_bytes: u64,
    /// How long an asynchronous invocation's result is kept (default 1 h).
    pub invocation_ttl: Duration,
    /// Asynchronous invocations this gateway runs at once (default 4096); each top-level
    /// tenant gets a share (`[quotas.default] async_in_flight`).
    pub max_async_in_flight: usize,
    /// Live nodes sampled per placement (power of k choices; default 2).
    pub placement_choices: usize,
}

/// `[gateway]`, with the listen override.
pub(crate) fn validate_gateway(raw: RawGateway, o: &Overrides) -> Result<GatewayConfig, ConfigError> {
    let max_body_bytes = raw.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
    let gateway = GatewayConfig {
        listen: parse_addr("gateway.listen", &pick(&o.gateway_listen, raw.listen, DEFAULT_GATEWAY_LISTEN))?,
        max_body_bytes,
        max_queue: raw.max_queue.unwrap_or(DEFAULT_MAX_QUEUE),
        default_wait: raw.default_wait.unwrap_or(DEFAULT_QUEUE_WAIT),
        drain_grace: raw.drain_grace.unwrap_or(DEFAULT_DRAIN_GRACE),
        drain_timeout: raw.drain_timeout.unwrap_or(DEFAULT_DRAIN_TIMEOUT),
        // Never over the body limit: a smaller body limit lowers the default too.
        max_invoke_bytes: raw.max_invoke_bytes.unwrap_or(DEFAULT_MAX_INVOKE_BYTES.min(max_body_bytes)),
        invocation_ttl: raw.invocation_ttl.unwrap_or(DEFAULT_INVOCATION_TTL),
        max_async_in_flight: raw.max_async_in_flight.unwrap_or(DEFAULT_MAX_ASYNC_IN_FLIGHT),
        placement_choices: raw.placement_choices.unwrap_or(DEFAULT_PLACEMENT_CHOICES),
    };
    if !(1..=16).contains(&gateway.placement_choices) {
        return Err(invalid("gateway.placement_choices", "must be 1 ..= 16"));
    }
    if gateway.max_invoke_bytes == 0 || gateway.max_invoke_bytes > gateway.max_body_bytes {
        return Err(invalid("gateway.max_invoke_bytes", "must be 1 ..= gateway.max_body_bytes"));
    }
    if !(1..=1 << 20).contains(&gateway.max_async_in_flight) {
        return Err(invalid("gateway.max_async_in_flight", "must be 1 ..= 1048576"));
    }
    if gateway.invocation_ttl < Duration::from_secs(1) || gateway.invocation_ttl > MAX_INVOCATION_TTL {
        return Err(invalid("gateway.invocation_ttl", format!("must be 1s ..= {MAX_INVOCATION_TTL:?}")));
    }
    if gateway.default_wait > MAX_QUEUE_WAIT {
        return Err(invalid("gateway.default_wait", format!("must be at most {MAX_QUEUE_WAIT:?}")));
    }
    Ok(gateway)
}

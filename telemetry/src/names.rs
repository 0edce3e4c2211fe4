//! The metric catalog: every metric sandpool exports, its type, help text and labels. Code
//! records through these constants only; `dashboards/` and `dashboards/alerts.yml` may name
//! only metrics listed here (checked in CI against a scrape of a running stack), and the
//! README's metrics list is generated from `CATALOG`.
//!
//! Label cardinality is bounded by design: `node`, `template` (configured templates; a
//! tenant's private snapshot templates are all reported as `private`), `tenant` (the top-level
//! tenant only), `route` (the route template, never the raw path), `method`, `status`, and
//! small closed sets (`start`, `reason`, `code`, `outcome`, `state`, `cause`, `op`, `script`,
//! `policy`, `direction`, `service`, `resource`), and `image` on the lazy-image series only
//! (the lazy images a node's `sandpool-lazyd` has mounted, as `repository@sha256:<12 hex>`:
//! bounded by the node's image disk budget). No session, sandbox or request id is ever a label.

/// What kind of metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (`_total`).
    Counter,
    /// Goes up and down; the value now.
    Gauge,
    /// A distribution of observations (durations, sizes).
    Histogram,
}

/// One metric of the catalog.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    /// The Prometheus name, e.g. `sandpool_http_requests_total`.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// One sentence: what is counted, as the README's metrics table says it.
    pub help: &'static str,
    /// Its label names; never an id of a session, sandbox or request.
    pub labels: &'static [&'static str],
}

macro_rules! catalog {
    ($( $c:ident: $kind:ident $name:literal [$($l:literal),*] $help:literal; )*) => {
        $( #[doc = $help] pub const $c: &str = $name; )*
        /// Every metric, in the order the README lists them.
        pub const CATALOG: &[Metric] = &[
            $( Metric { name: $name, kind: Kind::$kind, help: $help, labels: &[$($l),*] }, )*
        ];
    };
}

catalog! {
    // HTTP (gateway and pool-manager internal API)
    HTTP_REQUESTS: Counter "sandpool_http_requests_total" ["service", "route", "method", "status"]
        "HTTP requests answered, by service (gateway, pool_manager), route template, method and status.";
    HTTP_DURATION: Histogram "sandpool_http_request_duration_seconds" ["service", "route", "method"]
        "Time to answer an HTTP request (to the response head; streams not included).";

    // Named egress (pool-manager's proxy)
    EGRESS_CONNECTIONS: Counter "sandpool_egress_connections_total" ["node", "policy", "outcome"]
        "Connections out of egress sandboxes, by the session's policy and outcome: allowed, denied (by the policy), protected (the node's own services, other sandboxes), screened (a name resolved to a loopback, private, link-local or the node's own address no address rule allows), misnamed (its HTTP Host or TLS SNI names a host the admitting rule does not cover), failed (upstream unreachable), cut (a policy switch ended it). Refusals are logged at most once per sandbox per 10 s.";
    EGRESS_DNS: Counter "sandpool_egress_dns_queries_total" ["node", "outcome"]
        "DNS queries of egress sandboxes, by outcome: answered (a name the policy allows), refused (NXDOMAIN), malformed.";

    // Sessions (gateway)
    SESSIONS_CREATED: Counter "sandpool_sessions_created_total" ["template", "start"]
        "Sessions created, by template and start (warm: an idle sandbox; cold: one created for it).";
    SESSION_CHECKOUT: Histogram "sandpool_session_checkout_duration_seconds" ["template", "start"]
        "Time from a create request to its grant, queue wait included.";
    SESSION_QUEUE_WAIT: Histogram "sandpool_session_queue_wait_seconds" ["template"]
        "Time a create request spent waiting in a queue (requests that queued only).";
    SESSION_REJECTIONS: Counter "sandpool_session_rejections_total" ["template", "code"]
        "Create requests refused, by cause: queue_full, deadline, unhealthy, no_node, node_full, quota.";
    QUOTA_REFUSALS: Counter "sandpool_quota_refusals_total" ["dimension"]
        "Requests refused by a quota, by dimension (sessions, cpus, memory_mb, create_rate, queued, reserved, private_templates, functions, async_in_flight, async_results, async_result_mb, reservations, reservation_items, call_rate, isolation).";
    SESSIONS_ENDED: Counter "sandpool_sessions_ended_total" ["reason"]
        "Sessions ended, by reason (deleted, expired, max_lifetime, sandbox_failed, create_failed, removed).";
    SESSIONS_ACTIVE: Gauge "sandpool_sessions_active" ["node", "tenant"]
        "Live sessions on a node, by top-level tenant.";

    // Pools and nodes (pool-manager)
    POOL_SANDBOXES: Gauge "sandpool_pool_sandboxes" ["node", "template", "state"]
        "Sandboxes of a pool by state: idle, leased, paused, creating.";
    POOL_TARGET: Gauge "sandpool_pool_target" ["node", "template"]
        "The idle count the node steers a pool to (the autoscaler's target if fresh, else warm).";
    POOL_WAITING: Gauge "sandpool_pool_waiting" ["node", "template"]
        "Create requests waiting in a pool's queue.";
    TEMPLATE_HEALTHY: Gauge "sandpool_template_healthy" ["node", "template"]
        "1 while a template's sandboxes start, 0 while it backs off after failures.";
    CREATES: Counter "sandpool_sandbox_creates_total" ["node", "template", "outcome"]
        "Sandbox creates finished, by outcome (ok, failed).";
    CREATE_FAILURES: Counter "sandpool_sandbox_create_failures_total" ["node", "template", "cause"]
        "Failed sandbox creates, by cause (pull, image, runtime, agent, timeout, other).";
    CREATE_DURATION: Histogram "sandpool_sandbox_create_duration_seconds" ["node", "template"]
        "Time to create, start and ready one sandbox.";
    DESTROYS: Counter "sandpool_sandbox_destroys_total" ["node", "reason"]
        "Sandboxes destroyed, by reason.";
    SANDBOX_CPU: Counter "sandpool_sandbox_cpu_seconds_total" ["node", "template"]
        "CPU time sandboxes used (their cgroups), in whole seconds, counted when a session is read and when its sandbox ends. Over the rate of execs: the sandbox's CPU per command.";
    SANDBOX_CPU_THROTTLED: Counter "sandpool_sandbox_cpu_throttled_seconds_total" ["node", "template"]
        "Time CFS held sandboxes back for having spent their CPU quota within a period (the template's cpu_period), in whole seconds, counted like sandpool_sandbox_cpu_seconds_total: the tenant's quota at work, not the platform's latency.";
    NODE_CAPACITY: Gauge "sandpool_node_capacity_sandboxes" ["node"]
        "The most sandboxes the node may hold: its budget, the least that any resource (threads, memory, open files, max_sandboxes) leaves room for after a 10 % reserve.";
    NODE_BUDGET: Gauge "sandpool_node_budget_sandboxes" ["node", "resource"]
        "Sandboxes each resource leaves room for on the node (threads, memory_mb, open_files, max_sandboxes); the least is the capacity.";
    NODE_SANDBOXES: Gauge "sandpool_node_sandboxes" ["node"]
        "Sandboxes the node holds now, in any state.";
    NODE_CREATE_BUDGET: Gauge "sandpool_node_create_budget_per_second" ["node"]
        "The node's create budget (create_rate).";
    NODE_CREATE_WINDOW: Gauge "sandpool_node_create_window" ["node"]
        "Creates the node keeps in flight now: its window, adapted to what Docker sustains (at most max_creates_in_flight).";
    NODE_CREATE_RATE: Gauge "sandpool_node_create_rate_per_second" ["node"]
        "Creates per second the node sustained recently (EWMA).";
    NODE_HEARTBEAT_AGE: Gauge "sandpool_node_heartbeat_age_seconds" ["node"]
        "Seconds since the node's last heartbeat, as the autoscaler reads it.";
    NODES_LOST: Counter "sandpool_nodes_lost_total" []
        "Nodes given up after node.lost_after without a heartbeat (their sessions ended with node_lost).";
    LEDGER_REBUILDS: Counter "sandpool_ledger_rebuilds_total" ["node"]
        "Times a node rebuilt its part of the ledger from its sandboxes because Redis had forgotten them.";

    // Autoscaler
    AUTOSCALER_TARGET: Gauge "sandpool_autoscaler_target" ["node", "template", "policy"]
        "Idle target per policy step (reservations, forecast, reactive) and the combined one (combined).";
    AUTOSCALER_FORECAST: Gauge "sandpool_autoscaler_forecast_sandboxes" ["template"]
        "Size of the next burst the learned policy expects.";
    AUTOSCALER_FORECAST_IN: Gauge "sandpool_autoscaler_forecast_next_burst_seconds" ["template"]
        "Seconds until that burst is expected.";
    RESERVATIONS_PENDING: Gauge "sandpool_reservations_pending" ["template"]
        "Sandboxes reserved by reservations whose hold has not ended.";

    // Functions (gateway)
    FUNCTION_INVOCATIONS: Counter "sandpool_function_invocations_total" ["mode", "start", "outcome"]
        "Function invocations, by mode (exec, runtime), start (warm: an idle environment; cold: one made for it) and outcome (ok, handled, unhandled, timeout, crashed, error: the call failed before the function ran).";
    FUNCTION_DURATION: Histogram "sandpool_function_invoke_duration_seconds" ["mode", "start"]
        "Time to answer an invocation at the gateway (a cold one's environment start included).";
    FUNCTION_ENVIRONMENTS_MADE: Counter "sandpool_function_environments_made_total" ["why"]
        "Function environments made: demand (an invocation found none idle), keeper (ahead of demand: min_warm or Little's law).";
    FUNCTION_REFUSALS: Counter "sandpool_function_refusals_total" ["reason"]
        "Invocations refused before they ran: concurrency (the function's max_concurrency, 429).";

    // Exec and streams
    EXEC_DURATION: Histogram "sandpool_exec_duration_seconds" ["template", "outcome"]
        "Exec round trips at the pool-manager, by outcome (exit, timeout, error); its count is the exec count.";
    WS_OPEN: Gauge "sandpool_ws_sessions_open" ["service"]
        "Open session WebSockets.";
    WS_BYTES: Counter "sandpool_ws_bytes_total" ["service", "direction"]
        "WebSocket payload bytes relayed, by direction (in: from the client, out: to it).";
    PORT_CONNECTIONS: Counter "sandpool_port_connections_total" ["outcome"]
        "Connections to sandboxes' ports (pool-manager), by outcome: opened, refused (nothing listens), failed (the agent could not), over_limit (pool_manager.max_port_connections, 429), cut (closed at pool_manager.max_port_bytes).";
    PORT_CONNECTIONS_OPEN: Gauge "sandpool_port_connections_open" []
        "Open connections to sandboxes' ports (pool-manager).";
    PORT_BYTES: Counter "sandpool_port_bytes_total" ["direction"]
        "Bytes relayed to and from sandboxes' ports (pool-manager), by direction (in: towards the port, out: from it).";

    // Dependencies
    REDIS_DURATION: Histogram "sandpool_redis_script_duration_seconds" ["script"]
        "Ledger script round trips, by script.";
    REDIS_ERRORS: Counter "sandpool_redis_errors_total" ["script"]
        "Ledger script calls that failed, by script.";
    DOCKER_DURATION: Histogram "sandpool_docker_call_duration_seconds" ["op"]
        "Docker API calls, by operation.";
    DOCKER_ERRORS: Counter "sandpool_docker_errors_total" ["op"]
        "Docker API calls that failed or timed out, by operation.";
    IMAGE_PULL_DURATION: Histogram "sandpool_image_pull_duration_seconds" ["node", "outcome"]
        "Image pulls of templates made from images (one per image however many creates wait for it), by outcome (ok, failed).";
    IMAGE_DISK_BYTES: Gauge "sandpool_image_disk_bytes" ["node"]
        "Sizes of the pulled images the node holds (shared layers counted in each) plus its lazy chunk cache, against its images.disk_budget_mb.";
    IMAGE_EVICTIONS: Counter "sandpool_image_evictions_total" ["node"]
        "Pulled images the node removed, least recently used first, to stay within its image disk budget.";
    // Lazy images (the pool-manager reads its node's sandpool-lazyd every 5 s)
    LAZY_FETCHED_BYTES: Counter "sandpool_lazy_fetched_bytes_total" ["node", "image"]
        "Bytes of a lazy image's blob fetched from its registry (on demand, read-ahead and prefetch), per mounted image: against sandpool_lazy_image_bytes, the share of the image a node ever needed.";
    LAZY_IMAGE_BYTES: Gauge "sandpool_lazy_image_bytes" ["node", "image"]
        "Size of each mounted lazy image's blob (what a whole pull would transfer, compressed EROFS).";
    LAZY_CHUNK_READS: Counter "sandpool_lazy_chunk_reads_total" ["node", "image", "outcome"]
        "Chunk reads of lazy images, by outcome: hit (the node's chunk cache), miss (fetched from the registry), error (the fetch failed: the reader got EIO).";
    LAZY_FETCH_DURATION: Histogram "sandpool_lazy_fetch_duration_seconds" ["node"]
        "Registry range reads of lazy image chunks (one per chunk fetched or failed), as sandpool-lazyd timed them (counted in its buckets, so _sum is each read at its bucket's upper bound).";
    LAZY_CACHE_BYTES: Gauge "sandpool_lazy_cache_bytes" ["node"]
        "Bytes the node's lazy chunk cache holds; counted in images.disk_budget_mb with the pulled images.";
    LAZY_CACHE_LIMIT: Gauge "sandpool_lazy_cache_limit_bytes" ["node"]
        "The chunk cache's bound: the image disk budget less the pulled images (at least 8 MiB); least recently used chunks go beyond it.";
    LAZY_PREFETCHED_CHUNKS: Counter "sandpool_lazy_prefetched_chunks_total" ["node"]
        "Chunks fetched ahead of any reader by a prefetch of a lazy image (its recorded access profile, shared through the ledger).";
    AGENT_REATTACHES: Counter "sandpool_agent_reattaches_total" ["node"]
        "Agent channels reattached after a pool-manager restart.";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_prometheus_conventions() {
        let mut seen = std::collections::HashSet::new();
        for m in CATALOG {
            assert!(seen.insert(m.name), "{} twice", m.name);
            assert!(m.name.starts_with("sandpool_"), "{}", m.name);
            match m.kind {
                Kind::Counter => assert!(m.name.ends_with("_total"), "{}", m.name),
                Kind::Histogram => assert!(m.name.ends_with("_seconds"), "{}", m.name),
                Kind::Gauge => assert!(!m.name.ends_with("_total"), "{}", m.name),
            }
            for l in m.labels {
                assert!(!["session", "sandbox", "request_id", "session_id"].contains(l), "{}: {l}", m.name);
            }
        }
    }
}

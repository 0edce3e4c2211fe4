//! The node's series that start at 0 (`telemetry::zeros`): its configured templates' creates,
//! create failures by cause and execs by outcome; destroys and ended sessions by reason; the
//! Docker calls and ledger scripts it makes; its WebSocket gauges; and its live sessions, which
//! a node that has seen no tenant yet reports as one series with an empty tenant (Prometheus
//! reads an empty label as absent): 0, rather than no series at all.

use config::Config;
use telemetry::metrics::template_label;
use telemetry::names;
use telemetry::zeros::zeros;
use wire::GoneReason;

pub(crate) fn register(config: &Config, node: &str) {
    let node = [node];
    let mut templates: Vec<&str> = config.templates.keys().map(|t| template_label(t)).collect();
    templates.sort_unstable();
    templates.dedup();
    zeros(names::CREATES, &[("node", &node), ("template", &templates), ("outcome", &["ok", "failed"])]);
    zeros(
        names::CREATE_FAILURES,
        &[("node", &node), ("template", &templates), ("cause", &crate::node::pools::FAILURE_CAUSES)],
    );
    zeros(names::CREATE_DURATION, &[("node", &node), ("template", &templates)]);
    zeros(names::EXEC_DURATION, &[("template", &templates), ("outcome", &["exit", "timeout", "error"])]);
    let ended: Vec<&str> = GoneReason::ALL.iter().map(|r| r.as_str()).collect();
    zeros(names::SESSIONS_ENDED, &[("reason", &ended)]);
    // A destroy names the session's end, or `orphan` (a container the ledger does not know).
    let destroyed: Vec<&str> = ended.iter().copied().chain(["orphan"]).collect();
    zeros(names::DESTROYS, &[("node", &node), ("reason", &destroyed)]);
    zeros(names::AGENT_REATTACHES, &[("node", &node)]);
    zeros(names::LEDGER_REBUILDS, &[("node", &node)]);
    zeros(names::NODES_LOST, &[]);
    zeros(names::IMAGE_PULL_DURATION, &[("node", &node), ("outcome", &["ok", "failed"])]);
    zeros(names::IMAGE_EVICTIONS, &[("node", &node)]);
    // The lazy images' series: the node's at 0, and per image one with an empty image (absent
    // to Prometheus) until an image is mounted, as for tenants below.
    for name in
        [names::LAZY_CACHE_BYTES, names::LAZY_CACHE_LIMIT, names::LAZY_FETCH_DURATION, names::LAZY_PREFETCHED_CHUNKS]
    {
        zeros(name, &[("node", &node)]);
    }
    zeros(names::LAZY_FETCHED_BYTES, &[("node", &node), ("image", &[""])]);
    zeros(names::LAZY_IMAGE_BYTES, &[("node", &node), ("image", &[""])]);
    zeros(names::LAZY_CHUNK_READS, &[("node", &node), ("image", &[""]), ("outcome", &["hit", "miss", "error"])]);
    zeros(names::DOCKER_ERRORS, &[("op", crate::docker::DOCKER_OPS)]);
    zeros(names::DOCKER_DURATION, &[("op", crate::docker::DOCKER_OPS)]);
    zeros(names::REDIS_ERRORS, &[("script", ledger::SCRIPT_NAMES)]);
    zeros(names::REDIS_DURATION, &[("script", ledger::SCRIPT_NAMES)]);
    zeros(names::WS_OPEN, &[("service", &["pool_manager"])]);
    zeros(names::WS_BYTES, &[("service", &["pool_manager"]), ("direction", &["in", "out"])]);
    zeros(names::SESSIONS_ACTIVE, &[("node", &node), ("tenant", &[""])]);
}

//! `GET /metrics` of a stack: a session's life (create, exec, delete) shows up in the series
//! the catalog promises, with plausible values, and nothing outside the catalog is exported.
//! The recorder is process-wide, so series with a `node` label are filtered by this stack's.

use std::collections::BTreeMap;
use std::time::Duration;

use tests::{Stack, StackOpts, eventually};

use crate::FILL;

/// One scrape: every sample line as (name, labels) → value.
struct Scrape {
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
    text: String,
}

impl Scrape {
    fn parse(text: String) -> Scrape {
        let mut samples = Vec::new();
        for line in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
            let (series, value) = line.rsplit_once(' ').expect("a sample line");
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("a number in {line:?}"));
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split("\",")
                .filter(|p| !p.is_empty())
                .filter_map(|p| p.split_once('='))
                .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
                .collect();
            samples.push((name.to_string(), labels, value));
        }
        Scrape { samples, text }
    }

    /// The sum over the series of `name` that carry every label of `with`.
    fn sum(&self, name: &str, with: &[(&str, &str)]) -> Option<f64> {
        let mut found = None;
        for (n, labels, v) in &self.samples {
            if n == name && with.iter().all(|(k, want)| labels.get(*k).is_some_and(|got| got == want)) {
                *found.get_or_insert(0.0) += v;
            }
        }
        found
    }

    fn get(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        self.sum(name, with).unwrap_or_else(|| panic!("no series {name} with {with:?} in\n{}", self.text))
    }
}

async fn scrape(http: &reqwest::Client, url: &str) -> Scrape {
    let resp = http.get(url).send().await.expect("metrics answers");
    assert_eq!(resp.status(), 200);
    let ct = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    Scrape::parse(resp.text().await.expect("metrics body"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_life_shows_in_the_metrics() {
    let mut stack = Stack::start(StackOpts { metrics: true, warm: 2, ..Default::default() }).await;
    let url = stack.metrics_url.clone().expect("metrics: true serves /metrics");
    let node = stack.node.id.clone();
    let n = node.as_str();
    stack.wait_idle("bb", 2, FILL).await;

    let c = stack.client("acme/rl-team");
    let s = c.create("bb").await;
    let sid = s["session_id"].as_str().unwrap().to_string();
    assert_eq!(c.sh(&sid, "echo hi").await["stdout"], "hi\n");
    let timed_out = c.exec(&sid, serde_json::json!({ "cmd": "sleep 5", "timeout_ms": 200 })).await;
    assert_eq!(timed_out.status, 200, "{:?}", timed_out.body);
    assert_eq!(c.call(reqwest::Method::GET, "/v1/nowhere", None).await.status, 404);

    // Live: the session counts under its top-level tenant (the stats loop runs twice a second).
    let live = eventually(Duration::from_secs(10), || async {
        let m = scrape(&stack.http, &url).await;
        // Both come from the node's stats loop, which may publish between the two.
        let leased = m.sum("sandpool_pool_sandboxes", &[("node", n), ("template", "bb"), ("state", "leased")]);
        (m.sum("sandpool_sessions_active", &[("node", n), ("tenant", "acme")]) == Some(1.0) && leased == Some(1.0))
            .then_some(m)
    })
    .await
    .expect("sessions_active{tenant=acme} and the leased sandbox reach 1");
    assert_eq!(live.sum("sandpool_pool_sandboxes", &[("node", n), ("template", "bb"), ("state", "leased")]), Some(1.0));

    assert_eq!(c.delete(&sid).await, 204);
    let m = eventually(Duration::from_secs(20), || async {
        let m = scrape(&stack.http, &url).await;
        let gone = m.sum("sandpool_sessions_active", &[("node", n), ("tenant", "acme")]) == Some(0.0);
        let destroyed = m.sum("sandpool_sandbox_destroys_total", &[("node", n)]).unwrap_or(0.0) >= 1.0;
        let refilled =
            m.sum("sandpool_pool_sandboxes", &[("node", n), ("template", "bb"), ("state", "idle")]) == Some(2.0);
        // Settled: nothing still being created or destroyed (a loaded machine lags).
        let settled = m.sum("sandpool_node_sandboxes", &[("node", n)]) == Some(2.0);
        // The destroy is counted when it starts; Docker's remove call when it has answered.
        let removed =
            m.sum("sandpool_docker_call_duration_seconds_count", &[("op", "remove container")]).unwrap_or(0.0) >= 1.0;
        (gone && destroyed && refilled && settled && removed).then_some(m)
    })
    .await
    .expect("the session ends, its sandbox is destroyed and the pool refills in the metrics");

    // Every exported metric is in the catalog, with its type.
    let catalog: BTreeMap<&str, &telemetry::names::Metric> =
        telemetry::names::CATALOG.iter().map(|m| (m.name, m)).collect();
    for (name, labels, _) in &m.samples {
        let base = ["_bucket", "_sum", "_count"].iter().fold(name.as_str(), |n, s| n.strip_suffix(s).unwrap_or(n));
        let metric = catalog.get(name.as_str()).or_else(|| catalog.get(base));
        let metric = metric.unwrap_or_else(|| panic!("{name} is not in the catalog"));
        for l in labels.keys().filter(|l| *l != "le") {
            assert!(metric.labels.contains(&l.as_str()), "{name}: label {l} is not in the catalog");
        }
    }
    for m2 in telemetry::names::CATALOG {
        let kind = match m2.kind {
            telemetry::names::Kind::Counter => "counter",
            telemetry::names::Kind::Gauge => "gauge",
            telemetry::names::Kind::Histogram => "histogram",
        };
        if m.text.contains(&format!("\n{} ", m2.name)) || m.text.contains(&format!("\n{}{{", m2.name)) {
            assert!(m.text.contains(&format!("# TYPE {} {kind}", m2.name)), "{} has no TYPE {kind}", m2.name);
        }
    }

    // HTTP, by route template (never the raw path), both services.
    let gw = |route: &str, method: &str, status: &str| {
        m.sum(
            "sandpool_http_requests_total",
            &[("service", "gateway"), ("route", route), ("method", method), ("status", status)],
        )
        .unwrap_or(0.0)
    };
    assert!(gw("/v1/sessions", "POST", "201") >= 1.0, "{}", m.text);
    assert!(gw("/v1/sessions/{id}/exec", "POST", "200") >= 2.0);
    assert!(gw("/v1/sessions/{id}", "DELETE", "204") >= 1.0);
    assert!(gw("unmatched", "GET", "404") >= 1.0);
    assert!(!m.text.contains(&sid), "a session id leaked into a label");
    assert!(
        m.get(
            "sandpool_http_requests_total",
            &[("service", "pool_manager"), ("route", "/internal/v1/sandboxes/{sandbox}/exec"), ("status", "200")]
        ) >= 2.0
    );
    assert!(m.get("sandpool_http_request_duration_seconds_count", &[("service", "gateway")]) >= 4.0);

    // Sessions.
    assert!(m.get("sandpool_sessions_created_total", &[("template", "bb"), ("start", "warm")]) >= 1.0);
    let checkouts = m.get("sandpool_session_checkout_duration_seconds_count", &[("template", "bb")]);
    let checkout_s = m.get("sandpool_session_checkout_duration_seconds_sum", &[("template", "bb")]);
    assert!(checkouts >= 1.0 && checkout_s / checkouts < 1.0, "a warm checkout takes {}s", checkout_s / checkouts);
    assert!(m.get("sandpool_sessions_ended_total", &[("reason", "deleted")]) >= 1.0);

    // Exec: one exit, one timeout.
    assert!(m.get("sandpool_exec_duration_seconds_count", &[("template", "bb"), ("outcome", "exit")]) >= 1.0);
    assert!(m.get("sandpool_exec_duration_seconds_count", &[("template", "bb"), ("outcome", "timeout")]) >= 1.0);
    let exec_le_5s =
        m.get("sandpool_exec_duration_seconds_bucket", &[("template", "bb"), ("outcome", "exit"), ("le", "5")]);
    assert!(exec_le_5s >= 1.0, "an echo took over 5 s");

    // Pools and the node.
    let pool = |state: &str| m.get("sandpool_pool_sandboxes", &[("node", n), ("template", "bb"), ("state", state)]);
    assert_eq!((pool("idle"), pool("leased"), pool("paused")), (2.0, 0.0, 0.0));
    assert_eq!(m.get("sandpool_pool_target", &[("node", n), ("template", "bb")]), 2.0);
    assert_eq!(m.get("sandpool_pool_waiting", &[("node", n), ("template", "bb")]), 0.0);
    assert_eq!(m.get("sandpool_template_healthy", &[("node", n), ("template", "bb")]), 1.0);
    let creates = m.get("sandpool_sandbox_creates_total", &[("node", n), ("template", "bb"), ("outcome", "ok")]);
    assert!(creates >= 3.0, "2 warm + 1 refill, got {creates}");
    let create_s = m.get("sandpool_sandbox_create_duration_seconds_sum", &[("node", n), ("template", "bb")]);
    let create_n = m.get("sandpool_sandbox_create_duration_seconds_count", &[("node", n), ("template", "bb")]);
    assert!(create_n == creates && create_s / create_n > 0.001 && create_s / create_n < 60.0, "{create_s}/{create_n}");
    assert!(m.get("sandpool_sandbox_destroys_total", &[("node", n), ("reason", "removed")]) >= 1.0);
    assert_eq!(
        m.get("sandpool_node_capacity_sandboxes", &[("node", n)]),
        stack.config.pool_manager.max_sandboxes as f64
    );
    assert_eq!(m.get("sandpool_node_sandboxes", &[("node", n)]), 2.0);
    assert_eq!(m.get("sandpool_node_create_budget_per_second", &[("node", n)]), 50.0);
    assert!(m.get("sandpool_node_create_rate_per_second", &[("node", n)]) > 0.0);

    // Dependencies: the ledger's scripts and Docker's calls, by static names.
    assert!(m.get("sandpool_redis_script_duration_seconds_count", &[("script", "grant")]) >= 1.0);
    assert!(m.get("sandpool_redis_script_duration_seconds_count", &[("script", "release")]) >= 1.0);
    assert!(m.get("sandpool_docker_call_duration_seconds_count", &[("op", "create container")]) >= 3.0);
    assert!(m.get("sandpool_docker_call_duration_seconds_count", &[("op", "remove container")]) >= 1.0);

    // A restarted pool-manager reattaches its sandboxes' agents.
    stack.restart_pool_manager().await;
    let reattached = eventually(Duration::from_secs(10), || async {
        let m = scrape(&stack.http, &url).await;
        (m.sum("sandpool_agent_reattaches_total", &[("node", n)]) >= Some(2.0)).then_some(())
    })
    .await;
    assert!(reattached.is_some(), "the 2 idle sandboxes' agents were not counted as reattached");
    stack.shutdown().await;
}

/// A session's CPU (`GET /v1/sessions/{id}`: `cpu_ms`, `cpu_throttled_ms`) is read from its
/// sandbox's cgroup files, not by a Docker stats call per read (issue 34): each read lies
/// between two readings of the cgroup taken around it, and the node's count of Docker's
/// `container stats` calls does not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_cpu_comes_from_its_cgroup_without_a_docker_call() {
    let stack = Stack::start(StackOpts { metrics: true, warm: 1, ..Default::default() }).await;
    let url = stack.metrics_url.clone().expect("metrics: true serves /metrics");
    stack.wait_idle("bb", 1, FILL).await;
    let c = stack.client("acme");
    let sid = c.create("bb").await["session_id"].as_str().unwrap().to_string();
    let info = c.call(reqwest::Method::GET, &format!("/v1/sessions/{sid}"), None).await.body;
    let sandbox = info["sandbox_id"].as_str().unwrap().to_string();
    let pid = tests::container_pid(&sandbox).expect("the sandbox's container runs");
    // Some CPU to count.
    c.sh(&sid, "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done").await;
    let stats_calls =
        |m: &Scrape| m.sum("sandpool_docker_call_duration_seconds_count", &[("op", "container stats")]).unwrap_or(0.0);
    let before = stats_calls(&scrape(&stack.http, &url).await);
    let mut last = 0.0;
    for _ in 0..5 {
        let lo = tests::cgroup_cpu_usage(pid).unwrap().as_secs_f64() * 1e3;
        let got = c.call(reqwest::Method::GET, &format!("/v1/sessions/{sid}"), None).await.body;
        let hi = tests::cgroup_cpu_usage(pid).unwrap().as_secs_f64() * 1e3;
        let cpu = got["cpu_ms"].as_f64().unwrap_or_else(|| panic!("cpu_ms in {got}"));
        // The node and this test turn the same nanoseconds into milliseconds by different float
        // steps (36.402762 against 36.402761999999996 for an idle sandbox): 1 ns of slack.
        const NS: f64 = 1e-6;
        assert!(lo - NS <= cpu && cpu <= hi + NS && cpu >= last, "{lo} <= {cpu} <= {hi}, after {last}: {got}");
        assert!(got["cpu_throttled_ms"].as_f64().is_some_and(|t| t >= 0.0), "{got}");
        last = cpu;
    }
    assert!(last > 0.0, "the loop's CPU shows");
    let after = stats_calls(&scrape(&stack.http, &url).await);
    assert_eq!(after, before, "no Docker stats call for the reads");
    stack.shutdown().await;
}

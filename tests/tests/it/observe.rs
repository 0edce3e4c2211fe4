//! The dashboards and alert rules of `dashboards/` against a real stack and a real Prometheus:
//! every metric they name is exported, every panel's query returns data, every rule evaluates;
//! the shipped configs pass promtool, and the committed JSON is what `dashboards/gen.py` makes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use futures::{SinkExt, StreamExt};
use reqwest::Method;
use serde_json::{Value, json};
use tests::{Stack, StackOpts, rand_hex};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_util::sync::CancellationToken;

use crate::FILL;

const DASHBOARDS: [&str; 4] = ["overview.json", "pools.json", "tenants.json", "exec.json"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
}

fn dashboards_dir() -> PathBuf {
    root().join("dashboards")
}

/// Runs a command to completion; panics with its output unless it succeeds. Returns the output.
fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?} did not start: {e} (scripts/test installs it)"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed ({}):\n{text}", out.status);
    text
}

#[test]
fn the_committed_dashboards_are_what_gen_py_makes() {
    run(Command::new("python3").arg(dashboards_dir().join("gen.py")).arg("--check"));
}

#[test]
fn the_shipped_prometheus_config_and_rules_pass_promtool() {
    let d = dashboards_dir();
    let out = run(Command::new("promtool").arg("check").arg("config").arg(d.join("prometheus.yml")));
    assert!(out.contains("SUCCESS"), "{out}");
    let out = run(Command::new("promtool").arg("check").arg("rules").arg(d.join("alerts.yml")));
    assert!(out.contains("SUCCESS"), "{out}");
    // The rules' unit tests: each alert fires on the series it is meant for, not on others.
    let out = run(Command::new("promtool").arg("test").arg("rules").arg(d.join("alerts_test.yml")));
    assert!(out.contains("SUCCESS"), "{out}");
}

// ── Prometheus as a child process ───────────────────────────────────────────────────────────

/// A Prometheus on 127.0.0.1, killed and its data removed on drop.
struct Prometheus {
    child: Child,
    dir: PathBuf,
    url: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Prometheus {
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Starts Prometheus scraping `metrics_url` every second with dashboards/alerts.yml loaded,
    /// and waits (bounded) until it is ready.
    async fn start(metrics_url: &str) -> Prometheus {
        let rest = metrics_url.strip_prefix("http://").expect("an http metrics url");
        let (target, path) = rest.split_once('/').map_or((rest, "metrics"), |(t, p)| (t, p));
        let dir = std::env::temp_dir().join(format!("sandpool-observe-{}", rand_hex(10)));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let rules = dashboards_dir().join("alerts.yml");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules:?}\n\
             scrape_configs:\n  - job_name: sandpool\n    metrics_path: /{path}\n    static_configs:\n      - targets: [{target:?}]\n",
            rules = rules.display().to_string(),
        );
        let config_file = dir.join("prometheus.yml");
        std::fs::write(&config_file, config).expect("write prometheus.yml");
        run(Command::new("promtool").arg("check").arg("config").arg(&config_file));

        let mut last_log = String::new();
        for _attempt in 0..3 {
            // A free port; Prometheus binds it a moment later (retried if someone else did).
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let log = std::fs::File::create(dir.join("prometheus.log")).expect("log file");
            let child = Command::new("prometheus")
                .arg(format!("--config.file={}", config_file.display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
                .arg("--log.level=warn")
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("start prometheus (package prometheus; scripts/test installs it)");
            let mut p = Prometheus { child, dir: dir.clone(), url: format!("http://127.0.0.1:{port}") };
            let http = reqwest::Client::new();
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = p.child.try_wait() {
                    break;
                }
                let ready = http.get(format!("{}/-/ready", p.url)).send().await;
                if ready.is_ok_and(|r| r.status().is_success()) {
                    return p;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            last_log = p.log_tail();
            // Keep the directory for the next attempt.
            let _ = p.child.kill();
            let _ = p.child.wait();
            p.dir = PathBuf::new();
        }
        let _ = std::fs::remove_dir_all(&dir);
        panic!("prometheus did not become ready; its log:\n{last_log}");
    }

    /// An instant query: its result (a vector's samples; a scalar counts as one), or the error.
    async fn query(&self, http: &reqwest::Client, q: &str) -> Result<Vec<Value>, String> {
        let url = format!("{}/api/v1/query?query={}", self.url, urlencode(q));
        let resp = http.get(url).send().await.map_err(|e| e.to_string())?;
        let body: Value = resp.json().await.map_err(|e| e.to_string())?;
        if body["status"] != "success" {
            return Err(format!("{}: {}", body["errorType"], body["error"]));
        }
        Ok(match &body["data"]["result"] {
            Value::Array(v) if body["data"]["resultType"] == "vector" || body["data"]["resultType"] == "matrix" => {
                v.clone()
            }
            v => vec![v.clone()],
        })
    }

    async fn get(&self, http: &reqwest::Client, path: &str) -> Value {
        http.get(format!("{}{path}", self.url)).send().await.expect("prometheus answers").json().await.expect("json")
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

// ── what the dashboards and rules ask for ──────────────────────────────────────────────────

/// One query of a dashboard: where it is, and its PromQL as Grafana would send it.
struct PanelQuery {
    place: String,
    expr: String,
}

fn panels_of(panels: &[Value], out: &mut Vec<Value>) {
    for p in panels {
        out.push(p.clone());
        if let Some(inner) = p["panels"].as_array() {
            panels_of(inner, out);
        }
    }
}

/// Grafana's substitution of the dashboards' variables, for a test stack of node `node`.
fn substitute(expr: &str, node: &str) -> String {
    let mut e = expr.to_string();
    for (var, value) in [
        ("__rate_interval", "1m"),
        ("__interval", "15s"),
        ("__range", "5m"),
        ("node", node),
        ("template", ".*"),
        ("tenant", ".*"),
        ("datasource", "prometheus"),
    ] {
        e = e.replace(&format!("${{{var}}}"), value).replace(&format!("${var}"), value);
    }
    e
}

/// Every query of every dashboard (panel targets, and the variables' `label_values(m, l)` as
/// `count by (l) (m)`), with the variables substituted.
fn dashboard_queries(node: &str) -> Vec<PanelQuery> {
    let mut out = Vec::new();
    for file in DASHBOARDS {
        let text = std::fs::read_to_string(dashboards_dir().join(file)).expect("dashboard file");
        let d: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(d["schemaVersion"].as_u64().unwrap_or(0) >= 39, "{file}: schemaVersion");
        let vars: Vec<&Value> = d["templating"]["list"].as_array().expect("templating").iter().collect();
        assert!(vars.iter().any(|v| v["name"] == "datasource" && v["type"] == "datasource"), "{file}: ${{datasource}}");
        for v in vars.iter().filter(|v| v["type"] == "query") {
            let q = v["query"]["query"].as_str().or(v["query"].as_str()).expect("variable query");
            let inner = q.strip_prefix("label_values(").and_then(|r| r.strip_suffix(')')).expect("label_values(m, l)");
            let (metric, label) = inner.rsplit_once(',').expect("label_values(m, l)");
            out.push(PanelQuery {
                place: format!("{file} variable ${}", v["name"].as_str().unwrap_or("?")),
                expr: substitute(&format!("count by ({}) ({})", label.trim(), metric.trim()), node),
            });
        }
        let mut panels = Vec::new();
        panels_of(d["panels"].as_array().expect("panels"), &mut panels);
        let mut n = 0;
        for p in &panels {
            for t in p["targets"].as_array().into_iter().flatten() {
                let expr = t["expr"].as_str().expect("a target's expr");
                assert_eq!(t["datasource"]["uid"], "${datasource}", "{file} {}: datasource", p["title"]);
                n += 1;
                out.push(PanelQuery {
                    place: format!("{file} panel {:?} ({})", p["title"].as_str().unwrap_or(""), t["refId"]),
                    expr: substitute(expr, node),
                });
            }
        }
        assert!(n >= 8, "{file}: only {n} queries");
    }
    for q in &out {
        assert!(!q.expr.contains('$'), "{}: a variable no dashboard defines: {}", q.place, q.expr);
    }
    out
}

/// The metric names a PromQL expression uses (`sandpool_…`, with `_bucket`/`_sum`/`_count`
/// stripped).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("sandpool_") {
        let start = i + at;
        let word_start = start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
        let mut end = start;
        while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'_') {
            end += 1;
        }
        if word_start {
            names.insert(base_name(&expr[start..end]).to_string());
        }
        i = end;
    }
    names
}

fn base_name(name: &str) -> &str {
    ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name)
}

/// Metric names in a Prometheus text exposition (suffixes stripped).
fn exposed_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(|n| base_name(n).to_string())
        .collect()
}

// ── the load ────────────────────────────────────────────────────────────────────────────────

/// Files periodic arrival spikes of `template` (two bursts, a minute apart, in the past hour)
/// under the stack's prefix, so an autoscaler started afterwards learns a forecast at once.
async fn seed_arrival_history(prefix: &str, template: &str) {
    let mut conn = tests::redis_conn().await;
    let (now_s, _): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.expect("TIME");
    let keys = ledger::Keys::new(prefix);
    for second in [now_s - 130, now_s - 70] {
        let _: () = redis::cmd("SET")
            .arg(keys.arrivals(template, second))
            .arg(25)
            .arg("EX")
            .arg(3600)
            .query_async(&mut conn)
            .await
            .expect("SET arrivals");
    }
}

/// One ledger script call that fails: the session's record is briefly not a hash, so the
/// `lookup` script errors (WRONGTYPE) and the gateway answers 5xx; then the record is restored.
async fn one_failing_ledger_call(stack: &Stack, c: &tests::Client, sid: &str) {
    let mut conn = tests::redis_conn().await;
    let node = wire::ids::node_of(sid).expect("a session id names its node");
    let key = ledger::Keys::new(stack.ledger_prefix()).node(node).ses(sid);
    let dump: Vec<u8> = redis::cmd("DUMP").arg(&key).query_async(&mut conn).await.expect("DUMP");
    assert!(!dump.is_empty(), "no record at {key}");
    let _: () = redis::cmd("SET").arg(&key).arg("not a hash").query_async(&mut conn).await.expect("SET");
    let a = c.call(Method::GET, &format!("/v1/sessions/{sid}"), None).await;
    let _: () =
        redis::cmd("RESTORE").arg(&key).arg(0).arg(dump).arg("REPLACE").query_async(&mut conn).await.expect("RESTORE");
    assert!(a.status >= 500, "a broken session record answered {}: {:?}", a.status, a.body);
    assert_eq!(c.call(Method::GET, &format!("/v1/sessions/{sid}"), None).await.status, 200, "restored");
}

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A WebSocket that runs `cat` on some input and closes.
async fn one_websocket(url: &str, sid: &str, token: &str) {
    let mut req = format!("{}/v1/sessions/{sid}/ws", url.replace("http://", "ws://")).into_client_request().unwrap();
    req.headers_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    let mut ws: Ws = tokio_tungstenite::connect_async(req).await.expect("websocket upgrade").0;
    for m in [
        json!({"type": "start", "id": "c", "cmd": ["cat"]}),
        json!({"type": "stdin", "id": "c", "data": "observed\n"}),
        json!({"type": "stdin_eof", "id": "c"}),
    ] {
        ws.send(Message::Text(m.to_string().into())).await.unwrap();
    }
    let mut out = String::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), ws.next()).await.expect("a message in time");
        let Message::Text(t) = m.expect("socket open").expect("frame") else { continue };
        let v: Value = serde_json::from_str(&t).unwrap();
        match v["type"].as_str() {
            Some("stdout") => out.push_str(v["data"].as_str().unwrap_or("")),
            Some("exit") => break,
            Some("error") => panic!("websocket error: {v}"),
            _ => {}
        }
    }
    assert_eq!(out, "observed\n");
    let _ = ws.close(None).await;
}

/// Drives the series the dashboards show: warm and cold starts (and a queue wait), execs that
/// exit, fail (127) and time out, a WebSocket, a delete, rejections of a template whose image
/// does not exist (with its create failures and Docker errors), a reservation, a quota
/// refusal, a failing
/// ledger call, and agent reattaches after a pool-manager restart. Leaves sessions of two
/// tenants open.
async fn drive_load(stack: &mut Stack) {
    stack.wait_idle("bb", 2, FILL).await;
    let acme = stack.client("acme");
    let beta = stack.client("beta/team");
    let warm1 = acme.create("bb").await;
    assert_eq!(warm1["start"], "warm", "{warm1}");
    let s1 = warm1["session_id"].as_str().unwrap().to_string();
    let s2 = acme.create("bb").await["session_id"].as_str().unwrap().to_string();
    // `cold` keeps no idle sandbox: the request queues for one being created.
    let cold = beta.create("cold").await;
    assert_eq!(cold["start"], "cold", "{cold}");
    let s3 = cold["session_id"].as_str().unwrap().to_string();

    // A broken template: its creates fail, it backs off, and its callers are refused at once.
    let a = acme.call(Method::POST, "/v1/sessions", Some(json!({"template": "broken", "max_wait_s": 5}))).await;
    assert_eq!(a.status, 503, "{:?}", a.body);
    // A declared burst (the autoscaler reports it as pending).
    let ready_by = humantime::format_rfc3339(SystemTime::now() + Duration::from_secs(120)).to_string();
    let r = acme
        .call(
            Method::POST,
            "/v1/reservations",
            Some(json!({"template": "bb", "count": 3, "ready_by": ready_by, "hold_s": 120})),
        )
        .await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    // A tenant at its quota is refused.
    let capped = stack.admin_client().call(Method::PUT, "/v1/quotas/capped", Some(json!({"sessions": 0}))).await;
    assert_eq!(capped.status, 200, "{:?}", capped.body);
    let refused = stack.client("capped/run").call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
    assert_eq!((refused.status, refused.body["code"].as_str()), (429, Some("quota_exceeded")), "{:?}", refused.body);

    // The node agent restarts: the surviving sandboxes' agents are reattached.
    stack.restart_pool_manager().await;

    assert_eq!(acme.sh(&s1, "echo hi").await["exit_code"], 0);
    let missing = acme.exec(&s1, json!({"cmd": ["no-such-program"]})).await;
    assert_eq!((missing.status, missing.body["exit_code"].as_i64()), (200, Some(127)), "{:?}", missing.body);
    let slow = acme.exec(&s1, json!({"cmd": "sleep 5", "timeout_ms": 300})).await;
    assert_eq!((slow.status, slow.body["timed_out"].as_bool()), (200, Some(true)), "{:?}", slow.body);
    assert_eq!(beta.sh(&s3, "echo cold").await["exit_code"], 0);
    one_websocket(&stack.url, &s2, &acme.token).await;
    functions_load(stack).await;
    one_failing_ledger_call(stack, &acme, &s2).await;
    one_failing_pull(stack).await;
    assert_eq!(acme.delete(&s1).await, 204);
}

/// A template's image leaves its registry: the node's pull fails (the pull-failure alert's
/// series, `outcome="failed"`).
async fn one_failing_pull(stack: &Stack) {
    let corpus = tests::corpus::Corpus::build(1, 16);
    let img = &corpus.images[0];
    let c = stack.client("acme");
    let made = c.call(Method::POST, "/v1/templates", Some(json!({"name": "gone", "image": img.image}))).await;
    assert_eq!(made.status, 201, "{:?}", made.body);
    corpus.delete_from_registry(img);
    let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "acme/gone", "max_wait_s": 30}))).await;
    assert_eq!((a.status, a.body["code"].as_str()), (502, Some("image_pull_failed")), "{:?}", a.body);
}

/// A function invoked cold, warm, with an error, and once over its concurrency.
async fn functions_load(stack: &Stack) {
    let acme = stack.client("acme");
    let def = json!({"template": "bb", "mode": "exec", "max_concurrency": 1,
                     "handler": ["sh", "-c", "p=$(cat); [ \"$p\" = slow ] && sleep 2; [ \"$p\" != fail ]"]});
    assert_eq!(acme.call(Method::PUT, "/v1/functions/obs", Some(def)).await.status, 201);
    let invoke = |payload: &'static str| {
        let (url, token) = (stack.url.clone(), acme.token.clone());
        async move {
            let r =
                reqwest::Client::new().post(format!("{url}/v1/functions/obs/invoke")).bearer_auth(token).body(payload);
            r.send().await.expect("gateway answers").status().as_u16()
        }
    };
    assert_eq!(invoke("a").await, 200);
    assert_eq!(invoke("b").await, 200);
    assert_eq!(invoke("fail").await, 200);
    let slow = tokio::spawn(invoke("slow"));
    // Once the slow one holds the only slot, another is refused.
    let busy = tests::eventually(Duration::from_secs(10), || async {
        let f = acme.call(Method::GET, "/v1/functions/obs", None).await;
        (f.body["environments"]["in_flight"].as_u64() == Some(1)).then_some(())
    });
    assert!(busy.await.is_some(), "the slow invocation never held its slot");
    assert_eq!(invoke("c").await, 429, "an invocation over max_concurrency 1 was not refused");
    assert_eq!(slow.await.expect("the slow invocation"), 200);
}

/// What the load must have made, as queries that return data only then: the panels' queries
/// alone would also pass on a series that exists with nothing in it.
fn load_facts(node: &str) -> Vec<PanelQuery> {
    let n = format!("node=\"{node}\"");
    [
        r#"sandpool_sessions_created_total{start="warm"} > 0"#.to_string(),
        r#"sandpool_sessions_created_total{template="cold",start="cold"} > 0"#.into(),
        r#"sandpool_session_queue_wait_seconds_count{template="cold"} > 0"#.into(),
        r#"sandpool_session_rejections_total{template="broken",code="unhealthy"} > 0"#.into(),
        r#"sandpool_session_rejections_total{template="bb",code="quota"} > 0"#.into(),
        r#"sandpool_quota_refusals_total{dimension="sessions"} > 0"#.into(),
        r#"sandpool_http_requests_total{service="gateway",status=~"5.."} > 0"#.into(),
        r#"sandpool_sessions_ended_total{reason="deleted"} > 0"#.into(),
        format!(r#"sandpool_sessions_active{{{n},tenant="beta"}} > 0"#),
        format!(r#"sandpool_sessions_active{{{n},tenant="acme"}} > 0"#),
        format!(r#"sandpool_sandbox_create_failures_total{{{n},template="broken"}} > 0"#),
        format!(r#"sandpool_template_healthy{{{n},template="broken"}} == 0"#),
        format!(r#"sandpool_sandbox_destroys_total{{{n}}} > 0"#),
        format!(r#"sandpool_agent_reattaches_total{{{n}}} > 0"#),
        r#"sandpool_exec_duration_seconds_count{outcome="timeout"} > 0"#.into(),
        r#"sum(sandpool_exec_duration_seconds_count{outcome="exit"}) >= 3"#.into(),
        r#"sandpool_ws_bytes_total{direction="in"} > 0"#.into(),
        r#"sandpool_ws_bytes_total{direction="out"} > 0"#.into(),
        r#"sandpool_redis_errors_total{script="lookup"} > 0"#.into(),
        r#"sandpool_docker_errors_total > 0"#.into(),
        r#"sandpool_image_pull_duration_seconds_count{outcome="failed"} > 0"#.into(),
        r#"sandpool_quota_refusals_total{dimension="sessions"} > 0"#.into(),
        r#"sandpool_autoscaler_forecast_sandboxes{template="broken"} > 0"#.into(),
        r#"sandpool_reservations_pending{template="bb"} > 0"#.into(),
    ]
    .into_iter()
    .map(|expr| PanelQuery { place: "the load".into(), expr })
    .collect()
}

// ── the check ───────────────────────────────────────────────────────────────────────────────

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_and_alert_works_on_a_real_stack() {
    let t0 = Instant::now();
    let extra = "
[templates.cold]
image = \"sandpool/busybox:latest\"
exec = \"agent\"
workdir = \"/work\"
cpus = 0.5
memory_mb = 128
pids = 1024
warm = 0
[templates.broken]
image = \"sandpool/no-such-image:1\"
warm = 1
";
    let mut stack =
        Stack::start(StackOpts { metrics: true, warm: 2, extra_toml: extra.into(), ..Default::default() }).await;
    let metrics_url = stack.metrics_url.clone().expect("StackOpts { metrics: true } serves /metrics");
    // Our own autoscaler, started after its arrival history is seeded (a learned forecast).
    seed_arrival_history(stack.ledger_prefix(), "broken").await;
    let scaler_cancel = CancellationToken::new();
    let _scaler = scaler_cancel.clone().drop_guard();
    drop(autoscaler::live::start(stack.config.clone(), scaler_cancel.clone()).await.expect("start autoscaler"));
    let prom = Prometheus::start(&metrics_url).await;
    let http = reqwest::Client::new();

    drive_load(&mut stack).await;
    let loaded = t0.elapsed();

    // The dashboards' and rules' metric names.
    let node = stack.node.id.clone();
    let queries = dashboard_queries(&node);
    let rules_text = std::fs::read_to_string(dashboards_dir().join("alerts.yml")).expect("alerts.yml");
    let declared_alerts = rules_text.lines().filter(|l| l.trim_start().starts_with("- alert:")).count();
    let loaded_rules: Vec<Value> = prom.get(&http, "/api/v1/rules").await["data"]["groups"]
        .as_array()
        .expect("rule groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(
        loaded_rules.len(),
        declared_alerts,
        "Prometheus loaded {} of {declared_alerts} rules",
        loaded_rules.len()
    );
    let mut used: BTreeMap<String, String> = BTreeMap::new();
    for q in &queries {
        for m in metric_names(&q.expr) {
            used.entry(m).or_insert_with(|| q.place.clone());
        }
    }
    for r in &loaded_rules {
        for m in metric_names(r["query"].as_str().expect("a rule's query")) {
            used.entry(m).or_insert_with(|| format!("alerts.yml {}", r["name"]));
        }
    }
    // (a) Each is in the catalog and in the scrape (bounded wait: the autoscaler and the
    // nodes publish some series on their own ticks).
    let names_rs = std::fs::read_to_string(root().join("telemetry/src/names.rs")).expect("names.rs");
    for (m, place) in &used {
        assert!(names_rs.contains(&format!("\"{m}\"")), "{place}: {m} is not in telemetry/src/names.rs");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let missing = loop {
        let text = http.get(&metrics_url).send().await.expect("metrics").text().await.expect("metrics body");
        let exposed = exposed_names(&text);
        let missing: Vec<String> =
            used.iter().filter(|(m, _)| !exposed.contains(*m)).map(|(m, p)| format!("{m} ({p})")).collect();
        if missing.is_empty() || Instant::now() >= deadline {
            break missing;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(missing.is_empty(), "named by a panel or rule but not exported by the stack:\n  {}", missing.join("\n  "));

    // Prometheus scrapes the stack (bounded wait: target discovery runs after start).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let targets = prom.get(&http, "/api/v1/targets").await;
        let target = &targets["data"]["activeTargets"][0];
        if target["health"] == "up" {
            break;
        }
        assert!(Instant::now() < deadline, "prometheus does not scrape {metrics_url}: {target}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // (b) Every panel query returns data (bounded wait for Prometheus to hold enough samples:
    // rate() needs two in its window); and the load made the series the panels are for.
    let facts = load_facts(&node);
    let mut pending: Vec<&PanelQuery> = queries.iter().chain(&facts).collect();
    let mut errors: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut still = Vec::new();
        for q in pending {
            match prom.query(&http, &q.expr).await {
                Ok(r) if !r.is_empty() => {}
                Ok(_) => still.push(q),
                Err(e) => errors.push(format!("{}: {e}\n    {}", q.place, q.expr)),
            }
        }
        pending = still;
        if pending.is_empty() || !errors.is_empty() || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(errors.is_empty(), "panel queries Prometheus refuses:\n  {}", errors.join("\n  "));
    assert!(
        pending.is_empty(),
        "queries without data after the load (of {}):\n  {}",
        queries.len() + facts.len(),
        pending.iter().map(|q| format!("{}\n    {}", q.place, q.expr)).collect::<Vec<_>>().join("\n  ")
    );

    // (c) Every alert rule evaluates: by hand, and by Prometheus' rule manager (health "ok").
    for r in &loaded_rules {
        let q = r["query"].as_str().unwrap();
        if let Err(e) = prom.query(&http, q).await {
            panic!("alert {} does not evaluate: {e}\n    {q}", r["name"]);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rules = prom.get(&http, "/api/v1/rules").await;
        let bad: Vec<String> = rules["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .filter(|r| r["health"] != "ok")
            .map(|r| format!("{} {} {}", r["name"], r["health"], r["lastError"]))
            .collect();
        if bad.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "alert rules not evaluated ok: {bad:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "observe: {} panel/variable queries and {} alert rules over {} metrics checked; load {:.1}s, total {:.1}s",
        queries.len(),
        loaded_rules.len(),
        used.len(),
        loaded.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    drop(prom);
    stack.shutdown().await;
}

// ── a fresh stack ───────────────────────────────────────────────────────────────────────────

/// The PromQL expressions of dashboards/alerts.yml (`expr:` on one line, or a `|` block).
fn alert_exprs() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(dashboards_dir().join("alerts.yml")).expect("alerts.yml");
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut alert = String::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if let Some(name) = trimmed.strip_prefix("- alert:") {
            alert = name.trim().to_string();
        } else if let Some(rest) = trimmed.strip_prefix("expr:") {
            let rest = rest.trim();
            if rest == "|" || rest == ">-" || rest == "|-" {
                let indent = line.len() - trimmed.len();
                let mut expr = String::new();
                while i + 1 < lines.len() {
                    let next = lines[i + 1];
                    let next_indent = next.len() - next.trim_start().len();
                    if !next.trim().is_empty() && next_indent <= indent {
                        break;
                    }
                    expr.push_str(next.trim());
                    expr.push('\n');
                    i += 1;
                }
                out.push((alert.clone(), expr));
            } else {
                out.push((alert.clone(), rest.to_string()));
            }
        }
        i += 1;
    }
    out
}

/// A fresh stack, before any request: `/metrics` already names every series a dashboard or an
/// alert rule uses (known label sets start at 0), so a panel shows 0 rather than "No data" and
/// an alert on a rate of errors can tell "none" from "not scraped".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_stack_exports_every_series_the_dashboards_and_alerts_name() {
    let stack = Stack::start(StackOpts { metrics: true, autoscaler: true, warm: 1, ..Default::default() }).await;
    let metrics_url = stack.metrics_url.clone().expect("StackOpts { metrics: true } serves /metrics");
    let node = stack.node.id.clone();
    let mut used: BTreeMap<String, String> = BTreeMap::new();
    for q in dashboard_queries(&node) {
        for m in metric_names(&q.expr) {
            used.entry(m).or_insert_with(|| q.place.clone());
        }
    }
    let alerts = alert_exprs();
    assert!(alerts.len() >= 5, "only {} alert expressions parsed", alerts.len());
    for (alert, expr) in &alerts {
        let names = metric_names(expr);
        // Only the scrape-health rules (target down or absent) name no series of ours: Prometheus'
        // own `up` is theirs.
        let on_scrape = expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|w| w == "up");
        assert!(!names.is_empty() || on_scrape, "alerts.yml {alert}: no metric parsed from {expr:?}");
        for m in names {
            used.entry(m).or_insert_with(|| format!("alerts.yml {alert}"));
        }
    }
    // Bounded wait: the nodes and the autoscaler publish their gauges on their first ticks.
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let (missing, text) = loop {
        let text = http.get(&metrics_url).send().await.expect("metrics").text().await.expect("metrics body");
        let exposed = exposed_names(&text);
        let missing: Vec<String> =
            used.iter().filter(|(m, _)| !exposed.contains(*m)).map(|(m, p)| format!("{m} ({p})")).collect();
        if missing.is_empty() || Instant::now() >= deadline {
            break (missing, text);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(missing.is_empty(), "named by a panel or rule but absent from a fresh stack:\n  {}", missing.join("\n  "));
    // The zeros are zeros of this stack's node and templates, not of another test's.
    for series in [
        format!(r#"sandpool_sandbox_create_failures_total{{node="{node}",template="bb",cause="pull"}} 0"#),
        format!(r#"sandpool_sessions_active{{node="{node}",tenant=""}} 0"#),
        r#"sandpool_session_rejections_total{template="bb",code="queue_full"} 0"#.to_string(),
        r#"sandpool_function_refusals_total{reason="concurrency"} 0"#.to_string(),
        r#"sandpool_session_queue_wait_seconds_count{template="bb"} 0"#.to_string(),
    ] {
        assert!(text.lines().any(|l| l == series), "{series} is not in /metrics:\n{text}");
    }
    eprintln!("observe: {} metrics named by dashboards and alerts, all present on a fresh stack", used.len());
    stack.shutdown().await;
}

//! `sandpool up` exports its traces over OTLP/HTTP to a real receiver on loopback (an axum
//! server decoding `ExportTraceServiceRequest`s): a session create and an exec each arrive as
//! one trace, and the exec's trace runs from the gateway's request span through the ledger's
//! scripts and the call to the pool-manager into the pool-manager's server span (a child across
//! the process boundary, via `traceparent`) and the agent's or Docker's spans under it. The
//! access log names the same trace and request ids. Real Redis and Docker; its own process,
//! since the tracing subscriber is process-global.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message as _;
use serde_json::json;
use tests::{eventually, rand_hex};

mod support;
use support::Up;

/// A span as received, with the `service.name` of the process that sent it.
#[derive(Clone, Debug)]
struct Got {
    service: String,
    span: Span,
}

impl Got {
    fn trace(&self) -> String {
        hex(&self.span.trace_id)
    }

    fn id(&self) -> String {
        hex(&self.span.span_id)
    }

    fn parent(&self) -> String {
        hex(&self.span.parent_span_id)
    }

    fn attr(&self, key: &str) -> Option<String> {
        let v = self.span.attributes.iter().find(|kv| kv.key == key)?.value.as_ref()?.value.as_ref()?;
        Some(match v {
            Value::StringValue(s) => s.clone(),
            Value::IntValue(i) => i.to_string(),
            Value::BoolValue(b) => b.to_string(),
            Value::DoubleValue(d) => d.to_string(),
            other => format!("{other:?}"),
        })
    }

    fn kind(&self) -> SpanKind {
        SpanKind::try_from(self.span.kind).unwrap_or(SpanKind::Unspecified)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

type Received = Arc<Mutex<Vec<Got>>>;

async fn export(
    State(got): State<Received>,
    body: Bytes,
) -> (StatusCode, [(header::HeaderName, &'static str); 1], Vec<u8>) {
    let ct = [(header::CONTENT_TYPE, "application/x-protobuf")];
    let Ok(req) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, ct, Vec::new());
    };
    let mut got = got.lock().unwrap();
    for rs in req.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                Value::StringValue(s) => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_default();
        for ss in rs.scope_spans {
            got.extend(ss.spans.into_iter().map(|span| Got { service: service.clone(), span }));
        }
    }
    (StatusCode::OK, ct, ExportTraceServiceResponse::default().encode_to_vec())
}

/// An OTLP/HTTP receiver on loopback: its base URL and what it has received.
async fn receiver() -> (String, Received) {
    let got = Received::default();
    let app = axum::Router::new().route("/v1/traces", post(export)).with_state(got.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), got)
}

/// The spans of the trace whose gateway request span carries `request_id`, once the
/// pool-manager's part (if `want_node`) has arrived too.
fn trace_of(got: &Received, request_id: &str, want_node: bool) -> Option<(Got, Vec<Got>)> {
    let got = got.lock().unwrap();
    let root = got
        .iter()
        .find(|g| g.span.name.starts_with("POST /v1/") && g.attr("request_id").as_deref() == Some(request_id))?
        .clone();
    let spans: Vec<Got> = got.iter().filter(|g| g.trace() == root.trace()).cloned().collect();
    let node_done = spans.iter().any(|g| g.span.name.starts_with("POST /internal/v1/"));
    (!want_node || node_done).then_some((root, spans))
}

fn is_under(spans: &[Got], span: &Got, ancestor: &Got) -> bool {
    let by_id: HashMap<String, &Got> = spans.iter().map(|g| (g.id(), g)).collect();
    let mut at = span.parent();
    for _ in 0..spans.len() {
        if at == ancestor.id() {
            return true;
        }
        match by_id.get(&at) {
            Some(p) => at = p.parent(),
            None => return false,
        }
    }
    false
}

#[tokio::test]
async fn a_request_is_one_trace_across_the_gateway_and_the_pool_manager() {
    let (otlp, got) = receiver().await;
    let mut up = Up::start(
        |toml| toml,
        |cmd| {
            cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)
                // Batches leave every 100 ms (the default is 5 s).
                .env("OTEL_BSP_SCHEDULE_DELAY", "100")
                .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                .env_remove("OTEL_SERVICE_NAME")
                .env_remove("OTEL_TRACES_SAMPLER");
        },
    )
    .await;
    let (http, url, token, node, log_path) =
        (up.http.clone(), up.url.clone(), up.token.clone(), up.node.clone(), up.log.clone());
    let (create_rid, created) = up.create().await;
    let sid = created["session_id"].as_str().unwrap().to_string();

    // A caller's own request id is honoured.
    let exec_rid = format!("it-{}", rand_hex(12));
    let r = http
        .post(format!("{url}/v1/sessions/{sid}/exec"))
        .bearer_auth(&token)
        .header("x-request-id", &exec_rid)
        .json(&json!({"cmd": "echo traced"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["x-request-id"], exec_rid.as_str(), "every answer carries its request id");
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["stdout"], "traced\n");

    // The exec's trace, whole.
    let (root, spans) = eventually(Duration::from_secs(20), || async { trace_of(&got, &exec_rid, true) })
        .await
        .unwrap_or_else(|| panic!("the exec's trace arrives; received: {:#?}", names(&got)));
    let show =
        || format!("{:#?}", spans.iter().map(|g| (&g.service, &g.span.name, g.id(), g.parent())).collect::<Vec<_>>());
    assert_eq!(root.span.name, "POST /v1/sessions/{id}/exec");
    assert_eq!(root.parent(), "", "the gateway's request span is the root");
    assert_eq!(root.kind(), SpanKind::Server);
    assert_eq!(root.service, "sandpool");
    assert_eq!(root.attr("http.route").as_deref(), Some("/v1/sessions/{id}/exec"));
    assert_eq!(root.attr("http.response.status_code").as_deref(), Some("200"));
    assert_eq!(root.attr("tenant").as_deref(), Some("acme"), "the tenant is recorded after auth");
    assert_eq!(root.attr("session").as_deref(), Some(sid.as_str()));
    let script = spans
        .iter()
        .find(|g| g.span.name.starts_with("redis ") && g.parent() == root.id())
        .unwrap_or_else(|| panic!("a ledger script span under the request: {}", show()));
    assert_eq!(script.attr("script").as_deref(), Some("lookup"));
    assert_eq!(script.kind(), SpanKind::Client);
    let call = spans
        .iter()
        .find(|g| g.attr("node").as_deref() == Some(node.as_str()) && g.kind() == SpanKind::Client)
        .unwrap_or_else(|| panic!("the call to the pool-manager: {}", show()));
    assert!(is_under(&spans, call, &root), "the node call is in the request: {}", show());
    let server = spans
        .iter()
        .find(|g| g.span.name == "POST /internal/v1/sandboxes/{sandbox}/exec")
        .unwrap_or_else(|| panic!("the pool-manager's server span: {}", show()));
    assert_eq!(server.kind(), SpanKind::Server);
    assert_eq!(server.parent(), call.id(), "the pool-manager's span is the child of the gateway's call: {}", show());
    assert_eq!(server.attr("request_id").as_deref(), Some(exec_rid.as_str()), "the request id goes on to the node");
    let work = spans
        .iter()
        .find(|g| {
            (g.span.name.starts_with("agent.") || g.span.name.starts_with("docker ")) && is_under(&spans, g, server)
        })
        .unwrap_or_else(|| panic!("an agent or Docker span under the pool-manager's: {}", show()));
    assert_eq!(work.span.name, "agent.exec");

    // The create's trace is another one, with the checkout script in it.
    let (croot, cspans) = eventually(Duration::from_secs(20), || async { trace_of(&got, &create_rid, false) })
        .await
        .expect("the create's trace arrives");
    assert_ne!(croot.trace(), root.trace(), "one trace per request");
    assert_eq!(croot.span.name, "POST /v1/sessions");
    assert!(
        cspans.iter().any(|g| g.attr("script").as_deref() == Some("grant") && is_under(&cspans, g, &croot)),
        "the checkout script is in the create's trace"
    );
    // Background work has traces of its own: the warm pool's creates.
    let creates = got.lock().unwrap().iter().filter(|g| g.span.name == "pool.create").cloned().collect::<Vec<_>>();
    assert!(!creates.is_empty(), "pool creates are traced");
    assert!(creates.iter().all(|c| c.parent().is_empty() && c.trace() != root.trace()));

    // The access log line names the same request and trace.
    let line = eventually(Duration::from_secs(5), || async {
        let log = std::fs::read_to_string(&log_path).ok()?;
        log.lines().find(|l| l.contains("sandpool::access") && l.contains(&exec_rid)).map(str::to_string)
    })
    .await
    .expect("an access log line for the exec");
    for want in [
        format!("trace_id={}", root.trace()),
        "status=200".into(),
        "tenant=acme".into(),
        "method=POST".into(),
        "route=/v1/sessions/{id}/exec".into(),
        "duration_ms=".into(),
    ] {
        assert!(line.contains(&want), "{want} in {line}");
    }

    // A request its caller gives up on leaves a line too, at the gateway and at the node, with
    // how long it had waited: a hang can be traced to where it waited.
    let gone_rid = format!("it-{}", rand_hex(12));
    let r = http
        .post(format!("{url}/v1/sessions/{sid}/exec"))
        .bearer_auth(&token)
        .header("x-request-id", &gone_rid)
        .json(&json!({"cmd": "sleep 30"}))
        .timeout(Duration::from_millis(1500))
        .send()
        .await;
    assert!(r.is_err_and(|e| e.is_timeout()), "the caller gave up");
    let dropped = eventually(Duration::from_secs(10), || async {
        let log = std::fs::read_to_string(&log_path).ok()?;
        let lines: Vec<String> = log
            .lines()
            .filter(|l| l.contains("sandpool::access") && l.contains(&gone_rid) && l.contains("dropped before"))
            .map(str::to_string)
            .collect();
        (lines.len() == 2).then_some(lines)
    })
    .await
    .expect("a line each from the gateway and the pool-manager");
    assert!(dropped.iter().any(|l| l.contains("route=/v1/sessions/{id}/exec")), "{dropped:?}");
    assert!(dropped.iter().any(|l| l.contains("route=/internal/v1/sandboxes/{sandbox}/exec")), "{dropped:?}");
    for l in &dropped {
        let waited: u64 = l.split("waited_ms=").nth(1).and_then(|v| v.split(' ').next()?.parse().ok()).unwrap();
        assert!((1000..10_000).contains(&waited), "waited about 1.5 s: {l}");
    }

    // SIGTERM: a clean exit, the guard flushing what is left.
    up.sigterm();
    let status = up.wait_exit(Duration::from_secs(40)).await;
    assert!(status.success(), "exit status {status}");
}

fn names(got: &Received) -> Vec<String> {
    got.lock().unwrap().iter().map(|g| format!("{} {} {:?}", g.trace(), g.span.name, g.attr("request_id"))).collect()
}

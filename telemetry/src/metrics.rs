//! The process's Prometheus recorder, its `GET /metrics` endpoint, the HTTP middleware that
//! counts and times requests, and the helpers that keep labels bounded.
//!
//! Code records with the `metrics` macros and the names of [`crate::names`] only, e.g.
//! `metrics::counter!(names::CREATES, "node" => node, "template" => t, "outcome" => "ok")`.
//! Before [`install`] (or in a process that never calls it) the macros are no-ops.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::Router;
use axum::extract::{MatchedPath, Request};
use axum::http::{Method, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::names::{self, CATALOG, Kind};

/// Histogram buckets of every `_seconds` histogram: 100 µs to 60 s, roughly 1-2.5-5 per decade
/// (a warm create is ~0.4 ms, an exec ~1.2 ms, a cold create seconds, a queue wait up to
/// `max_wait_s`).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The `Content-Type` of the Prometheus text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How often histogram samples are folded into their buckets when nobody scrapes.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the global recorder (once per process; later calls return the same handle) and
/// describes every metric of the catalog. If another recorder was installed first, metrics
/// go there and the handle renders an empty page.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder =
                PrometheusBuilder::new().set_buckets(LATENCY_BUCKETS).expect("the latency buckets are not empty");
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                eprintln!("sandpool: a metrics recorder was already installed; /metrics stays empty");
            }
            describe();
            let upkeep = handle.clone();
            // Off the async runtime: folding histogram samples is the only periodic work.
            let _ = std::thread::Builder::new().name("metrics-upkeep".into()).spawn(move || {
                loop {
                    std::thread::sleep(UPKEEP_EVERY);
                    upkeep.run_upkeep();
                }
            });
            handle
        })
        .clone()
}

/// The installed recorder's handle, if [`install`] ran.
pub fn handle() -> Option<PrometheusHandle> {
    HANDLE.get().cloned()
}

fn describe() {
    for m in CATALOG {
        match m.kind {
            Kind::Counter => metrics::describe_counter!(m.name, m.help),
            Kind::Gauge => metrics::describe_gauge!(m.name, m.help),
            Kind::Histogram => metrics::describe_histogram!(m.name, metrics::Unit::Seconds, m.help),
        }
    }
}

/// The `/metrics` router over `handle` (mount it anywhere; [`serve`] gives it a listener).
pub fn router(handle: PrometheusHandle) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let handle = handle.clone();
            async move { ([(header::CONTENT_TYPE, CONTENT_TYPE)], handle.render()).into_response() }
        }),
    )
}

/// Installs the recorder if needed and serves `GET /metrics` on `listen` (port 0: any free
/// port) until `cancel` fires. Returns the bound address and the server's task.
pub async fn serve(listen: SocketAddr, cancel: CancellationToken) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let handle = install();
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("bind telemetry.metrics_listen {listen}"))?;
    let addr = listener.local_addr()?;
    let app = router(handle);
    // joined: the caller gets the handle and awaits it after cancelling (`sandpool` at exit).
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(cancel.cancelled_owned()).await {
            tracing::error!(error = %e, "metrics server failed");
        }
    });
    tracing::info!(%addr, "metrics at http://{addr}/metrics");
    Ok((addr, task))
}

/// The template label of a template name: configured templates by name (their names have no
/// `.` or `/`); a tenant's private snapshot templates (named `<node>.<hex>`, like ids) are all
/// `private`, and templates made from images (`<namespace>/<name>`, thousands of them in a
/// corpus) all `image`.
pub fn template_label(template: &str) -> &str {
    if template.contains('/') {
        "image"
    } else if template.contains('.') {
        "private"
    } else {
        template
    }
}

/// Counts one open session WebSocket of `service` ([`names::WS_OPEN`]) while it lives, and
/// hands out the byte counters of its relay ([`names::WS_BYTES`]).
pub struct WsMetrics {
    open: metrics::Gauge,
    /// Payload bytes from the client.
    pub bytes_in: metrics::Counter,
    /// Payload bytes to the client.
    pub bytes_out: metrics::Counter,
}

impl WsMetrics {
    /// Counts one WebSocket open for `service` until the value is dropped.
    pub fn open(service: &'static str) -> WsMetrics {
        let open = metrics::gauge!(names::WS_OPEN, "service" => service);
        open.increment(1.0);
        WsMetrics {
            open,
            bytes_in: metrics::counter!(names::WS_BYTES, "service" => service, "direction" => "in"),
            bytes_out: metrics::counter!(names::WS_BYTES, "service" => service, "direction" => "out"),
        }
    }
}

impl Drop for WsMetrics {
    fn drop(&mut self) {
        self.open.decrement(1.0);
    }
}

/// A layer for an axum `Router` that counts ([`names::HTTP_REQUESTS`]) and times
/// ([`names::HTTP_DURATION`], to the response head) every request by route template (from
/// `MatchedPath`; requests no route matched are `unmatched`), method and status. Apply it with
/// `Router::layer`, after the routes.
pub fn http_layer(service: &'static str) -> HttpLayer {
    HttpLayer { service }
}

/// See [`http_layer`].
#[derive(Debug, Clone, Copy)]
pub struct HttpLayer {
    service: &'static str,
}

impl<S> tower::Layer<S> for HttpLayer {
    type Service = HttpMetrics<S>;

    fn layer(&self, inner: S) -> HttpMetrics<S> {
        HttpMetrics { inner, service: self.service }
    }
}

/// The service of [`HttpLayer`].
#[derive(Debug, Clone)]
pub struct HttpMetrics<S> {
    inner: S,
    service: &'static str,
}

impl<S> tower::Service<Request> for HttpMetrics<S>
where
    S: tower::Service<Request, Response = Response> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let start = Instant::now();
        let service = self.service;
        let route =
            req.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
        let method = method_label(req.method());
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await;
            let elapsed = start.elapsed().as_secs_f64();
            let status = match &res {
                Ok(r) => r.status().as_u16(),
                Err(_) => 500,
            };
            metrics::histogram!(names::HTTP_DURATION, "service" => service, "route" => route.clone(), "method" => method)
                .record(elapsed);
            metrics::counter!(names::HTTP_REQUESTS, "service" => service, "route" => route, "method" => method,
                "status" => status_label(status))
            .increment(1);
            res
        })
    }
}

fn method_label(m: &Method) -> &'static str {
    match *m {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// Status codes as static labels (the common ones; others are formatted).
fn status_label(code: u16) -> metrics::SharedString {
    let s: &'static str = match code {
        200 => "200",
        201 => "201",
        204 => "204",
        101 => "101",
        400 => "400",
        401 => "401",
        403 => "403",
        404 => "404",
        409 => "409",
        410 => "410",
        413 => "413",
        422 => "422",
        429 => "429",
        500 => "500",
        502 => "502",
        503 => "503",
        504 => "504",
        other => return metrics::SharedString::from(other.to_string()),
    };
    metrics::SharedString::const_str(s)
}

/// The catalog as the README's markdown table (`sandpool metrics` prints it).
pub fn catalog_markdown() -> String {
    let mut out = String::from("| Metric | Type | Labels | Meaning |\n|---|---|---|---|\n");
    for m in CATALOG {
        let kind = match m.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        };
        let labels = m.labels.iter().map(|l| format!("`{l}`")).collect::<Vec<_>>().join(", ");
        out.push_str(&format!("| `{}` | {kind} | {labels} | {} |\n", m.name, m.help.replace('|', "\\|")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_stay_bounded() {
        assert_eq!(template_label("busybox"), "busybox");
        assert_eq!(template_label("python-3_12"), "python-3_12");
        assert_eq!(template_label("node-1.ab01cd"), "private");
    }

    #[test]
    fn renders_counters_and_histograms() {
        install();
        metrics::counter!(names::CREATES, "node" => "t-render", "template" => "busybox", "outcome" => "ok")
            .increment(3);
        metrics::histogram!(names::CREATE_DURATION, "node" => "t-render", "template" => "busybox").record(0.0003);
        metrics::gauge!(names::NODE_CAPACITY, "node" => "t-render").set(8.0);
        // install is idempotent: a second call renders the same recorder.
        let page = install().render();
        assert!(page.contains("# TYPE sandpool_sandbox_creates_total counter"), "{page}");
        assert!(page.contains("# HELP sandpool_sandbox_creates_total Sandbox creates finished"), "{page}");
        assert!(
            page.contains(r#"sandpool_sandbox_creates_total{node="t-render",template="busybox",outcome="ok"} 3"#),
            "{page}"
        );
        assert!(page.contains("# TYPE sandpool_sandbox_create_duration_seconds histogram"), "{page}");
        assert!(
            page.contains(
                r#"sandpool_sandbox_create_duration_seconds_bucket{node="t-render",template="busybox",le="0.0005"} 1"#
            ),
            "{page}"
        );
        assert!(
            page.contains(
                r#"sandpool_sandbox_create_duration_seconds_bucket{node="t-render",template="busybox",le="0.00025"} 0"#
            ),
            "{page}"
        );
        assert!(
            page.contains(r#"sandpool_sandbox_create_duration_seconds_count{node="t-render",template="busybox"} 1"#)
        );
        assert!(page.contains(r#"sandpool_node_capacity_sandboxes{node="t-render"} 8"#), "{page}");
    }

    #[tokio::test]
    async fn serves_the_text_format() {
        let cancel = CancellationToken::new();
        let (addr, task) = serve("127.0.0.1:0".parse().unwrap(), cancel.clone()).await.unwrap();
        metrics::counter!(names::AGENT_REATTACHES, "node" => "t-serve").increment(1);
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).await.unwrap();
        assert!(body.starts_with("HTTP/1.1 200"), "{body}");
        assert!(body.contains("text/plain; version=0.0.4"), "{body}");
        assert!(body.contains(r#"sandpool_agent_reattaches_total{node="t-serve"} 1"#), "{body}");
        cancel.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn http_layer_uses_route_templates() {
        use tower::ServiceExt as _;
        let handle = install();
        let app = Router::new().route("/t-layer/{id}", get(|| async { "ok" })).layer(http_layer("t_layer"));
        for uri in ["/t-layer/a", "/t-layer/b", "/nowhere"] {
            let req = Request::builder().uri(uri).body(axum::body::Body::empty()).unwrap();
            app.clone().oneshot(req).await.unwrap();
        }
        let page = handle.render();
        assert!(
            page.contains(
                r#"sandpool_http_requests_total{service="t_layer",route="/t-layer/{id}",method="GET",status="200"} 2"#
            ),
            "{page}"
        );
        assert!(
            page.contains(
                r#"sandpool_http_requests_total{service="t_layer",route="unmatched",method="GET",status="404"} 1"#
            ),
            "{page}"
        );
    }
}

#[cfg(test)]
mod readme {
    /// The README's metrics table is `catalog_markdown()` (regenerate it with `sandpool metrics`).
    #[test]
    fn the_readme_lists_the_catalog() {
        let readme = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"));
        let (begin, end) = ("<!-- metrics:begin -->\n", "<!-- metrics:end -->");
        let start = readme.find(begin).expect("README has <!-- metrics:begin -->") + begin.len();
        let len = readme[start..].find(end).expect("README has <!-- metrics:end -->");
        assert_eq!(
            &readme[start..start + len],
            super::catalog_markdown(),
            "README.md's metrics table is stale: replace it with the output of `sandpool metrics`"
        );
    }
}

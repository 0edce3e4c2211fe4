//! Per request: a request id, one span (the root of the request's trace, or the child of the
//! caller's W3C `traceparent`), and one access-log line.
//!
//! The request id is the caller's `x-request-id` if it is tame, else a new one; it is on every
//! answer, on the span, in the access log, quoted by 5xx error bodies (`http_util`'s task-local
//! scope) and sent on to the node. The tenant is recorded on the span and the log line once
//! the caller is authenticated (`auth.rs` calls [`tenant`]).

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use http_util::REQUEST_ID_HEADER;
use tracing::Instrument as _;
use tracing::field::{self, Empty};

tokio::task_local! {
    static TENANT: Arc<OnceLock<String>>;
}

/// Records the authenticated tenant on the current request's span and access-log line.
pub(crate) fn tenant(tenant: &str) {
    tracing::Span::current().record("tenant", tenant);
    let _ = TENANT.try_with(|t| t.set(tenant.to_string()));
}

/// Health probes get a request id but no span and no INFO log line (balancers poll them).
fn is_probe(route: &str) -> bool {
    matches!(route, "/healthz" | "/readyz")
}

/// The middleware (outermost layer of `app`).
pub(crate) async fn request(req: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = http_util::incoming_request_id(req.headers()).unwrap_or_else(http_util::request_id);
    let method = req.method().clone();
    let route = req.extensions().get::<MatchedPath>().map(|m| m.as_str().to_string());
    let route = route.as_deref().unwrap_or("unmatched").to_string();
    if is_probe(&route) {
        let mut resp = http_util::with_request_id(id.clone(), next.run(req)).await;
        set_id(&mut resp, &id);
        tracing::debug!(target: "sandpool::access", %method, %route, status = resp.status().as_u16(), request_id = %id, "request");
        return resp;
    }
    let session = http_util::path_param(&route, req.uri().path(), "{id}");
    let span = tracing::info_span!(
        "request",
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = Empty,
        request_id = %id,
        session = session.as_deref(),
        tenant = Empty,
    );
    telemetry::trace::set_parent(&span, req.headers());
    let tenant = Arc::new(OnceLock::new());
    let handled = TENANT.scope(tenant.clone(), http_util::with_request_id(id.clone(), next.run(req)));
    let unanswered = http_util::Unanswered::new(&method, &route, &id);
    let mut resp = handled.instrument(span.clone()).await;
    unanswered.answered();
    let status = resp.status().as_u16();
    span.record("http.response.status_code", status);
    if resp.status().is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    set_id(&mut resp, &id);
    let trace_id = telemetry::trace::trace_id(&span);
    tracing::info!(
        target: "sandpool::access",
        %method,
        %route,
        status,
        duration_ms = (started.elapsed().as_secs_f64() * 10_000.0).round() / 10.0,
        tenant = tenant.get().map(field::display),
        session = session.as_ref().map(field::display),
        trace_id = trace_id.as_ref().map(field::display),
        request_id = %id,
        "request",
    );
    resp
}

fn set_id(resp: &mut Response, id: &str) {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
}

//! Calls from the gateway to the nodes' internal APIs, behind the `NodeClient` trait so
//! handlers can be tested without a node. `HttpNodes` is the real one: the ledger's node
//! registry (cached briefly) and an HTTP client.

use std::collections::{HashMap, HashSet};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use axum::http::{Method, StatusCode};
use bytes::Bytes;
use futures::future::BoxFuture;
use http_util::ApiError;
use ledger::{Ledger, NodeInfo, NodeStats};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_tungstenite::tungstenite::handshake::client::Request as WsRequest;
use tracing::Instrument as _;
use wire::ErrorBody;
use wire::internal::{FENCE_HEADER, SECRET_HEADER};

/// How long the node list (registry, liveness, stats) is trusted before it is read again:
/// nodes write stats twice a second, and a node that goes down stops being placed on within
/// `node.down_after` plus this.
const NODES_TTL: Duration = Duration::from_millis(500);

/// A live node as placement sees it: its last self-report (none from a node that has not
/// reported, or a fake).
#[derive(Debug, Clone)]
pub struct NodeView {
    /// The node's id, as registered in the ledger.
    pub id: String,
    /// The node's last stats from the ledger, if it has reported any.
    pub stats: Option<NodeStats>,
}

/// One call to a node's internal API.
#[derive(Debug, Clone)]
pub struct NodeRequest {
    /// The method to call `path` with.
    pub method: Method,
    /// The path on the node's internal API, starting `/internal/v1/`.
    pub path: String,
    /// The body and its content type.
    pub body: Option<(Bytes, &'static str)>,
    /// The lease's fencing token, for calls on a leased sandbox.
    pub fence: Option<u64>,
    /// How long the whole call may take before it answers 504.
    pub timeout: Duration,
}

impl NodeRequest {
    /// A call with no body and no fence.
    pub fn new(method: Method, path: String, timeout: Duration) -> NodeRequest {
        NodeRequest { method, path, body: None, fence: None, timeout }
    }

    /// Sends the lease's fencing token, so the node can refuse a call from a lease that is no
    /// longer current.
    pub fn fence(mut self, fence: u64) -> NodeRequest {
        self.fence = Some(fence);
        self
    }

    /// Sets the body and its content type.
    pub fn body(mut self, body: Bytes, content_type: &'static str) -> NodeRequest {
        self.body = Some((body, content_type));
        self
    }

    /// Sets `body` encoded as JSON; 500 if it does not encode.
    pub fn json<T: Serialize>(self, body: &T) -> Result<NodeRequest, ApiError> {
        let bytes = serde_json::to_vec(body).map_err(|e| ApiError::internal(format!("encode node request: {e}")))?;
        Ok(self.body(bytes.into(), "application/json"))
    }
}

/// What the gateway needs of the nodes.
pub trait NodeClient: Send + Sync + 'static {
    /// Every live node's id (registered, heartbeat within `node.down_after`), in a random
    /// order.
    fn ids(&self) -> BoxFuture<'_, Result<Vec<String>, ApiError>>;

    /// Every live node with its last stats, for placement. Without stats: `ids`.
    fn views(&self) -> BoxFuture<'_, Result<Vec<NodeView>, ApiError>> {
        Box::pin(async move { Ok(self.ids().await?.into_iter().map(|id| NodeView { id, stats: None }).collect()) })
    }

    /// One call. A node's error answer comes back as the node said it (its 4xx codes pass
    /// through); a node that cannot be reached is 502, one that does not answer in time 504.
    fn call<'a>(&'a self, node: &'a str, req: NodeRequest) -> BoxFuture<'a, Result<Bytes, ApiError>>;

    /// The handshake request of a WebSocket to a node's internal API.
    fn ws_request<'a>(&'a self, node: &'a str, path: &'a str, fence: u64)
    -> BoxFuture<'a, Result<WsRequest, ApiError>>;

    /// A tunnel to port `path` (`/internal/v1/sandboxes/{id}/ports/{port}`) of a node: the raw
    /// bytes of one TCP connection to the port in the sandbox. Errors as `call` says.
    fn tunnel<'a>(
        &'a self,
        node: &'a str,
        path: &'a str,
        fence: u64,
    ) -> BoxFuture<'a, Result<Box<dyn Tunnel>, ApiError>> {
        let _ = (path, fence);
        Box::pin(async move {
            Err(ApiError::bad_gateway(
                format!("node {node} cannot be reached for ports"),
                "this node client has no tunnels",
            ))
        })
    }

    /// One call whose body (`upload`, if any) and answer stream through, never held whole:
    /// file transfers. A success comes back as the node's streaming answer; an error as `call`
    /// says. Without a streaming implementation: collected, through `call`.
    fn stream<'a>(
        &'a self,
        node: &'a str,
        req: NodeRequest,
        upload: Option<Upload>,
    ) -> BoxFuture<'a, Result<axum::response::Response, ApiError>> {
        Box::pin(async move {
            let req = match upload {
                Some(up) => {
                    let bytes = axum::body::to_bytes(up.body, up.max_bytes as usize)
                        .await
                        .map_err(|_| too_large(up.max_bytes))?;
                    req.body(bytes, up.content_type)
                }
                None => req,
            };
            let bytes = self.call(node, req).await?;
            Ok(axum::response::IntoResponse::into_response(bytes))
        })
    }
}

/// A byte stream to a node: a port tunnel (`NodeClient::tunnel`).
pub trait Tunnel: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static> Tunnel for T {}

/// How long opening a port tunnel may take: the node connects to the port before it answers.
const TUNNEL_TIMEOUT: Duration = Duration::from_secs(15);

/// A request body to stream to a node: at most `max_bytes` (more answers 413).
pub struct Upload {
    /// The client's request body, streamed as it arrives.
    pub body: axum::body::Body,
    /// The body's content type, sent on to the node.
    pub content_type: &'static str,
    /// The most bytes the body may hold.
    pub max_bytes: u64,
}

fn too_large(max_bytes: u64) -> ApiError {
    ApiError::new(wire::ErrorCode::PayloadTooLarge, format!("the body is over {max_bytes} bytes"))
}

/// A call whose answer is JSON the gateway needs the values of.
pub async fn call_json<T: DeserializeOwned>(
    nodes: &dyn NodeClient,
    node: &str,
    req: NodeRequest,
) -> Result<T, ApiError> {
    let bytes = nodes.call(node, req).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_gateway(format!("node {node} answered badly"), format!("decode: {e}")))
}

/// Ready when some node answers its health check.
pub async fn any_ready(nodes: &dyn NodeClient) -> Result<(), ApiError> {
    let ids = nodes.ids().await?;
    for id in &ids {
        let req = NodeRequest::new(Method::GET, "/internal/v1/healthz".into(), Duration::from_secs(2));
        if nodes.call(id, req).await.is_ok() {
            return Ok(());
        }
    }
    Err(ApiError::unavailable(if ids.is_empty() { "no node has registered" } else { "no node answers" }, 1))
}

/// Turns a node's error answer back into ours.
pub fn remote_error(node: &str, status: u16, body: &[u8]) -> ApiError {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    ApiError::from_remote(status, serde_json::from_slice::<ErrorBody>(body).ok(), node)
}

/// The real nodes: registered in the ledger, reached over HTTP with the shared secret.
pub struct HttpNodes {
    ledger: Ledger,
    secret: String,
    http: reqwest::Client,
    down_after: Duration,
    cache: RwLock<Cache>,
    /// One refresh at a time: the others wait for it and read its result.
    refreshing: tokio::sync::Mutex<()>,
    /// Nodes where a call found nothing listening, and when. A SIGKILLed pool-manager's lease
    /// outlives it by up to `down_after`; placement leaves such a node out from the first
    /// refused connection instead (see `placeable`).
    refused: std::sync::Mutex<HashMap<String, Instant>>,
}

/// What the gateway last read of the nodes.
#[derive(Default, Clone)]
struct Cache {
    at: Option<Instant>,
    /// Every registered node, live or down (a down node's sessions still route to it).
    nodes: HashMap<String, NodeInfo>,
    live: HashSet<String>,
    stats: HashMap<String, NodeStats>,
}

impl HttpNodes {
    /// Nodes from `ledger`'s registry, called with the shared `secret`; a node silent for
    /// `down_after` counts as down.
    pub fn new(ledger: Ledger, secret: String, down_after: Duration) -> anyhow::Result<HttpNodes> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .pool_max_idle_per_host(256)
            .tcp_nodelay(true)
            .build()?;
        Ok(HttpNodes {
            ledger,
            secret,
            http,
            down_after,
            cache: RwLock::new(Cache::default()),
            refreshing: tokio::sync::Mutex::new(()),
            refused: std::sync::Mutex::new(HashMap::new()),
        })
    }

    fn fresh(&self) -> Option<Cache> {
        let c = self.cache.read().unwrap_or_else(|e| e.into_inner());
        c.at.filter(|t| t.elapsed() < NODES_TTL).map(|_| c.clone())
    }

    /// The nodes as last read, read again when older than `NODES_TTL` (by one caller; the
    /// others wait for its answer).
    async fn current(&self) -> Result<Cache, ApiError> {
        if let Some(c) = self.fresh() {
            return Ok(c);
        }
        let _turn = self.refreshing.lock().await;
        if let Some(c) = self.fresh() {
            return Ok(c);
        }
        let states = self.ledger.node_states().await.map_err(crate::errors::ledger)?;
        let down_ms = self.down_after.as_millis() as u64;
        let live: HashSet<String> =
            states.iter().filter(|n| n.silent_ms < down_ms).map(|n| n.info.id.clone()).collect();
        let reads = live.iter().map(|id| async move { (id.clone(), self.ledger.stats(id).await) });
        let mut stats = HashMap::new();
        for (id, st) in futures::future::join_all(reads).await {
            if let Some(st) = st.map_err(crate::errors::ledger)? {
                stats.insert(id, st);
            }
        }
        let nodes = states.into_iter().map(|n| (n.info.id.clone(), n.info)).collect();
        let c = Cache { at: Some(Instant::now()), nodes, live, stats };
        *self.cache.write().unwrap_or_else(|e| e.into_inner()) = c.clone();
        Ok(c)
    }

    /// The address of a live node; a registered one that is down answers 503
    /// `node_unavailable` at once (no connection attempt, no timeout piling up).
    async fn addr(&self, node: &str) -> Result<String, ApiError> {
        let c = self.current().await?;
        match c.nodes.get(node) {
            Some(_) if !c.live.contains(node) => Err(crate::errors::node_down(node)),
            Some(n) => Ok(n.addr.clone()),
            None => Err(ApiError::bad_gateway(
                format!("node {node} is not available"),
                format!("node {node} is not registered"),
            )),
        }
    }

    async fn views_now(&self) -> Result<Vec<NodeView>, ApiError> {
        let c = self.current().await?;
        let live = {
            let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
            placeable(&c.live, &mut refused, self.down_after, Instant::now())
        };
        let mut views: Vec<NodeView> =
            live.into_iter().map(|id| NodeView { stats: c.stats.get(&id).cloned(), id }).collect();
        views.sort_by(|a, b| a.id.cmp(&b.id));
        if views.len() > 1 {
            let k = rand::random_range(0..views.len());
            views.rotate_left(k);
        }
        Ok(views)
    }

    async fn ids_now(&self) -> Result<Vec<String>, ApiError> {
        Ok(self.views_now().await?.into_iter().map(|v| v.id).collect())
    }

    async fn call_now(&self, node: &str, r: NodeRequest) -> Result<Bytes, ApiError> {
        // A client span, only inside a request's trace (not for readiness probes).
        let span = if tracing::Span::current().is_none() {
            tracing::Span::none()
        } else {
            tracing::info_span!(
                "node.call",
                otel.name = %format!("{} pool-manager", r.method),
                otel.kind = "client",
                otel.status_code = tracing::field::Empty,
                node,
                http.request.method = %r.method,
                url.path = %r.path,
                http.response.status_code = tracing::field::Empty,
            )
        };
        let outcome = self.call_traced(node, r, &span).instrument(span.clone()).await;
        if outcome.as_ref().is_err_and(|e| e.status().is_server_error()) {
            span.record("otel.status_code", "ERROR");
        }
        outcome
    }

    async fn call_traced(&self, node: &str, r: NodeRequest, span: &tracing::Span) -> Result<Bytes, ApiError> {
        let mut req = self.request(node, &r, span).await?;
        if let Some((b, ct)) = r.body {
            req = req.header(reqwest::header::CONTENT_TYPE, ct).body(b);
        }
        let resp = req.send().await.map_err(|e| self.transport(node, e))?;
        let status = resp.status();
        span.record("http.response.status_code", status.as_u16());
        let bytes = resp.bytes().await.map_err(|e| self.transport(node, e))?;
        if status.is_success() {
            return Ok(bytes);
        }
        Err(remote_error(node, status.as_u16(), &bytes))
    }

    /// A call to `node` as every call starts: its URL, method, secret, fence, timeout and the
    /// trace headers of `span`; the body is the caller's.
    async fn request(
        &self,
        node: &str,
        r: &NodeRequest,
        span: &tracing::Span,
    ) -> Result<reqwest::RequestBuilder, ApiError> {
        let url = format!("{}{}", self.addr(node).await?, r.path);
        let method = reqwest::Method::from_bytes(r.method.as_str().as_bytes())
            .map_err(|e| ApiError::internal(format!("method: {e}")))?;
        let mut req = self.http.request(method, &url).header(SECRET_HEADER, &self.secret).timeout(r.timeout);
        if let Some(f) = r.fence {
            req = req.header(FENCE_HEADER, f);
        }
        Ok(req.headers(trace_headers(span)))
    }

    /// `call_traced` for a streaming body and answer (no span of its own: the request's).
    async fn stream_now(
        &self,
        node: &str,
        r: NodeRequest,
        upload: Option<Upload>,
    ) -> Result<axum::response::Response, ApiError> {
        use futures::StreamExt as _;
        let mut req = self.request(node, &r, &tracing::Span::current()).await?;
        // Counted on the way through: past the limit the upload breaks off and answers 413.
        let over = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let limit = upload.as_ref().map_or(0, |u| u.max_bytes);
        if let Some(up) = upload {
            let (flag, max) = (over.clone(), up.max_bytes);
            let mut seen = 0u64;
            let body = up.body.into_data_stream().map(move |chunk| {
                let chunk = chunk.map_err(std::io::Error::other)?;
                seen += chunk.len() as u64;
                if seen > max {
                    flag.store(true, std::sync::atomic::Ordering::Relaxed);
                    return Err(std::io::Error::other("the body is over the limit"));
                }
                Ok(chunk)
            });
            req = req.header(reqwest::header::CONTENT_TYPE, up.content_type).body(reqwest::Body::wrap_stream(body));
        }
        let transport = |e: reqwest::Error| {
            if over.load(std::sync::atomic::Ordering::Relaxed) {
                too_large(limit).with_detail(e.to_string())
            } else {
                self.transport(node, e)
            }
        };
        let resp = req.send().await.map_err(transport)?;
        let status = resp.status();
        if !status.is_success() {
            let bytes = resp.bytes().await.map_err(transport)?;
            return Err(remote_error(node, status.as_u16(), &bytes));
        }
        let mut out = axum::response::Response::builder().status(status.as_u16());
        if let Some(ct) = resp.headers().get(reqwest::header::CONTENT_TYPE) {
            out = out.header(axum::http::header::CONTENT_TYPE, ct.as_bytes());
        }
        out.body(axum::body::Body::from_stream(resp.bytes_stream()))
            .map_err(|e| ApiError::internal(format!("relay the node's answer: {e}")))
    }

    async fn ws_request_now(&self, node: &str, path: &str, fence: u64) -> Result<WsRequest, ApiError> {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let addr = self.addr(node).await?;
        let url = format!("ws://{}{}", addr.trim_start_matches("http://"), path);
        let mut req = url.into_client_request().map_err(|e| ApiError::internal(format!("node ws url: {e}")))?;
        let h = req.headers_mut();
        let secret =
            self.secret.parse().map_err(|_| ApiError::internal("the internal secret is not a header value"))?;
        h.insert(SECRET_HEADER, secret);
        h.insert(FENCE_HEADER, fence.into());
        h.extend(trace_headers(&tracing::Span::current()));
        Ok(req)
    }
}

impl HttpNodes {
    async fn tunnel_now(&self, node: &str, path: &str, fence: u64) -> Result<Box<dyn Tunnel>, ApiError> {
        let url = format!("{}{}", self.addr(node).await?, path);
        // No reqwest timeout: it would bound the tunnel's whole life, not just its opening.
        let req = self
            .http
            .get(&url)
            .header(SECRET_HEADER, &self.secret)
            .header(FENCE_HEADER, fence)
            .header(reqwest::header::CONNECTION, "upgrade")
            .header(reqwest::header::UPGRADE, wire::internal::PORT_UPGRADE)
            .headers(trace_headers(&tracing::Span::current()));
        let resp = match tokio::time::timeout(TUNNEL_TIMEOUT, req.send()).await {
            Ok(r) => r.map_err(|e| self.transport(node, e))?,
            Err(_) => return Err(ApiError::gateway_timeout(format!("node {node} did not open the port in time"))),
        };
        let status = resp.status();
        if status != reqwest::StatusCode::SWITCHING_PROTOCOLS {
            let bytes = resp.bytes().await.map_err(|e| self.transport(node, e))?;
            return Err(remote_error(node, status.as_u16(), &bytes));
        }
        let io = resp.upgrade().await.map_err(|e| self.transport(node, e))?;
        Ok(Box::new(io))
    }

    /// A node call that failed on the way: 504 when it timed out; 503 `node_unavailable` when
    /// nothing listens at the node's address (its pool-manager is gone: the node will be down
    /// within `node.down_after`, and its sandboxes may well serve again after a restart, so
    /// the caller should retry, not give the session up; placement leaves it out from now);
    /// else 502.
    fn transport(&self, node: &str, e: reqwest::Error) -> ApiError {
        if e.is_connect() {
            self.refused.lock().unwrap_or_else(|e| e.into_inner()).insert(node.to_string(), Instant::now());
            return crate::errors::node_down(node).with_detail(e.to_string());
        }
        if e.is_timeout() {
            ApiError::gateway_timeout(format!("node {node} did not answer in time"))
        } else {
            ApiError::bad_gateway(format!("node {node} is unreachable or broke off its answer"), e.to_string())
        }
    }
}

/// The live nodes placement may choose: those without a refused connection in the last
/// `down_after` (by then a node that is really gone is down by its lease, and one that came
/// back is placed on again). Marks that old are forgotten. When every live node was refused
/// lately, all of them: the refusals may have been a blip, and a create has nowhere else to go.
fn placeable(
    live: &HashSet<String>,
    refused: &mut HashMap<String, Instant>,
    down_after: Duration,
    now: Instant,
) -> Vec<String> {
    refused.retain(|_, at| now.saturating_duration_since(*at) < down_after);
    let ok: Vec<String> = live.iter().filter(|id| !refused.contains_key(*id)).cloned().collect();
    if ok.is_empty() { live.iter().cloned().collect() } else { ok }
}

/// The W3C trace context of `span` and the request id, for a call to a node: its server span
/// joins the gateway's trace and its log quotes the same request id.
fn trace_headers(span: &tracing::Span) -> axum::http::HeaderMap {
    let mut h = axum::http::HeaderMap::new();
    telemetry::trace::inject(span, &mut h);
    if let Some(id) = http_util::current_request_id().and_then(|id| id.parse().ok()) {
        h.insert(http_util::REQUEST_ID_HEADER, id);
    }
    h
}

impl NodeClient for HttpNodes {
    fn ids(&self) -> BoxFuture<'_, Result<Vec<String>, ApiError>> {
        Box::pin(self.ids_now())
    }

    fn views(&self) -> BoxFuture<'_, Result<Vec<NodeView>, ApiError>> {
        Box::pin(self.views_now())
    }

    fn stream<'a>(
        &'a self,
        node: &'a str,
        req: NodeRequest,
        upload: Option<Upload>,
    ) -> BoxFuture<'a, Result<axum::response::Response, ApiError>> {
        Box::pin(self.stream_now(node, req, upload))
    }

    fn call<'a>(&'a self, node: &'a str, req: NodeRequest) -> BoxFuture<'a, Result<Bytes, ApiError>> {
        Box::pin(self.call_now(node, req))
    }

    fn tunnel<'a>(
        &'a self,
        node: &'a str,
        path: &'a str,
        fence: u64,
    ) -> BoxFuture<'a, Result<Box<dyn Tunnel>, ApiError>> {
        Box::pin(self.tunnel_now(node, path, fence))
    }

    fn ws_request<'a>(
        &'a self,
        node: &'a str,
        path: &'a str,
        fence: u64,
    ) -> BoxFuture<'a, Result<WsRequest, ApiError>> {
        Box::pin(self.ws_request_now(node, path, fence))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[&str]) -> HashSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn sorted(mut v: Vec<String>) -> Vec<String> {
        v.sort();
        v
    }

    #[test]
    fn a_refused_node_is_left_out_of_placement_until_down_after_has_passed() {
        let (t0, down_after) = (Instant::now(), Duration::from_secs(10));
        let live = set(&["a", "b", "c"]);
        let mut refused = HashMap::from([("b".to_string(), t0)]);
        assert_eq!(sorted(placeable(&live, &mut refused, down_after, t0)), ["a", "c"]);
        let later = t0 + Duration::from_secs(9);
        assert_eq!(sorted(placeable(&live, &mut refused, down_after, later)), ["a", "c"]);
        // Past down_after the mark is forgotten: by now the lease says whether b is down.
        let past = t0 + down_after;
        assert_eq!(sorted(placeable(&live, &mut refused, down_after, past)), ["a", "b", "c"]);
        assert!(refused.is_empty());
    }

    #[test]
    fn when_every_live_node_was_refused_all_stay_placeable() {
        let t0 = Instant::now();
        let live = set(&["a", "b"]);
        let mut refused = HashMap::from([("a".to_string(), t0), ("b".to_string(), t0)]);
        assert_eq!(sorted(placeable(&live, &mut refused, Duration::from_secs(10), t0)), ["a", "b"]);
        // A refused node that is no longer live does not count.
        let mut refused = HashMap::from([("z".to_string(), t0)]);
        assert_eq!(sorted(placeable(&live, &mut refused, Duration::from_secs(10), t0)), ["a", "b"]);
    }
}

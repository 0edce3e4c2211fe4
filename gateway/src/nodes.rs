//! The nodes a gateway can route to (from the ledger's registry, cached briefly) and the
//! client for their internal API.

use std::collections::HashMap;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_util::ApiError;
use ledger::{Ledger, NodeInfo};
use reqwest::Method;
use serde::Serialize;
use serde::de::DeserializeOwned;
use wire::ErrorBody;
use wire::internal::{FENCE_HEADER, SECRET_HEADER};

/// How long the node list is trusted before it is read again.
const NODES_TTL: Duration = Duration::from_secs(2);

pub struct Nodes {
    ledger: Ledger,
    secret: String,
    http: reqwest::Client,
    cache: RwLock<(Option<Instant>, HashMap<String, NodeInfo>)>,
}

impl Nodes {
    pub fn new(ledger: Ledger, secret: String) -> anyhow::Result<Nodes> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .pool_max_idle_per_host(256)
            .tcp_nodelay(true)
            .build()?;
        Ok(Nodes { ledger, secret, http, cache: RwLock::new((None, HashMap::new())) })
    }

    fn cached(&self) -> Option<HashMap<String, NodeInfo>> {
        let c = self.cache.read().ok()?;
        c.0.filter(|t| t.elapsed() < NODES_TTL).map(|_| c.1.clone())
    }

    async fn refresh(&self) -> Result<HashMap<String, NodeInfo>, ApiError> {
        let list =
            self.ledger.nodes().await.map_err(|e| ApiError::unavailable(format!("ledger unavailable: {e}"), 1))?;
        let map: HashMap<String, NodeInfo> = list.into_iter().map(|n| (n.id.clone(), n)).collect();
        if let Ok(mut c) = self.cache.write() {
            *c = (Some(Instant::now()), map.clone());
        }
        Ok(map)
    }

    /// Every registered node id, in a random order (spreads checkouts and cold creates).
    pub async fn ids(&self) -> Result<Vec<String>, ApiError> {
        let map = match self.cached() {
            Some(m) => m,
            None => self.refresh().await?,
        };
        let mut ids: Vec<String> = map.into_keys().collect();
        if ids.len() > 1 {
            let k = rand::random_range(0..ids.len());
            ids.rotate_left(k);
        }
        Ok(ids)
    }

    async fn addr(&self, node: &str) -> Result<String, ApiError> {
        if let Some(n) = self.cached().and_then(|m| m.get(node).cloned()) {
            return Ok(n.addr);
        }
        let map = self.refresh().await?;
        map.get(node)
            .map(|n| n.addr.clone())
            .ok_or_else(|| ApiError::BadGateway(format!("node {node} is not registered")))
    }

    /// A WebSocket request to a node's internal API, with the secret and the caller's fence.
    pub async fn ws_request(
        &self,
        node: &str,
        path: &str,
        fence: u64,
    ) -> Result<tokio_tungstenite::tungstenite::handshake::client::Request, ApiError> {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let addr = self.addr(node).await?;
        let url = format!("ws://{}{}", addr.trim_start_matches("http://"), path);
        let mut req = url.into_client_request().map_err(|e| ApiError::Internal(format!("node ws url: {e}")))?;
        let h = req.headers_mut();
        let secret =
            self.secret.parse().map_err(|_| ApiError::Internal("internal secret is not a header value".into()))?;
        h.insert(SECRET_HEADER, secret);
        h.insert(FENCE_HEADER, fence.into());
        Ok(req)
    }

    pub async fn any_ready(&self) -> Result<(), String> {
        let ids = self.ids().await.map_err(|e| e.body().message)?;
        for id in &ids {
            if self.call(id, Method::GET, "/internal/v1/healthz", None, None, Duration::from_secs(2)).await.is_ok() {
                return Ok(());
            }
        }
        Err(if ids.is_empty() { "no node has registered".into() } else { "no node answers".into() })
    }

    /// One call to a node's internal API. Node errors come back as the node said them;
    /// a node that cannot be reached is 502, one that does not answer in time 504.
    pub async fn call(
        &self,
        node: &str,
        method: Method,
        path: &str,
        body: Option<(Bytes, &'static str)>,
        fence: Option<u64>,
        timeout: Duration,
    ) -> Result<Bytes, ApiError> {
        let url = format!("{}{}", self.addr(node).await?, path);
        let mut req = self.http.request(method, &url).header(SECRET_HEADER, &self.secret).timeout(timeout);
        if let Some(f) = fence {
            req = req.header(FENCE_HEADER, f);
        }
        if let Some((b, ct)) = body {
            req = req.header(reqwest::header::CONTENT_TYPE, ct).body(b);
        }
        let transport = |e: reqwest::Error| {
            if e.is_timeout() {
                ApiError::GatewayTimeout(format!("node {node} did not answer in time"))
            } else {
                ApiError::BadGateway(format!("node {node} unreachable or broke off its answer"))
            }
        };
        let resp = req.send().await.map_err(transport)?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(transport)?;
        if status.is_success() {
            return Ok(bytes);
        }
        let body = serde_json::from_slice::<ErrorBody>(&bytes)
            .unwrap_or_else(|_| ErrorBody { code: "error".into(), message: format!("node {node} answered {status}") });
        let status = axum::http::StatusCode::from_u16(status.as_u16()).unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
        Err(ApiError::from_remote(status, body))
    }

    pub async fn call_json<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        node: &str,
        path: &str,
        req: &Req,
        fence: Option<u64>,
        timeout: Duration,
    ) -> Result<Resp, ApiError> {
        let body = serde_json::to_vec(req).map_err(|e| ApiError::Internal(format!("encode request: {e}")))?;
        let bytes =
            self.call(node, Method::POST, path, Some((body.into(), "application/json")), fence, timeout).await?;
        serde_json::from_slice(&bytes).map_err(|e| ApiError::BadGateway(format!("node {node} answered badly: {e}")))
    }
}

//! A gateway router over real Redis (its own key prefix, deleted on drop) and fake nodes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use futures::future::BoxFuture;
use gateway::{AppState, NodeClient, NodeRequest};
use http_util::ApiError;
use ledger::{Ledger, Ready};
use tokio_tungstenite::tungstenite::handshake::client::Request as WsRequest;
use tower::ServiceExt;

pub(crate) const NODE: &str = "n1";

fn redis_url() -> String {
    std::env::var("SANDPOOL_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// How the fake node answers a call.
pub(crate) type Answer = Arc<dyn Fn(&NodeRequest) -> Result<Bytes, ApiError> + Send + Sync>;

/// Nodes that answer from a closure and remember the calls made.
pub(crate) struct FakeNodes {
    pub answer: Mutex<Answer>,
    pub calls: Mutex<Vec<NodeRequest>>,
    pub ids: Vec<String>,
}

impl NodeClient for FakeNodes {
    fn ids(&self) -> BoxFuture<'_, Result<Vec<String>, ApiError>> {
        let ids = self.ids.clone();
        Box::pin(async move { Ok(ids) })
    }

    fn call<'a>(&'a self, _node: &'a str, req: NodeRequest) -> BoxFuture<'a, Result<Bytes, ApiError>> {
        let answer = self.answer.lock().unwrap().clone();
        let r = answer(&req);
        self.calls.lock().unwrap().push(req);
        Box::pin(async move { r })
    }

    fn ws_request<'a>(&'a self, _: &'a str, _: &'a str, _: u64) -> BoxFuture<'a, Result<WsRequest, ApiError>> {
        Box::pin(async { Err(ApiError::bad_gateway("no sockets here", "fake node")) })
    }
}

/// One gateway under test.
pub(crate) struct Gw {
    pub app: Router,
    pub ledger: Ledger,
    pub nodes: Arc<FakeNodes>,
    pub config: Arc<config::Config>,
    prefix: String,
}

impl Gw {
    pub(crate) async fn new() -> Gw {
        Gw::with_nodes(vec![NODE.to_string()]).await
    }

    pub(crate) async fn with_nodes(ids: Vec<String>) -> Gw {
        Gw::with_config(ids, "").await
    }

    /// A gateway whose config has `extra` TOML appended (more sections).
    pub(crate) async fn with_config(ids: Vec<String>, extra: &str) -> Gw {
        let prefix = format!("sptest-gw-{:016x}", rand::random::<u64>());
        let toml = format!(
            r#"
[node]
id = "{NODE}"
[redis]
url = "{url}"
prefix = "{prefix}"
[gateway]
max_body_bytes = 4096
[pool_manager]
secret = "test-internal-secret-0123456789"
[auth]
key = "test-jwt-key-0123456789abcdef"
[templates.bb]
image = "sandpool/busybox:latest"
idle_timeout = "10m"
max_lifetime = "1h"
{extra}
"#,
            url = redis_url()
        );
        let config = Arc::new(config::Config::from_toml(&toml, &Default::default()).expect("config"));
        let ledger = Ledger::connect(&redis_url(), &prefix).await.expect("redis");
        // The fake node is live: it holds its id's lease (for the test's life).
        ledger.claim_node(NODE, "test|fake", 3_600_000, true).await.expect("claim the node's lease");
        let ok: Answer = Arc::new(|_| Ok(Bytes::from_static(b"{}")));
        let nodes = Arc::new(FakeNodes { answer: Mutex::new(ok), calls: Mutex::new(Vec::new()), ids });
        let state = AppState::with_nodes(config.clone(), ledger.clone(), nodes.clone()).expect("state");
        Gw { app: gateway::app(state), ledger, nodes, config, prefix }
    }

    pub(crate) fn answer(&self, f: impl Fn(&NodeRequest) -> Result<Bytes, ApiError> + Send + Sync + 'static) {
        *self.nodes.answer.lock().unwrap() = Arc::new(f);
    }

    pub(crate) fn token(&self, tenant: &str) -> String {
        gateway::mint(&self.config.auth, tenant, false, Duration::from_secs(600)).expect("mint")
    }

    pub(crate) fn admin_token(&self, tenant: &str) -> String {
        gateway::mint(&self.config.auth, tenant, true, Duration::from_secs(600)).expect("mint")
    }

    /// A JSON request with an admin token.
    pub(crate) async fn admin(&self, method: &str, path: &str, body: &str) -> (StatusCode, serde_json::Value) {
        let (status, json, _) = self.call_with(&self.admin_token("ops"), method, path, body).await;
        (status, json)
    }

    /// Puts `n` idle sandboxes of template `bb` into the node's pool.
    pub(crate) async fn pool(&self, n: usize) {
        for i in 0..n {
            let sb = format!("{NODE}.{:08x}{i:04x}", rand::random::<u32>());
            self.ledger.sandbox_add(NODE, &sb, "bb").await.unwrap();
            assert_eq!(self.ledger.sandbox_ready(NODE, &sb, "c").await.unwrap(), Ready::Idle);
        }
    }

    /// Sends a request; returns status, headers and body.
    pub(crate) async fn send(&self, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, Bytes) {
        let resp = self.app.clone().oneshot(req).await.expect("router answers");
        let (parts, body) = resp.into_parts();
        (parts.status, parts.headers, axum::body::to_bytes(body, 1 << 20).await.expect("body"))
    }

    /// A JSON request as `tenant`.
    pub(crate) async fn call(
        &self,
        tenant: &str,
        method: &str,
        path: &str,
        body: &str,
    ) -> (StatusCode, serde_json::Value, axum::http::HeaderMap) {
        self.call_with(&self.token(tenant), method, path, body).await
    }

    /// A JSON request with the bearer token `token`.
    pub(crate) async fn call_with(
        &self,
        token: &str,
        method: &str,
        path: &str,
        body: &str,
    ) -> (StatusCode, serde_json::Value, axum::http::HeaderMap) {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {token}"))
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let (status, headers, bytes) = self.send(req).await;
        let json =
            if bytes.is_empty() { serde_json::Value::Null } else { serde_json::from_slice(&bytes).unwrap_or_default() };
        (status, json, headers)
    }

    /// A new session of `tenant` on a warm sandbox; its id.
    pub(crate) async fn session(&self, tenant: &str) -> String {
        self.pool(1).await;
        let (status, body, _) = self.call(tenant, "POST", "/v1/sessions", r#"{"template":"bb"}"#).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        body["session_id"].as_str().unwrap().to_string()
    }
}

impl Drop for Gw {
    fn drop(&mut self) {
        let Ok(client) = redis::Client::open(redis_url()) else { return };
        let Ok(mut conn) = client.get_connection() else { return };
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(format!("{}:*", self.prefix)).query(&mut conn).unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut conn);
        }
    }
}

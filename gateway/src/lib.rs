//! The gateway: sandpool's public HTTP API. Stateless (any number of replicas share one
//! Redis): it authenticates tenants, checks sessions out of the ledger, and routes exec and
//! file traffic to the pool-manager of the node a session's id names. It never calls Docker.

pub mod auth;
mod nodes;
mod reservations;
mod sessions;
mod waiters;
mod ws;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use config::Config;
use http_util::{ApiError, Json};
use ledger::Ledger;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use wire::TemplateList;

pub use auth::{Caller, mint};

/// Everything a handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub config: Arc<Config>,
    pub ledger: Ledger,
    pub verifier: Arc<auth::Verifier>,
    nodes: Arc<nodes::Nodes>,
    waiters: Arc<waiters::Waiters>,
    /// Cancelled when the gateway shuts down; open WebSockets close with a reason.
    pub shutdown: tokio_util::sync::CancellationToken,
}

impl AppState {
    pub fn new(config: Arc<Config>, ledger: Ledger) -> anyhow::Result<AppState> {
        let verifier = Arc::new(auth::Verifier::new(&config.auth).context("load auth.key")?);
        let nodes = Arc::new(nodes::Nodes::new(ledger.clone(), config.pool_manager.secret.clone())?);
        let waiters = Arc::new(waiters::Waiters::new(&ledger));
        let shutdown = tokio_util::sync::CancellationToken::new();
        Ok(AppState { config, ledger, verifier, nodes, waiters, shutdown })
    }
}

/// The whole public API as a router (tests call it with `oneshot`).
pub fn app(state: AppState) -> Router {
    let body_limit = state.config.gateway.max_body_bytes as usize;
    let v1 = Router::new()
        .route("/v1/templates", get(templates))
        .route("/v1/sessions", post(sessions::create))
        .route("/v1/sessions/{id}", get(sessions::get).delete(sessions::delete))
        .route("/v1/sessions/{id}/keepalive", post(sessions::keepalive))
        .route("/v1/sessions/{id}/pause", post(sessions::pause))
        .route("/v1/sessions/{id}/resume", post(sessions::resume))
        .route("/v1/sessions/{id}/snapshot", post(sessions::snapshot))
        .route("/v1/sessions/{id}/fork", post(sessions::fork))
        .route("/v1/templates/{name}", axum::routing::delete(sessions::delete_template))
        .route("/v1/sessions:pause", post(sessions::pause_selected))
        .route("/v1/sessions:resume", post(sessions::resume_selected))
        .route("/v1/sessions/{id}/exec", post(sessions::exec))
        .route("/v1/sessions/{id}/ws", get(ws::upgrade))
        .route("/v1/sessions/{id}/files/{*path}", get(sessions::read_file).put(sessions::write_file))
        .route("/v1/reservations", post(reservations::create))
        .route("/v1/pools", get(reservations::pools));
    Router::new()
        .merge(v1)
        .route("/healthz", get(|| async { StatusCode::NO_CONTENT }))
        .route("/readyz", get(readyz))
        .fallback(http_util::fallback_not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

async fn templates(_caller: Caller, State(s): State<AppState>) -> Json<TemplateList> {
    Json(TemplateList { templates: s.config.templates.values().map(|t| t.info()).collect() })
}

/// Ready when Redis answers and at least one node has registered and answers.
async fn readyz(State(s): State<AppState>) -> Result<StatusCode, ApiError> {
    s.ledger.ping().await.map_err(|e| ApiError::unavailable(format!("redis: {e}"), 1))?;
    s.nodes.any_ready().await.map_err(|e| ApiError::unavailable(e, 1))?;
    Ok(StatusCode::NO_CONTENT)
}

/// A started gateway.
pub struct Running {
    pub addr: SocketAddr,
    tracker: TaskTracker,
}

impl Running {
    pub async fn wait(self) {
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// Binds `config.gateway.listen` (or `listen` if given) and serves until `cancel` fires.
pub async fn start(
    config: Arc<Config>,
    listen: Option<SocketAddr>,
    cancel: CancellationToken,
) -> anyhow::Result<Running> {
    let ledger = Ledger::connect(&config.redis.url, &config.redis.prefix)
        .await
        .with_context(|| format!("connect to redis at {}", config.redis.url))?;
    let mut state = AppState::new(config.clone(), ledger)?;
    state.shutdown = cancel.child_token();
    let addr = listen.unwrap_or(config.gateway.listen);
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("bind gateway.listen {addr}"))?;
    let addr = listener.local_addr()?;
    let tracker = TaskTracker::new();
    let (w, l) = (state.waiters.clone(), state.ledger.clone());
    let c = cancel.child_token();
    tracker.spawn(async move { w.run_router(l, c).await });
    let (w, l) = (state.waiters.clone(), state.ledger.clone());
    let c = cancel.child_token();
    tracker.spawn(async move { w.run_arrivals(l, c).await });
    let app = app(state);
    tracker.spawn(async move {
        let r = axum::serve(listener, app).with_graceful_shutdown(cancel.cancelled_owned()).await;
        if let Err(e) = r {
            tracing::error!(error = %e, "gateway server failed");
        }
    });
    tracing::info!(%addr, "gateway ready");
    Ok(Running { addr, tracker })
}

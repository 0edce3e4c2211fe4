//! The gateway: sandpool's public HTTP API. Stateless (any number of replicas share one
//! Redis): it authenticates tenants, checks sessions out of the ledger, and routes exec and
//! file traffic to the pool-manager of the node a session's id names. It never calls Docker.
//!
//! Handlers by capability: `create` (open a session), `lookup` (find the caller's session;
//! every other session call starts there), `lifecycle` (get, keep alive, delete, pause),
//! `calls` (exec and files), `shells` (persistent shells), `snapshots`, `ws`, `reservations`, `quotas` (admission, the quota
//! API and the call rate). `errors` maps the ledger's
//! errors and ended sessions onto answers; `nodes` is the client of the nodes' internal API.
//! `lease` is a create's quota lease as typed states; `background` the tracker every task
//! that outlives its request runs on (shutdown drains it).

pub mod auth;
mod background;
mod calls;
mod create;
mod egress;
mod errors;
mod functions;
mod images;
pub mod jwks;
mod lease;
mod lifecycle;
mod limits;
mod lookup;
pub mod nodes;
mod observe;
pub mod openapi;
mod page;
mod placement;
mod ports;
mod quotas;
mod reservations;
mod shells;
mod snapshots;
mod waiters;
mod ws;
mod zeros;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context as _;
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use config::Config;
use http_util::ApiError;
use ledger::Ledger;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use auth::{Caller, mint};
pub use nodes::{HttpNodes, NodeClient, NodeRequest};

/// Everything a handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    /// The whole configuration the gateway was started with.
    pub config: Arc<Config>,
    /// The Redis ledger: sessions, quotas and the node registry.
    pub ledger: Ledger,
    /// Checks each request's bearer token.
    pub verifier: Arc<auth::Verifier>,
    /// The nodes' internal APIs (`HttpNodes`, or a test's fake).
    pub nodes: Arc<dyn NodeClient>,
    waiters: Arc<waiters::Waiters>,
    /// The per-principal call rate, when configured.
    call_rate: Option<Arc<quotas::CallRate>>,
    /// False once the gateway drains: `/readyz` fails first, so balancers stop sending.
    ready: Arc<AtomicBool>,
    /// Cancelled when the gateway drains; open WebSockets close with a reason.
    sockets_close: CancellationToken,
    /// The open WebSockets' relays (axum's graceful shutdown does not track upgraded
    /// connections; shutdown waits for these).
    sockets: TaskTracker,
    /// Invocations waiting here for a function's concurrency slot.
    slots: Arc<functions::Slots>,
    /// Work that outlives the request that started it; shutdown drains it.
    work: background::Background,
}

impl AppState {
    /// A gateway over the nodes registered in the ledger.
    pub fn new(config: Arc<Config>, ledger: Ledger) -> anyhow::Result<AppState> {
        let nodes =
            Arc::new(HttpNodes::new(ledger.clone(), config.pool_manager.secret.clone(), config.node.down_after)?);
        AppState::with_nodes(config, ledger, nodes)
    }

    /// A gateway over the given nodes (tests pass their own `NodeClient`).
    pub fn with_nodes(config: Arc<Config>, ledger: Ledger, nodes: Arc<dyn NodeClient>) -> anyhow::Result<AppState> {
        let verifier = Arc::new(auth::Verifier::new(&config.auth).context("load auth.key")?);
        let waiters = Arc::new(waiters::Waiters::new(&ledger));
        let q = &config.quotas;
        let call_rate = q.call_rate.map(|r| Arc::new(quotas::CallRate::new(r, q.call_burst)));
        let config_async = config.gateway.max_async_in_flight;
        Ok(AppState {
            config,
            ledger,
            verifier,
            nodes,
            waiters,
            call_rate,
            ready: Arc::new(AtomicBool::new(true)),
            sockets_close: CancellationToken::new(),
            sockets: TaskTracker::new(),
            slots: Arc::new(functions::Slots::new(config_async)),
            work: background::Background::default(),
        })
    }
}

/// Every public route, each registered from its handler's `#[utoipa::path]`: the route and
/// its OpenAPI entry are one declaration (`openapi` adds the error answers and serves it).
/// Add routes only here and only with `routes!` (a test reads the sources for any other).
fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::Base::openapi())
        .routes(routes!(images::list, images::create))
        .routes(routes!(images::get, snapshots::delete_template))
        .routes(routes!(images::prefetch))
        .routes(routes!(images::images))
        .routes(routes!(create::create, lifecycle::list, lifecycle::delete_selected))
        .routes(routes!(lifecycle::get, lifecycle::delete))
        .routes(routes!(lifecycle::keepalive))
        .routes(routes!(lifecycle::pause))
        .routes(routes!(lifecycle::resume))
        .routes(routes!(lifecycle::set_egress))
        .routes(routes!(egress::list))
        .routes(routes!(egress::put, egress::delete))
        .routes(routes!(lifecycle::pause_selected))
        .routes(routes!(lifecycle::resume_selected))
        .routes(routes!(snapshots::snapshot))
        .routes(routes!(snapshots::fork))
        .routes(routes!(calls::exec))
        .routes(routes!(calls::read_file, calls::write_file, calls::remove_file))
        .routes(routes!(calls::list_dir, calls::make_dir))
        .routes(routes!(calls::path_exists))
        .routes(routes!(calls::rename_file))
        .routes(routes!(calls::list_workdir))
        .routes(routes!(ws::upgrade))
        .routes(routes!(ws::ticket))
        .routes(routes!(ports::sign))
        .routes(routes!(
            ports::port_get,
            ports::port_head,
            ports::port_post,
            ports::port_put,
            ports::port_patch,
            ports::port_delete,
            ports::port_options
        ))
        .routes(routes!(
            ports::port_root_get,
            ports::port_root_head,
            ports::port_root_post,
            ports::port_root_put,
            ports::port_root_patch,
            ports::port_root_delete,
            ports::port_root_options
        ))
        .routes(routes!(
            ports::signed_port_get,
            ports::signed_port_head,
            ports::signed_port_post,
            ports::signed_port_put,
            ports::signed_port_patch,
            ports::signed_port_delete,
            ports::signed_port_options
        ))
        .routes(routes!(
            ports::signed_port_root_get,
            ports::signed_port_root_head,
            ports::signed_port_root_post,
            ports::signed_port_root_put,
            ports::signed_port_root_patch,
            ports::signed_port_root_delete,
            ports::signed_port_root_options
        ))
        .routes(routes!(shells::open, shells::list))
        .routes(routes!(shells::close))
        .routes(routes!(shells::run))
        .routes(routes!(shells::interrupt))
        .routes(routes!(functions::list))
        .routes(routes!(functions::put, functions::get, functions::delete))
        .routes(routes!(functions::invoke))
        .routes(routes!(functions::map))
        .routes(routes!(functions::get_invocation))
        .routes(routes!(reservations::create))
        .routes(routes!(reservations::pools))
        .routes(routes!(quotas::get, quotas::put, quotas::delete))
        .routes(routes!(quotas::verify))
        .routes(routes!(quotas::usage))
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(openapi::serve_document))
        .routes(routes!(openapi::docs))
}

/// The whole public API as a router (handler tests call it with `oneshot`).
pub fn app(state: AppState) -> Router {
    let body_limit = state.config.gateway.max_body_bytes as usize;
    let (router, _) = routes().split_for_parts();
    router
        .fallback(http_util::fallback_not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn(observe::request))
        .layer(telemetry::metrics::http_layer("gateway"))
        .with_state(state)
}

/// Alive: the process serves HTTP.
#[utoipa::path(get, path = "/healthz", tag = "operations", operation_id = "healthz", summary = "Liveness", responses((status = 204, description = "Alive.")))]
async fn healthz() -> StatusCode {
    StatusCode::NO_CONTENT
}

/// Ready when not draining, Redis answers, and at least one node has registered and answers.
#[utoipa::path(get, path = "/readyz", tag = "operations", operation_id = "readyz", summary = "Readiness", responses((status = 204, description = "Ready to serve.")))]
async fn readyz(State(s): State<AppState>) -> Result<StatusCode, ApiError> {
    if !s.ready.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the gateway is shutting down", 1));
    }
    s.ledger.ping().await.map_err(errors::ledger)?;
    nodes::any_ready(s.nodes.as_ref()).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A started gateway.
pub struct Running {
    /// The address the gateway listens on (the real port when `listen` asked for port 0).
    pub addr: SocketAddr,
    tracker: TaskTracker,
    work: background::Background,
}

impl Running {
    /// Waits until the gateway has drained and stopped (after its `cancel` fired). Answers
    /// how many background tasks were still running then: 0 unless one ignored its cancel
    /// (the process's exit cuts it).
    pub async fn wait(self) -> usize {
        self.tracker.close();
        self.tracker.wait().await;
        let left = self.work.len();
        tracing::info!(background_tasks = left, "gateway stopped");
        left
    }
}

/// Binds `config.gateway.listen` (or `listen` if given) and serves until `cancel` fires; then
/// drains in order: `/readyz` fails, and after `drain_grace` the listener closes; in-flight
/// requests finish and open WebSockets get a close frame with a reason, and the background
/// work (asynchronous invocations, undos) finishes or is cancelled and records how it ended,
/// all within `drain_timeout`; then the loops stop.
pub async fn start(
    config: Arc<Config>,
    listen: Option<SocketAddr>,
    cancel: CancellationToken,
) -> anyhow::Result<Running> {
    let ledger = Ledger::connect(&config.redis.url, &config.redis.prefix)
        .await
        .with_context(|| format!("connect to redis at {}", config.redis.url))?;
    // Reservations kept by an older build in one hash of every tenant's move to their
    // tenants' scopes (a no-op once done).
    match ledger.migrate_reservations().await {
        Ok(0) => {}
        Ok(n) => tracing::info!(moved = n, "reservations moved to per-tenant keys"),
        Err(e) => tracing::warn!(error = %e, "move reservations to per-tenant keys (the next start will)"),
    }
    let state = AppState::new(config.clone(), ledger)?;
    zeros::register(&config);
    // The key set is read before the gateway listens: a token signed with one of its keys
    // is never refused for a read not yet done.
    let key_set = state.verifier.key_set().cloned();
    if let Some(set) = &key_set {
        let n = set.reload().await.context("read auth.jwks")?;
        tracing::info!(keys = n, "read the JWKS");
    }
    let addr = listen.unwrap_or(config.gateway.listen);
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("bind gateway.listen {addr}"))?;
    let addr = listener.local_addr()?;
    let tracker = TaskTracker::new();
    // The loops stop only after the server has drained: a queued create still gets its wake-up.
    let loops = CancellationToken::new();
    let (w, l, c) = (state.waiters.clone(), state.ledger.clone(), loops.clone());
    tracker.spawn(async move { w.run_router(l, c).await });
    let (w, l, c) = (state.waiters.clone(), state.ledger.clone(), loops.clone());
    tracker.spawn(async move { w.run_arrivals(l, c).await });
    // The keeper makes sessions through the create path: it is background work (what a turn
    // cut short gives back runs on the same tracker), and it stops when the requests have.
    let (work, keeper) = (state.work.clone(), CancellationToken::new());
    let (st, c) = (state.clone(), keeper.clone());
    work.spawn(async move { functions::keep(st, c).await });
    if let Some(set) = key_set {
        tracker.spawn(set.run(config.auth.jwks_refresh, loops.clone()));
    }
    let (ready, sockets_close, sockets) = (state.ready.clone(), state.sockets_close.clone(), state.sockets.clone());
    let state_work = state.work.clone();
    let (grace, timeout) = (config.gateway.drain_grace, config.gateway.drain_timeout);
    let app = app(state);
    let stop_accepting = CancellationToken::new();
    let stop = stop_accepting.clone();
    tracker.spawn(async move {
        cancel.cancelled().await;
        ready.store(false, Ordering::Relaxed);
        tracing::info!(?grace, "gateway draining: readiness failed");
        tokio::time::sleep(grace).await;
        stop.cancel();
    });
    tracker.spawn(async move {
        let server = axum::serve(listener, app).with_graceful_shutdown(stop_accepting.clone().cancelled_owned());
        let drained = async {
            if let Err(e) = server.await {
                tracing::error!(error = %e, "gateway server failed");
            }
        };
        // Sockets close when the listener does; both get the same bound.
        let closing = async {
            stop_accepting.cancelled().await;
            sockets_close.cancel();
            sockets.close();
            sockets.wait().await;
        };
        // Boxed, so it can be dropped when the requests' bound passes.
        let mut both = Box::pin(async { tokio::join!(drained, closing) });
        // `both` ends only after the listener closes, so this serves until then.
        let mut done = false;
        tokio::select! {
            _ = &mut both => done = true,
            _ = stop_accepting.cancelled() => {}
        }
        // One bound for all that is left: requests and sockets, then the background work.
        let cut_at = tokio::time::Instant::now() + timeout;
        let requests_by = cut_at.checked_sub(background::Background::record_grace(timeout)).unwrap_or(cut_at);
        if !done {
            tokio::select! {
                _ = &mut both => tracing::info!("gateway requests drained"),
                _ = tokio::time::sleep_until(requests_by) => tracing::warn!(?timeout, "gateway drain timed out; cutting the requests left"),
            }
        }
        drop(both);
        keeper.cancel();
        match work.drain(cut_at, timeout).await {
            0 => tracing::info!("gateway drained"),
            left => tracing::warn!(tasks = left, "background work still running after the drain bound; the exit cuts it"),
        }
        loops.cancel();
    });
    tracing::info!(%addr, "gateway ready");
    Ok(Running { addr, tracker, work: state_work })
}

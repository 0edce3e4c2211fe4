//! `GET /v1/sessions/{id}/ws`: the session WebSocket (protocol in `wire::ws`). The gateway
//! authenticates, then relays messages to the owning node's internal socket, which speaks the
//! protocol. Relaying awaits each send, so TCP back-pressure runs from the client to the
//! sandbox. An open socket counts as activity. On shutdown, sockets get a close frame with a
//! reason (axum's graceful shutdown does not track upgraded connections; this does).

use std::time::{Duration, Instant};

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use futures::{SinkExt, StreamExt};
use http_util::{ApiError, Query};
use ledger::Access;
use serde::Deserialize;
use tokio_tungstenite::tungstenite::Message as Up;
use tokio_tungstenite::tungstenite::protocol::CloseFrame as UpClose;

use crate::{AppState, Caller};

/// How often an open socket refreshes its session's idle deadline (activity), at least.
const TOUCH_EVERY: Duration = Duration::from_secs(20);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct WsQuery {
    /// For clients that cannot set an Authorization header: a ticket from
    /// `POST /v1/sessions/{id}/ws-ticket` (short-lived, this session only).
    ticket: Option<String>,
    /// A bearer token in the URL (kept for older clients; prefer the header or a ticket: URLs
    /// end up in logs).
    token: Option<String>,
}

#[utoipa::path(post, path = "/v1/sessions/{id}/ws-ticket", tag = "commands", operation_id = "create_ws_ticket", summary = "A short-lived ticket for this session's WebSocket", params(("id" = String, Path, description = "The session id (names its node).")), responses((status = 201, description = "A ticket that opens the session's WebSocket (`?ticket=`) for 30 s.", body = wire::ws::WsTicket)))]
pub(crate) async fn ticket(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<(axum::http::StatusCode, axum::Json<wire::ws::WsTicket>), ApiError> {
    // The session's owner only, as for the socket itself.
    crate::lookup::live_active(&s, &caller, &id, Access::Owner, 0).await?;
    let ttl = crate::auth::WS_TICKET_TTL;
    let ticket = crate::auth::mint_ws_ticket(&s.config.pool_manager.secret, &caller, &id, ttl)
        .map_err(|e| ApiError::internal(format!("mint a WebSocket ticket: {e:#}")))?;
    let path = format!("/v1/sessions/{id}/ws?ticket={ticket}");
    Ok((axum::http::StatusCode::CREATED, axum::Json(wire::ws::WsTicket { ticket, expires_in_s: ttl.as_secs(), path })))
}

type Upstream = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

#[utoipa::path(get, path = "/v1/sessions/{id}/ws", tag = "commands", operation_id = "open_websocket", summary = "Stream commands and terminals over a WebSocket", params(("id" = String, Path, description = "The session id (names its node)."), WsQuery), responses((status = 101, description = "Switching to the WebSocket protocol: JSON text messages, `ClientMsg` from the client and `ServerMsg` from the server (see the README).")))]
pub(crate) async fn upgrade(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<WsQuery>,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let caller = match (q.ticket, q.token) {
        _ if headers.contains_key(axum::http::header::AUTHORIZATION) => crate::auth::from_headers(&s, &headers)?,
        (Some(ticket), _) => crate::auth::verify_ws_ticket(&s.config.pool_manager.secret, &ticket, &id)?,
        (None, Some(t)) => s.verifier.verify(&t)?,
        (None, None) => crate::auth::from_headers(&s, &headers)?,
    };
    crate::quotas::call(&s, &caller)?;
    let r = crate::lookup::live_active(&s, &caller, &id, Access::Owner, 0).await?;
    // Connect to the node before upgrading, so a node failure is a plain HTTP error.
    let req = s.nodes.ws_request(&r.node, &format!("/internal/v1/sandboxes/{}/ws", r.sandbox), r.fence).await?;
    let upstream = match tokio::time::timeout(CONNECT_TIMEOUT, tokio_tungstenite::connect_async(req)).await {
        Ok(Ok((up, _))) => up,
        Ok(Err(tokio_tungstenite::tungstenite::Error::Http(resp))) => {
            let body = resp.body().as_deref().unwrap_or_default();
            return Err(crate::nodes::remote_error(&r.node, resp.status().as_u16(), body));
        }
        Ok(Err(e)) => return Err(ApiError::bad_gateway(format!("node {} is unreachable", r.node), e.to_string())),
        Err(_) => return Err(ApiError::gateway_timeout(format!("node {} did not answer in time", r.node))),
    };
    let shutdown = s.sockets_close.child_token();
    let sockets = s.sockets.clone();
    Ok(ws.on_upgrade(move |socket| sockets.track_future(relay(socket, upstream, s, caller, id, shutdown))))
}

async fn relay(
    client: WebSocket,
    upstream: Upstream,
    s: AppState,
    caller: Caller,
    id: String,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let ws = telemetry::metrics::WsMetrics::open("gateway");
    let (mut c_sink, mut c_src) = client.split();
    let (mut u_sink, mut u_src) = upstream.split();
    let mut touched = Instant::now();
    let mut tick = tokio::time::interval(TOUCH_EVERY);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => {
                let frame = CloseFrame { code: 1001, reason: "gateway shutting down; reconnect".into() };
                let _ = c_sink.send(Message::Close(Some(frame))).await;
                let _ = u_sink.close().await;
                break;
            }
            _ = tick.tick() => {
                if touched.elapsed() >= TOUCH_EVERY {
                    touched = Instant::now();
                    if let Err(e) = crate::lookup::live(&s, &caller, &id, true, 0).await {
                        let frame = CloseFrame { code: 1008, reason: e.message.into() };
                        let _ = c_sink.send(Message::Close(Some(frame))).await;
                        let _ = u_sink.close().await;
                        break;
                    }
                }
            }
            m = c_src.next() => match m {
                Some(Ok(Message::Text(t))) => {
                    if touched.elapsed() >= Duration::from_secs(5) {
                        touched = Instant::now();
                        let _ = crate::lookup::live(&s, &caller, &id, true, 0).await;
                    }
                    ws.bytes_in.increment(t.len() as u64);
                    if u_sink.send(Up::Text(t.as_str().into())).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Binary(b))) => {
                    ws.bytes_in.increment(b.len() as u64);
                    if u_sink.send(Up::Binary(b)).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => {
                    let _ = u_sink.close().await;
                    break;
                }
                Some(Ok(_)) => {}
            },
            m = u_src.next() => match m {
                Some(Ok(Up::Text(t))) => {
                    ws.bytes_out.increment(t.len() as u64);
                    if c_sink.send(Message::Text(t.as_str().into())).await.is_err() {
                        let _ = u_sink.close().await;
                        break;
                    }
                }
                Some(Ok(Up::Close(frame))) => {
                    let frame = frame.map(|f: UpClose| CloseFrame { code: f.code.into(), reason: f.reason.as_str().into() });
                    let _ = c_sink.send(Message::Close(frame)).await;
                    break;
                }
                None | Some(Err(_)) => {
                    let frame = CloseFrame { code: 1011, reason: "lost the connection to the sandbox's node".into() };
                    let _ = c_sink.send(Message::Close(Some(frame))).await;
                    break;
                }
                Some(Ok(_)) => {}
            },
        }
    }
}

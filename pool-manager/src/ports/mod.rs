//! A sandbox's ports, relayed through the agent's channel: `GET /internal/v1/sandboxes/{id}/
//! ports/{port}` with `Upgrade: sandpool-port` answers 101, and from then on the connection
//! carries the raw bytes of one TCP connection to `127.0.0.1:port` inside the sandbox, which
//! the agent opens (`agent_proto::Kind::Connect`). The gateway speaks HTTP (or a WebSocket)
//! over it. The sandbox needs no network for this: the agent is PID 1 in the sandbox's own
//! network namespace, and the bytes travel on the channel the node already has.
//!
//! Bounds: `pool_manager.max_port_connections` open connections per sandbox (one more answers
//! 429 before the upgrade) and `pool_manager.max_port_bytes` per connection (past it the node
//! closes the connection). Flow control is end to end: the agent forwards only what this side
//! has credited, which it does once the bytes are written to the gateway, and it acknowledges
//! each chunk towards the port once written there.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use agent_proto::{self as proto, ConnectSpec, Frame, Kind};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_util::ApiError;
use hyper_util::rt::TokioIo;
use telemetry::names;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Semaphore;
use wire::ErrorCode;
use wire::internal::PORT_UPGRADE;

use crate::channel::{AgentConn, AgentError, Route};
use crate::node::Node;
use crate::sandbox::Sandbox;

pub(crate) mod open;

/// Bytes the agent may send from the port ahead of what was written to the gateway.
const PORT_WINDOW: u32 = 256 * 1024;
/// How long the agent may take to open the connection (loopback: at once, unless the
/// server's accept backlog is full).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// After the gateway's side ended, how long the port's answer may still take to end: the
/// gateway ends its side only when it is done with the connection.
const HALF_CLOSE_GRACE: Duration = Duration::from_secs(10);
/// Retry-After of a connection refused for the per-sandbox bound: connections are short.
const BUSY_RETRY_S: u64 = 1;

fn outcome(outcome: &'static str) {
    metrics::counter!(names::PORT_CONNECTIONS, "outcome" => outcome).increment(1);
}

/// `GET /internal/v1/sandboxes/{sandbox}/ports/{port}` (upgrade): see the module doc.
pub(crate) async fn upgrade(
    State(node): State<Arc<Node>>,
    Path((id, port)): Path<(String, String)>,
    mut req: Request,
) -> Result<Response, ApiError> {
    let (sb, fence) = crate::admit::admit_live_call(&node, &id, req.headers()).await?;
    let port = exposed(&sb, &port)?;
    let wants = req.headers().get(header::UPGRADE).and_then(|v| v.to_str().ok());
    if !wants.is_some_and(|v| v.eq_ignore_ascii_case(PORT_UPGRADE)) {
        return Err(ApiError::bad_request(format!("a port connection needs `Upgrade: {PORT_UPGRADE}`")));
    }
    let Some(agent) = sb.agent.clone() else {
        return Err(ApiError::bad_request(format!(
            "template {:?} runs docker exec; ports need exec = \"agent\"",
            sb.template.name
        )));
    };
    if agent.version() < 5 {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!("sandbox {}'s agent predates ports; open a new session", sb.id),
        ));
    }
    let max = node.config.pool_manager.max_port_connections;
    let Some(slot) = sb.ports.take(max) else {
        outcome("over_limit");
        let mut e = ApiError::new(
            ErrorCode::TooManyRequests,
            format!("sandbox {} has {max} port connections open, its limit (pool_manager.max_port_connections)", sb.id),
        );
        e.retry_after_s = Some(BUSY_RETRY_S);
        return Err(e);
    };
    // Connected before the upgrade, so a port nothing listens on is a plain HTTP answer.
    let conn = match tokio::time::timeout(CONNECT_TIMEOUT, PortConn::open(&agent, fence, port)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(connect_error(&sb, port, e)),
        Err(_) => return Err(connect_error(&sb, port, AgentError::Timeout)),
    };
    outcome("opened");
    let upgraded = hyper::upgrade::on(&mut req);
    let (max_bytes, cancel) = (node.config.pool_manager.max_port_bytes, node.shutdown_token());
    let sandbox = sb.id.clone();
    node.tracker.spawn(async move {
        let _slot = slot;
        match upgraded.await {
            Ok(io) => {
                let ended = tokio::select! {
                    r = relay(TokioIo::new(io), conn, max_bytes) => r,
                    _ = cancel.cancelled() => Ended::Shutdown,
                };
                if let Ended::Cut = ended {
                    outcome("cut");
                    tracing::info!(sandbox, port, max_bytes, "a port connection reached its byte limit and was closed");
                }
            }
            Err(e) => tracing::debug!(sandbox, port, error = %e, "a port connection's upgrade failed"),
        }
    });
    let mut resp = StatusCode::SWITCHING_PROTOCOLS.into_response();
    resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    resp.headers_mut().insert(header::UPGRADE, HeaderValue::from_static(PORT_UPGRADE));
    Ok(resp)
}

/// The port of the path, if the sandbox's template exposes it.
fn exposed(sb: &Sandbox, raw: &str) -> Result<u16, ApiError> {
    let port: u16 = raw
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::bad_request(format!("port {raw:?}: expected a number 1 ..= 65535")))?;
    if !sb.template.ports.contains(&port) {
        return Err(not_exposed(&sb.template.name, &sb.template.ports, port));
    }
    Ok(port)
}

/// The answer for a port the template does not expose (the gateway gives the same).
fn not_exposed(template: &str, ports: &[u16], port: u16) -> ApiError {
    ApiError::forbidden(wire::port_not_exposed(template, ports, port))
}

fn connect_error(sb: &Sandbox, port: u16, e: AgentError) -> ApiError {
    match e {
        AgentError::Remote(info) if info.code == proto::codes::REFUSED => {
            outcome("refused");
            ApiError::bad_gateway(format!("nothing listens on port {port} in sandbox {}", sb.id), info.message)
        }
        e => {
            outcome("failed");
            crate::admit::agent_error(sb, e)
        }
    }
}

/// One open connection to a port, on the agent's channel.
struct PortConn {
    agent: AgentConn,
    route: Route,
    /// A permit per `Data` frame the agent has not yet written to the port.
    window: Arc<Semaphore>,
    /// Tells the agent to close the connection however this side lets go of it (the relay
    /// ended, the upgrade never came, the node is shutting down).
    _close: CloseOnDrop,
}

/// Sends `Signal` for connection `id` when dropped. Closing an ended connection is
/// harmless: the agent ignores a `Signal` for an id it has forgotten.
struct CloseOnDrop {
    agent: AgentConn,
    id: u32,
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if !self.agent.is_alive() {
            return;
        }
        let (agent, frame) = (self.agent.clone(), Frame::new(Kind::Signal, self.id, 9u32.to_le_bytes().to_vec()));
        // Outside a runtime only at shutdown, when the channel goes anyway.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = agent.send(&[frame]).await;
            });
        }
    }
}

impl PortConn {
    async fn open(agent: &AgentConn, fence: u64, port: u16) -> Result<PortConn, AgentError> {
        let window = Arc::new(Semaphore::new(proto::STDIN_WINDOW as usize));
        let mut route = agent.open_route(Some(window.clone()))?;
        let spec = ConnectSpec { fence, port, credit: PORT_WINDOW };
        agent.send(&[Frame::new(Kind::Connect, route.id(), spec.encode())]).await?;
        // From here a connection given up on (the caller's timeout) is closed, opened or not.
        let close = CloseOnDrop { agent: agent.clone(), id: route.id() };
        let f = route.next().await?;
        match f.kind {
            Kind::Opened => Ok(PortConn { agent: agent.clone(), route, window, _close: close }),
            Kind::Error => Err(match proto::ErrorInfo::decode(&f.payload) {
                Ok(e) => AgentError::Remote(e),
                Err(e) => AgentError::Protocol(e.to_string()),
            }),
            k => Err(AgentError::Protocol(format!("unexpected {k:?} opening a port"))),
        }
    }
}

/// How a relay ended.
enum Ended {
    /// Both sides ended, or one failed.
    Done,
    /// Over `max_port_bytes`.
    Cut,
    /// The node is shutting down.
    Shutdown,
}

/// Relays bytes between `io` (the gateway's upgraded connection) and the port until both
/// sides have ended, one fails, or `max_bytes` have passed. However it ends (or is dropped),
/// the agent is told to close the connection (`CloseOnDrop`).
async fn relay<IO: AsyncRead + AsyncWrite>(io: IO, conn: PortConn, max_bytes: u64) -> Ended {
    let PortConn { agent, mut route, window, _close } = conn;
    let id = route.id();
    let (mut rd, mut wr) = tokio::io::split(io);
    // Bytes both ways together, against `max_bytes`.
    let moved = AtomicU64::new(0);
    let add = |n: usize| moved.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
    let bytes_in = metrics::counter!(names::PORT_BYTES, "direction" => "in");
    let bytes_out = metrics::counter!(names::PORT_BYTES, "direction" => "out");
    // The gateway's bytes towards the port; `Ok` at the gateway's end of stream.
    let to_port = async {
        let mut buf = vec![0u8; proto::MAX_CHUNK];
        loop {
            let n = rd.read(&mut buf).await.map_err(|_| Ended::Done)?;
            if n == 0 {
                let _ = agent.send(&[Frame::new(Kind::End, id, vec![])]).await;
                return Ok::<(), Ended>(());
            }
            if add(n) > max_bytes {
                return Err(Ended::Cut);
            }
            bytes_in.increment(n as u64);
            // Returned by the agent's StdinAck, not on drop.
            window.acquire().await.map_err(|_| Ended::Done)?.forget();
            agent.send(&[Frame::new(Kind::Data, id, buf[..n].to_vec())]).await.map_err(|_| Ended::Done)?;
        }
    };
    // The port's bytes towards the gateway; `Ok` at the port's end of stream.
    let from_port = async {
        loop {
            let f = route.next().await.map_err(|_| Ended::Done)?;
            match f.kind {
                Kind::Data => {
                    if add(f.payload.len()) > max_bytes {
                        return Err(Ended::Cut);
                    }
                    bytes_out.increment(f.payload.len() as u64);
                    wr.write_all(&f.payload).await.map_err(|_| Ended::Done)?;
                    wr.flush().await.map_err(|_| Ended::Done)?;
                    let credit = (f.payload.len() as u32).to_le_bytes().to_vec();
                    agent.send(&[Frame::new(Kind::Credit, id, credit)]).await.map_err(|_| Ended::Done)?;
                }
                Kind::End => {
                    let _ = wr.shutdown().await;
                    return Ok::<(), Ended>(());
                }
                _ => return Err(Ended::Done),
            }
        }
    };
    let ended = async {
        tokio::pin!(to_port, from_port);
        // Whichever side ends first, the other may finish; a failure ends both. Once the
        // gateway's side has ended, the port's answer gets `HALF_CLOSE_GRACE` to end too.
        tokio::select! {
            r = &mut to_port => match r {
                Ok(()) => match tokio::time::timeout(HALF_CLOSE_GRACE, from_port).await {
                    Ok(Err(e)) => e,
                    _ => Ended::Done,
                },
                Err(e) => e,
            },
            r = &mut from_port => match r {
                Ok(()) => to_port.await.err().unwrap_or(Ended::Done),
                Err(e) => e,
            },
        }
    }
    .await;
    drop(_close);
    ended
}

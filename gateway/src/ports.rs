//! A session's ports through the gateway: `/v1/sessions/{id}/ports/{port}/{path}` (any method;
//! the session's owner's bearer token) and `/v1/ports/{ticket}/{path}` (a signed URL the owner
//! asked for with `POST /v1/sessions/{id}/urls`; no token, the ticket in the path so a page's
//! relative links keep it). The gateway opens a tunnel to the owning node
//! (`Upgrade: sandpool-port`: raw bytes of one TCP connection to the port, which the sandbox's
//! agent opens on its loopback), then speaks HTTP/1.1 over it as a client: the request goes
//! on with its method, headers (but the caller's `Authorization` and hop-by-hop headers) and
//! body streamed, the answer comes back streamed. A WebSocket (or any `Upgrade`) answered 101
//! is relayed byte for byte until either side closes. The node decides which ports the
//! sandbox's template exposes; the tunnel needs no network in the sandbox.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, header};
use axum::response::Response;
use http_util::{ApiError, Json};
use hyper_util::rt::TokioIo;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use ledger::Access;
use serde::{Deserialize, Serialize};
use wire::{PortUrl, PortUrlRequest};

use crate::{AppState, Caller};

/// How long the port's server may take to answer a request's head (the body streams on
/// without a bound of the gateway's: the node bounds its bytes).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(300);
/// How often an upgraded connection (a WebSocket) counts as activity of its session.
const TOUCH_EVERY: Duration = Duration::from_secs(20);
/// A signed URL's life when the request names none: long enough to open a page and use it
/// for a while, short enough that a leaked link soon stops working.
pub(crate) const DEFAULT_URL_TTL_S: u64 = 600;
/// The longest a signed URL may live: a day (the owner can always ask again).
pub(crate) const MAX_URL_TTL_S: u64 = 86_400;
/// Domain separation: the tickets' key is derived from the internal secret every gateway
/// holds, so any replica checks a ticket another issued; nothing else signs with it.
const TICKET_KEY_PREFIX: &str = "sandpool port url v1\0";

/// Headers that describe one hop, not the request (RFC 9110 7.6.1); never forwarded as they
/// came. An upgrade's `Connection: upgrade` and `Upgrade` are set again where one is relayed.
const HOP_BY_HOP: &[HeaderName] = &[
    header::CONNECTION,
    header::UPGRADE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
];

/// What a signed URL's ticket says: this tenant's session, this port, until `exp`.
#[derive(Debug, Serialize, Deserialize)]
struct Ticket {
    /// The session.
    sid: String,
    /// Its owner, the caller the ticket stands for.
    sub: String,
    port: u16,
    exp: u64,
}

fn ticket_keys(secret: &str) -> Result<(EncodingKey, DecodingKey), ApiError> {
    let key = format!("{TICKET_KEY_PREFIX}{secret}");
    let bad = |e: jsonwebtoken::errors::Error| ApiError::internal(format!("the port url key: {e}"));
    Ok((EncodingKey::from_secret(key.as_bytes()).map_err(bad)?, DecodingKey::from_secret(key.as_bytes()).map_err(bad)?))
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn parse_port(raw: &str) -> Result<u16, ApiError> {
    raw.parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::bad_request(format!("port {raw:?}: expected a number 1 ..= 65535")))
}

/// The ports a configured template exposes (`None`: a template made from an image or a
/// snapshot, whose node decides).
fn exposed(s: &AppState, template: &str) -> Option<Vec<u16>> {
    s.config.templates.get(template).map(|t| t.ports.clone())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/urls", tag = "ports", operation_id = "sign_port_url", summary = "A signed URL of a port", params(("id" = String, Path, description = "The session id (names its node).")), request_body = wire::PortUrlRequest, responses((status = 200, description = "A URL path (under the gateway's address) that reaches the port without a token until `expires_at`.", body = wire::PortUrl)))]
pub(crate) async fn sign(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
    Json(req): Json<PortUrlRequest>,
) -> Result<Json<PortUrl>, ApiError> {
    if req.port == 0 {
        return Err(ApiError::bad_request("port: expected a number 1 ..= 65535"));
    }
    let ttl = req.ttl_s.unwrap_or(DEFAULT_URL_TTL_S);
    if !(1..=MAX_URL_TTL_S).contains(&ttl) {
        return Err(ApiError::bad_request(format!("ttl_s: must be 1 ..= {MAX_URL_TTL_S}")));
    }
    let r = crate::lookup::live(&s, &caller, &id, false, 0).await?;
    if let Some(ports) = exposed(&s, &r.template)
        && !ports.contains(&req.port)
    {
        return Err(not_exposed(&r.template, &ports, req.port));
    }
    let exp = now_s() + ttl;
    let ticket = Ticket { sid: r.id.clone(), sub: caller.tenant.clone(), port: req.port, exp };
    let (key, _) = ticket_keys(&s.config.pool_manager.secret)?;
    let token = jsonwebtoken::encode(&Header::new(Algorithm::HS256), &ticket, &key)
        .map_err(|e| ApiError::internal(format!("sign a port url: {e}")))?;
    Ok(Json(PortUrl {
        path: format!("/v1/ports/{token}/"),
        port: req.port,
        expires_at: crate::errors::rfc3339(exp * 1000),
    }))
}

/// The answer for a port the template does not expose (the node's is the same).
fn not_exposed(template: &str, ports: &[u16], port: u16) -> ApiError {
    ApiError::forbidden(wire::port_not_exposed(template, ports, port))
}

/// A request to a port by its owner (bearer token).
async fn by_owner(s: AppState, id: String, port: String, path: String, req: Request) -> Result<Response, ApiError> {
    let caller = crate::auth::from_headers(&s, req.headers())?;
    let port = parse_port(&port)?;
    let prefix = format!("/v1/sessions/{id}/ports/{port}");
    relay(s, caller, id, port, &prefix, path, req).await
}

/// A request to a port through a signed URL.
async fn by_ticket(s: AppState, ticket: String, path: String, req: Request) -> Result<Response, ApiError> {
    let (_, key) = ticket_keys(&s.config.pool_manager.secret)?;
    let mut v = Validation::new(Algorithm::HS256);
    v.leeway = 0;
    v.set_required_spec_claims(&["exp"]);
    let t = jsonwebtoken::decode::<Ticket>(&ticket, &key, &v)
        .map_err(|e| match e.kind() {
            jsonwebtoken::errors::ErrorKind::ExpiredSignature => {
                ApiError::unauthorized("this signed URL has expired; ask for a new one")
            }
            _ => ApiError::unauthorized("this signed URL is not valid"),
        })?
        .claims;
    crate::observe::tenant(&t.sub);
    let caller = Caller { tenant: t.sub, admin: false };
    let prefix = format!("/v1/ports/{ticket}");
    relay(s, caller, t.sid, t.port, &prefix, path, req).await
}

/// Forwards `req` to `port` of session `id` as `/{path}` and relays the answer.
async fn relay(
    s: AppState,
    caller: Caller,
    id: String,
    port: u16,
    prefix: &str,
    path: String,
    mut req: Request,
) -> Result<Response, ApiError> {
    crate::quotas::call(&s, &caller)?;
    let r = crate::lookup::live_active(&s, &caller, &id, Access::Owner, 0).await?;
    if let Some(ports) = exposed(&s, &r.template)
        && !ports.contains(&port)
    {
        return Err(not_exposed(&r.template, &ports, port));
    }
    let node_path = format!("/internal/v1/sandboxes/{}/ports/{port}", r.sandbox);
    let tunnel = s.nodes.tunnel(&r.node, &node_path, r.fence).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(tunnel))
        .await
        .map_err(|e| ApiError::bad_gateway(format!("port {port} of session {id} failed"), e.to_string()))?;
    s.sockets.spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "a port connection ended with an error");
        }
    });

    // The client's side of an upgrade (a WebSocket), taken before the request is rebuilt.
    let upgrading = req.headers().contains_key(header::UPGRADE);
    let client_upgrade = upgrading.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let query = parts.uri.query().map(|q| format!("?{q}")).unwrap_or_default();
    let uri: Uri =
        format!("/{path}{query}").parse().map_err(|e| ApiError::bad_request(format!("path {path:?}: {e}")))?;
    let mut out = axum::http::Request::builder()
        .method(parts.method)
        .uri(uri)
        .body(body)
        .map_err(|e| ApiError::bad_request(format!("cannot forward this request: {e}")))?;
    *out.headers_mut() = forwarded_headers(&parts.headers, port, prefix, upgrading);

    let mut answer = match tokio::time::timeout(RESPONSE_TIMEOUT, sender.send_request(out)).await {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => {
            return Err(ApiError::bad_gateway(
                format!("port {port} of session {id} closed the connection without an answer"),
                e.to_string(),
            ));
        }
        Err(_) => {
            return Err(ApiError::gateway_timeout(format!("port {port} of session {id} did not answer in time")));
        }
    };
    if answer.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_upgrade) = client_upgrade
    {
        let server_upgrade = hyper::upgrade::on(&mut answer);
        let shutdown = s.sockets_close.child_token();
        let s2 = s.clone();
        s.sockets.spawn(async move {
            let (Ok(client), Ok(server)) = (client_upgrade.await, server_upgrade.await) else { return };
            let (mut client, mut server) = (TokioIo::new(client), TokioIo::new(server));
            let copy = tokio::io::copy_bidirectional(&mut client, &mut server);
            tokio::pin!(copy);
            // An open socket is activity: the session's idle deadline moves while it is open,
            // and the socket closes once the session has ended.
            let mut touch = tokio::time::interval_at(tokio::time::Instant::now() + TOUCH_EVERY, TOUCH_EVERY);
            loop {
                tokio::select! {
                    _ = &mut copy => break,
                    _ = shutdown.cancelled() => break,
                    _ = touch.tick() => {
                        if crate::lookup::live(&s2, &caller, &id, true, 0).await.is_err() {
                            break;
                        }
                    }
                }
            }
        });
        let (parts, _) = answer.into_parts();
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (mut parts, body) = answer.into_parts();
    for h in HOP_BY_HOP {
        parts.headers.remove(h);
    }
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// The headers the port's server sees: the client's, without its credentials or hop-by-hop
/// headers (those an upgrade needs set again), `Host` the port's own, and where the request
/// came from in `X-Forwarded-*`.
fn forwarded_headers(incoming: &HeaderMap, port: u16, prefix: &str, upgrading: bool) -> HeaderMap {
    let mut h = incoming.clone();
    h.remove(header::AUTHORIZATION);
    if let Some(names) = incoming.get(header::CONNECTION).and_then(|v| v.to_str().ok()) {
        for name in names.split(',').filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok()) {
            if name != header::UPGRADE {
                h.remove(name);
            }
        }
    }
    for name in HOP_BY_HOP {
        h.remove(name);
    }
    if upgrading && let Some(u) = incoming.get(header::UPGRADE) {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, u.clone());
    }
    if let Some(host) = incoming.get(header::HOST) {
        h.insert(HeaderName::from_static("x-forwarded-host"), host.clone());
    }
    if let Ok(p) = HeaderValue::from_str(prefix) {
        h.insert(HeaderName::from_static("x-forwarded-prefix"), p);
    }
    if let Ok(host) = HeaderValue::from_str(&format!("localhost:{port}")) {
        h.insert(header::HOST, host);
    }
    h
}

/// One handler per method and path shape, each its own operation (the API's operation ids
/// are unique): `$owner` for `/v1/sessions/{id}/ports/{port}/{*path}`, `$owner_root` for the
/// port's root (`.../ports/{port}/`, which a wildcard does not match), `$signed` and
/// `$signed_root` the same under `/v1/ports/{ticket}`.
macro_rules! port_routes {
    ($($method:ident: $owner:ident, $owner_root:ident, $signed:ident, $signed_root:ident;)*) => {$(
        #[utoipa::path($method, path = "/v1/sessions/{id}/ports/{port}/{*path}", tag = "ports", operation_id = stringify!($owner), summary = "A request to a port of the session's sandbox", params(("id" = String, Path, description = "The session id (names its node)."), ("port" = u16, Path, description = "A port the session's template exposes (`ports`)."), ("path" = String, Path, description = "The path on the port's server.")), responses((status = 200, description = "The port's server's answer, as it answered (any status, headers and body, streamed; 101 for a WebSocket).")))]
        pub(crate) async fn $owner(State(s): State<AppState>, Path((id, port, path)): Path<(String, String, String)>, req: Request) -> Result<Response, ApiError> {
            by_owner(s, id, port, path, req).await
        }

        #[utoipa::path($method, path = "/v1/sessions/{id}/ports/{port}/", tag = "ports", operation_id = stringify!($owner_root), summary = "A request to the root of a port of the session's sandbox", params(("id" = String, Path, description = "The session id (names its node)."), ("port" = u16, Path, description = "A port the session's template exposes (`ports`).")), responses((status = 200, description = "The port's server's answer, as it answered.")))]
        pub(crate) async fn $owner_root(State(s): State<AppState>, Path((id, port)): Path<(String, String)>, req: Request) -> Result<Response, ApiError> {
            by_owner(s, id, port, String::new(), req).await
        }

        #[utoipa::path($method, path = "/v1/ports/{ticket}/{*path}", tag = "ports", operation_id = stringify!($signed), summary = "A request to a port through a signed URL", params(("ticket" = String, Path, description = "The ticket of a signed URL (`POST /v1/sessions/{id}/urls`)."), ("path" = String, Path, description = "The path on the port's server.")), responses((status = 200, description = "The port's server's answer, as it answered.")))]
        pub(crate) async fn $signed(State(s): State<AppState>, Path((ticket, path)): Path<(String, String)>, req: Request) -> Result<Response, ApiError> {
            by_ticket(s, ticket, path, req).await
        }

        #[utoipa::path($method, path = "/v1/ports/{ticket}/", tag = "ports", operation_id = stringify!($signed_root), summary = "A request to a port's root through a signed URL", params(("ticket" = String, Path, description = "The ticket of a signed URL (`POST /v1/sessions/{id}/urls`).")), responses((status = 200, description = "The port's server's answer, as it answered.")))]
        pub(crate) async fn $signed_root(State(s): State<AppState>, Path(ticket): Path<String>, req: Request) -> Result<Response, ApiError> {
            by_ticket(s, ticket, String::new(), req).await
        }
    )*};
}

port_routes! {
    get: port_get, port_root_get, signed_port_get, signed_port_root_get;
    head: port_head, port_root_head, signed_port_head, signed_port_root_head;
    post: port_post, port_root_post, signed_port_post, signed_port_root_post;
    put: port_put, port_root_put, signed_port_put, signed_port_root_put;
    patch: port_patch, port_root_patch, signed_port_patch, signed_port_root_patch;
    delete: port_delete, port_root_delete, signed_port_delete, signed_port_root_delete;
    options: port_options, port_root_options, signed_port_options, signed_port_root_options;
}

/// Whether `operation` is one of the port routes above (`signed`: by ticket, no bearer).
pub(crate) fn is_port_operation(operation: &str) -> Option<bool> {
    let signed = operation.starts_with("signed_port_");
    (signed || operation.starts_with("port_")).then_some(signed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_headers_drop_credentials_and_hops_and_name_the_port() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer secret"));
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, x-private"));
        h.insert(HeaderName::from_static("x-private"), HeaderValue::from_static("1"));
        h.insert(header::HOST, HeaderValue::from_static("gw.example:8080"));
        h.insert(header::COOKIE, HeaderValue::from_static("a=b"));
        let out = forwarded_headers(&h, 8000, "/v1/sessions/s/ports/8000", false);
        assert!(out.get(header::AUTHORIZATION).is_none());
        assert!(out.get("x-private").is_none() && out.get(header::CONNECTION).is_none());
        assert_eq!(out[header::HOST], "localhost:8000");
        assert_eq!(out["x-forwarded-host"], "gw.example:8080");
        assert_eq!(out["x-forwarded-prefix"], "/v1/sessions/s/ports/8000");
        assert_eq!(out[header::COOKIE], "a=b");

        h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        let out = forwarded_headers(&h, 8000, "/p", true);
        assert_eq!(out[header::CONNECTION], "upgrade");
        assert_eq!(out[header::UPGRADE], "websocket");
    }

    #[test]
    fn tickets_verify_only_with_the_same_secret_and_expire() {
        let (enc, _) = ticket_keys("one").unwrap();
        let t = Ticket { sid: "n.1".into(), sub: "acme".into(), port: 80, exp: now_s() + 60 };
        let token = jsonwebtoken::encode(&Header::new(Algorithm::HS256), &t, &enc).unwrap();
        let mut v = Validation::new(Algorithm::HS256);
        v.leeway = 0;
        assert!(jsonwebtoken::decode::<Ticket>(&token, &ticket_keys("one").unwrap().1, &v).is_ok());
        assert!(jsonwebtoken::decode::<Ticket>(&token, &ticket_keys("two").unwrap().1, &v).is_err());
        let old = Ticket { exp: now_s() - 1, ..t };
        let token = jsonwebtoken::encode(&Header::new(Algorithm::HS256), &old, &enc).unwrap();
        let e = jsonwebtoken::decode::<Ticket>(&token, &ticket_keys("one").unwrap().1, &v).unwrap_err();
        assert_eq!(e.kind(), &jsonwebtoken::errors::ErrorKind::ExpiredSignature);
    }
}

//! Calls into a session's sandbox, routed to the node its id names: exec and files. The
//! node's answer is forwarded as it came (bytes), never decoded and encoded again.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_util::{ApiError, Json};
use ledger::Access;
use wire::{ErrorCode, ExecRequest};

use crate::lookup::live_active;
use crate::nodes::NodeRequest;
use crate::{AppState, Caller};

/// Extra time the gateway waits for a node beyond the command's own timeout.
const EXEC_GRACE: Duration = Duration::from_secs(15);
const FILE_TIMEOUT: Duration = Duration::from_secs(180);

/// The exec timeout a request asks for, checked.
pub fn exec_timeout_ms(req: &ExecRequest) -> Result<u64, ApiError> {
    let max = config::MAX_EXEC_TIMEOUT.as_millis() as u64;
    match req.timeout_ms.unwrap_or(config::DEFAULT_EXEC_TIMEOUT.as_millis() as u64) {
        t @ 1.. if t <= max => Ok(t),
        _ => Err(ApiError::bad_request(format!("timeout_ms: must be 1 ..= {max}"))),
    }
}

pub async fn exec(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    // Validated here (a bad request never reaches a node), forwarded as received.
    let Json(req): Json<ExecRequest> = parse_json(&body)?;
    let timeout_ms = exec_timeout_ms(&req)?;
    crate::quotas::call(&s, &caller)?;
    let r = live_active(&s, &caller, &id, Access::Owner, timeout_ms).await?;
    let path = format!("/internal/v1/sandboxes/{}/exec", r.sandbox);
    let call = NodeRequest::new(Method::POST, path, Duration::from_millis(timeout_ms) + EXEC_GRACE)
        .fence(r.fence)
        .body(body, "application/json");
    let answer = s.nodes.call(&r.node, call).await?;
    Ok(with_type(answer, "application/json"))
}

/// The JSON body of a request, with our error shape when it is not acceptable.
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<Json<T>, ApiError> {
    serde_json::from_slice(body).map(Json).map_err(|e| {
        if e.is_syntax() || e.is_eof() {
            ApiError::bad_request(format!("malformed JSON: {e}"))
        } else {
            ApiError::bad_request(format!("invalid request: {e}"))
        }
    })
}

fn with_type(bytes: Bytes, content_type: &'static str) -> Response {
    let mut resp = bytes.into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

pub async fn read_file(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    crate::quotas::call(&s, &caller)?;
    let r = live_active(&s, &caller, &id, Access::Owner, 0).await?;
    let url = file_url(&r.sandbox, &path)?;
    let bytes = s.nodes.call(&r.node, NodeRequest::new(Method::GET, url, FILE_TIMEOUT).fence(r.fence)).await?;
    Ok(with_type(bytes, "application/octet-stream"))
}

pub async fn write_file(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, path)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    crate::quotas::call(&s, &caller)?;
    let r = live_active(&s, &caller, &id, Access::Owner, 0).await?;
    let url = file_url(&r.sandbox, &path)?;
    let call = NodeRequest::new(Method::PUT, url, FILE_TIMEOUT).fence(r.fence).body(body, "application/octet-stream");
    s.nodes.call(&r.node, call).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The internal URL of a file call, once the path is acceptable.
fn file_url(sandbox: &str, path: &str) -> Result<String, ApiError> {
    if let Some(why) = wire::paths::problem(path) {
        return Err(ApiError::new(ErrorCode::InvalidPath, format!("path {path:?}: {why}")));
    }
    Ok(format!("/internal/v1/sandboxes/{sandbox}/files/{}", encode_path(path)))
}

/// Percent-encodes a file path for the internal URL, keeping '/'.
fn encode_path(p: &str) -> String {
    let mut out = String::with_capacity(p.len());
    for b in p.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

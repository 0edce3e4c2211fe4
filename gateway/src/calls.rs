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
/// How far over the body limit an upload may be and still be read (and dropped) before 413.
const DRAIN_OVERSIZED: u64 = 16 << 20;
/// A whole file transfer, streamed both ways (a large download to a slow client takes long).
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(3600);

/// The exec timeout a request asks for, checked.
pub(crate) fn exec_timeout_ms(req: &ExecRequest) -> Result<u64, ApiError> {
    req.checked_timeout_ms().map_err(ApiError::bad_request)
}

#[utoipa::path(post, path = "/v1/sessions/{id}/exec", tag = "commands", operation_id = "exec", summary = "Run a command", params(("id" = String, Path, description = "The session id (names its node).")), request_body = wire::ExecRequest, responses((status = 200, description = "The command ran to its end or its timeout (`timed_out`); its exit code is in the body.", body = wire::ExecResponse)))]
pub(crate) async fn exec(
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

#[utoipa::path(get, path = "/v1/sessions/{id}/files/{*path}", tag = "files", operation_id = "read_file", summary = "Read a file (or a directory as tar)", params(("id" = String, Path, description = "The session id (names its node)."), ("path" = String, Path, description = "Absolute path in the sandbox (the slash after `files/` starts it: `files//tmp/x`); may contain slashes; `..` is refused.")), responses((status = 200, description = "A regular file's bytes; for a directory, a tar of it.", content_type = "application/octet-stream", body = crate::openapi::Binary)))]
pub(crate) async fn read_file(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    crate::quotas::call(&s, &caller)?;
    let r = live_active(&s, &caller, &id, Access::Owner, 0).await?;
    let url = file_url(&r.sandbox, "files", &path)?;
    let req = NodeRequest::new(Method::GET, url, TRANSFER_TIMEOUT).fence(r.fence);
    let mut resp = s.nodes.stream(&r.node, req, None).await?;
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    Ok(resp)
}

#[utoipa::path(put, path = "/v1/sessions/{id}/files/{*path}", tag = "files", operation_id = "write_file", summary = "Write a file", params(("id" = String, Path, description = "The session id (names its node)."), ("path" = String, Path, description = "Absolute path in the sandbox (the slash after `files/` starts it: `files//tmp/x`); may contain slashes; `..` is refused.")), request_body(content = crate::openapi::Binary, content_type = "application/octet-stream", description = "The file's new contents (parent directories are created)."), responses((status = 204, description = "Written (atomically: readers see the old or the new contents).")))]
pub(crate) async fn write_file(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, path)): Path<(String, String)>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Result<StatusCode, ApiError> {
    let max_bytes = s.config.gateway.max_body_bytes;
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > max_bytes) {
        // Read (and drop) a body not far over, so its client is done sending and reads the
        // answer; hang up on a larger one rather than take it all in.
        if n <= max_bytes.saturating_add(DRAIN_OVERSIZED) {
            let mut chunks = body.into_data_stream();
            while let Some(Ok(_)) = futures::StreamExt::next(&mut chunks).await {}
        }
        return Err(ApiError::new(ErrorCode::PayloadTooLarge, format!("the body is over {max_bytes} bytes")));
    }
    crate::quotas::call(&s, &caller)?;
    let r = live_active(&s, &caller, &id, Access::Owner, 0).await?;
    let url = file_url(&r.sandbox, "files", &path)?;
    let req = NodeRequest::new(Method::PUT, url, TRANSFER_TIMEOUT).fence(r.fence);
    let upload = crate::nodes::Upload { body, content_type: "application/octet-stream", max_bytes };
    s.nodes.stream(&r.node, req, Some(upload)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Lists a directory of the sandbox (one level; symbolic links are not followed).
#[utoipa::path(get, path = "/v1/sessions/{id}/dirs/{*path}", tag = "files", operation_id = "list_dir", summary = "List a directory", params(("id" = String, Path, description = "The session id (names its node)."), ("path" = String, Path, description = "The directory: absolute (`dirs//tmp`), or relative to the workdir (`dirs/src`); `GET .../dirs` lists the workdir itself.")), responses((status = 200, description = "The directory's entries, sorted by name (at most 10,000; `total` counts them all).", body = wire::DirListing)))]
pub(crate) async fn list_dir(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    listing(&s, &caller, &id, &path).await
}

/// Lists the template's workdir (`list_dir` of `.`, which a client would drop from a URL).
#[utoipa::path(get, path = "/v1/sessions/{id}/dirs", tag = "files", operation_id = "list_workdir", summary = "List the workdir", params(("id" = String, Path, description = "The session id (names its node).")), responses((status = 200, description = "The workdir's entries, sorted by name (at most 10,000; `total` counts them all).", body = wire::DirListing)))]
pub(crate) async fn list_workdir(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    listing(&s, &caller, &id, ".").await
}

async fn listing(s: &AppState, caller: &Caller, id: &str, path: &str) -> Result<Response, ApiError> {
    crate::quotas::call(s, caller)?;
    let r = live_active(s, caller, id, Access::Owner, 0).await?;
    let url = match path {
        // A URL client drops a `.` segment: the workdir has a route of its own.
        "." => format!("/internal/v1/sandboxes/{}/dirs", r.sandbox),
        _ => file_url(&r.sandbox, "dirs", path)?,
    };
    let bytes = s.nodes.call(&r.node, NodeRequest::new(Method::GET, url, FILE_TIMEOUT).fence(r.fence)).await?;
    Ok(with_type(bytes, "application/json"))
}

/// The internal URL of a file call, once the path is acceptable.
fn file_url(sandbox: &str, kind: &str, path: &str) -> Result<String, ApiError> {
    if let Some(why) = wire::paths::problem(path) {
        return Err(ApiError::new(ErrorCode::InvalidPath, format!("path {path:?}: {why}")));
    }
    Ok(format!("/internal/v1/sandboxes/{sandbox}/{kind}/{}", encode_path(path)))
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

/// Sends a one-shot file operation to the session's node, its paths checked here first.
async fn fs_op(s: &AppState, caller: &Caller, id: &str, op: wire::internal::FsOp) -> Result<Bytes, ApiError> {
    use wire::internal::FsOp;
    let paths: Vec<&str> = match &op {
        FsOp::Exists { path } | FsOp::Remove { path, .. } | FsOp::MakeDir { path } => vec![path],
        FsOp::Rename { from, to } => vec![from, to],
    };
    for path in paths {
        if let Some(why) = wire::paths::problem(path) {
            return Err(ApiError::new(ErrorCode::InvalidPath, format!("path {path:?}: {why}")));
        }
    }
    crate::quotas::call(s, caller)?;
    let r = live_active(s, caller, id, Access::Owner, 0).await?;
    let body = serde_json::to_vec(&op).map_err(|e| ApiError::internal(format!("encode a file operation: {e}")))?;
    let url = format!("/internal/v1/sandboxes/{}/fs", r.sandbox);
    let req = NodeRequest::new(Method::POST, url, FILE_TIMEOUT).fence(r.fence).body(body.into(), "application/json");
    s.nodes.call(&r.node, req).await
}

/// `?recursive=true` of a removal.
#[derive(Debug, Default, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct RemoveParams {
    /// Remove a directory with everything in it (without: only an empty one).
    #[serde(default)]
    pub recursive: bool,
}

/// Whether a path names anything in the sandbox (a symbolic link is not followed).
#[utoipa::path(get, path = "/v1/sessions/{id}/exists/{*path}", tag = "files", operation_id = "path_exists", summary = "Whether a path exists", params(("id" = String, Path, description = "The session id (names its node)."), ("path" = String, Path, description = "Relative to the workdir (`exists/src/a.py`), or absolute (`exists//tmp/x`); `..` is refused.")), responses((status = 200, description = "Whether something is there and what (`exists: false` when nothing is: a 404 is only ever the session's).", body = wire::PathExists)))]
pub(crate) async fn path_exists(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let answer = fs_op(&s, &caller, &id, wire::internal::FsOp::Exists { path }).await?;
    Ok(with_type(answer, "application/json"))
}

/// Removes a file, a symbolic link (not its target) or a directory.
#[utoipa::path(delete, path = "/v1/sessions/{id}/files/{*path}", tag = "files", operation_id = "remove_file", summary = "Remove a file or directory", params(("id" = String, Path, description = "The session id (names its node)."), ("path" = String, Path, description = "Relative to the workdir, or absolute (`files//tmp/x`); `..` and `/` are refused."), RemoveParams), responses((status = 204, description = "Removed. Nothing there is `not_found`; a directory that is not empty without `recursive=true` is `conflict`.")))]
pub(crate) async fn remove_file(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, path)): Path<(String, String)>,
    axum::extract::Query(q): axum::extract::Query<RemoveParams>,
) -> Result<StatusCode, ApiError> {
    fs_op(&s, &caller, &id, wire::internal::FsOp::Remove { path, recursive: q.recursive }).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Renames (moves) a file, link or directory within the sandbox; never over something.
#[utoipa::path(post, path = "/v1/sessions/{id}/files:rename", tag = "files", operation_id = "rename_file", summary = "Rename a file or directory", params(("id" = String, Path, description = "The session id (names its node).")), request_body = wire::RenameRequest, responses((status = 204, description = "Renamed. A missing `from` (or `to`'s directory) is `not_found`; a `to` that exists is `conflict`.")))]
pub(crate) async fn rename_file(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    let Json(req): Json<wire::RenameRequest> = parse_json(&body)?;
    fs_op(&s, &caller, &id, wire::internal::FsOp::Rename { from: req.from, to: req.to }).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Makes a directory and its parents (`mkdir -p`), as the sandbox's user.
#[utoipa::path(post, path = "/v1/sessions/{id}/dirs/{*path}", tag = "files", operation_id = "make_dir", summary = "Make a directory", params(("id" = String, Path, description = "The session id (names its node)."), ("path" = String, Path, description = "Relative to the workdir, or absolute (`dirs//tmp/x`); `..` is refused.")), responses((status = 204, description = "The directory is there (made, or there already). A file in its place (or in a parent's) is `conflict`.")))]
pub(crate) async fn make_dir(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    fs_op(&s, &caller, &id, wire::internal::FsOp::MakeDir { path }).await?;
    Ok(StatusCode::NO_CONTENT)
}

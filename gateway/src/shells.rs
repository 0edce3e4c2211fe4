//! Persistent shells of a session (`/v1/sessions/{id}/shells`), routed to the node its id
//! names; the node keeps the shells (see `pool_manager::shells`). Requests are checked here,
//! then forwarded as received and answered with the node's bytes.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_util::ApiError;
use ledger::Access;
use wire::shells::{CreateShell, ShellRun, name_problem};

use crate::calls::parse_json;
use crate::lookup::live_active;
use crate::nodes::NodeRequest;
use crate::{AppState, Caller};

/// Calls that do not run a command (open, list, close, interrupt).
const SHELL_CALL: Duration = Duration::from_secs(30);
/// Beyond a run's own timeout: the interrupt's steps (SIGINT, SIGKILL of the command, of the
/// shell) take a few seconds each.
const RUN_GRACE: Duration = Duration::from_secs(30);

fn json(bytes: Bytes, status: StatusCode) -> Response {
    let mut resp = (status, bytes).into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn checked(name: &str) -> Result<&str, ApiError> {
    match name_problem(name) {
        None => Ok(name),
        Some(p) => Err(ApiError::bad_request(format!("shell name {name:?}: {p}"))),
    }
}

/// Calls the session's node at `/internal/v1/sandboxes/{sandbox}/shells{rest}`; `run_ms`: a
/// run's timeout (the session is busy that long), 0 for the other calls.
async fn forward(
    s: &AppState,
    caller: &Caller,
    id: &str,
    method: Method,
    rest: &str,
    body: Option<Bytes>,
    run_ms: u64,
) -> Result<Bytes, ApiError> {
    let timeout = if run_ms > 0 { Duration::from_millis(run_ms) + RUN_GRACE } else { SHELL_CALL };
    crate::quotas::call(s, caller)?;
    let r = live_active(s, caller, id, Access::Owner, run_ms).await?;
    let path = format!("/internal/v1/sandboxes/{}/shells{rest}", r.sandbox);
    let mut call = NodeRequest::new(method, path, timeout).fence(r.fence);
    if let Some(b) = body {
        call = call.body(b, "application/json");
    }
    s.nodes.call(&r.node, call).await
}

#[utoipa::path(post, path = "/v1/sessions/{id}/shells", tag = "shells", operation_id = "open_shell", summary = "Open a persistent shell", params(("id" = String, Path, description = "The session id (names its node).")), request_body = wire::shells::CreateShell, responses((status = 201, description = "The new persistent shell.", body = wire::shells::ShellInfo)))]
pub(crate) async fn open(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CreateShell = parse_json(&body)?.0;
    if let Some(n) = &req.name {
        checked(n)?;
    }
    let answer = forward(&s, &caller, &id, Method::POST, "", Some(body), 0).await?;
    Ok(json(answer, StatusCode::CREATED))
}

#[utoipa::path(get, path = "/v1/sessions/{id}/shells", tag = "shells", operation_id = "list_shells", summary = "List persistent shells", params(("id" = String, Path, description = "The session id (names its node).")), responses((status = 200, description = "The session's shells.", body = wire::shells::ShellList)))]
pub(crate) async fn list(
    caller: Caller,
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(json(forward(&s, &caller, &id, Method::GET, "", None, 0).await?, StatusCode::OK))
}

#[utoipa::path(delete, path = "/v1/sessions/{id}/shells/{name}", tag = "shells", operation_id = "close_shell", summary = "Close a persistent shell", params(("id" = String, Path, description = "The session id (names its node)."), ("name" = String, Path, description = "The shell's name.")), responses((status = 204, description = "Closed; its processes are killed.")))]
pub(crate) async fn close(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let rest = format!("/{}", checked(&name)?);
    forward(&s, &caller, &id, Method::DELETE, &rest, None, 0).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sessions/{id}/shells/{name}/run", tag = "shells", operation_id = "run_in_shell", summary = "Run a command in a persistent shell", params(("id" = String, Path, description = "The session id (names its node)."), ("name" = String, Path, description = "The shell's name.")), request_body = wire::shells::ShellRun, responses((status = 200, description = "The command's combined output, exit code and the shell's working directory after it.", body = wire::shells::ShellResult)))]
pub(crate) async fn run(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ShellRun = parse_json(&body)?.0;
    let timeout_ms = req.checked_timeout_ms().map_err(ApiError::bad_request)?;
    let rest = format!("/{}/run", checked(&name)?);
    let answer = forward(&s, &caller, &id, Method::POST, &rest, Some(body), timeout_ms).await?;
    Ok(json(answer, StatusCode::OK))
}

#[utoipa::path(post, path = "/v1/sessions/{id}/shells/{name}/interrupt", tag = "shells", operation_id = "interrupt_shell", summary = "Interrupt the command running in a shell", params(("id" = String, Path, description = "The session id (names its node)."), ("name" = String, Path, description = "The shell's name.")), responses((status = 204, description = "The running command (if any) got SIGINT.")))]
pub(crate) async fn interrupt(
    caller: Caller,
    State(s): State<AppState>,
    Path((id, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let rest = format!("/{}/interrupt", checked(&name)?);
    forward(&s, &caller, &id, Method::POST, &rest, None, 0).await?;
    Ok(StatusCode::NO_CONTENT)
}

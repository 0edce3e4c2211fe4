//! The pool-manager's internal HTTP API. Only gateways call it, with the shared secret.

use std::sync::Arc;
use std::time::{Duration, Instant};

use agent_proto::{ExecSpec, ReadSpec, WriteSpec, codes};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use config::User;
use http_util::{ApiError, Json};
use telemetry::metrics::{http_layer, template_label};
use telemetry::names;
use wire::internal::{FENCE_HEADER, PrivateTemplate, SECRET_HEADER, SnapshotRequest};
use wire::shells::{CreateShell, ShellInfo, ShellList, ShellResult, ShellRun};
use wire::{DirListing, Encoding, ErrorCode, ExecRequest, ExecResponse, GoneReason, b64_decode, b64_encode};

use crate::channel::AgentError;
use crate::docker::{DockerExec, FileError};
use crate::node::{Node, Sandbox};

/// Extra time past a command's own timeout before the call itself gives up (agent wedged).
const EXEC_GRACE: Duration = Duration::from_secs(10);
const FILE_TIMEOUT: Duration = Duration::from_secs(120);
/// Retry-After when the node's Docker does not answer (a dockerd restart takes seconds).
const DOCKER_RETRY_AFTER_S: u64 = 5;

pub fn app(node: Arc<Node>) -> Router {
    let body_limit = (node.config.gateway.max_body_bytes as usize).saturating_add(1 << 20);
    Router::new()
        .route("/internal/v1/healthz", get(|| async { StatusCode::NO_CONTENT }))
        .route("/internal/v1/sandboxes/{sandbox}", delete(destroy))
        .route("/internal/v1/sandboxes/{sandbox}/exec", post(exec))
        .route("/internal/v1/sandboxes/{sandbox}/invoke", post(invoke))
        .route("/internal/v1/sandboxes/{sandbox}/ws", get(crate::stream::upgrade))
        .route("/internal/v1/sandboxes/{sandbox}/ports/{port}", get(crate::ports::upgrade))
        .route(
            "/internal/v1/sandboxes/{sandbox}/pause",
            post(|State(n): State<Arc<Node>>, Path(id): Path<String>, h: HeaderMap| set_paused(n, id, h, true)),
        )
        .route(
            "/internal/v1/sandboxes/{sandbox}/resume",
            post(|State(n): State<Arc<Node>>, Path(id): Path<String>, h: HeaderMap| set_paused(n, id, h, false)),
        )
        .route("/internal/v1/sandboxes/{sandbox}/snapshot", post(snapshot))
        .route("/internal/v1/sandboxes/{sandbox}/egress", put(switch_egress))
        .route("/internal/v1/sandboxes/{sandbox}/cpu", get(sandbox_cpu))
        .route("/internal/v1/sandboxes/{sandbox}/shells", post(shell_open).get(shell_list))
        .route("/internal/v1/sandboxes/{sandbox}/shells/{name}", delete(shell_close))
        .route("/internal/v1/sandboxes/{sandbox}/shells/{name}/run", post(shell_run))
        .route("/internal/v1/sandboxes/{sandbox}/shells/{name}/interrupt", post(shell_interrupt))
        .route("/internal/v1/templates/{name}", delete(forget_template))
        .route("/internal/v1/images:resolve", post(resolve_image))
        .route("/internal/v1/images:pull", post(pull_images))
        .route("/internal/v1/sandboxes/{sandbox}/files/{*path}", get(read_file).put(write_file))
        .route("/internal/v1/sandboxes/{sandbox}/dirs/{*path}", get(list_dir))
        .route("/internal/v1/sandboxes/{sandbox}/fs", post(fs_op))
        .route(
            "/internal/v1/sandboxes/{sandbox}/dirs",
            get(|n: State<Arc<Node>>, Path(id): Path<String>, h: HeaderMap| list_dir(n, Path((id, ".".into())), h)),
        )
        .fallback(http_util::fallback_not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn_with_state(node.clone(), require_secret))
        .layer(middleware::from_fn(traced))
        .layer(http_layer("pool_manager"))
        .with_state(node)
}

/// One server span per call (but the health probe), the child of the caller's W3C
/// `traceparent`, so a gateway request's trace continues here; handled under the gateway's
/// request id (`x-request-id`), which a 5xx answer from here then quotes.
async fn traced(req: Request, next: Next) -> Response {
    use tracing::Instrument as _;
    let id = http_util::incoming_request_id(req.headers()).unwrap_or_else(http_util::request_id);
    let route = req.extensions().get::<MatchedPath>().map(|m| m.as_str().to_string());
    let route = route.as_deref().unwrap_or("unmatched").to_string();
    if route == "/internal/v1/healthz" {
        return http_util::with_request_id(id, next.run(req)).await;
    }
    let method = req.method().clone();
    let sandbox = http_util::path_param(&route, req.uri().path(), "{sandbox}");
    let span = tracing::info_span!(
        "pool_manager.request",
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
        request_id = %id,
        sandbox = sandbox.as_deref(),
    );
    telemetry::trace::set_parent(&span, req.headers());
    let unanswered = http_util::Unanswered::new(&method, &route, &id);
    let resp = http_util::with_request_id(id, next.run(req)).instrument(span.clone()).await;
    unanswered.answered();
    span.record("http.response.status_code", resp.status().as_u16());
    if resp.status().is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    resp
}

async fn require_secret(State(node): State<Arc<Node>>, req: Request, next: Next) -> Response {
    let ok = req
        .headers()
        .get(SECRET_HEADER)
        .is_some_and(|v| constant_time_eq(v.as_bytes(), node.config.pool_manager.secret.as_bytes()));
    if !ok {
        return ApiError::unauthorized("internal API: bad or missing secret").into_response();
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn owned(node: &Node, id: &str) -> Result<Arc<Sandbox>, ApiError> {
    node.sandbox(id).ok_or_else(|| {
        ApiError::new(ErrorCode::SandboxFailed, format!("sandbox {id} is gone (it failed or was destroyed)"))
    })
}

fn fence(headers: &HeaderMap) -> Result<u64, ApiError> {
    headers
        .get(FENCE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| ApiError::bad_request(format!("missing or bad {FENCE_HEADER} header")))
}

fn admit(sb: &Sandbox, fence: u64) -> Result<(), ApiError> {
    if sb.admit(fence) { Ok(()) } else { Err(stale()) }
}

fn stale() -> ApiError {
    ApiError::new(ErrorCode::StaleFence, "this lease was superseded by a newer grant of the sandbox")
}

async fn destroy(State(node): State<Arc<Node>>, Path(id): Path<String>) -> StatusCode {
    node.destroy(&id, GoneReason::Deleted).await;
    StatusCode::NO_CONTENT
}

async fn set_paused(node: Arc<Node>, id: String, headers: HeaderMap, pause: bool) -> Result<StatusCode, ApiError> {
    let (sb, _) = admit_call(&node, &id, &headers)?;
    freeze(&node, &sb, pause).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Freezes or thaws a sandbox's container, and remembers which.
async fn freeze(node: &Node, sb: &Sandbox, pause: bool) -> Result<(), ApiError> {
    node.dock.set_paused(&sb.container, pause).await.map_err(|e| {
        if crate::docker::Unreachable::is(&e) {
            tracing::warn!(sandbox = %sb.id, error = %e, "pause or resume: docker is not answering");
            ApiError::unavailable("the node's container engine is not answering; retry", DOCKER_RETRY_AFTER_S)
        } else {
            ApiError::bad_gateway(format!("sandbox {} could not be paused or resumed", sb.id), format!("{e:#}"))
        }
    })?;
    sb.paused.store(pause, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Switches the sandbox's egress policy (the gateway has checked that its template allows it).
async fn switch_egress(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(req): Json<wire::EgressRequest>,
) -> Result<StatusCode, ApiError> {
    let (sb, _) = admit_call(&node, &id, &headers)?;
    let allowed = sb.template.egress.as_ref().is_some_and(|e| e.allowed.contains(&req.policy));
    if !allowed {
        // The gateway checks first; this is the node's own guard.
        return Err(ApiError::bad_request(format!(
            "the template of {id} does not allow egress policy {:?}",
            req.policy
        )));
    }
    node.switch_egress(&sb, &req.policy).await.map_err(|e| match e.downcast_ref() {
        Some(crate::egress::SwitchError::NoPolicy(name)) => ApiError::new(
            ErrorCode::Conflict,
            format!("no egress policy named {name:?} (yet): an admin defines it with PUT /v1/egress/policies/{{name}}"),
        ),
        _ => ApiError::bad_gateway(format!("egress of {id} could not be switched"), format!("{e:#}")),
    })?;
    Ok(StatusCode::NO_CONTENT)
}

/// The sandbox's CPU use and throttling so far, from its cgroup (`GET /v1/sessions/{id}`).
async fn sandbox_cpu(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<wire::internal::SandboxCpu>, ApiError> {
    let (sb, _) = admit_call(&node, &id, &headers)?;
    let cpu = node
        .cpu_use(&sb)
        .await
        .map_err(|e| ApiError::bad_gateway(format!("the CPU use of {id} could not be read"), format!("{e:#}")))?;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    Ok(Json(wire::internal::SandboxCpu { cpu_ms: ms(cpu.used), cpu_throttled_ms: ms(cpu.throttled) }))
}

/// A reference pinned to its registry's digest now: 400 `image_not_found` when the registry
/// has no such image, 502 `image_pull_failed` (with the registry's words) when it fails.
async fn resolve_image(
    State(node): State<Arc<Node>>,
    Json(req): Json<wire::internal::ResolveImage>,
) -> Result<Json<wire::internal::ResolvedImage>, ApiError> {
    use crate::docker::RegistryError;
    wire::images::valid_reference(&req.image).map_err(|e| ApiError::bad_request(format!("image: {e}")))?;
    let auth = node.config.images.auth_for(&req.image, req.principal.as_deref());
    match node.dock.resolve(&req.image, auth).await {
        Ok(image) => Ok(Json(wire::internal::ResolvedImage { image })),
        Err(RegistryError::NotFound(why)) => {
            // The same answer as an image the tenant may not name (the gateway's): the
            // registry's own words stay in the node's log.
            tracing::info!(image = %req.image, %why, "not in its registry");
            Err(ApiError::new(wire::ErrorCode::ImageNotFound, wire::images::not_found_message(&req.image)))
        }
        Err(RegistryError::Failed(why)) => Err(ApiError {
            retry_after_s: Some(5),
            ..ApiError::new(
                wire::ErrorCode::ImagePullFailed,
                format!("image: the registry of {:?} could not be asked: {why}", req.image),
            )
        }),
    }
}

/// Starts pulling images in the background; each one's state now.
async fn pull_images(
    State(node): State<Arc<Node>>,
    Json(req): Json<wire::internal::PullImages>,
) -> Result<Json<wire::internal::PullStates>, ApiError> {
    if let Some(bad) = req.images.iter().find(|i| !crate::images::is_pulled(i)) {
        return Err(ApiError::bad_request(format!("images: {bad:?} is not pinned to a digest")));
    }
    Ok(Json(wire::internal::PullStates { images: req.images.iter().map(|i| node.images.prefetch(i)).collect() }))
}

async fn snapshot(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(req): Json<SnapshotRequest>,
) -> Result<Json<PrivateTemplate>, ApiError> {
    let (sb, _) = admit_call(&node, &id, &headers)?;
    let t = node
        .snapshot(&sb, &req.tenant, req.id.as_deref())
        .await
        .map_err(|e| ApiError::bad_gateway(format!("snapshot of {id} failed"), format!("{e:#}")))?;
    Ok(Json(t))
}

/// The agent of an agent-mode sandbox; shells need one.
fn shell_agent(sb: &Sandbox) -> Result<crate::channel::AgentConn, ApiError> {
    sb.agent.clone().ok_or_else(|| {
        ApiError::bad_request(format!(
            "template {:?} runs docker exec; persistent shells need exec = \"agent\"",
            sb.template.name
        ))
    })
}

async fn shell_open(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(req): Json<CreateShell>,
) -> Result<(StatusCode, Json<ShellInfo>), ApiError> {
    let (sb, fence) = admit_live_call(&node, &id, &headers).await?;
    let agent = shell_agent(&sb)?;
    let cwd = match &req.cwd {
        Some(c) => resolve_path(&sb.template.workdir, c)?,
        None => String::new(),
    };
    let info = sb.shells.open(&agent, fence, req, cwd).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

async fn shell_list(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<ShellList>, ApiError> {
    let (sb, _) = admit_call(&node, &id, &headers)?;
    Ok(Json(ShellList { shells: sb.shells.list() }))
}

async fn shell_close(
    State(node): State<Arc<Node>>,
    Path((id, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let (sb, _) = admit_live_call(&node, &id, &headers).await?;
    sb.shells.close(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn shell_run(
    State(node): State<Arc<Node>>,
    Path((id, name)): Path<(String, String)>,
    headers: HeaderMap,
    Json(req): Json<ShellRun>,
) -> Result<Json<ShellResult>, ApiError> {
    let (sb, fence) = admit_live_call(&node, &id, &headers).await?;
    let agent = shell_agent(&sb)?;
    let shell = sb.shells.get(&name)?;
    let max_output = node.config.pool_manager.max_output_bytes;
    Ok(Json(shell.run(&agent, fence, req, max_output, None).await?))
}

async fn shell_interrupt(
    State(node): State<Arc<Node>>,
    Path((id, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let (sb, _) = admit_live_call(&node, &id, &headers).await?;
    sb.shells.get(&name)?.interrupt().await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A private template was deleted: prune its image now if nothing uses it (else later).
async fn forget_template(State(node): State<Arc<Node>>, Path(_name): Path<String>) -> StatusCode {
    if let Err(e) = node.prune_snapshots().await {
        tracing::warn!(error = %e, "prune snapshot images");
    }
    StatusCode::NO_CONTENT
}

/// Resolves a request path against the sandbox's working dir. Refuses `..` (no escaping,
/// even lexically) and NUL; `.` and empty segments are dropped.
pub fn resolve_path(workdir: &str, raw: &str) -> Result<String, ApiError> {
    let invalid = |why: &str| ApiError::new(ErrorCode::InvalidPath, format!("path {raw:?}: {why}"));
    if let Some(why) = wire::paths::problem(raw) {
        return Err(invalid(why));
    }
    let mut parts: Vec<&str> = if raw.starts_with('/') { Vec::new() } else { workdir.split('/').collect() };
    for seg in raw.split('/') {
        match seg {
            "" | "." => {}
            s => parts.push(s),
        }
    }
    let parts: Vec<&str> = parts.into_iter().filter(|s| !s.is_empty()).collect();
    if parts.is_empty() {
        return Ok("/".into());
    }
    Ok(format!("/{}", parts.join("/")))
}

fn encode_out(bytes: Vec<u8>, enc: Encoding) -> String {
    match enc {
        Encoding::Utf8 => {
            String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
        }
        Encoding::Base64 => b64_encode(&bytes),
    }
}

/// `Retry-After` of a call the sandbox had no process for: reaping a fork bomb's thousands of
/// processes takes about a second.
const BUSY_RETRY_S: u64 = 1;

pub(crate) fn agent_error(sb: &Sandbox, e: AgentError) -> ApiError {
    match e {
        AgentError::Closed => {
            ApiError::new(ErrorCode::SandboxFailed, format!("sandbox {} failed: its agent is gone", sb.id))
        }
        AgentError::Timeout => ApiError::gateway_timeout(format!("sandbox {} did not answer in time", sb.id)),
        AgentError::TooLarge(m) => ApiError::new(ErrorCode::PayloadTooLarge, format!("request too large: {m}")),
        AgentError::Upload(m) => ApiError::bad_request(format!("the upload broke off: {m}")),
        AgentError::Protocol(m) => ApiError::bad_gateway(format!("sandbox {} answered badly", sb.id), m),
        AgentError::Remote(info) => match info.code.as_str() {
            codes::STALE_FENCE => stale(),
            codes::NOT_FOUND => ApiError::not_found(info.message),
            codes::IS_DIRECTORY => ApiError::new(ErrorCode::IsDirectory, info.message),
            codes::NOT_EMPTY | codes::EXISTS => ApiError::new(ErrorCode::Conflict, info.message),
            codes::TOO_LARGE => ApiError::new(ErrorCode::PayloadTooLarge, info.message),
            codes::BAD_REQUEST | codes::PERMISSION_DENIED | codes::IO => ApiError::bad_request(info.message),
            // The tenant's own processes fill the sandbox (or are still being reaped): retry.
            codes::BUSY => {
                let mut e = ApiError::new(ErrorCode::SandboxBusy, format!("sandbox {}: {}", sb.id, info.message));
                e.retry_after_s = Some(BUSY_RETRY_S);
                e
            }
            // A code this side does not know: the agent's words go to the log only.
            _ => ApiError::bad_gateway(
                format!("sandbox {} failed the call", sb.id),
                format!("{}: {}", info.code, info.message),
            ),
        },
    }
}

/// One invocation of a function in its environment: the body is the `InvokeSpec` as one JSON
/// line, then the payload; the answer is an `InvokeAnswer` line, then the result.
async fn invoke(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (sb, fence) = admit_live_call(&node, &id, &headers).await?;
    let nl = body.iter().position(|&b| b == b'\n').ok_or_else(|| ApiError::bad_request("no invocation spec"))?;
    let spec: wire::internal::InvokeSpec =
        serde_json::from_slice(&body[..nl]).map_err(|e| ApiError::bad_request(format!("invocation spec: {e}")))?;
    if spec.handler.first().is_none_or(|a| a.is_empty()) {
        return Err(ApiError::bad_request("handler: must not be empty"));
    }
    if spec.timeout_ms == 0 || spec.timeout_ms > config::MAX_EXEC_TIMEOUT.as_millis() as u64 {
        return Err(ApiError::bad_request("timeout_ms: out of range"));
    }
    let Some(agent) = &sb.agent else {
        return Err(ApiError::bad_request("functions need an agent-mode template"));
    };
    let payload = body.slice(nl + 1..);
    let answer = crate::functions::invoke(&sb.runtime, agent, fence, &spec, payload).await?;
    let head = wire::internal::InvokeAnswer {
        outcome: answer.outcome,
        cold_worker: answer.cold,
        duration_ms: answer.duration.as_secs_f64() * 1000.0,
    };
    let mut out = serde_json::to_vec(&head).map_err(|e| ApiError::internal(format!("encode: {e}")))?;
    out.push(b'\n');
    out.extend_from_slice(&answer.body);
    Ok(out.into_response())
}

async fn exec(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(req): Json<ExecRequest>,
) -> Result<Json<ExecResponse>, ApiError> {
    let (sb, fence) = admit_live_call(&node, &id, &headers).await?;
    let argv = req.cmd.to_argv();
    if argv.is_empty() || argv[0].is_empty() {
        return Err(ApiError::bad_request("cmd: must not be empty"));
    }
    let stdin = match (&req.stdin, req.encoding) {
        (None, _) => None,
        (Some(s), Encoding::Utf8) => Some(Bytes::from(s.clone().into_bytes())),
        (Some(s), Encoding::Base64) => {
            Some(Bytes::from(b64_decode(s).map_err(|e| ApiError::bad_request(format!("stdin: bad base64: {e}")))?))
        }
    };
    let timeout = Duration::from_millis(req.timeout_ms.unwrap_or(config::DEFAULT_EXEC_TIMEOUT.as_millis() as u64));
    if timeout.is_zero() || timeout > config::MAX_EXEC_TIMEOUT {
        return Err(ApiError::bad_request(format!(
            "timeout_ms: must be 1 ..= {}",
            config::MAX_EXEC_TIMEOUT.as_millis()
        )));
    }
    let cwd = match &req.cwd {
        Some(c) => resolve_path(&sb.template.workdir, c)?,
        None => String::new(),
    };
    for k in req.env.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(ApiError::bad_request(format!("env: {k:?} is not a valid variable name")));
        }
    }
    let max_output = node.config.pool_manager.max_output_bytes;
    let started = Instant::now();
    // An async block, so every way out (`?`, `return Err`) passes the exec metric below.
    let resp: Result<ExecResponse, ApiError> = async {
        Ok(match &sb.agent {
            Some(agent) => {
                let spec = ExecSpec {
                    fence,
                    has_stdin: stdin.is_some(),
                    argv,
                    env: req.env.clone().into_iter().collect(),
                    cwd,
                    timeout_ms: timeout.as_millis() as u64,
                    max_output,
                    pty_rows: 0,
                    pty_cols: 0,
                };
                match agent.exec(spec, stdin, timeout + EXEC_GRACE).await {
                    Ok(out) => ExecResponse {
                        exit_code: out.exit.exit_code,
                        stdout: encode_out(out.stdout, req.encoding),
                        stderr: encode_out(out.stderr, req.encoding),
                        encoding: req.encoding,
                        duration_ms: out.exit.duration_us as f64 / 1000.0,
                        timed_out: out.exit.timed_out,
                        stdout_truncated: out.exit.stdout_truncated,
                        stderr_truncated: out.exit.stderr_truncated,
                    },
                    Err(AgentError::Remote(info))
                        if info.code == codes::NOT_FOUND || info.code == codes::PERMISSION_DENIED =>
                    {
                        // Like a shell: a command that cannot be found or run is an exit status.
                        let code = if info.code == codes::NOT_FOUND { 127 } else { 126 };
                        ExecResponse {
                            exit_code: code,
                            stdout: String::new(),
                            stderr: encode_out(format!("{}\n", info.message).into_bytes(), req.encoding),
                            encoding: req.encoding,
                            duration_ms: started.elapsed().as_secs_f64() * 1000.0,
                            timed_out: false,
                            stdout_truncated: false,
                            stderr_truncated: false,
                        }
                    }
                    Err(e) => return Err(agent_error(&sb, e)),
                }
            }
            None => {
                let out = node
                    .dock
                    .exec(
                        &sb.container,
                        DockerExec {
                            argv,
                            user: match sb.template.user {
                                User::Root => None,
                                user => Some(user.spec()),
                            },
                            env: req.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
                            cwd: (!cwd.is_empty()).then_some(cwd),
                            stdin,
                            timeout,
                            max_output: max_output as usize,
                        },
                    )
                    .await
                    .map_err(|e| ApiError::bad_gateway(format!("sandbox {}: exec failed", sb.id), format!("{e:#}")))?;
                ExecResponse {
                    exit_code: out.exit_code,
                    stdout: encode_out(out.stdout, req.encoding),
                    stderr: encode_out(out.stderr, req.encoding),
                    encoding: req.encoding,
                    duration_ms: started.elapsed().as_secs_f64() * 1000.0,
                    timed_out: out.timed_out,
                    stdout_truncated: out.stdout_truncated,
                    stderr_truncated: out.stderr_truncated,
                }
            }
        })
    }
    .await;
    let outcome = match &resp {
        Ok(r) if r.timed_out => "timeout",
        Ok(_) => "exit",
        Err(_) => "error",
    };
    metrics::histogram!(names::EXEC_DURATION, "template" => template_label(&sb.template.name).to_owned(),
        "outcome" => outcome)
    .record(started.elapsed().as_secs_f64());
    Ok(Json(resp?))
}

fn file_error(path: &str, e: FileError) -> ApiError {
    match e {
        FileError::NotFound => ApiError::not_found(format!("{path}: no such file or directory")),
        FileError::TooLarge => ApiError::new(ErrorCode::PayloadTooLarge, format!("{path}: file too large")),
        FileError::IsDirectory(m) => ApiError::new(ErrorCode::IsDirectory, format!("{path}: {m}")),
        FileError::Refused(m) => ApiError::bad_request(format!("{path}: {m}")),
        FileError::Other(m) => ApiError::bad_gateway(format!("{path}: the sandbox failed the file call"), m),
    }
}

/// `admit_call` for a call that the sandbox itself must answer (its agent, or a docker exec):
/// a sandbox this node froze is thawed first. The gateway resumes a session it knows is paused
/// before it calls; a sandbox frozen while the ledger says it runs (a pause whose record was
/// lost with a Redis master) would otherwise make every call wait out its deadline.
pub(crate) async fn admit_live_call(
    node: &Node,
    id: &str,
    headers: &HeaderMap,
) -> Result<(Arc<Sandbox>, u64), ApiError> {
    let (sb, fence) = admit_call(node, id, headers)?;
    if sb.paused.load(std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(sandbox = %id, "a call to a sandbox the ledger does not know is paused: thawed first");
        freeze(node, &sb, false).await?;
    }
    Ok((sb, fence))
}

/// The sandbox a call names and the caller's fence, once the fence is admitted.
pub(crate) fn admit_call(node: &Node, id: &str, headers: &HeaderMap) -> Result<(Arc<Sandbox>, u64), ApiError> {
    let sb = owned(node, id)?;
    let fence = fence(headers)?;
    admit(&sb, fence)?;
    Ok((sb, fence))
}

/// The sandbox, admitted fence and resolved path of a file call.
async fn file_call(
    node: &Node,
    id: &str,
    raw: &str,
    headers: &HeaderMap,
) -> Result<(Arc<Sandbox>, u64, String), ApiError> {
    let (sb, fence) = admit_live_call(node, id, headers).await?;
    let path = resolve_path(&sb.template.workdir, raw)?;
    Ok((sb, fence, path))
}

/// A file, or a directory as tar, streamed: the agent sends as fast as the client takes it (a
/// read with credit), never more than the template's `max_download_mb` (a directory is sized
/// before its first byte: over the limit is 413 with nothing sent). A docker-exec template's
/// read is collected, so it is bounded by the body limit too.
async fn read_file(
    State(node): State<Arc<Node>>,
    Path((id, raw)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let (sb, fence, path) = file_call(&node, &id, &raw, &headers).await?;
    let max_bytes = sb.template.max_download_mb << 20;
    let octets = [(axum::http::header::CONTENT_TYPE, "application/octet-stream")];
    let Some(agent) = &sb.agent else {
        let cap = max_bytes.min(node.config.gateway.max_body_bytes);
        let data = docker_read(&node, &sb, &path, cap).await.map_err(|e| file_error(&path, e))?;
        return Ok((octets, data).into_response());
    };
    let mut stream = agent
        .read_stream(ReadSpec { fence, path, max_bytes, ..Default::default() })
        .await
        .map_err(|e| agent_error(&sb, e))?;
    // The first chunk (or the refusal) before the status goes out.
    let first = match tokio::time::timeout(FILE_TIMEOUT, stream.next()).await {
        Err(_) => return Err(agent_error(&sb, AgentError::Timeout)),
        Ok(Some(Err(e))) => return Err(agent_error(&sb, e)),
        Ok(first) => first,
    };
    let rest = futures::stream::unfold(stream, |mut stream| async move {
        let next = match tokio::time::timeout(FILE_TIMEOUT, stream.next()).await {
            Ok(next) => next?,
            Err(_) => Err(AgentError::Timeout),
        };
        // An error now can only break the answer off: the client sees it cut short.
        Some((next.map_err(std::io::Error::other), stream))
    });
    let first = futures::stream::iter(first.map(|r| r.map_err(std::io::Error::other)));
    Ok((octets, axum::body::Body::from_stream(futures::StreamExt::chain(first, rest))).into_response())
}

/// A directory's entries: from the agent's listing, or (a docker-exec template, or an agent
/// older than version 4) from the directory's tar, whose size the body limit bounds.
async fn list_dir(
    State(node): State<Arc<Node>>,
    Path((id, raw)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<DirListing>, ApiError> {
    let (sb, fence, path) = file_call(&node, &id, &raw, &headers).await?;
    let max_bytes = node.config.gateway.max_body_bytes;
    let listing = match &sb.agent {
        Some(agent) if agent.version() >= 4 => {
            let spec = ReadSpec { fence, path: path.clone(), max_bytes, list: true, credit: 0 };
            let bytes = agent.read_file(spec, FILE_TIMEOUT).await.map_err(|e| agent_error(&sb, e))?;
            agent_proto::Listing::decode(&bytes)
                .map_err(|e| ApiError::bad_gateway(format!("sandbox {} answered badly", sb.id), e.to_string()))?
        }
        Some(agent) => {
            let spec = ReadSpec { fence, path: path.clone(), max_bytes, list: false, credit: 0 };
            let tar = agent.read_file(spec, FILE_TIMEOUT).await.map_err(|e| agent_error(&sb, e))?;
            crate::listing::from_tar(&tar, false).map_err(|e| not_a_dir(&path, e))?
        }
        None => {
            let tar = docker_read(&node, &sb, &path, max_bytes).await.map_err(|e| file_error(&path, e))?;
            // Docker's archive puts the directory's own name first; `tar -C dir .` does not.
            let prefixed = sb.template.user == User::Root;
            crate::listing::from_tar(&tar, prefixed).map_err(|e| not_a_dir(&path, e))?
        }
    };
    Ok(Json(crate::listing::to_wire(path, listing)))
}

/// A docker-exec sandbox's file: by the archive API for a root template, else as its user.
async fn docker_read(node: &Node, sb: &Sandbox, path: &str, max_bytes: u64) -> Result<Vec<u8>, FileError> {
    match sb.template.user {
        User::Root => node.dock.download(&sb.container, path, max_bytes).await,
        user => node.dock.read_as(&sb.container, &user.spec(), path, max_bytes).await,
    }
}

fn not_a_dir(path: &str, why: String) -> ApiError {
    ApiError::bad_request(format!("{path}: {why}"))
}

/// Writes a file as its body arrives (at most the body limit): never held whole here.
async fn write_file(
    State(node): State<Arc<Node>>,
    Path((id, raw)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<StatusCode, ApiError> {
    let (sb, fence, path) = file_call(&node, &id, &raw, &headers).await?;
    if path == "/" {
        return Err(ApiError::new(ErrorCode::InvalidPath, "path: must name a file"));
    }
    let max_bytes = node.config.gateway.max_body_bytes;
    match &sb.agent {
        Some(agent) => {
            let spec = WriteSpec { fence, path, mode: 0o644 };
            let write = agent.write_stream(spec, body.into_data_stream(), max_bytes);
            tokio::time::timeout(FILE_TIMEOUT, write)
                .await
                .unwrap_or(Err(AgentError::Timeout))
                .map_err(|e| agent_error(&sb, e))?;
        }
        None => {
            let body = axum::body::to_bytes(body, max_bytes as usize).await.map_err(|_| {
                ApiError::new(ErrorCode::PayloadTooLarge, format!("the body is over {max_bytes} bytes"))
            })?;
            match sb.template.user {
                User::Root => node.dock.upload(&sb.container, &path, body).await,
                user => node.dock.write_as(&sb.container, &user.spec(), &path, body).await,
            }
            .map_err(|e| file_error(&path, e))?
        }
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Exists, remove, rename, make a directory: one agent request each (protocol version 6),
/// run as the sandbox's user. Paths resolve as every file call's do.
async fn fs_op(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    use agent_proto::{FsOpKind, FsOpSpec};
    use wire::internal::FsOp;
    let op: FsOp = serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("file operation: {e}")))?;
    let (sb, fence) = admit_live_call(&node, &id, &headers).await?;
    let workdir = &sb.template.workdir;
    let not_root = |path: String| {
        if path == "/" { Err(ApiError::new(ErrorCode::InvalidPath, "path: must not be /")) } else { Ok(path) }
    };
    let spec = match &op {
        FsOp::Exists { path } => {
            FsOpSpec { op: FsOpKind::Stat, path: resolve_path(workdir, path)?, ..Default::default() }
        }
        FsOp::Remove { path, recursive } => FsOpSpec {
            op: FsOpKind::Remove,
            path: not_root(resolve_path(workdir, path)?)?,
            recursive: *recursive,
            ..Default::default()
        },
        FsOp::Rename { from, to } => FsOpSpec {
            op: FsOpKind::Rename,
            path: not_root(resolve_path(workdir, from)?)?,
            to: not_root(resolve_path(workdir, to)?)?,
            ..Default::default()
        },
        FsOp::MakeDir { path } => {
            FsOpSpec { op: FsOpKind::MakeDir, path: resolve_path(workdir, path)?, ..Default::default() }
        }
    };
    let Some(agent) = &sb.agent else {
        return Err(ApiError::bad_request(format!(
            "template {:?} runs docker exec; exists, remove, rename and make_dir need exec = \"agent\"",
            sb.template.name
        )));
    };
    if agent.version() < 6 {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!("sandbox {}'s agent predates exists, remove, rename and make_dir; open a new session", sb.id),
        ));
    }
    let path = spec.path.clone();
    let answer = agent.fs_op(FsOpSpec { fence, ..spec }, FILE_TIMEOUT).await.map_err(|e| agent_error(&sb, e))?;
    if !matches!(op, FsOp::Exists { .. }) {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let kind = match answer.first() {
        Some(0) => None,
        Some(1) => Some(wire::EntryType::File),
        Some(2) => Some(wire::EntryType::Dir),
        Some(3) => Some(wire::EntryType::Symlink),
        Some(4) => Some(wire::EntryType::Other),
        _ => {
            return Err(ApiError::bad_gateway(
                format!("sandbox {} answered badly", sb.id),
                format!("stat: {answer:?}"),
            ));
        }
    };
    Ok(Json(wire::PathExists { path, exists: kind.is_some(), kind }).into_response())
}

#[cfg(test)]
mod tests {
    use super::resolve_path;

    #[test]
    fn paths_resolve_inside_and_never_climb() {
        assert_eq!(resolve_path("/work", "a/b.txt").unwrap(), "/work/a/b.txt");
        assert_eq!(resolve_path("/work", "/etc/hosts").unwrap(), "/etc/hosts");
        assert_eq!(resolve_path("/work", "./a//b/").unwrap(), "/work/a/b");
        assert_eq!(resolve_path("/", "x").unwrap(), "/x");
        for bad in ["../../etc/passwd", "a/../../b", "..", "a/\0b"] {
            assert!(resolve_path("/work", bad).is_err(), "{bad}");
        }
    }
}

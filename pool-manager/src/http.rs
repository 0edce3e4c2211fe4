//! The pool-manager's internal HTTP API. Only gateways call it, with the shared secret.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use http_util::{ApiError, Json};
use telemetry::metrics::{http_layer, template_label};
use telemetry::names;
use wire::internal::{PrivateTemplate, SECRET_HEADER, SnapshotRequest};
use wire::shells::{CreateShell, ShellInfo, ShellList, ShellResult, ShellRun};
use wire::{DirListing, Encoding, ErrorCode, ExecRequest, ExecResponse, GoneReason, b64_decode, b64_encode};

use crate::admit::{admit_call, admit_live_call, agent_error, freeze, resolve_path};
use crate::backend::{Exec, FILE_TIMEOUT};
use crate::node::Node;
use crate::sandbox::Sandbox;

pub(crate) fn app(node: Arc<Node>) -> Router {
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

async fn destroy(State(node): State<Arc<Node>>, Path(id): Path<String>) -> StatusCode {
    node.destroy(&id, GoneReason::Deleted).await;
    StatusCode::NO_CONTENT
}

async fn set_paused(node: Arc<Node>, id: String, headers: HeaderMap, pause: bool) -> Result<StatusCode, ApiError> {
    let (sb, _) = admit_call(&node, &id, &headers)?;
    freeze(&node, &sb, pause).await?;
    Ok(StatusCode::NO_CONTENT)
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
/// has no such image, 400 `invalid_request` for a lazy image from a registry the node does not
/// trust with lazy images, 502 `image_pull_failed` (with the registry's words) when it fails.
async fn resolve_image(
    State(node): State<Arc<Node>>,
    Json(req): Json<wire::internal::ResolveImage>,
) -> Result<Json<wire::internal::ResolvedImage>, ApiError> {
    use crate::runtime::RegistryError;
    wire::images::valid_reference(&req.image).map_err(|e| ApiError::bad_request(format!("image: {e}")))?;
    let auth = node.config.images.auth_for(&req.image, req.principal.as_deref());
    match node.engine.resolve(&req.image, auth).await {
        Ok(image) => match node.images.refusal(&image).await {
            Some(why) => Err(ApiError::bad_request(format!("image: {why}"))),
            None => Ok(Json(wire::internal::ResolvedImage { image })),
        },
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

fn encode_out(bytes: Vec<u8>, enc: Encoding) -> String {
    match enc {
        Encoding::Utf8 => {
            String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
        }
        Encoding::Base64 => b64_encode(&bytes),
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
    spec.checked_timeout_ms().map_err(ApiError::bad_request)?;
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
    let timeout = Duration::from_millis(req.checked_timeout_ms().map_err(ApiError::bad_request)?);
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
    let call = Exec { fence, argv, env: req.env.clone().into_iter().collect(), cwd, stdin, timeout, max_output };
    let resp: Result<ExecResponse, ApiError> = sb.backend.exec(call).await.map(|ran| ExecResponse {
        exit_code: ran.exit_code,
        stdout: encode_out(ran.stdout, req.encoding),
        stderr: encode_out(ran.stderr, req.encoding),
        encoding: req.encoding,
        duration_ms: ran.duration_ms.unwrap_or_else(|| started.elapsed().as_secs_f64() * 1000.0),
        timed_out: ran.timed_out,
        stdout_truncated: ran.stdout_truncated,
        stderr_truncated: ran.stderr_truncated,
    });
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

/// A file, or a directory as tar: at most the template's `max_download_mb` (streamed from an
/// agent; a docker-exec template's read is collected, so the body limit bounds it too).
async fn read_file(
    State(node): State<Arc<Node>>,
    Path((id, raw)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let (sb, fence, path) = file_call(&node, &id, &raw, &headers).await?;
    let max_bytes = sb.template.max_download_mb << 20;
    let octets = [(axum::http::header::CONTENT_TYPE, "application/octet-stream")];
    let body = sb.backend.read(fence, path, max_bytes, node.config.gateway.max_body_bytes).await?;
    Ok((octets, body).into_response())
}

/// A directory's entries (at most the body limit of listing).
async fn list_dir(
    State(node): State<Arc<Node>>,
    Path((id, raw)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<DirListing>, ApiError> {
    let (sb, fence, path) = file_call(&node, &id, &raw, &headers).await?;
    let listing = sb.backend.list(fence, &path, node.config.gateway.max_body_bytes).await?;
    Ok(Json(crate::listing::to_wire(path, listing)))
}

/// Writes a file (at most the body limit).
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
    sb.backend.write(fence, path, body, node.config.gateway.max_body_bytes).await?;
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

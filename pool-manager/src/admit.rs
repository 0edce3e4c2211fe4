//! Admission of a call to a sandbox: which sandbox it names, whether the caller's fence still
//! holds, a frozen sandbox thawed for a call it must answer, and how an agent's refusal reads
//! as an API error. Shared by the HTTP routes, the WebSocket and the port relay.

use std::sync::Arc;

use axum::http::HeaderMap;
use http_util::ApiError;
use wire::ErrorCode;
use wire::internal::FENCE_HEADER;

use crate::channel::AgentError;
use crate::node::Node;
use crate::sandbox::Sandbox;

/// Retry-After when the node's Docker does not answer (a dockerd restart takes seconds).
const DOCKER_RETRY_AFTER_S: u64 = 5;

pub(crate) fn owned(node: &Node, id: &str) -> Result<Arc<Sandbox>, ApiError> {
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
    if sb.admit(fence) { Ok(()) } else { Err(crate::errors::stale()) }
}

/// Freezes or thaws a sandbox's container, and remembers which.
pub(crate) async fn freeze(node: &Node, sb: &Arc<Sandbox>, pause: bool) -> Result<(), ApiError> {
    node.engine.set_paused(&sb.container, pause).await.map_err(|e| {
        if crate::runtime::Unreachable::is(&e) {
            tracing::warn!(sandbox = %sb.id, error = %e, "pause or resume: docker is not answering");
            ApiError::unavailable("the node's container engine is not answering; retry", DOCKER_RETRY_AFTER_S)
        } else {
            ApiError::bad_gateway(format!("sandbox {} could not be paused or resumed", sb.id), format!("{e:#}"))
        }
    })?;
    node.mark_paused(sb, pause);
    Ok(())
}

/// Resolves a request path against the sandbox's working dir. Refuses `..` (no escaping,
/// even lexically) and NUL; `.` and empty segments are dropped.
pub(crate) fn resolve_path(workdir: &str, raw: &str) -> Result<String, ApiError> {
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

/// How the agent's refusal or failure of a call to `sb` reads as an API error.
pub(crate) fn agent_error(sb: &Sandbox, e: AgentError) -> ApiError {
    crate::errors::agent(&sb.id, e)
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

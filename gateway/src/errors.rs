//! Domain errors of the gateway's dependencies as HTTP answers: each mapping is one
//! exhaustive `match`, so a new case forces a decision about its status.

use std::time::{Duration, UNIX_EPOCH};

use http_util::ApiError;
use ledger::LedgerError;
use wire::{ErrorCode, GoneReason};

/// The ledger failed: Redis is down (503, retry) or its data is not what we wrote (our bug).
pub(crate) fn ledger(e: LedgerError) -> ApiError {
    match e {
        LedgerError::Unavailable(e) => {
            ApiError::unavailable("the ledger is unavailable; retry", 1).with_detail(format!("redis: {e}"))
        }
        LedgerError::Corrupt(m) => ApiError::internal(format!("ledger: {m}")),
    }
}

/// An ended session: the tenant's own doing or lifetime is 404 `session_gone`; the platform's
/// failure is 502 `sandbox_failed`. Both say why and when.
pub(crate) fn gone(id: &str, reason: GoneReason, at_ms: u64) -> ApiError {
    let message = format!("session {id} ended at {} ({})", rfc3339(at_ms), reason.describe());
    let code = match reason {
        GoneReason::Deleted | GoneReason::Expired | GoneReason::MaxLifetime | GoneReason::NodeLost => {
            ErrorCode::SessionGone
        }
        GoneReason::SandboxFailed | GoneReason::CreateFailed | GoneReason::Removed => ErrorCode::SandboxFailed,
    };
    ApiError::new(code, message)
}

/// The session's node is down: 503 `node_unavailable` at once, retry in a few seconds (it
/// may come back; past `node.lost_after` the session ends with `node_lost`).
pub(crate) fn node_down(node: &str) -> ApiError {
    ApiError {
        retry_after_s: Some(NODE_DOWN_RETRY_S),
        ..ApiError::new(
            ErrorCode::NodeUnavailable,
            format!("node {node} is not answering its heartbeat; the session is kept until it returns or is given up"),
        )
    }
}

/// `Retry-After` for a down node: a heartbeat or two.
const NODE_DOWN_RETRY_S: u64 = 3;

pub(crate) fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

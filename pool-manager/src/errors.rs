//! How a sandbox's failures read as API errors: the agent's refusals, a runtime's file call
//! failures, a superseded lease. Shared by admission, the routes and the sandbox backends.

use agent_proto::codes;
use http_util::ApiError;
use wire::ErrorCode;

use crate::channel::AgentError;
use crate::runtime::FileError;

/// A call whose fence a newer grant of the sandbox superseded.
pub(crate) fn stale() -> ApiError {
    ApiError::new(ErrorCode::StaleFence, "this lease was superseded by a newer grant of the sandbox")
}

/// `Retry-After` of a call the sandbox had no process for: reaping a fork bomb's thousands of
/// processes takes about a second.
const BUSY_RETRY_S: u64 = 1;

/// How the agent's refusal or failure of a call to sandbox `id` reads as an API error.
pub(crate) fn agent(id: &str, e: AgentError) -> ApiError {
    match e {
        AgentError::Closed => {
            ApiError::new(ErrorCode::SandboxFailed, format!("sandbox {} failed: its agent is gone", id))
        }
        AgentError::Timeout => ApiError::gateway_timeout(format!("sandbox {} did not answer in time", id)),
        AgentError::TooLarge(m) => ApiError::new(ErrorCode::PayloadTooLarge, format!("request too large: {m}")),
        AgentError::Upload(m) => ApiError::bad_request(format!("the upload broke off: {m}")),
        AgentError::Protocol(m) => ApiError::bad_gateway(format!("sandbox {} answered badly", id), m),
        AgentError::Remote(info) => match info.code.as_str() {
            codes::STALE_FENCE => stale(),
            codes::NOT_FOUND => ApiError::not_found(info.message),
            codes::IS_DIRECTORY => ApiError::new(ErrorCode::IsDirectory, info.message),
            codes::NOT_EMPTY | codes::EXISTS => ApiError::new(ErrorCode::Conflict, info.message),
            codes::TOO_LARGE => ApiError::new(ErrorCode::PayloadTooLarge, info.message),
            codes::BAD_REQUEST | codes::PERMISSION_DENIED | codes::IO => ApiError::bad_request(info.message),
            // The tenant's own processes fill the sandbox (or are still being reaped): retry.
            codes::BUSY => {
                let mut e = ApiError::new(ErrorCode::SandboxBusy, format!("sandbox {}: {}", id, info.message));
                e.retry_after_s = Some(BUSY_RETRY_S);
                e
            }
            // A code this side does not know: the agent's words go to the log only.
            _ => ApiError::bad_gateway(
                format!("sandbox {} failed the call", id),
                format!("{}: {}", info.code, info.message),
            ),
        },
    }
}

/// How a runtime's file call failure on `path` reads as an API error.
pub(crate) fn file(path: &str, e: FileError) -> ApiError {
    match e {
        FileError::NotFound => ApiError::not_found(format!("{path}: no such file or directory")),
        FileError::TooLarge => ApiError::new(ErrorCode::PayloadTooLarge, format!("{path}: file too large")),
        FileError::IsDirectory(m) => ApiError::new(ErrorCode::IsDirectory, format!("{path}: {m}")),
        FileError::Refused(m) => ApiError::bad_request(format!("{path}: {m}")),
        FileError::Other(m) => ApiError::bad_gateway(format!("{path}: the sandbox failed the file call"), m),
    }
}

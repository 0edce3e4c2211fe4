//! Errors as every sandpool HTTP service answers them (`ErrorBody`, with a code from the
//! closed set `ErrorCode`), and why a session ended (`GoneReason`).

use serde::{Deserialize, Serialize};

/// Every error answer of every sandpool HTTP service has this body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    /// Stable and machine-readable; each code has one HTTP status (see `http-util`).
    pub code: ErrorCode,
    /// For humans; names the offending field where there is one. Never internal details.
    pub message: String,
    /// On 5xx answers: quote it to the operators, whose log holds the cause under this id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// On `quota_exceeded`: which limit refused the request (its fields sit beside `code`).
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<QuotaDenied>,
}

/// Why a quota refused a request: the dimension, the level of the principal's path whose limit
/// is reached, that limit, and what is in use there.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct QuotaDenied {
    pub dimension: crate::quotas::Dimension,
    pub path: String,
    pub limit: f64,
    pub used: f64,
}

/// The closed set of error codes. Each maps to exactly one HTTP status, in one exhaustive
/// `match` (`http_util::status_of`), so a new code forces a decision about its status.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: a malformed request; the message names the field.
    BadRequest,
    /// 400: a file path that is not allowed (`..`, not a file).
    InvalidPath,
    /// 400: no template of that name for this caller.
    UnknownTemplate,
    /// 400: the path names a directory where a file is needed.
    IsDirectory,
    /// 401: missing, malformed, expired or wrongly signed credentials.
    Unauthorized,
    /// 403: authenticated, but not allowed.
    Forbidden,
    /// 404: no such thing for this caller (including another tenant's).
    NotFound,
    /// 404: the session has ended; the message says why.
    SessionGone,
    /// 409: conflicts with the current state (a session key being created).
    Conflict,
    /// 409: the caller's fencing token is older than one the sandbox has seen.
    StaleFence,
    /// 409: the persistent shell has exited (`exit`, `exec`, a crash); open a new one.
    ShellGone,
    /// 413: the body is larger than allowed.
    PayloadTooLarge,
    /// 429: over a limit (a full queue); retry after `Retry-After`.
    TooManyRequests,
    /// 429: over a quota of the caller's path; the body names the dimension and level.
    QuotaExceeded,
    /// 503: out of capacity or a dependency is down; retry after `Retry-After`.
    Unavailable,
    /// 502: a node or sandbox failed.
    BadGateway,
    /// 502: the session's sandbox failed; open a new session.
    SandboxFailed,
    /// 504: a node or sandbox did not answer in time.
    GatewayTimeout,
    /// 500: our own bug; the cause is logged under the request id.
    Internal,
    /// A code this client does not know (a newer server).
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// As it appears in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::InvalidPath => "invalid_path",
            ErrorCode::UnknownTemplate => "unknown_template",
            ErrorCode::IsDirectory => "is_directory",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::SessionGone => "session_gone",
            ErrorCode::Conflict => "conflict",
            ErrorCode::ShellGone => "shell_gone",
            ErrorCode::StaleFence => "stale_fence",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::TooManyRequests => "too_many_requests",
            ErrorCode::QuotaExceeded => "quota_exceeded",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::BadGateway => "bad_gateway",
            ErrorCode::SandboxFailed => "sandbox_failed",
            ErrorCode::GatewayTimeout => "gateway_timeout",
            ErrorCode::Internal => "internal",
            ErrorCode::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a session ended; `GET` and every later call of an ended session say so.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum GoneReason {
    /// Its tenant deleted it.
    Deleted,
    /// Its idle timeout passed.
    Expired,
    /// Its maximum lifetime was reached.
    MaxLifetime,
    /// Its sandbox failed (the platform's fault, answered with 502).
    SandboxFailed,
    /// Its sandbox could not be created.
    CreateFailed,
    /// Its node removed the sandbox (a restart found it broken or orphaned).
    Removed,
}

impl GoneReason {
    /// As the ledger stores it.
    pub fn as_str(self) -> &'static str {
        match self {
            GoneReason::Deleted => "deleted",
            GoneReason::Expired => "expired",
            GoneReason::MaxLifetime => "max_lifetime",
            GoneReason::SandboxFailed => "sandbox_failed",
            GoneReason::CreateFailed => "create_failed",
            GoneReason::Removed => "removed",
        }
    }

    /// For the person reading the error message.
    pub fn describe(self) -> &'static str {
        match self {
            GoneReason::Deleted => "deleted",
            GoneReason::Expired => "idle timeout passed",
            GoneReason::MaxLifetime => "maximum lifetime reached",
            GoneReason::SandboxFailed => "its sandbox failed; open a new session",
            GoneReason::CreateFailed => "its sandbox could not be created",
            GoneReason::Removed => "its sandbox was removed by its node",
        }
    }
}

//! Errors as every sandpool HTTP service answers them (`ErrorBody`, with a code from the
//! closed set `ErrorCode`), and why a session ended (`GoneReason`).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Every error answer of every sandpool HTTP service has this body. (Its OpenAPI schema is
/// written out in `gateway::openapi`: the derive cannot express the flattened, optional quota.)
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct QuotaDenied {
    /// What the refused quota limits.
    pub dimension: crate::quotas::Dimension,
    /// The level of the principal's path whose limit is reached.
    pub path: String,
    /// That level's limit.
    pub limit: f64,
    /// What is in use at that level.
    pub used: f64,
}

/// The closed set of error codes. Each maps to exactly one HTTP status, in one exhaustive
/// `match` (`http_util::status_of`), so a new code forces a decision about its status; what
/// each means to a caller is `ErrorCode::meaning`, which the API reference quotes.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// A malformed request; the message names the field.
    BadRequest,
    /// A file path that is not allowed (`..`, NUL).
    InvalidPath,
    /// No template of that name for this caller.
    UnknownTemplate,
    /// The image reference names nothing its registry has.
    ImageNotFound,
    /// The path names a directory where a file is needed.
    IsDirectory,
    /// Missing, malformed, expired or wrongly signed credentials.
    Unauthorized,
    /// Authenticated, but not allowed (the admin scope, another subtree).
    Forbidden,
    /// No such thing for this caller (another tenant's ids too).
    NotFound,
    /// The session has ended; the message says why.
    SessionGone,
    /// Conflicts with the current state (a session key being created, a busy shell).
    Conflict,
    /// The caller's fencing token is older than one the sandbox has seen.
    StaleFence,
    /// The persistent shell has exited (`exit`, `exec`, a crash); open a new one.
    ShellGone,
    /// The body is larger than allowed.
    PayloadTooLarge,
    /// Over a limit (a full queue); retry after `Retry-After`.
    TooManyRequests,
    /// Over a quota of the caller's path; the body names the dimension and level.
    QuotaExceeded,
    /// Out of capacity or a dependency is down; retry after `Retry-After`.
    Unavailable,
    /// Every node is at its budget (process ids, memory, open files, or its configured cap);
    /// retry after `Retry-After`.
    NodeFull,
    /// The session's node stopped answering its heartbeat; retry after `Retry-After` (the
    /// session ends with reason `node_lost` if the node stays away).
    NodeUnavailable,
    /// A node or sandbox failed.
    BadGateway,
    /// The template's image could not be pulled (the message quotes the registry); retry
    /// after `Retry-After`.
    ImagePullFailed,
    /// The session's sandbox failed; open a new session.
    SandboxFailed,
    /// The sandbox has no process to spare (at its pids limit, or still reaping a command it
    /// killed); nothing ran: retry after `Retry-After`.
    SandboxBusy,
    /// A node or sandbox did not answer in time.
    GatewayTimeout,
    /// The invocation ran past its function's `timeout_ms`; its environment was replaced.
    FunctionTimeout,
    /// The function's runtime worker exited or broke the protocol mid-invocation; the next
    /// invocation gets a fresh environment.
    FunctionCrashed,
    /// Our own bug; quote `request_id` to the operators, whose log holds the cause.
    Internal,
    /// A code this client does not know (a newer server).
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    /// What the code means to a caller (the API reference quotes it).
    pub fn meaning(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "a malformed request; the message names the field",
            ErrorCode::InvalidPath => "a file path that is not allowed (`..`, NUL)",
            ErrorCode::UnknownTemplate => "no template of that name for this caller",
            ErrorCode::ImageNotFound => "the image reference names nothing its registry has",
            ErrorCode::IsDirectory => "the path names a directory where a file is needed",
            ErrorCode::Unauthorized => "missing, malformed, expired or wrongly signed credentials",
            ErrorCode::Forbidden => "authenticated, but not allowed (the admin scope, another subtree)",
            ErrorCode::NotFound => "no such thing for this caller (another tenant's ids too)",
            ErrorCode::SessionGone => "the session has ended; the message says why",
            ErrorCode::Conflict => "conflicts with the current state (a session key being created, a busy shell)",
            ErrorCode::StaleFence => "the caller's fencing token is older than one the sandbox has seen",
            ErrorCode::ShellGone => "the persistent shell has exited (`exit`, `exec`, a crash); open a new one",
            ErrorCode::PayloadTooLarge => "the body is larger than allowed",
            ErrorCode::TooManyRequests => "over a limit (a full queue); retry after `Retry-After`",
            ErrorCode::QuotaExceeded => "over a quota of the caller's path; the body names the dimension and level",
            ErrorCode::Unavailable => "out of capacity or a dependency is down; retry after `Retry-After`",
            ErrorCode::NodeFull => {
                "every node is at its budget (process ids, memory, open files, or its configured cap); retry after `Retry-After`"
            }
            ErrorCode::NodeUnavailable => {
                "the session's node stopped answering its heartbeat; retry after `Retry-After` (the session ends with reason `node_lost` if the node stays away)"
            }
            ErrorCode::BadGateway => "a node or sandbox failed",
            ErrorCode::ImagePullFailed => {
                "the template's image could not be pulled (the message quotes the registry); retry after `Retry-After`"
            }
            ErrorCode::SandboxFailed => "the session's sandbox failed; open a new session",
            ErrorCode::SandboxBusy => {
                "the sandbox has no process to spare (at its pids limit, or still reaping a command it killed); nothing ran: retry after `Retry-After`"
            }
            ErrorCode::GatewayTimeout => "a node or sandbox did not answer in time",
            ErrorCode::FunctionTimeout => {
                "the invocation ran past its function's `timeout_ms`; its environment was replaced"
            }
            ErrorCode::FunctionCrashed => {
                "the function's runtime worker exited or broke the protocol mid-invocation; the next invocation gets a fresh environment"
            }
            ErrorCode::Internal => "our own bug; quote `request_id` to the operators, whose log holds the cause",
            ErrorCode::Unknown => "a code this client does not know (a newer server)",
        }
    }

    /// As it appears in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::InvalidPath => "invalid_path",
            ErrorCode::UnknownTemplate => "unknown_template",
            ErrorCode::ImageNotFound => "image_not_found",
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
            ErrorCode::NodeFull => "node_full",
            ErrorCode::NodeUnavailable => "node_unavailable",
            ErrorCode::BadGateway => "bad_gateway",
            ErrorCode::ImagePullFailed => "image_pull_failed",
            ErrorCode::SandboxFailed => "sandbox_failed",
            ErrorCode::SandboxBusy => "sandbox_busy",
            ErrorCode::GatewayTimeout => "gateway_timeout",
            ErrorCode::FunctionTimeout => "function_timeout",
            ErrorCode::FunctionCrashed => "function_crashed",
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
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash, ToSchema)]
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
    /// Its node stopped answering for longer than `node_lost_after`.
    NodeLost,
}

impl GoneReason {
    /// Every reason (the metrics' `reason` label set).
    pub const ALL: [GoneReason; 7] = [
        GoneReason::Deleted,
        GoneReason::Expired,
        GoneReason::MaxLifetime,
        GoneReason::SandboxFailed,
        GoneReason::CreateFailed,
        GoneReason::Removed,
        GoneReason::NodeLost,
    ];

    /// As the ledger stores it.
    pub fn as_str(self) -> &'static str {
        match self {
            GoneReason::Deleted => "deleted",
            GoneReason::Expired => "expired",
            GoneReason::MaxLifetime => "max_lifetime",
            GoneReason::SandboxFailed => "sandbox_failed",
            GoneReason::CreateFailed => "create_failed",
            GoneReason::Removed => "removed",
            GoneReason::NodeLost => "node_lost",
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
            GoneReason::NodeLost => "its node stopped answering and was given up; open a new session",
        }
    }
}

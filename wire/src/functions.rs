//! Functions: the serverless face of the gateway. A function names a template and a handler;
//! its invocations run in warm environments (sandboxes leased to that one function of that one
//! principal) reused from one invocation to the next.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Per-invocation time limit when the function does not set one.
pub const DEFAULT_TIMEOUT_MS: u64 = 60_000;
/// Environments (so invocations in flight) of one function when it does not set a limit.
pub const DEFAULT_MAX_CONCURRENCY: u32 = 16;
/// The most any function may ask for.
pub const MAX_CONCURRENCY: u32 = 1024;
/// Warm environments a function may ask to keep at all times.
pub const MAX_MIN_WARM: u32 = 64;
/// Invocations an environment serves before it is replaced, by default.
pub const DEFAULT_MAX_ENV_INVOCATIONS: u64 = 1000;
/// How long an environment may sit idle before it ends, by default (capped by the template's
/// idle timeout).
pub const DEFAULT_ENV_IDLE_S: u64 = 300;
/// Most arguments a handler may have.
pub const MAX_HANDLER_ARGS: usize = 64;
/// Most bytes a handler's arguments may hold, all together.
pub const MAX_HANDLER_BYTES: usize = 16 * 1024;

/// How an invocation runs in its environment.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum FunctionMode {
    /// Each invocation spawns `handler` with the payload on stdin; its stdout is the result
    /// and exit status 0 means success.
    Exec,
    /// `handler` is a worker started once per environment; invocations reach it over the
    /// runtime protocol on its stdio (`sdk/runtime/PROTOCOL.md`), so a warm one spawns nothing.
    Runtime,
}

impl FunctionMode {
    /// As the API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            FunctionMode::Exec => "exec",
            FunctionMode::Runtime => "runtime",
        }
    }
}

/// `PUT /v1/functions/{name}`: creates the function or replaces its definition (environments
/// of the old definition are retired).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutFunction {
    /// The template environments are made from (an agent-mode template).
    pub template: String,
    /// How its invocations run: `exec` spawns `handler` for each, `runtime` keeps a worker.
    pub mode: FunctionMode,
    /// argv: the command (exec mode) or the worker (runtime mode), e.g.
    /// `["python3", "-m", "sandpool_runtime", "reward:score"]`.
    pub handler: Vec<String>,
    /// Environment variables of the handler (at most 128 of 4 KiB each, 64 KiB in all).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Per invocation (default 60,000; at most the exec limit, 3,600,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Invocations in flight at once, so environments (default 16, at most 1024); more answer
    /// 429 with Retry-After.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u32>,
    /// Environments kept warm even when idle (default 0: scale to zero; at most 64).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_warm: Option<u32>,
    /// Invocations one environment serves before it is replaced (default 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_env_invocations: Option<u64>,
    /// Seconds an environment may be idle before it ends (default 300, capped by the
    /// template's idle timeout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_idle_s: Option<u64>,
}

/// A function as stored and shown: every setting resolved to its value.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Function {
    /// The function's name: 1-64 of a-z, 0-9, '-' and '_'.
    pub name: String,
    /// The principal (tenant path) that owns it.
    pub owner: String,
    /// The template its environments are made from.
    pub template: String,
    /// How its invocations run.
    pub mode: FunctionMode,
    /// argv: the command (exec mode) or the worker (runtime mode).
    pub handler: Vec<String>,
    /// Environment variables of the handler.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Time limit of each invocation, milliseconds.
    pub timeout_ms: u64,
    /// Invocations in flight at once, so environments; more answer 429.
    pub max_concurrency: u32,
    /// Environments kept warm even when idle (0: scale to zero).
    pub min_warm: u32,
    /// Invocations one environment serves before it is replaced.
    pub max_env_invocations: u64,
    /// Seconds an environment may be idle before it ends.
    pub env_idle_s: u64,
    /// Increases with every `PUT`; an environment serves one version only.
    pub version: u64,
    /// RFC 3339; when the function was created.
    pub created_at: String,
    /// RFC 3339; when its definition was last put.
    pub updated_at: String,
    /// Live now (not stored): environments, idle ones, invocations in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environments: Option<EnvironmentCounts>,
}

/// A function's environments right now.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct EnvironmentCounts {
    /// Environments that exist (idle or serving).
    pub total: u64,
    /// Environments waiting for an invocation.
    pub idle: u64,
    /// Invocations running now.
    pub in_flight: u64,
}

/// `GET /v1/functions`: the caller's functions.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct FunctionList {
    /// This page's functions, by name.
    pub functions: Vec<Function>,
    /// Where the next page starts (`?cursor=`); absent on the last page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// Answer of `POST /v1/functions/{name}/invoke?async=true`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct InvocationAccepted {
    /// Names the invocation in `GET /v1/invocations/{id}`.
    pub invocation_id: String,
}

/// Where an asynchronous invocation is.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum InvocationState {
    /// Accepted, not finished.
    Running,
    /// Finished: `status` is the HTTP status a synchronous call would have answered.
    Done,
    /// The gateway running it went away before it finished (past its deadline).
    Lost,
}

/// `GET /v1/invocations/{id}` (kept for `functions.result_ttl_s` after it finishes).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Invocation {
    /// As `POST /v1/functions/{name}/invoke?async=true` answered it.
    pub invocation_id: String,
    /// The function invoked.
    pub function: String,
    /// Where the invocation is.
    pub state: InvocationState,
    /// RFC 3339; when it was accepted.
    pub accepted_at: String,
    /// Once done: the status a synchronous invocation would have answered (200, 429, 504, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// `handled` or `unhandled` when the function failed (as the synchronous header says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function_error: Option<String>,
    /// Once done: `warm` when a running environment (and worker) served it, `cold` when one was started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<crate::Start>,
    /// Once done: the handler's own time, milliseconds (a worker's start excluded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<f64>,
    /// The answer's body: JSON when it parses as JSON, else a string (`base64` when
    /// `result_encoding` says so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    /// `base64` when the body was not UTF-8 and `result` holds it in base64; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_encoding: Option<String>,
}

impl Invocation {
    /// An invocation in `state`, with nothing yet of how it ran.
    pub fn new(invocation_id: String, function: String, state: InvocationState, accepted_at: String) -> Self {
        Invocation {
            invocation_id,
            function,
            state,
            accepted_at,
            status: None,
            function_error: None,
            start: None,
            duration_ms: None,
            result: None,
            result_encoding: None,
        }
    }
}

/// 1-64 characters: lowercase letters, digits, `-`, `_`; starting with a letter or digit.
pub fn name_problem(name: &str) -> Option<&'static str> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    (!ok)
        .then_some("must be 1-64 characters of lowercase letters, digits, '-' and '_', starting with a letter or digit")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for good in ["reward", "a", "grade-v2", "x_1", "9lives"] {
            assert!(name_problem(good).is_none(), "{good}");
        }
        for bad in ["", "-a", "_a", "A", "a b", "a/b", "a.b", "a|b", &"x".repeat(65)] {
            assert!(name_problem(bad).is_some(), "{bad}");
        }
    }

    #[test]
    fn a_definition_refuses_unknown_fields() {
        let ok = r#"{"template":"debian","mode":"runtime","handler":["python3","-m","sandpool_runtime","m:f"]}"#;
        assert!(serde_json::from_str::<PutFunction>(ok).is_ok());
        let bad = r#"{"template":"debian","mode":"runtime","handler":[],"timeout":5}"#;
        assert!(serde_json::from_str::<PutFunction>(bad).is_err());
        let bad_mode = r#"{"template":"debian","mode":"http","handler":["x"]}"#;
        assert!(serde_json::from_str::<PutFunction>(bad_mode).is_err());
    }
}

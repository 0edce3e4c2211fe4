//! How a sandbox's exec and file calls reach it: each `Sandbox` owns one `Backend`, chosen
//! when it is made (its agent's channel, or its runtime's own exec and archive calls for a
//! docker-exec template), so the routes call it without asking which.
//!
//! What only an agent can do (shells, streams, ports, functions, file operations) still takes
//! the sandbox's `agent`.

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures::future::BoxFuture;
use http_util::ApiError;

mod agent;
mod engine;

pub(crate) use agent::AgentBackend;
pub(crate) use engine::EngineBackend;

/// How long a file call may take.
pub(crate) const FILE_TIMEOUT: Duration = Duration::from_secs(120);

/// One command to run.
pub(crate) struct Exec {
    pub fence: u64,
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Resolved; empty: the template's workdir.
    pub cwd: String,
    pub stdin: Option<Bytes>,
    pub timeout: Duration,
    /// Bytes kept of each of stdout and stderr.
    pub max_output: u64,
}

/// How a command ended.
#[derive(Debug, Default)]
pub(crate) struct Ran {
    pub exit_code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// As the sandbox measured it; `None`: the caller measures.
    pub duration_ms: Option<f64>,
    pub timed_out: bool,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
}

/// A sandbox's exec and file calls. Errors are the API's already (the sandbox's id in them).
pub(crate) trait Backend: Send + Sync {
    fn exec(&self, call: Exec) -> BoxFuture<'_, Result<Ran, ApiError>>;
    /// A file, or a directory as tar, as a response body: at most `max_bytes`; a backend that
    /// collects before answering also holds to `collect_limit`.
    fn read(
        &self,
        fence: u64,
        path: String,
        max_bytes: u64,
        collect_limit: u64,
    ) -> BoxFuture<'_, Result<Body, ApiError>>;
    /// A directory's entries, from at most `max_bytes` of listing.
    fn list<'a>(
        &'a self,
        fence: u64,
        path: &'a str,
        max_bytes: u64,
    ) -> BoxFuture<'a, Result<agent_proto::Listing, ApiError>>;
    /// Writes `body` (at most `max_bytes`) to the file at `path`.
    fn write(&self, fence: u64, path: String, body: Body, max_bytes: u64) -> BoxFuture<'_, Result<(), ApiError>>;
}

fn not_a_dir(path: &str, why: String) -> ApiError {
    ApiError::bad_request(format!("{path}: {why}"))
}

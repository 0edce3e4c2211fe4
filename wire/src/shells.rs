//! Persistent shells: a long-lived shell in a session whose working directory, variables,
//! functions, aliases and background jobs carry over from one run to the next.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Shells one session may hold at once.
pub const MAX_SHELLS: usize = 8;

/// `POST /v1/sessions/{id}/shells`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateShell {
    /// 1-64 letters, digits, '-', '_', '.'; default: `shell-<n>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `sh` (default) or `bash` (if the template's image has it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    /// Environment variables set in the shell.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Starting directory (relative: under the template's workdir).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// A shell, as created and listed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ShellInfo {
    /// The shell's name in its session (`.../shells/{name}/run`).
    pub name: String,
    /// `sh` or `bash`.
    pub shell: String,
    /// Its working directory after its last run.
    pub cwd: String,
    /// A run is in progress.
    pub busy: bool,
}

/// `GET /v1/sessions/{id}/shells`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ShellList {
    /// The session's shells (at most 8).
    pub shells: Vec<ShellInfo>,
}

/// `POST /v1/sessions/{id}/shells/{name}/run`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ShellRun {
    /// Shell text, run in the shell itself (so `cd`, `export`, `source` persist).
    pub cmd: String,
    /// Default 300 000; at most 3 600 000. At the timeout the command gets SIGINT, then
    /// SIGKILL; the shell survives with its state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Given to the command as its standard input; absent: the command reads end of input
    /// at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
}

/// Answer of a shell run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ShellResult {
    /// The command's exit status.
    pub exit_code: i32,
    /// What the command wrote to stdout and stderr, interleaved as written (UTF-8, lossy).
    pub output: String,
    /// The shell's working directory after the run.
    pub cwd: String,
    /// How long the run took, milliseconds.
    pub duration_ms: f64,
    /// The run passed its timeout and was interrupted (the shell survives with its state).
    pub timed_out: bool,
    /// Output beyond `pool_manager.max_output_bytes` was dropped.
    pub truncated: bool,
}

/// Why `name` cannot name a shell, if it cannot.
pub fn name_problem(name: &str) -> Option<&'static str> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    (!ok).then_some("1-64 letters, digits, '-', '_', '.'")
}

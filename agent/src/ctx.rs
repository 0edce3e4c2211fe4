//! What every request handler shares with the threads it starts (`Ctx`), and the errors they
//! answer with before a request runs.

use std::io;
use std::sync::Arc;

use agent_proto::{ErrorInfo, codes};

use crate::out::Out;
use crate::reaper::Reaper;

/// Used for commands when the agent's own environment has no PATH (e.g. a bare image).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What the request handlers share with the threads they start. The requests in progress are
/// not here: each handler room keeps its own table (`exec::Execs`, `files::Reads`,
/// `ports::Ports`), so this room names none of them.
pub struct Ctx {
    /// Where replies go.
    pub out: Out,
    /// Reaps every child and hands exit statuses to the commands waiting for them.
    pub reaper: Arc<Reaper>,
    /// The environment commands start from: the agent's own, read once at start, with
    /// `DEFAULT_PATH` when it has no `PATH`.
    pub env: Vec<(std::ffi::OsString, std::ffi::OsString)>,
    /// Who commands run as (`--user`); `None`: as the agent (root).
    pub user: Option<(u32, u32)>,
    /// `HOME` of commands run as `user` (the workdir), unless their request sets one.
    pub home: String,
}

/// The error of a malformed request.
pub fn bad_request(msg: impl Into<String>) -> ErrorInfo {
    ErrorInfo::new(codes::BAD_REQUEST, msg)
}

/// The error of a request that could not get a process or a thread: `busy` when the sandbox
/// has none to spare (EAGAIN: its pids limit, say while a killed command's processes are
/// still being reaped), which the host answers as retryable (503); else `code`.
pub fn no_room(code: &str, msg: String, err: &io::Error) -> ErrorInfo {
    if err.raw_os_error() == Some(libc::EAGAIN) {
        ErrorInfo::new(codes::BUSY, format!("{msg}: the sandbox is at its process limit; retry shortly"))
    } else {
        ErrorInfo::new(code, msg)
    }
}

/// The agent's environment as commands inherit it (see `Ctx::env`), less the node's own
/// variable for the container runtime (`layout::SHIM_GROUP_ENV`).
pub fn command_env() -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    let mut env: Vec<_> = std::env::vars_os().filter(|(k, _)| k != agent_proto::layout::SHIM_GROUP_ENV).collect();
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), DEFAULT_PATH.into()));
    }
    env
}

//! The one rule for how long a command may run: an exec (HTTP or WebSocket), a shell run, a
//! function's invocation. The gateway checks it at the door and the node checks it again (a
//! node trusts no caller), both through these methods, so the bound and its message are one.

use crate::ExecRequest;
use crate::functions::{DEFAULT_TIMEOUT_MS, PutFunction};
use crate::internal::InvokeSpec;
use crate::shells::ShellRun;

/// A command's timeout when its request names none: a build or a test suite fits.
pub const DEFAULT_EXEC_TIMEOUT_MS: u64 = 300_000;
/// The longest a command may run (an hour): a sandbox slot held longer by one command is
/// work for a session of its own commands, not one call.
pub const MAX_EXEC_TIMEOUT_MS: u64 = 3_600_000;

/// `asked`, or `default` when the request names none, if it is within `1 ..=
/// MAX_EXEC_TIMEOUT_MS`; else the bad-request message naming the bound.
pub fn exec_timeout_ms(asked: Option<u64>, default: u64) -> Result<u64, String> {
    match asked.unwrap_or(default) {
        t @ 1..=MAX_EXEC_TIMEOUT_MS => Ok(t),
        _ => Err(format!("timeout_ms: must be 1 ..= {MAX_EXEC_TIMEOUT_MS}")),
    }
}

impl ExecRequest {
    /// The timeout this exec runs under (see [`exec_timeout_ms`]).
    pub fn checked_timeout_ms(&self) -> Result<u64, String> {
        exec_timeout_ms(self.timeout_ms, DEFAULT_EXEC_TIMEOUT_MS)
    }
}

impl ShellRun {
    /// The timeout this shell run runs under (see [`exec_timeout_ms`]).
    pub fn checked_timeout_ms(&self) -> Result<u64, String> {
        exec_timeout_ms(self.timeout_ms, DEFAULT_EXEC_TIMEOUT_MS)
    }
}

impl PutFunction {
    /// The timeout of each invocation of this function (its own default: functions are short).
    pub fn checked_timeout_ms(&self) -> Result<u64, String> {
        exec_timeout_ms(self.timeout_ms, DEFAULT_TIMEOUT_MS)
    }
}

impl InvokeSpec {
    /// The invocation's timeout, always set by the gateway, checked again by the node.
    pub fn checked_timeout_ms(&self) -> Result<u64, String> {
        exec_timeout_ms(Some(self.timeout_ms), DEFAULT_TIMEOUT_MS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_defaults() {
        assert_eq!(exec_timeout_ms(None, DEFAULT_EXEC_TIMEOUT_MS), Ok(300_000));
        assert_eq!(exec_timeout_ms(Some(1), DEFAULT_EXEC_TIMEOUT_MS), Ok(1));
        assert_eq!(exec_timeout_ms(Some(MAX_EXEC_TIMEOUT_MS), DEFAULT_EXEC_TIMEOUT_MS), Ok(MAX_EXEC_TIMEOUT_MS));
        let refused = Err("timeout_ms: must be 1 ..= 3600000".to_string());
        assert_eq!(exec_timeout_ms(Some(0), DEFAULT_EXEC_TIMEOUT_MS), refused);
        assert_eq!(exec_timeout_ms(Some(MAX_EXEC_TIMEOUT_MS + 1), DEFAULT_EXEC_TIMEOUT_MS), refused);
        let run = ShellRun { cmd: "true".into(), timeout_ms: None, stdin: None };
        assert_eq!(run.checked_timeout_ms(), Ok(DEFAULT_EXEC_TIMEOUT_MS));
    }
}

//! The session WebSocket protocol (`GET /v1/sessions/{id}/ws`): JSON text messages, several
//! commands multiplexed on one socket by a client-chosen `id`.
//!
//! Client → server: `start`, `stdin`, `stdin_eof`, `resize`, `signal`.
//! Server → client: `started`, `stdout`, `stderr`, `exit`, `error`.
//! Output arrives as the command writes it; a slow reader slows the command (flow control
//! reaches into the sandbox) rather than growing memory.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::{Cmd, Encoding};

/// Terminal size for `pty` commands.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    /// Terminal rows.
    pub rows: u16,
    /// Terminal columns.
    pub cols: u16,
}

/// A message from the client: JSON text, tagged by `type`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientMsg {
    /// Start a command. `id` names it in every later message.
    Start {
        /// Client-chosen; unique among the socket's running commands.
        id: String,
        /// What to run: an argv vector, or a string for `/bin/sh -c`.
        cmd: Cmd,
        /// Environment variables set for the command.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        env: BTreeMap<String, String>,
        /// Working directory (relative: under the template's workdir); default: the workdir.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
        /// Milliseconds before the command is killed (default 300,000; at most 3,600,000).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        timeout_ms: Option<u64>,
        /// Run under a pseudo-terminal of this size (stdout and stderr merged).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pty: Option<PtySize>,
        /// Encoding of `data` in this command's stdin, stdout and stderr messages.
        #[serde(default)]
        encoding: Encoding,
    },
    /// Bytes for the command's stdin (in the command's encoding).
    Stdin {
        /// The command, by the `id` it was started with.
        id: String,
        /// The bytes, in the command's encoding.
        data: String,
    },
    /// Close the command's stdin.
    StdinEof {
        /// The command, by the `id` it was started with.
        id: String,
    },
    /// Resize a `pty` command's terminal.
    Resize {
        /// The command, by the `id` it was started with.
        id: String,
        /// Terminal rows.
        rows: u16,
        /// Terminal columns.
        cols: u16,
    },
    /// Send a signal (number, e.g. 2 for SIGINT, 15 for SIGTERM) to the command's process group.
    Signal {
        /// The command, by the `id` it was started with.
        id: String,
        /// The signal's number, 1 ..= 64.
        signal: u32,
    },
    /// Run shell text in one of the session's persistent shells (created with
    /// `POST /v1/sessions/{id}/shells`): `stdout` messages as output arrives (stdout and stderr
    /// interleaved), then `shell_exit`.
    ShellRun {
        /// Client-chosen; names this run in its `stdout` and `shell_exit` messages.
        id: String,
        /// The persistent shell's name.
        shell: String,
        /// Shell text, run in the shell itself (so `cd`, `export`, `source` persist).
        cmd: String,
        /// Default 300,000; at most 3,600,000. At the timeout the command gets SIGINT, then SIGKILL.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        timeout_ms: Option<u64>,
        /// Given to the command as its standard input; absent: it reads end of input at once.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stdin: Option<String>,
    },
    /// Interrupt a persistent shell's running command (SIGINT, like Ctrl-C).
    ShellInterrupt {
        /// The persistent shell's name.
        shell: String,
    },
}

/// A message from the server: JSON text, tagged by `type`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMsg {
    /// The command (or shell run) has started.
    Started {
        /// The command or shell run, by the `id` the client gave it.
        id: String,
    },
    /// Output the command wrote to stdout (with a `pty`, stdout and stderr merged; of a shell
    /// run, both interleaved).
    Stdout {
        /// The command or shell run, by the `id` the client gave it.
        id: String,
        /// The bytes, in the command's encoding (a shell run's: UTF-8, lossy).
        data: String,
    },
    /// Output the command wrote to stderr.
    Stderr {
        /// The command, by the `id` the client started it with.
        id: String,
        /// The bytes, in the command's encoding.
        data: String,
    },
    /// The command ended.
    Exit {
        /// The command, by the `id` the client started it with.
        id: String,
        /// The command's exit status.
        exit_code: i32,
        /// It ran past its timeout and was killed.
        timed_out: bool,
        /// How long it ran, milliseconds.
        duration_ms: f64,
    },
    /// A shell run ended: like the HTTP run's answer, without the output (already sent).
    ShellExit {
        /// The run, by the `id` the client gave it.
        id: String,
        /// The command's exit status.
        exit_code: i32,
        /// The shell's working directory after the run.
        cwd: String,
        /// The run passed its timeout and was interrupted (the shell survives).
        timed_out: bool,
        /// Output beyond `pool_manager.max_output_bytes` was dropped.
        truncated: bool,
        /// How long the run took, milliseconds.
        duration_ms: f64,
    },
    /// A request failed (`id` is absent for a message that could not be read at all).
    Error {
        /// The command or run the error is about.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        /// An error code, as in HTTP error bodies (`bad_request`, `not_found`, ...).
        code: String,
        /// For humans; names the offending field where there is one.
        message: String,
    },
}

/// `POST /v1/sessions/{id}/ws-ticket`: a short-lived ticket that opens this session's
/// WebSocket as its owner (`?ticket=`), for clients that can set no header (browsers) and
/// should not put a bearer token in a URL.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct WsTicket {
    /// Signed; opens this session's WebSocket as `?ticket=` until it expires (`path` carries it).
    pub ticket: String,
    /// Seconds it stays valid (connect before then; an open socket stays open).
    pub expires_in_s: u64,
    /// The WebSocket's path with the ticket, to join to the gateway's `ws://` or `wss://` URL.
    pub path: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_tagged_json() {
        let m: ClientMsg =
            serde_json::from_str(r#"{"type":"start","id":"a","cmd":"ls","pty":{"rows":24,"cols":80}}"#).unwrap();
        assert!(matches!(m, ClientMsg::Start { pty: Some(PtySize { rows: 24, cols: 80 }), .. }));
        let s = serde_json::to_string(&ServerMsg::Stdout { id: "a".into(), data: "hi".into() }).unwrap();
        assert_eq!(s, r#"{"type":"stdout","id":"a","data":"hi"}"#);
        assert!(serde_json::from_str::<ClientMsg>(r#"{"type":"start","id":"a","cmd":"ls","bogus":1}"#).is_err());
    }
}

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
    pub rows: u16,
    pub cols: u16,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientMsg {
    /// Start a command. `id` names it in every later message.
    Start {
        id: String,
        cmd: Cmd,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        env: BTreeMap<String, String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
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
    Stdin { id: String, data: String },
    /// Close the command's stdin.
    StdinEof { id: String },
    /// Resize a `pty` command's terminal.
    Resize { id: String, rows: u16, cols: u16 },
    /// Send a signal (number, e.g. 2 for SIGINT, 15 for SIGTERM) to the command's process group.
    Signal { id: String, signal: u32 },
    /// Run shell text in one of the session's persistent shells (created with
    /// `POST /v1/sessions/{id}/shells`): `stdout` messages as output arrives (stdout and stderr
    /// interleaved), then `shell_exit`.
    ShellRun {
        id: String,
        shell: String,
        cmd: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        timeout_ms: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stdin: Option<String>,
    },
    /// Interrupt a persistent shell's running command (SIGINT, like Ctrl-C).
    ShellInterrupt { shell: String },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMsg {
    Started {
        id: String,
    },
    Stdout {
        id: String,
        data: String,
    },
    Stderr {
        id: String,
        data: String,
    },
    Exit {
        id: String,
        exit_code: i32,
        timed_out: bool,
        duration_ms: f64,
    },
    /// A shell run ended: like the HTTP run's answer, without the output (already sent).
    ShellExit {
        id: String,
        exit_code: i32,
        cwd: String,
        timed_out: bool,
        truncated: bool,
        duration_ms: f64,
    },
    /// A request failed (`id` is absent for a message that could not be read at all).
    Error {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        code: String,
        message: String,
    },
}

/// `POST /v1/sessions/{id}/ws-ticket`: a short-lived ticket that opens this session's
/// WebSocket as its owner (`?ticket=`), for clients that can set no header (browsers) and
/// should not put a bearer token in a URL.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct WsTicket {
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

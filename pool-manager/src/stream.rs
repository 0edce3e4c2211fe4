//! The internal session WebSocket: the `wire::ws` protocol served on top of the agent's
//! streaming execs. Gateways relay tenants' sockets here. Back-pressure is end to end: output
//! credit goes back to the agent only after a message was handed to the socket, so a slow
//! reader blocks the command on its full pipe instead of growing memory anywhere.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use agent_proto::{ErrorInfo, ExecSpec, ExitInfo, Kind};
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use futures::{SinkExt, StreamExt};
use http_util::ApiError;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use wire::ws::{ClientMsg, ServerMsg};
use wire::{Encoding, ErrorCode, b64_decode, b64_encode};

use crate::admit::{admit_live_call, resolve_path};
use crate::channel::{AgentConn, AgentError, ExecStream, StreamControl};
use crate::node::Node;
use crate::sandbox::Sandbox;

/// Messages queued for the socket before command tasks wait (and so stop crediting).
const OUTBOX: usize = 64;
/// SIGHUP, sent to a socket's running commands when it closes (a terminal hang-up).
const SIGHUP: u32 = 1;

pub(crate) async fn upgrade(
    State(node): State<Arc<Node>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let (sb, fence) = admit_live_call(&node, &id, &headers).await?;
    let Some(agent) = sb.agent.clone() else {
        return Err(ApiError::bad_request(format!(
            "template {:?} runs docker exec; streaming needs exec = \"agent\"",
            sb.template.name
        )));
    };
    let cancel = node.shutdown_token();
    let max_output = node.config.pool_manager.max_output_bytes;
    Ok(ws.on_upgrade(move |socket| serve(socket, sb, agent, fence, max_output, cancel)))
}

struct Running {
    control: StreamControl,
    encoding: Encoding,
}

async fn serve(
    socket: WebSocket,
    sb: Arc<Sandbox>,
    agent: AgentConn,
    fence: u64,
    max_output: u64,
    cancel: tokio_util::sync::CancellationToken,
) {
    let ws = telemetry::metrics::WsMetrics::open("pool_manager");
    let (mut sink, mut source) = socket.split();
    let (out_tx, mut out_rx) = mpsc::channel::<Message>(OUTBOX);
    let bytes_out = ws.bytes_out.clone();
    let writer = async move {
        while let Some(m) = out_rx.recv().await {
            let closing = matches!(m, Message::Close(_));
            if let Message::Text(t) = &m {
                bytes_out.increment(t.len() as u64);
            }
            if sink.send(m).await.is_err() || closing {
                break;
            }
        }
        let _ = sink.close().await;
    };
    let mut running: HashMap<String, Running> = HashMap::new();
    let mut tasks: JoinSet<String> = JoinSet::new();
    let reader = async {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => {
                    let reason = "node shutting down".into();
                    let _ = out_tx.send(Message::Close(Some(CloseFrame { code: 1001, reason }))).await;
                    break;
                }
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    if let Ok(id) = done {
                        running.remove(&id);
                    }
                }
                msg = source.next() => {
                    let text = match msg {
                        Some(Ok(Message::Text(t))) => {
                            ws.bytes_in.increment(t.len() as u64);
                            t.to_string()
                        }
                        Some(Ok(Message::Binary(_))) => {
                            send(&out_tx, error(None, "bad_request", "send JSON text messages")).await;
                            continue;
                        }
                        Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                        Some(Ok(_)) => continue,
                    };
                    match serde_json::from_str::<ClientMsg>(&text) {
                        Ok(m) => handle(m, &sb, &agent, (fence, max_output), &out_tx, &mut running, &mut tasks).await,
                        Err(e) => {
                            send(&out_tx, error(None, "bad_request", &format!("invalid message: {e}"))).await;
                        }
                    }
                }
            }
        }
        // The socket is gone: hang up on what still runs, as a terminal would, and lift flow
        // control so nothing waits for a reader that left.
        for r in running.values() {
            let _ = r.control.signal(SIGHUP).await;
            let _ = r.control.credit(u32::MAX).await;
        }
        tasks.shutdown().await;
        drop(out_tx);
    };
    tokio::join!(reader, writer);
}

async fn send(out: &mpsc::Sender<Message>, m: ServerMsg) -> bool {
    match serde_json::to_string(&m) {
        Ok(t) => out.send(Message::Text(t.into())).await.is_ok(),
        Err(_) => false,
    }
}

fn error(id: Option<&str>, code: &str, message: &str) -> ServerMsg {
    ServerMsg::Error { id: id.map(String::from), code: code.into(), message: message.into() }
}

fn decode(data: &str, enc: Encoding) -> Result<Vec<u8>, String> {
    match enc {
        Encoding::Utf8 => Ok(data.as_bytes().to_vec()),
        Encoding::Base64 => b64_decode(data),
    }
}

/// Text of a byte stream that arrives in chunks: a character split between two chunks is
/// held back (at most 3 bytes) and sent whole with the next, so only bytes that are not UTF-8
/// at all become U+FFFD, as they would in the whole output.
#[derive(Debug, Default)]
pub(crate) struct Utf8Stream {
    carry: Vec<u8>,
}

impl Utf8Stream {
    /// The text of `bytes` after what was held back, keeping back an incomplete last character.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> String {
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(bytes);
        let mut out = String::with_capacity(buf.len());
        let mut rest = &buf[..];
        loop {
            match std::str::from_utf8(rest) {
                Ok(text) => {
                    out.push_str(text);
                    return out;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        // Cut short by the chunk's end: the rest comes with the next one.
                        None => {
                            self.carry = after.to_vec();
                            return out;
                        }
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[n..];
                        }
                    }
                }
            }
        }
    }

    /// What is still held back, at the stream's end (an incomplete character: U+FFFD).
    pub(crate) fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.carry);
        String::from_utf8_lossy(&rest).into_owned()
    }
}

/// A stream's encoder: whole characters for `utf8` (`Utf8Stream`), plain base64 otherwise.
#[derive(Debug)]
struct Encoder {
    enc: Encoding,
    text: Utf8Stream,
}

impl Encoder {
    fn new(enc: Encoding) -> Encoder {
        Encoder { enc, text: Utf8Stream::default() }
    }

    fn push(&mut self, bytes: &[u8]) -> String {
        match self.enc {
            Encoding::Utf8 => self.text.push(bytes),
            Encoding::Base64 => b64_encode(bytes),
        }
    }

    fn finish(&mut self) -> String {
        self.text.finish()
    }
}

/// One client message. `call`: the lease's fence, and what a shell run keeps of its output.
async fn handle(
    m: ClientMsg,
    sb: &Arc<Sandbox>,
    agent: &AgentConn,
    call: (u64, u64),
    out: &mpsc::Sender<Message>,
    running: &mut HashMap<String, Running>,
    tasks: &mut JoinSet<String>,
) {
    let (fence, max_output) = call;
    let missing = |id: &str| error(Some(id), "not_found", &format!("no running command {id:?}"));
    match m {
        ClientMsg::Start { id, cmd, env, cwd, timeout_ms, pty, encoding } => {
            if running.contains_key(&id) {
                send(out, error(Some(&id), "conflict", "a command with this id is running")).await;
                return;
            }
            let argv = cmd.to_argv();
            if argv.first().is_none_or(|a| a.is_empty()) {
                send(out, error(Some(&id), "bad_request", "cmd: must not be empty")).await;
                return;
            }
            let cwd = match cwd.map(|c| resolve_path(&sb.template.workdir, &c)).transpose() {
                Ok(c) => c.unwrap_or_default(),
                Err(e) => {
                    send(out, error(Some(&id), "invalid_path", &e.body().message)).await;
                    return;
                }
            };
            let timeout_ms = match wire::timeouts::exec_timeout_ms(timeout_ms, wire::timeouts::DEFAULT_EXEC_TIMEOUT_MS)
            {
                Ok(t) => t,
                Err(why) => {
                    send(out, error(Some(&id), "bad_request", &why)).await;
                    return;
                }
            };
            let spec = ExecSpec {
                fence,
                argv,
                env: env.into_iter().collect(),
                cwd,
                timeout_ms,
                // Streams are flow-controlled, not capped.
                max_output: 0,
                has_stdin: true,
                pty_rows: pty.map(|p| p.rows).unwrap_or(0),
                pty_cols: pty.map(|p| p.cols).unwrap_or(0),
            };
            let stream = match agent.exec_stream(spec).await {
                Ok(s) => s,
                Err(e) => {
                    // Out of processes (the tenant's own, or still being reaped): retryable.
                    let busy = matches!(&e, AgentError::Remote(info) if info.code == agent_proto::codes::BUSY);
                    let code = if busy { ErrorCode::SandboxBusy } else { ErrorCode::SandboxFailed };
                    send(out, error(Some(&id), code.as_str(), &e.to_string())).await;
                    return;
                }
            };
            running.insert(id.clone(), Running { control: stream.control.clone(), encoding });
            send(out, ServerMsg::Started { id: id.clone() }).await;
            let out = out.clone();
            tasks.spawn(pump(id, stream, encoding, out));
        }
        ClientMsg::Stdin { id, data } => match running.get(&id) {
            Some(r) => match decode(&data, r.encoding) {
                Ok(bytes) => {
                    let _ = r.control.stdin(&bytes).await;
                }
                Err(e) => {
                    send(out, error(Some(&id), "bad_request", &format!("data: bad base64: {e}"))).await;
                }
            },
            None => {
                send(out, missing(&id)).await;
            }
        },
        ClientMsg::StdinEof { id } => match running.get(&id) {
            Some(r) => {
                let _ = r.control.stdin_eof().await;
            }
            None => {
                send(out, missing(&id)).await;
            }
        },
        ClientMsg::Resize { id, rows, cols } => match running.get(&id) {
            Some(r) => {
                let _ = r.control.resize(rows, cols).await;
            }
            None => {
                send(out, missing(&id)).await;
            }
        },
        ClientMsg::ShellRun { id, shell, cmd, timeout_ms, stdin } => {
            if running.contains_key(&id) {
                send(out, error(Some(&id), "conflict", "a command with this id is running")).await;
                return;
            }
            let sh = match sb.shells.get(&shell) {
                Ok(sh) => sh,
                Err(e) => {
                    send(out, error(Some(&id), e.code.as_str(), &e.message)).await;
                    return;
                }
            };
            send(out, ServerMsg::Started { id: id.clone() }).await;
            let (agent, out) = (agent.clone(), out.clone());
            tasks.spawn(async move {
                let (tx, mut rx) = mpsc::channel::<Vec<u8>>(OUTBOX);
                let forward = {
                    let (out, id) = (out.clone(), id.clone());
                    async move {
                        let mut text = Utf8Stream::default();
                        while let Some(bytes) = rx.recv().await {
                            let data = text.push(&bytes);
                            if !data.is_empty() {
                                send(&out, ServerMsg::Stdout { id: id.clone(), data }).await;
                            }
                        }
                        let data = text.finish();
                        if !data.is_empty() {
                            send(&out, ServerMsg::Stdout { id: id.clone(), data }).await;
                        }
                    }
                };
                let req = wire::shells::ShellRun { cmd, timeout_ms, stdin };
                let run = async {
                    let r = sh.run(&agent, fence, req, max_output, Some(&tx)).await;
                    drop(tx);
                    r
                };
                let (result, ()) = tokio::join!(run, forward);
                let msg = match result {
                    Ok(r) => ServerMsg::ShellExit {
                        id: id.clone(),
                        exit_code: r.exit_code,
                        cwd: r.cwd,
                        timed_out: r.timed_out,
                        truncated: r.truncated,
                        duration_ms: r.duration_ms,
                    },
                    Err(e) => error(Some(&id), e.code.as_str(), &e.message),
                };
                send(&out, msg).await;
                id
            });
        }
        ClientMsg::ShellInterrupt { shell } => {
            if let Err(e) = async { sb.shells.get(&shell)?.interrupt().await }.await {
                send(out, error(None, e.code.as_str(), &e.message)).await;
            }
        }
        ClientMsg::Signal { id, signal } => match running.get(&id) {
            Some(r) if (1..=64).contains(&signal) => {
                let _ = r.control.signal(signal).await;
            }
            Some(_) => {
                send(out, error(Some(&id), "bad_request", "signal: must be 1 ..= 64")).await;
            }
            None => {
                send(out, missing(&id)).await;
            }
        },
    }
}

/// Forwards one command's output to the socket, crediting the agent as messages leave.
async fn pump(id: String, mut stream: ExecStream, enc: Encoding, out: mpsc::Sender<Message>) -> String {
    let (mut stdout, mut stderr) = (Encoder::new(enc), Encoder::new(enc));
    loop {
        let frame = match tokio::time::timeout(Duration::from_secs(24 * 3600), stream.next()).await {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => {
                send(&out, error(Some(&id), "sandbox_failed", &e.to_string())).await;
                return id;
            }
            Err(_) => return id,
        };
        let msg = match frame.kind {
            // A chunk that only began a character sends nothing yet (it is credited all the same).
            Kind::Stdout => ServerMsg::Stdout { id: id.clone(), data: stdout.push(&frame.payload) },
            Kind::Stderr => ServerMsg::Stderr { id: id.clone(), data: stderr.push(&frame.payload) },
            Kind::Exit => {
                let info = ExitInfo::decode(&frame.payload).unwrap_or_default();
                // A last character the command left incomplete.
                for (data, stderr) in [(stdout.finish(), false), (stderr.finish(), true)] {
                    if !data.is_empty() {
                        let id = id.clone();
                        send(
                            &out,
                            if stderr { ServerMsg::Stderr { id, data } } else { ServerMsg::Stdout { id, data } },
                        )
                        .await;
                    }
                }
                send(
                    &out,
                    ServerMsg::Exit {
                        id: id.clone(),
                        exit_code: info.exit_code,
                        timed_out: info.timed_out,
                        duration_ms: info.duration_us as f64 / 1000.0,
                    },
                )
                .await;
                return id;
            }
            Kind::Error => {
                let e = ErrorInfo::decode(&frame.payload)
                    .unwrap_or_else(|_| ErrorInfo::new("error", "the agent sent a malformed error"));
                send(&out, error(Some(&id), &e.code, &e.message)).await;
                return id;
            }
            _ => continue,
        };
        // A chunk that only began a character sends nothing yet (it is credited all the same).
        let empty = matches!(&msg, ServerMsg::Stdout { data, .. } | ServerMsg::Stderr { data, .. } if data.is_empty());
        if !empty && !send(&out, msg).await {
            return id;
        }
        let _ = stream.control.credit(frame.payload.len() as u32).await;
    }
}

#[cfg(test)]
mod utf8_tests {
    use super::Utf8Stream;

    #[test]
    fn characters_split_between_chunks_arrive_whole() {
        let text = format!("x{}y", "€ü😀".repeat(1000));
        for size in [1, 2, 3, 4, 5, 7, 4093] {
            let mut s = Utf8Stream::default();
            let mut out: String = text.as_bytes().chunks(size).map(|c| s.push(c)).collect();
            out.push_str(&s.finish());
            assert_eq!(out, text, "chunks of {size}");
        }
    }

    #[test]
    fn bytes_that_are_not_utf8_become_one_replacement_each_as_in_the_whole() {
        let bytes = b"a\xffb\xe2\x82c\xe2";
        let mut s = Utf8Stream::default();
        let mut out: String = bytes.chunks(1).map(|c| s.push(c)).collect();
        out.push_str(&s.finish());
        assert_eq!(out, String::from_utf8_lossy(bytes));
    }
}

//! Invocations of a function in the sandbox that is one of its environments.
//!
//! Exec mode: each invocation is one agent exec of the handler with the payload on stdin; exit
//! status 0 makes its stdout the result. Runtime mode: the handler is a worker started by the
//! first invocation (one flow-controlled agent exec kept for the sandbox's life, like a
//! persistent shell) and fed frames of the runtime protocol (`sdk/runtime/PROTOCOL.md`) on its
//! stdin; a warm invocation spawns nothing. The node answers every outcome of the function
//! (a result, its error, a timeout, a crash) as 200 with `OUTCOME_HEADER`; the gateway decides
//! the status and whether the environment lives on.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agent_proto::{ErrorInfo, ExecSpec, ExitInfo, Kind, codes};
use bytes::Bytes;
use http_util::ApiError;
use serde_json::json;
use wire::ErrorCode;
use wire::functions::FunctionMode;
use wire::internal::{InvokeSpec, Outcome};

use crate::agent_bin::PYTHON_DIR_IN_SANDBOX;
use crate::channel::{AgentConn, AgentError, ExecStream, StreamControl};
use crate::sync::lock;

/// How long a runtime worker has to answer `READY`.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Beyond an invocation's timeout, how long the agent may take to report the end of a killed
/// exec-mode handler.
const EXEC_GRACE: Duration = Duration::from_secs(5);
/// The end of a worker's log kept for error messages.
const LOG_TAIL: usize = 2048;
/// The longest header line of the protocol (`RESULT <u64> <u64>\n`).
const MAX_HEADER: usize = 64;
const SIGKILL: u32 = 9;

/// What an invocation produced.
pub struct Answer {
    pub outcome: Outcome,
    /// The result (`Ok`) or the error as JSON.
    pub body: Vec<u8>,
    /// A runtime worker was started for it.
    pub cold: bool,
    /// The handler's own time (the worker's start excluded).
    pub duration: Duration,
}

fn error_body(kind: &str, message: impl Into<String>, extra: serde_json::Value) -> Vec<u8> {
    let mut v = json!({"type": kind, "message": message.into()});
    if let (Some(o), serde_json::Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    v.to_string().into_bytes()
}

/// The handler's environment variables: the function's, its name, and the Python runtime on
/// the module path.
fn handler_env(spec: &InvokeSpec) -> Vec<(String, String)> {
    let mut env: BTreeMap<String, String> = spec.env.clone();
    let name = spec.function.split('|').nth(1).unwrap_or_default();
    env.insert("SANDPOOL_FUNCTION".into(), name.to_string());
    let path = match env.get("PYTHONPATH") {
        Some(p) if !p.is_empty() => format!("{p}:{PYTHON_DIR_IN_SANDBOX}"),
        _ => PYTHON_DIR_IN_SANDBOX.to_string(),
    };
    env.insert("PYTHONPATH".into(), path);
    env.into_iter().collect()
}

/// The handler as an agent exec: its argv and environment, stdin open, in the workdir.
fn handler_exec(fence: u64, spec: &InvokeSpec, timeout_ms: u64, max_output: u64) -> ExecSpec {
    ExecSpec {
        fence,
        has_stdin: true,
        argv: spec.handler.clone(),
        env: handler_env(spec),
        cwd: String::new(),
        timeout_ms,
        max_output,
        pty_rows: 0,
        pty_cols: 0,
    }
}

/// Runs one invocation in an exec-mode environment.
pub(crate) async fn exec(
    agent: &AgentConn,
    fence: u64,
    spec: &InvokeSpec,
    payload: Bytes,
) -> Result<Answer, AgentError> {
    let exec = handler_exec(fence, spec, spec.timeout_ms, spec.max_result_bytes);
    let started = Instant::now();
    let out = match agent.exec(exec, Some(payload), Duration::from_millis(spec.timeout_ms) + EXEC_GRACE).await {
        Ok(out) => out,
        Err(AgentError::Remote(info)) if info.code == codes::NOT_FOUND || info.code == codes::PERMISSION_DENIED => {
            let body = error_body("HandlerNotRunnable", info.message, json!({}));
            return Ok(Answer { outcome: Outcome::Unhandled, body, cold: false, duration: started.elapsed() });
        }
        Err(e) => return Err(e),
    };
    let duration = Duration::from_micros(out.exit.duration_us);
    let tail = tail_text(&out.stderr);
    let (outcome, body) = if out.exit.timed_out {
        let msg = format!("the handler ran past the function's timeout of {} ms", spec.timeout_ms);
        (Outcome::Timeout, error_body("Timeout", msg, json!({"log": tail})))
    } else if out.exit.stdout_truncated {
        let msg = format!("the result is larger than {} bytes", spec.max_result_bytes);
        (Outcome::Unhandled, error_body("ResultTooLarge", msg, json!({"log": tail})))
    } else if out.exit.exit_code == 0 {
        (Outcome::Ok, out.stdout)
    } else {
        let msg = format!("the handler exited with status {}", out.exit.exit_code);
        (Outcome::Unhandled, error_body("ExitStatus", msg, json!({"exit_code": out.exit.exit_code, "log": tail})))
    };
    Ok(Answer { outcome, body, cold: false, duration })
}

fn tail_text(bytes: &[u8]) -> String {
    let from = bytes.len().saturating_sub(LOG_TAIL);
    String::from_utf8_lossy(&bytes[from..]).into_owned()
}

/// The runtime worker of one sandbox (at most one: an environment serves one function).
#[derive(Default)]
pub struct Runtime {
    worker: Mutex<Option<Arc<Worker>>>,
    /// Held while a worker starts, so two first invocations cannot start two.
    starting: tokio::sync::Mutex<()>,
}

/// A started runtime worker.
pub(crate) struct Worker {
    /// The function (and version) it serves.
    function: String,
    control: StreamControl,
    io: tokio::sync::Mutex<Io>,
    /// It exited, broke the protocol or was killed: it serves nothing more.
    gone: AtomicBool,
    next_id: AtomicU64,
}

struct Io {
    stream: ExecStream,
    /// Output read past the last frame.
    buf: Vec<u8>,
    /// The end of its stderr.
    log: VecDeque<u8>,
}

/// A frame from the worker.
enum Got {
    Frame {
        verb: String,
        id: u64,
        body: Vec<u8>,
    },
    /// It exited (its status) or its exec failed.
    Exited(Option<ExitInfo>),
    /// Not a frame of the protocol, or a body over the cap.
    Bad(String),
}

impl Io {
    fn log_text(&self) -> String {
        let (a, b) = self.log.as_slices();
        String::from_utf8_lossy(&[a, b].concat()).into_owned()
    }

    /// Reads the next frame, keeping stderr's tail and returning output credit as it goes.
    async fn next(&mut self, control: &StreamControl, max_body: u64) -> Result<Got, AgentError> {
        loop {
            if let Some(got) = parse(&mut self.buf, max_body) {
                return Ok(got);
            }
            let f = self.stream.next().await?;
            match f.kind {
                Kind::Stdout => {
                    control.credit(f.payload.len() as u32).await?;
                    self.buf.extend_from_slice(&f.payload);
                }
                Kind::Stderr => {
                    control.credit(f.payload.len() as u32).await?;
                    self.log.extend(f.payload.iter());
                    let over = self.log.len().saturating_sub(LOG_TAIL);
                    self.log.drain(..over);
                }
                Kind::Exit => return Ok(Got::Exited(ExitInfo::decode(&f.payload).ok())),
                Kind::Error => {
                    let why = ErrorInfo::decode(&f.payload).map(|e| e.message).unwrap_or_default();
                    self.log.extend(why.bytes());
                    return Ok(Got::Exited(None));
                }
                k => return Ok(Got::Bad(format!("unexpected {k:?} from the worker's exec"))),
            }
        }
    }
}

/// A whole frame at the head of `buf`, taken out of it, if there is one.
fn parse(buf: &mut Vec<u8>, max_body: u64) -> Option<Got> {
    let Some(nl) = buf.iter().take(MAX_HEADER).position(|&b| b == b'\n') else {
        return (buf.len() >= MAX_HEADER).then(|| Got::Bad("a header line longer than 64 bytes".into()));
    };
    let line = String::from_utf8_lossy(&buf[..nl]).into_owned();
    let mut parts = line.split(' ');
    let (Some(verb), Some(id), Some(len), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Some(Got::Bad(format!("not a frame header: {line:?}")));
    };
    let (Ok(id), Ok(len)) = (id.parse::<u64>(), len.parse::<u64>()) else {
        return Some(Got::Bad(format!("not a frame header: {line:?}")));
    };
    if len > max_body {
        return Some(Got::Bad(format!("a {len}-byte frame, over the cap of {max_body}")));
    }
    let end = nl + 1 + len as usize;
    if buf.len() < end {
        return None;
    }
    let body = buf[nl + 1..end].to_vec();
    buf.drain(..end);
    Some(Got::Frame { verb: verb.to_string(), id, body })
}

impl Runtime {
    /// Runs one invocation in a runtime-mode environment, starting its worker first if needed.
    pub async fn invoke(
        &self,
        agent: &AgentConn,
        fence: u64,
        spec: &InvokeSpec,
        payload: Bytes,
    ) -> Result<Answer, ApiError> {
        let (worker, cold) = match self.worker_for(agent, fence, spec).await? {
            Ok(started) => started,
            Err(answer) => return Ok(answer),
        };
        worker.invoke(spec, payload, cold).await
    }

    /// The worker for `spec.function`, started if there is none: `Err(answer)` when it could
    /// not start (the answer says why, as the function's error).
    async fn worker_for(
        &self,
        agent: &AgentConn,
        fence: u64,
        spec: &InvokeSpec,
    ) -> Result<Result<(Arc<Worker>, bool), Answer>, ApiError> {
        let _starting = self.starting.lock().await;
        if let Some(w) = lock(&self.worker).clone() {
            if w.function != spec.function {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    "this environment serves another function (environments are never shared)",
                ));
            }
            return Ok(Ok((w, false)));
        }
        let started = Instant::now();
        // The worker lives as long as its environment; its output is flow-controlled.
        let exec = handler_exec(fence, spec, 0, 0);
        let failed = |e: AgentError| ApiError::bad_gateway("the function's worker could not start", e.to_string());
        let stream = match agent.exec_stream(exec).await {
            Ok(s) => s,
            Err(AgentError::Remote(info)) if info.code == codes::NOT_FOUND || info.code == codes::PERMISSION_DENIED => {
                let body = error_body("HandlerNotRunnable", info.message, json!({}));
                return Ok(Err(Answer { outcome: Outcome::Unhandled, body, cold: true, duration: started.elapsed() }));
            }
            Err(e) => return Err(failed(e)),
        };
        let control = stream.control.clone();
        let mut io = Io { stream, buf: Vec::new(), log: VecDeque::new() };
        let ready = tokio::time::timeout(READY_TIMEOUT, io.next(&control, spec.max_result_bytes)).await;
        let not_ready =
            |outcome: Outcome, body: Vec<u8>| Answer { outcome, body, cold: true, duration: started.elapsed() };
        let got = match ready {
            Err(_) => {
                let _ = control.signal(SIGKILL).await;
                let msg = format!("the worker did not answer READY within {} s", READY_TIMEOUT.as_secs());
                return Ok(Err(not_ready(
                    Outcome::Timeout,
                    error_body("InitTimeout", msg, json!({"log": io.log_text()})),
                )));
            }
            Ok(got) => got.map_err(failed)?,
        };
        match got {
            Got::Frame { verb, id: 0, .. } if verb == "READY" => {}
            // The runtime's own report of a failed start (a missing module, an import error).
            Got::Frame { verb, id: 0, body } if verb == "ERROR" => {
                let _ = control.signal(SIGKILL).await;
                return Ok(Err(not_ready(Outcome::Unhandled, body)));
            }
            Got::Exited(exit) => {
                let status = exit.map_or("failed".to_string(), |e| format!("exited with status {}", e.exit_code));
                let msg = format!("the worker {status} before it was ready");
                return Ok(Err(not_ready(
                    Outcome::Crashed,
                    error_body("InitCrashed", msg, json!({"log": io.log_text()})),
                )));
            }
            Got::Frame { verb, .. } => {
                let _ = control.signal(SIGKILL).await;
                let msg = format!("the worker's first frame was {verb:?}, not READY");
                return Ok(Err(not_ready(Outcome::Crashed, error_body("ProtocolError", msg, json!({})))));
            }
            Got::Bad(why) => {
                let _ = control.signal(SIGKILL).await;
                return Ok(Err(not_ready(Outcome::Crashed, error_body("ProtocolError", why, json!({})))));
            }
        }
        let worker = Arc::new(Worker {
            function: spec.function.clone(),
            control,
            io: tokio::sync::Mutex::new(io),
            gone: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
        });
        *lock(&self.worker) = Some(worker.clone());
        Ok(Ok((worker, true)))
    }
}

impl Worker {
    async fn invoke(&self, spec: &InvokeSpec, payload: Bytes, cold: bool) -> Result<Answer, ApiError> {
        let Ok(mut io) = self.io.try_lock() else {
            return Err(ApiError::new(ErrorCode::Conflict, "this environment is serving another invocation"));
        };
        let crashed = |msg: String, log: String, duration: Duration| Answer {
            outcome: Outcome::Crashed,
            body: error_body("Crashed", msg, json!({"log": log})),
            cold,
            duration,
        };
        if self.gone.load(Ordering::Acquire) {
            return Ok(crashed("the worker has exited".into(), io.log_text(), Duration::ZERO));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let mut frame = format!("INVOKE {id} {}\n", payload.len()).into_bytes();
        frame.extend_from_slice(&payload);
        let fail = |e: AgentError| ApiError::bad_gateway("the function's worker failed", e.to_string());
        self.control.stdin(&frame).await.map_err(fail)?;
        let got =
            tokio::time::timeout(Duration::from_millis(spec.timeout_ms), io.next(&self.control, spec.max_result_bytes))
                .await;
        let duration = started.elapsed();
        let got = match got {
            Err(_) => {
                self.kill().await;
                let msg = format!("the handler ran past the function's timeout of {} ms", spec.timeout_ms);
                let body = error_body("Timeout", msg, json!({"log": io.log_text()}));
                return Ok(Answer { outcome: Outcome::Timeout, body, cold, duration });
            }
            Ok(got) => got.map_err(fail)?,
        };
        Ok(match got {
            Got::Frame { verb, id: got_id, body } if got_id == id && verb == "RESULT" => {
                Answer { outcome: Outcome::Ok, body, cold, duration }
            }
            Got::Frame { verb, id: got_id, body } if got_id == id && verb == "ERROR" => {
                Answer { outcome: Outcome::Handled, body, cold, duration }
            }
            Got::Frame { verb, id: got_id, .. } => {
                self.kill().await;
                crashed(
                    format!("the worker broke the protocol: {verb} {got_id} during invocation {id}"),
                    io.log_text(),
                    duration,
                )
            }
            Got::Bad(why) => {
                self.kill().await;
                crashed(format!("the worker broke the protocol: {why}"), io.log_text(), duration)
            }
            Got::Exited(exit) => {
                self.gone.store(true, Ordering::Release);
                let status = exit.map_or("failed".to_string(), |e| format!("exited with status {}", e.exit_code));
                crashed(format!("the worker {status} during the invocation"), io.log_text(), duration)
            }
        })
    }

    async fn kill(&self) {
        self.gone.store(true, Ordering::Release);
        let _ = self.control.signal(SIGKILL).await;
    }
}

/// Dispatches one invocation by the function's mode.
pub(crate) async fn invoke(
    runtime: &Runtime,
    agent: &AgentConn,
    fence: u64,
    spec: &InvokeSpec,
    payload: Bytes,
) -> Result<Answer, ApiError> {
    match spec.mode {
        FunctionMode::Exec => exec(agent, fence, spec, payload)
            .await
            .map_err(|e| ApiError::bad_gateway("the function's handler could not run", e.to_string())),
        FunctionMode::Runtime => runtime.invoke(agent, fence, spec, payload).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(env: &[(&str, &str)]) -> InvokeSpec {
        InvokeSpec {
            function: "acme/rl|reward|3".into(),
            mode: FunctionMode::Runtime,
            handler: vec!["w".into()],
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            timeout_ms: 1000,
            max_result_bytes: 100,
        }
    }

    fn frame(got: Option<Got>) -> (String, u64, Vec<u8>) {
        match got {
            Some(Got::Frame { verb, id, body }) => (verb, id, body),
            _ => panic!("not a frame"),
        }
    }

    #[test]
    fn frames_are_parsed_across_chunks_and_bad_ones_refused() {
        let mut buf = b"READY 0 0\nRESULT 1 5\nhel".to_vec();
        assert_eq!(frame(parse(&mut buf, 100)), ("READY".into(), 0, vec![]));
        assert!(parse(&mut buf, 100).is_none(), "a body not yet whole");
        buf.extend_from_slice(b"loERROR 2 2\n{}");
        assert_eq!(frame(parse(&mut buf, 100)), ("RESULT".into(), 1, b"hello".to_vec()));
        assert_eq!(frame(parse(&mut buf, 100)), ("ERROR".into(), 2, b"{}".to_vec()));
        assert!(buf.is_empty());
        assert!(parse(&mut buf, 100).is_none());
        for bad in [&b"hello world\n"[..], b"RESULT x 1\n", b"RESULT 1 101\n", b"RESULT 1 2 3\n", &[b'A'; 64]] {
            assert!(matches!(parse(&mut bad.to_vec(), 100), Some(Got::Bad(_))), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn the_handler_gets_its_name_and_the_runtime_on_its_module_path() {
        let env: BTreeMap<_, _> = handler_env(&spec(&[("A", "1")])).into_iter().collect();
        assert_eq!(env["SANDPOOL_FUNCTION"], "reward");
        assert_eq!(env["PYTHONPATH"], PYTHON_DIR_IN_SANDBOX);
        assert_eq!(env["A"], "1");
        let env: BTreeMap<_, _> = handler_env(&spec(&[("PYTHONPATH", "/app")])).into_iter().collect();
        assert_eq!(env["PYTHONPATH"], format!("/app:{PYTHON_DIR_IN_SANDBOX}"));
    }
}

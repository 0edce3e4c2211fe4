//! Test support: the agent binary as a child process, spoken to in frames over its stdio.

use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use agent_proto::{
    Dec, Enc, ErrorInfo, ExecFlowSpec, ExecSpec, ExitInfo, Frame, Kind, MAX_CHUNK, ReadSpec, WinSize, WriteSpec,
};

/// Upper bound for any single wait in these tests, so a bug fails instead of hanging.
pub const WAIT: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Inbox {
    frames: HashMap<u32, Vec<Frame>>,
    closed: bool,
}

/// A running agent. Killed on drop.
pub struct Agent {
    child: Child,
    stdin: ChildStdin,
    inbox: Arc<(Mutex<Inbox>, Condvar)>,
    next_id: AtomicU32,
}

/// What an exec produced.
#[derive(Debug)]
pub struct ExecOut {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit: ExitInfo,
    /// `Stdin` frames acknowledged (flow-controlled execs only).
    pub stdin_acks: u32,
}

impl ExecOut {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// The final frame of a request, when it is an error.
pub fn error_of(frames: &[Frame]) -> Option<ErrorInfo> {
    let last = frames.last()?;
    (last.kind == Kind::Error).then(|| ErrorInfo::decode(&last.payload).unwrap())
}

pub fn spec(argv: &[&str]) -> ExecSpec {
    ExecSpec { argv: argv.iter().map(|s| s.to_string()).collect(), timeout_ms: 20_000, ..ExecSpec::default() }
}

pub fn sh(script: &str) -> ExecSpec {
    spec(&["sh", "-c", script])
}

/// A fresh directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sandpool-agent-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Deterministic pseudo-random bytes (xorshift), so binary round trips cover every value.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

impl Agent {
    /// Starts the agent. `SANDPOOL_AGENT_BIN` overrides which binary (e.g. the static build).
    pub fn start() -> Agent {
        let bin = std::env::var_os("SANDPOOL_AGENT_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_sandpool-agent").into());
        let mut child = Command::new(bin)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn agent");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let inbox = Arc::new((Mutex::new(Inbox::default()), Condvar::new()));
        let inbox2 = Arc::clone(&inbox);
        std::thread::spawn(move || {
            let mut r = BufReader::with_capacity(256 * 1024, stdout);
            let (m, cv) = &*inbox2;
            loop {
                let frame = Frame::read_from(&mut r);
                let mut inbox = m.lock().unwrap();
                match frame {
                    Ok(Some(f)) => inbox.frames.entry(f.id).or_default().push(f),
                    Ok(None) | Err(_) => {
                        inbox.closed = true;
                        cv.notify_all();
                        return;
                    }
                }
                cv.notify_all();
            }
        });
        Agent { child, stdin, inbox, next_id: AtomicU32::new(1) }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    pub fn id(&self) -> u32 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn send(&mut self, kind: Kind, id: u32, payload: &[u8]) {
        self.send_raw(&Frame::new(kind, id, payload.to_vec()).encode());
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.stdin.write_all(bytes).expect("write to agent");
        self.stdin.flush().unwrap();
    }

    /// Sends `data` as chunk frames of `kind`.
    pub fn send_chunks(&mut self, kind: Kind, id: u32, data: &[u8]) {
        for chunk in data.chunks(MAX_CHUNK) {
            self.send(kind, id, chunk);
        }
    }

    /// Waits for request `id`'s final frame and returns all its frames, in order.
    pub fn finish(&self, id: u32) -> Vec<Frame> {
        let (m, cv) = &*self.inbox;
        let deadline = Instant::now() + WAIT;
        let mut inbox = m.lock().unwrap();
        loop {
            let done = inbox.frames.get(&id).and_then(|f| f.last()).is_some_and(|f| {
                matches!(f.kind, Kind::Exit | Kind::Error | Kind::Done | Kind::End | Kind::Pong | Kind::Hello)
            });
            if done {
                return inbox.frames.remove(&id).unwrap();
            }
            assert!(!inbox.closed, "agent stdout closed while waiting for request {id}");
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no final frame for request {id} within {WAIT:?}");
            inbox = cv.wait_timeout(inbox, left).unwrap().0;
        }
    }

    /// Frames received so far for `id`, without waiting.
    pub fn frames_so_far(&self, id: u32) -> usize {
        self.inbox.0.lock().unwrap().frames.get(&id).map_or(0, Vec::len)
    }

    /// Waits until request `id`'s frames so far satisfy `cond`; returns them (leaving them in
    /// the inbox).
    pub fn wait_frames(&self, id: u32, what: &str, cond: impl Fn(&[Frame]) -> bool) -> Vec<Frame> {
        let (m, cv) = &*self.inbox;
        let deadline = Instant::now() + WAIT;
        let mut inbox = m.lock().unwrap();
        loop {
            let frames = inbox.frames.get(&id).map_or(&[][..], Vec::as_slice);
            if cond(frames) {
                return frames.to_vec();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if inbox.closed || left.is_zero() {
                let why = if inbox.closed { "agent stdout closed" } else { "timed out" };
                let msg = format!("{why} waiting for {what}; frames so far: {}", summary(frames));
                // Unlocked first, so the reader thread does not die of a poisoned lock.
                drop(inbox);
                panic!("{msg}");
            }
            inbox = cv.wait_timeout(inbox, left).unwrap().0;
        }
    }

    /// Waits until request `id`'s stdout so far satisfies `cond`; returns it as text.
    pub fn wait_stdout(&self, id: u32, what: &str, cond: impl Fn(&str) -> bool) -> String {
        let frames = self.wait_frames(id, what, |frames| cond(&String::from_utf8_lossy(&stdout_of(frames))));
        String::from_utf8_lossy(&stdout_of(&frames)).into_owned()
    }

    /// Request `id`'s frames so far, without waiting.
    pub fn frames_now(&self, id: u32) -> Vec<Frame> {
        self.inbox.0.lock().unwrap().frames.get(&id).cloned().unwrap_or_default()
    }

    /// Starts a flow-controlled exec with `credit` bytes of output credit.
    pub fn start_flow(&mut self, spec: &ExecSpec, credit: u32) -> u32 {
        let id = self.id();
        self.send(Kind::ExecFlow, id, &ExecFlowSpec { credit, spec: spec.clone() }.encode());
        id
    }

    pub fn credit(&mut self, id: u32, bytes: u32) {
        self.send(Kind::Credit, id, &bytes.to_le_bytes());
    }

    pub fn resize(&mut self, id: u32, rows: u16, cols: u16) {
        self.send(Kind::Resize, id, &WinSize { rows, cols }.encode());
    }

    pub fn signal(&mut self, id: u32, sig: u32) {
        self.send(Kind::Signal, id, &Enc::default().u32(sig).finish());
    }

    pub fn start_exec(&mut self, spec: &ExecSpec) -> u32 {
        let id = self.id();
        self.send(Kind::Exec, id, &spec.encode());
        id
    }

    /// Collects an exec's output; panics if it ended with an error.
    pub fn exec_result(&self, id: u32) -> ExecOut {
        let frames = self.finish(id);
        let mut out = ExecOut { stdout: Vec::new(), stderr: Vec::new(), exit: ExitInfo::default(), stdin_acks: 0 };
        for f in frames {
            match f.kind {
                Kind::Stdout => out.stdout.extend_from_slice(&f.payload),
                Kind::Stderr => out.stderr.extend_from_slice(&f.payload),
                Kind::StdinAck => out.stdin_acks += Dec::new(&f.payload).u32().unwrap(),
                Kind::Exit => out.exit = ExitInfo::decode(&f.payload).unwrap(),
                Kind::Error => panic!("exec {id} failed: {:?}", ErrorInfo::decode(&f.payload).unwrap()),
                other => panic!("unexpected {other:?} frame for exec {id}"),
            }
        }
        out
    }

    pub fn exec(&mut self, spec: &ExecSpec) -> ExecOut {
        let id = self.start_exec(spec);
        self.exec_result(id)
    }

    /// Runs a command with `input` as its stdin.
    pub fn exec_with_stdin(&mut self, spec: &ExecSpec, input: &[u8]) -> ExecOut {
        let spec = ExecSpec { has_stdin: true, ..spec.clone() };
        let id = self.start_exec(&spec);
        self.send_chunks(Kind::Stdin, id, input);
        self.send(Kind::StdinEof, id, &[]);
        self.exec_result(id)
    }

    /// Reads a file: its bytes, or the error.
    pub fn read(&mut self, spec: &ReadSpec) -> Result<Vec<u8>, ErrorInfo> {
        let id = self.id();
        self.send(Kind::ReadFile, id, &spec.encode());
        let frames = self.finish(id);
        if let Some(err) = error_of(&frames) {
            return Err(err);
        }
        let (end, data) = frames.split_last().unwrap();
        assert_eq!(end.kind, Kind::End);
        let body: Vec<u8> = data
            .iter()
            .flat_map(|f| {
                assert_eq!(f.kind, Kind::Data);
                assert!(f.payload.len() <= MAX_CHUNK);
                f.payload.iter().copied()
            })
            .collect();
        assert_eq!(Dec::new(&end.payload).u64().unwrap(), body.len() as u64);
        Ok(body)
    }

    /// Starts an upload and sends its data, without waiting for the answer.
    pub fn start_write(&mut self, spec: &WriteSpec, data: &[u8]) -> u32 {
        let id = self.id();
        self.send(Kind::WriteFile, id, &spec.encode());
        self.send_chunks(Kind::Data, id, data);
        self.send(Kind::End, id, &[]);
        id
    }

    /// The answer to an upload: bytes written, or the error.
    pub fn write_result(&self, id: u32) -> Result<u64, ErrorInfo> {
        let frames = self.finish(id);
        if let Some(err) = error_of(&frames) {
            return Err(err);
        }
        assert_eq!(frames.len(), 1, "{frames:?}");
        assert_eq!(frames[0].kind, Kind::Done);
        Ok(Dec::new(&frames[0].payload).u64().unwrap())
    }

    pub fn write(&mut self, spec: &WriteSpec, data: &[u8]) -> Result<u64, ErrorInfo> {
        let id = self.start_write(spec, data);
        self.write_result(id)
    }

    pub fn ping(&mut self) {
        let id = self.id();
        self.send(Kind::Ping, id, &[]);
        let frames = self.finish(id);
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].kind, Kind::Pong);
        assert_eq!(Dec::new(&frames[0].payload).u32().unwrap(), agent_proto::PROTOCOL_VERSION);
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The concatenated `Stdout` payloads among `frames`.
pub fn stdout_of(frames: &[Frame]) -> Vec<u8> {
    frames.iter().filter(|f| f.kind == Kind::Stdout).flat_map(|f| f.payload.iter().copied()).collect()
}

/// Payload bytes of `kind` among `frames`.
pub fn bytes_of(frames: &[Frame], kind: Kind) -> usize {
    frames.iter().filter(|f| f.kind == kind).map(|f| f.payload.len()).sum()
}

/// The number of `StdinAck`ed frames among `frames`.
pub fn acks_of(frames: &[Frame]) -> u32 {
    frames.iter().filter(|f| f.kind == Kind::StdinAck).map(|f| Dec::new(&f.payload).u32().unwrap()).sum()
}

/// Whether the request's final frame is among `frames`.
pub fn ended(frames: &[Frame]) -> bool {
    frames.iter().any(|f| matches!(f.kind, Kind::Exit | Kind::Error))
}

/// Frame kinds and sizes, for failure messages.
fn summary(frames: &[Frame]) -> String {
    let text = String::from_utf8_lossy(&stdout_of(frames)).into_owned();
    let tail: String = text.chars().rev().take(400).collect::<Vec<_>>().into_iter().rev().collect();
    format!("{} frames, last {:?}, stdout ends {tail:?}", frames.len(), frames.last().map(|f| f.kind))
}

/// Polls `cond` until it holds or `WAIT` passes.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether `pid` is gone or a zombie (killed, waiting for some reaper that is not ours).
pub fn dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

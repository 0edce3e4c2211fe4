// One file over 600 lines (583 without its tests): a run's protocol (start, write, collect,
// end by marker, interrupt, kill) is one state machine over the same marker and collector.
//! Persistent shells: a long-lived `sh` or `bash` per name in a sandbox, driven through one
//! streaming exec of the agent, so the working directory, variables, functions, aliases and
//! background jobs carry over from one run to the next. No agent change: the host writes each
//! run to the shell's stdin and finds its end without sleeping or guessing.
//!
//! How a run ends. At start the shell moves its own stderr to fd 3 and sends its stderr to its
//! stdout (`exec 3>&2 2>&1`): the command's output, both streams interleaved as written,
//! arrives as the exec's stdout; fd 3, the exec's stderr, is the control channel. The agent
//! writes the run's text (and stdin) into a file, and the shell sources it with fd 3 closed
//! (`command . FILE 3>&-`; `command` keeps a syntax error from ending the shell), so neither
//! the command nor anything it starts can write to the control channel, and a run spawns no
//! process of its own (a run of `true` starts none at all). Then the shell prints the marker
//! on stdout and `SPCTL_<marker> <status> <cwd>` on fd 3. A run is over when both arrived:
//! the control line says the command finished, the stdout marker that every byte it printed
//! before has been read (the agent forwards the two pipes independently). A command that
//! prints a marker-like string cannot end a run: the marker is 128 random bits, new per run.
//!
//! Timeouts and interrupts work like Ctrl-C at a terminal: SIGINT to the shell's process group
//! (the shell traps it and lives on; its children do not); if the command is still running
//! after a grace, every descendant of the shell gets SIGKILL; if even then the run does not
//! end (a loop in the shell itself), the shell is killed and later runs answer `shell_gone`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use agent_proto::{ErrorInfo, ExecSpec, ExitInfo, Kind, WriteSpec};
use http_util::ApiError;
use wire::ErrorCode;
use wire::shells::{CreateShell, MAX_SHELLS, ShellInfo, ShellResult, ShellRun, name_problem};

use crate::channel::{AgentConn, AgentError, ExecStream, StreamControl};
use crate::sync::lock;

/// Where runs' command files live in the sandbox, for the moment of a run.
const RUN_DIR: &str = "/tmp/.sandpool-shells";
/// How long a new shell has to say it is ready.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// After SIGINT, and again after SIGKILL of the descendants, how long a run may take to end.
const INTERRUPT_GRACE: Duration = Duration::from_secs(2);
/// How long a run waits for the shell's previous run to end before it answers "busy": a
/// client that hangs up mid-run ends its run only when the node notices the closed connection
/// (under load, after its next request can already have arrived).
const BUSY_GRACE: Duration = Duration::from_secs(1);
const SIGINT: u32 = 2;
const SIGKILL: u32 = 9;

/// Kills every descendant of the process `$1` (not `$1` itself): run by a separate exec at an
/// interrupt's second step. Portable to busybox: reads `PPid` from `/proc/*/status`.
const KILL_DESCENDANTS: &str = r#"root=$1
tab=$(for s in /proc/[0-9]*/status; do pp=$(grep -m1 '^PPid:' "$s" 2>/dev/null) || continue; p=${s#/proc/}; echo "${p%/status} ${pp##*[!0-9]}"; done)
todo=$root; victims=
while [ -n "$todo" ]; do
  next=$(echo "$tab" | while read -r a b; do for t in $todo; do [ "$b" = "$t" ] && echo "$a"; done; done)
  victims="$victims $next"; todo=$(echo $next)
done
[ -n "$(echo $victims)" ] && kill -9 $victims 2>/dev/null
exit 0"#;

/// The shells of one sandbox.
#[derive(Default)]
pub struct Shells {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_name: BTreeMap<String, Arc<Shell>>,
    /// Names being started (counted against the limit, refused as duplicates).
    starting: Vec<String>,
    next: u32,
}

/// One persistent shell.
pub struct Shell {
    name: String,
    kind: String,
    control: StreamControl,
    /// The shell's pid inside the sandbox.
    pid: u32,
    cwd: Mutex<String>,
    /// Held by a run: one run at a time.
    io: tokio::sync::Mutex<Io>,
    gone: AtomicBool,
    /// The marker of a run whose caller went away before it ended: its command was
    /// interrupted, and the next run first reads past that run's end.
    abandoned: Mutex<Option<String>>,
}

/// The shell's output stream and what was read past the last run's end.
struct Io {
    stream: ExecStream,
    /// Output after the last run's marker (a background job's): the next run's first bytes.
    leftover: Vec<u8>,
}

/// The shells' errors as answers.
fn gone(name: &str) -> ApiError {
    ApiError::new(ErrorCode::ShellGone, format!("shell {name:?} has exited; open a new one"))
}

fn failed(what: &str, e: AgentError) -> ApiError {
    ApiError::bad_gateway(format!("the shell could not {what}"), e.to_string())
}

impl Shells {
    pub fn list(&self) -> Vec<ShellInfo> {
        lock(&self.inner).by_name.values().map(|s| s.info()).collect()
    }

    pub fn get(&self, name: &str) -> Result<Arc<Shell>, ApiError> {
        lock(&self.inner)
            .by_name
            .get(name)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("no shell {name:?} in this session")))
    }

    /// Starts a shell. `cwd`: resolved against the template's workdir already.
    pub async fn open(
        &self,
        agent: &AgentConn,
        fence: u64,
        req: CreateShell,
        cwd: String,
    ) -> Result<ShellInfo, ApiError> {
        let kind = req.shell.clone().unwrap_or_else(|| "sh".into());
        if kind != "sh" && kind != "bash" {
            return Err(ApiError::bad_request("shell: \"sh\" or \"bash\""));
        }
        for k in req.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(ApiError::bad_request(format!("env: {k:?} is not a valid variable name")));
            }
        }
        let name = {
            let mut inner = lock(&self.inner);
            let name = match req.name.clone() {
                Some(n) => {
                    if let Some(p) = name_problem(&n) {
                        return Err(ApiError::bad_request(format!("name: {p}")));
                    }
                    n
                }
                None => loop {
                    inner.next += 1;
                    let n = format!("shell-{}", inner.next);
                    if !inner.by_name.contains_key(&n) && !inner.starting.contains(&n) {
                        break n;
                    }
                },
            };
            if inner.by_name.contains_key(&name) || inner.starting.contains(&name) {
                return Err(ApiError::new(ErrorCode::Conflict, format!("a shell {name:?} exists already")));
            }
            if inner.by_name.len() + inner.starting.len() >= MAX_SHELLS {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!("a session holds at most {MAX_SHELLS} shells; delete one first"),
                ));
            }
            inner.starting.push(name.clone());
            name
        };
        let started = start(agent, fence, &name, &kind, req.env, cwd).await;
        let mut inner = lock(&self.inner);
        inner.starting.retain(|n| n != &name);
        let shell = Arc::new(started?);
        let info = shell.info();
        inner.by_name.insert(name, shell);
        Ok(info)
    }

    /// Ends a shell (and everything it started in its process group).
    pub async fn close(&self, name: &str) -> Result<(), ApiError> {
        let shell = lock(&self.inner).by_name.remove(name);
        let Some(shell) = shell else { return Err(ApiError::not_found(format!("no shell {name:?} in this session"))) };
        shell.gone.store(true, Ordering::Release);
        let _ = shell.control.signal(SIGKILL).await;
        Ok(())
    }
}

/// Starts a shell and waits for it to say it is ready (its pid and directory).
async fn start(
    agent: &AgentConn,
    fence: u64,
    name: &str,
    kind: &str,
    env: BTreeMap<String, String>,
    cwd: String,
) -> Result<Shell, ApiError> {
    let spec = ExecSpec {
        fence,
        argv: vec![kind.to_string(), "-s".into()],
        env: env.into_iter().collect(),
        cwd,
        // The shell lives as long as the session (or until closed); its output is
        // flow-controlled, not capped: runs cap what they keep.
        timeout_ms: 0,
        max_output: 0,
        has_stdin: true,
        pty_rows: 0,
        pty_cols: 0,
    };
    let mut stream = agent.exec_stream(spec).await.map_err(|e| failed("start", e))?;
    let control = stream.control.clone();
    let aliases = if kind == "bash" { "shopt -s expand_aliases\n" } else { "" };
    let init = format!(
        "exec 3>&2 2>&1\ntrap ':' INT\n{aliases}command mkdir -p {RUN_DIR} && command chmod 1777 {RUN_DIR} 2>/dev/null\ncommand printf 'SPREADY %s %s\\n' \"$$\" \"$PWD\" >&3\n"
    );
    control.stdin(init.as_bytes()).await.map_err(|e| failed("start", e))?;
    let mut ctl = Vec::new();
    let ready = tokio::time::timeout(START_TIMEOUT, async {
        loop {
            let f = stream.next().await.map_err(|e| failed("start", e))?;
            match f.kind {
                Kind::Stderr => {
                    control.credit(f.payload.len() as u32).await.map_err(|e| failed("start", e))?;
                    ctl.extend_from_slice(&f.payload);
                    if let Some(line) = take_line(&mut ctl, "SPREADY ") {
                        return Ok(line);
                    }
                }
                Kind::Stdout => control.credit(f.payload.len() as u32).await.map_err(|e| failed("start", e))?,
                Kind::Error => {
                    let why = ErrorInfo::decode(&f.payload).map(|e| e.message).unwrap_or_default();
                    return Err(ApiError::bad_request(format!("shell {kind:?} cannot start in this sandbox: {why}")));
                }
                _ => return Err(ApiError::bad_request(format!("shell {kind:?} exited at start"))),
            }
        }
    })
    .await
    .map_err(|_| ApiError::gateway_timeout("the shell did not start in time"))??;
    let (pid, cwd) = ready.split_once(' ').unwrap_or((ready.as_str(), ""));
    let pid =
        pid.parse().map_err(|_| ApiError::bad_gateway("the shell did not start", format!("ready line {ready:?}")))?;
    Ok(Shell {
        name: name.to_string(),
        kind: kind.to_string(),
        control,
        pid,
        cwd: Mutex::new(cwd.to_string()),
        io: tokio::sync::Mutex::new(Io { stream, leftover: Vec::new() }),
        gone: AtomicBool::new(false),
        abandoned: Mutex::new(None),
    })
}

/// Takes the first complete line starting with `prefix` out of `buf` (dropping what precedes
/// it), without the prefix and newline.
fn take_line(buf: &mut Vec<u8>, prefix: &str) -> Option<String> {
    let start = find(buf, prefix.as_bytes())?;
    let end = start + buf[start..].iter().position(|&b| b == b'\n')?;
    let line = String::from_utf8_lossy(&buf[start + prefix.len()..end]).into_owned();
    buf.drain(..=end);
    Some(line)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Output of a run as it arrives: kept up to a cap, with the end marker found across chunk
/// boundaries.
struct Collector {
    marker: Vec<u8>,
    kept: Vec<u8>,
    cap: usize,
    truncated: bool,
    /// Bytes that may be the start of the marker.
    pending: Vec<u8>,
    /// Bytes after the marker (for the next run), once it was seen.
    after: Option<Vec<u8>>,
    /// Kept bytes not yet streamed (when the run streams its output).
    fresh: Option<Vec<u8>>,
}

impl Collector {
    fn push(&mut self, chunk: &[u8]) {
        if let Some(after) = &mut self.after {
            after.extend_from_slice(chunk);
            return;
        }
        let mut buf = std::mem::take(&mut self.pending);
        buf.extend_from_slice(chunk);
        match find(&buf, &self.marker) {
            Some(i) => {
                self.keep(&buf[..i]);
                self.after = Some(buf[i + self.marker.len()..].to_vec());
            }
            None => {
                // Hold back only a tail that could be the marker's start.
                let longest = (self.marker.len() - 1).min(buf.len());
                let hold = (1..=longest).rev().find(|&k| buf.ends_with(&self.marker[..k])).unwrap_or(0);
                let cut = buf.len() - hold;
                self.keep(&buf[..cut]);
                self.pending = buf[cut..].to_vec();
            }
        }
    }

    fn keep(&mut self, bytes: &[u8]) {
        let room = self.cap.saturating_sub(self.kept.len());
        if bytes.len() > room {
            self.truncated = true;
        }
        let kept = &bytes[..bytes.len().min(room)];
        self.kept.extend_from_slice(kept);
        if let Some(fresh) = &mut self.fresh {
            fresh.extend_from_slice(kept);
        }
    }
}

impl Shell {
    pub fn info(&self) -> ShellInfo {
        ShellInfo {
            name: self.name.clone(),
            shell: self.kind.clone(),
            cwd: lock(&self.cwd).clone(),
            busy: self.io.try_lock().is_err(),
        }
    }

    /// Interrupts the running command (SIGINT to the shell's process group, like Ctrl-C).
    pub async fn interrupt(&self) -> Result<(), ApiError> {
        if self.gone.load(Ordering::Acquire) {
            return Err(gone(&self.name));
        }
        self.control.signal(SIGINT).await.map_err(|e| failed("be interrupted", e))
    }

    /// Runs shell text in the shell; see the module doc. With a `sink`, the output also goes
    /// there as it arrives (the run waits for the sink: a slow reader slows the command).
    pub async fn run(
        &self,
        agent: &AgentConn,
        fence: u64,
        req: ShellRun,
        max_output: u64,
        sink: Option<&tokio::sync::mpsc::Sender<Vec<u8>>>,
    ) -> Result<ShellResult, ApiError> {
        if req.cmd.contains('\0') || req.stdin.as_deref().is_some_and(|s| s.contains('\0')) {
            return Err(ApiError::bad_request("cmd and stdin may not contain NUL"));
        }
        let timeout = Duration::from_millis(req.checked_timeout_ms().map_err(ApiError::bad_request)?);
        let Ok(mut io) = tokio::time::timeout(BUSY_GRACE, self.io.lock()).await else {
            return Err(ApiError::new(ErrorCode::Conflict, format!("shell {:?} is busy with another run", self.name)));
        };
        if self.gone.load(Ordering::Acquire) {
            return Err(gone(&self.name));
        }
        let abandoned = lock(&self.abandoned).take();
        if let Some(old) = abandoned {
            self.read_past(&mut io, &old, timeout).await?;
        }
        let m = format!("{:032x}", rand::random::<u128>());
        // The command (and its stdin) go into files by the agent itself: no process is
        // spawned for that, and the text needs no quoting. One pair of files per shell,
        // overwritten by each run.
        let file = format!("{RUN_DIR}/{}-{}", self.name, self.pid);
        let write = |path: String, data: String| {
            let spec = WriteSpec { fence, path, mode: 0o600 };
            agent.write_file(spec, data.into(), Duration::from_secs(30))
        };
        write(format!("{file}.cmd"), format!("{}\n", req.cmd)).await.map_err(|e| failed("take the command", e))?;
        let input = match req.stdin {
            Some(s) => {
                write(format!("{file}.in"), s).await.map_err(|e| failed("take the input", e))?;
                format!("{file}.in")
            }
            None => "/dev/null".into(),
        };
        let script = format!(
            "command . {file}.cmd < {input} 3>&-\n__sp_rc=$?\ncommand printf '%s' 'SPOUT_{m}'\ncommand printf 'SPCTL_{m} %s %s\\n' \"$__sp_rc\" \"$PWD\" >&3\n"
        );
        let started = Instant::now();
        let mut out = Collector {
            marker: format!("SPOUT_{m}").into_bytes(),
            kept: Vec::new(),
            cap: max_output as usize,
            truncated: false,
            pending: Vec::new(),
            after: None,
            fresh: sink.map(|_| Vec::new()),
        };
        let leftover = std::mem::take(&mut io.leftover);
        out.keep(&leftover);
        self.control.stdin(script.as_bytes()).await.map_err(|e| failed("take the command", e))?;
        // From here, a caller that goes away (a client that hangs up) interrupts the command,
        // as Ctrl-C would, and leaves its end for the next run to read past.
        let mut running = Running { shell: self, marker: Some(m.clone()) };

        let ctl_prefix = format!("SPCTL_{m} ");
        let mut ctl = Vec::new();
        let mut status: Option<String> = None;
        let mut timed_out = false;
        let mut shell_exit: Option<i32> = None;
        // Steps past the deadline: SIGINT, then SIGKILL of the descendants, then of the shell.
        let mut step = 0;
        let mut deadline = tokio::time::Instant::now() + timeout;
        while status.is_none() || out.after.is_none() {
            let frame = tokio::select! {
                f = io.stream.next() => f,
                _ = tokio::time::sleep_until(deadline) => {
                    timed_out = true;
                    step += 1;
                    deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                    match step {
                        1 => { let _ = self.control.signal(SIGINT).await; }
                        2 => self.kill_descendants(agent, fence).await,
                        3 => { let _ = self.control.signal(SIGKILL).await; }
                        _ => {
                            self.gone.store(true, Ordering::Release);
                            return Err(ApiError::gateway_timeout(format!("shell {:?} did not stop", self.name)));
                        }
                    }
                    continue;
                }
            };
            let f = match frame {
                Ok(f) => f,
                Err(e) => {
                    self.gone.store(true, Ordering::Release);
                    return Err(failed("run", e));
                }
            };
            match f.kind {
                Kind::Stdout => {
                    out.push(&f.payload);
                    if let (Some(sink), Some(fresh)) = (sink, out.fresh.as_mut())
                        && !fresh.is_empty()
                    {
                        // A reader that left does not stop the run.
                        let _ = sink.send(std::mem::take(fresh)).await;
                    }
                    let _ = self.control.credit(f.payload.len() as u32).await;
                }
                Kind::Stderr => {
                    let _ = self.control.credit(f.payload.len() as u32).await;
                    ctl.extend_from_slice(&f.payload);
                    if status.is_none() {
                        status = take_line(&mut ctl, &ctl_prefix);
                    }
                }
                Kind::Exit => {
                    shell_exit = Some(ExitInfo::decode(&f.payload).map(|e| e.exit_code).unwrap_or(-1));
                    break;
                }
                _ => {
                    shell_exit = Some(-1);
                    break;
                }
            }
        }
        running.marker = None;
        let duration_ms = started.elapsed().as_secs_f64() * 1000.0;
        let (exit_code, cwd) = match (&status, shell_exit) {
            (Some(line), _) => {
                let (rc, cwd) = line.split_once(' ').unwrap_or((line.as_str(), ""));
                *lock(&self.cwd) = cwd.to_string();
                (rc.parse().unwrap_or(-1), cwd.to_string())
            }
            (None, code) => {
                // The shell itself ended (`exit`, `exec`, killed): this run says how; the next
                // answers `shell_gone`.
                self.gone.store(true, Ordering::Release);
                (code.unwrap_or(-1), lock(&self.cwd).clone())
            }
        };
        // Flush what may have been a marker's start but was not.
        let pending = std::mem::take(&mut out.pending);
        if out.after.is_none() {
            out.keep(&pending);
        }
        if let (Some(sink), Some(fresh)) = (sink, out.fresh.take())
            && !fresh.is_empty()
        {
            let _ = sink.send(fresh).await;
        }
        io.leftover = out.after.take().unwrap_or_default();
        Ok(ShellResult {
            exit_code,
            output: String::from_utf8_lossy(&out.kept).into_owned(),
            cwd,
            duration_ms,
            timed_out,
            truncated: out.truncated,
        })
    }

    /// Reads (and drops) the output of a run whose caller went away, up to its end.
    async fn read_past(&self, io: &mut Io, marker: &str, within: Duration) -> Result<(), ApiError> {
        let mut out = Collector {
            marker: format!("SPOUT_{marker}").into_bytes(),
            kept: Vec::new(),
            cap: 0,
            truncated: false,
            pending: Vec::new(),
            after: None,
            fresh: None,
        };
        let (prefix, mut ctl, mut ended) = (format!("SPCTL_{marker} "), Vec::new(), false);
        let read = async {
            while !ended || out.after.is_none() {
                let f = io.stream.next().await.map_err(|e| failed("run", e))?;
                let _ = self.control.credit(f.payload.len() as u32).await;
                match f.kind {
                    Kind::Stdout => out.push(&f.payload),
                    Kind::Stderr => {
                        ctl.extend_from_slice(&f.payload);
                        ended |= take_line(&mut ctl, &prefix).is_some();
                    }
                    _ => {
                        self.gone.store(true, Ordering::Release);
                        return Err(gone(&self.name));
                    }
                }
            }
            Ok(())
        };
        match tokio::time::timeout(within, read).await {
            Ok(r) => r?,
            Err(_) => {
                // The interrupted command would not end: the shell cannot be trusted.
                self.gone.store(true, Ordering::Release);
                let _ = self.control.signal(SIGKILL).await;
                return Err(gone(&self.name));
            }
        }
        io.leftover = out.after.take().unwrap_or_default();
        Ok(())
    }

    /// SIGKILL to every descendant of the shell (a command that ignored SIGINT, and anything
    /// that left the shell's process group), by a separate exec.
    async fn kill_descendants(&self, agent: &AgentConn, fence: u64) {
        let spec = ExecSpec {
            fence,
            argv: vec!["sh".into(), "-c".into(), KILL_DESCENDANTS.into(), "sh".into(), self.pid.to_string()],
            env: Vec::new(),
            cwd: String::new(),
            timeout_ms: 10_000,
            max_output: 4096,
            has_stdin: false,
            pty_rows: 0,
            pty_cols: 0,
        };
        if let Err(e) = agent.exec(spec, None, Duration::from_secs(15)).await {
            tracing::warn!(shell = %self.name, error = %e, "kill a shell's descendants");
        }
    }
}

/// A run in progress; dropped before it ended (its caller went away), it interrupts the
/// command and records the run's marker for the next run to read past.
struct Running<'a> {
    shell: &'a Shell,
    /// `None` once the run has ended.
    marker: Option<String>,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let Some(marker) = self.marker.take() else { return };
        *lock(&self.shell.abandoned) = Some(marker);
        let control = self.shell.control.clone();
        // detached: a drop guard reaches no tracker; one SIGINT frame to the agent, which ends
        // when the frame is written or the channel closes (as it does at shutdown).
        tokio::spawn(async move {
            let _ = control.signal(SIGINT).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collector(cap: usize) -> Collector {
        Collector {
            marker: b"SPOUT_abc".to_vec(),
            kept: Vec::new(),
            cap,
            truncated: false,
            pending: Vec::new(),
            after: None,
            fresh: Some(Vec::new()),
        }
    }

    #[test]
    fn the_marker_is_found_across_chunks_and_the_rest_is_kept_for_later() {
        let mut c = collector(1 << 20);
        for chunk in ["hello SP", "OUT", "_ab", "c", "later"] {
            c.push(chunk.as_bytes());
        }
        assert_eq!(c.kept, b"hello ");
        assert_eq!(c.fresh.as_deref(), Some(&b"hello "[..]), "what is kept is streamed");
        assert_eq!(c.after.as_deref(), Some(&b"later"[..]));
        // Output that cannot be the marker's start is not held back.
        let mut c = collector(1 << 20);
        c.push(b"line1\n");
        assert_eq!((c.kept.as_slice(), c.pending.as_slice()), (&b"line1\n"[..], &b""[..]));
        c.push(b"xSPO");
        assert_eq!(c.pending, b"SPO");
    }

    #[test]
    fn output_past_the_cap_is_dropped_and_flagged_but_the_marker_still_ends_the_run() {
        let mut c = collector(4);
        c.push(b"0123456789");
        c.push(b"SPOUT_abc");
        assert_eq!((c.kept.as_slice(), c.truncated, c.after.is_some()), (&b"0123"[..], true, true));
    }

    #[test]
    fn control_lines_are_taken_whole() {
        let mut buf = b"noise SPCTL_x 0 /w".to_vec();
        assert_eq!(take_line(&mut buf, "SPCTL_x "), None);
        buf.extend_from_slice(b"ork\nrest");
        assert_eq!(take_line(&mut buf, "SPCTL_x ").as_deref(), Some("0 /work"));
        assert_eq!(buf, b"rest");
    }
}

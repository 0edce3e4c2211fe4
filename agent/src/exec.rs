//! Running commands: spawn in a new process group, pump output, feed stdin, enforce the
//! timeout and report the exit.
//!
//! Per exec: a waiter thread (exit status from the reaper, timeout, final `Exit` frame), one
//! reader thread per output pipe, and with stdin a feeder thread. Readers forward up to
//! `max_output` bytes, then keep reading and discarding so the command never blocks on a full
//! pipe. Once the command has exited, its pipes get to drain: `Exit` waits until both reach
//! EOF, or until no reader has had data in hand for `PIPE_GRACE` (a background child holds a
//! pipe open), or at most `DRAIN_CAP`. Output arriving after `Exit` is dropped; output that a
//! reader held but could not forward by then sets the stream's truncated flag.

use std::io::{self, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::time::{Duration, Instant};

use crate::proto::{Dec, ErrorInfo, ExecSpec, ExitInfo, Kind, MAX_CHUNK, codes};
use crate::server::{Ctx, DEFAULT_PATH, bad_request, lock, log, spawn_thread};
use crate::sys;

/// How long output pipes may sit idle (open but silent) after the command exited before
/// `Exit` is sent.
const PIPE_GRACE: Duration = Duration::from_millis(100);
/// Upper bound on draining output after the command exited (a chatty background child, or a
/// host too slow to take the last chunks).
const DRAIN_CAP: Duration = Duration::from_secs(2);
/// How often the waiter looks at its readers while they drain.
const DRAIN_POLL: Duration = Duration::from_millis(10);
/// Stdin chunks queued per command before the main loop waits for the command to read them
/// (64 chunks, at most 4 MiB). The wait is deliberate backpressure: the protocol has no
/// per-request flow control, so a command that never reads a large stdin stalls the main loop
/// until it exits, is signalled, or times out.
const STDIN_QUEUE: usize = 64;

/// A running command, as the main loop sees it.
pub struct Running {
    /// The command's pid, which is also its process group id.
    pgid: i32,
    /// Feeds the stdin feeder thread; `None` for stdin chunks means EOF.
    stdin: Option<SyncSender<Option<Vec<u8>>>>,
}

/// One command, shared by its threads.
struct Job {
    id: u32,
    /// The command's pid, which is also its process group id.
    pid: i32,
    started: Instant,
    timeout_ms: u64,
    /// Per stream; 0 means no limit.
    max_output: u64,
    /// Set once `Exit` (or `Error`) is sent: nothing more may go out for this id.
    closed: AtomicBool,
    /// Index 0 is stdout, 1 is stderr.
    streams: [Stream; 2],
}

/// One output stream's reader, as its command's waiter sees it.
#[derive(Default)]
struct Stream {
    /// Not all output was forwarded (cut at `max_output`, or still unsent at `Exit`).
    truncated: AtomicBool,
    /// The reader holds data it has not forwarded yet.
    busy: AtomicBool,
}

/// Starts `spec` as request `id`. Errors before the command runs are returned for the caller
/// to send; after that every outcome is reported by the command's own threads.
pub fn start(ctx: &Arc<Ctx>, id: u32, spec: ExecSpec) -> Result<(), ErrorInfo> {
    let Some(program) = spec.argv.first() else {
        return Err(bad_request("argv is empty"));
    };
    if spec.pty_rows != 0 {
        return Err(bad_request("pseudo-terminals are not supported"));
    }
    if lock(&ctx.execs).contains_key(&id) {
        return Err(bad_request(format!("request id {id} is already running")));
    }
    let mut cmd = Command::new(program);
    cmd.args(&spec.argv[1..])
        .process_group(0)
        .stdin(if spec.has_stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if ctx.needs_path && !spec.env.iter().any(|(k, _)| k == "PATH") {
        cmd.env("PATH", DEFAULT_PATH);
    }
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    if !spec.cwd.is_empty() {
        cmd.current_dir(&spec.cwd);
    }
    let started = Instant::now();
    let mut child = ctx.reaper.spawn(&mut cmd).map_err(|e| spawn_error(&spec, &e))?;
    let job = Arc::new(Job {
        id,
        pid: child.id() as i32,
        started,
        timeout_ms: spec.timeout_ms,
        max_output: spec.max_output,
        closed: AtomicBool::new(false),
        streams: Default::default(),
    });
    let pipes: [Option<Box<dyn Read + Send>>; 2] =
        [child.stdout.take().map(|p| Box::new(p) as _), child.stderr.take().map(|p| Box::new(p) as _)];
    let stdin = child.stdin.take();
    // Dropping a `Child` neither kills nor waits; the reaper owns the exit status.
    drop(child);

    if let Err(e) = launch(ctx, &job, pipes, stdin) {
        let _ = sys::kill_group(job.pid, sys::SIGKILL);
        ctx.reaper.forget(job.pid);
        lock(&ctx.execs).remove(&id);
        let err = ErrorInfo::new(codes::SPAWN_FAILED, format!("cannot start a thread for {program}: {e}"));
        ctx.out.send_last(&job.closed, Kind::Error, id, &err.encode());
    }
    Ok(())
}

/// Starts the command's threads. On error the caller kills the command; threads already
/// started end when its pipes close.
fn launch(
    ctx: &Arc<Ctx>,
    job: &Arc<Job>,
    pipes: [Option<Box<dyn Read + Send>>; 2],
    stdin: Option<ChildStdin>,
) -> io::Result<()> {
    let (done_tx, done_rx) = mpsc::channel();
    let mut readers = 0;
    for (stream, pipe) in pipes.into_iter().enumerate() {
        let Some(pipe) = pipe else { continue };
        let (ctx, job, done) = (Arc::clone(ctx), Arc::clone(job), done_tx.clone());
        spawn_thread("exec-output", move || pump(&ctx, &job, stream, pipe, done))?;
        readers += 1;
    }
    drop(done_tx);

    let feeder = match stdin {
        Some(pipe) => {
            let (tx, rx) = mpsc::sync_channel(STDIN_QUEUE);
            spawn_thread("exec-stdin", move || feed(pipe, rx))?;
            Some(tx)
        }
        None => None,
    };
    lock(&ctx.execs).insert(job.id, Running { pgid: job.pid, stdin: feeder });

    let (ctx, job) = (Arc::clone(ctx), Arc::clone(job));
    spawn_thread("exec-wait", move || supervise(&ctx, &job, &done_rx, readers))
}

/// Waits for the command's exit (killing its process group at the timeout), lets its output
/// drain (see the module doc), then sends `Exit`.
fn supervise(ctx: &Ctx, job: &Job, readers_done: &Receiver<()>, readers: usize) {
    // No deadline if the timeout is 0 or so large the clock cannot represent it.
    let deadline =
        (job.timeout_ms > 0).then(|| job.started.checked_add(Duration::from_millis(job.timeout_ms))).flatten();
    let mut timed_out = false;
    let exited = loop {
        if let Some(exited) = ctx.reaper.wait(job.pid, if timed_out { None } else { deadline }) {
            break exited;
        }
        timed_out = true;
        if let Err(e) = sys::kill_group(job.pid, sys::SIGKILL) {
            log(&format!("cannot kill timed-out process group {}: {e}", job.pid));
        }
    };
    drain(job, readers_done, readers);
    // Unregister before `Exit` goes out, so the host may reuse the id as soon as it sees it.
    lock(&ctx.execs).remove(&job.id);
    let info = ExitInfo {
        exit_code: exited.code,
        timed_out,
        stdout_truncated: job.streams[0].truncated.load(Ordering::Relaxed),
        stderr_truncated: job.streams[1].truncated.load(Ordering::Relaxed),
        duration_us: exited.at.saturating_duration_since(job.started).as_micros() as u64,
    };
    ctx.out.send_last(&job.closed, Kind::Exit, job.id, &info.encode());
}

/// Waits, after the command exited, until its `readers` reach EOF or give up draining.
fn drain(job: &Job, readers_done: &Receiver<()>, mut readers: usize) {
    let exited = Instant::now();
    let mut idle_since = exited;
    while readers > 0 {
        match readers_done.recv_timeout(DRAIN_POLL) {
            Ok(()) => {
                readers -= 1;
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return,
            Err(RecvTimeoutError::Timeout) => {}
        }
        let now = Instant::now();
        if job.streams.iter().any(|s| s.busy.load(Ordering::Relaxed)) {
            idle_since = now;
        }
        if now.duration_since(exited) >= DRAIN_CAP {
            // Whatever a reader still holds will be dropped once `Exit` is out: say so.
            for s in &job.streams {
                if s.busy.load(Ordering::Relaxed) {
                    s.truncated.store(true, Ordering::Relaxed);
                }
            }
            return;
        }
        if now.duration_since(idle_since) >= PIPE_GRACE {
            return;
        }
    }
}

/// Forwards output stream `stream` (0 stdout, 1 stderr) until EOF, up to `max_output` bytes;
/// the rest is read and discarded.
fn pump(ctx: &Ctx, job: &Job, stream: usize, mut pipe: Box<dyn Read + Send>, done: Sender<()>) {
    let kind = if stream == 0 { Kind::Stdout } else { Kind::Stderr };
    let state = &job.streams[stream];
    let mut buf = vec![0u8; MAX_CHUNK];
    let mut sent: u64 = 0;
    loop {
        let n = match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let take = match job.max_output {
            0 => n,
            limit => limit.saturating_sub(sent).min(n as u64) as usize,
        };
        if take > 0 {
            state.busy.store(true, Ordering::Relaxed);
            ctx.out.send_open(&job.closed, kind, job.id, &buf[..take]);
            state.busy.store(false, Ordering::Relaxed);
            sent += take as u64;
        }
        if take < n {
            state.truncated.store(true, Ordering::Relaxed);
        }
    }
    let _ = done.send(());
}

/// Writes queued stdin chunks to the command; `None` closes its stdin. After a write error
/// (the command closed its stdin or exited) chunks are drained and dropped.
fn feed(pipe: ChildStdin, chunks: Receiver<Option<Vec<u8>>>) {
    let mut pipe = Some(pipe);
    while let Ok(Some(chunk)) = chunks.recv() {
        if let Some(p) = pipe.as_mut()
            && p.write_all(&chunk).is_err()
        {
            pipe = None;
        }
    }
}

/// Queues a stdin chunk (`None`: EOF) for request `id`. Input for unknown or finished
/// commands, or for commands started without stdin, is dropped.
pub fn stdin(ctx: &Ctx, id: u32, chunk: Option<Vec<u8>>) {
    let tx = {
        let mut execs = lock(&ctx.execs);
        let Some(running) = execs.get_mut(&id) else { return };
        if chunk.is_none() { running.stdin.take() } else { running.stdin.clone() }
    };
    // Blocks while the command is STDIN_QUEUE chunks behind; see STDIN_QUEUE.
    if let Some(tx) = tx {
        let _ = tx.send(chunk);
    }
}

/// Sends the signal in `payload` (u32) to request `id`'s process group. Signals for unknown
/// or finished commands are dropped: the exec's `Exit` may already be on its way.
pub fn signal(ctx: &Ctx, id: u32, payload: &[u8]) {
    let sig = match Dec::new(payload).u32() {
        Ok(sig) if (1..=64).contains(&sig) => sig as i32,
        _ => {
            log(&format!("ignoring a malformed signal request for id {id}"));
            return;
        }
    };
    let Some(pgid) = lock(&ctx.execs).get(&id).map(|r| r.pgid) else { return };
    if let Err(e) = sys::kill_group(pgid, sig) {
        log(&format!("cannot signal process group {pgid}: {e}"));
    }
}

fn spawn_error(spec: &ExecSpec, err: &io::Error) -> ErrorInfo {
    let program = &spec.argv[0];
    match err.raw_os_error() {
        // ENOENT: a missing working directory fails the same way as a missing program.
        Some(2) if !spec.cwd.is_empty() && !Path::new(&spec.cwd).is_dir() => {
            ErrorInfo::new(codes::NOT_FOUND, format!("working directory not found: {}", spec.cwd))
        }
        Some(2) => ErrorInfo::new(codes::NOT_FOUND, format!("executable file not found: {program}")),
        Some(13) => ErrorInfo::new(codes::PERMISSION_DENIED, format!("permission denied: {program}")),
        _ if err.kind() == io::ErrorKind::InvalidInput => bad_request(format!("cannot start {program}: {err}")),
        _ => ErrorInfo::new(codes::SPAWN_FAILED, format!("cannot start {program}: {err}")),
    }
}

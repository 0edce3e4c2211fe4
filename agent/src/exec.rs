// One file because spawning, output pumping, stdin and the timeout act on one running command
// and its process group, and are read together.
//! Running commands: spawn in a new process group (or on a pseudo-terminal, in a new
//! session), pump output, feed stdin, enforce the timeout and report the exit.
//!
//! Per exec: a waiter thread (exit status from the reaper, timeout, final `Exit` frame), one
//! reader thread per output pipe (a terminal has one: its master), and with stdin a feeder
//! thread. Readers forward up to `max_output` bytes, then keep reading and discarding so the
//! command never blocks on a full pipe. Under flow control (`ExecFlow`) a reader also waits
//! for output credit before forwarding, holding at most the one chunk it has read and leaving
//! the rest in the pipe (see `agent_proto`'s crate doc). Once the command has exited, its
//! pipes get to drain: `Exit` waits until both reach EOF, or until for `PIPE_GRACE` no reader
//! has had data in hand and no pipe has had unread data (a background child holds a pipe open;
//! a reader starved of CPU is not idle while its pipe holds output), or at most `DRAIN_CAP` of the
//! agent's own time, plus at most `FLOW_STALL_CAP_MS` spent waiting for credit. Output arriving
//! after `Exit` is dropped; output that a reader held but could not forward by then sets the
//! stream's truncated flag.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use agent_proto::{
    Dec, ErrorInfo, ExecSpec, ExitInfo, FLOW_STALL_CAP_MS, Kind, MAX_CHUNK, STDIN_WINDOW, WinSize, codes,
};

use crate::basics::{lock, log};
use crate::ctx::{Ctx, DEFAULT_PATH, bad_request, no_room};
use crate::pty::{self, Pty};
use crate::spawn::{Group, Spawn};
use crate::sys;
use crate::workers;

/// How long output pipes may sit idle (open but silent) after the command exited before
/// `Exit` is sent.
const PIPE_GRACE: Duration = Duration::from_millis(100);
/// Upper bound on draining output after the command exited (a chatty background child, or a
/// host too slow to take the last chunks), not counting time spent waiting for credit.
const DRAIN_CAP: Duration = Duration::from_secs(2);
/// Upper bound on the time, after the command exited, spent waiting for output credit.
const FLOW_STALL_CAP: Duration = Duration::from_millis(FLOW_STALL_CAP_MS);
/// How long `terminate` keeps killing what a command started.
const TERMINATE_CAP: Duration = Duration::from_secs(2);
/// Pause between `terminate`'s rounds (its victims need the reaper to go).
const TERMINATE_ROUND: Duration = Duration::from_millis(5);
/// How often the waiter looks at its readers while they drain.
const DRAIN_POLL: Duration = Duration::from_millis(10);
/// Stdin chunks queued per command before the main loop waits for the command to read them
/// (64 chunks, at most 4 MiB). For plain `Exec` the wait is deliberate backpressure: a command
/// that never reads a large stdin stalls the main loop until it exits, is signalled, or times
/// out. Under `ExecFlow` the host keeps within this window (acknowledged by `StdinAck`), so the
/// main loop never waits.
const STDIN_QUEUE: usize = STDIN_WINDOW as usize;
/// `TERM` for commands on a pseudo-terminal whose request does not set one.
const DEFAULT_TERM: &str = "xterm-256color";

/// The commands running, by request id, and what their threads share. The main loop finds a
/// command here for its `Stdin`, `Credit`, `Resize` and `Signal`; the command's waiter removes
/// it before its `Exit` goes out.
pub struct Execs {
    ctx: Arc<Ctx>,
    running: Mutex<HashMap<u32, Running>>,
}

impl Execs {
    /// No command running yet.
    pub fn new(ctx: Arc<Ctx>) -> Execs {
        Execs { ctx, running: Mutex::new(HashMap::new()) }
    }
}

/// A running command, as the main loop sees it.
struct Running {
    job: Arc<Job>,
    /// Feeds the stdin feeder thread; dropping it closes the command's stdin once the queued
    /// chunks are written.
    stdin: Option<SyncSender<Vec<u8>>>,
    /// The master of the command's pseudo-terminal, for `Resize` and `Signal`.
    pty: Option<File>,
}

/// One command, shared by its threads.
struct Job {
    id: u32,
    /// The command's pid, which is also its process group id (and, on a terminal, its
    /// session id).
    pid: i32,
    started: Instant,
    timeout_ms: u64,
    /// Per stream; 0 means no limit.
    max_output: u64,
    /// Output credit, for a command started with `ExecFlow`; `None` means no flow control.
    credit: Option<Credit>,
    /// Runs on a pseudo-terminal, in a session of its own.
    pty: bool,
    /// Set once `Exit` (or `Error`) is sent: nothing more may go out for this id.
    closed: AtomicBool,
    /// Index 0 is stdout, 1 is stderr.
    streams: [Stream; 2],
    /// Inodes of its output pipes: a process still holding one was started by it, wherever
    /// it went since (another process group or session).
    pipes: Vec<u64>,
}

/// Output bytes a flow-controlled command may still send, shared by its readers.
struct Credit {
    left: Mutex<u64>,
    /// Signalled when credit arrives and when the request closes.
    more: Condvar,
}

/// One output stream's reader, as its command's waiter sees it.
#[derive(Default)]
struct Stream {
    /// Not all output was forwarded (cut at `max_output`, or still unsent at `Exit`).
    truncated: AtomicBool,
    /// The reader holds data it has not forwarded yet.
    busy: AtomicBool,
    /// The reader holds data and waits for output credit (implies `busy`).
    stalled: AtomicBool,
    /// The pipe (or terminal) the reader reads, while it does; -1 before and after (set by
    /// `spawn`, which makes every `Job`; 0 only until then). The waiter asks it
    /// whether output is still waiting to be read: a reader starved of CPU (the sandbox's
    /// quota, many commands) is not busy, yet its command's output is there.
    fd: AtomicI32,
}

impl Stream {
    /// Bytes waiting in the stream's pipe, unread (`FIONREAD`; 0 when closed or unknown).
    fn unread(&self) -> i32 {
        let fd = self.fd.load(Ordering::Acquire);
        if fd < 0 {
            return 0;
        }
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int into `n`. The fd may have been closed (and even
        // reused) since the load: then the call fails or reports another file's bytes, which
        // only makes the waiter wait longer, within `DRAIN_CAP`.
        let rc = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
        if rc == 0 { n } else { 0 }
    }
}

impl Job {
    /// Takes up to `want` bytes of output credit for `stream`, waiting while there is none.
    /// `None` once the request is closed: the data is to be dropped.
    fn take_credit(&self, want: usize, stream: &Stream) -> Option<usize> {
        let Some(credit) = &self.credit else { return Some(want) };
        let mut left = lock(&credit.left);
        while *left == 0 {
            if self.closed.load(Ordering::Relaxed) {
                stream.stalled.store(false, Ordering::Relaxed);
                return None;
            }
            stream.stalled.store(true, Ordering::Relaxed);
            left = credit.more.wait(left).unwrap_or_else(|e| e.into_inner());
        }
        stream.stalled.store(false, Ordering::Relaxed);
        let n = (*left).min(want as u64);
        *left -= n;
        Some(n as usize)
    }

    /// Sends the request's final frame, then wakes readers waiting for credit so they see it
    /// closed.
    fn finish(&self, ctx: &Ctx, kind: Kind, payload: &[u8]) {
        ctx.out.send_last(&self.closed, kind, self.id, payload);
        if let Some(credit) = &self.credit {
            // Taking the lock orders this wake-up after any reader's look at `closed`.
            drop(lock(&credit.left));
            credit.more.notify_all();
        }
    }
}

/// Starts `spec` as request `id`, under flow control with `credit` bytes to start with if
/// `credit` is set (`ExecFlow`). Errors before the command runs are returned for the caller
/// to send; after that every outcome is reported by the command's own threads.
pub fn start(execs: &Arc<Execs>, id: u32, spec: ExecSpec, credit: Option<u32>) -> Result<(), ErrorInfo> {
    let ctx = &execs.ctx;
    let Some(program) = spec.argv.first() else {
        return Err(bad_request("argv is empty"));
    };
    let pty_size = match (spec.pty_rows, spec.pty_cols) {
        (0, 0) => None,
        (0, _) | (_, 0) => return Err(bad_request("pty_rows and pty_cols must both be set, or both be 0")),
        (rows, cols) => Some((rows, cols)),
    };
    if lock(&execs.running).contains_key(&id) {
        return Err(bad_request(format!("request id {id} is already running")));
    }
    let script = long_script(&spec.argv)?;
    let argv: Vec<&OsStr> = match &script {
        Some((argv, _)) => argv.iter().map(OsStr::new).collect(),
        None => spec.argv.iter().map(OsStr::new).collect(),
    };
    let env = command_env(ctx, &spec, pty_size.is_some());
    let path = env.iter().find(|(k, _)| *k == "PATH").map_or(OsStr::new(DEFAULT_PATH), |(_, v)| *v);
    let mut cmd = Spawn::new(&argv, path, env.iter().copied()).map_err(|e| spawn_error(&spec, &e))?;
    if let Some((_, memfd)) = &script {
        cmd.inherit(memfd.as_raw_fd());
    }
    let spawn_failed = |what: &str, e: io::Error| no_room(codes::SPAWN_FAILED, format!("cannot open {what}: {e}"), &e);
    // The command's ends of its terminal or pipes (dropped once it has started, so EOF or EIO
    // on the agent's ends means it and its children are gone), and the agent's ends.
    let (theirs, master, pipes_out, stdin_end): ([OwnedFd; 3], Option<File>, [Option<File>; 2], Option<File>) =
        match pty_size {
            Some((rows, cols)) => {
                let pty = Pty::open(rows, cols).map_err(|e| spawn_failed("a terminal", e))?;
                let (master, slave) = (pty.master, pty.slave);
                let ends = (|| Ok::<_, io::Error>([slave.try_clone()?, slave.try_clone()?, slave]))()
                    .map_err(|e| spawn_failed("a terminal", e))?;
                cmd.group(Group::Terminal);
                (ends, Some(master), [None, None], None)
            }
            None => {
                let (out_r, out_w) = sys::pipe().map_err(|e| spawn_failed("a pipe", e))?;
                let (err_r, err_w) = sys::pipe().map_err(|e| spawn_failed("a pipe", e))?;
                let (input, stdin_end) = if spec.has_stdin {
                    let (r, w) = sys::pipe().map_err(|e| spawn_failed("a pipe", e))?;
                    (r, Some(File::from(w)))
                } else {
                    (dev_null().map_err(|e| spawn_failed("/dev/null", e))?, None)
                };
                ([input, out_w, err_w], None, [Some(File::from(out_r)), Some(File::from(err_r))], stdin_end)
            }
        };
    cmd.stdio([theirs[0].as_raw_fd(), theirs[1].as_raw_fd(), theirs[2].as_raw_fd()])
        .oom_score_adj(sys::TENANT_OOM_SCORE_ADJ);
    if let Some((uid, gid)) = ctx.user {
        cmd.user(uid, gid);
    }
    if !spec.cwd.is_empty() {
        cmd.cwd(&spec.cwd).map_err(|e| spawn_error(&spec, &e))?;
    }
    // The agent's handles on the terminal: one to read, one to write.
    let master_ends = match &master {
        Some(m) => {
            let ends = m.try_clone().and_then(|r| Ok((r, m.try_clone()?)));
            Some(ends.map_err(|e| spawn_failed("a terminal", e))?)
        }
        None => None,
    };
    let started = Instant::now();
    let spawned = ctx.reaper.spawn(&cmd);
    drop(theirs);
    drop(script);
    let pid = spawned.map_err(|e| spawn_error(&spec, &e))?;
    let fds = [pipes_out[0].as_ref().map(|p| p.as_raw_fd()), pipes_out[1].as_ref().map(|p| p.as_raw_fd())];
    let pipes = fds.into_iter().flatten().filter_map(sys::inode).collect();
    let job = Arc::new(Job {
        id,
        pid,
        started,
        timeout_ms: spec.timeout_ms,
        max_output: spec.max_output,
        credit: credit.map(|c| Credit { left: Mutex::new(c.into()), more: Condvar::new() }),
        pty: master.is_some(),
        closed: AtomicBool::new(false),
        streams: Default::default(),
        pipes,
    });
    // Each stream's pipe, for the waiter's `Stream::unread` (-1: no such stream).
    let raw = match &master_ends {
        Some((reader, _)) => [reader.as_raw_fd(), -1],
        None => [fds[0].unwrap_or(-1), fds[1].unwrap_or(-1)],
    };
    for (stream, fd) in job.streams.iter().zip(raw) {
        stream.fd.store(fd, Ordering::Release);
    }
    type Output = Option<Box<dyn Read + Send>>;
    let (outputs, stdin): ([Output; 2], Option<Box<dyn Write + Send>>) = match master_ends {
        Some((reader, writer)) => ([Some(Box::new(reader)), None], Some(Box::new(writer))),
        None => {
            let [out, err] = pipes_out;
            ([out.map(|p| Box::new(p) as _), err.map(|p| Box::new(p) as _)], stdin_end.map(|p| Box::new(p) as _))
        }
    };

    if let Err(e) = launch(execs, &job, outputs, stdin, master) {
        let _ = kill(&job, libc::SIGKILL);
        ctx.reaper.forget(job.pid);
        lock(&execs.running).remove(&id);
        let err = no_room(codes::SPAWN_FAILED, format!("cannot start a thread for {program}: {e}"), &e);
        job.finish(ctx, Kind::Error, &err.encode());
    }
    Ok(())
}

/// The command's environment: the agent's own (read once at start), then `PATH` if the agent
/// has none, `TERM` on a terminal and `HOME` for the tenant's user, then the request's
/// variables; a later value of a name replaces an earlier one.
fn command_env<'a>(ctx: &'a Ctx, spec: &'a ExecSpec, pty: bool) -> Vec<(&'a OsStr, &'a OsStr)> {
    let mut env: Vec<(&OsStr, &OsStr)> = ctx.env.iter().map(|(k, v)| (k.as_os_str(), v.as_os_str())).collect();
    let mut set = |k: &'a OsStr, v: &'a OsStr| match env.iter_mut().find(|(name, _)| *name == k) {
        Some(slot) => slot.1 = v,
        None => env.push((k, v)),
    };
    let requested = |name: &str| spec.env.iter().any(|(k, _)| k == name);
    if pty && !requested("TERM") {
        set(OsStr::new("TERM"), OsStr::new(DEFAULT_TERM));
    }
    if ctx.user.is_some() {
        set(OsStr::new("HOME"), OsStr::new(&ctx.home));
    }
    for (k, v) in &spec.env {
        set(OsStr::new(k), OsStr::new(v));
    }
    env
}

/// `/dev/null`, opened once, for every command without stdin.
fn dev_null() -> io::Result<OwnedFd> {
    static NULL: OnceLock<File> = OnceLock::new();
    let null = match NULL.get() {
        Some(f) => f,
        None => {
            let f = File::open("/dev/null")?;
            NULL.get_or_init(|| f)
        }
    };
    null.as_fd().try_clone_to_owned()
}

/// Kills the command's process group, or on a terminal every process group of its session
/// (an interactive shell runs each job in a group of its own).
fn kill(job: &Job, sig: i32) -> io::Result<()> {
    if job.pty { sys::kill_session(job.pid, sig) } else { sys::kill_group(job.pid, sig) }
}

/// Kills everything the command started: its process group (on a terminal, its session's
/// groups) and every process still holding one of its output pipes, wherever it went (a fork
/// bomb's children, a `setsid` child): again and again until none is left, since a process
/// forking as the signal lands may slip through one round, at most `TERMINATE_CAP`. What
/// left both its group and its pipes is a service the command started on purpose, and lives.
fn terminate(job: &Job) {
    let until = Instant::now() + TERMINATE_CAP;
    loop {
        let group = kill(job, libc::SIGKILL);
        // As the user: reading another user's /proc/PID/fd takes their uid (or CAP_SYS_PTRACE).
        let holders = sys::as_user(|| sys::pipe_holders(&job.pipes)).unwrap_or_default();
        for &pid in &holders {
            let _ = sys::kill_pid(pid, libc::SIGKILL);
        }
        let group_gone = matches!(&group, Err(e) if e.raw_os_error() == Some(libc::ESRCH));
        if group_gone && holders.is_empty() {
            return;
        }
        if Instant::now() >= until {
            log(&format!("processes of request {} outlived {TERMINATE_CAP:?} of SIGKILL", job.id));
            return;
        }
        std::thread::sleep(TERMINATE_ROUND);
    }
}

/// Starts the command's threads. On error the caller kills the command; threads already
/// started end when its pipes close.
fn launch(
    execs: &Arc<Execs>,
    job: &Arc<Job>,
    outputs: [Option<Box<dyn Read + Send>>; 2],
    stdin: Option<Box<dyn Write + Send>>,
    pty: Option<File>,
) -> io::Result<()> {
    let ctx = &execs.ctx;
    let (done_tx, done_rx) = mpsc::channel();
    let mut readers = 0;
    for (stream, output) in outputs.into_iter().enumerate() {
        let Some(output) = output else { continue };
        let (ctx, job, done) = (Arc::clone(ctx), Arc::clone(job), done_tx.clone());
        workers::run(move || pump(&ctx, &job, stream, output, done))?;
        readers += 1;
    }
    drop(done_tx);

    let feeder = match stdin {
        Some(pipe) => {
            let (tx, rx) = mpsc::sync_channel(STDIN_QUEUE);
            let (ctx, job) = (Arc::clone(ctx), Arc::clone(job));
            workers::run(move || feed(&ctx, &job, pipe, &rx))?;
            Some(tx)
        }
        None => None,
    };
    lock(&execs.running).insert(job.id, Running { job: Arc::clone(job), stdin: feeder, pty });

    let (execs, job) = (Arc::clone(execs), Arc::clone(job));
    workers::run(move || supervise(&execs, &job, &done_rx, readers))
}

/// Waits for the command's exit (killing it at the timeout), lets its output drain (see the
/// module doc), then sends `Exit`.
fn supervise(execs: &Execs, job: &Job, readers_done: &Receiver<()>, readers: usize) {
    let ctx = &execs.ctx;
    // No deadline if the timeout is 0 or so large the clock cannot represent it.
    let deadline =
        (job.timeout_ms > 0).then(|| job.started.checked_add(Duration::from_millis(job.timeout_ms))).flatten();
    let mut timed_out = false;
    let exited = loop {
        if let Some(exited) = ctx.reaper.wait(job.pid, if timed_out { None } else { deadline }) {
            break exited;
        }
        timed_out = true;
        terminate(job);
    };
    let holding = drain(job, readers_done, readers);
    // Unregister before `Exit` goes out, so the host may reuse the id as soon as it sees it.
    lock(&execs.running).remove(&job.id);
    let info = ExitInfo {
        exit_code: exited.code,
        timed_out,
        stdout_truncated: job.streams[0].truncated.load(Ordering::Relaxed),
        stderr_truncated: job.streams[1].truncated.load(Ordering::Relaxed),
        duration_us: exited.at.saturating_duration_since(job.started).as_micros() as u64,
    };
    job.finish(ctx, Kind::Exit, &info.encode());
    // Processes it left that still hold its output are part of it: they end at its timeout
    // (a service that redirects its output is not held to it).
    let mut holding = holding;
    while holding > 0 {
        let wait = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()),
            None => return,
        };
        match readers_done.recv_timeout(wait) {
            Ok(()) => holding -= 1,
            Err(RecvTimeoutError::Disconnected) => return,
            Err(RecvTimeoutError::Timeout) => {
                terminate(job);
                return;
            }
        }
    }
}

/// Waits, after the command exited, until its `readers` reach EOF or give up draining;
/// returns how many have not reached EOF (a process it left holds the pipe).
fn drain(job: &Job, readers_done: &Receiver<()>, mut readers: usize) -> usize {
    let exited = Instant::now();
    let mut idle_since = exited;
    let mut last = exited;
    // Time spent waiting for the host's credit, which does not count against DRAIN_CAP.
    let mut stalled_for = Duration::ZERO;
    while readers > 0 {
        let polled = readers_done.recv_timeout(DRAIN_POLL);
        let now = Instant::now();
        if job.streams.iter().any(|s| s.stalled.load(Ordering::Relaxed)) {
            stalled_for += now.duration_since(last);
        }
        last = now;
        match polled {
            Ok(()) => {
                readers -= 1;
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return 0,
            Err(RecvTimeoutError::Timeout) => {}
        }
        if job.streams.iter().any(|s| s.busy.load(Ordering::Relaxed) || s.unread() > 0) {
            idle_since = now;
        }
        if now.duration_since(exited).saturating_sub(stalled_for) >= DRAIN_CAP || stalled_for >= FLOW_STALL_CAP {
            // Whatever a reader still holds will be dropped once `Exit` is out: say so.
            for s in &job.streams {
                if s.busy.load(Ordering::Relaxed) {
                    s.truncated.store(true, Ordering::Relaxed);
                }
            }
            return readers;
        }
        if now.duration_since(idle_since) >= PIPE_GRACE {
            return readers;
        }
    }
    0
}

/// Forwards output stream `stream` (0 stdout, 1 stderr) until EOF (or EIO, from a terminal
/// whose every slave descriptor is closed), up to `max_output` bytes and as credit allows;
/// the rest is read and discarded.
fn pump(ctx: &Ctx, job: &Job, stream: usize, mut pipe: Box<dyn Read + Send>, done: Sender<()>) {
    let kind = if stream == 0 { Kind::Stdout } else { Kind::Stderr };
    let state = &job.streams[stream];
    thread_local! {
        /// The reader's buffer, kept by its (pooled) thread for the next command.
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with_borrow_mut(|buf| {
        buf.resize(MAX_CHUNK, 0);
        pump_with(ctx, job, state, kind, &mut *pipe, buf);
    });
    state.fd.store(-1, Ordering::Release);
    drop(pipe);
    let _ = done.send(());
}

fn pump_with(ctx: &Ctx, job: &Job, state: &Stream, kind: Kind, pipe: &mut dyn Read, buf: &mut [u8]) {
    let mut sent: u64 = 0;
    loop {
        let n = match pipe.read(buf) {
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
            let mut rest = &buf[..take];
            while !rest.is_empty() {
                let Some(k) = job.take_credit(rest.len(), state) else { break };
                ctx.out.send_open(&job.closed, kind, job.id, &rest[..k]);
                rest = &rest[k..];
            }
            state.busy.store(false, Ordering::Relaxed);
            sent += take as u64;
        }
        if take < n {
            state.truncated.store(true, Ordering::Relaxed);
        }
    }
}

/// Writes queued stdin chunks to the command, acknowledging each under flow control; the
/// queue's end closes the command's stdin. After a write error (the command closed its stdin
/// or exited) chunks are drained and dropped.
fn feed(ctx: &Ctx, job: &Job, pipe: Box<dyn Write + Send>, chunks: &Receiver<Vec<u8>>) {
    let mut pipe = Some(pipe);
    while let Ok(chunk) = chunks.recv() {
        if let Some(p) = pipe.as_mut()
            && p.write_all(&chunk).is_err()
        {
            pipe = None;
        }
        if job.credit.is_some() {
            ctx.out.send_open(&job.closed, Kind::StdinAck, job.id, &1u32.to_le_bytes());
        }
    }
}

/// Queues a stdin chunk (`None`: EOF) for request `id`. Input for unknown or finished
/// commands, or for commands started without stdin, is dropped (and under flow control
/// acknowledged). On a terminal, EOF is ignored.
pub fn stdin(execs: &Execs, id: u32, chunk: Option<Vec<u8>>) {
    let mut table = lock(&execs.running);
    let Some(running) = table.get_mut(&id) else { return };
    let Some(chunk) = chunk else {
        if running.pty.is_none() {
            // The feeder closes the pipe once it has written what is queued.
            running.stdin = None;
        }
        return;
    };
    match running.stdin.clone() {
        Some(tx) => {
            drop(table);
            // Blocks while the command is STDIN_QUEUE chunks behind; see STDIN_QUEUE.
            let _ = tx.send(chunk);
        }
        None if running.job.credit.is_some() => {
            let job = Arc::clone(&running.job);
            drop(table);
            execs.ctx.out.send_open(&job.closed, Kind::StdinAck, id, &1u32.to_le_bytes());
        }
        None => {}
    }
}

/// Adds the credit in `payload` (u32 bytes) to flow-controlled request `id`. Credit for
/// unknown, finished or plain requests is dropped.
pub fn credit(execs: &Execs, id: u32, payload: &[u8]) {
    let Ok(more) = Dec::new(payload).u32() else {
        log(&format!("ignoring a malformed credit for id {id}"));
        return;
    };
    let Some(job) = lock(&execs.running).get(&id).map(|r| Arc::clone(&r.job)) else { return };
    if let Some(credit) = &job.credit {
        let mut left = lock(&credit.left);
        *left = left.saturating_add(more.into());
        drop(left);
        credit.more.notify_all();
    }
}

/// Resizes request `id`'s terminal to the `WinSize` in `payload`. Requests that are unknown,
/// finished or without a terminal are ignored.
pub fn resize(execs: &Execs, id: u32, payload: &[u8]) {
    let size = match WinSize::decode(payload) {
        Ok(size) if size.rows > 0 && size.cols > 0 => size,
        _ => {
            log(&format!("ignoring a malformed resize for id {id}"));
            return;
        }
    };
    let table = lock(&execs.running);
    if let Some(master) = table.get(&id).and_then(|r| r.pty.as_ref())
        && let Err(e) = pty::resize(master, size.rows, size.cols)
    {
        log(&format!("cannot resize the terminal of request {id}: {e}"));
    }
}

/// Sends the signal in `payload` (u32) to request `id`'s process group; on a terminal, see
/// `agent_proto`'s crate doc. Signals for unknown or finished commands are dropped: the exec's
/// `Exit` may already be on its way.
pub fn signal(execs: &Execs, id: u32, payload: &[u8]) {
    let sig = match Dec::new(payload).u32() {
        Ok(sig) if (1..=64).contains(&sig) => sig as i32,
        _ => {
            log(&format!("ignoring a malformed signal request for id {id}"));
            return;
        }
    };
    let (job, foreground) = {
        let table = lock(&execs.running);
        let Some(running) = table.get(&id) else { return };
        (Arc::clone(&running.job), running.pty.as_ref().map(pty::foreground_group))
    };
    if sig == libc::SIGKILL {
        // A kill ends everything the command started; off the main loop (it takes rounds).
        if let Err(e) = workers::run(move || terminate(&job)) {
            log(&format!("cannot start a thread to kill request {id}: {e}"));
        }
        return;
    }
    let result = match foreground {
        None => sys::kill_group(job.pid, sig),
        // A hang-up or a kill ends the whole terminal.
        Some(_) if sig == libc::SIGHUP || sig == libc::SIGKILL => sys::kill_session(job.pid, sig),
        // Anything else as if typed: to the foreground job, or with none (the shell has
        // exited, say) to the command's own group.
        Some(Ok(fg)) if fg > 1 => sys::kill_group(fg, sig),
        Some(_) => sys::kill_group(job.pid, sig),
    };
    if let Err(e) = result {
        log(&format!("cannot signal the processes of request {id}: {e}"));
    }
}

/// Linux refuses any single argument longer than this (`MAX_ARG_STRLEN`, 32 pages) with E2BIG.
const MAX_ARG: usize = 32 * 4096;

/// A `-c` script longer than Linux allows one argument to be (a shell or Python program of
/// hundreds of kilobytes) runs from a file instead: `prog [opts] -c SCRIPT args...` becomes
/// `prog [opts] /dev/fd/N args...`, N an in-memory file (memfd) holding SCRIPT that the command
/// inherits. Shells and Python read a script file the same way they run `-c` (only `$0` and
/// `sys.argv[0]` differ). Any other argument that long is refused with a clear message.
fn long_script(argv: &[String]) -> Result<Option<(Vec<String>, File)>, ErrorInfo> {
    let Some(long) = argv.iter().position(|a| a.len() >= MAX_ARG) else { return Ok(None) };
    let refuse = || {
        bad_request(format!(
            "argument {long} is {} bytes; Linux passes at most {MAX_ARG} bytes per argument (a `-c` script may be \
             longer); pass it on stdin or in a file",
            argv[long].len()
        ))
    };
    if long < 2 || argv[long - 1] != "-c" || argv[long + 1..].iter().any(|a| a.len() >= MAX_ARG) {
        return Err(refuse());
    }
    let spawn_failed = |e: io::Error| ErrorInfo::new(codes::SPAWN_FAILED, format!("cannot hold the script: {e}"));
    // SAFETY: a valid NUL-terminated name; the returned descriptor is owned by the File.
    let fd = unsafe { libc::memfd_create(c"sandpool-script".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(spawn_failed(io::Error::last_os_error()));
    }
    // SAFETY: fd is a fresh descriptor nobody else owns.
    let mut file = unsafe { File::from_raw_fd(fd) };
    file.write_all(argv[long].as_bytes()).map_err(spawn_failed)?;
    let mut new = argv[..long - 1].to_vec();
    new.push(format!("/dev/fd/{fd}"));
    new.extend_from_slice(&argv[long + 1..]);
    Ok(Some((new, file)))
}

fn spawn_error(spec: &ExecSpec, err: &io::Error) -> ErrorInfo {
    let program = &spec.argv[0];
    match err.raw_os_error() {
        // A missing working directory fails the same way as a missing program.
        Some(libc::ENOENT) if !spec.cwd.is_empty() && !Path::new(&spec.cwd).is_dir() => {
            ErrorInfo::new(codes::NOT_FOUND, format!("working directory not found: {}", spec.cwd))
        }
        Some(libc::ENOENT) => ErrorInfo::new(codes::NOT_FOUND, format!("executable file not found: {program}")),
        Some(libc::EACCES) => ErrorInfo::new(codes::PERMISSION_DENIED, format!("permission denied: {program}")),
        _ if err.kind() == io::ErrorKind::InvalidInput => bad_request(format!("cannot start {program}: {err}")),
        // Out of processes: the fork failed, nothing ran.
        _ => no_room(codes::SPAWN_FAILED, format!("cannot start {program}: {err}"), err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command that exited with its output still in the pipe, unread: its reader has not
    /// run yet (starved of CPU under the sandbox's quota). The waiter must not take the quiet
    /// for an idle pipe and send `Exit` without the output.
    #[test]
    fn output_still_in_the_pipe_keeps_the_waiter_waiting_for_a_starved_reader() {
        let mut ends = [0; 2];
        // SAFETY: pipe(2) writes two descriptors into the array.
        assert_eq!(unsafe { libc::pipe(ends.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors are fresh and owned here from now on.
        let (mut read_end, mut write_end) = unsafe { (File::from_raw_fd(ends[0]), File::from_raw_fd(ends[1])) };
        write_end.write_all(b"57\n").unwrap();
        drop(write_end);
        let job = Job {
            id: 1,
            pid: 0,
            started: Instant::now(),
            timeout_ms: 0,
            max_output: 0,
            credit: None,
            pty: false,
            closed: AtomicBool::new(false),
            streams: Default::default(),
            pipes: vec![],
        };
        job.streams[0].fd.store(read_end.as_raw_fd(), Ordering::Release);
        job.streams[1].fd.store(-1, Ordering::Release);
        let (done_tx, done_rx) = mpsc::channel();
        // The reader gets the CPU only after five times the idle grace.
        let late = PIPE_GRACE * 5;
        let reader = std::thread::spawn(move || {
            std::thread::sleep(late);
            let mut got = String::new();
            read_end.read_to_string(&mut got).unwrap();
            done_tx.send(()).unwrap();
            got
        });
        let started = Instant::now();
        let left = drain(&job, &done_rx, 1);
        assert_eq!(left, 0, "the waiter gave up after {:?} with the output unread", started.elapsed());
        assert!(started.elapsed() >= late);
        assert_eq!(reader.join().unwrap(), "57\n");
    }
}

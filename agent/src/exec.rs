// One file because spawning, output pumping, stdin and the timeout act on one running command
// and its process group, and are read together.
//! Running commands: spawn in a new process group (or on a pseudo-terminal, in a new
//! session), pump output, feed stdin, enforce the timeout and report the exit.
//!
//! Per exec one thread (a pooled `workers` thread) does it all: it polls the command's output
//! pipes (a terminal has one: its master) and the command's `Wake`, which the reaper rings when
//! the command exits and `credit` when output credit arrives; with stdin, a feeder thread writes
//! it. An `exec true` used to wake a reader per pipe and a waiter, nine or more wake-ups in
//! all, and those cost the sandbox more CPU than the agent's own work (BENCHMARKS.md,
//! "2026-12-06: one thread per exec"). The thread forwards up to `max_output` bytes per
//! stream, then keeps reading and discarding so the command never blocks on a full pipe. Under
//! flow control (`ExecFlow`) it forwards as credit allows, holding at most the one chunk it has
//! read per stream and leaving the rest in the pipe (see `agent_proto`'s crate doc). Once the
//! command has exited, its pipes get to drain: `Exit` waits until both reach EOF, or until for
//! `PIPE_GRACE` no pipe has had data and none is held (a background child holds a pipe open),
//! or at most `DRAIN_CAP`, plus at most `FLOW_STALL_CAP_MS` spent waiting for credit. Output
//! arriving after `Exit` is read and dropped; output held but not forwarded by then sets the
//! stream's truncated flag.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read, Write};
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use agent_proto::{
    Dec, ErrorInfo, ExecSpec, ExitInfo, FLOW_STALL_CAP_MS, Kind, MAX_CHUNK, STDIN_WINDOW, WinSize, codes,
};

use crate::basics::{lock, log};
use crate::ctx::{Ctx, DEFAULT_PATH, bad_request, no_room};
use crate::pty::{self, Pty};
use crate::spawn::{Group, Spawn};
use crate::sys::{self, Wake};
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
/// Stdin chunks queued per command before the main loop waits for the command to read them
/// (64 chunks, at most 4 MiB). For plain `Exec` the wait is deliberate backpressure: a command
/// that never reads a large stdin stalls the main loop until it exits, is signalled, or times
/// out. Under `ExecFlow` the host keeps within this window (acknowledged by `StdinAck`), so the
/// main loop never waits.
const STDIN_QUEUE: usize = STDIN_WINDOW as usize;
/// `TERM` for commands on a pseudo-terminal whose request does not set one.
const DEFAULT_TERM: &str = "xterm-256color";

/// The commands running, by request id. The main loop finds a command here for its `Stdin`,
/// `Credit`, `Resize` and `Signal`; the command's thread removes it before its `Exit` goes
/// out.
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

/// One command, as its thread, its feeder and the main loop share it.
struct Job {
    id: u32,
    /// The command's pid, which is also its process group id (and, on a terminal, its
    /// session id).
    pid: i32,
    started: Instant,
    timeout_ms: u64,
    /// Per stream; 0 means no limit.
    max_output: u64,
    /// Output bytes a flow-controlled command may still send (`ExecFlow`); `None` means no
    /// flow control.
    credit: Option<Mutex<u64>>,
    /// Runs on a pseudo-terminal, in a session of its own.
    pty: bool,
    /// Set once `Exit` (or `Error`) is sent: nothing more may go out for this id.
    closed: AtomicBool,
    /// Inodes of its output pipes: a process still holding one was started by it, wherever
    /// it went since (another process group or session).
    pipes: Vec<u64>,
    /// Rung by the reaper when the command exits and by `credit` when credit arrives; its
    /// thread polls it beside the output.
    wake: Arc<Wake>,
}

impl Job {
    /// Takes up to `want` bytes of output credit: 0 while there is none.
    fn take_credit(&self, want: usize) -> usize {
        let Some(credit) = &self.credit else { return want };
        let mut left = lock(credit);
        let n = (*left).min(want as u64);
        *left -= n;
        n as usize
    }

    /// Sends the request's final frame.
    fn finish(&self, ctx: &Ctx, kind: Kind, payload: &[u8]) {
        ctx.out.send_last(&self.closed, kind, self.id, payload);
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
    let wake = Arc::new(Wake::new().map_err(|e| spawn_failed("an eventfd", e))?);
    let started = Instant::now();
    let spawned = ctx.reaper.spawn(&cmd, Arc::clone(&wake));
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
        credit: credit.map(|c| Mutex::new(c.into())),
        pty: master.is_some(),
        closed: AtomicBool::new(false),
        pipes,
        wake,
    });
    let (outputs, stdin): ([Option<File>; 2], Option<File>) = match master_ends {
        Some((reader, writer)) => ([Some(reader), None], Some(writer)),
        None => (pipes_out, stdin_end),
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

/// Starts the command's thread (and its stdin feeder). On error the caller kills the command;
/// a feeder already started ends when its queue's sender is dropped.
fn launch(
    execs: &Arc<Execs>,
    job: &Arc<Job>,
    outputs: [Option<File>; 2],
    stdin: Option<File>,
    pty: Option<File>,
) -> io::Result<()> {
    let ctx = &execs.ctx;
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
    let [out, err] = outputs;
    workers::run(move || {
        let mut pump = Pump::new(&execs.ctx, &job, [Output::new(Kind::Stdout, out), Output::new(Kind::Stderr, err)]);
        supervise(&execs, &mut pump);
    })
}

/// Waits for the command's exit (killing it at the timeout) while forwarding its output, lets
/// the output drain (see the module doc), then sends `Exit`.
fn supervise(execs: &Execs, pump: &mut Pump) {
    let (ctx, job) = (pump.ctx, pump.job);
    // No deadline if the timeout is 0 or so large the clock cannot represent it.
    let deadline =
        (job.timeout_ms > 0).then(|| job.started.checked_add(Duration::from_millis(job.timeout_ms))).flatten();
    let mut timed_out = false;
    let exited = loop {
        if let Some(exited) = ctx.reaper.exited(job.pid) {
            break exited;
        }
        if !timed_out && deadline.is_some_and(|d| Instant::now() >= d) {
            timed_out = true;
            terminate(job);
            continue;
        }
        pump.step(if timed_out { None } else { deadline });
    };
    pump.drain();
    // Unregister before `Exit` goes out, so the host may reuse the id as soon as it sees it.
    lock(&execs.running).remove(&job.id);
    let info = ExitInfo {
        exit_code: exited.code,
        timed_out,
        stdout_truncated: pump.outputs[0].truncated,
        stderr_truncated: pump.outputs[1].truncated,
        duration_us: exited.at.saturating_duration_since(job.started).as_micros() as u64,
    };
    job.finish(ctx, Kind::Exit, &info.encode());
    // Processes it left that still hold its output are part of it: they end at its timeout
    // (a service that redirects its output is not held to it). Their output is read and
    // dropped until then, so they never block on a full pipe.
    let mut deadline = deadline;
    while pump.open() {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            terminate(job);
            deadline = None;
        }
        pump.step(deadline);
    }
}

/// One output stream, as its command's thread reads it.
struct Output {
    kind: Kind,
    /// `None` once at EOF (or EIO: a terminal whose every slave descriptor is closed), or for
    /// a stream the command does not have.
    pipe: Option<File>,
    /// Bytes forwarded, counted against `max_output`.
    sent: u64,
    /// What was read last; `buf[held]` is waiting for output credit.
    buf: Vec<u8>,
    held: Range<usize>,
    /// Not all output was forwarded (cut at `max_output`, or still held at `Exit`).
    truncated: bool,
}

impl Output {
    fn new(kind: Kind, pipe: Option<File>) -> Output {
        Output { kind, pipe, sent: 0, buf: Vec::new(), held: 0..0, truncated: false }
    }
}

/// A command's output streams and its `Wake`, pumped by its thread.
struct Pump<'a> {
    ctx: &'a Ctx,
    job: &'a Job,
    /// Stdout and stderr (a terminal's one stream is stdout).
    outputs: [Output; 2],
}

thread_local! {
    /// The read buffers of a command's streams, kept by the (pooled) thread for its next
    /// command.
    static BUFS: std::cell::RefCell<[Vec<u8>; 2]> = const { std::cell::RefCell::new([Vec::new(), Vec::new()]) };
}

impl<'a> Pump<'a> {
    fn new(ctx: &'a Ctx, job: &'a Job, mut outputs: [Output; 2]) -> Pump<'a> {
        BUFS.with_borrow_mut(|bufs| {
            for (out, buf) in outputs.iter_mut().zip(bufs.iter_mut()) {
                out.buf = std::mem::take(buf);
                out.buf.resize(MAX_CHUNK, 0);
            }
        });
        Pump { ctx, job, outputs }
    }

    /// Some stream is not at EOF yet.
    fn open(&self) -> bool {
        self.outputs.iter().any(|o| o.pipe.is_some())
    }

    /// Some stream holds output waiting for credit.
    fn holding(&self) -> bool {
        self.outputs.iter().any(|o| !o.held.is_empty())
    }

    /// Waits until a stream has output (or EOF), the `Wake` rings, or `until` passes; reads
    /// what is there and forwards what credit allows. True if output (or EOF) was read.
    fn step(&mut self, until: Option<Instant>) -> bool {
        let wake = &self.job.wake;
        let mut fds = [libc::pollfd { fd: wake.fd(), events: libc::POLLIN, revents: 0 }; 3];
        let mut streams = [0usize; 2];
        let mut n = 1;
        for (i, out) in self.outputs.iter().enumerate() {
            // A stream holding output leaves the rest in its pipe until credit comes.
            if let Some(pipe) = &out.pipe
                && out.held.is_empty()
            {
                fds[n] = libc::pollfd { fd: pipe.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                streams[n - 1] = i;
                n += 1;
            }
        }
        // Rounded up, so a wait never ends just before `until` and spins.
        let timeout = until.map_or(-1, |u| {
            let left = u.saturating_duration_since(Instant::now());
            left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
        });
        // SAFETY: `fds` holds `n` initialised entries, which poll only writes `revents` of.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), n as libc::nfds_t, timeout) };
        if rc < 0 {
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                log(&format!("poll for request {} failed: {err}", self.job.id));
                std::thread::sleep(Duration::from_millis(10));
            }
            return false;
        }
        if fds[0].revents != 0 {
            wake.clear();
            for out in &mut self.outputs {
                forward(self.ctx, self.job, out);
            }
        }
        let mut read = false;
        for (fd, &i) in fds[1..n].iter().zip(&streams) {
            if fd.revents != 0 {
                self.read(i);
                read = true;
            }
        }
        read
    }

    /// Reads stream `i` once: forwards up to `max_output` bytes as credit allows, drops the
    /// rest.
    fn read(&mut self, i: usize) {
        let max_output = self.job.max_output;
        let out = &mut self.outputs[i];
        let Some(pipe) = &mut out.pipe else { return };
        let n = match pipe.read(&mut out.buf) {
            Ok(0) => 0,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return,
            Err(_) => 0,
        };
        if n == 0 {
            out.pipe = None;
            return;
        }
        let take = match max_output {
            0 => n,
            limit => limit.saturating_sub(out.sent).min(n as u64) as usize,
        };
        if take < n {
            out.truncated = true;
        }
        out.sent += take as u64;
        out.held = 0..take;
        forward(self.ctx, self.job, out);
    }

    /// After the command's exit: reads until every stream is at EOF, or the pipes have been
    /// idle for `PIPE_GRACE`, or the caps pass (see the module doc). What is still held then
    /// is marked truncated.
    fn drain(&mut self) {
        let exited = Instant::now();
        let mut idle_since = exited;
        // Time spent holding output for want of credit, which does not count against DRAIN_CAP.
        let mut stalled_for = Duration::ZERO;
        // The last look that found output held: the time since then was a stall.
        let mut held_at: Option<Instant> = None;
        while self.open() || self.holding() {
            let now = Instant::now();
            if let Some(at) = held_at.take() {
                stalled_for += now.duration_since(at);
                idle_since = now;
            }
            let holding = self.holding();
            if holding {
                held_at = Some(now);
                idle_since = now;
            }
            let drain_end = exited + stalled_for + DRAIN_CAP;
            if now >= drain_end || stalled_for >= FLOW_STALL_CAP || (!holding && now >= idle_since + PIPE_GRACE) {
                break;
            }
            let until = if holding {
                drain_end.min(now + (FLOW_STALL_CAP - stalled_for))
            } else {
                drain_end.min(idle_since + PIPE_GRACE)
            };
            if self.step(Some(until)) {
                idle_since = Instant::now();
            }
        }
        for out in &mut self.outputs {
            if !out.held.is_empty() {
                out.truncated = true;
                out.held = 0..0;
            }
        }
    }
}

impl Drop for Pump<'_> {
    /// Hands the buffers back to the thread.
    fn drop(&mut self) {
        BUFS.with_borrow_mut(|bufs| {
            for (out, buf) in self.outputs.iter_mut().zip(bufs.iter_mut()) {
                *buf = std::mem::take(&mut out.buf);
            }
        });
    }
}

/// Forwards what `out` holds, as far as credit allows; once the request is closed, drops it.
fn forward(ctx: &Ctx, job: &Job, out: &mut Output) {
    while !out.held.is_empty() {
        if job.closed.load(Ordering::Relaxed) {
            out.held = 0..0;
            return;
        }
        let k = job.take_credit(out.held.len());
        if k == 0 {
            return;
        }
        let chunk = out.held.start..out.held.start + k;
        ctx.out.send_open(&job.closed, out.kind, job.id, &out.buf[chunk]);
        out.held.start += k;
    }
}

/// Writes queued stdin chunks to the command, acknowledging each under flow control; the
/// queue's end closes the command's stdin. After a write error (the command closed its stdin
/// or exited) chunks are drained and dropped.
fn feed(ctx: &Ctx, job: &Job, pipe: File, chunks: &Receiver<Vec<u8>>) {
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
        let mut left = lock(credit);
        *left = left.saturating_add(more.into());
        drop(left);
        job.wake.ring();
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
    use crate::out::{Out, Sink};
    use crate::reaper::Reaper;

    /// The stdout bytes sent so far.
    fn stdout(sink: &Sink) -> Vec<u8> {
        sink.frames().into_iter().filter(|f| f.kind == Kind::Stdout).flat_map(|f| f.payload).collect()
    }

    fn ctx(sink: &Sink) -> Ctx {
        Ctx {
            out: Out::new(Box::new(sink.clone())),
            reaper: Arc::new(Reaper::default()),
            env: vec![],
            user: None,
            home: "/".into(),
        }
    }

    fn job() -> Job {
        Job {
            id: 1,
            pid: 0,
            started: Instant::now(),
            timeout_ms: 0,
            max_output: 0,
            credit: None,
            pty: false,
            closed: AtomicBool::new(false),
            pipes: vec![],
            wake: Arc::new(Wake::new().unwrap()),
        }
    }

    fn pipe() -> (File, File) {
        let (r, w) = sys::pipe().unwrap();
        (File::from(r), File::from(w))
    }

    /// A command that exited with its output still in the pipe: the drain forwards it all.
    #[test]
    fn output_left_in_the_pipe_at_the_exit_is_forwarded() {
        let sink = Sink::default();
        let (ctx, job) = (ctx(&sink), job());
        let (read_end, mut write_end) = pipe();
        let big = vec![b'x'; 3 * MAX_CHUNK + 57];
        let writer = std::thread::spawn(move || write_end.write_all(&big));
        let mut pump =
            Pump::new(&ctx, &job, [Output::new(Kind::Stdout, Some(read_end)), Output::new(Kind::Stderr, None)]);
        pump.drain();
        writer.join().unwrap().unwrap();
        assert!(!pump.open(), "the drain ended before EOF");
        assert_eq!(stdout(&sink).len(), 3 * MAX_CHUNK + 57);
        assert!(!pump.outputs[0].truncated);
    }

    /// A background child holds the pipe open and writes once, late but within the grace:
    /// that output is forwarded, and the drain ends one grace after it, the pipe still open.
    #[test]
    fn a_pipe_held_open_ends_the_drain_one_grace_after_its_last_output() {
        let sink = Sink::default();
        let (ctx, job) = (ctx(&sink), job());
        let (read_end, mut write_end) = pipe();
        let (wrote_tx, wrote) = mpsc::channel();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(PIPE_GRACE / 2);
            write_end.write_all(b"57\n").unwrap();
            wrote_tx.send(Instant::now()).unwrap();
            // Held open, silent, until the test is done.
            std::thread::sleep(PIPE_GRACE * 20);
        });
        let mut pump =
            Pump::new(&ctx, &job, [Output::new(Kind::Stdout, Some(read_end)), Output::new(Kind::Stderr, None)]);
        pump.drain();
        let ended = Instant::now();
        assert_eq!(stdout(&sink), b"57\n");
        assert!(pump.open());
        let after = ended.duration_since(wrote.recv().unwrap());
        assert!(after >= PIPE_GRACE && after < PIPE_GRACE * 10, "the drain ended {after:?} after the output");
        drop(pump);
        drop(writer);
    }

    /// Under flow control with no credit, output is held (the rest left in the pipe) until
    /// credit comes; the `Wake` carries the credit's arrival to the pump.
    #[test]
    fn held_output_goes_out_when_credit_rings() {
        let sink = Sink::default();
        let ctx = ctx(&sink);
        let job = Job { credit: Some(Mutex::new(0)), ..job() };
        let (read_end, mut write_end) = pipe();
        write_end.write_all(b"hello").unwrap();
        drop(write_end);
        let mut pump =
            Pump::new(&ctx, &job, [Output::new(Kind::Stdout, Some(read_end)), Output::new(Kind::Stderr, None)]);
        assert!(pump.step(Some(Instant::now() + Duration::from_secs(5))));
        assert!(pump.holding() && stdout(&sink).is_empty());
        *lock(job.credit.as_ref().unwrap()) = 3;
        job.wake.ring();
        pump.step(Some(Instant::now() + Duration::from_secs(5)));
        assert_eq!(stdout(&sink), b"hel");
        *lock(job.credit.as_ref().unwrap()) = 100;
        job.wake.ring();
        pump.drain();
        assert_eq!(stdout(&sink), b"hello");
        assert!(!pump.open() && !pump.holding() && !pump.outputs[0].truncated);
    }
}

//! The agent's main loop: reads request frames from stdin, checks fences, and hands each
//! request to the exec or file handlers, which answer through the shared `Out` writer.
//!
//! Threads: the main loop (this module), the reaper, and per request a pooled one or two
//! (exec: one that pumps its output and waits for its exit, and with stdin a feeder; file
//! read: one streamer). The main loop never waits on a command, except on a plain `Exec` whose command
//! is a full stdin queue behind (see `exec`).
//! File uploads are written by the main loop itself: a chunk to the page cache is cheap.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};

use agent_proto::{
    ConnectSpec, Enc, ErrorInfo, ExecFlowSpec, ExecSpec, Frame, Kind, MAX_PARTS, PING_ID, PROTOCOL_VERSION, ReadSpec,
    WriteSpec, codes,
};

use crate::basics::{lock, log, spawn_thread};
use crate::ctx::{Ctx, bad_request, command_env};
use crate::exec::{self, Execs};
use crate::files::{self, Reads, Upload};
use crate::out::Out;
use crate::ports::{self, Ports};
use crate::reaper::Reaper;

/// The agent's command line: `--user UID:GID` (tenant code runs as that user, and every file
/// call is made as them), `--workdir DIR` (made theirs at start) and `--socket PATH` (also
/// serve the protocol on a Unix socket there, see `run`).
#[derive(Debug, Default)]
pub struct Options {
    pub user: Option<(u32, u32)>,
    pub workdir: Option<String>,
    pub socket: Option<String>,
}

impl Options {
    pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Options, String> {
        let mut o = Options::default();
        while let Some(a) = args.next() {
            let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
            match a.as_str() {
                "--user" => {
                    let v = value()?;
                    let ids = v.split_once(':').and_then(|(u, g)| Some((u.parse().ok()?, g.parse().ok()?)));
                    o.user = Some(ids.ok_or_else(|| format!("--user {v:?}: expected UID:GID"))?);
                }
                "--workdir" => o.workdir = Some(value()?),
                "--socket" => o.socket = Some(value()?),
                _ => return Err(format!("unknown argument {a:?}")),
            }
        }
        Ok(o)
    }
}

/// An upload in progress, by request id.
enum UploadState {
    Open(Upload),
    /// Already answered with an error; its remaining `Data` and `End` are dropped.
    Failed,
}

/// State owned by the main loop.
struct Server {
    ctx: Arc<Ctx>,
    execs: Arc<Execs>,
    reads: Arc<Reads>,
    ports: Arc<Ports>,
    writes: HashMap<u32, UploadState>,
    /// Highest fencing token seen on any request.
    fence: u64,
    /// Payloads arriving in `Part`s, by request id, until their request frame comes.
    parts: HashMap<u32, Vec<u8>>,
    /// Requests whose parts went past `MAX_PARTS`: their request frame is refused.
    oversized: std::collections::HashSet<u32>,
    /// The highest request id seen (`PING_ID` aside), which `Pong` reports.
    highest_id: u32,
}

/// Runs the agent on the process's stdin and stdout. Never returns: after stdin ends (or
/// breaks) the agent keeps reaping, so the sandbox keeps its processes.
pub fn run(opts: Options) -> ! {
    let out: Box<dyn Write + Send> = match io::stdout().as_fd().try_clone_to_owned() {
        Ok(fd) => Box::new(File::from(fd)),
        Err(e) => {
            log(&format!("cannot use stdout ({e}); replies are dropped"));
            Box::new(io::sink())
        }
    };
    if let Some((uid, gid)) = opts.user
        && let Err(e) = crate::sys::set_user(uid, gid, opts.workdir.as_deref())
    {
        log(&format!("cannot take on user {uid}:{gid}: {e}"));
        std::process::exit(1);
    }
    let ctx = Arc::new(Ctx {
        out: Out::new(out),
        reaper: Arc::new(Reaper::default()),
        env: command_env(),
        user: opts.user,
        home: opts.workdir.unwrap_or_else(|| "/".into()),
    });
    if let Err(e) = ctx.reaper.start() {
        log(&format!("cannot start the reaper thread: {e}"));
        std::process::exit(1);
    }
    let hello = Enc::default().u32(PROTOCOL_VERSION).u32(std::process::id()).finish();
    ctx.out.send(Kind::Hello, 0, &hello);

    let ports = Arc::new(Ports::new(ctx.clone()));
    let server = Arc::new(Mutex::new(Server {
        ctx: ctx.clone(),
        execs: Arc::new(Execs::new(ctx.clone())),
        reads: Arc::new(Reads::new(ctx.clone())),
        ports: ports.clone(),
        writes: HashMap::new(),
        fence: 0,
        parts: HashMap::new(),
        oversized: std::collections::HashSet::new(),
        highest_id: 0,
    }));
    if let Some(path) = &opts.socket {
        serve_socket(path, &ctx, &ports, &server, &hello);
    }
    let why = serve(&mut io::stdin().lock(), &server);
    log(&format!("stdin {why}; serving no more requests on it, still reaping"));
    // Dropping the uploads removes their temp files (unless the socket serves on).
    if opts.socket.is_none() {
        lock(&server).writes.clear();
    }
    drop(server);
    loop {
        std::thread::park();
    }
}

/// Serves the frames of `input` until it ends; says how it ended.
fn serve<R: io::Read>(input: &mut R, server: &Mutex<Server>) -> String {
    loop {
        match Frame::read_or_skip(input) {
            Ok(Some(Ok(frame))) => lock(server).take(frame),
            // A frame too long or of an unknown kind: refuse that request, serve on.
            Ok(Some(Err((id, why)))) => lock(server).ctx.out.send_error(id, &bad_request(why)),
            Ok(None) => return "closed".into(),
            Err(e) => return format!("broke ({e})"),
        }
    }
}

/// The direct channel: the host connects to a Unix socket at `path` (in a directory it
/// bind-mounts, readable by root only) instead of relaying frames through Docker's attach
/// stream. Each connection is read by a thread of its own until it ends; the newest one takes
/// the replies over (it gets a `Hello`, then every frame, as stdio did), so a restarted host
/// takes over at once even while its predecessor's connection is still open.
/// If the socket cannot be made, stdio stays the only channel.
fn serve_socket(path: &str, ctx: &Arc<Ctx>, ports: &Arc<Ports>, server: &Arc<Mutex<Server>>, hello: &[u8]) {
    use std::os::unix::fs::PermissionsExt as _;
    use std::os::unix::net::UnixListener;
    let _ = std::fs::remove_file(path);
    let listener = match UnixListener::bind(path) {
        Ok(l) => l,
        Err(e) => {
            log(&format!("cannot serve on {path} ({e}); stdio only"));
            return;
        }
    };
    if let Err(e) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
        log(&format!("cannot restrict {path} ({e}); stdio only"));
        return;
    }
    let (ctx, ports, server, hello) = (ctx.clone(), ports.clone(), server.clone(), hello.to_vec());
    let spawned = spawn_thread("socket", move || {
        for conn in listener.incoming() {
            let conn = match conn {
                Ok(c) => c,
                Err(e) => {
                    log(&format!("accept on the socket: {e}"));
                    continue;
                }
            };
            let writer = match conn.try_clone() {
                Ok(w) => w,
                Err(e) => {
                    log(&format!("socket connection: {e}"));
                    continue;
                }
            };
            // The newest connection gets the replies; an older one (a host that went away
            // without closing it, or is frozen) is still read until it ends.
            ctx.out.replace(Box::new(writer));
            ports::close_all(&ports);
            ctx.out.send(Kind::Hello, 0, &hello);
            let server = server.clone();
            let served = spawn_thread("connection", move || {
                let why = serve(&mut io::BufReader::new(conn), &server);
                log(&format!("socket connection {why}"));
            });
            if let Err(e) = served {
                log(&format!("cannot serve a socket connection: {e}"));
            }
        }
    });
    if let Err(e) = spawned {
        log(&format!("cannot start the socket thread ({e}); stdio only"));
    }
}

impl Server {
    /// Joins a request's `Part`s to its request frame, then handles it.
    fn take(&mut self, mut frame: Frame) {
        if frame.kind == Kind::Part {
            if self.oversized.contains(&frame.id) {
                return;
            }
            let buf = self.parts.entry(frame.id).or_default();
            if buf.len() + frame.payload.len() > MAX_PARTS {
                self.parts.remove(&frame.id);
                self.oversized.insert(frame.id);
            } else {
                buf.extend_from_slice(&frame.payload);
            }
            return;
        }
        if self.oversized.remove(&frame.id) {
            let why = format!("request of more than {MAX_PARTS} bytes");
            self.ctx.out.send_error(frame.id, &bad_request(why));
            return;
        }
        if let Some(mut head) = self.parts.remove(&frame.id) {
            head.extend_from_slice(&frame.payload);
            frame.payload = head;
        }
        self.handle(frame);
    }

    fn handle(&mut self, frame: Frame) {
        if frame.id != PING_ID {
            self.highest_id = self.highest_id.max(frame.id);
        }
        // The data, credit and close of an open port connection are its own.
        if ports::take(&self.ports, &frame) {
            return;
        }
        let Frame { kind, id, payload } = frame;
        let result = match kind {
            Kind::Exec => self.exec(id, &payload),
            Kind::ExecFlow => self.exec_flow(id, &payload),
            Kind::Credit => {
                let read = self.reads.get(id);
                match (read, agent_proto::Dec::new(&payload).u32()) {
                    (Some(read), Ok(n)) => read.grant(n),
                    _ => exec::credit(&self.execs, id, &payload),
                }
                Ok(())
            }
            Kind::Resize => {
                exec::resize(&self.execs, id, &payload);
                Ok(())
            }
            Kind::Stdin => {
                exec::stdin(&self.execs, id, Some(payload));
                Ok(())
            }
            Kind::StdinEof => {
                exec::stdin(&self.execs, id, None);
                Ok(())
            }
            Kind::Signal => {
                // A signal for a read or an upload cancels it (the upload's temp file goes).
                if let Some(read) = self.reads.get(id) {
                    read.cancel();
                } else if self.writes.remove(&id).is_some() {
                    self.ctx.out.send_error(id, &bad_request("the upload was cancelled"));
                } else {
                    exec::signal(&self.execs, id, &payload);
                }
                Ok(())
            }
            Kind::ReadFile => self.read_file(id, &payload),
            Kind::Connect => self.connect(id, &payload),
            Kind::FsOp => {
                let spec = agent_proto::FsOpSpec::decode(&payload)
                    .map_err(|e| bad_request(format!("bad file operation request: {e}")));
                spec.and_then(|spec| {
                    self.check_fence(spec.fence)?;
                    files::start_op(&self.ctx, id, spec)
                })
            }
            Kind::WriteFile => {
                self.write_file(id, &payload);
                Ok(())
            }
            Kind::Data => {
                self.write_data(id, &payload);
                Ok(())
            }
            Kind::End => {
                self.write_end(id);
                Ok(())
            }
            Kind::Ping => {
                self.ctx.out.send(Kind::Pong, id, &Enc::default().u32(PROTOCOL_VERSION).u32(self.highest_id).finish());
                Ok(())
            }
            // Joined in `take`; never reaches here.
            Kind::Part
            | Kind::Hello
            | Kind::Stdout
            | Kind::Stderr
            | Kind::Exit
            | Kind::Error
            | Kind::Done
            | Kind::StdinAck
            | Kind::Opened
            | Kind::Pong => Err(bad_request(format!("{kind:?} is not a request"))),
        };
        if let Err(err) = result {
            self.ctx.out.send_error(id, &err);
        }
    }

    /// Refuses a fence older than the highest seen, else raises the highest seen.
    fn check_fence(&mut self, fence: u64) -> Result<(), ErrorInfo> {
        if fence < self.fence {
            return Err(ErrorInfo::new(codes::STALE_FENCE, format!("fence {fence} is older than {}", self.fence)));
        }
        self.fence = fence;
        Ok(())
    }

    fn exec(&mut self, id: u32, payload: &[u8]) -> Result<(), ErrorInfo> {
        let spec = ExecSpec::decode(payload).map_err(|e| bad_request(format!("bad exec request: {e}")))?;
        self.check_fence(spec.fence)?;
        exec::start(&self.execs, id, spec, None)
    }

    fn exec_flow(&mut self, id: u32, payload: &[u8]) -> Result<(), ErrorInfo> {
        let flow = ExecFlowSpec::decode(payload).map_err(|e| bad_request(format!("bad exec request: {e}")))?;
        self.check_fence(flow.spec.fence)?;
        exec::start(&self.execs, id, flow.spec, Some(flow.credit))
    }

    fn read_file(&mut self, id: u32, payload: &[u8]) -> Result<(), ErrorInfo> {
        let spec = ReadSpec::decode(payload).map_err(|e| bad_request(format!("bad read request: {e}")))?;
        self.check_fence(spec.fence)?;
        files::start_read(&self.reads, id, spec)
    }

    fn connect(&mut self, id: u32, payload: &[u8]) -> Result<(), ErrorInfo> {
        let spec = ConnectSpec::decode(payload).map_err(|e| bad_request(format!("bad connect request: {e}")))?;
        self.check_fence(spec.fence)?;
        ports::start(&self.ports, id, spec)
    }

    /// Answers as soon as the outcome is known: an error right away (the rest of that upload
    /// is then dropped), `Done` after `End`.
    fn write_file(&mut self, id: u32, payload: &[u8]) {
        let opened =
            WriteSpec::decode(payload).map_err(|e| bad_request(format!("bad write request: {e}"))).and_then(|spec| {
                self.check_fence(spec.fence)?;
                Upload::create(id, &spec)
            });
        let state = match opened {
            Ok(upload) => UploadState::Open(upload),
            Err(err) => {
                self.ctx.out.send_error(id, &err);
                UploadState::Failed
            }
        };
        // A repeated id abandons the earlier upload (dropping it removes its temp file).
        self.writes.insert(id, state);
    }

    fn write_data(&mut self, id: u32, data: &[u8]) {
        if let Some(UploadState::Open(upload)) = self.writes.get_mut(&id)
            && let Err(err) = upload.write(data)
        {
            self.ctx.out.send_error(id, &err);
            self.writes.insert(id, UploadState::Failed);
        }
    }

    fn write_end(&mut self, id: u32) {
        if let Some(UploadState::Open(upload)) = self.writes.remove(&id) {
            match upload.commit() {
                Ok(n) => self.ctx.out.send(Kind::Done, id, &n.to_le_bytes()),
                Err(err) => self.ctx.out.send_error(id, &err),
            }
        }
    }
}

//! One long-lived, multiplexed channel to the agent inside a sandbox, over a plain byte
//! stream (`Link`: the agent's own socket, or whatever the runtime attaches to its stdio). Requests are told apart by id; a reader task routes reply frames to the
//! waiting request. When the stream ends, every waiting request fails with `Closed`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_proto::{self as proto, ErrorInfo, ExecSpec, ExitInfo, Frame, Kind, ReadSpec, WriteSpec};
use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::sync::lock;

mod link;
mod streams;

pub(crate) use link::Link;
pub(crate) use streams::{ExecStream, StreamControl};

/// Bytes of output a streaming exec may have in flight before the agent waits for credit.
pub(crate) const STREAM_WINDOW: u32 = 256 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the sandbox's agent channel is closed")]
    Closed,
    #[error("agent refused: {}: {}", .0.code, .0.message)]
    Remote(ErrorInfo),
    #[error("agent protocol error: {0}")]
    Protocol(String),
    #[error("agent did not answer in time")]
    Timeout,
    /// The request is larger than this sandbox's agent can take (an agent older than
    /// protocol version 3 takes no request payload over one frame).
    #[error("request too large for the sandbox's agent: {0}")]
    TooLarge(String),
    /// The body of an upload broke off (its client went away).
    #[error("the upload broke off: {0}")]
    Upload(String),
}

/// What an exec produced.
#[derive(Debug, Default)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit: ExitInfo,
}

type Writer = Pin<Box<dyn AsyncWrite + Send>>;

struct Inner {
    sandbox: String,
    writer: tokio::sync::Mutex<Writer>,
    /// Reply routes. Unbounded so one slow request never stalls the shared reader; what a
    /// request can have queued is bounded by its output cap (exec), its file size limit
    /// (reads) or its credit window (streams).
    pending: Mutex<HashMap<u32, mpsc::UnboundedSender<Frame>>>,
    /// Stdin windows of flow-controlled execs: a permit per unacknowledged `Stdin` frame.
    stdin_windows: Mutex<HashMap<u32, Arc<tokio::sync::Semaphore>>>,
    next_id: AtomicU32,
    /// The agent's protocol version: from its `Hello` (a new sandbox) or a `Pong` (after a
    /// reattach); 2 until known, the oldest this host still speaks.
    version: AtomicU32,
    alive: AtomicBool,
    /// One ping at a time: they share `PING_ID`.
    ping_lock: tokio::sync::Mutex<()>,
    /// Set when a write to the agent failed: the channel is lost (its sandbox has failed),
    /// not closed on purpose.
    failed: AtomicBool,
    /// Cancelled when the channel is closed, from either side.
    closed: CancellationToken,
    /// Over the agent's socket rather than Docker's attach stream.
    direct: bool,
}

/// Cheap to clone; all clones share the channel.
#[derive(Clone)]
pub struct AgentConn {
    inner: Arc<Inner>,
}

/// Removes a request's reply route however the request ends.
pub(crate) struct Route {
    inner: Arc<Inner>,
    id: u32,
    rx: mpsc::UnboundedReceiver<Frame>,
}

impl Drop for Route {
    fn drop(&mut self) {
        lock(&self.inner.pending).remove(&self.id);
        lock(&self.inner.stdin_windows).remove(&self.id);
    }
}

/// Sends `SIGKILL` for request `id` when dropped armed (`conn` set): its caller is gone. For a
/// command, the agent kills everything it started (see its `exec` module); a read or an
/// upload is cancelled.
struct CancelOnDrop {
    conn: Option<AgentConn>,
    id: u32,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        if !conn.is_alive() {
            return;
        }
        let frame = Frame::new(Kind::Signal, self.id, (libc::SIGKILL as u32).to_le_bytes().to_vec());
        // Drop runs outside any runtime only at shutdown, when the channel goes anyway.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = conn.send(&[frame]).await;
            });
        }
    }
}

impl Route {
    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    pub(crate) async fn next(&mut self) -> Result<Frame, AgentError> {
        tokio::select! {
            f = self.rx.recv() => f.ok_or(AgentError::Closed),
            _ = self.inner.closed.cancelled() => Err(AgentError::Closed),
        }
    }
}

impl AgentConn {
    /// Takes over a link to the agent and starts the reader task on `tracker`.
    /// `lost` is cancelled if the stream ends while `cancel` is not.
    pub fn start(
        sandbox: &str,
        link: Link,
        tracker: &TaskTracker,
        cancel: CancellationToken,
    ) -> (AgentConn, CancellationToken) {
        let inner = Arc::new(Inner {
            sandbox: sandbox.to_string(),
            writer: tokio::sync::Mutex::new(link.writer),
            pending: Mutex::new(HashMap::new()),
            stdin_windows: Mutex::new(HashMap::new()),
            next_id: AtomicU32::new(1),
            version: AtomicU32::new(2),
            alive: AtomicBool::new(true),
            ping_lock: tokio::sync::Mutex::new(()),
            failed: AtomicBool::new(false),
            closed: cancel.child_token(),
            direct: link.direct,
        });
        let lost = CancellationToken::new();
        tracker.spawn(read_loop(inner.clone(), link.reader, cancel, lost.clone()));
        (AgentConn { inner }, lost)
    }

    /// Whether frames travel over the agent's own socket (else through Docker's attach stream).
    pub fn is_direct(&self) -> bool {
        self.inner.direct
    }

    /// The agent's protocol version (2 until it says otherwise).
    pub fn version(&self) -> u32 {
        self.inner.version.load(Ordering::Acquire)
    }

    pub fn is_alive(&self) -> bool {
        self.inner.alive.load(Ordering::Acquire)
    }

    /// Closes the channel; waiting requests fail with `Closed`.
    pub fn close(&self) {
        self.inner.alive.store(false, Ordering::Release);
        self.inner.closed.cancel();
    }

    fn route(&self) -> Result<Route, AgentError> {
        let mut id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        // 0 is the agent's `Hello`, `PING_ID` the pings'.
        while id == 0 || id == proto::PING_ID {
            id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        }
        self.route_as(id)
    }

    fn route_as(&self, id: u32) -> Result<Route, AgentError> {
        if !self.is_alive() {
            return Err(AgentError::Closed);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.inner.pending).insert(id, tx);
        Ok(Route { inner: self.inner.clone(), id, rx })
    }

    /// A request frame as it must travel to this agent: in `Part`s when its payload is longer
    /// than a chunk (a long command line), which agents of version 3 and later join.
    fn request(&self, frame: Frame) -> Result<Vec<Frame>, AgentError> {
        if frame.payload.len() <= proto::MAX_CHUNK {
            return Ok(vec![frame]);
        }
        if frame.payload.len() > proto::MAX_PARTS {
            return Err(AgentError::TooLarge(format!("{} bytes, at most {}", frame.payload.len(), proto::MAX_PARTS)));
        }
        if self.inner.version.load(Ordering::Acquire) < 3 {
            return Err(AgentError::TooLarge(format!(
                "{} bytes; this sandbox's agent predates requests over {} bytes (open a new session)",
                frame.payload.len(),
                proto::MAX_CHUNK
            )));
        }
        Ok(frame.into_parts())
    }

    /// The hook of `ports.rs`: a new request's route, whose `StdinAck`s (if `window`) add
    /// permits to `window`.
    pub(crate) fn open_route(&self, window: Option<Arc<tokio::sync::Semaphore>>) -> Result<Route, AgentError> {
        let route = self.route()?;
        if let Some(w) = window {
            lock(&self.inner.stdin_windows).insert(route.id, w);
        }
        Ok(route)
    }

    pub(crate) async fn send(&self, frames: &[Frame]) -> Result<(), AgentError> {
        let mut buf = Vec::new();
        for f in frames {
            f.encode_into(&mut buf);
        }
        self.write(&buf).await
    }

    async fn write(&self, buf: &[u8]) -> Result<(), AgentError> {
        let mut w = self.inner.writer.lock().await;
        let r = async {
            w.write_all(buf).await?;
            w.flush().await
        };
        match tokio::time::timeout(Duration::from_secs(30), r).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) | Err(_) => {
                drop(w);
                // The sandbox's watcher hears of it (`lost`) and fails the sandbox: a channel
                // that cannot be written must not leave a sandbox that answers 502 for good.
                self.inner.failed.store(true, Ordering::Release);
                self.close();
                Err(AgentError::Closed)
            }
        }
    }

    /// Round trip to the agent, with `PING_ID`: learns its protocol version and (version 4)
    /// the highest request id it has seen, above which this channel then numbers its requests
    /// (a reattached channel must not take an earlier request's frames for its own). Frames of
    /// other kinds under that id (none but an earlier ping's) are passed over.
    #[tracing::instrument(name = "agent.ping", skip_all, fields(otel.kind = "client"))]
    pub async fn ping(&self, timeout: Duration) -> Result<(), AgentError> {
        let _one = tokio::time::timeout(timeout, self.inner.ping_lock.lock()).await.map_err(|_| AgentError::Timeout)?;
        let mut route = self.route_as(proto::PING_ID)?;
        self.send(&[Frame::new(Kind::Ping, route.id, vec![])]).await?;
        let pong = async {
            loop {
                let f = route.next().await?;
                if f.kind == Kind::Pong {
                    return Ok(f);
                }
            }
        };
        let f = tokio::time::timeout(timeout, pong).await.map_err(|_| AgentError::Timeout)??;
        // Version 3 and later say their version; an empty Pong is an older agent.
        let mut d = proto::Dec::new(&f.payload);
        if let Ok(v) = d.u32() {
            self.inner.version.store(v, Ordering::Release);
        }
        if let Ok(highest) = d.u32() {
            self.inner.next_id.fetch_max(highest.saturating_add(1), Ordering::AcqRel);
        }
        Ok(())
    }

    /// Runs a command to completion, collecting its (already capped) output.
    /// `deadline` bounds the whole call in case the agent itself is wedged.
    #[tracing::instrument(name = "agent.exec", skip_all, fields(otel.kind = "client"))]
    pub async fn exec(
        &self,
        spec: ExecSpec,
        stdin: Option<Bytes>,
        deadline: Duration,
    ) -> Result<ExecOutput, AgentError> {
        let mut route = self.route()?;
        let id = route.id;
        let has_stdin = spec.has_stdin;
        // The agent caps each stream at `max_output`; this side holds it to that, a chunk of
        // slack aside, rather than trust it with memory.
        let cap = if spec.max_output == 0 { usize::MAX } else { spec.max_output as usize + proto::MAX_CHUNK };
        // Small stdin rides in the same write as the request: one syscall for the common case.
        let mut frames = self.request(Frame::new(Kind::Exec, id, spec.encode()))?;
        let stdin = stdin.unwrap_or_default();
        let mut chunks = stdin.chunks(proto::MAX_CHUNK);
        if has_stdin && stdin.len() <= proto::MAX_CHUNK {
            frames.extend(chunks.next().map(|c| Frame::new(Kind::Stdin, id, c.to_vec())));
            frames.push(Frame::new(Kind::StdinEof, id, vec![]));
        }
        self.send(&frames).await?;
        // From here, a call given up on (its client hung up, or the deadline passed) kills its
        // command rather than leaving it to run to its own timeout.
        let mut running = CancelOnDrop { conn: Some(self.clone()), id };
        let run = async {
            let mut out = ExecOutput::default();
            let feed = async {
                if has_stdin && stdin.len() > proto::MAX_CHUNK {
                    for c in chunks {
                        self.send(&[Frame::new(Kind::Stdin, id, c.to_vec())]).await?;
                    }
                    self.send(&[Frame::new(Kind::StdinEof, id, vec![])]).await?;
                }
                Ok::<(), AgentError>(())
            };
            let collect = async {
                loop {
                    let f = route.next().await?;
                    match f.kind {
                        Kind::Stdout | Kind::Stderr => {
                            let buf = if f.kind == Kind::Stdout { &mut out.stdout } else { &mut out.stderr };
                            if buf.len() + f.payload.len() > cap {
                                return Err(AgentError::Protocol(format!("output over its cap of {cap} bytes")));
                            }
                            buf.extend_from_slice(&f.payload);
                        }
                        Kind::Exit => {
                            out.exit = ExitInfo::decode(&f.payload).map_err(|e| AgentError::Protocol(e.to_string()))?;
                            return Ok(());
                        }
                        Kind::Error => return Err(remote(&f)),
                        k => return Err(AgentError::Protocol(format!("unexpected {k:?} during exec"))),
                    }
                }
            };
            let (fed, collected) = tokio::join!(feed, collect);
            collected?;
            fed?;
            Ok(out)
        };
        let r = match tokio::time::timeout(deadline, run).await {
            Ok(r) => r,
            Err(_) => Err(AgentError::Timeout),
        };
        if !matches!(r, Err(AgentError::Timeout)) {
            running.conn = None; // it ended (or the channel did): nothing to kill
        }
        r
    }

    /// Reads a file (or a directory as tar).
    #[tracing::instrument(name = "agent.read_file", skip_all, fields(otel.kind = "client"))]
    pub async fn read_file(&self, spec: ReadSpec, deadline: Duration) -> Result<Vec<u8>, AgentError> {
        let mut route = self.route()?;
        self.send(&[Frame::new(Kind::ReadFile, route.id, spec.encode())]).await?;
        let run = async {
            let mut data = Vec::new();
            loop {
                let f = route.next().await?;
                match f.kind {
                    Kind::Data => data.extend_from_slice(&f.payload),
                    Kind::End => return Ok(data),
                    Kind::Error => return Err(remote(&f)),
                    k => return Err(AgentError::Protocol(format!("unexpected {k:?} during read"))),
                }
            }
        };
        tokio::time::timeout(deadline, run).await.map_err(|_| AgentError::Timeout)?
    }

    /// A one-shot file operation (version 6): the `Done` payload.
    #[tracing::instrument(name = "agent.fs_op", skip_all, fields(otel.kind = "client"))]
    pub async fn fs_op(&self, spec: proto::FsOpSpec, deadline: Duration) -> Result<Vec<u8>, AgentError> {
        let mut route = self.route()?;
        self.send(&self.request(Frame::new(Kind::FsOp, route.id, spec.encode()))?).await?;
        let run = async {
            let f = route.next().await?;
            match f.kind {
                Kind::Done => Ok(f.payload),
                Kind::Error => Err(remote(&f)),
                k => Err(AgentError::Protocol(format!("unexpected {k:?} during a file operation"))),
            }
        };
        tokio::time::timeout(deadline, run).await.map_err(|_| AgentError::Timeout)?
    }

    /// Writes a file, creating parent directories (`write_stream` of one chunk).
    pub async fn write_file(&self, spec: WriteSpec, data: Bytes, deadline: Duration) -> Result<u64, AgentError> {
        let data = futures::stream::once(async move { Ok::<Bytes, std::convert::Infallible>(data) });
        tokio::time::timeout(deadline, self.write_stream(spec, data, u64::MAX))
            .await
            .map_err(|_| AgentError::Timeout)?
    }
}

fn remote(f: &Frame) -> AgentError {
    match ErrorInfo::decode(&f.payload) {
        Ok(e) => AgentError::Remote(e),
        Err(e) => AgentError::Protocol(e.to_string()),
    }
}

/// How much the reader takes from the link at once.
const READ_CHUNK: usize = 64 * 1024;

async fn read_loop(
    inner: Arc<Inner>,
    mut reader: Pin<Box<dyn AsyncRead + Send>>,
    cancel: CancellationToken,
    lost: CancellationToken,
) {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; READ_CHUNK];
    let why = loop {
        let read = tokio::select! {
            _ = inner.closed.cancelled() => break "closed",
            r = reader.read(&mut chunk) => r,
        };
        match read {
            Ok(0) => break "stream ended",
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                loop {
                    match Frame::decode(&mut buf) {
                        Ok(Some(frame)) => dispatch(&inner, frame),
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!(sandbox = %inner.sandbox, error = %e, "agent sent a malformed frame");
                            buf.clear();
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::debug!(sandbox = %inner.sandbox, error = %e, "agent stream error");
                break "stream error";
            }
        }
    };
    inner.alive.store(false, Ordering::Release);
    inner.closed.cancel();
    lock(&inner.pending).clear();
    if !cancel.is_cancelled() && (why != "closed" || inner.failed.load(Ordering::Acquire)) {
        tracing::debug!(sandbox = %inner.sandbox, why, "agent channel lost");
        lost.cancel();
    }
}

fn dispatch(inner: &Inner, frame: Frame) {
    match frame.kind {
        Kind::Hello => {
            if let Ok(v) = proto::Dec::new(&frame.payload).u32() {
                inner.version.store(v, Ordering::Release);
            }
            return;
        }
        Kind::StdinAck => {
            let n = proto::Dec::new(&frame.payload).u32().unwrap_or(1) as usize;
            if let Some(w) = lock(&inner.stdin_windows).get(&frame.id).cloned() {
                w.add_permits(n);
            }
            return;
        }
        _ => {}
    }
    let tx = lock(&inner.pending).get(&frame.id).cloned();
    if let Some(tx) = tx {
        // A request that stopped listening has dropped its receiver; that is fine.
        let _ = tx.send(frame);
    }
}

#[cfg(test)]
mod tests {
    use std::task::{Context, Poll};

    use tokio_util::sync::CancellationToken;
    use tokio_util::task::TaskTracker;

    use super::*;

    /// An agent that never says a word.
    struct Pending;

    impl AsyncRead for Pending {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Poll::Pending
        }
    }

    /// A link that refuses every write.
    struct Broken;

    impl AsyncWrite for Broken {
        fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, _: &[u8]) -> Poll<std::io::Result<usize>> {
            Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_failed_write_loses_the_channel_so_its_sandbox_is_failed() {
        // Its output stays open (the agent's side looks alive); only writing fails.
        let link = Link { direct: false, reader: Box::pin(Pending), writer: Box::pin(Broken) };
        let (conn, lost) = AgentConn::start("n.00", link, &TaskTracker::new(), CancellationToken::new());
        let r = conn.exec(ExecSpec { argv: vec!["true".into()], ..Default::default() }, None, Duration::from_secs(5));
        assert!(matches!(r.await, Err(AgentError::Closed)));
        assert!(!conn.is_alive());
        tokio::time::timeout(Duration::from_secs(2), lost.cancelled()).await.expect("the watcher hears of it");
    }
}

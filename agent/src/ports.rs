//! Connections to a port inside the sandbox (`Kind::Connect`, protocol version 5): the agent,
//! PID 1 in the sandbox's network namespace, connects to `127.0.0.1:port` and relays bytes
//! between that socket and the host's channel. The sandbox gets no network for it: the
//! connection starts inside, on its loopback interface, and the bytes leave through the
//! channel the host already has.
//!
//! Per connection two threads: a reader (connects, then forwards what the port sends within
//! the host's credit) and a writer (writes the host's `Data` in order and acknowledges each).
//! The main loop only queues: at most `STDIN_WINDOW` frames, which the host keeps to, so a
//! server that does not read never stalls the agent's other requests.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use agent_proto::{ConnectSpec, ErrorInfo, Frame, Kind, MAX_CHUNK, STDIN_WINDOW, codes};

use crate::basics::{lock, spawn_thread};
use crate::ctx::{Ctx, bad_request, no_room};

/// Bound on connecting to a port on loopback: immediate unless the server's accept backlog
/// is full.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the host sends towards the port, in order.
enum ToPort {
    Data(Vec<u8>),
    /// The host's end of stream: half-close the connection.
    End,
}

/// The open connections, by request id, and what their threads share.
pub struct Ports {
    ctx: Arc<Ctx>,
    open: Mutex<HashMap<u32, Arc<Conn>>>,
}

impl Ports {
    /// No connection open yet.
    pub fn new(ctx: Arc<Ctx>) -> Ports {
        Ports { ctx, open: Mutex::new(HashMap::new()) }
    }
}

/// One open connection, as the main loop and its two threads see it.
struct Conn {
    id: u32,
    /// Taken out when the connection closes, which ends the writer's wait.
    to_port: Mutex<Option<SyncSender<ToPort>>>,
    /// Bytes the reader may still forward.
    credit: Mutex<u64>,
    more: Condvar,
    /// Set by the host's `Signal` (or a failure): both threads stop without another frame.
    closed: AtomicBool,
    /// A handle on the socket once connected, to shut it down from the main loop.
    socket: Mutex<Option<TcpStream>>,
    /// Threads (reader, writer) that have finished; the second one forgets the connection.
    finished: AtomicU8,
}

impl Conn {
    /// Waits for credit; how many bytes may be forwarded now (at most `MAX_CHUNK`), or 0 once
    /// the connection is closed.
    fn take_credit(&self) -> usize {
        let mut left = lock(&self.credit);
        loop {
            if self.closed.load(Ordering::Acquire) {
                return 0;
            }
            if *left > 0 {
                return (*left).min(MAX_CHUNK as u64) as usize;
            }
            left = self.more.wait(left).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn spend(&self, n: usize) {
        let mut left = lock(&self.credit);
        *left = left.saturating_sub(n as u64);
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        drop(lock(&self.credit));
        self.more.notify_all();
        lock(&self.to_port).take();
        if let Some(s) = lock(&self.socket).as_ref() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Called by each thread as it ends: the last one removes the connection from the map.
    fn finish(&self, ports: &Ports) {
        if self.finished.fetch_add(1, Ordering::AcqRel) == 1 {
            lock(&ports.open).remove(&self.id);
        }
    }
}

/// Starts connection `id` (its fence was checked by the caller).
pub fn start(ports: &Arc<Ports>, id: u32, spec: ConnectSpec) -> Result<(), ErrorInfo> {
    if spec.port == 0 {
        return Err(bad_request("port 0 is not a port"));
    }
    let (to_port, rx) = mpsc::sync_channel(STDIN_WINDOW as usize);
    let conn = Arc::new(Conn {
        id,
        to_port: Mutex::new(Some(to_port)),
        credit: Mutex::new(spec.credit.into()),
        more: Condvar::new(),
        closed: AtomicBool::new(false),
        socket: Mutex::new(None),
        finished: AtomicU8::new(0),
    });
    lock(&ports.open).insert(id, conn.clone());
    let ports2 = ports.clone();
    let started = spawn_thread("port-read", move || read_side(&ports2, &conn, spec.port, rx));
    started.map_err(|e| {
        lock(&ports.open).remove(&id);
        no_room(codes::IO, format!("cannot start a thread: {e}"), &e)
    })
}

/// Closes every open connection: a new host channel took over (a restarted node), and
/// nobody holds the old channel's connections any more. (Commands, unlike connections, are
/// the session's own and go on.)
pub fn close_all(ports: &Ports) {
    let open: Vec<Arc<Conn>> = lock(&ports.open).values().cloned().collect();
    for conn in open {
        conn.close();
    }
}

/// Handles a host frame for an open connection; false when `frame` is not one (the caller
/// dispatches it as before).
pub fn take(ports: &Ports, frame: &Frame) -> bool {
    if !matches!(frame.kind, Kind::Data | Kind::End | Kind::Credit | Kind::Signal) {
        return false;
    }
    let Some(conn) = lock(&ports.open).get(&frame.id).cloned() else { return false };
    match frame.kind {
        Kind::Data | Kind::End => {
            let item = if frame.kind == Kind::End { ToPort::End } else { ToPort::Data(frame.payload.clone()) };
            let sent = lock(&conn.to_port).as_ref().map(|tx| tx.try_send(item));
            match sent {
                None | Some(Ok(())) | Some(Err(TrySendError::Disconnected(_))) => {}
                Some(Err(TrySendError::Full(_))) => {
                    conn.close();
                    let why = format!("more than {STDIN_WINDOW} unacknowledged data frames");
                    ports.ctx.out.send_error(frame.id, &bad_request(why));
                }
            }
        }
        Kind::Credit => {
            if let Ok(n) = agent_proto::Dec::new(&frame.payload).u32() {
                *lock(&conn.credit) += u64::from(n);
                conn.more.notify_all();
            }
        }
        _ => conn.close(),
    }
    true
}

/// The reader thread: connects, starts the writer, then forwards the port's bytes.
fn read_side(ports: &Arc<Ports>, conn: &Arc<Conn>, port: u16, rx: Receiver<ToPort>) {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let stream = match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
        Ok(s) => s,
        Err(e) => {
            lock(&ports.open).remove(&conn.id);
            let code = if e.kind() == io::ErrorKind::ConnectionRefused { codes::REFUSED } else { codes::IO };
            ports
                .ctx
                .out
                .send_error(conn.id, &ErrorInfo::new(code, format!("connect to port {port} in the sandbox: {e}")));
            return;
        }
    };
    let _ = stream.set_nodelay(true);
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => return fail(ports, conn, format!("port {port}: {e}")),
    };
    *lock(&conn.socket) = stream.try_clone().ok();
    let (ports2, conn2) = (ports.clone(), conn.clone());
    if let Err(e) = spawn_thread("port-write", move || write_side(&ports2, &conn2, writer, rx)) {
        let _ = stream.shutdown(Shutdown::Both);
        lock(&ports.open).remove(&conn.id);
        ports.ctx.out.send_error(conn.id, &no_room(codes::IO, format!("cannot start a thread: {e}"), &e));
        return;
    }
    ports.ctx.out.send(Kind::Opened, conn.id, &[]);
    forward(ports, conn, stream);
    conn.finish(ports);
}

fn forward(ports: &Ports, conn: &Conn, mut stream: TcpStream) {
    let mut buf = vec![0u8; MAX_CHUNK];
    let mut total: u64 = 0;
    loop {
        // Out of credit, the port's end of stream is still news: wait for bytes or the end
        // without taking any (a server that answered and closed is done, credit or not).
        if *lock(&conn.credit) == 0 {
            match stream.peek(&mut buf[..1]) {
                Ok(0) => return end(ports, conn, total),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return read_failed(ports, conn, &e),
            }
        }
        let room = conn.take_credit();
        if room == 0 {
            return; // closed by the host
        }
        match stream.read(&mut buf[..room]) {
            Ok(0) => return end(ports, conn, total),
            Ok(n) => {
                conn.spend(n);
                total += n as u64;
                ports.ctx.out.send(Kind::Data, conn.id, &buf[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return read_failed(ports, conn, &e),
        }
    }
}

/// The port's end of stream (unless the host closed the connection first).
fn end(ports: &Ports, conn: &Conn, total: u64) {
    if !conn.closed.load(Ordering::Acquire) {
        ports.ctx.out.send(Kind::End, conn.id, &total.to_le_bytes());
    }
}

fn read_failed(ports: &Ports, conn: &Conn, e: &io::Error) {
    if !conn.closed.swap(true, Ordering::AcqRel) {
        ports.ctx.out.send_error(conn.id, &ErrorInfo::new(codes::REFUSED, format!("read from the port: {e}")));
    }
    conn.close();
}

/// The writer thread: the host's bytes to the port, each frame acknowledged once written.
fn write_side(ports: &Ports, conn: &Conn, mut stream: TcpStream, rx: Receiver<ToPort>) {
    let ack = 1u32.to_le_bytes();
    while let Ok(item) = rx.recv() {
        if conn.closed.load(Ordering::Acquire) {
            break;
        }
        match item {
            ToPort::Data(data) => {
                if let Err(e) = stream.write_all(&data) {
                    if !conn.closed.swap(true, Ordering::AcqRel) {
                        ports
                            .ctx
                            .out
                            .send_error(conn.id, &ErrorInfo::new(codes::REFUSED, format!("write to the port: {e}")));
                    }
                    conn.close();
                    break;
                }
                ports.ctx.out.send(Kind::StdinAck, conn.id, &ack);
            }
            ToPort::End => {
                let _ = stream.shutdown(Shutdown::Write);
                break;
            }
        }
    }
    conn.finish(ports);
}

/// A failure after the connection was made but before it was announced.
fn fail(ports: &Ports, conn: &Conn, why: String) {
    conn.close();
    lock(&ports.open).remove(&conn.id);
    ports.ctx.out.send_error(conn.id, &ErrorInfo::new(codes::IO, why));
}

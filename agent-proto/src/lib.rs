//! The wire protocol between the pool-manager and the in-sandbox agent.
//!
//! One byte stream each way (the container's attached stdin/stdout), carrying frames:
//!
//! ```text
//! u32 LE  len      length of everything after this field (kind + id + payload)
//! u8      kind     see `Kind`
//! u32 LE  id       request id chosen by the host; the agent echoes it on every reply frame
//! [u8]    payload  kind-specific, encoded with `Enc` / decoded with `Dec`
//! ```
//!
//! Many requests are in flight at once, told apart by `id`. Large data (stdin, output, file
//! contents) travels as a sequence of chunk frames of at most `MAX_CHUNK` bytes so one big
//! transfer never blocks the others for long. This crate is std-only: the static agent and
//! the host side share the same codec.
//!
//! ## Streaming execs (protocol version 2)
//!
//! `Exec` runs a command whose output the agent forwards as fast as the host reads its stdout:
//! fine for a capped, collected result. `ExecFlow` runs the same `ExecSpec` under flow control,
//! for output streamed on to a client that may be slow:
//!
//! - **Output credit.** The agent forwards at most as many `Stdout` + `Stderr` payload bytes
//!   (one budget for both streams together) as the host has granted: `ExecFlowSpec::credit`
//!   at the start, plus every `Credit` since. Out of credit, a stream's reader keeps the at most
//!   one chunk it has read and stops reading its pipe, so the command blocks on a full pipe
//!   and a slow client slows the command instead of growing memory. Credit is never returned
//!   and never expires; bytes cut by `max_output` use none. Once the command has exited, the
//!   agent waits at most `FLOW_STALL_CAP_MS` in total for credit to forward what it still
//!   holds, then sends `Exit` with the stream marked truncated.
//! - **Stdin window.** The host may have at most `STDIN_WINDOW` `Stdin` frames of an `ExecFlow`
//!   request in flight: sent, but not yet acknowledged by a `StdinAck`. The agent acknowledges
//!   every `Stdin` frame once the command has taken it (or it was discarded because the command
//!   closed its stdin, or was started without one). Within the window the agent's request loop
//!   never waits for the command, so a command that neither reads its stdin nor gets output
//!   credit cannot stall the other requests (or the `Credit` that would unblock it). `StdinEof`
//!   takes no slot. Plain `Exec` has no acknowledgements; there the agent's request loop itself
//!   waits while a command is `STDIN_WINDOW` chunks behind.
//!
//! ## Pseudo-terminals
//!
//! `ExecSpec::pty_rows` and `pty_cols` both non-zero (with `Exec` or `ExecFlow`) run the
//! command on a new pseudo-terminal of that size: the terminal is its stdin, stdout and stderr
//! and its controlling terminal, in a session of its own; `TERM` is `xterm-256color` unless
//! `env` sets it. Everything it prints arrives as `Stdout` (never `Stderr`), with the
//! terminal's own translations (`\n` becomes `\r\n`, input is echoed). `Stdin` bytes are typed
//! into the terminal whether or not `has_stdin` is set (`\x03` is Ctrl-C, `\x04` at the start
//! of a line is end of input), and `StdinEof` is ignored: a terminal has no end of input but
//! the one typed. `Resize` changes the size (the kernel sends `SIGWINCH`). `Signal` goes to
//! the terminal's foreground process group, as if typed (the running command of a shell, or
//! the shell at its prompt), except `SIGHUP` and `SIGKILL`, which go to every process group of
//! the session (hang-up, kill): send one of those to end an interactive shell, which itself
//! ignores `SIGINT` and `SIGTERM`. The timeout kills every process group of the session too.
//!
//! ## Ports (protocol version 5)
//!
//! `Connect` opens a TCP connection from the agent to `127.0.0.1:port` inside the sandbox's
//! own network namespace (the agent is its PID 1), so a server in a sandbox without any
//! network (`network = "none"`: loopback only) is reachable by the host through the channel
//! and by nothing else. The agent answers `Opened` (or `Error`: code `refused` when nothing
//! listens). Then bytes travel as `Data` both ways:
//!
//! - **From the port** the agent forwards at most `ConnectSpec::credit` bytes plus every
//!   `Credit` since, like `ExecFlow`'s output: a slow client slows the server in the sandbox.
//!   The port's end of stream is `End` (payload u64 bytes forwarded); a failed read is `Error`.
//! - **To the port** the host keeps at most `STDIN_WINDOW` `Data` frames unacknowledged; the
//!   agent answers each with a `StdinAck` once written to the socket. `End` from the host
//!   half-closes the connection (after the queued data); `Signal` (any number) closes it at
//!   once and is answered by nothing.
//!
//! The request is over for the host at `Error`, or once it has seen `End` and sent `End`.
//!
//! The frames and their kinds are here; the payloads of requests and answers in `payloads`,
//! their little-endian codec in `codec`.

use std::io;

mod codec;
pub mod layout;
mod payloads;

use codec::invalid;
pub use codec::{Dec, Enc};
pub use payloads::{
    ConnectSpec, DirEntry, EntryKind, ErrorInfo, ExecFlowSpec, ExecSpec, ExitInfo, FsOpKind, FsOpSpec, LIST_MAX,
    Listing, ReadSpec, WinSize, WriteSpec, codes,
};

/// Largest payload of one data chunk frame.
pub const MAX_CHUNK: usize = 64 * 1024;
/// Largest frame either side accepts. A version-3 agent refuses a longer one for its request
/// only (it skips the frame's bytes); earlier agents stop serving.
pub const MAX_FRAME: usize = MAX_CHUNK + 64 * 1024;
/// Most bytes one request's payload may have when sent in `Part`s (a command line, an
/// environment): above the largest request body a gateway accepts by default (64 MiB).
pub const MAX_PARTS: usize = 96 << 20;
/// Bumped on any incompatible change or new capability; sent in `Hello` and (from version 3)
/// in `Pong`. Version 2 added pseudo-terminals and `ExecFlow`, `Credit`, `Resize` and
/// `StdinAck`; version 3 added `Part` (a request payload longer than a chunk), the version in
/// `Pong`, and refusing a bad frame for its request only; version 4 added `ReadSpec::list`
/// (a directory's entries; earlier agents ignore the flag and send a tar, so a host asks
/// only an agent of version 4 or later); version 5 added `Connect` and `Opened` (ports);
/// version 6 added `FsOp` (exists, remove, rename, make a directory).
/// Every earlier frame is unchanged. An
/// agent of version 1 or 2 stops serving at a frame kind it does not know, so a host sends the
/// newer kinds only to an agent that announced a version that has them (an agent whose `Pong`
/// is empty is version 2 at most).
pub const PROTOCOL_VERSION: u32 = 6;
/// The request id of pings (see `Kind::Ping`).
pub const PING_ID: u32 = u32::MAX;
/// Most `Stdin` frames of one `ExecFlow` request the host may have sent but not yet seen
/// acknowledged by `StdinAck` (see the module doc). Also the queue length for plain `Exec`.
pub const STDIN_WINDOW: u32 = 64;
/// After a flow-controlled command exited, how long in total the agent waits for credit to
/// forward output it still holds before it sends `Exit` (milliseconds).
pub const FLOW_STALL_CAP_MS: u64 = 60_000;

/// Frame kinds. Host → agent are below 0x80, agent → host at or above.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Start a command: payload `ExecSpec`. Stdin follows as `Stdin` chunks and `StdinEof`.
    Exec = 0x01,
    /// A chunk of stdin for request `id`.
    Stdin = 0x02,
    /// End of stdin for request `id`.
    StdinEof = 0x03,
    /// Send a signal (payload: u32 signal number) to request `id`'s process group. Version 4:
    /// for a read or an upload in progress, cancels it (any number; answered by `Error`).
    Signal = 0x04,
    /// Read a file or directory: payload `ReadSpec`. Answered by `Data` chunks then `End`.
    ReadFile = 0x05,
    /// Start writing a file: payload `WriteSpec`. Contents follow as `Data` chunks, then `End`.
    WriteFile = 0x06,
    /// A chunk of file contents (both directions).
    Data = 0x07,
    /// End of a data stream (both directions). From the agent, payload: u64 total bytes.
    End = 0x08,
    /// Liveness probe; answered by `Pong` with the same id. A host pings with `PING_ID`, an id
    /// no other request uses.
    Ping = 0x09,
    /// Start a command under flow control: payload `ExecFlowSpec` (u32 initial output credit,
    /// then an `ExecSpec`). Answered like `Exec`, plus `StdinAck`s. See the module doc.
    ExecFlow = 0x0a,
    /// More output credit for `ExecFlow` request `id` (version 4: or a read with credit):
    /// payload u32 bytes, added to what is left. Ignored for unknown, finished or plain `Exec`
    /// requests.
    Credit = 0x0b,
    /// Resize request `id`'s pseudo-terminal: payload `WinSize` (u16 rows, u16 cols, both
    /// non-zero). Ignored for unknown or finished requests and ones without a terminal.
    Resize = 0x0c,
    /// A piece of the payload of request `id`'s next frame (version 3): the agent joins every
    /// `Part` (at most `MAX_PARTS` bytes in all) and puts them before that frame's payload.
    /// Lets a request whose payload is longer than a frame (a long command line) travel.
    Part = 0x0d,
    /// Version 5: connect to a port inside the sandbox: payload `ConnectSpec`. Answered by
    /// `Opened` or `Error`; then `Data`, `End`, `Credit` and `Signal` as the module doc says.
    Connect = 0x0e,
    /// Version 6: a one-shot file-system operation: payload `FsOpSpec`. Answered by `Done`
    /// (for `FsOpKind::Stat`, payload one byte: 0 nothing there, else 1 + the `EntryKind`) or
    /// `Error`.
    FsOp = 0x0f,

    /// Sent once by the agent at start, id 0: payload u32 protocol version, u32 agent pid.
    Hello = 0x80,
    /// A chunk of the command's stdout.
    Stdout = 0x81,
    /// A chunk of the command's stderr.
    Stderr = 0x82,
    /// The command finished: payload `ExitInfo`. Last frame for an exec request.
    Exit = 0x83,
    /// The request failed: payload `ErrorInfo`. Last frame for that request.
    Error = 0x84,
    /// A write finished successfully: payload u64 bytes written. Last frame for a write.
    Done = 0x85,
    /// `ExecFlow` request `id`'s command took (or dropped) this many more `Stdin` frames:
    /// payload u32 frame count. Frees that many slots of the `STDIN_WINDOW`.
    StdinAck = 0x86,
    /// Version 5: the connection of `Connect` request `id` is open (empty payload).
    Opened = 0x87,
    /// Answer to `Ping`; from version 3, payload u32 protocol version (empty before); from
    /// version 4 then u32 the highest request id the agent has seen (`PING_ID` aside): a host
    /// that reattaches numbers its requests above it, so no frame of a request from before
    /// the reattach can be taken for one of its own.
    Pong = 0x89,
}

impl Kind {
    /// The kind of a frame's kind byte; `None` for a byte no kind has.
    pub fn from_u8(b: u8) -> Option<Kind> {
        use Kind::*;
        Some(match b {
            0x01 => Exec,
            0x02 => Stdin,
            0x03 => StdinEof,
            0x04 => Signal,
            0x05 => ReadFile,
            0x06 => WriteFile,
            0x07 => Data,
            0x08 => End,
            0x09 => Ping,
            0x0a => ExecFlow,
            0x0b => Credit,
            0x0c => Resize,
            0x0d => Part,
            0x0e => Connect,
            0x0f => FsOp,
            0x80 => Hello,
            0x81 => Stdout,
            0x82 => Stderr,
            0x83 => Exit,
            0x84 => Error,
            0x85 => Done,
            0x86 => StdinAck,
            0x87 => Opened,
            0x89 => Pong,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// What the frame is (its kind byte).
    pub kind: Kind,
    /// The request it belongs to, chosen by the host.
    pub id: u32,
    /// Kind-specific bytes (see the payload types).
    pub payload: Vec<u8>,
}

impl Frame {
    /// A frame of `kind` for request `id`.
    pub fn new(kind: Kind, id: u32, payload: Vec<u8>) -> Frame {
        Frame { kind, id, payload }
    }

    /// Appends the encoded frame to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let len = 1 + 4 + self.payload.len();
        out.extend_from_slice(&(len as u32).to_le_bytes());
        out.push(self.kind as u8);
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.payload);
    }

    /// This frame as it travels: itself, or (payload longer than `MAX_CHUNK`) `Part`s of
    /// `MAX_CHUNK` bytes and then itself with the rest. Only for agents of version 3 or later.
    pub fn into_parts(self) -> Vec<Frame> {
        if self.payload.len() <= MAX_CHUNK {
            return vec![self];
        }
        let Frame { kind, id, payload } = self;
        let mut chunks: Vec<Vec<u8>> = payload.chunks(MAX_CHUNK).map(<[u8]>::to_vec).collect();
        let last = chunks.pop().unwrap_or_default();
        let mut frames: Vec<Frame> = chunks.into_iter().map(|c| Frame::new(Kind::Part, id, c)).collect();
        frames.push(Frame::new(kind, id, last));
        frames
    }

    /// The frame's bytes on the wire: length, kind, id, payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(9 + self.payload.len());
        self.encode_into(&mut out);
        out
    }

    /// Tries to take one frame off the front of `buf`. `Ok(None)` means more bytes are needed;
    /// on success the frame's bytes are drained from `buf`.
    pub fn decode(buf: &mut Vec<u8>) -> io::Result<Option<Frame>> {
        if buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if !(5..=MAX_FRAME).contains(&len) {
            return Err(invalid(format!("frame length {len} out of range")));
        }
        if buf.len() < 4 + len {
            return Ok(None);
        }
        let kind = Kind::from_u8(buf[4]).ok_or_else(|| invalid(format!("unknown frame kind {:#x}", buf[4])))?;
        let id = u32::from_le_bytes([buf[5], buf[6], buf[7], buf[8]]);
        let payload = buf[9..4 + len].to_vec();
        buf.drain(..4 + len);
        Ok(Some(Frame { kind, id, payload }))
    }

    /// Reads exactly one frame from a blocking reader. `Ok(None)` on clean EOF between frames.
    pub fn read_from(r: &mut impl io::Read) -> io::Result<Option<Frame>> {
        let mut len = [0u8; 4];
        match r.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let len = u32::from_le_bytes(len) as usize;
        if !(5..=MAX_FRAME).contains(&len) {
            return Err(invalid(format!("frame length {len} out of range")));
        }
        let mut rest = vec![0u8; len];
        r.read_exact(&mut rest)?;
        let kind = Kind::from_u8(rest[0]).ok_or_else(|| invalid(format!("unknown frame kind {:#x}", rest[0])))?;
        let id = u32::from_le_bytes([rest[1], rest[2], rest[3], rest[4]]);
        rest.drain(..5);
        Ok(Some(Frame { kind, id, payload: rest }))
    }
    /// Like `read_from`, but a frame that is too long or of an unknown kind is skipped and
    /// reported as `Err((id, why))`, so the reader can refuse that request and read on.
    /// Only a stream that is cut short or unreadable is an `io::Error`.
    pub fn read_or_skip(r: &mut impl io::Read) -> io::Result<Option<Result<Frame, (u32, String)>>> {
        let mut head = [0u8; 4];
        match r.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let len = u32::from_le_bytes(head) as usize;
        if len < 5 {
            return Err(invalid(format!("frame length {len} out of range")));
        }
        let mut kid = [0u8; 5];
        r.read_exact(&mut kid)?;
        let id = u32::from_le_bytes([kid[1], kid[2], kid[3], kid[4]]);
        let refused = match Kind::from_u8(kid[0]) {
            None => format!("unknown frame kind {:#x}", kid[0]),
            Some(_) if len > MAX_FRAME => format!("frame of {len} bytes is longer than {MAX_FRAME}"),
            Some(kind) => {
                let mut payload = vec![0u8; len - 5];
                r.read_exact(&mut payload)?;
                return Ok(Some(Ok(Frame { kind, id, payload })));
            }
        };
        let skipped = io::copy(&mut io::Read::take(&mut *r, (len - 5) as u64), &mut io::sink())?;
        if skipped != (len - 5) as u64 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "frame cut short"));
        }
        Ok(Some(Err((id, refused))))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_payloads_travel_in_parts_and_bad_frames_are_skipped() {
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let frames = Frame::new(Kind::Exec, 7, payload.clone()).into_parts();
        assert_eq!(frames.len(), 300_000usize.div_ceil(MAX_CHUNK));
        assert!(frames[..frames.len() - 1].iter().all(|f| f.kind == Kind::Part && f.id == 7));
        assert_eq!(frames.last().map(|f| f.kind), Some(Kind::Exec));
        let joined: Vec<u8> = frames.iter().flat_map(|f| f.payload.clone()).collect();
        assert_eq!(joined, payload);

        // An oversized frame and an unknown kind are refused for their ids; the next frame reads.
        let mut stream = Vec::new();
        let big = vec![0u8; MAX_FRAME + 10];
        stream.extend_from_slice(&((big.len() + 5) as u32).to_le_bytes());
        stream.push(Kind::Exec as u8);
        stream.extend_from_slice(&3u32.to_le_bytes());
        stream.extend_from_slice(&big);
        stream.extend_from_slice(&5u32.to_le_bytes());
        stream.push(0x7f);
        stream.extend_from_slice(&4u32.to_le_bytes());
        Frame::new(Kind::Ping, 9, vec![]).encode_into(&mut stream);
        let mut r = &stream[..];
        assert!(matches!(Frame::read_or_skip(&mut r).unwrap(), Some(Err((3, _)))));
        assert!(matches!(Frame::read_or_skip(&mut r).unwrap(), Some(Err((4, _)))));
        assert_eq!(Frame::read_or_skip(&mut r).unwrap(), Some(Ok(Frame::new(Kind::Ping, 9, vec![]))));
        assert_eq!(Frame::read_or_skip(&mut r).unwrap(), None);
    }

    use super::*;

    #[test]
    fn frames_round_trip_in_pieces() {
        let spec = ExecSpec {
            fence: 7,
            argv: vec!["sh".into(), "-c".into(), "echo hi".into()],
            env: vec![("A".into(), "b".into())],
            cwd: "/tmp".into(),
            timeout_ms: 1500,
            max_output: 1 << 20,
            has_stdin: true,
            pty_rows: 0,
            pty_cols: 0,
        };
        let mut wire = Frame::new(Kind::Exec, 42, spec.encode()).encode();
        wire.extend(Frame::new(Kind::Ping, 43, vec![]).encode());
        let mut buf = Vec::new();
        let mut frames = Vec::new();
        for b in wire {
            buf.push(b);
            while let Some(f) = Frame::decode(&mut buf).unwrap() {
                frames.push(f);
            }
        }
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].id, 42);
        assert_eq!(ExecSpec::decode(&frames[0].payload).unwrap(), spec);
        assert_eq!(frames[1].kind, Kind::Ping);
        assert!(buf.is_empty());
    }

    #[test]
    fn every_kind_round_trips_through_its_byte() {
        for b in 0..=255u8 {
            if let Some(kind) = Kind::from_u8(b) {
                assert_eq!(kind as u8, b);
            }
        }
        for kind in
            [Kind::ExecFlow, Kind::Credit, Kind::Resize, Kind::StdinAck, Kind::Connect, Kind::Opened, Kind::FsOp]
        {
            assert_eq!(Kind::from_u8(kind as u8), Some(kind));
        }
    }

    #[test]
    fn fs_ops_round_trip_and_refuse_unknown_operations() {
        let spec = FsOpSpec { fence: 7, op: FsOpKind::Rename, path: "/a".into(), to: "/b ü".into(), recursive: true };
        assert_eq!(FsOpSpec::decode(&spec.encode()).unwrap(), spec);
        let mut bad = spec.encode();
        bad[8] = 9;
        assert!(FsOpSpec::decode(&bad).is_err());
    }

    #[test]
    fn streaming_payloads_round_trip() {
        let flow = ExecFlowSpec { credit: 65536, spec: ExecSpec { pty_rows: 24, pty_cols: 80, ..Default::default() } };
        let wire = flow.encode();
        assert_eq!(&wire[..4], &65536u32.to_le_bytes());
        assert_eq!(&wire[4..], &flow.spec.encode()[..]);
        assert_eq!(ExecFlowSpec::decode(&wire).unwrap(), flow);
        assert!(ExecFlowSpec::decode(&wire[..3]).is_err());
        assert!(ExecFlowSpec::decode(&wire[..10]).is_err());

        let size = WinSize { rows: 50, cols: 132 };
        assert_eq!(size.encode(), [50, 0, 132, 0]);
        assert_eq!(WinSize::decode(&size.encode()).unwrap(), size);
        assert!(WinSize::decode(&[1, 0, 2]).is_err());
    }

    #[test]
    fn listings_and_reads_round_trip() {
        let l = Listing {
            total: 3,
            entries: vec![
                DirEntry { name: "a.txt".into(), kind: EntryKind::File, size: 5, mode: 0o644, mtime: 1_700_000_000 },
                DirEntry { name: "ü".into(), kind: EntryKind::Dir, size: 4096, mode: 0o755, mtime: -1 },
            ],
        };
        assert_eq!(Listing::decode(&l.encode()).unwrap(), l);
        assert!(Listing::decode(&l.encode()[..20]).is_err());
        let r = ReadSpec { fence: 7, path: "/w".into(), max_bytes: 9, list: true, credit: 65536 };
        assert_eq!(ReadSpec::decode(&r.encode()).unwrap(), r);
        let old = Enc::default().u64(7).str("/w").u64(9).finish();
        let old = ReadSpec::decode(&old).unwrap();
        assert!(!old.list && old.credit == 0, "a version-3 host's read is a plain read");
    }

    #[test]
    fn connects_round_trip() {
        let c = ConnectSpec { fence: 9, port: 8080, credit: 1 << 18 };
        assert_eq!(ConnectSpec::decode(&c.encode()).unwrap(), c);
        assert!(ConnectSpec::decode(&c.encode()[..9]).is_err());
    }

    #[test]
    fn bad_frames_are_errors_not_panics() {
        let mut buf = vec![0xff, 0xff, 0xff, 0xff, 1];
        assert!(Frame::decode(&mut buf).is_err());
        let mut buf = Frame::new(Kind::Ping, 1, vec![]).encode();
        buf[4] = 0x55;
        assert!(Frame::decode(&mut buf).is_err());
        assert!(ExecSpec::decode(&[1, 2, 3]).is_err());
        assert!(ErrorInfo::decode(&[9, 0, 0, 0, b'a']).is_err());
    }
}

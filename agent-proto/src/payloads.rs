//! The payloads of requests and answers (see the crate doc for which frame carries which),
//! each with its `encode` and `decode`.

use std::io;

use crate::codec::{Dec, Enc, invalid};

/// What to run. `argv[0]` is looked up in `PATH` (from `env`, else the agent's default).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecSpec {
    /// The lease's fencing token; the agent refuses a token lower than the highest it has seen.
    pub fence: u64,
    /// The command and its arguments; never empty.
    pub argv: Vec<String>,
    /// Extra environment, applied over the agent's own environment.
    pub env: Vec<(String, String)>,
    /// Working directory; empty means the agent's own working directory.
    pub cwd: String,
    /// Kill the whole process group after this long; 0 means no limit.
    pub timeout_ms: u64,
    /// Forward at most this many bytes of stdout and of stderr (each); the rest is read and
    /// discarded so the command never blocks on a full pipe, and `ExitInfo` flags the cut.
    pub max_output: u64,
    /// Whether stdin chunks will follow. When false the command's stdin is /dev/null.
    pub has_stdin: bool,
    /// Run on a pseudo-terminal of this many rows and columns (see the module doc); both 0
    /// means plain pipes, and exactly one 0 is a bad request.
    pub pty_rows: u16,
    /// See `pty_rows`.
    pub pty_cols: u16,
}

/// Payload of `ExecFlow`: the output credit to start with, then the command.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecFlowSpec {
    /// Bytes of output the agent may forward before the first `Credit` (0: none).
    pub credit: u32,
    /// The command to run.
    pub spec: ExecSpec,
}

/// Payload of `Resize`: a terminal size in character cells.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WinSize {
    /// Rows, at least 1.
    pub rows: u16,
    /// Columns, at least 1.
    pub cols: u16,
}

/// How a command ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExitInfo {
    /// Exit status; for a command killed by a signal, 128 + the signal number (shell style).
    pub exit_code: i32,
    /// Set when the command was killed because its timeout passed.
    pub timed_out: bool,
    /// Stdout went past `max_output` (or was still unsent at `Exit`) and was cut.
    pub stdout_truncated: bool,
    /// Stderr went past `max_output` (or was still unsent at `Exit`) and was cut.
    pub stderr_truncated: bool,
    /// Wall time from spawn to exit, in microseconds.
    pub duration_us: u64,
}

/// Error codes the agent reports in `ErrorInfo::code`.
pub mod codes {
    /// The request's fence is older than one already seen.
    pub const STALE_FENCE: &str = "stale_fence";
    /// The executable was not found.
    pub const NOT_FOUND: &str = "not_found";
    /// Permission denied (spawn or file access).
    pub const PERMISSION_DENIED: &str = "permission_denied";
    /// The command could not be started for another reason.
    pub const SPAWN_FAILED: &str = "spawn_failed";
    /// The sandbox has no process or thread to spare (its pids limit: a command's processes
    /// still running or being reaped, such as a fork bomb that just timed out): the request
    /// did not start (a command whose threads could not start was killed as it started).
    pub const BUSY: &str = "busy";
    /// A file operation failed; the message says why.
    pub const IO: &str = "io";
    /// The request itself was malformed.
    pub const BAD_REQUEST: &str = "bad_request";
    /// A file path names a directory where a file was expected (or the reverse).
    pub const IS_DIRECTORY: &str = "is_directory";
    /// What a read would send is over its `max_bytes` (version 4: a directory's tar is sized
    /// before any byte goes).
    pub const TOO_LARGE: &str = "too_large";
    /// Version 5: nothing listens on the port a `Connect` named (or the connection was
    /// refused or reset).
    pub const REFUSED: &str = "refused";
    /// Version 6: a removal without `recursive` named a directory that is not empty.
    pub const NOT_EMPTY: &str = "not_empty";
    /// Version 6: a rename's target (or a directory to make) names something already there.
    pub const EXISTS: &str = "exists";
}

/// What an `FsOp` does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum FsOpKind {
    /// Whether `path` names anything (a symbolic link counts, dangling or not).
    #[default]
    Stat = 0,
    /// Remove `path` (a file, a link, an empty directory, or any directory with `recursive`).
    Remove = 1,
    /// Rename `path` to `to`, refusing a `to` that exists.
    Rename = 2,
    /// Make the directory `path` and its parents (no error if it is a directory already).
    MakeDir = 3,
}

/// Payload of `FsOp` (version 6). Paths are absolute.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FsOpSpec {
    /// The lease's fencing token (see `ExecSpec::fence`).
    pub fence: u64,
    /// Which operation.
    pub op: FsOpKind,
    /// The path it acts on.
    pub path: String,
    /// `Rename`'s new path; empty otherwise.
    pub to: String,
    /// `Remove`: a directory with everything in it.
    pub recursive: bool,
}

impl FsOpSpec {
    /// The payload's bytes, as `decode` reads them.
    pub fn encode(&self) -> Vec<u8> {
        Enc::default().u64(self.fence).u8(self.op as u8).str(&self.path).str(&self.to).bool(self.recursive).finish()
    }

    /// Reads a payload written by `encode`; an `InvalidData` error when it is short or malformed.
    pub fn decode(buf: &[u8]) -> io::Result<FsOpSpec> {
        let mut d = Dec::new(buf);
        let fence = d.u64()?;
        let op = match d.u8()? {
            0 => FsOpKind::Stat,
            1 => FsOpKind::Remove,
            2 => FsOpKind::Rename,
            3 => FsOpKind::MakeDir,
            n => return Err(invalid(format!("unknown file operation {n}"))),
        };
        Ok(FsOpSpec { fence, op, path: d.str()?, to: d.str()?, recursive: d.bool()? })
    }
}

/// Payload of `Connect`: a port on the sandbox's loopback interface.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnectSpec {
    /// The lease's fencing token (see `ExecSpec::fence`).
    pub fence: u64,
    /// The port on the sandbox's loopback interface (1-65535).
    pub port: u16,
    /// Bytes the agent may forward from the port before the first `Credit`.
    pub credit: u32,
}

impl ConnectSpec {
    /// The payload's bytes, as `decode` reads them.
    pub fn encode(&self) -> Vec<u8> {
        Enc::default().u64(self.fence).u16(self.port).u32(self.credit).finish()
    }

    /// Reads a payload written by `encode`; an `InvalidData` error when it is short or malformed.
    pub fn decode(buf: &[u8]) -> io::Result<ConnectSpec> {
        let mut d = Dec::new(buf);
        Ok(ConnectSpec { fence: d.u64()?, port: d.u16()?, credit: d.u32()? })
    }
}

/// Payload of `Error`: a code of `codes` and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorInfo {
    /// One of `codes`, which the host maps to an HTTP status.
    pub code: String,
    /// What failed, naming the path or the call.
    pub message: String,
}

/// Read a file, or a directory as a tar archive.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadSpec {
    /// The lease's fencing token (see `ExecSpec::fence`).
    pub fence: u64,
    /// Absolute path inside the sandbox.
    pub path: String,
    /// Refuse (error `io`, "too large") files larger than this; 0 means no limit.
    pub max_bytes: u64,
    /// Version 4: list the directory instead: the `Data` chunks carry a `Listing`.
    pub list: bool,
    /// Version 4: when non-zero, the read is flow-controlled like `ExecFlow`'s output: the
    /// agent sends at most this many `Data` bytes plus every `Credit` since, and a `Signal`
    /// (any number) for the read cancels it. 0: sent as fast as read (a capped, collected read).
    pub credit: u32,
}

/// Most entries a listing carries (the first ones by name); `Listing::total` counts them all.
pub const LIST_MAX: usize = 10_000;

/// A directory's entries, sorted by name: the payload of a listing read's `Data` chunks
/// (joined). `total` is the number of entries in the directory, which may exceed
/// `entries.len()` (at most `LIST_MAX`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    /// Entries in the directory, which may be more than `entries` holds.
    pub total: u64,
    /// The first `LIST_MAX` entries by name.
    pub entries: Vec<DirEntry>,
}

/// One entry of a directory, as `lstat` sees it (a symbolic link is not followed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DirEntry {
    /// The file name (invalid UTF-8 replaced with U+FFFD).
    pub name: String,
    /// File, directory, link or other.
    pub kind: EntryKind,
    /// Size in bytes (`st_size`).
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Last modification, seconds since the Unix epoch.
    pub mtime: i64,
}

/// What a directory entry is (as `lstat` says).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum EntryKind {
    /// A regular file.
    #[default]
    File = 0,
    /// A directory.
    Dir = 1,
    /// A symbolic link (not followed).
    Symlink = 2,
    /// Anything else: a device, a socket, a FIFO.
    Other = 3,
}

impl Listing {
    /// The payload's bytes, as `decode` reads them.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u64(self.total).u32(self.entries.len() as u32);
        for d in &self.entries {
            e.u8(d.kind as u8).u64(d.size).u32(d.mode).u64(d.mtime as u64).str(&d.name);
        }
        e.finish()
    }

    /// Reads a payload written by `encode`; an `InvalidData` error when it is short or malformed.
    pub fn decode(buf: &[u8]) -> io::Result<Listing> {
        let mut d = Dec::new(buf);
        let total = d.u64()?;
        let n = d.u32()? as usize;
        let mut entries = Vec::with_capacity(n.min(LIST_MAX));
        for _ in 0..n {
            let kind = match d.u8()? {
                0 => EntryKind::File,
                1 => EntryKind::Dir,
                2 => EntryKind::Symlink,
                _ => EntryKind::Other,
            };
            let (size, mode, mtime) = (d.u64()?, d.u32()?, d.u64()? as i64);
            entries.push(DirEntry { name: d.str()?, kind, size, mode, mtime });
        }
        Ok(Listing { total, entries })
    }
}

/// Write a file, creating parent directories.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteSpec {
    /// The lease's fencing token (see `ExecSpec::fence`).
    pub fence: u64,
    /// Absolute path inside the sandbox.
    pub path: String,
    /// Permission bits for a new file, e.g. 0o644.
    pub mode: u32,
}

impl ExecSpec {
    /// The payload's bytes, as `decode` reads them.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u64(self.fence).u32(self.argv.len() as u32);
        for a in &self.argv {
            e.str(a);
        }
        e.u32(self.env.len() as u32);
        for (k, v) in &self.env {
            e.str(k).str(v);
        }
        e.str(&self.cwd)
            .u64(self.timeout_ms)
            .u64(self.max_output)
            .bool(self.has_stdin)
            .u16(self.pty_rows)
            .u16(self.pty_cols);
        e.finish()
    }

    /// Reads a payload written by `encode`; an `InvalidData` error when it is short or malformed.
    pub fn decode(buf: &[u8]) -> io::Result<ExecSpec> {
        let mut d = Dec::new(buf);
        let fence = d.u64()?;
        let n = d.u32()? as usize;
        let mut argv = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            argv.push(d.str()?);
        }
        let n = d.u32()? as usize;
        let mut env = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            env.push((d.str()?, d.str()?));
        }
        Ok(ExecSpec {
            fence,
            argv,
            env,
            cwd: d.str()?,
            timeout_ms: d.u64()?,
            max_output: d.u64()?,
            has_stdin: d.bool()?,
            pty_rows: d.u16()?,
            pty_cols: d.u16()?,
        })
    }
}

impl ExecFlowSpec {
    /// The payload's bytes, as `decode` reads them.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.credit.to_le_bytes().to_vec();
        out.extend(self.spec.encode());
        out
    }

    /// Reads a payload written by `encode`; an `InvalidData` error when it is short or malformed.
    pub fn decode(buf: &[u8]) -> io::Result<ExecFlowSpec> {
        let credit = Dec::new(buf).u32()?;
        Ok(ExecFlowSpec { credit, spec: ExecSpec::decode(&buf[4..])? })
    }
}

impl WinSize {
    /// The payload's bytes, as `decode` reads them.
    pub fn encode(&self) -> Vec<u8> {
        Enc::default().u16(self.rows).u16(self.cols).finish()
    }

    /// Reads a payload written by `encode`; an `InvalidData` error when it is short or malformed.
    pub fn decode(buf: &[u8]) -> io::Result<WinSize> {
        let mut d = Dec::new(buf);
        Ok(WinSize { rows: d.u16()?, cols: d.u16()? })
    }
}

impl ExitInfo {
    /// The payload's bytes, as `decode` reads them.
    pub fn encode(&self) -> Vec<u8> {
        Enc::default()
            .i32(self.exit_code)
            .bool(self.timed_out)
            .bool(self.stdout_truncated)
            .bool(self.stderr_truncated)
            .u64(self.duration_us)
            .finish()
    }

    /// Reads a payload written by `encode`; an `InvalidData` error when it is short or malformed.
    pub fn decode(buf: &[u8]) -> io::Result<ExitInfo> {
        let mut d = Dec::new(buf);
        Ok(ExitInfo {
            exit_code: d.i32()?,
            timed_out: d.bool()?,
            stdout_truncated: d.bool()?,
            stderr_truncated: d.bool()?,
            duration_us: d.u64()?,
        })
    }
}

impl ErrorInfo {
    /// An error of `code` (one of `codes`) with `message`.
    pub fn new(code: &str, message: impl Into<String>) -> ErrorInfo {
        ErrorInfo { code: code.to_string(), message: message.into() }
    }

    /// The payload's bytes, as `decode` reads them.
    pub fn encode(&self) -> Vec<u8> {
        Enc::default().str(&self.code).str(&self.message).finish()
    }

    /// Reads a payload written by `encode`; an `InvalidData` error when it is short or malformed.
    pub fn decode(buf: &[u8]) -> io::Result<ErrorInfo> {
        let mut d = Dec::new(buf);
        Ok(ErrorInfo { code: d.str()?, message: d.str()? })
    }
}

impl ReadSpec {
    /// The payload's bytes, as `decode` reads them.
    pub fn encode(&self) -> Vec<u8> {
        Enc::default().u64(self.fence).str(&self.path).u64(self.max_bytes).bool(self.list).u32(self.credit).finish()
    }

    /// A host of version 3 or earlier sends no `list` byte: a read.
    pub fn decode(buf: &[u8]) -> io::Result<ReadSpec> {
        let mut d = Dec::new(buf);
        let (fence, path, max_bytes) = (d.u64()?, d.str()?, d.u64()?);
        Ok(ReadSpec { fence, path, max_bytes, list: d.bool().unwrap_or(false), credit: d.u32().unwrap_or(0) })
    }
}

impl WriteSpec {
    /// The payload's bytes, as `decode` reads them.
    pub fn encode(&self) -> Vec<u8> {
        Enc::default().u64(self.fence).str(&self.path).u32(self.mode).finish()
    }

    /// Reads a payload written by `encode`; an `InvalidData` error when it is short or malformed.
    pub fn decode(buf: &[u8]) -> io::Result<WriteSpec> {
        let mut d = Dec::new(buf);
        Ok(WriteSpec { fence: d.u64()?, path: d.str()?, mode: d.u32()? })
    }
}

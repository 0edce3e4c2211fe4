//! File requests: streaming a file (or a directory as tar) to the host, atomic uploads, and
//! one-shot operations (exists, remove, rename, make a directory; protocol version 6).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use agent_proto::{
    DirEntry, EntryKind, ErrorInfo, FsOpKind, FsOpSpec, Kind, LIST_MAX, Listing, MAX_CHUNK, ReadSpec, WriteSpec, codes,
};

use crate::archive;
use crate::basics::lock;
use crate::ctx::{Ctx, bad_request, no_room};
use crate::sys;

/// Mode of an uploaded file when the request gives none (0).
const DEFAULT_MODE: u32 = 0o644;

/// Maps a file-system error to the protocol's codes, the message naming what failed.
fn fs_error(what: &str, path: &Path, err: &io::Error) -> ErrorInfo {
    let code = match err.kind() {
        io::ErrorKind::NotFound => codes::NOT_FOUND,
        io::ErrorKind::PermissionDenied => codes::PERMISSION_DENIED,
        io::ErrorKind::IsADirectory => codes::IS_DIRECTORY,
        _ => codes::IO,
    };
    ErrorInfo::new(code, format!("{what} {}: {err}", path.display()))
}

/// Runs a one-shot file operation on a worker thread (removing a large tree takes a while;
/// the request loop must not wait for it), as the sandbox's user: what that user may not
/// touch, the operation may not either. No operation follows a symbolic link at the end of a
/// path: `Stat` reports the link itself, `Remove` and `Rename` act on the link, not its
/// target (like `rm` and `mv`), and a recursive removal never descends through one.
pub fn start_op(ctx: &Arc<Ctx>, id: u32, spec: FsOpSpec) -> Result<(), ErrorInfo> {
    let path = absolute(&spec.path)?;
    let to = match spec.op {
        FsOpKind::Rename => Some(absolute(&spec.to)?),
        _ => None,
    };
    let ctx2 = Arc::clone(ctx);
    let started = crate::workers::run(move || {
        let done = sys::as_user(|| fs_op(spec.op, &path, to.as_deref(), spec.recursive))
            .unwrap_or_else(|e| Err(ErrorInfo::new(codes::IO, format!("cannot act as the sandbox's user: {e}"))));
        match done {
            Ok(answer) => ctx2.out.send(Kind::Done, id, &answer),
            Err(err) => ctx2.out.send_error(id, &err),
        }
    });
    started.map_err(|e| no_room(codes::IO, format!("cannot start a thread: {e}"), &e))
}

/// One operation; the `Done` payload it answers with.
fn fs_op(op: FsOpKind, path: &Path, to: Option<&Path>, recursive: bool) -> Result<Vec<u8>, ErrorInfo> {
    match op {
        FsOpKind::Stat => Ok(vec![match fs::symlink_metadata(path) {
            Ok(m) => 1 + entry_kind(m.file_type()) as u8,
            Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
            // A component that is a file (ENOTDIR) names nothing either.
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => 0,
            Err(e) => return Err(fs_error("stat", path, &e)),
        }]),
        FsOpKind::Remove => {
            let meta = fs::symlink_metadata(path).map_err(|e| fs_error("remove", path, &e))?;
            if path == Path::new("/") {
                return Err(bad_request("refusing to remove /"));
            }
            let removed = match (meta.is_dir(), recursive) {
                (false, _) => fs::remove_file(path),
                (true, false) => fs::remove_dir(path),
                // Does not follow symbolic links inside the tree: it removes the links.
                (true, true) => fs::remove_dir_all(path),
            };
            removed.map(|()| Vec::new()).map_err(|e| match e.kind() {
                io::ErrorKind::DirectoryNotEmpty => ErrorInfo::new(
                    codes::NOT_EMPTY,
                    format!("{} is a directory that is not empty (remove it with recursive)", path.display()),
                ),
                _ => fs_error("remove", path, &e),
            })
        }
        FsOpKind::Rename => {
            let to = to.ok_or_else(|| bad_request("rename: no target"))?;
            rename_no_replace(path, to).map(|()| Vec::new())
        }
        FsOpKind::MakeDir => match fs::symlink_metadata(path) {
            // A link to a directory is one too (as for `mkdir -p`): nothing is made through it.
            Ok(m) if m.is_dir() || fs::metadata(path).is_ok_and(|m| m.is_dir()) => Ok(Vec::new()),
            Ok(_) => {
                Err(ErrorInfo::new(codes::EXISTS, format!("{} exists already and is not a directory", path.display())))
            }
            Err(_) => match fs::create_dir_all(path) {
                Ok(()) => Ok(Vec::new()),
                // A parent that is a file.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists || e.raw_os_error() == Some(libc::ENOTDIR) => {
                    Err(ErrorInfo::new(
                        codes::EXISTS,
                        format!("{}: a part of the path exists and is not a directory", path.display()),
                    ))
                }
                Err(e) => Err(fs_error("make directory", path, &e)),
            },
        },
    }
}

/// Renames `from` to `to` unless `to` exists (`renameat2(RENAME_NOREPLACE)`: no window in
/// which a file made meanwhile is overwritten). A file system without the flag gets a check
/// then a plain rename.
fn rename_no_replace(from: &Path, to: &Path) -> Result<(), ErrorInfo> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    const RENAME_NOREPLACE: libc::c_long = 1;
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(|_| bad_request("a path with NUL"));
    let (cf, ct) = (c(from)?, c(to)?);
    // SAFETY: both are NUL-terminated strings that outlive the call; AT_FDCWD with absolute paths.
    let rc = unsafe {
        libc::syscall(libc::SYS_renameat2, libc::AT_FDCWD, cf.as_ptr(), libc::AT_FDCWD, ct.as_ptr(), RENAME_NOREPLACE)
    };
    let err = if rc == 0 { return Ok(()) } else { io::Error::last_os_error() };
    let err = match err.raw_os_error() {
        Some(libc::EINVAL | libc::ENOSYS) if fs::symlink_metadata(to).is_err() => match fs::rename(from, to) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        },
        Some(libc::EINVAL | libc::ENOSYS) => io::Error::from_raw_os_error(libc::EEXIST),
        _ => err,
    };
    Err(match err.kind() {
        io::ErrorKind::AlreadyExists => ErrorInfo::new(codes::EXISTS, format!("{} exists already", to.display())),
        // `from` missing, or `to`'s directory missing.
        io::ErrorKind::NotFound => ErrorInfo::new(
            codes::NOT_FOUND,
            format!("rename {} to {}: {err} (the source, or the target's directory)", from.display(), to.display()),
        ),
        _ => fs_error(&format!("rename {} to", from.display()), to, &err),
    })
}

fn entry_kind(t: fs::FileType) -> EntryKind {
    if t.is_file() {
        EntryKind::File
    } else if t.is_dir() {
        EntryKind::Dir
    } else if t.is_symlink() {
        EntryKind::Symlink
    } else {
        EntryKind::Other
    }
}

fn absolute(path: &str) -> Result<PathBuf, ErrorInfo> {
    let p = PathBuf::from(path);
    if p.is_absolute() { Ok(p) } else { Err(bad_request(format!("path is not absolute: {path:?}"))) }
}

/// The flow-controlled reads in progress, by request id, for their `Credit` and cancelling
/// `Signal`; and what their threads share.
pub struct Reads {
    ctx: Arc<Ctx>,
    flows: Mutex<HashMap<u32, Arc<ReadFlow>>>,
}

impl Reads {
    /// No read in progress yet.
    pub fn new(ctx: Arc<Ctx>) -> Reads {
        Reads { ctx, flows: Mutex::new(HashMap::new()) }
    }

    /// The flow of read `id`, while it runs under flow control.
    pub fn get(&self, id: u32) -> Option<Arc<ReadFlow>> {
        lock(&self.flows).get(&id).cloned()
    }
}

/// Streams `spec.path` to the host on a thread of its own: `Data` chunks then `End` (total
/// bytes), or `Error`. A read with credit waits for it before each chunk (see `ReadFlow`).
pub fn start_read(reads: &Arc<Reads>, id: u32, spec: ReadSpec) -> Result<(), ErrorInfo> {
    let path = absolute(&spec.path)?;
    let flow = (spec.credit > 0).then(|| Arc::new(ReadFlow::new(spec.credit)));
    if let Some(f) = &flow {
        lock(&reads.flows).insert(id, Arc::clone(f));
    }
    let reads2 = Arc::clone(reads);
    let (list, max_bytes) = (spec.list, spec.max_bytes);
    let started = crate::workers::run(move || {
        let mut out =
            Chunks { ctx: &reads2.ctx, id, flow: flow.as_deref(), max_bytes, buf: Vec::new(), total: 0, stop: None };
        let done = sys::as_user(|| if list { send_listing(&mut out, &path) } else { read(&mut out, &path) })
            .unwrap_or_else(|e| Err(ErrorInfo::new(codes::IO, format!("cannot read as the sandbox's user: {e}"))));
        lock(&reads2.flows).remove(&id);
        match done {
            Ok(()) => reads2.ctx.out.send(Kind::End, id, &out.total.to_le_bytes()),
            Err(err) => reads2.ctx.out.send_error(id, &err),
        }
    });
    started.map_err(|e| {
        lock(&reads.flows).remove(&id);
        no_room(codes::IO, format!("cannot start a thread: {e}"), &e)
    })
}

/// A flow-controlled read's credit: bytes it may still send, and whether the host gave up.
pub struct ReadFlow {
    left: Mutex<u64>,
    more: Condvar,
    cancelled: AtomicBool,
}

impl ReadFlow {
    fn new(credit: u32) -> ReadFlow {
        ReadFlow { left: Mutex::new(credit.into()), more: Condvar::new(), cancelled: AtomicBool::new(false) }
    }

    /// Takes `n` bytes of credit, waiting for them; false once the read is cancelled.
    fn take(&self, n: u64) -> bool {
        let mut left = lock(&self.left);
        loop {
            if self.cancelled.load(Ordering::Acquire) {
                return false;
            }
            if *left >= n {
                *left -= n;
                return true;
            }
            left = self.more.wait(left).unwrap_or_else(PoisonError::into_inner);
        }
    }

    pub fn grant(&self, n: u32) {
        let mut left = lock(&self.left);
        *left = left.saturating_add(n.into());
        drop(left);
        self.more.notify_all();
    }

    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        drop(lock(&self.left));
        self.more.notify_all();
    }
}

fn too_large(what: impl std::fmt::Display, max_bytes: u64) -> ErrorInfo {
    ErrorInfo::new(codes::TOO_LARGE, format!("{what} is over the limit of {max_bytes} bytes"))
}

fn read(out: &mut Chunks<'_>, path: &Path) -> Result<(), ErrorInfo> {
    let meta = fs::metadata(path).map_err(|e| fs_error("read", path, &e))?;
    let max_bytes = out.max_bytes;
    if meta.is_dir() {
        // Sized first, so a directory too large to send sends nothing (sparse and hard-linked
        // files count at their full size: so does the tar).
        let size = archive::tar_size(path);
        if max_bytes > 0 && size > max_bytes {
            return Err(too_large(format_args!("{} as a tar ({size} bytes)", path.display()), max_bytes));
        }
        let written = archive::write_dir(path, &mut *out);
        return match (written, out.stop.take()) {
            (_, Some(stop)) => Err(stop),
            (Err(e), None) => Err(ErrorInfo::new(codes::IO, format!("archive {}: {e}", path.display()))),
            (Ok(()), None) => out.flush_chunk().map_err(|_| out.stop.take().unwrap_or_else(cancelled)),
        };
    }
    if !meta.is_file() {
        return Err(ErrorInfo::new(codes::IO, format!("not a regular file or directory: {}", path.display())));
    }
    if max_bytes > 0 && meta.len() > max_bytes {
        return Err(too_large(format_args!("{} ({} bytes)", path.display(), meta.len()), max_bytes));
    }
    let mut file = File::open(path).map_err(|e| fs_error("open", path, &e))?;
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(fs_error("read", path, &e)),
        };
        out.send(&buf[..n])?;
    }
}

fn cancelled() -> ErrorInfo {
    ErrorInfo::new(codes::IO, "the read was cancelled")
}

/// Lists the directory `path` (its first `LIST_MAX` entries by name) as `Data` chunks of
/// an encoded `Listing`.
fn send_listing(out: &mut Chunks<'_>, path: &Path) -> Result<(), ErrorInfo> {
    let bytes = listing(path)?.encode();
    out.max_bytes = 0; // at most LIST_MAX entries: bounded by itself
    for c in bytes.chunks(MAX_CHUNK) {
        out.send(c)?;
    }
    Ok(())
}

fn listing(path: &Path) -> Result<Listing, ErrorInfo> {
    let meta = fs::metadata(path).map_err(|e| fs_error("list", path, &e))?;
    if !meta.is_dir() {
        return Err(bad_request(format!("not a directory: {}", path.display())));
    }
    let mut names: Vec<_> = fs::read_dir(path)
        .map_err(|e| fs_error("list", path, &e))?
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    let total = names.len() as u64;
    names.sort_unstable();
    names.truncate(LIST_MAX);
    let entries = names
        .into_iter()
        .filter_map(|name| {
            // An entry removed since `read_dir` is left out.
            let m = fs::symlink_metadata(path.join(&name)).ok()?;
            let kind = entry_kind(m.file_type());
            let name = name.to_string_lossy().into_owned();
            Some(DirEntry { name, kind, size: m.len(), mode: m.mode() & 0o7777, mtime: m.mtime() })
        })
        .collect();
    Ok(Listing { total, entries })
}

/// Sends a read's bytes as `Data` frames of at most `MAX_CHUNK` bytes, within its credit (if
/// flow-controlled) and its `max_bytes` (0: none). As a `Write` (the tar builder's), it
/// gathers full chunks; a refusal is kept in `stop` and surfaces as an I/O error.
struct Chunks<'a> {
    ctx: &'a Ctx,
    id: u32,
    flow: Option<&'a ReadFlow>,
    max_bytes: u64,
    buf: Vec<u8>,
    total: u64,
    stop: Option<ErrorInfo>,
}

impl Chunks<'_> {
    /// Sends `data` (at most a chunk) as one `Data` frame.
    fn send(&mut self, data: &[u8]) -> Result<(), ErrorInfo> {
        let total = self.total + data.len() as u64;
        if self.max_bytes > 0 && total > self.max_bytes {
            // A file that grew while it was read.
            return Err(too_large("what was read", self.max_bytes));
        }
        if let Some(flow) = self.flow
            && !flow.take(data.len() as u64)
        {
            return Err(cancelled());
        }
        self.ctx.out.send(Kind::Data, self.id, data);
        self.total = total;
        Ok(())
    }

    fn flush_chunk(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let buf = std::mem::take(&mut self.buf);
        let sent = self.send(&buf);
        self.buf = buf;
        self.buf.clear();
        sent.map_err(|e| {
            self.stop = Some(e);
            io::Error::other("the read was stopped")
        })
    }
}

impl Write for Chunks<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.capacity() == 0 {
            self.buf.reserve_exact(MAX_CHUNK);
        }
        let n = data.len().min(MAX_CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == MAX_CHUNK {
            self.flush_chunk()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// An upload in progress: data goes to a temp file next to the target, renamed over it at the
/// end so readers never see a partial file. Dropping an uncommitted upload removes the temp.
pub struct Upload {
    file: File,
    tmp: Option<PathBuf>,
    target: PathBuf,
    mode: u32,
    written: u64,
}

impl Upload {
    /// Creates the target's parent directories and the temp file, as the sandbox's user.
    pub fn create(id: u32, spec: &WriteSpec) -> Result<Upload, ErrorInfo> {
        sys::as_user(|| Upload::create_here(id, spec))
            .unwrap_or_else(|e| Err(ErrorInfo::new(codes::IO, format!("cannot write as the sandbox's user: {e}"))))
    }

    fn create_here(id: u32, spec: &WriteSpec) -> Result<Upload, ErrorInfo> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let target = absolute(&spec.path)?;
        let (Some(parent), Some(_)) = (target.parent(), target.file_name()) else {
            return Err(bad_request(format!("path names no file: {:?}", spec.path)));
        };
        if target.is_dir() {
            return Err(ErrorInfo::new(codes::IS_DIRECTORY, format!("is a directory: {}", target.display())));
        }
        fs::create_dir_all(parent).map_err(|e| fs_error("create directory", parent, &e))?;
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let tmp = parent.join(format!(".sandpool-upload-{}-{id}-{seq}", std::process::id()));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| fs_error("create", &tmp, &e))?;
        let mode = if spec.mode == 0 { DEFAULT_MODE } else { spec.mode & 0o7777 };
        Ok(Upload { file, tmp: Some(tmp), target, mode, written: 0 })
    }

    pub fn write(&mut self, data: &[u8]) -> Result<(), ErrorInfo> {
        self.file.write_all(data).map_err(|e| fs_error("write", &self.target, &e))?;
        self.written += data.len() as u64;
        Ok(())
    }

    /// Applies the mode and renames the temp file over the target; returns bytes written.
    pub fn commit(mut self) -> Result<u64, ErrorInfo> {
        let Some(tmp) = self.tmp.take() else {
            return Err(ErrorInfo::new(codes::IO, "upload already finished"));
        };
        let (file, target, mode) = (&self.file, &self.target, self.mode);
        let result = sys::as_user(|| {
            let done = file
                .set_permissions(Permissions::from_mode(mode))
                .map_err(|e| fs_error("chmod", target, &e))
                .and_then(|()| fs::rename(&tmp, target).map_err(|e| fs_error("rename onto", target, &e)));
            if done.is_err() {
                let _ = fs::remove_file(&tmp);
            }
            done
        });
        let result = result
            .unwrap_or_else(|e| Err(ErrorInfo::new(codes::IO, format!("cannot write as the sandbox's user: {e}"))));
        result.map(|()| self.written)
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            let _ = sys::as_user(|| fs::remove_file(tmp));
        }
    }
}

//! File requests: streaming a file (or a directory as tar) to the host, and atomic uploads.

use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use agent_proto::{DirEntry, EntryKind, ErrorInfo, Kind, LIST_MAX, Listing, MAX_CHUNK, ReadSpec, WriteSpec, codes};

use crate::archive;
use crate::server::{Ctx, bad_request, spawn_thread};

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

fn absolute(path: &str) -> Result<PathBuf, ErrorInfo> {
    let p = PathBuf::from(path);
    if p.is_absolute() { Ok(p) } else { Err(bad_request(format!("path is not absolute: {path:?}"))) }
}

/// Streams `spec.path` to the host on a thread of its own: `Data` chunks then `End` (total
/// bytes), or `Error`.
pub fn start_read(ctx: &Arc<Ctx>, id: u32, spec: ReadSpec) -> Result<(), ErrorInfo> {
    let path = absolute(&spec.path)?;
    let ctx2 = Arc::clone(ctx);
    let list = spec.list;
    spawn_thread("read-file", move || {
        match if list { send_listing(&ctx2, id, &path) } else { read(&ctx2, id, &path, spec.max_bytes) } {
            Ok(total) => ctx2.out.send(Kind::End, id, &total.to_le_bytes()),
            Err(err) => ctx2.out.send_error(id, &err),
        }
    })
    .map_err(|e| ErrorInfo::new(codes::IO, format!("cannot start a thread: {e}")))
}

fn read(ctx: &Ctx, id: u32, path: &Path, max_bytes: u64) -> Result<u64, ErrorInfo> {
    let meta = fs::metadata(path).map_err(|e| fs_error("read", path, &e))?;
    let mut out = Chunks { ctx, id, buf: Vec::new(), total: 0 };
    if meta.is_dir() {
        archive::write_dir(path, &mut out)
            .map_err(|e| ErrorInfo::new(codes::IO, format!("archive {}: {e}", path.display())))?;
        out.flush_chunk();
        return Ok(out.total);
    }
    if !meta.is_file() {
        return Err(ErrorInfo::new(codes::IO, format!("not a regular file or directory: {}", path.display())));
    }
    if max_bytes > 0 && meta.len() > max_bytes {
        return Err(ErrorInfo::new(codes::IO, format!("file too large ({} bytes, limit {max_bytes})", meta.len())));
    }
    let mut file = File::open(path).map_err(|e| fs_error("open", path, &e))?;
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => return Ok(out.total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(fs_error("read", path, &e)),
        };
        ctx.out.send(Kind::Data, id, &buf[..n]);
        out.total += n as u64;
    }
}

/// Lists the directory `path` (its first `LIST_MAX` entries by name) as `Data` chunks of
/// an encoded `Listing`; answers the total bytes sent.
fn send_listing(ctx: &Ctx, id: u32, path: &Path) -> Result<u64, ErrorInfo> {
    let bytes = listing(path)?.encode();
    for c in bytes.chunks(MAX_CHUNK) {
        ctx.out.send(Kind::Data, id, c);
    }
    Ok(bytes.len() as u64)
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
            let t = m.file_type();
            let kind = if t.is_file() {
                EntryKind::File
            } else if t.is_dir() {
                EntryKind::Dir
            } else if t.is_symlink() {
                EntryKind::Symlink
            } else {
                EntryKind::Other
            };
            let name = name.to_string_lossy().into_owned();
            Some(DirEntry { name, kind, size: m.len(), mode: m.mode() & 0o7777, mtime: m.mtime() })
        })
        .collect();
    Ok(Listing { total, entries })
}

/// Collects written bytes into `Data` frames of `MAX_CHUNK` bytes.
struct Chunks<'a> {
    ctx: &'a Ctx,
    id: u32,
    buf: Vec<u8>,
    total: u64,
}

impl Chunks<'_> {
    fn flush_chunk(&mut self) {
        if !self.buf.is_empty() {
            self.ctx.out.send(Kind::Data, self.id, &self.buf);
            self.total += self.buf.len() as u64;
            self.buf.clear();
        }
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
            self.flush_chunk();
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
    /// Creates the target's parent directories and the temp file.
    pub fn create(id: u32, spec: &WriteSpec) -> Result<Upload, ErrorInfo> {
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
        let result = self
            .file
            .set_permissions(Permissions::from_mode(self.mode))
            .map_err(|e| fs_error("chmod", &self.target, &e))
            .and_then(|()| fs::rename(&tmp, &self.target).map_err(|e| fs_error("rename onto", &self.target, &e)));
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result.map(|()| self.written)
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            let _ = fs::remove_file(tmp);
        }
    }
}

//! The lazy blob as a file: a read-only FUSE filesystem with one regular file, `rootfs.erofs`,
//! whose reads are [`LazyBlob::read_at`]. The kernel's file-backed EROFS is mounted on that
//! file, so the image's page cache and file lookups are the kernel's; only block reads that
//! miss the page cache come here.

use std::ffi::OsStr;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, LockOwner, MountOption, OpenFlags,
    ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry, ReplyOpen, Request,
};

use crate::blob::LazyBlob;

/// The one file's name in the FUSE mount.
pub const BLOB_FILE: &str = "rootfs.erofs";
const BLOB_INO: INodeNo = INodeNo(2);
/// Attributes never change (the blob is content-addressed), so the kernel may keep them long.
const TTL: Duration = Duration::from_secs(3600);
/// FUSE worker threads: reads of different chunks fetch in parallel (the kernel's readahead
/// sends several at once); a cold start is bound by round trips, not bandwidth.
const WORKER_THREADS: usize = 4;

struct BlobFs {
    blob: Arc<LazyBlob>,
}

impl BlobFs {
    fn dir_attr() -> FileAttr {
        attr(INodeNo::ROOT, FileType::Directory, 0, 0o555, 2)
    }

    fn file_attr(&self) -> FileAttr {
        attr(BLOB_INO, FileType::RegularFile, self.blob.size(), 0o444, 1)
    }
}

fn attr(ino: INodeNo, kind: FileType, size: u64, perm: u16, nlink: u32) -> FileAttr {
    FileAttr {
        ino,
        size,
        blocks: size.div_ceil(512),
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind,
        perm,
        nlink,
        uid: 0,
        gid: 0,
        rdev: 0,
        flags: 0,
        blksize: 4096,
    }
}

impl Filesystem for BlobFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == INodeNo::ROOT && name == BLOB_FILE {
            reply.entry(&TTL, &self.file_attr(), fuser::Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match ino {
            INodeNo::ROOT => reply.attr(&TTL, &Self::dir_attr()),
            BLOB_INO => reply.attr(&TTL, &self.file_attr()),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if ino != BLOB_INO {
            return reply.error(Errno::EISDIR);
        }
        // The content never changes: keep what the page cache holds across opens.
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != BLOB_INO {
            return reply.error(Errno::EISDIR);
        }
        match self.blob.read_at(offset, size as usize) {
            Ok(data) => reply.data(&data),
            // Registry gone, chunk corrupt: the reading process sees EIO, the node stays up.
            Err(_) => reply.error(Errno::EIO),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (INodeNo::ROOT, FileType::Directory, "."),
            (INodeNo::ROOT, FileType::Directory, ".."),
            (BLOB_INO, FileType::RegularFile, BLOB_FILE),
        ];
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(ino, (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// Mounts the blob's FUSE file system at `dir` (served by background threads until the
/// returned session is dropped or unmounted).
pub fn mount_blob(blob: Arc<LazyBlob>, dir: &Path) -> io::Result<fuser::BackgroundSession> {
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        MountOption::RO,
        MountOption::FSName("sandpool-lazy".to_string()),
        MountOption::Subtype("sandpool-lazy".to_string()),
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoExec,
    ];
    config.n_threads = Some(WORKER_THREADS);
    config.clone_fd = true;
    fuser::spawn_mount(BlobFs { blob }, dir, &config)
}

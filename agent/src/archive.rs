//! Directory reads as a tar archive, written by the `tar` crate as it walks the tree.
//!
//! Entries are regular files, directories and symlinks (not followed), with paths relative to
//! the archived directory, depth first in byte order of names. Sockets, fifos and devices are
//! skipped; hard links are stored as separate files. Entries that vanish while the archive is
//! being written are skipped; a file that shrinks is padded with zeros to its recorded size,
//! and one that grows is cut there. Headers are GNU-style: paths and link targets too long
//! for the header, and numbers too large for its octal fields, use GNU's extensions, which GNU
//! tar, bsdtar, Go's archive/tar and the `tar` crate all read.

use std::fs::{self, File, Metadata};
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use tar::{Builder, EntryType, Header, HeaderMode};

/// Writes the contents of directory `root` to `out` as a tar archive. On error the archive is
/// left without its end-of-archive blocks, so it cannot pass for a complete one.
pub fn write_dir(root: &Path, out: impl Write) -> io::Result<()> {
    let mut ar = Builder::new(out);
    match append_tree(&mut ar, root) {
        Ok(()) => ar.into_inner().map(drop),
        Err(e) => {
            // Dropping the builder would finish the archive; it owns nothing else.
            std::mem::forget(ar);
            Err(e)
        }
    }
}

/// The size `write_dir` would write for `root` as the tree is now: a header per entry (two
/// for a name or link target too long for one), regular files' contents at their full
/// size (sparse or hard-linked: so the tar has them) padded to blocks, the end blocks.
/// Entries it cannot read are left out (the archive would fail on them anyway).
pub fn tar_size(root: &Path) -> u64 {
    const BLOCK: u64 = 512;
    let padded = |n: u64| n.div_ceil(BLOCK).saturating_mul(BLOCK);
    let header = |name_len: usize| BLOCK + if name_len >= 100 { BLOCK + padded(name_len as u64 + 1) } else { 0 };
    let mut total = 2 * BLOCK;
    let mut stack = children(root, Path::new("")).unwrap_or_default();
    while let Some((path, name)) = stack.pop() {
        let Ok(meta) = fs::symlink_metadata(&path) else { continue };
        let name_len = name.as_os_str().len() + usize::from(meta.is_dir());
        total = total.saturating_add(header(name_len));
        if meta.is_dir() {
            stack.extend(children(&path, &name).unwrap_or_default());
        } else if meta.is_file() {
            total = total.saturating_add(padded(meta.len()));
        } else if meta.file_type().is_symlink() {
            let target = fs::read_link(&path).map(|t| t.as_os_str().len()).unwrap_or(0);
            total = total.saturating_add(header(target) - BLOCK);
        }
    }
    total
}

fn append_tree(ar: &mut Builder<impl Write>, root: &Path) -> io::Result<()> {
    let mut stack = children(root, Path::new(""))?;
    stack.reverse();
    while let Some((path, name)) = stack.pop() {
        let meta = match fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(at(&path, e)),
        };
        let kind = meta.file_type();
        if kind.is_dir() {
            let mut dir_name = name.clone().into_os_string();
            dir_name.push("/");
            ar.append_data(&mut header(&meta, EntryType::Directory, 0), dir_name, io::empty())
                .map_err(|e| at(&path, e))?;
            let mut kids = match children(&path, &name) {
                Ok(kids) => kids,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            kids.reverse();
            stack.extend(kids);
        } else if kind.is_file() {
            let file = match File::open(&path) {
                Ok(file) => file,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(at(&path, e)),
            };
            // The open file's size, so header and contents agree even if the path is replaced.
            let meta = file.metadata().map_err(|e| at(&path, e))?;
            let size = meta.len();
            let data = file.take(size).chain(io::repeat(0)).take(size);
            ar.append_data(&mut header(&meta, EntryType::Regular, size), &name, data).map_err(|e| at(&path, e))?;
        } else if kind.is_symlink() {
            let target = match fs::read_link(&path) {
                Ok(target) => target,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(at(&path, e)),
            };
            ar.append_link(&mut header(&meta, EntryType::Symlink, 0), &name, &target).map_err(|e| at(&path, e))?;
        }
    }
    Ok(())
}

/// A header with the entry's kind, size, permission bits, owner and modification time; the
/// builder sets the path (and link target) and the checksum.
fn header(meta: &Metadata, kind: EntryType, size: u64) -> Header {
    let mut h = Header::new_gnu();
    h.set_metadata_in_mode(meta, HeaderMode::Complete);
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(meta.mode() & 0o7777);
    h.set_mtime(meta.mtime().max(0) as u64);
    h
}

fn at(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// The entries of `dir` sorted by name, each with its archive name under `prefix`.
fn children(dir: &Path, prefix: &Path) -> io::Result<Vec<(PathBuf, PathBuf)>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| at(dir, e))? {
        names.push(entry.map_err(|e| at(dir, e))?.file_name());
    }
    names.sort();
    Ok(names.into_iter().map(|n| (dir.join(&n), prefix.join(n))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn tar_size_is_what_write_dir_writes() {
        let dir = scratch("size");
        fs::create_dir_all(dir.join("a/b")).unwrap();
        fs::write(dir.join("a/b/f"), vec![1u8; 1000]).unwrap();
        fs::write(dir.join("empty"), b"").unwrap();
        fs::write(dir.join("x".repeat(150)), b"long name").unwrap();
        std::os::unix::fs::symlink("y".repeat(120), dir.join("link")).unwrap();
        let sparse = File::create(dir.join("sparse")).unwrap();
        sparse.set_len(3 << 20).unwrap();
        let mut out = Vec::new();
        write_dir(&dir, &mut out).unwrap();
        assert_eq!(tar_size(&dir), out.len() as u64);
        let _ = fs::remove_dir_all(&dir);
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sandpool-tar-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn host_tar_lists_and_extracts_the_archive() {
        let src = scratch("src");
        let long = "d".repeat(60) + "/" + &"e".repeat(70);
        fs::create_dir_all(src.join("sub/empty")).unwrap();
        fs::create_dir_all(src.join(&long)).unwrap();
        fs::write(src.join("a.txt"), b"hello\n").unwrap();
        fs::write(src.join("sub/b.bin"), (0..=255u8).cycle().take(70_000).collect::<Vec<_>>()).unwrap();
        fs::write(src.join(&long).join("f".repeat(90)), b"deep").unwrap();
        fs::write(src.join("exec.sh"), b"#!/bin/sh\n").unwrap();
        fs::set_permissions(src.join("exec.sh"), std::os::unix::fs::PermissionsExt::from_mode(0o750)).unwrap();
        std::os::unix::fs::symlink("a.txt", src.join("link")).unwrap();
        std::os::unix::fs::symlink("t".repeat(150), src.join("longlink")).unwrap();
        let fifo = Command::new("mkfifo").arg(src.join("fifo")).status().unwrap();
        assert!(fifo.success());

        let mut archive = Vec::new();
        write_dir(&src, &mut archive).unwrap();
        assert_eq!(archive.len() % 512, 0);
        assert!(archive.ends_with(&[0; 1024]));
        let tar_path = scratch("archive").join("x.tar");
        fs::write(&tar_path, &archive).unwrap();

        let listed = Command::new("tar").arg("-tf").arg(&tar_path).output().unwrap();
        assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
        let listed = String::from_utf8(listed.stdout).unwrap();
        let names: Vec<&str> = listed.lines().collect();
        let deep = format!("{long}/{}", "f".repeat(90));
        let want = [
            "a.txt",
            &format!("{}/", "d".repeat(60)),
            &format!("{long}/"),
            &deep,
            "exec.sh",
            "link",
            "longlink",
            "sub/",
            "sub/b.bin",
            "sub/empty/",
        ];
        assert_eq!(names, want, "depth first in byte order, the fifo skipped");

        let dst = scratch("dst");
        let out = Command::new("tar").arg("-xpf").arg(&tar_path).arg("-C").arg(&dst).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(fs::read(dst.join("a.txt")).unwrap(), b"hello\n");
        assert_eq!(fs::read(dst.join("sub/b.bin")).unwrap(), fs::read(src.join("sub/b.bin")).unwrap());
        assert_eq!(fs::read(dst.join(&deep)).unwrap(), b"deep");
        assert_eq!(fs::metadata(dst.join("exec.sh")).unwrap().mode() & 0o7777, 0o750);
        assert_eq!(fs::read_link(dst.join("link")).unwrap(), Path::new("a.txt"));
        assert_eq!(fs::read_link(dst.join("longlink")).unwrap(), Path::new(&"t".repeat(150)));
        for d in [src, dst, tar_path.parent().unwrap().to_path_buf()] {
            let _ = fs::remove_dir_all(d);
        }
    }

    #[test]
    fn a_missing_root_is_an_error_and_no_archive() {
        let mut out = Vec::new();
        let err = write_dir(Path::new("/nonexistent/sandpool-tar"), &mut out).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert!(out.is_empty(), "no end-of-archive blocks after an error");
    }
}

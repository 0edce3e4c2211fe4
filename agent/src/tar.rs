//! A streaming tar writer for directory reads: ustar headers, with a pax extended header
//! (`path`, `linkpath`, `size`, `uid`, `gid`) where a value does not fit, which GNU tar,
//! bsdtar and the `tar` crate all read.
//!
//! Entries are regular files, directories and symlinks (not followed), with paths relative to
//! the archived directory, depth first in byte order of names. Sockets, fifos and devices are
//! skipped; hard links are stored as separate files. Entries that vanish while the archive is
//! being written are skipped; a file that shrinks is padded with zeros to its recorded size.

use std::fs::{self, File, Metadata};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

const BLOCK: usize = 512;
/// Largest value of an 11-digit octal field (size, mtime): 8 GiB - 1.
const MAX_OCTAL_11: u64 = 0o777_7777_7777;
/// Largest value of a 7-digit octal field (uid, gid).
const MAX_OCTAL_7: u64 = 0o777_7777;

const REGULAR: u8 = b'0';
const SYMLINK: u8 = b'2';
const DIRECTORY: u8 = b'5';
const PAX: u8 = b'x';

/// Writes the contents of directory `root` to `out` as a tar archive.
pub fn write_dir(root: &Path, out: &mut impl Write) -> io::Result<()> {
    let mut stack = children(root, b"")?;
    stack.reverse();
    while let Some((path, name)) = stack.pop() {
        let meta = match fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(at(&path, e)),
        };
        let kind = meta.file_type();
        if kind.is_dir() {
            let mut dir_name = name.clone();
            dir_name.push(b'/');
            header(out, &dir_name, &meta, DIRECTORY, 0, b"")?;
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
            header(out, &name, &meta, REGULAR, size, b"")?;
            let copied = io::copy(&mut file.take(size), out).map_err(|e| at(&path, e))?;
            zeros(out, size - copied)?;
            pad(out, size)?;
        } else if kind.is_symlink() {
            let target = match fs::read_link(&path) {
                Ok(target) => target,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(at(&path, e)),
            };
            header(out, &name, &meta, SYMLINK, 0, target.as_os_str().as_bytes())?;
        }
    }
    // End of archive: two zero blocks.
    zeros(out, 2 * BLOCK as u64)
}

fn at(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// The entries of `dir` sorted by name, each with its archive name under `prefix`.
fn children(dir: &Path, prefix: &[u8]) -> io::Result<Vec<(PathBuf, Vec<u8>)>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| at(dir, e))? {
        names.push(entry.map_err(|e| at(dir, e))?.file_name());
    }
    names.sort();
    Ok(names
        .into_iter()
        .map(|n| {
            let mut name = prefix.to_vec();
            if !name.is_empty() {
                name.push(b'/');
            }
            name.extend_from_slice(n.as_bytes());
            (dir.join(n), name)
        })
        .collect())
}

fn zeros(out: &mut impl Write, mut n: u64) -> io::Result<()> {
    const Z: [u8; BLOCK] = [0; BLOCK];
    while n > 0 {
        let k = n.min(BLOCK as u64) as usize;
        out.write_all(&Z[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Pads `len` bytes of entry data to a whole block.
fn pad(out: &mut impl Write, len: u64) -> io::Result<()> {
    zeros(out, (BLOCK as u64 - len % BLOCK as u64) % BLOCK as u64)
}

/// Writes the header of one entry, preceded by a pax header if some value does not fit.
fn header(out: &mut impl Write, name: &[u8], meta: &Metadata, kind: u8, size: u64, link: &[u8]) -> io::Result<()> {
    let (uid, gid) = (u64::from(meta.uid()), u64::from(meta.gid()));
    let mut pax = Vec::new();
    if name.len() > 100 {
        pax_record(&mut pax, "path", name);
    }
    if link.len() > 100 {
        pax_record(&mut pax, "linkpath", link);
    }
    if size > MAX_OCTAL_11 {
        pax_record(&mut pax, "size", size.to_string().as_bytes());
    }
    if uid > MAX_OCTAL_7 {
        pax_record(&mut pax, "uid", uid.to_string().as_bytes());
    }
    if gid > MAX_OCTAL_7 {
        pax_record(&mut pax, "gid", gid.to_string().as_bytes());
    }
    if !pax.is_empty() {
        let fields =
            Fields { name: b"././@PaxHeader", mode: 0o644, size: pax.len() as u64, kind: PAX, ..Fields::default() };
        out.write_all(&fields.block())?;
        out.write_all(&pax)?;
        pad(out, pax.len() as u64)?;
    }
    let fields = Fields {
        name: &name[..name.len().min(100)],
        mode: meta.mode() & 0o7777,
        uid: uid.min(MAX_OCTAL_7),
        gid: gid.min(MAX_OCTAL_7),
        size: size.min(MAX_OCTAL_11),
        mtime: (meta.mtime().max(0) as u64).min(MAX_OCTAL_11),
        kind,
        link: &link[..link.len().min(100)],
    };
    out.write_all(&fields.block())
}

/// Appends one pax record, "<len> <key>=<value>\n", where len counts the whole record.
fn pax_record(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    let base = key.len() + value.len() + 3;
    let mut len = base + 1;
    while base + len.to_string().len() != len {
        len = base + len.to_string().len();
    }
    out.extend_from_slice(format!("{len} {key}=").as_bytes());
    out.extend_from_slice(value);
    out.push(b'\n');
}

/// The fields of a ustar header that the agent sets (all must fit; `header` clamps them).
#[derive(Default)]
struct Fields<'a> {
    name: &'a [u8],
    mode: u32,
    uid: u64,
    gid: u64,
    size: u64,
    mtime: u64,
    kind: u8,
    link: &'a [u8],
}

impl Fields<'_> {
    fn block(&self) -> [u8; BLOCK] {
        let mut h = [0u8; BLOCK];
        h[..self.name.len()].copy_from_slice(self.name);
        octal(&mut h[100..108], u64::from(self.mode));
        octal(&mut h[108..116], self.uid);
        octal(&mut h[116..124], self.gid);
        octal(&mut h[124..136], self.size);
        octal(&mut h[136..148], self.mtime);
        h[148..156].fill(b' '); // the checksum counts its own field as spaces
        h[156] = self.kind;
        h[157..157 + self.link.len()].copy_from_slice(self.link);
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
        octal(&mut h[148..155], sum); // six digits, NUL, then the space already there
        h
    }
}

/// Zero-padded octal digits filling `field` but its last byte, which stays NUL.
fn octal(field: &mut [u8], value: u64) {
    let digits = format!("{value:0width$o}", width = field.len() - 1);
    field[..digits.len()].copy_from_slice(digits.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sandpool-tar-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn pax_records_count_their_own_length() {
        let mut out = Vec::new();
        pax_record(&mut out, "path", b"abc");
        assert_eq!(out, b"12 path=abc\n");
        // Across the digit-count boundaries, where the length changes its own width.
        for n in 0..1100 {
            let mut out = Vec::new();
            pax_record(&mut out, "path", &vec![b'x'; n]);
            let digits = out.iter().position(|&b| b == b' ').unwrap();
            let len: usize = std::str::from_utf8(&out[..digits]).unwrap().parse().unwrap();
            assert_eq!(len, out.len(), "value length {n}");
        }
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
        std::os::unix::fs::symlink("a.txt", src.join("link")).unwrap();
        std::os::unix::fs::symlink("t".repeat(150), src.join("longlink")).unwrap();

        let mut archive = Vec::new();
        write_dir(&src, &mut archive).unwrap();
        assert_eq!(archive.len() % BLOCK, 0);
        let tar_path = scratch("archive").join("x.tar");
        fs::write(&tar_path, &archive).unwrap();

        let listed = Command::new("tar").arg("-tf").arg(&tar_path).output().unwrap();
        assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
        let listed = String::from_utf8(listed.stdout).unwrap();
        let names: Vec<&str> = listed.lines().collect();
        assert!(names.contains(&"a.txt"), "{names:?}");
        assert!(names.contains(&"sub/empty/"), "{names:?}");
        assert!(names.contains(&"sub/b.bin"), "{names:?}");
        assert!(names.contains(&format!("{long}/{}", "f".repeat(90)).as_str()), "{names:?}");

        let dst = scratch("dst");
        let out = Command::new("tar").arg("-xf").arg(&tar_path).arg("-C").arg(&dst).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(fs::read(dst.join("a.txt")).unwrap(), b"hello\n");
        assert_eq!(fs::read(dst.join("sub/b.bin")).unwrap(), fs::read(src.join("sub/b.bin")).unwrap());
        assert_eq!(fs::read(dst.join(&long).join("f".repeat(90))).unwrap(), b"deep");
        assert_eq!(fs::read_link(dst.join("link")).unwrap(), Path::new("a.txt"));
        assert_eq!(fs::read_link(dst.join("longlink")).unwrap(), Path::new(&"t".repeat(150)));
        for d in [src, dst, tar_path.parent().unwrap().to_path_buf()] {
            let _ = fs::remove_dir_all(d);
        }
    }
}

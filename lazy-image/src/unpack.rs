//! Applies image layers (tar streams) to one directory, in order, as a container runtime's
//! overlay would see them: whiteouts (`.wh.NAME`) delete what lower layers put there, an
//! opaque marker (`.wh..wh..opq`) hides a directory's lower contents. Ownership, modes,
//! xattrs and device nodes are kept (this runs as root, as `mkfs.erofs` needs).

use std::collections::HashSet;
use std::ffi::CString;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Component, Path, PathBuf};

use anyhow::{Context as _, bail};

const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_MARKER: &str = ".wh..wh..opq";

/// What a layer's stream is compressed with (from its media type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// A plain tar stream.
    None,
    /// A gzip-compressed tar stream.
    Gzip,
}

impl Compression {
    /// The compression a layer media type implies (`...tar` or `...tar+gzip`, OCI or Docker); any
    /// other media type is refused.
    pub fn from_media_type(media_type: &str) -> anyhow::Result<Self> {
        if media_type.ends_with(".tar") || media_type.ends_with("tar.v1") {
            return Ok(Compression::None);
        }
        if media_type.ends_with("+gzip") || media_type.ends_with(".tar.gzip") || media_type.ends_with("tar.gzip") {
            return Ok(Compression::Gzip);
        }
        bail!("layer media type {media_type:?} is not supported (tar or gzip-compressed tar)")
    }
}

/// Unpacks one layer into `root` (which holds the layers below it).
pub fn apply_layer(root: &Path, layer: impl Read, compression: Compression) -> anyhow::Result<()> {
    let reader: Box<dyn Read> = match compression {
        Compression::None => Box::new(layer),
        Compression::Gzip => Box::new(flate2::read::GzDecoder::new(layer)),
    };
    let mut archive = tar::Archive::new(reader);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_preserve_mtime(true);
    archive.set_unpack_xattrs(true);
    archive.set_overwrite(true);
    // Paths this layer wrote: an opaque marker hides only what lies below this layer.
    let mut written: HashSet<PathBuf> = HashSet::new();
    for entry in archive.entries().context("read layer")? {
        let mut entry = entry.context("read layer entry")?;
        let rel = clean_path(&entry.path().context("entry path")?)?;
        let Some(name) = rel.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            continue; // the root itself
        };
        let parent = rel.parent().unwrap_or(Path::new(""));
        if name == OPAQUE_MARKER {
            clear_dir_except(&root.join(parent), parent, &written)?;
            continue;
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
            remove_any(&root.join(parent).join(hidden))?;
            continue;
        }
        let dst = root.join(&rel);
        let kind = entry.header().entry_type();
        // A path changing kind between layers (file <-> directory) replaces what was there.
        if let Ok(meta) = std::fs::symlink_metadata(&dst)
            && (meta.is_dir() != kind.is_dir())
        {
            remove_any(&dst)?;
        }
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            make_node(&mut entry, &dst)?;
        } else {
            entry.unpack_in(root).with_context(|| format!("unpack {}", rel.display()))?;
        }
        written.insert(rel);
    }
    Ok(())
}

/// A layer path relative to the root, without `.`; `..` is refused (a layer must not write
/// outside its root).
fn clean_path(path: &Path) -> anyhow::Result<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => bail!("layer path {} leaves the root", path.display()),
        }
    }
    Ok(out)
}

fn remove_any(path: &Path) -> anyhow::Result<()> {
    let result = match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    result.with_context(|| format!("remove {}", path.display()))
}

/// Empties `dir` of everything this layer did not write itself.
fn clear_dir_except(dir: &Path, rel_dir: &Path, written: &HashSet<PathBuf>) -> anyhow::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("read {}", dir.display())),
    };
    for entry in entries {
        let entry = entry?;
        if !written.contains(&rel_dir.join(entry.file_name())) {
            remove_any(&entry.path())?;
        }
    }
    Ok(())
}

/// Device nodes and FIFOs (the tar crate does not create them).
fn make_node<R: Read>(entry: &mut tar::Entry<'_, R>, dst: &Path) -> anyhow::Result<()> {
    let header = entry.header();
    let kind = header.entry_type();
    let mode = header.mode().context("node mode")?;
    let uid = header.uid().context("node uid")?;
    let gid = header.gid().context("node gid")?;
    let major = header.device_major().context("node major")?.unwrap_or(0);
    let minor = header.device_minor().context("node minor")?.unwrap_or(0);
    let type_bits = if kind.is_character_special() {
        libc::S_IFCHR
    } else if kind.is_block_special() {
        libc::S_IFBLK
    } else {
        libc::S_IFIFO
    };
    if let Some(parent) = dst.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
    }
    remove_any(dst)?;
    let path = CString::new(dst.as_os_str().as_bytes()).context("node path has a NUL")?;
    let dev = libc::makedev(major, minor);
    // SAFETY: `path` is a valid NUL-terminated string; mknod reads nothing else of ours.
    if unsafe { libc::mknod(path.as_ptr(), type_bits | (mode & 0o7777), dev) } != 0 {
        return Err(io::Error::last_os_error()).with_context(|| format!("mknod {}", dst.display()));
    }
    // SAFETY: as above; lchown takes the path and two integers.
    if unsafe { libc::lchown(path.as_ptr(), uid as libc::uid_t, gid as libc::gid_t) } != 0 {
        return Err(io::Error::last_os_error()).with_context(|| format!("chown {}", dst.display()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(entries: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, content) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            match content {
                Some(data) => {
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_size(data.len() as u64);
                    header.set_mode(0o644);
                    header.set_cksum();
                    builder.append_data(&mut header, path, *data).unwrap();
                }
                None => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_size(0);
                    header.set_mode(0o755);
                    header.set_cksum();
                    builder.append_data(&mut header, path, io::empty()).unwrap();
                }
            }
        }
        builder.into_inner().unwrap()
    }

    /// A scratch directory removed on drop, pass or fail.
    struct TempDir(PathBuf);

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tempdir() -> TempDir {
        let dir = std::env::temp_dir().join(format!("lazy-unpack-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    #[test]
    fn whiteouts_and_opaque_dirs_hide_lower_layers() {
        let scratch = tempdir();
        let root = scratch.0.clone();
        let lower = layer(&[
            ("etc/", None),
            ("etc/keep", Some(b"keep")),
            ("etc/gone", Some(b"gone")),
            ("opt/", None),
            ("opt/old", Some(b"old")),
            ("file-then-dir", Some(b"f")),
        ]);
        apply_layer(&root, &lower[..], Compression::None).unwrap();
        let upper = layer(&[
            ("etc/.wh.gone", Some(b"")),
            ("opt/", None),
            ("opt/new", Some(b"new")),
            ("opt/.wh..wh..opq", Some(b"")),
            ("file-then-dir/", None),
            ("file-then-dir/inside", Some(b"i")),
        ]);
        apply_layer(&root, &upper[..], Compression::None).unwrap();

        assert_eq!(std::fs::read(root.join("etc/keep")).unwrap(), b"keep");
        assert!(!root.join("etc/gone").exists(), "a whiteout removes the lower file");
        assert!(!root.join("etc/.wh.gone").exists(), "whiteout markers are not files of the image");
        assert!(!root.join("opt/old").exists(), "an opaque dir hides the lower contents");
        assert_eq!(std::fs::read(root.join("opt/new")).unwrap(), b"new", "but keeps its own layer's");
        assert_eq!(std::fs::read(root.join("file-then-dir/inside")).unwrap(), b"i");
    }

    #[test]
    fn refuses_paths_that_leave_the_root() {
        assert!(clean_path(Path::new("../etc/passwd")).is_err());
        assert_eq!(clean_path(Path::new("./a/./b")).unwrap(), PathBuf::from("a/b"));
    }

    #[test]
    fn knows_layer_media_types() {
        assert_eq!(
            Compression::from_media_type("application/vnd.docker.image.rootfs.diff.tar.gzip").unwrap(),
            Compression::Gzip
        );
        assert_eq!(
            Compression::from_media_type("application/vnd.oci.image.layer.v1.tar+gzip").unwrap(),
            Compression::Gzip
        );
        assert_eq!(Compression::from_media_type("application/vnd.oci.image.layer.v1.tar").unwrap(), Compression::None);
        assert!(Compression::from_media_type("application/vnd.oci.image.layer.v1.tar+zstd").is_err());
    }
}

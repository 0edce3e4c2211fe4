//! A lazy image's root filesystem on a node: the image's blob as a FUSE file (chunks fetched
//! on demand into the node's chunk cache) and the kernel's file-backed EROFS mounted on it,
//! read-only. A sandbox's writable root is an overlay with this as its lower layer
//! ([`overlay_options`]).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context as _, bail, ensure};

use crate::blob::{BlobStats, LazyBlob};
use crate::cache::ChunkCache;
use crate::fetch::FetchPolicy;
use crate::fuse::{BLOB_FILE, mount_blob};
use crate::manifest::{EROFS_LAYER_MEDIA_TYPE, ImageManifest, LAZY_CONFIG_MEDIA_TYPE, LazyConfig};
use crate::reference::Reference;
use crate::registry::Registry;

/// A resolved lazy image: what its manifest and config say.
#[derive(Debug, Clone)]
pub struct LazyImage {
    /// The image pinned to its manifest digest.
    pub reference: Reference,
    /// The lazy config: the source, its run config and the blob's chunk digests.
    pub config: LazyConfig,
}

impl LazyImage {
    /// Fetches and checks a lazy image's manifest and config. A plain image is refused with a
    /// message saying how to make it lazy.
    pub async fn resolve(image: &Reference) -> anyhow::Result<Self> {
        let registry = Registry::for_reference(image)?;
        let fetched = registry.manifest(&image.repository, image.manifest_reference()).await?;
        let manifest: ImageManifest =
            serde_json::from_slice(&fetched.bytes).with_context(|| format!("parse the manifest of {image}"))?;
        if manifest.config.media_type != LAZY_CONFIG_MEDIA_TYPE {
            bail!("{image} is not a lazy image (convert it with `sandpool images convert`)");
        }
        let config_bytes = registry.blob(&image.repository, &manifest.config.digest).await?;
        let config: LazyConfig =
            serde_json::from_slice(&config_bytes).with_context(|| format!("parse the lazy config of {image}"))?;
        config.rootfs.validate()?;
        let [layer] = manifest.layers.as_slice() else {
            bail!("{image}: a lazy image has exactly one layer, not {}", manifest.layers.len());
        };
        ensure!(
            layer.media_type == EROFS_LAYER_MEDIA_TYPE
                && layer.digest == config.rootfs.digest
                && layer.size == config.rootfs.size,
            "{image}: its layer and its config disagree about the EROFS blob"
        );
        Ok(LazyImage { reference: image.pinned(&fetched.digest), config })
    }
}

/// A mounted lazy root filesystem. Unmounted by [`LazyRootfs::unmount`], or on drop (lazily:
/// detached, for a drop cannot report errors).
pub struct LazyRootfs {
    image: LazyImage,
    target: PathBuf,
    fuse_dir: PathBuf,
    session: Option<fuser::BackgroundSession>,
    blob: Arc<LazyBlob>,
    stats: Arc<BlobStats>,
    erofs_mounted: bool,
}

impl LazyRootfs {
    /// Mounts `image` read-only at `target` (an existing directory). `state_dir` holds this
    /// mount's FUSE directory; `cache` is the node's chunk cache; `policy` bounds each chunk
    /// fetch (past it, the reader gets EIO).
    pub async fn mount(
        image: &Reference,
        cache: Arc<ChunkCache>,
        policy: FetchPolicy,
        state_dir: &Path,
        target: &Path,
    ) -> anyhow::Result<LazyRootfs> {
        let image = LazyImage::resolve(image).await?;
        let registry = Registry::for_reference(&image.reference)?;
        let blob =
            LazyBlob::new(registry, image.reference.repository.clone(), image.config.rootfs.clone(), cache, policy)?;
        let blob = Arc::new(blob);
        let stats = blob.stats();
        let fuse_dir = state_dir.join("blob");
        std::fs::create_dir_all(&fuse_dir).with_context(|| format!("create {}", fuse_dir.display()))?;
        let mut rootfs = LazyRootfs {
            image,
            target: target.to_path_buf(),
            fuse_dir: fuse_dir.clone(),
            session: None,
            blob: blob.clone(),
            stats,
            erofs_mounted: false,
        };
        let target = target.to_path_buf();
        // Both mounts block (the EROFS mount reads the superblock through FUSE, so through the
        // registry): off the async threads. On failure, dropping `rootfs` undoes what was done.
        tokio::task::spawn_blocking(move || -> anyhow::Result<LazyRootfs> {
            let session = mount_blob(blob, &fuse_dir)
                .with_context(|| format!("mount the blob's FUSE file at {}", fuse_dir.display()))?;
            rootfs.session = Some(session);
            mount_erofs(&fuse_dir.join(BLOB_FILE), &target)?;
            rootfs.erofs_mounted = true;
            rootfs.blob.mark_mounted();
            Ok(rootfs)
        })
        .await
        .context("join the mount task")?
    }

    /// The image this mount serves.
    pub fn image(&self) -> &LazyImage {
        &self.image
    }

    /// The mount's blob: its access profile, and prefetches into the cache.
    pub fn blob(&self) -> &Arc<LazyBlob> {
        &self.blob
    }

    /// Counters of this mount's blob: bytes fetched, cache hits, errors.
    pub fn stats(&self) -> &Arc<BlobStats> {
        &self.stats
    }

    /// Where the image's EROFS root filesystem is mounted (read-only; an overlay's lower layer).
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Unmounts the EROFS, then the FUSE file. Fails (and leaves both mounted) while the root
    /// filesystem is in use.
    pub fn unmount(mut self) -> anyhow::Result<()> {
        if self.erofs_mounted {
            umount(&self.target, 0)?;
            self.erofs_mounted = false;
        }
        if let Some(session) = self.session.take() {
            // The kernel lets go of the EROFS backing file a moment after the EROFS unmount
            // returns (a deferred close): until then the FUSE mount is busy.
            if let Err(e) = umount_when_free(&self.fuse_dir) {
                self.session = Some(session);
                return Err(e);
            }
            // Unmounted: the session's thread sees ENODEV and ends. (fuser's own unmount, run
            // when the session drops, then finds nothing to do.)
            session.join().with_context(|| format!("join the FUSE session of {}", self.fuse_dir.display()))?;
        }
        Ok(())
    }
}

impl Drop for LazyRootfs {
    fn drop(&mut self) {
        if self.erofs_mounted
            && let Err(e) = umount(&self.target, libc::MNT_DETACH)
        {
            tracing::warn!(target = %self.target.display(), error = format!("{e:#}"), "could not detach a lazy rootfs");
        }
        if let Some(session) = self.session.take() {
            // Detached, the FUSE mount goes when the kernel closes the backing file, and the
            // session's threads end then; a drop does not wait for that.
            if let Err(e) = umount(&self.fuse_dir, libc::MNT_DETACH) {
                tracing::warn!(dir = %self.fuse_dir.display(), error = format!("{e:#}"), "could not detach a lazy blob");
            }
            drop(session);
        }
    }
}

/// How long `unmount` waits for the kernel to release the EROFS backing file.
const FUSE_RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Unmounts `dir`, retrying while it is busy, up to `FUSE_RELEASE_WAIT`.
fn umount_when_free(dir: &Path) -> anyhow::Result<()> {
    let began = std::time::Instant::now();
    loop {
        match umount(dir, 0) {
            Ok(()) => return Ok(()),
            Err(e)
                if began.elapsed() < FUSE_RELEASE_WAIT
                    && e.downcast_ref::<io::Error>().and_then(io::Error::raw_os_error) == Some(libc::EBUSY) =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Mounts the EROFS image in `file` (file-backed: kernel 6.12+, no loop device) at `target`.
fn mount_erofs(file: &Path, target: &Path) -> anyhow::Result<()> {
    let source = c_path(file)?;
    let dir = c_path(target)?;
    let fstype = c"erofs";
    // SAFETY: every pointer is a valid NUL-terminated string that outlives the call; no data.
    let rc = unsafe {
        libc::mount(source.as_ptr(), dir.as_ptr(), fstype.as_ptr(), libc::MS_RDONLY | libc::MS_NODEV, std::ptr::null())
    };
    if rc != 0 {
        let err = io::Error::last_os_error();
        bail!(
            "mount the EROFS image {} at {}: {err} (needs root and a kernel with file-backed EROFS, \
             CONFIG_EROFS_FS_BACKED_BY_FILE)",
            file.display(),
            target.display()
        );
    }
    Ok(())
}

/// Detaches the mount at `target` (`umount -l`): it goes once nothing uses it.
pub fn detach(target: &Path) -> anyhow::Result<()> {
    umount(target, libc::MNT_DETACH)
}

fn umount(target: &Path, flags: libc::c_int) -> anyhow::Result<()> {
    let dir = c_path(target)?;
    // SAFETY: a valid NUL-terminated path and plain flags.
    if unsafe { libc::umount2(dir.as_ptr(), flags) } != 0 {
        return Err(io::Error::last_os_error()).with_context(|| format!("unmount {}", target.display()));
    }
    Ok(())
}

fn c_path(path: &Path) -> anyhow::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).with_context(|| format!("path {} has a NUL byte", path.display()))
}

/// The overlay mount options for a sandbox root with `lower` (a mounted lazy rootfs) under a
/// writable `upper`/`work` pair on the node's bounded data disk.
pub fn overlay_options(lower: &Path, upper: &Path, work: &Path) -> String {
    format!("lowerdir={},upperdir={},workdir={}", lower.display(), upper.display(), work.display())
}

//! `sandpool-lazy-runtime`, an OCI runtime in front of runc (or crun, or gVisor's runsc: dockerd
//! names the real one with `--sandpool-oci=PATH`), so Docker runs lazy sandboxes with
//! everything it gives any container (networks, cgroup limits, pause, events, labels, disk
//! bounds). Docker creates a lazy sandbox from a tiny stub image whose root holds only
//! [`MARKER`]; on `create`/`run` this wrapper finds the marker in the bundle's `root.path`,
//! mounts an overlay there-over (lower: the node's lazy mount of the image; upper and work:
//! `.lazy/{upper,work}` in the container's own writable layer, its root on btrfs and its
//! `upperdir` on overlay2, so Docker's disk bound counts the writes and `docker commit` keeps
//! them), points `root.path` at the overlay and runs the real runtime. On `delete` it unmounts
//! the overlay. Every other command, and any container without the marker, passes through to
//! the real runtime unchanged.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};

/// The stub image's one file: which lazy image the container runs and where it is mounted.
pub const MARKER: &str = ".sandpool-lazy";
/// Where each container's overlay is mounted (`<dir>/<container id>`).
pub const ROOTS_DIR: &str = "/run/sandpool/lazy-roots";
/// The runtime name Docker knows the wrapper by (`/etc/docker/daemon.json`).
pub const RUNTIME_NAME: &str = "sandpool-lazy";
/// Inside the stub's root: the overlay's upper and work directories.
const UPPER: &str = ".lazy/upper";
const WORK: &str = ".lazy/work";

/// The content of [`MARKER`] (JSON).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Marker {
    /// The lazy image, pinned by digest.
    pub image: String,
    /// The node's read-only mount of it (`sandpool-lazyd`'s `<state>/<digest>/root`).
    pub lower: PathBuf,
}

/// What runc is asked to do, as far as the wrapper cares.
#[derive(Debug, Default, PartialEq)]
pub struct Invocation {
    /// runc's command (`create`, `run`, `delete`, ...): its first argument past the global flags.
    pub command: Option<String>,
    /// The `--bundle`/`-b` directory, when given.
    pub bundle: Option<PathBuf>,
    /// The container id (runc's last argument).
    pub id: Option<String>,
}

/// runc's global flags that take a value (`--root DIR`), before the command.
const GLOBAL_VALUE_FLAGS: &[&str] = &["--root", "--log", "--log-format", "--criu", "--rootless"];

/// Reads runc's command line: `[global flags] COMMAND [flags] ID`.
pub fn parse(args: &[String]) -> Invocation {
    let mut inv = Invocation::default();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        if inv.command.is_none() {
            if GLOBAL_VALUE_FLAGS.contains(&arg.as_str()) {
                i += 1;
            } else if !arg.starts_with('-') {
                inv.command = Some(arg.clone());
            }
        } else if arg == "--bundle" || arg == "-b" {
            inv.bundle = args.get(i + 1).map(PathBuf::from);
            i += 1;
        } else if let Some(b) = arg.strip_prefix("--bundle=") {
            inv.bundle = Some(PathBuf::from(b));
        }
        i += 1;
    }
    if inv.command.is_some() {
        inv.id = args.last().filter(|a| !a.starts_with('-') && Some(*a) != inv.command.as_ref()).cloned();
    }
    inv
}

/// A container id as a path component: runc's own rule (no `/`, no `..`).
fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 1024 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-+".contains(&b))
}

/// Before runc `create`/`run`: when the bundle's root carries the marker, mounts the overlay
/// at `<roots_dir>/<id>` and points the bundle's `root.path` there. Returns whether it did.
pub fn prepare(bundle: &Path, id: &str, roots_dir: &Path) -> anyhow::Result<bool> {
    let config_path = bundle.join("config.json");
    let bytes = std::fs::read(&config_path).with_context(|| format!("read {}", config_path.display()))?;
    let mut config: serde_json::Value =
        serde_json::from_slice(&bytes).with_context(|| format!("parse {}", config_path.display()))?;
    let Some(root) = config.pointer("/root/path").and_then(|p| p.as_str()) else {
        return Ok(false);
    };
    let root = bundle.join(root);
    let marker_path = root.join(MARKER);
    let marker = match std::fs::read(&marker_path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("read {}", marker_path.display())),
    };
    let marker: Marker = serde_json::from_slice(&marker).with_context(|| format!("parse {}", marker_path.display()))?;
    if !valid_id(id) {
        bail!("container id {id:?} is not a valid path component");
    }
    if !crate::lazyd::is_mount_point(&marker.lower) {
        bail!(
            "lazy image {} is not mounted at {} on this node (sandpool-lazyd mounts it when the node \
             prepares the template)",
            marker.image,
            marker.lower.display()
        );
    }
    // The container's own writable layer: the root itself (btrfs: a snapshot holding the image's
    // layers too), or on an overlay2 data root (an overlayfs, which cannot hold another
    // overlay's upper) the layer's own directory, its image's layers beside it.
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let layers = docker_overlay(&root, &mountinfo);
    let layer = layers.as_ref().map_or(root.as_path(), |l| l.upper.as_path());
    let upper = layer.join(UPPER);
    let work = layer.join(WORK);
    if !upper.exists() {
        std::fs::create_dir_all(&upper).with_context(|| format!("create {}", upper.display()))?;
        // The overlay's root directory takes the upper's owner and mode: the image's.
        let lower_root = std::fs::metadata(&marker.lower)?;
        std::fs::set_permissions(&upper, std::fs::Permissions::from_mode(lower_root.mode() & 0o7777))?;
        std::os::unix::fs::chown(&upper, Some(lower_root.uid()), Some(lower_root.gid()))?;
    }
    std::fs::create_dir_all(&work).with_context(|| format!("create {}", work.display()))?;
    let target = roots_dir.join(id);
    std::fs::create_dir_all(&target).with_context(|| format!("create {}", target.display()))?;
    if !crate::lazyd::is_mount_point(&target) {
        // A snapshot's container on overlay2: its parents' writes are `.lazy/upper` in Docker's
        // lower layers (a commit's layer holds its session's upper, whiteouts and all); they
        // sit over the image, the newest on top, as Docker's own layers do.
        let mut lowers: Vec<PathBuf> =
            layers.iter().flat_map(|l| &l.lowers).map(|dir| dir.join(UPPER)).filter(|dir| dir.is_dir()).collect();
        lowers.push(marker.lower.clone());
        let lower = std::env::join_paths(&lowers).context("the overlay's lower layers")?;
        let options = crate::mount::overlay_options(Path::new(&lower), &upper, &work);
        mount_overlay(&target, &options)?;
    }
    config["root"]["path"] = serde_json::Value::String(target.display().to_string());
    let tmp = bundle.join("config.json.sandpool-lazy");
    std::fs::write(&tmp, serde_json::to_vec(&config)?).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, &config_path).with_context(|| format!("replace {}", config_path.display()))?;
    Ok(true)
}

/// The layers of a container whose root filesystem is an overlayfs (Docker's overlay2 driver).
#[derive(Debug, PartialEq)]
pub struct DockerLayers {
    /// The container's own layer (`upperdir`): a plain directory, which commits and disk
    /// quotas see as they see the root on btrfs.
    pub upper: PathBuf,
    /// Its image's layers (`lowerdir`), topmost first.
    pub lowers: Vec<PathBuf>,
}

/// The layers of root filesystem `root` when, by `mountinfo` (`/proc/self/mountinfo`), it is an
/// overlayfs mount; `None` for anything else (btrfs's snapshot, a plain directory).
pub fn docker_overlay(root: &Path, mountinfo: &str) -> Option<DockerLayers> {
    // Fields: id parent major:minor root mount-point options [optional...] - fstype source super-options
    mountinfo.lines().rev().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mount_point = left.split(' ').nth(4)?;
        let mut right = right.split(' ');
        let (fstype, _source, options) = (right.next()?, right.next()?, right.next()?);
        if fstype != "overlay" || Path::new(&unescape_octal(mount_point)) != root {
            return None;
        }
        let option = |key: &str| options.split(',').find_map(|o| o.strip_prefix(key)).map(unescape_octal);
        let lowers = option("lowerdir=").map(|l| l.split(':').map(PathBuf::from).collect()).unwrap_or_default();
        Some(DockerLayers { upper: PathBuf::from(option("upperdir=")?), lowers })
    })
}

/// mountinfo's escapes (`\040` for a space, and so on) undone.
fn unescape_octal(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal =
            bytes.get(i + 1..i + 4).filter(|d| bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// After runc `delete`: unmounts the container's overlay, if it has one.
pub fn cleanup(id: &str, roots_dir: &Path) -> anyhow::Result<()> {
    if !valid_id(id) {
        return Ok(());
    }
    let target = roots_dir.join(id);
    if crate::lazyd::is_mount_point(&target) {
        crate::mount::detach(&target)?;
    }
    match std::fs::remove_dir(&target) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("remove {}", target.display()))
        }
        _ => Ok(()),
    }
}

fn mount_overlay(target: &Path, options: &str) -> anyhow::Result<()> {
    let dir = CString::new(target.as_os_str().as_bytes())?;
    let data = CString::new(options)?;
    // SAFETY: valid NUL-terminated strings that outlive the call.
    let rc = unsafe { libc::mount(c"overlay".as_ptr(), dir.as_ptr(), c"overlay".as_ptr(), 0, data.as_ptr().cast()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("mount an overlay at {} ({options})", target.display()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn reads_the_shims_create_and_delete() {
        let inv = parse(&args(
            "--root /run/docker/runtime-runc/moby --log /b/log.json --log-format json create \
             --bundle /b --pid-file /b/init.pid --console-socket /tmp/c.sock abc123",
        ));
        assert_eq!(inv.command.as_deref(), Some("create"));
        assert_eq!(inv.bundle.as_deref(), Some(Path::new("/b")));
        assert_eq!(inv.id.as_deref(), Some("abc123"));

        let inv = parse(&args("--root /r --log /l --log-format json delete --force abc123"));
        assert_eq!((inv.command.as_deref(), inv.id.as_deref(), inv.bundle), (Some("delete"), Some("abc123"), None));

        let inv = parse(&args("--debug run -b=/x --bundle=/b id"));
        assert_eq!((inv.command.as_deref(), inv.bundle.as_deref()), (Some("run"), Some(Path::new("/b"))));

        assert_eq!(parse(&args("--version")), Invocation::default());
        assert_eq!(parse(&args("features")).id, None);
    }

    #[test]
    fn on_an_overlay2_data_root_the_writes_go_to_the_layers_upper_directory() {
        let mountinfo = "\
22 1 0:21 / / rw,relatime shared:1 - btrfs /dev/vda rw
901 22 0:77 / /var/lib/d2/overlay2/abc/merged rw,relatime - overlay overlay rw,lowerdir=/var/lib/d2/overlay2/l/X:/var/lib/d2/overlay2/l/Y,upperdir=/var/lib/d2/overlay2/abc/diff,workdir=/var/lib/d2/overlay2/abc/work
902 22 0:78 / /var/lib/d2/overlay2/a\\040b/merged rw - overlay overlay rw,lowerdir=/l,upperdir=/var/lib/d2/overlay2/a\\040b/diff,workdir=/w
";
        let root = Path::new("/var/lib/d2/overlay2/abc/merged");
        let layers = docker_overlay(root, mountinfo).expect("an overlay");
        assert_eq!(layers.upper, Path::new("/var/lib/d2/overlay2/abc/diff"));
        assert_eq!(layers.lowers, [Path::new("/var/lib/d2/overlay2/l/X"), Path::new("/var/lib/d2/overlay2/l/Y")]);
        let spaced = Path::new("/var/lib/d2/overlay2/a b/merged");
        assert_eq!(
            docker_overlay(spaced, mountinfo).expect("an overlay").upper,
            Path::new("/var/lib/d2/overlay2/a b/diff")
        );
        // Anything else (btrfs's subvolume, a plain directory) is its own layer.
        assert_eq!(docker_overlay(Path::new("/var/lib/sandpool/docker/btrfs/subvolumes/abc"), mountinfo), None);
    }

    #[test]
    fn ids_that_would_leave_the_roots_directory_are_refused() {
        assert!(valid_id("0123abcdef"));
        assert!(!valid_id("../etc"));
        assert!(!valid_id("a/b"));
        assert!(!valid_id(""));
    }

    #[test]
    fn a_bundle_without_the_marker_passes_through_untouched() {
        let dir = std::env::temp_dir().join(format!("sp-oci-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(dir.join("rootfs")).unwrap();
        let config = r#"{"root":{"path":"rootfs"}}"#;
        std::fs::write(dir.join("config.json"), config).unwrap();
        assert!(!prepare(&dir, "abc", &dir.join("roots")).unwrap());
        assert_eq!(std::fs::read_to_string(dir.join("config.json")).unwrap(), config);
        assert!(!dir.join("roots").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_marker_whose_image_is_not_mounted_is_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("sp-oci-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(dir.join("rootfs")).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"root":{"path":"rootfs"}}"#).unwrap();
        let marker = Marker { image: "127.0.0.1:5000/x@sha256:00".into(), lower: dir.join("not-mounted") };
        std::fs::create_dir_all(&marker.lower).unwrap();
        std::fs::write(dir.join("rootfs").join(MARKER), serde_json::to_vec(&marker).unwrap()).unwrap();
        let err = prepare(&dir, "abc", &dir.join("roots")).unwrap_err();
        assert!(format!("{err:#}").contains("is not mounted"), "{err:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! Test support: the registry's address, pushing a local image under a test's own prefix,
//! scratch directories and mounts that clean up after themselves.

use std::path::{Path, PathBuf};
use std::process::Command;

pub(crate) fn registry() -> String {
    let port = std::env::var("SANDPOOL_REGISTRY_PORT").unwrap_or_else(|_| "5000".into());
    format!("127.0.0.1:{port}")
}

/// A test's own repository prefix in the registry (registries cannot delete repositories
/// through the API, so prefixes keep runs apart).
pub(crate) fn prefix() -> String {
    format!("sptest-lazy-{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

pub(crate) fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().expect("run docker");
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A local image pushed to the registry under a new name; the local tag goes on drop.
pub(crate) struct Pushed {
    pub name: String,
}

impl Pushed {
    pub(crate) fn new(local: &str, name: String) -> Self {
        docker(&["tag", local, &name]);
        let pushed = Pushed { name };
        docker(&["push", "-q", &pushed.name]);
        pushed
    }
}

impl Drop for Pushed {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rmi", &self.name]).output();
    }
}

/// A scratch directory, removed on drop (after any mounts in it are gone).
pub(crate) struct TempDir(pub PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("sptest-lazy-{tag}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub(crate) fn sub(&self, name: &str) -> PathBuf {
        let dir = self.0.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A mount detached on drop (so a failing assertion does not leave it behind).
pub(crate) struct MountGuard(pub PathBuf);

impl MountGuard {
    pub(crate) fn overlay(lower: &Path, upper: &Path, work: &Path, merged: &Path) -> Self {
        let options = lazy_image::mount::overlay_options(lower, upper, work);
        let status = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o", &options])
            .arg(merged)
            .status()
            .expect("run mount");
        assert!(status.success(), "mount overlay {options}");
        MountGuard(merged.to_path_buf())
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(bytes))
}

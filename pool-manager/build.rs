//! Builds the in-sandbox agent (the `agent` crate's `sandpool-agent` binary) with cargo into a
//! static, stripped executable and copies it to `OUT_DIR`, where `src/agent_bin.rs` embeds it.
//! Static (glibc, `+crt-static`) so it runs as PID 1 of any image, `FROM scratch` included.
//!
//! The inner cargo gets a target directory of its own, `<workspace>/target/agent-build` (or
//! `$CARGO_TARGET_DIR/agent-build`, a relative one taken from the workspace root): the outer
//! build holds the lock on its own directory, and the agent then builds once for all the outer
//! build's profiles. The profile is the workspace's `agent` (release with `panic = "abort"`,
//! LTO, stripped symbols). Offline: every crate the agent uses is a dependency of this crate
//! too, so cargo has fetched it before running this script.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const PROFILE: &str = "agent";
const BIN: &str = "sandpool-agent";
const RUSTFLAGS: &str = "-Ctarget-feature=+crt-static";

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest_dir.parent().expect("pool-manager sits in the workspace").to_path_buf();
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join(BIN);
    let target = env::var("TARGET").expect("cargo sets TARGET");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());

    // A directory is scanned for changes to anything below it, new files included. The root
    // manifest holds the `agent` profile, the lock file the dependencies' versions.
    let inputs =
        ["agent/src", "agent/Cargo.toml", "agent-proto/src", "agent-proto/Cargo.toml", "Cargo.toml", "Cargo.lock"];
    for path in inputs {
        println!("cargo:rerun-if-changed={}", workspace.join(path).display());
    }
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");

    let target_dir = env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace.join("target"), |dir| workspace.join(PathBuf::from(dir)))
        .join("agent-build");

    let mut cmd = Command::new(&cargo);
    cmd.current_dir(&workspace)
        .args(["build", "--profile", PROFILE, "-p", "agent", "--bin", BIN, "--locked", "--offline"])
        .args(["--target", &target])
        .arg("--target-dir")
        .arg(&target_dir);
    // The outer build's settings are for the outer build: drop its flags, target directory,
    // profile overrides and clippy's wrapper. The jobserver (CARGO_MAKEFLAGS) is kept, so
    // both builds share the outer one's job slots.
    for (key, _) in env::vars_os() {
        if drops(&key) {
            cmd.env_remove(key);
        }
    }
    cmd.env("CARGO_ENCODED_RUSTFLAGS", RUSTFLAGS);
    // Cargo reads this script's stdout for instructions: the inner cargo's output goes to
    // stderr, which cargo shows when the build fails.
    cmd.stdout(stderr_stdio());
    let status = cmd.status().unwrap_or_else(|e| panic!("run {}: {e}", Path::new(&cargo).display()));
    assert!(status.success(), "building the static agent failed ({status}); cargo's output is above");

    let built = target_dir.join(&target).join(PROFILE).join(BIN);
    copy_if_changed(&built, &out).unwrap_or_else(|e| panic!("copy {} to {}: {e}", built.display(), out.display()));
}

/// Whether the inner cargo must not inherit environment variable `key`.
fn drops(key: &OsString) -> bool {
    let Some(key) = key.to_str() else { return false };
    match key {
        "CARGO_HOME" | "CARGO_MAKEFLAGS" => false,
        "RUSTFLAGS" | "RUSTC_WORKSPACE_WRAPPER" => true,
        _ => key.starts_with("CARGO_") || key.starts_with("__CARGO"),
    }
}

/// This script's stderr, for a child's stdout.
fn stderr_stdio() -> Stdio {
    match io::stderr().as_fd().try_clone_to_owned() {
        Ok(fd) => Stdio::from(fd),
        Err(_) => Stdio::null(),
    }
}

/// Copies `from` to `to` unless `to` already holds the same bytes, so an unchanged agent
/// leaves the embedding crate's inputs untouched.
fn copy_if_changed(from: &Path, to: &Path) -> io::Result<()> {
    if fs::read(to).is_ok_and(|old| fs::read(from).is_ok_and(|new| new == old)) {
        return Ok(());
    }
    fs::copy(from, to).map(drop)
}

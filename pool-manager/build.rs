//! Compiles the in-sandbox agent (`../agent/src/main.rs`, std only) with plain `rustc` into a
//! static, stripped executable in `OUT_DIR`, which `src/agent_bin.rs` embeds. Static (glibc,
//! `+crt-static`) so it runs as PID 1 of any image, `FROM scratch` included.

use std::env;
use std::fs;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let src = manifest_dir.join("../agent/src");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("sandpool-agent");

    // The directory itself catches added and removed modules.
    println!("cargo:rerun-if-changed={}", src.display());
    let mut files: Vec<PathBuf> = fs::read_dir(&src)
        .unwrap_or_else(|e| panic!("list {}: {e}", src.display()))
        .map(|entry| entry.expect("read agent/src entry").path())
        .collect();
    files.sort();
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }

    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let target = env::var("TARGET").expect("cargo sets TARGET");
    let status = Command::new(&rustc)
        .args(["--edition", "2024", "--crate-name", "sandpool_agent", "--crate-type", "bin"])
        .args(["--target", &target])
        .args(["-C", "opt-level=2", "-C", "codegen-units=1", "-C", "panic=abort"])
        .args(["-C", "target-feature=+crt-static", "-C", "strip=symbols"])
        .arg("-o")
        .arg(&out)
        .arg(src.join("main.rs"))
        .status()
        .unwrap_or_else(|e| panic!("run {}: {e}", rustc.to_string_lossy()));
    assert!(status.success(), "compiling the static agent failed ({status}); rustc's output is above");
}

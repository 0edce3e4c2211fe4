//! The Python function runtime's own tests (`sdk/runtime/python`, pytest): framing, handlers,
//! errors and the protocol edge cases, against the runtime run as a worker process. No stack:
//! the tests play the host themselves.

use std::path::Path;
use std::process::Command;

#[test]
fn the_python_runtime_passes_its_tests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("python3")
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "sdk/runtime/python"])
        .current_dir(&root)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("run python3 -m pytest");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "pytest failed:\n{text}");
    assert!(text.contains("passed") && !text.contains("skipped"), "{text}");
}

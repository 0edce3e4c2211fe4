//! The Python SDK's tests (`sdk/python/tests`, pytest) against `sandpool up` on a test stack.
//! `scripts/test` installs the SDK's test dependencies (httpx, websockets, pytest,
//! openapi-spec-validator) and builds the Debian image the rollout example runs on.

mod support;

use std::process::Command;

use support::Up;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_passes_its_tests_against_a_live_stack() {
    // `deb`: the Debian template (python3) for the rollout example, as realistic episodes run,
    // and for a server on a port (`python3 -m http.server`).
    let debian = r#"
[templates.deb]
image = "sandpool/debian:bookworm"
exec = "agent"
workdir = "/work"
cpus = 0.5
memory_mb = 256
pids = 1024
warm = 4
ports = [8000]
"#;
    let up = Up::start(|toml| toml + debian, |_| {}).await;
    up.create().await; // the pool is warm
    let sdk = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk/python");
    let mut pytest = Command::new("python3");
    pytest
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"])
        .current_dir(&sdk)
        .env("PYTHONPATH", &sdk)
        .env("SANDPOOL_TEMPLATE", "bb")
        .env("SANDPOOL_ROLLOUT_TEMPLATE", "deb");
    let (out, text) = up.run(pytest).await;
    assert!(out.status.success(), "pytest failed:\n{text}");
    assert!(text.contains("passed") && !text.contains("skipped"), "{text}");
}

//! The Python SDK's tests (`sdk/python/tests`, pytest) against `sandpool up` on a test stack,
//! with the SDK installed into a fresh virtual environment (`pip install './sdk/python[test]'`,
//! no PYTHONPATH: what a user's install gets is what is tested), and the wheel a release ships.
//! `scripts/test` makes sure `python3 -m venv` works and builds the Debian image the rollout
//! example runs on.

mod support;

use std::process::Command;

use support::{Up, run_ok, sdk_checkout};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_passes_its_tests_against_a_live_stack() {
    // `deb`: the Debian template (python3) for the rollout example, as realistic episodes run.
    let debian = r#"
[templates.deb]
image = "sandpool/debian:bookworm"
exec = "agent"
workdir = "/work"
cpus = 0.5
memory_mb = 256
pids = 1024
warm = 4
"#;
    // The venv first: the stack's token lives 10 minutes, and pip under load takes minutes.
    let tmp = std::env::temp_dir().join(format!("sdk-venv-{}", tests::rand_hex(8)));
    let _gone = RemoveOnDrop(tmp.clone());
    let dir = sdk_checkout(&tmp);
    let venv = tokio::task::spawn_blocking(move || venv_with(&dir, "./sdk/python[test]")).await.unwrap();
    let up = Up::start(|toml| toml + debian, |_| {}).await;
    up.create().await; // the pool is warm
    let tests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk/python/tests");
    let mut pytest = Command::new(venv.join("bin/python"));
    // From the tests' own directory: `python -m` puts the working directory first on the path,
    // and there no `sandpool` shadows the installed one.
    pytest
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "."])
        .current_dir(&tests)
        .env_remove("PYTHONPATH")
        .env("SANDPOOL_TEMPLATE", "bb")
        .env("SANDPOOL_ROLLOUT_TEMPLATE", "deb")
        .env("SANDPOOL_SDK_VENV", &venv);
    let (out, text) = up.run(pytest).await;
    assert!(out.status.success(), "pytest failed:\n{text}");
    assert!(text.contains("passed") && !text.contains("skipped"), "{text}");
    println!("{}", text.lines().last().unwrap_or_default()); // the count, with --success-output
}

/// A fresh virtual environment under `dir` with `spec` installed by pip.
fn venv_with(dir: &std::path::Path, spec: &str) -> std::path::PathBuf {
    let venv = dir.join("venv");
    run_ok(Command::new("python3").args(["-m", "venv"]).arg(&venv).env_remove("PYTHONPATH"));
    run_ok(
        Command::new(venv.join("bin/pip"))
            .args(["install", "-q", "--disable-pip-version-check", spec])
            .current_dir(dir)
            .env_remove("PYTHONPATH"),
    );
    venv
}

/// The wheel a release ships: built by pip from the package alone, named with the project's
/// version, with its license and readme in the metadata, and installable on its own.
#[test]
fn the_sdk_builds_a_wheel_that_installs_in_a_fresh_venv() {
    let tmp = std::env::temp_dir().join(format!("sdk-wheel-{}", tests::rand_hex(8)));
    let _gone = RemoveOnDrop(tmp.clone());
    let dir = sdk_checkout(&tmp);
    // Built as the README says, by a venv's pip (Debian's python3 has no pip of its own).
    let build = venv_with(&dir.join("build-env"), "pip");
    run_ok(
        Command::new(build.join("bin/pip"))
            .args(["wheel", "-q", "--disable-pip-version-check", "--no-deps", "-w", "dist", "./sdk/python"])
            .current_dir(&dir)
            .env_remove("PYTHONPATH"),
    );
    let version = env!("CARGO_PKG_VERSION");
    let wheel = dir.join(format!("dist/sandpool-{version}-py3-none-any.whl"));
    assert!(wheel.exists(), "no {}", wheel.display());
    let read = "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); print('\\n'.join(z.namelist())); \
                print(z.read(sys.argv[2]).decode())";
    let listing = run_ok(
        Command::new("python3").args(["-c", read]).arg(&wheel).arg(format!("sandpool-{version}.dist-info/METADATA")),
    );
    let (files, metadata) = listing.split_once("Metadata-Version").expect("the METADATA");
    for f in files.lines() {
        let ok = f.starts_with("sandpool/") || f.starts_with(&format!("sandpool-{version}.dist-info/"));
        assert!(ok, "the wheel ships the client only, not {f:?}");
    }
    assert!(files.contains("sandpool/py.typed") && files.contains("sandpool/_http.py"), "{files}");
    for want in [
        &format!("Version: {version}"),
        "License: Apache-2.0",
        "Requires-Dist: httpx",
        "Description-Content-Type: text/markdown",
        "# sandpool (Python client)",
    ] {
        assert!(metadata.contains(want), "no {want:?} in the METADATA:\n{metadata}");
    }
    let venv = venv_with(&tmp, wheel.to_str().unwrap());
    let out = run_ok(
        Command::new(venv.join("bin/python"))
            .args(["-c", "import sandpool; print(sandpool.__version__, sandpool.__file__)"])
            .current_dir(&tmp)
            .env_remove("PYTHONPATH"),
    );
    let (v, file) = out.trim().split_once(' ').expect("version and file");
    assert_eq!(v, version, "the SDK's version is the project's");
    assert!(file.starts_with(venv.to_str().unwrap()), "imported from the venv: {file}");
}

struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

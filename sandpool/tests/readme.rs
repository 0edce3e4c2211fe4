//! The README works as written: its curl episode and its Python install and quick start,
//! extracted from README.md and run verbatim against `sandpool up` (a `busybox` template, a `target/release/
//! sandpool` and `.sandpool-run/secrets` laid out as `scripts/up` leaves them).

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use support::{Up, sdk_checkout};

/// The first fenced block of `lang` after the heading `heading`.
fn block(readme: &str, heading: &str, lang: &str) -> String {
    let after = &readme[readme.find(heading).unwrap_or_else(|| panic!("README has {heading:?}"))..];
    let start = after.find(&format!("```{lang}\n")).expect("a code block") + lang.len() + 4;
    let len = after[start..].find("```").expect("the block ends");
    after[start..start + len].to_string()
}

/// A working directory laid out like a checkout after `scripts/up`.
fn checkout(up: &Up) -> PathBuf {
    let dir = up.config_path().parent().unwrap().join("checkout");
    std::fs::create_dir_all(dir.join("target/release")).unwrap();
    std::fs::create_dir_all(dir.join(".sandpool-run")).unwrap();
    let wrapper = dir.join("target/release/sandpool");
    let script = format!(
        "#!/bin/sh\nexec '{}' --config '{}' \"$@\"\n",
        env!("CARGO_BIN_EXE_sandpool"),
        up.config_path().display()
    );
    std::fs::write(&wrapper, script).unwrap();
    let mut perms = std::fs::metadata(&wrapper).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&wrapper, perms).unwrap();
    // The key `sandpool up` runs with (the test config's).
    std::fs::write(dir.join(".sandpool-run/secrets"), "SANDPOOL_JWT_KEY=test-jwt-key-0123456789abcdef\n").unwrap();
    dir
}

fn with_busybox(toml: String) -> String {
    format!(
        "{toml}\n[templates.busybox]\nimage = \"{}\"\nexec = \"agent\"\nworkdir = \"/work\"\nwarm = 2\n",
        tests::BUSYBOX_IMAGE
    )
}

fn readme() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_curl_episode_runs_as_written() {
    let up = Up::start(with_busybox, |_| {}).await;
    up.create().await; // the pools are warm
    let dir = checkout(&up);
    let script = block(&readme(), "## An episode with curl", "sh");
    let mut bash = Command::new("bash");
    bash.arg("-euo").arg("pipefail").arg("-c").arg(script).current_dir(&dir);
    let (out, text) = up.run(bash).await;
    assert!(out.status.success(), "the README's episode failed:\n{text}");
    for want in [r#""template":"busybox""#, r#""stdout":"hello\n""#, "the file came back whole"] {
        assert!(text.contains(want), "no {want:?} in:\n{text}");
    }
    assert!(!text.contains(r#""code""#), "an error answer:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_python_quick_start_runs_as_written() {
    let up = Up::start(with_busybox, |_| {}).await;
    up.create().await;
    let readme = readme();
    // Installed as the README says, into a fresh virtual environment of a checkout's copy:
    // nothing comes from the test's environment (no PYTHONPATH, no site packages).
    let dir = sdk_checkout(&up.config_path().parent().unwrap().join("checkout"));
    let mut install = Command::new("bash");
    install.args(["-euo", "pipefail", "-c", &block(&readme, "## From Python", "sh")]).current_dir(&dir);
    install.env_remove("PYTHONPATH").env_remove("VIRTUAL_ENV");
    let (out, text) = up.run(install).await;
    assert!(out.status.success(), "the README's install failed:\n{text}");
    let python = dir.join(".venv/bin/python");
    let mut which = Command::new(&python);
    which.args(["-c", "import sandpool; print(sandpool.__file__)"]).current_dir(&dir).env_remove("PYTHONPATH");
    let (_, text) = up.run(which).await;
    assert!(text.trim().starts_with(dir.join(".venv").to_str().unwrap()), "sandpool comes from the venv: {text}");

    let mut quick_start = Command::new(&python);
    quick_start.arg("-c").arg(block(&readme, "## From Python", "python")).current_dir(&dir).env_remove("PYTHONPATH");
    let (out, text) = up.run(quick_start).await;
    assert!(out.status.success(), "the README's quick start failed:\n{text}");
    for want in ["hello\nLinux", "3 4", "1\n\n2\n\n3", "/work/task\n1"] {
        assert!(text.contains(want), "no {want:?} in:\n{text}");
    }
}

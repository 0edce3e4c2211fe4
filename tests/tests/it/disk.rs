//! Disk bounds: a sandbox writes up to its template's `disk_mb` and no further, in both exec
//! modes, without touching another sandbox's room; what Docker keeps outside the writable
//! layer (`/etc/hosts` and friends) is read-only; a snapshot's sessions get the whole bound
//! again on top of what the snapshot holds.
//!
//! The stacks here say `docker.disk_bounds = "required"`: on a node whose Docker cannot bound
//! disks the pool-manager refuses to start, and the test fails with its message, which says
//! what to run (`SANDPOOL_DOCKER_SWITCH=1 scripts/up`). Never skipped.

use reqwest::Method;
use serde_json::{Value, json};
use tests::{BUSYBOX_IMAGE, Client, Stack, StackOpts};

const DISK_MB: u64 = 64;

async fn bounded_stack() -> Stack {
    let extra_toml = format!(
        r#"
[templates.small]
image = "{BUSYBOX_IMAGE}"
exec = "agent"
workdir = "/work"
memory_mb = 128
disk_mb = {DISK_MB}
[templates.smalld]
image = "{BUSYBOX_IMAGE}"
exec = "docker"
workdir = "/work"
memory_mb = 128
disk_mb = {DISK_MB}
[docker]
disk_bounds = "required"
"#
    );
    Stack::start(StackOpts { warm: 0, extra_toml, ..Default::default() }).await
}

/// Writes `mb` MiB of zeros to `path` in the session; the exec's answer.
async fn write(c: &Client, sid: &str, path: &str, mb: u64) -> Value {
    c.sh(sid, &format!("dd if=/dev/zero of={path} bs=1M count={mb} && sync")).await
}

/// The answer of a write that the bound stopped: the error a full disk gives (XFS project
/// quotas say "No space left on device", btrfs quotas "Disk quota exceeded").
fn assert_stopped_by_the_bound(r: &Value, what: &str) {
    let err = r["stderr"].as_str().unwrap_or_default();
    assert!(
        r["exit_code"].as_i64() != Some(0)
            && (err.contains("No space left on device") || err.contains("Disk quota exceeded")),
        "{what}: the write past disk_mb = {DISK_MB} was not stopped by the bound: {r}"
    );
}

fn assert_ok(r: &Value, what: &str) {
    assert_eq!(r["exit_code"].as_i64(), Some(0), "{what}: {r}");
}

async fn bounds_hold(template: &str) {
    let stack = bounded_stack().await;
    let c = stack.client("t");
    let sid = c.create(template).await["session_id"].as_str().unwrap().to_string();
    let other = c.create(template).await["session_id"].as_str().unwrap().to_string();

    // Under the bound: fine. Past it: the disk is full, for this sandbox only.
    assert_ok(&write(&c, &sid, "/work/under", 48).await, "48 MiB under a 64 MiB bound");
    assert_stopped_by_the_bound(&write(&c, &sid, "/work/over", 64).await, "48 + 64 MiB");
    assert_ok(&write(&c, &other, "/work/under", 48).await, "another sandbox keeps its own room");
    // The sandbox can still run commands and free its room (a plain exec needs no disk).
    assert_ok(&c.sh(&sid, "rm -f /work/over /work/under").await, "rm");
    assert_ok(&write(&c, &sid, "/work/again", 48).await, "the freed room is usable again");

    // Docker's network files live outside the writable layer: read-only, not a way around it.
    for f in ["/etc/hosts", "/etc/hostname", "/etc/resolv.conf"] {
        let r = c.sh(&sid, &format!("echo x >> {f}")).await;
        assert_ne!(r["exit_code"].as_i64(), Some(0), "{f} is writable: {r}");
    }
    let r = c.sh(&sid, "hostname; cat /etc/hostname; grep -c localhost /etc/hosts").await;
    assert_eq!(r["stdout"], "sandbox\nsandbox\n2\n", "{r}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_past_disk_mb_fail_in_the_sandbox_agent_mode() {
    bounds_hold("small").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_past_disk_mb_fail_in_the_sandbox_docker_exec_mode() {
    bounds_hold("smalld").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_keeps_its_files_and_its_sessions_get_the_whole_bound_again() {
    let stack = bounded_stack().await;
    // Snapshot images are not containers: remove them however the test ends.
    struct Images(String);
    impl Drop for Images {
        fn drop(&mut self) {
            let repo = format!("sandpool-snap/{}", self.0);
            if let Ok(out) = std::process::Command::new("docker").args(["images", "-q", &repo]).output() {
                for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = std::process::Command::new("docker").args(["rmi", "-f", id]).output();
                }
            }
        }
    }
    let _images = Images(stack.ledger_prefix().to_string());
    let c = stack.client("t");
    let sid = c.create("small").await["session_id"].as_str().unwrap().to_string();
    assert_ok(&write(&c, &sid, "/work/kept", 40).await, "40 MiB before the snapshot");
    let a = c.call(Method::POST, &format!("/v1/sessions/{sid}/snapshot"), None).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let template = a.body["template"].as_str().unwrap().to_string();

    let a = c.call(Method::POST, "/v1/sessions", Some(json!({ "template": template }))).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let kid = a.body["session_id"].as_str().unwrap().to_string();
    let r = c.sh(&kid, "wc -c < /work/kept").await;
    assert_eq!(r["stdout"].as_str().map(str::trim), Some("41943040"), "{r}");
    // The bound is on the sandbox's own writes: the snapshot's 40 MiB do not count.
    assert_ok(&write(&c, &kid, "/work/more", 48).await, "48 MiB on top of a 40 MiB snapshot");
    assert_stopped_by_the_bound(&write(&c, &kid, "/work/over", 64).await, "48 + 64 MiB on a snapshot");
    stack.shutdown().await;
}

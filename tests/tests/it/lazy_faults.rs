//! The registry of a lazy image going away mid-session (issue 32): a read of a part not yet
//! fetched fails with an I/O error inside the sandbox within the fetch bound, counted and
//! logged by the node's `sandpool-lazyd`; the node stays healthy (the same session's other
//! commands, other sessions, the daemon's answers, a restarted pool-manager opening new
//! sessions of the image); once the registry is back the same read succeeds with the right bytes.
//!
//! The test runs a registry and a `sandpool-lazyd` of its own (this tree's build, on a socket
//! and state directory of its own, a short fetch bound): the node's shared daemon may be
//! another build's, and the shared registry must not be killed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lazy_image::lazyd::{self, Request, Response};
use reqwest::Method;
use serde_json::json;
use tests::own_registry::OwnRegistry;
use tests::{Stack, StackOpts, rand_hex};

use crate::lazy::{DATA_BYTES, LazyFixture, install_lazy_binaries};

/// The daemon's bound on one chunk fetch (`--fetch-timeout-s`), retries included.
const FETCH_TIMEOUT_S: u64 = 3;
/// What a read against a gone registry may take beyond the fetch bound: the kernel's
/// read-ahead and retried page reads, the exec's round trips, a loaded machine.
const SLACK: Duration = Duration::from_secs(7);

/// A `sandpool-lazyd` of this test's own; stopped (SIGTERM: its mounts are detached) and its
/// state removed on drop, after the stack's containers are gone.
struct OwnLazyd {
    socket: PathBuf,
    dir: PathBuf,
    child: Option<Child>,
}

impl OwnLazyd {
    fn start() -> OwnLazyd {
        let dir = PathBuf::from(lazyd::DEFAULT_STATE_DIR).with_file_name(format!("lazy-test-{}", rand_hex(8)));
        std::fs::create_dir_all(&dir).expect("the daemon's state directory");
        let socket = dir.join("lazyd.sock");
        let exe = std::env::current_exe().expect("this test's path");
        let bin = exe.parent().and_then(Path::parent).expect("<target>/<profile>").join("sandpool-lazyd");
        let log = std::fs::File::create(dir.join("lazyd.log")).expect("the daemon's log");
        let child = Command::new(&bin)
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["--cache-mb", "256", "--fetch-timeout-s", &FETCH_TIMEOUT_S.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
        let daemon = OwnLazyd { socket, dir, child: Some(child) };
        let began = Instant::now();
        while std::os::unix::net::UnixStream::connect(&daemon.socket).is_err() {
            assert!(began.elapsed() < Duration::from_secs(10), "{} did not listen", bin.display());
            std::thread::sleep(Duration::from_millis(50));
        }
        daemon
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("lazyd.log")).unwrap_or_default()
    }
}

impl Drop for OwnLazyd {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").arg(child.id().to_string()).status();
            let began = Instant::now();
            while matches!(child.try_wait(), Ok(None)) && began.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        // Its mounts went with it (detached); what is left is plain files.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_gone_mid_session_fails_reads_with_eio_within_the_bound_and_the_node_stays_healthy() {
    install_lazy_binaries();
    // Dropped last: after the stack's containers (whose roots stand on its mounts).
    let daemon = &OwnLazyd::start();
    let scratch = std::env::temp_dir().join(format!("sptest-lazyfault-{}", rand_hex(8)));
    std::fs::create_dir_all(&scratch).expect("a scratch directory");
    struct Scratch(PathBuf);
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _scratch = Scratch(scratch.clone());
    let mut registry = OwnRegistry::start(&scratch).expect("a registry of the test's own");
    let image = LazyFixture::build_in(&registry.host, DATA_BYTES, &daemon.socket).await;
    // The node asks this test's daemon (running already, so the node starts none).
    let extra_toml = format!(
        "[templates.lazybase]\nimage = \"{}\"\nexec = \"agent\"\nworkdir = \"/work\"\nmemory_mb = 128\n\
         [images]\nbase = \"lazybase\"\nlazyd_socket = {:?}\nlazy_state_dir = {:?}\n",
        tests::BUSYBOX_IMAGE,
        daemon.socket,
        daemon.dir.join("state"),
    );
    let mut stack = Stack::start(StackOpts { warm: 1, extra_toml, ..Default::default() }).await;
    let c = stack.client("acme");
    let t = c.call(Method::POST, "/v1/templates", Some(json!({"name": "lazy", "image": image.lazy}))).await;
    assert_eq!(t.status, 201, "{:?}", t.body);
    let opened = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "acme/lazy", "max_wait_s": 60}))).await;
    assert_eq!(opened.status, 201, "{:?}", opened.body);
    let sid = opened.body["session_id"].as_str().expect("a session id").to_string();

    // A part read while the registry is there.
    let head = c.sh(&sid, "head -c 1048576 /data.bin | wc -c").await;
    assert_eq!(head["stdout"].as_str().map(str::trim), Some("1048576"), "{head:?}");
    assert_eq!(image.mount_info().await.fetch_errors, 0);

    // The registry goes away; a part never read fails with an I/O error, within the bound.
    registry.kill();
    let began = Instant::now();
    let gone = c.exec(&sid, json!({"cmd": "tail -c 8388608 /data.bin | wc -c", "timeout_ms": 60_000})).await;
    let took = began.elapsed();
    eprintln!("a read with the registry gone answered after {took:?}: {:?}", gone.body["stderr"]);
    assert_eq!(gone.status, 200, "an answered call: {:?}", gone.body);
    let stderr = gone.body["stderr"].as_str().unwrap_or_default();
    assert!(
        stderr.contains("I/O error") || stderr.contains("Input/output error"),
        "the reader sees EIO: {:?}",
        gone.body
    );
    assert_ne!(gone.body["stdout"].as_str().map(str::trim), Some("8388608"), "{:?}", gone.body);
    let bound = Duration::from_secs(FETCH_TIMEOUT_S) + SLACK;
    assert!(took < bound, "the read failed after {took:?}, past {bound:?}");
    let info = image.mount_info().await;
    assert!(info.fetch_errors > 0, "failed fetches are counted: {info:?}");
    assert!(daemon.log().contains("lazy image registry unreachable"), "the daemon says why: {}", daemon.log());

    // The node stays healthy: the same session answers, the daemon answers at once, a session
    // of a Docker template opens and answers.
    let alive = c.sh(&sid, "echo alive").await;
    assert_eq!(alive["stdout"], "alive\n", "{alive:?}");
    let began = Instant::now();
    let stats = lazyd::call_within(&daemon.socket, &Request::Stats, Duration::from_secs(5)).await;
    assert!(matches!(stats, Ok(Response::Stats { .. })), "{stats:?}");
    assert!(began.elapsed() < Duration::from_secs(1), "stats took {:?}", began.elapsed());
    let plain = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb", "max_wait_s": 60}))).await;
    assert_eq!(plain.status, 201, "{:?}", plain.body);
    let plain_sid = plain.body["session_id"].as_str().expect("a session id");
    assert_eq!(c.sh(plain_sid, "echo plain").await["stdout"], "plain\n");

    // A pool-manager restarted with the registry still gone finds the image through the
    // node's daemon (it is mounted there) and opens new sessions of it; the first one answers.
    stack.restart_pool_manager().await;
    let fresh = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "acme/lazy", "max_wait_s": 60}))).await;
    assert_eq!(fresh.status, 201, "a lazy session after a restart with the registry gone: {:?}", fresh.body);
    let fresh_sid = fresh.body["session_id"].as_str().expect("a session id");
    assert_eq!(
        c.sh(fresh_sid, "head -c 1048576 /data.bin | wc -c").await["stdout"].as_str().map(str::trim),
        Some("1048576")
    );

    // The registry is back on the same port: the same read works, and the bytes are right.
    registry.resume().expect("the registry starts again");
    let back = c.exec(&sid, json!({"cmd": "sha256sum /data.bin", "timeout_ms": 60_000})).await;
    assert_eq!(back.status, 200, "{:?}", back.body);
    assert_eq!(back.body["stdout"], format!("{}  /data.bin\n", image.data_sha256), "{:?}", back.body);
    assert!(daemon.log().contains("lazy image registry answers again"), "{}", daemon.log());

    assert_eq!(c.delete(fresh_sid).await, 204);
    assert_eq!(c.delete(plain_sid).await, 204);
    assert_eq!(c.delete(&sid).await, 204);
    stack.shutdown().await;
}

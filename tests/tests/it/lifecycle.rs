//! Session and sandbox lifecycles: warm and cold starts, refill, expiry, deletion, restarts
//! of the node agent, and concurrent checkouts.

use std::collections::HashSet;
use std::time::Duration;

use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts, eventually};

use crate::FILL;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_then_cold_and_the_pool_refills() {
    let stack = Stack::start(StackOpts { warm: 2, ..Default::default() }).await;
    stack.wait_idle("bb", 2, FILL).await;
    let c = stack.client("t");
    let a = c.create("bb").await;
    let b = c.create("bb").await;
    assert_eq!((a["start"].as_str(), b["start"].as_str()), (Some("warm"), Some("warm")));
    assert!(a["wait_ms"].as_f64().unwrap() < 1000.0);
    assert_ne!(a["sandbox_id"], b["sandbox_id"]);
    assert_eq!(a["node"].as_str().unwrap(), stack.node.id);
    assert!(a["sandbox_id"].as_str().unwrap().starts_with(&format!("{}.", stack.node.id)));
    // The pool is refilled behind the checkouts.
    stack.wait_idle("bb", 2, FILL).await;
    // A template with no warm pool starts cold, and works the same.
    let d = c.create("bbd").await;
    assert_eq!(d["start"], "cold");
    let sid = d["session_id"].as_str().unwrap();
    assert_eq!(c.sh(sid, "echo cold").await["stdout"], "cold\n");
    let got = c.call(Method::GET, &format!("/v1/sessions/{sid}"), None).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.body["template"], "bbd");
    assert!(got.body["expires_at"].as_str().unwrap().ends_with('Z'));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_and_expiry_remove_the_sandbox() {
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let c = stack.client("t");
    let kept = c.create("bb").await;
    let doomed = c.create("bb").await;
    let short = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb", "idle_timeout_s": 1}))).await;
    assert_eq!(short.status, 201, "{:?}", short.body);
    assert_eq!(stack.containers().len(), 3);

    assert_eq!(c.delete(doomed["session_id"].as_str().unwrap()).await, 204);
    assert_eq!(c.delete(doomed["session_id"].as_str().unwrap()).await, 404);
    // Keepalive holds the kept one; the short one idles out and is reaped.
    let short_id = short.body["session_id"].as_str().unwrap().to_string();
    let kept_id = kept["session_id"].as_str().unwrap().to_string();
    let gone = eventually(Duration::from_secs(20), || async {
        let k = c.call(Method::POST, &format!("/v1/sessions/{kept_id}/keepalive"), None).await;
        assert_eq!(k.status, 200, "{:?}", k.body);
        (stack.containers().len() == 1).then_some(())
    })
    .await;
    assert!(gone.is_some(), "expired and deleted sandboxes were not removed: {:?}", stack.containers());
    let a = c.exec(&short_id, json!({"cmd": "true"})).await;
    assert_eq!((a.status, a.body["code"].as_str()), (404, Some("session_gone")), "{:?}", a.body);
    assert!(a.body["message"].as_str().unwrap().contains("idle"), "{:?}", a.body);
    assert_eq!(c.sh(&kept_id, "echo alive").await["stdout"], "alive\n");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_manager_restart_keeps_leases_and_leaves_no_orphans() {
    let mut stack = Stack::start(StackOpts { warm: 2, ..Default::default() }).await;
    stack.wait_idle("bb", 2, FILL).await;
    let c = stack.client("t");
    let s = c.create("bb").await;
    let sid = s["session_id"].as_str().unwrap().to_string();
    c.sh(&sid, "echo before > /work/mark").await;
    // A container with our labels that the ledger never heard of: an orphan of a crash.
    let orphan = std::process::Command::new("docker")
        .args([
            "run",
            "-d",
            "--network",
            "none",
            "--label",
            "sandpool.managed=true",
            "--label",
            &format!("sandpool.prefix={}", stack.ledger_prefix()),
            "--label",
            &format!("sandpool.node={}", stack.node.id),
            "--label",
            &format!("sandpool.sandbox={}.deadbeef0000", stack.node.id),
            tests::BUSYBOX_IMAGE,
            "sleep",
            "600",
        ])
        .output()
        .unwrap();
    assert!(orphan.status.success(), "{orphan:?}");
    let orphan_id = String::from_utf8_lossy(&orphan.stdout).trim().to_string();

    // The agent's channel is its own socket, which the sandbox's user cannot reach.
    let sandbox = c.call(Method::GET, &format!("/v1/sessions/{sid}"), None).await.body["sandbox_id"]
        .as_str()
        .unwrap()
        .to_string();
    let direct = |stack: &Stack| stack.node.sandbox(&sandbox).and_then(|s| s.agent.as_ref().map(|a| a.is_direct()));
    assert_eq!(direct(&stack), Some(true), "the sandbox's channel is Docker's attach stream");
    let probe = c.sh(&sid, "ls /.sandpool/run 2>&1; echo rc=$?").await["stdout"].as_str().unwrap().to_string();
    assert!(probe.contains("Permission denied") && probe.contains("rc=1"), "the user reaches the socket: {probe}");

    stack.restart_pool_manager().await;
    assert_eq!(direct(&stack), Some(true), "reattached over Docker's attach stream");

    // Removed in the background, after the live sandboxes were reattached.
    let gone = eventually(Duration::from_secs(15), || async {
        (!stack.containers().iter().any(|c| c.starts_with(&orphan_id[..12]))).then_some(())
    })
    .await;
    assert!(gone.is_some(), "orphan survived reconcile");
    // The lease survived, state and all, and new sessions work too.
    assert_eq!(c.sh(&sid, "cat /work/mark").await["stdout"], "before\n");
    let fresh = c.create("bb").await;
    assert_eq!(c.sh(fresh["session_id"].as_str().unwrap(), "echo ok").await["stdout"], "ok\n");
    stack.wait_idle("bb", 2, FILL).await;
    // Settles at exactly 2 leased + 2 idle, nothing else (a refill may briefly overlap).
    let settled = eventually(Duration::from_secs(15), || async { (stack.containers().len() == 4).then_some(()) }).await;
    assert!(settled.is_some(), "{:?}", stack.containers());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_never_share_a_sandbox() {
    let stack =
        Stack::start(StackOpts { warm: 50, max_creates_in_flight: 8, default_wait: "1s", ..Default::default() }).await;
    stack.wait_idle("bb", 50, Duration::from_secs(180)).await;
    let c = stack.client("t");
    let calls: Vec<_> = (0..200)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move { c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await })
        })
        .collect();
    let mut sandboxes = HashSet::new();
    let (mut warm, mut refused) = (0, 0);
    for call in calls {
        let a = call.await.unwrap();
        match a.status {
            201 => {
                assert!(sandboxes.insert(a.body["sandbox_id"].as_str().unwrap().to_string()), "sandbox granted twice");
                warm += (a.body["start"] == "warm") as usize;
            }
            503 => {
                assert!(a.headers.contains_key("retry-after"), "503 without Retry-After");
                refused += 1;
            }
            s => panic!("unexpected {s}: {:?}", a.body),
        }
    }
    assert!(warm >= 50, "only {warm} warm grants from a pool of 50");
    assert_eq!(sandboxes.len() + refused, 200);
    stack.shutdown().await;
}

/// The process that started `pid` (its `PPid`), and that parent's name.
/// Issue 34: a node's sandboxes share containerd shims (`[docker] shim_group`, sandpool-shim
/// installed by `scripts/lib.sh`), their commands never see the group's variable, and a
/// group's shim goes with its last sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_sandboxes_share_a_containerd_shim_that_goes_with_the_last_of_them() {
    // No warm pool: the creates below are made one at a time, so they go to one group
    // (creates in flight at once are spread over groups).
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let c = stack.client("t");
    let mut shims = HashSet::new();
    let mut sessions = vec![];
    for _ in 0..3 {
        let s = c.create("bb").await;
        let (shim, name) = tests::shim_of(s["sandbox_id"].as_str().unwrap());
        assert_eq!(name, "containerd-shim", "the agent's parent is {shim} ({name})");
        shims.insert(shim);
        sessions.push(s["session_id"].as_str().unwrap().to_string());
    }
    assert_eq!(
        shims.len(),
        1,
        "three sandboxes of one node run under {shims:?}: is sandpool-shim installed (scripts/lib.sh ensure_shim_groups) \
         and was dockerd started after it, with it first on its PATH?"
    );
    let env = c.sh(&sessions[0], "env").await;
    assert_eq!(env["exit_code"], 0, "{env:?}");
    assert!(!env["stdout"].as_str().unwrap().contains("SANDPOOL_SHIM_GROUP"), "{env:?}");
    // Sandboxes go and come through the same group: every one still works.
    assert_eq!(c.delete(&sessions[0]).await, 204);
    let s = c.create("bb").await;
    assert_eq!(c.sh(s["session_id"].as_str().unwrap(), "echo ok").await["stdout"], "ok\n");
    for s in &sessions[1..] {
        assert_eq!(c.delete(s).await, 204);
    }
    assert_eq!(c.sh(s["session_id"].as_str().unwrap(), "echo still").await["stdout"], "still\n");
    // The group's shim ends once the last of its sandboxes is removed.
    let shim = *shims.iter().next().unwrap();
    drop(stack);
    let gone = eventually(Duration::from_secs(60), || async {
        // Gone, or a zombie its new parent has not reaped yet.
        let stat = std::fs::read_to_string(format!("/proc/{shim}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next());
        matches!(state, None | Some(Some('Z'))).then_some(())
    })
    .await;
    assert!(gone.is_some(), "the shared shim {shim} outlived its sandboxes");
}

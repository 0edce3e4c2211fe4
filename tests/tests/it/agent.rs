//! The in-sandbox agent path under stress: concurrency, big streams, a dying agent, fencing.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts, eventually};

use crate::FILL;

async fn leased(stack: &Stack) -> (tests::Client, String, String) {
    stack.wait_idle("bb", 1, FILL).await;
    let c = stack.client("t");
    let s = c.create("bb").await;
    (c, s["session_id"].as_str().unwrap().to_string(), s["sandbox_id"].as_str().unwrap().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_execs_and_big_streams_in_one_sandbox() {
    let stack = Stack::start(StackOpts { warm: 1, max_body_bytes: 32 << 20, ..Default::default() }).await;
    let (c, sid, _) = leased(&stack).await;
    let calls: Vec<_> = (0..64)
        .map(|i| {
            let c = c.clone();
            let sid = sid.clone();
            tokio::spawn(async move {
                let r = c.exec(&sid, json!({"cmd": format!("sleep 0.2; echo {i}"), "stdin": "x"})).await;
                (i, r)
            })
        })
        .collect();
    for call in calls {
        let (i, r) = call.await.unwrap();
        assert_eq!(r.status, 200, "{i}: {:?}", r.body);
        assert_eq!(r.body["stdout"], format!("{i}\n"), "{i}: {:?}", r.body);
    }
    // 100 MiB to stdout: capped at 1 MiB, flagged, and the command is not blocked.
    let t0 = Instant::now();
    let r = c.sh(&sid, "head -c 104857600 /dev/zero; echo end >&2").await;
    assert_eq!((r["stdout_truncated"].as_bool(), r["stdout"].as_str().map(str::len)), (Some(true), Some(1 << 20)));
    assert_eq!(r["stderr"], "end\n");
    assert!(t0.elapsed() < Duration::from_secs(60), "100 MiB took {:?}", t0.elapsed());
    // 10 MiB of stdin arrives whole.
    let stdin = "y".repeat(10 << 20);
    let r = c.exec(&sid, json!({"cmd": ["wc", "-c"], "stdin": stdin})).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["stdout"].as_str().unwrap().trim(), (10 << 20).to_string());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_agent_fails_its_sandbox_cleanly_and_is_replaced() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let (c, sid, sandbox) = leased(&stack).await;
    assert_eq!(c.sh(&sid, "echo up").await["stdout"], "up\n");
    let filter = format!("label=sandpool.sandbox={sandbox}");
    let out = std::process::Command::new("docker").args(["ps", "-q", "--filter", &filter]).output().unwrap();
    let container = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let pid =
        std::process::Command::new("docker").args(["inspect", "-f", "{{.State.Pid}}", &container]).output().unwrap();
    let pid = String::from_utf8_lossy(&pid.stdout).trim().to_string();
    assert!(std::process::Command::new("kill").args(["-9", &pid]).status().unwrap().success());

    let r = c.exec(&sid, json!({"cmd": "true"})).await;
    assert_eq!(r.status, 502, "{:?}", r.body);
    assert!(r.body["message"].as_str().unwrap().contains("sandbox"), "{:?}", r.body);
    // The failed sandbox is removed and the pool refilled with a working one.
    let gone = eventually(Duration::from_secs(30), || async {
        (!stack.containers().iter().any(|c| container.starts_with(c.as_str()) || c.starts_with(&container)))
            .then_some(())
    })
    .await;
    assert!(gone.is_some(), "failed sandbox's container was not removed");
    stack.wait_idle("bb", 1, FILL).await;
    let fresh = c.create("bb").await;
    assert_ne!(fresh["sandbox_id"].as_str().unwrap(), sandbox);
    assert_eq!(c.sh(fresh["session_id"].as_str().unwrap(), "echo ok").await["stdout"], "ok\n");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_fencing_token_is_refused() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let (c, sid, sandbox) = leased(&stack).await;
    c.sh(&sid, "true").await;
    let fence = stack.node.sandbox(&sandbox).unwrap().max_fence.load(std::sync::atomic::Ordering::Acquire);
    assert!(fence > 0);
    let internal = |fence: u64| {
        let http = stack.http.clone();
        let url = format!("{}/internal/v1/sandboxes/{sandbox}/exec", stack.node.config.pool_manager.advertise);
        let secret = stack.config.pool_manager.secret.clone();
        async move {
            http.post(url)
                .header(wire::internal::SECRET_HEADER, secret)
                .header(wire::internal::FENCE_HEADER, fence)
                .json(&json!({"cmd": ["true"]}))
                .send()
                .await
                .unwrap()
        }
    };
    // A newer lease holder acts; the older one is refused from then on.
    assert_eq!(internal(fence + 1).await.status(), 200);
    let r = internal(fence).await;
    assert_eq!(r.status(), 409);
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["code"], "stale_fence");
    // Without the secret the internal API answers nothing useful.
    let r = stack
        .http
        .post(format!("{}/internal/v1/sandboxes/{sandbox}/exec", stack.node.config.pool_manager.advertise))
        .json(&json!({"cmd": ["true"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let _ = c.call(Method::GET, "/v1/templates", None).await;
    stack.shutdown().await;
}

//! Pause and resume: one session, a whole job by label, transparent resume, idle clock.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts};

use crate::FILL;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_job_pauses_by_label_and_resumes_transparently() {
    let stack = Stack::start(StackOpts { warm: 20, max_creates_in_flight: 8, ..Default::default() }).await;
    stack.wait_idle("bb", 20, Duration::from_secs(120)).await;
    let c = stack.client("t");
    let mut job = Vec::new();
    for i in 0..20 {
        let body = json!({"template": "bb", "labels": {"job": "ppo", "rank": i.to_string()}});
        let a = c.call(Method::POST, "/v1/sessions", Some(body)).await;
        assert_eq!(a.status, 201, "{:?}", a.body);
        job.push((
            a.body["session_id"].as_str().unwrap().to_string(),
            a.body["sandbox_id"].as_str().unwrap().to_string(),
        ));
    }
    stack.wait_idle("bb", 1, FILL).await;
    let other = c.create("bb").await;
    for (sid, _) in &job[..2] {
        c.sh(sid, "echo state > /work/s; sleep 1000 >/dev/null 2>&1 &").await;
    }
    // One of the job's sessions has a 2 s idle timeout; it is paused the moment it exists.
    let short = json!({"template": "bb", "labels": {"job": "ppo", "rank": "short"}, "idle_timeout_s": 2});
    let short = c.call(Method::POST, "/v1/sessions", Some(short)).await;
    assert_eq!(short.status, 201, "{:?}", short.body);
    let short = short.body["session_id"].as_str().unwrap().to_string();
    let a = c.call(Method::POST, &format!("/v1/sessions/{short}/pause"), None).await;
    assert_eq!((a.status, a.body["paused"].as_bool()), (200, Some(true)), "{:?}", a.body);
    // The rest of the job by label (the short one is paused already, so not counted again).
    let a = c.call(Method::POST, "/v1/sessions:pause", Some(json!({"labels": {"job": "ppo"}}))).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.body["session_ids"].as_array().unwrap().len(), 20);
    for (sid, sb) in &job {
        assert_eq!(tests::container_state(sb), "paused", "{sid}");
    }
    // Sessions outside the selector run on.
    assert_eq!(c.sh(other["session_id"].as_str().unwrap(), "echo free").await["stdout"], "free\n");
    let got = c.call(Method::GET, &format!("/v1/sessions/{}", job[0].0), None).await;
    assert_eq!(got.body["paused"], true);
    // Paused longer than its idle timeout: not reaped.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(c.sh(&short, "echo kept").await["stdout"], "kept\n");
    // The next call resumes transparently, with state and processes intact.
    let r = c.sh(&job[0].0, "cat /work/s; ps -o args | grep -c '^sleep 1000'").await;
    assert_eq!(r["stdout"], "state\n1\n");
    assert_eq!(tests::container_state(&job[0].1), "running");
    // Resume the rest of the job by label.
    let a = c.call(Method::POST, "/v1/sessions:resume", Some(json!({"labels": {"job": "ppo"}}))).await;
    assert_eq!(a.body["session_ids"].as_array().unwrap().len(), 19, "{:?}", a.body);
    assert_eq!(tests::container_state(&job[19].1), "running");
    // Single-session pause and resume.
    let a = c.call(Method::POST, &format!("/v1/sessions/{}/pause", job[1].0), None).await;
    assert_eq!((a.status, a.body["paused"].as_bool()), (200, Some(true)));
    let a = c.call(Method::POST, &format!("/v1/sessions/{}/resume", job[1].0), None).await;
    assert_eq!((a.status, a.body["paused"].as_bool()), (200, Some(false)));
    let a = c.call(Method::POST, "/v1/sessions:pause", Some(json!({"labels": {}}))).await;
    assert_eq!(a.status, 400);
    stack.shutdown().await;
}

/// A sandbox frozen while the ledger says it runs (its pause was never recorded: the Redis
/// master went away between the two, as a fault run found) is thawed by its node on the next
/// call, which answers at once instead of waiting out its deadline on a frozen agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_frozen_behind_the_ledgers_back_is_thawed_by_its_next_call() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    stack.wait_idle("bb", 1, FILL).await;
    let c = stack.client("t");
    let s = c.create("bb").await;
    let (sid, sandbox) = (s["session_id"].as_str().unwrap(), s["sandbox_id"].as_str().unwrap());
    c.sh(sid, "echo state > /work/s").await;
    // The node freezes the sandbox, as the gateway asks before it records a pause; the ledger
    // is never told.
    let freeze = || async {
        let fence = stack.node.sandbox(sandbox).unwrap().max_fence.load(std::sync::atomic::Ordering::Acquire);
        let url = format!("{}/internal/v1/sandboxes/{sandbox}/pause", stack.node.config.pool_manager.advertise);
        let r = stack
            .http
            .post(url)
            .header(wire::internal::SECRET_HEADER, stack.config.pool_manager.secret.clone())
            .header(wire::internal::FENCE_HEADER, fence)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204);
        assert_eq!(tests::container_state(sandbox), "paused");
    };
    freeze().await;
    let got = c.call(Method::GET, &format!("/v1/sessions/{sid}"), None).await;
    assert_eq!(got.body["paused"], false, "the ledger thinks it runs");
    // An exec answers, with the state intact, well inside its own timeout.
    let t = Instant::now();
    let r = c.exec(sid, json!({"cmd": "cat /work/s", "timeout_ms": 30_000})).await;
    assert_eq!((r.status, r.body["stdout"].as_str()), (200, Some("state\n")), "{:?}", r.body);
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    assert_eq!(tests::container_state(sandbox), "running");
    // So do file calls (an upload into a frozen agent would fill its pipe and stall).
    freeze().await;
    let t = Instant::now();
    let data: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(c.put_file(sid, "/work/big.bin", data.clone()).await, 204);
    assert_eq!(c.get_file(sid, "/work/big.bin").await, (200, data));
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    assert_eq!(tests::container_state(sandbox), "running");
    stack.shutdown().await;
}

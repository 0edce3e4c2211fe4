//! Pause and resume: one session, a whole job by label, transparent resume, idle clock.

use std::time::Duration;

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

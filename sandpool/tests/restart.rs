//! `sandpool up` killed with SIGKILL and started again: what was live stays live. Idle, leased
//! and paused sandboxes are kept (a paused one stays paused until its next call), and a
//! reattached agent channel never hands a new request the frames of a command started before
//! the crash.

mod support;

use std::time::Duration;

use reqwest::Method;
use serde_json::json;
use support::Up;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_and_restart_keeps_live_and_paused_sessions_and_their_channels_apart() {
    let mut up = Up::start(|toml| toml, |_| {}).await;
    let c = up.client();
    let (_, busy) = up.create().await;
    let (_, frozen) = up.create().await;
    let busy_id = busy["session_id"].as_str().unwrap().to_string();
    let frozen_id = frozen["session_id"].as_str().unwrap().to_string();
    c.sh(&busy_id, "echo before > /work/mark").await;
    c.sh(&frozen_id, "echo cold > /work/mark").await;
    let a = c.call(Method::POST, &format!("/v1/sessions/{frozen_id}/pause"), None).await;
    assert_eq!((a.status, &a.body["paused"]), (200, &json!(true)), "{:?}", a.body);
    // A command that keeps printing across the crash: its frames keep coming to whoever
    // attaches next, under the request id the old process gave it.
    let ticking = {
        let (http, url, token) = (up.http.clone(), format!("{}/v1/sessions/{busy_id}/exec", up.url), up.token.clone());
        tokio::spawn(async move {
            let cmd = json!({"cmd": "while :; do echo tick; sleep 0.02; done", "timeout_ms": 30000});
            let _ = http.post(url).bearer_auth(token).json(&cmd).send().await;
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;

    up.crash_and_restart().await;
    ticking.abort();

    // The paused session is still paused, in Docker too, and resumes on its next call.
    let a = c.call(Method::GET, &format!("/v1/sessions/{frozen_id}"), None).await;
    assert_eq!((a.status, &a.body["paused"]), (200, &json!(true)), "{:?}", a.body);
    assert_eq!(tests::container_state(frozen["sandbox_id"].as_str().unwrap()), "paused");
    assert_eq!(c.sh(&frozen_id, "cat /work/mark").await["stdout"], "cold\n");
    // New requests on the reattached channel get their own output only.
    for i in 0..40 {
        let r = c.sh(&busy_id, &format!("echo new-{i}")).await;
        assert_eq!(r["stdout"], format!("new-{i}\n"), "request {i} got another request's output: {r}");
    }
    assert_eq!(c.sh(&busy_id, "cat /work/mark").await["stdout"], "before\n");
    for sid in [&busy_id, &frozen_id] {
        assert_eq!(c.delete(sid).await, 204);
    }
}

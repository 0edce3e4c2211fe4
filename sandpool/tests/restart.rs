//! `sandpool up` killed with SIGKILL and started again: what was live stays live. Idle, leased
//! and paused sandboxes are kept (a paused one stays paused until its next call), and a
//! reattached agent channel never hands a new request the frames of a command started before
//! the crash.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::Up;

async fn call(up: &Up, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
    let mut req = up.http.request(method, format!("{}{path}", up.url)).bearer_auth(&up.token);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.expect("call the gateway");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn sh(up: &Up, sid: &str, cmd: &str) -> Value {
    let (s, body) =
        call(up, reqwest::Method::POST, &format!("/v1/sessions/{sid}/exec"), Some(json!({"cmd": cmd}))).await;
    assert_eq!(s, 200, "{body}");
    body
}

fn container_state(up: &Up, sandbox: &str) -> String {
    let out = std::process::Command::new("docker")
        .args(["ps", "-a", "--filter", &format!("label=sandpool.sandbox={sandbox}"), "--format", "{{.State}}"])
        .output()
        .unwrap();
    let _ = up;
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_and_restart_keeps_live_and_paused_sessions_and_their_channels_apart() {
    let mut up = Up::start(|toml| toml, |_| {}).await;
    let (_, busy) = up.create().await;
    let (_, frozen) = up.create().await;
    let busy_id = busy["session_id"].as_str().unwrap().to_string();
    let frozen_id = frozen["session_id"].as_str().unwrap().to_string();
    sh(&up, &busy_id, "echo before > /work/mark").await;
    sh(&up, &frozen_id, "echo cold > /work/mark").await;
    let (s, body) = call(&up, reqwest::Method::POST, &format!("/v1/sessions/{frozen_id}/pause"), None).await;
    assert_eq!((s, &body["paused"]), (200, &json!(true)), "{body}");
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
    let (s, body) = call(&up, reqwest::Method::GET, &format!("/v1/sessions/{frozen_id}"), None).await;
    assert_eq!((s, &body["paused"]), (200, &json!(true)), "{body}");
    assert_eq!(container_state(&up, frozen["sandbox_id"].as_str().unwrap()), "paused");
    assert_eq!(sh(&up, &frozen_id, "cat /work/mark").await["stdout"], "cold\n");
    // New requests on the reattached channel get their own output only.
    for i in 0..40 {
        let r = sh(&up, &busy_id, &format!("echo new-{i}")).await;
        assert_eq!(r["stdout"], format!("new-{i}\n"), "request {i} got another request's output: {r}");
    }
    assert_eq!(sh(&up, &busy_id, "cat /work/mark").await["stdout"], "before\n");
    for sid in [&busy_id, &frozen_id] {
        let (s, _) = call(&up, reqwest::Method::DELETE, &format!("/v1/sessions/{sid}"), None).await;
        assert_eq!(s, 204);
    }
}

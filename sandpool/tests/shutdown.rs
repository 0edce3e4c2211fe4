//! The `sandpool up` binary shuts down in order on SIGTERM: readiness fails first, an exec in
//! flight completes, and the process exits cleanly. Real Redis and Docker.

use std::time::{Duration, Instant};

use serde_json::json;
use tests::eventually;

mod support;
use support::Up;

#[tokio::test]
async fn sigterm_drains_the_gateway_before_the_pool_manager_stops() {
    let mut up =
        Up::start(|toml| toml.replace("default_wait = ", "drain_grace = \"500ms\"\ndefault_wait = "), |_| {}).await;
    let sid = up.create().await.1["session_id"].as_str().unwrap().to_string();

    // An exec that is still running when SIGTERM arrives.
    let exec = tokio::spawn({
        let (http, url, token) = (up.http.clone(), up.url.clone(), up.token.clone());
        async move {
            let r = http
                .post(format!("{url}/v1/sessions/{sid}/exec"))
                .bearer_auth(&token)
                .json(&json!({"cmd": "sleep 3; echo survived"}))
                .send()
                .await
                .expect("the in-flight exec gets an answer");
            (r.status().as_u16(), r.json::<serde_json::Value>().await.unwrap_or_default())
        }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    let sent = Instant::now();
    up.sigterm();

    // Readiness fails first, while the listener still answers (drain_grace).
    let not_ready =
        eventually(Duration::from_millis(400), || async { (up.ready().await == Some(503)).then_some(()) }).await;
    assert!(not_ready.is_some(), "readyz answers 503 during the drain grace");

    let (status, body) = exec.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["stdout"], "survived\n", "{body}");
    assert!(sent.elapsed() >= Duration::from_secs(1), "the exec really was in flight");

    let status = up.wait_exit(Duration::from_secs(30)).await;
    assert!(status.success(), "exit status {status}");
}

//! The `sandpool up` binary shuts down in order on SIGTERM: readiness fails first, an exec in
//! flight completes, and the process exits cleanly. Real Redis and Docker.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use tests::{Cleanup, StackOpts, config_for, config_toml, eventually, rand_hex};

mod support;
use support::{Proc, free_port};

#[tokio::test]
async fn sigterm_drains_the_gateway_before_the_pool_manager_stops() {
    let prefix = format!("sptest-{}", rand_hex(10));
    let node = format!("n{}", rand_hex(6));
    let cleanup = Cleanup { prefix: prefix.clone() };
    let opts = StackOpts { warm: 1, ..Default::default() };
    let toml =
        config_toml(&prefix, &node, &opts).replace("default_wait = ", "drain_grace = \"500ms\"\ndefault_wait = ");
    let dir = std::env::temp_dir().join(&prefix);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg_path = dir.join("sandpool.toml");
    std::fs::write(&cfg_path, &toml).unwrap();
    let log = std::fs::File::create(dir.join("sandpool.log")).unwrap();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = Command::new(env!("CARGO_BIN_EXE_sandpool"))
        .arg("--config")
        .arg(&cfg_path)
        .args(["--gateway-listen", &format!("127.0.0.1:{port}"), "up"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start sandpool up");
    let mut proc = Proc(child);
    let http = reqwest::Client::new();
    let ready = || async { http.get(format!("{url}/readyz")).send().await.ok().map(|r| r.status().as_u16()) };
    eventually(Duration::from_secs(60), || async { (ready().await == Some(204)).then_some(()) })
        .await
        .expect("sandpool up becomes ready");

    let config = config_for(&prefix, &node, &opts);
    let token = gateway::mint(&config.auth, "acme", false, Duration::from_secs(600)).unwrap();
    let created = eventually(Duration::from_secs(60), || async {
        let r = http
            .post(format!("{url}/v1/sessions"))
            .bearer_auth(&token)
            .json(&json!({"template": "bb"}))
            .send()
            .await
            .ok()?;
        (r.status().as_u16() == 201).then_some(())?;
        r.json::<serde_json::Value>().await.ok()
    })
    .await
    .expect("a session");
    let sid = created["session_id"].as_str().unwrap().to_string();

    // An exec that is still running when SIGTERM arrives.
    let exec = tokio::spawn({
        let (http, url, token) = (http.clone(), url.clone(), token.clone());
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
    let kill = Command::new("kill").args(["-TERM", &proc.0.id().to_string()]).status().unwrap();
    assert!(kill.success());

    // Readiness fails first, while the listener still answers (drain_grace).
    let not_ready =
        eventually(Duration::from_millis(400), || async { (ready().await == Some(503)).then_some(()) }).await;
    assert!(not_ready.is_some(), "readyz answers 503 during the drain grace");

    let (status, body) = exec.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["stdout"], "survived\n", "{body}");
    assert!(sent.elapsed() >= Duration::from_secs(1), "the exec really was in flight");

    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = proc.0.try_wait().expect("wait for sandpool") {
            break status;
        }
        assert!(Instant::now() < deadline, "sandpool exits after draining");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "exit status {status}");
    let _ = std::fs::remove_dir_all(&dir);
    drop(cleanup);
}

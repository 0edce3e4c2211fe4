//! A caller who left holds nothing: a create whose gateway died leaves a session its
//! session key's retry finds (not 409 until the pending claim expires), and an invocation whose
//! client hung up gives back its concurrency slot and its environment at once.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts, eventually};

/// Answers' statuses in order, runs counted: "409 x112, 200".
fn summary(statuses: &[u16]) -> String {
    let mut runs: Vec<(u16, usize)> = Vec::new();
    for &s in statuses {
        match runs.last_mut() {
            Some((last, n)) if *last == s => *n += 1,
            _ => runs.push((s, 1)),
        }
    }
    let runs: Vec<String> =
        runs.into_iter().map(|(s, n)| if n == 1 { s.to_string() } else { format!("{s} x{n}") }).collect();
    format!("statuses {}", runs.join(", "))
}

/// A create is queued on a gateway that is then killed (no drain, no clean-up); the node
/// grants the sandbox to the dead request all the same. A retry with the same session key, on
/// another gateway, gets that session (200, the one session the tenant has), not 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_gets_the_session_a_killed_gateways_create_made() {
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let (l, node) = (stack.node.ledger.clone(), stack.node.id.clone());
    let mut doomed = stack.killable_gateway().await;
    let token = stack.token("acme");
    let body = json!({"template": "bb", "session_key": "episode-7", "max_wait_s": 60});
    let (url, b) = (doomed.url.clone(), body.clone());
    // The create waits in the node's queue (no idle sandbox: one is created for it).
    let create = tokio::spawn(async move {
        reqwest::Client::new().post(format!("{url}/v1/sessions")).bearer_auth(token).json(&b).send().await
    });
    let queued = eventually(Duration::from_secs(20), || {
        let (l, node) = (l.clone(), node.clone());
        async move { (l.waiting_counts(&node, &["bb"]).await.ok()? == vec![1]).then_some(()) }
    })
    .await;
    assert!(queued.is_some(), "the create never queued");
    doomed.kill();
    assert!(create.await.expect("the create task").is_err(), "a killed gateway answered");

    let c = stack.client("acme");
    let t0 = Instant::now();
    let mut statuses = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let found = loop {
        let a = c.call(Method::POST, "/v1/sessions", Some(body.clone())).await;
        statuses.push(a.status);
        if a.status == 200 || Instant::now() >= deadline {
            break (a.status == 200).then_some(a.body);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let session = found.unwrap_or_else(|| panic!("no retry got the session: {}", summary(&statuses)));
    let id = session["session_id"].as_str().expect("a session id").to_string();
    assert!(statuses.iter().all(|s| *s == 409 || *s == 200), "{}", summary(&statuses));
    eprintln!("caller_left: the retry found {id} after {:.1}s ({} tries)", t0.elapsed().as_secs_f64(), statuses.len());
    // It is the only session the tenant has, and the key keeps naming it.
    let list = c.call(Method::GET, "/v1/sessions", None).await;
    let ids: Vec<&str> =
        list.body["sessions"].as_array().expect("sessions").iter().filter_map(|s| s["session_id"].as_str()).collect();
    assert_eq!(ids, vec![id.as_str()], "{:?}", list.body);
    let again = c.call(Method::POST, "/v1/sessions", Some(body)).await;
    assert_eq!((again.status, again.body["session_id"].as_str()), (200, Some(id.as_str())), "{:?}", again.body);
    stack.shutdown().await;
}

/// A client hangs up during an invocation of a function allowed one at a time: the slot is
/// free again at once (the next call runs, rather than a 429 until the function's timeout and
/// 45 s more) and the environment the call was running in is retired, its session ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_mid_invocation_frees_its_slot_and_environment() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let c = stack.client("acme");
    // Sleeps as many seconds as its payload says.
    let def = json!({"template": "bb", "mode": "exec", "handler": ["sh", "-c", "sleep $(cat); echo done"],
                     "max_concurrency": 1, "timeout_ms": 120000});
    let put = c.call(Method::PUT, "/v1/functions/nap", Some(def)).await;
    assert_eq!(put.status, 201, "{:?}", put.body);
    let invoke = |payload: &'static str, timeout: Duration| {
        let (url, token) = (stack.url.clone(), stack.token("acme"));
        async move {
            reqwest::Client::builder()
                .timeout(timeout)
                .build()
                .expect("a client")
                .post(format!("{url}/v1/functions/nap/invoke"))
                .bearer_auth(token)
                .body(payload)
                .send()
                .await
        }
    };
    let first = invoke("0", Duration::from_secs(60)).await.expect("the first invocation");
    assert_eq!(first.status(), 200);
    let env = first.headers()["x-sandpool-environment"].to_str().expect("an environment").to_string();

    // The warm environment runs a 60 s nap; its client leaves after 2 s.
    let left = invoke("60", Duration::from_secs(2)).await;
    assert!(left.is_err_and(|e| e.is_timeout()), "the long invocation answered");
    let t0 = Instant::now();
    // The slot is free: the next invocation runs (in a new environment) within seconds.
    let mut statuses = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let next = loop {
        let r = invoke("0", Duration::from_secs(60)).await.expect("an invocation");
        statuses.push(r.status().as_u16());
        if r.status() == 200 {
            break Some(r.headers()["x-sandpool-environment"].to_str().unwrap_or_default().to_string());
        }
        if Instant::now() >= deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let next = next.unwrap_or_else(|| panic!("the slot stayed taken: {}", summary(&statuses)));
    assert_ne!(next, env, "the environment the left call ran in was used again while it may still run");
    eprintln!("caller_left: the slot was free {:.1}s after the client left", t0.elapsed().as_secs_f64());
    // The left call's environment was retired: its session has ended.
    let ended = eventually(Duration::from_secs(20), || {
        let c = &c;
        let path = format!("/v1/sessions/{env}");
        // 404 `session_gone` (or `not_found`, once its record is gone too).
        async move { (c.call(Method::GET, &path, None).await.status == 404).then_some(()) }
    })
    .await;
    assert!(ended.is_some(), "the left call's environment {env} still lives");
    stack.shutdown().await;
}

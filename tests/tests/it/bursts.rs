//! Bursts without a forecast: bounded waiting, the create budget, and broken templates.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_pool_answers_within_deadlines_and_keeps_the_create_budget() {
    let stack = Stack::start(StackOpts {
        warm: 0,
        create_rate: 3.0,
        max_creates_in_flight: 3,
        max_queue: 12,
        // 3 creates a second would serve 3 in one second; 5 s leaves a loaded machine (the
        // whole suite runs beside it) room for its slower creates.
        default_wait: "5s",
        // One tenant may fill the whole queue here: this is the node's cap under test (a
        // tenant's share of it is `a_flooding_tenant_fills_its_share_of_the_queue_not_everyones`).
        extra_toml: "[quotas.default]\nqueued = 100\n".into(),
        // The rate budget is under test, so the window is fixed at its cap: an adaptive one
        // starts at half of it (2 here), and on a loaded machine two cold creates in flight
        // may take the whole 3 s (`budget::the_create_window_*` covers the adaptive window).
        pool_manager_toml: "adaptive_create_window = false".into(),
        ..Default::default()
    })
    .await;
    let c = stack.client("t");
    let t0 = Instant::now();
    let calls: Vec<_> = (0..20)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move {
                let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
                (a, t0.elapsed())
            })
        })
        .collect();
    let (mut ok, mut busy, mut full) = (0, 0, 0);
    for call in calls {
        let (a, took) = call.await.unwrap();
        assert!(took < Duration::from_secs(10), "an answer took {took:?}");
        match a.status {
            201 => {
                assert_eq!(a.body["start"], "cold");
                ok += 1;
            }
            503 | 429 => {
                assert!(a.headers.contains_key("retry-after"), "{} without Retry-After", a.status);
                assert!(!a.body["message"].as_str().unwrap_or("").is_empty());
                if a.status == 503 { busy += 1 } else { full += 1 }
            }
            s => panic!("unexpected {s}: {:?}", a.body),
        }
    }
    assert!(ok >= 3, "only {ok} sessions in 5 s at 3 creates/s");
    // The queue holds 12: of 20, at most 8 are turned away at once (fewer only if a sandbox
    // was granted while the burst was still arriving), and at least one is.
    assert!((1..=8).contains(&full), "{full} refused as queue-full ({ok} ok, {busy} timed out)");
    assert_eq!(ok + busy + full, 20);
    // The budget: a burst of 3, then 3 a second, never more.
    let elapsed = t0.elapsed().as_secs_f64();
    let started = stack.node.creates_started();
    assert!(started as f64 <= 3.0 + 3.0 * elapsed + 1.0, "{started} creates in {elapsed:.1}s");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_image_backs_off_and_fails_requests_fast() {
    let stack = Stack::start(StackOpts {
        warm: 0,
        extra_toml: "[templates.broken]\nimage = \"sandpool/no-such-image:1\"\nwarm = 2\n".into(),
        ..Default::default()
    })
    .await;
    let c = stack.client("t");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let started = stack.node.creates_started();
    // Back-off 0.5 s, 1 s, 2 s, ... after consecutive failures: a handful, not a storm.
    assert!((1..=8).contains(&started), "{started} creates of a broken template in 4 s");
    let t0 = Instant::now();
    let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "broken", "max_wait_s": 20}))).await;
    assert_eq!(a.status, 503, "{:?}", a.body);
    assert!(t0.elapsed() < Duration::from_secs(5), "the failure took {:?} to surface", t0.elapsed());
    assert!(a.headers.contains_key("retry-after"));
    let msg = a.body["message"].as_str().unwrap();
    assert!(msg.contains("broken") && msg.contains("no-such-image"), "{msg}");
    // Other templates are unaffected.
    let ok = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
    assert_eq!(ok.status, 201, "{:?}", ok.body);
    stack.shutdown().await;
}

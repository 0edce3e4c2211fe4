//! Bursts met warm by the autoscaler: declared (reservations) and learned (periodic).

use std::time::{Duration, Instant, SystemTime};

use reqwest::Method;
use serde_json::json;
use tests::{Client, Stack, StackOpts};

fn opts() -> StackOpts {
    StackOpts { warm: 0, autoscaler: true, create_rate: 20.0, max_creates_in_flight: 8, ..Default::default() }
}

/// Fires `n` session creates at once; returns (warm count, latencies, errors).
async fn burst(c: &Client, n: usize) -> (usize, Vec<Duration>, Vec<String>) {
    let calls: Vec<_> = (0..n)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move {
                let t0 = Instant::now();
                let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
                (a, t0.elapsed())
            })
        })
        .collect();
    let (mut warm, mut lat, mut errors, mut sids) = (0, Vec::new(), Vec::new(), Vec::new());
    for call in calls {
        let (a, took) = call.await.unwrap();
        if a.status == 201 {
            warm += (a.body["start"] == "warm") as usize;
            lat.push(took);
            sids.push(a.body["session_id"].as_str().unwrap().to_string());
        } else {
            errors.push(format!("{} {}", a.status, a.body));
        }
    }
    for sid in sids {
        c.delete(&sid).await;
    }
    lat.sort();
    (warm, lat, errors)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserved_burst_is_all_warm() {
    let stack = Stack::start(opts()).await;
    let c = stack.client("trainer");
    let ready_by = SystemTime::now() + Duration::from_secs(8);
    let body = json!({"template": "bb", "count": 40, "ready_by": humantime::format_rfc3339(ready_by).to_string(), "hold_s": 60});
    let r = c.call(Method::POST, "/v1/reservations", Some(body)).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!(r.body["feasible"], true, "{:?}", r.body);
    // An impossible one says when it could be ready instead.
    let soon = humantime::format_rfc3339(SystemTime::now() + Duration::from_secs(1)).to_string();
    let r = c
        .call(Method::POST, "/v1/reservations", Some(json!({"template": "bb", "count": 5000, "ready_by": soon})))
        .await;
    assert_eq!((r.status, r.body["feasible"].as_bool()), (201, Some(false)), "{:?}", r.body);
    assert!(r.body["earliest_ready_at"].as_str().unwrap() > soon.as_str());
    // The pool is warm by the declared time...
    stack.wait_idle("bb", 40, Duration::from_secs(30)).await;
    // ...and the burst finds it so.
    let (warm, lat, errors) = burst(&c, 40).await;
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(warm, 40, "every session of a reserved burst is warm");
    eprintln!("reserved burst of 40: p50 {:?}, max {:?}", lat[lat.len() / 2], lat[lat.len() - 1]);
    // (The ≤ 50 ms p99 aim is measured by the benchmark, not asserted on a shared CI box.)
    assert!(lat[lat.len() - 1] < Duration::from_secs(2), "{lat:?}");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_bursts_are_learned_without_a_reservation() {
    let stack = Stack::start(opts()).await;
    let c = stack.client("trainer");
    let period = Duration::from_secs(25);
    let t0 = Instant::now();
    let mut results = Vec::new();
    for k in 0..3u32 {
        let at = t0 + period * k;
        tokio::time::sleep_until(at.into()).await;
        let (warm, _, errors) = burst(&c, 24).await;
        assert!(errors.is_empty(), "burst {k}: {errors:?}");
        results.push(warm);
    }
    eprintln!("warm per burst: {results:?}");
    assert_eq!(results[0], 0, "nothing can know about the first burst");
    assert!(results[2] >= 20, "the third burst should be mostly warm: {results:?}");
    stack.shutdown().await;
}

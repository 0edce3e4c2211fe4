//! The node's sandbox budget end to end: a node at its budget refuses creates at once with
//! 503 `node_full` and Retry-After (never running the machine into fork failures), stays
//! healthy for the sessions it has, reports its budget and what binds it, and takes creates
//! again once sandboxes end.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};
use tests::{Stack, StackOpts, eventually};

use crate::FILL;

async fn budget(stack: &Stack) -> Value {
    let pools = stack.admin_client().call(Method::GET, "/v1/pools", None).await;
    assert_eq!(pools.status, 200, "{:?}", pools.body);
    pools.body["nodes"][0]["budget"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_thread_budget_is_spent_refuses_creates_at_once_and_stays_healthy() {
    // A cap of one thread: the machine uses far more, so the budget leaves room for nothing.
    let opts = StackOpts { warm: 0, pool_manager_toml: "max_threads = 1".into(), ..Default::default() };
    let stack = Stack::start(opts).await;
    let b = eventually(Duration::from_secs(5), || async {
        let b = budget(&stack).await;
        (b["binding"] == "threads").then_some(b)
    })
    .await
    .expect("the budget is reported, bound by threads");
    assert_eq!(b["capacity"], 0, "{b}");
    let threads = b["resources"].as_array().unwrap().iter().find(|r| r["name"] == "threads").unwrap().clone();
    assert_eq!(threads["limit"], 1.0, "{threads}");
    assert!(threads["used"].as_f64().unwrap() > 10.0, "{threads}");
    for name in ["memory_mb", "open_files", "max_sandboxes"] {
        assert!(b["resources"].as_array().unwrap().iter().any(|r| r["name"] == name), "{name} in {b}");
    }

    let c = stack.client("acme");
    let started = Instant::now();
    let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb", "max_wait_s": 30}))).await;
    assert_eq!((a.status, a.body["code"].as_str()), (503, Some("node_full")), "{:?}", a.body);
    assert!(a.headers.get("retry-after").is_some(), "Retry-After is set");
    assert!(started.elapsed() < Duration::from_secs(2), "refused at once, not at the deadline");
    assert_eq!(stack.node.sandbox_count(), 0, "nothing was created");
    let docker = std::process::Command::new("docker").args(["info", "-f", "{{.ServerVersion}}"]).output().unwrap();
    assert!(docker.status.success(), "docker still answers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_its_configured_cap_a_node_refuses_more_and_serves_the_sessions_it_has() {
    let opts = StackOpts { warm: 0, pool_manager_toml: "max_sandboxes = 2".into(), ..Default::default() };
    let stack = Stack::start(opts).await;
    let c = stack.client("acme");
    let first = c.create("bb").await["session_id"].as_str().unwrap().to_string();
    let second = c.create("bb").await["session_id"].as_str().unwrap().to_string();
    // The node reports itself full within its stats period (half a second).
    let full = eventually(Duration::from_secs(5), || async {
        let b = budget(&stack).await;
        (b["binding"] == "max_sandboxes" && b["capacity"] == 2 && b["sandboxes"] == 2).then_some(())
    })
    .await;
    assert!(full.is_some(), "{}", budget(&stack).await);
    let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
    assert_eq!((a.status, a.body["code"].as_str()), (503, Some("node_full")), "{:?}", a.body);
    // The sessions it has keep working.
    let r = c.sh(&first, "echo still here").await;
    assert_eq!(r["stdout"], "still here\n");
    // One ends: its sandbox is destroyed and the node has room again.
    assert_eq!(c.delete(&second).await, 204);
    let again = eventually(Duration::from_secs(15), || async {
        let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
        (a.status == 201).then(|| a.body["session_id"].as_str().unwrap().to_string())
    })
    .await
    .expect("a create succeeds once a sandbox has ended");
    for s in [&first, &again] {
        assert_eq!(c.delete(s).await, 204);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_create_window_is_reported_within_its_cap_and_a_fixed_one_at_it() {
    for (adaptive, warm) in [(true, 6u32), (false, 2)] {
        let opts = StackOpts {
            warm,
            max_creates_in_flight: 4,
            pool_manager_toml: format!("adaptive_create_window = {adaptive}"),
            ..Default::default()
        };
        let stack = Stack::start(opts).await;
        stack.wait_idle("bb", warm as usize, Duration::from_secs(60)).await;
        // The node publishes its stats twice a second.
        let window = eventually(Duration::from_secs(5), || async {
            let pools = stack.admin_client().call(Method::GET, "/v1/pools", None).await;
            pools.body["nodes"][0]["create_window"].as_u64().filter(|&w| w > 0)
        })
        .await
        .expect("create_window is reported");
        if adaptive {
            assert!((1..=4).contains(&window), "an adaptive window within [1, max_creates_in_flight]: {window}");
        } else {
            assert_eq!(window, 4, "a fixed window is max_creates_in_flight");
        }
        stack.shutdown().await;
    }
}

/// The budget's measure reads a sample of the node's sandboxes through their cgroups, not
/// every process of the machine (issue 34), and finds what the full walk of `/proc` finds:
/// threads per sandbox within 20 % of the walk's over the same sandboxes, and dockerd's and
/// containerd's descriptors, their pids remembered for the next measure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_budget_measures_a_sample_of_sandboxes_as_the_full_walk_does() {
    use pool_manager::budget;
    let stack = Stack::start(StackOpts { warm: 4, ..Default::default() }).await;
    stack.wait_idle("bb", 4, FILL).await;
    let out = std::process::Command::new("docker")
        .args(["ps", "-q", "--no-trunc", "--filter", &format!("label=sandpool.node={}", stack.node.id)])
        .output()
        .expect("docker ps");
    let ids: Vec<String> = String::from_utf8_lossy(&out.stdout).split_whitespace().map(String::from).collect();
    assert_eq!(ids.len(), 4, "{ids:?}");
    let mut pids = budget::ServicePids::default();
    let sampled = budget::measure(&ids, 4, &mut pids);
    let walked = budget::walk_threads(&ids).expect("the walk finds the sandboxes' threads");
    let threads = sampled.threads_per_sandbox.expect("the sample finds the sandboxes' threads");
    assert!((threads - walked).abs() <= 0.2 * walked, "sampled {threads}, walked {walked}");
    assert!((2.0..200.0).contains(&threads), "{threads}");
    for name in ["dockerd", "containerd", "pool-manager"] {
        let f = sampled.files.iter().find(|f| f.name == name).unwrap_or_else(|| panic!("{name}: {sampled:?}"));
        assert!(f.open > 0.0 && f.sandboxes == 4, "{f:?}");
    }
    // The next measure finds dockerd and containerd where they were.
    let again = budget::measure(&ids, 4, &mut pids);
    assert_eq!(again.files.len(), sampled.files.len());
    stack.shutdown().await;
}

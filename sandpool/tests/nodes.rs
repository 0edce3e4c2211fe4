//! Many nodes as processes: `sandpool up --nodes 3` on one Docker engine, and a node that is
//! killed with SIGKILL (no shutdown, no lease given back): it is down within `down_after`, its
//! sessions answer 503 `node_unavailable` at once, and once restarted it serves them again.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use tests::eventually;

mod support;
use support::Up;

/// Removes the sandboxes' socket directories of the given node ids when dropped (the stack's
/// cleanup knows only its own node id; these nodes are `<id>-<i>` or `<id>-b`).
struct RunDirs(Vec<String>);

impl Drop for RunDirs {
    fn drop(&mut self) {
        let run = std::path::Path::new(tests::TEST_STATE_DIR).join("run");
        for e in std::fs::read_dir(&run).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if self.0.iter().any(|n| name.starts_with(&format!("{n}."))) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

fn fast_liveness(toml: String) -> String {
    toml.replacen("[node]\n", "[node]\ndown_after = \"3s\"\n", 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_three_nodes_runs_three_nodes_and_spreads_sessions_over_them() {
    let up = Up::start(
        |t| t,
        |cmd| {
            cmd.args(["--nodes", "3"]);
        },
    )
    .await;
    let _dirs = RunDirs((1..=3).map(|i| format!("{}-{i}", up.node)).collect());
    let c = up.client();
    let mut per_node = std::collections::BTreeMap::<String, usize>::new();
    let mut sids = Vec::new();
    for _ in 0..30 {
        let s = c.create("bb").await;
        *per_node.entry(s["node"].as_str().unwrap().to_string()).or_default() += 1;
        sids.push(s["session_id"].as_str().unwrap().to_string());
    }
    for sid in &sids {
        c.delete(sid).await;
    }
    let expected: Vec<String> = (1..=3).map(|i| format!("{}-{i}", up.node)).collect();
    assert_eq!(per_node.keys().cloned().collect::<Vec<_>>(), expected, "{per_node:?}");
    assert!(per_node.values().all(|n| *n >= 4), "30 sessions spread over 3 nodes: {per_node:?}");
}

/// `sandpool pool-manager` as node `id` on `up`'s config: another host's node agent.
fn pool_manager(up: &Up, id: &str) -> Child {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(up.log.with_extension("b.log")).unwrap();
    Command::new(env!("CARGO_BIN_EXE_sandpool"))
        .arg("--config")
        .arg(up.config_path())
        .args(["--node-id", id, "pool-manager"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .expect("start a pool-manager")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_is_down_within_down_after_and_serves_its_sessions_again_when_restarted() {
    let up = Up::start(fast_liveness, |_| {}).await;
    let b_id = format!("{}-b", up.node);
    let _dirs = RunDirs(vec![b_id.clone()]);
    let mut b = pool_manager(&up, &b_id);
    struct Kill<'a>(&'a mut Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let c = up.client();
    // A session on b.
    let on_b = eventually(Duration::from_secs(60), || async {
        let s = c.call(reqwest::Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
        let sid = s.body["session_id"].as_str()?.to_string();
        if s.body["node"] == b_id.as_str() {
            return Some(sid);
        }
        c.delete(&sid).await;
        None
    })
    .await
    .expect("a session lands on node b");
    assert_eq!(c.sh(&on_b, "echo before > /work/f; cat /work/f").await["stdout"], "before\n");

    // SIGKILL: no shutdown, the lease stays until it expires.
    b.kill().unwrap();
    b.wait().unwrap();
    let killed = Instant::now();
    let down = eventually(Duration::from_secs(10), || async {
        let r = c.exec(&on_b, json!({"cmd": "true"})).await;
        (r.body["code"] == "node_unavailable").then_some(r)
    })
    .await
    .expect("the session answers node_unavailable");
    let down_in = killed.elapsed();
    assert_eq!(down.status, 503);
    assert!(down.headers.contains_key("retry-after"));
    eprintln!("node b killed: its session answered 503 node_unavailable after {down_in:?}");
    assert!(down_in <= Duration::from_secs(5), "down_after is 3 s: {down_in:?}");
    // Once down, no create is placed on it.
    for _ in 0..6 {
        let s = c.create("bb").await;
        assert_eq!(s["node"], up.node.as_str(), "{s}");
        c.delete(s["session_id"].as_str().unwrap()).await;
    }

    // Restarted (before lost_after): it reattaches its sandboxes and the session goes on.
    let mut b = pool_manager(&up, &b_id);
    let _kill = Kill(&mut b);
    let back = eventually(Duration::from_secs(30), || async {
        let r = c.exec(&on_b, json!({"cmd": "cat /work/f"})).await;
        (r.status == 200).then_some(r.body)
    })
    .await
    .expect("the session is served again by the restarted node");
    assert_eq!(back["stdout"], "before\n");
}

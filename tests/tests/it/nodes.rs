//! Many nodes: ids held by a lease, placement over live nodes only, a node that stops (its
//! sessions answer 503 at once, and end with `node_lost` once it is given up), a node that
//! returns, and a ledger that forgets everything (Redis restarted without its data).

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts, eventually};

use crate::FILL;

/// Nodes are down 3 s after their last heartbeat and given up 3 s later (the sweep runs every
/// 5 s), so a test sees the whole life of a lost node in seconds.
fn fast_liveness(warm: u32) -> StackOpts {
    StackOpts { warm, node_toml: "down_after = \"3s\"\nlost_after = \"6s\"".into(), ..Default::default() }
}

/// Starts a container with the stack's node's labels for `sandbox`, an id neither the node nor
/// the ledger has (as one left by a crashed create would be); answers the id.
fn run_stray(stack: &Stack, sandbox: &str) -> String {
    let node = &stack.node;
    let labels = [
        "sandpool.managed=true".to_string(),
        format!("sandpool.prefix={}", stack.ledger_prefix()),
        format!("sandpool.node={}", node.id),
        format!("sandpool.sandbox={sandbox}"),
    ];
    let mut args = vec!["run", "-d", "--network", "none"];
    for l in &labels {
        args.extend(["--label", l.as_str()]);
    }
    args.extend([tests::BUSYBOX_IMAGE, "sleep", "600"]);
    let out = std::process::Command::new("docker").args(&args).output().expect("docker run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    sandbox.to_string()
}

/// Whether a container of `sandbox` exists.
fn stray_runs(sandbox: &str) -> bool {
    let filter = format!("label=sandpool.sandbox={sandbox}");
    let out =
        std::process::Command::new("docker").args(["ps", "-aq", "--filter", &filter]).output().expect("docker ps");
    !out.stdout.is_empty()
}

fn containers_of(node: &str) -> usize {
    let out = std::process::Command::new("docker")
        .args(["ps", "-aq", "--filter", &format!("label=sandpool.node={node}")])
        .output()
        .expect("docker ps");
    String::from_utf8_lossy(&out.stdout).split_whitespace().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_node_gets_no_placement_its_sessions_answer_503_then_end_as_node_lost_and_it_can_return() {
    let stack = Stack::start(fast_liveness(2)).await;
    let b = stack.add_node().await;
    let (a_id, b_id) = (stack.node.id.clone(), b.node.id.clone());
    stack.wait_idle("bb", 2, FILL).await;
    let c = stack.client("t");
    // A session on node b (placement spreads creates; delete the ones that land on a).
    let on_b = eventually(FILL, || async {
        let s = c.create("bb").await;
        let (sid, node) = (s["session_id"].as_str()?.to_string(), s["node"].as_str()?.to_string());
        if node == b_id {
            return Some(sid);
        }
        c.delete(&sid).await;
        None
    })
    .await
    .expect("a create lands on the second node");
    assert_eq!(c.sh(&on_b, "echo hi").await["stdout"], "hi\n");

    // b stops (its containers keep running): it is down at once, having given its lease back.
    drop(b);
    let t = Instant::now();
    let r = c.exec(&on_b, json!({"cmd": "echo hi"})).await;
    assert_eq!((r.status, r.body["code"].as_str()), (503, Some("node_unavailable")), "{:?}", r.body);
    assert!(r.headers.contains_key("retry-after"));
    assert!(t.elapsed() < Duration::from_secs(2), "answered at once, not after a timeout: {:?}", t.elapsed());
    // Every create lands on the live node.
    let mut made = Vec::new();
    for _ in 0..6 {
        let s = c.create("bb").await;
        assert_eq!(s["node"], a_id.as_str(), "{s}");
        made.push(s["session_id"].as_str().unwrap().to_string());
    }
    for sid in &made {
        c.delete(sid).await;
    }
    // Past lost_after, the live node gives b up: the session ends with node_lost, its quota
    // usage returns, b leaves the registry.
    let gone = eventually(Duration::from_secs(20), || async {
        let r = c.call(Method::GET, &format!("/v1/sessions/{on_b}"), None).await;
        (r.status == 404).then_some(r)
    })
    .await
    .expect("the session of a lost node ends");
    assert_eq!(gone.body["code"], "session_gone", "{:?}", gone.body);
    assert!(gone.body["message"].as_str().unwrap().contains("its node stopped answering"), "{:?}", gone.body);
    let usage = c.call(Method::GET, "/v1/usage", None).await;
    assert_eq!(usage.body["levels"][0]["usage"]["sessions"], 0, "{:?}", usage.body);
    let nodes: Vec<String> = stack.node.ledger.nodes().await.unwrap().into_iter().map(|n| n.id).collect();
    assert!(!nodes.contains(&b_id), "{nodes:?}");

    // b comes back under its id: it rejoins, removes the sandboxes it was given up with, and
    // serves again.
    let b = stack.add_node_as(&b_id).await;
    eventually(FILL, || async {
        let idle = stack.node.ledger.idle_counts(&b_id, &["bb"]).await.ok()?;
        (idle[0] >= 2 && containers_of(&b_id) == 2).then_some(())
    })
    .await
    .unwrap_or_else(|| {
        panic!("node b rejoined with a fresh pool of 2 and nothing else ({} containers)", containers_of(&b_id))
    });
    let back = eventually(FILL, || async {
        let s = c.create("bb").await;
        let sid = s["session_id"].as_str()?.to_string();
        let node = s["node"].as_str()?.to_string();
        c.delete(&sid).await;
        (node == b_id).then_some(())
    })
    .await;
    assert!(back.is_some(), "creates land on the returned node again");
    drop(b);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_manager_refuses_an_id_that_a_live_node_on_another_host_holds() {
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let ledger = &stack.node.ledger;
    ledger.claim_node("ntaken", "otherhost/ENGINE-ID|1234", 60_000, true).await.unwrap();
    let mut cfg = (*stack.config).clone();
    cfg.node.id = Some("ntaken".into());
    cfg.pool_manager.listen = "127.0.0.1:0".parse().unwrap();
    cfg.pool_manager.advertise = "http://127.0.0.1:0".into();
    let err = match pool_manager::start(Arc::new(cfg), tokio_util::sync::CancellationToken::new()).await {
        Ok(_) => panic!("a second pool-manager started with a live node's id"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("\"ntaken\" is held by a live pool-manager on otherhost/ENGINE-ID"), "{err}");
    assert!(ledger.sandboxes("ntaken").await.unwrap().is_empty(), "it touched nothing of that node");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_that_forgets_everything_loses_no_idle_sandbox_and_no_private_template() {
    let stack = Stack::start(StackOpts { warm: 2, ..Default::default() }).await;
    struct Images(String);
    impl Drop for Images {
        fn drop(&mut self) {
            let out = std::process::Command::new("docker")
                .args(["images", "-q", &format!("sandpool-snap/{}", self.0)])
                .output()
                .unwrap();
            for i in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = std::process::Command::new("docker").args(["rmi", "-f", i]).output();
            }
        }
    }
    let _images = Images(stack.ledger_prefix().to_string());
    stack.wait_idle("bb", 2, FILL).await;
    let c = stack.client("t");
    let first = c.create("bb").await;
    let sid = first["session_id"].as_str().unwrap().to_string();
    let leased_sandbox = first["sandbox_id"].as_str().unwrap().to_string();
    c.sh(&sid, "echo kept > /work/f").await;
    let snap = c.call(Method::POST, &format!("/v1/sessions/{sid}/snapshot"), None).await;
    assert_eq!(snap.status, 201, "{:?}", snap.body);
    let template = snap.body["template"].as_str().unwrap().to_string();
    stack.wait_idle("bb", 2, FILL).await;
    let idle_before: Vec<String> = stack
        .node
        .ledger
        .sandboxes(&stack.node.id)
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.state == ledger::SandboxState::Idle)
        .map(|r| r.id)
        .collect();
    assert_eq!(idle_before.len(), 2);

    // Redis comes back empty: every key of the deployment is gone.
    stack.node.ledger.delete_all_keys().await.unwrap();

    // Within a heartbeat or two the node has registered again and put its untouched sandboxes
    // back into their pool; creates work again.
    let t = Instant::now();
    let s = eventually(Duration::from_secs(15), || async {
        let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
        (a.status == 201).then_some(a.body)
    })
    .await
    .expect("creates work again after Redis came back empty");
    eprintln!("first create after the ledger was wiped: {:?}", t.elapsed());
    assert_eq!(s["start"], "warm", "{s}");
    // The pooled sandboxes are back in the ledger (the pool may have refilled beside them):
    // at the rejoin (a heartbeat after the wipe), or at the latest by the node's sweep, every
    // 20 s. (Once, under CI's load, they were not back 10 s after the first create; the cause
    // is not known: RELIABILITY.md. The time it took is printed.)
    let t = Instant::now();
    let known = eventually(Duration::from_secs(30), || async {
        let records: Vec<String> =
            stack.node.ledger.sandboxes(&stack.node.id).await.ok()?.into_iter().map(|r| r.id).collect();
        idle_before.iter().all(|id| records.contains(id)).then_some(())
    })
    .await;
    eprintln!("untouched sandboxes back in the ledger after {:?} more", t.elapsed());
    assert!(known.is_some(), "the untouched sandboxes are back in the ledger");
    // The session whose record is gone is ended cleanly: 404, and its container is removed.
    assert_eq!(c.call(Method::GET, &format!("/v1/sessions/{sid}"), None).await.status, 404);
    let container_gone = eventually(FILL, || async {
        let filter = format!("label=sandpool.sandbox={leased_sandbox}");
        let out = std::process::Command::new("docker").args(["ps", "-aq", "--filter", &filter]).output().ok()?;
        (stack.node.sandbox(&leased_sandbox).is_none() && out.stdout.is_empty()).then_some(())
    })
    .await;
    assert!(container_gone.is_some(), "the forgotten session's sandbox {leased_sandbox} is removed");
    // The private template comes back from its image's label, never deleted for lack of a
    // record: a session of it starts from the snapshot.
    let from_snap = eventually(Duration::from_secs(30), || async {
        let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": template, "max_wait_s": 20}))).await;
        (a.status == 201).then_some(a.body)
    })
    .await
    .expect("the private template is restored");
    let kid = from_snap["session_id"].as_str().unwrap();
    assert_eq!(c.sh(kid, "cat /work/f").await["stdout"], "kept\n");
    stack.shutdown().await;
}

/// What a running node's sweep puts right: a container of the node that nobody knows (a killed
/// pool-manager's create that Docker finished after its successor had reconciled) is removed,
/// and a sandbox whose record the ledger lost while the node kept its lease (a Redis restart
/// that lost its last second of writes) goes back into its pool. Nothing else is touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_node_removes_containers_nobody_knows_and_pools_sandboxes_the_ledger_forgot() {
    // Room for the two warm sandboxes only: the pool cannot refill the one the ledger forgets
    // before the sweep puts it back (a third would be surplus, and the pool would retire one).
    let opts = StackOpts { warm: 2, pool_manager_toml: "max_sandboxes = 2".into(), ..Default::default() };
    let stack = Stack::start(opts).await;
    stack.wait_idle("bb", 2, FILL).await;
    let node = &stack.node;
    let idle: Vec<String> = node.ledger.sandboxes(&node.id).await.unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(idle.len(), 2, "{idle:?}");

    // A container with the node's labels for a sandbox id neither the node nor the ledger has.
    let stray = run_stray(&stack, &format!("{}.0000deadbeef", node.id));
    // The ledger forgets one idle sandbox the node still runs.
    let forgotten = idle[0].clone();
    node.ledger.sandbox_remove(&node.id, &forgotten, wire::GoneReason::Removed).await.unwrap();

    node.sweep().await.unwrap();

    assert!(!stray_runs(&stray), "the stray container is removed");
    let records = node.ledger.sandboxes(&node.id).await.unwrap();
    for id in &idle {
        let r = records.iter().find(|r| &r.id == id).unwrap_or_else(|| panic!("{id} has a record: {records:?}"));
        assert_eq!(r.state, ledger::SandboxState::Idle, "{r:?}");
        assert!(node.sandbox(id).is_some(), "{id} still runs");
    }
    // The pooled sandbox is checked out again: sessions until it is the one granted.
    let c = stack.client("t");
    let granted = eventually(Duration::from_secs(10), || async {
        let s = c.create("bb").await;
        (s["sandbox_id"] == forgotten.as_str()).then_some(s)
    })
    .await
    .expect("the forgotten sandbox is granted again");
    assert_eq!(c.sh(granted["session_id"].as_str().unwrap(), "echo ok").await["stdout"], "ok\n");
}

/// A running node's sweep costs what changed since the last one, not what the node holds
/// (issue 34): once Docker's event stream has settled and the containers were listed once, a
/// sweep over 2 idle sandboxes and one over 4 list no container and read no record; the one
/// after the 2 new creates looks at those 2 at most (fewer if the reaper's own sweep came
/// first); and a container nobody knows is still found, by its create event alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_nodes_sweep_costs_what_changed_not_what_it_holds() {
    use pool_manager::node::SweepCost;
    let stack = Stack::start(StackOpts { warm: 2, ..Default::default() }).await;
    stack.wait_idle("bb", 2, FILL).await;
    let node = stack.node.clone();
    let settle = |node: Arc<pool_manager::Node>| async move {
        eventually(Duration::from_secs(40), || async {
            let c = node.sweep().await.expect("sweep");
            (c == SweepCost::default()).then_some(())
        })
        .await
        .expect("a sweep that reads nothing once the event stream has settled");
    };
    settle(node.clone()).await;
    assert_eq!(node.sweep().await.unwrap(), SweepCost::default(), "at 2 idle");

    // Twice the sandboxes (the pool's target, refreshed as the autoscaler would).
    let now = node.ledger.now_ms().await.unwrap();
    node.ledger.set_targets(&node.id, &std::collections::HashMap::from([("bb".to_string(), 4)]), now).await.unwrap();
    stack.wait_idle("bb", 4, FILL).await;
    let after_creates = node.sweep().await.unwrap();
    assert_eq!((after_creates.containers_listed, after_creates.records_read), (0, 0), "{after_creates:?}");
    assert!(after_creates.containers_checked <= 2, "only the new containers are looked at: {after_creates:?}");
    assert_eq!(node.sweep().await.unwrap(), SweepCost::default(), "at 4 idle");
    assert_eq!(node.sandbox_count(), 4);

    // A container with the node's labels that nobody knows: its create event is enough.
    let stray = run_stray(&stack, &format!("{}.0000feedbeef", node.id));
    let removed = eventually(Duration::from_secs(10), || async {
        let c = node.sweep().await.expect("sweep");
        assert_eq!((c.containers_listed, c.records_read), (0, 0), "{c:?}");
        (!stray_runs(&stray)).then_some(())
    })
    .await;
    assert!(removed.is_some(), "the stray container is removed");
    assert_eq!(node.sandbox_count(), 4, "nothing else is touched");
    stack.shutdown().await;
}

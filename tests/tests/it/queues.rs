//! Waiters that vanish, on a real node: a grant its waiter never collects goes back to the
//! pool within seconds, and vanished waiters do not keep the node's waiting count up. The
//! gateway that dies is simulated at the ledger level: a request queued as a gateway would
//! queue it, whose mail nobody ever takes.

use std::time::{Duration, Instant};

use ledger::{Admission, Checkout, Cost, LeaseSpec, Ledger, Lookup, QueueSpec, SandboxState};
use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts, eventually, rand_hex};

use crate::FILL;

/// The lease of a session of template `bb` for `tenant`, as the gateway asks for it.
fn bb_spec(node: &str, tenant: &str) -> LeaseSpec {
    LeaseSpec {
        session_id: format!("{node}.{}", rand_hex(32)),
        tenant: tenant.into(),
        template: "bb".into(),
        ttl_ms: 3_600_000,
        idle_ms: 600_000,
        labels: Default::default(),
        session_key: None,
    }
}

async fn sessions_used(l: &Ledger, stack: &Stack, path: &str) -> (u64, u64) {
    let u = l.quota_view(path, &stack.config.quotas.default, false).await.unwrap().usage;
    (u.sessions, u.queued)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_its_waiter_never_collects_goes_back_to_the_pool_within_seconds() {
    // No warm pool and room for one sandbox: the only sandbox the node makes is the waiter's.
    let opts = StackOpts { warm: 0, pool_manager_toml: "max_sandboxes = 1".into(), ..Default::default() };
    let stack = Stack::start(opts).await;
    let (l, node) = (&stack.node.ledger, stack.node.id.as_str());
    // A request is admitted and queued, as its gateway would; then the gateway dies.
    let spec = bb_spec(node, "acme");
    let lease = ledger::session_lease(&spec.session_id);
    let d = &stack.config.quotas.default;
    let admitted = l.quota_admit(&lease, "acme", Cost::session(0.5, 128), d, true, 60_000, 0).await.unwrap();
    assert_eq!(admitted, Admission::Admitted);
    assert_eq!(l.quota_queue(&lease, "acme", true, d).await.unwrap(), Admission::Admitted);
    let channel = l.wake_channel("a-gateway-that-died");
    let queue = QueueSpec { request_id: "orphan-1", channel: &channel, max_len: 16, waiter_ttl_ms: 80_000 };
    assert!(matches!(l.checkout_or_queue(node, &spec, &queue).await.unwrap(), Checkout::Queued { .. }));
    // The node creates a sandbox for it, and grants it.
    let sandbox = eventually(FILL, || async {
        let sbs = l.sandboxes(node).await.ok()?;
        sbs.into_iter().find(|s| s.session.as_deref() == Some(spec.session_id.as_str())).map(|s| s.id)
    })
    .await
    .expect("the waiter is granted the sandbox the node made for it");
    let granted = Instant::now();
    assert_eq!(l.active_sessions(node).await.unwrap().get("acme"), Some(&1));
    // From here the pool's target is one idle sandbox (as the autoscaler would set it, held for
    // the test's life), so the sandbox that comes back stays in the pool rather than retiring.
    let held = l.now_ms().await.unwrap() + 3_600_000;
    l.set_targets(node, &[("bb".to_string(), 1)].into(), held).await.unwrap();
    // Nobody collects the grant: after its claim window (10 s) it is back in the pool.
    eventually(Duration::from_secs(40), || async {
        (l.idle_counts(node, &["bb"]).await.ok()? == vec![1]).then_some(())
    })
    .await
    .expect("the uncollected grant's sandbox is back in its pool");
    let took = granted.elapsed();
    assert!(took >= Duration::from_secs(9), "not before its claim window ended: {took:?}");
    assert!(took < Duration::from_secs(20), "within seconds of it: {took:?}");
    let record = l.sandboxes(node).await.unwrap().into_iter().find(|s| s.id == sandbox).expect("not destroyed");
    assert_eq!((record.state, record.session), (SandboxState::Idle, None));
    assert!(l.active_sessions(node).await.unwrap().is_empty(), "no session counted");
    assert_eq!(l.lookup(&spec.session_id, "acme", false).await.unwrap(), Lookup::Missing, "no tombstone");
    let back = eventually(Duration::from_secs(5), || async {
        (sessions_used(l, &stack, "acme").await == (0, 0)).then_some(())
    })
    .await;
    assert!(back.is_some(), "the quota lease is given back: {:?}", sessions_used(l, &stack, "acme").await);
    // The sandbox serves the next create, warm.
    let s = stack.client("acme").create("bb").await;
    assert_eq!((s["sandbox_id"].as_str(), s["start"].as_str()), (Some(sandbox.as_str()), Some("warm")));
    let a = stack.admin_client().call(Method::POST, "/v1/quotas:verify", None).await;
    assert_eq!((a.status, &a.body["drift"]), (200, &json!([])), "{:?}", a.body);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanished_waiters_do_not_keep_the_waiting_count_up() {
    let stack = Stack::start(StackOpts { warm: 0, max_queue: 4, ..Default::default() }).await;
    let (l, node) = (&stack.node.ledger, stack.node.id.as_str());
    // A gateway queues four requests of one tenant (the queue's cap) and dies: their records,
    // and the tenant's list, expire 300 ms later.
    let channel = l.wake_channel("a-gateway-that-died");
    for i in 0..4 {
        let request = format!("vanished-{i}");
        let queue = QueueSpec { request_id: &request, channel: &channel, max_len: 4, waiter_ttl_ms: 300 };
        let r = l.checkout_or_queue(node, &bb_spec(node, "acme"), &queue).await.unwrap();
        assert!(matches!(r, Checkout::Queued { .. }), "{r:?}");
    }
    // The node's count of waiting requests comes back to zero, and stays there.
    let zero = eventually(Duration::from_secs(10), || async {
        (l.waiting_counts(node, &["bb"]).await.ok()? == vec![0]).then_some(())
    })
    .await;
    assert!(zero.is_some(), "still counted: {:?}", l.waiting_counts(node, &["bb"]).await);
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(l.waiting_counts(node, &["bb"]).await.unwrap(), vec![0]);
    }
    // Whatever the node made for them meanwhile leaves again (nobody waits, the target is 0).
    let empty = eventually(FILL, || async {
        let sbs = l.sandboxes(node).await.ok()?;
        sbs.iter().all(|s| s.state == SandboxState::Stopping).then_some(())
    })
    .await;
    assert!(empty.is_some(), "the node keeps sandboxes for requests that are gone");
    // The queue is open again: a create that has to wait is queued and served, not refused.
    let a = stack
        .client("acme")
        .call(Method::POST, "/v1/sessions", Some(json!({"template": "bb", "max_wait_s": 60})))
        .await;
    assert_eq!((a.status, a.body["start"].as_str()), (201, Some("cold")), "{:?}", a.body);
    stack.shutdown().await;
}

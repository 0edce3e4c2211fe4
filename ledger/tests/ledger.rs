//! Ledger scripts against a real Redis (SANDPOOL_TEST_REDIS, default 127.0.0.1:6379).
//! Each test uses its own key prefix and deletes it on drop, pass or fail.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use ledger::{Ledger, Lookup, PinClaim, SandboxState};
use wire::internal::LeaseSpec;

fn redis_url() -> String {
    std::env::var("SANDPOOL_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Deletes the test's keys when dropped, whether the test passed or panicked.
struct Prefix(String);

impl Prefix {
    fn new() -> Prefix {
        Prefix(format!("sptest-{}", uuid::Uuid::new_v4().simple()))
    }
}

impl Drop for Prefix {
    fn drop(&mut self) {
        let Ok(client) = redis::Client::open(redis_url()) else { return };
        let Ok(mut conn) = client.get_connection() else { return };
        let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{}:*", self.0)).query(&mut conn).unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut conn);
        }
    }
}

fn spec(sid: &str, tenant: &str, idle_ms: u64, ttl_ms: u64) -> LeaseSpec {
    LeaseSpec {
        session_id: sid.into(),
        tenant: tenant.into(),
        template: "tpl".into(),
        ttl_ms,
        idle_ms,
        labels: BTreeMap::from([("job".into(), "j1".into())]),
        session_key: None,
    }
}

async fn fill(l: &Ledger, node: &str, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let sb = format!("{node}.{i:04x}");
        l.sandbox_add(node, &sb, "tpl").await.unwrap();
        assert!(l.sandbox_ready(node, &sb, &format!("c{i}")).await.unwrap());
        ids.push(sb);
    }
    ids
}

#[tokio::test]
async fn concurrent_checkouts_never_share_a_sandbox() {
    let p = Prefix::new();
    let l = Ledger::connect(&redis_url(), &p.0).await.unwrap();
    fill(&l, "n1", 50).await;
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let l = l.clone();
            tokio::spawn(async move { l.checkout("n1", &spec(&format!("n1.{i:08x}"), "t", 60_000, 600_000)).await })
        })
        .collect();
    let mut granted = Vec::new();
    let mut fences = HashSet::new();
    for t in tasks {
        if let Some(g) = t.await.unwrap().unwrap() {
            assert!(fences.insert(g.fence), "fence {} granted twice", g.fence);
            granted.push(g.sandbox_id);
        }
    }
    assert_eq!(granted.len(), 50, "every idle sandbox is granted, none more");
    assert_eq!(granted.iter().collect::<HashSet<_>>().len(), 50, "no sandbox granted twice");
    assert_eq!(l.idle_counts("n1", &["tpl"]).await.unwrap(), vec![0]);
}

#[tokio::test]
async fn lookup_is_tenant_scoped_and_release_dooms_the_sandbox() {
    let p = Prefix::new();
    let l = Ledger::connect(&redis_url(), &p.0).await.unwrap();
    fill(&l, "n1", 1).await;
    let g = l.checkout("n1", &spec("n1.aa", "alice", 60_000, 600_000)).await.unwrap().unwrap();
    let Lookup::Live(s) = l.lookup("n1.aa", "alice", true).await.unwrap() else { panic!("live") };
    assert_eq!((s.sandbox.as_str(), s.fence, s.labels["job"].as_str()), (g.sandbox_id.as_str(), g.fence, "j1"));
    assert_eq!(l.lookup("n1.aa", "mallory", true).await.unwrap(), Lookup::Missing);
    assert_eq!(l.release("n1.aa", "mallory", "deleted").await.unwrap(), None);
    assert_eq!(l.release("n1.aa", "alice", "deleted").await.unwrap(), Some(g.sandbox_id.clone()));
    assert!(
        matches!(l.lookup("n1.aa", "alice", true).await.unwrap(), Lookup::Gone { reason, .. } if reason == "deleted")
    );
    assert_eq!(l.lookup("n1.aa", "mallory", true).await.unwrap(), Lookup::Missing);
    let sbs = l.sandboxes("n1").await.unwrap();
    assert_eq!(sbs[0].state, SandboxState::Stopping);
    let mut bc = l.blocking_connection().await.unwrap();
    assert_eq!(l.pop_doomed(&mut bc, "n1", Duration::from_secs(1)).await.unwrap(), Some(g.sandbox_id));
    // A stopping sandbox is never handed out again.
    assert_eq!(l.checkout("n1", &spec("n1.bb", "bob", 60_000, 600_000)).await.unwrap(), None);
}

#[tokio::test]
async fn idle_and_hard_deadlines_expire_sessions() {
    let p = Prefix::new();
    let l = Ledger::connect(&redis_url(), &p.0).await.unwrap();
    fill(&l, "n1", 2).await;
    l.checkout("n1", &spec("n1.01", "t", 1_000, 600_000)).await.unwrap().unwrap();
    l.checkout("n1", &spec("n1.02", "t", 60_000, 1_500)).await.unwrap().unwrap();
    // Activity (every 300 ms, well inside the 1 s idle timeout even on a loaded machine) keeps
    // the first alive past its idle timeout...
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(matches!(l.lookup("n1.01", "t", true).await.unwrap(), Lookup::Live(_)));
    }
    // ...but not the second past its max lifetime.
    assert!(matches!(l.lookup("n1.02", "t", true).await.unwrap(),
        Lookup::Gone { reason, .. } if reason == "max_lifetime"));
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let ended = l.reap_expired("n1", 100).await.unwrap();
    assert_eq!(ended.iter().map(|e| e.session_id.as_str()).collect::<Vec<_>>(), ["n1.01"]);
    assert!(matches!(l.lookup("n1.01", "t", false).await.unwrap(), Lookup::Gone { reason, .. } if reason == "expired"));
}

#[tokio::test]
async fn pins_and_sandbox_removal() {
    let p = Prefix::new();
    let l = Ledger::connect(&redis_url(), &p.0).await.unwrap();
    fill(&l, "n1", 1).await;
    assert_eq!(l.pin_claim("t", "ep-1", "n1.0a").await.unwrap(), PinClaim::Claimed);
    assert_eq!(l.pin_claim("t", "ep-1", "n1.0b").await.unwrap(), PinClaim::Pending);
    let mut s = spec("n1.0a", "t", 60_000, 600_000);
    s.session_key = Some("ep-1".into());
    let g = l.checkout("n1", &s).await.unwrap().unwrap();
    l.pin_set("t", "ep-1", "n1.0a", 600_000).await.unwrap();
    assert_eq!(l.pin_claim("t", "ep-1", "n1.0c").await.unwrap(), PinClaim::Existing("n1.0a".into()));
    // Another tenant's key of the same name is independent.
    assert_eq!(l.pin_claim("u", "ep-1", "n1.0d").await.unwrap(), PinClaim::Claimed);
    // The sandbox dies: the session ends with that reason and the pin is dropped.
    let ended = l.sandbox_remove("n1", &g.sandbox_id, "sandbox_failed").await.unwrap().unwrap();
    assert_eq!(ended.session_id, "n1.0a");
    assert!(
        matches!(l.lookup("n1.0a", "t", false).await.unwrap(), Lookup::Gone { reason, .. } if reason == "sandbox_failed")
    );
    assert_eq!(l.pin_claim("t", "ep-1", "n1.0e").await.unwrap(), PinClaim::Claimed);
    assert!(l.sandboxes("n1").await.unwrap().is_empty());
}

#[tokio::test]
async fn unreachable_redis_is_an_error_not_an_empty_pool() {
    let r = Ledger::connect("redis://127.0.0.1:1", "sptest-none").await;
    assert!(r.is_err());
}

fn queue<'a>(req: &'a str, channel: &'a str) -> ledger::QueueSpec<'a> {
    ledger::QueueSpec { request_id: req, channel, max_len: 3, waiter_ttl_ms: 60_000 }
}

#[tokio::test]
async fn queued_requests_are_served_round_robin_between_tenants() {
    let p = Prefix::new();
    let l = Ledger::connect(&redis_url(), &p.0).await.unwrap();
    let chan = format!("{}:wake:test", p.0);
    let mut sub = l.subscribe(&chan).await.unwrap();
    // alice queues two, then bob one; a fourth is refused (max_len 3).
    for (req, sid, tenant) in [("ra1", "n1.a1", "alice"), ("ra2", "n1.a2", "alice"), ("rb1", "n1.b1", "bob")] {
        let r = l.checkout_or_queue("n1", &spec(sid, tenant, 60_000, 600_000), &queue(req, &chan)).await.unwrap();
        assert!(matches!(r, ledger::Checkout::Queued { .. }), "{r:?}");
    }
    let r = l.checkout_or_queue("n1", &spec("n1.0c", "carol", 60_000, 600_000), &queue("rc1", &chan)).await.unwrap();
    assert_eq!(r, ledger::Checkout::Full { depth: 3 });
    assert_eq!(l.waiting_counts("n1", &["tpl"]).await.unwrap(), vec![3]);
    // Two sandboxes become ready: alice's first request, then bob's (not alice's second).
    let ids = fill_ready(&l, "n1", 2).await;
    assert_eq!(ids, vec![2, 2], "both went to waiters");
    let mut stream = sub.on_message();
    use futures::StreamExt;
    let mut woken = Vec::new();
    for _ in 0..2 {
        let m = tokio::time::timeout(Duration::from_secs(2), stream.next()).await.unwrap().unwrap();
        woken.push(m.get_payload::<String>().unwrap());
    }
    assert_eq!(woken, ["ra1", "rb1"]);
    assert!(matches!(l.take_mail("n1", "ra1").await.unwrap(), Some(ledger::Mail::Granted(_))));
    assert!(l.take_mail("n1", "ra1").await.unwrap().is_none(), "mail is taken once");
    // alice's second gives up at its deadline and leaves the queue.
    assert_eq!(l.dequeue("n1", "ra2", "tpl", "alice").await.unwrap(), None);
    assert_eq!(l.waiting_counts("n1", &["tpl"]).await.unwrap(), vec![0]);
    // An unhealthy template refuses to queue and tells the cause.
    l.set_health("n1", "tpl", Some(("image not found", l.now_ms().await.unwrap() + 5_000))).await.unwrap();
    let r = l.checkout_or_queue("n1", &spec("n1.0d", "dan", 60_000, 600_000), &queue("rd1", &chan)).await.unwrap();
    assert!(matches!(r, ledger::Checkout::Unhealthy { ref cause, .. } if cause == "image not found"), "{r:?}");
}

/// Adds `n` sandboxes and marks them ready; returns what `sandbox_ready` said for each.
async fn fill_ready(l: &Ledger, node: &str, n: usize) -> Vec<i64> {
    let mut out = Vec::new();
    for i in 0..n {
        let sb = format!("{node}.f{i:03x}");
        l.sandbox_add(node, &sb, "tpl").await.unwrap();
        out.push(l.sandbox_ready_code(node, &sb, "c").await.unwrap());
    }
    out
}

//! Ledger scripts against a real Redis (SANDPOOL_TEST_REDIS, default 127.0.0.1:6379).
//! Each test uses its own key prefix and deletes it on drop, pass or fail.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use ledger::{GoneReason, LeaseSpec, Ledger, Lookup, NodeClaim, NodeLost, PinClaim, Ready, SandboxState};

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
        // Every master's keys when SANDPOOL_TEST_REDIS is a cluster's seeds.
        let _ = ledger::delete_all_keys_blocking(&redis_url(), &self.0);
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

/// A ledger under the test's prefix whose node `n1` is live (holds its lease for an hour).
async fn live_ledger(p: &Prefix) -> Ledger {
    let l = Ledger::connect(&redis_url(), &p.0).await.unwrap();
    l.claim_node("n1", "test|n1", 3_600_000, true).await.unwrap();
    l
}

async fn fill(l: &Ledger, node: &str, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let sb = format!("{node}.{i:04x}");
        l.sandbox_add(node, &sb, "tpl").await.unwrap();
        assert_eq!(l.sandbox_ready(node, &sb, &format!("c{i}")).await.unwrap(), Ready::Idle);
        ids.push(sb);
    }
    ids
}

#[tokio::test]
async fn concurrent_checkouts_never_share_a_sandbox() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
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
    let l = live_ledger(&p).await;
    fill(&l, "n1", 1).await;
    let g = l.checkout("n1", &spec("n1.aa", "alice", 60_000, 600_000)).await.unwrap().unwrap();
    let Lookup::Live(s) = l.lookup("n1.aa", "alice", true).await.unwrap() else { panic!("live") };
    assert_eq!((s.sandbox.as_str(), s.fence, s.labels["job"].as_str()), (g.sandbox_id.as_str(), g.fence, "j1"));
    assert_eq!(l.lookup("n1.aa", "mallory", true).await.unwrap(), Lookup::Missing);
    assert_eq!(l.release("n1.aa", "mallory", GoneReason::Deleted).await.unwrap(), None);
    assert_eq!(l.release("n1.aa", "alice", GoneReason::Deleted).await.unwrap(), Some(g.sandbox_id.clone()));
    assert!(matches!(
        l.lookup("n1.aa", "alice", true).await.unwrap(),
        Lookup::Gone { reason: GoneReason::Deleted, .. }
    ));
    assert_eq!(l.lookup("n1.aa", "mallory", true).await.unwrap(), Lookup::Missing);
    let sbs = l.sandboxes("n1").await.unwrap();
    assert_eq!(sbs[0].state, SandboxState::Stopping);
    assert_eq!(l.pop_doomed("n1", Duration::from_secs(1)).await.unwrap(), Some(g.sandbox_id));
    // A stopping sandbox is never handed out again.
    assert_eq!(l.checkout("n1", &spec("n1.bb", "bob", 60_000, 600_000)).await.unwrap(), None);
}

#[tokio::test]
async fn idle_and_hard_deadlines_expire_sessions() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
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
    assert!(matches!(
        l.lookup("n1.02", "t", true).await.unwrap(),
        Lookup::Gone { reason: GoneReason::MaxLifetime, .. }
    ));
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let ended = l.reap_expired("n1", 100).await.unwrap();
    assert_eq!(ended.iter().map(|e| e.session_id.as_str()).collect::<Vec<_>>(), ["n1.01"]);
    assert!(matches!(l.lookup("n1.01", "t", false).await.unwrap(), Lookup::Gone { reason: GoneReason::Expired, .. }));
}

#[tokio::test]
async fn pins_and_sandbox_removal() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    fill(&l, "n1", 1).await;
    assert_eq!(l.pin_claim("t", "ep-1", "n1.0a", Duration::from_secs(30)).await.unwrap(), PinClaim::Claimed);
    // A second claim is told whose claim holds the key.
    assert_eq!(
        l.pin_claim("t", "ep-1", "n1.0b", Duration::from_secs(30)).await.unwrap(),
        PinClaim::Pending { claim: "n1.0a".into() }
    );
    let mut s = spec("n1.0a", "t", 60_000, 600_000);
    s.session_key = Some("ep-1".into());
    let g = l.checkout("n1", &s).await.unwrap().unwrap();
    // A retry that found the session the pending claim made pins it (as a gateway that dies
    // before its `pin_set` leaves it to): only while the key still holds that claim.
    assert!(!l.pin_resolve("t", "ep-1", "other", "n1.0a", 600_000).await.unwrap());
    assert!(l.pin_resolve("t", "ep-1", "n1.0a", "n1.0a", 600_000).await.unwrap());
    assert!(!l.pin_resolve("t", "ep-1", "n1.0a", "n1.0a", 600_000).await.unwrap(), "no longer pending");
    let ttl: u64 = redis::cmd("PTTL").arg(l.keys().pin("t", "ep-1")).query_async(&mut l.connection()).await.unwrap();
    assert!(ttl > 590_000 && ttl <= 600_000, "a resolved pin lives as long as its session may: {ttl} ms");
    l.pin_set("t", "ep-1", "n1.0a", 600_000).await.unwrap();
    assert_eq!(
        l.pin_claim("t", "ep-1", "n1.0c", Duration::from_secs(30)).await.unwrap(),
        PinClaim::Existing { session_id: "n1.0a".into() }
    );
    // Another tenant's key of the same name is independent.
    assert_eq!(l.pin_claim("u", "ep-1", "n1.0d", Duration::from_secs(30)).await.unwrap(), PinClaim::Claimed);
    // The sandbox dies: the session ends with that reason. The pin still names it until the
    // next claimer finds it gone and forgets it (pins live outside the node's slot).
    let ended = l.sandbox_remove("n1", &g.sandbox_id, GoneReason::SandboxFailed).await.unwrap().unwrap();
    assert_eq!((ended.session_id.as_str(), ended.session_key.as_deref()), ("n1.0a", Some("ep-1")));
    assert!(matches!(
        l.lookup("n1.0a", "t", false).await.unwrap(),
        Lookup::Gone { reason: GoneReason::SandboxFailed, .. }
    ));
    assert_eq!(
        l.pin_claim("t", "ep-1", "n1.0e", Duration::from_secs(30)).await.unwrap(),
        PinClaim::Existing { session_id: "n1.0a".into() }
    );
    l.pin_forget("t", "ep-1", "n1.0a").await.unwrap();
    assert_eq!(l.pin_claim("t", "ep-1", "n1.0e", Duration::from_secs(30)).await.unwrap(), PinClaim::Claimed);
    assert!(l.sandboxes("n1").await.unwrap().is_empty());
}

#[tokio::test]
async fn a_lazy_images_profile_is_shared_bounded_and_expires() {
    let p = Prefix::new();
    let l = Ledger::connect(&redis_url(), &p.0).await.unwrap();
    let digest = "sha256:ab12";
    assert_eq!(l.lazy_profile(digest).await.unwrap(), None);
    l.put_lazy_profile(digest, &[3, 0, 7]).await.unwrap();
    assert_eq!(l.lazy_profile(digest).await.unwrap(), Some(vec![3, 0, 7]), "in the order first read");
    // A later profile replaces it; a longer one than the bound is cut.
    let long: Vec<u64> = (0..ledger::MAX_LAZY_PROFILE_CHUNKS as u64 + 10).collect();
    l.put_lazy_profile(digest, &long).await.unwrap();
    let stored = l.lazy_profile(digest).await.unwrap().unwrap();
    assert_eq!(stored, long[..ledger::MAX_LAZY_PROFILE_CHUNKS]);
    let ttl: u64 = redis::cmd("TTL").arg(l.keys().lazy_profile(digest)).query_async(&mut l.connection()).await.unwrap();
    assert!(ttl > ledger::LAZY_PROFILE_TTL_S - 60 && ttl <= ledger::LAZY_PROFILE_TTL_S, "{ttl}");
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
async fn a_warm_checkout_never_queues_and_a_queue_of_length_zero_is_full() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let chan = format!("{}:wake:test", p.0);
    // No idle sandbox: the warm checkout answers none and leaves no waiter behind.
    assert_eq!(l.checkout("n1", &spec("n1.e1", "alice", 60_000, 600_000)).await.unwrap(), None);
    assert_eq!(l.waiting_counts("n1", &["tpl"]).await.unwrap(), vec![0]);
    // A request that may queue, on a queue configured to hold nobody, is told it is full.
    let nobody = ledger::QueueSpec { max_len: 0, ..queue("re1", &chan) };
    let r = l.checkout_or_queue("n1", &spec("n1.e2", "alice", 60_000, 600_000), &nobody).await.unwrap();
    assert_eq!(r, ledger::Checkout::Full { depth: 0 });
    assert_eq!(l.waiting_counts("n1", &["tpl"]).await.unwrap(), vec![0]);
    // With an idle sandbox both are granted it.
    fill(&l, "n1", 1).await;
    assert!(l.checkout("n1", &spec("n1.e3", "alice", 60_000, 600_000)).await.unwrap().is_some());
}

#[tokio::test]
async fn queued_requests_are_served_round_robin_between_tenants() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
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
    assert_eq!(ids, vec![Ready::Granted, Ready::Granted], "both went to waiters");
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
    let (until, told) = l.set_unhealthy("n1", "tpl", "image not found", None, 5_000).await.unwrap();
    assert_eq!(told, 0, "nobody waits any more");
    assert!(until > l.now_ms().await.unwrap() + 3_000, "until is on Redis's clock");
    let r = l.checkout_or_queue("n1", &spec("n1.0d", "dan", 60_000, 600_000), &queue("rd1", &chan)).await.unwrap();
    assert!(matches!(r, ledger::Checkout::Unhealthy { ref cause, .. } if cause == "image not found"), "{r:?}");
}

/// Adds `n` sandboxes and marks them ready; returns what `sandbox_ready` said for each.
async fn fill_ready(l: &Ledger, node: &str, n: usize) -> Vec<Ready> {
    let mut out = Vec::new();
    for i in 0..n {
        let sb = format!("{node}.f{i:03x}");
        l.sandbox_add(node, &sb, "tpl").await.unwrap();
        out.push(l.sandbox_ready(node, &sb, "c").await.unwrap());
    }
    out
}

#[tokio::test]
async fn the_ledger_computes_every_deadline() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    fill(&l, "n1", 1).await;
    let g = l.checkout("n1", &spec("n1.d1", "t", 10_000, 60_000)).await.unwrap().unwrap();
    assert_eq!((g.expires_ms, g.hard_ms), (g.now_ms + 10_000, g.now_ms + 60_000));
    // A call that may run 30 s holds the session busy: idle counts from its end.
    let Lookup::Live(s) = l.lookup_hold("n1.d1", "t", true, 30_000).await.unwrap() else { panic!("live") };
    assert_eq!(s.expires_ms, (s.busy_ms + 10_000).min(s.hard_ms));
    assert!(s.busy_ms >= s.last_ms + 30_000);
    // Paused: only the maximum lifetime runs.
    l.set_paused("n1.d1", "t", true).await.unwrap();
    let Lookup::Live(s) = l.lookup("n1.d1", "t", false).await.unwrap() else { panic!("live") };
    assert_eq!((s.expires_ms, s.paused_ms.is_some()), (s.hard_ms, true));
}

#[tokio::test]
async fn an_unhealthy_template_fails_its_waiters_at_once() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let chan = format!("{}:wake:test", p.0);
    l.checkout_or_queue("n1", &spec("n1.w1", "alice", 60_000, 600_000), &queue("rw1", &chan)).await.unwrap();
    let pull_failed = Some(wire::ErrorCode::ImagePullFailed);
    let (until, told) = l.set_unhealthy("n1", "tpl", "no such image", pull_failed, 2_000).await.unwrap();
    assert_eq!(told, 1);
    let code = Some(wire::ErrorCode::ImagePullFailed);
    assert_eq!(
        l.take_mail("n1", "rw1").await.unwrap(),
        Some(ledger::Mail::Failed { cause: "no such image".into(), until_ms: until, code })
    );
    // A request that comes meanwhile hears the same code.
    let r = l.checkout_or_queue("n1", &spec("n1.w3", "bob", 60_000, 600_000), &queue("rw3", &chan)).await.unwrap();
    assert!(matches!(r, ledger::Checkout::Unhealthy { code: c, .. } if c == code), "{r:?}");
    l.set_healthy("n1", "tpl").await.unwrap();
    let r = l.checkout_or_queue("n1", &spec("n1.w2", "alice", 60_000, 600_000), &queue("rw2", &chan)).await.unwrap();
    assert!(matches!(r, ledger::Checkout::Queued { depth: 1 }), "{r:?}");
}

#[tokio::test]
async fn arrivals_count_by_redis_seconds_and_reservations_prune_themselves() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let before = l.now_ms().await.unwrap() / 1000;
    l.add_arrivals(&[("tpl".into(), 3), ("other".into(), 1)]).await.unwrap();
    l.add_arrivals(&[("tpl".into(), 2)]).await.unwrap();
    let after = l.now_ms().await.unwrap() / 1000 + 1;
    assert_eq!(l.arrivals("tpl", before, after).await.unwrap().iter().sum::<u64>(), 5);
    let now = l.now_ms().await.unwrap();
    let r = |id: &str, ready_by_ms: u64| ledger::Reservation {
        id: id.into(),
        tenant: "t".into(),
        template: "tpl".into(),
        count: 4,
        ready_by_ms,
        hold_s: 1,
    };
    l.record_reservations("t", &[r("old", now - 10_000)]).await.unwrap();
    assert!(l.reservations(now).await.unwrap().is_empty(), "ended holds are not read");
    l.record_reservations("t", &[r("new", now + 60_000)]).await.unwrap();
    let live = l.reservations(now).await.unwrap();
    assert_eq!(live.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["new"]);
    let n: usize =
        redis::cmd("HLEN").arg(l.keys().reservations("t").resv).query_async(&mut l.connection()).await.unwrap();
    assert_eq!(n, 1, "adding a reservation dropped the ended one");
}

async fn hlen(l: &Ledger, key: &str) -> usize {
    redis::cmd("HLEN").arg(key).query_async(&mut l.connection()).await.unwrap()
}

/// Finding 5 of issue 30: adding a reservation scanned one hash of every tenant's
/// reservations. Each tenant's now live in a scope of its own; an add touches only its
/// tenant's scope and drops a bounded number of ended ones; the autoscaler's read sees every
/// tenant's live ones; the legacy hash moves over at a gateway's start.
#[tokio::test]
async fn reservations_live_per_tenant_and_an_add_costs_its_own_request_only() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let now = l.now_ms().await.unwrap();
    let r = |tenant: &str, id: String, ready_by_ms: u64| ledger::Reservation {
        id,
        tenant: tenant.into(),
        template: "tpl".into(),
        count: 1,
        ready_by_ms,
        hold_s: 1,
    };
    // Tenant acme holds 1,000 reservations that ended and one live one.
    let ended: Vec<_> = (0..1000).map(|i| r("acme/rl", format!("a{i}"), now - 60_000)).collect();
    l.add_reservations("acme", &ended).await.unwrap();
    l.record_reservations("acme", &[r("acme/rl", "alive".into(), now + 60_000)]).await.unwrap();
    let acme = l.keys().reservations("acme");
    let acme_left = hlen(&l, &acme.resv).await;
    let step = ledger::MAX_RESERVATION_PRUNE + 1;
    assert_eq!(acme_left, 1000 - step + 1, "an add of one drops at most {step} ended ones");
    // Another tenant's add leaves acme's scope alone.
    l.record_reservations("bob", &[r("bob", "b1".into(), now + 60_000)]).await.unwrap();
    assert_eq!(hlen(&l, &acme.resv).await, acme_left, "bob's add touched acme's reservations");
    assert_eq!(hlen(&l, &l.keys().reservations("bob").resv).await, 1);
    // The autoscaler reads both tenants' live reservations, none of the ended ones.
    let mut live: Vec<String> = l.reservations(now).await.unwrap().into_iter().map(|r| r.id).collect();
    live.sort();
    assert_eq!(live, ["alive", "b1"]);
    // Repeated adds drain acme's ended ones in bounded steps.
    for i in 0..20 {
        l.add_reservations("acme", &[r("acme", format!("n{i}"), now + 60_000)]).await.unwrap();
    }
    assert_eq!(hlen(&l, &acme.resv).await, 21, "ended ones all dropped after enough adds");
    // A tenant's scope expires with its last hold.
    let ttl: i64 = redis::cmd("PTTL").arg(&acme.resv).query_async(&mut l.connection()).await.unwrap();
    assert!(ttl > 0 && ttl <= 60_000 + 60_000 + 1_000, "{ttl}");
    l.delete_reservations("bob", &["b1".into()]).await.unwrap();
    assert_eq!(hlen(&l, &l.keys().reservations("bob").resv).await, 0);

    // The legacy hash of every tenant's reservations moves to their scopes.
    let legacy = l.keys().reservations_legacy();
    let old = r("carol/x", "c1".into(), now + 60_000);
    let gone = r("carol/x", "c0".into(), now - 60_000);
    let _: () = redis::cmd("HSET")
        .arg(&legacy)
        .arg("c1")
        .arg(serde_json::to_string(&old).unwrap())
        .arg("c0")
        .arg(serde_json::to_string(&gone).unwrap())
        .query_async(&mut l.connection())
        .await
        .unwrap();
    assert_eq!(l.migrate_reservations().await.unwrap(), 1, "the live one moves, the ended one goes");
    assert_eq!(hlen(&l, &legacy).await, 0);
    let carol: Vec<String> = l.tenant_reservations("carol", now).await.unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(carol, ["c1"]);
    assert!(l.reservations(now).await.unwrap().iter().any(|r| r.id == "c1"));
    assert_eq!(l.migrate_reservations().await.unwrap(), 0, "a second run finds nothing");
}

/// A cluster-mode Redis started for one test, serving one hash slot at a time. Redis refuses
/// any command or script there that touches a key of another slot ("non local key"), so an
/// episode run through every script proves each stays in the slot of its declared keys.
struct ClusterRedis {
    child: std::process::Child,
    port: u16,
    dir: std::path::PathBuf,
    served: Option<i64>,
}

impl ClusterRedis {
    fn start() -> ClusterRedis {
        let dir = std::env::temp_dir().join(format!("sandpool-cluster-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        for attempt in 0..20u16 {
            // Below the ephemeral range (32768-), with the cluster bus port (+10000) too, so
            // the many client connections of a parallel test run cannot hold it.
            let port = 10000 + (uuid::Uuid::new_v4().as_u128() % 10000) as u16;
            // A config file per attempt: a failed start leaves its own behind.
            let conf = dir.join(format!("nodes-{attempt}.conf"));
            let child = std::process::Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--cluster-enabled", "yes"])
                .args(["--cluster-require-full-coverage", "no"])
                .args(["--cluster-config-file", conf.to_str().unwrap()])
                .args(["--save", "", "--appendonly", "no", "--dir", dir.to_str().unwrap()])
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("redis-server (package redis-server) runs");
            let mut c = ClusterRedis { child, port, dir: dir.clone(), served: None };
            if c.wait_ok() {
                return c;
            }
            let _ = c.child.kill();
            let _ = c.child.wait();
        }
        panic!("could not start a cluster-mode redis-server");
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn wait_ok(&mut self) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if redis::Client::open(self.url()).and_then(|c| c.get_connection()).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// Serves only the slot of `key` from now on.
    fn serve_only_slot_of(&mut self, key: &str) {
        let mut conn = redis::Client::open(self.url()).unwrap().get_connection().unwrap();
        if let Some(old) = self.served.take() {
            redis::cmd("CLUSTER").arg("DELSLOTS").arg(old).query::<()>(&mut conn).unwrap();
        }
        let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut conn).unwrap();
        redis::cmd("CLUSTER").arg("ADDSLOTS").arg(slot).query::<()>(&mut conn).unwrap();
        self.served = Some(slot);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut conn).unwrap_or_default();
            if info.contains("cluster_state:ok") {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "cluster state never ok: {info}");
            std::thread::sleep(Duration::from_millis(50));
        }
        // A command on another slot is refused, so the checks below mean something.
        let other: redis::RedisResult<()> = redis::cmd("SET").arg("{elsewhere}x").arg(1).query(&mut conn);
        assert!(other.is_err() || key.contains("{elsewhere}"), "a key of another slot was served");
    }
}

impl Drop for ClusterRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn every_script_stays_in_one_cluster_slot() {
    let mut cluster = ClusterRedis::start();
    let l = Ledger::connect(&cluster.url(), "sp").await.unwrap();
    let chan = l.wake_channel("g1");
    // The node's slot: every node script and command.
    cluster.serve_only_slot_of(&l.keys().node("n1").sbs());
    assert_eq!(
        l.claim_node("n1", "h|1", 60_000, true).await.unwrap(),
        NodeClaim::Claimed { fresh: true, known: false }
    );
    l.set_room("n1", 10, 3_000).await.unwrap();
    fill(&l, "n1", 2).await;
    let mut s = spec("n1.c1", "t", 60_000, 600_000);
    s.session_key = Some("k".into());
    let g = l.checkout("n1", &s).await.unwrap().unwrap();
    assert!(matches!(l.lookup_hold("n1.c1", "t", true, 5_000).await.unwrap(), Lookup::Live(_)));
    l.set_paused("n1.c1", "t", true).await.unwrap();
    l.set_paused("n1.c1", "t", false).await.unwrap();
    l.checkout("n1", &spec("n1.c2", "t", 60_000, 600_000)).await.unwrap().unwrap();
    // Queue, hand a new sandbox to the waiter, collect; queue and leave; fail a waiter.
    let r = l.checkout_or_queue("n1", &spec("n1.c3", "u", 60_000, 600_000), &queue("q1", &chan)).await.unwrap();
    assert!(matches!(r, ledger::Checkout::Queued { .. }));
    assert_eq!(fill_ready(&l, "n1", 1).await, vec![Ready::Granted]);
    assert!(matches!(l.take_mail("n1", "q1").await.unwrap(), Some(ledger::Mail::Granted(_))));
    l.checkout_or_queue("n1", &spec("n1.c4", "u", 60_000, 600_000), &queue("q2", &chan)).await.unwrap();
    assert_eq!(l.dequeue("n1", "q2", "tpl", "u").await.unwrap(), None);
    l.checkout_or_queue("n1", &spec("n1.c5", "u", 60_000, 600_000), &queue("q3", &chan)).await.unwrap();
    assert_eq!(l.set_unhealthy("n1", "tpl", "broken", None, 1_000).await.unwrap().1, 1);
    l.set_healthy("n1", "tpl").await.unwrap();
    assert_eq!(l.waiting_counts("n1", &["tpl"]).await.unwrap(), vec![0]);
    // A waiter withdraws (its grant goes to the next), whose gateway is gone: past the claim
    // window its grant is undone. Recount the queue.
    l.checkout_or_queue("n1", &spec("n1.c6", "u", 60_000, 600_000), &queue("q4", &chan)).await.unwrap();
    l.checkout_or_queue("n1", &spec("n1.c7", "u", 60_000, 600_000), &queue("q5", &chan)).await.unwrap();
    assert_eq!(ready(&l, "n1.e001").await, Ready::Granted);
    l.withdraw("n1", "q4", "tpl", "u").await.unwrap();
    end_claim_windows(&l, "n1").await;
    l.reap_expired("n1", 10).await.unwrap();
    assert_eq!(l.recount_waiters("n1", &["tpl"]).await.unwrap(), 0);
    // End sessions every way.
    assert!(l.ungrant("n1.c2", "t").await.unwrap());
    assert_eq!(l.release("n1.c1", "t", GoneReason::Deleted).await.unwrap(), Some(g.sandbox_id));
    assert!(l.sandbox_remove("n1", "n1.f000", GoneReason::SandboxFailed).await.unwrap().is_some());
    l.reap_expired("n1", 10).await.unwrap();
    fill(&l, "n1", 1).await;
    // The sandboxes of the undone grants are idle again, beside the new one.
    assert_eq!(l.shrink("n1", "tpl", 5).await.unwrap(), 3);
    assert!(l.pop_doomed("n1", Duration::from_millis(100)).await.unwrap().is_some());
    l.sandboxes("n1").await.unwrap();
    l.idle_counts("n1", &["tpl"]).await.unwrap();
    l.write_stats("n1", &Default::default()).await.unwrap();
    l.stats("n1").await.unwrap().unwrap();
    l.set_targets("n1", &[("tpl".to_string(), 3)].into(), 5).await.unwrap();
    assert_eq!(l.targets("n1").await.unwrap().1["tpl"], 3);
    l.private_templates("n1").await.unwrap();
    l.release_node("n1", "h|1").await.unwrap();
    assert!(matches!(l.give_up_node("n1", 10).await.unwrap(), NodeLost::GivenUp { .. }));
    // A pin's own slot.
    cluster.serve_only_slot_of(&l.keys().pin("t", "k"));
    assert_eq!(l.pin_claim("t", "k", "claim", Duration::from_secs(30)).await.unwrap(), PinClaim::Claimed);
    assert!(l.pin_resolve("t", "k", "claim", "n1.c1", 600_000).await.unwrap());
    l.pin_set("t", "k", "n1.c1", 600_000).await.unwrap();
    l.pin_forget("t", "k", "n1.c1").await.unwrap();
    // The registry's slot.
    cluster.serve_only_slot_of(&l.keys().nodes());
    l.register_node(&ledger::NodeInfo { id: "n1".into(), addr: "http://x".into(), started_ms: 1 }).await.unwrap();
    l.heartbeat("n1", 2).await.unwrap();
    assert_eq!(l.nodes().await.unwrap().len(), 1);
    assert_eq!(l.node_states().await.unwrap().len(), 1);
    let now_ms = l.now_ms().await.unwrap();
    let res = ledger::Reservation {
        id: "r1".into(),
        tenant: "t".into(),
        template: "tpl".into(),
        count: 1,
        ready_by_ms: now_ms + 1_000,
        hold_s: 1,
    };
    l.reservation_index_add("t", res.ends_ms()).await.unwrap();
    // The quota sweep's index of tenants (noted here, so the admission below needs only the
    // tenant's slot).
    l.quota_note_top("acme").await.unwrap();
    assert!(l.reservations(now_ms + 5_000).await.unwrap().is_empty());
    // One top-level tenant's reservations.
    cluster.serve_only_slot_of(&l.keys().reservations("t").resv);
    assert_eq!(l.add_reservations("t", &[res]).await.unwrap(), 1);
    assert_eq!(l.tenant_reservations("t", 0).await.unwrap().len(), 1);
    l.delete_reservations("t", &["r1".into()]).await.unwrap();
    // One template's arrivals.
    cluster.serve_only_slot_of(&l.keys().arrivals("tpl", 0));
    l.add_arrivals(&[("tpl".into(), 2)]).await.unwrap();
    let now_s = l.now_ms().await.unwrap() / 1000;
    assert_eq!(l.arrivals("tpl", now_s - 2, now_s + 1).await.unwrap().iter().sum::<u64>(), 2);
    // One top-level tenant's quota scope: every level of its paths.
    cluster.serve_only_slot_of(&l.keys().quota("acme").lim);
    let d = wire::quotas::QuotaLimits::default();
    l.quota_set("acme/rl", Some(&limits(3)), &d).await.unwrap();
    assert_eq!(admit(&l, "s:1", "acme/rl/x").await, Admission::Admitted);
    l.quota_queue("s:1", "acme/rl/x", true, &d).await.unwrap();
    assert_eq!(l.quota_view("acme", &d, true).await.unwrap().usage.sessions, 1);
    assert_eq!(l.quota_release("acme", &["s:1".into()]).await.unwrap(), 1);
    assert_eq!(l.quota_index_tenant("acme").await.unwrap(), 0);
    // Who set a limit (the admin marker) is in the same scope.
    let tenant = l.quota_set_by("acme/rl", None, &d, ledger::SetBy::Tenant).await.unwrap();
    assert!(matches!(tenant, SetLimits::AdminSet { .. }), "{tenant:?}");
    assert_eq!(l.quota_view("acme/rl", &d, false).await.unwrap().admin_set, limits(3));
    // One top-level tenant's functions (every level of its paths) and their invocations.
    cluster.serve_only_slot_of(&l.keys().function("acme", "f").def);
    let (def, _) = l.function_put(&function("acme/rl", "f", 2)).await.unwrap();
    assert!(matches!(l.env_take("acme/rl", "f", "i1", 5_000).await.unwrap(), Take::Taken { env: None, .. }));
    assert!(l.env_put("acme/rl", "f", "i1", &env("n1.s1", &def), true, 1.0).await.unwrap());
    l.env_forget("acme/rl", "f", "n1.s1").await.unwrap();
    l.env_counts("acme/rl", "f").await.unwrap();
    l.function_stats("acme/rl", "f").await.unwrap();
    l.function_get("acme/rl", "f").await.unwrap().unwrap();
    assert_eq!(l.function_list("acme/rl").await.unwrap().len(), 1);
    l.invocation_set("acme/rl", "i1", "{}", 60).await.unwrap();
    l.invocation_get("acme/rl", "i1").await.unwrap().unwrap();
    assert!(l.function_delete("acme/rl", "f").await.unwrap().is_some());
    cluster.serve_only_slot_of(&l.keys().functions_index());
    l.functions_index_add("acme/rl", "f").await.unwrap();
    assert_eq!(l.functions_all().await.unwrap(), vec![("acme/rl".to_string(), "f".to_string())]);
    l.functions_index_remove("acme/rl", "f").await.unwrap();
}

// ---- Functions ----------------------------------------------------------------------------

use ledger::{Env, FunctionDef, Take};

fn function(owner: &str, name: &str, max_concurrency: u32) -> FunctionDef {
    FunctionDef {
        name: name.into(),
        owner: owner.into(),
        template: "tpl".into(),
        mode: wire::functions::FunctionMode::Runtime,
        handler: vec!["w".into()],
        env: Default::default(),
        timeout_ms: 1_000,
        max_concurrency,
        min_warm: 0,
        max_env_invocations: 3,
        env_idle_s: 60,
        version: 0,
        created_ms: 0,
        updated_ms: 0,
    }
}

fn env(session: &str, def: &FunctionDef) -> Env {
    Env {
        session: session.into(),
        version: def.version,
        uses: 1,
        sandbox: format!("{session}-sb"),
        fence: 7,
        idle_ms: 0,
    }
}

#[tokio::test]
async fn function_environments_are_reused_within_their_limits_and_version() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    assert!(matches!(l.env_take("acme", "f", "i0", 5_000).await.unwrap(), Take::Missing));
    let (v1, retired) = l.function_put(&function("acme", "f", 2)).await.unwrap();
    assert_eq!((v1.version, retired.len()), (1, 0));
    // Two slots: the third invocation is refused; a freed slot is taken again.
    for i in ["i1", "i2"] {
        assert!(matches!(l.env_take("acme", "f", i, 5_000).await.unwrap(), Take::Taken { env: None, .. }));
    }
    assert!(matches!(l.env_take("acme", "f", "i3", 5_000).await.unwrap(), Take::Busy(_)));
    // A retry of a held invocation keeps its slot.
    assert!(matches!(l.env_take("acme", "f", "i2", 5_000).await.unwrap(), Take::Taken { .. }));
    assert!(l.env_put("acme", "f", "i1", &env("n1.a", &v1), true, 2.0).await.unwrap());
    assert!(l.env_put("acme", "f", "i2", &env("n1.b", &v1), true, 2.0).await.unwrap());
    assert_eq!(l.env_counts("acme", "f").await.unwrap(), ledger::EnvCounts { total: 2, idle: 2, in_flight: 0 });
    // The warmest (last returned) first; a failed one is retired, not kept.
    let Take::Taken { env: Some(e), .. } = l.env_take("acme", "f", "i4", 5_000).await.unwrap() else { panic!() };
    assert_eq!((e.session.as_str(), e.sandbox.as_str(), e.fence), ("n1.b", "n1.b-sb", 7));
    assert!(!l.env_put("acme", "f", "i4", &e, false, 1.0).await.unwrap());
    // An environment that served `max_env_invocations` (3) is retired.
    let Take::Taken { env: Some(e), .. } = l.env_take("acme", "f", "i5", 5_000).await.unwrap() else { panic!() };
    l.env_slot_free("acme", "f", "i5").await.unwrap();
    assert_eq!(e.session, "n1.a");
    let used_up = Env { uses: 3, ..e };
    assert!(!l.env_put("acme", "f", "i5", &used_up, true, 1.0).await.unwrap());
    assert_eq!(l.env_counts("acme", "f").await.unwrap(), ledger::EnvCounts::default());
    assert_eq!(l.function_stats("acme", "f").await.unwrap(), (4, 6.0));
    // A new version retires the idle environments of the old one, and one coming back late.
    assert!(matches!(l.env_take("acme", "f", "i6", 5_000).await.unwrap(), Take::Taken { env: None, .. }));
    assert!(matches!(l.env_take("acme", "f", "i7", 5_000).await.unwrap(), Take::Taken { env: None, .. }));
    assert!(l.env_put("acme", "f", "i6", &env("n1.c", &v1), true, 1.0).await.unwrap());
    let (v2, retired) = l.function_put(&function("acme", "f", 2)).await.unwrap();
    assert_eq!((v2.version, v2.created_ms), (2, v1.created_ms));
    assert_eq!(retired, vec!["n1.c".to_string()]);
    assert!(!l.env_put("acme", "f", "i7", &env("n1.d", &v1), true, 1.0).await.unwrap());
    // Another owner's function of the same name is another function.
    assert!(matches!(l.env_take("acme/other", "f", "i8", 5_000).await.unwrap(), Take::Missing));
    assert_eq!(l.function_list("acme").await.unwrap().len(), 1);
    assert!(l.function_list("acme/other").await.unwrap().is_empty());
    // Deleting answers every environment, busy ones too.
    assert!(matches!(l.env_take("acme", "f", "i9", 5_000).await.unwrap(), Take::Taken { .. }));
    assert!(l.env_put("acme", "f", "i9", &env("n1.e", &v2), true, 1.0).await.unwrap());
    assert_eq!(l.function_delete("acme", "f").await.unwrap(), Some(vec!["n1.e".to_string()]));
    assert_eq!(l.function_delete("acme", "f").await.unwrap(), None);
}

#[tokio::test]
async fn an_invocation_slot_ends_by_itself_at_its_deadline() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    l.function_put(&FunctionDef { timeout_ms: 100, ..function("acme", "g", 1) }).await.unwrap();
    assert!(matches!(l.env_take("acme", "g", "i1", 100).await.unwrap(), Take::Taken { .. }));
    assert!(matches!(l.env_take("acme", "g", "i2", 200).await.unwrap(), Take::Busy(_)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(l.env_take("acme", "g", "i2", 200).await.unwrap(), Take::Taken { .. }));
}

// ---- Quotas -------------------------------------------------------------------------------

use ledger::{Access, Admission, Cost, SetBy, SetLimits};
use wire::quotas::{Dimension, QuotaLimits};

fn limits(sessions: u64) -> QuotaLimits {
    QuotaLimits { sessions: Some(sessions), ..Default::default() }
}

/// A create's admission: one session of a 1-cpu, 256 MiB template.
async fn admit(l: &Ledger, lease: &str, path: &str) -> Admission {
    let d = QuotaLimits::default();
    l.quota_admit(lease, path, Cost::session(1.0, 256), &d, true, 60_000, 0).await.unwrap()
}

async fn used_sessions(l: &Ledger, path: &str) -> u64 {
    l.quota_view(path, &QuotaLimits::default(), false).await.unwrap().usage.sessions
}

#[tokio::test]
async fn a_quota_of_ten_admits_exactly_ten_of_a_hundred_concurrent_creates() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    assert_eq!(l.quota_set("acme", Some(&limits(10)), &QuotaLimits::default()).await.unwrap(), SetLimits::Ok);
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let l = l.clone();
            tokio::spawn(async move { admit(&l, &format!("s:{i:032x}"), "acme/rl").await })
        })
        .collect();
    let mut admitted = 0;
    let mut first_admitted = None;
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await.unwrap() {
            Admission::Admitted => {
                admitted += 1;
                first_admitted.get_or_insert(i);
            }
            Admission::Denied { dimension, path, limit, used, .. } => {
                assert_eq!((dimension, path.as_str(), limit, used), (Dimension::Sessions, "acme", 10.0, 10.0));
            }
            other => panic!("admission answered {other:?}"),
        }
    }
    assert_eq!(admitted, 10);
    let view = l.quota_view("acme", &QuotaLimits::default(), true).await.unwrap();
    assert_eq!((view.usage.sessions, view.usage.cpus, view.usage.memory_mb), (10, 10.0, 2560));
    assert_eq!(view.children.len(), 1, "acme/rl shows as a child");
    assert_eq!(view.children[0].usage.sessions, 10);
    // Admitting a held lease again is idempotent; giving it back twice counts once.
    // (Which ten were admitted depends on the order the requests reached Redis.)
    let held_one = format!("s:{:032x}", first_admitted.unwrap());
    assert_eq!(admit(&l, &held_one, "acme/rl").await, Admission::Admitted);
    let held: Vec<String> = (0..100).map(|i| format!("s:{i:032x}")).collect();
    assert_eq!(l.quota_release("acme", &held).await.unwrap(), 10);
    assert_eq!(l.quota_release("acme", &held).await.unwrap(), 0);
    assert_eq!(used_sessions(&l, "acme").await, 0);
    assert_eq!(used_sessions(&l, "acme/rl").await, 0);
}

#[tokio::test]
async fn nested_limits_bind_every_level_and_children_may_not_exceed_parents() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let d = QuotaLimits::default();
    l.quota_set("lab", Some(&limits(6)), &d).await.unwrap();
    l.quota_set("lab/a", Some(&limits(4)), &d).await.unwrap();
    l.quota_set("lab/b", Some(&limits(4)), &d).await.unwrap();
    assert_eq!(
        l.quota_set("lab/a/run1", Some(&limits(5)), &d).await.unwrap(),
        SetLimits::Above { dimension: "sessions".into(), path: "lab/a".into(), limit: 4.0 }
    );
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let l = l.clone();
            let path = if i % 2 == 0 { "lab/a/run1" } else { "lab/b" };
            tokio::spawn(async move { (path, admit(&l, &format!("s:{i:032x}"), path).await) })
        })
        .collect();
    let (mut a, mut b) = (0, 0);
    for t in tasks {
        if let (path, Admission::Admitted) = t.await.unwrap() {
            if path == "lab/b" { b += 1 } else { a += 1 }
        }
    }
    assert!(a <= 4 && b <= 4 && a + b == 6, "a {a}, b {b}");
    assert_eq!(used_sessions(&l, "lab").await, 6);
    assert_eq!(used_sessions(&l, "lab/a").await, a);
    assert_eq!(used_sessions(&l, "lab/a/run1").await, a);
    // Removing a child's own limit leaves it bound by its parent.
    l.quota_set("lab/b", None, &d).await.unwrap();
    assert!(matches!(admit(&l, "s:ff", "lab/b").await, Admission::Denied { path, .. } if path == "lab"));
    // The configured default binds a top-level tenant without a limit of its own.
    let dflt = limits(1);
    assert_eq!(
        l.quota_admit("s:1", "other", Cost::session(1.0, 1), &dflt, true, 60_000, 0).await.unwrap(),
        Admission::Admitted
    );
    assert!(matches!(
        l.quota_admit("s:2", "other/x", Cost::session(1.0, 1), &dflt, true, 60_000, 0).await.unwrap(),
        Admission::Denied { dimension: Dimension::Sessions, path, .. } if path == "other"
    ));
}

#[tokio::test]
async fn isolation_classes_bind_every_level_and_nest() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let classes =
        |c: &[&str]| QuotaLimits { isolation: Some(c.iter().map(|s| s.to_string()).collect()), ..Default::default() };
    let d = classes(&["runc"]);
    let of = |lease: &'static str, path: &'static str, runtime: &'static str| {
        let l = &l;
        let d = &d;
        async move {
            l.quota_admit(lease, path, Cost::session(1.0, 1).of_isolation(runtime), d, true, 60_000, 0).await.unwrap()
        }
    };
    // The default binds a top-level tenant that sets nothing.
    assert_eq!(of("s:1", "acme", "runc").await, Admission::Admitted);
    let Admission::Forbidden { path, isolation, allowed } = of("s:2", "acme/rl", "runsc").await else {
        panic!("runsc is outside the default");
    };
    assert_eq!((path.as_str(), isolation.as_str(), allowed), ("acme", "runsc", vec!["runc".to_string()]));
    // A tenant's own list replaces the default; a child may narrow it, never widen it.
    assert_eq!(l.quota_set("acme", Some(&classes(&["runc", "runsc"])), &d).await.unwrap(), SetLimits::Ok);
    assert_eq!(of("s:3", "acme/rl", "runsc").await, Admission::Admitted);
    assert_eq!(l.quota_set("acme/rl", Some(&classes(&["runsc"])), &d).await.unwrap(), SetLimits::Ok);
    assert!(matches!(of("s:4", "acme/rl/x", "runc").await, Admission::Forbidden { path, .. } if path == "acme/rl"));
    assert!(matches!(
        l.quota_set("acme/rl/x", Some(&classes(&["crun"])), &d).await.unwrap(),
        SetLimits::Outside { path, allowed } if path == "acme/rl" && allowed == ["runsc"]
    ));
    // An empty list allows nothing; a request naming no class is not checked.
    assert_eq!(l.quota_set("acme/none", Some(&classes(&[])), &d).await.unwrap(), SetLimits::Ok);
    assert!(matches!(of("s:5", "acme/none", "runc").await, Admission::Forbidden { allowed, .. } if allowed.is_empty()));
    let plain = l.quota_admit("s:6", "acme/none", Cost::session(1.0, 1), &d, true, 60_000, 0).await.unwrap();
    assert_eq!(plain, Admission::Admitted);
    // A refused request holds nothing.
    assert_eq!(used_sessions(&l, "acme").await, 3);
}

#[tokio::test]
async fn the_create_rate_allows_a_burst_then_the_refill_rate() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let d = QuotaLimits::default();
    let rate = QuotaLimits { create_rate: Some(4.0), create_burst: Some(3), ..Default::default() };
    l.quota_set("acme", Some(&rate), &d).await.unwrap();
    for i in 0..3 {
        assert_eq!(admit(&l, &format!("s:{i}"), "acme").await, Admission::Admitted, "burst create {i}");
    }
    let Admission::Denied { dimension, retry_ms, limit, .. } = admit(&l, "s:3", "acme").await else {
        panic!("the fourth create at once is over the burst");
    };
    assert_eq!((dimension, limit), (Dimension::CreateRate, 4.0));
    assert!((1..=250).contains(&retry_ms), "one token every 250 ms: retry in {retry_ms} ms");
    tokio::time::sleep(Duration::from_millis(retry_ms + 20)).await;
    assert_eq!(admit(&l, "s:3", "acme").await, Admission::Admitted, "a token has arrived after Retry-After");
    assert!(matches!(admit(&l, "s:4", "acme").await, Admission::Denied { dimension: Dimension::CreateRate, .. }));
}

#[tokio::test]
async fn queue_slots_and_reservations_hold_quota_until_they_end() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let d = QuotaLimits { queued: Some(2), ..Default::default() };
    for i in 0..3 {
        admit(&l, &format!("s:{i}"), "acme").await;
    }
    assert_eq!(l.quota_queue("s:0", "acme", true, &d).await.unwrap(), Admission::Admitted);
    assert_eq!(l.quota_queue("s:1", "acme", true, &d).await.unwrap(), Admission::Admitted);
    assert!(matches!(
        l.quota_queue("s:2", "acme", true, &d).await.unwrap(),
        Admission::Denied { dimension: Dimension::Queued, limit, .. } if limit == 2.0
    ));
    l.quota_queue("s:0", "acme", false, &d).await.unwrap();
    assert_eq!(l.quota_queue("s:2", "acme", true, &d).await.unwrap(), Admission::Admitted);
    // Giving a queued lease back frees its queue slot too.
    l.quota_release("acme", &["s:2".into()]).await.unwrap();
    assert_eq!(l.quota_view("acme", &d, false).await.unwrap().usage.queued, 1);
    assert_eq!(l.quota_queue("s:9", "acme", true, &d).await.unwrap(), Admission::Missing);

    // A reservation's lease ends by itself when its hold does.
    let r = QuotaLimits { reserved: Some(10), ..Default::default() };
    let cost = Cost { reserved: 8, ..Cost::default() };
    assert_eq!(l.quota_admit("r:1", "acme", cost.clone(), &r, false, 0, 300).await.unwrap(), Admission::Admitted);
    assert!(matches!(
        l.quota_admit("r:2", "acme", cost.clone(), &r, false, 0, 300).await.unwrap(),
        Admission::Denied { dimension: Dimension::Reserved, .. }
    ));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(l.quota_admit("r:2", "acme", cost, &r, false, 0, 300).await.unwrap(), Admission::Admitted);
    assert_eq!(l.quota_view("acme", &r, false).await.unwrap().usage.reserved, 8);
}

#[tokio::test]
async fn every_ending_gives_the_lease_back_and_verify_finds_no_drift() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let d = QuotaLimits::default();
    l.heartbeat("n1", l.now_ms().await.unwrap()).await.unwrap();
    let sbs = fill(&l, "n1", 4).await;
    let sid = |i: u32| format!("n1.{i:032x}");
    for i in 0..4 {
        assert_eq!(admit(&l, &ledger::session_lease(&sid(i)), "acme/rl").await, Admission::Admitted);
        let idle = if i == 1 { 1 } else { 60_000 };
        l.checkout("n1", &spec(&sid(i), "acme/rl", idle, 600_000)).await.unwrap().unwrap();
    }
    assert_eq!(used_sessions(&l, "acme").await, 4);
    // Deleted (by an ancestor), reaped at its idle timeout, failed sandbox: each queues a return.
    assert!(l.release(&sid(0), "acme", GoneReason::Deleted).await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(l.reap_expired("n1", 10).await.unwrap().len(), 1);
    let failed = l.lookup_as(&sid(2), "acme/rl", Access::Owner, false, 0).await.unwrap();
    let Lookup::Live(failed) = failed else { panic!("session 2 is live") };
    assert!(l.sandbox_remove("n1", &failed.sandbox, GoneReason::SandboxFailed).await.unwrap().is_some());
    assert_eq!(used_sessions(&l, "acme").await, 4, "returns wait on the node's list");
    assert_eq!(l.quota_drain_returns("n1", 256).await.unwrap(), 3);
    assert_eq!(used_sessions(&l, "acme").await, 1);
    assert_eq!(l.quota_drain_returns("n1", 256).await.unwrap(), 0);
    // An orphan: a lease whose create died before any session existed (deadline 0: at once).
    l.quota_admit("s:dead", "acme/ml", Cost::session(1.0, 1), &d, true, 0, 0).await.unwrap();
    assert_eq!(used_sessions(&l, "acme").await, 2);
    let v = l.quota_verify(&d, false).await.unwrap();
    assert_eq!(v.orphans_released, 1, "{v:?}");
    assert!(v.drift.is_empty(), "{v:?}");
    assert_eq!(used_sessions(&l, "acme").await, 1, "the live session keeps its lease");
    // Counted usage that went wrong is reported, and fixed on request.
    let mut conn = l.connection();
    let _: () = redis::cmd("HINCRBY")
        .arg(&l.keys().quota("acme").used)
        .arg("acme|sessions")
        .arg(5)
        .query_async(&mut conn)
        .await
        .unwrap();
    let v = l.quota_verify(&d, true).await.unwrap();
    assert_eq!(v.drift.len(), 1, "{v:?}");
    assert_eq!((v.drift[0].counted, v.drift[0].recomputed), (6.0, 1.0));
    assert!(l.quota_verify(&d, false).await.unwrap().drift.is_empty());
    assert_eq!(sbs.len(), 4);
}

#[tokio::test]
async fn ancestors_manage_descendants_sessions_and_nobody_else_sees_them() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    fill(&l, "n1", 1).await;
    l.checkout("n1", &spec("n1.aa", "acme/rl/ppo", 60_000, 600_000)).await.unwrap().unwrap();
    let live = |who: &'static str, access| {
        let l = l.clone();
        async move { matches!(l.lookup_as("n1.aa", who, access, false, 0).await.unwrap(), Lookup::Live(_)) }
    };
    assert!(live("acme/rl/ppo", Access::Owner).await);
    assert!(live("acme", Access::Subtree).await && live("acme/rl", Access::Subtree).await);
    assert!(!live("acme", Access::Owner).await, "using a session is for its owner only");
    for stranger in ["acme/ml", "acme/r", "acme-2", "acme/rl/ppo-2", "acme/rl/ppo/x"] {
        assert!(!live(stranger, Access::Subtree).await, "{stranger} must not see it");
    }
    assert_eq!(l.release("n1.aa", "acme/ml", GoneReason::Deleted).await.unwrap(), None);
    assert!(l.set_paused("n1.aa", "acme/rl", true).await.unwrap().is_some());
    assert!(l.release("n1.aa", "acme", GoneReason::Deleted).await.unwrap().is_some());
}

#[tokio::test]
async fn a_lease_grows_only_where_every_level_has_room() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let d = QuotaLimits::default();
    let disk = QuotaLimits { private_templates: Some(5), private_template_mb: Some(100), ..Default::default() };
    l.quota_set("acme", Some(&disk), &d).await.unwrap();
    let one = Cost { private_templates: 1, ..Cost::default() };
    assert_eq!(l.quota_admit("t:1", "acme/rl", one.clone(), &d, false, 60_000, 0).await.unwrap(), Admission::Admitted);
    let mb = |n| Cost { private_template_mb: n, ..Cost::default() };
    assert_eq!(l.quota_extend("t:1", "acme/rl", mb(60), &d).await.unwrap(), Admission::Admitted);
    l.quota_admit("t:2", "acme/rl", one, &d, false, 60_000, 0).await.unwrap();
    assert!(matches!(
        l.quota_extend("t:2", "acme/rl", mb(50), &d).await.unwrap(),
        Admission::Denied { dimension: Dimension::PrivateTemplateMb, limit, used, .. } if (limit, used) == (100.0, 60.0)
    ));
    assert_eq!(l.quota_extend("t:9", "acme/rl", mb(1), &d).await.unwrap(), Admission::Missing);
    let usage = l.quota_view("acme", &d, false).await.unwrap().usage;
    assert_eq!((usage.private_templates, usage.private_template_mb), (2, 60));
    // Giving a grown lease back gives all of it back.
    l.quota_release("acme", &["t:1".into(), "t:2".into()]).await.unwrap();
    let usage = l.quota_view("acme", &d, false).await.unwrap().usage;
    assert_eq!((usage.private_templates, usage.private_template_mb), (0, 0));
}

#[tokio::test]
async fn an_unseen_grant_is_undone_back_into_the_pool() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let sbs = fill(&l, "n1", 1).await;
    let g = l.checkout("n1", &spec("n1.a1", "acme", 60_000, 600_000)).await.unwrap().unwrap();
    assert_eq!(l.idle_counts("n1", &["tpl"]).await.unwrap(), vec![0]);
    assert!(l.ungrant("n1.a1", "acme").await.unwrap());
    assert!(!l.ungrant("n1.a1", "acme").await.unwrap(), "undone once");
    assert_eq!(l.lookup("n1.a1", "acme", false).await.unwrap(), Lookup::Missing, "no tombstone: it never was");
    assert_eq!(l.idle_counts("n1", &["tpl"]).await.unwrap(), vec![1]);
    assert!(l.active_sessions("n1").await.unwrap().is_empty());
    assert!(l.pop_doomed("n1", Duration::from_millis(50)).await.unwrap().is_none(), "the sandbox is not destroyed");
    let again = l.checkout("n1", &spec("n1.a2", "acme", 60_000, 600_000)).await.unwrap().unwrap();
    assert_eq!(again.sandbox_id, sbs[0]);
    assert!(again.fence > g.fence);
}

// ---------- node liveness ----------

#[tokio::test]
async fn a_node_id_has_one_holder_and_a_restart_on_its_host_takes_it_over() {
    let p = Prefix::new();
    let l = Ledger::connect(&redis_url(), &p.0).await.unwrap();
    assert_eq!(
        l.claim_node("n1", "hostA/e1|i1", 60_000, true).await.unwrap(),
        NodeClaim::Claimed { fresh: true, known: false }
    );
    assert_eq!(
        l.claim_node("n1", "hostA/e1|i1", 60_000, false).await.unwrap(),
        NodeClaim::Claimed { fresh: false, known: false }
    );
    // Another host with the same id is refused, at start and later.
    for start in [true, false] {
        let NodeClaim::Held { by, ttl_ms } = l.claim_node("n1", "hostB/e2|i9", 60_000, start).await.unwrap() else {
            panic!("another host took a live node's id")
        };
        assert_eq!(by, "hostA/e1|i1");
        assert!(ttl_ms > 50_000);
    }
    // A restart on the same host takes the lease over; the old instance then finds it held.
    fill(&l, "n1", 1).await;
    assert_eq!(
        l.claim_node("n1", "hostA/e1|i2", 60_000, true).await.unwrap(),
        NodeClaim::Claimed { fresh: false, known: true }
    );
    assert!(matches!(l.claim_node("n1", "hostA/e1|i1", 60_000, false).await.unwrap(), NodeClaim::Held { .. }));
    // Given back (a clean stop) only by its holder; then vacant.
    l.release_node("n1", "hostA/e1|i1").await.unwrap();
    assert!(matches!(l.claim_node("n1", "hostB/e2|i9", 60_000, false).await.unwrap(), NodeClaim::Held { .. }));
    l.release_node("n1", "hostA/e1|i2").await.unwrap();
    assert_eq!(
        l.claim_node("n1", "hostB/e2|i9", 60_000, false).await.unwrap(),
        NodeClaim::Claimed { fresh: true, known: true }
    );
}

#[tokio::test]
async fn a_down_node_gets_no_placement_and_its_sessions_answer_node_down_until_it_returns() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    fill(&l, "n1", 3).await;
    l.checkout("n1", &spec("n1.a1", "acme", 600_000, 3_600_000)).await.unwrap().unwrap();
    l.release_node("n1", "test|n1").await.unwrap();
    // Down: no warm checkout, no queueing, and a use of a session answers node_down (a read
    // still sees it).
    assert_eq!(l.checkout("n1", &spec("n1.a2", "acme", 60_000, 600_000)).await.unwrap(), None);
    let r = l.checkout_or_queue("n1", &spec("n1.a3", "acme", 60_000, 600_000), &queue("q1", "ch")).await.unwrap();
    assert_eq!(r, ledger::Checkout::Down);
    assert_eq!(l.lookup("n1.a1", "acme", true).await.unwrap(), Lookup::NodeDown);
    assert!(matches!(l.lookup("n1.a1", "acme", false).await.unwrap(), Lookup::Live(_)));
    assert_eq!(l.lookup("n1.a1", "mallory", true).await.unwrap(), Lookup::Missing, "others still see nothing");
    // Back: the session is usable and the pool serves again.
    l.claim_node("n1", "test|n1", 60_000, false).await.unwrap();
    assert!(matches!(l.lookup("n1.a1", "acme", true).await.unwrap(), Lookup::Live(_)));
    assert!(l.checkout("n1", &spec("n1.a4", "acme", 60_000, 600_000)).await.unwrap().is_some());
}

#[tokio::test]
async fn a_node_without_room_refuses_to_queue() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    l.set_room("n1", 1, 60_000).await.unwrap();
    let first = l.checkout_or_queue("n1", &spec("n1.b1", "acme", 60_000, 600_000), &queue("q1", "ch")).await.unwrap();
    assert_eq!(first, ledger::Checkout::Queued { depth: 1 });
    let second = l.checkout_or_queue("n1", &spec("n1.b2", "acme", 60_000, 600_000), &queue("q2", "ch")).await.unwrap();
    assert_eq!(second, ledger::Checkout::Refused { room: 1, depth: 1 });
    // An idle sandbox is still granted: room bounds creates, not checkouts.
    assert_eq!(l.dequeue("n1", "q1", "tpl", "acme").await.unwrap(), None);
    fill(&l, "n1", 1).await;
    let r = l.checkout_or_queue("n1", &spec("n1.b3", "acme", 60_000, 600_000), &queue("q3", "ch")).await.unwrap();
    assert!(matches!(r, ledger::Checkout::Granted(_)), "{r:?}");
}

#[tokio::test]
async fn a_lost_node_is_given_up_its_sessions_end_with_node_lost_and_its_quota_returns() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let sandboxes = fill(&l, "n1", 4).await;
    for i in 0..2 {
        l.checkout("n1", &spec(&format!("n1.c{i}"), "acme", 600_000, 3_600_000)).await.unwrap().unwrap();
    }
    assert_eq!(l.give_up_node("n1", 10).await.unwrap(), NodeLost::Live, "a live node is never given up");
    l.release_node("n1", "test|n1").await.unwrap();
    let NodeLost::GivenUp { ended, doomed, more } = l.give_up_node("n1", 10).await.unwrap() else { panic!() };
    assert_eq!((ended.len(), doomed, more), (2, 2, false));
    assert!(ended.iter().all(|e| e.reason == GoneReason::NodeLost));
    let Lookup::Gone { reason, .. } = l.lookup("n1.c0", "acme", true).await.unwrap() else { panic!() };
    assert_eq!(reason, GoneReason::NodeLost);
    // Nothing of it stays in a pool; every sandbox is doomed, for the node to remove if it returns.
    assert_eq!(l.idle_counts("n1", &["tpl"]).await.unwrap(), vec![0]);
    let mut popped = Vec::new();
    while let Some(sb) = l.pop_doomed("n1", Duration::from_millis(50)).await.unwrap() {
        popped.push(sb);
    }
    popped.sort();
    assert_eq!(popped, sandboxes);
    assert_eq!(l.active_sessions("n1").await.unwrap().len(), 0);
    assert_eq!(l.quota_drain_returns("n1", 10).await.unwrap(), 2, "both sessions' quota leases go back");
}

// ---------- waiters that vanish ----------

/// Adds sandbox `sb` of `tpl` to its node and marks it ready.
async fn ready(l: &Ledger, sb: &str) -> Ready {
    let node = sb.split_once('.').unwrap().0;
    l.sandbox_add(node, sb, "tpl").await.unwrap();
    l.sandbox_ready(node, sb, "c").await.unwrap()
}

/// Moves the end of every claim window of `node` to now (rather than waiting 10 s for it).
async fn end_claim_windows(l: &Ledger, node: &str) {
    let k = l.keys().node(node);
    let sids: Vec<String> =
        redis::cmd("ZRANGE").arg(k.unclaimed()).arg(0).arg(-1).query_async(&mut l.connection()).await.unwrap();
    for sid in sids {
        let _: i64 =
            redis::cmd("ZADD").arg(k.unclaimed()).arg(0).arg(sid).query_async(&mut l.connection()).await.unwrap();
    }
}

#[tokio::test]
async fn a_grant_nobody_collects_goes_back_after_the_claim_window() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let k = l.keys().node("n1");
    let q = |req| queue(req, "ch");
    // Two requests wait; the first one's gateway is gone and never collects its mail.
    assert_eq!(admit(&l, &ledger::session_lease("n1.0a01"), "acme").await, Admission::Admitted);
    for (req, sid) in [("gone", "n1.0a01"), ("here", "n1.0a02")] {
        let r = l.checkout_or_queue("n1", &spec(sid, "acme", 60_000, 600_000), &q(req)).await.unwrap();
        assert!(matches!(r, ledger::Checkout::Queued { .. }), "{r:?}");
    }
    assert_eq!(fill_ready(&l, "n1", 2).await, vec![Ready::Granted, Ready::Granted]);
    let now = l.now_ms().await.unwrap();
    let until: u64 =
        redis::cmd("ZSCORE").arg(k.unclaimed()).arg("n1.0a01").query_async(&mut l.connection()).await.unwrap();
    assert!(until.abs_diff(now + 10_000) < 2_000, "claimable for 10 s: until {until}, now {now}");
    let Some(ledger::Mail::Granted(kept)) = l.take_mail("n1", "here").await.unwrap() else { panic!("granted") };
    // Within the window nothing happens.
    assert!(l.reap_expired("n1", 10).await.unwrap().is_empty());
    assert_eq!(l.active_sessions("n1").await.unwrap().get("acme"), Some(&2));
    // Past it, the uncollected grant is undone; the collected one stays.
    end_claim_windows(&l, "n1").await;
    assert!(l.reap_expired("n1", 10).await.unwrap().is_empty(), "no session ended: one was undone");
    assert_eq!(l.idle_counts("n1", &["tpl"]).await.unwrap(), vec![1], "its sandbox is idle in its pool again");
    assert_eq!(l.active_sessions("n1").await.unwrap().get("acme"), Some(&1));
    assert_eq!(l.lookup("n1.0a01", "acme", false).await.unwrap(), Lookup::Missing, "no tombstone: nobody saw it");
    assert!(
        matches!(l.lookup("n1.0a02", "acme", true).await.unwrap(), Lookup::Live(s) if s.sandbox == kept.sandbox_id)
    );
    assert!(l.take_mail("n1", "gone").await.unwrap().is_none(), "the grant left the mailbox too");
    assert!(l.pop_doomed("n1", Duration::from_millis(50)).await.unwrap().is_none(), "nothing is destroyed");
    assert_eq!(used_sessions(&l, "acme").await, 1);
    assert_eq!(l.quota_drain_returns("n1", 10).await.unwrap(), 1);
    assert_eq!(used_sessions(&l, "acme").await, 0, "its quota lease is given back");

    // With another request waiting, an undone grant goes to it, not to the pool.
    l.checkout("n1", &spec("n1.0b00", "bob", 60_000, 600_000)).await.unwrap().unwrap();
    l.checkout_or_queue("n1", &spec("n1.0b01", "bob", 60_000, 600_000), &q("gone2")).await.unwrap();
    assert_eq!(ready(&l, "n1.e001").await, Ready::Granted);
    l.checkout_or_queue("n1", &spec("n1.0b02", "bob", 60_000, 600_000), &q("next")).await.unwrap();
    end_claim_windows(&l, "n1").await;
    l.reap_expired("n1", 10).await.unwrap();
    let Some(ledger::Mail::Granted(g)) = l.take_mail("n1", "next").await.unwrap() else { panic!("granted") };
    assert_eq!(g.sandbox_id, "n1.e001");
    assert_eq!(l.idle_counts("n1", &["tpl"]).await.unwrap(), vec![0]);
    end_claim_windows(&l, "n1").await;
    l.reap_expired("n1", 10).await.unwrap();
    assert!(matches!(l.lookup("n1.0b02", "bob", true).await.unwrap(), Lookup::Live(_)), "collected: kept");

    // A grant collected by `dequeue` (it raced the deadline) is claimed as well; one that
    // races a request that withdraws (its client hung up) goes back at once.
    l.checkout_or_queue("n1", &spec("n1.0c01", "carol", 60_000, 600_000), &q("late")).await.unwrap();
    l.checkout_or_queue("n1", &spec("n1.0c02", "carol", 60_000, 600_000), &q("left")).await.unwrap();
    assert_eq!((ready(&l, "n1.e002").await, ready(&l, "n1.e003").await), (Ready::Granted, Ready::Granted));
    assert!(matches!(l.dequeue("n1", "late", "tpl", "carol").await.unwrap(), Some(ledger::Mail::Granted(_))));
    l.withdraw("n1", "left", "tpl", "carol").await.unwrap();
    assert_eq!(l.idle_counts("n1", &["tpl"]).await.unwrap(), vec![1], "the withdrawn grant's sandbox is back");
    assert_eq!(l.active_sessions("n1").await.unwrap().get("carol"), Some(&1));
    end_claim_windows(&l, "n1").await;
    l.reap_expired("n1", 10).await.unwrap();
    assert!(matches!(l.lookup("n1.0c01", "carol", true).await.unwrap(), Lookup::Live(_)), "collected: kept");
    assert_eq!(l.lookup("n1.0c02", "carol", false).await.unwrap(), Lookup::Missing);
}

#[tokio::test]
async fn waiting_counts_forget_waiters_that_vanished() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let k = l.keys().node("n1");
    let q = |req| queue(req, "ch");
    // Three wait (the queue's cap), then their gateway dies: alice's first record expires,
    // and bob's whole list with his record.
    for (req, sid, tenant) in [("ra1", "n1.a1", "alice"), ("ra2", "n1.a2", "alice"), ("rb1", "n1.b1", "bob")] {
        let r = l.checkout_or_queue("n1", &spec(sid, tenant, 60_000, 600_000), &q(req)).await.unwrap();
        assert!(matches!(r, ledger::Checkout::Queued { .. }), "{r:?}");
    }
    let del = |key: String| {
        let l = l.clone();
        async move { redis::cmd("DEL").arg(key).query_async::<i64>(&mut l.connection()).await.unwrap() }
    };
    del(k.waiter("ra1")).await;
    del(k.waiter("rb1")).await;
    del(k.wq("tpl", "bob")).await;
    // The count still counts them: the node would create for them, and the queue looks full.
    assert_eq!(l.waiting_counts("n1", &["tpl"]).await.unwrap(), vec![3]);
    let carol = spec("n1.c1", "carol", 60_000, 600_000);
    assert_eq!(l.checkout_or_queue("n1", &carol, &q("rc1")).await.unwrap(), ledger::Checkout::Full { depth: 3 });
    // The reaper's recount puts it right.
    assert_eq!(l.recount_waiters("n1", &["tpl", "other"]).await.unwrap(), 1, "alice's vanished entry");
    assert_eq!(l.waiting_counts("n1", &["tpl", "other"]).await.unwrap(), vec![1, 0]);
    let ring: Vec<String> =
        redis::cmd("LRANGE").arg(k.wring("tpl")).arg(0).arg(-1).query_async(&mut l.connection()).await.unwrap();
    assert_eq!(ring, ["alice"]);
    assert_eq!(l.checkout_or_queue("n1", &carol, &q("rc1")).await.unwrap(), ledger::Checkout::Queued { depth: 2 });
    // Sandboxes go to the requests that wait, in turn; the counts follow.
    assert_eq!(fill_ready(&l, "n1", 2).await, vec![Ready::Granted, Ready::Granted]);
    assert!(matches!(l.take_mail("n1", "ra2").await.unwrap(), Some(ledger::Mail::Granted(_))));
    assert!(matches!(l.take_mail("n1", "rc1").await.unwrap(), Some(ledger::Mail::Granted(_))));
    assert_eq!(l.waiting_counts("n1", &["tpl"]).await.unwrap(), vec![0]);
    assert_eq!(l.recount_waiters("n1", &["tpl"]).await.unwrap(), 0);
    assert_eq!(l.waiting_counts("n1", &["tpl"]).await.unwrap(), vec![0]);
}

#[tokio::test]
async fn a_pending_session_key_lives_as_long_as_the_longest_wait() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let max_wait = Duration::from_secs(300);
    assert_eq!(l.pin_claim("t", "ep-1", "c1", max_wait).await.unwrap(), PinClaim::Claimed);
    let ttl: u64 = redis::cmd("PTTL").arg(l.keys().pin("t", "ep-1")).query_async(&mut l.connection()).await.unwrap();
    assert!(ttl > 300_000, "a request that waits 300 s still holds its key: {ttl} ms");
    assert!(ttl <= 360_000, "and not much longer: {ttl} ms");
    assert_eq!(l.pin_claim("t", "ep-1", "c2", max_wait).await.unwrap(), PinClaim::Pending { claim: "c1".into() });
}

// ---- One Redis or a Redis Cluster ---------------------------------------------------------

/// What reaches several hash tags in one call works on a Redis Cluster as on one Redis
/// (`scripts/test` runs this file against both): a pipeline over many nodes' keys, the sweep
/// that scans every tenant's quota scope, a wake-up published in one node's slot and heard
/// through the first seed, and deleting a prefix.
#[tokio::test]
async fn calls_across_hash_tags_work_on_one_redis_and_on_a_cluster() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    l.ping().await.unwrap();
    assert!(l.now_ms().await.unwrap() > 1_600_000_000_000);
    // Six nodes' keys: on the test cluster they spread over its three masters.
    let nodes: Vec<String> = (0..6).map(|i| format!("n{i}")).collect();
    for n in &nodes {
        l.heartbeat(n, 1).await.unwrap();
    }
    for n in &nodes[..3] {
        l.node_holds(n, "img@sha256:1").await.unwrap();
    }
    assert_eq!(l.holding(&nodes, "img@sha256:1").await.unwrap(), [true, true, true, false, false, false]);
    // Orphaned leases (deadline 0) in six tenants' scopes: the sweep finds every scope and
    // asks every node whether the session lives.
    let d = QuotaLimits::default();
    for i in 0..6 {
        let lease = ledger::session_lease(&format!("n{i}.{i:032x}"));
        l.quota_admit(&lease, &format!("t{i}"), Cost::session(1.0, 1), &d, true, 0, 0).await.unwrap();
    }
    assert_eq!(l.quota_sweep(&d).await.unwrap(), 6);
    // A grant on n2 (another master than the first seed's on the test cluster) wakes its waiter.
    l.claim_node("n2", "test|n2", 3_600_000, true).await.unwrap();
    let chan = format!("{}:wake:x", p.0);
    let mut sub = l.subscribe(&chan).await.unwrap();
    let r = l.checkout_or_queue("n2", &spec("n2.a1", "alice", 60_000, 600_000), &queue("r1", &chan)).await.unwrap();
    assert!(matches!(r, ledger::Checkout::Queued { .. }), "{r:?}");
    assert_eq!(fill_ready(&l, "n2", 1).await, vec![Ready::Granted]);
    use futures::StreamExt;
    let m = tokio::time::timeout(Duration::from_secs(2), sub.on_message().next()).await.unwrap().unwrap();
    assert_eq!(m.get_payload::<String>().unwrap(), "r1");
    // Every key of the prefix, on every master.
    assert!(l.delete_all_keys().await.unwrap() > 10);
    assert!(l.connection().scan_keys(&l.keys().all_pattern()).await.unwrap().is_empty());
}

#[tokio::test]
async fn limits_an_admin_set_are_restated_or_tightened_by_tenants_never_loosened_or_removed() {
    let p = Prefix::new();
    let l = live_ledger(&p).await;
    let d = QuotaLimits::default();
    let by = |path: &'static str, lim: Option<QuotaLimits>, who: SetBy| {
        let l = l.clone();
        async move { l.quota_set_by(path, lim.as_ref(), &QuotaLimits::default(), who).await.unwrap() }
    };
    let refused = |r: SetLimits| match r {
        SetLimits::AdminSet { path, fields } => (path, fields),
        other => panic!("not refused: {other:?}"),
    };
    let admin = QuotaLimits {
        sessions: Some(4),
        isolation: Some(vec!["runc".into()]),
        create_rate: Some(2.0),
        ..Default::default()
    };
    assert_eq!(by("acme/rl", Some(admin.clone()), SetBy::Admin).await, SetLimits::Ok);
    let view = l.quota_view("acme/rl", &d, false).await.unwrap();
    assert_eq!((view.limits.clone(), view.admin_set.clone()), (admin.clone(), admin.clone()));
    // Removing, dropping a field, loosening a number, widening the list, a bigger burst.
    let (at, fields) = refused(by("acme/rl", None, SetBy::Tenant).await);
    assert_eq!(
        (at.as_str(), fields),
        ("acme/rl", vec!["create_rate".to_string(), "isolation".into(), "sessions".into()])
    );
    let (_, fields) =
        refused(by("acme/rl", Some(QuotaLimits { isolation: None, ..admin.clone() }), SetBy::Tenant).await);
    assert_eq!(fields, ["isolation"]);
    let (_, fields) =
        refused(by("acme/rl", Some(QuotaLimits { sessions: Some(5), ..admin.clone() }), SetBy::Tenant).await);
    assert_eq!(fields, ["sessions"]);
    let wide = QuotaLimits { isolation: Some(vec!["runc".into(), "runsc".into()]), ..admin.clone() };
    assert_eq!(refused(by("acme/rl", Some(wide), SetBy::Tenant).await).1, ["isolation"]);
    let burst = QuotaLimits { create_burst: Some(3), ..admin.clone() };
    assert_eq!(refused(by("acme/rl", Some(burst), SetBy::Tenant).await).1, ["create_burst"]);
    assert_eq!(l.quota_view("acme/rl", &d, false).await.unwrap().limits, admin, "refusals change nothing");
    // Restating, tightening (an empty list allows nothing: tighter still) and adding limits of its own.
    assert_eq!(by("acme/rl", Some(admin.clone()), SetBy::Tenant).await, SetLimits::Ok);
    let tight = QuotaLimits {
        sessions: Some(1),
        isolation: Some(vec![]),
        create_rate: Some(1.0),
        create_burst: Some(2),
        memory_mb: Some(512),
        ..Default::default()
    };
    assert_eq!(by("acme/rl", Some(tight.clone()), SetBy::Tenant).await, SetLimits::Ok);
    let view = l.quota_view("acme/rl", &d, false).await.unwrap();
    assert_eq!((view.limits, view.admin_set), (tight, admin.clone()), "the admin's limits are kept");
    assert_eq!(admit(&l, "s:1", "acme/rl").await, Admission::Admitted);
    assert!(matches!(admit(&l, "s:2", "acme/rl/x").await, Admission::Denied { dimension: Dimension::Sessions, .. }));
    // Back up to the admin's, not past it.
    assert_eq!(by("acme/rl", Some(admin.clone()), SetBy::Tenant).await, SetLimits::Ok);
    // Paths the admin did not set are the tenant's; an admin replaces and removes its own.
    assert_eq!(by("acme/ops", Some(limits(9)), SetBy::Tenant).await, SetLimits::Ok);
    assert_eq!(by("acme/ops", None, SetBy::Tenant).await, SetLimits::Ok);
    assert_eq!(by("acme/rl", Some(limits(8)), SetBy::Admin).await, SetLimits::Ok);
    assert_eq!(l.quota_view("acme/rl", &d, false).await.unwrap().admin_set, limits(8));
    assert_eq!(by("acme/rl", None, SetBy::Admin).await, SetLimits::Ok);
    let view = l.quota_view("acme/rl", &d, false).await.unwrap();
    assert!(view.limits.is_empty() && view.admin_set.is_empty(), "{view:?}");
    assert_eq!(by("acme/rl", Some(limits(9)), SetBy::Tenant).await, SetLimits::Ok);
    assert_eq!(by("acme/rl", None, SetBy::Tenant).await, SetLimits::Ok);
}

// ---- What a periodic loop reads -------------------------------------------------------------

/// A plain redis-server started for one test, so `INFO commandstats` counts this test's
/// commands and nobody else's.
struct PrivateRedis {
    child: std::process::Child,
    port: u16,
}

impl PrivateRedis {
    fn start() -> PrivateRedis {
        for _ in 0..20 {
            // Below the ephemeral range, as the cluster above.
            let port = 10000 + (uuid::Uuid::new_v4().as_u128() % 10000) as u16;
            let child = std::process::Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("redis-server (package redis-server) runs");
            let mut r = PrivateRedis { child, port };
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = r.child.try_wait() {
                    break;
                }
                if redis::Client::open(r.url()).and_then(|c| c.get_connection()).is_ok() {
                    return r;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
        panic!("could not start a private redis-server");
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every command the server ran since the last `CONFIG RESETSTAT` (scripts' own calls too).
async fn commands_since_reset(l: &Ledger) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut l.connection()).await.unwrap();
    info.lines().filter_map(|line| line.split_once("calls=")?.1.split(',').next()?.parse::<u64>().ok()).sum()
}

/// One sweep of the quotas, with what it cost the server in commands.
async fn counted_sweep(l: &Ledger) -> (u64, u64) {
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut l.connection()).await.unwrap();
    let fixed = l.quota_sweep(&QuotaLimits::default()).await.unwrap();
    (fixed, commands_since_reset(l).await)
}

/// Issue 34: the quota sweep (every 30 s on every node) reads what is due, never the keyspace:
/// with the same leases due, it sends Redis exactly as many commands beside 400 idle sandboxes
/// as beside 800 (a `SCAN` for the lease hashes grew with every key). Leases an older build
/// admitted (no index entry) are still found, by the first sweep; a live session's lease
/// stays held and is not read again on the next sweep.
#[tokio::test]
async fn the_quota_sweep_reads_what_is_due_not_what_the_node_holds() {
    let redis = PrivateRedis::start();
    let l = Ledger::connect(&redis.url(), "sp").await.unwrap();
    l.claim_node("n1", "test|n1", 3_600_000, true).await.unwrap();
    l.heartbeat("n1", 1).await.unwrap();
    let d = QuotaLimits::default();
    let tenants = ["t0", "t1", "t2"];
    // Each tenant: a live session (its lease due at once, its holder alive) and a lease left by
    // an older build, past its deadline, with no session and no index entry.
    fill(&l, "n1", tenants.len()).await;
    for (i, t) in tenants.iter().enumerate() {
        let sid = format!("n1.{i:032x}");
        l.checkout("n1", &spec(&sid, t, 600_000, 600_000)).await.unwrap().unwrap();
        let lease = ledger::session_lease(&sid);
        assert_eq!(
            l.quota_admit(&lease, t, Cost::session(0.5, 64), &d, true, 0, 0).await.unwrap(),
            Admission::Admitted
        );
        let old = r#"{"path":"PATH","cost":{"sessions":1},"queued":0,"at_ms":1,"deadline_ms":2}"#.replace("PATH", t);
        let k = l.keys().quota(t);
        let _: () = redis::pipe()
            .hset(&k.lease, format!("s:old{i}"), old)
            .hincr(&k.used, format!("{t}|sessions"), 1)
            .query_async(&mut l.connection())
            .await
            .unwrap();
    }
    let (fixed, _) = counted_sweep(&l).await;
    assert_eq!(fixed, 3, "the first sweep gives back the older build's orphans, not the live leases");
    for t in tenants {
        let v = l.quota_view(t, &d, false).await.unwrap();
        assert_eq!(v.usage.sessions, 1, "{t}'s live session keeps its lease");
    }
    // The same work twice (an orphan per tenant: a create whose client vanished), beside 400
    // and then 800 idle sandboxes.
    let mut costs = Vec::new();
    for round in 0..2u32 {
        for i in 0..400u32 {
            let sb = format!("n1.f{round}{i:04x}");
            l.sandbox_add("n1", &sb, "tpl").await.unwrap();
            assert_eq!(l.sandbox_ready("n1", &sb, &format!("c{round}-{i}")).await.unwrap(), Ready::Idle);
        }
        for (i, t) in tenants.iter().enumerate() {
            let lease = ledger::session_lease(&format!("n1.ab{round:015x}{i:015x}"));
            l.quota_admit(&lease, t, Cost::session(0.5, 64), &d, true, 0, 0).await.unwrap();
        }
        let (fixed, commands) = counted_sweep(&l).await;
        assert_eq!(fixed, 3, "round {round}: each vanished client's lease is given back");
        costs.push(commands);
    }
    let sandboxes: u64 =
        redis::cmd("SCARD").arg(l.keys().node("n1").sbs()).query_async(&mut l.connection()).await.unwrap();
    assert_eq!(sandboxes, 800 + tenants.len() as u64);
    assert_eq!(costs[0], costs[1], "a sweep's Redis commands beside 400 and 800 idle sandboxes: {costs:?}");
    // And nothing due costs a command per tenant and a few more, whatever the keyspace.
    let (fixed, idle) = counted_sweep(&l).await;
    assert_eq!(fixed, 0);
    assert!(idle < costs[0], "an idle sweep ({idle}) costs less than one with work ({})", costs[0]);
    // The index of tenants forgets one with nothing due that nobody noted for ten minutes, and
    // keeps one noted just now (a process may admit for it without noting it again).
    l.quota_note_top("fresh").await.unwrap();
    let tops = l.keys().quota_tops();
    let _: () = redis::cmd("ZADD").arg(&tops).arg(1).arg("ancient").query_async(&mut l.connection()).await.unwrap();
    counted_sweep(&l).await;
    let listed: Vec<String> =
        redis::cmd("ZRANGE").arg(&tops).arg(0).arg(-1).query_async(&mut l.connection()).await.unwrap();
    assert_eq!(listed.iter().filter(|t| t.as_str() == "ancient").count(), 0, "{listed:?}");
    assert!(listed.iter().any(|t| t == "fresh"), "{listed:?}");
    assert!(tenants.iter().all(|t| listed.iter().any(|x| x == t)), "tenants with leases stay: {listed:?}");
}

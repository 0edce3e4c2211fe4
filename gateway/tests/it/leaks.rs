//! What a create or a fork leaves behind when its client goes away midway or a step fails:
//! nothing. Requests are dropped while they wait (the client hung up: hyper drops the handler),
//! and the fake node loses a snapshot's answer after it recorded the template.

use std::future::Future;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use http_util::ApiError;
use ledger::{Ledger, PrivateTemplate, Ready};
use wire::internal::SnapshotRequest;

use crate::support::{Gw, NODE};

/// Polls `f` until it holds, at most `within`.
async fn eventually<F, Fut>(within: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !f().await {
        assert!(tokio::time::Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Drives `request` (not yet answered) until `ready` holds, without letting it finish.
async fn drive_until<R, F, Fut>(request: &mut std::pin::Pin<Box<R>>, what: &str, mut ready: F)
where
    R: Future,
    R::Output: std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    for _ in 0..200 {
        tokio::select! {
            answer = request.as_mut() => panic!("answered before {what}: {answer:?}"),
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        if ready().await {
            return;
        }
    }
    panic!("never {what}");
}

/// Runs `f` on a runtime of its own, on another thread: for the fake node's answers, which
/// are synchronous, to write to the ledger as a node would.
fn on_the_side<T: Send + 'static>(f: impl Future<Output = T> + Send + 'static) -> T {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime").block_on(f)
    })
    .join()
    .expect("the side thread")
}

/// The template a snapshot request names (`<node>.<id>`), and the record a node makes of it.
fn snapshot_template(req: &gateway::NodeRequest) -> PrivateTemplate {
    let (body, _) = req.body.as_ref().expect("a snapshot request has a body");
    let r: SnapshotRequest = serde_json::from_slice(body).expect("a snapshot request");
    PrivateTemplate {
        name: format!("{NODE}.{}", r.id.expect("the gateway names the template")),
        tenant: r.tenant,
        base: "bb".into(),
        image: "sandpool-snap:test".into(),
        created_ms: 1,
        size_mb: 0,
    }
}

/// The fake node takes snapshots as a node would: it records the template, then either answers
/// with it, one sandbox of the template ready at once (`answered`), or its answer is lost (the
/// call times out).
fn fake_snapshots(gw: &Gw, answered: bool) {
    let (url, prefix) = (gw.config.redis.url.clone(), gw.config.redis.prefix.clone());
    gw.answer(move |req| {
        if !req.path.ends_with("/snapshot") {
            return Ok(Bytes::from_static(b"{}"));
        }
        let t = snapshot_template(req);
        let (url, prefix, record) = (url.clone(), prefix.clone(), t.clone());
        on_the_side(async move {
            let l = Ledger::connect(&url, &prefix).await.unwrap();
            l.put_private_template(NODE, &record).await.unwrap();
            if answered {
                l.sandbox_add(NODE, "n1.0000bb", &record.name).await.unwrap();
                l.sandbox_ready(NODE, "n1.0000bb", "c").await.unwrap();
            }
        });
        if answered {
            Ok(Bytes::from(serde_json::to_vec(&t).unwrap()))
        } else {
            Err(ApiError::gateway_timeout("the node did not answer in time"))
        }
    });
}

/// The template the gateway asked the fake node to snapshot into, once it has.
fn snapshot_name(gw: &Gw) -> Option<String> {
    let calls = gw.nodes.calls.lock().unwrap();
    calls.iter().find(|c| c.path.ends_with("/snapshot")).map(|c| snapshot_template(c).name)
}

async fn usage(l: &Ledger, path: &str) -> wire::quotas::QuotaUsage {
    l.quota_view(path, &Default::default(), false).await.unwrap().usage
}

async fn active(l: &Ledger, tenant: &str) -> u64 {
    l.active_sessions(NODE).await.unwrap().get(tenant).copied().unwrap_or(0)
}

#[tokio::test]
async fn a_create_dropped_while_it_waits_leaves_the_queue_and_a_grant_that_raced_it_goes_back() {
    let gw = Gw::new().await;
    let l = gw.ledger.clone();
    let body = r#"{"template":"bb","max_wait_s":300,"session_key":"ep-1"}"#;
    let mut request = Box::pin(gw.call("acme", "POST", "/v1/sessions", body));
    drive_until(&mut request, "it waits in the queue", || async {
        l.waiting_counts(NODE, &["bb"]).await.unwrap() == vec![1]
    })
    .await;
    // Its session key stays claimed for as long as it may wait (300 s), not a fixed minute.
    let pin = l.keys().pin("acme", "ep-1");
    let ttl: u64 = redis::cmd("PTTL").arg(&pin).query_async(&mut l.connection()).await.unwrap();
    assert!(ttl > 300_000, "the pending key lives {ttl} ms");
    // A sandbox is granted to it just as its client goes away (the request is no longer polled,
    // then dropped): the grant nobody will collect goes back to the pool at once.
    l.sandbox_add(NODE, "n1.0000aa", "bb").await.unwrap();
    assert_eq!(l.sandbox_ready(NODE, "n1.0000aa", "c").await.unwrap(), Ready::Granted);
    assert_eq!(active(&l, "acme").await, 1);
    drop(request);
    eventually(Duration::from_secs(5), "the sandbox is back in its pool", || async {
        l.idle_counts(NODE, &["bb"]).await.unwrap() == vec![1]
    })
    .await;
    assert_eq!(active(&l, "acme").await, 0, "no session is left");
    assert_eq!(l.waiting_counts(NODE, &["bb"]).await.unwrap(), vec![0]);
    // The key's claim is given up with the request: a retry of the key is not refused.
    eventually(Duration::from_secs(5), "the session key is free again", || async {
        let n: u64 = redis::cmd("EXISTS").arg(&pin).query_async(&mut l.connection()).await.unwrap();
        n == 0
    })
    .await;
    eventually(Duration::from_secs(5), "the quota lease is given back", || async {
        let u = usage(&l, "acme").await;
        (u.sessions, u.queued) == (0, 0)
    })
    .await;
}

#[tokio::test]
async fn a_fork_whose_snapshot_answer_is_lost_forgets_the_template_the_node_recorded() {
    let gw = Gw::new().await;
    let sid = gw.session("acme").await;
    fake_snapshots(&gw, false);
    let (status, body, _) = gw.call("acme", "POST", &format!("/v1/sessions/{sid}/fork"), r#"{"count":2}"#).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{body}");
    let name = snapshot_name(&gw).unwrap();
    assert_eq!(gw.ledger.private_template(&name).await.unwrap(), None, "the template is forgotten");
    assert!(
        gw.ledger.deleted_private_templates(NODE).await.unwrap().contains(&name),
        "recorded as deleted, so its node removes the image"
    );
    let u = usage(&gw.ledger, "acme").await;
    assert_eq!((u.private_templates, u.sessions), (0, 1), "only the parent session holds quota");
}

#[tokio::test]
async fn a_fork_dropped_midway_undoes_its_snapshot_and_the_copies_it_opened() {
    let gw = Gw::new().await;
    let l = gw.ledger.clone();
    let sid = gw.session("acme").await;
    fake_snapshots(&gw, true);
    let path = format!("/v1/sessions/{sid}/fork");
    let mut fork = Box::pin(gw.call("acme", "POST", &path, r#"{"count":2,"max_wait_s":300}"#));
    // One copy got the ready sandbox; the other waits for the next.
    drive_until(&mut fork, "one copy is open and the other waits", || async {
        let Some(t) = snapshot_name(&gw) else { return false };
        active(&l, "acme").await == 2 && l.waiting_counts(NODE, &[&t]).await.unwrap() == vec![1]
    })
    .await;
    let name = snapshot_name(&gw).unwrap();
    // The client hangs up.
    drop(fork);
    eventually(Duration::from_secs(5), "the open copy ends and the template goes", || async {
        active(&l, "acme").await == 1 && l.private_template(&name).await.unwrap().is_none()
    })
    .await;
    assert_eq!(l.waiting_counts(NODE, &[&name]).await.unwrap(), vec![0], "the waiting copy left the queue");
    assert!(l.deleted_private_templates(NODE).await.unwrap().contains(&name));
    eventually(Duration::from_secs(5), "the quota comes back", || async {
        let u = usage(&l, "acme").await;
        (u.sessions, u.private_templates, u.queued) == (1, 0, 0)
    })
    .await;
}

#[tokio::test]
async fn a_fork_that_cannot_open_every_copy_undoes_the_ones_it_opened() {
    let gw = Gw::new().await;
    let l = gw.ledger.clone();
    let sid = gw.session("acme").await;
    fake_snapshots(&gw, true);
    // One sandbox for two copies, and no waiting: the second copy fails, so the fork does.
    let path = format!("/v1/sessions/{sid}/fork");
    let (status, body, _) = gw.call("acme", "POST", &path, r#"{"count":2,"max_wait_s":0}"#).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let name = snapshot_name(&gw).unwrap();
    assert_eq!(active(&l, "acme").await, 1, "the copy that opened has ended");
    assert_eq!(l.private_template(&name).await.unwrap(), None);
    let u = usage(&l, "acme").await;
    assert_eq!((u.sessions, u.private_templates, u.queued), (1, 0, 0));
}

//! Tenancy end to end on real Docker and Redis: exact admission under a race, usage that comes
//! back on every ending (also after clients vanish mid-request and the pool-manager restarts),
//! zero drift, and a flooding tenant that cannot take the queue from another.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use tests::{Client, Stack, StackOpts, eventually};

use crate::FILL;

async fn usage(c: &Client) -> Vec<u64> {
    let a = c.call(Method::GET, "/v1/usage", None).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    a.body["levels"].as_array().unwrap().iter().map(|l| l["usage"]["sessions"].as_u64().unwrap()).collect()
}

async fn verify_no_drift(stack: &Stack) {
    let a = stack.admin_client().call(Method::POST, "/v1/quotas:verify", None).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.body["drift"], json!([]), "usage drifted: {:?}", a.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_of_ten_grants_exactly_ten_of_a_hundred_creates_and_every_ending_gives_back() {
    let stack = Stack::start(StackOpts { warm: 3, ..Default::default() }).await;
    let admin = stack.admin_client();
    let a = admin.call(Method::PUT, "/v1/quotas/acme", Some(json!({"sessions": 10}))).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    stack.wait_idle("bb", 3, FILL).await;
    let rl = stack.client("acme/rl");
    let creates: Vec<_> = (0..100)
        .map(|_| {
            let rl = rl.clone();
            tokio::spawn(async move {
                rl.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb", "max_wait_s": 60}))).await
            })
        })
        .collect();
    let mut ids = Vec::new();
    for t in creates {
        let a = t.await.unwrap();
        match a.status {
            201 => ids.push(a.body["session_id"].as_str().unwrap().to_string()),
            429 => assert_eq!(
                (a.body["code"].as_str(), a.body["dimension"].as_str()),
                (Some("quota_exceeded"), Some("sessions"))
            ),
            other => panic!("create answered {other}: {:?}", a.body),
        }
    }
    assert_eq!(ids.len(), 10, "exactly the quota is granted");
    assert_eq!(usage(&rl).await, vec![10, 10]);

    // Deleted by an ancestor (a team lead cleaning up).
    let lead = stack.client("acme");
    for id in &ids[..3] {
        assert_eq!(lead.delete(id).await, 204);
    }
    assert_eq!(usage(&rl).await, vec![7, 7], "deletes give back before they answer");
    // Ended by the reaper at its idle timeout.
    let a = rl.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb", "idle_timeout_s": 1}))).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    assert_eq!(usage(&rl).await, vec![8, 8]);
    let back = eventually(Duration::from_secs(20), || async { (usage(&rl).await == vec![7, 7]).then_some(()) }).await;
    assert!(back.is_some(), "the idle timeout gave the session's usage back");
    // A sandbox that dies ends its session.
    let s = rl.call(Method::GET, &format!("/v1/sessions/{}", ids[3]), None).await;
    let sandbox = s.body["sandbox_id"].as_str().unwrap().to_string();
    let filter = format!("label=sandpool.sandbox={sandbox}");
    let out = std::process::Command::new("docker").args(["ps", "-q", "--filter", &filter]).output().unwrap();
    let container = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(!container.is_empty(), "sandbox {sandbox} has a container");
    std::process::Command::new("docker").args(["rm", "-f", &container]).output().unwrap();
    let back = eventually(Duration::from_secs(30), || async {
        let _ = rl.exec(&ids[3], json!({"cmd": "true"})).await;
        (usage(&rl).await == vec![6, 6]).then_some(())
    })
    .await;
    assert!(back.is_some(), "a failed sandbox gave its session's usage back: {:?}", usage(&rl).await);
    verify_no_drift(&stack).await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanished_clients_and_a_pool_manager_restart_leave_no_drift() {
    let mut stack = Stack::start(StackOpts { warm: 2, ..Default::default() }).await;
    stack.wait_idle("bb", 2, FILL).await;
    let c = stack.client("crash/a");
    // Clients that give up mid-request: their handlers are dropped wherever they were.
    let impatient = reqwest::Client::builder().timeout(Duration::from_millis(15)).build().unwrap();
    let tasks: Vec<_> = (0..30)
        .map(|_| {
            let (http, url, token) = (impatient.clone(), stack.url.clone(), c.token.clone());
            tokio::spawn(async move {
                let _ = http
                    .post(format!("{url}/v1/sessions"))
                    .bearer_auth(token)
                    .json(&json!({"template": "bb", "max_wait_s": 1}))
                    .send()
                    .await;
            })
        })
        .collect();
    // The node agent restarts while they are in flight.
    stack.restart_pool_manager().await;
    for t in tasks {
        t.await.unwrap();
    }
    // Whatever got a session holds exactly its lease; the rest gave theirs back: at once (the
    // dropped handler's guard), or at the latest at the first quota sweep (every 30 s) after the
    // lease's deadline, its wait (1 s) plus `LEASE_SLACK_MS` (70 s): a lease whose return was
    // lost in the restart is only an orphan then. (CI runs failed waiting 30 s and 65 s.)
    let ledger = stack.node.ledger.clone();
    let node = stack.node.id.clone();
    let settled = eventually(Duration::from_secs(1 + 70 + 30 + 15), || async {
        let live = ledger.active_sessions(&node).await.ok()?.get("crash/a").copied().unwrap_or(0);
        (usage(&c).await[0] == live).then_some(live)
    })
    .await;
    assert!(settled.is_some(), "usage {:?} settles to the live sessions", usage(&c).await);
    verify_no_drift(&stack).await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_fills_its_share_of_the_queue_not_everyones() {
    // A queue of 16: each top-level tenant may hold a quarter of it.
    let stack = Stack::start(StackOpts { warm: 0, max_queue: 16, create_rate: 2.0, ..Default::default() }).await;
    let flood = stack.client("flood");
    let creates: Vec<_> = (0..40)
        .map(|_| {
            let flood = flood.clone();
            tokio::spawn(async move {
                flood.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb", "max_wait_s": 30}))).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let calm = stack.client("calm");
    let a = calm.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb", "max_wait_s": 60}))).await;
    assert_eq!(a.status, 201, "the calm tenant still queues and gets a sandbox: {:?}", a.body);
    let mut refused: Vec<Value> = Vec::new();
    for t in creates {
        let a = t.await.unwrap();
        if a.status == 429 {
            refused.push(a.body);
        }
    }
    assert!(refused.len() >= 40 - 4 - 8, "the flood is refused beyond its share: {} refused", refused.len());
    for body in &refused {
        assert_eq!(
            (body["code"].as_str(), body["dimension"].as_str(), body["path"].as_str()),
            (Some("quota_exceeded"), Some("queued"), Some("flood")),
            "{body}"
        );
    }
    stack.shutdown().await;
}

/// Removes this stack's snapshot images however the test ends (they are not containers).
struct SnapshotImages(String);

impl Drop for SnapshotImages {
    fn drop(&mut self) {
        let repo = format!("sandpool-snap/{}", self.0);
        let out = std::process::Command::new("docker").args(["images", "-q", &repo]).output();
        for id in out.map(|o| String::from_utf8_lossy(&o.stdout).to_string()).unwrap_or_default().split_whitespace() {
            let _ = std::process::Command::new("docker").args(["rmi", "-f", id]).output();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_and_forks_are_held_to_template_disk_and_session_quotas() {
    let stack = Stack::start(StackOpts { warm: 2, ..Default::default() }).await;
    let _images = SnapshotImages(stack.ledger_prefix().to_string());
    let admin = stack.admin_client();
    let limits = json!({"sessions": 3, "private_templates": 2, "private_template_mb": 4});
    assert_eq!(admin.call(Method::PUT, "/v1/quotas/lab", Some(limits)).await.status, 200);
    stack.wait_idle("bb", 2, FILL).await;
    let c = stack.client("lab/run");
    let parent = c.create("bb").await["session_id"].as_str().unwrap().to_string();
    let snapshot = |c: &Client, sid: &str| {
        let (c, path) = (c.clone(), format!("/v1/sessions/{sid}/snapshot"));
        async move { c.call(Method::POST, &path, None).await }
    };
    // Disk: a snapshot that wrote 6 MiB is over a 4 MiB allowance, and leaves nothing behind.
    c.sh(&parent, "dd if=/dev/zero of=/work/big bs=1M count=6 2>/dev/null").await;
    let a = snapshot(&c, &parent).await;
    assert_eq!((a.status, a.body["dimension"].as_str()), (429, Some("private_template_mb")), "{:?}", a.body);
    c.sh(&parent, "rm /work/big && echo small > /work/note").await;
    let usage_of = |c: &Client| {
        let c = c.clone();
        async move { c.call(Method::GET, "/v1/usage", None).await.body["levels"][0]["usage"].clone() }
    };
    assert_eq!(usage_of(&c).await["private_templates"], 0, "the refused snapshot gave its lease back");
    // Count: two snapshots fit, the third does not.
    for _ in 0..2 {
        let a = snapshot(&c, &parent).await;
        assert_eq!(a.status, 201, "{:?}", a.body);
    }
    let a = snapshot(&c, &parent).await;
    assert_eq!((a.status, a.body["dimension"].as_str()), (429, Some("private_templates")), "{:?}", a.body);
    // Free one; a fork of 4 copies needs 4 more sessions where 2 are left: all or nothing.
    let templates: Vec<String> =
        stack.node.ledger.private_templates(&stack.node.id).await.unwrap().into_iter().map(|t| t.name).collect();
    assert_eq!(c.call(Method::DELETE, &format!("/v1/templates/{}", templates[0]), None).await.status, 204);
    let a =
        c.call(Method::POST, &format!("/v1/sessions/{parent}/fork"), Some(json!({"count": 4, "max_wait_s": 60}))).await;
    assert_eq!((a.status, a.body["dimension"].as_str()), (429, Some("sessions")), "{:?}", a.body);
    let u = usage_of(&c).await;
    assert_eq!(
        (u["sessions"].as_u64(), u["private_templates"].as_u64()),
        (Some(1), Some(1)),
        "the fork undid itself: {u}"
    );
    // A fork that fits.
    let a =
        c.call(Method::POST, &format!("/v1/sessions/{parent}/fork"), Some(json!({"count": 2, "max_wait_s": 60}))).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let kid = a.body["sessions"][0]["session_id"].as_str().unwrap().to_string();
    assert_eq!(c.sh(&kid, "cat /work/note").await["stdout"], "small\n");
    verify_no_drift(&stack).await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_restricted_to_runc_cannot_open_a_gvisor_session_and_one_allowed_can() {
    let extra_toml = crate::exec::gvisor_template(1);
    let stack = Stack::start(StackOpts { warm: 0, extra_toml, ..Default::default() }).await;
    let admin = stack.admin_client();
    let set = admin.call(Method::PUT, "/v1/quotas/acme", Some(json!({"isolation": ["runc", "runsc"]}))).await;
    assert_eq!(set.status, 200, "{:?}", set.body);
    assert_eq!(set.body["limits"]["isolation"], json!(["runc", "runsc"]));
    // The team lead narrows one child to runc; the child cannot widen it again.
    let lead = stack.client("acme");
    assert_eq!(lead.call(Method::PUT, "/v1/quotas/acme/tools", Some(json!({"isolation": ["runc"]}))).await.status, 200);
    let wider = lead.call(Method::PUT, "/v1/quotas/acme/tools/x", Some(json!({"isolation": ["crun"]}))).await;
    assert_eq!((wider.status, wider.body["code"].as_str()), (400, Some("bad_request")), "{:?}", wider.body);
    stack.wait_idle("bbg", 1, FILL).await;

    let tools = stack.client("acme/tools/x");
    let refused = tools.call(Method::POST, "/v1/sessions", Some(json!({"template": "bbg"}))).await;
    assert_eq!((refused.status, refused.body["code"].as_str()), (403, Some("forbidden")), "{:?}", refused.body);
    let msg = refused.body["message"].as_str().unwrap();
    assert!(msg.contains("runsc") && msg.contains("acme/tools"), "{msg}");
    assert_eq!(usage(&tools).await, vec![0, 0, 0], "a refused create holds nothing");
    // The same principal still gets runc sessions; a sibling gets gVisor.
    let s = tools.create("bb").await;
    assert_eq!(tools.delete(s["session_id"].as_str().unwrap()).await, 204);
    let rl = stack.client("acme/rl");
    let s = rl.create("bbg").await;
    assert_eq!(s["start"], "warm", "{s}");
    assert_eq!(rl.delete(s["session_id"].as_str().unwrap()).await, 204);
    verify_no_drift(&stack).await;
}

/// The answer's status and message, for refusals.
fn refusal(a: &tests::Answer) -> (u16, &str, &str) {
    (a.status, a.body["code"].as_str().unwrap_or_default(), a.body["message"].as_str().unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_an_admin_set_on_a_descendant_bind_its_ancestors_too() {
    let stack = Stack::start(StackOpts { warm: 2, ..Default::default() }).await;
    let admin = stack.admin_client();
    let lead = stack.client("acme");
    let set = admin.call(Method::PUT, "/v1/quotas/acme/rl", Some(json!({"sessions": 2, "isolation": ["runc"]}))).await;
    assert_eq!(set.status, 200, "{:?}", set.body);

    // The ancestor may neither remove nor loosen them, an isolation list included.
    let removed = lead.call(Method::DELETE, "/v1/quotas/acme/rl", None).await;
    let (status, code, msg) = refusal(&removed);
    assert_eq!((status, code), (403, "forbidden"), "{msg}");
    assert!(msg.contains("isolation, sessions") && msg.contains("admin"), "{msg}");
    let looser =
        lead.call(Method::PUT, "/v1/quotas/acme/rl", Some(json!({"sessions": 5, "isolation": ["runc"]}))).await;
    let (status, code, msg) = refusal(&looser);
    assert_eq!((status, code), (403, "forbidden"), "{msg}");
    assert!(msg.starts_with("sessions:") && !msg.contains("isolation"), "{msg}");
    let dropped = lead.call(Method::PUT, "/v1/quotas/acme/rl", Some(json!({"sessions": 2}))).await;
    let (status, _, msg) = refusal(&dropped);
    assert_eq!(status, 403, "{msg}");
    assert!(msg.starts_with("isolation:"), "{msg}");
    let wider = json!({"sessions": 2, "isolation": ["runc", "runsc"]});
    let wider = lead.call(Method::PUT, "/v1/quotas/acme/rl", Some(wider)).await;
    let (status, _, msg) = refusal(&wider);
    assert_eq!(status, 403, "{msg}");
    assert!(msg.starts_with("isolation:"), "{msg}");
    let burst = json!({"sessions": 2, "isolation": ["runc"], "create_rate": 1.0, "create_burst": 50});
    assert_eq!(lead.call(Method::PUT, "/v1/quotas/acme/rl", Some(burst)).await.status, 200, "a limit the admin left");
    let view = lead.call(Method::GET, "/v1/quotas/acme/rl", None).await;
    assert_eq!(view.body["limits"]["sessions"], 2, "{:?}", view.body);
    assert_eq!(view.body["limits"]["isolation"], json!(["runc"]), "{:?}", view.body);
    assert_eq!(view.body["admin_set"], json!({"sessions": 2, "isolation": ["runc"]}), "{:?}", view.body);

    // It may tighten within them, and loosen back up to what the admin set, not beyond.
    let tighter = json!({"sessions": 1, "isolation": ["runc"], "memory_mb": 512});
    let a = lead.call(Method::PUT, "/v1/quotas/acme/rl", Some(tighter)).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!((a.body["limits"]["sessions"].as_u64(), a.body["admin_set"]["sessions"].as_u64()), (Some(1), Some(2)));
    let rl = stack.client("acme/rl");
    stack.wait_idle("bb", 2, FILL).await;
    let s = rl.create("bb").await;
    let over = rl.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
    assert_eq!((over.status, over.body["dimension"].as_str()), (429, Some("sessions")), "{:?}", over.body);
    let back = json!({"sessions": 2, "isolation": ["runc"]});
    assert_eq!(lead.call(Method::PUT, "/v1/quotas/acme/rl", Some(back)).await.status, 200);
    let beyond = json!({"sessions": 3, "isolation": ["runc"]});
    assert_eq!(lead.call(Method::PUT, "/v1/quotas/acme/rl", Some(beyond)).await.status, 403);
    // The parent's view shows which of its children's limits are admin-set.
    let view = lead.call(Method::GET, "/v1/quotas/acme", None).await;
    let kids = view.body["children"].as_array().cloned().unwrap_or_default();
    let kid = kids.iter().find(|k| k["path"] == "acme/rl").unwrap_or_else(|| panic!("{:?}", view.body));
    assert_eq!(kid["admin_set"]["isolation"], json!(["runc"]), "{kid}");

    // Limits no admin set stay the ancestor's to change.
    assert_eq!(lead.call(Method::PUT, "/v1/quotas/acme/ops", Some(json!({"sessions": 3}))).await.status, 200);
    assert_eq!(lead.call(Method::PUT, "/v1/quotas/acme/ops", Some(json!({"sessions": 9}))).await.status, 200);
    assert_eq!(lead.call(Method::DELETE, "/v1/quotas/acme/ops", None).await.status, 204);
    // An admin loosens and removes its own; then the ancestor may too.
    let a = admin.call(Method::PUT, "/v1/quotas/acme/rl", Some(json!({"sessions": 4}))).await;
    assert_eq!((a.status, a.body["admin_set"].clone()), (200, json!({"sessions": 4})), "{:?}", a.body);
    assert_eq!(admin.call(Method::DELETE, "/v1/quotas/acme/rl", None).await.status, 204);
    let a = lead.call(Method::PUT, "/v1/quotas/acme/rl", Some(json!({"sessions": 9}))).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert!(a.body.get("admin_set").is_none(), "{:?}", a.body);
    assert_eq!(lead.call(Method::DELETE, "/v1/quotas/acme/rl", None).await.status, 204);
    assert_eq!(rl.delete(s["session_id"].as_str().unwrap()).await, 204);
    verify_no_drift(&stack).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_is_a_reserved_principal_no_tenant_token_may_name() {
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    for sub in ["public", "public/acme"] {
        let t = stack.client(sub);
        for (method, path, body) in [
            (Method::GET, "/v1/usage", None),
            (Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))),
            (Method::PUT, "/v1/quotas/public/acme/x", Some(json!({"sessions": 100}))),
            (Method::GET, "/v1/templates", None),
        ] {
            let a = t.call(method.clone(), path, body).await;
            let (status, code, msg) = refusal(&a);
            assert_eq!((status, code), (403, "forbidden"), "{sub} {method} {path}: {msg}");
            assert!(msg.contains("reserved"), "{msg}");
        }
    }
    // A tenant named like it is not it; an admin still manages `public`.
    assert_eq!(stack.client("publicity").call(Method::GET, "/v1/usage", None).await.status, 200);
    let a = stack.admin_client().call(Method::PUT, "/v1/quotas/public", Some(json!({"sessions": 5}))).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
}

//! Bounded state per tenant (issue 30, findings 4-6), tried as a tenant would through the API:
//! sizes over their bounds answer 413 naming the field and the bound, counts over the
//! `[quotas.default]` limits 429 naming the dimension, and a tenant that fills its share of a
//! gateway's asynchronous slots leaves the other tenants served.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use tests::corpus::Corpus;
use tests::{Client, Stack, StackOpts, eventually};

/// The message of an error answer.
fn message(body: &Value) -> &str {
    body["message"].as_str().unwrap_or_default()
}

/// A 429 `quota_exceeded` naming `dimension` at `path` with `limit`.
fn assert_quota(a: &tests::Answer, dimension: &str, path: &str, limit: f64) {
    assert_eq!(a.status, 429, "{dimension}: {:?}", a.body);
    assert_eq!(a.body["code"], "quota_exceeded", "{:?}", a.body);
    assert_eq!(a.body["dimension"], dimension, "{:?}", a.body);
    assert_eq!(a.body["path"], path, "{:?}", a.body);
    assert_eq!(a.body["limit"].as_f64(), Some(limit), "{:?}", a.body);
}

async fn put_function(c: &Client, name: &str, def: Value) -> tests::Answer {
    c.call(Method::PUT, &format!("/v1/functions/{name}"), Some(def)).await
}

/// The record of the asynchronous invocation `accepted` (a 202's body) once it is done.
async fn finished(c: &Client, accepted: &Value, within: Duration) -> Option<Value> {
    let id = accepted["invocation_id"].as_str().unwrap_or_default().to_string();
    eventually(within, || async {
        let g = c.call(Method::GET, &format!("/v1/invocations/{id}"), None).await;
        (g.body["state"] == "done").then_some(g.body)
    })
    .await
}

fn reservation(items: Vec<Value>) -> Value {
    let ready_by = humantime::format_rfc3339(std::time::SystemTime::now() + Duration::from_secs(600)).to_string();
    json!({"items": items, "ready_by": ready_by, "hold_s": 60})
}

/// Finding 4: a function whose env holds one 30 MB value was 201; a template of 128 variables
/// of 4 KB each was 201. Both are 413 now, naming the field and the bound; and a tenant
/// without limits of its own sees the shipped defaults of every per-tenant count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_env_and_definitions_answer_413_naming_the_bound() {
    // The shipped body limit (64 MiB), so the env check answers, not the body limit.
    let stack = Stack::start(StackOpts { warm: 0, max_body_bytes: 64 << 20, ..Default::default() }).await;
    let c = stack.client("acme/rl");

    let big = "x".repeat(30 << 20);
    let a = put_function(&c, "fat", json!({"template": "bb", "mode": "exec", "handler": ["cat"], "env": {"BIG": big}}))
        .await;
    assert_eq!(a.status, 413, "{:?}", message(&a.body));
    assert_eq!(a.body["code"], "payload_too_large");
    assert!(message(&a.body).contains("env.BIG") && message(&a.body).contains("4096"), "{:?}", a.body);
    assert_eq!(c.call(Method::GET, "/v1/functions/fat", None).await.status, 404, "nothing was stored");

    // Within each variable's bound, over the total.
    let env: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!("V{i:02}"), Value::String("y".repeat(4000)))).collect();
    let a = put_function(&c, "wide", json!({"template": "bb", "mode": "exec", "handler": ["cat"], "env": env})).await;
    assert_eq!(a.status, 413, "{:?}", a.body);
    assert!(message(&a.body).starts_with("env:") && message(&a.body).contains("65536"), "{:?}", a.body);

    // A handler over its bound.
    let a = put_function(
        &c,
        "long",
        json!({"template": "bb", "mode": "exec", "handler": ["sh", "-c", "z".repeat(20_000)]}),
    )
    .await;
    assert_eq!(a.status, 413, "{:?}", a.body);
    assert!(message(&a.body).contains("handler") && message(&a.body).contains("16384"), "{:?}", a.body);

    // Templates: 128 variables of 4 KB each (512 KB) were accepted; the total bounds them.
    let env: serde_json::Map<String, Value> =
        (0..128).map(|i| (format!("V{i:03}"), Value::String("v".repeat(4000)))).collect();
    let image = "127.0.0.1:5000/nothing/here:latest";
    let a = c.call(Method::POST, "/v1/templates", Some(json!({"name": "wide", "image": image, "env": env}))).await;
    assert_eq!(a.status, 413, "{:?}", a.body);
    assert!(message(&a.body).starts_with("env:") && message(&a.body).contains("65536"), "{:?}", a.body);
    let workdir = format!("/{}", "w".repeat(30 << 20));
    let a =
        c.call(Method::POST, "/v1/templates", Some(json!({"name": "deep", "image": image, "workdir": workdir}))).await;
    assert_eq!(a.status, 413, "{:?}", message(&a.body));
    assert!(message(&a.body).starts_with("workdir:") && message(&a.body).contains("4096"), "{:?}", a.body);

    // Within the bounds, a definition is stored.
    let ok = put_function(&c, "fine", json!({"template": "bb", "mode": "exec", "handler": ["cat"], "env": {"A": "1"}}))
        .await;
    assert_eq!(ok.status, 201, "{:?}", ok.body);

    // The shipped defaults bind a top-level tenant without limits of its own.
    let usage = c.call(Method::GET, "/v1/usage", None).await;
    assert_eq!(usage.status, 200, "{:?}", usage.body);
    let top = usage.body["levels"].as_array().and_then(|l| l.last()).cloned().unwrap_or_default();
    assert_eq!(top["path"], "acme");
    let d = &top["defaults"];
    for (dim, want) in [
        ("private_templates", 500),
        ("functions", 200),
        ("async_in_flight", 256),
        ("async_results", 36_000),
        ("async_result_mb", 1024),
        ("reservations", 100),
        ("reservation_items", 5000),
    ] {
        assert_eq!(d[dim].as_u64(), Some(want), "default {dim}: {d}");
    }
    assert_eq!(top["usage"]["functions"].as_u64(), Some(1), "{top}");
    stack.shutdown().await;
}

/// Finding 4: templates, functions and reservations had no count bound a tenant met by
/// default. With `[quotas.default]` lowered (the shipped values are checked above), the one
/// over the limit answers 429 naming the dimension, and ending one makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_template_function_and_reservation_over_the_default_answer_429() {
    let corpus = Corpus::build(1, 16);
    let limits = "[quotas.default]\nprivate_templates = 2\nfunctions = 3\nreservations = 2\nreservation_items = 5\n";
    let stack = Stack::start(StackOpts { warm: 0, extra_toml: limits.into(), ..Default::default() }).await;
    let c = stack.client("acme/rl");

    // Templates made from an image.
    let img = &corpus.images[0].image;
    for name in ["t1", "t2"] {
        let a = c.call(Method::POST, "/v1/templates", Some(json!({"name": name, "image": img}))).await;
        assert_eq!(a.status, 201, "{name}: {:?}", a.body);
    }
    let third = c.call(Method::POST, "/v1/templates", Some(json!({"name": "t3", "image": img}))).await;
    assert_quota(&third, "private_templates", "acme", 2.0);

    // Functions: a replacement holds the same unit; a delete gives it back.
    let def = json!({"template": "bb", "mode": "exec", "handler": ["cat"]});
    for name in ["f1", "f2", "f3"] {
        assert_eq!(put_function(&c, name, def.clone()).await.status, 201, "{name}");
    }
    assert_quota(&put_function(&c, "f4", def.clone()).await, "functions", "acme", 3.0);
    assert_eq!(put_function(&c, "f1", def.clone()).await.status, 200, "a replacement is no new function");
    // Another principal of the same tenant counts against the tenant.
    assert_quota(&put_function(&stack.client("acme/other"), "g1", def.clone()).await, "functions", "acme", 3.0);
    assert_eq!(c.call(Method::DELETE, "/v1/functions/f2", None).await.status, 204);
    assert_eq!(put_function(&c, "f4", def.clone()).await.status, 201, "the deleted one's unit is free again");
    // Another tenant has its own.
    assert_eq!(put_function(&stack.client("globex"), "f1", def.clone()).await.status, 201);

    // Reservations and the templates they name.
    let item = |n| json!({"template": "bb", "count": n});
    let r = c.call(Method::POST, "/v1/reservations", Some(reservation(vec![item(1), item(1), item(1), item(1)]))).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let r = c.call(Method::POST, "/v1/reservations", Some(reservation(vec![item(1), item(1)]))).await;
    assert_quota(&r, "reservation_items", "acme", 5.0);
    let r = c.call(Method::POST, "/v1/reservations", Some(reservation(vec![item(2)]))).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let r = c.call(Method::POST, "/v1/reservations", Some(reservation(vec![item(1)]))).await;
    assert_quota(&r, "reservations", "acme", 2.0);

    let usage = stack.admin_client().call(Method::GET, "/v1/quotas/acme?children=false", None).await;
    let u = &usage.body["usage"];
    assert_eq!(
        (u["private_templates"].as_u64(), u["functions"].as_u64(), u["reservations"].as_u64()),
        (Some(2), Some(3), Some(2)),
        "{u}"
    );
    assert_eq!(u["reservation_items"].as_u64(), Some(5), "{u}");
    let drift = stack.admin_client().call(Method::POST, "/v1/quotas:verify", None).await;
    assert_eq!(drift.body["drift"], json!([]), "{:?}", drift.body);
    stack.shutdown().await;
}

/// Finding 5: one reservation request could carry 10,000 items, each one ledger call that
/// scanned every tenant's reservations. At most 1,000 now (413), stored in one call into the
/// tenant's own scope, and still read by the nodes and the autoscaler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_with_too_many_items_answers_413_and_one_within_is_planned() {
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let c = stack.client("acme/rl");
    let many: Vec<Value> = (0..1001).map(|_| json!({"template": "bb", "count": 1})).collect();
    let a = c.call(Method::POST, "/v1/reservations", Some(reservation(many))).await;
    assert_eq!(a.status, 413, "{:?}", a.body);
    assert!(message(&a.body).contains("items") && message(&a.body).contains("1000"), "{:?}", a.body);

    let items: Vec<Value> = (0..300).map(|_| json!({"template": "bb", "count": 1})).collect();
    let a = c.call(Method::POST, "/v1/reservations", Some(reservation(items))).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let other = stack
        .client("globex")
        .call(Method::POST, "/v1/reservations", Some(reservation(vec![json!({"template": "bbd", "count": 2})])))
        .await;
    assert_eq!(other.status, 201, "{:?}", other.body);
    // What the autoscaler and the nodes read: every tenant's live reservations.
    let l = &stack.node.ledger;
    let live = l.reservations(l.now_ms().await.unwrap()).await.unwrap();
    assert_eq!(live.iter().filter(|r| r.tenant == "acme/rl").count(), 300);
    assert_eq!(live.iter().filter(|r| r.tenant == "globex").map(|r| r.count).sum::<u64>(), 2);
    stack.shutdown().await;
}

/// Finding 6: a gateway's asynchronous slots were shared by every tenant, so one tenant that
/// held them got every other tenant 429. Each top-level tenant gets at most a quarter of a
/// gateway's slots (here 2 of 8), and its `async_in_flight` quota over all gateways (here 1
/// by `[quotas.default]`; by default 256, at most the quarter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_filling_its_async_share_leaves_another_tenant_served() {
    let stack = Stack::start(StackOpts {
        warm: 2,
        gateway_toml: "max_async_in_flight = 8".into(),
        extra_toml: "[quotas.default]\nasync_in_flight = 1\nasync_result_mb = 1\n".into(),
        ..Default::default()
    })
    .await;
    let (a, b) = (stack.client("acme"), stack.client("globex"));
    let slow = json!({"template": "bb", "mode": "exec", "handler": ["sh", "-c", "sleep 4; cat"], "max_concurrency": 1});
    assert_eq!(put_function(&a, "slow", slow).await.status, 201);
    let quick = json!({"template": "bb", "mode": "exec", "handler": ["cat"]});
    assert_eq!(put_function(&b, "quick", quick).await.status, 201);

    // Tenant A asks for every slot of the gateway: its quota admits one, the rest is 429.
    let mut accepted = Vec::new();
    let ask = |i: i64| {
        let a = a.clone();
        async move { a.call(Method::POST, "/v1/functions/slow/invoke?async=true", Some(json!(i))).await }
    };
    for i in 0..8 {
        let r = ask(i).await;
        if i == 0 {
            assert_eq!(r.status, 202, "{:?}", r.body);
            accepted.push(r.body["invocation_id"].as_str().unwrap_or_default().to_string());
            continue;
        }
        assert_quota(&r, "async_in_flight", "acme", 1.0);
        assert!(r.headers.get("retry-after").is_some(), "a slot frees up: Retry-After");
    }
    // An admin raises A's quota: A gets no more than its share of this gateway all the same.
    let raised = stack.admin_client().call(Method::PUT, "/v1/quotas/acme", Some(json!({"async_in_flight": 100}))).await;
    assert_eq!(raised.status, 200, "{:?}", raised.body);
    let r = ask(8).await;
    assert_eq!(r.status, 202, "{:?}", r.body);
    accepted.push(r.body["invocation_id"].as_str().unwrap_or_default().to_string());
    for i in 9..16 {
        let r = ask(i).await;
        assert_eq!((r.status, r.body["code"].as_str()), (429, Some("too_many_requests")), "{:?}", r.body);
        assert!(message(&r.body).starts_with("async_in_flight") && message(&r.body).contains("2 of 8"), "{:?}", r.body);
        assert!(r.headers.get("retry-after").is_some());
    }

    // Tenant B is served while A holds its share.
    let r = b.call(Method::POST, "/v1/functions/quick/invoke?async=true", Some(json!({"n": 1}))).await;
    assert_eq!(r.status, 202, "tenant B was refused while tenant A held its share: {:?}", r.body);
    let done = finished(&b, &r.body, Duration::from_secs(30)).await.expect("tenant B's invocation finished");
    assert_eq!((done["status"].as_u64(), done["result"].clone()), (Some(200), json!({"n": 1})), "{done}");

    // Kept results are bounded in bytes too: one that would take B over its `async_result_mb`
    // (1 MiB here) is kept as that refusal, not as its 1.5 MB result.
    let r = b.call(Method::POST, "/v1/functions/quick/invoke?async=true", Some(json!("r".repeat(1_500_000)))).await;
    assert_eq!(r.status, 202, "{:?}", r.body);
    let done = finished(&b, &r.body, Duration::from_secs(30)).await.expect("tenant B's large invocation finished");
    assert_eq!(
        done["status"].as_u64(),
        Some(429),
        "{}",
        done["result"].to_string().chars().take(200).collect::<String>()
    );
    assert_eq!(done["result"]["dimension"], "async_result_mb", "{}", done["result"]);

    // A's share comes back as its invocations end; their records stay counted while kept.
    for id in &accepted {
        let ticket = json!({"invocation_id": id});
        finished(&a, &ticket, Duration::from_secs(40)).await.expect("tenant A's invocation finished");
    }
    let usage = eventually(Duration::from_secs(5), || async {
        let u = a.call(Method::GET, "/v1/usage", None).await;
        let u = u.body["levels"][0]["usage"].clone();
        (u["async_in_flight"].as_u64() == Some(0)).then_some(u)
    })
    .await
    .expect("tenant A's async_in_flight went back to 0");
    assert_eq!(usage["async_results"].as_u64(), Some(2), "{usage}");
    let again = a.call(Method::POST, "/v1/functions/slow/invoke?async=true", Some(json!(9))).await;
    assert_eq!(again.status, 202, "{:?}", again.body);
    stack.shutdown().await;
}

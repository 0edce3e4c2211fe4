//! The image corpus: templates made from images in the local registry (`scripts/corpus`),
//! pulled on first need, placed by locality, prefetched, reserved many at once, evicted.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};
use tests::corpus::{Corpus, registry};
use tests::{Stack, StackOpts, eventually};

/// Makes a template from `image` as `c`'s caller; its answer.
async fn make(c: &tests::Client, name: &str, image: &str) -> Value {
    let a = c.call(Method::POST, "/v1/templates", Some(json!({"name": name, "image": image}))).await;
    assert_eq!(a.status, 201, "make template {name}: {:?}", a.body);
    a.body
}

/// Opens a session of `template`, waiting up to a minute (a pull may come first).
async fn open(c: &tests::Client, template: &str) -> tests::Answer {
    c.call(Method::POST, "/v1/sessions", Some(json!({"template": template, "max_wait_s": 60}))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_from_an_absent_image_is_pulled_once_and_its_own() {
    let corpus = Corpus::build(1, 16);
    let img = &corpus.images[0];
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let c = stack.client("acme/rl");

    // Made from the tag, pinned to the digest; named in the caller's namespace.
    let t = make(&c, "task-a", &img.image).await;
    assert_eq!(t["name"], "acme/rl/task-a");
    assert_eq!(t["image"], img.reference.as_str(), "pinned to the digest");
    assert_eq!((t["source"].as_str(), t["owner"].as_str()), (Some(img.image.as_str()), Some("acme/rl")));
    assert!(corpus.local().is_empty(), "nothing pulled yet");

    // Four sessions at once: one pull, four cold sandboxes of the image.
    let opens = (0..4).map(|_| open(&c, "acme/rl/task-a"));
    let answers = futures::future::join_all(opens).await;
    let mut sessions = Vec::new();
    for a in &answers {
        assert_eq!(a.status, 201, "{:?}", a.body);
        assert_eq!((a.body["start"].as_str(), a.body["template"].as_str()), (Some("cold"), Some("acme/rl/task-a")));
        sessions.push(a.body["session_id"].as_str().unwrap().to_string());
    }
    assert_eq!(stack.node.images.pulls_started.load(Ordering::Relaxed), 1, "concurrent creates pull once");
    let out = c.sh(&sessions[0], "cat /task/id; pwd").await;
    assert_eq!(out["stdout"], format!("{}\n/work\n", img.image));
    assert_eq!(stack.node.ledger.node_images(&stack.node.id).await.unwrap(), vec![img.reference.clone()]);

    // The image stays: the next sandbox of it starts without a pull.
    for s in &sessions {
        assert_eq!(c.delete(s).await, 204);
    }
    let again = open(&c, "acme/rl/task-a").await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert_eq!(stack.node.images.pulls_started.load(Ordering::Relaxed), 1, "no second pull");

    // Another tenant neither sees nor uses it; its owner lists, reads and deletes it.
    let other = stack.client("other");
    let refused = open(&other, "acme/rl/task-a").await;
    assert_eq!((refused.status, refused.body["code"].as_str()), (400, Some("unknown_template")));
    assert_eq!(other.call(Method::GET, "/v1/templates/acme/rl/task-a", None).await.status, 404);
    assert_eq!(other.call(Method::DELETE, "/v1/templates/acme/rl/task-a", None).await.status, 404);
    let listed = c.call(Method::GET, "/v1/templates", None).await;
    let names: Vec<&str> =
        listed.body["templates"].as_array().unwrap().iter().filter_map(|t| t["name"].as_str()).collect();
    assert!(names.contains(&"acme/rl/task-a") && names.contains(&"bb"), "{names:?}");
    let theirs = other.call(Method::GET, "/v1/templates", None).await;
    assert!(!theirs.body.to_string().contains("task-a"), "{:?}", theirs.body);
    let dup = c.call(Method::POST, "/v1/templates", Some(json!({"name": "task-a", "image": img.image}))).await;
    assert_eq!((dup.status, dup.body["code"].as_str()), (409, Some("conflict")));
    // Eight racing creates of one new name: one template, holding one unit of the quota (the
    // losers must not give back the lease the winner holds).
    let race =
        (0..8).map(|_| c.call(Method::POST, "/v1/templates", Some(json!({"name": "raced", "image": img.image}))));
    let statuses: Vec<u16> = futures::future::join_all(race).await.iter().map(|a| a.status).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 201).count(), 1, "{statuses:?}");
    assert!(statuses.iter().all(|s| *s == 201 || *s == 409), "{statuses:?}");
    let usage = c.call(Method::GET, "/v1/usage", None).await.body["levels"][0]["usage"].clone();
    assert_eq!(usage["private_templates"], 2, "task-a and raced: {usage:?}");
    assert_eq!(c.call(Method::DELETE, "/v1/templates/acme/rl/raced", None).await.status, 204);
    assert_eq!(c.call(Method::DELETE, "/v1/templates/acme/rl/task-a", None).await.status, 204);
    let gone = open(&c, "acme/rl/task-a").await;
    assert_eq!((gone.status, gone.body["code"].as_str()), (400, Some("unknown_template")));
    // The session it had goes on.
    let sid = again.body["session_id"].as_str().unwrap();
    assert_eq!(c.sh(sid, "cat /task/id").await["stdout"], format!("{}\n", img.image));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_references_and_failing_registries_answer_clear_errors_quickly() {
    let corpus = Corpus::build(1, 16);
    let img = &corpus.images[0];
    let allowed = format!("[images]\nallowed_registries = [\"{}\"]\n", registry());
    let stack = Stack::start(StackOpts { warm: 0, extra_toml: allowed, ..Default::default() }).await;
    let c = stack.client("acme");
    let post = |body: Value| {
        let c = c.clone();
        async move { c.call(Method::POST, "/v1/templates", Some(body)).await }
    };
    // Tenants name only the registries the config allows (nodes contact what they name); the
    // others answer as images that do not exist.
    let elsewhere = post(json!({"image": "127.0.0.2:5000/x/y:latest"})).await;
    assert_eq!(
        (elsewhere.status, elsewhere.body["code"].as_str()),
        (400, Some("image_not_found")),
        "{:?}",
        elsewhere.body
    );
    let hub = post(json!({"image": "busybox:latest"})).await;
    assert_eq!(hub.status, 400, "{:?}", hub.body);

    let bad = post(json!({"image": "Not/A:Reference!"})).await;
    assert_eq!((bad.status, bad.body["code"].as_str()), (400, Some("bad_request")), "{:?}", bad.body);
    let unknown = post(json!({"image": "x", "unknown_field": 1})).await;
    assert_eq!(unknown.status, 400, "{:?}", unknown.body);
    let env: serde_json::Map<String, Value> = (0..200).map(|i| (format!("V{i}"), Value::from("x"))).collect();
    let huge = post(json!({"image": img.image, "env": env})).await;
    assert_eq!(huge.status, 400, "{:?}", huge.body);
    assert!(huge.body["message"].as_str().unwrap().starts_with("env:"), "{:?}", huge.body);
    let limits = post(json!({"image": img.image, "cpus": 0})).await;
    assert!(limits.body["message"].as_str().unwrap().starts_with("cpus:"), "{:?}", limits.body);

    // The registry has no such repository: 400 image_not_found, at once.
    let started = Instant::now();
    let missing = format!("{}/{}/nothing-here:latest", registry(), corpus.prefix);
    let a = post(json!({"image": missing})).await;
    assert_eq!((a.status, a.body["code"].as_str()), (400, Some("image_not_found")), "{:?}", a.body);
    // A registry that is down (an admin may name any): 502 image_pull_failed quoting why,
    // with Retry-After.
    let body = json!({"image": "127.0.0.1:1/nothing/listens:latest"});
    let a = stack.admin_client().call(Method::POST, "/v1/templates", Some(body)).await;
    assert_eq!((a.status, a.body["code"].as_str()), (502, Some("image_pull_failed")), "{:?}", a.body);
    assert!(a.body["message"].as_str().unwrap().contains("connection refused"), "{:?}", a.body);
    assert!(a.headers.contains_key("retry-after"));
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());

    // The image goes from the registry after the template was made: the create that needs it
    // fails with the registry's reason, its waiters at once, and later ones while it backs off.
    make(&c, "doomed", &img.image).await;
    corpus.delete_from_registry(img);
    let started = Instant::now();
    let a = open(&c, "acme/doomed").await;
    assert_eq!((a.status, a.body["code"].as_str()), (502, Some("image_pull_failed")), "{:?}", a.body);
    let message = a.body["message"].as_str().unwrap();
    assert!(message.contains("could not be pulled") && message.contains("unknown"), "{message}");
    assert!(a.headers.contains_key("retry-after"));
    assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
    let b = open(&c, "acme/doomed").await;
    assert_eq!((b.status, b.body["code"].as_str()), (502, Some("image_pull_failed")), "{:?}", b.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_prefers_the_node_that_holds_the_image_and_prefetch_pulls_ahead() {
    let corpus = Corpus::build(2, 16);
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let guard = stack.add_node().await;
    let second = guard.node.clone();
    let admin = stack.admin_client();
    let c = stack.client("acme");
    let (a, b) = (&corpus.images[0], &corpus.images[1]);
    make(&admin, "task-a", &a.image).await;

    // A tenant prefetches by template, onto the second node; naming images needs admin.
    let refused = c.call(Method::POST, "/v1/images:prefetch", Some(json!({"images": [b.image]}))).await;
    assert_eq!(refused.status, 403, "{:?}", refused.body);
    // Gateways learn of a new node within their registry cache's life (2 s).
    let body = json!({"templates": ["public/task-a"], "nodes": [second.id]});
    let p = eventually(Duration::from_secs(5), || async {
        let p = c.call(Method::POST, "/v1/images:prefetch", Some(body.clone())).await;
        (p.status == 202).then_some(p)
    })
    .await
    .expect("prefetch accepted");
    assert_eq!(p.body["pulls"][0]["node"], second.id.as_str());
    assert_eq!(p.body["pulls"][0]["state"], "pulling");
    let held = eventually(Duration::from_secs(30), || async {
        let v = admin.call(Method::GET, "/v1/images", None).await.body;
        let node = v["nodes"].as_array()?.iter().find(|n| n["node"] == second.id.as_str())?.clone();
        node["images"].as_array()?.iter().any(|i| i == a.reference.as_str()).then_some(())
    })
    .await;
    assert!(held.is_some(), "the second node reports the prefetched image");

    // Every cold create of it goes to the node that holds it, and nobody pulls again.
    for _ in 0..3 {
        let s = open(&c, "public/task-a").await;
        assert_eq!(s.status, 201, "{:?}", s.body);
        assert_eq!(s.body["node"], second.id.as_str());
    }
    assert_eq!(stack.node.images.pulls_started.load(Ordering::Relaxed), 0);
    assert_eq!(second.images.pulls_started.load(Ordering::Relaxed), 1);

    // An admin prefetches an image by tag without naming nodes: it lands on one node, and a
    // second prefetch finds it there.
    let p = admin.call(Method::POST, "/v1/images:prefetch", Some(json!({"images": [b.image]}))).await;
    assert_eq!(p.status, 202, "{:?}", p.body);
    let node = p.body["pulls"][0]["node"].as_str().unwrap().to_string();
    let present = eventually(Duration::from_secs(30), || async {
        let p = admin.call(Method::POST, "/v1/images:prefetch", Some(json!({"images": [b.image]}))).await;
        (p.body["pulls"][0]["state"] == "present").then_some(p.body["pulls"][0]["node"].clone())
    })
    .await;
    assert_eq!(present, Some(Value::from(node)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_of_many_templates_is_ready_by_its_time() {
    let corpus = Corpus::build(3, 16);
    let stack = Stack::start(StackOpts { warm: 0, autoscaler: true, ..Default::default() }).await;
    let c = stack.client("trainer");
    let mut items = Vec::new();
    for (i, img) in corpus.images.iter().enumerate() {
        make(&c, &format!("step-{i}"), &img.image).await;
        items.push(json!({"template": format!("trainer/step-{i}"), "count": i + 1}));
    }
    const AHEAD: Duration = Duration::from_secs(20);
    let ready_by = humantime::format_rfc3339(std::time::SystemTime::now() + AHEAD).to_string();
    let reserved_at = Instant::now();
    let r = c.call(Method::POST, "/v1/reservations", Some(json!({"items": items, "ready_by": ready_by}))).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    assert_eq!((r.body["count"].as_u64(), r.body["items"].as_array().map(Vec::len)), (Some(6), Some(3)));
    assert!(r.body.get("template").is_none(), "{:?}", r.body);
    // Bad shapes are refused.
    let both = c
        .call(Method::POST, "/v1/reservations", Some(json!({"template": "bb", "items": items, "ready_by": ready_by})))
        .await;
    assert_eq!(both.status, 400, "{:?}", both.body);

    // By ready_by every template has its count idle: pulled and created ahead.
    let names: Vec<String> = (0..3).map(|i| format!("trainer/step-{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    // The planner starts as late as the create rate the node reports allows (plus 5 s); on a
    // machine busy with the rest of the suite the creates run slower than that rate and the
    // pools have been seen filling a few seconds late (BENCHMARKS.md, The image corpus). So:
    // ready by ready_by, give or take 8 s, and the lateness is printed.
    assert_eq!(r.body["feasible"], true, "{:?}", r.body);
    let ready = eventually(AHEAD + Duration::from_secs(8), || async {
        let idle = stack.node.ledger.idle_counts(&stack.node.id, &refs).await.ok()?;
        (idle.iter().enumerate().all(|(i, n)| *n > i)).then_some(idle)
    })
    .await;
    assert!(ready.is_some(), "the reserved pools did not fill by ready_by (+8 s)");
    eprintln!("reserved pools ready {:?} after the reservation (ready_by in {AHEAD:?})", reserved_at.elapsed());
    // The node reports what each template's creates cost it, which the planner fills it at.
    let node = &stack.node;
    let measured = eventually(Duration::from_secs(5), || async {
        let st = node.ledger.stats(&node.id).await.ok()??;
        let rates: Vec<(f64, f64)> =
            names.iter().map(|n| st.pools.get(n).map_or((0.0, 0.0), |p| (p.create_rate, p.create_ms))).collect();
        rates.iter().all(|(rate, ms)| *rate > 0.0 && *ms > 0.0).then_some(rates)
    })
    .await;
    eprintln!("per-template create rate and latency: {measured:?}");
    assert!(measured.is_some(), "each reserved template's create rate is published");
    for name in &names {
        let s = c.create(name).await;
        assert_eq!(s["start"], "warm", "{s:?}");
    }
    // A deleted template's idle sandboxes go at once (step-2 had three reserved, one taken).
    assert_eq!(c.call(Method::DELETE, "/v1/templates/trainer/step-2", None).await.status, 204);
    let node = &stack.node;
    let drained = eventually(Duration::from_secs(10), || async {
        let idle = node.ledger.idle_counts(&node.id, &["trainer/step-2"]).await.ok()?;
        (idle[0] == 0).then_some(())
    })
    .await;
    assert!(drained.is_some(), "the deleted template's idle sandboxes were retired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_keeps_the_node_under_its_budget_and_spares_what_is_used() {
    // Each corpus image is ~2.2 MB (busybox's layers and its own 64 KiB): a 5 MB budget
    // holds two.
    let corpus = Corpus::build(5, 64);
    let opts = StackOpts { warm: 0, extra_toml: "[images]\ndisk_budget_mb = 5\n".into(), ..Default::default() };
    let stack = Stack::start(opts).await;
    let admin = stack.admin_client();
    let c = stack.client("acme");
    for (i, img) in corpus.images.iter().enumerate() {
        make(&admin, &format!("t{i}"), &img.image).await;
    }
    // t0 has a live session: in use, whatever its age.
    let s = open(&c, "public/t0").await;
    assert_eq!(s.status, 201, "{:?}", s.body);
    // The others are pulled one after another (t1 the least recently used of them).
    for i in 1..5 {
        let p =
            admin.call(Method::POST, "/v1/images:prefetch", Some(json!({"templates": [format!("public/t{i}")]}))).await;
        assert_eq!(p.status, 202, "{:?}", p.body);
        let node = &stack.node;
        let pulled = eventually(Duration::from_secs(30), || async {
            let held = node.ledger.node_images(&node.id).await.ok()?;
            held.contains(&corpus.images[i].reference).then_some(())
        })
        .await;
        assert!(pulled.is_some(), "t{i} pulled");
    }
    // Within a few eviction rounds (every 5 s) the node is under budget, t0 kept.
    let refs: Vec<String> = corpus.images.iter().map(|i| i.reference.clone()).collect();
    let left = eventually(Duration::from_secs(30), || async {
        let local = corpus.local();
        (local.len() <= 2).then_some(local)
    })
    .await
    .expect("evicted down to the budget");
    assert!(left.contains(&refs[0]), "the image of a live session stays: {left:?}");
    assert!(!left.contains(&refs[1]), "the least recently used goes first: {left:?}");
    let held = stack.node.ledger.node_images(&stack.node.id).await.unwrap();
    assert_eq!(held.len(), left.len(), "the ledger says what the node holds: {held:?} vs {left:?}");
    // An evicted image comes back on demand.
    let again = open(&c, "public/t1").await;
    assert_eq!(again.status, 201, "{:?}", again.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_reserved_pool_lands_whole_on_the_node_its_image_goes_to() {
    let corpus = Corpus::build(1, 16);
    let stack = Stack::start(StackOpts { warm: 0, autoscaler: true, ..Default::default() }).await;
    let guard = stack.add_node().await;
    let second = guard.node.clone();
    let c = stack.client("trainer");
    make(&c, "task", &corpus.images[0].image).await;
    // Both nodes report to the autoscaler before the reservation is planned.
    let ledger = &stack.node.ledger;
    let both = eventually(Duration::from_secs(10), || async {
        let a = ledger.stats(&stack.node.id).await.ok()??;
        let b = ledger.stats(&second.id).await.ok()??;
        (a.at_ms > 0 && b.at_ms > 0).then_some(())
    })
    .await;
    assert!(both.is_some(), "both nodes publish stats");
    let ready_by = humantime::format_rfc3339(std::time::SystemTime::now() + Duration::from_secs(12)).to_string();
    let items = json!([{"template": "trainer/task", "count": 4}]);
    let r = eventually(Duration::from_secs(5), || async {
        let r = c.call(Method::POST, "/v1/reservations", Some(json!({"items": items, "ready_by": ready_by}))).await;
        (r.status == 201).then_some(r)
    })
    .await;
    assert!(r.is_some(), "reserved");
    let nodes = [stack.node.clone(), second.clone()];
    let idle = eventually(Duration::from_secs(30), || async {
        let mut counts = Vec::new();
        for n in &nodes {
            counts.push(n.ledger.idle_counts(&n.id, &["trainer/task"]).await.ok()?[0]);
        }
        (counts.iter().sum::<usize>() >= 4).then_some(counts)
    })
    .await
    .expect("the reserved pool filled");
    // Whole on one node, the one that pulled the image; one pull in all.
    let home = if idle[0] >= 4 { &nodes[0] } else { &nodes[1] };
    assert!(idle.contains(&0), "split over nodes: {idle:?}");
    let held = home.ledger.node_images(&home.id).await.unwrap();
    assert_eq!(held, vec![corpus.images[0].reference.clone()]);
    let pulls: u64 = nodes.iter().map(|n| n.images.pulls_started.load(Ordering::Relaxed)).sum();
    assert_eq!(pulls, 1, "one node pulled the image");
}

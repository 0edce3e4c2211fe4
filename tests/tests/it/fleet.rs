//! Fleet operations: listings a page at a time (`limit`, `cursor` -> `next_cursor`) and the
//! end of every session that carries a label in one call (`DELETE /v1/sessions?label=k=v`,
//! `&subtree=true` for an ancestor), with their bad inputs and other tenants' sessions.

use std::collections::BTreeSet;

use reqwest::Method;
use serde_json::{Value, json};
use tests::{Client, Stack, StackOpts};

use crate::FILL;

async fn create_labelled(c: &Client, job: &str) -> String {
    let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb", "labels": {"job": job}}))).await;
    assert_eq!(a.status, 201, "create: {:?}", a.body);
    a.body["session_id"].as_str().expect("a session id").to_string()
}

/// Every item of a listing, walked `limit` at a time; the pages it took.
async fn walk(c: &Client, path: &str, key: &str, limit: usize) -> (Vec<Value>, usize) {
    let (mut items, mut pages, mut cursor) = (Vec::new(), 0, None::<String>);
    loop {
        let sep = if path.contains('?') { '&' } else { '?' };
        let mut url = format!("{path}{sep}limit={limit}");
        if let Some(c) = &cursor {
            url += &format!("&cursor={c}");
        }
        let a = c.call(Method::GET, &url, None).await;
        assert_eq!(a.status, 200, "{url}: {:?}", a.body);
        let page = a.body[key].as_array().expect("a list").clone();
        assert!(page.len() <= limit, "{url}: {} items", page.len());
        items.extend(page);
        pages += 1;
        match a.body.get("next_cursor").and_then(Value::as_str) {
            Some(next) => cursor = Some(next.to_string()),
            None => return (items, pages),
        }
    }
}

fn ids(sessions: &[Value]) -> Vec<String> {
    sessions.iter().map(|s| s["session_id"].as_str().expect("session_id").to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_list_a_page_at_a_time_and_end_by_label() {
    let stack = Stack::start(StackOpts { warm: 4, ..Default::default() }).await;
    stack.wait_idle("bb", 1, FILL).await;
    let acme = stack.client("acme");
    let run = stack.client("acme/run-7"); // a descendant of acme
    let other = stack.client("globex");
    let mut a_ids = Vec::new();
    for _ in 0..3 {
        a_ids.push(create_labelled(&acme, "a").await);
    }
    let b_ids = vec![create_labelled(&acme, "b").await, create_labelled(&acme, "b").await];
    let run_id = create_labelled(&run, "a").await;
    let other_id = create_labelled(&other, "a").await;

    // Two at a time: every own session once, oldest first, and no cursor after the last page.
    let (listed, pages) = walk(&acme, "/v1/sessions", "sessions", 2).await;
    let created: Vec<String> = a_ids.iter().chain(&b_ids).cloned().collect();
    assert_eq!(ids(&listed), created, "the pages in creation order");
    assert_eq!(pages, 3);
    let (listed, _) = walk(&acme, "/v1/sessions?subtree=true&label=job%3Da", "sessions", 1).await;
    let want: BTreeSet<String> = a_ids.iter().chain([&run_id]).cloned().collect();
    assert_eq!(ids(&listed).into_iter().collect::<BTreeSet<_>>(), want, "subtree and label select across pages");

    // Bad pages and selectors: clear 400s.
    let functions_cursor = {
        for name in ["f1", "f2"] {
            let def = json!({"template": "bb", "mode": "exec", "handler": ["cat"]});
            let a = acme.call(Method::PUT, &format!("/v1/functions/{name}"), Some(def)).await;
            assert_eq!(a.status, 201, "{:?}", a.body);
        }
        let a = acme.call(Method::GET, "/v1/functions?limit=1", None).await;
        assert_eq!(a.body["functions"][0]["name"], "f1", "{:?}", a.body);
        a.body["next_cursor"].as_str().expect("a second page").to_string()
    };
    for (path, word) in [
        ("/v1/sessions?cursor=zz".to_string(), "cursor"),
        ("/v1/sessions?cursor=6869".to_string(), "cursor"),
        (format!("/v1/sessions?cursor={functions_cursor}"), "cursor"),
        ("/v1/sessions?limit=0".to_string(), "limit"),
        ("/v1/sessions?limit=1001".to_string(), "limit"),
        ("/v1/sessions?label=job".to_string(), "label"),
        ("/v1/functions?cursor=00".to_string(), "cursor"),
        ("/v1/templates?limit=-1".to_string(), "limit"),
    ] {
        let a = acme.call(Method::GET, &path, None).await;
        assert_eq!((a.status, a.body["code"].as_str()), (400, Some("bad_request")), "{path}: {:?}", a.body);
        assert!(a.body["message"].as_str().unwrap_or_default().contains(word), "{path}: {:?}", a.body);
    }
    for path in ["/v1/sessions", "/v1/sessions?label=job", "/v1/sessions?label==a"] {
        let a = acme.call(Method::DELETE, path, None).await;
        assert_eq!((a.status, a.body["code"].as_str()), (400, Some("bad_request")), "{path}: {:?}", a.body);
    }
    let (fns, _) = walk(&acme, "/v1/functions", "functions", 1).await;
    assert_eq!(fns.iter().map(|f| f["name"].as_str().unwrap_or_default()).collect::<Vec<_>>(), ["f1", "f2"]);
    let (all, _) = walk(&acme, "/v1/templates", "templates", 1000).await;
    let (paged, pages) = walk(&acme, "/v1/templates", "templates", 1).await;
    assert_eq!((paged, pages), (all.clone(), all.len()), "templates a page at a time are the whole listing");

    // Another tenant's delete by label touches nothing of acme's.
    let a = other.call(Method::DELETE, "/v1/sessions?label=job%3Db", None).await;
    assert_eq!((a.status, &a.body), (200, &json!({"ended": 0})));
    assert_eq!(other.call(Method::GET, &format!("/v1/sessions/{}", b_ids[0]), None).await.status, 404);

    // acme's own job=a sessions end; its descendant's and globex's go on.
    let a = acme.call(Method::DELETE, "/v1/sessions?label=job%3Da", None).await;
    assert_eq!((a.status, &a.body), (200, &json!({"ended": 3})));
    for id in &a_ids {
        let got = acme.call(Method::GET, &format!("/v1/sessions/{id}"), None).await;
        assert_eq!((got.status, got.body["code"].as_str()), (404, Some("session_gone")), "{id}: {:?}", got.body);
    }
    assert_eq!(run.call(Method::GET, &format!("/v1/sessions/{run_id}"), None).await.status, 200);
    assert_eq!(other.call(Method::GET, &format!("/v1/sessions/{other_id}"), None).await.status, 200);
    // The ancestor ends its run's with the subtree; a second call finds nothing left.
    let a = acme.call(Method::DELETE, "/v1/sessions?label=job%3Da&subtree=true", None).await;
    assert_eq!((a.status, &a.body), (200, &json!({"ended": 1})));
    let a = acme.call(Method::DELETE, "/v1/sessions?label=job%3Da&subtree=true", None).await;
    assert_eq!((a.status, &a.body), (200, &json!({"ended": 0})));
    assert_eq!(run.call(Method::GET, &format!("/v1/sessions/{run_id}"), None).await.status, 404);
    assert_eq!(other.call(Method::GET, &format!("/v1/sessions/{other_id}"), None).await.status, 200);
    let (left, _) = walk(&acme, "/v1/sessions", "sessions", 1000).await;
    assert_eq!(ids(&left), b_ids, "job=b stays");
}

//! The public API's contract: auth, tenant isolation, validation and error shapes.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts};

use crate::FILL;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tokens_are_401_with_a_json_body() {
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let url = format!("{}/v1/templates", stack.url);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    let expired = {
        let c = gateway::auth::Claims {
            sub: "t".into(),
            exp: now - 120,
            iat: now - 200,
            scope: String::new(),
            nbf: None,
            iss: None,
            aud: None,
        };
        let k = jsonwebtoken_key(&stack);
        jsonwebtoken::encode(&jsonwebtoken::Header::default(), &c, &k).unwrap()
    };
    let foreign = {
        let c = gateway::auth::Claims {
            sub: "t".into(),
            exp: now + 120,
            iat: now,
            scope: String::new(),
            nbf: None,
            iss: None,
            aud: None,
        };
        let k = jsonwebtoken::EncodingKey::from_secret(b"some-other-key-entirely").unwrap();
        jsonwebtoken::encode(&jsonwebtoken::Header::default(), &c, &k).unwrap()
    };
    for (name, auth) in [
        ("missing", None),
        ("not bearer", Some("Basic Zm9vOmJhcg==".to_string())),
        ("malformed", Some("Bearer not-a-jwt".to_string())),
        ("expired", Some(format!("Bearer {expired}"))),
        ("wrong key", Some(format!("Bearer {foreign}"))),
    ] {
        let mut req = stack.http.get(&url);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{name}");
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["code"], "unauthorized", "{name}: {body}");
        assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()), "{name}");
    }
    let ok = stack.client("t").call(Method::GET, "/v1/templates", None).await;
    assert_eq!(ok.status, 200);
    let names: Vec<&str> =
        ok.body["templates"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["bb", "bbd"]);
}

fn jsonwebtoken_key(stack: &Stack) -> jsonwebtoken::EncodingKey {
    jsonwebtoken::EncodingKey::from_secret(&stack.config.auth.key).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_400_naming_the_field() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let c = stack.client("t");
    let raw = |body: &'static str| {
        let c = c.clone();
        async move {
            let r = c
                .http
                .post(format!("{}/v1/sessions", c.url))
                .bearer_auth(&c.token)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<serde_json::Value>().await.unwrap())
        }
    };
    let (s, b) = raw("{not json").await;
    assert_eq!((s, b["code"].as_str()), (400, Some("bad_request")), "{b}");
    let (s, b) = raw(r#"{"template":"bb","surprise":1}"#).await;
    assert_eq!(s, 400);
    assert!(b["message"].as_str().unwrap().contains("surprise"), "{b}");
    let (s, b) = raw(r#"{"template":"nope"}"#).await;
    assert_eq!((s, b["code"].as_str()), (400, Some("unknown_template")), "{b}");
    assert!(b["message"].as_str().unwrap().contains("template"), "{b}");
    let (s, b) = raw(r#"{"template":"bb","ttl_s":"soon"}"#).await;
    assert_eq!(s, 400);
    assert!(b["message"].as_str().unwrap().contains("ttl_s"), "{b}");
    let (s, b) = raw(r#"{"template":"bb","labels":{"bad key!":"x"}}"#).await;
    assert_eq!(s, 400);
    assert!(b["message"].as_str().unwrap().contains("labels"), "{b}");

    stack.wait_idle("bb", 1, FILL).await;
    let sid = c.create("bb").await["session_id"].as_str().unwrap().to_string();
    let a = c.exec(&sid, json!({"cmd": ["true"], "cwd_typo": "/"})).await;
    assert_eq!(a.status, 400);
    assert!(a.body["message"].as_str().unwrap().contains("cwd_typo"), "{:?}", a.body);
    let a = c.exec(&sid, json!({"cmd": 42})).await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    let a = c.exec(&sid, json!({"cmd": []})).await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    let a = c.exec(&sid, json!({"cmd": "true", "timeout_ms": 0})).await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    assert_eq!(a.body["message"].as_str(), Some("timeout_ms: must be 1 ..= 3600000"), "{:?}", a.body);
    // Oversized bodies are refused whole, with the same error shape.
    let big = vec![b'x'; (stack.config.gateway.max_body_bytes + 1) as usize];
    assert_eq!(c.put_file(&sid, "big.bin", big).await, 413);
    let a = c.call(Method::GET, "/v1/nope", None).await;
    assert_eq!((a.status, a.body["code"].as_str()), (404, Some("not_found")));
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_cannot_see_each_others_sessions() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    stack.wait_idle("bb", 1, FILL).await;
    let alice = stack.client("alice");
    let mallory = stack.client("mallory");
    let sid = alice.create("bb").await["session_id"].as_str().unwrap().to_string();
    for (m, path, body) in [
        (Method::GET, format!("/v1/sessions/{sid}"), None),
        (Method::POST, format!("/v1/sessions/{sid}/exec"), Some(json!({"cmd": "id"}))),
        (Method::POST, format!("/v1/sessions/{sid}/keepalive"), None),
        (Method::DELETE, format!("/v1/sessions/{sid}"), None),
    ] {
        let a = mallory.call(m.clone(), &path, body).await;
        assert_eq!(a.status, 404, "{m} {path}: {:?}", a.body);
        assert_eq!(a.body["code"], "not_found");
    }
    assert_eq!(mallory.get_file(&sid, "x").await.0, 404);
    assert_eq!(mallory.put_file(&sid, "x", b"evil".to_vec()).await, 404);
    // Untouched for its owner.
    assert_eq!(alice.sh(&sid, "echo still-mine").await["stdout"], "still-mine\n");
    assert_eq!(alice.delete(&sid).await, 204);
    let a = alice.call(Method::GET, &format!("/v1/sessions/{sid}"), None).await;
    assert_eq!((a.status, a.body["code"].as_str()), (404, Some("session_gone")), "{:?}", a.body);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_key_pins_the_same_session() {
    let stack = Stack::start(StackOpts { warm: 2, ..Default::default() }).await;
    stack.wait_idle("bb", 2, FILL).await;
    let c = stack.client("t");
    let body = json!({"template": "bb", "session_key": "episode-7", "labels": {"job": "j1"}});
    let first = c.call(Method::POST, "/v1/sessions", Some(body.clone())).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let again = c.call(Method::POST, "/v1/sessions", Some(body.clone())).await;
    assert_eq!(again.status, 200, "{:?}", again.body);
    assert_eq!(again.body["session_id"], first.body["session_id"]);
    assert_eq!(again.body["labels"]["job"], "j1");
    // Another tenant's identical key is a different session.
    let other = stack.client("u").call(Method::POST, "/v1/sessions", Some(body.clone())).await;
    assert_eq!(other.status, 201);
    assert_ne!(other.body["session_id"], first.body["session_id"]);
    // After delete, the key is free again.
    assert_eq!(c.delete(first.body["session_id"].as_str().unwrap()).await, 204);
    stack.wait_idle("bb", 1, FILL).await;
    let fresh = c.call(Method::POST, "/v1/sessions", Some(body)).await;
    assert_eq!(fresh.status, 201, "{:?}", fresh.body);
    assert_ne!(fresh.body["session_id"], first.body["session_id"]);
    let _ = Duration::ZERO;
    stack.shutdown().await;
}

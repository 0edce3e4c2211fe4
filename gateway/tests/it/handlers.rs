//! Auth, validation and error mapping of the public API.

use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use http_util::ApiError;
use serde_json::json;
use wire::ErrorCode;

use crate::support::Gw;

fn code(body: &serde_json::Value) -> &str {
    body["code"].as_str().unwrap_or("<none>")
}

#[tokio::test]
async fn requests_without_valid_tokens_are_401_with_a_json_body() {
    let gw = Gw::new().await;
    let bare = Request::builder().uri("/v1/templates").body(Body::empty()).unwrap();
    let (status, _, body) = gw.send(bare).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(code(&body), "unauthorized");

    let claims = json!({ "sub": "acme", "exp": 1_000_000_000u64 });
    let expired = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(b"test-jwt-key-0123456789abcdef").unwrap(),
    )
    .unwrap();
    let wrong_key = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &json!({ "sub": "acme", "exp": 4_000_000_000u64 }),
        &jsonwebtoken::EncodingKey::from_secret(b"another-key").unwrap(),
    )
    .unwrap();
    for (token, says) in [(expired.as_str(), "expired"), (wrong_key.as_str(), "signature"), ("nonsense", "invalid")] {
        let req = Request::builder()
            .uri("/v1/templates")
            .header("authorization", format!("Bearer {token}"))
            .body(Body::empty())
            .unwrap();
        let (status, _, body) = gw.send(req).await;
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!((status, code(&body)), (StatusCode::UNAUTHORIZED, "unauthorized"));
        assert!(body["message"].as_str().unwrap().contains(says), "{body}");
    }
}

#[tokio::test]
async fn bad_create_requests_are_400_naming_the_field() {
    let gw = Gw::new().await;
    for (body, want_code, names) in [
        (r#"{"template":"bb""#, "bad_request", "malformed JSON"),
        (r#"{"template":"bb","bogus":1}"#, "bad_request", "bogus"),
        (r#"{"template":"nope"}"#, "unknown_template", "template"),
        (r#"{"template":"bb","ttl_s":0}"#, "bad_request", "ttl_s"),
        (r#"{"template":"bb","max_wait_s":-1}"#, "bad_request", "max_wait_s"),
        (r#"{"template":"bb","session_key":"a b"}"#, "bad_request", "session_key"),
        (r#"{"template":"bb","labels":{"":"x"}}"#, "bad_request", "labels"),
    ] {
        let (status, answer, _) = gw.call("acme", "POST", "/v1/sessions", body).await;
        assert_eq!((status, code(&answer)), (StatusCode::BAD_REQUEST, want_code), "{body}: {answer}");
        assert!(answer["message"].as_str().unwrap().contains(names), "{body}: {answer}");
    }
    let big = format!(r#"{{"template":"bb","labels":{{"k":"{}"}}}}"#, "x".repeat(8192));
    let (status, answer, _) = gw.call("acme", "POST", "/v1/sessions", &big).await;
    assert_eq!((status, code(&answer)), (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"));
}

#[tokio::test]
async fn other_tenants_sessions_are_404_and_ended_ones_say_why() {
    let gw = Gw::new().await;
    let sid = gw.session("alice").await;
    for path in [format!("/v1/sessions/{sid}"), "/v1/sessions/n1.zz".into(), "/v1/sessions/nonsense".into()] {
        let (status, body, _) = gw.call("mallory", "GET", &path, "").await;
        assert_eq!((status, code(&body)), (StatusCode::NOT_FOUND, "not_found"), "{path}");
    }
    let (status, _, _) = gw.call("mallory", "DELETE", &format!("/v1/sessions/{sid}"), "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _, _) = gw.call("alice", "DELETE", &format!("/v1/sessions/{sid}"), "").await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, body, _) = gw.call("alice", "POST", &format!("/v1/sessions/{sid}/exec"), r#"{"cmd":"true"}"#).await;
    assert_eq!((status, code(&body)), (StatusCode::NOT_FOUND, "session_gone"));
    assert!(body["message"].as_str().unwrap().contains("deleted"), "{body}");
    assert!(gw.nodes.calls.lock().unwrap().is_empty(), "no call reached a node");
}

#[tokio::test]
async fn exec_is_validated_then_forwarded_byte_for_byte() {
    let gw = Gw::new().await;
    let sid = gw.session("acme").await;
    let path = format!("/v1/sessions/{sid}/exec");
    for body in [r#"{"cmd":"true","timeout_ms":0}"#, r#"{"cmd":"true","extra":1}"#, r#"{"cmd":"#] {
        let (status, answer, _) = gw.call("acme", "POST", &path, body).await;
        assert_eq!((status, code(&answer)), (StatusCode::BAD_REQUEST, "bad_request"), "{body}");
    }
    assert!(gw.nodes.calls.lock().unwrap().is_empty(), "invalid requests never reach a node");
    let node_answer = Bytes::from_static(br#"{"exit_code":0, "stdout":"hi\n","stderr":"","encoding":"utf8","duration_ms":0.5,"timed_out":false,"stdout_truncated":false,"stderr_truncated":false}"#);
    let a = node_answer.clone();
    gw.answer(move |_| Ok(a.clone()));
    let req = Request::builder()
        .method("POST")
        .uri(&path)
        .header("authorization", format!("Bearer {}", gw.token("acme")))
        .header("content-type", "application/json")
        .body(Body::from(r#"{"cmd":["echo","hi"]}"#))
        .unwrap();
    let (status, headers, bytes) = gw.send(req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(bytes, node_answer, "the node's answer is forwarded as it came");
    assert_eq!(headers["content-type"], "application/json");
    let calls = gw.nodes.calls.lock().unwrap();
    assert_eq!(calls.len(), 1);
    assert!(calls[0].path.ends_with("/exec") && calls[0].fence.is_some(), "{:?}", calls[0]);
    assert_eq!(calls[0].body.as_ref().unwrap().0, Bytes::from_static(br#"{"cmd":["echo","hi"]}"#));
}

#[tokio::test]
async fn node_failures_map_to_502_504_without_internal_details() {
    let gw = Gw::new().await;
    let sid = gw.session("acme").await;
    let path = format!("/v1/sessions/{sid}/exec");
    let cases: Vec<(ApiError, StatusCode, &str)> = vec![
        // The node's own bug: the gateway says the node failed.
        (
            ApiError::from_remote(
                StatusCode::INTERNAL_SERVER_ERROR,
                serde_json::from_str(r#"{"code":"internal","message":"internal error"}"#).ok(),
                "n1",
            ),
            StatusCode::BAD_GATEWAY,
            "bad_gateway",
        ),
        (
            ApiError::bad_gateway("node n1 is unreachable", "connect: OCI secret detail"),
            StatusCode::BAD_GATEWAY,
            "bad_gateway",
        ),
        (ApiError::gateway_timeout("node n1 did not answer in time"), StatusCode::GATEWAY_TIMEOUT, "gateway_timeout"),
        (ApiError::new(ErrorCode::StaleFence, "superseded"), StatusCode::CONFLICT, "stale_fence"),
        (ApiError::new(ErrorCode::SandboxFailed, "sandbox failed"), StatusCode::BAD_GATEWAY, "sandbox_failed"),
    ];
    for (err, want_status, want_code) in cases {
        let (c, m, r, d) = (err.code, err.message.clone(), err.retry_after_s, err.detail.clone());
        gw.answer(move |_| {
            Err(ApiError { code: c, message: m.clone(), retry_after_s: r, detail: d.clone(), quota: None })
        });
        let (status, body, headers) = gw.call("acme", "POST", &path, r#"{"cmd":"true"}"#).await;
        assert_eq!((status, code(&body)), (want_status, want_code), "{body}");
        assert!(!body.to_string().contains("OCI"), "no internal detail in {body}");
        if status.is_server_error() {
            let id = body["request_id"].as_str().expect("5xx answers quote a request id");
            assert_eq!(headers["x-request-id"], id);
        }
    }
}

#[tokio::test]
async fn readiness_needs_a_node_that_answers() {
    let gw = Gw::new().await;
    let ready = || Request::builder().uri("/readyz").body(Body::empty()).unwrap();
    assert_eq!(gw.send(ready()).await.0, StatusCode::NO_CONTENT);
    gw.answer(|_| Err(ApiError::bad_gateway("down", "down")));
    let (status, headers, _) = gw.send(ready()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.contains_key("retry-after"));
    let none = Gw::with_nodes(Vec::new()).await;
    assert_eq!(none.send(ready()).await.0, StatusCode::SERVICE_UNAVAILABLE);
    let (status, body, headers) = none.call("acme", "POST", "/v1/sessions", r#"{"template":"bb"}"#).await;
    assert_eq!((status, code(&body)), (StatusCode::SERVICE_UNAVAILABLE, "unavailable"));
    assert!(headers.contains_key("retry-after"));
}

#[tokio::test]
async fn unknown_routes_and_admin_calls_answer_in_json() {
    let gw = Gw::new().await;
    let (status, body, _) = gw.call("acme", "GET", "/v1/nothing-here", "").await;
    assert_eq!((status, code(&body)), (StatusCode::NOT_FOUND, "not_found"));
    let (status, body, _) = gw.call("acme", "GET", "/v1/pools", "").await;
    assert_eq!((status, code(&body)), (StatusCode::FORBIDDEN, "forbidden"));
    let (status, body, _) = gw
        .call("acme", "POST", "/v1/reservations", r#"{"template":"bb","count":0,"ready_by":"2030-01-01T00:00:00Z"}"#)
        .await;
    assert_eq!((status, code(&body)), (StatusCode::BAD_REQUEST, "bad_request"));
}

#[tokio::test]
async fn file_paths_that_climb_are_400_before_any_node_call() {
    let gw = Gw::new().await;
    let sid = gw.session("acme").await;
    for bad in ["../../etc/passwd", "a/../../b", "..%2F..%2Fetc%2Fpasswd", "x/%00y"] {
        for method in ["GET", "PUT"] {
            let (status, body, _) = gw.call("acme", method, &format!("/v1/sessions/{sid}/files/{bad}"), "x").await;
            assert_eq!((status, code(&body)), (StatusCode::BAD_REQUEST, "invalid_path"), "{method} {bad}: {body}");
        }
    }
    assert!(gw.nodes.calls.lock().unwrap().is_empty(), "no bad path reached a node");
}

#[tokio::test]
async fn every_answer_carries_its_request_id_and_a_5xx_body_quotes_it() {
    let gw = Gw::new().await;
    let sid = gw.session("acme").await;
    // A new id on every answer, success or not.
    let (_, _, ok) = gw.call("acme", "GET", &format!("/v1/sessions/{sid}"), "").await;
    let (_, _, missing) = gw.call("acme", "GET", "/v1/no-such-route", "").await;
    let (a, b) = (ok["x-request-id"].to_str().unwrap(), missing["x-request-id"].to_str().unwrap());
    assert!(!a.is_empty() && a != b, "{a} {b}");
    // The caller's own id is kept, and a 5xx body quotes it.
    gw.answer(|_| Err(ApiError::bad_gateway("node n1 failed", "detail")));
    let req = Request::builder()
        .method("POST")
        .uri(format!("/v1/sessions/{sid}/exec"))
        .header("authorization", format!("Bearer {}", gw.token("acme")))
        .header("content-type", "application/json")
        .header("x-request-id", "caller-7")
        .body(Body::from(r#"{"cmd":"true"}"#))
        .unwrap();
    let (status, headers, bytes) = gw.send(req).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(headers["x-request-id"], "caller-7");
    let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(body["request_id"], "caller-7", "{body}");
}

#[tokio::test]
async fn a_json_body_is_read_whatever_its_content_type_says() {
    let gw = Gw::new().await;
    gw.pool(2).await;
    let send = |content_type: Option<&'static str>, body: &'static str| {
        let mut req = Request::builder()
            .method("POST")
            .uri("/v1/sessions")
            .header("authorization", format!("Bearer {}", gw.token("acme")));
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        gw.send(req.body(Body::from(body)).unwrap())
    };
    // What `curl -d` sends, and no content type at all.
    for ct in [Some("application/x-www-form-urlencoded"), None] {
        let (status, _, bytes) = send(ct, r#"{"template":"bb"}"#).await;
        assert_eq!(status, StatusCode::CREATED, "{ct:?}: {}", String::from_utf8_lossy(&bytes));
    }
    // A body that is not JSON is still refused, with our error body.
    let (status, _, bytes) = send(Some("application/x-www-form-urlencoded"), "template=bb").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(body["code"], "bad_request");
    assert!(body["message"].as_str().unwrap().contains("malformed JSON"), "{body}");
}

#[tokio::test]
async fn sessions_are_listed_for_their_owner_and_with_subtree_for_ancestors() {
    let gw = Gw::new().await;
    let a1 = gw.session("lab").await;
    let a2 = gw.session("lab").await;
    let kid = gw.session("lab/run").await;
    gw.session("other").await;
    let ids = |v: &serde_json::Value| -> Vec<String> {
        let mut ids: Vec<String> =
            v["sessions"].as_array().unwrap().iter().map(|s| s["session_id"].as_str().unwrap().to_string()).collect();
        ids.sort();
        ids
    };
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let (status, body, _) = gw.call("lab", "GET", "/v1/sessions", "").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(ids(&body), sorted(vec![a1.clone(), a2.clone()]));
    let (_, body, _) = gw.call("lab", "GET", "/v1/sessions?subtree=true", "").await;
    assert_eq!(ids(&body), sorted(vec![a1.clone(), a2.clone(), kid.clone()]));
    let (_, body, _) = gw.call("lab/run", "GET", "/v1/sessions?subtree=true", "").await;
    assert_eq!(ids(&body), vec![kid.clone()], "a descendant does not see its ancestor's");
    let (_, body, _) = gw.call("lab", "GET", "/v1/sessions?subtree=true&label=job%3Dother", "").await;
    assert_eq!(ids(&body), Vec::<String>::new());
    for bad in ["/v1/sessions?label=nokv", "/v1/sessions?subtree=maybe", "/v1/sessions?colour=red"] {
        let (status, body, _) = gw.call("lab", "GET", bad, "").await;
        assert_eq!((status, code(&body)), (StatusCode::BAD_REQUEST, "bad_request"), "{bad}: {body}");
    }
}

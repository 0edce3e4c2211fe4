//! Tenancy through the API: delegation rights, refusals that name the limit, ancestors
//! managing descendants' sessions, and the call rate.

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::Value;

use crate::support::Gw;

fn code(body: &Value) -> &str {
    body["code"].as_str().unwrap_or("")
}

#[tokio::test]
async fn quotas_are_set_by_admins_and_delegated_down_never_up_or_sideways() {
    let gw = Gw::new().await;
    let (status, body) = gw.admin("PUT", "/v1/quotas/lab", r#"{"sessions": 6, "cpus": 8}"#).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["limits"]["sessions"], 6);
    // Delegation: a principal sets limits on its descendants, never on itself or a sibling.
    for (who, path, want) in [
        ("lab", "/v1/quotas/lab", StatusCode::FORBIDDEN),
        ("lab", "/v1/quotas/lab/a", StatusCode::OK),
        ("lab", "/v1/quotas/lab/b", StatusCode::OK),
        ("lab/a", "/v1/quotas/lab/b", StatusCode::FORBIDDEN),
        ("lab/a", "/v1/quotas/lab", StatusCode::FORBIDDEN),
        ("other", "/v1/quotas/lab/a", StatusCode::FORBIDDEN),
        ("lab/a", "/v1/quotas/lab/a/run1", StatusCode::OK),
    ] {
        let (status, body, _) = gw.call(who, "PUT", path, r#"{"sessions": 4}"#).await;
        assert_eq!(status, want, "{who} PUT {path}: {body}");
        if want == StatusCode::FORBIDDEN {
            assert_eq!(code(&body), "forbidden");
        }
    }
    // A child's limit may not exceed its parent's; bad bodies and paths are 400.
    for (path, body, names) in [
        ("/v1/quotas/lab/a/run2", r#"{"sessions": 5}"#, "lab/a"),
        ("/v1/quotas/lab/a/run2", r#"{"cpus": 9}"#, "cpus"),
        ("/v1/quotas/lab/a/run2", r#"{"sesions": 1}"#, "sesions"),
        ("/v1/quotas/lab/a/run2", r#"{"create_burst": 3}"#, "create_burst"),
        ("/v1/quotas/lab/a/x%20y", r#"{"sessions": 1}"#, "segments"),
    ] {
        let (status, answer, _) = gw.call("lab", "PUT", path, body).await;
        assert_eq!((status, code(&answer)), (StatusCode::BAD_REQUEST, "bad_request"), "{path} {body}: {answer}");
        assert!(answer["message"].as_str().unwrap().contains(names), "{body}: {answer}");
    }
    // Reading: one's own subtree (or admin).
    let (status, view, _) = gw.call("lab", "GET", "/v1/quotas/lab", "").await;
    assert_eq!(status, StatusCode::OK, "{view}");
    let children: Vec<&str> =
        view["children"].as_array().unwrap().iter().map(|c| c["path"].as_str().unwrap()).collect();
    assert_eq!(children, ["lab/a", "lab/b"]);
    let (status, _, _) = gw.call("lab/a", "GET", "/v1/quotas/lab/b", "").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    for bad in ["/v1/quotas/lab?children=maybe", "/v1/quotas/lab?colour=red"] {
        let (status, answer, _) = gw.call("lab", "GET", bad, "").await;
        assert_eq!((status, code(&answer)), (StatusCode::BAD_REQUEST, "bad_request"), "{bad}: {answer}");
    }
    // Usage up the caller's chain.
    let (status, usage, _) = gw.call("lab/a/run1", "GET", "/v1/usage", "").await;
    assert_eq!(status, StatusCode::OK);
    let levels: Vec<&str> = usage["levels"].as_array().unwrap().iter().map(|l| l["path"].as_str().unwrap()).collect();
    assert_eq!(levels, ["lab/a/run1", "lab/a", "lab"]);
    assert_eq!(usage["levels"][2]["limits"]["sessions"], 6);
    // Removing: the same rights.
    let (status, _, _) = gw.call("lab/a", "DELETE", "/v1/quotas/lab/a", "").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _, _) = gw.call("lab", "DELETE", "/v1/quotas/lab/a", "").await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    // Verify is for admins.
    let (status, _, _) = gw.call("lab", "POST", "/v1/quotas:verify", "").await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, drift) = gw.admin("POST", "/v1/quotas:verify", "").await;
    assert_eq!(status, StatusCode::OK, "{drift}");
    assert_eq!(drift["drift"], serde_json::json!([]));
}

#[tokio::test]
async fn creates_over_a_quota_are_429_naming_the_dimension_path_limit_and_use() {
    let gw = Gw::new().await;
    gw.pool(4).await;
    gw.admin("PUT", "/v1/quotas/acme", r#"{"sessions": 2}"#).await;
    let create = r#"{"template":"bb"}"#;
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (status, body, _) = gw.call("acme/rl", "POST", "/v1/sessions", create).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        ids.push(body["session_id"].as_str().unwrap().to_string());
    }
    let idle = gw.ledger.idle_counts(crate::support::NODE, &["bb"]).await.unwrap();
    let (status, body, _) = gw.call("acme/ml", "POST", "/v1/sessions", create).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    // The refused create's checkout (sent beside its admission) was undone: the pool is whole.
    assert_eq!(gw.ledger.idle_counts(crate::support::NODE, &["bb"]).await.unwrap(), idle);
    assert!(gw.ledger.pop_doomed(crate::support::NODE, std::time::Duration::from_millis(20)).await.unwrap().is_none());
    assert_eq!(code(&body), "quota_exceeded");
    assert_eq!(
        (&body["dimension"], &body["path"], &body["limit"], &body["used"]),
        (&"sessions".into(), &"acme".into(), &2.0.into(), &2.0.into())
    );
    assert!(body["message"].as_str().unwrap().contains("sessions"), "{body}");
    // Another tenant is untouched.
    let (status, _, _) = gw.call("beta", "POST", "/v1/sessions", create).await;
    assert_eq!(status, StatusCode::CREATED);
    // An ancestor reads and deletes a descendant's session; a sibling gets 404; using it
    // (exec) is for its owner only.
    let s0 = format!("/v1/sessions/{}", ids[0]);
    assert_eq!(gw.call("acme/ml", "GET", &s0, "").await.0, StatusCode::NOT_FOUND);
    assert_eq!(gw.call("acme", "GET", &s0, "").await.0, StatusCode::OK);
    assert_eq!(gw.call("acme", "POST", &format!("{s0}/exec"), r#"{"cmd":"true"}"#).await.0, StatusCode::NOT_FOUND);
    assert_eq!(gw.call("acme", "DELETE", &s0, "").await.0, StatusCode::NO_CONTENT);
    // Its usage came back with the answer.
    let (status, body, _) = gw.call("acme/ml", "POST", "/v1/sessions", create).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (_, usage, _) = gw.call("acme/ml", "GET", "/v1/usage", "").await;
    assert_eq!(
        (&usage["levels"][0]["usage"]["sessions"], &usage["levels"][1]["usage"]["sessions"]),
        (&1.into(), &2.into())
    );
}

#[tokio::test]
async fn the_create_rate_answers_429_with_retry_after() {
    let gw = Gw::new().await;
    gw.pool(3).await;
    gw.admin("PUT", "/v1/quotas/acme", r#"{"create_rate": 0.5, "create_burst": 1}"#).await;
    let (status, _, _) = gw.call("acme", "POST", "/v1/sessions", r#"{"template":"bb"}"#).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, body, headers) = gw.call("acme", "POST", "/v1/sessions", r#"{"template":"bb"}"#).await;
    assert_eq!(
        (status, code(&body), &body["dimension"]),
        (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", &"create_rate".into())
    );
    assert_eq!(headers["retry-after"], "2", "one create every 2 s");
}

#[tokio::test]
async fn the_call_rate_limits_each_principal_on_its_own() {
    let gw = Gw::with_config(vec![crate::support::NODE.into()], "[quotas]\ncall_rate = 0.5\ncall_burst = 2\n").await;
    let result = Bytes::from_static(br#"{"exit_code":0,"stdout":"","stderr":"","encoding":"utf8","duration_ms":0.1,"timed_out":false,"stdout_truncated":false,"stderr_truncated":false}"#);
    gw.answer(move |_| Ok(result.clone()));
    let (a, b) = (gw.session("acme").await, gw.session("beta").await);
    let exec = |sid: &str| format!("/v1/sessions/{sid}/exec");
    for _ in 0..2 {
        assert_eq!(gw.call("acme", "POST", &exec(&a), r#"{"cmd":"true"}"#).await.0, StatusCode::OK);
    }
    let (status, body, headers) = gw.call("acme", "POST", &exec(&a), r#"{"cmd":"true"}"#).await;
    assert_eq!(
        (status, code(&body), &body["dimension"]),
        (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", &"call_rate".into())
    );
    assert_eq!(headers["retry-after"], "2");
    assert_eq!(gw.call("beta", "POST", &exec(&b), r#"{"cmd":"true"}"#).await.0, StatusCode::OK);
}

#[tokio::test]
async fn reservations_hold_the_reserved_quota() {
    let gw = Gw::new().await;
    gw.admin("PUT", "/v1/quotas/acme", r#"{"reserved": 10}"#).await;
    let ready_by = humantime::format_rfc3339(std::time::SystemTime::now() + std::time::Duration::from_secs(60));
    let body = |count: u64| format!(r#"{{"template":"bb","count":{count},"ready_by":"{ready_by}","hold_s":60}}"#);
    let (status, answer, _) = gw.call("acme/rl", "POST", "/v1/reservations", &body(8)).await;
    assert_eq!(status, StatusCode::CREATED, "{answer}");
    let (status, answer, _) = gw.call("acme/ml", "POST", "/v1/reservations", &body(3)).await;
    assert_eq!(
        (status, code(&answer), &answer["dimension"]),
        (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded", &"reserved".into())
    );
    assert_eq!((&answer["path"], &answer["used"]), (&"acme".into(), &8.0.into()));
    let (status, _, _) = gw.call("acme/ml", "POST", "/v1/reservations", &body(2)).await;
    assert_eq!(status, StatusCode::CREATED);
    let (_, usage, _) = gw.call("acme/ml", "GET", "/v1/usage", "").await;
    assert_eq!(
        (&usage["levels"][0]["usage"]["reserved"], &usage["levels"][1]["usage"]["reserved"]),
        (&2.into(), &10.into())
    );
}

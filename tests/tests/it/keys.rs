//! Tokens signed by an identity provider's keys (`auth.jwks`), through a running gateway: the
//! set is read before the gateway listens, a rotated key is picked up without a restart, and
//! the static key keeps working for tokens that name no key id.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts};

fn jwk(kid: &str, secret: &[u8]) -> serde_json::Value {
    let k = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret);
    json!({"kty": "oct", "kid": kid, "alg": "HS256", "k": k})
}

fn token(secret: &[u8], kid: Option<&str>, sub: &str) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256);
    header.kid = kid.map(String::from);
    let claims = json!({"sub": sub, "iat": now, "exp": now + 300});
    jsonwebtoken::encode(&header, &claims, &jsonwebtoken::EncodingKey::from_secret(secret).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_reads_its_jwks_and_follows_a_rotation() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let dir = std::env::temp_dir().join(format!("sandpool-keys-{}", tests::rand_hex(8)));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("jwks.json");
    let (old, new) =
        (b"idp-signing-key-2026-11-0123456789".as_slice(), b"idp-signing-key-2026-12-0123456789".as_slice());
    std::fs::write(&path, json!({"keys": [jwk("2026-11", old)]}).to_string()).unwrap();

    let mut config = (*stack.config).clone();
    config.auth.jwks = Some(config::JwksSource::File(path.clone()));
    let (url, _stop) = stack.gateway_with(Arc::new(config)).await;
    let as_token = |t: String| tests::Client { http: reqwest::Client::new(), url: url.clone(), token: t };

    // A key of the set, at once (read before the gateway listened); the static key for a token
    // that names no key id; a key id the set lacks is refused, naming it.
    let idp = as_token(token(old, Some("2026-11"), "acme"));
    let listed = idp.call(Method::GET, "/v1/sessions", None).await;
    assert_eq!(listed.status, 200, "{:?}", listed.body);
    let legacy = as_token(stack.client("acme").token.clone());
    assert_eq!(legacy.call(Method::GET, "/v1/sessions", None).await.status, 200);
    let next = as_token(token(new, Some("2026-12"), "acme"));
    let refused = next.call(Method::GET, "/v1/sessions", None).await;
    assert_eq!((refused.status, refused.body["code"].as_str()), (401, Some("unauthorized")), "{:?}", refused.body);
    assert!(refused.body["message"].as_str().unwrap().contains("2026-12"), "{:?}", refused.body);

    // Rotation: the provider publishes the new key beside the old one. The next token naming
    // it is accepted within seconds (an unknown key id reads the set early), not after the
    // five-minute refresh, and with no restart; sessions work under it.
    std::fs::write(&path, json!({"keys": [jwk("2026-11", old), jwk("2026-12", new)]}).to_string()).unwrap();
    let accepted = tests::eventually(Duration::from_secs(10), || async {
        (next.call(Method::GET, "/v1/sessions", None).await.status == 200).then_some(())
    });
    assert!(accepted.await.is_some(), "the rotated key was not picked up within 10 s");
    let s = next.create("bb").await["session_id"].as_str().unwrap().to_string();
    assert_eq!(next.sh(&s, "echo rotated").await["stdout"], "rotated\n");
    assert_eq!(next.delete(&s).await, 204);
    std::fs::remove_dir_all(&dir).unwrap();
    stack.shutdown().await;
}

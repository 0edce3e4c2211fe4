//! Keys by id from a JSON Web Key Set (`auth.jwks`: a file or an http(s) URL), read again every
//! `auth.jwks_refresh` and sooner when a token names a key id the set lacks: an issuer rotates
//! its signing key (publishes the new one, signs with it, retires the old one) and gateways
//! follow without a restart. A failed read keeps the keys already read.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use config::JwksSource;
use jsonwebtoken::jwk::{AlgorithmParameters, Jwk, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Unknown key ids read the set again at most this often: a stream of tokens with made-up
/// ids must not become a stream of fetches from the issuer.
const MIN_REREAD: Duration = Duration::from_secs(2);
/// One read of a URL, at most.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

type Keys = HashMap<String, (DecodingKey, Algorithm)>;

/// The signing keys of an `auth.jwks` key set by key id, kept fresh by `run`.
pub struct KeySet {
    source: JwksSource,
    keys: RwLock<Keys>,
    /// Woken by a token whose key id is not in the set.
    stale: Notify,
    http: reqwest::Client,
}

impl KeySet {
    /// An empty set read from `source` by `reload` (the gateway reads it before it listens).
    pub fn new(source: JwksSource) -> anyhow::Result<KeySet> {
        let http = reqwest::Client::builder().timeout(FETCH_TIMEOUT).build().context("build the JWKS client")?;
        Ok(KeySet { source, keys: RwLock::new(HashMap::new()), stale: Notify::new(), http })
    }

    /// The key with id `kid` and its algorithm. An unknown id asks for an early read.
    pub fn get(&self, kid: &str) -> Option<(DecodingKey, Algorithm)> {
        // A poisoned lock only means a writer panicked between two whole-map swaps: the map
        // is whole either way.
        let found = self.keys.read().unwrap_or_else(|p| p.into_inner()).get(kid).cloned();
        if found.is_none() {
            self.stale.notify_one();
        }
        found
    }

    /// Reads the set again and replaces the keys; answers how many it holds.
    pub async fn reload(&self) -> anyhow::Result<usize> {
        let text = match &self.source {
            JwksSource::File(path) => {
                tokio::fs::read_to_string(path).await.with_context(|| format!("read {}", path.display()))?
            }
            JwksSource::Url(url) => {
                let r = self.http.get(url).send().await.with_context(|| format!("fetch {url}"))?;
                r.error_for_status().with_context(|| format!("fetch {url}"))?.text().await?
            }
        };
        let keys = parse(&text)?;
        let n = keys.len();
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = keys;
        Ok(n)
    }

    /// Reads the set every `every`, and (at most every `MIN_REREAD`) when a token named an
    /// unknown key id, until `cancel`.
    pub async fn run(self: Arc<Self>, every: Duration, cancel: CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
                _ = self.stale.notified() => {}
            }
            match self.reload().await {
                Ok(n) => tracing::debug!(keys = n, "read the JWKS"),
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "read the JWKS (keeping the keys read before)"),
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(MIN_REREAD) => {}
            }
        }
    }
}

/// The keys of a JWKS document that have an id; a key this gateway cannot use is an error
/// (a typo in a key should not pass as a smaller set).
fn parse(text: &str) -> anyhow::Result<Keys> {
    let set: JwkSet = serde_json::from_str(text).context("parse the JWKS")?;
    let mut keys = HashMap::new();
    for jwk in &set.keys {
        let Some(kid) = jwk.common.key_id.clone() else { continue };
        let key = DecodingKey::from_jwk(jwk).with_context(|| format!("JWKS key {kid:?}"))?;
        keys.insert(kid, (key, algorithm_of(jwk)?));
    }
    Ok(keys)
}

/// A key's algorithm: its `alg`, else its key type's usual one.
fn algorithm_of(jwk: &Jwk) -> anyhow::Result<Algorithm> {
    if let Some(alg) = jwk.common.key_algorithm {
        return Algorithm::try_from(alg).map_err(|e| anyhow::anyhow!("JWKS key algorithm {alg}: {e}"));
    }
    Ok(match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::EllipticCurve(_) => Algorithm::ES256,
        AlgorithmParameters::OctetKeyPair(_) => Algorithm::EdDSA,
        AlgorithmParameters::OctetKey(_) => Algorithm::HS256,
        _ => anyhow::bail!("JWKS key of an unknown type"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{Claims, Verifier};
    use jsonwebtoken::{EncodingKey, Header};

    const ONE: &[u8] = b"jwks-secret-one-0123456789abcdef";
    const TWO: &[u8] = b"jwks-secret-two-0123456789abcdef";
    const ONE_JWK: &str = r#"{"kty":"oct","kid":"k1","alg":"HS256","k":"andrcy1zZWNyZXQtb25lLTAxMjM0NTY3ODlhYmNkZWY"}"#;
    const TWO_JWK: &str = r#"{"kty":"oct","kid":"k2","alg":"HS256","k":"andrcy1zZWNyZXQtdHdvLTAxMjM0NTY3ODlhYmNkZWY"}"#;

    fn token(secret: &[u8], kid: Option<&str>, sub: &str) -> String {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let claims =
            Claims { sub: sub.into(), exp: now + 60, iat: now, nbf: None, iss: None, aud: None, scope: String::new() };
        let mut header = Header::new(Algorithm::HS256);
        header.kid = kid.map(String::from);
        jsonwebtoken::encode(&header, &claims, &EncodingKey::from_secret(secret).unwrap()).unwrap()
    }

    fn auth(jwks: JwksSource) -> config::AuthConfig {
        let text = "[pool_manager]\nsecret = \"0123456789abcdef\"\n[auth]\nkey = \"static-key-0123456789\"\n\
                    [templates.t]\nimage = \"x\"\n";
        let mut c = config::Config::from_toml(text, &config::Overrides::default()).unwrap().auth;
        c.jwks = Some(jwks);
        c
    }

    #[tokio::test]
    async fn a_rotated_key_is_picked_up_from_a_url_without_a_restart() {
        // The issuer's JWKS endpoint: k1 now, k1 and k2 after the rotation.
        let doc = Arc::new(std::sync::Mutex::new(format!(r#"{{"keys":[{ONE_JWK}]}}"#)));
        let served = doc.clone();
        // Any path (a fallback: this is a stand-in server, not a route of the gateway).
        let app = axum::Router::new().fallback(move || {
            let d = served.clone();
            async move { d.lock().unwrap().clone() }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/jwks.json", listener.local_addr().unwrap());
        let cancel = CancellationToken::new();
        let server_stop = cancel.clone();
        tokio::spawn(async move {
            axum::serve(listener, app).with_graceful_shutdown(server_stop.cancelled_owned()).await.unwrap()
        });

        let v = Verifier::new(&auth(JwksSource::Url(url))).unwrap();
        let set = v.key_set().expect("a key set").clone();
        assert_eq!(set.reload().await.unwrap(), 1);
        tokio::spawn(set.clone().run(Duration::from_secs(3600), cancel.clone()));

        assert_eq!(v.verify(&token(ONE, Some("k1"), "acme")).unwrap().tenant, "acme");
        assert_eq!(
            v.verify(&token(b"static-key-0123456789", None, "old")).unwrap().tenant,
            "old",
            "no kid: the static key"
        );
        let e = v.verify(&token(TWO, Some("k2"), "acme")).unwrap_err();
        assert!(e.message.contains("k2"), "{}", e.message);
        let e = v.verify(&token(TWO, Some("k1"), "acme")).unwrap_err();
        assert!(e.message.contains("signature"), "k1's id with another key: {}", e.message);

        // Rotation: the issuer publishes k2; the next token naming it is accepted once the
        // early read (woken by the unknown id) has run, long before the hourly one.
        *doc.lock().unwrap() = format!(r#"{{"keys":[{ONE_JWK},{TWO_JWK}]}}"#);
        let t2 = token(TWO, Some("k2"), "acme");
        let _ = v.verify(&t2);
        let mut accepted = false;
        for _ in 0..100 {
            if v.verify(&t2).is_ok() {
                accepted = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(accepted, "the rotated key was not picked up within 5 s");
        cancel.cancel();
    }

    #[tokio::test]
    async fn a_file_set_is_read_and_a_bad_one_keeps_the_keys_read_before() {
        let dir = std::env::temp_dir().join(format!("sandpool-jwks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("jwks.json");
        std::fs::write(&path, format!(r#"{{"keys":[{TWO_JWK}, {{"kty":"oct","k":"bm8ta2lk"}}]}}"#)).unwrap();
        let v = Verifier::new(&auth(JwksSource::File(path.clone()))).unwrap();
        let set = v.key_set().expect("a key set").clone();
        assert_eq!(set.reload().await.unwrap(), 1, "a key without an id is no key of the set");
        assert!(v.verify(&token(TWO, Some("k2"), "acme")).is_ok());
        std::fs::write(&path, "{not json").unwrap();
        assert!(set.reload().await.is_err());
        assert!(v.verify(&token(TWO, Some("k2"), "acme")).is_ok(), "a bad read keeps the keys");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

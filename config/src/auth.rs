//! `[auth]`: how callers are authenticated (HMAC or public-key JWTs, a JWKS) and the shipped
//! development secrets.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::{ConfigError, HIDDEN, Overrides, invalid, pick};

/// The development JWT key and internal secret shipped in `config/sandpool.toml`. Anyone can
/// read them, so a process refuses them unless every listener it opens is on loopback.
pub const DEV_JWT_KEY: &str = "dev-jwt-key-change-me-please";

/// The shipped development internal secret; refused like `DEV_JWT_KEY`.
pub const DEV_INTERNAL_SECRET: &str = "dev-internal-secret-change-me";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawAuth {
    algorithm: Option<String>,
    /// HS*: the shared secret. Asymmetric: a PEM public key (verification).
    key: Option<String>,
    key_file: Option<PathBuf>,
    /// Asymmetric only: PEM private key, used by `sandpool token` to mint dev tokens.
    private_key_file: Option<PathBuf>,
    /// If set, tokens must carry this `iss`.
    issuer: Option<String>,
    /// If set, tokens must carry this `aud`.
    audience: Option<String>,
    /// If set, tokens must carry `iat` and live at most this long (`exp - iat`).
    #[serde(with = "humantime_serde", default)]
    max_token_lifetime: Option<Duration>,
    /// A JSON Web Key Set: a file path or an http(s) URL. Tokens whose header names a `kid`
    /// are checked with that key of the set; tokens without one, with `key`.
    jwks: Option<String>,
    /// How often the set is read again (default 5m); an unknown `kid` reads it sooner.
    #[serde(with = "humantime_serde", default)]
    jwks_refresh: Option<Duration>,
}

/// How tokens are signed: an HMAC secret (HS*) or a public-key pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JwtAlgorithm {
    /// HMAC with SHA-256 (a shared secret).
    HS256,
    /// HMAC with SHA-384 (a shared secret).
    HS384,
    /// HMAC with SHA-512 (a shared secret).
    HS512,
    /// RSA PKCS#1 v1.5 with SHA-256 (a public key).
    RS256,
    /// ECDSA P-256 with SHA-256 (a public key).
    ES256,
    /// Ed25519 (a public key).
    EdDSA,
}

impl JwtAlgorithm {
    /// True for the HMAC algorithms, whose one key both signs and verifies.
    pub fn is_symmetric(self) -> bool {
        matches!(self, JwtAlgorithm::HS256 | JwtAlgorithm::HS384 | JwtAlgorithm::HS512)
    }
}

/// `[auth]`, validated: how tokens are verified (and minted, where a signing key is given).
#[derive(Clone)]
pub struct AuthConfig {
    /// The algorithm every token must be signed with.
    pub algorithm: JwtAlgorithm,
    /// HS*: the secret bytes; otherwise the PEM public key.
    pub key: Vec<u8>,
    /// Asymmetric only: the PEM private key for minting, if configured.
    pub private_key: Option<Vec<u8>>,
    /// Tokens must carry this issuer (`iss`), if set; minted tokens carry it.
    pub issuer: Option<String>,
    /// Tokens must carry this audience (`aud`), if set; minted tokens carry it.
    pub audience: Option<String>,
    /// Tokens may live at most this long from `iat` to `exp`, if set.
    pub max_token_lifetime: Option<Duration>,
    /// Keys by id (`kid`), beside `key`: where the set is read from, if anywhere.
    pub jwks: Option<JwksSource>,
    /// How often the key set is read again.
    pub jwks_refresh: Duration,
}

/// Where a JSON Web Key Set is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JwksSource {
    /// A JWKS file on this machine, read again every `jwks_refresh`.
    File(PathBuf),
    /// A JWKS URL, fetched again every `jwks_refresh`.
    Url(String),
}

/// An identity provider rotates keys over days and publishes the next one ahead; five
/// minutes picks a new key up well before tokens signed with it appear, at one small read.
pub const DEFAULT_JWKS_REFRESH: Duration = Duration::from_secs(300);

/// What `sandpool config check` (or a stray `{:?}`) shows: an HMAC secret and a private key
/// are never printed; a public key is, as its PEM text.
impl std::fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let key = if self.algorithm.is_symmetric() {
            HIDDEN.to_string()
        } else {
            String::from_utf8_lossy(&self.key).into_owned()
        };
        f.debug_struct("AuthConfig")
            .field("algorithm", &self.algorithm)
            .field("key", &key)
            .field("private_key", &self.private_key.as_ref().map(|_| HIDDEN))
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("max_token_lifetime", &self.max_token_lifetime)
            .field("jwks", &self.jwks)
            .field("jwks_refresh", &self.jwks_refresh)
            .finish()
    }
}

pub(crate) fn validate_auth(raw: RawAuth, o: &Overrides) -> Result<AuthConfig, ConfigError> {
    let alg = pick(&o.jwt_algorithm, raw.algorithm, "HS256");
    let algorithm = match alg.as_str() {
        "HS256" => JwtAlgorithm::HS256,
        "HS384" => JwtAlgorithm::HS384,
        "HS512" => JwtAlgorithm::HS512,
        "RS256" => JwtAlgorithm::RS256,
        "ES256" => JwtAlgorithm::ES256,
        "EdDSA" => JwtAlgorithm::EdDSA,
        other => {
            return Err(invalid(
                "auth.algorithm",
                format!("{other:?} is not one of HS256, HS384, HS512, RS256, ES256, EdDSA"),
            ));
        }
    };
    let key = match (o.jwt_key.clone().or(raw.key), raw.key_file) {
        (Some(k), _) => k.into_bytes(),
        (None, Some(path)) => {
            std::fs::read(&path).map_err(|e| invalid("auth.key_file", format!("read {}: {e}", path.display())))?
        }
        (None, None) => return Err(invalid("auth.key", "a key (or auth.key_file, or SANDPOOL_JWT_KEY) is required")),
    };
    if algorithm.is_symmetric() && key.len() < 16 {
        return Err(invalid("auth.key", "an HMAC secret must be at least 16 bytes"));
    }
    let private_key = match raw.private_key_file {
        Some(path) => Some(
            std::fs::read(&path)
                .map_err(|e| invalid("auth.private_key_file", format!("read {}: {e}", path.display())))?,
        ),
        None => None,
    };
    if raw.max_token_lifetime.is_some_and(|d| d.is_zero()) {
        return Err(invalid("auth.max_token_lifetime", "must be more than 0"));
    }
    let jwks = match raw.jwks.filter(|j| !j.is_empty()) {
        Some(u) if u.starts_with("https://") || u.starts_with("http://") => Some(JwksSource::Url(u)),
        Some(u) if u.contains("://") => return Err(invalid("auth.jwks", "a file path or an http(s):// URL")),
        Some(path) => Some(JwksSource::File(PathBuf::from(path))),
        None => None,
    };
    let jwks_refresh = raw.jwks_refresh.unwrap_or(DEFAULT_JWKS_REFRESH);
    if jwks_refresh < Duration::from_secs(1) {
        return Err(invalid("auth.jwks_refresh", "must be at least 1s"));
    }
    Ok(AuthConfig {
        algorithm,
        key,
        private_key,
        issuer: raw.issuer,
        audience: raw.audience,
        max_token_lifetime: raw.max_token_lifetime,
        jwks,
        jwks_refresh,
    })
}

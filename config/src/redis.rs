//! `[redis]`: where the ledger lives (one Redis, or a Redis Cluster's seeds) and its key prefix.

use serde::Deserialize;

use crate::{ConfigError, Overrides, invalid, pick};

/// A Redis on this machine.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// Every key sandpool writes starts with this, so one Redis can host several deployments.
pub const DEFAULT_REDIS_PREFIX: &str = "sandpool";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawRedis {
    url: Option<String>,
    prefix: Option<String>,
}

/// `[redis]`, validated.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// One `redis://` or `unix://` URL, or a Redis Cluster's comma-separated seeds.
    pub url: String,
    /// What every key of this deployment starts with.
    pub prefix: String,
}

/// `[redis]`, with the URL and prefix overrides.
pub(crate) fn validate_redis(raw: RawRedis, o: &Overrides) -> Result<RedisConfig, ConfigError> {
    let redis = RedisConfig {
        url: pick(&o.redis_url, raw.url, DEFAULT_REDIS_URL),
        prefix: pick(&o.redis_prefix, raw.prefix, DEFAULT_REDIS_PREFIX),
    };
    // One URL is a single Redis; a comma-separated list is a Redis Cluster's seeds (the ledger
    // tells them apart the same way: `ledger::Topology`).
    if redis.url.contains(',') {
        let seeds: Vec<&str> = redis.url.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        if seeds.is_empty() || !seeds.iter().all(|s| s.starts_with("redis://")) {
            return Err(invalid("redis.url", "a cluster's seeds must each start with redis://"));
        }
    } else if !redis.url.starts_with("redis://") && !redis.url.starts_with("unix://") {
        return Err(invalid("redis.url", "must start with redis:// or unix://"));
    }
    if redis.prefix.is_empty() || redis.prefix.contains(['{', '}', ' ']) {
        return Err(invalid("redis.prefix", "must be non-empty without braces or spaces"));
    }
    Ok(redis)
}

//! sandpool's typed configuration: a raw TOML layer with defaults, environment overrides, and
//! validation into the runtime `Config` that every binary uses. Bad config names its field.
//!
//! One file per section (`node`, `redis`, `docker`, `gateway`, `pool_manager`, `auth`,
//! `telemetry`, `quotas`, `egress`, `images`, `template`): its raw serde struct, its validated
//! struct, its defaults and its `validate_*`. This file holds what spans sections: the whole
//! `Config`, loading, overrides and the checks across sections.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

mod auth;
mod docker;
pub mod egress;
pub mod env;
pub mod envelope;
mod gateway;
mod images;
mod node;
mod pool_manager;
mod quotas;
mod redis;
pub mod registries;
mod telemetry;
mod template;

pub use auth::*;
pub use docker::*;
pub use egress::EgressConfig;
pub(crate) use egress::{RawEgress, validate_egress};
pub use gateway::*;
pub use images::*;
pub use node::*;
pub use pool_manager::*;
pub use quotas::*;
pub use redis::*;
pub use registries::RegistryAuth;
pub use telemetry::*;
pub use template::*;

/// Where `sandpool` looks for its config when no `--config` is given.
pub const DEFAULT_CONFIG_PATH: &str = "config/sandpool.toml";

/// A command's timeout when its request names none (`wire::timeouts` checks every command).
pub const DEFAULT_EXEC_TIMEOUT: Duration = Duration::from_millis(wire::timeouts::DEFAULT_EXEC_TIMEOUT_MS);
/// The longest timeout a command may ask for.
pub const MAX_EXEC_TIMEOUT: Duration = Duration::from_millis(wire::timeouts::MAX_EXEC_TIMEOUT_MS);

/// Why a config could not be loaded; `Invalid` names the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// The file is not TOML of the expected shape.
    #[error("parse config file {path}: {message}")]
    Parse {
        /// The file (empty for text given directly).
        path: PathBuf,
        /// The parser's words, with the line.
        message: String,
    },
    /// A value is out of bounds or inconsistent with another.
    #[error("invalid config: {field}: {message}")]
    Invalid {
        /// The field at fault, as the file spells it (`gateway.max_queue`).
        field: String,
        /// What is wrong with it.
        message: String,
    },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), message: message.into() }
}

/// Overrides from flags or the environment; `None` keeps the file's value.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// Over `redis.url`.
    pub redis_url: Option<String>,
    /// Over `redis.prefix`.
    pub redis_prefix: Option<String>,
    /// Over `docker.socket`.
    pub docker_socket: Option<String>,
    /// Over `gateway.listen`.
    pub gateway_listen: Option<String>,
    /// Over `pool_manager.listen`.
    pub pool_manager_listen: Option<String>,
    /// Over `pool_manager.advertise`.
    pub pool_manager_advertise: Option<String>,
    /// Over `node.id`.
    pub node_id: Option<String>,
    /// Over `auth.key`: the JWT key (`SANDPOOL_JWT_KEY`).
    pub jwt_key: Option<String>,
    /// Over `auth.algorithm` (`SANDPOOL_JWT_ALGORITHM`).
    pub jwt_algorithm: Option<String>,
    /// Over `pool_manager.secret` (`SANDPOOL_INTERNAL_SECRET`).
    pub internal_secret: Option<String>,
}

// ---------- raw layer: what the TOML file says ----------

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawConfig {
    node: RawNode,
    redis: RawRedis,
    docker: RawDocker,
    gateway: RawGateway,
    pool_manager: RawPoolManager,
    auth: RawAuth,
    telemetry: RawTelemetry,
    log: RawLog,
    quotas: RawQuotas,
    egress: RawEgress,
    images: RawImages,
    templates: BTreeMap<String, RawTemplate>,
}

// ---------- runtime layer: validated ----------

/// The validated config every sandpool process runs with.
#[derive(Debug, Clone)]
pub struct Config {
    /// `[node]`.
    pub node: NodeConfig,
    /// `[redis]`.
    pub redis: RedisConfig,
    /// `[docker]`.
    pub docker: DockerConfig,
    /// `[gateway]`.
    pub gateway: GatewayConfig,
    /// `[pool_manager]`.
    pub pool_manager: PoolManagerConfig,
    /// `[auth]`.
    pub auth: AuthConfig,
    /// `[telemetry]`.
    pub telemetry: TelemetryConfig,
    /// `[log]`.
    pub log: LogConfig,
    /// `[quotas]`.
    pub quotas: QuotasConfig,
    /// `[egress]`.
    pub egress: EgressConfig,
    /// `[images]`.
    pub images: ImagesConfig,
    /// `[templates.*]`, by name.
    pub templates: BTreeMap<String, Template>,
}

/// What a secret shows as in printed config.
pub const HIDDEN: &str = "<hidden>";

impl Config {
    /// This config with every secret replaced by `HIDDEN` (the internal secret, registry
    /// passwords; the JWT key hides itself): what `sandpool config check` prints.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        c.pool_manager.secret = HIDDEN.into();
        let hide =
            |auths: &mut BTreeMap<String, RegistryAuth>| auths.values_mut().for_each(|a| a.password = HIDDEN.into());
        hide(&mut c.images.registries);
        c.images.scopes.values_mut().for_each(|s| hide(&mut s.registries));
        c
    }
}

impl Config {
    /// Reads `path`, applies this process's `SANDPOOL__SECTION__KEY` variables (`env`), then
    /// `overrides`, validates.
    pub fn load(path: &Path, overrides: &Overrides) -> Result<Config, ConfigError> {
        Self::load_with_env(path, overrides, process_env())
    }

    /// `load` with the environment given (tests, and `sandpool config check`).
    pub fn load_with_env(
        path: &Path,
        overrides: &Overrides,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        Self::from_toml_with_env(&text, overrides, vars).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: path.to_path_buf(), message },
            other => other,
        })
    }

    /// Parses and validates config text (file paths inside resolve against the working dir).
    /// The process's environment plays no part: see `from_toml_with_env`.
    pub fn from_toml(text: &str, overrides: &Overrides) -> Result<Config, ConfigError> {
        let raw: RawConfig =
            toml::from_str(text).map_err(|e| ConfigError::Parse { path: PathBuf::new(), message: e.to_string() })?;
        validate(raw, overrides)
    }

    /// `from_toml` with `SANDPOOL__SECTION__KEY` variables applied over the text (`env`).
    pub fn from_toml_with_env(
        text: &str,
        overrides: &Overrides,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let parse = |message: String| ConfigError::Parse { path: PathBuf::new(), message };
        let mut table: toml::Table = toml::from_str(text).map_err(|e| parse(e.to_string()))?;
        let applied = env::apply(&mut table, vars)?;
        if applied.is_empty() {
            // The text alone: its errors keep their line and column.
            return Self::from_toml(text, overrides);
        }
        let raw: RawConfig = toml::Value::Table(table).try_into().map_err(|e| {
            let e = e.to_string().trim_end().replace('\n', " ");
            parse(format!("{e} (with {} from the environment)", applied.join(", ")))
        })?;
        validate(raw, overrides)
    }
}

/// This process's environment, as far as it is text (a variable that is not is no config).
fn process_env() -> impl Iterator<Item = (String, String)> {
    std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
}

fn pick(over: &Option<String>, file: Option<String>, default: &str) -> String {
    over.clone().or(file).unwrap_or_else(|| default.to_string())
}

fn is_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn parse_addr(field: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse().map_err(|e| invalid(field, format!("{s:?} is not an ip:port address ({e})")))
}

/// The whole config, section by section; each section's own file validates it.
fn validate(raw: RawConfig, o: &Overrides) -> Result<Config, ConfigError> {
    let node = validate_node(raw.node, o)?;
    let redis = validate_redis(raw.redis, o)?;
    let docker = validate_docker(raw.docker, o)?;
    let gateway = validate_gateway(raw.gateway, o)?;
    let pool_manager = validate_pool_manager(raw.pool_manager, o)?;
    let auth = validate_auth(raw.auth, o)?;
    if raw.templates.is_empty() {
        return Err(invalid("templates", "at least one template is needed"));
    }
    let egress = validate_egress(raw.egress)?;
    let mut templates = BTreeMap::new();
    for (name, t) in raw.templates {
        let tpl = validate_template(&name, t, &docker.runtime, &egress)?;
        templates.insert(name, tpl);
    }
    let telemetry = validate_telemetry(raw.telemetry)?;
    let log = validate_log(raw.log)?;
    let quotas = validate_quotas(raw.quotas, &gateway)?;
    let images = validate_images(raw.images, &templates)?;
    let config =
        Config { node, redis, docker, gateway, pool_manager, auth, telemetry, log, quotas, egress, images, templates };
    refuse_public_dev_secrets(&config)?;
    Ok(config)
}

/// The shipped development secrets are fine for a laptop and fatal on a network: refuse them
/// when any listener is not on loopback, naming the listener and the fix.
fn refuse_public_dev_secrets(c: &Config) -> Result<(), ConfigError> {
    let mut listeners = vec![("gateway.listen", c.gateway.listen), ("pool_manager.listen", c.pool_manager.listen)];
    listeners.extend(c.telemetry.metrics_listen.map(|a| ("telemetry.metrics_listen", a)));
    let Some((name, addr)) = listeners.into_iter().find(|(_, a)| !a.ip().is_loopback()) else { return Ok(()) };
    let why = |what: &str, var: &str| {
        format!(
            "is the shipped development {what}, and {name} = {addr} is not on loopback: anyone could use it. \
             Set {var} to a fresh secret (for example `openssl rand -hex 32`), or listen on 127.0.0.1 only"
        )
    };
    if c.auth.algorithm.is_symmetric() && c.auth.key == DEV_JWT_KEY.as_bytes() {
        return Err(invalid("auth.key", why("JWT key", "SANDPOOL_JWT_KEY")));
    }
    if c.pool_manager.secret == DEV_INTERNAL_SECRET {
        return Err(invalid("pool_manager.secret", why("internal secret", "SANDPOOL_INTERNAL_SECRET")));
    }
    Ok(())
}

#[cfg(test)]
mod tests;

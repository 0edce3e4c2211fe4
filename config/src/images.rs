//! `[images]`: templates made from images: their bases, pulls, registries and the node's
//! image disk.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::registries::{self, RegistryAuth};
use crate::template::Template;
use crate::{ConfigError, invalid};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawImages {
    /// The configured template a template made from an image starts from when it names none.
    base: Option<String>,
    /// The configured templates a tenant's template may start from (default: `base` only).
    bases: Option<Vec<String>>,
    max_pulls_in_flight: Option<usize>,
    #[serde(with = "humantime_serde", default)]
    pull_timeout: Option<Duration>,
    /// MiB of images a node keeps; unused pulled images beyond it are evicted, least recently
    /// used first. 0: never evict.
    disk_budget_mb: Option<u64>,
    /// Credentials per registry host (`host[:port]`).
    registries: BTreeMap<String, RegistryAuth>,
    /// What every tenant may name (`host[:port]` or `host[:port]/path/*`, `{tenant}` in the
    /// path); empty (and no scope): any. Admins may name any.
    allowed_registries: Vec<String>,
    /// More entries and credentials per principal path (`registries::RegistryScope`).
    scopes: BTreeMap<String, registries::RawScope>,
    /// The registries a node mounts lazy images from (`host[:port]` or `host[:port]/path/*`);
    /// unset: its loopback registries only.
    lazy_registries: Option<Vec<String>>,
    /// Where the node's `sandpool-lazyd` listens (started there by the node when none answers).
    lazyd_socket: Option<PathBuf>,
    /// Where that daemon keeps its chunk cache and mounts.
    lazy_state_dir: Option<PathBuf>,
}

/// The image corpus: templates made from images, pulls and the node's image disk.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagesConfig {
    /// The configured template a template made from an image starts from by default.
    pub base: String,
    /// The configured templates a tenant's template may start from (their runtime, user and
    /// network are the operator's envelope for tenants' images); admins may start from any.
    pub bases: Vec<String>,
    /// Pulls one node runs at once (more wait their turn).
    pub max_pulls_in_flight: usize,
    /// One pull's bound (it counts toward the create that needs it).
    pub pull_timeout: Duration,
    /// MiB of images a node keeps before it evicts unused pulled ones; 0: never.
    pub disk_budget_mb: u64,
    /// Credentials by registry host, for every tenant.
    pub registries: BTreeMap<String, RegistryAuth>,
    /// What every tenant may make templates from; empty (with no scope on a tenant's path):
    /// any (nodes then contact whatever host a tenant names).
    pub allowed_registries: Vec<registries::RegistryPattern>,
    /// More entries and credentials per principal path, for it and its descendants.
    pub scopes: BTreeMap<String, registries::RegistryScope>,
    /// The registries whose lazy images a node mounts: a lazy image's filesystem is parsed by
    /// the node's kernel, so it must come from a registry the operator trusts with that (not
    /// one a tenant can push to). `None`: the node's loopback registries (`localhost`,
    /// `127.0.0.0/8`, `[::1]`), which only the node's own processes reach.
    pub lazy_registries: Option<Vec<registries::RegistryPattern>>,
    /// Where the node's lazy-image daemon `sandpool-lazyd` listens (one per node).
    pub lazyd_socket: PathBuf,
    /// Where it keeps its lock, chunk cache and mounts.
    pub lazy_state_dir: PathBuf,
}

impl ImagesConfig {
    /// The scopes on `principal`'s path, the most specific first.
    fn scopes_of(&self, principal: &str) -> Vec<&registries::RegistryScope> {
        let mut on_path: Vec<(&String, &registries::RegistryScope)> =
            self.scopes.iter().filter(|(p, _)| wire::quotas::within(principal, p)).collect();
        on_path.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
        on_path.into_iter().map(|(_, s)| s).collect()
    }

    /// The credentials for `reference`'s registry: those of the most specific scope on
    /// `principal`'s path that has some for it, else the deployment's.
    pub fn auth_for(&self, reference: &str, principal: Option<&str>) -> Option<&RegistryAuth> {
        let host = wire::images::registry_of(reference);
        principal
            .and_then(|p| self.scopes_of(p).into_iter().find_map(|s| s.registries.get(host)))
            .or_else(|| self.registries.get(host))
    }

    /// Whether a node may mount lazy image `reference` (see `lazy_registries`).
    pub fn lazy_trusted(&self, reference: &str) -> bool {
        match &self.lazy_registries {
            Some(trusted) => trusted.iter().any(|p| p.matches(reference, "")),
            None => registries::is_loopback(wire::images::registry_of(reference)),
        }
    }

    /// Whether tenant `principal` may name `reference`: an entry of `allowed_registries` or of
    /// a scope on its path matches it; with no entry at all, any reference.
    pub fn may_name(&self, principal: &str, reference: &str) -> bool {
        let scopes = self.scopes_of(principal);
        let mut entries = self.allowed_registries.iter().chain(scopes.iter().flat_map(|s| &s.allowed));
        let mut none = true;
        entries.any(|e| {
            none = false;
            e.matches(reference, principal)
        }) || none
    }
}

/// A pull from a registry on this machine takes seconds; 10 minutes is a large image from afar.
pub const DEFAULT_PULL_TIMEOUT: Duration = Duration::from_secs(600);

/// Pulls a node runs at once: each is network and disk bound, and a burst of new images should
/// not starve the creates of images already present.
pub const DEFAULT_MAX_PULLS_IN_FLIGHT: usize = 4;

/// `sandpool-lazyd`'s own defaults (`lazy_image::lazyd::DEFAULT_SOCKET`, `DEFAULT_STATE_DIR`;
/// this crate does not depend on that one: a pool-manager test holds them equal).
pub const DEFAULT_LAZYD_SOCKET: &str = "/run/sandpool/lazyd.sock";
/// See [`DEFAULT_LAZYD_SOCKET`].
pub const DEFAULT_LAZY_STATE_DIR: &str = "/var/lib/sandpool/lazy";

/// A node's image disk: 20 GiB holds ~100 typical task images (SWE-style, 100-300 MB each).
pub const DEFAULT_IMAGE_DISK_BUDGET_MB: u64 = 20 << 10;

pub(crate) fn validate_images(
    raw: RawImages,
    templates: &BTreeMap<String, Template>,
) -> Result<ImagesConfig, ConfigError> {
    let base = match raw.base {
        Some(b) if templates.contains_key(&b) => b,
        Some(b) => return Err(invalid("images.base", format!("no template named {b:?}"))),
        None if templates.contains_key("busybox") => "busybox".to_string(),
        None => templates.keys().next().cloned().unwrap_or_default(),
    };
    let bases = raw.bases.unwrap_or_else(|| vec![base.clone()]);
    if let Some(b) = bases.iter().find(|b| !templates.contains_key(*b)) {
        return Err(invalid("images.bases", format!("no template named {b:?}")));
    }
    let max_pulls_in_flight = raw.max_pulls_in_flight.unwrap_or(DEFAULT_MAX_PULLS_IN_FLIGHT);
    if !(1..=64).contains(&max_pulls_in_flight) {
        return Err(invalid("images.max_pulls_in_flight", "must be 1..=64"));
    }
    let pull_timeout = raw.pull_timeout.unwrap_or(DEFAULT_PULL_TIMEOUT);
    if pull_timeout < Duration::from_secs(1) {
        return Err(invalid("images.pull_timeout", "must be at least 1s"));
    }
    for host in raw.registries.keys() {
        if host.is_empty() || host.contains('/') {
            return Err(invalid(format!("images.registries.{host}"), "must be a registry host[:port]"));
        }
    }
    let allowed_registries = registries::patterns("images.allowed_registries", &raw.allowed_registries)?;
    let scopes = registries::scopes(raw.scopes)?;
    let lazy_registries = match raw.lazy_registries {
        Some(list) if list.iter().any(|e| e.contains(registries::TENANT_PLACEHOLDER)) => {
            return Err(invalid(
                "images.lazy_registries",
                "names registries the operator trusts, so it takes no {tenant} (a tenant's own path)",
            ));
        }
        Some(list) => Some(registries::patterns("images.lazy_registries", &list)?),
        None => None,
    };
    let lazyd_socket = raw.lazyd_socket.unwrap_or_else(|| DEFAULT_LAZYD_SOCKET.into());
    let lazy_state_dir = raw.lazy_state_dir.unwrap_or_else(|| DEFAULT_LAZY_STATE_DIR.into());
    for (field, path) in [("images.lazyd_socket", &lazyd_socket), ("images.lazy_state_dir", &lazy_state_dir)] {
        if !path.is_absolute() {
            return Err(invalid(field, "must be an absolute path"));
        }
    }
    Ok(ImagesConfig {
        base,
        bases,
        max_pulls_in_flight,
        pull_timeout,
        disk_budget_mb: raw.disk_budget_mb.unwrap_or(DEFAULT_IMAGE_DISK_BUDGET_MB),
        registries: raw.registries,
        allowed_registries,
        scopes,
        lazy_registries,
        lazyd_socket,
        lazy_state_dir,
    })
}

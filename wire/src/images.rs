//! Templates made from images by API, and the image corpus: prefetching images onto nodes
//! and seeing which node holds which.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::Network;

/// Longest name part of a template made from an image (after its namespace).
pub const MAX_TEMPLATE_NAME: usize = 64;
/// Most images (and templates) one prefetch names.
pub const MAX_PREFETCH: usize = 10_000;
/// The namespace of public templates (made by an admin).
pub const PUBLIC_NAMESPACE: &str = "public";

/// `POST /v1/templates`: a template from an image in a registry. A tenant's is private, named
/// `<principal>/<name>`; an admin's is public, `public/<name>`. The image is resolved to its
/// digest now: a tag that moves later never changes what this template runs.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTemplate {
    /// The name part: 1-64 characters of a-z, 0-9, '-' and '_' (default: `img-<hex>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `registry/repository:tag` or `registry/repository@sha256:...`.
    pub image: String,
    /// The configured template whose settings it starts from (runtime, user, lifetimes,
    /// limits); default: the config's `images.base`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    /// CPUs (fractional) a sandbox may use; default: the base's; at most it unless `beyond_base`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// The CFS period the CPU quota is spent in, 1 ..= 1000 ms: at least the base's (a
    /// shorter one costs the node scheduler work).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_period_ms: Option<u64>,
    /// Memory limit of a sandbox, MiB; default: the base's; at most it unless `beyond_base`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Writable disk of a sandbox, MiB; default: the base's; at most it (if bounded) unless `beyond_base`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mb: Option<u64>,
    /// Process (pids) limit of a sandbox; default: the base's; at most it unless `beyond_base`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
    /// The sandboxes' working directory (at most 4096 bytes); default: the base's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// Environment variables of its sandboxes (at most 128 of 4 KiB each, 64 KiB in all).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The base's network; an admin may choose `none` or `bridge` with `beyond_base`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
    /// Ports reachable through the gateway (`/v1/sessions/{id}/ports/{port}`): some of the
    /// base's (default: all of them); an admin may list others with `beyond_base`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<u16>>,
    /// Admin only: go past the base's envelope (its cpus, memory, pids and disk ceilings, its
    /// network). A tenant's template is always inside it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub beyond_base: bool,
}

/// A template made from an image, as the ledger keeps it and every node serves it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ImageTemplate {
    /// `<namespace>/<name>`.
    pub name: String,
    /// The principal that owns it; `None`: public.
    pub owner: Option<String>,
    /// The configured template it starts from.
    pub base: String,
    /// The reference as it was asked for.
    pub source: String,
    /// What sandboxes run: `repository@sha256:...`.
    pub image: String,
    /// CPUs (fractional) a sandbox may use.
    pub cpus: f64,
    /// 0: the base's (a record written before the field).
    #[serde(default)]
    pub cpu_period_ms: u64,
    /// Memory limit of a sandbox, MiB.
    pub memory_mb: u64,
    /// Writable disk of a sandbox, MiB; 0: no bound.
    pub disk_mb: u64,
    /// Process (pids) limit of a sandbox.
    pub pids: u64,
    /// The sandboxes' working directory.
    pub workdir: String,
    /// Environment variables of its sandboxes, as asked.
    pub env: BTreeMap<String, String>,
    /// Its network policy (`none` or `bridge`).
    pub network: Network,
    /// Its exposed ports (none in a record from before ports existed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    /// When it was made, Unix milliseconds (the ledger's clock).
    pub created_ms: u64,
    /// Made by an admin past its base's envelope (`CreateTemplate::beyond_base`); nodes hold
    /// every other template to its base's ceilings again when they run it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub beyond_base: bool,
}

/// `POST /v1/images:prefetch`: pull images onto nodes ahead of their sessions.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PrefetchRequest {
    /// Templates the caller may use; their images are pulled.
    #[serde(default)]
    pub templates: Vec<String>,
    /// Image references (admin only: a tenant names templates).
    #[serde(default)]
    pub images: Vec<String>,
    /// The nodes to pull onto; default: one node per image, spread over the nodes (a node that
    /// holds it already, else the image's place by rendezvous hashing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<Vec<String>>,
}

/// Where one image stands on one node.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PullState {
    /// On the node already.
    Present,
    /// Being pulled (started by this request or an earlier one).
    Pulling,
    /// Its last pull failed and it backs off; `error` says why.
    Failed,
}

/// Where one image stands on one node, as a prefetch or a node's pull answers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ImagePull {
    /// The image, pinned: `repository@sha256:...`.
    pub image: String,
    /// The node it is on or being pulled onto.
    pub node: String,
    /// Present, being pulled, or failed.
    pub state: PullState,
    /// Why its last pull failed (`failed` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Answer of `POST /v1/images:prefetch` (202: pulls run on).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct Prefetched {
    /// Each image on each node it goes to.
    pub pulls: Vec<ImagePull>,
}

/// `GET /v1/images` (admin): the images each node holds that templates made from images use.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ImagesView {
    /// Every node, with its images.
    pub nodes: Vec<NodeImages>,
}

/// The images one node holds, in `GET /v1/images`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct NodeImages {
    /// The node's id.
    pub node: String,
    /// `repository@sha256:...`, sorted.
    pub images: Vec<String>,
}

/// Whether `name` is a template made from an image (`<namespace>/<name>`).
pub fn is_image_template(name: &str) -> bool {
    name.contains('/')
}

/// Checks the name part of a template made from an image.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TEMPLATE_NAME
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// A reference taken apart: `[registry/]path[:tag][@digest]`, unchecked.
struct Parts<'a> {
    /// `host[:port]`, when the first component is one (it has a '.' or ':', or is `localhost`).
    registry: Option<&'a str>,
    /// The repository, its registry included (the reference without tag and digest).
    repository: &'a str,
    /// The repository's path components (after the registry).
    path: &'a str,
    tag: Option<&'a str>,
    digest: Option<&'a str>,
}

fn parts(r: &str) -> Parts<'_> {
    let (name, digest) = match r.split_once('@') {
        Some((n, d)) => (n, Some(d)),
        None => (r, None),
    };
    // A tag follows the last ':' after the last '/' (a registry's port comes before it).
    let last = name.rsplit('/').next().unwrap_or(name);
    let (repository, tag) = match last.rsplit_once(':') {
        Some((_, t)) => (&name[..name.len() - t.len() - 1], Some(t)),
        None => (name, None),
    };
    let (registry, path) = match repository.split_once('/') {
        Some((first, rest)) if first.contains(['.', ':']) || first == "localhost" => (Some(first), rest),
        _ => (None, repository),
    };
    Parts { registry, repository, path, tag, digest }
}

/// Checks an image reference's shape (`[registry/]repository[:tag][@sha256:<64 hex>]`): what
/// Docker would parse, so a bad one is refused before any node is asked.
pub fn valid_reference(r: &str) -> Result<(), String> {
    if r.is_empty() || r.len() > 512 {
        return Err("must be 1-512 characters".into());
    }
    let p = parts(r);
    if let Some(d) = p.digest {
        let hex = d.strip_prefix("sha256:").ok_or("a digest must be sha256:<64 hex digits>")?;
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err("a digest must be sha256:<64 lower-case hex digits>".into());
        }
    }
    if let Some(t) = p.tag
        && (t.is_empty()
            || t.len() > 128
            || !t.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
            || t.starts_with(['.', '-']))
    {
        return Err(format!("tag {t:?} is not a valid tag"));
    }
    if let Some(host) = p.registry {
        let host_ok = host.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'))
            && host.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '[')
            && !host.contains("..");
        if !host_ok {
            return Err(format!("registry {host:?} is not a host[:port]"));
        }
    }
    let component_ok = |c: &str| {
        !c.is_empty()
            && c.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'))
            && c.starts_with(|ch: char| ch.is_ascii_lowercase() || ch.is_ascii_digit())
    };
    if !p.path.split('/').all(component_ok) {
        return Err(format!("repository {:?} must be lower-case path components", p.repository));
    }
    Ok(())
}

/// The registry a reference names (`host[:port]`; Docker Hub's `docker.io` when it names none).
pub fn registry_of(reference: &str) -> &str {
    parts(reference).registry.unwrap_or("docker.io")
}

/// The repository of a reference: without its tag and digest.
pub fn repository_of(reference: &str) -> &str {
    parts(reference).repository
}

/// The repository's path inside its registry (`acme/task` of `127.0.0.1:5000/acme/task:v1`).
pub fn path_of(reference: &str) -> &str {
    parts(reference).path
}

/// The principal that owns a template made from an image, from its name (`acme/rl` for
/// `acme/rl/task`); `None` for a public one or a configured one.
pub fn owner_of(template: &str) -> Option<&str> {
    template.rsplit_once('/').map(|(ns, _)| ns).filter(|ns| *ns != PUBLIC_NAMESPACE)
}

/// The answer to an image a registry does not have and to one the caller may not name alike
/// (with `ErrorCode::ImageNotFound`), so a tenant cannot learn which names exist elsewhere.
pub fn not_found_message(reference: &str) -> String {
    format!("image: {reference:?} is not in its registry, or not one you may name")
}

/// The digest of a `repository@sha256:...` reference.
pub fn digest_of(reference: &str) -> Option<&str> {
    parts(reference).digest
}

/// The node `image` belongs to by rendezvous (highest random weight) hashing: the same answer
/// in every gateway and autoscaler, of any build (`stable_hash`, never `DefaultHasher`), and
/// adding or losing a node moves only its share.
pub fn rendezvous<'a>(nodes: &'a [String], image: &str) -> Option<&'a str> {
    let weight = |n: &str| crate::stable_hash::hash_parts(&["rendezvous", n, image]);
    nodes.iter().max_by_key(|n| weight(n)).map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references() {
        for ok in [
            "busybox",
            "sandpool/busybox:latest",
            "127.0.0.1:5000/corpus/task-0001:latest",
            "localhost/x",
            "registry.example.com/a/b/c@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "127.0.0.1:5000/x:v1.2@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ] {
            assert_eq!(valid_reference(ok), Ok(()), "{ok}");
        }
        for bad in
            ["", "Upper/case", "x:", "x@sha256:12", "a//b", "127.0.0.1:5000/", "x:-tag", "a b", "x@md5:00", "../x"]
        {
            assert!(valid_reference(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rendezvous_spreads_and_is_stable() {
        let nodes: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let mut counts = std::collections::HashMap::new();
        for i in 0..300 {
            let image = format!("r/task-{i}@sha256:00");
            let n = rendezvous(&nodes, &image).unwrap();
            assert_eq!(Some(n), rendezvous(&nodes, &image), "stable");
            *counts.entry(n).or_insert(0) += 1;
        }
        assert!(counts.values().all(|c| (60..=140).contains(c)), "{counts:?}");
        // Dropping a node moves only its images.
        for i in 0..100 {
            let image = format!("r/task-{i}@sha256:00");
            let before = rendezvous(&nodes, &image).unwrap();
            if before != "c" {
                assert_eq!(rendezvous(&nodes[..2], &image), Some(before));
            }
        }
        assert_eq!(rendezvous(&[], "x"), None);
        // Pinned: gateways and autoscalers of every build agree (`stable_hash`).
        let pinned: Vec<&str> = (0..6).map(|i| rendezvous(&nodes, &format!("r/task-{i}@sha256:00")).unwrap()).collect();
        assert_eq!(pinned, PINNED);
    }

    const PINNED: [&str; 6] = ["a", "a", "a", "b", "c", "a"];

    #[test]
    fn names() {
        assert!(valid_name("swe-task_0001"));
        assert!(!valid_name("a.b") && !valid_name("A") && !valid_name("") && !valid_name(&"a".repeat(65)));
        assert!(is_image_template("acme/x") && !is_image_template("busybox") && !is_image_template("local.ab12"));
        assert_eq!(digest_of("r/x@sha256:ab"), Some("sha256:ab"));
        assert_eq!(repository_of("127.0.0.1:5000/c/t:latest"), "127.0.0.1:5000/c/t");
        assert_eq!(repository_of("127.0.0.1:5000/c/t@sha256:ab"), "127.0.0.1:5000/c/t");
        assert_eq!(repository_of("127.0.0.1:5000/c/t"), "127.0.0.1:5000/c/t");
        assert_eq!(registry_of("127.0.0.1:5000/c/t:1"), "127.0.0.1:5000");
        assert_eq!((registry_of("busybox"), registry_of("library/busybox:1")), ("docker.io", "docker.io"));
        assert_eq!(registry_of("localhost/x"), "localhost");
    }
}

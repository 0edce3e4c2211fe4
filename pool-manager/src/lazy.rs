//! Lazy images on the node (issue 32). A template whose image is a lazy image (the form
//! `sandpool images convert` publishes) runs through Docker like any other, so everything
//! Docker gives a sandbox holds (networks, limits, pause, events, labels, readoption):
//! - the image is mounted once per node by `sandpool-lazyd` (started here on first need,
//!   detached, so its mounts outlive this process), its chunks fetched on demand;
//! - the container is made from a **stub image** (`sandpool-lazy:<manifest digest hex>`, one
//!   file: `lazy_image::oci::MARKER`, naming the image and its mount; the source's `Env`,
//!   `WorkingDir` and `Volumes`) on the `sandpool-lazy` OCI runtime, which mounts an overlay
//!   on the lazy mount as the container's root and runs runc (`lazy_image::oci`).
//!
//! The node asks here instead of pulling (`images.rs`), and creates containers of a lazy image
//! from its stub (`docker.rs`, [`LazyStubs::container_image`]), on the lazy runtime whenever
//! the image carries [`LABEL_LAZY_IMAGE`] (stubs, and snapshots of lazy sandboxes, which keep
//! their stub's label and marker: [`runtime_for`]). Nothing here calls Docker: the stub is a
//! tarball `Dock::use_lazy_stub` loads.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use lazy_image::lazyd::{self, MountInfo, Request, Response};
use lazy_image::manifest::{ImageManifest, LAZY_CONFIG_MEDIA_TYPE};
use lazy_image::oci::{MARKER, Marker, RUNTIME_NAME};
use lazy_image::{Reference, Registry};

/// The stub images' repository; the tag is the lazy image's manifest digest (hex).
pub(crate) const STUB_REPOSITORY: &str = "sandpool-lazy";
/// The label on a stub image naming its lazy image.
pub(crate) const LABEL_LAZY_IMAGE: &str = "sandpool.lazy.image";
/// How long a started `sandpool-lazyd` may take to answer.
const LAZYD_START_WAIT: Duration = Duration::from_secs(10);

/// Where the node's `sandpool-lazyd` listens and keeps its state (`[images] lazyd_socket`,
/// `lazy_state_dir`).
#[derive(Debug, Clone, PartialEq)]
pub struct Lazyd {
    /// Its Unix socket.
    pub socket: PathBuf,
    /// Its lock, chunk cache and mounts.
    pub state_dir: PathBuf,
}

impl Default for Lazyd {
    fn default() -> Lazyd {
        Lazyd { socket: lazyd::DEFAULT_SOCKET.into(), state_dir: lazyd::DEFAULT_STATE_DIR.into() }
    }
}

impl Lazyd {
    /// The daemon `config` names.
    pub fn of(config: &config::ImagesConfig) -> Lazyd {
        Lazyd { socket: config.lazyd_socket.clone(), state_dir: config.lazy_state_dir.clone() }
    }
}

/// The stub image of each lazy image this node has prepared, by the image's reference (the
/// template's `image`), and the daemon that mounts them. Shared by a `Dock` and its clones.
#[derive(Clone, Default)]
pub(crate) struct LazyStubs {
    by_image: Arc<Mutex<HashMap<String, String>>>,
    pub(crate) lazyd: Lazyd,
}

impl LazyStubs {
    pub(crate) fn insert(&self, image: &str, stub: &str) {
        self.by_image.lock().unwrap_or_else(|e| e.into_inner()).insert(image.to_string(), stub.to_string());
    }

    /// The image a container of a template of `image` is created from: the stub of a prepared
    /// lazy image, else `image` itself.
    pub(crate) fn container_image(&self, image: &str) -> String {
        let stub = self.by_image.lock().unwrap_or_else(|e| e.into_inner()).get(image).cloned();
        stub.unwrap_or_else(|| image.to_string())
    }
}

/// The OCI runtime of a container whose image runs over lazy image `lazy` (a stub, or a
/// snapshot of a lazy sandbox), for a template asking for `runtime`: the lazy runtime, once
/// the image is mounted on this node (again, after a `sandpool-lazyd` restart: a snapshot's
/// marker names the same mount point, which depends on the image's digest alone).
pub(crate) async fn runtime_for(lazyd: &Lazyd, lazy: &str, runtime: &str) -> anyhow::Result<String> {
    let name = lazy_runtime(runtime)
        .ok_or_else(|| anyhow::anyhow!("{lazy} is a lazy image, which runs on runc, crun or runsc, not {runtime}"))?;
    mount(lazyd, lazy).await?;
    Ok(name)
}

/// The lazy runtime in front of OCI runtime `runtime`, as dockerd knows it
/// (`ensure_runtimes` in scripts/lib.sh registers one per runtime, with the same flags).
fn lazy_runtime(runtime: &str) -> Option<String> {
    match runtime {
        "runc" => Some(RUNTIME_NAME.to_string()),
        "crun" | "runsc" => Some(format!("{RUNTIME_NAME}-{runtime}")),
        _ => None,
    }
}

/// A stub image to load into Docker: its tag and its `docker load` tarball.
pub struct Stub {
    pub tag: String,
    pub tar: Bytes,
}

/// Whether `image` is a lazy image: the node's `sandpool-lazyd` has it mounted (so a restarted
/// pool-manager finds its lazy images with the registry gone), or its registry answers with the
/// lazy config's media type. Anything else, a registry this client cannot read included, is
/// not: Docker pulls it as before (and reports any trouble in its own words).
pub(crate) async fn is_lazy(lazyd: &Lazyd, image: &str) -> bool {
    if mounted(lazyd, image).await {
        return true;
    }
    let Ok(reference) = Reference::parse(image) else { return false };
    let Ok(registry) = Registry::for_reference(&reference) else { return false };
    let probe = registry.manifest(&reference.repository, reference.manifest_reference());
    let Ok(Ok(fetched)) = tokio::time::timeout(Duration::from_secs(10), probe).await else {
        return false;
    };
    serde_json::from_slice::<ImageManifest>(&fetched.bytes).is_ok_and(|m| m.config.media_type == LAZY_CONFIG_MEDIA_TYPE)
}

/// Mounts lazy `image` through the node's `sandpool-lazyd` (started when none answers) and
/// returns its stub image.
pub(crate) async fn prepare(lazyd: &Lazyd, image: &str) -> anyhow::Result<Stub> {
    let began = Instant::now();
    let info = mount(lazyd, image).await?;
    tracing::info!(image, took = ?began.elapsed(), fetched = info.bytes_fetched, "lazy image mounted");
    stub(&info)
}

/// Whether the node's `sandpool-lazyd` answers and has `image` mounted (a question answered
/// from its memory: bounded short, and never starting a daemon).
async fn mounted(lazyd: &Lazyd, image: &str) -> bool {
    let stats = lazyd::call_within(&lazyd.socket, &Request::Stats, lazyd::QUICK_CALL_TIMEOUT).await;
    matches!(stats, Ok(Response::Stats { mounts, .. }) if mounts.iter().any(|m| m.image == image))
}

/// Mounts `image` on this node (at once when it is mounted already: no registry call).
async fn mount(lazyd: &Lazyd, image: &str) -> anyhow::Result<MountInfo> {
    ensure_lazyd(lazyd).await?;
    match lazyd::call(&lazyd.socket, &Request::Mount { image: image.to_string() }).await? {
        Response::Mounted(info) => Ok(info),
        Response::Error { message } => bail!("sandpool-lazyd could not mount {image}: {message}"),
        other => bail!("sandpool-lazyd answered {other:?} to a mount"),
    }
}

/// One request to the node's running `sandpool-lazyd` (never started here: these are the
/// upkeep's and prefetch's, which follow a mount), answered within `within`.
async fn ask(lazyd: &Lazyd, req: Request, within: Duration) -> anyhow::Result<Response> {
    match lazyd::call_within(&lazyd.socket, &req, within).await? {
        Response::Error { message } => bail!("sandpool-lazyd: {message}"),
        answer => Ok(answer),
    }
}

/// What the node's `sandpool-lazyd` holds: every mount's counters, the chunk cache's bytes
/// and bound.
pub(crate) struct LazydStats {
    pub(crate) mounts: Vec<MountInfo>,
    pub(crate) cache_used_bytes: u64,
    pub(crate) cache_limit_bytes: u64,
}

pub(crate) async fn stats(lazyd: &Lazyd) -> anyhow::Result<LazydStats> {
    match ask(lazyd, Request::Stats, lazyd::QUICK_CALL_TIMEOUT).await? {
        Response::Stats { mounts, cache_used_bytes, cache_limit_bytes } => {
            Ok(LazydStats { mounts, cache_used_bytes, cache_limit_bytes })
        }
        other => bail!("sandpool-lazyd answered {other:?} to stats"),
    }
}

/// Asks `sandpool-lazyd` to keep its chunk cache within `bytes` for this node (a lease the
/// node renews each upkeep); returns the cache's bound now.
pub(crate) async fn set_cache_limit(lazyd: &Lazyd, node: &str, bytes: u64) -> anyhow::Result<u64> {
    match ask(lazyd, Request::SetCacheLimit { client: node.to_string(), bytes }, lazyd::QUICK_CALL_TIMEOUT).await? {
        Response::CacheLimit { limit_bytes } => Ok(limit_bytes),
        other => bail!("sandpool-lazyd answered {other:?} to a cache limit"),
    }
}

/// The access profile of mounted `image`: its chunks in the order first read, and whether
/// its recording window has closed.
pub(crate) async fn profile(lazyd: &Lazyd, image: &str) -> anyhow::Result<(Vec<u64>, bool)> {
    match ask(lazyd, Request::Profile { image: image.to_string() }, lazyd::QUICK_CALL_TIMEOUT).await? {
        Response::Profile { chunks, complete } => Ok((chunks, complete)),
        other => bail!("sandpool-lazyd answered {other:?} to a profile"),
    }
}

/// Fetches `chunks` of `image` into the node's chunk cache; answers how many were fetched.
pub(crate) async fn prefetch(lazyd: &Lazyd, image: &str, chunks: Vec<u64>) -> anyhow::Result<u64> {
    match ask(lazyd, Request::Prefetch { image: image.to_string(), chunks }, lazyd::CALL_TIMEOUT).await? {
        Response::Prefetched { chunks_fetched } => Ok(chunks_fetched),
        other => bail!("sandpool-lazyd answered {other:?} to a prefetch"),
    }
}

/// The manifest digest (`sha256:...`) a pinned lazy image names.
pub(crate) fn digest_of(image: &str) -> Option<&str> {
    image.rsplit_once('@').map(|(_, digest)| digest).filter(|d| d.starts_with("sha256:"))
}

/// Makes sure a `sandpool-lazyd` answers on `socket`, starting one (detached: `setsid -f`, so
/// neither this process's exit nor its process group's signals reach it) when none does.
async fn ensure_lazyd(lazyd: &Lazyd) -> anyhow::Result<()> {
    let socket = lazyd.socket.as_path();
    if lazyd::call_within(socket, &Request::Stats, lazyd::QUICK_CALL_TIMEOUT).await.is_ok() {
        return Ok(());
    }
    let bin = lazyd_binary();
    let state_dir = lazyd.state_dir.as_path();
    std::fs::create_dir_all(state_dir).with_context(|| format!("create {}", state_dir.display()))?;
    let log_path = state_dir.join("lazyd.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("open {}", log_path.display()))?;
    let status = tokio::process::Command::new("setsid")
        .arg("-f")
        .arg(&bin)
        .arg("--socket")
        .arg(socket)
        .arg("--state-dir")
        .arg(state_dir)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .await
        .with_context(|| format!("start {}", bin.display()))?;
    if !status.success() {
        bail!("start {}: {status}", bin.display());
    }
    tracing::info!(bin = %bin.display(), socket = %socket.display(), "started sandpool-lazyd");
    let began = Instant::now();
    loop {
        if lazyd::call_within(socket, &Request::Stats, lazyd::QUICK_CALL_TIMEOUT).await.is_ok() {
            return Ok(());
        }
        if began.elapsed() > LAZYD_START_WAIT {
            bail!(
                "{} did not answer on {} within {LAZYD_START_WAIT:?} (see {})",
                bin.display(),
                socket.display(),
                log_path.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `sandpool-lazyd` executable: `$SANDPOOL_LAZYD`, else beside this executable (or one
/// directory up: cargo puts test binaries in `deps/`), else from PATH.
fn lazyd_binary() -> PathBuf {
    const NAME: &str = "sandpool-lazyd";
    if let Some(path) = std::env::var_os("SANDPOOL_LAZYD") {
        return path.into();
    }
    let exe = std::env::current_exe().ok();
    let dirs = exe.iter().flat_map(|e| e.ancestors().skip(1).take(2));
    dirs.map(|d| d.join(NAME)).find(|p| p.is_file()).unwrap_or_else(|| PathBuf::from(NAME))
}

/// The stub image of a mounted lazy image, as a `docker load` tarball.
pub(crate) fn stub(info: &MountInfo) -> anyhow::Result<Stub> {
    let reference = Reference::parse(&info.image)?;
    let digest = reference.digest.as_deref().context("sandpool-lazyd answered an unpinned image")?;
    // One Docker engine may serve nodes whose daemons keep their mounts in different places
    // (tests do): a stub names its mount, so its tag names the place unless it is the default.
    let mut tag = format!("{STUB_REPOSITORY}:{}", digest.trim_start_matches("sha256:"));
    if !info.lower.starts_with(lazyd::DEFAULT_STATE_DIR) {
        let place = lazy_image::registry::sha256_digest(info.lower.as_os_str().as_encoded_bytes());
        tag.push('-');
        tag.push_str(&place.trim_start_matches("sha256:")[..8]);
    }
    let marker = serde_json::to_vec(&Marker { image: info.image.clone(), lower: info.lower.clone() })?;
    let layer = {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(marker.len() as u64);
        h.set_mode(0o444);
        h.set_cksum();
        b.append_data(&mut h, MARKER, marker.as_slice())?;
        b.into_inner()?
    };
    let source = &info.image_config;
    let mut run_config = serde_json::json!({ "Labels": { LABEL_LAZY_IMAGE: info.image } });
    for key in ["Env", "WorkingDir", "Volumes", "Cmd"] {
        if let Some(v) = source.get(key).filter(|v| !v.is_null()) {
            run_config[key] = v.clone();
        }
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": docker_arch(),
        "os": "linux",
        "config": run_config,
        "rootfs": { "type": "layers", "diff_ids": [lazy_image::registry::sha256_digest(&layer)] },
    }))?;
    let manifest = serde_json::to_vec(&serde_json::json!([
        { "Config": "config.json", "RepoTags": [tag], "Layers": ["layer.tar"] }
    ]))?;
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in [("manifest.json", &manifest), ("config.json", &config), ("layer.tar", &layer)] {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data.as_slice())?;
    }
    Ok(Stub { tag, tar: b.into_inner()?.into() })
}

fn docker_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configs_default_daemon_is_the_daemons_default() {
        let toml = "[pool_manager]\nsecret = \"0123456789abcdef\"\n[auth]\nkey = \"0123456789abcdef\"\n\
                    [templates.t]\nimage = \"sandpool/busybox:latest\"\n";
        let images = config::Config::from_toml(toml, &config::Overrides::default()).expect("a config").images;
        assert_eq!(Lazyd::of(&images), Lazyd::default());
    }

    #[test]
    fn only_a_prepared_lazy_image_is_created_from_a_stub() {
        let stubs = LazyStubs::default();
        assert_eq!(stubs.container_image("127.0.0.1:5000/x@sha256:aa"), "127.0.0.1:5000/x@sha256:aa");
        stubs.insert("127.0.0.1:5000/x@sha256:aa", "sandpool-lazy:aa");
        assert_eq!(stubs.container_image("127.0.0.1:5000/x@sha256:aa"), "sandpool-lazy:aa");
        assert_eq!(stubs.container_image("sandpool/busybox:latest"), "sandpool/busybox:latest");
    }

    #[tokio::test]
    async fn a_lazy_image_on_an_unknown_runtime_is_refused_before_anything_is_mounted() {
        let err = runtime_for(&Lazyd::default(), "127.0.0.1:5000/x@sha256:aa", "kata").await.unwrap_err();
        assert!(err.to_string().contains("runs on runc, crun or runsc, not kata"), "{err}");
    }

    #[test]
    fn each_isolation_class_has_its_lazy_runtime() {
        let names: Vec<_> = ["runc", "crun", "runsc"].into_iter().map(lazy_runtime).collect();
        assert_eq!(
            names,
            [Some("sandpool-lazy".into()), Some("sandpool-lazy-crun".into()), Some("sandpool-lazy-runsc".into())]
        );
    }

    #[test]
    fn the_stub_carries_the_marker_and_the_source_run_config() {
        let digest = "ab".repeat(32);
        let info = MountInfo {
            image: format!("127.0.0.1:5000/t/img@sha256:{digest}"),
            lower: "/var/lib/sandpool/lazy/x/root".into(),
            image_config: serde_json::json!({"Env": ["A=1"], "WorkingDir": "/w", "User": "nobody", "Volumes": null}),
            blob_size: 1,
            source_size: 1,
            bytes_fetched: 0,
            chunks_fetched: 0,
            cache_hits: 0,
            fetch_errors: 0,
            fetch_latency: Vec::new(),
        };
        let stub = stub(&info).unwrap();
        assert_eq!(stub.tag, format!("sandpool-lazy:{digest}"));
        let mut files = HashMap::new();
        for entry in tar::Archive::new(stub.tar.as_ref()).entries().unwrap() {
            let mut entry = entry.unwrap();
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
            files.insert(entry.path().unwrap().display().to_string(), data);
        }
        let config: serde_json::Value = serde_json::from_slice(&files["config.json"]).unwrap();
        assert_eq!(config["config"]["Env"], serde_json::json!(["A=1"]));
        assert_eq!(config["config"]["WorkingDir"], "/w");
        // The agent runs as root and switches to the template's user: the image's USER stays out.
        assert!(config["config"].get("User").is_none());
        assert!(config["config"].get("Volumes").is_none());
        let layer = &files["layer.tar"];
        assert_eq!(config["rootfs"]["diff_ids"][0], lazy_image::registry::sha256_digest(layer));
        let mut marker = tar::Archive::new(layer.as_slice());
        let mut entry = marker.entries().unwrap().next().unwrap().unwrap();
        assert_eq!(entry.path().unwrap().to_str(), Some(MARKER));
        let marker: Marker = serde_json::from_reader(&mut entry).unwrap();
        assert_eq!(marker, Marker { image: info.image.clone(), lower: info.lower.clone() });
    }
}

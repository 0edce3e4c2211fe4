//! `sandpool-lazyd`, the node's lazy-image daemon: one [`LazyRootfs`] per image (manifest
//! digest), mounted at `<state>/<digest hex>/root` on first request and kept for the daemon's
//! life, every image's chunks in one [`ChunkCache`]. A separate process, not a part of the
//! pool-manager, because a FUSE server that exits turns every read of its mount into EIO: the
//! mounts must outlive pool-manager restarts, which readopt running sandboxes.
//!
//! Its API is one JSON object per line over a Unix socket (root only): [`Request`] in,
//! [`Response`] out. [`call`] is the client.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::OnceCell;

use crate::cache::ChunkCache;
use crate::fetch::FetchPolicy;
use crate::mount::LazyRootfs;
use crate::reference::Reference;

/// Where the daemon listens and keeps its mounts unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/sandpool/lazyd.sock";
/// Where the daemon keeps its lock, chunk cache and mounts unless told otherwise.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/sandpool/lazy";
/// The chunk cache's default bound: a few large task images' working sets.
pub const DEFAULT_CACHE_MB: u64 = 10 << 10;
/// The longest a request line may be (an image reference and a few words).
const MAX_LINE: usize = 64 << 10;

/// A request to the daemon: one JSON object on one line of its socket.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    /// Mount `image` (pinned by digest) if it is not mounted yet; answers [`Response::Mounted`].
    Mount {
        /// The lazy image, `host:port/repo@sha256:...` (a digest is required).
        image: String,
    },
    /// Unmount `image` unless a sandbox still uses it; answers [`Response::Unmounted`] (whether
    /// it was mounted) or an error.
    Unmount {
        /// The lazy image, as it was mounted (pinned by digest).
        image: String,
    },
    /// Every mount's counters; answers [`Response::Stats`].
    Stats,
    /// Client `client` (a node) bounds the chunk cache at `bytes` for [`CACHE_LEASE`]; the
    /// cache's bound is the least any client asks for within its lease (one node per daemon in
    /// production; tests share one), never more than the daemon's `--cache-mb`. Answers
    /// [`Response::CacheLimit`].
    SetCacheLimit {
        /// Who asks (a node id): a later request of the same client replaces its earlier one.
        client: String,
        /// The bound it asks for.
        bytes: u64,
    },
    /// The access profile of mounted `image`; answers [`Response::Profile`].
    Profile {
        /// The lazy image, pinned by digest, as mounted.
        image: String,
    },
    /// Mounts `image` and fetches the chunks `chunks` names into the cache (a recorded profile:
    /// what a first session reads); answers [`Response::Prefetched`] once they are in.
    Prefetch {
        /// The lazy image, pinned by digest.
        image: String,
        /// Chunk indexes (at most `blob::MAX_PROFILE_CHUNKS` are taken, and no more than half
        /// the cache's bound).
        chunks: Vec<u64>,
    },
    /// Unmounts `image` (unless a sandbox uses it) and drops its chunks from the cache; answers
    /// [`Response::Evicted`] or an error.
    Evict {
        /// The lazy image, pinned by digest.
        image: String,
    },
}

/// The daemon's answer to one [`Request`], one JSON object on one line.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Response {
    /// The image is mounted (now or already): where, and its counters.
    Mounted(MountInfo),
    /// The answer to [`Request::Unmount`].
    Unmounted {
        /// Whether the image was mounted (false: nothing to do).
        was_mounted: bool,
    },
    /// The answer to [`Request::Stats`].
    Stats {
        /// Every image mounted now.
        mounts: Vec<MountInfo>,
        /// Bytes the node's chunk cache holds.
        cache_used_bytes: u64,
        /// The chunk cache's bound in bytes.
        cache_limit_bytes: u64,
    },
    /// The answer to [`Request::SetCacheLimit`]: the cache's bound now.
    CacheLimit {
        /// Bytes.
        limit_bytes: u64,
    },
    /// The answer to [`Request::Profile`].
    Profile {
        /// Chunk indexes in the order first read.
        chunks: Vec<u64>,
        /// Whether its window has closed (it will not change).
        complete: bool,
    },
    /// The answer to [`Request::Prefetch`].
    Prefetched {
        /// Chunks fetched now (those already cached are not).
        chunks_fetched: u64,
    },
    /// The answer to [`Request::Evict`].
    Evicted {
        /// Whether the image was mounted.
        was_mounted: bool,
        /// Bytes of its chunks dropped from the cache.
        bytes_freed: u64,
    },
    /// The request failed (or could not be parsed).
    Error {
        /// What went wrong, with its causes.
        message: String,
    },
}

/// One mounted image and its blob's counters.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MountInfo {
    /// The image pinned by its manifest digest.
    pub image: String,
    /// The read-only root filesystem (the EROFS mount): a sandbox overlay's lower layer.
    pub lower: PathBuf,
    /// The source image's run config (`Env`, `Cmd`, `User`, `WorkingDir`), as converted.
    pub image_config: serde_json::Value,
    /// The EROFS blob's size in bytes.
    pub blob_size: u64,
    /// The source image's layer bytes (what a whole pull would have transferred).
    pub source_size: u64,
    /// Bytes fetched from the registry for this mount so far.
    pub bytes_fetched: u64,
    /// Chunks fetched from the registry (cache misses that were filled).
    pub chunks_fetched: u64,
    /// Chunk reads served from the node's chunk cache.
    pub cache_hits: u64,
    /// Chunk fetches that failed (each a reader's EIO).
    pub fetch_errors: u64,
    /// Range reads per latency bucket (`blob::FETCH_LATENCY_BUCKETS`, then the rest).
    #[serde(default)]
    pub fetch_latency: Vec<u64>,
}

/// What [`run`] serves with; `sandpool-lazyd` fills it from its flags and `DEFAULT_*`.
pub struct Options {
    /// The Unix socket to serve requests on (mode 0600).
    pub socket: PathBuf,
    /// The directory holding the daemon's lock, chunk cache and mounts.
    pub state_dir: PathBuf,
    /// The chunk cache's bound in bytes (`--cache-mb` × 1 MiB).
    pub cache_bytes: u64,
    /// The bounds of each chunk fetch (`--fetch-timeout-s`): past them, the reader gets EIO.
    pub fetch: FetchPolicy,
}

/// How long a client's [`Request::SetCacheLimit`] holds: a node asks again every few seconds,
/// so a node that stopped no longer bounds the cache after this.
pub const CACHE_LEASE: Duration = Duration::from_secs(60);

struct Daemon {
    state_dir: PathBuf,
    cache: Arc<ChunkCache>,
    fetch: FetchPolicy,
    /// The cache's bound when no client asks for less (`--cache-mb`).
    cache_cap: u64,
    /// Each client's bound and when it asked.
    cache_leases: Mutex<HashMap<String, (u64, Instant)>>,
    /// By manifest digest hex; a cell so concurrent requests for one image mount it once.
    mounts: Mutex<HashMap<String, Arc<OnceCell<LazyRootfs>>>>,
}

/// Runs the daemon until SIGTERM or SIGINT. Returns at once (Ok) when another daemon holds
/// the state directory's lock: one daemon per node.
pub async fn run(opts: Options) -> anyhow::Result<()> {
    std::fs::create_dir_all(&opts.state_dir).with_context(|| format!("create {}", opts.state_dir.display()))?;
    let Some(_lock) = lock_state_dir(&opts.state_dir)? else {
        tracing::info!(state_dir = %opts.state_dir.display(), "another sandpool-lazyd runs here");
        return Ok(());
    };
    detach_stale_mounts(&opts.state_dir);
    let cache = Arc::new(ChunkCache::open(opts.state_dir.join("chunks"), opts.cache_bytes)?);
    if let Some(dir) = opts.socket.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(&opts.socket);
    let listener = UnixListener::bind(&opts.socket).with_context(|| format!("listen on {}", opts.socket.display()))?;
    std::fs::set_permissions(&opts.socket, std::fs::Permissions::from_mode(0o600))?;
    let daemon = Arc::new(Daemon {
        state_dir: opts.state_dir,
        cache,
        fetch: opts.fetch,
        cache_cap: opts.cache_bytes,
        cache_leases: Mutex::default(),
        mounts: Mutex::new(HashMap::new()),
    });
    tracing::info!(socket = %opts.socket.display(), fetch_timeout = ?opts.fetch.total, "sandpool-lazyd serving");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = accepted.context("accept")?;
                // detached: one task per client connection of the daemon, ending with its connection;
                // the daemon has no drain (its mounts are meant to outlive it).
                tokio::spawn(daemon.clone().serve(stream));
            }
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    let _ = std::fs::remove_file(&opts.socket);
    // The mounts are detached as the map drops: sandboxes still on them get EIO from here on.
    tracing::warn!("sandpool-lazyd stopping: its mounts go with it");
    Ok(())
}

impl Daemon {
    async fn serve(self: Arc<Self>, stream: UnixStream) {
        let (read, mut write) = stream.into_split();
        let mut lines = BufReader::new(read);
        let mut line = String::new();
        loop {
            line.clear();
            match lines.read_line(&mut line).await {
                Ok(0) | Err(_) => return,
                Ok(_) if line.len() > MAX_LINE => return,
                Ok(_) => {}
            }
            let response = match serde_json::from_str::<Request>(&line) {
                Ok(req) => self.handle(req).await,
                Err(e) => Response::Error { message: format!("bad request: {e}") },
            };
            let mut out = serde_json::to_vec(&response).unwrap_or_default();
            out.push(b'\n');
            if write.write_all(&out).await.is_err() {
                return;
            }
        }
    }

    async fn handle(&self, req: Request) -> Response {
        match req {
            Request::Mount { image } => match self.mount(&image).await {
                Ok(info) => Response::Mounted(info),
                Err(e) => {
                    tracing::warn!(image, error = format!("{e:#}"), "mount failed");
                    Response::Error { message: format!("{e:#}") }
                }
            },
            Request::Unmount { image } => match self.unmount(&image).await {
                Ok(was_mounted) => Response::Unmounted { was_mounted },
                Err(e) => Response::Error { message: format!("{e:#}") },
            },
            Request::Stats => {
                self.apply_cache_leases();
                Response::Stats {
                    mounts: self.mounted().iter().filter_map(|c| c.get().map(info)).collect(),
                    cache_used_bytes: self.cache.used_bytes(),
                    cache_limit_bytes: self.cache.limit_bytes(),
                }
            }
            Request::SetCacheLimit { client, bytes } => {
                self.cache_leases.lock().unwrap_or_else(|e| e.into_inner()).insert(client, (bytes, Instant::now()));
                Response::CacheLimit { limit_bytes: self.apply_cache_leases() }
            }
            Request::Profile { image } => match self.mounted_rootfs(&image) {
                Ok(Some(cell)) => {
                    let p = cell.get().map(|r| r.blob().profile()).unwrap_or_default();
                    Response::Profile { chunks: p.chunks, complete: p.complete }
                }
                Ok(None) => Response::Error { message: format!("{image} is not mounted") },
                Err(e) => Response::Error { message: format!("{e:#}") },
            },
            Request::Prefetch { image, chunks } => match self.prefetch(&image, chunks).await {
                Ok(chunks_fetched) => Response::Prefetched { chunks_fetched },
                Err(e) => Response::Error { message: format!("{e:#}") },
            },
            Request::Evict { image } => match self.evict(&image).await {
                Ok((was_mounted, bytes_freed)) => Response::Evicted { was_mounted, bytes_freed },
                Err(e) => Response::Error { message: format!("{e:#}") },
            },
        }
    }

    fn mounted(&self) -> Vec<Arc<OnceCell<LazyRootfs>>> {
        self.mounts.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }

    /// The mount of `image`, if it is mounted.
    fn mounted_rootfs(&self, image: &str) -> anyhow::Result<Option<Arc<OnceCell<LazyRootfs>>>> {
        let hex = digest_hex(&Reference::parse(image)?, image)?;
        let cell = self.mounts.lock().unwrap_or_else(|e| e.into_inner()).get(&hex).cloned();
        Ok(cell.filter(|c| c.get().is_some()))
    }

    /// Sets the cache's bound to the least of the live leases and the cap (expired leases go).
    fn apply_cache_leases(&self) -> u64 {
        let least = {
            let mut leases = self.cache_leases.lock().unwrap_or_else(|e| e.into_inner());
            leases.retain(|_, (_, at)| at.elapsed() < CACHE_LEASE);
            leases.values().map(|(bytes, _)| *bytes).min()
        };
        let limit = least.unwrap_or(self.cache_cap).min(self.cache_cap);
        if limit != self.cache.limit_bytes() {
            tracing::info!(limit_mb = limit >> 20, "chunk cache bound");
            self.cache.set_limit(limit);
        }
        limit
    }

    async fn prefetch(&self, image: &str, mut chunks: Vec<u64>) -> anyhow::Result<u64> {
        self.mount(image).await?;
        let rootfs = self.mounted_rootfs(image)?.context("unmounted during the prefetch")?;
        let Some(blob) = rootfs.get().map(|r| r.blob().clone()) else { bail!("{image} is not mounted") };
        // No more than half the cache: a prefetch must not evict what it has just fetched.
        let chunk_size = rootfs.get().map_or(1, |r| r.image().config.rootfs.chunk_size.max(1));
        let room = (self.cache.limit_bytes() / 2 / chunk_size) as usize;
        chunks.truncate(crate::blob::MAX_PROFILE_CHUNKS.min(room));
        let began = Instant::now();
        let fetched = tokio::task::spawn_blocking(move || blob.prefetch(&chunks)).await.context("join the prefetch")?;
        tracing::info!(image, fetched, took = ?began.elapsed(), "prefetched a profile");
        Ok(fetched)
    }

    /// Unmounts `image` and drops its chunks (its blob learned from the mount, else the registry).
    async fn evict(&self, image: &str) -> anyhow::Result<(bool, u64)> {
        let blob_digest =
            match self.mounted_rootfs(image)?.and_then(|c| c.get().map(|r| r.image().config.rootfs.digest.clone())) {
                Some(d) => d,
                None => crate::mount::LazyImage::resolve(&Reference::parse(image)?).await?.config.rootfs.digest,
            };
        let was_mounted = self.unmount(image).await?;
        let freed = self.cache.remove_blob(blob_digest.trim_start_matches("sha256:"));
        tracing::info!(image, freed_mb = freed >> 20, "evicted");
        Ok((was_mounted, freed))
    }

    async fn mount(&self, image: &str) -> anyhow::Result<MountInfo> {
        let reference = Reference::parse(image)?;
        let hex = digest_hex(&reference, image)?;
        let cell = self.mounts.lock().unwrap_or_else(|e| e.into_inner()).entry(hex.clone()).or_default().clone();
        let rootfs = cell
            .get_or_try_init(|| async {
                let dir = self.state_dir.join(&hex);
                let target = dir.join("root");
                std::fs::create_dir_all(&target).with_context(|| format!("create {}", target.display()))?;
                let began = std::time::Instant::now();
                let rootfs = LazyRootfs::mount(&reference, self.cache.clone(), self.fetch, &dir, &target).await?;
                tracing::info!(image, took = ?began.elapsed(), "mounted");
                anyhow::Ok(rootfs)
            })
            .await?;
        Ok(info(rootfs))
    }
}

impl Daemon {
    async fn unmount(&self, image: &str) -> anyhow::Result<bool> {
        let hex = digest_hex(&Reference::parse(image)?, image)?;
        let lower = self.state_dir.join(&hex).join("root");
        // An overlay keeps its lower layer's superblock (and so the FUSE file) alive after the
        // EROFS mount point goes: unmounting under a running sandbox would end its reads.
        let users = overlays_on(&lower)?;
        if users > 0 {
            bail!("{image} is the lower layer of {users} mounted overlays (running sandboxes)");
        }
        let cell = self.mounts.lock().unwrap_or_else(|e| e.into_inner()).remove(&hex);
        let Some(rootfs) = cell.and_then(|c| Arc::try_unwrap(c).ok()).and_then(OnceCell::into_inner) else {
            return Ok(false);
        };
        tokio::task::spawn_blocking(move || rootfs.unmount()).await.context("join the unmount")??;
        // Empty now: its mount points (non-recursive removals, so nothing mounted goes).
        let dir = self.state_dir.join(&hex);
        for empty in [dir.join("root"), dir.join("blob"), dir] {
            let _ = std::fs::remove_dir(empty);
        }
        Ok(true)
    }
}

/// How many overlay mounts name `lower` as a lower directory (`/proc/self/mountinfo`).
fn overlays_on(lower: &Path) -> anyhow::Result<usize> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo")?;
    Ok(overlays_in(&table, lower))
}

fn overlays_in(table: &str, lower: &Path) -> usize {
    let lower = lower.display().to_string();
    table
        .lines()
        .filter(|line| line.contains(" - overlay "))
        .filter(|line| {
            line.split([',', ' '])
                .any(|opt| opt.strip_prefix("lowerdir=").is_some_and(|dirs| dirs.split(':').any(|d| d == lower)))
        })
        .count()
}

fn digest_hex(reference: &Reference, image: &str) -> anyhow::Result<String> {
    let Some(digest) = &reference.digest else {
        bail!("{image}: a lazy image is named by digest here (repository@sha256:...)");
    };
    Ok(digest.trim_start_matches("sha256:").to_string())
}

fn info(rootfs: &LazyRootfs) -> MountInfo {
    let stats = rootfs.stats();
    let image = rootfs.image();
    MountInfo {
        image: image.reference.to_string(),
        lower: rootfs.target().to_path_buf(),
        image_config: image.config.image_config.clone(),
        blob_size: image.config.rootfs.size,
        source_size: image.config.source.layers_size,
        bytes_fetched: stats.bytes_fetched(),
        chunks_fetched: stats.chunks_fetched(),
        cache_hits: stats.cache_hits(),
        fetch_errors: stats.fetch_errors(),
        fetch_latency: stats.fetch_latency(),
    }
}

/// Takes `<state>/lazyd.lock` (flock, held while the returned file lives); `None` when another
/// process holds it.
fn lock_state_dir(dir: &Path) -> anyhow::Result<Option<std::fs::File>> {
    use std::os::fd::AsRawFd as _;
    let path = dir.join("lazyd.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    // SAFETY: a valid open descriptor and plain flags.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Ok(None);
        }
        return Err(err).with_context(|| format!("lock {}", path.display()));
    }
    Ok(Some(file))
}

/// The mounts an earlier daemon left (it died: their FUSE files answer nothing or EIO) are
/// detached, so this daemon mounts afresh at the same paths.
fn detach_stale_mounts(state_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(state_dir) else { return };
    for entry in entries.flatten() {
        for sub in ["root", "blob"] {
            let path = entry.path().join(sub);
            if is_mount_point(&path) {
                match crate::mount::detach(&path) {
                    Ok(()) => tracing::warn!(path = %path.display(), "detached a mount of an earlier sandpool-lazyd"),
                    Err(e) => tracing::warn!(path = %path.display(), error = format!("{e:#}"), "detach a stale mount"),
                }
            }
        }
    }
}

/// Whether `path` is a mount point (its device differs from its parent's). A dead FUSE mount
/// answers `stat` with ENOTCONN: a mount point too.
pub fn is_mount_point(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let Some(parent) = path.parent() else { return false };
    match (std::fs::metadata(path), std::fs::metadata(parent)) {
        (Ok(m), Ok(p)) => m.dev() != p.dev(),
        (Err(e), Ok(_)) => e.raw_os_error() == Some(libc::ENOTCONN),
        _ => false,
    }
}

/// How long a client waits for the daemon's answer to a mount: it fetches the manifest and the
/// config (10 s each at most) and the EROFS superblock's chunks (each within the daemon's fetch
/// bound, `--fetch-timeout-s`, 10 s by default).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a client waits for an answer that needs no registry (stats, an unmount, a mount
/// of an image mounted already): the daemon answers those from memory.
pub const QUICK_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends one request to the daemon at `socket` and returns its answer, within
/// [`CALL_TIMEOUT`].
pub async fn call(socket: &Path, req: &Request) -> anyhow::Result<Response> {
    call_within(socket, req, CALL_TIMEOUT).await
}

/// Sends one request to the daemon at `socket` and returns its answer, within `timeout`.
pub async fn call_within(socket: &Path, req: &Request, timeout: Duration) -> anyhow::Result<Response> {
    let exchange = async {
        let mut stream = UnixStream::connect(socket)
            .await
            .with_context(|| format!("connect to sandpool-lazyd at {}", socket.display()))?;
        let mut line = serde_json::to_vec(req)?;
        line.push(b'\n');
        stream.write_all(&line).await.context("send to sandpool-lazyd")?;
        let mut answer = String::new();
        BufReader::new(stream).read_line(&mut answer).await.context("read sandpool-lazyd's answer")?;
        anyhow::ensure!(!answer.is_empty(), "sandpool-lazyd closed the connection without answering");
        serde_json::from_str(&answer).context("parse sandpool-lazyd's answer")
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .with_context(|| format!("sandpool-lazyd did not answer within {timeout:?}"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlays_on_a_lower_directory_are_counted_from_the_mount_table() {
        let table = "\
36 25 0:32 / /var/lib/sandpool/lazy/ab/root ro,relatime - erofs /var/lib/sandpool/lazy/ab/blob/rootfs.erofs ro
40 25 0:40 / /run/sandpool/lazy-roots/c1 rw,relatime - overlay overlay rw,lowerdir=/var/lib/sandpool/lazy/ab/root,upperdir=/u1,workdir=/w1
41 25 0:41 / /run/sandpool/lazy-roots/c2 rw,relatime - overlay overlay rw,lowerdir=/x:/var/lib/sandpool/lazy/ab/root,upperdir=/u2,workdir=/w2
42 25 0:42 / /run/sandpool/lazy-roots/c3 rw,relatime - overlay overlay rw,lowerdir=/var/lib/sandpool/lazy/ab/rootfs,upperdir=/u3,workdir=/w3
";
        assert_eq!(overlays_in(table, Path::new("/var/lib/sandpool/lazy/ab/root")), 2);
        assert_eq!(overlays_in(table, Path::new("/var/lib/sandpool/lazy/cd/root")), 0);
    }

    #[tokio::test]
    async fn the_cache_bound_is_the_least_any_live_client_asks_for_within_the_cap() {
        let dir = std::env::temp_dir().join(format!("lazyd-leases-{}", uuid::Uuid::new_v4().simple()));
        let cache = Arc::new(ChunkCache::open(dir.join("chunks"), 1000).unwrap());
        let daemon = Daemon {
            state_dir: dir.clone(),
            cache,
            fetch: FetchPolicy::default(),
            cache_cap: 1000,
            cache_leases: Mutex::default(),
            mounts: Mutex::default(),
        };
        let set = |client: &str, bytes| Request::SetCacheLimit { client: client.into(), bytes };
        assert_eq!(daemon.handle(set("n1", 600)).await, Response::CacheLimit { limit_bytes: 600 });
        assert_eq!(daemon.handle(set("n2", 400)).await, Response::CacheLimit { limit_bytes: 400 });
        // A client's later request replaces its earlier one; the cap bounds every request.
        assert_eq!(daemon.handle(set("n2", 5000)).await, Response::CacheLimit { limit_bytes: 600 });
        assert_eq!(daemon.cache.limit_bytes(), 600);
        // A lease that was not renewed no longer binds.
        daemon.cache_leases.lock().unwrap().get_mut("n1").unwrap().1 -= CACHE_LEASE;
        assert_eq!(daemon.handle(set("n2", 5000)).await, Response::CacheLimit { limit_bytes: 1000 });
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn requests_and_answers_are_one_json_object_each() {
        let req = Request::Mount { image: "127.0.0.1:5000/x@sha256:00".into() };
        let line = serde_json::to_string(&req).unwrap();
        assert_eq!(line, r#"{"mount":{"image":"127.0.0.1:5000/x@sha256:00"}}"#);
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), req);
        assert_eq!(serde_json::to_string(&Request::Stats).unwrap(), r#""stats""#);
    }
}

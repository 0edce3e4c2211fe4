//! Reads of a lazy image's blob at any offset: each chunk the read touches comes from the
//! node's chunk cache, or from the registry by an HTTP range read (retried within the bounds
//! of a `FetchPolicy`, `fetch.rs`: a registry gone makes the reader's read fail with EIO, never
//! hang), checked against the digest the image's config pins, then cached. Synchronous on purpose: the callers are FUSE worker
//! threads (and the mount syscall's superblock read), which block on the async registry
//! client through a small runtime of the blob's own, so no caller's runtime can deadlock it.

use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::Digest as _;

/// Chunks fetched ahead of a reader that moves forward chunk by chunk (a whole-file read, a
/// scan): at 1 MiB chunks, 4 MiB in flight, each on a thread of its own. A reader that jumps
/// around (the first command of a sandbox, mostly) triggers none.
const READ_AHEAD_CHUNKS: u64 = 4;

/// Upper bounds (seconds) of the fetch latency buckets [`BlobStats::fetch_latency`] counts in:
/// the node's latency buckets (`telemetry::metrics::LATENCY_BUCKETS`; this crate uses no
/// sandpool crate), so the node exports them as a histogram with no loss. A last bucket past
/// the end counts the rest.
pub const FETCH_LATENCY_BUCKETS: [f64; 18] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// How long after its first read a mount records which chunks are read: its access profile,
/// what a sandbox's start and first commands need (stargz's "prioritized files", learned
/// instead of declared). Reads after it (a long session's work) are not a first session's.
pub const PROFILE_WINDOW: Duration = Duration::from_secs(30);

/// The most chunks a profile holds (1 GiB at 1 MiB chunks): a bound on what a prefetch fetches
/// and on the profile's size where it is shared.
pub const MAX_PROFILE_CHUNKS: usize = 1024;

/// Chunks a prefetch fetches at once: a cold start is bound by round trips, not bandwidth.
const PREFETCH_PARALLEL: usize = 8;

use crate::cache::{ChunkCache, ChunkKey};
use crate::fetch::{FetchPolicy, Next, Outage};
use crate::manifest::Rootfs;
use crate::registry::Registry;

/// Counters of one mounted blob (exported as metrics by the node; read by tests).
#[derive(Debug, Default)]
pub struct BlobStats {
    /// Bytes received from the registry.
    pub bytes_fetched: AtomicU64,
    /// Chunks fetched from the registry (each one a range read that passed its digest check).
    pub chunks_fetched: AtomicU64,
    /// Chunk reads served from the cache.
    pub cache_hits: AtomicU64,
    /// Chunk fetches that failed, after their retries (the reader got EIO; a read-ahead's
    /// failure is counted too, and its reader fetches again).
    pub fetch_errors: AtomicU64,
    /// Time spent in registry range reads, summed (microseconds).
    pub fetch_micros: AtomicU64,
    /// Range reads by latency: one count per bucket of [`FETCH_LATENCY_BUCKETS`], and one
    /// for the rest (failed reads included).
    pub fetch_latency: [AtomicU64; FETCH_LATENCY_BUCKETS.len() + 1],
}

impl BlobStats {
    /// Reads [`BlobStats::bytes_fetched`].
    pub fn bytes_fetched(&self) -> u64 {
        self.bytes_fetched.load(Ordering::Relaxed)
    }
    /// Reads [`BlobStats::chunks_fetched`].
    pub fn chunks_fetched(&self) -> u64 {
        self.chunks_fetched.load(Ordering::Relaxed)
    }
    /// Reads [`BlobStats::cache_hits`].
    pub fn cache_hits(&self) -> u64 {
        self.cache_hits.load(Ordering::Relaxed)
    }
    /// Reads [`BlobStats::fetch_errors`].
    pub fn fetch_errors(&self) -> u64 {
        self.fetch_errors.load(Ordering::Relaxed)
    }
    /// Reads [`BlobStats::fetch_latency`]: range reads per latency bucket.
    pub fn fetch_latency(&self) -> Vec<u64> {
        self.fetch_latency.iter().map(|c| c.load(Ordering::Relaxed)).collect()
    }

    fn record_fetch(&self, took: Duration) {
        self.fetch_micros.fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        let bucket = FETCH_LATENCY_BUCKETS.iter().position(|le| secs <= *le).unwrap_or(FETCH_LATENCY_BUCKETS.len());
        self.fetch_latency[bucket].fetch_add(1, Ordering::Relaxed);
    }
}

/// The chunks a mount's first reads touched, in the order first read ([`PROFILE_WINDOW`]).
#[derive(Default)]
struct Profile {
    chunks: Vec<u64>,
    seen: HashSet<u64>,
    /// When the first read after the mount came: the window's start.
    opened: Option<Instant>,
}

/// A mount's access profile as it stands.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ProfileSnapshot {
    /// Chunk indexes in the order first read, at most [`MAX_PROFILE_CHUNKS`].
    pub chunks: Vec<u64>,
    /// Whether the window has closed (the profile will not change any more).
    pub complete: bool,
}

/// One lazy image's EROFS blob, read at any offset via the chunk cache or registry range reads.
pub struct LazyBlob {
    registry: Registry,
    repository: String,
    rootfs: Rootfs,
    /// The blob digest without `sha256:`, the cache's name for it.
    blob_hex: String,
    cache: Arc<ChunkCache>,
    stats: Arc<BlobStats>,
    /// One lock per chunk being read: concurrent readers of a cold chunk wait for one fetch
    /// instead of each fetching it.
    in_flight: Mutex<HashMap<u64, Arc<Mutex<()>>>>,
    /// The chunk the last read touched (`u64::MAX`: none yet): a read of the next one is a
    /// sequential reader, and starts read-ahead.
    last_chunk: AtomicU64,
    /// Read-ahead threads running (at most `READ_AHEAD_CHUNKS`).
    read_ahead_running: AtomicU64,
    policy: FetchPolicy,
    /// Whether the registry is known to be gone (one attempt per fetch until it answers).
    outage: Outage,
    /// Set once the blob's EROFS mount is up: the next read opens the profile's window.
    mounted: AtomicBool,
    profile: Mutex<Profile>,
    /// The profile's window has closed (or it is full): reads no longer take its lock.
    profile_closed: AtomicBool,
    runtime: FetchRuntime,
}

/// The blob's own runtime for registry calls. Dropped without waiting (the last reference to
/// a blob may go away inside some other runtime, where a blocking shutdown would panic).
struct FetchRuntime(Option<tokio::runtime::Runtime>);

impl Drop for FetchRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl LazyBlob {
    /// A reader of `rootfs`'s blob in `repository`, with its own one-thread fetch runtime, whose
    /// chunk fetches are bounded by `policy`; fails if `rootfs` is invalid or its digest is not
    /// sha256.
    pub fn new(
        registry: Registry,
        repository: String,
        rootfs: Rootfs,
        cache: Arc<ChunkCache>,
        policy: FetchPolicy,
    ) -> anyhow::Result<Self> {
        rootfs.validate()?;
        let blob_hex = rootfs
            .digest
            .strip_prefix("sha256:")
            .ok_or_else(|| anyhow::anyhow!("blob digest {} is not sha256", rootfs.digest))?
            .to_string();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("lazy-fetch")
            .enable_all()
            .build()?;
        Ok(LazyBlob {
            registry,
            repository,
            rootfs,
            blob_hex,
            cache,
            stats: Arc::default(),
            in_flight: Mutex::default(),
            last_chunk: AtomicU64::new(u64::MAX),
            read_ahead_running: AtomicU64::new(0),
            policy,
            outage: Outage::default(),
            mounted: AtomicBool::new(false),
            profile: Mutex::default(),
            profile_closed: AtomicBool::new(false),
            runtime: FetchRuntime(Some(runtime)),
        })
    }

    /// The blob's size in bytes.
    pub fn size(&self) -> u64 {
        self.rootfs.size
    }

    /// This blob's counters, shared (the mount reports them).
    pub fn stats(&self) -> Arc<BlobStats> {
        self.stats.clone()
    }

    /// The EROFS mount on this blob is up: what is read from here on is a sandbox's (the
    /// profile's window opens at the next read).
    pub fn mark_mounted(&self) {
        self.mounted.store(true, Ordering::Relaxed);
    }

    /// The chunks read by the mount and in [`PROFILE_WINDOW`] after its first read since.
    pub fn profile(&self) -> ProfileSnapshot {
        let p = self.profile.lock().unwrap_or_else(|e| e.into_inner());
        let complete =
            p.opened.is_some_and(|at| at.elapsed() >= PROFILE_WINDOW) || p.chunks.len() >= MAX_PROFILE_CHUNKS;
        ProfileSnapshot { chunks: p.chunks.clone(), complete }
    }

    /// Notes that a reader asked for chunks `first..=last`, or read-ahead fetched them for one
    /// (the mount's own reads, then a sandbox's within the window).
    fn note_read(&self, first: u64, last: u64) {
        if self.profile_closed.load(Ordering::Relaxed) {
            return;
        }
        let mounted = self.mounted.load(Ordering::Relaxed);
        // The lock is held for a few set operations; the map holds no state a panic could tear.
        let mut p = self.profile.lock().unwrap_or_else(|e| e.into_inner());
        if mounted {
            let opened = *p.opened.get_or_insert_with(Instant::now);
            if opened.elapsed() >= PROFILE_WINDOW {
                self.profile_closed.store(true, Ordering::Relaxed);
                return;
            }
        }
        for index in first..=last {
            if p.chunks.len() >= MAX_PROFILE_CHUNKS {
                self.profile_closed.store(true, Ordering::Relaxed);
                return;
            }
            if p.seen.insert(index) {
                p.chunks.push(index);
            }
        }
    }

    /// Fetches `chunks` into the cache (those not cached yet, indexes past the blob ignored),
    /// [`PREFETCH_PARALLEL`] at a time, and returns how many it fetched. Not a reader: the
    /// profile does not see these. A chunk that fails is left for a reader to fetch again.
    pub fn prefetch(self: &Arc<Self>, chunks: &[u64]) -> u64 {
        let count = self.rootfs.chunks.len() as u64;
        let todo: Vec<u64> = chunks
            .iter()
            .copied()
            .filter(|i| *i < count)
            .filter(|i| !self.cache.contains(&ChunkKey { blob_hex: self.blob_hex.clone(), index: *i }))
            .collect();
        let next = AtomicU64::new(0);
        let fetched = AtomicU64::new(0);
        std::thread::scope(|scope| {
            for _ in 0..PREFETCH_PARALLEL.min(todo.len()) {
                scope.spawn(|| {
                    while let Some(index) = todo.get(next.fetch_add(1, Ordering::Relaxed) as usize) {
                        if self.read_chunk_range(*index, 0, 1).is_ok() {
                            fetched.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        fetched.into_inner()
    }

    /// Up to `len` bytes at `offset` (short only at the end of the blob). Any chunk that can be
    /// neither read from the cache nor fetched and verified fails the whole read with EIO.
    pub fn read_at(self: &Arc<Self>, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let end = (offset + len as u64).min(self.rootfs.size);
        if end > offset {
            self.note_read(offset / self.rootfs.chunk_size, (end - 1) / self.rootfs.chunk_size);
        }
        let mut out = Vec::with_capacity(end.saturating_sub(offset) as usize);
        let mut pos = offset;
        while pos < end {
            let index = pos / self.rootfs.chunk_size;
            let chunk_start = index * self.rootfs.chunk_size;
            let in_chunk = pos - chunk_start;
            let want = (end - pos).min(self.rootfs.chunk_size - in_chunk) as usize;
            let previous = self.last_chunk.swap(index, Ordering::Relaxed);
            if previous != u64::MAX && previous + 1 == index {
                self.read_ahead(index);
            }
            let piece = self.read_chunk_range(index, in_chunk, want)?;
            if piece.len() != want {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short chunk"));
            }
            out.extend_from_slice(&piece);
            pos += want as u64;
        }
        Ok(out)
    }

    fn read_chunk_range(&self, index: u64, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let key = ChunkKey { blob_hex: self.blob_hex.clone(), index };
        let chunk_lock = self.chunk_lock(index);
        let _held = chunk_lock.lock().unwrap_or_else(|e| e.into_inner());
        let result = self.read_chunk_range_locked(&key, offset, len);
        drop(_held);
        self.release_chunk_lock(index, chunk_lock);
        result
    }

    /// Starts fetches of the chunks after `index` that are neither cached nor being fetched.
    /// Their errors are counted and otherwise dropped: a reader that reaches such a chunk
    /// fetches it again and gets the error itself.
    fn read_ahead(self: &Arc<Self>, index: u64) {
        let chunks = self.rootfs.chunks.len() as u64;
        for next in (index + 1)..=(index + READ_AHEAD_CHUNKS).min(chunks.saturating_sub(1)) {
            let key = ChunkKey { blob_hex: self.blob_hex.clone(), index: next };
            if self.cache.contains(&key) || self.is_in_flight(next) {
                continue;
            }
            if self.read_ahead_running.fetch_add(1, Ordering::AcqRel) >= READ_AHEAD_CHUNKS {
                self.read_ahead_running.fetch_sub(1, Ordering::AcqRel);
                return;
            }
            let blob = self.clone();
            // A thread, not a task: the fetch blocks on the blob's runtime, which a thread of
            // that runtime must not do.
            let spawned = std::thread::Builder::new().name("lazy-read-ahead".into()).spawn(move || {
                // What a first session's reads fetched ahead is in its profile too: a prefetch
                // of the profile then leaves read-ahead nothing to fetch.
                if blob.read_chunk_range(next, 0, 1).is_ok() {
                    blob.note_read(next, next);
                }
                blob.read_ahead_running.fetch_sub(1, Ordering::AcqRel);
            });
            if spawned.is_err() {
                self.read_ahead_running.fetch_sub(1, Ordering::AcqRel);
                return;
            }
        }
    }

    fn is_in_flight(&self, index: u64) -> bool {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&index)
    }

    fn chunk_lock(&self, index: u64) -> Arc<Mutex<()>> {
        // The map only holds Arcs; a poisoned lock has no half-made state to fear.
        let mut map = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(index).or_default().clone()
    }

    /// Drops the chunk's lock from the map when no other reader holds it.
    fn release_chunk_lock(&self, index: u64, lock: Arc<Mutex<()>>) {
        let mut map = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        // Two references: the map's and ours.
        if Arc::strong_count(&lock) == 2 {
            map.remove(&index);
        }
    }

    fn read_chunk_range_locked(&self, key: &ChunkKey, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let index = key.index;
        if let Some(data) = self.cache.read(key, offset, len)
            && data.len() == len
        {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(data);
        }
        let chunk = self.fetch_chunk(index).inspect_err(|_| {
            self.stats.fetch_errors.fetch_add(1, Ordering::Relaxed);
        })?;
        if let Err(e) = self.cache.insert(key, &chunk) {
            // Served all the same; the next read fetches again.
            tracing::warn!(error = %e, "could not cache a lazy image chunk");
        }
        let start = offset as usize;
        Ok(chunk[start..(start + len).min(chunk.len())].to_vec())
    }

    /// Chunk `index` from the registry, verified: attempts and retries within the policy's
    /// bounds. A fetch that gives up starts (or continues) an outage; a success ends one. Each
    /// transition is logged once, so a reader's EIO has its cause in the daemon's log.
    fn fetch_chunk(&self, index: u64) -> io::Result<Vec<u8>> {
        let start = index * self.rootfs.chunk_size;
        let end = (start + self.rootfs.chunk_size).min(self.rootfs.size);
        let Some(runtime) = &self.runtime.0 else { return Err(io::Error::other("blob runtime shut down")) };
        let began = Instant::now();
        let mut within = self.policy.first_attempt();
        let mut failed = 0;
        let fetched = loop {
            let attempt = self.registry.blob_range(&self.repository, &self.rootfs.digest, start, end, within);
            match runtime.block_on(attempt) {
                Ok(bytes) => break Ok(bytes),
                Err(e) => {
                    failed += 1;
                    match self.policy.next_attempt(failed, began.elapsed(), self.outage.is_down()) {
                        Next::Retry { after, within: next } => {
                            tracing::debug!(
                                chunk = index,
                                attempt = failed,
                                error = format!("{e:#}"),
                                "retrying a chunk fetch"
                            );
                            std::thread::sleep(after);
                            within = next;
                        }
                        Next::GiveUp => break Err(e),
                    }
                }
            }
        };
        self.stats.record_fetch(began.elapsed());
        let bytes = match fetched {
            Ok(bytes) => {
                if let Some(lasted) = self.outage.succeeded() {
                    tracing::warn!(repository = %self.repository, blob = %self.rootfs.digest, ?lasted, "lazy image registry answers again: reads are served");
                }
                bytes
            }
            Err(e) => {
                let error = format!("{e:#}");
                if self.outage.failed() {
                    tracing::error!(
                        repository = %self.repository, blob = %self.rootfs.digest, chunk = index, attempts = failed,
                        took = ?began.elapsed(), error,
                        "lazy image registry unreachable: reads of chunks not cached fail with EIO until it answers"
                    );
                } else {
                    tracing::debug!(chunk = index, error, "lazy image fetch failed (registry still unreachable)");
                }
                return Err(io::Error::other(e));
            }
        };
        self.stats.bytes_fetched.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.stats.chunks_fetched.fetch_add(1, Ordering::Relaxed);
        let digest = hex::encode(sha2::Sha256::digest(&bytes));
        if digest != self.rootfs.chunks[index as usize] {
            tracing::warn!(blob = %self.rootfs.digest, chunk = index, "lazy image chunk does not match its pinned digest");
            return Err(io::Error::new(io::ErrorKind::InvalidData, "chunk digest mismatch"));
        }
        Ok(bytes.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A blob of 8 chunks of 4 KiB whose reads are never made (only the profile is used).
    fn blob(dir: &std::path::Path) -> Arc<LazyBlob> {
        let rootfs = Rootfs {
            format: "erofs".into(),
            digest: format!("sha256:{}", "a".repeat(64)),
            size: 8 * 4096,
            chunk_size: 4096,
            chunks: vec!["b".repeat(64); 8],
        };
        let cache = Arc::new(ChunkCache::open(dir, 1 << 20).unwrap());
        Arc::new(
            LazyBlob::new(Registry::new("127.0.0.1:1").unwrap(), "x".into(), rootfs, cache, FetchPolicy::default())
                .unwrap(),
        )
    }

    #[test]
    fn a_profile_keeps_first_reads_in_order_once_each_and_stays_bounded() {
        let dir = std::env::temp_dir().join(format!("lazy-profile-{}", uuid::Uuid::new_v4().simple()));
        let b = blob(&dir);
        // The mount's own reads (the superblock), then a sandbox's once the mount is up.
        b.note_read(0, 0);
        assert!(b.profile.lock().unwrap().opened.is_none(), "the window opens after the mount");
        b.mark_mounted();
        b.note_read(5, 6);
        b.note_read(0, 1);
        assert!(b.profile.lock().unwrap().opened.is_some());
        assert_eq!(b.profile(), ProfileSnapshot { chunks: vec![0, 5, 6, 1], complete: false });
        // A window that has passed records nothing more, and the profile is complete.
        b.profile.lock().unwrap().opened = Some(Instant::now() - PROFILE_WINDOW);
        b.note_read(7, 7);
        assert_eq!(b.profile(), ProfileSnapshot { chunks: vec![0, 5, 6, 1], complete: true });
        // At most MAX_PROFILE_CHUNKS, then complete.
        let big = blob(&dir);
        big.note_read(0, MAX_PROFILE_CHUNKS as u64 + 5);
        let p = big.profile();
        assert_eq!((p.chunks.len(), p.complete), (MAX_PROFILE_CHUNKS, true));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn fetch_latency_is_counted_in_the_nodes_buckets() {
        let stats = BlobStats::default();
        stats.record_fetch(Duration::from_micros(80));
        stats.record_fetch(Duration::from_millis(3));
        stats.record_fetch(Duration::from_secs(90));
        let counts = stats.fetch_latency();
        assert_eq!(counts.len(), FETCH_LATENCY_BUCKETS.len() + 1);
        assert_eq!(counts[0], 1, "80 µs: the first bucket (le 100 µs)");
        assert_eq!(counts[5], 1, "3 ms: le 5 ms");
        assert_eq!(counts[FETCH_LATENCY_BUCKETS.len()], 1, "past the last bound");
        assert_eq!(counts.iter().sum::<u64>(), 3);
    }
}

//! Reads of a lazy image's blob at any offset: each chunk the read touches comes from the
//! node's chunk cache, or from the registry by one HTTP range read, checked against the digest
//! the image's config pins, then cached. Synchronous on purpose: the callers are FUSE worker
//! threads (and the mount syscall's superblock read), which block on the async registry
//! client through a small runtime of the blob's own, so no caller's runtime can deadlock it.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use sha2::Digest as _;

/// Chunks fetched ahead of a reader that moves forward chunk by chunk (a whole-file read, a
/// scan): at 1 MiB chunks, 4 MiB in flight, each on a thread of its own. A reader that jumps
/// around (the first command of a sandbox, mostly) triggers none.
const READ_AHEAD_CHUNKS: u64 = 4;

use crate::cache::{ChunkCache, ChunkKey};
use crate::manifest::Rootfs;
use crate::registry::Registry;

/// Counters of one mounted blob (exported as metrics by the node; read by tests).
#[derive(Debug, Default)]
pub struct BlobStats {
    /// Bytes received from the registry.
    pub bytes_fetched: AtomicU64,
    pub chunks_fetched: AtomicU64,
    /// Chunk reads served from the cache.
    pub cache_hits: AtomicU64,
    /// Fetches that failed (the reader got EIO).
    pub fetch_errors: AtomicU64,
    /// Time spent in registry range reads, summed (microseconds).
    pub fetch_micros: AtomicU64,
}

impl BlobStats {
    pub fn bytes_fetched(&self) -> u64 {
        self.bytes_fetched.load(Ordering::Relaxed)
    }
    pub fn chunks_fetched(&self) -> u64 {
        self.chunks_fetched.load(Ordering::Relaxed)
    }
    pub fn cache_hits(&self) -> u64 {
        self.cache_hits.load(Ordering::Relaxed)
    }
    pub fn fetch_errors(&self) -> u64 {
        self.fetch_errors.load(Ordering::Relaxed)
    }
}

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
    pub fn new(registry: Registry, repository: String, rootfs: Rootfs, cache: Arc<ChunkCache>) -> anyhow::Result<Self> {
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
            runtime: FetchRuntime(Some(runtime)),
        })
    }

    pub fn size(&self) -> u64 {
        self.rootfs.size
    }

    pub fn stats(&self) -> Arc<BlobStats> {
        self.stats.clone()
    }

    /// Up to `len` bytes at `offset` (short only at the end of the blob). Any chunk that can be
    /// neither read from the cache nor fetched and verified fails the whole read with EIO.
    pub fn read_at(self: &Arc<Self>, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let end = (offset + len as u64).min(self.rootfs.size);
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
                let _ = blob.read_chunk_range(next, 0, 1);
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

    fn fetch_chunk(&self, index: u64) -> io::Result<Vec<u8>> {
        let start = index * self.rootfs.chunk_size;
        let end = (start + self.rootfs.chunk_size).min(self.rootfs.size);
        let began = Instant::now();
        let Some(runtime) = &self.runtime.0 else { return Err(io::Error::other("blob runtime shut down")) };
        let fetched = runtime.block_on(self.registry.blob_range(&self.repository, &self.rootfs.digest, start, end));
        self.stats.fetch_micros.fetch_add(began.elapsed().as_micros() as u64, Ordering::Relaxed);
        let bytes = fetched.map_err(|e| {
            tracing::warn!(blob = %self.rootfs.digest, chunk = index, error = format!("{e:#}"), "lazy image fetch failed");
            io::Error::other(e)
        })?;
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

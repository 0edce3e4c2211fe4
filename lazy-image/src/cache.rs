//! The node's chunk cache: fetched chunks of lazy image blobs as files in one directory,
//! shared by every image and sandbox on the node, bounded in bytes. Over the bound, the least
//! recently used chunks go first. Chunks are checked against their digests when fetched, so
//! what is in here is trusted; a file missing (evicted meanwhile, or removed by hand) is a
//! miss, never an error.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

use anyhow::Context as _;

/// A chunk's name: the blob's sha256 (hex) and the chunk's index in it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChunkKey {
    /// The blob's sha256, hex, without the `sha256:` prefix.
    pub blob_hex: String,
    /// The chunk's index in the blob (its offset over the chunk size).
    pub index: u64,
}

impl ChunkKey {
    fn file_name(&self) -> String {
        format!("{}-{}", self.blob_hex, self.index)
    }

    fn parse(name: &str) -> Option<ChunkKey> {
        let (blob_hex, index) = name.rsplit_once('-')?;
        (blob_hex.len() == 64 && blob_hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())?;
        Some(ChunkKey { blob_hex: blob_hex.to_string(), index: index.parse().ok()? })
    }
}

/// Chunks being written are named so, then renamed into place.
const TMP_PREFIX: &str = ".tmp-";

/// The node's chunk cache: chunk files in one directory, bounded in bytes, LRU eviction.
pub struct ChunkCache {
    dir: PathBuf,
    /// The bound; lowered or raised while the cache runs (`set_limit`: the node's image disk
    /// budget less its pulled images).
    limit_bytes: AtomicU64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    entries: HashMap<ChunkKey, Entry>,
    total_bytes: u64,
    /// A logical clock: each use stamps the entry with the next tick.
    clock: u64,
}

struct Entry {
    size: u64,
    last_used: u64,
}

impl ChunkCache {
    /// Opens (creating) the cache in `dir`, adopting the chunks already there (oldest
    /// modification first in the eviction order), and trims it to `limit_bytes`.
    pub fn open(dir: impl Into<PathBuf>, limit_bytes: u64) -> anyhow::Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).with_context(|| format!("create chunk cache {}", dir.display()))?;
        let mut found: Vec<(SystemTime, ChunkKey, u64)> = Vec::new();
        for entry in std::fs::read_dir(&dir).with_context(|| format!("read chunk cache {}", dir.display()))? {
            let entry = entry?;
            let name = entry.file_name();
            let Some(key) = name.to_str().and_then(ChunkKey::parse) else {
                // Leftover temporary files from a crash mid-write go; anything else is not
                // ours (a cache pointed at the wrong directory must not delete its files).
                if name.to_str().is_some_and(|n| n.starts_with(TMP_PREFIX)) {
                    let _ = std::fs::remove_file(entry.path());
                }
                continue;
            };
            let meta = entry.metadata()?;
            found.push((meta.modified().unwrap_or(SystemTime::UNIX_EPOCH), key, meta.len()));
        }
        found.sort_by_key(|(mtime, _, _)| *mtime);
        let cache = ChunkCache { dir, limit_bytes: AtomicU64::new(limit_bytes), state: Mutex::new(State::default()) };
        {
            let mut state = cache.lock();
            for (_, key, size) in found {
                state.clock += 1;
                let last_used = state.clock;
                state.total_bytes += size;
                state.entries.insert(key, Entry { size, last_used });
            }
            cache.evict_to_fit(&mut state, None);
        }
        Ok(cache)
    }

    /// `len` bytes at `offset` of a cached chunk, or `None` if it is not cached.
    pub fn read(&self, key: &ChunkKey, offset: u64, len: usize) -> Option<Vec<u8>> {
        {
            let mut state = self.lock();
            state.clock += 1;
            let tick = state.clock;
            state.entries.get_mut(key)?.last_used = tick;
        }
        let file = File::open(self.path(key)).ok()?;
        let mut buf = vec![0u8; len];
        let mut filled = 0;
        while filled < len {
            match file.read_at(&mut buf[filled..], offset + filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
        buf.truncate(filled);
        Some(buf)
    }

    /// Stores a (verified) chunk; evicts least recently used chunks to stay within the bound.
    /// A chunk larger than the whole bound is not stored.
    pub fn insert(&self, key: &ChunkKey, data: &[u8]) -> io::Result<()> {
        let size = data.len() as u64;
        if size > self.limit_bytes() {
            return Ok(());
        }
        // Write aside and rename: a reader never sees half a chunk.
        let tmp = self.dir.join(format!("{TMP_PREFIX}{}-{:?}", key.file_name(), std::thread::current().id()));
        std::fs::write(&tmp, data)?;
        std::fs::rename(&tmp, self.path(key))?;
        let mut state = self.lock();
        state.clock += 1;
        let last_used = state.clock;
        if let Some(old) = state.entries.insert(key.clone(), Entry { size, last_used }) {
            state.total_bytes -= old.size;
        }
        state.total_bytes += size;
        self.evict_to_fit(&mut state, Some(key));
        Ok(())
    }

    /// Whether the chunk is cached (as far as the index knows; the file may have gone since).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.lock().entries.contains_key(key)
    }

    /// Bytes the cached chunks take.
    pub fn used_bytes(&self) -> u64 {
        self.lock().total_bytes
    }

    /// The bound in bytes that eviction keeps the cache under.
    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes.load(Ordering::Relaxed)
    }

    /// Moves the bound to `limit_bytes`, evicting least recently used chunks at once when the
    /// cache holds more. Readers of an evicted chunk fetch it again: nothing breaks, it costs.
    pub fn set_limit(&self, limit_bytes: u64) {
        let mut state = self.lock();
        self.limit_bytes.store(limit_bytes, Ordering::Relaxed);
        self.evict_to_fit(&mut state, None);
    }

    /// Removes every chunk of blob `blob_hex` (an image evicted from the node); returns the
    /// bytes freed.
    pub fn remove_blob(&self, blob_hex: &str) -> u64 {
        let mut state = self.lock();
        let gone: Vec<ChunkKey> = state.entries.keys().filter(|k| k.blob_hex == blob_hex).cloned().collect();
        let mut freed = 0;
        for key in gone {
            if let Some(entry) = state.entries.remove(&key) {
                state.total_bytes -= entry.size;
                freed += entry.size;
            }
            let _ = std::fs::remove_file(self.path(&key));
        }
        freed
    }

    /// The directory holding the chunk files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &ChunkKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// Removes least recently used chunks (never `keep`, the one just stored) until the total
    /// fits the bound. A linear scan per eviction: the cache holds thousands of chunks (GBs in
    /// MiB chunks), and evictions happen once per fetched chunk at most.
    fn evict_to_fit(&self, state: &mut State, keep: Option<&ChunkKey>) {
        while state.total_bytes > self.limit_bytes() {
            let victim = state
                .entries
                .iter()
                .filter(|(k, _)| Some(*k) != keep)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { break };
            if let Some(entry) = state.entries.remove(&victim) {
                state.total_bytes -= entry.size;
            }
            if let Err(e) = std::fs::remove_file(self.path(&victim))
                && e.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(chunk = %victim.file_name(), error = %e, "could not remove an evicted chunk");
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a map and counters updated together under the lock; a panic elsewhere
        // cannot leave it half-updated, so a poisoned lock is safe to keep using.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> ChunkKey {
        ChunkKey { blob_hex: "a".repeat(64), index: i }
    }

    /// A scratch directory removed on drop, pass or fail.
    struct TempDir(PathBuf);

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tempdir() -> TempDir {
        TempDir(std::env::temp_dir().join(format!("lazy-cache-{}", uuid::Uuid::new_v4().simple())))
    }

    #[test]
    fn evicts_least_recently_used_within_the_byte_bound() {
        let scratch = tempdir();
        let dir = scratch.0.clone();
        let cache = ChunkCache::open(&dir, 300).unwrap();
        cache.insert(&key(0), &[0; 100]).unwrap();
        cache.insert(&key(1), &[1; 100]).unwrap();
        cache.insert(&key(2), &[2; 100]).unwrap();
        assert_eq!(cache.used_bytes(), 300);
        // Chunk 0 is used again, so 1 is now the least recently used.
        assert_eq!(cache.read(&key(0), 10, 5).unwrap(), vec![0; 5]);
        cache.insert(&key(3), &[3; 100]).unwrap();
        assert!(cache.contains(&key(0)) && !cache.contains(&key(1)) && cache.contains(&key(2)));
        assert!(!dir.join(key(1).file_name()).exists(), "an evicted chunk's file is removed");
        assert_eq!(cache.used_bytes(), 300);
        assert!(cache.read(&key(1), 0, 1).is_none());
        // Too big for the bound: served by the caller, never stored.
        cache.insert(&key(9), &[9; 301]).unwrap();
        assert!(!cache.contains(&key(9)));
    }

    #[test]
    fn reopening_adopts_chunks_and_trims_to_a_smaller_bound() {
        let scratch = tempdir();
        let dir = scratch.0.clone();
        {
            let cache = ChunkCache::open(&dir, 1000).unwrap();
            for i in 0..5 {
                cache.insert(&key(i), &[i as u8; 100]).unwrap();
            }
        }
        std::fs::write(dir.join(".tmp-leftover"), b"x").unwrap();
        std::fs::write(dir.join("not-a-chunk"), b"someone else's").unwrap();
        let cache = ChunkCache::open(&dir, 250).unwrap();
        assert!(cache.used_bytes() <= 250);
        assert!(!dir.join(".tmp-leftover").exists());
        assert!(dir.join("not-a-chunk").exists(), "files that are not chunks are left alone");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count() as u64 - 1, cache.used_bytes() / 100);
        let n = (0..5).filter(|i| cache.contains(&key(*i))).count();
        assert_eq!(n, 2);
    }

    #[test]
    fn a_lowered_bound_evicts_at_once_and_a_blob_goes_whole() {
        let scratch = tempdir();
        let cache = ChunkCache::open(&scratch.0, 1000).unwrap();
        let other = |i| ChunkKey { blob_hex: "b".repeat(64), index: i };
        for i in 0..3 {
            cache.insert(&key(i), &[1; 100]).unwrap();
            cache.insert(&other(i), &[2; 100]).unwrap();
        }
        assert_eq!(cache.used_bytes(), 600);
        cache.set_limit(250);
        assert_eq!((cache.used_bytes(), cache.limit_bytes()), (200, 250));
        // The two most recently stored survive: blob b's chunk 2 and blob a's chunk 2.
        assert!(cache.contains(&key(2)) && cache.contains(&other(2)));
        assert_eq!(cache.remove_blob(&"b".repeat(64)), 100);
        assert!(!cache.contains(&other(2)) && !scratch.0.join(other(2).file_name()).exists());
        assert_eq!(cache.used_bytes(), 100);
    }

    #[test]
    fn reads_past_the_end_are_short() {
        let scratch = tempdir();
        let dir = scratch.0.clone();
        let cache = ChunkCache::open(&dir, 1000).unwrap();
        cache.insert(&key(0), b"hello").unwrap();
        assert_eq!(cache.read(&key(0), 3, 10).unwrap(), b"lo");
    }
}

//! The node's upkeep of its lazy images (issue 32), run with each image eviction pass (5 s):
//! - **the chunk cache in the image disk budget**: pulled images and `sandpool-lazyd`'s chunk
//!   cache share `images.disk_budget_mb`. Pulled images are evicted down to the budget less a
//!   floor kept for chunks ([`pulled_bound`]); the cache is bounded by what the pulled images
//!   leave ([`cache_bound`]), a lease the node renews each pass (`lazyd::CACHE_LEASE`), and
//!   evicts its least recently used chunks beyond it. A running sandbox's chunks may go too:
//!   they are fetched again when read, and its image stays mounted;
//! - **access profiles**: what a mount's first session read (recorded by `sandpool-lazyd`) is
//!   published to the ledger under the image's digest, for every node's prefetch of the image
//!   (`images.rs`);
//! - **metrics**: the daemon's counters per mount become the node's series (deltas since the
//!   last pass, so a restarted daemon's counters starting again do not go backwards).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use lazy_image::blob::FETCH_LATENCY_BUCKETS;
use lazy_image::lazyd::MountInfo;
use ledger::Ledger;
use telemetry::names;

use crate::lazy::Lazyd;
use crate::sync::lock;

/// The least the chunk cache is bounded at, whatever the pulled images take: a cache that
/// cannot hold a few 1 MiB chunks fetches every read again.
pub(crate) const MIN_CACHE_BYTES: u64 = 8 << 20;
/// The most of the budget kept for chunks when pulled images want it: a few large task
/// images' working sets (DSec: 4-13 % of an image is read).
const CACHE_FLOOR_MAX: u64 = 2 << 30;

/// What pulled images may take of `budget` (bytes) on a node: all of it without lazy images;
/// with them, all but a floor for the chunk cache (a quarter, at most [`CACHE_FLOOR_MAX`]).
pub(crate) fn pulled_bound(budget: u64, lazy: bool) -> u64 {
    if lazy { budget - (budget / 4).min(CACHE_FLOOR_MAX) } else { budget }
}

/// The chunk cache's bound: what `pulled` bytes of images leave of `budget`, at least
/// [`MIN_CACHE_BYTES`] (images in use may hold more than their bound, and are never evicted).
pub(crate) fn cache_bound(budget: u64, pulled: u64) -> u64 {
    budget.saturating_sub(pulled).max(MIN_CACHE_BYTES)
}

/// The `image` label of a lazy image's series: `repository@sha256:<12 hex>` (its digest's
/// first 12 hex digits tell images apart as Docker's short ids do).
pub(crate) fn image_label(image: &str) -> String {
    match image.rsplit_once("@sha256:") {
        Some((repository, hex)) => format!("{repository}@sha256:{}", &hex[..hex.len().min(12)]),
        None => image.to_string(),
    }
}

/// Counts that only go up, per mount; a smaller one than last time is a restarted daemon's.
fn delta(now: u64, before: u64) -> u64 {
    if now >= before { now - before } else { now }
}

#[derive(Default)]
pub(crate) struct LazyUpkeep {
    /// Each mount's counters at the last pass, by image.
    last: Mutex<HashMap<String, MountInfo>>,
    /// Per image: the profile length published, and whether it was complete.
    published: Mutex<HashMap<String, (usize, bool)>>,
}

impl LazyUpkeep {
    /// One pass for node `node` with daemon `lazyd`, whose lazy images are `ours`, with `pulled` bytes of pulled
    /// images left after eviction (`budget` 0: no bound). Returns the chunk cache's bytes
    /// (0 when the daemon does not answer).
    pub(crate) async fn run(
        &self,
        lazyd: &Lazyd,
        node: &str,
        ledger: &Ledger,
        ours: &HashSet<String>,
        budget: u64,
        pulled: u64,
    ) -> u64 {
        if budget > 0
            && let Err(e) = crate::lazy::set_cache_limit(lazyd, node, cache_bound(budget, pulled)).await
        {
            tracing::warn!(error = format!("{e:#}"), "bound the lazy chunk cache");
        }
        let stats = match crate::lazy::stats(lazyd).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = format!("{e:#}"), "sandpool-lazyd stats");
                return 0;
            }
        };
        metrics::gauge!(names::LAZY_CACHE_BYTES, "node" => node.to_string()).set(stats.cache_used_bytes as f64);
        metrics::gauge!(names::LAZY_CACHE_LIMIT, "node" => node.to_string()).set(stats.cache_limit_bytes as f64);
        for mount in &stats.mounts {
            self.export(node, mount);
        }
        // Unmounted images' counters go (a remount counts from 0 again: `delta`).
        let mounted: HashSet<&str> = stats.mounts.iter().map(|m| m.image.as_str()).collect();
        lock(&self.last).retain(|image, _| mounted.contains(image.as_str()));
        for mount in stats.mounts.iter().filter(|m| ours.contains(&m.image)) {
            self.publish_profile(lazyd, ledger, &mount.image).await;
        }
        stats.cache_used_bytes
    }

    fn export(&self, node: &str, mount: &MountInfo) {
        let before = lock(&self.last).insert(mount.image.clone(), mount.clone());
        // First seen: everything it counted is new.
        let before = before.unwrap_or_else(|| MountInfo {
            bytes_fetched: 0,
            chunks_fetched: 0,
            cache_hits: 0,
            fetch_errors: 0,
            fetch_latency: Vec::new(),
            ..mount.clone()
        });
        let (node, image) = (node.to_string(), image_label(&mount.image));
        metrics::gauge!(names::LAZY_IMAGE_BYTES, "node" => node.clone(), "image" => image.clone())
            .set(mount.blob_size as f64);
        metrics::counter!(names::LAZY_FETCHED_BYTES, "node" => node.clone(), "image" => image.clone())
            .increment(delta(mount.bytes_fetched, before.bytes_fetched));
        for (outcome, now, was) in [
            ("hit", mount.cache_hits, before.cache_hits),
            ("miss", mount.chunks_fetched, before.chunks_fetched),
            ("error", mount.fetch_errors, before.fetch_errors),
        ] {
            metrics::counter!(names::LAZY_CHUNK_READS, "node" => node.clone(), "image" => image.clone(), "outcome" => outcome)
                .increment(delta(now, was));
        }
        // Each bucket's new reads, recorded at its upper bound (the rest at twice the last):
        // the node's histogram has the same buckets, so its counts are exact.
        let histogram = metrics::histogram!(names::LAZY_FETCH_DURATION, "node" => node);
        for (i, now) in mount.fetch_latency.iter().enumerate() {
            let was = before.fetch_latency.get(i).copied().unwrap_or(0);
            let new = delta(*now, was);
            let at = FETCH_LATENCY_BUCKETS
                .get(i)
                .copied()
                .unwrap_or(FETCH_LATENCY_BUCKETS[FETCH_LATENCY_BUCKETS.len() - 1] * 2.0);
            if new > 0 {
                histogram.record_many(at, new as usize);
            }
        }
    }

    /// Publishes `image`'s profile while it grows, until its window closes.
    async fn publish_profile(&self, lazyd: &Lazyd, ledger: &Ledger, image: &str) {
        let (len, complete) = lock(&self.published).get(image).copied().unwrap_or_default();
        if complete {
            return;
        }
        let Some(digest) = crate::lazy::digest_of(image) else { return };
        let (chunks, now_complete) = match crate::lazy::profile(lazyd, image).await {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(image, error = format!("{e:#}"), "read a lazy image's profile");
                return;
            }
        };
        if chunks.is_empty() || (chunks.len() == len && !now_complete) {
            return;
        }
        match ledger.put_lazy_profile(digest, &chunks).await {
            Ok(()) => {
                tracing::debug!(
                    image,
                    chunks = chunks.len(),
                    complete = now_complete,
                    "published a lazy image's profile"
                );
                lock(&self.published).insert(image.to_string(), (chunks.len(), now_complete));
            }
            Err(e) => tracing::warn!(image, error = %e, "publish a lazy image's profile"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pulled_images_and_the_chunk_cache_share_the_budget() {
        const MB: u64 = 1 << 20;
        // No lazy image: the pulled images have it all.
        assert_eq!(pulled_bound(1000 * MB, false), 1000 * MB);
        // With lazy images, a quarter is kept for chunks, at most 2 GiB.
        assert_eq!(pulled_bound(1000 * MB, true), 750 * MB);
        assert_eq!(pulled_bound(20 << 30, true), 18 << 30);
        // The cache gets what the pulled images leave, never less than a few chunks.
        assert_eq!(cache_bound(1000 * MB, 600 * MB), 400 * MB);
        assert_eq!(cache_bound(1000 * MB, 0), 1000 * MB);
        assert_eq!(cache_bound(1000 * MB, 1200 * MB), MIN_CACHE_BYTES);
        // Whatever the pulled images hold within their bound, the two stay within the budget.
        for budget in [64 * MB, 1000 * MB, 20 << 30] {
            let pulled = pulled_bound(budget, true);
            assert!(pulled + cache_bound(budget, pulled) <= budget.max(pulled + MIN_CACHE_BYTES));
        }
    }

    #[test]
    fn image_labels_are_short_and_counts_survive_a_daemon_restart() {
        let hex = "ab".repeat(32);
        assert_eq!(
            image_label(&format!("127.0.0.1:5000/t/img@sha256:{hex}")),
            "127.0.0.1:5000/t/img@sha256:abababababab"
        );
        assert_eq!(delta(10, 4), 6);
        assert_eq!(delta(3, 40), 3, "a restarted daemon counts from 0 again");
    }
}

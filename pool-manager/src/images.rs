//! The node's images of the corpus: pulled on first need (one pull per image however many
//! creates want it, a bounded number at once, a failed image backing off), reported to the
//! ledger (placement prefers the node that holds a template's image), and evicted least
//! recently used when they outgrow the node's image disk budget, never one that something uses.
//!
//! Only images named by digest (`repository@sha256:...`: templates made from images) come
//! through here; configured templates' images are the operator's, never pulled or evicted.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use config::ImagesConfig;
use futures::FutureExt as _;
use futures::future::{BoxFuture, Shared};
use ledger::Ledger;
use telemetry::names;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use wire::images::{ImagePull, PullState};

use crate::lazy_upkeep::{LazyUpkeep, pulled_bound};
use crate::runtime::Runtime;
use crate::sync::lock;

/// Back-off of an image whose pull failed: doubles per failure, like a template's.
const BACKOFF_MIN: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// Why a create could not have its image.
#[derive(Debug, Clone, thiserror::Error)]
#[error("image {image} could not be pulled: {reason}")]
pub struct PullFailed {
    pub image: String,
    /// The registry's (or Docker's) words.
    pub reason: String,
}

type Pull = Shared<BoxFuture<'static, Result<(), String>>>;

/// Where an image stands on the node.
enum Now {
    Present,
    /// Being pulled (the pull to await).
    Pulling(Pull),
    /// Its last pull failed and it backs off: that failure's words.
    Failed(String),
}

#[derive(Default)]
struct Entry {
    present: bool,
    pulling: Option<Pull>,
    failures: u32,
    /// Backing off until then, with the last pull's error.
    failed: Option<(Instant, String)>,
    last_used: Option<Instant>,
}

pub struct Images {
    node: String,
    engine: Arc<dyn Runtime>,
    ledger: Ledger,
    config: ImagesConfig,
    slots: Arc<Semaphore>,
    entries: Mutex<HashMap<String, Entry>>,
    /// The tenant whose registry credentials pull each image of a private template
    /// (`ImagesConfig::auth_for`); images of public templates use the deployment's.
    owners: Mutex<HashMap<String, String>>,
    /// Pulls started (one per image however many creates wait for it; tests count them).
    pub pulls_started: std::sync::atomic::AtomicU64,
    /// The lazy images prepared here (mounted by the node's `sandpool-lazyd`, never pulled).
    lazy: Mutex<HashSet<String>>,
    /// Their chunk cache's bound, profiles and metrics (`lazy_upkeep.rs`).
    lazy_upkeep: LazyUpkeep,
    /// The node's `sandpool-lazyd`.
    lazyd: crate::lazy::Lazyd,
    /// The node's tasks and its shutdown: a pull runs on the one and stops at the other.
    tracker: TaskTracker,
    cancel: CancellationToken,
}

/// Why lazy `image` is not mounted: the node's kernel would parse its filesystem, and its
/// registry is not one `images.lazy_registries` trusts.
fn untrusted_lazy(image: &str) -> String {
    format!(
        "{image} is a lazy image, whose filesystem the node's kernel would parse, from a registry the node \
         does not trust with that (images.lazy_registries; by default only the node's loopback registries)"
    )
}

/// Whether `image` is one of the corpus's (named by digest: pulled and evicted by the node).
pub(crate) fn is_pulled(image: &str) -> bool {
    wire::images::digest_of(image).is_some()
}

impl Images {
    pub fn new(
        node: &str,
        engine: Arc<dyn Runtime>,
        ledger: Ledger,
        config: ImagesConfig,
        tracker: TaskTracker,
        cancel: CancellationToken,
    ) -> Arc<Images> {
        Arc::new(Images {
            node: node.to_string(),
            engine,
            ledger,
            slots: Arc::new(Semaphore::new(config.max_pulls_in_flight)),
            lazyd: crate::lazy::Lazyd::of(&config),
            config,
            entries: Mutex::new(HashMap::new()),
            owners: Mutex::new(HashMap::new()),
            pulls_started: Default::default(),
            lazy: Mutex::default(),
            lazy_upkeep: LazyUpkeep::default(),
            tracker,
            cancel,
        })
    }

    /// Learns whose credentials pull each image (`(image, owner)` of every private template).
    pub fn set_owners(&self, owners: impl IntoIterator<Item = (String, String)>) {
        *lock(&self.owners) = owners.into_iter().collect();
    }

    /// After a restart: what the ledger says this node holds, checked against Docker.
    pub async fn resync(&self) -> anyhow::Result<()> {
        let held = self.engine.digest_image_sizes().await?;
        for image in self.ledger.node_images(&self.node).await? {
            if held.contains_key(&image) {
                lock(&self.entries).entry(image).or_default().present = true;
            } else {
                self.ledger.node_dropped(&self.node, &image).await?;
            }
        }
        Ok(())
    }

    /// Where `image` stands now, its pull started here when it is absent and not backing off.
    fn now(self: &Arc<Self>, image: &str) -> Now {
        let mut all = lock(&self.entries);
        let e = all.entry(image.to_string()).or_default();
        e.last_used = Some(Instant::now());
        if e.present {
            return Now::Present;
        }
        if let Some(p) = &e.pulling {
            return Now::Pulling(p.clone());
        }
        if let Some((until, reason)) = &e.failed
            && Instant::now() < *until
        {
            return Now::Failed(reason.clone());
        }
        let p = self.clone().start_pull(image.to_string());
        e.pulling = Some(p.clone());
        Now::Pulling(p)
    }

    /// Makes sure `image` is on the node: at once if it is, else after the one pull of it
    /// (started here or by an earlier caller); within its back-off, the last failure again.
    pub async fn ensure(self: &Arc<Self>, image: &str) -> Result<(), PullFailed> {
        let failed = |reason: String| PullFailed { image: image.to_string(), reason };
        match self.now(image) {
            Now::Present => Ok(()),
            Now::Pulling(pull) => pull.await.map_err(failed),
            Now::Failed(reason) => Err(failed(reason)),
        }
    }

    /// Whether a create of `image` may start now: yes when it is present, or when its last pull
    /// failed (the create then fails at once with the registry's words, which its waiters are
    /// told); no while it is being pulled (its pull starts here when it is absent). So pulls run
    /// beside creates instead of holding a create slot each: the node's create window measures
    /// Docker, not the registry.
    pub fn ready_for_create(self: &Arc<Self>, image: &str) -> bool {
        !matches!(self.now(image), Now::Pulling(_))
    }

    /// Starts pulling `image` without waiting; its state now.
    pub fn prefetch(self: &Arc<Self>, image: &str) -> ImagePull {
        let (state, error) = match self.now(image) {
            Now::Present => (PullState::Present, None),
            Now::Pulling(_) => (PullState::Pulling, None),
            Now::Failed(reason) => (PullState::Failed, Some(reason)),
        };
        ImagePull { image: image.to_string(), node: self.node.clone(), state, error }
    }

    /// The pull of `image` as a shared future, driven by a task of its own (on the node's
    /// tracker) so that it finishes and records its outcome even when every create that wanted
    /// it has given up. Shutdown stops it unrecorded: the image is neither present nor failed.
    fn start_pull(self: Arc<Self>, image: String) -> Pull {
        let this = self.clone();
        let task = self.tracker.spawn(async move {
            let r = tokio::select! {
                r = this.pull_now(&image) => r,
                () = this.cancel.cancelled() => return Err("the node is shutting down".to_string()),
            };
            this.finish(&image, &r).await;
            r
        });
        async move { task.await.unwrap_or_else(|e| Err(format!("the pull task failed: {e}"))) }.boxed().shared()
    }

    async fn pull_now(&self, image: &str) -> Result<(), String> {
        // Present already (pulled by hand, or before a restart the ledger forgot): no pull.
        if self.engine.image_exists(image).await.unwrap_or(false) {
            return Ok(());
        }
        // A lazy image is mounted by the node's sandpool-lazyd and run from a stub image, never
        // pulled (`lazy.rs`).
        if crate::lazy::is_lazy(&self.lazyd, image).await {
            if !self.config.lazy_trusted(image) {
                return Err(untrusted_lazy(image));
            }
            let stub = crate::lazy::prepare(&self.lazyd, image).await.map_err(|e| format!("{e:#}"))?;
            self.engine.use_lazy_stub(image, stub).await.map_err(|e| format!("{e:#}"))?;
            lock(&self.lazy).insert(image.to_string());
            self.prefetch_profile(image).await;
            return Ok(());
        }
        let _slot = self.slots.acquire().await.map_err(|_| "the node is shutting down".to_string())?;
        self.pulls_started.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let started = Instant::now();
        let owner = lock(&self.owners).get(image).cloned();
        let r = self.engine.pull(image, self.config.auth_for(image, owner.as_deref()), self.config.pull_timeout).await;
        let outcome = if r.is_ok() { "ok" } else { "failed" };
        metrics::histogram!(names::IMAGE_PULL_DURATION, "node" => self.node.clone(), "outcome" => outcome)
            .record(started.elapsed().as_secs_f64());
        match &r {
            Ok(()) => tracing::info!(image, took = ?started.elapsed(), "image pulled"),
            Err(e) => tracing::warn!(image, error = %e, "image pull failed"),
        }
        r
    }

    /// Why `image` may not make a template here, if it may not: a lazy image from a registry
    /// the node does not trust with lazy images (asked of its registry; a plain image, or a
    /// registry that does not answer, is not refused here: its pull tells).
    pub async fn refusal(&self, image: &str) -> Option<String> {
        let lazy = !self.config.lazy_trusted(image) && crate::lazy::is_lazy(&self.lazyd, image).await;
        lazy.then(|| untrusted_lazy(image))
    }

    /// Fetches the chunks of lazy `image` that a first session read on some node (its profile
    /// in the ledger), so the sandboxes of this node start warm and light. A profile is a hint:
    /// none yet, or a failure, leaves the chunks to be fetched on demand.
    async fn prefetch_profile(&self, image: &str) {
        let Some(digest) = crate::lazy::digest_of(image) else { return };
        let chunks = match self.ledger.lazy_profile(digest).await {
            Ok(Some(chunks)) if !chunks.is_empty() => chunks,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(image, error = %e, "read a lazy image's profile");
                return;
            }
        };
        let began = Instant::now();
        match crate::lazy::prefetch(&self.lazyd, image, chunks).await {
            Ok(fetched) => {
                metrics::counter!(names::LAZY_PREFETCHED_CHUNKS, "node" => self.node.clone()).increment(fetched);
                tracing::info!(image, fetched, took = ?began.elapsed(), "prefetched a lazy image's profile");
            }
            Err(e) => tracing::warn!(image, error = format!("{e:#}"), "prefetch a lazy image's profile"),
        }
    }

    async fn finish(&self, image: &str, r: &Result<(), String>) {
        {
            let mut all = lock(&self.entries);
            let e = all.entry(image.to_string()).or_default();
            e.pulling = None;
            match r {
                Ok(()) => {
                    e.present = true;
                    e.failures = 0;
                    e.failed = None;
                }
                Err(reason) => {
                    e.failures += 1;
                    let delay = BACKOFF_MIN.saturating_mul(1 << (e.failures - 1).min(10)).min(BACKOFF_MAX);
                    e.failed = Some((Instant::now() + delay, reason.clone()));
                }
            }
        }
        if r.is_ok()
            && let Err(e) = self.ledger.node_holds(&self.node, image).await
        {
            tracing::warn!(image, error = %e, "record a pulled image");
        }
    }

    /// Keeps the node's image disk within its budget: evicts unused pulled images, least
    /// recently used first, to what the budget leaves them (`lazy_upkeep::pulled_bound`), and
    /// bounds the lazy chunk cache by the rest (`lazy_upkeep.rs`, which also exports the lazy
    /// images' metrics and publishes their profiles). `in_use`: images a sandbox, a pool with a
    /// target or waiters, or a pending reservation needs (an image being pulled is not present
    /// yet: never a candidate). Returns the images removed.
    pub async fn evict(&self, in_use: &HashSet<String>) -> anyhow::Result<Vec<String>> {
        let budget = self.config.disk_budget_mb << 20;
        let lazy = lock(&self.lazy).clone();
        let (removed, pulled) = if budget == 0 {
            (Vec::new(), 0)
        } else {
            self.evict_pulled(in_use, pulled_bound(budget, !lazy.is_empty())).await?
        };
        let cache = if lazy.is_empty() {
            0
        } else {
            self.lazy_upkeep.run(&self.lazyd, &self.node, &self.ledger, &lazy, budget, pulled).await
        };
        if budget > 0 {
            metrics::gauge!(names::IMAGE_DISK_BYTES, "node" => self.node.clone()).set((pulled + cache) as f64);
        }
        Ok(removed)
    }

    /// Evicts unused pulled images, least recently used first, until their sizes fit `bound`.
    /// Returns the images removed and the bytes of those kept.
    async fn evict_pulled(&self, in_use: &HashSet<String>, bound: u64) -> anyhow::Result<(Vec<String>, u64)> {
        let sizes = self.engine.digest_image_sizes().await?;
        let mut held: Vec<(Option<Instant>, String, u64)> = {
            let all = lock(&self.entries);
            all.iter()
                .filter(|(_, e)| e.present)
                .filter_map(|(image, e)| Some((e.last_used, image.clone(), *sizes.get(image)?)))
                .collect()
        };
        let mut total: u64 = held.iter().map(|(_, _, size)| size).sum();
        if total <= bound {
            return Ok((Vec::new(), total));
        }
        // Oldest use first (never used since the node started: oldest of all).
        held.sort();
        let mut removed = Vec::new();
        for (_, image, size) in held {
            if total <= bound {
                break;
            }
            if in_use.contains(&image) {
                continue;
            }
            // Forgotten first: a create that wants it from here on pulls it again.
            if let Some(e) = lock(&self.entries).get_mut(&image) {
                e.present = false;
            }
            self.ledger.node_dropped(&self.node, &image).await?;
            if self.engine.remove_image(&image).await? {
                // A create that asked for it meanwhile found it still there and marked it
                // present again: it is gone now, and the next create pulls it.
                let marked_again = lock(&self.entries).get_mut(&image).is_some_and(|e| std::mem::take(&mut e.present));
                if marked_again {
                    self.ledger.node_dropped(&self.node, &image).await?;
                }
                total = total.saturating_sub(size);
                metrics::counter!(names::IMAGE_EVICTIONS, "node" => self.node.clone()).increment(1);
                tracing::info!(image, size_mb = size >> 20, "image evicted");
                removed.push(image);
            } else {
                // A container still uses it (one being created this instant): keep it.
                if let Some(e) = lock(&self.entries).get_mut(&image) {
                    e.present = true;
                }
                self.ledger.node_holds(&self.node, &image).await?;
            }
        }
        Ok((removed, total))
    }
}

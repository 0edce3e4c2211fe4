//! Sizing the node's pools: every tick, creates what waiting requests need first, then what
//! the pools' idle targets need, within a create budget (a token bucket shared by both, and a
//! window of creates in flight that adapts to what Docker sustains, `pace::Window`) and the
//! node's sandbox capacity. A template whose sandboxes fail
//! to start backs off exponentially and is marked unhealthy in the ledger, which tells its
//! waiting requests at once. The node's counts are published for the autoscaler.
//!
//! The decisions themselves are `plan::plan`, a pure function; this module gathers its
//! inputs and carries its plan out.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use config::{Config, Template};
use ledger::{GoneReason, Ready};
use telemetry::metrics::template_label;
use telemetry::names;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::node::Node;
use crate::plan::{self, Budget, Plan, PoolView};
use crate::sync::lock;

/// How often pools are compared with their targets and queues.
const TICK: Duration = Duration::from_millis(100);
/// Node stats are published every this many ticks.
const STATS_EVERY: u32 = 5;
/// Private templates are reloaded (and deleted ones' images pruned) every this many ticks.
const PRIVATE_EVERY: u32 = 20;
/// Pulled images are checked against the node's image disk budget every this many ticks.
const EVICT_EVERY: u32 = 50;
/// Autoscaler targets older than this are ignored (the autoscaler is down): config `warm` rules.
const TARGETS_FRESH_MS: u64 = 10_000;
/// Back-off after a failed create of a template: doubles per consecutive failure up to the max.
const BACKOFF_MIN: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// Consecutive failures of a template's creates that may be the machine's load (a timeout, an
/// agent slow to answer, an error of Docker's) before its waiting requests are told it cannot
/// start sandboxes: one such failure in a burst of 64 creates on a busy node must not fail
/// all 64 requests. Failures that are the template's own (its image, its pull, its runtime)
/// are told at the first.
const TRANSIENT_FAILURES_TOLD: u32 = 3;
/// The create rate is measured over this window.
const RATE_WINDOW: Duration = Duration::from_secs(30);

#[derive(Default)]
pub(super) struct Backoff {
    pub(super) failures: u32,
    pub(super) until: Option<Instant>,
    pub(super) cause: Option<String>,
}

impl Backoff {
    /// Notes a failed create: backs off (0.5 s, doubling to 60 s) and, when the failure is
    /// sure to be the template's, records its cause and returns the back-off to tell waiting
    /// requests. A create that timed out or lost a race under load says little: requests keep
    /// their wait until such failures repeat.
    fn failed(&mut self, cause: &str, now: Instant) -> Option<Duration> {
        self.failures += 1;
        let delay = BACKOFF_MIN.saturating_mul(1 << (self.failures - 1).min(10)).min(BACKOFF_MAX);
        self.until = Some(now + delay);
        let transient = matches!(failure_cause(cause), "timeout" | "agent" | "other");
        (!transient || self.failures >= TRANSIENT_FAILURES_TOLD).then(|| {
            self.cause = Some(cause.to_string());
            delay
        })
    }
}

/// A token bucket: `rate` tokens a second, at most `burst` saved up.
struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// Refills the bucket up to `now` and returns the whole tokens in it.
    fn available(&mut self, now: Instant) -> u64 {
        self.tokens = (self.tokens + now.saturating_duration_since(self.at).as_secs_f64() * self.rate).min(self.burst);
        self.at = self.at.max(now);
        self.tokens.floor() as u64
    }

    /// Takes one token (the caller saw it in `available`).
    fn spend(&mut self) {
        self.tokens = (self.tokens - 1.0).max(0.0);
    }
}

/// Create bookkeeping of one node.
pub(crate) struct Pools {
    pub(super) slots: Arc<Semaphore>,
    bucket: Mutex<Bucket>,
    pub(super) slots_total: usize,
    /// How many of the slots may be in use now (at most all of them); `None`: all, always
    /// (`adaptive_create_window = false`).
    pub(super) window: Mutex<Option<crate::pace::Window>>,
    pub(super) creating: Mutex<HashMap<String, u64>>,
    pub(super) backoff: Mutex<HashMap<String, Backoff>>,
    /// Completion times of recent successful creates, and their mean latency (EWMA, ms).
    pub(super) done: Mutex<VecDeque<Instant>>,
    pub(super) create_ms: AtomicU64,
    /// The same per template, and what each template's creates cost the node (its create rate).
    pub(super) per_template: Mutex<crate::template_rates::TemplateRates>,
    /// Creates started, ever (tests check the budget with it).
    pub started: AtomicU64,
    /// What the budget measures from the machine's processes (`budget::measure`), and when.
    pub(super) measured: Mutex<(crate::budget::Measured, Option<Instant>)>,
    /// Where the measure last found dockerd and containerd.
    pub(super) service_pids: Mutex<crate::budget::ServicePids>,
    /// The template whose waiters the last plan that ran out of budget served last: the next
    /// plan starts with it (round-robin between templates).
    pub(super) resume_at: Mutex<Option<String>>,
    /// Label values (templates, tenants) given to the pool gauges last time, so a value that
    /// disappears is set to 0 rather than left at its last reading.
    pub(super) reported: Mutex<HashSet<(&'static str, String)>>,
}

impl Pools {
    pub(crate) fn new(config: &Config) -> Pools {
        let pm = &config.pool_manager;
        let burst = pm.max_creates_in_flight as f64;
        Pools {
            slots: Arc::new(Semaphore::new(pm.max_creates_in_flight)),
            bucket: Mutex::new(Bucket { rate: pm.create_rate, burst, tokens: burst, at: Instant::now() }),
            slots_total: pm.max_creates_in_flight,
            window: Mutex::new(pm.adaptive_create_window.then(|| crate::pace::Window::new(pm.max_creates_in_flight))),
            creating: Mutex::new(HashMap::new()),
            backoff: Mutex::new(HashMap::new()),
            done: Mutex::new(VecDeque::new()),
            create_ms: AtomicU64::new(500),
            per_template: Mutex::default(),
            measured: Mutex::new((Default::default(), None)),
            service_pids: Mutex::new(Default::default()),
            resume_at: Mutex::new(None),
            started: AtomicU64::new(0),
            reported: Mutex::new(HashSet::new()),
        }
    }

    pub(super) fn creating(&self, template: &str) -> u64 {
        lock(&self.creating).get(template).copied().unwrap_or(0)
    }

    pub(super) fn backing_off(&self, template: &str, now: Instant) -> bool {
        lock(&self.backoff).get(template).and_then(|b| b.until).is_some_and(|u| now < u)
    }

    /// Creates holding a slot now.
    pub(crate) fn in_flight(&self) -> u64 {
        self.slots_total.saturating_sub(self.slots.available_permits()) as u64
    }

    /// The create window now (`None` inside: a fixed window of all the slots).
    pub(crate) fn window(&self) -> u64 {
        match lock(&self.window).as_ref() {
            Some(w) => w.limit(),
            None => self.slots_total as u64,
        }
    }

    pub(super) fn rate(&self, now: Instant) -> f64 {
        let mut done = lock(&self.done);
        while done.front().is_some_and(|t| now.duration_since(*t) > RATE_WINDOW) {
            done.pop_front();
        }
        done.len() as f64 / RATE_WINDOW.as_secs_f64()
    }
}

/// One tick's reading of a template's pool from the ledger.
pub(super) struct Observed {
    pub(super) template: Arc<Template>,
    pub(super) idle: u64,
    pub(super) waiting: u64,
    pub(super) target: u64,
}

impl Node {
    /// Keeps every pool at its target and feeds waiting requests, until cancelled.
    pub async fn pool_loop(self: Arc<Self>, cancel: CancellationToken) {
        let mut tick = 0u32;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(TICK) => {}
            }
            tick = tick.wrapping_add(1);
            if tick.is_multiple_of(PRIVATE_EVERY) {
                if let Err(e) = self.refresh_private_templates().await {
                    tracing::warn!(error = %e, "load private templates");
                }
                match self.prune_snapshots().await {
                    Ok(n) if n > 0 => tracing::info!(images = n, "removed snapshot images of deleted templates"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "prune snapshot images"),
                }
            }
            if let Err(e) = self.refresh_image_templates().await {
                tracing::warn!(error = %e, "load templates made from images");
            }
            let names = self.template_names();
            match self.observe(&names).await {
                Ok(observed) => {
                    let plan = self.plan(&observed, Instant::now());
                    self.start_creates(&observed, &plan);
                    self.retire(&plan).await;
                    if tick.is_multiple_of(STATS_EVERY) {
                        self.publish_stats(&observed).await;
                    }
                    if tick.is_multiple_of(EVICT_EVERY) {
                        self.evict_images(&observed).await;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "read pool state"),
            }
        }
    }

    async fn observe(&self, names: &[String]) -> Result<Vec<Observed>, ledger::LedgerError> {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let idle = self.ledger.idle_counts(&self.id, &refs).await?;
        let waiting = self.ledger.waiting_counts(&self.id, &refs).await?;
        let (at, targets) = self.ledger.targets(&self.id).await?;
        let fresh = at > 0 && self.ledger.now_ms().await?.saturating_sub(at) < TARGETS_FRESH_MS;
        Ok(names
            .iter()
            .zip(idle.into_iter().zip(waiting))
            .filter_map(|(name, (idle, waiting))| {
                let template = self.template(name)?;
                let target = match targets.get(name) {
                    Some(t) if fresh => *t,
                    _ => template.warm as u64,
                };
                Some(Observed { template, idle: idle as u64, waiting: waiting as u64, target })
            })
            .collect())
    }

    /// This tick's plan (see `plan::plan`): the observed pools plus creates in flight and
    /// back-off, against the token bucket (refilled to `now`), the free in-flight slots and the
    /// node's capacity.
    fn plan(&self, observed: &[Observed], now: Instant) -> Plan {
        let mut views: Vec<PoolView> = observed
            .iter()
            .map(|o| PoolView {
                template: o.template.name.clone(),
                idle: o.idle,
                creating: self.pools.creating(&o.template.name),
                waiting: o.waiting,
                target: o.target,
                // A template whose image is being pulled gets no create slot until it is here.
                backed_off: self.pools.backing_off(&o.template.name, now)
                    || (crate::images::is_pulled(&o.template.image)
                        && (o.waiting > 0 || o.target > o.idle)
                        && !self.images.ready_for_create(&o.template.image)),
            })
            .collect();
        let budget = Budget {
            tokens: lock(&self.pools.bucket).available(now),
            max_in_flight: self.pools.window(),
            in_flight: self.pools.in_flight(),
            // The least capacity of any resource (the config's cap among them).
            max_sandboxes: self.budget().capacity,
            sandboxes: self.sandbox_count() as u64,
        };
        // Round-robin between templates: `plan` serves them greedily in the order given, so a
        // tick starts where the last one that ran out of budget stopped. Otherwise, with more
        // templates waiting than creates to spend (a corpus of hundreds of templates), the
        // first ones in the order were served every tick and the last starved.
        let mut resume = lock(&self.pools.resume_at);
        plan::rotate(&mut views, resume.as_deref());
        let plan = plan::plan(&views, &budget);
        if let Some(last) = plan::resume_after(&plan) {
            *resume = Some(last.to_string());
        }
        drop(resume);
        if plan.total_creates() > 0 || plan.limited_by.is_some() {
            tracing::trace!(?plan, ?budget, "pool plan");
        }
        plan
    }

    /// The node's sandbox budget now (`budget::compute`: a few small reads of `/proc`).
    pub fn budget(&self) -> wire::NodeBudget {
        let pm = &self.config.pool_manager;
        let probe = crate::budget::Proc { thread_cap: pm.max_threads };
        let measured = lock(&self.pools.measured).0.clone();
        crate::budget::compute(&probe, self.sandbox_count() as u64, pm.max_sandboxes, &measured)
    }

    /// Measures what the budget reads from the machine's processes again if the last
    /// measure is a minute old (it reads every process: off the async threads, and rarely).
    pub async fn remeasure(&self) {
        const EVERY: Duration = Duration::from_secs(60);
        {
            let mut m = lock(&self.pools.measured);
            if m.1.is_some_and(|at| at.elapsed() < EVERY) {
                return;
            }
            m.1 = Some(Instant::now());
        }
        let (sample, sandboxes) = self.container_sample(crate::budget::THREAD_SAMPLE);
        let mut pids = lock(&self.pools.service_pids).clone();
        let measured = tokio::task::spawn_blocking(move || {
            let m = crate::budget::measure(&sample, sandboxes, &mut pids);
            (m, pids)
        })
        .await;
        if let Ok((mut fresh, pids)) = measured {
            *lock(&self.pools.service_pids) = pids;
            let mut m = lock(&self.pools.measured);
            // Too few sandboxes to measure threads by: keep the last figure.
            fresh.threads_per_sandbox = fresh.threads_per_sandbox.or(m.0.threads_per_sandbox);
            m.0 = fresh;
        }
    }

    /// Starts the planned creates, each holding an in-flight slot and spending a token.
    fn start_creates(self: &Arc<Self>, observed: &[Observed], plan: &Plan) {
        for create in &plan.creates {
            let Some(template) = observed.iter().find(|o| o.template.name == create.template).map(|o| &o.template)
            else {
                continue;
            };
            for _ in 0..create.count {
                // The plan counted the free slots, and only this loop takes them.
                let Ok(permit) = self.pools.slots.clone().try_acquire_owned() else {
                    tracing::warn!("create slots ran out mid-plan");
                    return;
                };
                lock(&self.pools.bucket).spend();
                *lock(&self.pools.creating).entry(template.name.clone()).or_insert(0) += 1;
                self.pools.started.fetch_add(1, Ordering::Relaxed);
                let node = self.clone();
                let template = template.clone();
                self.tracker.spawn(async move {
                    let started = Instant::now();
                    let outcome = node.create_one(&template).await;
                    drop(permit);
                    if let Some(n) = lock(&node.pools.creating).get_mut(&template.name) {
                        *n = n.saturating_sub(1);
                    }
                    node.record_outcome(&template.name, outcome, started.elapsed()).await;
                });
            }
        }
    }

    /// Creates one sandbox and hands it to a waiting request or its pool (a trace of its own).
    #[tracing::instrument(name = "pool.create", skip_all, fields(template = %template.name, sandbox))]
    async fn create_one(self: &Arc<Self>, template: &Arc<Template>) -> Result<(), String> {
        let sb = self.create_sandbox(template).await.map_err(|e| e.to_string())?;
        match self.ledger.sandbox_ready(&self.id, &sb.id, &sb.container).await {
            Ok(Ready::Granted | Ready::Idle) => Ok(()),
            Ok(Ready::Stale) => {
                // Doomed while it was being created (its record was removed): not a failure.
                self.destroy(&sb.id, GoneReason::Removed).await;
                Ok(())
            }
            Err(e) => {
                self.destroy(&sb.id, GoneReason::CreateFailed).await;
                Err(format!("publish ready sandbox: {e}"))
            }
        }
    }

    async fn record_outcome(&self, template: &str, outcome: Result<(), String>, took: Duration) {
        let now = Instant::now();
        let label = template_label(template).to_owned();
        match &outcome {
            Ok(()) => {
                metrics::histogram!(names::CREATE_DURATION, "node" => self.id.clone(), "template" => label.clone())
                    .record(took.as_secs_f64());
                metrics::counter!(names::CREATES, "node" => self.id.clone(), "template" => label, "outcome" => "ok")
                    .increment(1);
            }
            Err(cause) => {
                metrics::counter!(names::CREATES, "node" => self.id.clone(), "template" => label.clone(),
                    "outcome" => "failed")
                .increment(1);
                metrics::counter!(names::CREATE_FAILURES, "node" => self.id.clone(), "template" => label,
                    "cause" => failure_cause(cause))
                .increment(1);
            }
        }
        let mark = {
            let mut all = lock(&self.pools.backoff);
            let b = all.entry(template.to_string()).or_default();
            match &outcome {
                Ok(()) => {
                    let was_unhealthy = b.cause.is_some();
                    *b = Backoff::default();
                    was_unhealthy.then_some(None)
                }
                Err(cause) => b.failed(cause, now).map(|delay| Some((cause.clone(), delay))),
            }
        };
        // The window learns from every finished create (this one's slot is already free), and
        // halves when Docker itself errs or times out; a template's own failure (its image,
        // its runtime, its agent) says nothing about Docker's load.
        let in_flight = self.pools.in_flight() + 1;
        if let Some(window) = lock(&self.pools.window).as_mut() {
            match &outcome {
                Ok(()) => window.done(took, in_flight),
                Err(cause) if matches!(failure_cause(cause), "timeout" | "other") => window.failed(),
                Err(_) => {}
            }
        }
        if outcome.is_ok() {
            lock(&self.pools.done).push_back(now);
            let prev = self.pools.create_ms.load(Ordering::Relaxed) as f64;
            let ewma = 0.8 * prev + 0.2 * took.as_secs_f64() * 1000.0;
            self.pools.create_ms.store(ewma as u64, Ordering::Relaxed);
            lock(&self.pools.per_template).done(template, took, in_flight);
        }
        match mark {
            None => {}
            Some(None) => {
                tracing::info!(template, "template healthy again");
                if let Err(e) = self.ledger.set_healthy(&self.id, template).await {
                    tracing::warn!(template, error = %e, "clear template health");
                }
            }
            Some(Some((cause, delay))) => {
                tracing::warn!(template, %cause, backoff = ?delay, "sandbox create failed; backing off");
                // Tenants see that it fails, not Docker's words (those are in this log line);
                // a failed pull is the registry's answer about the tenant's own image: quoted.
                let image = self.template(template).map(|t| t.image.clone()).unwrap_or_default();
                let (public, code) = match cause.strip_prefix(crate::node::PULL_FAILED) {
                    Some(reason) => (
                        format!("image {image} could not be pulled on node {}: {reason}", self.id),
                        Some(wire::ErrorCode::ImagePullFailed),
                    ),
                    None => (format!("sandboxes of image {image} fail to start on node {}", self.id), None),
                };
                let backoff = delay.as_millis() as u64;
                match self.ledger.set_unhealthy(&self.id, template, &public, code, backoff).await {
                    Ok((_, told)) if told > 0 => tracing::info!(template, waiters = told, "told waiting requests"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(template, error = %e, "mark template unhealthy"),
                }
            }
        }
    }

    /// Evicts pulled images beyond the node's image disk budget, keeping every image that a
    /// sandbox, a pool with a target, idle sandboxes, waiters or creates, or a pending
    /// reservation needs.
    async fn evict_images(&self, observed: &[Observed]) {
        let evicted = async {
            let mut in_use: HashSet<String> = self.sandbox_images();
            in_use.extend(
                observed
                    .iter()
                    .filter(|o| {
                        o.target > 0 || o.waiting > 0 || o.idle > 0 || self.pools.creating(&o.template.name) > 0
                    })
                    .map(|o| o.template.image.clone()),
            );
            let reserved = self.ledger.reservations(self.ledger.now_ms().await?).await?;
            in_use.extend(reserved.iter().filter_map(|r| self.template(&r.template)).map(|t| t.image.clone()));
            self.images.evict(&in_use).await
        };
        if let Err(e) = evicted.await {
            tracing::warn!(error = %e, "evict images");
        }
    }

    /// Retires the planned idle sandboxes (beyond a lowered target, nobody waiting).
    async fn retire(&self, plan: &Plan) {
        for r in &plan.retires {
            match self.ledger.shrink(&self.id, &r.template, r.count as usize).await {
                Ok(n) if n > 0 => tracing::debug!(template = %r.template, n, "pool shrunk"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "shrink pool"),
            }
        }
    }
}

/// The `cause` label of a failed create, from its error: the image is missing (`image`), the
/// container runtime refused to start it (`runtime`), the agent did not come up (`agent`),
/// Docker did not answer in time (`timeout`), or anything else (`other`).
/// Every `cause` of `CREATE_FAILURES` (what `failure_cause` answers).
pub(crate) const FAILURE_CAUSES: [&str; 6] = ["pull", "image", "runtime", "agent", "timeout", "other"];

fn failure_cause(error: &str) -> &'static str {
    let e = error.to_ascii_lowercase();
    if e.starts_with(crate::node::PULL_FAILED) {
        "pull"
    } else if e.contains("agent not ready") || e.contains("agent") && e.contains("handshake") {
        "agent"
    } else if e.contains("did not answer within") || e.contains("timed out") || e.contains("deadline") {
        "timeout"
    } else if e.contains("no such image")
        || e.contains("pull access denied")
        || e.contains("image") && e.contains("not found")
    {
        "image"
    } else if e.contains("oci runtime") || e.contains("runtime") || e.contains("start container") {
        "runtime"
    } else {
        "other"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_of_the_template_is_told_at_once_a_failure_under_load_when_it_repeats() {
        let now = Instant::now();
        let mut b = Backoff::default();
        let told = b.failed("create container: Docker responded with status code 404: No such image: x:1", now);
        assert_eq!((told, b.cause.is_some()), (Some(BACKOFF_MIN), true));
        let mut b = Backoff::default();
        let slow = "agent not ready: Timeout";
        assert_eq!(b.failed(slow, now), None);
        assert_eq!(b.failed(slow, now), None);
        assert!(b.cause.is_none() && b.until > Some(now), "it backs off without telling");
        assert_eq!(b.failed(slow, now), Some(BACKOFF_MIN * 4));
        assert_eq!(b.cause.as_deref(), Some(slow));
    }

    #[test]
    fn create_failures_are_classified() {
        for (error, cause) in [
            ("create container: Docker responded with status code 404: No such image: nope:latest", "image"),
            (
                "start container: Docker responded with status code 500: failed to create task for container: OCI runtime create failed: runc",
                "runtime",
            ),
            (
                "start container: Docker responded with status code 500: unknown or invalid runtime name: runsc",
                "runtime",
            ),
            ("agent not ready: Timeout", "agent"),
            ("create container: docker did not answer within 60s", "timeout"),
            ("ledger: redis unavailable", "other"),
        ] {
            assert_eq!(failure_cause(error), cause, "{error}");
        }
    }

    #[test]
    fn the_bucket_refills_at_its_rate_up_to_its_burst() {
        let t0 = Instant::now();
        let mut b = Bucket { rate: 2.0, burst: 3.0, tokens: 3.0, at: t0 };
        assert_eq!(b.available(t0), 3);
        for _ in 0..3 {
            b.spend();
        }
        assert_eq!(b.available(t0), 0);
        // 2 a second: 1 token after half a second, 1 more after another half.
        assert_eq!(b.available(t0 + Duration::from_millis(500)), 1);
        assert_eq!(b.available(t0 + Duration::from_millis(1000)), 2);
        b.spend();
        assert_eq!(b.available(t0 + Duration::from_millis(1000)), 1);
        // Never more than the burst saved up.
        assert_eq!(b.available(t0 + Duration::from_secs(60)), 3);
        // Asking again at the same instant adds nothing.
        b.spend();
        assert_eq!(b.available(t0 + Duration::from_secs(60)), 2);
    }
}

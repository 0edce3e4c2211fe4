//! Making Docker and the ledger agree: `reconcile` after a (re)start, `rebuild` when the
//! ledger forgot sandboxes, and the orphan `sweep` fed by the container event stream.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use config::Template;
use futures::StreamExt as _;
use ledger::{GoneReason, SandboxState};
use telemetry::names;
use tokio_util::sync::CancellationToken;
use wire::ExecMode;

use super::{AGENT_READY_TIMEOUT, Leftover, Node, SweepCost};
use crate::agent_bin::SocketCheck;
use crate::sandbox::Sandbox;
use crate::sync::lock;

/// Sandboxes reattached at once by `reconcile` (an attach and a ping each: light for Docker).
const READOPTS_IN_FLIGHT: usize = 16;
/// How long after Docker's event stream is (re)opened the sweep trusts it: dockerd takes the
/// subscription within milliseconds on its local socket, but nothing tells us when, so the
/// listing that covers what came before waits this long.
const EVENTS_SETTLE: Duration = Duration::from_secs(5);
/// How often the sweep lists every container and reads every record all the same: the net
/// under the event stream and the record count (O(sandboxes), hence rarely).
const FULL_SWEEP_INTERVAL: Duration = Duration::from_secs(600);

impl Node {
    /// Brings Docker and the ledger into agreement after a (re)start: live idle and leased
    /// sandboxes are reattached (16 at once) before this returns; unknown containers and
    /// records without a live container are removed after, in the background (8 at once).
    /// Docker removes ~12 containers a second whatever the parallelism, so a restart right after
    /// a release of 200 sessions waited 16 s for their removal when it came first (BENCHMARKS.md).
    #[tracing::instrument(name = "pool.reconcile", skip_all)]
    pub async fn reconcile(self: &Arc<Self>) -> anyhow::Result<()> {
        let containers = self.engine.list().await?;
        let records = self.ledger.sandboxes(&self.id).await?;
        let by_sandbox: HashMap<&str, &crate::runtime::SandboxContainer> =
            containers.iter().map(|c| (c.sandbox.as_str(), c)).collect();
        let known: std::collections::HashSet<&str> = records.iter().map(|r| r.id.as_str()).collect();
        let unknown: Vec<String> =
            containers.iter().filter(|c| !known.contains(c.sandbox.as_str())).map(|c| c.id.clone()).collect();
        let by_sandbox = &by_sandbox;
        // Each record: `None` when reattached, else the sandbox to remove.
        let outcomes: Vec<Option<String>> = futures::stream::iter(records.iter().map(|r| async move {
            let container = by_sandbox.get(r.id.as_str()).filter(|c| c.running || c.paused);
            let template = self.template(&r.template);
            let keep = matches!(r.state, SandboxState::Idle | SandboxState::Leased);
            let (Some(container), Some(template), true) = (container, template, keep) else {
                return Some(r.id.clone());
            };
            match self.readopt(&r.id, r.fence, container, template).await {
                Ok(()) => None,
                Err(e) => {
                    tracing::warn!(sandbox = %r.id, error = %e, "reattach failed");
                    // Out of the map at once: the node must not serve it meanwhile.
                    self.take(&r.id);
                    Some(r.id.clone())
                }
            }
        }))
        .buffer_unordered(READOPTS_IN_FLIGHT)
        .collect()
        .await;
        let stale: Vec<String> = outcomes.into_iter().flatten().collect();
        let kept = records.len() - stale.len();
        // Socket directories of this node's sandboxes that are gone (a crash between a
        // container's removal and its directory's; stale ones go with their `destroy`).
        let mine = format!("{}.", self.id);
        for e in std::fs::read_dir(&self.agent_files.run).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&mine) && self.sandbox(&name).is_none() && !stale.contains(&name) {
                self.agent_files.remove_run_dir(&name);
            }
        }
        tracing::info!(kept, removing = stale.len() + unknown.len(), "reconciled sandboxes");
        enum Removal {
            Container(String),
            Sandbox(String),
        }
        let removals = unknown
            .into_iter()
            .map(Removal::Container)
            .chain(stale.into_iter().map(Removal::Sandbox))
            .map(|what| {
                let node = self.clone();
                async move {
                    match what {
                        Removal::Sandbox(id) => node.destroy(&id, GoneReason::SandboxFailed).await,
                        Removal::Container(c) => {
                            let left = Leftover {
                                sandbox: format!("(unknown, container {c})"),
                                container: Some(c),
                                forget: None,
                            };
                            node.finish_or_retry(left).await;
                        }
                    }
                }
            })
            .collect::<Vec<_>>();
        self.tracker.spawn(async move {
            futures::stream::iter(removals).buffer_unordered(config::MAX_DESTROYS_IN_FLIGHT).collect::<()>().await;
        });
        Ok(())
    }

    /// Takes a sandbox found after a restart back: reattaches its agent and checks that it
    /// answers. A paused one is thawed for that (Docker attaches to no frozen container, and
    /// a frozen agent cannot answer) and frozen again: it stays paused, and its next call
    /// resumes it.
    async fn readopt(
        self: &Arc<Self>,
        id: &str,
        fence: u64,
        container: &crate::runtime::SandboxContainer,
        template: Arc<Template>,
    ) -> anyhow::Result<()> {
        if container.paused {
            self.engine.set_paused(&container.id, false).await?;
        }
        let agent = match template.exec {
            ExecMode::Agent => {
                let direct = match self.engine.direct_channel(&template) {
                    true => {
                        let check = self.agent_files.check_socket(id);
                        // The agent serves its socket only: a sandbox whose socket was tampered
                        // with is not reached another way, it fails (and ends).
                        if let SocketCheck::Tampered(problem) = check {
                            anyhow::bail!("the agent's socket is not the one this node sealed: {problem}");
                        }
                        let direct =
                            crate::channel::Link::connect_socket(&self.agent_files.run_dir(id), Duration::ZERO).await;
                        if direct.is_some() && check == SocketCheck::Unsealed {
                            self.agent_files.seal_run_dir(id).context("seal the agent's socket directory")?;
                        }
                        direct
                    }
                    false => None,
                };
                let attached = match direct {
                    Some(d) => d,
                    None => self.engine.attach(&container.id).await?,
                };
                Some(self.watch(id, attached))
            }
            ExecMode::Docker => None,
        };
        self.join_egress(id, &container.id, &template, None).await?;
        let sb = Arc::new(Sandbox::new(
            id,
            template,
            container.id.clone(),
            agent.clone(),
            self.engine.clone(),
            fence,
            container.paused,
        ));
        self.insert(sb);
        if let Some(conn) = agent {
            conn.ping(AGENT_READY_TIMEOUT)
                .await
                .map_err(|e| anyhow::anyhow!("reattached agent does not answer: {e}"))?;
            metrics::counter!(names::AGENT_REATTACHES, "node" => self.id.clone()).increment(1);
        }
        if container.paused {
            self.engine.set_paused(&container.id, true).await?;
        }
        tracing::debug!(sandbox = %id, paused = container.paused, "reattached");
        Ok(())
    }

    /// Every sandbox the node runs that the ledger has no record of (Redis lost it): one no
    /// tenant call ever reached (no fence admitted, never paused) goes back to its pool; the
    /// others served sessions whose records are gone, so they are removed (their tenants get
    /// 404 for those ids, as for any id the ledger does not know). A sandbox always has its
    /// record before it joins the map and leaves the map before its record goes, so a sandbox
    /// in the map without a record is one the ledger forgot. Private templates come back from
    /// their images' labels (`prune_snapshots`), never deleted for lack of a record.
    ///
    /// Safe while the node works (`sweep` calls it): only a sandbox in the map both before and
    /// after the records are read counts, so one that joined or left the map meanwhile (its
    /// record written before, or removed after) is never taken for forgotten.
    pub async fn rebuild(self: &Arc<Self>) -> Result<(), ledger::LedgerError> {
        let before: HashSet<String> = lock(&self.sandboxes).keys().cloned().collect();
        let records: HashSet<String> = self.ledger.sandboxes(&self.id).await?.into_iter().map(|r| r.id).collect();
        let forgotten: Vec<Arc<Sandbox>> = lock(&self.sandboxes)
            .values()
            .filter(|sb| before.contains(&sb.id) && !records.contains(&sb.id))
            .cloned()
            .collect();
        if forgotten.is_empty() {
            return Ok(());
        }
        let (mut pooled, mut removed) = (0, 0);
        for sb in forgotten {
            let pristine = sb.max_fence.load(Ordering::Acquire) == 0 && !sb.paused.load(Ordering::Acquire);
            if pristine {
                self.ledger.sandbox_add(&self.id, &sb.id, &sb.template.name).await?;
                self.ledger.sandbox_ready(&self.id, &sb.id, &sb.container).await?;
                pooled += 1;
            } else {
                removed += 1;
                let node = self.clone();
                self.tracker.spawn(async move { node.destroy(&sb.id, GoneReason::Removed).await });
            }
        }
        metrics::counter!(names::LEDGER_REBUILDS, "node" => self.id.clone()).increment(1);
        tracing::warn!(
            pooled,
            removed,
            "rebuilt the node's part of the ledger from its sandboxes (the ledger had forgotten them)"
        );
        self.prune_snapshots()
            .await
            .map_err(|e| ledger::LedgerError::Corrupt(format!("restore private templates: {e:#}")))?;
        Ok(())
    }

    /// `reconcile` for a node that runs, every `ORPHAN_SWEEP_INTERVAL`. A container of this
    /// node that neither its map nor the ledger knows is removed: one whose create a killed
    /// pool-manager had sent, which Docker finished after its successor's `reconcile` had
    /// listed the containers and forgotten the half-made record. (A sandbox of this process
    /// has its record before its container exists, so none of its own creates is taken.) Then
    /// sandboxes the ledger forgot while it kept the node's lease (a Redis restart that lost
    /// its last second of writes) are rebuilt, as after a lapsed lease.
    ///
    /// Cost O(creates since the last sweep): the containers looked at are those Docker's event
    /// stream reported created (`container_events_loop`), and the records are read only when
    /// the ledger holds fewer than the map has sandboxes (every sandbox has its record before
    /// it joins the map and until after it leaves, so fewer means forgotten). Every container
    /// is listed when the stream is down or new, and everything is read every
    /// `FULL_SWEEP_INTERVAL`, the net under both.
    pub async fn sweep(self: &Arc<Self>) -> anyhow::Result<SweepCost> {
        let mut cost = SweepCost::default();
        let now = std::time::Instant::now();
        let (full, listing_for, created) = {
            let mut s = lock(&self.sightings);
            let full = s.full_at.is_none_or(|at| now.duration_since(at) >= FULL_SWEEP_INTERVAL);
            let settled = s.up.filter(|(_, at)| now.duration_since(*at) >= EVENTS_SETTLE).map(|(n, _)| n);
            let list = full || settled.is_none() || s.listed != settled;
            (full, list.then_some(settled), std::mem::take(&mut s.created))
        };
        let candidates: Vec<crate::runtime::SandboxContainer> = match listing_for {
            Some(settled) => {
                let containers = match self.engine.list().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Looked at next time, listed or not.
                        lock(&self.sightings).created.extend(created);
                        return Err(e);
                    }
                };
                cost.containers_listed = containers.len();
                let mut s = lock(&self.sightings);
                if settled.is_some() && s.up.map(|(n, _)| n) == settled {
                    s.listed = settled;
                }
                containers
            }
            None => created
                .into_iter()
                .map(|(id, sandbox)| crate::runtime::SandboxContainer { id, sandbox, running: false, paused: false })
                .collect(),
        };
        // Only those the map does not have, before and after the records are read: one that
        // joined or left it meanwhile has (or had) its record and is never taken for unknown.
        let candidates: Vec<_> = candidates.into_iter().filter(|c| self.sandbox(&c.sandbox).is_none()).collect();
        if listing_for.is_none() {
            cost.containers_checked = candidates.len();
        }
        if !candidates.is_empty() {
            let ids: Vec<&str> = candidates.iter().map(|c| c.sandbox.as_str()).collect();
            let recorded = self.ledger.sandboxes_recorded(&self.id, &ids).await?;
            // Unfinished destroys are the reaper's to retry, not unknown.
            let leftover: HashSet<String> = lock(&self.leftovers).iter().filter_map(|l| l.container.clone()).collect();
            let unknown: Vec<_> = candidates
                .into_iter()
                .zip(recorded)
                .filter(|(c, recorded)| !recorded && self.sandbox(&c.sandbox).is_none() && !leftover.contains(&c.id))
                .map(|(c, _)| c)
                .collect();
            for c in unknown {
                tracing::warn!(sandbox = %c.sandbox, container = %c.id, "removing a container neither the node nor the ledger knows");
                metrics::counter!(names::DESTROYS, "node" => self.id.clone(), "reason" => "orphan").increment(1);
                let left = Leftover { sandbox: c.sandbox, container: Some(c.id), forget: None };
                self.finish_or_retry(left).await;
            }
        }
        // Fewer records than sandboxes in the map (counted before and after) means forgotten
        // ones; a sandbox that left the map and its record meanwhile can only make it look so
        // (a full rebuild that finds nothing), never hide it.
        let in_map = self.sandbox_count();
        let records = self.ledger.sandbox_record_count(&self.id).await?;
        let in_map = in_map.min(self.sandbox_count()) as u64;
        if full || records < in_map {
            cost.records_read = records as usize;
            self.rebuild().await?;
        }
        if full {
            lock(&self.sightings).full_at = Some(now);
        }
        Ok(cost)
    }

    /// Follows Docker's reports of this node's container creates and removals, for the sweep
    /// (`Sightings`); reconnects after a second when the stream ends (a dockerd restart), and
    /// the sweep lists every container until the new stream has settled.
    pub async fn container_events_loop(self: Arc<Self>, cancel: CancellationToken) {
        let mut connection = 0u64;
        while !cancel.is_cancelled() {
            connection += 1;
            lock(&self.sightings).up = Some((connection, std::time::Instant::now()));
            let mut events = std::pin::pin!(self.engine.events());
            loop {
                let next = tokio::select! {
                    _ = cancel.cancelled() => return,
                    e = events.next() => e,
                };
                match next {
                    Some(Ok(crate::runtime::ContainerEvent::Created { id, sandbox })) => {
                        lock(&self.sightings).created.insert(id, sandbox);
                    }
                    Some(Ok(crate::runtime::ContainerEvent::Destroyed { id })) => {
                        lock(&self.sightings).created.remove(&id);
                    }
                    Some(Err(e)) => {
                        tracing::debug!(error = format!("{e:#}"), "docker's event stream failed");
                        break;
                    }
                    None => break,
                }
            }
            lock(&self.sightings).up = None;
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }
}

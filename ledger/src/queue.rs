//! Waiting for a sandbox: checkout-or-queue, the waiter's mailbox, leaving the queue at the
//! deadline, wake-up channels, and a template's health (which fails its waiters at once).
//!
//! Two things a vanished waiter (its gateway died, its client hung up) could leave behind are
//! put right by the node's reap tick: a grant it never collects (unclaimed past
//! `script::CLAIM_WINDOW`, the sandbox goes back to its pool: `reap_expired`) and a waiting count
//! that still counts it (`recount_waiters`).

use redis::AsyncCommands;
use serde::Deserialize;

use crate::script::{labels_json, refs};
use crate::{Grant, LeaseSpec, Ledger, Result};

/// How a request may wait when no sandbox is idle.
#[derive(Debug, Clone, Copy)]
pub struct QueueSpec<'a> {
    /// Unique id of the waiting request.
    pub request_id: &'a str,
    /// Where its gateway listens for the wake-up (`Ledger::wake_channel`).
    pub channel: &'a str,
    /// Queue no further than this many waiters per template and node (0: the queue is always
    /// full: `Checkout::Full`).
    pub max_len: usize,
    /// How long the waiter's record may outlive a crashed gateway.
    pub waiter_ttl_ms: u64,
}

/// Outcome of `checkout_or_queue`: a request that may queue is granted, queued or told why
/// not; it is never merely "empty" (that is `checkout`'s answer, which never queues).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Checkout {
    /// A warm sandbox was leased at once.
    Granted(Grant),
    /// Waiting for the next ready sandbox; `depth` requests wait for this template.
    Queued {
        /// How many requests wait for the template, this one included.
        depth: u64,
    },
    /// The queue is at its maximum length.
    Full {
        /// How many requests already wait for the template (its queue is at the limit).
        depth: u64,
    },
    /// The template's sandboxes fail to start; no request is queued until `until_ms`.
    Unhealthy {
        /// Why its sandboxes fail to start (the node's words).
        cause: String,
        /// When queueing for it resumes (ms, Redis clock).
        until_ms: u64,
        /// The error code the node asked for (`image_pull_failed`); none: `unavailable`.
        #[serde(default)]
        code: Option<wire::ErrorCode>,
    },
    /// The node is down (its lease expired): nothing is placed on it.
    Down,
    /// The node has no room for more sandboxes than already wait for this template (it says
    /// so itself, `room`): try another node.
    Refused {
        /// Sandboxes the node said it can still add.
        room: u64,
        /// Requests already waiting for the template on the node.
        depth: u64,
    },
}

/// What a queued request finds in its mailbox.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Mail {
    /// A sandbox became ready and was leased to the waiting request.
    Granted(Grant),
    /// The template failed to start sandboxes; retry after `until_ms`.
    Failed {
        /// Why the template's sandboxes fail to start (the node's words).
        cause: String,
        /// When to retry (ms, Redis clock).
        until_ms: u64,
        /// The error code the node asked for (`image_pull_failed`); none: `unavailable`.
        #[serde(default)]
        code: Option<wire::ErrorCode>,
    },
}

#[derive(Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
enum Dequeued {
    Removed,
    Mail {
        mail: Mail,
    },
    Missing,
    /// Withdrawn: a grant that raced it was undone.
    Undone,
}

#[derive(Deserialize)]
struct Taken {
    #[serde(default)]
    mail: Option<Mail>,
}

#[derive(Deserialize)]
struct Recounted {
    dropped: usize,
}

#[derive(Deserialize)]
struct HealthSet {
    until_ms: u64,
    told: usize,
}

impl Ledger {
    /// Leases an idle sandbox, or queues the request for the next one that becomes ready
    /// (FIFO per tenant, round-robin between tenants). A queued request is woken by a
    /// `PUBLISH` of its id on `queue.channel`, then collects its grant with `take_mail`.
    pub async fn checkout_or_queue(&self, node: &str, spec: &LeaseSpec, queue: &QueueSpec<'_>) -> Result<Checkout> {
        self.grant(node, spec, Some(queue)).await
    }

    /// Leases an idle sandbox of `spec.template` on `node`. `Ok(None)`: the pool is empty or
    /// the node is down; nothing is queued.
    pub async fn checkout(&self, node: &str, spec: &LeaseSpec) -> Result<Option<Grant>> {
        /// What the grant script answers a request that may not queue.
        #[derive(Deserialize)]
        #[serde(tag = "outcome", rename_all = "snake_case")]
        enum Warm {
            Granted(Grant),
            Empty,
            Down,
        }
        Ok(match self.grant(node, spec, None).await? {
            Warm::Granted(g) => Some(g),
            Warm::Empty | Warm::Down => None,
        })
    }

    /// The grant script, with a queue to join (`checkout_or_queue`) or none (`checkout`: the
    /// script answers `empty` where it would have queued).
    async fn grant<T: serde::de::DeserializeOwned>(
        &self,
        node: &str,
        spec: &LeaseSpec,
        queue: Option<&QueueSpec<'_>>,
    ) -> Result<T> {
        let (request_id, channel, max_len, waiter_ttl_ms) = match queue {
            Some(q) => (q.request_id, q.channel, q.max_len.to_string(), q.waiter_ttl_ms),
            None => ("", "", "-1".to_string(), 0),
        };
        let k = self.keys.node(node);
        let t = &spec.template;
        let keys = [
            k.sbs(),
            k.idle(t),
            k.fence(),
            k.ses(&spec.session_id),
            k.expiry(),
            k.tses(&spec.tenant),
            k.health(t),
            k.wcount(t),
            k.wring(t),
            k.wq(t, &spec.tenant),
            k.waiter(request_id),
            k.active(),
            k.lease(),
            k.room(),
        ];
        let args = [
            spec.session_id.as_str(),
            &spec.tenant,
            t,
            &spec.ttl_ms.to_string(),
            &spec.idle_ms.to_string(),
            &labels_json(&spec.labels)?,
            spec.session_key.as_deref().unwrap_or(""),
            node,
            request_id,
            channel,
            &max_len,
            &waiter_ttl_ms.to_string(),
        ];
        self.run("grant", &self.scripts.grant, &refs(&keys), &args).await
    }

    /// Collects a queued request's outcome, if it has one. A grant collected is claimed: from
    /// here on it is the caller's (the reaper gives back only grants left uncollected for
    /// `script::CLAIM_WINDOW`).
    pub async fn take_mail(&self, node: &str, request_id: &str) -> Result<Option<Mail>> {
        let k = self.keys.node(node);
        let keys = [k.sbs(), k.mail(request_id), k.unclaimed()];
        let t: Taken = self.run("take_mail", &self.scripts.take_mail, &refs(&keys), &[request_id]).await?;
        Ok(t.mail)
    }

    /// Takes a queued request out of the queue (its deadline passed). If a sandbox was
    /// granted to it meanwhile, that grant is returned instead (collected, like `take_mail`: the
    /// caller uses it or undoes it with `ungrant`).
    pub async fn dequeue(&self, node: &str, request_id: &str, template: &str, tenant: &str) -> Result<Option<Mail>> {
        Ok(match self.leave(node, request_id, template, tenant, "").await? {
            Dequeued::Mail { mail } => Some(mail),
            Dequeued::Removed | Dequeued::Missing | Dequeued::Undone => None,
        })
    }

    /// Takes a queued request that is gone (its client hung up) out of the queue; a sandbox
    /// granted to it meanwhile goes back at once (to the next waiter or its pool, as
    /// `ungrant`). The caller settles the request's quota lease.
    pub async fn withdraw(&self, node: &str, request_id: &str, template: &str, tenant: &str) -> Result<()> {
        self.leave(node, request_id, template, tenant, "withdraw").await.map(drop)
    }

    async fn leave(&self, node: &str, request_id: &str, template: &str, tenant: &str, mode: &str) -> Result<Dequeued> {
        let k = self.keys.node(node);
        let keys = [
            k.sbs(),
            k.waiter(request_id),
            k.wq(template, tenant),
            k.wring(template),
            k.wcount(template),
            k.mail(request_id),
            k.unclaimed(),
        ];
        self.run("dequeue", &self.scripts.dequeue, &refs(&keys), &[request_id, template, tenant, mode]).await
    }

    /// Marks a template unable to start sandboxes on `node` for `backoff_ms` from now (Redis
    /// clock) and tells every request waiting for it, in one script; `code` is the error code
    /// they answer with (`None`: `unavailable`). Returns until when, and how many waiters were told.
    pub async fn set_unhealthy(
        &self,
        node: &str,
        template: &str,
        cause: &str,
        code: Option<wire::ErrorCode>,
        backoff_ms: u64,
    ) -> Result<(u64, usize)> {
        let k = self.keys.node(node);
        let keys = [k.sbs(), k.health(template), k.wring(template), k.wcount(template)];
        let code = code.map_or("", |c| c.as_str());
        let args = [template, cause, &backoff_ms.to_string(), code];
        let h: HealthSet = self.run("set_health", &self.scripts.set_health, &refs(&keys), &args).await?;
        Ok((h.until_ms, h.told))
    }

    /// The template starts sandboxes again.
    pub async fn set_healthy(&self, node: &str, template: &str) -> Result<()> {
        let _: () = self.conn().del(self.keys.node(node).health(template)).await?;
        Ok(())
    }

    /// Recounts the queues of `templates` on `node` from their lists: requests whose waiter
    /// record is gone are dropped, and each template's waiting count becomes the number that
    /// really wait. The node's reaper runs it every tick, so a count left high by waiters that
    /// vanished (their records expire with a gateway that died) lasts one tick at most.
    /// Returns how many entries were dropped. O(waiting requests).
    pub async fn recount_waiters(&self, node: &str, templates: &[&str]) -> Result<usize> {
        let k = self.keys.node(node);
        let mut keys = vec![k.sbs()];
        for t in templates {
            keys.push(k.wring(t));
            keys.push(k.wcount(t));
        }
        let r: Recounted = self.run("recount", &self.scripts.recount, &refs(&keys), templates).await?;
        Ok(r.dropped)
    }

    /// Requests waiting for each of the given templates on `node`, in order.
    pub async fn waiting_counts(&self, node: &str, templates: &[&str]) -> Result<Vec<usize>> {
        let k = self.keys.node(node);
        let keys: Vec<String> = templates.iter().map(|t| k.wcount(t)).collect();
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let v: Vec<Option<i64>> = redis::cmd("MGET").arg(&keys).query_async(&mut self.conn()).await?;
        Ok(v.into_iter().map(|n| n.unwrap_or(0).max(0) as usize).collect())
    }

    /// The channel a gateway listens on for wake-ups of its queued requests.
    pub fn wake_channel(&self, gateway_id: &str) -> String {
        self.keys.wake(gateway_id)
    }

    /// A pub/sub connection subscribed to `channel` (on a cluster, through the first seed that
    /// answers: a `PUBLISH` reaches every node).
    pub async fn subscribe(&self, channel: &str) -> Result<redis::aio::PubSub> {
        crate::conn::subscribe(&self.topology, channel).await
    }
}

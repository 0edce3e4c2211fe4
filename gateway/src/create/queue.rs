//! A create's wait in a node's queue: queued on the first node of its placement order that
//! admits it, woken by its mail, or taking a sandbox that became idle elsewhere first; bounded
//! by the request's wait.

use std::time::{Duration, Instant};

use http_util::ApiError;
use ledger::{Checkout, LeaseSpec, Mail, QueueSpec};
use wire::{CreateSession, ErrorCode, Start};

use super::{Attempt, record_wait, rejected, undo_grant, unhealthy};
use crate::errors;
use crate::lease::{Granted, Queued};
use crate::placement;
use crate::{AppState, Caller};

/// Waits (bounded by the request's wait) in the queue of the first node of `order` that
/// admits the request, until it is granted a sandbox there or elsewhere; a node that goes
/// down moves it to the live nodes.
pub(super) async fn wait_in_queue(
    s: &AppState,
    caller: &Caller,
    at: &Attempt<'_>,
    mut order: Vec<String>,
    mut queued: Queued<'_>,
) -> Result<Granted, ApiError> {
    let (req, wait) = (at.req, at.wait);
    let spec_for = |node: &str| at.spec(&caller.tenant, node);
    let mut reg = s.waiters.register();
    let queued_at = Instant::now();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let (node, depth) = match enqueue(s, req, &order, &spec_for, &reg.id, wait).await {
            Ok(Enqueued::Granted(spec, grant)) => return Ok(queued.granted(spec, grant, Start::Warm).await),
            Ok(Enqueued::Queued { node, depth }) => (node, depth),
            Err(e) => return Err(queued.refuse(e).await),
        };
        queued.at(&node, &reg.id, &req.template);
        let mail = match wait_for_mail(s, req, &node, &spec_for, &mut reg, deadline).await {
            Ok(Waited::Mail(mail)) => Some(mail),
            Ok(Waited::Elsewhere(spec, grant)) => {
                record_wait(&req.template, queued_at);
                return Ok(queued.granted(spec, grant, Start::Cold).await);
            }
            // The node went down: the request moves to the live nodes (its place there is
            // given up first; a grant that raced that is still ours).
            Ok(Waited::NodeDown) => match s.ledger.dequeue(&node, &reg.id, &req.template, &caller.tenant).await {
                Ok(Some(mail)) => Some(mail),
                Ok(None) => {
                    order = match s.nodes.ids().await {
                        Ok(order) => order,
                        Err(e) => return Err(queued.refuse(e).await),
                    };
                    if order.is_empty() {
                        None
                    } else {
                        tracing::info!(node = %node, template = %req.template, "a queued request leaves a node that went down");
                        reg = s.waiters.register();
                        continue;
                    }
                }
                Err(e) => return Err(queued.refuse(errors::ledger(e)).await),
            },
            Ok(Waited::Deadline) => None,
            Err(e) => return Err(queued.refuse(e).await),
        };
        record_wait(&req.template, queued_at);
        let mail = match mail {
            Some(mail) => Some(mail),
            // Deadline: give up our place; a sandbox granted meanwhile is still ours.
            None => match s.ledger.dequeue(&node, &reg.id, &req.template, &caller.tenant).await {
                Ok(mail) => mail,
                Err(e) => return Err(queued.refuse(errors::ledger(e)).await),
            },
        };
        return match mail {
            Some(Mail::Granted(grant)) => Ok(queued.granted(spec_for(&node), grant, Start::Cold).await),
            Some(Mail::Failed { cause, until_ms, code }) => {
                rejected(&req.template, "unhealthy");
                let e = unhealthy(s, &req.template, &cause, until_ms, code).await;
                Err(queued.refuse(e).await)
            }
            None => {
                rejected(&req.template, "deadline");
                let e = ApiError::unavailable(
                    format!(
                        "no sandbox of template {:?} became free within {:.1}s ({depth} were waiting); retry",
                        req.template,
                        wait.as_secs_f64()
                    ),
                    2,
                );
                Err(queued.refuse(e).await)
            }
        };
    }
}

/// What queueing a request found.
enum Enqueued {
    /// A sandbox was idle after all.
    Granted(LeaseSpec, ledger::Grant),
    Queued {
        node: String,
        depth: u64,
    },
}

/// Queues the request on the first node of `order` that admits it: a node that is down, or
/// says it has no room (node-side admission), or whose queue is full, sends it to the next.
/// With none left: 503 `unavailable` (every node down), 429 (a queue full) or 503 `node_full`
/// (no room anywhere), now rather than at the deadline.
async fn enqueue(
    s: &AppState,
    req: &CreateSession,
    order: &[String],
    spec_for: &(dyn Fn(&str) -> LeaseSpec + Sync),
    request_id: &str,
    wait: Duration,
) -> Result<Enqueued, ApiError> {
    let queue = QueueSpec {
        request_id,
        channel: &s.waiters.channel,
        max_len: s.config.gateway.max_queue,
        waiter_ttl_ms: (wait + Duration::from_secs(60)).as_millis() as u64,
    };
    let (mut full_depth, mut down) = (None, 0);
    for node in order {
        let spec = spec_for(node);
        match s.ledger.checkout_or_queue(node, &spec, &queue).await.map_err(errors::ledger)? {
            Checkout::Granted(grant) => return Ok(Enqueued::Granted(spec, grant)),
            Checkout::Queued { depth } => return Ok(Enqueued::Queued { node: node.clone(), depth }),
            Checkout::Full { depth } => full_depth = Some(depth),
            Checkout::Down => down += 1,
            Checkout::Refused { .. } => {}
            Checkout::Unhealthy { cause, until_ms, code } => {
                rejected(&req.template, "unhealthy");
                return Err(unhealthy(s, &req.template, &cause, until_ms, code).await);
            }
        }
    }
    if down == order.len() {
        // Every node it could go to stopped heartbeating since this gateway last looked.
        rejected(&req.template, "no_node");
        return Err(ApiError::unavailable("no live node: every node's heartbeat has lapsed; retry", 2));
    }
    if let Some(depth) = full_depth {
        rejected(&req.template, "queue_full");
        return Err(ApiError::too_many_requests(
            format!("{depth} requests already wait for template {:?}; retry later", req.template),
            2,
        ));
    }
    rejected(&req.template, "node_full");
    Err(ApiError {
        retry_after_s: Some(NODE_FULL_RETRY_S),
        ..ApiError::new(
            ErrorCode::NodeFull,
            format!(
                "every node is at its sandbox budget; no sandbox of template {:?} can be created now",
                req.template
            ),
        )
    })
}

/// `Retry-After` of a create refused because every node is full: sandboxes end and are
/// destroyed in seconds.
const NODE_FULL_RETRY_S: u64 = 5;

/// How a wait in a node's queue ended.
enum Waited {
    Mail(Mail),
    /// A sandbox became idle on another node first, and this request took it.
    Elsewhere(LeaseSpec, ledger::Grant),
    /// The queue's node went down.
    NodeDown,
    Deadline,
}

/// Waits for this request's wake-up (polling its mailbox too, in case a wake-up was lost),
/// until `deadline`. Each poll also looks at the other live nodes: one that reports an idle
/// sandbox of the template is tried (the request leaves its queue when it gets one: a grant
/// that raced that is undone), and a queue node that went down ends the wait.
async fn wait_for_mail(
    s: &AppState,
    req: &CreateSession,
    node: &str,
    spec_for: &(dyn Fn(&str) -> LeaseSpec + Sync),
    reg: &mut crate::waiters::Registration<'_>,
    deadline: tokio::time::Instant,
) -> Result<Waited, ApiError> {
    let mut woken = false;
    loop {
        tokio::select! {
            _ = &mut reg.woken, if !woken => woken = true,
            _ = tokio::time::sleep(crate::waiters::MAILBOX_POLL) => {}
            _ = tokio::time::sleep_until(deadline) => return Ok(Waited::Deadline),
        }
        if let Some(mail) = s.ledger.take_mail(node, &reg.id).await.map_err(errors::ledger)? {
            return Ok(Waited::Mail(mail));
        }
        let views = s.nodes.views().await?;
        if !views.iter().any(|v| v.id == node) {
            return Ok(Waited::NodeDown);
        }
        let elsewhere = views
            .iter()
            .filter(|v| v.id != node && placement::idle_of(&views, &v.id, &req.template).is_some_and(|n| n > 0));
        for other in elsewhere {
            let spec = spec_for(&other.id);
            let grant = match s.ledger.checkout(&other.id, &spec).await {
                Ok(Some(grant)) => grant,
                Ok(None) => continue,
                Err(e) => {
                    undo_grant(s, &spec.session_id, &spec.tenant).await;
                    return Err(errors::ledger(e));
                }
            };
            let tenant = &spec.tenant;
            if let Some(Mail::Granted(_)) =
                s.ledger.dequeue(node, &reg.id, &req.template, tenant).await.map_err(errors::ledger)?
            {
                // Two sandboxes for one request: the queue's goes back (nobody has seen it).
                undo_grant(s, &spec_for(node).session_id, tenant).await;
            }
            return Ok(Waited::Elsewhere(spec, grant));
        }
    }
}

//! A create's checkout in named steps: where it may go (`placement_order`), a warm sandbox
//! from its node choices with the quota admission raced against the first (`warm`), else a
//! wait in a node's queue (`super::queue`).

use std::collections::HashSet;

use http_util::ApiError;
use wire::Start;

use super::queue::wait_in_queue;
use super::{Attempt, rejected, undo_grant};
use crate::errors;
use crate::lease::{Admitted, Granted};
use crate::nodes::NodeView;
use crate::placement;
use crate::{AppState, Caller};

/// A warm sandbox from one of the request's node choices (or a node that reported idle ones);
/// else the request waits (bounded) in the queue of the first choice that admits it, while
/// still taking a sandbox that becomes idle on any other node: the queue is per template
/// across nodes.
pub(super) async fn checkout<'a>(s: &'a AppState, caller: &'a Caller, at: &Attempt<'a>) -> Result<Granted, ApiError> {
    let (views, order) = placement_order(s, at).await?;
    let admitted = match warm(s, caller, at, &views, &order).await? {
        Warm::Granted(granted) => return Ok(granted),
        Warm::Missed(admitted) => admitted,
    };
    let queued = admitted.enter_queue().await.inspect_err(|_| rejected(&at.req.template, "quota"))?;
    wait_in_queue(s, caller, at, order, queued).await
}

/// The nodes the request may go to (its private template's, or every live one) and its
/// placement order over them, best first.
async fn placement_order(s: &AppState, at: &Attempt<'_>) -> Result<(Vec<NodeView>, Vec<String>), ApiError> {
    let views = match at.pinned {
        Some(node) => vec![NodeView { id: node.to_string(), stats: None }],
        None => s.nodes.views().await?,
    };
    if views.is_empty() {
        rejected(&at.req.template, "no_node");
        return Err(ApiError::unavailable("no live node has registered", 2));
    }
    s.waiters.arrived(&at.req.template);
    let holders = holders(s, &views, at.image).await?;
    let order = placement::order(&views, &at.req.template, &holders, s.config.gateway.placement_choices);
    Ok((views, order))
}

/// What the warm step found.
enum Warm<'a> {
    Granted(Granted),
    /// No idle sandbox on the choices tried: the request, admitted, goes on to queue.
    Missed(Admitted<'a>),
}

/// Admits the request and tries its warm choices, best first. Without quotas the first
/// choice is left to the queueing script (which grants an idle sandbox first); with quotas on
/// it is tried warm too, so only a request that will really wait takes a slot of its
/// principal's `queued` quota.
async fn warm<'a>(
    s: &'a AppState,
    caller: &'a Caller,
    at: &Attempt<'a>,
    views: &[NodeView],
    order: &[String],
) -> Result<Warm<'a>, ApiError> {
    let quotas_on = s.config.quotas.enabled;
    let wait_ms = at.wait.as_millis() as u64;
    let k = s.config.gateway.placement_choices;
    let candidates = placement::warm_candidates(order, views, &at.req.template, k);
    let mut nodes = candidates.iter().filter(|n| quotas_on || **n != order[0]);
    let admit = || Admitted::admit(s, caller, at.lease, at.cost.clone(), wait_ms);
    let (admitted, mut tried) = match nodes.next() {
        // The admission and the first checkout go out together: one round trip for both. A
        // refused admission undoes the grant it raced (nobody has seen it).
        Some(node) => {
            let spec = at.spec(&caller.tenant, node);
            let (admitted, grant) = tokio::join!(admit(), s.ledger.checkout(node, &spec));
            match admitted {
                Ok(admitted) => (admitted, Some((spec, grant))),
                Err(e) => {
                    // A grant, or a checkout whose answer was lost (it may have granted).
                    if !matches!(grant, Ok(None)) {
                        undo_grant(s, &spec.session_id, &caller.tenant).await;
                    }
                    rejected(&at.req.template, "quota");
                    return Err(e);
                }
            }
        }
        // No node to try warm first (quotas off, or a single node): admit alone.
        None => (admit().await.inspect_err(|_| rejected(&at.req.template, "quota"))?, None),
    };
    while let Some((spec, grant)) = tried {
        match grant {
            Ok(Some(grant)) => return Ok(Warm::Granted(admitted.granted(spec, grant, Start::Warm))),
            Ok(None) => {}
            Err(e) => {
                undo_grant(s, &spec.session_id, &caller.tenant).await;
                return Err(admitted.refuse(errors::ledger(e)).await);
            }
        }
        tried = match nodes.next() {
            Some(node) => {
                let spec = at.spec(&caller.tenant, node);
                let grant = s.ledger.checkout(node, &spec).await;
                Some((spec, grant))
            }
            None => None,
        };
    }
    Ok(Warm::Missed(admitted))
}

/// The nodes placement should prefer for `image`: those that hold it, when it is an image
/// nodes pull (a cold create with the image present is a fraction of one with a pull); held by
/// none, the image's rendezvous node, where a prefetch or the autoscaler would put it, so one
/// node pulls it.
async fn holders(s: &AppState, views: &[NodeView], image: &str) -> Result<HashSet<String>, ApiError> {
    if views.len() < 2 || wire::images::digest_of(image).is_none() {
        return Ok(HashSet::new());
    }
    let ids: Vec<String> = views.iter().map(|v| v.id.clone()).collect();
    let holding = s.ledger.holding(&ids, image).await.map_err(errors::ledger)?;
    let mut set: HashSet<String> = ids.iter().zip(holding).filter(|(_, h)| *h).map(|(n, _)| n.clone()).collect();
    if set.is_empty()
        && let Some(home) = wire::images::rendezvous(&ids, image)
    {
        set.insert(home.to_string());
    }
    Ok(set)
}

//! A create's quota lease as a state machine: `Admitted` (the quota admission took the lease)
//! -> `Queued` (it also holds a slot of its principal's `queued` quota, and waits in a node's
//! queue) -> `Granted` (a sandbox is the request's; its session holds the lease from here).
//! Each transition consumes the state before it, so a request cannot be granted twice or
//! leave a queue it never entered; the quota queue slot is left by the transitions out of
//! `Queued` and nowhere else.
//!
//! A state dropped before it is granted or refused (the client went away, so axum dropped
//! the create; or an error returned early) gives back what it holds in the background: it
//! withdraws from its node's queue (a sandbox granted to it meanwhile goes back at once, as
//! nobody will see it) and, with quotas on, settles the lease (given back unless a session
//! holds it). `refuse` does the same before the caller is answered, so the caller's usage
//! is already down when it reads the refusal.

use http_util::ApiError;
use ledger::{Cost, Grant, LeaseSpec};
use wire::Start;

use crate::quotas;
use crate::{AppState, Caller};

/// What every state holds: the request's lease and, while queued, its place in a node's
/// queue. Dropped while armed, it gives them back in the background.
struct Hold<'a> {
    s: &'a AppState,
    caller: &'a Caller,
    lease: &'a str,
    /// (node, request id, template) while the request waits in a node's queue.
    place: Option<(String, String, String)>,
    armed: bool,
}

impl Hold<'_> {
    /// The request has finished with the lease (a session holds it, or it was given back).
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        let settle = self.s.config.quotas.enabled;
        if !self.armed || (self.place.is_none() && !settle) {
            return;
        }
        let (ledger, tenant, lease, place) =
            (self.s.ledger.clone(), self.caller.tenant.clone(), self.lease.to_string(), self.place.take());
        self.s.work.spawn_from_drop(async move {
            if let Some((node, request, template)) = place
                && let Err(e) = ledger.withdraw(&node, &request, &template, &tenant).await
            {
                tracing::warn!(error = %e, "leave the queue for a dropped request");
            }
            if settle && let Err(e) = ledger.quota_settle(wire::quotas::top(&tenant), &lease).await {
                tracing::warn!(error = %e, "settle the lease of a dropped request (the sweep will)");
            }
        });
    }
}

/// A create admitted against its caller's quotas: it holds the lease `lease` (with quotas
/// off, nothing; the states still order the create's steps).
pub(crate) struct Admitted<'a>(Hold<'a>);

impl<'a> Admitted<'a> {
    /// Admits the request: takes `lease` at `cost`, or answers the refusal (429
    /// `quota_exceeded`, 403 for an isolation class). `wait_ms`: how long the request may
    /// take before its session exists. A drop during the admission itself settles the lease.
    pub(crate) async fn admit(
        s: &'a AppState,
        caller: &'a Caller,
        lease: &'a str,
        cost: Cost,
        wait_ms: u64,
    ) -> Result<Admitted<'a>, ApiError> {
        let mut hold = Hold { s, caller, lease, place: None, armed: true };
        match quotas::admit(s, caller, lease, cost, true, wait_ms, 0).await {
            Ok(()) => Ok(Admitted(hold)),
            Err(e) => {
                // Refused: there is no lease to give back.
                hold.disarm();
                Err(e)
            }
        }
    }

    /// A sandbox was idle: the session it opened holds the lease.
    pub(crate) fn granted(mut self, spec: LeaseSpec, grant: Grant, start: Start) -> Granted {
        self.0.disarm();
        Granted { spec, grant, start }
    }

    /// The request will wait: it takes a slot of its principal's `queued` quota at every
    /// level (one tenant's flood fills its own share, not the queue everyone shares), or is
    /// refused (its lease given back).
    pub(crate) async fn enter_queue(self) -> Result<Queued<'a>, ApiError> {
        let (s, caller, lease) = (self.0.s, self.0.caller, self.0.lease);
        match quotas::enter_queue(s, caller, lease).await {
            Ok(()) => Ok(Queued(self.0)),
            Err(e) => Err(self.refuse(e).await),
        }
    }

    /// The request fails with `e`: its lease goes back before the caller is answered.
    pub(crate) async fn refuse(mut self, e: ApiError) -> ApiError {
        self.0.disarm();
        let (s, caller, lease) = (self.0.s, self.0.caller, self.0.lease);
        quotas::give_back(s, caller, lease).await;
        e
    }
}

/// An admitted create that holds a slot of its principal's `queued` quota and, once `at` a
/// node, a place in that node's queue.
pub(crate) struct Queued<'a>(Hold<'a>);

impl Queued<'_> {
    /// The request waits in `node`'s queue as `request_id` (a drop withdraws it from there).
    pub(crate) fn at(&mut self, node: &str, request_id: &str, template: &str) {
        self.0.place = Some((node.to_string(), request_id.to_string(), template.to_string()));
    }

    /// A sandbox is the request's (its session holds the lease): the request leaves the
    /// quota queue.
    pub(crate) async fn granted(mut self, spec: LeaseSpec, grant: Grant, start: Start) -> Granted {
        self.0.disarm();
        let (s, caller, lease) = (self.0.s, self.0.caller, self.0.lease);
        quotas::leave_queue(s, caller, lease).await;
        Granted { spec, grant, start }
    }

    /// The request fails with `e`: it leaves the quota queue and its lease goes back before
    /// the caller is answered (its place in a node's queue was given up by whoever failed).
    pub(crate) async fn refuse(mut self, e: ApiError) -> ApiError {
        self.0.disarm();
        let (s, caller, lease) = (self.0.s, self.0.caller, self.0.lease);
        quotas::leave_queue(s, caller, lease).await;
        quotas::give_back(s, caller, lease).await;
        e
    }
}

/// A sandbox granted to the create: its session holds the quota lease, so nothing is left to
/// give back. `owned` hands the parts to the answer.
pub(crate) struct Granted {
    spec: LeaseSpec,
    grant: Grant,
    start: Start,
}

impl Granted {
    /// The session is the caller's: its lease spec, its grant, and whether it was warm.
    pub(crate) fn owned(self) -> (LeaseSpec, Grant, Start) {
        (self.spec, self.grant, self.start)
    }
}

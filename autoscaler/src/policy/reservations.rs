//! Declared demand: have `count` idle by `ready_by`, starting just early enough given the create budget,
//! and say when a reservation cannot be met and the earliest time it could be.
//!
//! Planning is a pure function of the observation. Reservations are taken earliest deadline first (EDF,
//! optimal for meeting deadlines on one shared create budget). The budget is the cluster's measured create
//! rate, per template where the nodes measured it (a Debian create costs the node several busybox ones):
//! `n` creates of a template take `n / its rate` of the shared budget, and the margin before `ready_by`
//! grows with the fill time and with how far the template's rate has fallen lately
//! ([`crate::RateMemory`]: a machine that slowed may slow further during the fill). Creates already
//! committed are on-demand creates for waiting requests (they go first) and the needs
//! of reservations with earlier deadlines. Idle and in-flight sandboxes of the template count towards its
//! reservations. A forward pass (everything as soon as possible) gives each reservation its earliest ready
//! time and so its feasibility; a backward pass (everything as late as possible) gives the start times
//! that keep sandboxes idle for the least time, and the target of a reservation is its count from then on
//! (nothing before).
//! From `early_s` before `ready_by` the arrivals of the template consume the reservation, and what is left
//! is held until `ready_by + hold_s`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{PerTemplate, Policy, Targets, TemplateTargets, spread};
use crate::signals::{Observation, Reservation};

/// Slack before `ready_by` for tick rounding and token-bucket jitter, seconds.
pub(super) const MARGIN_S: f64 = 5.0;
/// Extra slack proportional to the fill time, for creates shared with other pools; the template's
/// slowdown adds `slowdown - 1` fill times more (half again when its rate fell by a third).
pub(super) const MARGIN_FRACTION: f64 = 0.05;
/// Trainers start a little early: arrivals this long before `ready_by` already count against the reservation.
pub(super) const EARLY_S: u64 = 10;

/// Tuning of the reservation planner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReservationConfig {
    /// Fixed slack before `ready_by`, seconds.
    pub margin_s: f64,
    /// Slack as a fraction of the time the creates take.
    pub margin_fraction: f64,
    /// Arrivals from this long before `ready_by` consume the reservation, seconds.
    pub early_s: u64,
}

impl Default for ReservationConfig {
    fn default() -> Self {
        Self { margin_s: MARGIN_S, margin_fraction: MARGIN_FRACTION, early_s: EARLY_S }
    }
}

/// The planner's answer for one reservation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationStatus {
    /// Template name.
    pub template: String,
    /// Sandboxes declared.
    pub count: u32,
    /// Declared ready-by time, ms.
    pub ready_by_ms: u64,
    /// Whether `count` can be idle by `ready_by` given the create budget and what is committed before it.
    pub feasible: bool,
    /// Earliest time `count` can be idle (equal to now when nothing remains to create); `None` when no node
    /// can create at all.
    pub earliest_ready_ms: Option<u64>,
    /// When creating for it starts: the latest start that still makes `ready_by`, or now once started.
    pub start_ms: u64,
    /// Sandboxes still to be created for it.
    pub to_create: u32,
}

/// Per-template targets from reservations, and the status of each (in the observation's order).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReservationPlan {
    /// Idle sandboxes wanted now per template, summed over its reservations.
    pub targets: TemplateTargets,
    /// One status per reservation of the observation, same order.
    pub statuses: Vec<ReservationStatus>,
}

/// Plan all reservations of `obs` (see the module docs).
pub fn plan_reservations(obs: &Observation, cfg: &ReservationConfig) -> ReservationPlan {
    let now = obs.now_ms;
    let rate = obs.total_create_rate();
    let latency = obs.max_create_latency_ms();
    // A template's creates at its own measured rate and latency, else the nodes' over every template.
    let pace = |template: &str| -> Pace {
        let t = obs.templates.get(template);
        Pace {
            rate: t.and_then(|t| t.create_rate_per_s).filter(|r| *r > 0.0 && rate > 0.0).unwrap_or(rate),
            latency_ms: t.and_then(|t| t.create_latency_ms).unwrap_or(latency),
            slowdown: t.map_or(1.0, |t| t.create_slowdown.max(1.0)),
        }
    };

    // Committed before any reservation: on-demand creates for requests that no create in flight will
    // serve, in ms of the shared budget.
    let mut backlog_ms = 0u64;
    // What each template already has towards its reservations: idle, plus creates not claimed by waiters.
    let mut avail: BTreeMap<&str, u32> = BTreeMap::new();
    for r in &obs.reservations {
        avail.entry(r.template.as_str()).or_insert(0);
    }
    let pools = PerTemplate::new(obs);
    for (i, (name, t)) in obs.templates.iter().enumerate() {
        let totals = pools.totals(i);
        let waiting = t.waiting.saturating_sub(totals.creating);
        if waiting > 0 {
            backlog_ms = backlog_ms.saturating_add(pace(name).fill_ms(u64::from(waiting)));
        }
        if let Some(a) = avail.get_mut(name.as_str()) {
            *a = totals.idle.saturating_add(totals.creating.saturating_sub(t.waiting));
        }
    }

    let mut order: Vec<usize> =
        (0..obs.reservations.len()).filter(|i| obs.reservations[*i].expires_ms() > now).collect();
    order.sort_by(|a, b| {
        let (x, y) = (&obs.reservations[*a], &obs.reservations[*b]);
        x.ready_by_ms.cmp(&y.ready_by_ms).then(x.template.cmp(&y.template)).then(a.cmp(b))
    });

    struct Work {
        remaining: u32,
        need: u32,
        earliest: Option<u64>,
        start: u64,
    }
    let mut work: Vec<Work> = Vec::with_capacity(order.len());
    let mut cursor = now.saturating_add(backlog_ms);
    for &i in &order {
        let r = &obs.reservations[i];
        let consume_from = r.ready_by_ms.saturating_sub(cfg.early_s * 1_000);
        let consumed = if now >= consume_from {
            obs.templates.get(&r.template).map_or(0, |t| t.arrivals.count_since(consume_from))
        } else {
            0
        };
        let remaining = r.count.saturating_sub(u32::try_from(consumed).unwrap_or(u32::MAX));
        let a = avail.get_mut(r.template.as_str());
        let credit = a.as_ref().map_or(0, |a| (**a).min(remaining));
        if let Some(a) = a {
            *a -= credit;
        }
        let need = remaining - credit;
        let pace = pace(&r.template);
        let earliest = if need == 0 {
            Some(now)
        } else if rate > 0.0 {
            cursor = cursor.saturating_add(pace.fill_ms(u64::from(need)));
            Some(cursor.saturating_add(pace.latency_ms))
        } else {
            None
        };
        work.push(Work { remaining, need, earliest, start: now });
    }

    // Backward pass: latest starts that still leave each reservation's creates done by its deadline. It
    // plans for the whole remaining count (not crediting idle sandboxes), so a start does not move while
    // the pool fills; at the start whatever is idle counts, and the fill only ends sooner.
    let mut next_start = u64::MAX;
    for (w, &i) in work.iter_mut().zip(&order).rev() {
        if w.remaining == 0 {
            continue;
        }
        let r = &obs.reservations[i];
        let pace = pace(&r.template);
        let fill_ms = pace.fill_ms(u64::from(w.remaining));
        let fraction = cfg.margin_fraction + (pace.slowdown - 1.0);
        let margin_ms = ((cfg.margin_s + fraction * fill_ms as f64 / 1_000.0) * 1_000.0) as u64;
        let finish = r.ready_by_ms.saturating_sub(pace.latency_ms.saturating_add(margin_ms)).min(next_start);
        w.start = finish.saturating_sub(fill_ms);
        next_start = w.start;
    }

    let mut plan = ReservationPlan::default();
    let mut status: Vec<Option<ReservationStatus>> = vec![None; obs.reservations.len()];
    for (w, &i) in work.iter().zip(&order) {
        let r = &obs.reservations[i];
        // Before its start a reservation holds nothing: sandboxes idle now would wait longer than new ones.
        let target = if now >= w.start { w.remaining } else { 0 };
        if target > 0 {
            *plan.targets.entry(r.template.clone()).or_insert(0) += target;
        }
        status[i] = Some(ReservationStatus {
            template: r.template.clone(),
            count: r.count,
            ready_by_ms: r.ready_by_ms,
            feasible: w.earliest.is_some_and(|e| e <= r.ready_by_ms || w.need == 0),
            earliest_ready_ms: w.earliest,
            start_ms: w.start.max(now),
            to_create: w.need,
        });
    }
    // Expired reservations are reported fulfilled with nothing left to do.
    plan.statuses = obs
        .reservations
        .iter()
        .zip(status)
        .map(|(r, s)| {
            s.unwrap_or_else(|| ReservationStatus {
                template: r.template.clone(),
                count: r.count,
                ready_by_ms: r.ready_by_ms,
                feasible: true,
                earliest_ready_ms: Some(now),
                start_ms: now,
                to_create: 0,
            })
        })
        .collect();
    plan
}

/// How fast one template's creates go: its rate (creates per second of the shared budget), the time
/// from a create's start to an idle sandbox, and how far its rate has fallen lately (at least 1).
struct Pace {
    rate: f64,
    latency_ms: u64,
    slowdown: f64,
}

impl Pace {
    /// The time `creates` take at this rate, ms (practically never when nothing can be created).
    fn fill_ms(&self, creates: u64) -> u64 {
        if self.rate > 0.0 { (creates as f64 / self.rate * 1_000.0).ceil() as u64 } else { u64::MAX / 4 }
    }
}

/// Whether `candidate` can be met without making any reservation already in `obs` miss its time, and the
/// earliest ready-by time at which it could be: the answer for `POST /v1/reservations`.
///
/// A declaration with an earlier deadline would be served first (EDF), so it is feasible only if every
/// reservation that was feasible before stays feasible. Feasibility only improves with a later ready-by
/// (the processor-demand criterion of EDF), so the earliest feasible time is found by bisection.
pub fn check_reservation(obs: &Observation, candidate: &Reservation, cfg: &ReservationConfig) -> ReservationStatus {
    let before: Vec<bool> = plan_reservations(obs, cfg).statuses.iter().map(|s| s.feasible).collect();
    let mut with = obs.clone();
    with.reservations.push(candidate.clone());
    let at = |ready_by_ms: u64, with: &mut Observation| -> (bool, ReservationStatus) {
        if let Some(last) = with.reservations.last_mut() {
            last.ready_by_ms = ready_by_ms;
        }
        let plan = plan_reservations(with, cfg);
        let ok = plan.statuses.iter().zip(&before).all(|(s, was)| s.feasible || !was);
        let own = plan.statuses.into_iter().last();
        match own {
            Some(s) => (ok && s.feasible, s),
            None => (false, unplannable(candidate, obs.now_ms)),
        }
    };
    let (ok, mut status) = at(candidate.ready_by_ms, &mut with);
    // Latest useful probe: the candidate after everything else.
    let (ok_late, late) = at(u64::MAX / 4, &mut with);
    let Some(mut hi) = late.earliest_ready_ms.filter(|_| ok_late) else {
        status.feasible = false;
        status.earliest_ready_ms = None;
        return status;
    };
    let mut lo = obs.now_ms;
    if ok {
        hi = hi.min(candidate.ready_by_ms);
    }
    // Invariant: feasible at `hi`; bisect to 100 ms.
    while hi.saturating_sub(lo) > 100 {
        let mid = lo + (hi - lo) / 2;
        if at(mid, &mut with).0 { hi = mid } else { lo = mid }
    }
    status.feasible = ok;
    status.earliest_ready_ms = Some(hi);
    status
}

fn unplannable(r: &Reservation, now_ms: u64) -> ReservationStatus {
    ReservationStatus {
        template: r.template.clone(),
        count: r.count,
        ready_by_ms: r.ready_by_ms,
        feasible: false,
        earliest_ready_ms: None,
        start_ms: now_ms,
        to_create: r.count,
    }
}

/// Reservations alone: idle targets only for declared demand.
#[derive(Debug, Default)]
pub struct Reservations {
    cfg: ReservationConfig,
}

impl Reservations {
    /// A reservations-only policy with this tuning.
    pub fn new(cfg: ReservationConfig) -> Self {
        Self { cfg }
    }
}

impl Policy for Reservations {
    fn name(&self) -> String {
        "reservations".into()
    }

    fn decide(&mut self, obs: &Observation) -> Targets {
        let plan = plan_reservations(obs, &self.cfg);
        Targets { idle: spread(obs, &plan.targets), reservations: plan.statuses }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::node;
    use crate::signals::{PoolKey, PoolSignals, TemplateSignals};

    fn base(now_ms: u64) -> Observation {
        // Two nodes at 4 creates/s: 8/s together, 500 ms latency.
        let mut o = Observation::new(now_ms, vec![node("n1", 10_000, 4.0), node("n2", 10_000, 4.0)]);
        o.templates.insert("t".into(), TemplateSignals::default());
        o.templates.insert("u".into(), TemplateSignals::default());
        o
    }

    fn res(template: &str, count: u32, ready_by_ms: u64) -> Reservation {
        Reservation { template: template.into(), count, ready_by_ms, hold_s: 60 }
    }

    #[test]
    fn starts_just_early_enough() {
        let cfg = ReservationConfig::default();
        let mut o = base(0);
        // 800 by 600 s: 100 s of creates at 8/s, plus 0.5 s latency and 5 s + 5 s margin.
        o.reservations.push(res("t", 800, 600_000));
        let plan = plan_reservations(&o, &cfg);
        let s = &plan.statuses[0];
        assert!(s.feasible);
        assert_eq!(s.earliest_ready_ms, Some(100_500));
        assert_eq!(s.start_ms, 600_000 - 500 - 10_000 - 100_000);
        assert_eq!(plan.targets.get("t"), None, "nothing before the start");
        o.now_ms = s.start_ms - 1_000;
        assert_eq!(plan_reservations(&o, &cfg).targets.get("t"), None);
        o.now_ms = s.start_ms;
        assert_eq!(plan_reservations(&o, &cfg).targets["t"], 800);
        // Sandboxes already idle count towards it (fewer creates, ready sooner) but are not held early, and
        // the start does not move as the pool fills.
        o.now_ms = 0;
        o.pools.insert(PoolKey::new("t", "n1"), PoolSignals { idle: 400, leased: 0, creating: 0 });
        let p = plan_reservations(&o, &cfg);
        assert_eq!((p.statuses[0].to_create, p.statuses[0].earliest_ready_ms), (400, Some(50_500)));
        assert_eq!(p.statuses[0].start_ms, s.start_ms);
        assert_eq!(p.targets.get("t"), None, "nothing is held before the start");
    }

    #[test]
    fn reports_infeasible_with_the_earliest_time() {
        let cfg = ReservationConfig::default();
        let mut o = base(1_000_000);
        // 1,000 in 60 s cannot be done at 8/s: 125 s of creates.
        o.reservations.push(res("t", 1_000, 1_060_000));
        let s = &plan_reservations(&o, &cfg).statuses[0];
        assert!(!s.feasible);
        assert_eq!(s.earliest_ready_ms, Some(1_000_000 + 125_000 + 500));
        assert_eq!(s.start_ms, 1_000_000, "an infeasible reservation starts now");
        // Committed work comes first: an earlier reservation and 80 waiting requests delay a later one.
        let mut o = base(0);
        if let Some(t) = o.templates.get_mut("u") {
            t.waiting = 80;
        }
        o.reservations.push(res("t", 400, 100_000));
        o.reservations.push(res("u", 400, 90_000));
        let plan = plan_reservations(&o, &cfg);
        // u: 10 s of backlog, then 50 s of its own creates; t follows with 50 s more.
        assert_eq!(plan.statuses[1].earliest_ready_ms, Some(60_500));
        assert_eq!(plan.statuses[0].earliest_ready_ms, Some(110_500));
        assert!(plan.statuses[1].feasible && !plan.statuses[0].feasible);
        // A new declaration fits where it breaks nothing that was feasible...
        let s = check_reservation(&o, &res("t", 80, 75_000), &cfg);
        assert!(s.feasible);
        assert!(s.earliest_ready_ms.is_some_and(|e| (20_400..=20_600).contains(&e)));
        // ...and is refused where it would make u late; the earliest time queues it behind u and t.
        let s = check_reservation(&o, &res("t", 400, 75_000), &cfg);
        assert!(!s.feasible);
        assert!(s.earliest_ready_ms.is_some_and(|e| (160_400..=160_600).contains(&e)), "{s:?}");
    }

    #[test]
    fn each_template_fills_at_its_own_rate_with_a_margin_that_grows_as_it_falls() {
        let cfg = ReservationConfig::default();
        let mut o = base(0);
        // A Debian-like template: the nodes create 2 a second of it (8 a second over every
        // template, mostly busybox), 3 s each.
        let deb = |o: &mut Observation, rate: Option<f64>, slowdown: f64| {
            let t = o.templates.get_mut("u").unwrap();
            (t.create_rate_per_s, t.create_latency_ms, t.create_slowdown) = (rate, Some(3_000), slowdown);
        };
        deb(&mut o, Some(2.0), 1.0);
        o.reservations.push(res("u", 24, 120_000));
        let s = plan_reservations(&o, &cfg).statuses[0].clone();
        // 24 at 2/s: 12 s of creates and 3 s of latency; margin 5 s + 5 % of 12 s.
        assert_eq!(s.earliest_ready_ms, Some(15_000));
        assert_eq!(s.start_ms, 120_000 - 3_000 - 5_600 - 12_000);
        // At the nodes' rate over every template it starts 9 s later (3 s of creates planned, not
        // 12): the burst that came in late under load.
        let mut flat = o.clone();
        flat.templates.insert("u".into(), TemplateSignals::default());
        assert_eq!(plan_reservations(&flat, &cfg).statuses[0].start_ms, 120_000 - 500 - 5_150 - 3_000);
        // Its rate has halved lately: the margin adds one more fill time, and the targets come then.
        deb(&mut o, Some(2.0), 2.0);
        let slowed = plan_reservations(&o, &cfg).statuses[0].clone();
        assert_eq!(slowed.start_ms, 120_000 - 3_000 - 17_600 - 12_000);
        o.now_ms = slowed.start_ms - 100;
        assert_eq!(plan_reservations(&o, &cfg).targets.get("u"), None);
        o.now_ms = slowed.start_ms;
        assert_eq!(plan_reservations(&o, &cfg).targets["u"], 24);
        // A slowdown below 1 (unset) counts as none.
        o.now_ms = 0;
        deb(&mut o, Some(2.0), 0.0);
        assert_eq!(plan_reservations(&o, &cfg).statuses[0], s);
        // The budget is shared: a busybox-like reservation due after it waits for its 12 s of
        // creates, then takes 10 s of its own at the nodes' 8 a second.
        o.reservations.push(res("t", 80, 130_000));
        let plan = plan_reservations(&o, &cfg);
        assert_eq!(plan.statuses[1].earliest_ready_ms, Some(12_000 + 10_000 + 500));
        // And waiting requests of the slow template delay both by their own fill time (4 at 2/s).
        o.templates.get_mut("u").unwrap().waiting = 4;
        let plan = plan_reservations(&o, &cfg);
        assert_eq!(plan.statuses[0].earliest_ready_ms, Some(2_000 + 15_000));
    }

    #[test]
    fn arrivals_consume_and_the_rest_is_held() {
        let cfg = ReservationConfig::default();
        let mut o = base(601_000);
        o.reservations.push(res("t", 800, 600_000));
        o.pools.insert(PoolKey::new("t", "n1"), PoolSignals { idle: 300, leased: 500, creating: 0 });
        if let Some(t) = o.templates.get_mut("t") {
            t.arrivals.record(599_000, 500);
        }
        assert_eq!(plan_reservations(&o, &cfg).targets["t"], 300);
        o.now_ms = 659_000;
        assert_eq!(plan_reservations(&o, &cfg).targets["t"], 300, "held for hold_s");
        o.now_ms = 660_000;
        assert_eq!(plan_reservations(&o, &cfg).targets.get("t"), None, "released after");
    }
}

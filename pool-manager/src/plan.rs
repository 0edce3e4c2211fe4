//! The create plan of one pool tick, as a pure function of what the tick observed.
//!
//! `plan` decides how many sandboxes to create for which template and which pools to shrink;
//! `node/pools.rs` gathers the inputs (ledger counts, creates in flight, back-off, the token bucket
//! and the in-flight semaphore) and carries the plan out. No I/O and no clock in here: the
//! caller decides "backed off" and "tokens available" at its own `now`.
//!
//! The rules:
//! - Two passes over the pools, in the order given (the node passes configured templates
//!   sorted by name, then private ones sorted): first **demand** (requests already waiting,
//!   less the creates in flight for that template), then **refill** (up to `target + waiting`
//!   sandboxes idle or being created).
//! - Within a pass a template takes all it wants before the next one gets any (greedy, in
//!   order), so an earlier template's refill never starves a later template's waiters. The
//!   node rotates the order each tick to start with the template whose waiters a plan that ran
//!   out of budget served last, so between templates demand is served round-robin.
//! - Every create costs one token, one in-flight slot and one unit of capacity
//!   (`max_sandboxes` less the sandboxes held and the creates in flight). The first of these
//!   to run out ends the plan (checked in that order: capacity, in-flight, tokens).
//! - A backed-off template gets nothing (its waiters were already told it is unhealthy).
//! - A pool with idle sandboxes beyond its target and nobody waiting retires the excess.
//!
//! Memory is not accounted here: the autoscaler fits its targets to the node's memory in its
//! capacity step; the node itself only enforces `max_sandboxes`.

/// One template's pool as a tick sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PoolView {
    pub template: String,
    /// Idle sandboxes in the ledger's pool.
    pub idle: u64,
    /// Creates of this template in flight (started, not yet finished).
    pub creating: u64,
    /// Requests waiting in this node's queue for the template.
    pub waiting: u64,
    /// The idle target: the autoscaler's if fresh, else config `warm`.
    pub target: u64,
    /// A recent create failed and the back-off has not run out.
    pub backed_off: bool,
}

/// What this tick may spend on creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Budget {
    /// Whole tokens in the create bucket now (`create_rate`, refilled by the caller).
    pub tokens: u64,
    /// The create window now (`pace::Window`, at most `max_creates_in_flight`).
    pub max_in_flight: u64,
    /// Creates holding an in-flight slot now.
    pub in_flight: u64,
    /// `max_sandboxes`.
    pub max_sandboxes: u64,
    /// Sandboxes the node holds now (idle or leased). Creates in flight are counted on top,
    /// from the views' `creating`.
    pub sandboxes: u64,
}

/// Why a create is planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Why {
    /// For requests already waiting.
    Demand,
    /// To bring the pool up to its idle target.
    Refill,
}

/// Start `count` creates of `template`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Create {
    pub template: String,
    pub count: u64,
    pub why: Why,
}

/// Retire `count` idle sandboxes of `template` (the target went down).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Retire {
    pub template: String,
    pub count: u64,
}

/// The budget that ran out while creates were still wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Limit {
    /// `max_sandboxes` reached.
    Capacity,
    /// The create window is full.
    InFlight,
    /// The token bucket is empty.
    Tokens,
}

/// One tick's decisions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Creates to start, in order: all demand entries before any refill entry, templates in
    /// the order of the views. No entry has a zero count.
    pub creates: Vec<Create>,
    /// Pools to shrink, in the order of the views. No entry has a zero count.
    pub retires: Vec<Retire>,
    /// Set when a budget stopped creates that were wanted.
    pub limited_by: Option<Limit>,
}

impl Plan {
    /// Creates planned in all.
    pub(crate) fn total_creates(&self) -> u64 {
        self.creates.iter().map(|c| c.count).sum()
    }

    /// Creates planned for `template` (demand and refill); the tests' view of a plan.
    #[cfg(test)]
    pub(crate) fn creates_for(&self, template: &str) -> u64 {
        self.creates.iter().filter(|c| c.template == template).map(|c| c.count).sum()
    }

    /// Idle sandboxes of `template` to retire; the tests' view of a plan.
    #[cfg(test)]
    pub(crate) fn retires_for(&self, template: &str) -> u64 {
        self.retires.iter().filter(|r| r.template == template).map(|r| r.count).sum()
    }
}

/// Decides this tick's creates and retirements (see the module documentation for the rules).
pub(crate) fn plan(pools: &[PoolView], budget: &Budget) -> Plan {
    let mut plan = Plan::default();
    let in_flight_creates: u64 = pools.iter().map(|p| p.creating).sum();
    let mut room = budget.max_sandboxes.saturating_sub(budget.sandboxes.saturating_add(in_flight_creates));
    let mut slots = budget.max_in_flight.saturating_sub(budget.in_flight);
    let mut tokens = budget.tokens;
    // Creates this plan starts, per view: the refill pass counts demand's as in flight.
    let mut started = vec![0u64; pools.len()];
    'passes: for why in [Why::Demand, Why::Refill] {
        for (p, started) in pools.iter().zip(started.iter_mut()) {
            if p.backed_off {
                continue;
            }
            let creating = p.creating.saturating_add(*started);
            let want = match why {
                Why::Demand => p.waiting.saturating_sub(creating),
                Why::Refill => p.target.saturating_add(p.waiting).saturating_sub(p.idle.saturating_add(creating)),
            };
            if want == 0 {
                continue;
            }
            let n = want.min(room).min(slots).min(tokens);
            if n > 0 {
                plan.creates.push(Create { template: p.template.clone(), count: n, why });
                room -= n;
                slots -= n;
                tokens -= n;
                *started += n;
            }
            if n < want {
                plan.limited_by = Some(if room == 0 {
                    Limit::Capacity
                } else if slots == 0 {
                    Limit::InFlight
                } else {
                    Limit::Tokens
                });
                break 'passes;
            }
        }
    }
    plan.retires = pools
        .iter()
        .filter(|p| p.waiting == 0 && p.idle > p.target)
        .map(|p| Retire { template: p.template.clone(), count: p.idle - p.target })
        .collect();
    plan
}

/// Round-robin between templates across ticks: `views` rotated to start with `resume_at` (the
/// template a previous plan that ran out of budget served last); and after planning, what the
/// next tick should resume at. Greedy in order within a tick, in turn between ticks.
pub(crate) fn rotate(views: &mut [PoolView], resume_at: Option<&str>) {
    if let Some(i) = resume_at.and_then(|t| views.iter().position(|v| v.template == t)) {
        views.rotate_left(i);
    }
}

/// Where the tick after `plan` should start (`None`: where it is; nothing ran out).
pub(crate) fn resume_after(plan: &Plan) -> Option<&str> {
    plan.limited_by?;
    plan.creates.iter().rev().find(|c| c.why == Why::Demand).map(|c| c.template.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_late_in_the_order_is_served_while_early_ones_keep_getting_requests() {
        // 50 templates, 4 creates a tick; each tick the creates finish (their waiters are
        // served) and 4 new requests come for the first ten templates. One request waits for
        // the last template from the start: in order alone it would wait forever.
        let mut pools: Vec<PoolView> = (0..50).map(|i| pool(&format!("t{i:02}"), 0, 0, 0)).collect();
        pools[49].waiting = 1;
        let mut resume: Option<String> = None;
        let mut served_at = None;
        for tick in 0..40 {
            for j in 0..4 {
                pools[(tick * 4 + j) % 10].waiting += 1;
            }
            let mut views = pools.clone();
            rotate(&mut views, resume.as_deref());
            let p = plan(&views, &Budget { tokens: 4, ..plenty() });
            resume = resume_after(&p).map(String::from).or(resume);
            for c in &p.creates {
                let v = pools.iter_mut().find(|v| v.template == c.template).unwrap();
                v.waiting -= c.count;
            }
            if pools[49].waiting == 0 && served_at.is_none() {
                served_at = Some(tick);
            }
        }
        assert!(served_at.is_some_and(|t| t < 10), "served at tick {served_at:?}");
        // Without rotation the same load never reaches it.
        let mut pools: Vec<PoolView> = (0..50).map(|i| pool(&format!("t{i:02}"), 0, 0, 0)).collect();
        pools[49].waiting = 1;
        for tick in 0..40 {
            for j in 0..4 {
                pools[(tick * 4 + j) % 10].waiting += 1;
            }
            let p = plan(&pools, &Budget { tokens: 4, ..plenty() });
            for c in &p.creates {
                pools.iter_mut().find(|v| v.template == c.template).unwrap().waiting -= c.count;
            }
        }
        assert_eq!(pools[49].waiting, 1);
    }

    fn pool(template: &str, idle: u64, waiting: u64, target: u64) -> PoolView {
        PoolView { template: template.into(), idle, creating: 0, waiting, target, backed_off: false }
    }

    /// A budget that never binds.
    fn plenty() -> Budget {
        Budget { tokens: 1_000, max_in_flight: 1_000, in_flight: 0, max_sandboxes: 1_000, sandboxes: 0 }
    }

    fn create(template: &str, count: u64, why: Why) -> Create {
        Create { template: template.into(), count, why }
    }

    #[test]
    fn nothing_when_every_pool_is_at_target() {
        let pools = [pool("a", 3, 0, 3), pool("b", 0, 0, 0)];
        assert_eq!(plan(&pools, &plenty()), Plan::default());
    }

    #[test]
    fn nothing_when_creates_in_flight_already_cover_target_and_waiters() {
        let pools = [PoolView { creating: 4, ..pool("a", 1, 2, 3) }];
        assert_eq!(plan(&pools, &plenty()), Plan::default());
    }

    #[test]
    fn nothing_for_no_pools() {
        assert_eq!(plan(&[], &plenty()), Plan::default());
    }

    #[test]
    fn refills_up_to_target() {
        let p = plan(&[pool("a", 1, 0, 4)], &plenty());
        assert_eq!(p.creates, vec![create("a", 3, Why::Refill)]);
        assert_eq!(p.limited_by, None);
        assert!(p.retires.is_empty());
    }

    #[test]
    fn waiters_are_served_on_top_of_the_target() {
        // 2 waiting and a target of 3 idle: 2 for the waiters, then 3 - 1 idle for the pool.
        let p = plan(&[pool("a", 1, 2, 3)], &plenty());
        assert_eq!(p.creates, vec![create("a", 2, Why::Demand), create("a", 2, Why::Refill)]);
    }

    #[test]
    fn creates_in_flight_count_against_demand_and_refill() {
        let p = plan(&[PoolView { creating: 1, ..pool("a", 0, 3, 2) }], &plenty());
        // Demand: 3 waiting - 1 in flight; refill: 2 + 3 - (0 + 1 + 2).
        assert_eq!(p.creates, vec![create("a", 2, Why::Demand), create("a", 2, Why::Refill)]);
    }

    #[test]
    fn demand_of_every_template_comes_before_any_refill() {
        let pools = [pool("a", 0, 0, 5), pool("b", 0, 2, 0), pool("c", 0, 1, 1)];
        let p = plan(&pools, &plenty());
        assert_eq!(
            p.creates,
            vec![
                create("b", 2, Why::Demand),
                create("c", 1, Why::Demand),
                create("a", 5, Why::Refill),
                create("c", 1, Why::Refill),
            ]
        );
    }

    #[test]
    fn waiters_beat_targets_when_tokens_are_short() {
        // "a" comes first and wants 5 for its target, but "b" has waiters: they get the tokens.
        let pools = [pool("a", 0, 0, 5), pool("b", 0, 3, 0)];
        let p = plan(&pools, &Budget { tokens: 3, ..plenty() });
        assert_eq!(p.creates, vec![create("b", 3, Why::Demand)]);
        assert_eq!(p.limited_by, Some(Limit::Tokens));
    }

    #[test]
    fn templates_are_served_greedily_in_the_given_order() {
        // Within a pass the first template takes all it wants before the next gets any.
        let pools = [pool("a", 0, 4, 0), pool("b", 0, 4, 0)];
        let p = plan(&pools, &Budget { tokens: 6, ..plenty() });
        assert_eq!(p.creates, vec![create("a", 4, Why::Demand), create("b", 2, Why::Demand)]);
        // The same pools in the other order: the other template is first.
        let pools = [pool("b", 0, 4, 0), pool("a", 0, 4, 0)];
        let p = plan(&pools, &Budget { tokens: 6, ..plenty() });
        assert_eq!(p.creates, vec![create("b", 4, Why::Demand), create("a", 2, Why::Demand)]);
    }

    #[test]
    fn a_budget_that_runs_out_ends_the_plan() {
        // "a" wants more than there is and takes it all: "b", later in the order, waits for
        // the next tick. The template order decides who goes first, not a share.
        let pools = [pool("a", 0, 0, 5), pool("b", 0, 0, 1)];
        let p = plan(&pools, &Budget { tokens: 3, ..plenty() });
        assert_eq!(p.creates, vec![create("a", 3, Why::Refill)]);
        assert_eq!(p.limited_by, Some(Limit::Tokens));
    }

    #[test]
    fn the_token_bucket_limits_creates() {
        let p = plan(&[pool("a", 0, 2, 10)], &Budget { tokens: 5, ..plenty() });
        assert_eq!(p.creates, vec![create("a", 2, Why::Demand), create("a", 3, Why::Refill)]);
        assert_eq!(p.total_creates(), 5);
        assert_eq!(p.limited_by, Some(Limit::Tokens));
    }

    #[test]
    fn an_empty_bucket_creates_nothing() {
        let p = plan(&[pool("a", 0, 2, 10)], &Budget { tokens: 0, ..plenty() });
        assert!(p.creates.is_empty());
        assert_eq!(p.limited_by, Some(Limit::Tokens));
    }

    #[test]
    fn the_in_flight_cap_limits_creates() {
        let budget = Budget { max_in_flight: 4, in_flight: 1, ..plenty() };
        let p = plan(&[PoolView { creating: 1, ..pool("a", 0, 0, 10) }], &budget);
        assert_eq!(p.creates, vec![create("a", 3, Why::Refill)]);
        assert_eq!(p.limited_by, Some(Limit::InFlight));
        // All slots taken: nothing.
        let budget = Budget { max_in_flight: 4, in_flight: 4, ..plenty() };
        let p = plan(&[pool("a", 0, 3, 0)], &budget);
        assert!(p.creates.is_empty());
        assert_eq!(p.limited_by, Some(Limit::InFlight));
    }

    #[test]
    fn max_sandboxes_limits_creates_counting_those_in_flight() {
        // 10 allowed, 6 held, 2 being created: room for 2.
        let budget = Budget { max_sandboxes: 10, sandboxes: 6, ..plenty() };
        let pools = [PoolView { creating: 2, ..pool("a", 0, 3, 0) }, pool("b", 0, 0, 5)];
        let p = plan(&pools, &budget);
        assert_eq!(p.creates, vec![create("a", 1, Why::Demand), create("b", 1, Why::Refill)]);
        assert_eq!(p.limited_by, Some(Limit::Capacity));
    }

    #[test]
    fn a_full_node_creates_nothing() {
        let budget = Budget { max_sandboxes: 4, sandboxes: 5, ..plenty() };
        let p = plan(&[pool("a", 0, 3, 2)], &budget);
        assert!(p.creates.is_empty());
        assert_eq!(p.limited_by, Some(Limit::Capacity));
    }

    #[test]
    fn the_first_budget_to_run_out_is_reported_capacity_then_in_flight_then_tokens() {
        let tight = Budget { tokens: 2, max_in_flight: 2, in_flight: 0, max_sandboxes: 2, sandboxes: 0 };
        let pools = [pool("a", 0, 5, 0)];
        assert_eq!(plan(&pools, &tight).limited_by, Some(Limit::Capacity));
        assert_eq!(plan(&pools, &Budget { max_sandboxes: 9, ..tight }).limited_by, Some(Limit::InFlight));
        let loose = Budget { max_sandboxes: 9, max_in_flight: 9, ..tight };
        assert_eq!(plan(&pools, &loose).limited_by, Some(Limit::Tokens));
        // Exactly enough: no limit was hit.
        assert_eq!(plan(&[pool("a", 0, 2, 0)], &tight).limited_by, None);
    }

    #[test]
    fn backed_off_templates_get_nothing() {
        let pools = [PoolView { backed_off: true, ..pool("broken", 0, 5, 3) }, pool("ok", 0, 1, 1)];
        let p = plan(&pools, &Budget { tokens: 3, ..plenty() });
        assert_eq!(p.creates, vec![create("ok", 1, Why::Demand), create("ok", 1, Why::Refill)]);
        assert_eq!(p.creates_for("broken"), 0);
        assert_eq!(p.limited_by, None);
    }

    #[test]
    fn a_backed_off_template_is_still_retired_beyond_its_target() {
        let p = plan(&[PoolView { backed_off: true, ..pool("a", 4, 0, 1) }], &plenty());
        assert_eq!(p.retires, vec![Retire { template: "a".into(), count: 3 }]);
    }

    #[test]
    fn idle_beyond_a_lowered_target_is_retired() {
        let pools = [pool("a", 5, 0, 2), pool("b", 2, 0, 2), pool("c", 3, 0, 0)];
        let p = plan(&pools, &plenty());
        assert!(p.creates.is_empty());
        assert_eq!(
            p.retires,
            vec![Retire { template: "a".into(), count: 3 }, Retire { template: "c".into(), count: 3 }]
        );
        assert_eq!(p.retires_for("b"), 0);
    }

    #[test]
    fn nothing_is_retired_while_requests_wait() {
        // Idle sandboxes beside waiters only last until the grant script hands them out (a
        // request queues only when the pool is empty), so a waiter still counts as demand.
        let p = plan(&[pool("a", 5, 1, 2)], &plenty());
        assert!(p.retires.is_empty());
        assert_eq!(p.creates, vec![create("a", 1, Why::Demand)]);
    }

    #[test]
    fn retiring_does_not_depend_on_the_create_budget() {
        let empty = Budget { tokens: 0, max_in_flight: 1, in_flight: 1, max_sandboxes: 1, sandboxes: 9 };
        let p = plan(&[pool("a", 4, 0, 1), pool("b", 0, 2, 0)], &empty);
        assert!(p.creates.is_empty());
        assert_eq!(p.retires, vec![Retire { template: "a".into(), count: 3 }]);
    }

    #[test]
    fn huge_counts_do_not_overflow() {
        let pools = [PoolView { creating: u64::MAX, ..pool("a", u64::MAX, u64::MAX, u64::MAX) }];
        let budget = Budget { sandboxes: u64::MAX, in_flight: u64::MAX, ..plenty() };
        let p = plan(&pools, &budget);
        assert!(p.creates.is_empty());
        let p = plan(&[pool("a", 0, u64::MAX, u64::MAX)], &plenty());
        assert_eq!(p.total_creates(), 1_000);
    }

    /// The loop as it was before `plan` existed: one create at a time, re-reading the counts,
    /// stopping at the first budget that refuses. `plan` must decide exactly the same.
    fn one_at_a_time(pools: &[PoolView], budget: &Budget) -> (Vec<u64>, Option<Limit>) {
        let mut creating: Vec<u64> = pools.iter().map(|p| p.creating).collect();
        let mut started = vec![0u64; pools.len()];
        let in_flight: u64 = creating.iter().sum();
        let mut room = budget.max_sandboxes.saturating_sub(budget.sandboxes + in_flight);
        let mut permits = budget.max_in_flight.saturating_sub(budget.in_flight);
        let mut tokens = budget.tokens;
        for pass in 0..2 {
            for (i, v) in pools.iter().enumerate() {
                if v.backed_off {
                    continue;
                }
                let want = if pass == 0 {
                    v.waiting.saturating_sub(creating[i])
                } else {
                    (v.target + v.waiting).saturating_sub(v.idle + creating[i])
                };
                for _ in 0..want {
                    if room == 0 {
                        return (started, Some(Limit::Capacity));
                    }
                    if permits == 0 {
                        return (started, Some(Limit::InFlight));
                    }
                    if tokens == 0 {
                        return (started, Some(Limit::Tokens));
                    }
                    room -= 1;
                    permits -= 1;
                    tokens -= 1;
                    creating[i] += 1;
                    started[i] += 1;
                }
            }
        }
        (started, None)
    }

    /// A tiny deterministic generator (xorshift64): the same cases on every run.
    struct Gen(u64);
    impl Gen {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    #[test]
    fn agrees_with_the_one_at_a_time_loop_and_keeps_its_invariants() {
        let mut g = Gen(0x5eed_1234_abcd_0001);
        for case in 0..20_000 {
            let n = g.below(5) as usize;
            let pools: Vec<PoolView> = (0..n)
                .map(|i| PoolView {
                    template: format!("t{i}"),
                    idle: g.below(6),
                    creating: g.below(4),
                    waiting: g.below(6),
                    target: g.below(8),
                    backed_off: g.below(5) == 0,
                })
                .collect();
            let budget = Budget {
                tokens: g.below(12),
                max_in_flight: 1 + g.below(10),
                in_flight: g.below(8),
                max_sandboxes: 1 + g.below(40),
                sandboxes: g.below(40),
            };
            let p = plan(&pools, &budget);
            let (expected, limit) = one_at_a_time(&pools, &budget);
            let got: Vec<u64> = pools.iter().map(|v| p.creates_for(&v.template)).collect();
            assert_eq!(got, expected, "case {case}: {pools:?} {budget:?} -> {p:?}");
            assert_eq!(p.limited_by, limit, "case {case}: {pools:?} {budget:?} -> {p:?}");

            // Never beyond any budget.
            let total = p.total_creates();
            assert!(total <= budget.tokens, "case {case}");
            assert!(total <= budget.max_in_flight.saturating_sub(budget.in_flight), "case {case}");
            let held: u64 = budget.sandboxes + pools.iter().map(|v| v.creating).sum::<u64>();
            if held <= budget.max_sandboxes {
                assert!(held + total <= budget.max_sandboxes, "case {case}");
            } else {
                assert_eq!(total, 0, "case {case}");
            }
            // Demand entries all come first; no zero entries; nothing for backed-off pools.
            let first_refill = p.creates.iter().position(|c| c.why == Why::Refill).unwrap_or(p.creates.len());
            assert!(p.creates[first_refill..].iter().all(|c| c.why == Why::Refill), "case {case}");
            assert!(p.creates.iter().all(|c| c.count > 0));
            for v in &pools {
                if v.backed_off {
                    assert_eq!(p.creates_for(&v.template), 0, "case {case}");
                }
                // Never created and retired in the same tick.
                assert!(p.creates_for(&v.template) == 0 || p.retires_for(&v.template) == 0, "case {case}");
                let retire = if v.waiting == 0 { v.idle.saturating_sub(v.target) } else { 0 };
                assert_eq!(p.retires_for(&v.template), retire, "case {case}");
                // Never more than the waiters not yet covered plus what the target lacks;
                // exactly that when no budget ran out.
                let demand = v.waiting.saturating_sub(v.creating);
                let refill = (v.target + v.waiting).saturating_sub(v.idle + v.creating + demand);
                let want = if v.backed_off { 0 } else { demand + refill };
                assert!(p.creates_for(&v.template) <= want, "case {case}: {v:?}");
                if p.limited_by.is_none() {
                    assert_eq!(p.creates_for(&v.template), want, "case {case}: {v:?}");
                }
            }
        }
    }
}

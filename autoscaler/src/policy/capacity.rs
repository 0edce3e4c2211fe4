//! The capacity step: fit idle targets of all templates into each node's sandbox count and memory.
//!
//! Leased sandboxes occupy their node first, then room is set aside for waiting requests (they will be
//! leased on some node). Idle targets are then placed tier by tier (reservations, then forecasts, then
//! reactive demand); within a tier, templates with the most recent arrival come first, so when room runs
//! out the pools left idle longest are the ones released. Each template is placed sticky to where its
//! sandboxes already are, towards create-rate shares, and spills to nodes with room.

use std::collections::BTreeMap;

use super::{PerTemplate, TemplateTargets, node_weights, place};
use crate::signals::{Observation, PoolKey};

/// Place tiered per-template idle targets onto nodes within capacity.
///
/// `tiers[k][template]` is the idle wanted at priority `k` on top of the tiers before it. The result never
/// makes `leased + idle target` exceed a node's `max_sandboxes` or memory.
pub fn fit_to_capacity(obs: &Observation, tiers: &[TemplateTargets]) -> BTreeMap<PoolKey, u32> {
    let n = obs.nodes.len();
    let weights = node_weights(obs);
    let node_idx: BTreeMap<&str, usize> = obs.nodes.iter().enumerate().map(|(i, nd)| (nd.node.as_str(), i)).collect();
    let mem_of = |t: &str| u64::from(obs.templates.get(t).map_or(0, |t| t.memory_mib));
    let mut room_count: Vec<u64> = obs.nodes.iter().map(|nd| u64::from(nd.max_sandboxes)).collect();
    let mut room_mem: Vec<u64> = obs.nodes.iter().map(|nd| nd.memory_mib).collect();
    for (key, p) in &obs.pools {
        if let Some(&i) = node_idx.get(key.node.as_str()) {
            room_count[i] = room_count[i].saturating_sub(u64::from(p.leased));
            room_mem[i] = room_mem[i].saturating_sub(u64::from(p.leased) * mem_of(&key.template));
        }
    }
    let room_for = |room_count: &[u64], room_mem: &[u64], mem: u64| -> Vec<u32> {
        (0..n)
            .map(|i| {
                let by_mem = room_mem[i].checked_div(mem).unwrap_or(u64::MAX);
                u32::try_from(room_count[i].min(by_mem)).unwrap_or(u32::MAX)
            })
            .collect()
    };
    let take = |a: &[u32], mem: u64, room_count: &mut Vec<u64>, room_mem: &mut Vec<u64>| {
        for i in 0..n {
            room_count[i] = room_count[i].saturating_sub(u64::from(a[i]));
            room_mem[i] = room_mem[i].saturating_sub(u64::from(a[i]) * mem);
        }
    };
    for (name, t) in &obs.templates {
        if t.waiting > 0 {
            let mem = mem_of(name);
            let room = room_for(&room_count, &room_mem, mem);
            let a = place(t.waiting, &vec![0; n], &weights, Some(&room));
            take(&a, mem, &mut room_count, &mut room_mem);
        }
    }

    let mut names_in_tiers: Vec<&str> = tiers.iter().flat_map(|t| t.keys().map(String::as_str)).collect();
    names_in_tiers.sort_unstable();
    names_in_tiers.dedup();
    let mut keyed: Vec<(std::cmp::Reverse<Option<u64>>, &str)> = names_in_tiers
        .into_iter()
        .map(|t| (std::cmp::Reverse(obs.templates.get(t).and_then(|s| s.arrivals.last_arrival_ms())), t))
        .collect();
    keyed.sort_unstable();
    let order: Vec<&str> = keyed.into_iter().map(|(_, t)| t).collect();

    let pools = PerTemplate::new(obs);
    let names: Vec<&str> = obs.templates.keys().map(String::as_str).collect();
    let held_of = |t: &str| names.binary_search(&t).ok().map(|i| pools.held(i));
    let none = vec![0; n];
    let mut alloc: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for tier in tiers {
        for &t in &order {
            let amount = tier.get(t).copied().unwrap_or(0);
            if amount == 0 {
                continue;
            }
            let mem = mem_of(t);
            let prior = alloc.entry(t).or_insert_with(|| vec![0; n]);
            let held: Vec<u32> =
                held_of(t).unwrap_or(&none).iter().zip(prior.iter()).map(|(h, p)| h.saturating_sub(*p)).collect();
            let room = room_for(&room_count, &room_mem, mem);
            let a = place(amount, &held, &weights, Some(&room));
            take(&a, mem, &mut room_count, &mut room_mem);
            for (p, x) in prior.iter_mut().zip(&a) {
                *p += x;
            }
        }
    }
    let mut out = BTreeMap::new();
    for (t, a) in alloc {
        for (i, x) in a.into_iter().enumerate() {
            if x > 0 {
                out.insert(PoolKey::new(t, obs.nodes[i].node.clone()), x);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::node;
    use crate::signals::{NodeSignals, PoolSignals, TemplateSignals};

    #[test]
    fn never_exceeds_capacity_and_prefers_reservations() {
        // Two nodes of 100 sandboxes; 60 already leased on n1.
        let mut obs = Observation::new(10_000, vec![node("n1", 100, 4.0), node("n2", 100, 4.0)]);
        for (t, last) in [("res", 1_000), ("old", 2_000), ("new", 9_000)] {
            let mut s = TemplateSignals { memory_mib: 1, ..TemplateSignals::default() };
            s.arrivals.record(last, 1);
            obs.templates.insert(t.into(), s);
        }
        obs.pools.insert(PoolKey::new("new", "n1"), PoolSignals { idle: 0, leased: 60, creating: 0 });
        let tiers = [
            TemplateTargets::from([("res".into(), 90)]),
            TemplateTargets::new(),
            TemplateTargets::from([("old".into(), 40), ("new".into(), 40)]),
        ];
        let out = fit_to_capacity(&obs, &tiers);
        let on = |n: &str| out.iter().filter(|(k, _)| k.node == n).map(|(_, v)| *v).sum::<u32>();
        assert!(60 + on("n1") <= 100 && on("n2") <= 100, "{out:?}");
        let total = |t: &str| out.iter().filter(|(k, _)| k.template == t).map(|(_, v)| *v).sum::<u32>();
        assert_eq!(total("res"), 90, "reservations are placed in full first");
        // 50 places remain for 80 wanted: the most recently used template gets them first.
        assert_eq!((total("new"), total("old")), (40, 10));

        // Memory binds too: 10 MiB sandboxes on a node with 100 MiB.
        let mut obs = Observation::new(0, vec![NodeSignals { memory_mib: 100, ..node("n1", 1_000, 4.0) }]);
        obs.templates.insert("big".into(), TemplateSignals { memory_mib: 10, ..TemplateSignals::default() });
        let out = fit_to_capacity(&obs, &[TemplateTargets::from([("big".into(), 50)])]);
        assert_eq!(out.values().sum::<u32>(), 10);
    }

    #[test]
    fn random_targets_always_fit() {
        let mut rng = crate::sim::rng::SimRng::new(42);
        for _ in 0..300 {
            let nodes: Vec<NodeSignals> = (0..1 + rng.below(3))
                .map(|i| NodeSignals {
                    memory_mib: 100 + rng.below(400),
                    ..node(&format!("n{i}"), 20 + rng.below(100) as u32, rng.range(0.0, 8.0))
                })
                .collect();
            let mut obs = Observation::new(1_000, nodes.clone());
            let mut tiers = vec![TemplateTargets::new(); 3];
            for t in 0..1 + rng.below(6) {
                let name = format!("t{t}");
                let memory_mib = rng.below(4) as u32;
                let waiting = rng.below(10) as u32;
                obs.templates
                    .insert(name.clone(), TemplateSignals { memory_mib, waiting, ..TemplateSignals::default() });
                for nd in &nodes {
                    let p = PoolSignals {
                        idle: rng.below(30) as u32,
                        leased: rng.below(10) as u32,
                        creating: rng.below(5) as u32,
                    };
                    obs.pools.insert(PoolKey::new(name.clone(), nd.node.clone()), p);
                }
                for tier in &mut tiers {
                    if rng.below(2) == 0 {
                        tier.insert(name.clone(), rng.below(200) as u32);
                    }
                }
            }
            let out = fit_to_capacity(&obs, &tiers);
            for nd in &nodes {
                let on_node = |f: &dyn Fn(&str, u32) -> u64| -> u64 {
                    obs.templates.keys().map(|t| f(t, obs.pool(t, &nd.node).leased)).sum()
                };
                let mem = |t: &str| u64::from(obs.templates[t].memory_mib);
                let leased = on_node(&|_, l| u64::from(l));
                let leased_mem = on_node(&|t, l| u64::from(l) * mem(t));
                let idle: u64 = out.iter().filter(|(k, _)| k.node == nd.node).map(|(_, v)| u64::from(*v)).sum();
                let idle_mem: u64 =
                    out.iter().filter(|(k, _)| k.node == nd.node).map(|(k, v)| u64::from(*v) * mem(&k.template)).sum();
                assert!(
                    idle <= u64::from(nd.max_sandboxes).saturating_sub(leased),
                    "{nd:?}: {leased} leased + {idle} idle"
                );
                assert!(idle_mem <= nd.memory_mib.saturating_sub(leased_mem), "{nd:?}: {leased_mem} + {idle_mem} MiB");
            }
            // Nothing is placed beyond what the tiers ask for.
            for t in obs.templates.keys() {
                let asked: u32 = tiers.iter().map(|tier| tier.get(t).copied().unwrap_or(0)).sum();
                let placed: u32 = out.iter().filter(|(k, _)| k.template == *t).map(|(_, v)| *v).sum();
                assert!(placed <= asked);
            }
        }
    }
}

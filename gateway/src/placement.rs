//! Where a create goes: power of k choices among the live nodes (DSec's answer at 160 nodes).
//!
//! `order` samples `k` live nodes at random (the nodes holding the template's image first, if
//! it is a pulled one: a pull costs more than any imbalance) and ranks the sample by score:
//! idle sandboxes of the template, then image presence, then free capacity. The rest of the
//! nodes follow, ranked the same way, as fallbacks: the chosen node admits or refuses in the
//! queueing script itself (it knows its own pressure: `room`, and whether it is live), and a
//! refused request tries the next. The scores come from the nodes' stats (at most about a
//! second old), so they steer; the scripts decide.

use std::cmp::Reverse;
use std::collections::HashSet;

use rand::seq::SliceRandom as _;

use crate::nodes::NodeView;

/// Warm checkouts a create tries at most before it queues: its `k` choices and nodes that
/// reported idle sandboxes of the template, up to this many in all (each is a Redis script).
pub(crate) const MAX_WARM_TRIES: usize = 8;

/// The nodes in the order a create should try them (see the module's doc).
pub(crate) fn order(views: &[NodeView], template: &str, holders: &HashSet<String>, k: usize) -> Vec<String> {
    let mut idx: Vec<usize> = (0..views.len()).collect();
    idx.shuffle(&mut rand::rng());
    // Holders first into the sample, each group in random order (a stable sort keeps it).
    idx.sort_by_key(|&i| !holders.contains(&views[i].id));
    let key = |&i: &usize| Reverse(score(&views[i], template, holders.contains(&views[i].id)));
    let k = k.clamp(1, idx.len().max(1)).min(idx.len());
    let (sample, rest) = idx.split_at_mut(k);
    sample.sort_by_key(key);
    rest.sort_by_key(key);
    idx.into_iter().map(|i| views[i].id.clone()).collect()
}

/// The nodes of `order` worth a warm checkout: the first `k` (the choices), then those whose
/// stats report idle sandboxes of the template, at most `MAX_WARM_TRIES` in all.
pub(crate) fn warm_candidates<'a>(order: &'a [String], views: &[NodeView], template: &str, k: usize) -> Vec<&'a str> {
    order
        .iter()
        .enumerate()
        .filter(|(i, id)| *i < k || idle_of(views, id, template) != Some(0))
        .map(|(_, id)| id.as_str())
        .take(MAX_WARM_TRIES)
        .collect()
}

/// The idle sandboxes of `template` `node` last reported (`None`: it reported nothing).
pub(crate) fn idle_of(views: &[NodeView], node: &str, template: &str) -> Option<u64> {
    let st = views.iter().find(|v| v.id == node)?.stats.as_ref()?;
    Some(st.pools.get(template).map_or(0, |p| p.idle))
}

/// Higher is better: warm sandboxes of the template, then the image, then free capacity (in
/// thousandths of the node's budget; a node without stats counts as half free).
fn score(v: &NodeView, template: &str, holds_image: bool) -> (u64, bool, u64) {
    let Some(st) = &v.stats else { return (0, holds_image, 500) };
    let idle = st.pools.get(template).map_or(0, |p| p.idle);
    let b = &st.budget;
    let free = (b.capacity.saturating_sub(b.sandboxes) * 1000).checked_div(b.capacity).unwrap_or(500);
    (idle, holds_image, free)
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use wire::{NodeBudget, NodeStats, PoolStats};

    use super::*;

    fn view(id: &str, idle: u64, sandboxes: u64) -> NodeView {
        let pools = BTreeMap::from([("t".to_string(), PoolStats { idle, ..Default::default() })]);
        let budget = NodeBudget { capacity: 100, sandboxes, ..Default::default() };
        NodeView { id: id.into(), stats: Some(NodeStats { pools, budget, ..Default::default() }) }
    }

    #[test]
    fn the_best_of_the_sample_comes_first_and_every_node_follows() {
        let views = vec![view("a", 0, 90), view("b", 5, 10), view("c", 0, 10)];
        for _ in 0..50 {
            let o = order(&views, "t", &HashSet::new(), 3);
            assert_eq!(o, ["b", "c", "a"], "with k = every node: warm, then free capacity");
            let o = order(&views, "t", &HashSet::new(), 2);
            assert_eq!(o.len(), 3);
            let mut sorted = o.clone();
            sorted.sort();
            assert_eq!(sorted, ["a", "b", "c"]);
        }
    }

    #[test]
    fn two_choices_spread_a_burst_evenly() {
        // Each placement takes one idle sandbox from the node it picks: power of two choices
        // drains 3 nodes of 400 idle each evenly.
        let mut views = vec![view("a", 400, 0), view("b", 400, 0), view("c", 400, 0)];
        let mut taken: HashMap<String, u64> = HashMap::new();
        for _ in 0..900 {
            let first = order(&views, "t", &HashSet::new(), 2)[0].clone();
            *taken.entry(first.clone()).or_default() += 1;
            let v = views.iter_mut().find(|v| v.id == first).unwrap();
            v.stats.as_mut().unwrap().pools.get_mut("t").unwrap().idle -= 1;
        }
        for n in ["a", "b", "c"] {
            let t = taken[n];
            assert!((285..=315).contains(&t), "{n} took {t} of 900: {taken:?}");
        }
    }

    #[test]
    fn holders_of_the_image_are_always_in_the_sample() {
        let views = vec![view("a", 0, 0), view("b", 0, 50), view("c", 0, 0), view("d", 0, 0)];
        let holders = HashSet::from(["b".to_string()]);
        for _ in 0..50 {
            assert_eq!(order(&views, "t", &holders, 2)[0], "b");
        }
    }

    #[test]
    fn warm_tries_are_the_choices_and_nodes_with_idle_sandboxes() {
        let views = vec![view("a", 0, 0), view("b", 0, 0), view("c", 3, 0), view("d", 0, 0)];
        let o: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        assert_eq!(warm_candidates(&o, &views, "t", 2), ["a", "b", "c"]);
        let unknown = vec![NodeView { id: "a".into(), stats: None }];
        assert_eq!(warm_candidates(&["a".to_string()], &unknown, "t", 0), ["a"], "no stats: worth a try");
    }
}

//! Pool-sizing policies: pure functions of an [`Observation`] (and of earlier observations) to idle targets.
//!
//! Every policy implements [`Policy`]. Whatever state a policy keeps (windows, detected bursts) it derives
//! only from the observations it is given, so replaying the same observations gives the same targets.
//! Per-template policies compute a desired number of idle sandboxes per template; [`spread`] turns those
//! into per-(template, node) targets, and [`Combined`] fits them to each node's capacity instead.

mod capacity;
mod combined;
mod learned;
mod openwhisk;
mod reactive;
mod reservations;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use capacity::fit_to_capacity;
pub use combined::{Combined, CombinedConfig};
pub use learned::{BurstForecast, LearnedBursts, LearnedConfig};
pub use openwhisk::{OpenWhiskConfig, OpenWhiskPrewarm};
pub use reactive::{Reactive, ReactiveConfig};
pub use reservations::{
    ReservationConfig, ReservationPlan, ReservationStatus, Reservations, check_reservation, plan_reservations,
};

use crate::signals::{Observation, PoolKey, PoolSignals};

/// Desired idle sandboxes per template (summed over nodes).
pub type TemplateTargets = BTreeMap<String, u32>;

/// A policy's decision: idle (warm) sandboxes wanted per pool, and the state of declared reservations.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Targets {
    /// Idle sandboxes wanted per pool; a pool not listed has target 0.
    pub idle: BTreeMap<PoolKey, u32>,
    /// One entry per declared reservation in the observation (empty for policies that ignore them).
    pub reservations: Vec<ReservationStatus>,
}

impl Targets {
    /// The idle target of a pool (0 if not listed).
    pub fn get(&self, template: &str, node: &str) -> u32 {
        let start = PoolKey { template: template.to_owned(), node: node.to_owned() };
        self.idle.range(start..).next().filter(|(k, _)| k.template == template && k.node == node).map_or(0, |(_, v)| *v)
    }

    /// The idle target of a template summed over nodes.
    pub fn template_total(&self, template: &str) -> u32 {
        let start = PoolKey { template: template.to_owned(), node: String::new() };
        self.idle.range(start..).take_while(|(k, _)| k.template == template).map(|(_, v)| *v).sum()
    }

    /// The idle target summed over all pools.
    pub fn total(&self) -> u64 {
        self.idle.values().map(|v| u64::from(*v)).sum()
    }
}

/// A pool-sizing policy. `decide` is called once per autoscaler tick with the latest observation.
pub trait Policy {
    /// A short name for reports.
    fn name(&self) -> String;

    /// Idle targets for this observation. Must not read a clock or any input besides `obs`.
    fn decide(&mut self, obs: &Observation) -> Targets;
}

/// A constant pool: `n` idle sandboxes per template, spread over the nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fixed(pub u32);

impl Policy for Fixed {
    fn name(&self) -> String {
        format!("fixed({})", self.0)
    }

    fn decide(&mut self, obs: &Observation) -> Targets {
        let totals: TemplateTargets = obs.templates.keys().map(|t| (t.clone(), self.0)).collect();
        Targets { idle: spread(obs, &totals), reservations: Vec::new() }
    }
}

/// Per-node weights for spreading a template: the nodes' create rates (equal if none is known),
/// with every node within `SAME_CLASS` of the fastest counted as fast as it. A node's measured
/// rate (create window / latency) moves by a third from one second to the next as its window
/// adapts, and halves with its window on a slow create, so splitting by it as measured skewed a
/// reserved burst on three identical nodes to 269 / 316 / 415 sessions (and to 362 / 405 / 233
/// with nodes within 60 % counted as equals); a node several times slower (another machine
/// class) still gets its smaller share.
pub(crate) fn node_weights(obs: &Observation) -> Vec<f64> {
    let w: Vec<f64> = obs.nodes.iter().map(|n| n.create_rate_per_s.max(0.0)).collect();
    let fastest = w.iter().copied().fold(0.0, f64::max);
    if fastest <= 0.0 {
        return vec![1.0; obs.nodes.len()];
    }
    w.into_iter().map(|r| if r >= SAME_CLASS * fastest { fastest } else { r }).collect()
}

/// Nodes whose create rate is at least this share of the fastest's count as equals.
const SAME_CLASS: f64 = 0.3;

/// Every template's pools, aligned with `obs.templates` (index `i` is its `i`-th template): counts summed
/// over nodes, and what each node holds that a target can keep (idle plus creating), nodes in the order of
/// `obs.nodes`. Built in one merge pass over the (sorted) pools, in two allocations.
#[derive(Clone, Debug, Default)]
pub(crate) struct PerTemplate {
    nodes: usize,
    totals: Vec<PoolSignals>,
    held: Vec<u32>,
}

impl PerTemplate {
    pub(crate) fn new(obs: &Observation) -> Self {
        let n = obs.nodes.len();
        let mut out = Self {
            nodes: n,
            totals: vec![PoolSignals::default(); obs.templates.len()],
            held: vec![0; obs.templates.len() * n],
        };
        let mut pools = obs.pools.iter().peekable();
        for (t, name) in obs.templates.keys().enumerate() {
            while pools.next_if(|(k, _)| k.template.as_str() < name.as_str()).is_some() {}
            while let Some((k, p)) = pools.next_if(|(k, _)| k.template == *name) {
                let acc = &mut out.totals[t];
                acc.idle = acc.idle.saturating_add(p.idle);
                acc.leased = acc.leased.saturating_add(p.leased);
                acc.creating = acc.creating.saturating_add(p.creating);
                if let Some(i) = obs.nodes.iter().position(|nd| nd.node == k.node) {
                    out.held[t * n + i] = p.idle.saturating_add(p.creating);
                }
            }
        }
        out
    }

    /// Counts of the `t`-th template summed over nodes.
    pub(crate) fn totals(&self, t: usize) -> PoolSignals {
        self.totals.get(t).copied().unwrap_or_default()
    }

    /// Idle plus creating of the `t`-th template per node.
    pub(crate) fn held(&self, t: usize) -> &[u32] {
        self.held.get(t * self.nodes..(t + 1) * self.nodes).unwrap_or(&[])
    }
}

/// Pair each entry of a name-sorted map with the index of the same template in `obs.templates`, if any.
pub(crate) fn join_templates<'a, V>(
    obs: &'a Observation,
    map: &'a BTreeMap<String, V>,
) -> impl Iterator<Item = (&'a String, &'a V, Option<usize>)> + 'a {
    let mut known = obs.templates.keys().enumerate().peekable();
    map.iter().map(move |(name, v)| {
        while known.next_if(|(_, k)| k.as_str() < name.as_str()).is_some() {}
        let idx = known.peek().filter(|(_, k)| *k == name).map(|(i, _)| *i);
        (name, v, idx)
    })
}

/// Spread per-template totals over the nodes (ignoring capacity; see [`fit_to_capacity`] for that).
///
/// Sticky: what a node already holds is kept where possible, so a changed total moves no sandbox between
/// nodes; growth goes to the nodes furthest below their create-rate share, shrinking comes off those above it.
pub fn spread(obs: &Observation, totals: &TemplateTargets) -> BTreeMap<PoolKey, u32> {
    let weights = node_weights(obs);
    let pools = PerTemplate::new(obs);
    let none = vec![0; obs.nodes.len()];
    // Built in key order and collected at once (a bulk build, not one search per insert).
    let mut out = Vec::new();
    for (template, &total, idx) in join_templates(obs, totals) {
        if total == 0 {
            continue;
        }
        let held = idx.map_or(none.as_slice(), |i| pools.held(i));
        for (i, n) in place(total, held, &weights, None).into_iter().enumerate() {
            if n > 0 {
                out.push((PoolKey::new(template.clone(), obs.nodes[i].node.clone()), n));
            }
        }
    }
    out.into_iter().collect()
}

/// Make a per-template state map hold exactly the templates of `obs` (new ones at their default), so
/// `obs.templates.iter().zip(map.iter_mut())` pairs each template with its state (both sorted by name).
/// One merge pass; only templates that came or went are inserted or removed.
pub(crate) fn sync_states<S: Default>(map: &mut BTreeMap<String, S>, obs: &Observation) {
    let (mut gone, mut new) = (Vec::new(), Vec::new());
    {
        let mut have = map.keys().peekable();
        let mut want = obs.templates.keys().peekable();
        loop {
            match (have.peek(), want.peek()) {
                (None, None) => break,
                (Some(h), Some(w)) if h == w => {
                    have.next();
                    want.next();
                }
                (Some(h), Some(w)) if h < w => gone.extend(have.next().cloned()),
                (Some(_), None) => gone.extend(have.next().cloned()),
                (_, Some(_)) => new.extend(want.next().cloned()),
            }
        }
    }
    for k in gone {
        map.remove(&k);
    }
    for k in new {
        map.insert(k, S::default());
    }
}

/// Split `total` over nodes: sticky to `current`, towards shares proportional to `weights`, within `room`.
///
/// Whatever does not fit a node's room spills to other nodes with room (largest weight first); the result
/// sums to `total` unless the rooms together are smaller.
pub(crate) fn place(total: u32, current: &[u32], weights: &[f64], room: Option<&[u32]>) -> Vec<u32> {
    let n = weights.len();
    if n == 0 {
        return Vec::new();
    }
    let ideal = apportion_f(total, weights);
    let cur_sum: u32 = current.iter().fold(0u32, |a, c| a.saturating_add(*c));
    let mut out: Vec<u32> = current.to_vec();
    if cur_sum >= total {
        let excess: Vec<u32> = (0..n).map(|i| current[i].saturating_sub(ideal[i])).collect();
        let cut = apportion_u(cur_sum - total, &excess);
        for i in 0..n {
            out[i] -= cut[i].min(out[i]);
        }
    } else {
        let deficit: Vec<u32> = (0..n).map(|i| ideal[i].saturating_sub(current[i])).collect();
        let add = apportion_u(total - cur_sum, &deficit);
        for i in 0..n {
            out[i] = out[i].saturating_add(add[i]);
        }
    }
    if let Some(room) = room {
        let mut spill = 0u32;
        for i in 0..n {
            if out[i] > room[i] {
                spill += out[i] - room[i];
                out[i] = room[i];
            }
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|a, b| weights[*b].total_cmp(&weights[*a]).then(a.cmp(b)));
        for i in order {
            if spill == 0 {
                break;
            }
            let add = spill.min(room[i] - out[i]);
            out[i] += add;
            spill -= add;
        }
    }
    out
}

/// Largest-remainder split of `total` proportional to non-negative float weights.
pub(crate) fn apportion_f(total: u32, weights: &[f64]) -> Vec<u32> {
    let sum: f64 = weights.iter().map(|w| w.max(0.0)).sum();
    if weights.is_empty() {
        return Vec::new();
    }
    if sum <= 0.0 {
        return apportion_f(total, &vec![1.0; weights.len()]);
    }
    let exact: Vec<f64> = weights.iter().map(|w| f64::from(total) * w.max(0.0) / sum).collect();
    let mut out: Vec<u32> = exact.iter().map(|e| e.floor() as u32).collect();
    let mut left = total.saturating_sub(out.iter().sum());
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|a, b| (exact[*b] - exact[*b].floor()).total_cmp(&(exact[*a] - exact[*a].floor())).then(a.cmp(b)));
    for i in order.iter().cycle().take(order.len() * 2) {
        if left == 0 {
            break;
        }
        out[*i] += 1;
        left -= 1;
    }
    out
}

/// Largest-remainder split of `total` proportional to integer caps, never giving an entry more than its cap.
pub(crate) fn apportion_u(total: u32, caps: &[u32]) -> Vec<u32> {
    let sum: u64 = caps.iter().map(|c| u64::from(*c)).sum();
    let mut out = vec![0u32; caps.len()];
    if sum == 0 || total == 0 {
        return out;
    }
    let total = u64::from(total).min(sum);
    let mut rem: Vec<(u64, usize)> = Vec::with_capacity(caps.len());
    let mut given = 0u64;
    for (i, c) in caps.iter().enumerate() {
        let num = total * u64::from(*c);
        out[i] = (num / sum) as u32;
        given += num / sum;
        rem.push((num % sum, i));
    }
    rem.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut left = total - given;
    for (_, i) in rem {
        if left == 0 {
            break;
        }
        if out[i] < caps[i] {
            out[i] += 1;
            left -= 1;
        }
    }
    out
}

/// Median of a non-empty slice (the lower middle for even lengths); 0.0 if empty.
pub(crate) fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[(v.len() - 1) / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signals::{NodeSignals, PoolSignals, TemplateSignals};

    pub(crate) fn node(id: &str, max: u32, rate: f64) -> NodeSignals {
        NodeSignals {
            node: id.into(),
            max_sandboxes: max,
            memory_mib: 1 << 20,
            create_rate_per_s: rate,
            create_latency_ms: 500,
        }
    }

    #[test]
    fn nodes_of_one_class_share_evenly_and_a_slow_one_gets_less() {
        let obs = |rates: &[f64]| {
            let nodes = rates.iter().enumerate().map(|(i, r)| node(&format!("n{i}"), 100, *r)).collect();
            Observation::new(0, nodes)
        };
        // Measured rates of three identical nodes, a second apart.
        assert_eq!(node_weights(&obs(&[9.0, 12.5, 14.0])), vec![14.0; 3]);
        assert_eq!(node_weights(&obs(&[6.0, 14.0])), vec![14.0; 2], "a halved window is noise");
        assert_eq!(node_weights(&obs(&[3.0, 14.0])), vec![3.0, 14.0]);
        assert_eq!(node_weights(&obs(&[0.0, 0.0])), vec![1.0, 1.0]);
    }

    #[test]
    fn apportion_sums_and_respects_caps() {
        assert_eq!(apportion_f(10, &[1.0, 1.0, 1.0]), vec![4, 3, 3]);
        assert_eq!(apportion_f(7, &[0.0, 0.0]), vec![4, 3]);
        assert_eq!(apportion_u(5, &[1, 10]), vec![0, 5]);
        assert_eq!(apportion_u(6, &[1, 1, 10]), vec![1, 0, 5]);
        assert_eq!(apportion_u(50, &[1, 10]), vec![1, 10]);
    }

    #[test]
    fn place_is_sticky_and_spills() {
        // Shrinking takes from the node above its share.
        assert_eq!(place(10, &[8, 4], &[1.0, 1.0], None), vec![6, 4]);
        // Growing fills the node below its share.
        assert_eq!(place(12, &[8, 2], &[1.0, 1.0], None), vec![8, 4]);
        // Room caps a node; the rest spills over.
        assert_eq!(place(10, &[0, 0], &[1.0, 1.0], Some(&[2, 100])), vec![2, 8]);
        assert_eq!(place(10, &[0, 0], &[1.0, 1.0], Some(&[2, 3])), vec![2, 3]);
    }

    #[test]
    fn fixed_spreads_over_nodes() {
        let mut obs = Observation::new(0, vec![node("n1", 100, 4.0), node("n2", 100, 4.0)]);
        obs.templates.insert("t".into(), TemplateSignals::default());
        obs.pools.insert(PoolKey::new("t", "n1"), PoolSignals { idle: 7, leased: 0, creating: 0 });
        let t = Fixed(10).decide(&obs);
        assert_eq!((t.get("t", "n1"), t.get("t", "n2")), (7, 3));
        assert_eq!(t.template_total("t"), 10);
    }
}

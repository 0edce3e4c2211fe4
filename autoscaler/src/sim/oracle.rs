//! The oracle: perfect foresight, one sandbox ready just in time for each arrival, within the create rate.
//!
//! Its idle sandbox-seconds are the floor for 100 % warm: creates are scheduled as late as the nodes'
//! sustained create rates allow (latest-deadline-first on each node, greedily on the node free latest),
//! so a sandbox waits idle only when the creates for a burst cannot all finish at its arrival. Images are
//! not its concern: knowing every arrival, it pulls each image before its first create needs it.

use std::collections::BinaryHeap;

use super::{NodeSpec, RunReport, Trace};

/// Score the oracle on `trace` over its window, on `nodes`.
pub fn oracle(trace: &Trace, nodes: &[NodeSpec]) -> RunReport {
    // Each node: (latest time a create may complete there, in µs for integer ordering; node index).
    let mut free: BinaryHeap<(u64, usize)> = nodes.iter().enumerate().map(|(i, _)| (u64::MAX, i)).collect();
    let mut ready = vec![0u64; trace.arrivals.len()];
    for (i, a) in trace.arrivals.iter().enumerate().rev() {
        let Some((slot, n)) = free.pop() else { break };
        let r = slot.min(a.at_ms * 1_000);
        ready[i] = r;
        let gap = nodes.get(n).map_or(1.0, |nd| 1.0 / nd.create_rate_per_s.max(1e-9)) * 1e6;
        free.push((r.saturating_sub(gap as u64), n));
    }
    let (w0, w1) = (trace.warmup_ms, trace.end_ms);
    let latency = nodes.iter().map(|n| n.create_latency_ms).max().unwrap_or(0);
    let mut idle_ms = 0.0;
    let mut deltas: Vec<(u64, i64)> = Vec::with_capacity(trace.arrivals.len() * 2);
    let mut scored = 0u64;
    for (a, r) in trace.arrivals.iter().zip(&ready) {
        let r_ms = r / 1_000;
        let from = r_ms.max(w0);
        let to = a.at_ms.min(w1);
        if to > from {
            idle_ms += (to - from) as f64;
        }
        if a.at_ms >= w0 && a.at_ms < w1 {
            scored += 1;
        }
        // Alive from its create's start to the episode's end.
        deltas.push((r_ms.saturating_sub(latency), 1));
        deltas.push((a.at_ms + a.duration_ms, -1));
    }
    // Equal times: ends (-1) sort before starts (+1).
    deltas.sort_unstable();
    let (mut live, mut peak, mut at_open) = (0i64, 0i64, 0i64);
    for (t, d) in deltas {
        if t >= w1 {
            break;
        }
        live += d;
        if t < w0 {
            at_open = live;
        } else {
            peak = peak.max(live);
        }
    }
    RunReport {
        policy: "oracle".into(),
        arrivals: scored,
        warm_pct: 100.0,
        wait_p50_ms: 0,
        wait_p99_ms: 0,
        idle_sandbox_s: idle_ms / 1_000.0,
        idle_vs_oracle: Some(1.0),
        peak_sandboxes: u64::try_from(peak.max(at_open)).unwrap_or(0),
        creates: scored,
        unserved: 0,
        infeasible_reservations: 0,
        pulls: 0,
        late_reservations: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::trace::{Arrival, TemplateSpec};

    #[test]
    fn just_in_time_within_the_rate() {
        // 8 arrivals at once on one node at 4/s: ready at 0, 0.25, ..., 1.75 s before; idle 7 s in total.
        let arrivals = (0..8).map(|_| Arrival { at_ms: 10_000, template: 0, duration_ms: 1_000 }).collect();
        let trace = Trace {
            name: "t".into(),
            templates: vec![TemplateSpec { name: "t".into(), memory_mib: 1, appears_ms: 0, image: None }],
            arrivals,
            declared: Vec::new(),
            images: Vec::new(),
            warmup_ms: 0,
            end_ms: 20_000,
        };
        let node = NodeSpec::default();
        let r = oracle(&trace, std::slice::from_ref(&node));
        assert!((r.idle_sandbox_s - 7.0).abs() < 1e-6, "{}", r.idle_sandbox_s);
        assert_eq!(r.peak_sandboxes, 8);
        // Two nodes, four creates each: 2 × (0 + 0.25 + 0.5 + 0.75) = 3 s.
        let r = oracle(&trace, &[node.clone(), node]);
        assert!((r.idle_sandbox_s - 3.0).abs() < 1e-6, "{}", r.idle_sandbox_s);
    }
}

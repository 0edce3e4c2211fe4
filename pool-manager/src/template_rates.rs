//! What each template's creates cost this node, so the reservation planner fills a template at
//! its own rate (issue 34): a Debian create costs several busybox ones and slows most under
//! load, and a burst planned at the node's rate over every template came in late (18 of 24 warm
//! on a loaded machine, RELIABILITY.md).
//!
//! A create that took `t` while `k` creates were in flight (itself included) held a `1/k` share
//! of the node's create path for `t`: it cost the node `t / k`. The mean of that cost per
//! template (EWMA) is what the node can do of that template per second, `1 / cost`, whatever the
//! other templates do; the node's own sustainable rate (its budget, its window over its latency)
//! caps it. Creates measured with one in flight make the estimate low where Docker would have run
//! more side by side: a planner that starts early keeps sandboxes idle a little longer, one that
//! starts late misses the burst. State: two numbers per template the node created, pruned to the
//! templates it serves.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// Weight of a new create in a template's averages: about the last five creates.
const WEIGHT: f64 = 0.2;

/// One template's recent creates on this node.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TemplateCreates {
    /// Mean latency, ms.
    pub(crate) ms: f64,
    /// Mean cost to the node (latency over the creates in flight with it), ms.
    pub(crate) cost_ms: f64,
}

impl TemplateCreates {
    /// Creates per second of this template the node sustains, at most `node_rate` (what the
    /// node sustains of any).
    pub(crate) fn rate(&self, node_rate: f64) -> f64 {
        (1_000.0 / self.cost_ms.max(1.0)).min(node_rate)
    }
}

/// The per-template averages of one node.
#[derive(Debug, Default)]
pub(crate) struct TemplateRates {
    by_template: HashMap<String, TemplateCreates>,
}

impl TemplateRates {
    /// A create of `template` succeeded in `took` with `in_flight` creates running (itself
    /// included).
    pub(crate) fn done(&mut self, template: &str, took: Duration, in_flight: u64) {
        let ms = took.as_secs_f64() * 1_000.0;
        let cost_ms = ms / in_flight.max(1) as f64;
        match self.by_template.get_mut(template) {
            Some(c) => {
                c.ms = c.ms * (1.0 - WEIGHT) + ms * WEIGHT;
                c.cost_ms = c.cost_ms * (1.0 - WEIGHT) + cost_ms * WEIGHT;
            }
            None => {
                self.by_template.insert(template.to_string(), TemplateCreates { ms, cost_ms });
            }
        }
    }

    /// The template's averages, once it has created on this node.
    pub(crate) fn get(&self, template: &str) -> Option<TemplateCreates> {
        self.by_template.get(template).copied()
    }

    /// Forgets the templates the node no longer serves (deleted private templates).
    pub(crate) fn retain(&mut self, serving: &HashSet<&str>) {
        self.by_template.retain(|t, _| serving.contains(t.as_str()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_templates_rate_is_its_share_of_the_create_path_capped_by_the_nodes() {
        let mut r = TemplateRates::default();
        assert_eq!(r.get("deb"), None);
        // Eight Debian creates side by side, 4 s each: the node does 2 a second of them.
        r.done("deb", Duration::from_secs(4), 8);
        // busybox alone: 200 ms each, 5 a second.
        r.done("bb", Duration::from_millis(200), 1);
        let deb = r.get("deb").unwrap();
        assert_eq!((deb.ms, deb.cost_ms), (4_000.0, 500.0));
        assert_eq!(deb.rate(8.0), 2.0);
        assert_eq!(r.get("bb").unwrap().rate(8.0), 5.0);
        assert_eq!(r.get("bb").unwrap().rate(3.0), 3.0, "never above what the node sustains");
        // Under load the Debian creates slow to 8 s each: the rate falls towards 1 a second.
        for _ in 0..20 {
            r.done("deb", Duration::from_secs(8), 8);
        }
        let deb = r.get("deb").unwrap();
        assert!((deb.rate(8.0) - 1.0).abs() < 0.02, "{deb:?}");
        assert!((deb.ms - 8_000.0).abs() < 100.0, "{deb:?}");
        // A deleted template's averages go.
        r.retain(&HashSet::from(["bb"]));
        assert_eq!(r.get("deb"), None);
        assert!(r.get("bb").is_some());
    }
}

//! How many sandboxes the node holds per template and per image, and how many of them are
//! paused per template, kept as sandboxes join and leave the node's map and as they are frozen
//! and thawed, so the stats tick (twice a second) and image eviction read O(templates) and
//! O(images) instead of walking every sandbox (issue 34: a profile of an idle node at 500
//! sandboxes put the walk, a `String` clone per sandbox, first among what grew with them).

use std::collections::{HashMap, HashSet};

/// Counts of the sandboxes in the node's map; changed only together with the map, under its
/// lock, so the two never disagree.
#[derive(Debug, Default)]
pub(crate) struct HeldCounts {
    by_template: HashMap<String, u64>,
    by_image: HashMap<String, u64>,
    /// Of `by_template`, the sandboxes frozen by a pause.
    paused_by_template: HashMap<String, u64>,
}

impl HeldCounts {
    /// A sandbox of `template` running `image` joined the map (`paused`: frozen already, as a
    /// readopted one can be).
    pub(crate) fn add(&mut self, template: &str, image: &str, paused: bool) {
        bump(&mut self.by_template, template);
        bump(&mut self.by_image, image);
        if paused {
            bump(&mut self.paused_by_template, template);
        }
    }

    /// A sandbox of `template` running `image` left the map (`paused`: frozen as it left).
    pub(crate) fn remove(&mut self, template: &str, image: &str, paused: bool) {
        drop_one(&mut self.by_template, template);
        drop_one(&mut self.by_image, image);
        if paused {
            drop_one(&mut self.paused_by_template, template);
        }
    }

    /// A sandbox of `template` in the map was frozen (`true`) or thawed (`false`); called only
    /// when its state changed.
    pub(crate) fn pause(&mut self, template: &str, paused: bool) {
        if paused {
            bump(&mut self.paused_by_template, template);
        } else {
            drop_one(&mut self.paused_by_template, template);
        }
    }

    /// Paused sandboxes per template (templates with none are absent).
    pub(crate) fn paused_by_template(&self) -> HashMap<String, u64> {
        self.paused_by_template.clone()
    }

    /// Sandboxes per template (templates with none are absent).
    pub(crate) fn by_template(&self) -> HashMap<String, u64> {
        self.by_template.clone()
    }

    /// The images at least one sandbox runs.
    pub(crate) fn images(&self) -> HashSet<String> {
        self.by_image.keys().cloned().collect()
    }
}

fn bump(counts: &mut HashMap<String, u64>, key: &str) {
    match counts.get_mut(key) {
        Some(n) => *n += 1,
        None => {
            counts.insert(key.to_string(), 1);
        }
    }
}

fn drop_one(counts: &mut HashMap<String, u64>, key: &str) {
    if let Some(n) = counts.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            counts.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_joins_and_leaves() {
        let mut h = HeldCounts::default();
        h.add("bb", "busybox", false);
        h.add("bb", "busybox", true);
        h.add("py", "python", false);
        assert_eq!(h.by_template(), HashMap::from([("bb".into(), 2), ("py".into(), 1)]));
        assert_eq!(h.images(), HashSet::from(["busybox".into(), "python".into()]));
        assert_eq!(h.paused_by_template(), HashMap::from([("bb".into(), 1)]));
        h.pause("py", true);
        h.pause("bb", false);
        assert_eq!(h.paused_by_template(), HashMap::from([("py".into(), 1)]));
        h.remove("py", "python", true);
        h.remove("bb", "busybox", false);
        assert_eq!(h.by_template(), HashMap::from([("bb".into(), 1)]));
        assert_eq!(h.images(), HashSet::from(["busybox".into()]));
        assert!(h.paused_by_template().is_empty());
        // A leave never seen joining (cannot happen under the map's lock) changes nothing.
        h.remove("zz", "none", true);
        h.remove("bb", "busybox", false);
        assert!(h.by_template().is_empty() && h.images().is_empty() && h.paused_by_template().is_empty());
    }
}

//! Which containerd shim each sandbox shares.
//!
//! Docker runs one `containerd-shim-runc-v2` per container, and an idle shim costs the node
//! ~0.35 ms of CPU a second and 11 threads whatever it serves: at 2,000 idle sandboxes that is
//! most of a 2-core node (BENCHMARKS.md, "What an idle sandbox costs"). containerd's runc shim
//! serves many containers when their specs name one group (`io.containerd.runc.v2.group`, how
//! Kubernetes pods share one); Docker 20.10 passes no annotations, so the node names the group
//! in the container's environment (`agent_proto::layout::SHIM_GROUP_ENV`) and `sandpool-shim`,
//! found first on containerd's `PATH`, copies it into the spec's annotations before handing
//! over to the real shim.
//!
//! A group's shim exits when its last container is deleted, and containerd hands a new
//! member the address of a shim that is still bound but shutting down: that member's start
//! fails. So this module keeps every group alive across its members' starts:
//! - a sandbox joins only a group that is fresh or has a started member not on its way out,
//!   and at most `size` sandboxes ever join one group (then the next is opened);
//! - creates in flight at once go to different groups, up to the node's create window
//!   (`max_creates_in_flight`) of them: a runc
//!   shim makes its containers one at a time (its `Create` holds its lock through `runc
//!   create`), so one group would serialize a burst;
//! - the removal of a group's last started member waits while any member is still starting
//!   (at most `START_WAIT`), and if it is the last of all, the group is retired: never joined
//!   again (its name is never reused);
//! - each node process names its groups afresh (`nonce`), so sandboxes made before a restart
//!   are never joined.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use crate::sync::lock;

/// The longest a removal waits for a starting member of its group (a Docker call's timeout).
const START_WAIT: Duration = Duration::from_secs(60);

/// The groups of one node's sandboxes.
pub(crate) struct ShimGroups {
    /// Sandboxes per group; 1 turns grouping off.
    size: usize,
    /// Groups taking sandboxes at once: the node's most creates in flight, so concurrent
    /// creates never wait on one shim.
    open_max: usize,
    /// Names this process's groups: `sandpool-<node>-<nonce>-<n>`.
    stem: String,
    state: Mutex<State>,
    /// Woken whenever a member stops starting (started, failed or removed).
    settled: Notify,
}

#[derive(Default)]
struct State {
    /// The groups new sandboxes join while they take them, oldest first.
    open: Vec<u64>,
    next: u64,
    groups: HashMap<u64, Group>,
    /// The group of each container made in one, and whether it started.
    members: HashMap<String, Member>,
}

#[derive(Default)]
struct Group {
    /// Sandboxes that ever joined.
    joined: usize,
    /// Members being created or started.
    starting: usize,
    /// Started members not being removed.
    started: usize,
    /// A member started once (so `started == 0` now means its shim may be going away).
    ever_started: bool,
}

#[derive(Clone, Copy)]
struct Member {
    group: u64,
    started: bool,
}

/// A sandbox's place in a group while its container is made: `created` once the container
/// exists; dropped without, the place is given back.
#[must_use]
pub(crate) struct Ticket {
    groups: Arc<ShimGroups>,
    group: u64,
    /// The value of `SHIM_GROUP_ENV` for the container.
    pub(crate) name: String,
    /// Taken by `created`.
    held: bool,
}

impl Ticket {
    /// The ticket's container exists (not started yet).
    pub(crate) fn created(mut self, container: &str) {
        self.held = false;
        let member = Member { group: self.group, started: false };
        lock(&self.groups.state).members.insert(container.to_string(), member);
    }
}

impl Drop for Ticket {
    /// The container was never made.
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        lock(&self.groups.state).start_ended(self.group, false);
        self.groups.settled.notify_waiters();
    }
}

impl ShimGroups {
    /// Groups of `size` sandboxes for node `node` (1: no grouping), `open` of them taking
    /// sandboxes at once.
    pub(crate) fn new(node: &str, size: usize, open: usize) -> Arc<ShimGroups> {
        let safe: String =
            node.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c } else { '-' }).collect();
        let nonce: u32 = rand::random();
        Arc::new(ShimGroups {
            size,
            open_max: open.max(1),
            stem: format!("sandpool-{safe}-{nonce:08x}"),
            state: Mutex::default(),
            settled: Notify::new(),
        })
    }

    /// A place for a new sandbox, or `None` when grouping is off.
    pub(crate) fn join(self: &Arc<Self>) -> Option<Ticket> {
        if self.size <= 1 {
            return None;
        }
        let mut st = lock(&self.state);
        let takes = |g: &Group| g.joined < self.size && (g.started > 0 || !g.ever_started);
        let State { open, groups, next, .. } = &mut *st;
        open.retain(|g| groups.get(g).is_some_and(takes));
        // The oldest open group with no create in flight; else a new one while fewer than
        // `open_max` are open; else the open group with the fewest in flight.
        let idle = open.iter().copied().find(|g| groups[g].starting == 0);
        let group = match idle {
            Some(g) => g,
            None if open.len() < self.open_max => {
                let g = *next;
                *next += 1;
                groups.insert(g, Group::default());
                open.push(g);
                g
            }
            None => *open.iter().min_by_key(|g| groups[g].starting).expect("groups are open"),
        };
        let entry = st.groups.get_mut(&group).expect("the group was just found or made");
        entry.joined += 1;
        entry.starting += 1;
        Some(Ticket { groups: Arc::clone(self), group, name: format!("{}-{group}", self.stem), held: true })
    }

    /// `container` started (its shim holds it), or failed to.
    pub(crate) fn start_ended(&self, container: &str, ok: bool) {
        let mut st = lock(&self.state);
        let Some(member) = st.members.get_mut(container).filter(|m| !m.started) else { return };
        let group = member.group;
        if ok {
            member.started = true;
        } else {
            st.members.remove(container);
        }
        st.start_ended(group, ok);
        drop(st);
        self.settled.notify_waiters();
    }

    /// `container` is about to be removed: returns once its removal cannot take its group's
    /// shim away from a member still starting (at once unless it is its group's last started
    /// member and another is starting).
    pub(crate) async fn leave(&self, container: &str) {
        let Member { group, started } = {
            let mut st = lock(&self.state);
            let Some(member) = st.members.remove(container) else { return };
            if member.started {
                if let Some(g) = st.groups.get_mut(&member.group) {
                    g.started -= 1;
                }
                st.retire_if_empty(member.group);
            } else {
                st.start_ended(member.group, false);
            }
            member
        };
        self.settled.notify_waiters();
        if !started {
            // No task in the shim: its removal cannot end the shim.
            return;
        }
        let waited = tokio::time::timeout(START_WAIT, async {
            loop {
                let settled = self.settled.notified();
                tokio::pin!(settled);
                settled.as_mut().enable();
                {
                    let st = lock(&self.state);
                    match st.groups.get(&group) {
                        Some(g) if g.started == 0 && g.starting > 0 => {}
                        _ => return,
                    }
                }
                settled.await;
            }
        })
        .await;
        if waited.is_err() {
            tracing::warn!(container, "removing a shim group's last member while another still starts");
        }
    }

    /// Sandboxes in groups, and the groups (for tests and the log).
    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        let st = lock(&self.state);
        (st.members.len(), st.groups.len())
    }
}

impl State {
    /// A member of `group` stopped starting: in its shim (`ok`), or never to be.
    fn start_ended(&mut self, group: u64, ok: bool) {
        if let Some(g) = self.groups.get_mut(&group) {
            g.starting -= 1;
            if ok {
                g.started += 1;
                g.ever_started = true;
            }
        }
        self.retire_if_empty(group);
    }

    /// Forgets `group` once nothing is in it: its shim goes, and nothing joins it again.
    fn retire_if_empty(&mut self, group: u64) {
        if self.groups.get(&group).is_some_and(|g| g.started == 0 && g.starting == 0 && g.joined > 0) {
            self.groups.remove(&group);
            self.open.retain(|&g| g != group);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// Runs `f` to its end on a runtime of its own (`leave` waits on tokio's clock).
    fn block<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(f)
    }

    fn started(groups: &Arc<ShimGroups>, container: &str) -> String {
        let t = groups.join().unwrap();
        let name = t.name.clone();
        t.created(container);
        groups.start_ended(container, true);
        name
    }

    #[test]
    fn sandboxes_fill_a_group_then_the_next_and_a_size_of_one_groups_nothing() {
        assert!(ShimGroups::new("n1", 1, 4).join().is_none());
        let groups = ShimGroups::new("node/1", 3, 4);
        let names: Vec<String> = (0..7).map(|i| started(&groups, &format!("c{i}"))).collect();
        assert!(names[0].starts_with("sandpool-node-1-"), "{}", names[0]);
        assert_eq!(names[0], names[2]);
        assert_ne!(names[2], names[3]);
        assert_eq!(names[3], names[5]);
        assert_ne!(names[5], names[6]);
        assert_eq!(groups.counts(), (7, 3));
        // Leaving frees no place: a group takes `size` sandboxes in its life.
        block(groups.leave("c6"));
        assert_eq!(groups.counts(), (6, 2));
        let next = started(&groups, "c7");
        assert_ne!(next, names[6], "a retired group is never joined again");
    }

    #[test]
    fn creates_in_flight_at_once_go_to_different_groups() {
        const OPEN: usize = 4;
        let groups = ShimGroups::new("n", 32, OPEN);
        let tickets: Vec<Ticket> = (0..OPEN + 2).map(|_| groups.join().unwrap()).collect();
        let names: HashSet<&str> = tickets.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names.len(), OPEN, "at most {OPEN} groups open");
        for (i, t) in tickets.into_iter().enumerate() {
            let c = format!("c{i}");
            t.created(&c);
            groups.start_ended(&c, true);
        }
        // One at a time again: the oldest open group takes them.
        let first = started(&groups, "d0");
        assert_eq!(started(&groups, "d1"), first);
        assert_eq!(groups.counts(), (OPEN + 4, OPEN));
    }

    #[test]
    fn a_group_whose_started_members_all_left_takes_no_one() {
        let groups = ShimGroups::new("n", 8, 4);
        let first = started(&groups, "a");
        // b is starting in a's group; a leaves: the group has no started member now.
        let b = groups.join().unwrap();
        assert_eq!(b.name, first);
        b.created("b");
        let leaving = std::thread::scope(|s| {
            let h = s.spawn(|| block(groups.leave("a")));
            std::thread::sleep(Duration::from_millis(50));
            // A newcomer goes elsewhere while a's removal waits for b.
            let c = groups.join().unwrap();
            let other = c.name.clone();
            drop(c);
            assert!(!h.is_finished(), "the last started member's removal waits while b starts");
            groups.start_ended("b", true);
            h.join().unwrap();
            other
        });
        assert_ne!(leaving, first);
    }

    #[test]
    fn a_failed_start_or_create_leaves_no_count_behind() {
        let groups = ShimGroups::new("n", 4, 4);
        drop(groups.join().unwrap());
        groups.join().unwrap().created("x");
        groups.start_ended("x", false);
        assert_eq!(groups.counts(), (0, 0));
        // A removal of a member that never started does not wait.
        groups.join().unwrap().created("y");
        block(groups.leave("y"));
        block(groups.leave("unknown"));
        assert_eq!(groups.counts(), (0, 0));
    }
}

//! Images on nodes: which node holds (or is pulling) which image, the pulls themselves, and where a
//! template's creates go.
//!
//! A node holds an image once it has pulled it, and keeps it (no eviction: in the long-tail mix an image's
//! task is over long before a disk budget would matter). A create on a node without its template's image
//! starts the pull there, unless one is under way, and finishes `pull + create latency` after it started;
//! every create that needs the image meanwhile waits for the same pull (one pull per image per node). A
//! node runs at most [`super::NodeSpec::max_pulls_in_flight`] pulls, the rest queue in order, and the pulls
//! in flight share the node equally (processor sharing): four pulls of 250 ms started together all finish
//! after about a second, as four `docker pull`s from the local registry did here.
//!
//! Placement prefers the image: an image's places are the nodes that hold or are pulling it, or, while
//! there are none, its rendezvous node (highest hash of node and image: what the gateway's prefetch picks).
//! An on-demand create goes to one of those if it has room, and a template's idle target is moved onto one
//! of them (with [`super::SimConfig::place_by_image`]); a declared reservation's images start pulling when
//! it is announced.

use std::collections::VecDeque;

use super::rng::SimRng;
use super::{Ev, Sim};

/// The node neither holds the image nor is pulling it.
pub(super) const ABSENT: u8 = 0;
/// Queued or in flight on the node.
pub(super) const PULLING: u8 = 1;
/// The node holds it.
pub(super) const PRESENT: u8 = 2;

/// Finished pulls are those with at most this much work left (float rounding), ms.
const DONE_EPS_MS: f64 = 1e-6;

/// One node's pulls.
#[derive(Clone, Debug, Default)]
pub(super) struct Pulls {
    /// In flight: (image, work left in ms of a pull alone on the node).
    active: Vec<(usize, f64)>,
    /// Waiting for a slot, in order.
    queue: VecDeque<usize>,
    /// When `active`'s work was last brought up to date.
    at: u64,
    /// Bumped whenever the next completion is rescheduled; a `PullDone` of an older generation is stale.
    generation: u64,
}

impl Sim<'_> {
    pub(super) fn img_slot(&self, image: usize, n: usize) -> usize {
        image * self.n + n
    }

    /// Whether node `n` holds `image` or is pulling it.
    pub(super) fn has_or_pulls(&self, image: usize, n: usize) -> bool {
        self.img_state[self.img_slot(image, n)] != ABSENT
    }

    /// The image's rendezvous node: highest hash of (image, node).
    pub(super) fn rendezvous(&self, image: usize) -> usize {
        (0..self.n)
            .max_by_key(|&n| (SimRng::new(((image as u64) << 20) ^ n as u64 ^ 0x1A6E_0000_0000).next_u64(), n))
            .unwrap_or(0)
    }

    /// Where `image` should be used: the nodes that hold or pull it, else its rendezvous node.
    pub(super) fn image_places(&self, image: usize) -> Vec<usize> {
        let places: Vec<usize> = (0..self.n).filter(|&n| self.has_or_pulls(image, n)).collect();
        if places.is_empty() { vec![self.rendezvous(image)] } else { places }
    }

    /// Whether node `n` should leave an on-demand create of template `t` to another node: `t`'s image is
    /// elsewhere (or belongs elsewhere) and that node has room.
    pub(super) fn leave_to_image_place(&self, n: usize, t: usize) -> bool {
        let Some(image) = self.img_of[t] else { return false };
        let places = self.image_places(image);
        !places.contains(&n) && places.iter().any(|&m| self.has_room(m, t))
    }

    /// Move template `t`'s idle targets on nodes that are not among its image's places onto the first place
    /// with room (none with room: leave them where the policy put them).
    pub(super) fn place_targets_by_image(&mut self, t: usize) {
        let Some(image) = self.img_of[t] else { return };
        let places = self.image_places(image);
        let Some(dest) = places.iter().copied().find(|&m| self.has_room(m, t)) else { return };
        let mut moved = 0;
        for m in (0..self.n).filter(|m| !places.contains(m)) {
            let p = self.pool_of(t, m);
            moved += std::mem::take(&mut self.pools[p].target);
        }
        if moved > 0 {
            let p = self.pool_of(t, dest);
            if self.pools[p].target == 0 {
                self.targeted.push(p);
            }
            self.pools[p].target += moved;
        }
    }

    /// A create of pool `p` on node `n` that needs `image`: it waits for the image's pull there (started
    /// now if none is under way); false when the node holds the image and the create can start at once.
    pub(super) fn wait_for_image(&mut self, n: usize, image: usize, p: usize, ondemand: bool) -> bool {
        let slot = self.img_slot(image, n);
        match self.img_state[slot] {
            PRESENT => false,
            state => {
                if state == ABSENT {
                    self.start_pull(n, image);
                }
                self.pending[slot].push((p, ondemand));
                true
            }
        }
    }

    /// Start pulling `image` onto node `n` (queued behind the node's slots if they are all taken).
    pub(super) fn start_pull(&mut self, n: usize, image: usize) {
        let slot = self.img_slot(image, n);
        if self.img_state[slot] != ABSENT {
            return;
        }
        self.img_state[slot] = PULLING;
        if self.in_window(self.now) {
            self.pulls_started += 1;
        }
        if self.pulls[n].active.len() < self.cfg.nodes[n].max_pulls_in_flight.max(1) {
            self.progress_pulls(n);
            let work = self.trace.images[image].pull_ms as f64;
            self.pulls[n].active.push((image, work));
            self.schedule_pull(n);
        } else {
            self.pulls[n].queue.push_back(image);
        }
    }

    /// The images a declared reservation of template `t` needs start pulling now (onto their place).
    pub(super) fn prefetch(&mut self, t: usize) {
        if let Some(image) = self.img_of[t]
            && (0..self.n).all(|n| !self.has_or_pulls(image, n))
        {
            let n = self.rendezvous(image);
            self.start_pull(n, image);
        }
    }

    /// Bring the work left of node `n`'s pulls up to now: each of `k` pulls in flight advanced `1/k` per ms.
    fn progress_pulls(&mut self, n: usize) {
        let now = self.now;
        let pulls = &mut self.pulls[n];
        let k = pulls.active.len();
        if k > 0 {
            let done = now.saturating_sub(pulls.at) as f64 / k as f64;
            for a in &mut pulls.active {
                a.1 -= done;
            }
        }
        pulls.at = now;
    }

    /// Schedule node `n`'s next pull completion (invalidating any earlier one).
    fn schedule_pull(&mut self, n: usize) {
        let pulls = &mut self.pulls[n];
        pulls.generation += 1;
        let k = pulls.active.len() as f64;
        let Some(least) = pulls.active.iter().map(|a| a.1).min_by(f64::total_cmp) else { return };
        let at = self.now + (least.max(0.0) * k).ceil() as u64;
        let generation = pulls.generation;
        self.push(at, Ev::PullDone { node: n, generation });
    }

    /// A pull completion on node `n`: the images done are held, their waiting creates go on, queued pulls
    /// take the free slots.
    pub(super) fn pull_done(&mut self, n: usize, generation: u64) {
        if self.pulls[n].generation != generation {
            return;
        }
        self.progress_pulls(n);
        let least = self.pulls[n].active.iter().map(|a| a.1).min_by(f64::total_cmp).unwrap_or(0.0);
        let limit = least.max(DONE_EPS_MS);
        let mut done = Vec::new();
        self.pulls[n].active.retain(|&(image, left)| {
            let finished = left <= limit;
            if finished {
                done.push(image);
            }
            !finished
        });
        let latency = self.cfg.nodes[n].create_latency_ms;
        for image in done {
            let slot = self.img_slot(image, n);
            self.img_state[slot] = PRESENT;
            for (p, ondemand) in std::mem::take(&mut self.pending[slot]) {
                self.push(self.now + latency, Ev::CreateDone { pool: p, ondemand });
            }
        }
        let max = self.cfg.nodes[n].max_pulls_in_flight.max(1);
        while self.pulls[n].active.len() < max {
            let Some(image) = self.pulls[n].queue.pop_front() else { break };
            let work = self.trace.images[image].pull_ms as f64;
            self.pulls[n].active.push((image, work));
        }
        self.schedule_pull(n);
    }
}

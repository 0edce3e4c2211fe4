// One file because the event loop, the node model and the scoring of one replay are one
// mechanism; its traces and benches live in `sim/`, and the images on nodes in `sim/images.rs`.
//! A discrete-event simulator that replays a trace against a policy on a virtual clock.
//!
//! The model: each node has a create budget (token bucket at its measured rate) and a create latency, and
//! a capacity (sandbox count and memory). Every tick the policy sees an [`Observation`] and returns idle
//! targets; nodes destroy idle sandboxes beyond their target at once and create towards it within the
//! budget (on-demand creates for waiting requests first, then refills, round-robin over pools). A request
//! takes an idle sandbox of its template from the node with most of them (a warm hit, wait 0), or waits
//! FIFO for the next sandbox of its template to finish creating; an on-demand create is started for it
//! unless enough are already in flight. If a node is full, an on-demand create evicts an idle sandbox of
//! the template whose last arrival is oldest. A sandbox is single-use: the episode's end destroys it.
//! Templates made from registry images ([`trace::TemplateSpec::image`]) need their image on the node: the
//! first create there pulls it, and placement prefers the nodes that hold it (`sim/images.rs`). Declared
//! reservations start their images' pulls when they are announced.
//! Nothing here reads a clock or an unseeded random source, so a run is a pure function of its inputs.

pub mod bench;
mod images;
mod oracle;
pub mod rng;
pub mod trace;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};

use serde::{Deserialize, Serialize};

pub use oracle::oracle;
pub use trace::Trace;

use crate::policy::Policy;
use crate::signals::{HISTORY_HORIZON_MS, NodeSignals, Observation, PoolKey, PoolSignals, TemplateSignals};

/// Creates per second one 2-core node sustains (measured here: about 4 `docker run`s per second in parallel).
pub const CREATE_RATE_PER_S: f64 = 4.0;
/// Token-bucket depth: one second's worth, so a tick can start a second of creates at once.
pub const CREATE_BURST: f64 = 4.0;
/// `docker run` here takes 400-560 ms.
pub const CREATE_LATENCY_MS: u64 = 500;
/// Sandboxes per node: 5,000 idle runc sandboxes (~4 MiB each) fit a 24 GiB node with room to spare.
pub const NODE_MAX_SANDBOXES: u32 = 5_000;
/// Memory per node offered to sandboxes: this machine's 24 GiB.
pub const NODE_MEMORY_MIB: u64 = 24 * 1_024;
/// Nodes: 1,000 episodes per 5 minutes at DSec's lengths settle near 6,400 concurrent leases, more than one
/// node's 5,000, so the default cluster is two nodes like this machine.
pub const NODES: usize = 2;
/// The autoscaler's tick.
pub const TICK_MS: u64 = 1_000;
/// After the scored window, waiting requests are still served for up to this long (then counted unserved).
pub const DRAIN_LIMIT_MS: u64 = 30 * 60 * 1_000;
/// Pulls one node runs at once (sandpool's `images.max_pulls_in_flight` default).
pub const MAX_PULLS_IN_FLIGHT: usize = 4;
/// A declared reservation is met if its count is idle at `ready_by`, counting the sandboxes its template's
/// arrivals took warm this long before (trainers start a little early; the planner's `EARLY_S`).
pub const READY_EARLY_MS: u64 = 10_000;

/// One simulated node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeSpec {
    /// Node id.
    pub id: String,
    /// Most sandboxes (any state).
    pub max_sandboxes: u32,
    /// Memory for sandboxes, MiB.
    pub memory_mib: u64,
    /// Sustained creates per second.
    pub create_rate_per_s: f64,
    /// Token-bucket depth, creates.
    pub create_burst: f64,
    /// Create latency, ms.
    pub create_latency_ms: u64,
    /// Image pulls the node runs at once (they share it); more wait their turn.
    #[serde(default = "default_max_pulls")]
    pub max_pulls_in_flight: usize,
}

fn default_max_pulls() -> usize {
    MAX_PULLS_IN_FLIGHT
}

fn yes() -> bool {
    true
}

impl Default for NodeSpec {
    fn default() -> Self {
        Self {
            id: "node-1".into(),
            max_sandboxes: NODE_MAX_SANDBOXES,
            memory_mib: NODE_MEMORY_MIB,
            create_rate_per_s: CREATE_RATE_PER_S,
            create_burst: CREATE_BURST,
            create_latency_ms: CREATE_LATENCY_MS,
            max_pulls_in_flight: MAX_PULLS_IN_FLIGHT,
        }
    }
}

/// The simulated cluster and clock.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimConfig {
    /// Nodes, in a stable order.
    pub nodes: Vec<NodeSpec>,
    /// Policy tick, ms.
    pub tick_ms: u64,
    /// How long waiting requests are still served after the scored window, ms.
    pub drain_limit_ms: u64,
    /// Idle targets of a template made from an image are moved onto a node that holds or pulls the image (or
    /// will: its rendezvous node). Off, they stay where the policy put them (the policies know no images),
    /// and each node a target lands on pulls the image; on-demand creates prefer the image's nodes either way.
    #[serde(default = "yes")]
    pub place_by_image: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self::with_nodes(NODES, NodeSpec::default())
    }
}

impl SimConfig {
    /// `count` nodes like `node` (ids `node-1`, `node-2`, ...).
    pub fn with_nodes(count: usize, node: NodeSpec) -> Self {
        let nodes = (1..=count).map(|i| NodeSpec { id: format!("node-{i}"), ..node.clone() }).collect();
        Self { nodes, tick_ms: TICK_MS, drain_limit_ms: DRAIN_LIMIT_MS, place_by_image: true }
    }
}

/// What one run scored over the trace's window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// Policy name.
    pub policy: String,
    /// Requests in the window.
    pub arrivals: u64,
    /// Requests served from an idle sandbox, %.
    pub warm_pct: f64,
    /// Median wait for a sandbox, ms.
    pub wait_p50_ms: u64,
    /// 99th-percentile wait, ms.
    pub wait_p99_ms: u64,
    /// Integral of idle sandboxes over the window, sandbox-seconds.
    pub idle_sandbox_s: f64,
    /// `idle_sandbox_s` over the oracle's (filled in by [`bench::run_suite`]).
    pub idle_vs_oracle: Option<f64>,
    /// Most sandboxes alive at once (idle, leased, creating) in the window.
    pub peak_sandboxes: u64,
    /// Creates started in the window.
    pub creates: u64,
    /// Requests still waiting when the run stopped (their wait counts up to then).
    pub unserved: u64,
    /// Declared reservations the policy reported infeasible at some tick.
    pub infeasible_reservations: u64,
    /// Image pulls started in the window (one per image per node).
    #[serde(default)]
    pub pulls: u64,
    /// Declared reservations with `ready_by` in the window that did not have their count idle by then
    /// (see [`READY_EARLY_MS`]); 0 when nothing is declared.
    #[serde(default)]
    pub late_reservations: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Pool {
    idle: u32,
    leased: u32,
    refill: u32,
    ondemand: u32,
    target: u32,
    queued: bool,
    dirty: bool,
    in_idle_list: bool,
}

#[derive(Clone, Debug)]
struct Node {
    spec: NodeSpec,
    tokens: f64,
    tokens_at: u64,
    used: u32,
    mem: u64,
    pump_at: Option<u64>,
    refill_q: VecDeque<usize>,
}

#[derive(Clone, Debug, Default)]
struct Tmpl {
    queue: VecDeque<usize>,
    creating: u32,
    mem: u64,
    dirty: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Tick,
    CreateDone {
        pool: usize,
        ondemand: bool,
    },
    End(usize),
    Pump(usize),
    /// A node's pull completion (stale unless `generation` is still the node's).
    PullDone {
        node: usize,
        generation: u64,
    },
    /// A declared reservation's `ready_by` (index into [`Trace::declared`]): was it met?
    Ready(usize),
}

/// What the trainer's declarations (the trace's [`Trace::declared`]) do in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Declare {
    /// Nothing: the trainer declares nothing.
    #[default]
    Nothing,
    /// Only the images: at announce the declared templates are registered and their images start pulling
    /// (`POST /v1/images:prefetch` by template); the policy sees no reservation.
    Prefetch,
    /// Reservations: from announce the policy sees them, and their templates' images start pulling then.
    Reservations,
}

/// Replay `trace` against `policy` on the cluster of `cfg`. With `declare`, the trace's declared
/// reservations are shown to the policy from their announce time (and their images pulled from then).
pub fn simulate(cfg: &SimConfig, trace: &Trace, policy: &mut dyn Policy, declare: bool) -> RunReport {
    simulate_declaring(cfg, trace, policy, if declare { Declare::Reservations } else { Declare::Nothing })
}

/// [`simulate`], with the trainer's declarations used as `declare` says.
pub fn simulate_declaring(cfg: &SimConfig, trace: &Trace, policy: &mut dyn Policy, declare: Declare) -> RunReport {
    let mut sim = Sim::new(cfg, trace, declare);
    sim.run(policy);
    sim.report(policy.name())
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    trace: &'a Trace,
    declare: Declare,
    n: usize,
    now: u64,
    seq: u64,
    events: BinaryHeap<Reverse<(u64, u64, Ev)>>,
    nodes: Vec<Node>,
    pools: Vec<Pool>,
    tmpls: Vec<Tmpl>,
    ondemand: VecDeque<usize>,
    obs: Observation,
    keys: Vec<PoolKey>,
    tmpl_idx: HashMap<String, usize>,
    node_idx: HashMap<String, usize>,
    dirty_pools: Vec<usize>,
    dirty_tmpls: Vec<usize>,
    targeted: Vec<usize>,
    /// Templates in `obs`, and those not yet registered in order of `appears_ms`.
    registered: Vec<bool>,
    live_tmpls: Vec<usize>,
    to_appear: VecDeque<usize>,
    /// Per template: last arrival, ms (for eviction order).
    last_arrival: Vec<Option<u64>>,
    /// Per node: pools that may hold idle sandboxes (entries with none are dropped lazily).
    idle_lists: Vec<Vec<usize>>,
    /// Per template: index of its image in `trace.images`, if it is made from one.
    img_of: Vec<Option<usize>>,
    /// Per (image, node), at `image * n + node`: [`images::ABSENT`], `PULLING` or `PRESENT`.
    img_state: Vec<u8>,
    /// Per (image, node): creates `(pool, ondemand)` waiting for the image's pull there.
    pending: Vec<Vec<(usize, bool)>>,
    /// Per node: its pulls.
    pulls: Vec<images::Pulls>,
    /// Declared reservations in order of announce, and how many of them have been announced.
    declared_order: Vec<usize>,
    announced: usize,
    /// Per arrival: served from an idle sandbox.
    served_warm: Vec<bool>,
    // Scoring.
    waits: Vec<u64>,
    warm: u64,
    idle_total: u64,
    idle_ms: f64,
    accounted_to: u64,
    live: u64,
    peak: u64,
    creates: u64,
    unserved: u64,
    infeasible: HashSet<(String, u64)>,
    pulls_started: u64,
    late: u64,
}

impl<'a> Sim<'a> {
    fn new(cfg: &'a SimConfig, trace: &'a Trace, declare: Declare) -> Self {
        let n = cfg.nodes.len();
        let nodes_obs: Vec<NodeSignals> = cfg
            .nodes
            .iter()
            .map(|s| NodeSignals {
                node: s.id.clone(),
                max_sandboxes: s.max_sandboxes,
                memory_mib: s.memory_mib,
                create_rate_per_s: s.create_rate_per_s,
                create_latency_ms: s.create_latency_ms,
            })
            .collect();
        let obs = Observation::new(0, nodes_obs);
        let mut to_appear: Vec<usize> = (0..trace.templates.len()).collect();
        to_appear.sort_by_key(|t| (trace.templates[*t].appears_ms, *t));
        let keys = trace
            .templates
            .iter()
            .flat_map(|t| cfg.nodes.iter().map(move |nd| PoolKey::new(t.name.clone(), nd.id.clone())))
            .collect();
        let images = trace.images.len();
        let mut declared_order: Vec<usize> = (0..trace.declared.len()).collect();
        declared_order.sort_by_key(|i| (trace.declared[*i].announce_ms, *i));
        Self {
            cfg,
            trace,
            declare,
            n,
            now: 0,
            seq: 0,
            events: BinaryHeap::new(),
            nodes: cfg
                .nodes
                .iter()
                .map(|s| Node {
                    spec: s.clone(),
                    tokens: s.create_burst.max(1.0),
                    tokens_at: 0,
                    used: 0,
                    mem: 0,
                    pump_at: None,
                    refill_q: VecDeque::new(),
                })
                .collect(),
            pools: vec![Pool::default(); trace.templates.len() * n],
            tmpls: trace.templates.iter().map(|t| Tmpl { mem: u64::from(t.memory_mib), ..Tmpl::default() }).collect(),
            ondemand: VecDeque::new(),
            obs,
            keys,
            tmpl_idx: trace.templates.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect(),
            node_idx: cfg.nodes.iter().enumerate().map(|(i, s)| (s.id.clone(), i)).collect(),
            dirty_pools: Vec::new(),
            dirty_tmpls: Vec::new(),
            targeted: Vec::new(),
            registered: vec![false; trace.templates.len()],
            live_tmpls: Vec::new(),
            to_appear: to_appear.into(),
            last_arrival: vec![None; trace.templates.len()],
            idle_lists: vec![Vec::new(); n],
            img_of: trace.templates.iter().map(|t| t.image.filter(|i| *i < images)).collect(),
            img_state: vec![images::ABSENT; images * n],
            pending: vec![Vec::new(); images * n],
            pulls: vec![images::Pulls::default(); n],
            declared_order,
            announced: 0,
            served_warm: vec![false; trace.arrivals.len()],
            waits: Vec::new(),
            warm: 0,
            idle_total: 0,
            idle_ms: 0.0,
            accounted_to: 0,
            live: 0,
            peak: 0,
            creates: 0,
            unserved: 0,
            infeasible: HashSet::new(),
            pulls_started: 0,
            late: 0,
        }
    }

    fn in_window(&self, t: u64) -> bool {
        t >= self.trace.warmup_ms && t < self.trace.end_ms
    }

    fn push(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, ev)));
    }

    fn run(&mut self, policy: &mut dyn Policy) {
        self.push(0, Ev::Tick);
        if self.declare == Declare::Reservations {
            for (i, d) in self.trace.declared.iter().enumerate() {
                self.push(d.reservation.ready_by_ms, Ev::Ready(i));
            }
        }
        let mut next_arrival = 0usize;
        loop {
            let heap_at = self.events.peek().map(|Reverse((t, _, _))| *t);
            let arr_at = self.trace.arrivals.get(next_arrival).map(|a| a.at_ms);
            let take_arrival = match (heap_at, arr_at) {
                (None, None) => break,
                (Some(h), Some(a)) => a < h,
                (None, Some(_)) => true,
                (Some(_), None) => false,
            };
            let at = if take_arrival { arr_at } else { heap_at }.unwrap_or(self.now);
            self.advance(at);
            if take_arrival {
                self.arrival(next_arrival);
                next_arrival += 1;
            } else if let Some(Reverse((_, _, ev))) = self.events.pop() {
                match ev {
                    Ev::Tick => {
                        if self.tick(policy) {
                            break;
                        }
                    }
                    Ev::CreateDone { pool, ondemand } => self.create_done(pool, ondemand),
                    Ev::End(pool) => self.end(pool),
                    Ev::Pump(node) => {
                        if self.nodes[node].pump_at == Some(self.now) {
                            self.nodes[node].pump_at = None;
                        }
                        self.pump(node);
                    }
                    Ev::PullDone { node, generation } => self.pull_done(node, generation),
                    Ev::Ready(i) => self.check_ready(i),
                }
            }
            if self.in_window(self.now) {
                self.peak = self.peak.max(self.live);
            }
        }
        // Whoever still waits is unserved; their wait runs to the stop.
        for t in 0..self.tmpls.len() {
            while let Some(i) = self.tmpls[t].queue.pop_front() {
                let a = self.trace.arrivals[i];
                if self.in_window(a.at_ms) {
                    self.unserved += 1;
                    self.waits.push(self.now.saturating_sub(a.at_ms));
                }
            }
        }
        self.advance(self.now.max(self.trace.end_ms));
    }

    /// Move the clock, integrating idle sandboxes over the scored window.
    fn advance(&mut self, to: u64) {
        let from = self.accounted_to.max(self.trace.warmup_ms);
        let until = to.min(self.trace.end_ms);
        if until > from {
            self.idle_ms += self.idle_total as f64 * (until - from) as f64;
        }
        self.accounted_to = self.accounted_to.max(to);
        self.now = self.now.max(to);
    }

    fn pool_of(&self, t: usize, n: usize) -> usize {
        t * self.n + n
    }

    fn touch_pool(&mut self, p: usize) {
        if !self.pools[p].dirty {
            self.pools[p].dirty = true;
            self.dirty_pools.push(p);
        }
    }

    fn touch_tmpl(&mut self, t: usize) {
        if !self.tmpls[t].dirty {
            self.tmpls[t].dirty = true;
            self.dirty_tmpls.push(t);
        }
    }

    fn enqueue_refill(&mut self, p: usize) {
        let pool = &self.pools[p];
        if !pool.queued && pool.target > pool.idle + pool.refill {
            self.pools[p].queued = true;
            self.nodes[p % self.n].refill_q.push_back(p);
        }
    }

    fn lease(&mut self, p: usize, arrival: usize) {
        let a = self.trace.arrivals[arrival];
        self.pools[p].leased += 1;
        self.touch_pool(p);
        self.push(self.now + a.duration_ms, Ev::End(p));
        if self.in_window(a.at_ms) {
            self.waits.push(self.now - a.at_ms);
        }
    }

    fn arrival(&mut self, i: usize) {
        let a = self.trace.arrivals[i];
        let t = a.template;
        let scored = self.in_window(a.at_ms);
        self.register(t);
        self.last_arrival[t] = Some(self.now);
        let name = &self.trace.templates[t].name;
        let best = (0..self.n).map(|n| self.pool_of(t, n)).max_by_key(|p| (self.pools[*p].idle, Reverse(*p)));
        let warm = best.filter(|p| self.pools[*p].idle > 0);
        if let Some(ts) = self.obs.templates.get_mut(name) {
            ts.arrivals.record(self.now, 1);
            if warm.is_none() {
                ts.cold_starts += 1;
            }
        }
        match warm {
            Some(p) => {
                self.pools[p].idle -= 1;
                self.idle_total -= 1;
                self.served_warm[i] = true;
                if scored {
                    self.warm += 1;
                }
                self.lease(p, i);
                self.enqueue_refill(p);
                self.pump(p % self.n);
            }
            None => {
                self.tmpls[t].queue.push_back(i);
                self.touch_tmpl(t);
                if self.tmpls[t].queue.len() > self.tmpls[t].creating as usize {
                    self.ondemand.push_back(t);
                }
                for n in 0..self.n {
                    self.pump(n);
                }
            }
        }
    }

    fn create_done(&mut self, p: usize, ondemand: bool) {
        let t = p / self.n;
        if ondemand {
            self.pools[p].ondemand -= 1;
        } else {
            self.pools[p].refill -= 1;
        }
        self.tmpls[t].creating -= 1;
        self.touch_pool(p);
        if let Some(i) = self.tmpls[t].queue.pop_front() {
            self.touch_tmpl(t);
            self.lease(p, i);
            self.enqueue_refill(p);
            self.pump(p % self.n);
        } else {
            self.pools[p].idle += 1;
            self.idle_total += 1;
            if !self.pools[p].in_idle_list {
                self.pools[p].in_idle_list = true;
                self.idle_lists[p % self.n].push(p);
            }
        }
    }

    fn end(&mut self, p: usize) {
        self.pools[p].leased -= 1;
        self.touch_pool(p);
        self.free(p);
        self.pump(p % self.n);
    }

    /// Release one sandbox's place on its node.
    fn free(&mut self, p: usize) {
        let (n, mem) = (p % self.n, self.tmpls[p / self.n].mem);
        self.nodes[n].used -= 1;
        self.nodes[n].mem = self.nodes[n].mem.saturating_sub(mem);
        self.live -= 1;
    }

    fn destroy_idle(&mut self, p: usize, k: u32) {
        for _ in 0..k {
            self.pools[p].idle -= 1;
            self.idle_total -= 1;
            self.free(p);
        }
        self.touch_pool(p);
    }

    fn has_room(&self, n: usize, t: usize) -> bool {
        let node = &self.nodes[n];
        node.used < node.spec.max_sandboxes && node.mem + self.tmpls[t].mem <= node.spec.memory_mib
    }

    /// Make room on node `n` for template `t` by evicting idle sandboxes whose template was used longest ago.
    fn evict_for(&mut self, n: usize, t: usize) -> bool {
        while !self.has_room(n, t) {
            let mut list = std::mem::take(&mut self.idle_lists[n]);
            list.retain(|p| {
                let keep = self.pools[*p].idle > 0;
                if !keep {
                    self.pools[*p].in_idle_list = false;
                }
                keep
            });
            let victim = list.iter().copied().min_by_key(|p| (self.last_arrival[*p / self.n], *p));
            self.idle_lists[n] = list;
            match victim {
                Some(p) => self.destroy_idle(p, 1),
                None => return false,
            }
        }
        true
    }

    /// Show template `t` to the autoscaler (from its `appears_ms`, or its first arrival if earlier).
    fn register(&mut self, t: usize) {
        if self.registered[t] {
            return;
        }
        self.registered[t] = true;
        self.live_tmpls.push(t);
        let spec = &self.trace.templates[t];
        self.obs
            .templates
            .insert(spec.name.clone(), TemplateSignals { memory_mib: spec.memory_mib, ..TemplateSignals::default() });
        self.touch_tmpl(t);
    }

    /// Register templates whose time has come; forget those with no sandbox, no waiter, no reservation and
    /// no arrival within the history horizon (a long-tail image that is done).
    fn sync_templates(&mut self) {
        let now = self.now;
        while let Some(&t) = self.to_appear.front() {
            if self.trace.templates[t].appears_ms > now {
                break;
            }
            self.to_appear.pop_front();
            self.register(t);
        }
        let mut live = std::mem::take(&mut self.live_tmpls);
        live.retain(|&t| {
            let spec = &self.trace.templates[t];
            let since = self.last_arrival[t].unwrap_or(spec.appears_ms);
            let empty = self.tmpls[t].queue.is_empty()
                && (0..self.n).all(|n| {
                    let p = &self.pools[t * self.n + n];
                    p.idle == 0 && p.leased == 0 && p.refill == 0 && p.ondemand == 0
                });
            let reserved = self.obs.reservations.iter().any(|r| r.template == spec.name);
            if empty && !reserved && since + HISTORY_HORIZON_MS <= now {
                self.obs.templates.remove(&spec.name);
                self.registered[t] = false;
                false
            } else {
                true
            }
        });
        self.live_tmpls = live;
    }

    fn start_create(&mut self, n: usize, t: usize, ondemand: bool) {
        let p = self.pool_of(t, n);
        if ondemand {
            self.pools[p].ondemand += 1;
        } else {
            self.pools[p].refill += 1;
        }
        self.tmpls[t].creating += 1;
        self.nodes[n].used += 1;
        self.nodes[n].mem += self.tmpls[t].mem;
        self.live += 1;
        if self.in_window(self.now) {
            self.creates += 1;
        }
        self.touch_pool(p);
        if let Some(image) = self.img_of[t]
            && self.wait_for_image(n, image, p, ondemand)
        {
            return;
        }
        let done = self.now + self.nodes[n].spec.create_latency_ms;
        self.push(done, Ev::CreateDone { pool: p, ondemand });
    }

    /// Start as many creates on node `n` as its budget allows: on-demand first, then refills.
    fn pump(&mut self, n: usize) {
        let now = self.now;
        {
            let node = &mut self.nodes[n];
            let rate = node.spec.create_rate_per_s.max(0.0);
            let elapsed = now.saturating_sub(node.tokens_at) as f64 / 1_000.0;
            node.tokens = (node.tokens + elapsed * rate).min(node.spec.create_burst.max(1.0));
            node.tokens_at = now;
        }
        while self.nodes[n].tokens >= 1.0 {
            let mut started = false;
            // In order, except that a create whose image is (to be) on another node with room is left to it.
            let mut j = 0;
            while let Some(&t) = self.ondemand.get(j) {
                if self.tmpls[t].queue.len() <= self.tmpls[t].creating as usize {
                    self.ondemand.remove(j);
                    continue;
                }
                if self.leave_to_image_place(n, t) {
                    j += 1;
                    continue;
                }
                if self.has_room(n, t) || self.evict_for(n, t) {
                    self.ondemand.remove(j);
                    self.start_create(n, t, true);
                    started = true;
                }
                break;
            }
            if !started {
                while let Some(p) = self.nodes[n].refill_q.pop_front() {
                    self.pools[p].queued = false;
                    let pool = self.pools[p];
                    let t = p / self.n;
                    if pool.target > pool.idle + pool.refill && self.has_room(n, t) {
                        self.start_create(n, t, false);
                        self.enqueue_refill(p);
                        started = true;
                        break;
                    }
                }
            }
            if !started {
                return;
            }
            self.nodes[n].tokens -= 1.0;
        }
        let work = !self.nodes[n].refill_q.is_empty() || !self.ondemand.is_empty();
        let rate = self.nodes[n].spec.create_rate_per_s;
        if work && rate > 0.0 {
            let wait_ms = ((1.0 - self.nodes[n].tokens) / rate * 1_000.0).ceil().max(1.0) as u64;
            let at = now + wait_ms;
            if self.nodes[n].pump_at.is_none_or(|p| p > at) {
                self.nodes[n].pump_at = Some(at);
                self.push(at, Ev::Pump(n));
            }
        }
    }

    /// One autoscaler tick. Returns true when the run is over.
    fn tick(&mut self, policy: &mut dyn Policy) -> bool {
        let now = self.now;
        let waiting: usize = self.tmpls.iter().map(|t| t.queue.len()).sum();
        if now >= self.trace.end_ms && (waiting == 0 || now >= self.trace.end_ms + self.cfg.drain_limit_ms) {
            return true;
        }
        self.announce();
        self.sync_observation();
        let targets = policy.decide(&self.obs);
        for s in targets.reservations.iter().filter(|s| !s.feasible) {
            self.infeasible.insert((s.template.clone(), s.ready_by_ms));
        }
        for p in std::mem::take(&mut self.targeted) {
            self.pools[p].target = 0;
        }
        for (key, v) in &targets.idle {
            if let (Some(&t), Some(&n)) = (self.tmpl_idx.get(&key.template), self.node_idx.get(&key.node)) {
                let p = self.pool_of(t, n);
                self.pools[p].target = *v;
                self.targeted.push(p);
            }
        }
        if self.cfg.place_by_image && !self.trace.images.is_empty() {
            let mut ts: Vec<usize> = self.targeted.iter().map(|p| p / self.n).collect();
            ts.sort_unstable();
            ts.dedup();
            for t in ts {
                self.place_targets_by_image(t);
            }
        }
        for p in 0..self.pools.len() {
            let pool = self.pools[p];
            if pool.idle > pool.target {
                self.destroy_idle(p, pool.idle - pool.target);
            } else {
                self.enqueue_refill(p);
            }
        }
        for n in 0..self.n {
            self.pump(n);
        }
        self.push(now + self.cfg.tick_ms.max(1), Ev::Tick);
        false
    }

    /// Declarations announced by now: their templates are registered and their images start pulling.
    fn announce(&mut self) {
        if self.declare == Declare::Nothing {
            return;
        }
        let trace = self.trace;
        while let Some(&i) = self.declared_order.get(self.announced) {
            let d = &trace.declared[i];
            if d.announce_ms > self.now {
                break;
            }
            self.announced += 1;
            if let Some(&t) = self.tmpl_idx.get(&d.reservation.template) {
                if d.reservation.expires_ms() > self.now {
                    self.register(t);
                }
                self.prefetch(t);
            }
        }
    }

    /// A declared reservation's `ready_by`: count it late if fewer than its count are idle, crediting the
    /// arrivals of its template that took a sandbox warm in the [`READY_EARLY_MS`] before.
    fn check_ready(&mut self, i: usize) {
        let trace = self.trace;
        let r = &trace.declared[i].reservation;
        if !self.in_window(r.ready_by_ms) {
            return;
        }
        let Some(&t) = self.tmpl_idx.get(&r.template) else { return };
        let idle: u64 = (0..self.n).map(|n| u64::from(self.pools[self.pool_of(t, n)].idle)).sum();
        let from = r.ready_by_ms.saturating_sub(READY_EARLY_MS);
        let arrivals = &trace.arrivals;
        let first = arrivals.partition_point(|a| a.at_ms < from);
        let last = arrivals.partition_point(|a| a.at_ms < r.ready_by_ms);
        let early = (first..last).filter(|&j| arrivals[j].template == t && self.served_warm[j]).count() as u64;
        if idle + early < u64::from(r.count) {
            self.late += 1;
        }
    }

    fn sync_observation(&mut self) {
        self.obs.now_ms = self.now;
        if self.declare == Declare::Reservations {
            let now = self.now;
            self.obs.reservations = self
                .trace
                .declared
                .iter()
                .filter(|d| d.announce_ms <= now && d.reservation.expires_ms() > now)
                .map(|d| d.reservation.clone())
                .collect();
        }
        self.sync_templates();
        for p in std::mem::take(&mut self.dirty_pools) {
            let pool = &mut self.pools[p];
            pool.dirty = false;
            let s = PoolSignals { idle: pool.idle, leased: pool.leased, creating: pool.refill + pool.ondemand };
            if s == PoolSignals::default() {
                self.obs.pools.remove(&self.keys[p]);
            } else if let Some(slot) = self.obs.pools.get_mut(&self.keys[p]) {
                *slot = s;
            } else {
                self.obs.pools.insert(self.keys[p].clone(), s);
            }
        }
        for t in std::mem::take(&mut self.dirty_tmpls) {
            self.tmpls[t].dirty = false;
            let waiting = u32::try_from(self.tmpls[t].queue.len()).unwrap_or(u32::MAX);
            if let Some(ts) = self.obs.templates.get_mut(&self.trace.templates[t].name) {
                ts.waiting = waiting;
            }
        }
    }

    fn report(&mut self, policy: String) -> RunReport {
        self.waits.sort_unstable();
        let n = self.waits.len();
        let pct = |q: f64| -> u64 {
            if n == 0 {
                return 0;
            }
            let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
            self.waits[rank - 1]
        };
        RunReport {
            policy,
            arrivals: n as u64,
            warm_pct: if n == 0 { 100.0 } else { 100.0 * self.warm as f64 / n as f64 },
            wait_p50_ms: pct(0.50),
            wait_p99_ms: pct(0.99),
            idle_sandbox_s: self.idle_ms / 1_000.0,
            idle_vs_oracle: None,
            peak_sandboxes: self.peak,
            creates: self.creates,
            unserved: self.unserved,
            infeasible_reservations: self.infeasible.len() as u64,
            pulls: self.pulls_started,
            late_reservations: self.late,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::trace::{Arrival, ImageSpec, LongtailSpec, PeriodicSpec, PullTimes, TemplateSpec, longtail, periodic};
    use super::*;
    use crate::policy::{Combined, Reservations};
    use crate::signals::Reservation;

    /// Templates `t0, t1, ...`, each made from an image of its own pulled in `pulls[i]` ms; arrivals
    /// `(at_ms, template)` of 1-second episodes; scored from 0 to 60 s.
    fn trace(pulls: &[u64], arrivals: &[(u64, usize)]) -> Trace {
        Trace {
            name: "t".into(),
            templates: (0..pulls.len())
                .map(|i| TemplateSpec { name: format!("t{i}"), memory_mib: 1, appears_ms: 0, image: Some(i) })
                .collect(),
            arrivals: arrivals
                .iter()
                .map(|&(at_ms, template)| Arrival { at_ms, template, duration_ms: 1_000 })
                .collect(),
            declared: Vec::new(),
            images: pulls
                .iter()
                .enumerate()
                .map(|(i, &pull_ms)| ImageSpec { name: format!("i{i}"), pull_ms })
                .collect(),
            warmup_ms: 0,
            end_ms: 60_000,
        }
    }

    /// Nothing kept warm: every request is an on-demand create.
    fn cold(cfg: &SimConfig, trace: &Trace, declare: Declare) -> RunReport {
        simulate_declaring(cfg, trace, &mut Reservations::default(), declare)
    }

    #[test]
    fn a_pull_is_paid_once_per_image_per_node() {
        // Four requests at once and four later, on two nodes: one pull, on one node, for all of them.
        let mut arrivals = vec![(1_000, 0); 4];
        arrivals.extend([(20_000, 0); 4]);
        let t = trace(&[2_000], &arrivals);
        let r = cold(&SimConfig::default(), &t, Declare::Nothing);
        assert_eq!((r.pulls, r.creates, r.warm_pct), (1, 8, 0.0), "{r:?}");
        // The first four wait for the pull and the create (2 s + 0.5 s), the later four for the create alone
        // (on the node with the image, whose burst of 4 tokens covers them).
        assert_eq!((r.wait_p50_ms, r.wait_p99_ms), (500, 2_500), "{r:?}");

        // Without images the same requests wait for the create only.
        let mut plain = t.clone();
        plain.images.clear();
        plain.templates[0].image = None;
        let r = cold(&SimConfig::default(), &plain, Declare::Nothing);
        assert_eq!((r.pulls, r.wait_p50_ms, r.wait_p99_ms), (0, 500, 500));

        // Idle targets follow the image: a fixed pool of 3 per template, which the policy spreads 2 + 1, is
        // pulled onto one node; left where the policy puts it, onto both.
        let t = trace(&[2_000], &[(30_000, 0)]);
        let placed = simulate(&SimConfig::default(), &t, &mut crate::policy::Fixed(3), false);
        let spread = SimConfig { place_by_image: false, ..SimConfig::default() };
        let spread = simulate(&spread, &t, &mut crate::policy::Fixed(3), false);
        assert_eq!((placed.pulls, spread.pulls), (1, 2));
        assert_eq!((placed.warm_pct, spread.warm_pct), (100.0, 100.0));
    }

    #[test]
    fn pulls_in_flight_share_the_node_and_are_bounded() {
        // One node, two images (1 s and 3 s alone) wanted at once: shared, the short one ends at 2 s, the long
        // one has 2 s left and ends alone at 4 s; each create takes 0.5 s more.
        let cfg = SimConfig::with_nodes(1, NodeSpec::default());
        let t = trace(&[1_000, 3_000], &[(1_000, 0), (1_000, 1)]);
        let r = cold(&cfg, &t, Declare::Nothing);
        assert_eq!((r.pulls, r.wait_p50_ms, r.wait_p99_ms), (2, 2_500, 4_500), "{r:?}");
        // One pull at a time: 1 s, then 3 s after it.
        let one = SimConfig::with_nodes(1, NodeSpec { max_pulls_in_flight: 1, ..NodeSpec::default() });
        let r = cold(&one, &t, Declare::Nothing);
        assert_eq!((r.wait_p50_ms, r.wait_p99_ms), (1_500, 4_500), "{r:?}");
    }

    #[test]
    fn a_declaration_pulls_its_images_when_announced() {
        // Announced at 0 for 10 s: by then the 5 s pull is done, and a cold request waits for the create only.
        let mut t = trace(&[5_000], &[(10_000, 0)]);
        t.declared.push(trace::Declared {
            announce_ms: 0,
            reservation: Reservation { template: "t0".into(), count: 1, ready_by_ms: 10_000, hold_s: 30 },
        });
        let cfg = SimConfig::default();
        assert_eq!(cold(&cfg, &t, Declare::Nothing).wait_p50_ms, 5_500);
        let r = cold(&cfg, &t, Declare::Prefetch);
        assert_eq!((r.wait_p50_ms, r.pulls, r.late_reservations), (500, 1, 0), "{r:?}");
        // Declared in full, the sandbox is idle by then too.
        let r = cold(&cfg, &t, Declare::Reservations);
        assert_eq!((r.warm_pct, r.late_reservations, r.infeasible_reservations), (100.0, 0, 0), "{r:?}");
        // A pull longer than the lead makes it late, and the request waits for the rest of it.
        t.images[0].pull_ms = 30_000;
        let r = cold(&cfg, &t, Declare::Reservations);
        assert_eq!((r.warm_pct, r.late_reservations), (0.0, 1), "{r:?}");
        assert_eq!(r.wait_p50_ms, 20_500);
    }

    fn small_longtail(pulls: PullTimes) -> LongtailSpec {
        LongtailSpec { duration_s: 600, warmup_s: 120, pulls: Some(pulls), ..LongtailSpec::default() }
    }

    #[test]
    fn declared_steps_are_ready_by_their_time_when_capacity_allows() {
        let cfg = SimConfig::default();
        let t = longtail(4, &small_longtail(PullTimes::local()));
        let declared = t.declared.iter().filter(|d| (t.warmup_ms..t.end_ms).contains(&d.reservation.ready_by_ms));
        assert!(declared.count() > 150);
        let r = simulate(&cfg, &t, &mut Combined::default(), true);
        assert_eq!((r.late_reservations, r.infeasible_reservations, r.unserved), (0, 0, 0), "{r:?}");
        assert_eq!((r.warm_pct, r.wait_p99_ms), (100.0, 0), "{r:?}");
        // Each image is pulled once, ahead of its step.
        let images = t.templates.iter().filter(|s| (t.warmup_ms..t.end_ms).contains(&s.appears_ms)).count() as u64;
        assert!(r.pulls <= images + 25, "{} pulls for {images} images", r.pulls);
        // Without the declarations the first sandbox of each image is cold, and waits for its pull.
        let r = simulate(&cfg, &t, &mut Combined::default(), false);
        assert!(r.warm_pct < 80.0 && r.wait_p99_ms > 500, "{r:?}");

        // Pulls that cannot keep up (SWE-sized images on two nodes) make steps late.
        let t = longtail(4, &small_longtail(PullTimes::swe()));
        let r = simulate(&cfg, &t, &mut Combined::default(), true);
        assert!(r.late_reservations > 50 && r.warm_pct < 50.0, "{r:?}");
    }

    #[test]
    fn runs_with_images_are_deterministic_for_a_seed() {
        let cfg = SimConfig::default();
        let spec = small_longtail(PullTimes::swe());
        let run = |seed: u64, declare: Declare| {
            simulate_declaring(&cfg, &longtail(seed, &spec), &mut Combined::default(), declare)
        };
        for declare in [Declare::Nothing, Declare::Prefetch, Declare::Reservations] {
            let a = run(5, declare);
            assert_eq!(a, run(5, declare));
            assert_ne!(a, run(6, declare), "another seed is another trace");
            assert!(a.pulls > 0);
        }
    }

    #[test]
    fn traces_without_images_do_not_care_about_image_placement() {
        let t = periodic(2, &PeriodicSpec { burst: 200, bursts: 5, ..PeriodicSpec::default() });
        let spread = SimConfig { place_by_image: false, ..SimConfig::default() };
        for declare in [false, true] {
            let a = simulate(&SimConfig::default(), &t, &mut Combined::default(), declare);
            assert_eq!(a, simulate(&spread, &t, &mut Combined::default(), declare));
            assert_eq!(a.pulls, 0);
        }
    }
}

// One file over 600 lines: the layout table, the key definitions and their builders are one
// description read together (a unit test holds the table to the definitions).
//! Key names: the one place that spells them, for Rust and for Lua alike.
//!
//! Every key is described once below as a `KeyDef` (a pattern such as `sb:{sandbox}`). The
//! Rust builders fill the patterns in; the Lua key functions every node script uses (`K.sb(id)`)
//! are generated from the same patterns (`lua_key_functions`); and the layout table here is
//! checked against them by a unit test, so it cannot fall behind the code.
//!
//! `P` is the configured prefix and `N` a node id. Everything of one node lives under the hash
//! tag `{N}`, so every node script touches one Redis Cluster slot. The registry keys share the
//! tag `{global}`; one template's arrival counts share the tag `{arr:<template>}`; the quotas
//! of one top-level tenant and all its descendants share the tag `{q:<top>}`, so admission
//! checks every level of a path in one script; its functions, their environments and
//! invocations share `{f:<top>}`; its reservations `{r:<top>}` (so adding one costs that
//! tenant's request, never every tenant's reservations).
//!
//! ```text
//! P:{N}:sbs                       set    every sandbox the node owns
//! P:{N}:sb:<sandbox>              hash   one sandbox: template, state, container, created_ms, session, fence
//! P:{N}:idle:<template>           list   idle sandboxes of one pool (LPUSH when ready, RPOP at checkout)
//! P:{N}:fence                     string fencing counter, INCR on every grant
//! P:{N}:ses:<session>             hash   a live session: tenant, sandbox, template, fence, times, labels, key, mailbox
//! P:{N}:expiry                    zset   session -> the time it ends unless used (ms, Redis clock)
//! P:{N}:tses:<tenant>             set    the live sessions of one tenant on this node
//! P:{N}:gone:<session>            hash   tombstone of an ended session: tenant, reason, at_ms (1 h)
//! P:{N}:doomed                    list   sandboxes to destroy (the node BLPOPs it)
//! P:{N}:health:<template>         hash   why a template cannot start sandboxes, and until when
//! P:{N}:wcount:<template>         string how many requests wait for a template (recounted from the lists every reap tick)
//! P:{N}:wring:<template>          list   tenants with waiting requests, served round-robin
//! P:{N}:wq:<template>:<tenant>    list   one tenant's waiting requests, FIFO
//! P:{N}:waiter:<request>          hash   a waiting request: its session spec and wake channel
//! P:{N}:mail:<request>            string a waiting request's outcome (JSON), until collected
//! P:{N}:unclaimed                 zset   session -> end of its claim window (ms): a grant still in its waiter's mailbox
//! P:{N}:ptpl                      hash   private template name -> JSON (snapshots on this node)
//! P:{N}:ptpl-gone                 set    private templates deleted on purpose, until their images are removed
//! P:{N}:stats                     string the node's self-report (JSON), refreshed twice a second
//! P:{N}:targets                   hash   template -> idle target set by the autoscaler, and _at_ms
//! P:{N}:active                    hash   tenant -> its live sessions on this node (the sessions-active gauge)
//! P:{N}:qret                      list   ended sessions whose quota lease is still to be given back (tenant TAB id)
//! P:{N}:imgs                      set    images (repository@digest) the node pulled and holds; placement prefers them
//! P:{N}:lease                     string the node id's holder (host|instance), expiring node_down_after after its last heartbeat: absent = down
//! P:{N}:room                      string sandboxes the node can still add (its budget), refreshed with its stats; absent = unknown
//! P:{global}:nodes                hash   node id -> registration (JSON)
//! P:{global}:node-seen            hash   node id -> last heartbeat (ms, Redis clock)
//! P:{global}:reservations         hash   legacy: every tenant's reservations (moved to {r:<top>} at a gateway's start)
//! P:{global}:rtops                zset   top-level tenant -> when its last reservation ends (ms): whose to read
//! P:{global}:qtops                zset   top-level tenant -> when a process last noted it admitting a lease the sweep checks (ms)
//! P:{global}:egress               hash   egress policy name -> its rules (JSON), set by the admin API
//! P:{global}:fns                  set    every function (owner|name), for the keeper
//! P:{global}:itpl                 hash   template made from an image: <namespace>/<name> -> JSON
//! P:{global}:itpl-version         string bumped on every change of itpl (nodes reload when it moves)
//! P:{arr:<template>}:<second>     string session requests for a template in one second (1 h)
//! P:{q:<top>}:qlim                hash   path -> its limits (JSON), for the paths under one top-level tenant
//! P:{q:<top>}:quse                hash   path|dimension -> usage (sessions, cpu_m, memory_mb, queued, ... : quota/prelude.lua)
//! P:{q:<top>}:qtat                hash   path -> GCRA theoretical arrival time of creates (ms)
//! P:{q:<top>}:qlease              hash   lease -> what it holds (JSON: path, costs, deadline)
//! P:{q:<top>}:qrexp               zset   lease -> when it ends by itself (reservations, ms)
//! P:{q:<top>}:qadm                hash   path -> the limits an admin set on it (JSON): only an admin may loosen or remove them
//! P:{q:<top>}:qdue                zset   lease -> when the quota sweep next looks for its holder (ms): its deadline, then every recheck
//! P:{r:<top>}:resv                hash   reservation id -> declared burst (JSON), one top-level tenant's
//! P:{r:<top>}:rends               zset   reservation id -> when its hold ends (ms): pruning in bounded steps
//! P:{f:<top>}:fdef                hash   owner|name -> a function's definition (JSON, with its version)
//! P:{f:<top>}:fidle:<function>    list   idle environments of one function (JSON: session, version, uses, since); LIFO
//! P:{f:<top>}:fenvs:<function>    zset   session -> last use (ms): every environment of one function
//! P:{f:<top>}:finfl:<function>    zset   invocation -> its deadline (ms): one function's invocations in flight
//! P:{f:<top>}:fstat:<function>    hash   one function's completed invocations and their busy time (for Little's law)
//! P:{f:<top>}:fkeep:<function>    string the keeper's turn for one function (one gateway per second)
//! P:{f:<top>}:inv:<invocation>    string an asynchronous invocation's state and result (JSON), kept result_ttl_s
//! P:pin:<tenant>:<key>            string session id pinned by a tenant's session key, or pending:<claim>
//! P:lprof:<digest>                string a lazy image's access profile: chunks its first session read (JSON, 7 d)
//! P:wake:<gateway>                pubsub a gateway's wake-up channel for its queued requests
//! ```

/// One key (or channel) of the layout.
#[derive(Debug, Clone, Copy)]
pub struct KeyDef {
    /// The Lua function name (`K.<name>`).
    pub name: &'static str,
    /// What follows the scope (`P:{N}:` for node keys); `{arg}` is filled in by the builder.
    pub pattern: &'static str,
    /// The Redis type (`set`, `hash`, `list`, `zset`, `string`, `pubsub`), for the layout table.
    pub kind: &'static str,
    /// What the key holds, as the layout table says it.
    pub doc: &'static str,
}

macro_rules! defs {
    ($( $c:ident = $name:literal, $pattern:literal, $kind:literal, $doc:literal; )*) => {
        $( const $c: KeyDef = KeyDef { name: $name, pattern: $pattern, kind: $kind, doc: $doc }; )*
    };
}

defs! {
    SBS = "sbs", "sbs", "set", "every sandbox the node owns";
    SB = "sb", "sb:{sandbox}", "hash", "one sandbox: template, state, container, created_ms, session, fence";
    IDLE = "idle", "idle:{template}", "list", "idle sandboxes of one pool (LPUSH when ready, RPOP at checkout)";
    FENCE = "fence", "fence", "string", "fencing counter, INCR on every grant";
    SES = "ses", "ses:{session}", "hash", "a live session: tenant, sandbox, template, fence, times, labels, key, mailbox";
    EXPIRY = "expiry", "expiry", "zset", "session -> the time it ends unless used (ms, Redis clock)";
    TSES = "tses", "tses:{tenant}", "set", "the live sessions of one tenant on this node";
    GONE = "gone", "gone:{session}", "hash", "tombstone of an ended session: tenant, reason, at_ms (1 h)";
    DOOMED = "doomed", "doomed", "list", "sandboxes to destroy (the node BLPOPs it)";
    HEALTH = "health", "health:{template}", "hash", "why a template cannot start sandboxes, and until when";
    WCOUNT = "wcount", "wcount:{template}", "string", "how many requests wait for a template (recounted from the lists every reap tick)";
    WRING = "wring", "wring:{template}", "list", "tenants with waiting requests, served round-robin";
    WQ = "wq", "wq:{template}:{tenant}", "list", "one tenant's waiting requests, FIFO";
    WAITER = "waiter", "waiter:{request}", "hash", "a waiting request: its session spec and wake channel";
    MAIL = "mail", "mail:{request}", "string", "a waiting request's outcome (JSON), until collected";
    UNCLAIMED = "unclaimed", "unclaimed", "zset", "session -> end of its claim window (ms): a grant still in its waiter's mailbox";
    PTPL = "ptpl", "ptpl", "hash", "private template name -> JSON (snapshots on this node)";
    PTPL_GONE = "ptpl_gone", "ptpl-gone", "set", "private templates deleted on purpose, until their images are removed";
    STATS = "stats", "stats", "string", "the node's self-report (JSON), refreshed twice a second";
    TARGETS = "targets", "targets", "hash", "template -> idle target set by the autoscaler, and _at_ms";
    ACTIVE = "active", "active", "hash", "tenant -> its live sessions on this node (the sessions-active gauge)";
    QRET = "qret", "qret", "list", "ended sessions whose quota lease is still to be given back (tenant TAB id)";
    QLIM = "qlim", "qlim", "hash", "path -> its limits (JSON), for the paths under one top-level tenant";
    QUSE = "quse", "quse", "hash", "path|dimension -> usage (sessions, cpu_m, memory_mb, queued, ... : quota/prelude.lua)";
    QTAT = "qtat", "qtat", "hash", "path -> GCRA theoretical arrival time of creates (ms)";
    QLEASE = "qlease", "qlease", "hash", "lease -> what it holds (JSON: path, costs, deadline)";
    QREXP = "qrexp", "qrexp", "zset", "lease -> when it ends by itself (reservations, ms)";
    QADM = "qadm", "qadm", "hash", "path -> the limits an admin set on it (JSON): only an admin may loosen or remove them";
    QDUE = "qdue", "qdue", "zset", "lease -> when the quota sweep next looks for its holder (ms): its deadline, then every recheck";
    QTOPS = "qtops", "qtops", "zset", "top-level tenant -> when a process last noted it admitting a lease the sweep checks (ms)";
    IMGS = "imgs", "imgs", "set", "images (repository@digest) the node pulled and holds; placement prefers them";
    LEASE = "lease", "lease", "string", "the node id's holder (host|instance), expiring node_down_after after its last heartbeat: absent = down";
    ROOM = "room", "room", "string", "sandboxes the node can still add (its budget), refreshed with its stats; absent = unknown";
    ITPL = "itpl", "itpl", "hash", "template made from an image: <namespace>/<name> -> JSON";
    ITPL_VERSION = "itpl_version", "itpl-version", "string", "bumped on every change of itpl (nodes reload when it moves)";
    NODES = "nodes", "nodes", "hash", "node id -> registration (JSON)";
    NODE_SEEN = "node_seen", "node-seen", "hash", "node id -> last heartbeat (ms, Redis clock)";
    EGRESS = "egress", "egress", "hash", "egress policy name -> its rules (JSON), set by the admin API";
    RESERVATIONS = "reservations", "reservations", "hash", "legacy: every tenant's reservations (moved to {r:<top>} at a gateway's start)";
    RTOPS = "rtops", "rtops", "zset", "top-level tenant -> when its last reservation ends (ms): whose to read";
    RESV = "resv", "resv", "hash", "reservation id -> declared burst (JSON), one top-level tenant's";
    RENDS = "rends", "rends", "zset", "reservation id -> when its hold ends (ms): pruning in bounded steps";
    ARRIVALS = "arrivals", "{second}", "string", "session requests for a template in one second (1 h)";
    FDEF = "fdef", "fdef", "hash", "owner|name -> a function's definition (JSON, with its version)";
    FIDLE = "fidle", "fidle:{function}", "list", "idle environments of one function (JSON: session, version, uses, since); LIFO";
    FENVS = "fenvs", "fenvs:{function}", "zset", "session -> last use (ms): every environment of one function";
    FINFL = "finfl", "finfl:{function}", "zset", "invocation -> its deadline (ms): one function's invocations in flight";
    FSTAT = "fstat", "fstat:{function}", "hash", "one function's completed invocations and their busy time (for Little's law)";
    FKEEP = "fkeep", "fkeep:{function}", "string", "the keeper's turn for one function (one gateway per second)";
    INV = "inv", "inv:{invocation}", "string", "an asynchronous invocation's state and result (JSON), kept result_ttl_s";
    FNS = "fns", "fns", "set", "every function (owner|name), for the keeper";
    PIN = "pin", "pin:{tenant}:{key}", "string", "session id pinned by a tenant's session key, or pending:<claim>";
    LPROF = "lprof", "lprof:{digest}", "string", "a lazy image's access profile: chunks its first session read (JSON, 7 d)";
    WAKE = "wake", "wake:{gateway}", "pubsub", "a gateway's wake-up channel for its queued requests";
}

/// Keys of one node, in the order of the layout table.
pub const NODE_KEYS: &[KeyDef] = &[
    SBS, SB, IDLE, FENCE, SES, EXPIRY, TSES, GONE, DOOMED, HEALTH, WCOUNT, WRING, WQ, WAITER, MAIL, UNCLAIMED, PTPL,
    PTPL_GONE, STATS, TARGETS, ACTIVE, QRET, IMGS, LEASE, ROOM,
];

/// Keys of one top-level tenant's quota scope, under the `{q:<top>}` tag.
pub const QUOTA_KEYS: &[KeyDef] = &[QLIM, QUSE, QTAT, QLEASE, QREXP, QADM, QDUE];

/// Keys of the registry, under the `{global}` tag.
const GLOBAL_KEYS: &[KeyDef] = &[NODES, NODE_SEEN, RESERVATIONS, RTOPS, QTOPS, EGRESS, FNS, ITPL, ITPL_VERSION];

/// Keys of one top-level tenant's reservations, under the `{r:<top>}` tag.
pub const RESERVATION_KEYS: &[KeyDef] = &[RESV, RENDS];

/// Keys of one top-level tenant's functions (and their descendants'), under the `{f:<top>}`
/// tag; `{function}` is `owner|name`.
pub const FUNCTION_KEYS: &[KeyDef] = &[FDEF, FIDLE, FENVS, FINFL, FSTAT, FKEEP, INV];

/// The hash tag shared by the registry keys.
const GLOBAL_TAG: &str = "global";

/// Hours of arrival history kept, in seconds.
pub const ARRIVALS_TTL_S: u64 = 3600;

/// Fills `{arg}` placeholders of `pattern` with `args`, in order.
fn fill(out: &mut String, pattern: &str, args: &[&str]) {
    let mut args = args.iter();
    let mut rest = pattern;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..].find('}').map_or(rest.len(), |c| open + c);
        out.push_str(args.next().copied().unwrap_or_default());
        rest = rest.get(close + 1..).unwrap_or_default();
    }
    out.push_str(rest);
}

/// The placeholders of a pattern, in order (`sb:{sandbox}` → `["sandbox"]`).
fn params(pattern: &str) -> Vec<&str> {
    pattern.split('{').skip(1).filter_map(|p| p.split_once('}').map(|(name, _)| name)).collect()
}

/// Key names under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Key names under `prefix` (the deployment's `redis.prefix`).
    pub fn new(prefix: &str) -> Keys {
        Keys { prefix: prefix.to_string() }
    }

    /// The prefix every key starts with.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The keys of one node.
    pub fn node(&self, node: &str) -> NodeKeys {
        NodeKeys { base: format!("{}:{{{}}}:", self.prefix, node) }
    }

    fn global(&self, def: &KeyDef) -> String {
        let mut k = format!("{}:{{{GLOBAL_TAG}}}:", self.prefix);
        fill(&mut k, def.pattern, &[]);
        k
    }

    /// `{global}:nodes` (hash): node id -> its registration (JSON).
    pub fn nodes(&self) -> String {
        self.global(&NODES)
    }

    /// `{global}:node-seen` (hash): node id -> its last heartbeat (ms, Redis clock).
    pub fn node_seen(&self) -> String {
        self.global(&NODE_SEEN)
    }

    /// The legacy hash of every tenant's reservations (read once, by the migration).
    pub fn reservations_legacy(&self) -> String {
        self.global(&RESERVATIONS)
    }

    /// The top-level tenants with reservations, scored by when their last one ends.
    pub fn reservation_tops(&self) -> String {
        self.global(&RTOPS)
    }

    /// The reservation keys of the top-level tenant `top` (and all its descendants).
    pub fn reservations(&self, top: &str) -> ReservationKeys {
        let base = format!("{}:{{r:{top}}}:", self.prefix);
        let key = |def: &KeyDef| {
            let mut k = base.clone();
            fill(&mut k, def.pattern, &[]);
            k
        };
        ReservationKeys { resv: key(&RESV), ends: key(&RENDS) }
    }

    /// `{global}:egress` (hash): egress policy name -> its rules (JSON), set by the admin API.
    pub fn egress(&self) -> String {
        self.global(&EGRESS)
    }

    /// `{global}:itpl` (hash): templates made from images, `<namespace>/<name>` -> JSON.
    pub fn image_templates(&self) -> String {
        self.global(&ITPL)
    }

    /// `{global}:itpl-version` (string): bumped on every change of `itpl`; nodes reload then.
    pub fn image_templates_version(&self) -> String {
        self.global(&ITPL_VERSION)
    }

    /// The scope of one template's arrival counts; the arrivals script appends the second.
    pub fn arrivals_base(&self, template: &str) -> String {
        format!("{}:{{arr:{template}}}:", self.prefix)
    }

    /// Session requests for `template` in the Unix second `second` (kept [`ARRIVALS_TTL_S`]).
    pub fn arrivals(&self, template: &str, second: u64) -> String {
        let mut k = self.arrivals_base(template);
        fill(&mut k, ARRIVALS.pattern, &[&second.to_string()]);
        k
    }

    /// `pin:<tenant>:<key>` (string): the session a tenant's key pins, or `pending:<claim>`.
    pub fn pin(&self, tenant: &str, key: &str) -> String {
        let mut k = format!("{}:", self.prefix);
        fill(&mut k, PIN.pattern, &[tenant, key]);
        k
    }

    /// `lprof:<digest>` (string): the access profile of the lazy image with manifest digest
    /// `digest` (`sha256:...`), shared by every node.
    pub fn lazy_profile(&self, digest: &str) -> String {
        let mut k = format!("{}:", self.prefix);
        fill(&mut k, LPROF.pattern, &[digest]);
        k
    }

    /// The quota keys of the top-level tenant `top` (and all its descendants).
    pub fn quota(&self, top: &str) -> QuotaKeys {
        let base = format!("{}:{{q:{top}}}:", self.prefix);
        let key = |def: &KeyDef| {
            let mut k = base.clone();
            fill(&mut k, def.pattern, &[]);
            k
        };
        QuotaKeys {
            lim: key(&QLIM),
            used: key(&QUSE),
            tat: key(&QTAT),
            lease: key(&QLEASE),
            rexp: key(&QREXP),
            adm: key(&QADM),
            due: key(&QDUE),
        }
    }

    /// Every key of the deployment (`SCAN MATCH`), for wiping it.
    pub fn all_pattern(&self) -> String {
        format!("{}:*", self.prefix)
    }

    /// The top-level tenants whose leases the quota sweep reads (`qdue`), scored by when a
    /// process last noted one admitting such a lease.
    pub fn quota_tops(&self) -> String {
        self.global(&QTOPS)
    }

    /// The pattern matching every top-level tenant's lease hash (for `SCAN`: the index's
    /// migration at a node's start, and the operator's `verify`).
    pub fn quota_lease_pattern(&self) -> String {
        format!("{}:{{q:*}}:{}", self.prefix, QLEASE.pattern)
    }

    /// Every function (`owner|name`), for the keeper.
    pub fn functions_index(&self) -> String {
        self.global(&FNS)
    }

    /// The keys of the function `owner|name`, under its owner's top-level tag.
    pub fn function(&self, owner: &str, name: &str) -> FunctionKeys {
        let id = format!("{owner}|{name}");
        let base = self.function_scope(owner);
        let key = |def: &KeyDef, args: &[&str]| {
            let mut k = base.clone();
            fill(&mut k, def.pattern, args);
            k
        };
        FunctionKeys {
            def: key(&FDEF, &[]),
            idle: key(&FIDLE, &[&id]),
            envs: key(&FENVS, &[&id]),
            infl: key(&FINFL, &[&id]),
            stat: key(&FSTAT, &[&id]),
            keep: key(&FKEEP, &[&id]),
            id,
        }
    }

    /// An asynchronous invocation of a function of `owner` (or of any path under its top).
    pub fn invocation(&self, owner: &str, invocation: &str) -> String {
        let mut k = self.function_scope(owner);
        fill(&mut k, INV.pattern, &[invocation]);
        k
    }

    fn function_scope(&self, owner: &str) -> String {
        format!("{}:{{f:{}}}:", self.prefix, wire::quotas::top(owner))
    }

    /// `wake:<gateway>`: the pub/sub channel that wakes a gateway's queued requests.
    pub fn wake(&self, gateway: &str) -> String {
        let mut k = format!("{}:", self.prefix);
        fill(&mut k, WAKE.pattern, &[gateway]);
        k
    }
}

/// Key names of one top-level tenant's quotas, all under its hash tag, in the order every
/// quota script declares them.
#[derive(Debug, Clone)]
pub struct QuotaKeys {
    /// `qlim` (hash): path -> its limits (JSON).
    pub lim: String,
    /// `quse` (hash): `path|dimension` -> usage (sessions, cpu_m, memory_mb, queued, ...).
    pub used: String,
    /// `qtat` (hash): path -> GCRA theoretical arrival time of its creates (ms).
    pub tat: String,
    /// `qlease` (hash): lease -> what it holds (JSON: path, costs, deadline).
    pub lease: String,
    /// `qrexp` (zset): lease -> when it ends by itself (reservations; ms).
    pub rexp: String,
    /// Path -> the limits an admin set on it (who set a limit decides who may loosen it).
    pub adm: String,
    /// Lease -> when the sweep next looks for its holder: only leases that end with a holder.
    pub due: String,
}

impl QuotaKeys {
    /// The seven keys in the order every quota script declares them (its `KEYS`).
    pub fn all(&self) -> [&str; 7] {
        [&self.lim, &self.used, &self.tat, &self.lease, &self.rexp, &self.adm, &self.due]
    }
}

/// Key names of one top-level tenant's reservations, in the order the script declares them.
#[derive(Debug, Clone)]
pub struct ReservationKeys {
    /// `resv` (hash): reservation id -> its declared burst (JSON).
    pub resv: String,
    /// `rends` (zset): reservation id -> when its hold ends (ms), for pruning in bounded steps.
    pub ends: String,
}

impl ReservationKeys {
    /// Both keys in the order the reservation script declares them.
    pub fn all(&self) -> [&str; 2] {
        [&self.resv, &self.ends]
    }
}

/// Key names of one function, all under its owner's top-level tag, in the order every
/// function script declares them.
#[derive(Debug, Clone)]
pub struct FunctionKeys {
    /// `owner|name`: the function's field in `def` and the suffix of its other keys.
    pub id: String,
    /// `fdef` (hash): `owner|name` -> definition (JSON, with version), every function of the top.
    pub def: String,
    /// `fidle:<function>` (list): idle environments (JSON: session, version, uses, since), LIFO.
    pub idle: String,
    /// `fenvs:<function>` (zset): session -> last use (ms), every environment of the function.
    pub envs: String,
    /// `finfl:<function>` (zset): invocation -> its deadline (ms), the invocations in flight.
    pub infl: String,
    /// `fstat:<function>` (hash): completed invocations and their busy time (for Little's law).
    pub stat: String,
    /// Not a script key: the keeper's turn.
    pub keep: String,
}

impl FunctionKeys {
    /// The five script keys in the order every function script declares them (not `keep`).
    pub fn all(&self) -> [&str; 5] {
        [&self.def, &self.idle, &self.envs, &self.infl, &self.stat]
    }
}

/// Key names of one node, all under its hash tag.
#[derive(Debug, Clone)]
pub struct NodeKeys {
    base: String,
}

impl NodeKeys {
    fn key(&self, def: &KeyDef, args: &[&str]) -> String {
        let mut k = self.base.clone();
        fill(&mut k, def.pattern, args);
        k
    }

    /// `sbs` (set): every sandbox the node owns (`KEYS[1]` of every node script).
    pub fn sbs(&self) -> String {
        self.key(&SBS, &[])
    }
    /// `sb:<sandbox>` (hash): one sandbox's template, state, container, created_ms, session, fence.
    pub fn sb(&self, sandbox: &str) -> String {
        self.key(&SB, &[sandbox])
    }
    /// `idle:<template>` (list): the pool's idle sandboxes (LPUSH when ready, RPOP at checkout).
    pub fn idle(&self, template: &str) -> String {
        self.key(&IDLE, &[template])
    }
    /// `fence` (string): the fencing counter, INCR on every grant.
    pub fn fence(&self) -> String {
        self.key(&FENCE, &[])
    }
    /// `ses:<session>` (hash): a live session's tenant, sandbox, template, fence, times, labels.
    pub fn ses(&self, session: &str) -> String {
        self.key(&SES, &[session])
    }
    /// `expiry` (zset): session -> when it ends unless used (ms, Redis clock).
    pub fn expiry(&self) -> String {
        self.key(&EXPIRY, &[])
    }
    /// `tses:<tenant>` (set): the tenant's live sessions on this node.
    pub fn tses(&self, tenant: &str) -> String {
        self.key(&TSES, &[tenant])
    }
    /// `gone:<session>` (hash): an ended session's tombstone (tenant, reason, at_ms), kept 1 h.
    pub fn gone(&self, session: &str) -> String {
        self.key(&GONE, &[session])
    }
    /// `doomed` (list): sandboxes to destroy; the node BLPOPs it.
    pub fn doomed(&self) -> String {
        self.key(&DOOMED, &[])
    }
    /// `health:<template>` (hash): why the template cannot start sandboxes, and until when.
    pub fn health(&self, template: &str) -> String {
        self.key(&HEALTH, &[template])
    }
    /// `wcount:<template>` (string): requests waiting for the template (recounted every reap tick).
    pub fn wcount(&self, template: &str) -> String {
        self.key(&WCOUNT, &[template])
    }
    /// `wring:<template>` (list): tenants with waiting requests, served round-robin.
    pub fn wring(&self, template: &str) -> String {
        self.key(&WRING, &[template])
    }
    /// `wq:<template>:<tenant>` (list): one tenant's waiting requests, FIFO.
    pub fn wq(&self, template: &str, tenant: &str) -> String {
        self.key(&WQ, &[template, tenant])
    }
    /// `waiter:<request>` (hash): a waiting request's session spec and wake channel.
    pub fn waiter(&self, request: &str) -> String {
        self.key(&WAITER, &[request])
    }
    /// `mail:<request>` (string): a waiting request's outcome (JSON), until collected.
    pub fn mail(&self, request: &str) -> String {
        self.key(&MAIL, &[request])
    }
    /// `unclaimed` (zset): session -> end of its claim window (ms), for grants still in a mailbox.
    pub fn unclaimed(&self) -> String {
        self.key(&UNCLAIMED, &[])
    }
    /// `ptpl` (hash): private template name -> JSON (snapshots on this node).
    pub fn ptpl(&self) -> String {
        self.key(&PTPL, &[])
    }
    /// `stats` (string): the node's self-report (JSON), refreshed twice a second.
    pub fn stats(&self) -> String {
        self.key(&STATS, &[])
    }
    /// `targets` (hash): template -> idle target set by the autoscaler, plus `_at_ms`.
    pub fn targets(&self) -> String {
        self.key(&TARGETS, &[])
    }
    /// `active` (hash): tenant -> its live sessions on this node (the sessions-active gauge).
    pub fn active(&self) -> String {
        self.key(&ACTIVE, &[])
    }
    /// `qret` (list): ended sessions whose quota lease is still to be given back (`tenant TAB id`).
    pub fn qret(&self) -> String {
        self.key(&QRET, &[])
    }
    /// `imgs` (set): images (`repository@digest`) the node holds; placement prefers them.
    pub fn imgs(&self) -> String {
        self.key(&IMGS, &[])
    }
    /// `ptpl-gone` (set): private templates deleted on purpose, until their images are removed.
    pub fn ptpl_gone(&self) -> String {
        self.key(&PTPL_GONE, &[])
    }
    /// `lease` (string): the node id's holder (`host|instance`); absent: the node is down.
    pub fn lease(&self) -> String {
        self.key(&LEASE, &[])
    }
    /// `room` (string): sandboxes the node can still add, set with its stats; absent: unknown.
    pub fn room(&self) -> String {
        self.key(&ROOM, &[])
    }
}

/// Lua for the head of every node script: `base` (the node's key scope, taken from `KEYS[1]`,
/// which every node script declares as the node's `sbs` key) and one function per node key,
/// `K.<name>(args)`, built from the same patterns as the Rust builders.
pub fn lua_key_functions() -> String {
    let mut lua = String::from("-- Generated by ledger/src/keys.rs: key names come from there only.\n");
    lua.push_str(&format!("local base = string.sub(KEYS[1], 1, #KEYS[1] - {})\n", SBS.pattern.len()));
    lua.push_str("local K = {}\n");
    for def in NODE_KEYS {
        let ps = params(def.pattern);
        let mut body = String::from("base");
        let mut rest = def.pattern;
        for p in &ps {
            let open = rest.find('{').unwrap_or(rest.len());
            if open > 0 {
                body.push_str(&format!(" .. '{}'", &rest[..open]));
            }
            body.push_str(&format!(" .. {p}"));
            rest = &rest[open + p.len() + 2..];
        }
        if !rest.is_empty() {
            body.push_str(&format!(" .. '{rest}'"));
        }
        lua.push_str(&format!("function K.{}({}) return {body} end\n", def.name, ps.join(", ")));
    }
    lua
}

/// The layout table as the module doc shows it.
pub fn layout() -> Vec<String> {
    let row = |name: String, def: &KeyDef| format!("{name:<31} {:<6} {}", def.kind, def.doc);
    let shown = |scope: &str, def: &KeyDef| {
        let mut name = scope.to_string();
        let args: Vec<String> = params(def.pattern).iter().map(|p| format!("<{p}>")).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        fill(&mut name, def.pattern, &args);
        name
    };
    let mut rows: Vec<String> = NODE_KEYS.iter().map(|d| row(shown("P:{N}:", d), d)).collect();
    rows.extend(GLOBAL_KEYS.iter().map(|d| row(shown(&format!("P:{{{GLOBAL_TAG}}}:"), d), d)));
    rows.push(row(shown("P:{arr:<template>}:", &ARRIVALS), &ARRIVALS));
    rows.extend(QUOTA_KEYS.iter().map(|d| row(shown("P:{q:<top>}:", d), d)));
    rows.extend(RESERVATION_KEYS.iter().map(|d| row(shown("P:{r:<top>}:", d), d)));
    rows.extend(FUNCTION_KEYS.iter().map(|d| row(shown("P:{f:<top>}:", d), d)));
    rows.push(row(shown("P:", &PIN), &PIN));
    rows.push(row(shown("P:", &LPROF), &LPROF));
    rows.push(row(shown("P:", &WAKE), &WAKE));
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_doc_is_the_layout() {
        let src = include_str!("keys.rs");
        let doc: Vec<String> = src
            .lines()
            .skip_while(|l| !l.starts_with("//!"))
            .take_while(|l| l.starts_with("//!"))
            .skip_while(|l| *l != "//! ```text")
            .skip(1)
            .take_while(|l| *l != "//! ```")
            .map(|l| l.trim_start_matches("//! ").to_string())
            .collect();
        assert_eq!(doc, layout(), "regenerate the table at the top of keys.rs from keys::layout()");
    }

    #[test]
    fn builders_follow_the_patterns() {
        let k = Keys::new("p");
        let n = k.node("n1");
        assert_eq!(n.sb("n1.ab"), "p:{n1}:sb:n1.ab");
        assert_eq!(n.wq("busybox", "acme"), "p:{n1}:wq:busybox:acme");
        assert_eq!(n.sbs(), "p:{n1}:sbs");
        assert_eq!(k.nodes(), "p:{global}:nodes");
        assert_eq!(k.node_seen(), "p:{global}:node-seen");
        assert_eq!(k.arrivals("busybox", 17), "p:{arr:busybox}:17");
        assert_eq!(k.pin("acme", "ep-1"), "p:pin:acme:ep-1");
        assert_eq!(k.wake("g1"), "p:wake:g1");
        assert_eq!(k.lazy_profile("sha256:ab"), "p:lprof:sha256:ab");
        let f = k.function("acme/rl", "reward");
        assert_eq!(
            f.all(),
            [
                "p:{f:acme}:fdef",
                "p:{f:acme}:fidle:acme/rl|reward",
                "p:{f:acme}:fenvs:acme/rl|reward",
                "p:{f:acme}:finfl:acme/rl|reward",
                "p:{f:acme}:fstat:acme/rl|reward"
            ]
        );
        assert_eq!(k.invocation("acme/rl", "ab12"), "p:{f:acme}:inv:ab12");
        assert_eq!(k.functions_index(), "p:{global}:fns");
        assert_eq!(k.reservations("acme").all(), ["p:{r:acme}:resv", "p:{r:acme}:rends"]);
        assert_eq!(k.reservation_tops(), "p:{global}:rtops");
        assert_eq!(k.quota_tops(), "p:{global}:qtops");
        assert_eq!(
            k.quota("acme").all(),
            [
                "p:{q:acme}:qlim",
                "p:{q:acme}:quse",
                "p:{q:acme}:qtat",
                "p:{q:acme}:qlease",
                "p:{q:acme}:qrexp",
                "p:{q:acme}:qadm",
                "p:{q:acme}:qdue"
            ]
        );
    }

    #[test]
    fn lua_functions_build_the_same_names() {
        let lua = lua_key_functions();
        assert!(lua.contains("function K.sbs() return base .. 'sbs' end"), "{lua}");
        assert!(lua.contains("function K.sb(sandbox) return base .. 'sb:' .. sandbox end"), "{lua}");
        assert!(lua.contains("function K.wq(template, tenant) return base .. 'wq:' .. template .. ':' .. tenant end"));
        assert!(lua.contains("string.sub(KEYS[1], 1, #KEYS[1] - 3)"));
        assert_eq!(lua.matches("function K.").count(), NODE_KEYS.len());
    }
}

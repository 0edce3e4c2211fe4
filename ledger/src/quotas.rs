//! Quotas: limits on principal paths, admission against every level of a path, and leases
//! that say what each session, waiting request, reservation and private template holds.
//!
//! Everything of one top-level tenant (`acme` and all of `acme/...`) lives under the hash tag
//! `{q:acme}`, so admission (check every level, then count at every level) is one atomic
//! script: 100 concurrent creates under a limit of 10 get exactly 10 admissions. A node's
//! scripts cannot touch that tag (another Redis Cluster slot), so a session's end reaches its
//! lease in a second step: the node script that ends a session pushes it onto the node's
//! `qret` list, and whoever ends it or drains the list gives the lease back. Giving back is
//! idempotent, and `sweep` finds leases whose session or request no longer exists (a gateway
//! or pool-manager that died between the two steps), so usage never drifts for good.

use std::collections::{BTreeMap, HashMap};

use redis::AsyncCommands as _;
use serde::Deserialize;
use wire::quotas::{Dimension, DriftEntry, QuotaDrift, QuotaLimits, QuotaUsage, QuotaView};

use crate::keys::QuotaKeys;
use crate::script::seq;
use crate::{Ledger, Result, from_json, to_json};

/// What a lease holds, in stored units (cpus in thousandths), and the isolation class the
/// request uses (checked against every level's `isolation`, held nowhere).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cost {
    /// Live sessions (1 for a session's lease).
    pub sessions: u64,
    /// CPUs in thousandths (milli-cpus) of the sandbox's template.
    pub cpu_m: u64,
    /// Memory in MiB of the sandbox's template.
    pub memory_mb: u64,
    /// Sandboxes a reservation holds warm (the sum of its items' counts).
    pub reserved: u64,
    /// Private templates (snapshots) kept.
    pub private_templates: u64,
    /// Disk of private templates in MiB, added once a snapshot's size is known.
    pub private_template_mb: u64,
    /// Functions defined (1 for a function's lease).
    pub functions: u64,
    /// Asynchronous invocations accepted and not finished.
    pub async_in_flight: u64,
    /// Asynchronous invocations whose record is kept.
    pub async_results: u64,
    /// KiB (the limit, `async_result_mb`, is in MiB).
    pub async_result_kb: u64,
    /// Reservation requests whose hold has not ended.
    pub reservations: u64,
    /// Templates named by live reservations (one per item).
    pub reservation_items: u64,
    /// The request's isolation class (its template's runtime): checked on every level, not counted.
    pub isolation: Option<String>,
}

impl Cost {
    /// One live session of a template with these limits.
    pub fn session(cpus: f64, memory_mb: u64) -> Cost {
        Cost { sessions: 1, cpu_m: (cpus * 1000.0).round() as u64, memory_mb, ..Cost::default() }
    }

    /// This cost for a request of the isolation class `runtime`.
    pub fn of_isolation(self, runtime: &str) -> Cost {
        Cost { isolation: Some(runtime.to_string()), ..self }
    }

    fn to_json(&self) -> Result<String> {
        let mut m = BTreeMap::new();
        for (k, v) in [
            ("sessions", self.sessions),
            ("cpu_m", self.cpu_m),
            ("memory_mb", self.memory_mb),
            ("reserved", self.reserved),
            ("ptpl", self.private_templates),
            ("ptpl_mb", self.private_template_mb),
            ("fn", self.functions),
            ("ainf", self.async_in_flight),
            ("ares", self.async_results),
            ("ares_kb", self.async_result_kb),
            ("resv", self.reservations),
            ("ritems", self.reservation_items),
        ] {
            if v > 0 {
                m.insert(k, v);
            }
        }
        to_json("quota cost", &m)
    }
}

/// A quota's answer.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Admission {
    /// Every level had room: the lease is held (or already was, counted once).
    Admitted,
    /// Refused: the first limit on the path (own level first) that the request would exceed.
    Denied {
        /// The dimension that is full.
        dimension: Dimension,
        /// The level of the path whose limit it is.
        path: String,
        /// That level's limit, in the API's units (cpus, MiB).
        limit: f64,
        /// What that level uses now, in the same units.
        used: f64,
        /// For the rate: when the next create fits.
        #[serde(default)]
        retry_ms: u64,
    },
    /// Refused for good: a level's `isolation` leaves the request's class out.
    Forbidden {
        /// The level whose `isolation` list refuses the class.
        path: String,
        /// The class the request asked for.
        isolation: String,
        /// The classes that level allows.
        #[serde(deserialize_with = "seq")]
        allowed: Vec<String>,
    },
    /// No such lease (it was given back already).
    Missing,
}

/// Setting a limit above an ancestor's.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum SetLimits {
    /// The limits were set (or removed).
    Ok,
    /// Refused: a limit would exceed an ancestor's (the top-level tenant's including the defaults).
    Above {
        /// The limit's name, as in the limits JSON.
        dimension: String,
        /// The ancestor whose limit is lower.
        path: String,
        /// That ancestor's limit, in the API's units.
        limit: f64,
    },
    /// An isolation class that the ancestor `path` does not allow.
    Outside {
        /// The ancestor that does not allow a class.
        path: String,
        /// The classes that ancestor allows.
        #[serde(deserialize_with = "seq")]
        allowed: Vec<String>,
    },
    /// A tenant would loosen or remove `fields` (sorted), which an admin set on `path`.
    AdminSet {
        /// The path whose admin-set limits they are.
        path: String,
        /// The limits (names as in the limits JSON) it would loosen or remove.
        #[serde(deserialize_with = "seq")]
        fields: Vec<String>,
    },
}

/// Who sets a path's limits: what an admin sets only an admin may loosen or remove.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetBy {
    /// An admin (admin token, operator CLI): its limits are kept as admin-set.
    Admin,
    /// A tenant, on a descendant of its own path (delegation).
    Tenant,
}

#[derive(Deserialize)]
struct Released {
    released: u64,
}

#[derive(Deserialize)]
struct Verified {
    #[serde(deserialize_with = "seq")]
    drift: Vec<DriftEntry>,
}

/// A lease as stored.
#[derive(Debug, Deserialize)]
pub(crate) struct LeaseRecord {
    pub path: String,
    #[serde(default)]
    pub cost: HashMap<String, u64>,
    #[serde(default)]
    pub queued: u8,
}

/// The lease of a session: one per create request, named by the random part of the session
/// id (the same on every node the request tries).
pub fn session_lease(session_id: &str) -> String {
    let hex = session_id.split_once('.').map_or(session_id, |(_, h)| h);
    format!("s:{hex}")
}

/// The lease of a reservation.
pub fn reservation_lease(reservation_id: &str) -> String {
    format!("r:{reservation_id}")
}

/// The lease of a template made from an image (`<namespace>/<name>`).
pub fn image_template_lease(template: &str) -> String {
    format!("i:{template}")
}

/// The lease of a function, by its owner and name.
pub fn function_lease(owner: &str, name: &str) -> String {
    format!("f:{owner}|{name}")
}

/// The lease of an asynchronous invocation while it runs (`async_in_flight`).
pub fn async_running_lease(invocation: &str) -> String {
    format!("ai:{invocation}")
}

/// The lease of an asynchronous invocation's kept record (`async_results`).
pub fn async_kept_lease(invocation: &str) -> String {
    format!("ak:{invocation}")
}

/// Whether a lease ends by itself at its time (`qrexp`) rather than with a holder (the sweep
/// looks for the holder of every other lease: `qdue`).
pub(crate) fn ends_by_itself(lease: &str) -> bool {
    ["r:", "ai:", "ak:"].iter().any(|p| lease.starts_with(p))
}

/// The lease of a private template, by its name or its name's random part.
pub fn template_lease(template: &str) -> String {
    let hex = template.split_once('.').map_or(template, |(_, h)| h);
    format!("t:{hex}")
}

impl Ledger {
    fn quota_keys(&self, path: &str) -> QuotaKeys {
        self.keys.quota(wire::quotas::top(path))
    }

    /// Admits a request of `path` costing `cost` against every level of the path, and holds
    /// it under `lease` (idempotent: an existing lease is admitted again without counting).
    /// `rate`: counts as a session create against `create_rate`. A session lease whose session
    /// does not exist `deadline_in_ms` from now is an orphan (`sweep`); `ends_in_ms` (non-zero)
    /// gives the lease back by itself that long from now. Both count by Redis's clock. A lease
    /// that ends with a holder is indexed for the sweep (its tenant in `qtops` first).
    #[allow(clippy::too_many_arguments)]
    pub async fn quota_admit(
        &self,
        lease: &str,
        path: &str,
        cost: Cost,
        defaults: &QuotaLimits,
        rate: bool,
        deadline_in_ms: u64,
        ends_in_ms: u64,
    ) -> Result<Admission> {
        let k = self.quota_keys(path);
        let checked = !ends_by_itself(lease);
        if checked {
            self.quota_note_top(wire::quotas::top(path)).await?;
        }
        let args = [
            lease,
            path,
            &cost.to_json()?,
            &to_json("quota defaults", defaults)?,
            if rate { "1" } else { "0" },
            &deadline_in_ms.to_string(),
            &ends_in_ms.to_string(),
            cost.isolation.as_deref().unwrap_or(""),
            if checked { "1" } else { "0" },
        ];
        self.run("quota_admit", &self.scripts.quota_admit, &k.all(), &args).await
    }

    /// Adds `extra` to what the held `lease` of `path` costs, if every level has room for it.
    pub async fn quota_extend(
        &self,
        lease: &str,
        path: &str,
        extra: Cost,
        defaults: &QuotaLimits,
    ) -> Result<Admission> {
        let k = self.quota_keys(path);
        let args = [lease, &extra.to_json()?, &to_json("quota defaults", defaults)?];
        self.run("quota_extend", &self.scripts.quota_extend, &k.all(), &args).await
    }

    /// Gives leases of the top-level tenant `top` back; returns how many were still held.
    pub async fn quota_release(&self, top: &str, leases: &[String]) -> Result<u64> {
        if leases.is_empty() {
            return Ok(0);
        }
        let k = self.keys.quota(top);
        let args: Vec<&str> = leases.iter().map(String::as_str).collect();
        let r: Released = self.run("quota_release", &self.scripts.quota_release, &k.all(), &args).await?;
        Ok(r.released)
    }

    /// A held lease enters (`enter`, checking `queued` on every level) or leaves a wait queue.
    pub async fn quota_queue(&self, lease: &str, path: &str, enter: bool, defaults: &QuotaLimits) -> Result<Admission> {
        let k = self.quota_keys(path);
        let args = [lease, if enter { "enter" } else { "leave" }, &to_json("quota defaults", defaults)?];
        self.run("quota_queue", &self.scripts.quota_queue, &k.all(), &args).await
    }

    /// Sets the limits of `path` (`None`: removes them) as an admin (an admin token, the
    /// operator's CLI): they become admin-set. A limit above an ancestor's is refused.
    pub async fn quota_set(
        &self,
        path: &str,
        limits: Option<&QuotaLimits>,
        defaults: &QuotaLimits,
    ) -> Result<SetLimits> {
        self.quota_set_by(path, limits, defaults, SetBy::Admin).await
    }

    /// Sets the limits of `path` (`None`: removes them) on behalf of `by`. A limit above an
    /// ancestor's is refused; a tenant may restate or tighten the limits an admin set on the
    /// path, never loosen or remove them (`SetLimits::AdminSet`).
    pub async fn quota_set_by(
        &self,
        path: &str,
        limits: Option<&QuotaLimits>,
        defaults: &QuotaLimits,
        by: SetBy,
    ) -> Result<SetLimits> {
        let k = self.quota_keys(path);
        let raw = match limits {
            Some(l) => to_json("quota limits", l)?,
            None => String::new(),
        };
        let admin = if by == SetBy::Admin { "1" } else { "0" };
        let args = [path, raw.as_str(), &to_json("quota defaults", defaults)?, admin];
        self.run("quota_set", &self.scripts.quota_set, &k.all(), &args).await
    }

    /// The limits and usage of `path`, and with `children` those of its children too.
    pub async fn quota_view(&self, path: &str, defaults: &QuotaLimits, children: bool) -> Result<QuotaView> {
        let k = self.quota_keys(path);
        let mut conn = self.conn();
        let (lim, used, adm): (HashMap<String, String>, HashMap<String, i64>, HashMap<String, String>) =
            redis::pipe().hgetall(&k.lim).hgetall(&k.used).hgetall(&k.adm).query_async(&mut conn).await?;
        let view = |p: &str| -> Result<QuotaView> {
            let limits = match lim.get(p) {
                Some(raw) => from_json("quota limits", raw)?,
                None => QuotaLimits::default(),
            };
            let admin_set = match adm.get(p) {
                Some(raw) => from_json("admin-set quota limits", raw)?,
                None => QuotaLimits::default(),
            };
            let n = |dim: &str| used.get(&format!("{p}|{dim}")).copied().unwrap_or(0).max(0) as u64;
            let usage = QuotaUsage {
                sessions: n("sessions"),
                cpus: n("cpu_m") as f64 / 1000.0,
                memory_mb: n("memory_mb"),
                queued: n("queued"),
                reserved: n("reserved"),
                private_templates: n("ptpl"),
                private_template_mb: n("ptpl_mb"),
                functions: n("fn"),
                async_in_flight: n("ainf"),
                async_results: n("ares"),
                async_result_mb: n("ares_kb") as f64 / 1024.0,
                reservations: n("resv"),
                reservation_items: n("ritems"),
            };
            let defaults = if wire::quotas::parent(p).is_none() { defaults.clone() } else { QuotaLimits::default() };
            Ok(QuotaView { path: p.to_string(), limits, admin_set, defaults, usage, children: Vec::new() })
        };
        let mut v = view(path)?;
        if children {
            let mut kids: Vec<&str> = lim
                .keys()
                .map(String::as_str)
                .chain(used.keys().filter_map(|f| f.rsplit_once('|').map(|(p, _)| p)))
                .filter(|p| wire::quotas::parent(p) == Some(path))
                .collect();
            kids.sort_unstable();
            kids.dedup();
            v.children = kids.into_iter().map(view).collect::<Result<_>>()?;
        }
        Ok(v)
    }

    /// Gives back the leases of up to `max` sessions that ended on `node` (the node's `qret`
    /// list); returns how many it took off the list. Any number of drainers may run: a
    /// popped entry is given back once (a crash in between leaves it to `sweep`).
    pub async fn quota_drain_returns(&self, node: &str, max: usize) -> Result<usize> {
        let Some(max) = std::num::NonZeroUsize::new(max) else { return Ok(0) };
        let popped: Vec<String> = self.conn().rpop(self.keys.node(node).qret(), Some(max)).await?;
        let mut by_top: HashMap<&str, Vec<String>> = HashMap::new();
        for entry in &popped {
            let Some((tenant, sid)) = entry.split_once('\t') else { continue };
            by_top.entry(wire::quotas::top(tenant)).or_default().push(session_lease(sid));
        }
        for (top, leases) in by_top {
            self.quota_release(top, &leases).await?;
        }
        Ok(popped.len())
    }

    /// Gives `lease` (of the top-level tenant `top`) back unless what it stands for exists:
    /// for a request that was abandoned at an unknown point (its session may or may not have
    /// been granted). True if it was given back.
    pub async fn quota_settle(&self, top: &str, lease: &str) -> Result<bool> {
        let nodes = self.known_nodes().await?;
        if self.holder_alive(lease, &nodes).await? {
            return Ok(false);
        }
        Ok(self.quota_release(top, &[lease.to_string()]).await? > 0)
    }

    /// Recomputes usage and reports drift: the counted usage of every path against the sum of
    /// the leases held (after `sweep`), and the leased sessions of every principal against its
    /// live sessions on every node. With `fix`, counted usage is replaced by the recomputed one.
    pub async fn quota_verify(&self, defaults: &QuotaLimits, fix: bool) -> Result<QuotaDrift> {
        let orphans_released = self.quota_sweep(defaults).await?;
        let mut drift = Vec::new();
        let mut leased: HashMap<String, f64> = HashMap::new();
        for top in self.quota_tops_scanned().await? {
            let k = self.keys.quota(&top);
            let r: Verified =
                self.run("quota_verify", &self.scripts.quota_verify, &k.all(), &[if fix { "1" } else { "0" }]).await?;
            drift.extend(r.drift);
            let leases: HashMap<String, String> = self.conn().hgetall(&k.lease).await?;
            for (id, raw) in leases {
                if id.starts_with("s:") {
                    let l: LeaseRecord = from_json("quota lease", &raw)?;
                    *leased.entry(l.path).or_default() += l.cost.get("sessions").copied().unwrap_or(0) as f64;
                }
            }
        }
        let mut live: HashMap<String, f64> = HashMap::new();
        for n in self.known_nodes().await? {
            for (tenant, count) in self.active_sessions(&n).await? {
                *live.entry(tenant).or_default() += count as f64;
            }
        }
        // A lease is taken before its session exists: leases may exceed live sessions while
        // creates are in flight, never the other way round.
        for (path, &n) in &live {
            let l = leased.get(path).copied().unwrap_or(0.0);
            if n > l {
                drift.push(DriftEntry {
                    path: path.clone(),
                    dimension: "live_sessions".into(),
                    counted: l,
                    recomputed: n,
                });
            }
        }
        drift.sort_by(|a, b| (&a.path, &a.dimension).cmp(&(&b.path, &b.dimension)));
        Ok(QuotaDrift { orphans_released, drift, fixed: fix })
    }
}

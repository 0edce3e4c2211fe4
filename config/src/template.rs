//! `[templates.*]`: the configured templates, their resources, network, ports and user.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use wire::{ExecMode, Network, TemplateEgress, TemplateInfo};

use crate::egress::{self, EgressConfig};
use crate::{ConfigError, invalid, is_name};

/// Writable disk of one sandbox (its own writes, not its image), MiB: room for a repository, a
/// build and a pip install, while 30 sandboxes cannot fill a 64 GiB data root.
pub const DEFAULT_DISK_MB: u64 = 2048;

/// A sandbox's CFS period: short, so a sandbox that spent its quota (0.5 CPU of a closed loop
/// of execs) waits at most a few milliseconds for the next period, not the tens of
/// milliseconds of the kernel's 100 ms default. 5 ms, not 10: a closed loop of `exec true` at
/// 0.5 CPU then meets p99.9 ≤ 6 ms (4.6-4.9 ms against 5.9-9.6 at 10 ms), for ~0.16 ms more
/// at the median; a sandbox that spins gets its whole quota as at 10 ms unless the host itself
/// is full, and the node pays a little more scheduler work (BENCHMARKS.md, "CFS period").
pub const DEFAULT_CPU_PERIOD: Duration = Duration::from_millis(5);

/// The kernel's bounds on a CFS period.
pub const MIN_CPU_PERIOD: Duration = Duration::from_millis(1);

/// The longest CFS period the kernel takes.
pub const MAX_CPU_PERIOD: Duration = Duration::from_secs(1);

/// The kernel's smallest CFS quota, in microseconds.
const MIN_CFS_QUOTA_US: f64 = 1000.0;

/// Below this the bound would trip on the few KiB a new container writes when it starts.
pub const MIN_DISK_MB: u64 = 16;

/// 16 TiB: above any disk a node has; a larger value is a typo.
pub const MAX_DISK_MB: u64 = 1 << 24;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawTemplate {
    image: Option<String>,
    exec: Option<ExecMode>,
    runtime: Option<String>,
    network: Option<Network>,
    /// The egress policy sessions start under (implies `network = "egress"`).
    egress: Option<String>,
    /// The policies sessions may switch to (default: the initial one and `deny-all`).
    egress_allowed: Option<Vec<String>>,
    cpus: Option<f64>,
    /// The CFS period the sandbox's CPU quota (`cpus` x period) is spent in.
    #[serde(with = "humantime_serde", default)]
    cpu_period: Option<Duration>,
    memory_mb: Option<u64>,
    /// Writable disk per sandbox, MiB; 0: no bound.
    disk_mb: Option<u64>,
    pids: Option<u64>,
    env: BTreeMap<String, String>,
    workdir: Option<String>,
    user: Option<String>,
    max_download_mb: Option<u64>,
    /// TCP ports on the sandbox's loopback the gateway may relay to (`/v1/sessions/{id}/ports/{port}`).
    ports: Option<Vec<u16>>,
    warm: Option<u32>,
    #[serde(with = "humantime_serde", default)]
    idle_timeout: Option<Duration>,
    #[serde(with = "humantime_serde", default)]
    max_lifetime: Option<Duration>,
}

/// A template, validated: what each of its sandboxes is made from and runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    /// Its name, unique among configured and tenant templates.
    pub name: String,
    /// The Docker image its sandboxes start from.
    pub image: String,
    /// How commands run: through the agent, or `docker exec`.
    pub exec: ExecMode,
    /// The OCI runtime, its isolation class: `runc`, `runsc` (gVisor), `crun`, or any other
    /// Docker knows (`docker.runtime` when the template names none).
    pub runtime: String,
    /// No network, the bridge, or named egress through the node's proxy.
    pub network: Network,
    /// Named egress, for `Network::Egress`.
    pub egress: Option<TemplateEgress>,
    /// CPUs (fractional): the sandbox's CFS quota is this many periods' worth.
    pub cpus: f64,
    /// The CFS period of the sandbox's CPU quota: a sandbox that spends `cpus` x this within
    /// one period waits for the next (`DEFAULT_CPU_PERIOD`).
    pub cpu_period: Duration,
    /// Memory limit, MiB.
    pub memory_mb: u64,
    /// Bound on the sandbox's own writes (its writable layer), MiB; 0: none. Enforced by
    /// Docker's `StorageOpt size` where the node supports it (see `DockerConfig::disk_bounds`).
    pub disk_mb: u64,
    /// Process (pids) limit.
    pub pids: u64,
    /// Environment of every command, over the image's.
    pub env: BTreeMap<String, String>,
    /// The working directory of commands and relative file paths.
    pub workdir: String,
    /// Who tenant commands, terminals and file calls run as.
    pub user: User,
    /// Most bytes one file read sends (a directory's tar included), in MiB.
    pub max_download_mb: u64,
    /// Ports of the sandbox the gateway relays to (sorted, no duplicates); empty: none.
    pub ports: Vec<u16>,
    /// Idle sandboxes each node keeps ready.
    pub warm: u32,
    /// A session idle this long ends.
    pub idle_timeout: Duration,
    /// A session ends this long after it started, busy or not.
    pub max_lifetime: Duration,
}

impl Template {
    /// What the API shows of it (`GET /v1/templates`).
    pub fn info(&self) -> TemplateInfo {
        TemplateInfo {
            name: self.name.clone(),
            image: self.image.clone(),
            exec: self.exec,
            runtime: self.runtime.clone(),
            network: self.network,
            egress: self.egress.clone(),
            cpus: self.cpus,
            cpu_period_ms: self.cpu_period.as_millis() as u64,
            memory_mb: self.memory_mb,
            disk_mb: self.disk_mb,
            pids: self.pids,
            workdir: self.workdir.clone(),
            user: self.user.spec(),
            ports: self.ports.clone(),
            warm: self.warm,
            idle_timeout_s: self.idle_timeout.as_secs(),
            max_lifetime_s: self.max_lifetime.as_secs(),
            owner: None,
            source: None,
        }
    }
}

impl Template {
    /// The sandbox's CFS period and quota, in microseconds: `cpus` x `cpu_period`, with the
    /// period lengthened where that quota would be under the kernel's 1 ms minimum (a
    /// template of 0.05 CPU runs in 20 ms periods).
    pub fn cfs_period_and_quota_us(&self) -> (i64, i64) {
        let mut period = self.cpu_period.as_micros() as f64;
        if self.cpus * period < MIN_CFS_QUOTA_US {
            period = (MIN_CFS_QUOTA_US / self.cpus).ceil().min(MAX_CPU_PERIOD.as_micros() as f64);
        }
        let quota = (self.cpus * period).round().max(MIN_CFS_QUOTA_US);
        (period as i64, quota as i64)
    }

    /// Checks a CFS period (`cpu_period`): the kernel takes 1 ms ..= 1 s.
    pub fn check_cpu_period(period: Duration) -> Result<(), (&'static str, String)> {
        if !(MIN_CPU_PERIOD..=MAX_CPU_PERIOD).contains(&period) || !period.subsec_micros().is_multiple_of(1000) {
            return Err(("cpu_period", "must be whole milliseconds in 1ms ..= 1s".into()));
        }
        Ok(())
    }

    /// Checks a template's limits (`field` names the one at fault).
    pub fn check_limits(cpus: f64, memory_mb: u64, disk_mb: u64, pids: u64) -> Result<(), (&'static str, String)> {
        if !(cpus > 0.0 && cpus <= 64.0) {
            return Err(("cpus", "must be in (0, 64]".into()));
        }
        if !(8..=1 << 20).contains(&memory_mb) {
            return Err(("memory_mb", "must be 8 ..= 1048576".into()));
        }
        if disk_mb != 0 && !(MIN_DISK_MB..=MAX_DISK_MB).contains(&disk_mb) {
            return Err(("disk_mb", format!("must be 0 (no bound) or {MIN_DISK_MB} ..= {MAX_DISK_MB}")));
        }
        if !(8..=1 << 20).contains(&pids) {
            return Err(("pids", "must be 8 ..= 1048576".into()));
        }
        Ok(())
    }
}

/// A template's network and named egress: `egress` implies `network = "egress"`, which needs it.
fn template_egress(
    name: &str,
    network: Option<Network>,
    initial: Option<String>,
    allowed: Option<Vec<String>>,
    egress: &EgressConfig,
) -> Result<(Network, Option<TemplateEgress>), ConfigError> {
    let f = |field: &str| format!("templates.{name}.{field}");
    let Some(initial) = initial else {
        if network == Some(Network::Egress) {
            return Err(invalid(f("egress"), "network = \"egress\" needs the policy sessions start under"));
        }
        if allowed.is_some() {
            return Err(invalid(f("egress_allowed"), "needs egress (the initial policy)"));
        }
        return Ok((network.unwrap_or_default(), None));
    };
    if network.is_some_and(|n| n != Network::Egress) {
        return Err(invalid(f("network"), "must be \"egress\" (or absent) with named egress"));
    }
    let allowed = allowed.unwrap_or_else(|| {
        let mut a = vec![initial.clone()];
        if initial != egress::DENY_ALL {
            a.push(egress::DENY_ALL.to_string());
        }
        a
    });
    // The initial policy must exist now (every sandbox starts under it); the others may be
    // defined later through the admin API (a switch to one not defined yet answers 409).
    if egress.policy(&initial).is_none() {
        return Err(invalid(f("egress"), format!("no policy named {initial:?} in [egress.policies]")));
    }
    if let Some(bad) = allowed.iter().find(|p| !egress::is_policy_name(p)) {
        return Err(invalid(f("egress_allowed"), format!("{bad:?} is not a policy name")));
    }
    if !allowed.contains(&initial) {
        return Err(invalid(f("egress_allowed"), format!("must include the initial policy {initial:?}")));
    }
    Ok((Network::Egress, Some(TemplateEgress { initial, allowed })))
}

pub(crate) fn validate_template(
    name: &str,
    t: RawTemplate,
    default_runtime: &str,
    egress: &EgressConfig,
) -> Result<Template, ConfigError> {
    let (network, template_egress) = template_egress(name, t.network, t.egress, t.egress_allowed, egress)?;
    let f = |field: &str| format!("templates.{name}.{field}");
    if !is_name(name, 64) {
        return Err(invalid(format!("templates.{name}"), "name must be 1-64 characters of a-z, 0-9, '-' and '_'"));
    }
    let image = t.image.ok_or_else(|| invalid(f("image"), "is required"))?;
    let cpus = t.cpus.unwrap_or(1.0);
    let memory_mb = t.memory_mb.unwrap_or(512);
    let disk_mb = t.disk_mb.unwrap_or(DEFAULT_DISK_MB);
    let pids = t.pids.unwrap_or(512);
    Template::check_limits(cpus, memory_mb, disk_mb, pids).map_err(|(field, m)| invalid(f(field), m))?;
    let cpu_period = t.cpu_period.unwrap_or(DEFAULT_CPU_PERIOD);
    Template::check_cpu_period(cpu_period).map_err(|(field, m)| invalid(f(field), m))?;
    let workdir = t.workdir.unwrap_or_else(|| "/".into());
    if let Some(p) = agent_proto::layout::workdir_problem(&workdir) {
        return Err(invalid(f("workdir"), p));
    }
    let user = match t.user.as_deref() {
        None => User::DEFAULT,
        Some(u) => User::parse(u).ok_or_else(|| {
            invalid(f("user"), "must be \"root\", a uid or uid:gid (numbers: the image's user names are not read)")
        })?,
    };
    if matches!(user, User::Id { uid, gid } if uid == SEALED_UID || gid == SEALED_UID) {
        return Err(invalid(f("user"), format!("{SEALED_UID} is the node's own (sealed directories)")));
    }
    let max_download_mb = t.max_download_mb.unwrap_or(1024);
    if !(1..=1 << 20).contains(&max_download_mb) {
        return Err(invalid(f("max_download_mb"), "must be 1 ..= 1048576"));
    }
    let ports = validate_ports(t.ports.unwrap_or_default()).map_err(|m| invalid(f("ports"), m))?;
    let warm = t.warm.unwrap_or(0);
    if warm > 10_000 {
        return Err(invalid(f("warm"), "must be at most 10000"));
    }
    let idle_timeout = t.idle_timeout.unwrap_or(Duration::from_secs(600));
    let max_lifetime = t.max_lifetime.unwrap_or(Duration::from_secs(4 * 3600));
    if idle_timeout < Duration::from_secs(1) {
        return Err(invalid(f("idle_timeout"), "must be at least 1s"));
    }
    if max_lifetime < idle_timeout.min(Duration::from_secs(1)) || max_lifetime < Duration::from_secs(1) {
        return Err(invalid(f("max_lifetime"), "must be at least 1s"));
    }
    for k in t.env.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(invalid(f(&format!("env.{k}")), "is not a valid variable name"));
        }
    }
    Ok(Template {
        name: name.to_string(),
        image,
        exec: t.exec.unwrap_or_default(),
        runtime: t.runtime.unwrap_or_else(|| default_runtime.to_string()),
        network,
        egress: template_egress,
        cpus,
        cpu_period,
        memory_mb,
        disk_mb,
        pids,
        env: t.env,
        workdir,
        user,
        max_download_mb,
        ports,
        warm,
        idle_timeout,
        max_lifetime,
    })
}

/// Most ports one template exposes: a handful of services per sandbox is the use.
pub const MAX_TEMPLATE_PORTS: usize = 32;

/// A template's exposed ports, sorted: each 1 ..= 65535, no duplicates, at most
/// `MAX_TEMPLATE_PORTS`.
pub fn validate_ports(mut ports: Vec<u16>) -> Result<Vec<u16>, String> {
    if ports.contains(&0) {
        return Err("port 0 is not a port (1 ..= 65535)".into());
    }
    if ports.len() > MAX_TEMPLATE_PORTS {
        return Err(format!("at most {MAX_TEMPLATE_PORTS} ports"));
    }
    ports.sort_unstable();
    if let Some(w) = ports.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("port {} is listed twice", w[0]));
    }
    Ok(ports)
}

/// The user a template's tenant code runs as: an unprivileged uid by default; `root` only
/// when the template says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum User {
    /// Root (uid 0): only when the template says `user = "root"`.
    Root,
    /// This uid and gid.
    Id {
        /// The user id.
        uid: u32,
        /// The group id.
        gid: u32,
    },
}

/// A uid (and gid) no template may run as: the owner of the node's sealed per-sandbox
/// directories, which no sandbox process may own.
pub const SEALED_UID: u32 = 0xFFFF_FFFE;

impl User {
    /// Who tenant code runs as when the template names no user.
    pub const DEFAULT: User = User::Id { uid: 1000, gid: 1000 };

    /// `root`, `0`, `uid` (its gid the same) or `uid:gid`.
    pub fn parse(s: &str) -> Option<User> {
        let (uid, gid) = match s.split_once(':') {
            _ if s == "root" => return Some(User::Root),
            Some((u, g)) => (u.parse().ok()?, g.parse().ok()?),
            None => {
                let u = s.parse().ok()?;
                (u, u)
            }
        };
        Some(if uid == 0 && gid == 0 { User::Root } else { User::Id { uid, gid } })
    }

    /// As Docker and the agent take it: `uid:gid`, or `root`.
    pub fn spec(&self) -> String {
        match self {
            User::Root => "root".into(),
            User::Id { uid, gid } => format!("{uid}:{gid}"),
        }
    }
}

//! The node's sandbox budget: how many sandboxes this machine can hold, from every resource
//! that can run out, not only memory. A node that runs out of process ids cannot fork at all:
//! Docker, shells and the pool-manager itself fail, for everyone (2,354 sandboxes on this
//! 2-core, 24 GiB machine at the default `kernel.pid_max` of 32,768). So each resource keeps a
//! reserve for the system, and creates stop at the least capacity of any.
//!
//! For a resource with machine-wide `limit`, `used` now and `per_sandbox` cost, with `n`
//! sandboxes on the node: `capacity = n + (limit × (1 − reserve) − used) / per_sandbox`. Using
//! what is in use *now* (the node's own sandboxes included) keeps it true whatever else runs on
//! the machine; `per_sandbox` is measured from the node's own sandboxes where it can be.

use wire::{BudgetResource, NodeBudget};

/// The share of each machine-wide resource kept for the system.
pub const RESERVE: f64 = 0.10;
/// Threads one idle runc sandbox costs: its containerd shim (~12) and the agent (2). Measured
/// on this machine filling it to 2,354 sandboxes (BENCHMARKS.md); the node refines it from its
/// own sandboxes (`measured_threads_per_sandbox`).
pub const THREADS_PER_SANDBOX: f64 = 14.0;
/// Memory one idle sandbox costs the machine beyond what it uses itself: shim, agent, kernel
/// objects (~4.9 MiB measured at 2,354 idle busybox sandboxes).
pub const MEMORY_MB_PER_SANDBOX: f64 = 5.0;
/// Open files per sandbox, machine-wide (`fs.file-max`): the shim's, the attach streams.
pub const FILES_PER_SANDBOX: f64 = 32.0;
/// Descriptors one sandbox holds open in each long-lived process that serves them, against
/// that process's own `RLIMIT_NOFILE` (measured at 2,850 sandboxes here: dockerd 19,986,
/// containerd 11,424, the pool-manager 2,868). dockerd at its limit (20,000 on this machine,
/// which cannot raise it) fails every create with "too many open files".
pub const PROCESS_FILES_PER_SANDBOX: [(&str, f64); 3] = [("dockerd", 7.0), ("containerd", 4.0), ("pool-manager", 1.0)];

/// Open descriptors of one process against its soft limit, as last measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessFiles {
    /// `dockerd`, `containerd`, `pool-manager` (this process).
    pub name: &'static str,
    /// The process's soft `RLIMIT_NOFILE` (infinite when unlimited).
    pub limit: f64,
    /// Descriptors it had open (entries in its `/proc/<pid>/fd`).
    pub open: f64,
    /// The node's sandboxes at the time: the estimate of what is open now is
    /// `open + per_sandbox × (sandboxes now − sandboxes then)`.
    pub sandboxes: u64,
}

/// What the node measures from the machine's processes, once a minute (a walk of `/proc`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    /// Threads per sandbox measured from a sample of the node's containers; `None` (fewer than 3
    /// found) falls back to `THREADS_PER_SANDBOX`.
    pub threads_per_sandbox: Option<f64>,
    /// Open descriptors against their limit, for each of dockerd, containerd and this process
    /// found.
    pub files: Vec<ProcessFiles>,
}

/// What the machine has and uses now. A trait so the arithmetic is tested with fixed figures.
pub trait Probe {
    /// The most threads (process ids) the machine allows: the least of `kernel.pid_max`,
    /// `kernel.threads-max`, and the configured cap if any.
    fn thread_limit(&self) -> Option<f64>;
    /// Threads alive on the whole machine.
    fn threads_used(&self) -> Option<f64>;
    /// (total, in use) memory, MiB (in use: total less what is available).
    fn memory_mb(&self) -> Option<(f64, f64)>;
    /// (`fs.file-max`, open now).
    fn open_files(&self) -> Option<(f64, f64)>;
}

/// Reads `/proc`.
pub struct Proc {
    /// `pool_manager.max_threads`: a cap below the kernel's (tests, shared machines).
    pub thread_cap: Option<u64>,
}

fn read_num(path: &str) -> Option<f64> {
    std::fs::read_to_string(path).ok()?.split_whitespace().next()?.parse().ok()
}

impl Probe for Proc {
    fn thread_limit(&self) -> Option<f64> {
        let kernel = [read_num("/proc/sys/kernel/pid_max")?, read_num("/proc/sys/kernel/threads-max")?];
        let cap = self.thread_cap.map(|c| c as f64).unwrap_or(f64::INFINITY);
        Some(kernel.into_iter().fold(cap, f64::min))
    }

    fn threads_used(&self) -> Option<f64> {
        // The fourth field of loadavg is "runnable/total" scheduling entities: every thread.
        let l = std::fs::read_to_string("/proc/loadavg").ok()?;
        l.split_whitespace().nth(3)?.split('/').nth(1)?.parse().ok()
    }

    fn memory_mb(&self) -> Option<(f64, f64)> {
        let m = std::fs::read_to_string("/proc/meminfo").ok()?;
        let field = |name: &str| -> Option<f64> {
            m.lines()
                .find(|l| l.starts_with(name))?
                .split_whitespace()
                .nth(1)?
                .parse::<f64>()
                .ok()
                .map(|kb| kb / 1024.0)
        };
        let total = field("MemTotal:")?;
        Some((total, total - field("MemAvailable:")?))
    }

    fn open_files(&self) -> Option<(f64, f64)> {
        let nr = std::fs::read_to_string("/proc/sys/fs/file-nr").ok()?;
        let v: Vec<f64> = nr.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        Some((*v.get(2)?, *v.first()?))
    }
}

/// The node's budget with `sandboxes` on it, at most `max_sandboxes` (the config's cap), with
/// what was last `measured` (threads per sandbox, else the estimate; the serving processes'
/// descriptors).
pub fn compute(probe: &dyn Probe, sandboxes: u64, max_sandboxes: u64, measured: &Measured) -> NodeBudget {
    let threads_per_sandbox = measured.threads_per_sandbox;
    let n = sandboxes as f64;
    let mut resources = Vec::new();
    let mut add = |name: &str, limit: f64, used: f64, per: f64, reserve: f64| {
        let room = (limit * (1.0 - reserve) - used) / per;
        let capacity = (n + room).floor().max(0.0) as u64;
        resources.push(BudgetResource { name: name.into(), limit, used, per_sandbox: per, capacity });
    };
    if let (Some(limit), Some(used)) = (probe.thread_limit(), probe.threads_used()) {
        add("threads", limit, used, threads_per_sandbox.unwrap_or(THREADS_PER_SANDBOX), RESERVE);
    }
    if let Some((total, used)) = probe.memory_mb() {
        add("memory_mb", total, used, MEMORY_MB_PER_SANDBOX, RESERVE);
    }
    if let Some((max, open)) = probe.open_files() {
        add("open_files", max, open, FILES_PER_SANDBOX, RESERVE);
    }
    for pf in &measured.files {
        let per = PROCESS_FILES_PER_SANDBOX.iter().find(|(n, _)| *n == pf.name).map_or(1.0, |(_, p)| *p);
        let open_now = pf.open + per * (n - pf.sandboxes as f64);
        add(&format!("{}_files", pf.name), pf.limit, open_now, per, RESERVE);
    }
    add("max_sandboxes", max_sandboxes as f64, n, 1.0, 0.0);
    let binding = resources.iter().min_by_key(|r| r.capacity).expect("max_sandboxes is always there");
    NodeBudget { capacity: binding.capacity, sandboxes, binding: binding.name.clone(), resources }
}

/// The warning a node gives at start-up when a kernel limit caps it below what its memory
/// allows (the config's own cap is a choice, not a warning).
pub fn tuning_advice(b: &NodeBudget) -> Option<String> {
    let cap = |name: &str| b.resources.iter().find(|r| r.name == name).map(|r| r.capacity);
    let memory = cap("memory_mb")?;
    let binding = b.resources.iter().find(|r| r.name == b.binding)?;
    let knob = match binding.name.as_str() {
        "threads" => "kernel.pid_max / kernel.threads-max",
        "open_files" => "fs.file-max",
        _ => return None,
    };
    (binding.capacity < memory).then(|| {
        format!(
            "this node holds at most {} sandboxes, bound by {} ({knob} = {}), while its memory would allow {memory}: \
             raise {knob} (scripts/lib.sh ensure_node_tuning does; README, Operating sandpool)",
            binding.capacity, binding.name, binding.limit
        )
    })
}

/// Sandboxes whose threads one measure counts: a sample, so a measure reads a few dozen
/// processes whatever the node holds.
pub const THREAD_SAMPLE: usize = 32;

/// Where dockerd and containerd were last found in `/proc`, so a measure reads their
/// descriptors without walking every process (only again when one of them has moved: a
/// restart).
#[derive(Debug, Default, Clone)]
pub struct ServicePids(Vec<(&'static str, u32)>);

/// One measure, with `sandboxes` on the node: threads per sandbox from `sample` (a few of the node's containers: the
/// processes in each one's cgroup plus the shim that is their parent, over how many were
/// found; `None` with fewer than 3), and the open descriptors and limits of dockerd,
/// containerd and this process. O(sample + those three processes' descriptors): `/proc` is
/// walked only to find dockerd and containerd (the first time, and after they restart), and
/// for the threads only where the sandboxes' cgroups are not where Docker puts them by
/// default. The node calls it once a minute, off the async threads.
pub fn measure(sample: &[String], sandboxes: u64, pids: &mut ServicePids) -> Measured {
    let mut files = Vec::new();
    if let Some(pf) = process_files("pool-manager", std::path::Path::new("/proc/self"), sandboxes) {
        files.push(pf);
    }
    let alive =
        |name: &str, pid: u32| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == name);
    if pids.0.len() < 2 || pids.0.iter().any(|(n, p)| !alive(n, *p)) {
        pids.0 = find_services();
    }
    for (name, pid) in &pids.0 {
        if let Some(pf) = process_files(name, &std::path::Path::new("/proc").join(pid.to_string()), sandboxes) {
            files.push(pf);
        }
    }
    let threads_per_sandbox = sample_threads(sample).or_else(|| walk_threads(sample));
    Measured { threads_per_sandbox, files }
}

/// dockerd's and containerd's process ids: a walk of `/proc` reading each `comm`.
fn find_services() -> Vec<(&'static str, u32)> {
    let mut found: Vec<(&'static str, u32)> = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else { continue };
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if let Some(name) = ["dockerd", "containerd"].into_iter().find(|n| comm.trim() == *n)
            && !found.iter().any(|(n, _)| *n == name)
        {
            found.push((name, pid));
        }
    }
    found
}

/// `(Threads, PPid)` of a process.
fn threads_and_parent(pid: u32) -> Option<(u64, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| status.lines().find(|l| l.starts_with(name))?.split_whitespace().nth(1)?.parse().ok();
    Some((field("Threads:")?, field("PPid:")? as u32))
}

/// Threads per sandbox from the sample's cgroups (Docker's default places, cgroup v1 and v2,
/// cgroupfs and systemd drivers); `None` if fewer than 3 were found there.
fn sample_threads(sample: &[String]) -> Option<f64> {
    let procs: Vec<Vec<u32>> = sample
        .iter()
        .filter_map(|id| {
            let dirs = [
                format!("/sys/fs/cgroup/pids/docker/{id}"),
                format!("/sys/fs/cgroup/docker/{id}"),
                format!("/sys/fs/cgroup/system.slice/docker-{id}.scope"),
                format!("/sys/fs/cgroup/pids/system.slice/docker-{id}.scope"),
            ];
            let procs = dirs.iter().find_map(|d| std::fs::read_to_string(format!("{d}/cgroup.procs")).ok())?;
            Some(procs.lines().filter_map(|l| l.trim().parse().ok()).collect())
        })
        .collect();
    threads_of(&procs, 3)
}

/// Threads per sandbox of sandboxes whose processes are `procs` (one list each): their own,
/// plus their shims' (the parents of their inits, outside them), each shim counted once however
/// many of them it serves. Sandboxes that share shims (`[docker] shim_group`) share them with
/// sandboxes outside the sample too, so this is an upper bound then: the budget errs low.
/// `None` with fewer than `least` sandboxes found running.
fn threads_of(procs: &[Vec<u32>], least: u64) -> Option<f64> {
    let (mut threads, mut found) = (0u64, 0u64);
    let mut shims: Vec<u32> = Vec::new();
    for pids in procs {
        let mut mine = 0;
        for pid in pids {
            let Some((n, parent)) = threads_and_parent(*pid) else { continue };
            mine += n;
            // The container's init: its parent, outside the cgroup, is the shim.
            if !pids.contains(&parent) && !shims.contains(&parent) {
                shims.push(parent);
            }
        }
        if mine > 0 {
            threads += mine;
            found += 1;
        }
    }
    threads += shims.iter().filter_map(|s| threads_and_parent(*s)).map(|(n, _)| n).sum::<u64>();
    (found >= least && threads > 0).then(|| threads as f64 / found as f64)
}

/// Threads per sandbox the slow way, where the cgroups are elsewhere: a walk of every process
/// to find those in the sample's cgroups, then as `sample_threads`. (Public for the test that
/// checks the sample against it.)
pub fn walk_threads(sample: &[String]) -> Option<f64> {
    let ids: Vec<&str> = sample.iter().map(String::as_str).collect();
    if ids.len() < 3 {
        return None;
    }
    let mut procs: Vec<Vec<u32>> = vec![Vec::new(); ids.len()];
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else { continue };
        let cgroup = std::fs::read_to_string(entry.path().join("cgroup")).unwrap_or_default();
        let last = |l: &str| {
            l.rsplit('/').next().map(|s| s.trim_start_matches("docker-").trim_end_matches(".scope").to_string())
        };
        if let Some(i) = cgroup.lines().filter_map(last).find_map(|c| ids.iter().position(|id| *id == c)) {
            procs[i].push(pid);
        }
    }
    threads_of(&procs, 1)
}

/// A process's open descriptors and its soft `RLIMIT_NOFILE`.
fn process_files(name: &'static str, proc_dir: &std::path::Path, sandboxes: u64) -> Option<ProcessFiles> {
    let limits = std::fs::read_to_string(proc_dir.join("limits")).ok()?;
    let soft = limits.lines().find(|l| l.starts_with("Max open files"))?.split_whitespace().nth(3)?;
    let limit = if soft == "unlimited" { f64::INFINITY } else { soft.parse().ok()? };
    let open = std::fs::read_dir(proc_dir.join("fd")).ok()?.count() as f64;
    Some(ProcessFiles { name, limit, open, sandboxes })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed {
        threads: (f64, f64),
        memory: (f64, f64),
        files: (f64, f64),
    }

    impl Probe for Fixed {
        fn thread_limit(&self) -> Option<f64> {
            Some(self.threads.0)
        }
        fn threads_used(&self) -> Option<f64> {
            Some(self.threads.1)
        }
        fn memory_mb(&self) -> Option<(f64, f64)> {
            Some(self.memory)
        }
        fn open_files(&self) -> Option<(f64, f64)> {
            Some(self.files)
        }
    }

    /// This machine at the default tuning with 2,000 sandboxes: 24 GiB, pid_max 32,768.
    fn machine() -> Fixed {
        Fixed { threads: (32_768.0, 29_000.0), memory: (24_576.0, 11_000.0), files: (1e6, 60_000.0) }
    }

    #[test]
    fn process_ids_bind_this_machine_before_memory_does() {
        let b = compute(&machine(), 2_000, 10_000, &Measured::default());
        assert_eq!(b.binding, "threads");
        // (32,768 × 0.9 − 29,000) / 14 = 35.5 more: 2,035 in all, far below the 2,354 that
        // ran the machine out of process ids.
        assert_eq!(b.capacity, 2_035);
        let mem = b.resources.iter().find(|r| r.name == "memory_mb").unwrap();
        assert!(mem.capacity > 3_000, "{mem:?}");
        assert!(!b.full());
        // 35 sandboxes later, their threads in use too: full.
        let later = Fixed { threads: (32_768.0, 29_000.0 + 35.0 * 14.0), ..machine() };
        assert!(compute(&later, 2_035, 10_000, &Measured::default()).full());
    }

    #[test]
    fn a_raised_pid_max_leaves_memory_or_the_cap_binding() {
        let tuned = Fixed { threads: (4_194_304.0, 29_000.0), ..machine() };
        let b = compute(&tuned, 2_000, 10_000, &Measured::default());
        assert_eq!(b.binding, "memory_mb");
        let capped = compute(&tuned, 2_000, 2_500, &Measured::default());
        assert_eq!((capped.binding.as_str(), capped.capacity), ("max_sandboxes", 2_500));
    }

    #[test]
    fn a_kernel_limit_below_the_memory_capacity_is_warned_about_and_the_cap_is_not() {
        let advice = tuning_advice(&compute(&machine(), 2_000, 10_000, &Measured::default())).expect("pid_max binds");
        assert!(advice.contains("kernel.pid_max") && advice.contains("2035"), "{advice}");
        let tuned = Fixed { threads: (4_194_304.0, 29_000.0), ..machine() };
        assert_eq!(tuning_advice(&compute(&tuned, 2_000, 10_000, &Measured::default())), None);
        assert_eq!(
            tuning_advice(&compute(&tuned, 2_000, 100, &Measured::default())),
            None,
            "the config's cap is a choice"
        );
    }

    #[test]
    fn dockerds_descriptor_limit_binds_a_tuned_node_where_it_cannot_be_raised() {
        // This machine: dockerd's RLIMIT_NOFILE is 20,000 and cannot be raised here; at 2,850
        // sandboxes it had 19,986 open and every create failed.
        let tuned = Fixed { threads: (4_194_304.0, 39_000.0), memory: (24_105.0, 14_600.0), ..machine() };
        let dockerd = ProcessFiles { name: "dockerd", limit: 20_000.0, open: 14_100.0, sandboxes: 2_000 };
        let m = Measured { threads_per_sandbox: Some(13.8), files: vec![dockerd] };
        let b = compute(&tuned, 2_000, 10_000, &m);
        assert_eq!(b.binding, "dockerd_files");
        // (20,000 × 0.9 − 14,100) / 7 = 557 more: 2,557, short of the 2,850 that failed.
        assert_eq!(b.capacity, 2_557);
        assert!(b.capacity < 2_850);
        // Later, with more sandboxes, the estimate of what is open grows with them.
        assert!(compute(&tuned, 2_557, 10_000, &m).full());
        assert_eq!(tuning_advice(&b), None, "a process limit is not a sysctl: no sysctl advice");
    }

    #[test]
    fn over_budget_is_full_never_negative() {
        let starved = Fixed { threads: (1_000.0, 990.0), ..machine() };
        let b = compute(&starved, 5, 100, &Measured { threads_per_sandbox: Some(20.0), files: vec![] });
        assert_eq!((b.capacity, b.binding.as_str()), (0, "threads"));
        assert!(b.full());
        let t = b.resources.iter().find(|r| r.name == "threads").unwrap();
        assert_eq!(t.per_sandbox, 20.0, "the measured cost is used");
    }
}

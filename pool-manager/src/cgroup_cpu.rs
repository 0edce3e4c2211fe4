//! A container's CPU accounting read from its cgroup's files, without asking Docker.
//!
//! `GET /v1/sessions/{id}` shows the sandbox's CPU use and throttling; Docker's one-shot stats
//! cost a Docker call (tens of ms on a busy node) per read, while the kernel keeps the same
//! counters in two small files. Where the files are depends on the cgroup version and driver:
//!
//! - v1 (separate or joint `cpu`/`cpuacct` hierarchies): `cpuacct.usage` (ns) and the `cpu`
//!   controller's `cpu.stat` (`throttled_time`, ns);
//! - v2: one `cpu.stat` (`usage_usec`, `throttled_usec`);
//!
//! under Docker's `cgroupfs` parent (`docker/<id>`) or its `systemd` one
//! (`system.slice/docker-<id>.scope`). A layout found nowhere (a custom `--cgroup-parent`, a
//! runtime that keeps its cgroup elsewhere, a node whose `/sys/fs/cgroup` is not the host's)
//! answers `None`, and the caller asks Docker instead.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// What a container's CPU accounting says so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuUse {
    /// CPU time its processes used.
    pub used: Duration,
    /// Time CFS held it back for having spent its quota within a period.
    pub throttled: Duration,
}

/// The accounting of container `id` (its full id) from the host's cgroup files under `root`
/// (`/sys/fs/cgroup` on a node), or `None` where no layout this knows holds them.
pub(crate) fn read(root: &Path, id: &str) -> Option<CpuUse> {
    // An id is what Docker made it: refuse anything that could leave the directory.
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return None;
    }
    let scopes = [format!("docker/{id}"), format!("system.slice/docker-{id}.scope")];
    for scope in &scopes {
        if let Some(cpu) = read_v1(root, scope).or_else(|| read_v2(&root.join(scope))) {
            return Some(cpu);
        }
    }
    None
}

/// The host's cgroup root.
pub(crate) fn host_root() -> PathBuf {
    PathBuf::from("/sys/fs/cgroup")
}

/// cgroup v1: usage from the `cpuacct` hierarchy, throttling from the `cpu` one (mounted
/// apart or joined as `cpu,cpuacct`).
fn read_v1(root: &Path, scope: &str) -> Option<CpuUse> {
    let dirs = ["cpuacct", "cpu,cpuacct", "cpuacct,cpu"];
    let (mount, usage) =
        dirs.iter().find_map(|m| Some((*m, read_u64(&root.join(m).join(scope).join("cpuacct.usage"))?)))?;
    // The throttling counters live with the `cpu` controller: the joint mount's directory, or
    // the `cpu` one. A container without a quota has them at 0.
    let cpu_dir = if mount == "cpuacct" { root.join("cpu").join(scope) } else { root.join(mount).join(scope) };
    let throttled_ns =
        std::fs::read_to_string(cpu_dir.join("cpu.stat")).ok().and_then(|s| field(&s, "throttled_time")).unwrap_or(0);
    Some(CpuUse { used: Duration::from_nanos(usage), throttled: Duration::from_nanos(throttled_ns) })
}

/// cgroup v2: one `cpu.stat` in the container's directory.
fn read_v2(dir: &Path) -> Option<CpuUse> {
    let stat = std::fs::read_to_string(dir.join("cpu.stat")).ok()?;
    let used = field(&stat, "usage_usec")?;
    let throttled = field(&stat, "throttled_usec").unwrap_or(0);
    Some(CpuUse { used: Duration::from_micros(used), throttled: Duration::from_micros(throttled) })
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The value of `name` in a flat-keyed file (`name value` per line).
fn field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    fn tree() -> PathBuf {
        let d = std::env::temp_dir().join(format!("sandpool-cgroup-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn v1_with_cpu_and_cpuacct_mounted_apart() {
        let root = tree();
        write(&root, "cpuacct/docker/abc/cpuacct.usage", "2500000\n");
        write(&root, "cpu/docker/abc/cpu.stat", "nr_periods 9\nnr_throttled 3\nthrottled_time 700000\n");
        let cpu = read(&root, "abc").unwrap();
        assert_eq!(cpu, CpuUse { used: Duration::from_micros(2500), throttled: Duration::from_micros(700) });
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn v1_joint_mount_under_systemd() {
        let root = tree();
        write(&root, "cpu,cpuacct/system.slice/docker-abc.scope/cpuacct.usage", "1000\n");
        write(&root, "cpu,cpuacct/system.slice/docker-abc.scope/cpu.stat", "throttled_time 5\n");
        let cpu = read(&root, "abc").unwrap();
        assert_eq!(cpu, CpuUse { used: Duration::from_nanos(1000), throttled: Duration::from_nanos(5) });
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn v2_one_cpu_stat() {
        let root = tree();
        write(&root, "docker/abc/cpu.stat", "usage_usec 42\nuser_usec 40\nnr_throttled 1\nthrottled_usec 7\n");
        assert_eq!(
            read(&root, "abc").unwrap(),
            CpuUse { used: Duration::from_micros(42), throttled: Duration::from_micros(7) }
        );
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn nothing_found_or_a_strange_id_is_none() {
        let root = tree();
        assert_eq!(read(&root, "abc"), None, "no layout holds it: ask Docker");
        write(&root, "docker/x/cpu.stat", "usage_usec 1\n");
        assert_eq!(read(&root, "../docker/x"), None);
        assert_eq!(read(&root, ""), None);
        std::fs::remove_dir_all(root).unwrap();
    }
}

//! Disk bounds of sandboxes: whether this node enforces templates' `disk_mb` (decided once, at
//! start-up, from a probe of Docker), and the host files every sandbox mounts read-only so that
//! nothing it can write lies outside its bounded writable layer.
//!
//! Why: Docker bounds a container's writable layer (`StorageOpt size`) only on a data root that
//! can (overlay2 on XFS mounted with `pquota`, btrfs with quotas; `scripts/lib.sh` prepares
//! one), and it bind-mounts `/etc/hosts`, `/etc/hostname` and `/etc/resolv.conf` writable from
//! its own directory, where no bound applies: a sandbox could fill the data root through them.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use config::{Config, DiskBounds};

/// The hostname of every sandbox (and the name `/etc/hosts` gives it): the same everywhere, so
/// a command's output does not depend on which container ran it.
pub(crate) const SANDBOX_HOSTNAME: &str = "sandbox";

/// Files under the directory `install_etc` fills, and where sandboxes see them.
pub(crate) const ETC_FILES: [(&str, &str); 3] =
    [("hosts", "/etc/hosts"), ("hostname", "/etc/hostname"), ("resolv.conf", "/etc/resolv.conf")];

/// The command that moves this machine's dockerd onto a data root that bounds disks.
pub(crate) const SWITCH_COMMAND: &str = "SANDPOOL_DOCKER_SWITCH=1 scripts/up";

/// What Docker answered when asked for a container with a bounded writable layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiskSupport {
    /// It created one: every sandbox can get its template's bound.
    Enforced,
    /// It refused (Docker's words), or it could not be asked (no image to probe with).
    Unsupported(String),
}

/// Whether sandboxes of this node get their templates' disk bounds. On a node that cannot
/// bound them: an error naming the templates and the fix when `docker.disk_bounds` is
/// `required`, else a warning and `false` (sandboxes unbounded).
pub(crate) fn decide(config: &Config, support: &DiskSupport) -> anyhow::Result<bool> {
    let asking: Vec<String> = config
        .templates
        .values()
        .filter(|t| t.disk_mb > 0)
        .map(|t| format!("{} (disk_mb {})", t.name, t.disk_mb))
        .collect();
    if asking.is_empty() {
        return Ok(false);
    }
    let why = match support {
        DiskSupport::Enforced => {
            tracing::info!(templates = %asking.join(", "), "sandbox disks are bounded");
            return Ok(true);
        }
        DiskSupport::Unsupported(why) => why,
    };
    let fix = format!(
        "to enforce them, run dockerd on a data root that bounds disks (`{SWITCH_COMMAND}` does, stopping dockerd \
         and every container on it; see the README, \"Disk bounds\")"
    );
    match config.docker.disk_bounds {
        DiskBounds::Required => anyhow::bail!(
            "docker.disk_bounds = \"required\", but this node's Docker cannot bound a sandbox's disk ({why}); \
             templates asking for a bound: {}; {fix}, or set templates.<name>.disk_mb = 0",
            asking.join(", ")
        ),
        DiskBounds::BestEffort => {
            tracing::warn!(
                reason = %why,
                templates = %asking.join(", "),
                "sandbox disks are NOT bounded on this node (docker.disk_bounds = \"best_effort\"): a sandbox can \
                 fill Docker's data root; {fix}"
            );
            Ok(false)
        }
    }
}

/// Writes the read-only `/etc` files of sandboxes into `dir` (unless identical copies are there)
/// and returns `dir`. `resolv.conf` follows the host's as Docker would (loopback and IPv6
/// servers dropped; Google's if none is left), read now: a changed host file reaches sandboxes
/// after the next start.
pub(crate) fn install_etc(dir: &Path) -> io::Result<PathBuf> {
    fs::create_dir_all(dir)?;
    let host_resolv = host_resolv_conf();
    for (name, _) in ETC_FILES {
        let text = match name {
            "hosts" => format!(
                "127.0.0.1\tlocalhost {SANDBOX_HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback {SANDBOX_HOSTNAME}\n"
            ),
            "hostname" => format!("{SANDBOX_HOSTNAME}\n"),
            _ => sandbox_resolv_conf(&host_resolv),
        };
        write_if_changed(&dir.join(name), text.as_bytes())?;
    }
    Ok(dir.to_path_buf())
}

/// The host's resolver configuration: systemd-resolved's upstream list when `/etc/resolv.conf`
/// only names its local stub (as Docker does), else `/etc/resolv.conf`; empty if unreadable.
fn host_resolv_conf() -> String {
    let etc = fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    let stub_only = etc.lines().filter_map(nameserver).all(|ns| ns == "127.0.0.53");
    if stub_only && let Ok(upstream) = fs::read_to_string("/run/systemd/resolve/resolv.conf") {
        return upstream;
    }
    etc
}

fn nameserver(line: &str) -> Option<&str> {
    let mut words = line.split_whitespace();
    (words.next() == Some("nameserver")).then(|| words.next()).flatten()
}

/// `host` without nameservers a sandbox cannot reach (loopback: the host's own; IPv6: Docker's
/// default bridge has none), with Google's public servers if none is left (Docker's rule).
fn sandbox_resolv_conf(host: &str) -> String {
    let mut out = String::from("# sandpool: the host's resolvers (read-only)\n");
    let mut servers = 0;
    for line in host.lines() {
        if let Some(ns) = nameserver(line) {
            let reachable = ns.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_ipv4() && !ip.is_loopback());
            if !reachable {
                continue;
            }
            servers += 1;
        }
        out.push_str(line);
        out.push('\n');
    }
    if servers == 0 {
        out.push_str("nameserver 8.8.8.8\nnameserver 8.8.4.4\n");
    }
    out
}

/// Replaces `path` with `data` (mode 0644) through a rename, unless it already holds exactly
/// that: sandboxes that mounted the old file keep the inode they mounted.
fn write_if_changed(path: &Path, data: &[u8]) -> io::Result<()> {
    if fs::read(path).is_ok_and(|old| old == data) {
        return Ok(());
    }
    let tmp = path.with_extension(format!("{}.{}.tmp", std::process::id(), rand::random::<u32>()));
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).mode(0o644).open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"
[pool_manager]
secret = "0123456789abcdef"
[auth]
key = "0123456789abcdef"
[templates.small]
image = "sandpool/busybox:latest"
disk_mb = 64
[templates.free]
image = "sandpool/busybox:latest"
disk_mb = 0
"#;

    fn config(extra: &str) -> Config {
        Config::from_toml(&format!("{CONFIG}{extra}"), &config::Overrides::default()).unwrap()
    }

    #[test]
    fn a_node_that_cannot_bound_disks_warns_or_refuses() {
        let no = DiskSupport::Unsupported("--storage-opt is supported only for overlay over xfs".into());
        assert!(decide(&config(""), &DiskSupport::Enforced).unwrap());
        assert!(!decide(&config(""), &no).unwrap(), "best effort: start unbounded");
        let required = config("[docker]\ndisk_bounds = \"required\"\n");
        assert!(decide(&required, &DiskSupport::Enforced).unwrap());
        let e = decide(&required, &no).unwrap_err().to_string();
        for part in ["small (disk_mb 64)", "overlay over xfs", SWITCH_COMMAND, "disk_mb = 0"] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
        assert!(!e.contains("free"), "a template without a bound is not named: {e}");
        // Nothing asks for a bound: nothing to refuse.
        let unbounded = Config::from_toml(
            &format!("{}\n[docker]\ndisk_bounds = \"required\"\n", CONFIG.replace("disk_mb = 64", "disk_mb = 0")),
            &config::Overrides::default(),
        )
        .unwrap();
        assert!(!decide(&unbounded, &no).unwrap());
    }

    #[test]
    fn resolv_conf_keeps_what_a_sandbox_can_reach() {
        let host =
            "search corp.example\nnameserver 127.0.0.53\nnameserver 10.0.0.2\nnameserver fd00::1\noptions ndots:2\n";
        let r = sandbox_resolv_conf(host);
        assert!(r.contains("search corp.example\n") && r.contains("options ndots:2\n"), "{r}");
        assert!(r.contains("nameserver 10.0.0.2\n"), "{r}");
        assert!(!r.contains("127.0.0.53") && !r.contains("fd00::1") && !r.contains("8.8.8.8"), "{r}");
        let r = sandbox_resolv_conf("nameserver 127.0.0.1\n");
        assert!(r.contains("nameserver 8.8.8.8\n") && !r.contains("127.0.0.1"), "{r}");
    }

    #[test]
    fn etc_files_are_written_once() {
        let dir = std::env::temp_dir().join(format!("sandpool-etc-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        install_etc(&dir).unwrap();
        let hosts = fs::read_to_string(dir.join("hosts")).unwrap();
        assert!(hosts.starts_with("127.0.0.1\tlocalhost sandbox\n"), "{hosts}");
        assert_eq!(fs::read_to_string(dir.join("hostname")).unwrap(), "sandbox\n");
        let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).unwrap());
        let first = inode(&dir.join("hosts"));
        install_etc(&dir).unwrap();
        assert_eq!(inode(&dir.join("hosts")), first, "an identical file is left alone");
        let mut names: Vec<_> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["hostname", "hosts", "resolv.conf"], "no temp files left");
        let _ = fs::remove_dir_all(dir);
    }
}

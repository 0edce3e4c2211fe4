//! Where the platform puts things inside every sandbox, and the rule that keeps a template's
//! working directory clear of them. The node mounts these paths and the agent serves from
//! them; a workdir that is, contains or lies under one would be handed to tenant code (the
//! agent gives the workdir to the template's user), so the API, the config, the node and the
//! agent all refuse such a workdir with this one rule.

/// The platform's own directory: the agent, its function runtime, its socket.
pub const PLATFORM_DIR: &str = "/.sandpool";
/// The agent binary (read-only bind mount from the node).
pub const AGENT_PATH: &str = "/.sandpool/agent";
/// The Python function runtime (read-only bind mount from the node).
pub const PYTHON_DIR: &str = "/.sandpool/python";
/// The agent's socket directory (bind mount of a per-sandbox directory on the node).
pub const SOCKET_DIR: &str = "/.sandpool/run";

/// The variable in a sandbox's container environment that names the containerd shim group it
/// joins (the node sets it, `sandpool-shim` reads it from the container's spec, and the agent
/// keeps it out of every command's environment).
pub const SHIM_GROUP_ENV: &str = "SANDPOOL_SHIM_GROUP";

/// Every path the container runtime or the node mounts into a sandbox.
pub const PLATFORM_MOUNTS: &[&str] =
    &[PLATFORM_DIR, "/proc", "/sys", "/dev", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf"];

/// True when `path` is `base` or lies under it (`/devx` is not under `/dev`).
fn within(path: &str, base: &str) -> bool {
    path == base || (path.starts_with(base) && path.as_bytes().get(base.len()) == Some(&b'/'))
}

/// Why `dir` may not be a template's working directory, or `None` when it may: it must be an
/// absolute, normal path (no empty, `.` or `..` segment, no NUL) of at most 4,096 bytes (`PATH_MAX`) that
/// neither is, contains nor lies under a path in `PLATFORM_MOUNTS` (so `/etc` is refused as
/// well as `/.sandpool/run` and `/proc/self`). `/` itself is allowed: it is the image's own
/// root, the default of a configured template, and the agent never gives it to anyone.
pub fn workdir_problem(dir: &str) -> Option<String> {
    if !dir.starts_with('/') || dir.len() > 4096 || dir.contains('\0') {
        return Some("must be an absolute path of at most 4096 bytes".into());
    }
    if dir == "/" {
        return None;
    }
    let trimmed = dir.strip_suffix('/').unwrap_or(dir);
    if trimmed[1..].split('/').any(|seg| seg.is_empty() || seg == "." || seg == "..") {
        return Some("must be a normal path (no empty, '.' or '..' segment)".into());
    }
    let hit = PLATFORM_MOUNTS.iter().find(|m| within(trimmed, m) || within(m, trimmed));
    hit.map(|m| format!("must not be, contain or lie under {m} (the platform mounts it)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn platform_paths_and_their_parents_are_refused() {
        for bad in [
            "/.sandpool",
            "/.sandpool/run",
            "/.sandpool/run/",
            "/proc/self",
            "/sys",
            "/dev/shm",
            "/etc",
            "/etc/hosts",
            "/etc/hosts/x",
            "relative",
            "",
            "/work/../.sandpool/run",
            "/work/./x",
            "//.sandpool",
            "/a\0b",
        ] {
            assert!(workdir_problem(bad).is_some(), "{bad:?} should be refused");
        }
        for ok in ["/", "/work", "/work/", "/home/user", "/devices", "/etc-data", "/srv/.sandpoolx", "/tmp"] {
            assert_eq!(workdir_problem(ok), None, "{ok:?}");
        }
    }
}

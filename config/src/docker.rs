//! `[docker]`: the Docker daemon a node drives, its runtime and how sandbox disk is bounded.

use serde::Deserialize;

use crate::{ConfigError, Overrides, invalid, pick};

/// Docker's default socket.
pub const DEFAULT_DOCKER_SOCKET: &str = "/var/run/docker.sock";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawDocker {
    socket: Option<String>,
    /// OCI runtime for templates that name none (runc, crun, runsc).
    runtime: Option<String>,
    /// "required": refuse to start on a node that cannot bound sandbox disks; "best_effort":
    /// start anyway, unbounded, with a warning.
    disk_bounds: Option<String>,
    /// Sandboxes that share one containerd shim (1: a shim each).
    shim_group: Option<usize>,
}

/// `[docker]`, validated.
#[derive(Debug, Clone)]
pub struct DockerConfig {
    /// The Docker daemon's Unix socket.
    pub socket: String,
    /// The OCI runtime of templates that name none (default `runc`).
    pub runtime: String,
    /// What a node whose Docker cannot bound a container's writable layer does with templates
    /// that ask for a bound (`disk_mb` > 0).
    pub disk_bounds: DiskBounds,
    /// How many sandboxes share one containerd shim process (default `DEFAULT_SHIM_GROUP`; 1:
    /// a shim each, Docker's way). Takes effect only where dockerd's containerd finds
    /// `sandpool-shim` first on its `PATH` (`scripts/lib.sh`, `ensure_shim_groups`); elsewhere
    /// every sandbox gets its own shim whatever this says.
    pub shim_group: usize,
}

/// Sandboxes per containerd shim. An idle shim costs the node ~0.35 ms of CPU a second and
/// 11 threads whatever it serves (its Go runtime's housekeeping: BENCHMARKS.md, "What an idle
/// sandbox costs"), so one shim per 32 sandboxes cuts that ~16x; a shim's crash takes its
/// group's sandboxes with it, so groups stay small.
pub const DEFAULT_SHIM_GROUP: usize = 32;
/// The largest `shim_group`.
pub const MAX_SHIM_GROUP: usize = 256;

/// See `DockerConfig::disk_bounds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskBounds {
    /// The pool-manager refuses to start, naming the templates and the fix.
    Required,
    /// The pool-manager starts and creates sandboxes without the bound, with a warning. The
    /// default: a development machine whose dockerd predates `scripts/lib.sh`'s bounded data
    /// root keeps working.
    BestEffort,
}

/// `[docker]`, with the socket override.
pub(crate) fn validate_docker(raw: RawDocker, o: &Overrides) -> Result<DockerConfig, ConfigError> {
    Ok(DockerConfig {
        socket: pick(&o.docker_socket, raw.socket, DEFAULT_DOCKER_SOCKET),
        runtime: raw.runtime.unwrap_or_else(|| "runc".into()),
        disk_bounds: match raw.disk_bounds.as_deref().unwrap_or("best_effort") {
            "required" => DiskBounds::Required,
            "best_effort" => DiskBounds::BestEffort,
            other => {
                return Err(invalid("docker.disk_bounds", format!("{other:?} is not \"required\" or \"best_effort\"")));
            }
        },
        shim_group: match raw.shim_group.unwrap_or(DEFAULT_SHIM_GROUP) {
            n @ 1..=MAX_SHIM_GROUP => n,
            n => return Err(invalid("docker.shim_group", format!("{n} is not within 1..={MAX_SHIM_GROUP}"))),
        },
    })
}

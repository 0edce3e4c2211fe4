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
}

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
    })
}

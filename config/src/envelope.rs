//! The tenant's envelope: what a template made from an image (`POST /v1/templates`) may ask of
//! the configured template it starts from (its base). The base fixes runtime, user, network,
//! egress and lifetimes, and its cpus, memory, pids and disk are ceilings: a tenant may ask for
//! less, never more. Its CFS period (`cpu_period`) is a floor: a tenant may ask for a longer
//! one, never a shorter (which would cost the node scheduler work). An admin may go past the ceilings and pick the network only by saying so
//! (`beyond_base`). No one may put the workdir on a path the platform mounts.
//!
//! `grant` answers a request at the API; `clamp` applies the same rule again where a node turns
//! a stored template into a sandbox, so a record written by an older build (or by hand) cannot
//! carry more than its base allows.

use wire::Network;
use wire::images::{CreateTemplate, ImageTemplate};

use crate::template::{MAX_CPU_PERIOD, MIN_CPU_PERIOD, Template};

/// What a template made from an image runs with, after the envelope.
#[derive(Debug, Clone, PartialEq)]
pub struct Granted {
    /// CPUs (fractional), within the base's.
    pub cpus: f64,
    /// The CFS period of the CPU quota.
    pub cpu_period: std::time::Duration,
    /// Memory limit, MiB, within the base's.
    pub memory_mb: u64,
    /// Writable-layer bound, MiB, within the base's.
    pub disk_mb: u64,
    /// Process limit, within the base's.
    pub pids: u64,
    /// The working directory of its commands.
    pub workdir: String,
    /// The network it runs on (never more open than the base's).
    pub network: Network,
    /// Ports the gateway relays to.
    pub ports: Vec<u16>,
}

/// A request past the envelope: the field at fault and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The request's field at fault.
    pub field: &'static str,
    /// Why, for the caller.
    pub message: String,
}

fn refused(field: &'static str, message: impl Into<String>) -> Refused {
    Refused { field, message: message.into() }
}

/// Checks `req` against `base` and answers what the template gets. `beyond_base` (an admin's
/// explicit opt-in, checked by the caller) lifts the ceilings and lets `network` differ from
/// the base's; the workdir rule holds for everyone.
pub fn grant(base: &Template, req: &CreateTemplate, beyond_base: bool) -> Result<Granted, Refused> {
    let of_base = |what: &str| format!("{what} (the ceiling of base {:?})", base.name);
    let cpus = req.cpus.unwrap_or(base.cpus);
    let memory_mb = req.memory_mb.unwrap_or(base.memory_mb);
    let disk_mb = req.disk_mb.unwrap_or(base.disk_mb);
    let pids = req.pids.unwrap_or(base.pids);
    Template::check_limits(cpus, memory_mb, disk_mb, pids).map_err(|(field, m)| refused(field, m))?;
    let cpu_period = req.cpu_period_ms.map_or(base.cpu_period, std::time::Duration::from_millis);
    Template::check_cpu_period(cpu_period).map_err(|(field, m)| refused(field, m))?;
    let network = req.network.unwrap_or(base.network);
    if network == Network::Egress {
        return Err(refused("network", "\"none\" or \"bridge\" (named egress is for configured templates)"));
    }
    if !beyond_base {
        if cpus > base.cpus {
            return Err(refused("cpus", of_base(&format!("at most {}", base.cpus))));
        }
        // A shorter period costs the node scheduler work: the base's is a floor.
        if cpu_period < base.cpu_period {
            let floor = format!("at least {} ms (the floor of base {:?})", base.cpu_period.as_millis(), base.name);
            return Err(refused("cpu_period_ms", floor));
        }
        if memory_mb > base.memory_mb {
            return Err(refused("memory_mb", of_base(&format!("at most {}", base.memory_mb))));
        }
        if pids > base.pids {
            return Err(refused("pids", of_base(&format!("at most {}", base.pids))));
        }
        if base.disk_mb > 0 && (disk_mb == 0 || disk_mb > base.disk_mb) {
            return Err(refused(
                "disk_mb",
                of_base(&format!("1 ..= {} (0, no bound, is the operator's)", base.disk_mb)),
            ));
        }
        if network != base.network {
            return Err(refused(
                "network",
                format!("is the base's ({:?}); only an admin may choose another", base.network.as_str()),
            ));
        }
    }
    let workdir = req.workdir.clone().unwrap_or_else(|| base.workdir.clone());
    if let Some(p) = agent_proto::layout::workdir_problem(&workdir) {
        return Err(refused("workdir", p));
    }
    let ports = match &req.ports {
        None => base.ports.clone(),
        Some(p) => crate::validate_ports(p.clone()).map_err(|m| refused("ports", m))?,
    };
    if !beyond_base && let Some(p) = ports.iter().find(|p| !base.ports.contains(p)) {
        return Err(refused("ports", of_base(&format!("{p} is not among the base's ports {:?}", base.ports))));
    }
    Ok(Granted { cpus, cpu_period, memory_mb, disk_mb, pids, workdir, network, ports })
}

/// `t`'s settings held to its base's envelope (unless an admin made it `beyond_base`), with
/// a workdir the platform mounts replaced by the base's.
pub fn clamp(base: &Template, t: &ImageTemplate) -> Granted {
    let workdir = match agent_proto::layout::workdir_problem(&t.workdir) {
        None => t.workdir.clone(),
        Some(_) => base.workdir.clone(),
    };
    // 0: a record from before the field, which runs at its base's period.
    let asked = match t.cpu_period_ms {
        0 => base.cpu_period,
        ms => std::time::Duration::from_millis(ms).clamp(MIN_CPU_PERIOD, MAX_CPU_PERIOD),
    };
    if t.beyond_base {
        let network = if t.network == Network::Egress { Network::None } else { t.network };
        let (cpus, memory_mb, disk_mb, pids) = (t.cpus, t.memory_mb, t.disk_mb, t.pids);
        let ports = t.ports.clone();
        return Granted { cpus, cpu_period: asked, memory_mb, disk_mb, pids, workdir, network, ports };
    }
    let disk_mb = match base.disk_mb {
        0 => t.disk_mb,
        ceiling if t.disk_mb == 0 => ceiling,
        ceiling => t.disk_mb.min(ceiling),
    };
    Granted {
        cpus: t.cpus.min(base.cpus),
        cpu_period: asked.max(base.cpu_period),
        memory_mb: t.memory_mb.min(base.memory_mb),
        disk_mb,
        pids: t.pids.min(base.pids),
        workdir,
        // A base with named egress is refused as a base; its templates get no network at all.
        network: if base.network == Network::Egress { Network::None } else { base.network },
        // The base's, as the operator may have narrowed them since.
        ports: t.ports.iter().copied().filter(|p| base.ports.contains(p)).collect(),
    }
}

impl Template {
    /// The template a sandbox of `t` (made from an image) runs: its base's settings with the
    /// image and whatever it overrides, held to the base's envelope (`envelope::clamp`). No
    /// warm pool of its own: demand and reservations size it.
    pub fn from_image(base: &Template, t: &wire::images::ImageTemplate) -> Template {
        let mut env = base.env.clone();
        env.extend(t.env.clone());
        let g = clamp(base, t);
        Template {
            name: t.name.clone(),
            image: t.image.clone(),
            network: g.network,
            egress: None,
            cpus: g.cpus,
            cpu_period: g.cpu_period,
            memory_mb: g.memory_mb,
            disk_mb: g.disk_mb,
            pids: g.pids,
            env,
            workdir: g.workdir,
            ports: g.ports,
            warm: 0,
            ..base.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Config, Overrides};

    fn base() -> Template {
        let toml = "[redis]\nurl = \"redis://127.0.0.1:6379\"\n[pool_manager]\nsecret = \"test-internal-secret-0123456789\"\n\
                    [auth]\nkey = \"test-jwt-key-0123456789abcdef\"\n\
                    [templates.web]\nimage = \"busybox\"\nports = [8000, 9000]\n";
        let c = Config::from_toml(toml, &Overrides::default()).expect("valid");
        c.templates["web"].clone()
    }

    fn req(ports: Option<Vec<u16>>) -> CreateTemplate {
        CreateTemplate { image: "r/x".into(), ports, ..Default::default() }
    }

    #[test]
    fn a_templates_ports_are_some_of_its_bases_unless_an_admin_goes_beyond() {
        let base = base();
        assert_eq!(grant(&base, &req(None), false).unwrap().ports, [8000, 9000], "the base's by default");
        assert_eq!(grant(&base, &req(Some(vec![9000])), false).unwrap().ports, [9000]);
        assert_eq!(grant(&base, &req(Some(vec![])), false).unwrap().ports, Vec::<u16>::new());
        let e = grant(&base, &req(Some(vec![22])), false).unwrap_err();
        assert_eq!(e.field, "ports");
        assert!(e.message.contains("22") && e.message.contains("8000"), "{}", e.message);
        assert_eq!(grant(&base, &req(Some(vec![22])), true).unwrap().ports, [22], "an admin's beyond_base");
        assert_eq!(grant(&base, &req(Some(vec![9000, 9000])), true).unwrap_err().field, "ports");
    }
}

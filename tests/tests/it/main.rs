//! End-to-end tests: the whole stack on real Redis and Docker. Each test starts its own
//! stack under its own key prefix and container label, and removes both when it ends.

mod agent;
mod api;
mod budget;
mod bursts;
mod caller_left;
mod deploy;
mod disk;
mod egress;
mod envelope;
mod exec;
mod files;
mod fleet;
mod forecast;
mod forkbomb;
mod functions;
mod hostnet;
mod images;
mod keys;
mod lazy;
mod lazy_faults;
mod lifecycle;
mod metrics;
mod nodes;
mod observe;
mod pause;
mod ports;
mod queues;
mod quotas;
mod shells;
mod snapshot;
mod tenant_state;
mod ws;

use std::time::Duration;

/// Generous bound for pools to fill on a loaded 2-core machine.
pub const FILL: Duration = Duration::from_secs(60);

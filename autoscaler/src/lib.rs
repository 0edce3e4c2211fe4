//! sandpool's autoscaler: pool-sizing policies as pure functions of observed signals, and a simulator.
//!
//! Wiring the live autoscaler: keep one [`Combined`] for the life of the process; every tick, build an
//! [`Observation`] from the ledger (nodes with capacity and measured create rate/latency; per template its
//! queue depth, memory, warm floor, arrival history and cold-start counter; per pool its idle, leased and
//! creating counts; unexpired reservations), call [`Policy::decide`], and write [`Targets::idle`] as the
//! pools' idle targets (a pool not listed has target 0). [`Targets::reservations`] says, per reservation,
//! whether it will be met and the earliest time it could be; [`check_reservation`] answers
//! `POST /v1/reservations` before a declaration is stored. Policies read no clock: restarting the process
//! loses only the reactive windows, since bursts are re-learned from the arrival history on the first tick.
//!
//! ```
//! use autoscaler::{ArrivalHistory, Combined, NodeSignals, Observation, Policy, PoolKey, PoolSignals, TemplateSignals};
//!
//! let mut policy = Combined::default();
//! let node = NodeSignals {
//!     node: "node-1".into(),
//!     max_sandboxes: 5_000,
//!     memory_mib: 24 * 1024,
//!     create_rate_per_s: 4.0,
//!     create_latency_ms: 500,
//! };
//! let mut obs = Observation::new(120_000, vec![node]);
//! // Per-second arrival counts, e.g. from the ledger's counters: 3 requests in each of the last 60 seconds.
//! let arrivals = ArrivalHistory::from_buckets((60..120).map(|s| (s, 3)));
//! obs.templates.insert("busybox".into(), TemplateSignals { memory_mib: 4, arrivals, ..TemplateSignals::default() });
//! obs.pools.insert(PoolKey::new("busybox", "node-1"), PoolSignals { idle: 2, leased: 40, creating: 1 });
//! let targets = policy.decide(&obs);
//! assert!(targets.get("busybox", "node-1") > 0, "steady traffic keeps a few warm");
//! ```
//!
//! The `sandpool-sim` binary replays traces against every policy ([`sim::bench`]).

pub mod functions;
pub mod live;
pub mod policy;
pub mod signals;
pub mod sim;

pub use policy::{
    BurstForecast, Combined, CombinedConfig, Fixed, LearnedBursts, LearnedConfig, OpenWhiskConfig, OpenWhiskPrewarm,
    Policy, Reactive, ReactiveConfig, ReservationConfig, ReservationPlan, ReservationStatus, Reservations, Targets,
    TemplateTargets, check_reservation, fit_to_capacity, plan_reservations, spread,
};
pub use signals::{
    ArrivalHistory, NodeSignals, Observation, PoolKey, PoolSignals, RateMemory, Reservation, TemplateSignals,
};

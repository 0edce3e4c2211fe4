//! How many port connections a sandbox has open: the per-sandbox bound, kept apart from the
//! relay (`ports/mod.rs`) so a sandbox can hold its count without depending on the routes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use telemetry::names;

/// The open port connections of one sandbox.
#[derive(Default)]
pub struct Open(Arc<AtomicU32>);

/// One open connection's place in `Open`, given back on drop.
pub(crate) struct Slot {
    open: Arc<AtomicU32>,
    gauge: metrics::Gauge,
}

impl Open {
    /// A slot if fewer than `max` connections are open.
    pub(crate) fn take(&self, max: u32) -> Option<Slot> {
        let taken = self.0.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1));
        taken.ok().map(|_| {
            let gauge = metrics::gauge!(names::PORT_CONNECTIONS_OPEN);
            gauge.increment(1.0);
            Slot { open: self.0.clone(), gauge }
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        self.gauge.decrement(1.0);
    }
}

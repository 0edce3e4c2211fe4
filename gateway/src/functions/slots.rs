//! This gateway's slots: invocations waiting for a function's concurrency slot, and the
//! asynchronous invocations it runs (bounded, a share per tenant).

use std::sync::Arc;

/// Invocations of this gateway waiting for a function's slot, woken when one of its
/// invocations here ends (slots freed by other gateways are found by polling).
pub(crate) struct Slots {
    by_function: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Notify>>>,
    /// Asynchronous invocations running here (`gateway.max_async_in_flight`).
    running_async: Arc<tokio::sync::Semaphore>,
    pub(super) max_async: usize,
    /// The slots each top-level tenant holds here: at most `async_share` (a quarter), whatever
    /// its `async_in_flight` quota (counted over all gateways) allows, and with quotas off.
    async_by_tenant: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    pub(super) async_share: usize,
}

/// Why an asynchronous slot of this gateway was refused.
pub(super) enum NoSlot {
    /// The tenant holds its share of them.
    Share,
    /// All of them are taken.
    Full,
}

/// One asynchronous invocation's slot of this gateway, counted against its tenant's share
/// until dropped.
pub(super) struct AsyncSlot {
    slots: Arc<Slots>,
    top: String,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for AsyncSlot {
    fn drop(&mut self) {
        let mut m = self.slots.async_by_tenant.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.top) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.top);
            }
        }
    }
}

impl Slots {
    pub(crate) fn new(max_async: usize) -> Slots {
        Slots {
            by_function: Default::default(),
            running_async: Arc::new(tokio::sync::Semaphore::new(max_async)),
            max_async,
            async_by_tenant: Default::default(),
            async_share: (max_async / 4).max(1),
        }
    }

    /// A slot for an asynchronous invocation of the top-level tenant `top`, within its share.
    pub(super) fn take_async(self: &Arc<Self>, top: &str) -> Result<AsyncSlot, NoSlot> {
        // The lock is held across the try-acquire (no await): count and permit agree.
        let mut m = self.async_by_tenant.lock().unwrap_or_else(|p| p.into_inner());
        let held = m.get(top).copied().unwrap_or(0);
        if held >= self.async_share {
            return Err(NoSlot::Share);
        }
        let permit = self.running_async.clone().try_acquire_owned().map_err(|_| NoSlot::Full)?;
        m.insert(top.to_string(), held + 1);
        Ok(AsyncSlot { slots: self.clone(), top: top.to_string(), _permit: permit })
    }

    pub(super) fn notify(&self, owner: &str, name: &str) -> Arc<tokio::sync::Notify> {
        let mut m = self.by_function.lock().unwrap_or_else(|p| p.into_inner());
        // Drop the entries nobody waits on, now and then.
        if m.len() > 4096 {
            m.retain(|_, n| Arc::strong_count(n) > 1);
        }
        m.entry(format!("{owner}|{name}")).or_default().clone()
    }

    /// A slot of the function was freed here: one waiter may take it.
    pub(super) fn freed(&self, owner: &str, name: &str) {
        let n = self.by_function.lock().unwrap_or_else(|p| p.into_inner()).get(&format!("{owner}|{name}")).cloned();
        if let Some(n) = n {
            n.notify_one();
        }
    }
}

//! Waiting for sandboxes: a gateway's queued session requests are woken through one Redis
//! pub/sub channel per gateway (the node's `sandbox_ready` script publishes the request id
//! when it grants a sandbox to it). Also counts session arrivals per template and second for
//! the autoscaler, flushed once a second so the create path pays nothing for it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use ledger::Ledger;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// Wake-ups can be lost (a reconnect); waiters also look at their mailbox this often.
pub const MAILBOX_POLL: Duration = Duration::from_secs(1);

pub struct Waiters {
    /// This gateway's wake channel.
    pub channel: String,
    waiting: Mutex<HashMap<String, oneshot::Sender<()>>>,
    arrivals: Mutex<HashMap<(String, u64), u64>>,
}

/// Removes a waiter's wake route however its request ends.
pub struct Registration<'a> {
    waiters: &'a Waiters,
    pub id: String,
    pub woken: oneshot::Receiver<()>,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        if let Ok(mut w) = self.waiters.waiting.lock() {
            w.remove(&self.id);
        }
    }
}

impl Waiters {
    pub fn new(ledger: &Ledger) -> Waiters {
        let gateway_id = format!("{:016x}", rand::random::<u64>());
        Waiters {
            channel: ledger.wake_channel(&gateway_id),
            waiting: Mutex::new(HashMap::new()),
            arrivals: Mutex::new(HashMap::new()),
        }
    }

    /// Registers a request before it is queued, so its wake-up cannot be missed.
    pub fn register(&self) -> Registration<'_> {
        let id = format!("{:032x}", rand::random::<u128>());
        let (tx, woken) = oneshot::channel();
        if let Ok(mut w) = self.waiting.lock() {
            w.insert(id.clone(), tx);
        }
        Registration { waiters: self, id, woken }
    }

    fn wake(&self, id: &str) {
        let tx = self.waiting.lock().ok().and_then(|mut w| w.remove(id));
        if let Some(tx) = tx {
            let _ = tx.send(());
        }
    }

    /// Counts one session request for `template` now.
    pub fn arrived(&self, template: &str) {
        let sec = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        if let Ok(mut a) = self.arrivals.lock() {
            *a.entry((template.to_string(), sec)).or_insert(0) += 1;
        }
    }

    /// Routes wake-ups to waiting requests until cancelled; reconnects when Redis drops.
    pub async fn run_router(&self, ledger: Ledger, cancel: CancellationToken) {
        loop {
            let mut pubsub = tokio::select! {
                _ = cancel.cancelled() => return,
                r = ledger.subscribe(&self.channel) => match r {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(error = %e, "subscribe for wake-ups");
                        tokio::select! {
                            _ = cancel.cancelled() => return,
                            _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                        }
                    }
                },
            };
            let mut messages = pubsub.on_message();
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    msg = messages.next() => match msg {
                        Some(m) => {
                            if let Ok(id) = m.get_payload::<String>() {
                                self.wake(&id);
                            }
                        }
                        None => break,
                    },
                }
            }
            tracing::warn!("wake-up subscription lost; reconnecting");
        }
    }

    /// Writes arrival counts to the ledger once a second until cancelled.
    pub async fn run_arrivals(&self, ledger: Ledger, cancel: CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            let batch: Vec<(String, u64, u64)> = match self.arrivals.lock() {
                Ok(mut a) => a.drain().map(|((t, s), n)| (t, s, n)).collect(),
                Err(_) => continue,
            };
            if let Err(e) = ledger.add_arrivals(&batch).await {
                tracing::warn!(error = %e, "record arrivals");
            }
        }
    }
}

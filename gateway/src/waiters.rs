//! Waiting for sandboxes: a gateway's queued session requests are woken through one Redis
//! pub/sub channel per gateway (the node's `sandbox_ready` script publishes the request id
//! when it grants a sandbox to it). Also counts session arrivals per template and second for
//! the autoscaler, flushed once a second so the create path pays nothing for it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::StreamExt;
use ledger::Ledger;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// Wake-ups can be lost (a reconnect); waiters also look at their mailbox this often.
pub(crate) const MAILBOX_POLL: Duration = Duration::from_secs(1);

pub(crate) struct Waiters {
    /// This gateway's wake channel.
    pub channel: String,
    waiting: Mutex<HashMap<String, oneshot::Sender<()>>>,
    /// Session requests per template since the last flush.
    arrivals: Mutex<HashMap<String, u64>>,
}

/// Removes a waiter's wake route however its request ends.
pub(crate) struct Registration<'a> {
    waiters: &'a Waiters,
    pub id: String,
    pub woken: oneshot::Receiver<()>,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.waiters.waiting.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
    }
}

impl Waiters {
    pub(crate) fn new(ledger: &Ledger) -> Waiters {
        let gateway_id = format!("{:016x}", rand::random::<u64>());
        Waiters {
            channel: ledger.wake_channel(&gateway_id),
            waiting: Mutex::new(HashMap::new()),
            arrivals: Mutex::new(HashMap::new()),
        }
    }

    /// Registers a request before it is queued, so its wake-up cannot be missed.
    pub(crate) fn register(&self) -> Registration<'_> {
        let id = format!("{:032x}", rand::random::<u128>());
        let (tx, woken) = oneshot::channel();
        self.waiting.lock().unwrap_or_else(|e| e.into_inner()).insert(id.clone(), tx);
        Registration { waiters: self, id, woken }
    }

    fn wake(&self, id: &str) {
        let tx = self.waiting.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        if let Some(tx) = tx {
            let _ = tx.send(());
        }
    }

    /// Counts one session request for `template` (the ledger files it under the second of
    /// Redis's clock in which it is flushed, within a second of now).
    pub(crate) fn arrived(&self, template: &str) {
        let mut a = self.arrivals.lock().unwrap_or_else(|e| e.into_inner());
        *a.entry(template.to_string()).or_insert(0) += 1;
    }

    /// Routes wake-ups to waiting requests until cancelled; reconnects when Redis drops.
    pub(crate) async fn run_router(&self, ledger: Ledger, cancel: CancellationToken) {
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
    pub(crate) async fn run_arrivals(&self, ledger: Ledger, cancel: CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            let batch: Vec<(String, u64)> = self.arrivals.lock().unwrap_or_else(|e| e.into_inner()).drain().collect();
            if let Err(e) = ledger.add_arrivals(&batch).await {
                tracing::warn!(error = %e, "record arrivals");
            }
        }
    }
}

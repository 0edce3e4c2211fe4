//! The keeper: environments made ahead of demand, and idle ones kept warm.

use std::time::{Duration, Instant};

use http_util::ApiError;
use telemetry::names;

use super::invoke::cold_environment;
use super::retire;
use crate::errors::{self};
use crate::{AppState, Caller};

/// How often the keeper looks at every function.
const KEEP_EVERY: Duration = Duration::from_secs(1);
/// Environments one function gets per keeper turn (cold starts ahead of demand are spread).
const KEEP_CREATES_PER_TURN: u32 = 4;

/// The keeper: once a second, every function gets the environments its load asks for
/// (`autoscaler::functions`: Little's law on its completions and busy time, at least
/// `min_warm`), made ahead of demand through the ordinary create path, and its idle ones up to
/// that count stay warm (their idle clocks restart); beyond it, idle environments end at
/// `env_idle_s`. Every gateway runs it; a per-function turn in the ledger lets one act per
/// second.
pub(crate) async fn keep(s: AppState, cancel: tokio_util::sync::CancellationToken) {
    let mut seen: std::collections::HashMap<String, Measured> = Default::default();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(KEEP_EVERY) => {}
        }
        let all = match s.ledger.functions_all().await {
            Ok(all) => all,
            Err(e) => {
                tracing::debug!(error = %e, "function keeper: list functions");
                continue;
            }
        };
        seen.retain(|id, _| all.iter().any(|(o, n)| format!("{o}|{n}") == *id));
        for (owner, name) in all {
            let m = seen.entry(format!("{owner}|{name}")).or_default();
            // A turn may wait for sandboxes (its creates queue like any): a stopping gateway
            // cuts it, and what its creates held goes back as for a caller that left.
            let turn = tokio::select! {
                turn = keep_one(&s, &owner, &name, m) => turn,
                _ = cancel.cancelled() => return,
            };
            if let Err(e) = turn {
                tracing::debug!(%owner, function = %name, error = %e.message, "function keeper");
            }
        }
    }
}

/// What the keeper measured of one function.
#[derive(Default)]
struct Measured {
    last: Option<(Instant, u64, f64)>,
    rate: Option<f64>,
    duration_s: Option<f64>,
}

impl Measured {
    /// Folds in the function's counters (completions, busy ms) read now.
    fn observe(&mut self, done: u64, busy_ms: f64) -> autoscaler::functions::Load {
        use autoscaler::functions::smooth;
        let now = Instant::now();
        if let Some((t, d0, b0)) = self.last {
            let dt = now.duration_since(t).as_secs_f64().max(0.001);
            let n = done.saturating_sub(d0);
            self.rate = Some(smooth(self.rate, n as f64 / dt, 0.5));
            if n > 0 {
                self.duration_s = Some(smooth(self.duration_s, (busy_ms - b0).max(0.0) / 1000.0 / n as f64, 0.5));
            }
        }
        self.last = Some((now, done, busy_ms));
        autoscaler::functions::Load { rate: self.rate.unwrap_or(0.0), duration_s: self.duration_s.unwrap_or(0.0) }
    }
}

async fn keep_one(s: &AppState, owner: &str, name: &str, m: &mut Measured) -> Result<(), ApiError> {
    let Some(def) = s.ledger.function_get(owner, name).await.map_err(errors::ledger)? else {
        s.ledger.functions_index_remove(owner, name).await.map_err(errors::ledger)?;
        return Ok(());
    };
    let (done, busy_ms) = s.ledger.function_stats(owner, name).await.map_err(errors::ledger)?;
    let load = m.observe(done, busy_ms);
    let turn_ms = KEEP_EVERY.as_millis() as u64 - 100;
    if !s.ledger.keeper_turn(owner, name, turn_ms).await.map_err(errors::ledger)? {
        return Ok(());
    }
    let target = autoscaler::functions::environments(load, def.min_warm, def.max_concurrency);
    let (kept, stale) = s.ledger.env_refresh(owner, name, target).await.map_err(errors::ledger)?;
    retire(s, owner, stale);
    for session in &kept {
        // A touch, not a settle: one taken since the refresh may hold its session for a call.
        if let Err(e) = s.ledger.lookup_hold(session, owner, true, 0).await {
            tracing::debug!(%session, error = %e, "keep an environment warm");
        }
    }
    let counts = s.ledger.env_counts(owner, name).await.map_err(errors::ledger)?;
    // Warm environments serving an invocation are in `total` too; cold ones only in flight.
    let have = counts.total.max(counts.in_flight) as u32;
    let missing = target.saturating_sub(have).min(KEEP_CREATES_PER_TURN);
    if missing == 0 {
        return Ok(());
    }
    let caller = Caller { tenant: owner.to_string(), admin: false };
    let made = futures::future::join_all((0..missing).map(|_| async {
        let env = cold_environment(s, &caller, &def, 0).await?;
        metrics::counter!(names::FUNCTION_ENVIRONMENTS_MADE, "why" => "keeper").increment(1);
        if !s.ledger.env_add(owner, name, &env).await.map_err(errors::ledger)? {
            retire(s, owner, vec![env.session]);
        }
        Ok::<_, ApiError>(())
    }))
    .await;
    let failed = made.iter().filter(|r| r.is_err()).count();
    tracing::info!(%owner, function = %name, target, made = missing as usize - failed, failed, "function environments made ahead");
    Ok(())
}

//! Injecting one fault and timing the recovery.

use std::process::Command;
use std::time::{Duration, Instant};

use rand::Rng;
use rand::rngs::StdRng;
use serde::Serialize;

use crate::api::Api;
use crate::world::{Proc, World, wait_for};
use crate::{DOCKER2_PIDFILE, Fault, RECOVERY_BOUND};

#[derive(Serialize)]
pub(crate) struct Injected {
    pub(crate) fault: Fault,
    pub(crate) target: String,
    pub(crate) at_s: f64,
    pub(crate) down_s: f64,
    /// From the restart until the part served again (a gateway ready, a node live with a warm
    /// sandbox, the autoscaler writing targets, Redis answering with every part back).
    pub(crate) recovered_s: Option<f64>,
}

pub(crate) async fn inject(
    w: &mut World,
    api: &Api,
    http: &reqwest::Client,
    fault: Fault,
    rng: &mut StdRng,
    at_s: f64,
) -> Injected {
    let (target, down) = match fault {
        Fault::Gateway => {
            let i = rng.random_range(0..w.gateways.len());
            w.gateways[i].1.kill();
            (w.gateways[i].1.name.clone(), Duration::from_millis(rng.random_range(2000..6000)))
        }
        Fault::PoolManager | Fault::NodeLost => {
            let i = rng.random_range(0..w.nodes.len());
            w.nodes[i].proc.kill();
            let down_ms = w.config.node.down_after.as_millis() as u64;
            let down = if fault == Fault::NodeLost {
                w.config.node.lost_after + Duration::from_secs(5)
            } else {
                Duration::from_millis(rng.random_range(down_ms / 2..down_ms * 3))
            };
            (w.nodes[i].id.clone(), down)
        }
        Fault::Redis => {
            let i = rng.random_range(0..w.redis.len());
            w.redis[i].kill();
            (w.redis[i].name.clone(), Duration::from_millis(rng.random_range(2000..5000)))
        }
        Fault::Autoscaler => {
            let a = w.autoscaler.as_mut().expect("started for the autoscaler fault");
            a.kill();
            (a.name.clone(), Duration::from_millis(rng.random_range(2000..8000)))
        }
        Fault::Dockerd2 => {
            let pid = std::fs::read_to_string(DOCKER2_PIDFILE).unwrap_or_default();
            let _ = Command::new("kill").args(["-9", pid.trim()]).status();
            ("dockerd2".to_string(), Duration::from_millis(rng.random_range(2000..5000)))
        }
        Fault::Registry => {
            let lazy = w.lazy.as_mut().expect("started for the registry fault");
            lazy.registry.kill();
            (format!("registry {}", lazy.registry.host), Duration::from_millis(rng.random_range(3000..8000)))
        }
    };
    eprintln!("[{at_s:.1} s] fault: {fault:?} {target}, down {:.1} s", down.as_secs_f64());
    let down_since = Instant::now();
    // The registry gone: a block nobody fetched fails with EIO, promptly (the probe's read may
    // outlast `down`: the registry stays down until it is answered).
    let mut probed = None;
    if fault == Fault::Registry
        && let Some(lazy) = w.lazy.as_mut()
    {
        match lazy.probe_gone(api).await {
            Ok(block) => probed = block,
            Err(detail) => api.rec.lock().unwrap().violation("registry", detail),
        }
    }
    tokio::time::sleep(down.saturating_sub(down_since.elapsed())).await;
    // The autoscaler serves again once it writes targets stamped later than its last before it died.
    let stamp = if fault == Fault::Autoscaler { w.autoscaler_stamp().await } else { 0 };
    let restarted = Instant::now();
    let started = match fault {
        Fault::Gateway => w.gateways.iter_mut().find(|g| g.1.name == target).map(|g| g.1.start()),
        Fault::PoolManager | Fault::NodeLost => w.nodes.iter_mut().find(|n| n.id == target).map(|n| n.proc.start()),
        Fault::Redis => w.redis.iter_mut().find(|r| r.name == target).map(|r| r.start()),
        Fault::Autoscaler => w.autoscaler.as_mut().map(Proc::start),
        Fault::Dockerd2 => Some(w.restore_dockerd2()),
        // Waits (blocking, bounded at 20 s) until it answers again.
        Fault::Registry => w.lazy.as_mut().map(|l| tokio::task::block_in_place(|| l.registry.resume())),
    };
    if let Some(Err(e)) = started {
        eprintln!("restart of {target} failed: {e:#}");
    }
    let recovered = match fault {
        Fault::Gateway => {
            let url = w.gateways.iter().find(|g| g.1.name == target).map(|g| g.0.clone()).unwrap_or_default();
            wait_for(RECOVERY_BOUND, || async {
                let r = http.get(format!("{url}/readyz")).timeout(Duration::from_secs(5)).send().await.ok()?;
                (r.status().as_u16() == 204).then_some(())
            })
            .await
        }
        Fault::PoolManager | Fault::NodeLost => wait_for(RECOVERY_BOUND, || w.node_serves(&target)).await,
        Fault::Dockerd2 => {
            let id = w.nodes[2].id.clone();
            wait_for(RECOVERY_BOUND, || w.node_serves(&id)).await
        }
        Fault::Redis => wait_for(RECOVERY_BOUND, || async { w.healthy(http).await.then_some(()) }).await,
        Fault::Autoscaler => wait_for(RECOVERY_BOUND, || w.autoscaler_decides(stamp)).await,
        Fault::Registry => {
            let answers = w.lazy.as_ref().is_some_and(|l| l.registry.answers());
            if answers { Ok(()) } else { Err(anyhow::anyhow!("the registry does not answer")) }
        }
    };
    let recovered_s = recovered.ok().map(|()| restarted.elapsed().as_secs_f64());
    if let (Some(n), Some(lazy)) = (probed, w.lazy.as_ref())
        && let Err(detail) = lazy.probe_back(api, n).await
    {
        api.rec.lock().unwrap().violation("registry", detail);
    }
    eprintln!("  {target} serves again: {recovered_s:?} s after its restart");
    Injected { fault, target, at_s, down_s: down.as_secs_f64(), recovered_s }
}

//! The load: episodes (create, claim, steps, delete) and the survivors that must outlive faults.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reqwest::Method;
use serde_json::json;

use crate::api::{Api, Body, Outcome};
use crate::{CALL_DEADLINE, SURVIVOR_TENANT, TENANTS};

/// The share of episodes on the lazy template when the run has one.
const LAZY_SHARE: f64 = 0.4;

/// One episode: create, claim, a few steps (a long episode keeps going for a while), delete.
/// With `lazy` (the run has a lazy image), some episodes open a session of the tenant's lazy
/// template and read blocks of its data among their steps.
pub(crate) async fn episode(api: Api, seed: u64, lazy: bool) {
    let mut rng = StdRng::seed_from_u64(seed);
    let tenant = TENANTS[rng.random_range(0..TENANTS.len())];
    let gw = rng.random_range(0..api.gateways.len());
    let bump = |what: &'static str| *api.rec.lock().unwrap().episodes.entry(what).or_default() += 1;
    bump("started");
    let lazy = lazy && rng.random_bool(LAZY_SHARE);
    let template = if lazy { format!("{tenant}/{}", crate::lazy::TEMPLATE) } else { "bb".to_string() };
    let Some((sid, sandbox)) = api.create(gw, tenant, &template).await else {
        bump("create_failed");
        return;
    };
    let long = rng.random_bool(0.1);
    let steps = if long { rng.random_range(6..12) } else { rng.random_range(1..5) };
    let mut outcome = api.claim(gw, tenant, &sid, &sandbox).await;
    for i in 0..steps {
        if matches!(outcome, Outcome::Ended) || outcome.violation() {
            break;
        }
        let pause = if long { rng.random_range(2000..5000) } else { rng.random_range(0..1500) };
        tokio::time::sleep(Duration::from_millis(pause)).await;
        // A lazy episode reads a block in two steps of five.
        outcome = match rng.random_range(0..if lazy { 5 } else { 3 }) {
            0 => api.echo("exec", gw, tenant, &sid, &format!("step-{i}-{}", rng.random::<u32>())).await.0,
            1 => {
                let data: Vec<u8> = (0..rng.random_range(1..64 * 1024)).map(|_| rng.random()).collect();
                api.file_roundtrip(gw, tenant, &sid, &format!("/work/f{i}.bin"), data).await
            }
            3 | 4 => {
                crate::lazy::read_block(&api, gw, tenant, &sid, rng.random_range(0..crate::lazy::EPISODE_BLOCKS)).await
            }
            _ => {
                let base = format!("/v1/sessions/{sid}");
                let (o, _) =
                    api.session_call("pause", gw, tenant, Method::POST, &format!("{base}/pause"), None, 200).await;
                if o == Outcome::Ok {
                    api.session_call("resume", gw, tenant, Method::POST, &format!("{base}/resume"), None, 200).await.0
                } else {
                    o
                }
            }
        };
        if outcome == Outcome::Refused {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    if outcome == Outcome::Ended {
        api.rec.lock().unwrap().open.remove(&sid);
        bump("ended_by_platform");
        return;
    }
    let d = api.delete(gw, tenant, &sid).await;
    bump(if outcome == Outcome::Ok && d == Outcome::Ok { "completed" } else { "incomplete" });
}

/// A session that lives through the whole run: a file written at the start, an echo every few
/// seconds. Returns its id and the file, for the final check.
pub(crate) struct Survivor {
    pub(crate) sid: String,
    pub(crate) node: String,
    pub(crate) data: Vec<u8>,
}

pub(crate) async fn open_survivors(api: &Api, n: usize, rng: &mut StdRng) -> anyhow::Result<Vec<Survivor>> {
    let mut out = Vec::new();
    for i in 0..n {
        let body = json!({"template": "bb", "labels": {"chaos": "survivor"}});
        let r = api
            .call(i, SURVIVOR_TENANT, Method::POST, "/v1/sessions", Some(Body::Json(body)), CALL_DEADLINE)
            .await
            .map_err(|o| anyhow::anyhow!("survivor create: {o:?}"))?;
        anyhow::ensure!(r.status == 201, "survivor create: {} {}", r.status, r.body);
        let sid = r.body["session_id"].as_str().unwrap_or_default().to_string();
        let node = r.body["node"].as_str().unwrap_or_default().to_string();
        let data: Vec<u8> = (0..4096).map(|_| rng.random()).collect();
        anyhow::ensure!(
            api.file_roundtrip(i, SURVIVOR_TENANT, &sid, "/work/state.bin", data.clone()).await == Outcome::Ok,
            "survivor {sid}: could not write its state"
        );
        api.rec.lock().unwrap().open.insert(sid.clone(), SURVIVOR_TENANT.into());
        out.push(Survivor { sid, node, data });
    }
    Ok(out)
}

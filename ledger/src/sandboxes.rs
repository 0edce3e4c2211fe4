//! The node's side of the pools: sandboxes being created, ready, doomed and removed, idle
//! counts, retiring idle sandboxes, and the private templates (snapshots) a node holds.

use std::collections::HashMap;
use std::time::Duration;

use redis::AsyncCommands;
use serde::Deserialize;
use wire::GoneReason;
use wire::internal::PrivateTemplate;

use crate::script::refs;
use crate::{Ended, Ledger, LedgerError, Result, from_json, to_json};

/// Sandbox states as the ledger stores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxState {
    /// Recorded by `sandbox_add`; its container is being created.
    Creating,
    /// Ready, in its template's idle pool.
    Idle,
    /// Leased to a session.
    Leased,
    /// Doomed: its container is being destroyed (never reused).
    Stopping,
}

/// A sandbox as its node's `sb:<sandbox>` hash holds it (what a restarted node readopts from).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRecord {
    /// The sandbox id.
    pub id: String,
    /// The template (pool) it was created for.
    pub template: String,
    /// Where it is in its life.
    pub state: SandboxState,
    /// Its container's id, once the node recorded one.
    pub container: Option<String>,
    /// The session it is (or was last) leased to.
    pub session: Option<String>,
    /// The fencing token of its latest grant (0 if never leased).
    pub fence: u64,
}

/// Where a newly created sandbox went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Ready {
    /// Straight to the longest-waiting request.
    Granted,
    /// Into its pool.
    Idle,
    /// It stopped being `creating` meanwhile (its node removed it): destroy it.
    Stale,
}

#[derive(Deserialize)]
struct Removed {
    #[serde(default)]
    ended: Option<Ended>,
}

#[derive(Deserialize)]
struct Retired {
    retired: usize,
}

impl Ledger {
    /// Records a sandbox about to be created (state `creating`).
    pub async fn sandbox_add(&self, node: &str, sandbox: &str, template: &str) -> Result<()> {
        let k = self.keys.node(node);
        let _: serde::de::IgnoredAny = self
            .run("sandbox_add", &self.scripts.sandbox_add, &refs(&[k.sbs(), k.sb(sandbox)]), &[sandbox, template])
            .await?;
        Ok(())
    }

    /// Records the egress policy a sandbox's connections are checked against now (the node's
    /// proxy enforces it; session reads report it). False if the sandbox is gone.
    pub async fn sandbox_set_egress(&self, node: &str, sandbox: &str, policy: &str) -> Result<bool> {
        let key = self.keys.node(node).sb(sandbox);
        self.run_flag("hset_if_exists", &self.scripts.hset_if_exists, &[&key], &["egress", policy]).await
    }

    /// The egress policy recorded for a sandbox, if any.
    pub async fn sandbox_egress(&self, node: &str, sandbox: &str) -> Result<Option<String>> {
        Ok(self.conn().hget(self.keys.node(node).sb(sandbox), "egress").await?)
    }

    /// Records the container of a sandbox still being created.
    pub async fn sandbox_set_container(&self, node: &str, sandbox: &str, container: &str) -> Result<()> {
        let _: () = self.conn().hset(self.keys.node(node).sb(sandbox), "container", container).await?;
        Ok(())
    }

    /// Hands a created sandbox to the longest waiter, or puts it into its pool.
    pub async fn sandbox_ready(&self, node: &str, sandbox: &str, container: &str) -> Result<Ready> {
        let k = self.keys.node(node);
        let keys = [k.sbs(), k.sb(sandbox), k.fence(), k.expiry(), k.active(), k.unclaimed()];
        self.run("sandbox_ready", &self.scripts.sandbox_ready, &refs(&keys), &[sandbox, container]).await
    }

    /// Forgets a sandbox; a session on it ends with `reason`, which is returned.
    pub async fn sandbox_remove(&self, node: &str, sandbox: &str, reason: GoneReason) -> Result<Option<Ended>> {
        let k = self.keys.node(node);
        let keys = [k.sbs(), k.sb(sandbox), k.expiry(), k.doomed(), k.active()];
        let r: Removed =
            self.run("sandbox_remove", &self.scripts.sandbox_remove, &refs(&keys), &[sandbox, reason.as_str()]).await?;
        Ok(r.ended)
    }

    /// How many sandbox records the ledger holds for `node` (one `SCARD`): what a running node
    /// compares with its own count to tell whether the ledger forgot any, without reading them.
    pub async fn sandbox_record_count(&self, node: &str) -> Result<u64> {
        Ok(self.conn().scard(self.keys.node(node).sbs()).await?)
    }

    /// Which of `sandboxes` have a record on `node` (one pipelined `EXISTS` each).
    pub async fn sandboxes_recorded(&self, node: &str, sandboxes: &[&str]) -> Result<Vec<bool>> {
        if sandboxes.is_empty() {
            return Ok(Vec::new());
        }
        let k = self.keys.node(node);
        let mut pipe = redis::pipe();
        for id in sandboxes {
            pipe.exists(k.sb(id));
        }
        Ok(pipe.query_async(&mut self.conn()).await?)
    }

    /// Every sandbox the ledger has for `node`.
    pub async fn sandboxes(&self, node: &str) -> Result<Vec<SandboxRecord>> {
        let k = self.keys.node(node);
        let ids: Vec<String> = self.conn().smembers(k.sbs()).await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in &ids {
            pipe.hgetall(k.sb(id));
        }
        let hashes: Vec<HashMap<String, String>> = pipe.query_async(&mut self.conn()).await?;
        let mut out = Vec::with_capacity(ids.len());
        for (id, h) in ids.into_iter().zip(hashes) {
            if h.is_empty() {
                continue;
            }
            let state = match h.get("state").map(String::as_str) {
                Some("creating") => SandboxState::Creating,
                Some("idle") => SandboxState::Idle,
                Some("leased") => SandboxState::Leased,
                Some("stopping") => SandboxState::Stopping,
                other => return Err(LedgerError::Corrupt(format!("sandbox {id} state {other:?}"))),
            };
            out.push(SandboxRecord {
                template: h.get("template").cloned().unwrap_or_default(),
                state,
                container: h.get("container").filter(|c| !c.is_empty()).cloned(),
                session: h.get("session").cloned(),
                fence: h.get("fence").and_then(|f| f.parse().ok()).unwrap_or(0),
                id,
            });
        }
        Ok(out)
    }

    /// The container of one sandbox of `node`, if the ledger has one for it (one read, whatever
    /// the node holds: the destroy path of a sandbox the node has no entry for).
    pub async fn sandbox_container(&self, node: &str, sandbox: &str) -> Result<Option<String>> {
        let c: Option<String> = self.conn().hget(self.keys.node(node).sb(sandbox), "container").await?;
        Ok(c.filter(|c| !c.is_empty()))
    }

    /// Idle counts of the given templates' pools on `node`, in order.
    pub async fn idle_counts(&self, node: &str, templates: &[&str]) -> Result<Vec<usize>> {
        let k = self.keys.node(node);
        let mut pipe = redis::pipe();
        for t in templates {
            pipe.llen(k.idle(t));
        }
        Ok(pipe.query_async(&mut self.conn()).await?)
    }

    /// Waits up to `timeout` for a sandbox to destroy, on a pooled connection that has no
    /// response timeout (a blocking pop on the shared connection would stall everyone).
    ///
    /// Not cancel-safe: a dropped pop leaves its `BLPOP` waiting in Redis, on a connection that
    /// lives on in the pool, and an id Redis hands it then is lost. Await it to the end.
    pub async fn pop_doomed(&self, node: &str, timeout: Duration) -> Result<Option<String>> {
        let reply = self.blocking.blpop(&self.keys.node(node).doomed(), timeout).await?;
        Ok(reply.map(|(_, sb)| sb))
    }

    /// Retires up to `n` idle sandboxes of `template` (doomed, destroyed by the node).
    pub async fn shrink(&self, node: &str, template: &str, n: usize) -> Result<usize> {
        let k = self.keys.node(node);
        let keys = [k.sbs(), k.idle(template), k.doomed()];
        let r: Retired = self.run("shrink", &self.scripts.shrink, &refs(&keys), &[template, &n.to_string()]).await?;
        Ok(r.retired)
    }

    /// Records a private template (snapshot) `node` holds, under its name (replacing any such).
    pub async fn put_private_template(&self, node: &str, t: &PrivateTemplate) -> Result<()> {
        let _: () = self.conn().hset(self.keys.node(node).ptpl(), &t.name, to_json("template", t)?).await?;
        Ok(())
    }

    /// The private template `name` (its node is in the name), whoever owns it.
    pub async fn private_template(&self, name: &str) -> Result<Option<PrivateTemplate>> {
        let Some(node) = wire::ids::node_of(name) else { return Ok(None) };
        let v: Option<String> = self.conn().hget(self.keys.node(node).ptpl(), name).await?;
        v.map(|j| from_json("private template", &j)).transpose()
    }

    /// Every private template `node` holds.
    pub async fn private_templates(&self, node: &str) -> Result<Vec<PrivateTemplate>> {
        let all: HashMap<String, String> = self.conn().hgetall(self.keys.node(node).ptpl()).await?;
        all.values().map(|j| from_json("private template", j)).collect()
    }

    /// Forgets a private template, and records that it was deleted on purpose: the one
    /// record that lets its node remove the image (an image whose template has no record at
    /// all is restored from its labels, never removed). `true` if it existed.
    pub async fn delete_private_template(&self, name: &str) -> Result<bool> {
        let Some(node) = wire::ids::node_of(name) else { return Ok(false) };
        let k = self.keys.node(node);
        let (n, _): (i64, i64) =
            redis::pipe().atomic().hdel(k.ptpl(), name).sadd(k.ptpl_gone(), name).query_async(&mut self.conn()).await?;
        Ok(n > 0)
    }

    /// Private templates of `node` deleted on purpose whose images may still exist.
    pub async fn deleted_private_templates(&self, node: &str) -> Result<std::collections::HashSet<String>> {
        Ok(self.conn().smembers(self.keys.node(node).ptpl_gone()).await?)
    }

    /// Drops the deletion record of a private template whose image is gone.
    pub async fn forget_deleted_private_template(&self, node: &str, name: &str) -> Result<()> {
        let _: i64 = self.conn().srem(self.keys.node(node).ptpl_gone(), name).await?;
        Ok(())
    }
}

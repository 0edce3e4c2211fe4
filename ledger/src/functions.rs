//! Functions and their environments. A definition lives under its owner's top-level tag
//! (`{f:<top>}`) with every key of its environments, so taking an environment (a concurrency
//! slot and the warmest idle one) and giving it back are one script each. An environment *is*
//! a session of the owner (leased, counted against quotas, reaped at its idle timeout like any
//! other); this scope only says which sessions serve which function and version, and how many
//! invocations are in flight. A session that ended behind its back is found when it is taken
//! (its lookup fails) and forgotten; one idle past the function's `env_idle_s` is never taken.

use std::collections::BTreeMap;

use redis::AsyncCommands as _;
use serde::{Deserialize, Serialize};
use wire::functions::FunctionMode;

use crate::keys::FunctionKeys;
use crate::script::seq;
use crate::{Ledger, Result, from_json, to_json};

/// A function's definition as stored: every setting resolved.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FunctionDef {
    /// Its name, unique per owner.
    pub name: String,
    /// The principal (tenant path) that owns it; its top-level tenant's tag holds it.
    pub owner: String,
    /// The template its environments are made from (an agent-mode template).
    pub template: String,
    /// Exec (spawn `handler` per invocation) or runtime (one worker per environment).
    pub mode: FunctionMode,
    /// The argv: the command (exec mode) or the worker (runtime mode).
    pub handler: Vec<String>,
    /// (Lua's cjson writes an empty table as `{}`, so an empty map survives the scripts.)
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Per-invocation timeout in ms; `env_take` holds a slot this long (plus `extra_ms`).
    pub timeout_ms: u64,
    /// Invocations in flight at once (so environments at most); more are `Take::Busy`.
    pub max_concurrency: u32,
    /// Environments kept warm even when idle (0: scale to zero).
    pub min_warm: u32,
    /// Invocations one environment serves before it is replaced.
    pub max_env_invocations: u64,
    /// Seconds an environment may be idle before it is retired (never taken after).
    pub env_idle_s: u64,
    /// Set by the ledger: 1 at creation, one more with every change.
    #[serde(default)]
    pub version: u64,
    /// Set by the ledger: when it was first stored (ms, Redis clock).
    #[serde(default)]
    pub created_ms: u64,
    /// Set by the ledger: when it was last stored (ms, Redis clock).
    #[serde(default)]
    pub updated_ms: u64,
}

/// An environment as the idle list holds it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Env {
    /// Its session.
    #[serde(rename = "s")]
    pub session: String,
    /// The function version it serves.
    #[serde(rename = "v")]
    pub version: u64,
    /// Invocations it has served.
    #[serde(rename = "n")]
    pub uses: u64,
    /// Its session's sandbox and fencing token: a warm invocation calls the node with them
    /// directly (the node refuses a sandbox it no longer has, and a stale fence).
    #[serde(rename = "b", default)]
    pub sandbox: String,
    /// The fencing token of its session's grant.
    #[serde(rename = "f", default)]
    pub fence: u64,
    /// As taken: how long it had been idle (its session's idle clock too), in ms.
    #[serde(rename = "a", default, skip_serializing)]
    pub idle_ms: u64,
}

/// What `env_take` found.
#[derive(Debug)]
pub enum Take {
    /// No such function.
    Missing,
    /// At its concurrency limit.
    Busy(FunctionDef),
    /// A slot, and an idle environment if one was warm; `stale`: sessions of environments to
    /// retire (an older version, or idle too long).
    Taken {
        /// The definition, as of this take.
        def: FunctionDef,
        /// The warmest idle environment of the current version; `None`: the caller makes one.
        env: Option<Env>,
        /// Sessions of environments to retire, which the caller ends.
        stale: Vec<String>,
    },
}

#[derive(Deserialize)]
#[serde(tag = "outcome", rename_all = "lowercase")]
enum TakeReply {
    Missing,
    Busy {
        def: String,
    },
    Taken {
        def: String,
        env: Option<Env>,
        #[serde(deserialize_with = "seq")]
        stale: Vec<String>,
    },
}

#[derive(Deserialize)]
struct SetReply {
    def: String,
    #[serde(deserialize_with = "seq")]
    retire: Vec<String>,
}

#[derive(Deserialize)]
struct DeleteReply {
    existed: bool,
    #[serde(deserialize_with = "seq")]
    retire: Vec<String>,
}

#[derive(Deserialize)]
struct PutReply {
    kept: bool,
}

/// A function's environments right now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EnvCounts {
    /// Environments (sessions) of the function, idle or busy.
    pub total: u64,
    /// Environments idle in its list, ready to take.
    pub idle: u64,
    /// Invocations holding a concurrency slot whose deadline has not passed.
    pub in_flight: u64,
}

impl Ledger {
    fn function_keys(&self, owner: &str, name: &str) -> FunctionKeys {
        self.keys.function(owner, name)
    }

    /// Stores a definition (its version is the stored one's plus one) and answers it with the
    /// sessions of the previous version's idle environments, which the caller ends.
    pub async fn function_put(&self, def: &FunctionDef) -> Result<(FunctionDef, Vec<String>)> {
        let k = self.function_keys(&def.owner, &def.name);
        let json = to_json("function", def)?;
        let r: SetReply = self.run("function_set", &self.scripts.function_set, &k.all(), &[&k.id, &json]).await?;
        let stored: FunctionDef = from_json("function", &r.def)?;
        Ok((stored, r.retire))
    }

    /// Lists a function in the index the keeper walks (the registry's slot, so a second step
    /// after `function_put`; the keeper drops entries whose function is gone).
    pub async fn functions_index_add(&self, owner: &str, name: &str) -> Result<()> {
        let _: () = self.conn().sadd(self.keys.functions_index(), format!("{owner}|{name}")).await?;
        Ok(())
    }

    /// Takes a function off the keeper's index (after `function_delete`; the registry's slot).
    pub async fn functions_index_remove(&self, owner: &str, name: &str) -> Result<()> {
        let _: () = self.conn().srem(self.keys.functions_index(), format!("{owner}|{name}")).await?;
        Ok(())
    }

    /// The definition of `owner`'s function `name`, if it exists.
    pub async fn function_get(&self, owner: &str, name: &str) -> Result<Option<FunctionDef>> {
        let k = self.function_keys(owner, name);
        let raw: Option<String> = self.conn().hget(&k.def, &k.id).await?;
        raw.map(|r| from_json("function", &r)).transpose()
    }

    /// The functions `owner` itself owns, by name.
    pub async fn function_list(&self, owner: &str) -> Result<Vec<FunctionDef>> {
        let k = self.function_keys(owner, "");
        let all: BTreeMap<String, String> = self.conn().hgetall(&k.def).await?;
        let mine = format!("{owner}|");
        all.iter().filter(|(id, _)| id.starts_with(&mine)).map(|(_, raw)| from_json("function", raw)).collect()
    }

    /// Deletes a function: `None` if there was none, else the sessions of all its
    /// environments, which the caller ends.
    pub async fn function_delete(&self, owner: &str, name: &str) -> Result<Option<Vec<String>>> {
        let k = self.function_keys(owner, name);
        let r: DeleteReply = self.run("function_delete", &self.scripts.function_delete, &k.all(), &[&k.id]).await?;
        Ok(r.existed.then_some(r.retire))
    }

    /// Every function (`owner|name`) of every tenant.
    pub async fn functions_all(&self) -> Result<Vec<(String, String)>> {
        let ids: Vec<String> = self.conn().smembers(self.keys.functions_index()).await?;
        Ok(ids.into_iter().filter_map(|id| id.rsplit_once('|').map(|(o, n)| (o.to_string(), n.to_string()))).collect())
    }

    /// How many environments the function has now (all, idle) and invocations in flight.
    pub async fn env_counts(&self, owner: &str, name: &str) -> Result<EnvCounts> {
        let k = self.function_keys(owner, name);
        let now = self.now_ms().await?;
        let (total, idle, in_flight): (u64, u64, u64) = redis::pipe()
            .zcard(&k.envs)
            .llen(&k.idle)
            .zcount(&k.infl, now, "+inf")
            .query_async(&mut self.conn())
            .await?;
        Ok(EnvCounts { total, idle, in_flight })
    }

    /// An invocation starts: a concurrency slot held until the function's timeout and
    /// `extra_ms` more have passed (or its `env_put`: a gateway that dies mid-invocation
    /// leaks no slot for good), and the warmest idle environment of the current version.
    pub async fn env_take(&self, owner: &str, name: &str, invocation: &str, extra_ms: u64) -> Result<Take> {
        let k = self.function_keys(owner, name);
        let hold = extra_ms.to_string();
        let r: TakeReply =
            self.run("function_take", &self.scripts.function_take, &k.all(), &[&k.id, invocation, &hold]).await?;
        Ok(match r {
            TakeReply::Missing => Take::Missing,
            TakeReply::Busy { def } => Take::Busy(from_json("function", &def)?),
            TakeReply::Taken { def, env, stale } => Take::Taken { def: from_json("function", &def)?, env, stale },
        })
    }

    /// An invocation ends: its slot is freed, and `env` goes back to the idle list if `keep`
    /// and the function still wants it (same version, invocations left). `Ok(false)`: the
    /// environment is retired, and the caller ends its session.
    pub async fn env_put(
        &self,
        owner: &str,
        name: &str,
        invocation: &str,
        env: &Env,
        keep: bool,
        busy_ms: f64,
    ) -> Result<bool> {
        let k = self.function_keys(owner, name);
        let args = [
            k.id.as_str(),
            invocation,
            &env.session,
            &env.uses.to_string(),
            &env.version.to_string(),
            if keep { "1" } else { "0" },
            &format!("{busy_ms:.3}"),
            &env.sandbox,
            &env.fence.to_string(),
        ];
        let r: PutReply = self.run("function_put", &self.scripts.function_put, &k.all(), &args).await?;
        Ok(r.kept)
    }

    /// An environment the keeper made ahead of demand joins the idle list (no invocation).
    pub async fn env_add(&self, owner: &str, name: &str, env: &Env) -> Result<bool> {
        let k = self.function_keys(owner, name);
        let args = [
            k.id.as_str(),
            "-",
            &env.session,
            "0",
            &env.version.to_string(),
            "1",
            "-",
            &env.sandbox,
            &env.fence.to_string(),
        ];
        let r: PutReply = self.run("function_put", &self.scripts.function_put, &k.all(), &args).await?;
        Ok(r.kept)
    }

    /// Restarts the idle clocks of up to `keep` idle environments (answered: their sessions,
    /// which the caller settles too) and drops stale ones (answered for the caller to end).
    pub async fn env_refresh(&self, owner: &str, name: &str, keep: u32) -> Result<(Vec<String>, Vec<String>)> {
        #[derive(Deserialize)]
        struct Reply {
            #[serde(deserialize_with = "seq")]
            keep: Vec<String>,
            #[serde(deserialize_with = "seq")]
            stale: Vec<String>,
        }
        let k = self.function_keys(owner, name);
        let r: Reply =
            self.run("function_refresh", &self.scripts.function_refresh, &k.all(), &[&k.id, &keep.to_string()]).await?;
        Ok((r.keep, r.stale))
    }

    /// The keeper's turn for one function: true for one caller per `ms` (one gateway of many).
    pub async fn keeper_turn(&self, owner: &str, name: &str, ms: u64) -> Result<bool> {
        let k = self.function_keys(owner, name);
        let set: Option<String> =
            redis::cmd("SET").arg(&k.keep).arg(1).arg("NX").arg("PX").arg(ms).query_async(&mut self.conn()).await?;
        Ok(set.is_some())
    }

    /// Frees an invocation's slot when it got no environment (its cold start failed).
    pub async fn env_slot_free(&self, owner: &str, name: &str, invocation: &str) -> Result<()> {
        let k = self.function_keys(owner, name);
        let _: () = self.conn().zrem(&k.infl, invocation).await?;
        Ok(())
    }

    /// Forgets an environment whose session has ended.
    pub async fn env_forget(&self, owner: &str, name: &str, session: &str) -> Result<()> {
        let k = self.function_keys(owner, name);
        let _: () = self.conn().zrem(&k.envs, session).await?;
        Ok(())
    }

    /// A function's completed invocations and their total busy time (ms), ever.
    pub async fn function_stats(&self, owner: &str, name: &str) -> Result<(u64, f64)> {
        let k = self.function_keys(owner, name);
        let (done, busy): (Option<u64>, Option<f64>) =
            redis::pipe().hget(&k.stat, "done").hget(&k.stat, "busy_ms").query_async(&mut self.conn()).await?;
        Ok((done.unwrap_or(0), busy.unwrap_or(0.0)))
    }

    /// Stores an asynchronous invocation's record (JSON) for `ttl_s`.
    pub async fn invocation_set(&self, owner: &str, id: &str, record: &str, ttl_s: u64) -> Result<()> {
        let _: () = self.conn().set_ex(self.keys.invocation(owner, id), record, ttl_s.max(1)).await?;
        Ok(())
    }

    /// An asynchronous invocation's record (JSON), while its `ttl_s` lasts.
    pub async fn invocation_get(&self, owner: &str, id: &str) -> Result<Option<String>> {
        Ok(self.conn().get(self.keys.invocation(owner, id)).await?)
    }
}

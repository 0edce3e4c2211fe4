//! The Lua scripts and the one way they are called: declared keys, arguments, and a JSON
//! answer decoded into the caller's type.

use std::collections::BTreeMap;
use std::time::Duration;

use redis::Script;
use serde::Deserialize;
use serde::de::{DeserializeOwned, Deserializer};
use tracing::Instrument as _;

use telemetry::names;

use crate::{Ledger, Result, from_json, keys, to_json};

/// How long a grant may wait in a waiter's mailbox before the node's reaper gives its sandbox
/// back. A waiting gateway collects its mail within about a second of the grant (woken at once,
/// and it polls its mailbox every second besides), so ten seconds is only ever reached by a
/// waiter that is gone. Here because the scripts are built with it (`CLAIM_WINDOW_MS`).
pub(crate) const CLAIM_WINDOW: Duration = Duration::from_secs(10);

/// The `script` label of every ledger script call (the `what` of `Ledger::run`), so a role can
/// start its `sandpool_redis_*` series at 0 (`telemetry::zeros`). A test checks it against
/// the calls in this crate's sources.
pub const SCRIPT_NAMES: &[&str] = &[
    "add_arrivals",
    "add_reservation",
    "dequeue",
    "del_if_eq",
    "function_delete",
    "function_put",
    "function_refresh",
    "function_set",
    "function_take",
    "grant",
    "hset_if_exists",
    "lookup",
    "node_claim",
    "node_lost",
    "pause",
    "pin_claim",
    "pin_resolve",
    "quota_admit",
    "quota_extend",
    "quota_index",
    "quota_queue",
    "quota_release",
    "quota_set",
    "quota_top",
    "quota_verify",
    "reap",
    "recount",
    "release",
    "sandbox_add",
    "sandbox_ready",
    "sandbox_remove",
    "set_health",
    "shrink",
    "take_mail",
    "ungrant",
];

pub(crate) struct Scripts {
    pub grant: Script,
    pub lookup: Script,
    pub release: Script,
    pub ungrant: Script,
    pub reap: Script,
    pub pause: Script,
    pub dequeue: Script,
    pub take_mail: Script,
    pub recount: Script,
    pub set_health: Script,
    pub shrink: Script,
    pub sandbox_add: Script,
    pub sandbox_ready: Script,
    pub sandbox_remove: Script,
    pub node_claim: Script,
    pub node_lost: Script,
    pub pin_claim: Script,
    pub del_if_eq: Script,
    pub set_if_eq: Script,
    pub hset_if_exists: Script,
    pub add_arrivals: Script,
    pub add_reservation: Script,
    pub quota_admit: Script,
    pub quota_extend: Script,
    pub quota_release: Script,
    pub quota_queue: Script,
    pub quota_set: Script,
    pub quota_verify: Script,
    pub quota_index: Script,
    pub quota_top: Script,
    pub function_set: Script,
    pub function_delete: Script,
    pub function_take: Script,
    pub function_put: Script,
    pub function_refresh: Script,
}

macro_rules! lua {
    ($file:literal) => {
        include_str!(concat!("lua/", $file))
    };
}

/// A node script: the generated key functions, the shared prelude, then the script.
fn node_script(prelude: &str, body: &str) -> Script {
    Script::new(&format!("{prelude}{body}"))
}

/// A function script: the function prelude (its keys and helpers), then the script.
fn function_script(body: &str) -> Script {
    node_script(lua!("function/prelude.lua"), body)
}

/// A quota script: the quota prelude (its keys and helpers), then the script.
fn quota_script(body: &str) -> Script {
    node_script(lua!("quota/prelude.lua"), body)
}

impl Scripts {
    pub(crate) fn new() -> Scripts {
        let prelude = format!(
            "{}local CLAIM_WINDOW_MS = {}\n{}",
            keys::lua_key_functions(),
            CLAIM_WINDOW.as_millis(),
            lua!("prelude.lua")
        );
        let node = |body: &str| node_script(&prelude, body);
        Scripts {
            grant: node(lua!("grant.lua")),
            lookup: node(lua!("lookup.lua")),
            release: node(lua!("release.lua")),
            ungrant: node(lua!("ungrant.lua")),
            reap: node(lua!("reap.lua")),
            pause: node(lua!("pause.lua")),
            dequeue: node(lua!("dequeue.lua")),
            take_mail: node(lua!("take_mail.lua")),
            recount: node(lua!("recount.lua")),
            set_health: node(lua!("set_health.lua")),
            shrink: node(lua!("shrink.lua")),
            sandbox_add: node(lua!("sandbox_add.lua")),
            sandbox_ready: node(lua!("sandbox_ready.lua")),
            sandbox_remove: node(lua!("sandbox_remove.lua")),
            node_claim: node(lua!("node_claim.lua")),
            node_lost: node(lua!("node_lost.lua")),
            pin_claim: Script::new(lua!("pin_claim.lua")),
            del_if_eq: Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            ),
            set_if_eq: Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3])) return 1 end return 0",
            ),
            hset_if_exists: Script::new(
                "if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) return 1 end return 0",
            ),
            add_arrivals: Script::new(lua!("add_arrivals.lua")),
            add_reservation: Script::new(lua!("add_reservation.lua")),
            quota_admit: quota_script(lua!("quota/admit.lua")),
            quota_extend: quota_script(lua!("quota/extend.lua")),
            quota_release: quota_script(lua!("quota/release.lua")),
            quota_queue: quota_script(lua!("quota/queue.lua")),
            quota_set: quota_script(lua!("quota/set.lua")),
            quota_verify: quota_script(lua!("quota/verify.lua")),
            quota_index: quota_script(lua!("quota/index.lua")),
            quota_top: Script::new(lua!("quota_top.lua")),
            function_set: function_script(lua!("function/set.lua")),
            function_delete: function_script(lua!("function/delete.lua")),
            function_take: function_script(lua!("function/take.lua")),
            function_put: function_script(lua!("function/put.lua")),
            function_refresh: function_script(lua!("function/refresh.lua")),
        }
    }
}

impl Ledger {
    /// The SHA1 a script is called by (`EVALSHA`), for the benchmarks that read Redis's
    /// `SLOWLOG` to tell scripts apart: `checkout` (the grant script), `quota_admit`,
    /// `quota_release`.
    pub fn script_hash(&self, name: &str) -> Option<String> {
        let s = &self.scripts;
        let script = match name {
            "checkout" => &s.grant,
            "quota_admit" => &s.quota_admit,
            "quota_release" => &s.quota_release,
            _ => return None,
        };
        Some(script.get_hash().to_string())
    }

    /// Runs `script` with its declared `keys` and `args`, and decodes its JSON answer.
    pub(crate) async fn run<T: DeserializeOwned>(
        &self,
        what: &'static str,
        script: &Script,
        keys: &[&str],
        args: &[&str],
    ) -> Result<T> {
        let answer = self.invoke::<String>(what, script, keys, args).await;
        let decoded = answer.and_then(|json| from_json(what, &json));
        if decoded.is_err() {
            metrics::counter!(names::REDIS_ERRORS, "script" => what).increment(1);
        }
        decoded
    }

    /// Runs one of the one-line compare-and-set scripts (`del_if_eq`, `set_if_eq`,
    /// `hset_if_exists`), which answer 1 (done) or 0 (the key did not hold what was expected)
    /// rather than JSON: whether it was done.
    pub(crate) async fn run_flag(
        &self,
        what: &'static str,
        script: &Script,
        keys: &[&str],
        args: &[&str],
    ) -> Result<bool> {
        let answer = self.invoke::<i64>(what, script, keys, args).await;
        if answer.is_err() {
            metrics::counter!(names::REDIS_ERRORS, "script" => what).increment(1);
        }
        Ok(answer? == 1)
    }

    /// The one place a script is sent to Redis: in its span, timed under its name.
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        what: &'static str,
        script: &Script,
        keys: &[&str],
        args: &[&str],
    ) -> Result<T> {
        let mut inv = script.prepare_invoke();
        for k in keys {
            inv.key(*k);
        }
        for a in args {
            inv.arg(*a);
        }
        let started = std::time::Instant::now();
        let res: redis::RedisResult<T> = inv.invoke_async(&mut self.conn()).instrument(script_span(what)).await;
        metrics::histogram!(names::REDIS_DURATION, "script" => what).record(started.elapsed().as_secs_f64());
        Ok(res?)
    }
}

/// `&str`s of owned key names, for `Ledger::run`.
pub(crate) fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

/// The labels as the ledger stores them (an argument of the scripts that record a session).
pub(crate) fn labels_json(labels: &BTreeMap<String, String>) -> Result<String> {
    to_json("labels", labels)
}

/// The span of one script call: a child of the request or background job that runs it, and
/// none outside any span (the nodes' periodic loops would otherwise each start a trace).
fn script_span(what: &str) -> tracing::Span {
    if tracing::Span::current().is_none() {
        return tracing::Span::none();
    }
    tracing::info_span!(
        "redis.script",
        otel.name = %format!("redis {what}"),
        otel.kind = "client",
        db.system.name = "redis",
        script = what,
    )
}

/// Lua's cjson writes an empty table as `{}`; read that as an empty list.
pub(crate) fn seq<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum SeqOrEmpty<T> {
        Seq(Vec<T>),
        Empty {},
    }
    Ok(match SeqOrEmpty::deserialize(d)? {
        SeqOrEmpty::Seq(v) => v,
        SeqOrEmpty::Empty {} => Vec::new(),
    })
}

#[cfg(test)]
mod names_test {
    /// Every `.run("<name>", ...)` and `.run_flag("<name>", ...)` of the crate's sources names a script of `SCRIPT_NAMES`, and
    /// every name there is called.
    #[test]
    fn script_names_are_the_calls() {
        let sources = [
            include_str!("conn.rs"),
            include_str!("egress.rs"),
            include_str!("functions.rs"),
            include_str!("images.rs"),
            include_str!("lib.rs"),
            include_str!("pins.rs"),
            include_str!("queue.rs"),
            include_str!("quota_sweep.rs"),
            include_str!("quotas.rs"),
            include_str!("sandboxes.rs"),
            include_str!("sessions.rs"),
            include_str!("signals.rs"),
        ];
        let mut called = std::collections::BTreeSet::new();
        for text in sources {
            let calls = text.match_indices(".run(").map(|(at, m)| at + m.len());
            let flags = text.match_indices(".run_flag(").map(|(at, m)| at + m.len());
            for at in calls.chain(flags) {
                let rest = text[at..].trim_start();
                if let Some(quoted) = rest.strip_prefix('"') {
                    called.insert(quoted.split('"').next().unwrap_or_default().to_string());
                }
            }
        }
        let listed: std::collections::BTreeSet<String> = super::SCRIPT_NAMES.iter().map(|s| s.to_string()).collect();
        assert_eq!(called, listed, "SCRIPT_NAMES must list exactly the scripts the ledger runs");
    }
}

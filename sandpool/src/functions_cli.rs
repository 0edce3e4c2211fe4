//! `sandpool fn ...`: functions on a gateway, with the `Client` of the other user commands.
//! `deploy` (create or replace), `invoke` (the result on stdout; a function error on stderr and
//! exit status 1), `map` (the NDJSON answer streamed to stdout), `result` (an asynchronous
//! invocation), `ls`, `get`, `rm`.

use std::io::{Read as _, Write as _};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Subcommand;
use reqwest::Method;
use serde_json::{Value, json};

use crate::client::{Client, Remote, key_value, print, query_escape};

#[derive(Subcommand)]
pub enum FnOp {
    /// Creates a function or replaces its definition (a new version; environments of the old
    /// one are retired); prints it (JSON).
    Deploy {
        name: String,
        /// The template its environments are made from (an agent-mode template).
        #[arg(long)]
        template: String,
        /// `exec`: the handler runs per invocation, payload on stdin, result on stdout;
        /// `runtime`: the handler is a worker kept per environment (sdk/runtime/PROTOCOL.md).
        #[arg(long, value_parser = ["exec", "runtime"])]
        mode: String,
        /// Environment of the handler, `KEY=VALUE` (repeatable).
        #[arg(long = "env", value_parser = key_value)]
        env: Vec<(String, String)>,
        /// Per invocation, milliseconds (default 60000).
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// Invocations in flight at once (default 16); more answer 429.
        #[arg(long)]
        max_concurrency: Option<u32>,
        /// Environments kept warm even when idle (default 0).
        #[arg(long)]
        min_warm: Option<u32>,
        /// Invocations one environment serves before it is replaced (default 1000).
        #[arg(long)]
        max_env_invocations: Option<u64>,
        /// Seconds an environment may sit idle before it ends (default 300).
        #[arg(long)]
        env_idle_s: Option<u64>,
        /// The handler's argv (after `--`).
        #[arg(last = true, required = true)]
        handler: Vec<String>,
    },
    /// Invokes a function: its result on stdout, exit status 0; a function error's report on
    /// stderr, exit status 1.
    Invoke {
        name: String,
        /// The payload as an argument (JSON text), or `-` to read it from stdin; none: empty.
        #[arg(allow_hyphen_values = true)]
        payload: Option<String>,
        /// Do not wait: print the invocation's id (`sandpool fn result ID` reads it later).
        #[arg(long = "async")]
        run_async: bool,
        /// At the function's max_concurrency, wait up to this long for a slot (default: 429
        /// at once).
        #[arg(long)]
        max_wait_ms: Option<u64>,
    },
    /// Invokes a function over a batch (a JSON array or NDJSON, from FILE or `-`/none: stdin);
    /// prints one NDJSON line per payload in input order, as they arrive.
    Map { name: String, file: Option<String> },
    /// Prints an asynchronous invocation (JSON): its state, and once done its status and result.
    Result { invocation: String },
    /// Lists the caller's functions (JSON).
    Ls,
    /// Prints a function with its environments now (JSON).
    Get { name: String },
    /// Deletes a function; its environments end.
    Rm { name: String },
}

fn function_path(name: &str) -> String {
    format!("/v1/functions/{}", query_escape(name))
}

/// Bytes from a file, or from stdin for `-`.
fn read_input(from: &str) -> anyhow::Result<Vec<u8>> {
    if from == "-" {
        let mut v = Vec::new();
        std::io::stdin().read_to_end(&mut v).context("read stdin")?;
        Ok(v)
    } else {
        std::fs::read(from).with_context(|| format!("read {from}"))
    }
}

pub async fn run(remote: Remote, op: FnOp) -> anyhow::Result<ExitCode> {
    let c = Client::new(&remote)?;
    match op {
        FnOp::Deploy {
            name,
            template,
            mode,
            env,
            timeout_ms,
            max_concurrency,
            min_warm,
            max_env_invocations,
            env_idle_s,
            handler,
        } => {
            let mut body = json!({ "template": template, "mode": mode, "handler": handler });
            if !env.is_empty() {
                body["env"] = json!(env.into_iter().collect::<std::collections::BTreeMap<_, _>>());
            }
            for (k, v) in [
                ("timeout_ms", timeout_ms.map(Value::from)),
                ("max_concurrency", max_concurrency.map(Value::from)),
                ("min_warm", min_warm.map(Value::from)),
                ("max_env_invocations", max_env_invocations.map(Value::from)),
                ("env_idle_s", env_idle_s.map(Value::from)),
            ] {
                if let Some(v) = v {
                    body[k] = v;
                }
            }
            print(&c.json(Method::PUT, &function_path(&name), Some(body)).await?)?;
        }
        FnOp::Invoke { name, payload, run_async, max_wait_ms } => {
            let payload = match payload.as_deref() {
                Some("-") => read_input("-")?,
                Some(p) => p.as_bytes().to_vec(),
                None => Vec::new(),
            };
            let body = Some((reqwest::Body::from(payload), "application/octet-stream"));
            if run_async {
                let path = format!("{}/invoke?async=true", function_path(&name));
                let accepted: Value = serde_json::from_slice(&c.call(Method::POST, &path, body).await?)?;
                println!("{}", accepted["invocation_id"].as_str().context("no invocation_id in the answer")?);
                return Ok(ExitCode::SUCCESS);
            }
            let wait = max_wait_ms.map(|ms| format!("?max_wait_ms={ms}")).unwrap_or_default();
            let resp = c.send(Method::POST, &format!("{}/invoke{wait}", function_path(&name)), body).await?;
            let function_error = resp.headers().contains_key("x-sandpool-function-error");
            let result = resp.bytes().await?;
            if function_error {
                let mut err = std::io::stderr();
                err.write_all(&result)?;
                if !result.ends_with(b"\n") {
                    err.write_all(b"\n")?;
                }
                return Ok(ExitCode::FAILURE);
            }
            std::io::stdout().write_all(&result)?;
        }
        FnOp::Map { name, file } => {
            let batch = read_input(file.as_deref().unwrap_or("-"))?;
            let content_type = match batch.iter().find(|b| !b.is_ascii_whitespace()) {
                Some(b'[') => "application/json",
                _ => "application/x-ndjson",
            };
            let path = format!("{}/map", function_path(&name));
            let mut resp = c.send(Method::POST, &path, Some((reqwest::Body::from(batch), content_type))).await?;
            let mut out = std::io::stdout();
            while let Some(chunk) = resp.chunk().await.context("read the map's answer")? {
                out.write_all(&chunk)?;
                out.flush()?;
            }
        }
        FnOp::Result { invocation } => {
            let path = format!("/v1/invocations/{}", query_escape(&invocation));
            print(&c.json(Method::GET, &path, None).await?)?;
        }
        FnOp::Ls => print(&c.all_pages("/v1/functions", "functions").await?)?,
        FnOp::Get { name } => print(&c.json(Method::GET, &function_path(&name), None).await?)?,
        FnOp::Rm { name } => {
            c.call(Method::DELETE, &function_path(&name), None).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

//! User commands that talk to a gateway (`--url`/`SANDPOOL_URL`, `--token`/`SANDPOOL_TOKEN`):
//! `sandpool sessions create|get|rm`, `sandpool exec SID -- CMD...` (its exit code passed
//! through), `sandpool cp SRC DST` (one side `SID:PATH`, the other a local file or `-`).

use std::io::{Read as _, Write as _};
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};

#[derive(Args, Clone)]
pub struct Remote {
    /// The gateway.
    #[arg(long, env = "SANDPOOL_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// A bearer token (`sandpool token` mints one).
    #[arg(long, env = "SANDPOOL_TOKEN", hide_env_values = true)]
    token: String,
}

#[derive(Subcommand)]
pub enum SessionsOp {
    /// Opens a session; prints it (JSON).
    Create {
        template: String,
        /// A label, `key=value` (repeatable).
        #[arg(long = "label", value_parser = key_value)]
        labels: Vec<(String, String)>,
        /// Maximum lifetime, seconds.
        #[arg(long)]
        ttl: Option<u64>,
        /// Idle timeout, seconds.
        #[arg(long)]
        idle_timeout: Option<u64>,
        #[arg(long)]
        session_key: Option<String>,
        /// How long to wait for a sandbox, seconds.
        #[arg(long)]
        max_wait: Option<f64>,
    },
    /// Lists the caller's live sessions (JSON), oldest first.
    Ls {
        /// Include the sessions of the caller's descendants.
        #[arg(long)]
        subtree: bool,
        /// Only sessions with this label, `key=value`.
        #[arg(long)]
        label: Option<String>,
    },
    /// Prints a session (JSON).
    Get { session: String },
    /// Ends a session.
    Rm { session: String },
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("{s:?}: expected key=value"))
}

struct Client {
    http: reqwest::Client,
    url: String,
    token: String,
}

impl Client {
    fn new(r: &Remote) -> anyhow::Result<Client> {
        Ok(Client {
            http: reqwest::Client::builder().build()?,
            url: r.url.trim_end_matches('/').to_string(),
            token: r.token.clone(),
        })
    }

    /// Sends a call; an error answer becomes an error naming its code and message.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<(reqwest::Body, &'static str)>,
    ) -> anyhow::Result<Vec<u8>> {
        let mut req = self.http.request(method, format!("{}{path}", self.url)).bearer_auth(&self.token);
        if let Some((b, content_type)) = body {
            req = req.header("content-type", content_type).body(b);
        }
        let resp = req.send().await.with_context(|| format!("reach the gateway at {}", self.url))?;
        let status = resp.status();
        let bytes = resp.bytes().await?.to_vec();
        if !status.is_success() {
            let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            match (v["code"].as_str(), v["message"].as_str()) {
                (Some(code), Some(message)) => bail!("{code} ({}): {message}", status.as_u16()),
                _ => bail!("the gateway answered {status}"),
            }
        }
        Ok(bytes)
    }

    async fn json(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        let bytes =
            self.call(method, path, body.map(|b| (reqwest::Body::from(b.to_string()), "application/json"))).await?;
        Ok(if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes)? })
    }
}

fn print(v: &Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

pub async fn sessions(remote: Remote, op: SessionsOp) -> anyhow::Result<ExitCode> {
    let c = Client::new(&remote)?;
    match op {
        SessionsOp::Create { template, labels, ttl, idle_timeout, session_key, max_wait } => {
            let mut body = json!({ "template": template });
            if !labels.is_empty() {
                body["labels"] = json!(labels.into_iter().collect::<std::collections::BTreeMap<_, _>>());
            }
            for (k, v) in [("ttl_s", ttl.map(Value::from)), ("idle_timeout_s", idle_timeout.map(Value::from))] {
                if let Some(v) = v {
                    body[k] = v;
                }
            }
            if let Some(k) = session_key {
                body["session_key"] = json!(k);
            }
            if let Some(w) = max_wait {
                body["max_wait_s"] = json!(w);
            }
            print(&c.json(reqwest::Method::POST, "/v1/sessions", Some(body)).await?)?;
        }
        SessionsOp::Ls { subtree, label } => {
            let mut path = format!("/v1/sessions?subtree={subtree}");
            if let Some(l) = label {
                path.push_str("&label=");
                path.push_str(&query_escape(&l));
            }
            print(&c.json(reqwest::Method::GET, &path, None).await?)?;
        }
        SessionsOp::Get { session } => {
            print(&c.json(reqwest::Method::GET, &format!("/v1/sessions/{session}"), None).await?)?
        }
        SessionsOp::Rm { session } => {
            c.call(reqwest::Method::DELETE, &format!("/v1/sessions/{session}"), None).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs a command in a session: its stdout and stderr go to ours, its exit code is ours (124
/// when it timed out, like `timeout(1)`).
pub async fn exec(
    remote: Remote,
    session: String,
    cmd: Vec<String>,
    env: Vec<(String, String)>,
    cwd: Option<String>,
    timeout_s: Option<f64>,
) -> anyhow::Result<ExitCode> {
    let c = Client::new(&remote)?;
    let mut body = json!({ "cmd": cmd, "encoding": "base64" });
    if !env.is_empty() {
        body["env"] = json!(env.into_iter().collect::<std::collections::BTreeMap<_, _>>());
    }
    if let Some(cwd) = cwd {
        body["cwd"] = json!(cwd);
    }
    if let Some(t) = timeout_s {
        body["timeout_ms"] = json!((t * 1000.0) as u64);
    }
    let r = c.json(reqwest::Method::POST, &format!("/v1/sessions/{session}/exec"), Some(body)).await?;
    let decode = |k: &str| wire::b64_decode(r[k].as_str().unwrap_or_default()).map_err(|e| anyhow::anyhow!("{k}: {e}"));
    std::io::stdout().write_all(&decode("stdout")?)?;
    std::io::stderr().write_all(&decode("stderr")?)?;
    if r["timed_out"].as_bool() == Some(true) {
        return Ok(ExitCode::from(124));
    }
    let code = r["exit_code"].as_i64().unwrap_or(1);
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

/// A `cp` operand: `SID:PATH` in a session, else a local path (`-`: stdin or stdout).
enum End {
    Remote { session: String, path: String },
    Local(String),
}

fn end(s: &str) -> End {
    match s.split_once(':') {
        Some((sid, path)) if wire::ids::node_of(sid).is_some() => {
            End::Remote { session: sid.into(), path: path.into() }
        }
        _ => End::Local(s.into()),
    }
}

/// Percent-encodes `s`, keeping letters, digits and `keep`.
fn escape(s: &str, keep: &[u8]) -> String {
    let mut enc = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || keep.contains(&b) {
            enc.push(b as char);
        } else {
            enc.push_str(&format!("%{b:02X}"));
        }
    }
    enc
}

fn query_escape(s: &str) -> String {
    escape(s, b"-_.~")
}

fn file_url(session: &str, path: &str) -> String {
    // An absolute path keeps its '/' after the route's: `files//tmp/x`.
    format!("/v1/sessions/{session}/files/{}", escape(path, b"/-_.~"))
}

/// Copies a file into or out of a session (a directory comes out as a tar).
pub async fn cp(remote: Remote, src: String, dst: String) -> anyhow::Result<ExitCode> {
    let c = Client::new(&remote)?;
    match (end(&src), end(&dst)) {
        (End::Local(from), End::Remote { session, path }) => {
            let data = if from == "-" {
                let mut v = Vec::new();
                std::io::stdin().read_to_end(&mut v)?;
                v
            } else {
                std::fs::read(&from).with_context(|| format!("read {from}"))?
            };
            let body = (reqwest::Body::from(data), "application/octet-stream");
            c.call(reqwest::Method::PUT, &file_url(&session, &path), Some(body)).await?;
        }
        (End::Remote { session, path }, End::Local(to)) => {
            let data = c.call(reqwest::Method::GET, &file_url(&session, &path), None).await?;
            if to == "-" {
                std::io::stdout().write_all(&data)?;
            } else {
                std::fs::write(&to, &data).with_context(|| format!("write {to}"))?;
            }
        }
        _ => bail!("one side of cp is SESSION:PATH, the other a local path or -"),
    }
    Ok(ExitCode::SUCCESS)
}

/// `KEY=VALUE` of `--env`.
pub fn env_pair(s: &str) -> Result<(String, String), String> {
    key_value(s)
}

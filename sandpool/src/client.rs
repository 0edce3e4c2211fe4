//! User commands that talk to a gateway (`--url`/`SANDPOOL_URL`, `--token`/`SANDPOOL_TOKEN`):
//! `sandpool sessions create|ls|get|rm` (`rm --label k=v`: every session carrying it), `sandpool exec SID -- CMD...` (its exit code passed
//! through), `sandpool cp SRC DST` (one side `SID:PATH`, the other a local file or `-`),
//! `sandpool fs exists|rm|mv|mkdir SID PATH...`.
//! `sandpool fn ...` (functions) is in `functions_cli`, on the same `Client`.

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
    /// Lists the caller's live sessions (JSON), oldest first: every page, or with `--limit`
    /// one page as the API answers it (its `next_cursor` goes to `--cursor`).
    Ls {
        /// Include the sessions of the caller's descendants.
        #[arg(long)]
        subtree: bool,
        /// Only sessions with this label, `key=value`.
        #[arg(long)]
        label: Option<String>,
        /// One page of at most this many sessions (1-1000).
        #[arg(long)]
        limit: Option<usize>,
        /// Where the page starts: the previous page's `next_cursor`.
        #[arg(long, requires = "limit")]
        cursor: Option<String>,
    },
    /// Prints a session (JSON).
    Get { session: String },
    /// Ends a session, or with `--label` every session carrying it (prints `{"ended": N}`).
    Rm {
        #[arg(required_unless_present = "label", conflicts_with = "label")]
        session: Option<String>,
        /// End every live session with this label, `key=value`.
        #[arg(long)]
        label: Option<String>,
        /// With `--label`: the sessions of the caller's descendants too.
        #[arg(long, requires = "label")]
        subtree: bool,
    },
}

/// `sandpool fs`: paths as the file calls take them (relative to the workdir, or absolute).
#[derive(Subcommand)]
pub enum FsOp {
    /// Prints `{"path", "exists", "type"}`; exits 1 when nothing is there.
    Exists { session: String, path: String },
    /// Removes a file, a link or an empty directory (`-r`: a directory with its contents).
    Rm {
        session: String,
        path: String,
        #[arg(short, long)]
        recursive: bool,
    },
    /// Renames (moves) within the session; refuses a target that exists.
    Mv { session: String, from: String, to: String },
    /// Makes a directory and its parents.
    Mkdir { session: String, path: String },
}

/// `KEY=VALUE` of `--label` and `--env`.
pub fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("{s:?}: expected key=value"))
}

pub(crate) struct Client {
    http: reqwest::Client,
    url: String,
    token: String,
}

impl Client {
    pub(crate) fn new(r: &Remote) -> anyhow::Result<Client> {
        Ok(Client {
            http: reqwest::Client::builder().build()?,
            url: r.url.trim_end_matches('/').to_string(),
            token: r.token.clone(),
        })
    }

    /// Sends a call; an error answer becomes an error naming its code and message. The answer
    /// (a success) with its body unread.
    pub(crate) async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<(reqwest::Body, &'static str)>,
    ) -> anyhow::Result<reqwest::Response> {
        let mut req = self.http.request(method, format!("{}{path}", self.url)).bearer_auth(&self.token);
        if let Some((b, content_type)) = body {
            req = req.header("content-type", content_type).body(b);
        }
        let resp = req.send().await.with_context(|| format!("reach the gateway at {}", self.url))?;
        let status = resp.status();
        if !status.is_success() {
            let bytes = resp.bytes().await?;
            let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            match (v["code"].as_str(), v["message"].as_str()) {
                (Some(code), Some(message)) => bail!("{code} ({}): {message}", status.as_u16()),
                _ => bail!("the gateway answered {status}"),
            }
        }
        Ok(resp)
    }

    /// `send`, and the answer's body.
    pub(crate) async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<(reqwest::Body, &'static str)>,
    ) -> anyhow::Result<Vec<u8>> {
        Ok(self.send(method, path, body).await?.bytes().await?.to_vec())
    }

    pub(crate) async fn json(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        let bytes =
            self.call(method, path, body.map(|b| (reqwest::Body::from(b.to_string()), "application/json"))).await?;
        Ok(if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes)? })
    }
}

impl Client {
    /// Every item of a paginated listing at `path` (which has a query already or not), as one
    /// answer `{key: [...]}`: callers that printed the whole listing before pages still do.
    pub(crate) async fn all_pages(&self, path: &str, key: &str) -> anyhow::Result<Value> {
        let sep = if path.contains('?') { '&' } else { '?' };
        let (mut items, mut cursor) = (Vec::new(), None::<String>);
        loop {
            let mut page_path = format!("{path}{sep}limit={PAGE}");
            if let Some(c) = &cursor {
                page_path.push_str("&cursor=");
                page_path.push_str(&query_escape(c));
            }
            let mut page = self.json(reqwest::Method::GET, &page_path, None).await?;
            match page[key].take() {
                Value::Array(a) => items.extend(a),
                other => bail!("the gateway answered no {key:?} list: {other}"),
            }
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_string()),
                None => return Ok(json!({ key: items })),
            }
        }
    }
}

/// Items a walk over every page asks for at a time (the API's most).
const PAGE: usize = 1000;

pub(crate) fn print(v: &Value) -> anyhow::Result<()> {
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
        SessionsOp::Ls { subtree, label, limit, cursor } => {
            let mut path = format!("/v1/sessions?subtree={subtree}");
            if let Some(l) = label {
                path.push_str("&label=");
                path.push_str(&query_escape(&l));
            }
            match limit {
                Some(n) => {
                    path.push_str(&format!("&limit={n}"));
                    if let Some(cur) = cursor {
                        path.push_str("&cursor=");
                        path.push_str(&query_escape(&cur));
                    }
                    print(&c.json(reqwest::Method::GET, &path, None).await?)?;
                }
                None => print(&c.all_pages(&path, "sessions").await?)?,
            }
        }
        SessionsOp::Get { session } => {
            print(&c.json(reqwest::Method::GET, &format!("/v1/sessions/{session}"), None).await?)?
        }
        SessionsOp::Rm { session: Some(session), .. } => {
            c.call(reqwest::Method::DELETE, &format!("/v1/sessions/{session}"), None).await?;
        }
        SessionsOp::Rm { session: None, label, subtree } => {
            let label = label.context("a session or --label")?;
            let path = format!("/v1/sessions?label={}&subtree={subtree}", query_escape(&label));
            print(&c.json(reqwest::Method::DELETE, &path, None).await?)?;
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

pub(crate) fn query_escape(s: &str) -> String {
    escape(s, b"-_.~")
}

fn file_url(session: &str, path: &str) -> String {
    // An absolute path keeps its '/' after the route's: `files//tmp/x`.
    format!("/v1/sessions/{session}/files/{}", escape(path, b"/-_.~"))
}

pub async fn fs(remote: Remote, op: FsOp) -> anyhow::Result<ExitCode> {
    let c = Client::new(&remote)?;
    let url =
        |session: &str, kind: &str, path: &str| format!("/v1/sessions/{session}/{kind}/{}", escape(path, b"/-_.~"));
    match op {
        FsOp::Exists { session, path } => {
            let v = c.json(reqwest::Method::GET, &url(&session, "exists", &path), None).await?;
            print(&v)?;
            if v["exists"].as_bool() != Some(true) {
                return Ok(ExitCode::FAILURE);
            }
        }
        FsOp::Rm { session, path, recursive } => {
            let q = if recursive { "?recursive=true" } else { "" };
            c.call(reqwest::Method::DELETE, &format!("{}{q}", url(&session, "files", &path)), None).await?;
        }
        FsOp::Mv { session, from, to } => {
            let body = json!({ "from": from, "to": to });
            c.json(reqwest::Method::POST, &format!("/v1/sessions/{session}/files:rename"), Some(body)).await?;
        }
        FsOp::Mkdir { session, path } => {
            c.call(reqwest::Method::POST, &url(&session, "dirs", &path), None).await?;
        }
    }
    Ok(ExitCode::SUCCESS)
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

/// The terminal size of stdout, if it is a terminal.
fn terminal_size() -> Option<(u16, u16)> {
    // SAFETY: TIOCGWINSZ fills a winsize on a valid descriptor and touches nothing else.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) } == 0;
    (ok && ws.ws_row > 0 && ws.ws_col > 0).then_some((ws.ws_row, ws.ws_col))
}

/// Puts stdin in raw mode while alive (keys go to the remote terminal as typed, Ctrl-C
/// included), and restores it when dropped.
struct RawMode(Option<libc::termios>);

impl RawMode {
    fn enter() -> RawMode {
        // SAFETY: tcgetattr/tcsetattr on stdin with a termios we own; nothing changes when
        // stdin is not a terminal (tcgetattr fails).
        unsafe {
            let mut saved: libc::termios = std::mem::zeroed();
            if libc::isatty(libc::STDIN_FILENO) != 1 || libc::tcgetattr(libc::STDIN_FILENO, &mut saved) != 0 {
                return RawMode(None);
            }
            let mut raw = saved;
            libc::cfmakeraw(&mut raw);
            libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &raw);
            RawMode(Some(saved))
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(saved) = &self.0 {
            // SAFETY: restores the settings read in `enter`.
            unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, saved) };
        }
    }
}

/// An interactive terminal in a session over its WebSocket: keys in, screen out, resizes
/// followed; ends with the remote command, whose exit code is ours.
pub async fn shell(remote: Remote, session: String, cmd: Vec<String>) -> anyhow::Result<ExitCode> {
    use futures::{SinkExt as _, StreamExt as _};
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;

    let ws_url = format!("{}/v1/sessions/{session}/ws", remote.url.trim_end_matches('/').replacen("http", "ws", 1));
    let mut req = ws_url.as_str().into_client_request()?;
    req.headers_mut().insert("authorization", format!("Bearer {}", remote.token).parse()?);
    let (ws, _) = match tokio_tungstenite::connect_async(req).await {
        Ok(ok) => ok,
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            let body = resp.body().as_deref().map(String::from_utf8_lossy).unwrap_or_default().to_string();
            let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            match (v["code"].as_str(), v["message"].as_str()) {
                (Some(code), Some(message)) => bail!("{code} ({}): {message}", resp.status().as_u16()),
                _ => bail!("the gateway answered {}", resp.status()),
            }
        }
        Err(e) => return Err(e).with_context(|| format!("open the session socket at {ws_url}")),
    };
    let (mut tx, mut rx) = ws.split();
    let (rows, cols) = terminal_size().unwrap_or((24, 80));
    let cmd = if cmd.is_empty() { vec!["sh".to_string()] } else { cmd };
    let start =
        json!({"type": "start", "id": "tty", "cmd": cmd, "pty": {"rows": rows, "cols": cols}, "encoding": "base64"});
    tx.send(Message::Text(start.to_string().into())).await?;
    let _raw = RawMode::enter();

    // Keys: a blocking reader thread (stdin has no portable async read).
    let (keys_tx, mut keys) = tokio::sync::mpsc::channel::<Vec<u8>>(64);
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let mut stdin = std::io::stdin();
        while let Ok(n @ 1..) = stdin.read(&mut buf) {
            if keys_tx.blocking_send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())?;
    let mut out = std::io::stdout();
    loop {
        tokio::select! {
            Some(k) = keys.recv() => {
                let m = json!({"type": "stdin", "id": "tty", "data": wire::b64_encode(&k)});
                tx.send(Message::Text(m.to_string().into())).await?;
            }
            _ = winch.recv() => {
                if let Some((rows, cols)) = terminal_size() {
                    let m = json!({"type": "resize", "id": "tty", "rows": rows, "cols": cols});
                    tx.send(Message::Text(m.to_string().into())).await?;
                }
            }
            msg = rx.next() => {
                let Some(msg) = msg else { bail!("the session socket closed") };
                let Message::Text(t) = msg? else { continue };
                let m: Value = serde_json::from_str(&t)?;
                match m["type"].as_str() {
                    Some("stdout" | "stderr") => {
                        out.write_all(&wire::b64_decode(m["data"].as_str().unwrap_or_default()).map_err(|e| anyhow::anyhow!(e))?)?;
                        out.flush()?;
                    }
                    Some("exit") => {
                        let code = m["exit_code"].as_i64().unwrap_or(1);
                        return Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)));
                    }
                    Some("error") => bail!("{}: {}", m["code"].as_str().unwrap_or("error"), m["message"].as_str().unwrap_or("")),
                    _ => {}
                }
            }
        }
    }
}

//! What a load run drives: sandpool's HTTP API, or the naive baseline that does the same
//! episode with the plain docker CLI (`docker run` per episode, `docker exec` per step,
//! `docker rm -f` at the end). The platform itself never shells out to docker; this tool does
//! so on purpose, because that is the naive way it is compared against.

use std::collections::BTreeMap;
use std::future::Future;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use reqwest::StatusCode;
use wire::Cmd;

use crate::record::{Failure, StartKind};

/// Label on every baseline container, so they can be found and removed.
pub const LOADTEST_LABEL: &str = "sandpool.loadtest";
/// Label naming the run a baseline container belongs to.
pub const RUN_LABEL: &str = "sandpool.loadtest.run";

/// A session (sandpool) or a container (baseline) as the load run holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Created {
    pub handle: String,
    pub start: StartKind,
}

/// The three calls of an episode. The runner times them and applies their deadlines; an
/// implementation only makes the call (and must stop its work when the future is dropped).
pub trait Target: Send + Sync + 'static {
    fn create(&self, template: &str) -> impl Future<Output = Result<Created, Failure>> + Send;
    /// Run one step; the command's exit code.
    fn exec(&self, handle: &str, cmd: &Cmd) -> impl Future<Output = Result<i32, Failure>> + Send;
    fn delete(&self, handle: &str) -> impl Future<Output = Result<(), Failure>> + Send;
}

// ---------------------------------------------------------------------------------------------
// sandpool over HTTP

/// sandpool's public API.
#[derive(Debug, Clone)]
pub struct Sandpool {
    http: reqwest::Client,
    base: String,
    auth: String,
    labels: BTreeMap<String, String>,
}

impl Sandpool {
    /// `url`: the gateway's base URL; `labels` go on every session.
    pub fn new(url: &str, token: &str, labels: BTreeMap<String, String>) -> anyhow::Result<Sandpool> {
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            // The runner enforces per-request deadlines; this only bounds connection setup.
            .connect_timeout(Duration::from_secs(10))
            .build()
            .context("build HTTP client")?;
        Ok(Sandpool { http, base: url.trim_end_matches('/').to_string(), auth: format!("Bearer {token}"), labels })
    }

    /// Check that the gateway is ready, accepts the token and knows every template.
    pub async fn preflight(&self, templates: &[String]) -> anyhow::Result<()> {
        let timeout = Duration::from_secs(10);
        let ready = self
            .http
            .get(format!("{}/readyz", self.base))
            .timeout(timeout)
            .send()
            .await
            .with_context(|| format!("reach the gateway at {}", self.base))?;
        anyhow::ensure!(ready.status().is_success(), "gateway at {} is not ready: {}", self.base, ready.status());
        let resp = self
            .http
            .get(format!("{}/v1/templates", self.base))
            .header(reqwest::header::AUTHORIZATION, &self.auth)
            .timeout(timeout)
            .send()
            .await
            .context("list templates")?;
        let status = resp.status();
        let body = resp.text().await.context("read the template list")?;
        anyhow::ensure!(status != StatusCode::UNAUTHORIZED, "the gateway refused the token: {body}");
        anyhow::ensure!(status.is_success(), "list templates: {status}: {body}");
        let list: wire::TemplateList = serde_json::from_str(&body).context("parse the template list")?;
        for t in templates {
            anyhow::ensure!(
                list.templates.iter().any(|i| &i.name == t),
                "the scenario uses template {t:?}, which the gateway does not have (it has: {})",
                list.templates.iter().map(|i| i.name.as_str()).collect::<Vec<_>>().join(", ")
            );
        }
        Ok(())
    }

    async fn call(&self, req: reqwest::RequestBuilder) -> Result<(StatusCode, String), Failure> {
        let resp = req
            .header(reqwest::header::AUTHORIZATION, &self.auth)
            .send()
            .await
            .map_err(|e| Failure::Transport(format!("{e:#}")))?;
        let status = resp.status();
        let retry_after = resp.headers().contains_key(reqwest::header::RETRY_AFTER);
        // Read the whole body in every case, so the connection goes back to the pool.
        let body = resp.text().await.map_err(|e| Failure::Transport(format!("read answer: {e:#}")))?;
        if status.is_success() {
            Ok((status, body))
        } else {
            let message = serde_json::from_str::<wire::ErrorBody>(&body)
                .map(|e| format!("{}: {}", e.code, e.message))
                .unwrap_or(body);
            Err(Failure::Status { code: status.as_u16(), retry_after, message })
        }
    }
}

fn parse<T: serde::de::DeserializeOwned>(what: &str, body: &str) -> Result<T, Failure> {
    serde_json::from_str(body).map_err(|e| Failure::Transport(format!("parse {what} answer: {e}")))
}

impl Target for Sandpool {
    async fn create(&self, template: &str) -> Result<Created, Failure> {
        let body =
            wire::CreateSession { template: template.to_string(), labels: self.labels.clone(), ..Default::default() };
        let (_, text) = self.call(self.http.post(format!("{}/v1/sessions", self.base)).json(&body)).await?;
        let s: wire::Session = parse("create", &text)?;
        // The create answer always carries `start`; treat a missing one as not warm.
        let start = if s.start == Some(wire::Start::Warm) { StartKind::Warm } else { StartKind::Cold };
        Ok(Created { handle: s.session_id, start })
    }

    async fn exec(&self, handle: &str, cmd: &Cmd) -> Result<i32, Failure> {
        // Only `cmd`: every other field of `wire::ExecRequest` keeps the server's default.
        let body = serde_json::json!({ "cmd": cmd });
        let url = format!("{}/v1/sessions/{handle}/exec", self.base);
        let (_, text) = self.call(self.http.post(url).json(&body)).await?;
        let r: wire::ExecResponse = parse("exec", &text)?;
        Ok(r.exit_code)
    }

    async fn delete(&self, handle: &str) -> Result<(), Failure> {
        self.call(self.http.delete(format!("{}/v1/sessions/{handle}", self.base))).await.map(|_| ())
    }
}

// ---------------------------------------------------------------------------------------------
// The naive baseline: the docker CLI

/// The docker CLI, one container per episode, labelled with this run's id.
#[derive(Debug, Clone)]
pub struct DockerCli {
    run_id: String,
    images: BTreeMap<String, String>,
}

/// The outcome of one docker CLI call.
struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

async fn docker(args: &[&str]) -> Result<Output, Failure> {
    let out = tokio::process::Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        // A deadline drops the future: the CLI process must not outlive it.
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| Failure::Docker(format!("spawn docker: {e}")))?;
    Ok(Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).trim().to_string(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

fn docker_failure(args: &[&str], out: &Output) -> Failure {
    let verb = args.first().copied().unwrap_or("");
    Failure::Docker(format!("docker {verb}: exit {:?}: {}", out.code, out.stderr))
}

impl DockerCli {
    /// `images`: template → image for every template the scenario uses.
    pub fn new(run_id: &str, images: BTreeMap<String, String>) -> DockerCli {
        DockerCli { run_id: run_id.to_string(), images }
    }

    /// Check that docker answers and every image is present locally.
    pub async fn preflight(&self) -> anyhow::Result<()> {
        let v = docker(&["version", "--format", "{{.Server.Version}}"]).await.map_err(|e| anyhow::anyhow!("{e:?}"))?;
        anyhow::ensure!(v.code == Some(0), "docker does not answer: {}", v.stderr);
        for (t, image) in &self.images {
            let out = docker(&["image", "inspect", "--format", "{{.Id}}", image])
                .await
                .map_err(|e| anyhow::anyhow!("{e:?}"))?;
            anyhow::ensure!(out.code == Some(0), "templates.{t}: image {image} is not present: {}", out.stderr);
        }
        Ok(())
    }
}

impl Target for DockerCli {
    async fn create(&self, template: &str) -> Result<Created, Failure> {
        let image =
            self.images.get(template).ok_or_else(|| Failure::Docker(format!("no image for template {template:?}")))?;
        let loadtest = format!("{LOADTEST_LABEL}=1");
        let run = format!("{RUN_LABEL}={}", self.run_id);
        let args =
            ["run", "-d", "--network", "none", "--label", &loadtest, "--label", &run, image, "sleep", "infinity"];
        let out = docker(&args).await?;
        if out.code != Some(0) || out.stdout.is_empty() {
            return Err(docker_failure(&args, &out));
        }
        Ok(Created { handle: out.stdout, start: StartKind::Cold })
    }

    async fn exec(&self, handle: &str, cmd: &Cmd) -> Result<i32, Failure> {
        let argv = cmd.to_argv();
        let mut args = vec!["exec", handle];
        args.extend(argv.iter().map(String::as_str));
        let out = docker(&args).await?;
        match out.code {
            // docker exec exits with the command's status, except when docker itself failed.
            Some(code) if !(code != 0 && out.stderr.starts_with("Error response from daemon")) => Ok(code),
            _ => Err(docker_failure(&args, &out)),
        }
    }

    async fn delete(&self, handle: &str) -> Result<(), Failure> {
        let args = ["rm", "-f", handle];
        let out = docker(&args).await?;
        if out.code == Some(0) { Ok(()) } else { Err(docker_failure(&args, &out)) }
    }
}

/// Remove every container of baseline run `run_id` (by label), repeating until none is left
/// (a `docker run` killed at its deadline may still create its container a moment later, and
/// an episode may be removing its own at the same time). Returns how many were removed.
pub async fn remove_run_containers(run_id: &str) -> anyhow::Result<usize> {
    let filter = format!("label={RUN_LABEL}={run_id}");
    let mut removed = 0;
    let mut empty_looks = 0;
    let mut left = Vec::new();
    for _ in 0..10 {
        let ps = docker(&["ps", "-aq", "--filter", &filter]).await.map_err(|e| anyhow::anyhow!("{e:?}"))?;
        anyhow::ensure!(ps.code == Some(0), "docker ps: {}", ps.stderr);
        left = ps.stdout.split_whitespace().map(str::to_string).collect();
        if left.is_empty() {
            // Look twice, a moment apart, for the reason above.
            empty_looks += 1;
            if empty_looks == 2 {
                return Ok(removed);
            }
        } else {
            let mut args = vec!["rm", "-f"];
            args.extend(left.iter().map(String::as_str));
            // "No such container" / "removal already in progress" are fine: the next look
            // tells what is really left.
            let out = docker(&args).await.map_err(|e| anyhow::anyhow!("{e:?}"))?;
            removed += out.stdout.lines().count();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    anyhow::bail!("{} containers with label {RUN_LABEL}={run_id} are still there: {}", left.len(), left.join(" "))
}

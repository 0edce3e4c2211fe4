//! What the tests of the `sandpool` binary share: `sandpool up` started as a child process on
//! a test stack's config (its own key prefix and node id, a free loopback port), ready, with a
//! token; killed on drop, its containers and keys removed and its files deleted, pass or fail.

// Each test binary compiles this module for itself and uses a different part of it.
#![allow(dead_code)]

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use tests::{Cleanup, StackOpts, config_for, config_toml, eventually, rand_hex};

/// A running `sandpool up`.
pub struct Up {
    pub child: Child,
    port: u16,
    /// The gateway's base URL.
    pub url: String,
    pub http: reqwest::Client,
    /// A token of tenant `acme`.
    pub token: String,
    pub node: String,
    /// Where the process logs (stdout and stderr).
    pub log: PathBuf,
    dir: PathBuf,
    // Last: removes the stack's containers and keys after the process is gone.
    _cleanup: Cleanup,
}

impl Up {
    /// Starts `sandpool up` on a test config (`edit` may change its TOML; `configure` the
    /// command, e.g. its environment) and waits until it is ready.
    pub async fn start(edit: impl FnOnce(String) -> String, configure: impl FnOnce(&mut Command)) -> Up {
        let prefix = format!("sptest-{}", rand_hex(10));
        let node = format!("n{}", rand_hex(6));
        let cleanup = Cleanup { prefix: prefix.clone(), redis: tests::redis_url(), node: node.clone() };
        let opts = StackOpts { warm: 1, ..Default::default() };
        let dir = std::env::temp_dir().join(&prefix);
        std::fs::create_dir_all(&dir).unwrap();
        let cfg_path = dir.join("sandpool.toml");
        std::fs::write(&cfg_path, edit(config_toml(&prefix, &node, &opts))).unwrap();
        let log = dir.join("sandpool.log");
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
        let mut cmd = up_command(&cfg_path, port, &log);
        configure(&mut cmd);
        let child = cmd.spawn().expect("start sandpool up");
        let config = config_for(&prefix, &node, &opts);
        let node = node.clone();
        let token = gateway::mint(&config.auth, "acme", false, Duration::from_secs(600)).unwrap();
        let up = Up {
            child,
            port,
            url: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::new(),
            token,
            node,
            log,
            dir,
            _cleanup: cleanup,
        };
        eventually(Duration::from_secs(60), || async { (up.ready().await == Some(204)).then_some(()) })
            .await
            .expect("sandpool up becomes ready");
        up
    }

    /// A client of the gateway as tenant `acme`.
    pub fn client(&self) -> tests::Client {
        tests::Client { http: self.http.clone(), url: self.url.clone(), token: self.token.clone() }
    }

    /// Runs `cmd` to its end (off the runtime) as a client of this stack (`SANDPOOL_URL`,
    /// `SANDPOOL_TOKEN`); its output and its stdout and stderr as one text.
    pub async fn run(&self, mut cmd: std::process::Command) -> (std::process::Output, String) {
        cmd.env("SANDPOOL_URL", &self.url).env("SANDPOOL_TOKEN", &self.token);
        let program = format!("{:?}", cmd.get_program());
        let out = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap();
        let out = out.unwrap_or_else(|e| panic!("run {program}: {e}"));
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out, text)
    }

    /// The last `n` lines of the process's log that warn or err: what a failed test prints, so
    /// that a failure on a CI machine says what the stack saw.
    pub fn warnings(&self, n: usize) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The config file the process runs with.
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("sandpool.toml")
    }

    /// The status `/readyz` answers, if it answers.
    pub async fn ready(&self) -> Option<u16> {
        self.http.get(format!("{}/readyz", self.url)).send().await.ok().map(|r| r.status().as_u16())
    }

    /// Creates a session of template `bb` (retrying while the pool warms up); returns the
    /// answer's `x-request-id` and body.
    pub async fn create(&self) -> (String, serde_json::Value) {
        eventually(Duration::from_secs(60), || async {
            let r = self
                .http
                .post(format!("{}/v1/sessions", self.url))
                .bearer_auth(&self.token)
                .json(&serde_json::json!({"template": "bb"}))
                .send()
                .await
                .ok()?;
            (r.status().as_u16() == 201).then_some(())?;
            let rid = r.headers().get("x-request-id")?.to_str().ok()?.to_string();
            Some((rid, r.json::<serde_json::Value>().await.ok()?))
        })
        .await
        .expect("a session")
    }
}

/// `sandpool up` on config `cfg` with its gateway on 127.0.0.1:`port`, logging into `log`.
fn up_command(cfg: &std::path::Path, port: u16, log: &std::path::Path) -> Command {
    let out = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    let err = out.try_clone().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandpool"));
    cmd.arg("--config")
        .arg(cfg)
        .args(["--gateway-listen", &format!("127.0.0.1:{port}"), "up"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err));
    cmd
}

impl Up {
    /// Kills the process with SIGKILL (no shutdown of any kind: a crash) and starts it again
    /// on the same config and port; waits until it is ready.
    pub async fn crash_and_restart(&mut self) {
        self.child.kill().expect("kill -9 sandpool");
        self.child.wait().expect("reap sandpool");
        self.child = up_command(&self.config_path(), self.port, &self.log).spawn().expect("restart sandpool up");
        eventually(Duration::from_secs(60), || async { (self.ready().await == Some(204)).then_some(()) })
            .await
            .expect("sandpool up becomes ready again");
    }

    pub fn sigterm(&self) {
        let kill = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        assert!(kill.success());
    }

    /// Waits (at most `within`) for the process to exit.
    pub async fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for sandpool") {
                return status;
            }
            assert!(std::time::Instant::now() < deadline, "sandpool exits within {within:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs the `sandpool` binary as a user against `up` (`SANDPOOL_URL` and `SANDPOOL_TOKEN`), with
/// `stdin` as its input.
pub fn sandpool(up: &Up, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sandpool"))
        .args(args)
        .env("SANDPOOL_URL", &up.url)
        .env("SANDPOOL_TOKEN", &up.token)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run sandpool");
    let mut input = child.stdin.take().unwrap();
    if let Some(data) = stdin {
        input.write_all(data).unwrap();
    }
    drop(input);
    child.wait_with_output().unwrap()
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A copy of `sdk/python` (the package's sources only) under `dir/sdk/python`, laid out as in a
/// checkout: `pip install ./sdk/python` builds in the source tree, and the tests' builds must
/// leave the worktree as it was.
pub fn sdk_checkout(dir: &std::path::Path) -> PathBuf {
    fn copy(from: &std::path::Path, to: &std::path::Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            let name = e.file_name();
            let skip = ["__pycache__", "build", "dist", ".venv"].iter().any(|s| name == *s)
                || name.to_string_lossy().ends_with(".egg-info");
            if skip {
                continue;
            }
            if e.file_type().unwrap().is_dir() {
                copy(&e.path(), &to.join(&name));
            } else {
                std::fs::copy(e.path(), to.join(&name)).unwrap();
            }
        }
    }
    let sdk = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk/python");
    copy(&sdk, &dir.join("sdk/python"));
    dir.to_path_buf()
}

/// Runs `cmd` to its end and panics with its output if it fails; its stdout.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

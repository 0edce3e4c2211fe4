//! The operator's kit as an operator uses it: the sandpool image (scripts/image) and
//! deploy/compose.yml, brought up with docker-compose on free ports under a key prefix and
//! container label of their own, serving an episode; then a second pool-manager on the same
//! machine configured by environment variables alone. Torn down (containers, volume, sandboxes,
//! state directory) when the test ends, pass or fail.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use reqwest::Method;
use serde_json::json;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The sandpool binary of this build (`cargo build -p sandpool` into the target directory
/// this test runs from: a no-op when it is up to date).
fn sandpool_binary() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(cargo).current_dir(root()).args(["build", "-q", "-p", "sandpool"]));
    // <target>/debug/deps/it-<hash> -> <target>/debug/sandpool
    let exe = std::env::current_exe().expect("this test's path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("<target>/<profile>/deps/..");
    let bin = profile_dir.join("sandpool");
    assert!(bin.is_file(), "no sandpool binary at {}", bin.display());
    bin
}

/// Ports nothing listens on now (bound to port 0 and let go: others' tests bind 0 too, so a
/// collision would need the kernel to hand the same port out twice in a few seconds).
fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<std::net::TcpListener> =
        (0..N).map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0")).collect();
    std::array::from_fn(|i| listeners[i].local_addr().expect("local addr").port())
}

/// One compose project: its environment, and its removal when dropped.
struct Deployment {
    project: String,
    prefix: String,
    env: Vec<(String, String)>,
    state_dirs: Vec<PathBuf>,
    extra_containers: Vec<String>,
}

impl Deployment {
    fn compose(&self) -> Command {
        let mut c = Command::new("docker-compose");
        c.current_dir(root()).args(["-p", &self.project, "-f", "deploy/compose.yml"]);
        c.envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // What the services said, for the failure's report.
            if let Ok(out) = self.compose().args(["logs", "--no-color", "--tail", "40"]).output() {
                eprintln!("{}", String::from_utf8_lossy(&out.stdout));
            }
        }
        let _ = self.compose().args(["down", "-v", "--timeout", "10"]).output();
        for name in &self.extra_containers {
            let _ = Command::new("docker").args(["rm", "-f", name]).output();
        }
        // Sandboxes outlive their pool-manager by design (a restart reattaches them).
        let filter = format!("label=sandpool.prefix={}", self.prefix);
        for _ in 0..2 {
            if let Ok(out) = Command::new("docker").args(["ps", "-aq", "--filter", &filter]).output() {
                let ids: Vec<String> =
                    String::from_utf8_lossy(&out.stdout).split_whitespace().map(String::from).collect();
                if !ids.is_empty() {
                    let _ = Command::new("docker").arg("rm").arg("-f").args(&ids).output();
                }
            }
            std::thread::sleep(Duration::from_millis(750));
        }
        for d in &self.state_dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_file_serves_an_episode_and_a_second_node_needs_only_env_vars() {
    let bin = sandpool_binary();
    let image = "sandpool/sandpool:test";
    run(Command::new(root().join("scripts/image")).args(["--bin"]).arg(&bin).args(["--tag", image]));

    let id = tests::rand_hex(8);
    let [ledger, gw, pm, gw_metrics, pm_metrics, scaler_metrics, pm2, pm2_metrics] = free_ports::<8>();
    let state_dir = PathBuf::from(format!("/tmp/sandpool-compose-{id}"));
    let vars = [
        ("SANDPOOL_IMAGE", image.to_string()),
        ("SANDPOOL_PREFIX", format!("sptest-compose-{id}")),
        ("SANDPOOL_NODE_ID", format!("compose-{id}")),
        ("SANDPOOL_LEDGER_PORT", ledger.to_string()),
        ("SANDPOOL_REDIS_URL", format!("redis://127.0.0.1:{ledger}")),
        ("SANDPOOL_GATEWAY_PORT", gw.to_string()),
        ("SANDPOOL_NODE_PORT", pm.to_string()),
        ("SANDPOOL_GATEWAY_METRICS_PORT", gw_metrics.to_string()),
        ("SANDPOOL_NODE_METRICS_PORT", pm_metrics.to_string()),
        ("SANDPOOL_AUTOSCALER_METRICS_PORT", scaler_metrics.to_string()),
        ("SANDPOOL_STATE_DIR", state_dir.display().to_string()),
        ("SANDPOOL_BUSYBOX_WARM", "1".to_string()),
        ("SANDPOOL_DEBIAN_WARM", "0".to_string()),
    ];
    let mut d = Deployment {
        project: format!("sptest{id}"),
        prefix: format!("sptest-compose-{id}"),
        env: vars.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
        state_dirs: vec![state_dir],
        extra_containers: vec![],
    };
    run(d.compose().args(["up", "-d"]));

    // Ready: the gateway answers /readyz, and its log lines are JSON (log.format from the env).
    let url = format!("http://127.0.0.1:{gw}");
    let http = reqwest::Client::new();
    let ready = tests::eventually(Duration::from_secs(90), || async {
        let r = http.get(format!("{url}/readyz")).send().await.ok()?;
        r.status().is_success().then_some(())
    });
    assert!(ready.await.is_some(), "the compose gateway was not ready within 90 s");
    let logs = run(d.compose().args(["logs", "--no-color", "gateway"]));
    let logs = String::from_utf8_lossy(&logs.stdout);
    let ready_line = logs.lines().find(|l| l.contains("gateway ready")).expect("a 'gateway ready' log line");
    let json_part = &ready_line[ready_line.find('{').expect("a JSON log line")..];
    let line: serde_json::Value = serde_json::from_str(json_part).expect("the log line is JSON");
    assert_eq!(line["fields"]["message"], "gateway ready", "{line}");

    // A token from the image's own CLI, with the deployment's key.
    let token = run(d.compose().args(["exec", "-T", "gateway", "sandpool", "token", "--tenant", "acme"]));
    let token = String::from_utf8_lossy(&token.stdout).trim().to_string();
    let acme = tests::Client { http: http.clone(), url: url.clone(), token };

    // An episode: a session, state kept across steps, the end.
    let a = acme.call(Method::POST, "/v1/sessions", Some(json!({"template": "busybox", "max_wait_s": 60}))).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    let s = a.body["session_id"].as_str().expect("a session id").to_string();
    assert_eq!(acme.sh(&s, "echo step-1 > notes.txt").await["exit_code"], 0);
    let read = acme.sh(&s, "cat notes.txt && echo step-2").await;
    assert_eq!(read["stdout"], "step-1\nstep-2\n", "{read}");
    assert_eq!(acme.delete(&s).await, 204);

    // A second pool-manager on this machine, from the same image, by environment variables
    // alone (its own node id, listeners, metrics port and state directory).
    let node2 = format!("compose2-{id}");
    let state2 = PathBuf::from(format!("/tmp/sandpool-compose2-{id}"));
    d.state_dirs.push(state2.clone());
    let name2 = format!("sptest{id}-pm2");
    d.extra_containers.push(name2.clone());
    let env2 = [
        format!("SANDPOOL__REDIS__URL=redis://127.0.0.1:{ledger}"),
        format!("SANDPOOL__REDIS__PREFIX={}", d.prefix),
        format!("SANDPOOL__NODE__ID={node2}"),
        format!("SANDPOOL__POOL_MANAGER__LISTEN=127.0.0.1:{pm2}"),
        format!("SANDPOOL__TELEMETRY__METRICS_LISTEN=127.0.0.1:{pm2_metrics}"),
        format!("SANDPOOL__POOL_MANAGER__STATE_DIR={}", state2.display()),
        "SANDPOOL__TEMPLATES__BUSYBOX__WARM=1".to_string(),
        "SANDPOOL__TEMPLATES__DEBIAN__WARM=0".to_string(),
    ];
    let mut docker_run = Command::new("docker");
    docker_run.args([
        "run",
        "-d",
        "--name",
        &name2,
        "--network",
        "host",
        "--cap-add",
        "NET_ADMIN",
        "--cap-add",
        "NET_RAW",
    ]);
    docker_run.args(["-v", "/var/run/docker.sock:/var/run/docker.sock"]);
    docker_run.arg("-v").arg(format!("{0}:{0}", state2.display()));
    for e in &env2 {
        docker_run.args(["-e", e]);
    }
    run(docker_run.args([image, "pool-manager"]));
    // It joins: its metrics answer, and it fills its own warm pool (sandboxes labelled with it).
    let joined = tests::eventually(Duration::from_secs(60), || async {
        let m = http.get(format!("http://127.0.0.1:{pm2_metrics}/metrics")).send().await.ok()?;
        if !m.status().is_success() {
            return None;
        }
        let filter = format!("label=sandpool.node={node2}");
        let out = Command::new("docker").args(["ps", "-q", "--filter", &filter]).output().ok()?;
        (!String::from_utf8_lossy(&out.stdout).trim().is_empty()).then_some(())
    });
    if joined.await.is_none() {
        let logs = Command::new("docker").args(["logs", "--tail", "30", &name2]).output();
        let logs = logs.map(|o| String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout));
        panic!("the second pool-manager did not start sandboxes within 60 s: {logs:?}");
    }
}

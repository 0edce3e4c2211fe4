//! The operator's kit as an operator uses it: the sandpool image (scripts/image) and
//! deploy/compose.yml, brought up with docker-compose on free ports under a key prefix and
//! container label of their own, serving an episode; then a second pool-manager on the same
//! machine configured by environment variables alone. Torn down (containers, volume, sandboxes,
//! state directory) when the test ends, pass or fail.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use reqwest::Method;
use serde::Deserialize as _;
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
    // The probes the Kubernetes manifests use: the gateway's answer without credentials; the
    // pool-manager's is a TCP connect (its API wants the internal secret, probes included).
    let r = http.get(format!("{url}/healthz")).send().await.expect("the gateway answers /healthz");
    assert!(r.status().is_success(), "/healthz: {}", r.status());
    std::net::TcpStream::connect(("127.0.0.1", pm)).expect("the pool-manager listens");
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
        "--pid",
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

// ── the manifests, as far as this machine checks them (no cluster, no systemd here) ────────

/// What the image provides: its ENTRYPOINT (the binary's path) and its config file's path,
/// read from images/sandpool/Dockerfile.
fn image_entrypoint_and_config() -> (String, String) {
    let dockerfile = std::fs::read_to_string(root().join("images/sandpool/Dockerfile")).expect("the Dockerfile");
    let entry = dockerfile.lines().find_map(|l| l.strip_prefix("ENTRYPOINT ")).expect("an ENTRYPOINT");
    let entry: Vec<String> = serde_json::from_str(entry).expect("ENTRYPOINT in exec form");
    let config = dockerfile.lines().find_map(|l| l.strip_prefix("ENV SANDPOOL_CONFIG=")).expect("SANDPOOL_CONFIG");
    (entry[0].clone(), config.to_string())
}

/// Whether `sandpool <sub>` is a subcommand of the binary this tree builds.
fn is_subcommand(bin: &Path, sub: &str) -> bool {
    Command::new(bin).args([sub, "--help"]).output().is_ok_and(|o| o.status.success())
}

/// The effective config of the shipped file (the image's) with `env` applied, or why not.
fn config_with(env: &[(String, String)]) -> Result<config::Config, String> {
    let text = std::fs::read_to_string(root().join("config/sandpool.toml")).expect("config/sandpool.toml");
    config::Config::from_toml_with_env(&text, &config::Overrides::default(), env.iter().cloned())
        .map_err(|e| e.to_string())
}

fn port_of(addr: Option<std::net::SocketAddr>) -> Option<u64> {
    addr.map(|a| u64::from(a.port()))
}

#[test]
fn the_kubernetes_manifests_and_systemd_units_name_only_what_the_image_provides() {
    let bin = sandpool_binary();
    let (entrypoint, image_config) = image_entrypoint_and_config();
    assert_eq!(image_config, "/etc/sandpool/sandpool.toml");
    let k8s = root().join("deploy/kubernetes");

    // The secret's keys, with the example's values (not the shipped development ones).
    let secret_text = std::fs::read_to_string(k8s.join("secret.example.yaml")).expect("secret.example.yaml");
    let secret: serde_yaml::Value = serde_yaml::from_str(&secret_text).expect("the secret parses");
    let secret_value = |key: &str| secret["stringData"][key].as_str().map(String::from);

    let mut roles_seen = Vec::new();
    for file in ["namespace.yaml", "pool-manager.yaml", "gateway.yaml", "autoscaler.yaml"] {
        let text = std::fs::read_to_string(k8s.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let doc = serde_yaml::Value::deserialize(doc).unwrap_or_else(|e| panic!("{file} parses as YAML: {e}"));
            let kind = doc["kind"].as_str().unwrap_or_else(|| panic!("{file}: a document without kind"));
            assert!(doc["apiVersion"].is_string(), "{file}: {kind} without apiVersion");
            let Some(containers) = doc["spec"]["template"]["spec"]["containers"].as_sequence() else { continue };
            for c in containers {
                let name = c["name"].as_str().unwrap_or("?");
                let at = format!("{file} {kind} container {name}");
                let image = c["image"].as_str().unwrap_or("");
                assert!(image.starts_with("sandpool/sandpool:"), "{at}: image {image}");
                assert_eq!(c["command"][0].as_str(), Some(entrypoint.as_str()), "{at}: the image's ENTRYPOINT");
                let role = c["args"][0].as_str().unwrap_or_else(|| panic!("{at}: no role in args"));
                if role == "pool-manager" {
                    let pod = &doc["spec"]["template"]["spec"];
                    assert_eq!(
                        (pod["hostNetwork"].as_bool(), pod["hostPID"].as_bool()),
                        (Some(true), Some(true)),
                        "{at}: the host's network (iptables guard) and process ids (budget, timeouts)"
                    );
                }
                assert!(is_subcommand(&bin, role), "{at}: `sandpool {role}` is no subcommand");
                roles_seen.push(role.to_string());

                // The environment, as the kubelet gives it: secrets from the example, the
                // downward API's addresses, $(VAR) expanded.
                let mut env: Vec<(String, String)> = Vec::new();
                for e in c["env"].as_sequence().into_iter().flatten() {
                    let key = e["name"].as_str().expect("an env name").to_string();
                    let value = if let Some(v) = e["value"].as_str() {
                        let mut v = v.to_string();
                        for (k, val) in &env {
                            v = v.replace(&format!("$({k})"), val);
                        }
                        v
                    } else if let Some(r) = e["valueFrom"]["secretKeyRef"].as_mapping() {
                        let k = r.get("key").and_then(|k| k.as_str()).expect("a secret key");
                        secret_value(k).unwrap_or_else(|| panic!("{at}: secret key {k} is not in the secret"))
                    } else if e["valueFrom"]["fieldRef"].is_mapping() {
                        "10.0.0.7".to_string()
                    } else {
                        panic!("{at}: env {key} has neither value nor a known valueFrom")
                    };
                    env.push((key, value));
                }
                let cfg = config_with(&env).unwrap_or_else(|e| panic!("{at}: its environment is no valid config: {e}"));
                assert!(!cfg.pool_manager.advertise.contains("$("), "{at}: advertise {}", cfg.pool_manager.advertise);

                // Its ports are the ones the config listens on for its role, and its probes
                // name its ports.
                let listens = match role {
                    "gateway" => {
                        vec![Some(u64::from(cfg.gateway.listen.port())), port_of(cfg.telemetry.metrics_listen)]
                    }
                    "pool-manager" => {
                        vec![Some(u64::from(cfg.pool_manager.listen.port())), port_of(cfg.telemetry.metrics_listen)]
                    }
                    _ => vec![port_of(cfg.telemetry.metrics_listen)],
                };
                let ports: Vec<(String, u64)> = c["ports"]
                    .as_sequence()
                    .into_iter()
                    .flatten()
                    .map(|p| (p["name"].as_str().unwrap_or("").to_string(), p["containerPort"].as_u64().unwrap_or(0)))
                    .collect();
                for (pname, port) in &ports {
                    assert!(
                        listens.contains(&Some(*port)),
                        "{at}: port {pname} {port} is not one the config listens on"
                    );
                }
                let metrics = port_of(cfg.telemetry.metrics_listen).expect("metrics on");
                let scraped = doc["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"].as_str();
                assert_eq!(scraped, Some(metrics.to_string().as_str()), "{at}: Prometheus scrapes the metrics port");
                for probe in ["readinessProbe", "livenessProbe"] {
                    let p = &c[probe];
                    let named = p["httpGet"]["port"].as_str().or(p["tcpSocket"]["port"].as_str());
                    if let Some(named) = named {
                        assert!(ports.iter().any(|(n, _)| n == named), "{at}: {probe} names no port of it: {named}");
                    }
                }
            }
        }
    }
    roles_seen.sort();
    assert_eq!(roles_seen, ["autoscaler", "gateway", "pool-manager"], "one workload per role");

    // systemd: the binary, a subcommand, and environment files that make a valid config.
    let units = root().join("deploy/systemd");
    for unit in ["sandpool-gateway.service", "sandpool-autoscaler.service", "sandpool-pool-manager@.service"] {
        let text = std::fs::read_to_string(units.join(unit)).unwrap_or_else(|e| panic!("{unit}: {e}"));
        let exec =
            text.lines().find_map(|l| l.strip_prefix("ExecStart=")).unwrap_or_else(|| panic!("{unit}: ExecStart"));
        let argv: Vec<&str> = exec.split_whitespace().collect();
        assert_eq!(argv[0], entrypoint, "{unit}: the binary's path");
        assert_eq!(&argv[1..3], ["--config", image_config.as_str()], "{unit}");
        assert!(is_subcommand(&bin, argv[3]), "{unit}: `sandpool {}` is no subcommand", argv[3]);
    }
    let env_file = |name: &str| -> Vec<(String, String)> {
        let text = std::fs::read_to_string(units.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        text.lines()
            .filter(|l| !l.trim_start().starts_with('#') && l.contains('='))
            .map(|l| {
                let (k, v) = l.split_once('=').expect("KEY=VALUE");
                (k.trim().to_string(), v.trim().to_string())
            })
            .collect()
    };
    let mut env = env_file("sandpool.env.example");
    env.extend(env_file("pool-manager-main.env.example"));
    let cfg = config_with(&env).unwrap_or_else(|e| panic!("the systemd environment files: {e}"));
    assert_eq!(cfg.node.id.as_deref(), Some("worker-07"));
    assert_eq!(cfg.pool_manager.advertise, "http://10.0.0.7:8081");
}

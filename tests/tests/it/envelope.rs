//! The tenant's envelope, tried as a hostile tenant would through the API: a template a tenant
//! makes (`POST /v1/templates`) is a request inside its base's settings; the image's own
//! settings reach no further; the agent's socket directory is the node's, not the sandbox's.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use tests::corpus::{Built, Corpus};
use tests::{Stack, StackOpts, container_inspect, eventually, shim_of};

/// Opens a session of `template` (a pull may come first).
async fn open(c: &tests::Client, template: &str) -> Value {
    let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": template, "max_wait_s": 60}))).await;
    assert_eq!(a.status, 201, "open {template}: {:?}", a.body);
    a.body
}

fn refused_on(a: &tests::Answer, status: u16, field: &str) {
    assert_eq!(a.status, status, "{:?}", a.body);
    let message = a.body["message"].as_str().unwrap_or_default();
    assert!(message.starts_with(&format!("{field}:")), "names {field}: {:?}", a.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_put_its_workdir_on_a_path_the_platform_mounts() {
    let corpus = Corpus::build(1, 16);
    let img = &corpus.images[0].image;
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let c = stack.client("acme");
    for (i, bad) in [
        "/.sandpool/run",
        "/.sandpool",
        "/.sandpool/run/",
        "/proc/self",
        "/sys/fs",
        "/dev/shm",
        "/etc",
        "/etc/hosts",
        "/work/../.sandpool/run",
        "work",
    ]
    .iter()
    .enumerate()
    {
        let body = json!({"name": format!("wd{i}"), "image": img, "workdir": bad});
        let a = c.call(Method::POST, "/v1/templates", Some(body.clone())).await;
        refused_on(&a, 400, "workdir");
        // Admins too: no opt-in reaches a platform path.
        let mut admin_body = body.clone();
        admin_body["beyond_base"] = json!(true);
        let a = stack.admin_client().call(Method::POST, "/v1/templates", Some(admin_body)).await;
        refused_on(&a, 400, "workdir");
    }

    // A workdir of its own is the tenant's; the socket directory stays sealed to it.
    let body = json!({"name": "own", "image": img, "workdir": "/home/task"});
    assert_eq!(c.call(Method::POST, "/v1/templates", Some(body)).await.status, 201);
    let s = open(&c, "acme/own").await;
    let sid = s["session_id"].as_str().unwrap();
    let out = c.sh(sid, "pwd; stat -c %u .; stat -c '%u %a' /.sandpool/run; touch /.sandpool/run/x; echo $?").await;
    let lines: Vec<&str> = out["stdout"].as_str().unwrap().lines().collect();
    assert_eq!(lines[..3], ["/home/task", "1000", "4294967294 500"], "{out:?}");
    assert_ne!(lines[3], "0", "the tenant cannot write the socket directory: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_template_keeps_its_bases_network_and_asks_at_most_its_limits() {
    let corpus = Corpus::build(1, 16);
    let img = &corpus.images[0].image;
    // The base (`bb`): no network, 0.5 cpus, 128 MiB, 1024 pids, a bounded disk.
    let stack = Stack::start(StackOpts { warm: 0, cpus: 0.5, ..Default::default() }).await;
    assert!(stack.config.templates["bb"].disk_mb > 512, "a bounded disk");
    let c = stack.client("acme");
    let admin = stack.admin_client();
    let post = |c: &tests::Client, body: Value| {
        let c = c.clone();
        async move { c.call(Method::POST, "/v1/templates", Some(body)).await }
    };
    for (field, value) in [
        ("network", json!("bridge")),
        ("cpus", json!(64)),
        ("cpus", json!(0.75)),
        ("memory_mb", json!(1_048_576)),
        ("memory_mb", json!(129)),
        ("pids", json!(1_048_576)),
        ("disk_mb", json!(0)),
        ("disk_mb", json!(1_000_000)),
    ] {
        let mut body = json!({"image": img});
        body[field] = value.clone();
        refused_on(&post(&c, body.clone()).await, 400, field);
        // An admin is held to the same envelope unless it opts out, which a tenant may not.
        refused_on(&post(&admin, body.clone()).await, 400, field);
        body["beyond_base"] = json!(true);
        refused_on(&post(&c, body).await, 403, "beyond_base");
    }
    let msg = post(&c, json!({"image": img, "cpus": 2})).await.body["message"].as_str().unwrap_or_default().to_string();
    assert!(msg.contains("at most 0.5") && msg.contains("\"bb\""), "names the ceiling and the base: {msg}");

    // Tenants start from the bases the operator offers (`images.bases`: here `bb` only).
    refused_on(&post(&c, json!({"image": img, "base": "bbd"})).await, 400, "base");
    assert_eq!(post(&admin, json!({"name": "on-bbd", "image": img, "base": "bbd"})).await.status, 201);

    // At the ceilings is fine.
    let base = &stack.config.templates["bb"];
    let at = json!({"name": "at", "image": img, "cpus": base.cpus, "memory_mb": base.memory_mb, "pids": base.pids,
                    "disk_mb": base.disk_mb, "network": "none", "workdir": "/work"});
    assert_eq!(post(&c, at).await.status, 201);

    // Asking for less is fine, and the sandbox gets what was asked.
    // A CFS period shorter than the base's is refused; a longer one is fine.
    let short = json!({"name": "short", "image": img, "cpu_period_ms": base.cpu_period.as_millis() as u64 - 1});
    let t = post(&c, short).await;
    assert_eq!(t.status, 400, "{:?}", t.body);
    assert!(t.body.to_string().contains("cpu_period_ms"), "{:?}", t.body);
    let less = json!({"name": "small", "image": img, "cpus": 0.25, "memory_mb": 64, "pids": 100, "disk_mb": 512,
                      "cpu_period_ms": 20});
    let t = post(&c, less).await;
    assert_eq!(t.status, 201, "{:?}", t.body);
    assert_eq!((t.body["network"].as_str(), t.body["cpus"].as_f64()), (Some("none"), Some(0.25)));
    assert_eq!(t.body["cpu_period_ms"], 20, "{:?}", t.body);
    let s = open(&c, "acme/small").await;
    let hc = &container_inspect(s["sandbox_id"].as_str().unwrap())["HostConfig"];
    assert_eq!((hc["CpuQuota"].as_i64(), hc["CpuPeriod"].as_i64()), (Some(5_000), Some(20_000)), "{hc}");
    assert_eq!(hc["Memory"].as_i64(), Some(64 << 20), "{hc}");
    assert_eq!((hc["PidsLimit"].as_i64(), hc["NetworkMode"].as_str()), (Some(100), Some("none")), "{hc}");

    // An admin who opts out gets what it asks.
    let wide = json!({"name": "wide", "image": img, "cpus": 1.0, "network": "bridge", "beyond_base": true});
    let t = post(&admin, wide).await;
    assert_eq!((t.status, t.body["network"].as_str(), t.body["cpus"].as_f64()), (201, Some("bridge"), Some(1.0)));
    // Its sandboxes get the bridge, though no configured template uses it (and its host rule).
    let s = open(&c, "public/wide").await;
    let hc = &container_inspect(s["sandbox_id"].as_str().unwrap())["HostConfig"];
    assert_eq!(hc["NetworkMode"], "sandpool-bridge", "{hc}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_template_past_its_envelope_runs_inside_it() {
    // A record an older build accepted (or one written by hand): the node runs it inside its
    // base's envelope all the same.
    let corpus = Corpus::build(1, 16);
    let stack = Stack::start(StackOpts { warm: 0, cpus: 0.5, ..Default::default() }).await;
    let c = stack.client("acme");
    let made =
        c.call(Method::POST, "/v1/templates", Some(json!({"name": "old", "image": corpus.images[0].image}))).await;
    assert_eq!(made.status, 201, "{:?}", made.body);
    let mut t = stack.node.ledger.image_template("acme/old").await.unwrap().expect("stored");
    stack.node.ledger.delete_image_template("acme/old").await.unwrap();
    t.network = wire::Network::Bridge;
    (t.cpus, t.memory_mb, t.pids, t.disk_mb) = (2.0, 1 << 20, 1 << 20, 0);
    t.workdir = "/.sandpool/run".into();
    t.cpu_period_ms = 1;
    assert!(stack.node.ledger.put_image_template(&t).await.unwrap());

    let s = open(&c, "acme/old").await;
    let sid = s["sandbox_id"].as_str().unwrap();
    let hc = &container_inspect(sid)["HostConfig"];
    // 0.5 CPU in the base's (default) period.
    let period = config::DEFAULT_CPU_PERIOD.as_micros() as i64;
    assert_eq!((hc["CpuQuota"].as_i64(), hc["CpuPeriod"].as_i64()), (Some(period / 2), Some(period)), "{hc}");
    assert_eq!(hc["Memory"].as_i64(), Some(128 << 20), "{hc}");
    assert_eq!((hc["PidsLimit"].as_i64(), hc["NetworkMode"].as_str()), (Some(1024), Some("none")), "{hc}");
    let out = c.sh(s["session_id"].as_str().unwrap(), "pwd; stat -c '%u %a' /.sandpool/run").await;
    assert_eq!(out["stdout"], "/work\n4294967294 500\n", "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_images_volumes_healthcheck_and_user_reach_no_further_than_its_template() {
    let built = Built::new(
        "hostile",
        "USER 1234\nVOLUME /data\nHEALTHCHECK --interval=1s CMD touch /tmp/healthcheck-ran\nEXPOSE 8080",
    );
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    let c = stack.client("acme");
    let made = c.call(Method::POST, "/v1/templates", Some(json!({"name": "hostile", "image": built.image}))).await;
    assert_eq!(made.status, 201, "{:?}", made.body);
    let s = open(&c, "acme/hostile").await;
    let sid = s["session_id"].as_str().unwrap();
    let inspect = container_inspect(s["sandbox_id"].as_str().unwrap());

    // No anonymous volume (outside every disk bound): a tmpfs, bounded and charged to memory.
    assert!(inspect["Mounts"].as_array().unwrap().iter().all(|m| m["Type"] != "volume"), "{}", inspect["Mounts"]);
    let tmpfs = inspect["HostConfig"]["Tmpfs"]["/data"].as_str().unwrap_or_default();
    assert!(tmpfs.contains("size="), "{}", inspect["HostConfig"]);
    let out = c.sh(sid, "id -u; df -k /data | tail -1; head -c 2000000 /dev/zero > /data/x && echo written").await;
    let lines: Vec<&str> = out["stdout"].as_str().unwrap().lines().collect();
    assert_eq!(lines[0], "1000", "tenant code runs as the template's user, not the image's: {out:?}");
    assert!(lines[1].starts_with("tmpfs"), "{out:?}");
    assert_eq!(lines[2], "written", "the tenant may use it: {out:?}");

    // The image's healthcheck never runs; PID 1 (the agent) is root whatever USER says.
    assert_eq!(inspect["Config"]["Healthcheck"]["Test"], json!(["NONE"]), "{}", inspect["Config"]);
    assert_eq!(inspect["Config"]["User"], "0:0");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let out = c.sh(sid, "ls /tmp/healthcheck-ran 2>&1; stat -c %u /proc/1").await;
    assert!(out["stdout"].as_str().unwrap().contains("No such file"), "{out:?}");
    assert!(out["stdout"].as_str().unwrap().ends_with("\n0\n"), "{out:?}");
    assert!(inspect["HostConfig"]["PortBindings"].as_object().is_none_or(|p| p.is_empty()), "no port is published");
}

/// Issue 34: sandboxes share containerd shims in groups the node names (`[docker]
/// shim_group`); neither a tenant's image (`ENV`) nor its template (`env`) picks the group,
/// and where the node groups nothing, neither does the tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_choose_the_containerd_shim_its_sandboxes_share() {
    const PICKED: &str = "tenant-picked";
    let variable = "SANDPOOL_SHIM_GROUP";
    let built = Built::new("shimgroup", &format!("ENV {variable}={PICKED}"));
    for shim_group in [1, 32] {
        let extra_toml = format!("[docker]\nshim_group = {shim_group}\n");
        let stack = Stack::start(StackOpts { warm: 0, extra_toml, ..Default::default() }).await;
        let c = stack.client("acme");
        for body in [
            json!({"name": "img", "image": built.image}),
            json!({"name": "env", "image": built.image, "env": {"SANDPOOL_SHIM_GROUP": PICKED}}),
        ] {
            let made = c.call(Method::POST, "/v1/templates", Some(body)).await;
            assert_eq!(made.status, 201, "{:?}", made.body);
        }
        let mut shims = vec![];
        for template in ["acme/img", "acme/env"] {
            let s = open(&c, template).await;
            let sandbox = s["sandbox_id"].as_str().unwrap();
            let env = container_inspect(sandbox)["Config"]["Env"].clone();
            let prefix = format!("{variable}=");
            let named: Vec<&str> =
                env.as_array().unwrap().iter().filter_map(|e| e.as_str()?.strip_prefix(&prefix)).collect();
            match shim_group {
                1 => assert_eq!(named, [""], "{template}: the node names no group: {env}"),
                _ => assert!(named.len() == 1 && !named[0].is_empty() && named[0] != PICKED, "{template}: {env}"),
            }
            let (shim, name) = shim_of(sandbox);
            assert_eq!(name, "containerd-shim", "{template}: its init's parent is {shim} ({name})");
            shims.push(shim);
            let out = c.sh(s["session_id"].as_str().unwrap(), "env").await;
            assert!(!out["stdout"].as_str().unwrap().contains(variable), "{template}: {out:?}");
        }
        // Made one after the other, the two share the node's group, or have a shim each.
        match shim_group {
            1 => assert_ne!(shims[0], shims[1], "the image's ENV grouped them"),
            _ => assert_eq!(shims[0], shims[1], "one node group for both"),
        }
        // A sandbox the node does not group, of an image that names none, has no such variable
        // (a docker-exec template has no agent to keep it from commands).
        let s = c.create("bbd").await;
        let env = container_inspect(s["sandbox_id"].as_str().unwrap())["Config"]["Env"].to_string();
        assert!(!env.contains(variable), "{env}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_socket_directory_is_the_nodes_and_a_planted_socket_is_never_dialled() {
    // Root tenant code (an operator's choice) has no capability to override file permissions:
    // the sealed directory is closed to it too.
    let root = "[templates.rootbb]\nimage = \"sandpool/busybox:latest\"\nexec = \"agent\"\nuser = \"root\"\nworkdir = \"/work\"\n";
    let mut stack = Stack::start(StackOpts { warm: 0, extra_toml: root.into(), ..Default::default() }).await;
    let c = stack.client("acme");
    let s = c.create("rootbb").await;
    let (sid, sandbox) = (s["session_id"].as_str().unwrap(), s["sandbox_id"].as_str().unwrap());
    let cmd = "id -u; for op in 'rm /.sandpool/run/agent.sock' 'touch /.sandpool/run/x' 'chmod 700 /.sandpool/run' \
               'mv /.sandpool/run/agent.sock /tmp/'; do sh -c \"$op\" 2>/dev/null && echo \"$op: allowed\"; done; echo end";
    let out = c.sh(sid, cmd).await;
    assert_eq!(out["stdout"], "0\nend\n", "{out:?}");

    // Should the socket be replaced anyway (here by the host, as a sandbox no longer can), a
    // restarted node does not dial what it did not seal: the sandbox fails and its session
    // ends, and the planted listener never hears from the node.
    let dir = std::path::Path::new(tests::TEST_STATE_DIR).join("run").join(sandbox);
    std::fs::remove_file(dir.join("agent.sock")).expect("remove the agent's socket");
    let planted = std::os::unix::net::UnixListener::bind(dir.join("agent.sock")).expect("plant a socket");
    planted.set_nonblocking(true).expect("nonblocking");
    stack.restart_pool_manager().await;
    assert!(stack.node.sandbox(sandbox).is_none(), "not taken back");
    let last = std::sync::Mutex::new(None);
    let ended = eventually(Duration::from_secs(20), || async {
        let a = c.exec(sid, json!({"cmd": "true"})).await;
        *last.lock().unwrap() = Some((a.status, a.body.clone()));
        (a.status == 502 && a.body["message"].as_str().is_some_and(|m| m.contains("ended"))).then_some(a.body)
    })
    .await;
    // The session ended with its sandbox (as any sandbox that fails does).
    let code = ended.as_ref().map(|b| (b["code"].clone(), b["message"].as_str().is_some_and(|m| m.contains("ended"))));
    assert_eq!(code, Some((json!("sandbox_failed"), true)), "{:?}", last.lock().unwrap());
    assert!(planted.accept().is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock), "the node dialled it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_names_only_its_own_registry_paths_and_others_look_absent() {
    // Two tenants' images in one shared registry, and a corpus shared with one team by scope.
    let (mine, shared) = (Corpus::build(1, 16), Corpus::build(1, 16));
    let (a, b) = (mine.prefix.clone(), format!("other-{}", tests::rand_hex(6)));
    let registry = tests::corpus::registry();
    let toml = format!(
        "[images]\nallowed_registries = [\"{registry}/{{tenant}}/*\"]\n\
         [images.scopes.\"lab\"]\nallowed = [\"{registry}/{}/*\"]\n",
        shared.prefix
    );
    let stack = Stack::start(StackOpts { warm: 0, extra_toml: toml, ..Default::default() }).await;
    let make = |tenant: &str, image: &str| {
        let c = stack.client(tenant);
        let image = image.to_string();
        async move { c.call(Method::POST, "/v1/templates", Some(json!({"image": image}))).await }
    };
    let own = make(&format!("{a}/rl"), &mine.images[0].image).await;
    assert_eq!(own.status, 201, "a tenant names its own path: {:?}", own.body);

    // Another tenant asking for it hears exactly what it hears of an image nobody has.
    let theirs = make(&b, &mine.images[0].image).await;
    let absent_ref = format!("{registry}/{b}/nothing-here:latest");
    let absent = make(&b, &absent_ref).await;
    for x in [&theirs, &absent] {
        assert_eq!((x.status, x.body["code"].as_str()), (400, Some("image_not_found")), "{:?}", x.body);
    }
    let text = |x: &tests::Answer, reference: &str| x.body["message"].as_str().unwrap().replace(reference, "REF");
    assert_eq!(text(&theirs, &mine.images[0].image), text(&absent, &absent_ref));
    // Nor another registry, nor another tenant's path by digest.
    assert_eq!(make(&b, "127.0.0.2:5000/x/y:latest").await.status, 400);
    assert_eq!(make(&b, &mine.images[0].reference).await.body["code"], "image_not_found");

    // A scope grants a team the shared corpus; others still cannot name it; admins name any.
    assert_eq!(make("lab/rl", &shared.images[0].image).await.status, 201);
    assert_eq!(make(&b, &shared.images[0].image).await.body["code"], "image_not_found");
    let admin = stack.admin_client();
    let made = admin.call(Method::POST, "/v1/templates", Some(json!({"image": shared.images[0].image}))).await;
    assert_eq!(made.status, 201, "{:?}", made.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scopes_credentials_resolve_and_pull_its_tenants_images_and_no_one_elses() {
    let tenant = format!("cred-{}", tests::rand_hex(6));
    let registry = tests::corpus::AuthRegistry::start(&tenant, 1);
    let img = &registry.images[0];
    // The tenant's scope holds the registry's password; `peer`'s scope may name the same
    // repositories but has no password of its own, nor has the deployment.
    let toml = format!(
        "[images]\n[images.scopes.\"{tenant}\"]\nallowed = [\"{host}/{tenant}/*\"]\n\
         [images.scopes.\"{tenant}\".registries.\"{host}\"]\nusername = \"{user}\"\npassword = \"{password}\"\n\
         [images.scopes.\"peer\"]\nallowed = [\"{host}/{tenant}/*\"]\n",
        host = registry.host,
        user = registry.user,
        password = registry.password,
    );
    let stack = Stack::start(StackOpts { warm: 0, extra_toml: toml, ..Default::default() }).await;
    let c = stack.client(&format!("{tenant}/rl"));
    let made = c.call(Method::POST, "/v1/templates", Some(json!({"name": "task", "image": img.image}))).await;
    assert_eq!(made.status, 201, "resolved with the scope's credentials: {:?}", made.body);
    let s = open(&c, &format!("{tenant}/rl/task")).await;
    let out = c.sh(s["session_id"].as_str().unwrap(), "cat /task/id").await;
    assert_eq!(out["stdout"], format!("{}\n", img.image), "pulled with the scope's credentials");

    let peer = stack.client("peer");
    let refused = peer.call(Method::POST, "/v1/templates", Some(json!({"image": img.image}))).await;
    assert_eq!((refused.status, refused.body["code"].as_str()), (400, Some("image_not_found")), "{:?}", refused.body);
}

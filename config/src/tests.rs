//! The config's tests: loading, validation per section, and the checks across sections.

use wire::{ExecMode, Network};

use super::*;

const MIN: &str = r#"
[pool_manager]
secret = "0123456789abcdef"
[auth]
key = "0123456789abcdef"
[templates.busybox]
image = "sandpool/busybox:latest"
"#;

#[test]
fn minimal_config_gets_defaults() {
    let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
    assert_eq!(c.node.id, None, "derived at start from the host");
    assert_eq!(c.node.down_after, DEFAULT_NODE_DOWN_AFTER);
    assert_eq!(c.gateway.placement_choices, 2);
    assert_eq!(c.gateway.listen.to_string(), DEFAULT_GATEWAY_LISTEN);
    assert_eq!(c.templates["busybox"].network, Network::None);
    assert_eq!(c.templates["busybox"].exec, ExecMode::Agent);
}

fn env(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[test]
fn any_key_is_settable_from_the_environment_and_flags_win() {
    let vars = env(&[
        ("SANDPOOL__TELEMETRY__METRICS_LISTEN", "127.0.0.1:9465"),
        ("SANDPOOL__POOL_MANAGER__LISTEN", "127.0.0.1:8091"),
        ("SANDPOOL__POOL_MANAGER__STATE_DIR", "/var/lib/sandpool-2"),
        ("SANDPOOL__NODE__ID", "second"),
        ("SANDPOOL__NODE__DOWN_AFTER", "20s"),
        ("SANDPOOL__GATEWAY__MAX_QUEUE", "100"),
        ("SANDPOOL__QUOTAS__DEFAULT__SESSIONS", "7"),
        ("SANDPOOL__TEMPLATES__BUSYBOX__WARM", "9"),
        ("SANDPOOL__TEMPLATES__EXTRA__IMAGE", "sandpool/bash:latest"),
        ("SANDPOOL__LOG__FORMAT", "json"),
        ("SANDPOOL__REDIS__PREFIX", "from-env"),
    ]);
    let flags = Overrides { redis_prefix: Some("from-flag".into()), ..Overrides::default() };
    let c = Config::from_toml_with_env(MIN, &flags, vars).unwrap();
    assert_eq!(c.telemetry.metrics_listen.map(|a| a.to_string()).as_deref(), Some("127.0.0.1:9465"));
    assert_eq!(c.pool_manager.listen.to_string(), "127.0.0.1:8091");
    assert_eq!(c.pool_manager.advertise, "http://127.0.0.1:8091", "the advertised address follows");
    assert_eq!(c.pool_manager.state_dir, PathBuf::from("/var/lib/sandpool-2"));
    assert_eq!(c.node.id.as_deref(), Some("second"));
    assert_eq!(c.node.down_after, Duration::from_secs(20));
    assert_eq!(c.gateway.max_queue, 100);
    assert_eq!(c.quotas.default.sessions, Some(7));
    assert_eq!(c.templates["busybox"].warm, 9);
    assert_eq!(c.templates["extra"].image, "sandpool/bash:latest", "a whole new template");
    assert_eq!(c.log.format, LogFormat::Json);
    assert_eq!(c.redis.prefix, "from-flag", "a flag (or SANDPOOL_REDIS_PREFIX) wins over the layer");
    // Without the variables, the file as it is.
    let plain = Config::from_toml_with_env(MIN, &Overrides::default(), env(&[])).unwrap();
    assert_eq!(plain.log.format, LogFormat::Text);
    assert_eq!(plain.pool_manager.listen.to_string(), DEFAULT_POOL_MANAGER_LISTEN);
}

#[test]
fn a_bad_value_from_the_environment_names_its_field_and_variable() {
    let bad = |k: &str, v: &str| {
        Config::from_toml_with_env(MIN, &Overrides::default(), env(&[(k, v)])).unwrap_err().to_string()
    };
    let e = bad("SANDPOOL__GATEWAY__MAX_QUEUE", "many");
    assert!(e.contains("max_queue") && e.contains("SANDPOOL__GATEWAY__MAX_QUEUE"), "{e}");
    let e = bad("SANDPOOL__GATEWAY__NO_SUCH_KEY", "1");
    assert!(e.contains("no_such_key") && e.contains("SANDPOOL__GATEWAY__NO_SUCH_KEY"), "{e}");
    let e = bad("SANDPOOL__TELEMETRY__METRICS_LISTEN", "nowhere");
    assert!(e.contains("telemetry.metrics_listen"), "{e}");
    let e = bad("SANDPOOL__LOG__FORMAT", "xml");
    assert!(e.contains("log.format"), "{e}");
}

#[test]
fn a_jwks_is_a_file_or_an_http_url() {
    let with = |v: &str| Config::from_toml_with_env(MIN, &Overrides::default(), env(&[("SANDPOOL__AUTH__JWKS", v)]));
    let c = with("https://idp.example/.well-known/jwks.json").unwrap();
    assert_eq!(c.auth.jwks, Some(JwksSource::Url("https://idp.example/.well-known/jwks.json".into())));
    assert_eq!(c.auth.jwks_refresh, DEFAULT_JWKS_REFRESH);
    assert_eq!(
        with("/etc/sandpool/jwks.json").unwrap().auth.jwks,
        Some(JwksSource::File("/etc/sandpool/jwks.json".into()))
    );
    assert!(with("ftp://idp.example/jwks").unwrap_err().to_string().contains("auth.jwks"));
    assert_eq!(Config::from_toml(MIN, &Overrides::default()).unwrap().auth.jwks, None);
}

#[test]
fn redacted_config_shows_no_secret() {
    let text = format!(
        "{MIN}\n[images.registries.\"r.example\"]\nusername = \"u\"\npassword = \"registry-pass-1\"\n\
         [images.scopes.acme.registries.\"s.example\"]\nusername = \"u\"\npassword = \"scope-pass-2\"\n"
    );
    let c = Config::from_toml(&text, &Overrides::default()).unwrap();
    let shown = format!("{:#?}", c.redacted());
    for secret in ["0123456789abcdef", "registry-pass-1", "scope-pass-2"] {
        assert!(!shown.contains(secret), "{secret} shows in {shown}");
    }
    assert!(shown.contains(HIDDEN) && shown.contains("busybox") && shown.contains("max_queue"), "{shown}");
    assert_eq!(c.pool_manager.secret, "0123456789abcdef", "the config itself keeps its secret");
}

#[test]
fn named_egress_is_checked_against_the_policies() {
    let cfg = |tpl: &str| {
        let text = format!(
            "{MIN}\n[egress.policies.mirror]\nallow = [\"deb.debian.org:80\", \"10.0.0.0/8\"]\n[egress.hosts]\n\"task.test\" = \"127.0.0.2\"\n[templates.e]\nimage = \"x\"\n{tpl}\n"
        );
        Config::from_toml(&text, &Overrides::default()).map_err(|e| e.to_string())
    };
    let c = cfg("egress = \"mirror\"").unwrap();
    let e = c.templates["e"].egress.clone().unwrap();
    assert_eq!((c.templates["e"].network, e.initial.as_str()), (Network::Egress, "mirror"));
    assert_eq!(e.allowed, ["mirror", "deny-all"], "deny-all is always there to switch to");
    // A policy the admin API will define may be named ahead.
    let later = cfg("egress = \"mirror\"\negress_allowed = [\"mirror\", \"by-api\"]").unwrap();
    assert_eq!(later.templates["e"].egress.clone().unwrap().allowed, ["mirror", "by-api"]);
    assert_eq!(c.egress.hosts["task.test"].to_string(), "127.0.0.2");
    assert!(c.egress.policy("deny-all").unwrap().rules.is_empty());
    for (tpl, field) in [
        ("egress = \"nope\"", "templates.e.egress"),
        ("network = \"egress\"", "templates.e.egress"),
        ("network = \"bridge\"\negress = \"mirror\"", "templates.e.network"),
        ("egress = \"mirror\"\negress_allowed = [\"deny-all\"]", "templates.e.egress_allowed"),
        ("egress_allowed = [\"mirror\"]", "templates.e.egress_allowed"),
        ("egress = \"mirror\"\negress_allowed = [\"mirror\", \"Bad Name\"]", "templates.e.egress_allowed"),
    ] {
        let e = cfg(tpl).unwrap_err();
        assert!(e.contains(field), "{tpl}: {e}");
    }
    let bad = format!("{MIN}\n[egress.policies.p]\nallow = [\"10.0.0.0/40\"]\n");
    let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
    assert!(e.contains("egress.policies.p.allow"), "{e}");
    let bad = format!("{MIN}\n[egress.policies.deny-all]\nallow = []\n");
    assert!(Config::from_toml(&bad, &Overrides::default()).is_err(), "deny-all is built in");
}

#[test]
fn the_create_window_and_destroys_default_and_are_checked() {
    let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
    let pm = &c.pool_manager;
    assert!(pm.adaptive_create_window);
    assert_eq!(pm.destroys_beside_creates, DEFAULT_DESTROYS_BESIDE_CREATES);
    let set = |line: &str| MIN.replace("[pool_manager]", &format!("[pool_manager]\n{line}"));
    let c =
        Config::from_toml(&set("adaptive_create_window = false\ndestroys_beside_creates = 8"), &Overrides::default())
            .unwrap();
    assert!(!c.pool_manager.adaptive_create_window);
    assert_eq!(c.pool_manager.destroys_beside_creates, 8);
    for bad in ["destroys_beside_creates = 0", "destroys_beside_creates = 9"] {
        let e = Config::from_toml(&set(bad), &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("pool_manager.destroys_beside_creates"), "{bad}: {e}");
    }
}

#[test]
fn sandboxes_share_shims_by_default_and_the_group_size_is_checked() {
    assert_eq!(Config::from_toml(MIN, &Overrides::default()).unwrap().docker.shim_group, DEFAULT_SHIM_GROUP);
    let set = |n: usize| format!("{MIN}\n[docker]\nshim_group = {n}\n");
    assert_eq!(Config::from_toml(&set(1), &Overrides::default()).unwrap().docker.shim_group, 1);
    for bad in [0, MAX_SHIM_GROUP + 1] {
        let e = Config::from_toml(&set(bad), &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("docker.shim_group"), "{bad}: {e}");
    }
}

#[test]
fn overrides_win() {
    let o = Overrides { redis_url: Some("redis://10.0.0.1:7000".into()), ..Default::default() };
    let c = Config::from_toml(MIN, &o).unwrap();
    assert_eq!(c.redis.url, "redis://10.0.0.1:7000");
}

#[test]
fn redis_url_is_one_redis_or_a_clusters_seeds() {
    let with = |url: &str| Overrides { redis_url: Some(url.into()), ..Default::default() };
    for good in ["redis://127.0.0.1:7001,redis://127.0.0.1:7002", "redis://a:7001, redis://b:7002", "redis://a:7001,"] {
        assert!(Config::from_toml(MIN, &with(good)).is_ok(), "{good}");
    }
    for bad in ["redis://a:7001,unix:///tmp/r.sock", "redis://a:7001,b:7002", ",", "http://a"] {
        let e = Config::from_toml(MIN, &with(bad)).unwrap_err().to_string();
        assert!(e.contains("redis.url"), "{bad}: {e}");
    }
}

#[test]
fn the_cpu_period_defaults_short_is_checked_and_held_to_the_envelope() {
    let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
    let base = &c.templates["busybox"];
    assert_eq!(base.cpu_period, DEFAULT_CPU_PERIOD);
    assert_eq!(base.info().cpu_period_ms, 5);
    let set = |v: &str| MIN.replace("[templates.busybox]", &format!("[templates.busybox]\ncpu_period = \"{v}\""));
    assert_eq!(
        Config::from_toml(&set("25ms"), &Overrides::default()).unwrap().templates["busybox"].cpu_period,
        Duration::from_millis(25)
    );
    for bad in ["0ms", "1500us", "2s"] {
        let e = Config::from_toml(&set(bad), &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("templates.busybox.cpu_period"), "{bad}: {e}");
    }

    // Quota = cpus x period, the period lengthened where the quota would be under 1 ms.
    let with = |cpus: f64, ms: u64| Template { cpus, cpu_period: Duration::from_millis(ms), ..base.clone() };
    assert_eq!(with(0.5, 10).cfs_period_and_quota_us(), (10_000, 5_000));
    assert_eq!(with(2.0, 100).cfs_period_and_quota_us(), (100_000, 200_000));
    assert_eq!(with(0.05, 10).cfs_period_and_quota_us(), (20_000, 1_000));
    assert_eq!(with(0.0001, 10).cfs_period_and_quota_us(), (1_000_000, 1_000));

    // A tenant may ask for a longer period than the base's, not a shorter one.
    let req = |ms: u64| wire::images::CreateTemplate { cpu_period_ms: Some(ms), ..Default::default() };
    assert_eq!(envelope::grant(base, &req(50), false).unwrap().cpu_period, Duration::from_millis(50));
    assert_eq!(envelope::grant(base, &req(3), false).unwrap_err().field, "cpu_period_ms");
    assert_eq!(envelope::grant(base, &req(3), true).unwrap().cpu_period, Duration::from_millis(3));
    assert_eq!(envelope::grant(base, &req(0), true).unwrap_err().field, "cpu_period");
    let inherited = envelope::grant(base, &wire::images::CreateTemplate::default(), false).unwrap();
    assert_eq!(inherited.cpu_period, base.cpu_period);
}

#[test]
fn errors_name_the_field() {
    let bad = MIN.replace("[templates.busybox]", "[templates.busybox]\ncpus = -1");
    let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
    assert!(e.contains("templates.busybox.cpus"), "{e}");
    let bad = format!("{MIN}\n[gateway]\nlisten = \"nope\"\n");
    let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
    assert!(e.contains("gateway.listen"), "{e}");
    let bad = format!("{MIN}\n[gateway]\nlisten_typo = 1\n");
    let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
    assert!(e.contains("listen_typo"), "{e}");
}

#[test]
fn template_ports_are_sorted_and_checked() {
    let ok = MIN.replace("[templates.busybox]", "[templates.busybox]\nports = [8080, 80]");
    let c = Config::from_toml(&ok, &Overrides::default()).unwrap();
    assert_eq!(c.templates["busybox"].ports, [80, 8080]);
    assert_eq!(c.templates["busybox"].info().ports, [80, 8080]);
    for (ports, why) in [("[80, 80]", "listed twice"), ("[0]", "port 0"), ("[70000]", "70000")] {
        let bad = MIN.replace("[templates.busybox]", &format!("[templates.busybox]\nports = {ports}"));
        let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains(why) && e.contains("ports"), "{ports}: {e}");
    }
    let many: Vec<String> = (1..=33).map(|p| p.to_string()).collect();
    let bad = MIN.replace("[templates.busybox]", &format!("[templates.busybox]\nports = [{}]", many.join(",")));
    let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
    assert!(e.contains("templates.busybox.ports") && e.contains("at most 32"), "{e}");
    let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
    assert!(c.templates["busybox"].ports.is_empty(), "no port is exposed unless listed");
    assert_eq!(c.pool_manager.max_port_connections, DEFAULT_MAX_PORT_CONNECTIONS);
    let bad = MIN.replace("[pool_manager]", "[pool_manager]\nmax_port_connections = 0");
    let e = Config::from_toml(&bad, &Overrides::default()).unwrap_err().to_string();
    assert!(e.contains("pool_manager.max_port_connections"), "{e}");
}

#[test]
fn the_shipped_dev_secrets_stay_on_loopback() {
    let text = include_str!("../sandpool.toml");
    let public = Overrides { gateway_listen: Some("0.0.0.0:8080".into()), ..Default::default() };
    let e = Config::from_toml(text, &public).unwrap_err().to_string();
    assert!(e.contains("auth.key") && e.contains("0.0.0.0:8080") && e.contains("SANDPOOL_JWT_KEY"), "{e}");
    let fresh_key = Overrides { jwt_key: Some("a-fresh-key-0123456789".into()), ..public.clone() };
    let e = Config::from_toml(text, &fresh_key).unwrap_err().to_string();
    assert!(e.contains("pool_manager.secret") && e.contains("SANDPOOL_INTERNAL_SECRET"), "{e}");
    let both = Overrides { internal_secret: Some("a-fresh-secret-0123456789".into()), ..fresh_key };
    Config::from_toml(text, &both).unwrap();
    // The shipped values match the constants the check compares with.
    assert!(text.contains(DEV_JWT_KEY) && text.contains(DEV_INTERNAL_SECRET));
}

#[test]
fn images_default_and_validate() {
    let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
    assert_eq!(c.images.base, "busybox");
    assert_eq!((c.images.max_pulls_in_flight, c.images.disk_budget_mb), (4, 20 << 10));
    assert_eq!(c.images.pull_timeout, DEFAULT_PULL_TIMEOUT);
    let with = |extra: &str| Config::from_toml(&format!("{MIN}\n[images]\n{extra}\n"), &Overrides::default());
    let e = with("base = \"nope\"").unwrap_err().to_string();
    assert!(e.contains("images.base") && e.contains("nope"), "{e}");
    assert_eq!(c.images.bases, ["busybox"], "only the default base unless the operator names more");
    let e = with("bases = [\"busybox\", \"nope\"]").unwrap_err().to_string();
    assert!(e.contains("images.bases") && e.contains("nope"), "{e}");
    assert!(with("max_pulls_in_flight = 0").unwrap_err().to_string().contains("images.max_pulls_in_flight"));
    assert!(with("pull_timeout = \"0s\"").unwrap_err().to_string().contains("images.pull_timeout"));
    let c = with("disk_budget_mb = 0\n[images.registries.\"reg.example:5000\"]\nusername = \"u\"\npassword = \"p\"")
        .unwrap();
    assert_eq!(c.images.disk_budget_mb, 0);
    assert_eq!(c.images.auth_for("reg.example:5000/a/b:1", None).map(|a| a.username.as_str()), Some("u"));
    assert!(c.images.auth_for("other.example/a/b:1", None).is_none());
    assert!(c.images.allowed_registries.is_empty());
    assert!(c.images.may_name("anyone", "other.example/a/b:1"), "no entry at all: any");
    let e = with("allowed_registries = [\"a/b\"]").unwrap_err().to_string();
    assert!(e.contains("images.allowed_registries") && e.contains("/*"), "{e}");
}

#[test]
fn lazy_images_are_mounted_from_loopback_registries_unless_the_operator_names_others() {
    let with = |extra: &str| Config::from_toml(&format!("{MIN}\n[images]\n{extra}\n"), &Overrides::default());
    let c = with("").unwrap().images;
    for trusted in ["127.0.0.1:5000/lazy/a:1", "127.0.0.2:5001/b@sha256:00", "localhost:5000/c:1", "[::1]:5000/d:1"] {
        assert!(c.lazy_trusted(trusted), "{trusted}");
    }
    for other in ["registry.example:5000/a:1", "docker.io/library/busybox:1", "10.0.0.1:5000/a:1", "localhost.evil/a:1"]
    {
        assert!(!c.lazy_trusted(other), "{other}");
    }
    let c = with("lazy_registries = [\"reg.example:5000/lazy/*\"]").unwrap().images;
    assert!(c.lazy_trusted("reg.example:5000/lazy/task:1"));
    assert!(!c.lazy_trusted("reg.example:5000/other/task:1") && !c.lazy_trusted("127.0.0.1:5000/lazy/task:1"));
    assert!(!with("lazy_registries = []").unwrap().images.lazy_trusted("127.0.0.1:5000/a:1"), "none at all");
    for bad in ["lazy_registries = [\"reg:5000/{tenant}/*\"]", "lazy_registries = [\"a/b\"]"] {
        let e = with(bad).unwrap_err().to_string();
        assert!(e.contains("images.lazy_registries"), "{bad}: {e}");
    }
}

#[test]
fn registry_scopes_choose_entries_and_credentials_per_principal() {
    let toml = format!(
        "{MIN}\n[images]\nallowed_registries = [\"reg:5000/{{tenant}}/*\"]\n\
         [images.registries.\"reg:5000\"]\nusername = \"ops\"\npassword = \"p\"\n\
         [images.scopes.\"acme\"]\nallowed = [\"reg:5000/shared/*\"]\n\
         [images.scopes.\"acme\".registries.\"reg:5000\"]\nusername = \"acme\"\npassword = \"p\"\n\
         [images.scopes.\"acme/rl\".registries.\"reg:5000\"]\nusername = \"acme-rl\"\npassword = \"p\"\n"
    );
    let c = Config::from_toml(&toml, &Overrides::default()).unwrap().images;
    let user = |p: Option<&str>| c.auth_for("reg:5000/x/y:1", p).map(|a| a.username.clone());
    assert_eq!(user(Some("acme/rl/ppo")).as_deref(), Some("acme-rl"), "the most specific scope");
    assert_eq!(user(Some("acme/eval")).as_deref(), Some("acme"));
    assert_eq!(user(Some("acme-2")).as_deref(), Some("ops"), "not on acme's path");
    assert_eq!(user(None).as_deref(), Some("ops"));
    assert!(c.may_name("acme/rl", "reg:5000/acme/task:1") && c.may_name("acme/rl", "reg:5000/shared/t:1"));
    assert!(!c.may_name("other", "reg:5000/acme/task:1") && !c.may_name("other", "reg:5000/shared/t:1"));
    assert!(!c.may_name("acme", "elsewhere:5000/acme/task:1"));
    for bad in ["[images.scopes.\"public\"]", "[images.scopes.\"a//b\"]", "[images.scopes.\"a\"]\nallowed = [\"r/x\"]"]
    {
        let e = Config::from_toml(&format!("{MIN}\n{bad}\n"), &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("images.scopes"), "{bad}: {e}");
    }
}

#[test]
fn disk_bounds_default_and_validate() {
    let c = Config::from_toml(MIN, &Overrides::default()).unwrap();
    assert_eq!(c.templates["busybox"].disk_mb, DEFAULT_DISK_MB);
    assert_eq!(c.docker.disk_bounds, DiskBounds::BestEffort);
    let t = |line: &str| MIN.replace("[templates.busybox]", &format!("[templates.busybox]\n{line}"));
    let c = Config::from_toml(&t("disk_mb = 0"), &Overrides::default()).unwrap();
    assert_eq!(c.templates["busybox"].disk_mb, 0, "0 asks for no bound");
    for bad in ["disk_mb = 8", "disk_mb = 99999999"] {
        let e = Config::from_toml(&t(bad), &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("templates.busybox.disk_mb"), "{e}");
    }
    let c = Config::from_toml(&format!("{MIN}\n[docker]\ndisk_bounds = \"required\"\n"), &Overrides::default());
    assert_eq!(c.unwrap().docker.disk_bounds, DiskBounds::Required);
    let e = Config::from_toml(&format!("{MIN}\n[docker]\ndisk_bounds = \"yes\"\n"), &Overrides::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("docker.disk_bounds"), "{e}");
}

#[test]
fn shipped_config_is_valid() {
    let text = include_str!("../sandpool.toml");
    Config::from_toml(text, &Overrides::default()).unwrap();
}

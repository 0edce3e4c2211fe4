//! `sandpool config check`: the config as it takes effect (file, `SANDPOOL__` variables,
//! flags), secrets hidden; exit code 2 naming the field and variable when it is invalid.

use std::path::Path;
use std::process::Command;

fn check(vars: &[(&str, &str)]) -> (i32, String, String) {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/sandpool.toml");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandpool"));
    cmd.arg("--config").arg(&config).args(["config", "check"]);
    // Only the variables given: the developer's shell may hold SANDPOOL_ ones.
    for (k, _) in std::env::vars() {
        if k.starts_with("SANDPOOL") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(vars.iter().copied());
    let out = cmd.output().expect("run sandpool config check");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

#[test]
fn prints_the_effective_config_with_secrets_hidden() {
    let secret = "a-fresh-jwt-key-0123456789abcdef";
    let (code, out, err) = check(&[
        ("SANDPOOL__AUTH__KEY", secret),
        ("SANDPOOL__TELEMETRY__METRICS_LISTEN", "127.0.0.1:9475"),
        ("SANDPOOL__TEMPLATES__DEBIAN__WARM", "0"),
        ("SANDPOOL__LOG__FORMAT", "json"),
    ]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("# from the environment: SANDPOOL__AUTH__KEY, SANDPOOL__LOG__FORMAT"), "{out}");
    assert!(out.contains("127.0.0.1:9475") && out.contains("format: Json"), "{out}");
    assert!(!out.contains(secret) && !out.contains("dev-internal-secret-change-me"), "a secret shows:\n{out}");
    assert!(out.contains("<hidden>"), "{out}");
    // The defaults the file leaves out are shown too.
    assert!(out.contains("placement_choices: 2"), "{out}");
}

#[test]
fn an_invalid_value_exits_2_naming_the_field_and_variable() {
    let (code, out, err) = check(&[("SANDPOOL__GATEWAY__MAX_QUEUE", "lots")]);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(err.contains("gateway.max_queue") && err.contains("SANDPOOL__GATEWAY__MAX_QUEUE"), "{err}");
    let (code, _, err) = check(&[("SANDPOOL__TEMPLATES__BUSYBOX__CPUS", "0")]);
    assert_eq!(code, 2);
    assert!(err.contains("templates.busybox.cpus"), "{err}");
}

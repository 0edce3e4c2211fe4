//! `sandpool quota`: set, get, refuse a child above its parent, verify, remove, on the real
//! Redis under a key prefix of its own (removed on drop, pass or fail).

use std::process::{Command, Output};

use tests::{Cleanup, StackOpts, config_toml, rand_hex};

struct Cli {
    config: std::path::PathBuf,
    _cleanup: Cleanup,
}

impl Cli {
    fn new() -> Cli {
        let prefix = format!("sptest-{}", rand_hex(10));
        let dir = std::env::temp_dir().join(&prefix);
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("sandpool.toml");
        std::fs::write(&config, config_toml(&prefix, "nq", &StackOpts::default())).unwrap();
        Cli { config, _cleanup: Cleanup { prefix, redis: tests::redis_url(), node: "nq".into() } }
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_sandpool"))
            .arg("--config")
            .arg(&self.config)
            .arg("quota")
            .args(args)
            .output()
            .expect("run sandpool quota")
    }

    fn json(&self, args: &[&str]) -> serde_json::Value {
        let out = self.run(args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("JSON on stdout")
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        if let Some(dir) = self.config.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[test]
fn quotas_are_set_read_verified_and_removed_from_the_command_line() {
    let cli = Cli::new();
    let v = cli.json(&["set", "lab", "--sessions", "6", "--memory", "2GiB", "--create-rate", "300/m", "--burst", "20"]);
    assert_eq!(
        v["limits"],
        serde_json::json!({"sessions": 6, "memory_mb": 2048, "create_rate": 5.0, "create_burst": 20})
    );
    // `set` keeps what it does not name.
    let v = cli.json(&["set", "lab", "--cpus", "8"]);
    assert_eq!((v["limits"]["sessions"].as_u64(), v["limits"]["cpus"].as_f64()), (Some(6), Some(8.0)));
    cli.json(&["set", "lab/a", "--sessions", "4"]);
    // A child may not exceed its parent.
    let out = cli.run(&["set", "lab/b", "--sessions", "7"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"lab\""), "{}", String::from_utf8_lossy(&out.stderr));
    let v = cli.json(&["get", "lab"]);
    assert_eq!(v["children"][0]["path"], "lab/a");
    assert_eq!(cli.json(&["verify"])["drift"], serde_json::json!([]));
    assert!(cli.run(&["rm", "lab/a"]).status.success());
    assert!(cli.json(&["get", "lab"])["children"].as_array().is_none_or(|c| c.is_empty()));
    let out = cli.run(&["get", "lab/../x"]);
    assert_eq!(out.status.code(), Some(2), "a bad path is refused");
}

//! The Python SDK's tests (`sdk/python/tests`, pytest) against `sandpool up` on a test stack.
//! `scripts/test` installs the SDK's test dependencies (httpx, websockets, pytest,
//! openapi-spec-validator) and builds the Debian image the rollout example runs on.

mod support;

use std::process::Command;

use support::Up;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_passes_its_tests_against_a_live_stack() {
    // `deb`: the Debian template (python3) for the rollout example, as realistic episodes run.
    let debian = r#"
[templates.deb]
image = "sandpool/debian:bookworm"
exec = "agent"
workdir = "/work"
cpus = 0.5
memory_mb = 256
pids = 1024
warm = 4
"#;
    let up = Up::start(|toml| toml + debian, |_| {}).await;
    up.create().await; // the pool is warm
    let sdk = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk/python");
    let mut pytest = Command::new("python3");
    pytest
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"])
        .current_dir(&sdk)
        .env("PYTHONPATH", &sdk)
        .env("SANDPOOL_TEMPLATE", "bb")
        .env("SANDPOOL_ROLLOUT_TEMPLATE", "deb");
    let (out, text) = up.run(pytest).await;
    assert!(out.status.success(), "pytest failed:\n{text}");
    assert!(text.contains("passed") && !text.contains("skipped"), "{text}");
}

/// The rollout example as the README shows it, on the default config's Debian template (warm 2,
/// for steady traffic): it reserves its burst ahead, so every episode of the first burst starts
/// warm. The same burst unannounced, on an identical template, is the baseline: it waits for
/// cold creates. Latencies are printed (and recorded in BENCHMARKS.md), not held: a timed
/// assertion would measure the machine's load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rollout_example_reserves_its_first_burst_and_meets_it_warm() {
    // The default config's `debian` template (config/sandpool.toml), and a twin for the baseline.
    let template = |name: &str| {
        format!(
            "\n[templates.{name}]\nimage = \"sandpool/debian:bookworm\"\nexec = \"agent\"\nnetwork = \"none\"\n\
             cpus = 1.0\nmemory_mb = 1024\ndisk_mb = 2048\npids = 1024\nworkdir = \"/work\"\nwarm = 2\n\
             idle_timeout = \"30m\"\nmax_lifetime = \"4h\"\n"
        )
    };
    let up = Up::start(|toml| toml + &template("debian") + &template("debian_twin"), |_| {}).await;
    let sdk = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk/python");
    let episodes = 16;
    let rollout = |template: &str, lead_s: &str| {
        let mut example = Command::new("python3");
        example
            .arg(sdk.join("examples/rl_rollout.py"))
            .args(["--template", template, "--episodes", &episodes.to_string(), "--steps", "1"])
            .args(["--reserve-lead-s", lead_s])
            .env("PYTHONPATH", &sdk);
        example
    };
    // A step's p50 from the example's table.
    let p50 = |text: &str, step: &str| -> f64 {
        let row = text.lines().find(|l| l.split_whitespace().next() == Some(step)).expect("a row of the step");
        row.split_whitespace().nth(2).and_then(|v| v.parse().ok()).expect("its p50 ms")
    };
    let starts =
        |text: &str| text.lines().find_map(|l| l.strip_prefix("sandboxes: ")).expect("a sandboxes line").to_string();

    let (out, baseline) = up.run(rollout("debian_twin", "0")).await;
    assert!(out.status.success(), "the unannounced burst failed:\n{baseline}");
    let (out, reserved) = up.run(rollout("debian", "30")).await;
    assert!(out.status.success(), "the reserved burst failed:\n{reserved}");
    assert!(reserved.contains(&format!("reserved {episodes} x 'debian'")), "{reserved}");
    eprintln!(
        "rollout, first burst of {episodes}: unannounced {} (grant p50 {} ms, create p50 {} ms); \
         reserved {} (grant p50 {} ms, create p50 {} ms)",
        starts(&baseline),
        p50(&baseline, "grant"),
        p50(&baseline, "create"),
        starts(&reserved),
        p50(&reserved, "grant"),
        p50(&reserved, "create"),
    );
    assert_eq!(starts(&reserved), format!("{episodes} warm, 0 cold"), "{reserved}");
    assert_ne!(starts(&baseline), format!("{episodes} warm, 0 cold"), "the baseline met its burst warm:\n{baseline}");
}

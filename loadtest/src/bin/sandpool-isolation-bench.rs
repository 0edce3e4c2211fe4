//! What an isolation class costs: runc against crun and runsc (gVisor), and the default unprivileged
//! user against root, in one run on one stack, so all see the same machine at the same moment. Cold session creates (no idle sandbox: the create
//! pays for the container), `exec true` round trips through the agent, and the memory an idle
//! sandbox holds (its cgroup's, as `docker stats` reports it), alternating between the classes.
//!
//!     cargo build --release -p loadtest --bin sandpool-isolation-bench
//!     ./target/release/sandpool-isolation-bench [--creates 12] [--execs 400]
//!
//! Needs Redis (SANDPOOL_TEST_REDIS), Docker with the runsc runtime registered
//! (`scripts/lib.sh` `ensure_runtimes`), and the busybox image.

use std::time::{Duration, Instant};

use clap::Parser;
use loadtest::Samples;
use serde_json::json;
use tests::{Stack, StackOpts};

#[derive(Parser)]
struct Args {
    /// Cold creates per class.
    #[arg(long, default_value_t = 12)]
    creates: usize,
    /// Exec round trips per class.
    #[arg(long, default_value_t = 400)]
    execs: usize,
}

/// The classes measured, as (template name, runtime, user): runc as root is the baseline of
/// what the default unprivileged user costs.
const CLASSES: [(&str, &str, &str); 5] = [
    ("runc-root", "runc", "root"),
    ("runc", "runc", "1000"),
    ("crun", "crun", "1000"),
    ("gvisor", "runsc", "1000"),
    ("gvisor-root", "runsc", "root"),
];

fn templates() -> String {
    let mut toml = String::new();
    for (name, runtime, user) in CLASSES {
        for (suffix, warm) in [("", 2), ("-cold", 0)] {
            toml.push_str(&format!(
                "[templates.{name}{suffix}]\nimage = \"{}\"\nruntime = \"{runtime}\"\nuser = \"{user}\"\n\
                 workdir = \"/work\"\ncpus = 1.0\nmemory_mb = 256\nwarm = {warm}\n",
                tests::BUSYBOX_IMAGE
            ));
        }
    }
    toml
}

/// Memory of a container's cgroup as `docker stats` reports it (usage less page cache), MiB.
fn memory_mib(container: &str) -> anyhow::Result<f64> {
    let out = std::process::Command::new("docker")
        .args(["stats", "--no-stream", "--format", "{{.MemUsage}}", container])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let used = text.split('/').next().unwrap_or_default().trim();
    let (num, unit) = used.split_at(used.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(used.len()));
    let n: f64 = num.trim().parse()?;
    Ok(match unit {
        "KiB" => n / 1024.0,
        "MiB" => n,
        "GiB" => n * 1024.0,
        _ => n / (1024.0 * 1024.0),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _logs = telemetry::trace::init_with("sandpool-isolation-bench", None, "warn");
    let opts = StackOpts { warm: 0, extra_toml: templates(), max_creates_in_flight: 2, ..Default::default() };
    let stack = Stack::start(opts).await;
    let c = stack.client("bench");
    for (name, _, _) in CLASSES {
        stack.wait_idle(name, 2, Duration::from_secs(300)).await;
    }

    // Idle memory, before anything ran in them.
    let mut memory = Vec::new();
    for (name, _, _) in CLASSES {
        let mut per = Vec::new();
        for container in stack.containers() {
            let labels = std::process::Command::new("docker")
                .args(["inspect", "-f", "{{index .Config.Labels \"sandpool.template\"}}", &container])
                .output()?;
            if String::from_utf8_lossy(&labels.stdout).trim() == name {
                per.push(memory_mib(&container)?);
            }
        }
        anyhow::ensure!(!per.is_empty(), "no idle {name} sandbox to measure");
        memory.push(per.iter().sum::<f64>() / per.len() as f64);
    }

    // Cold creates, alternating.
    let mut creates: Vec<Samples> = CLASSES.iter().map(|_| Samples::default()).collect();
    for _ in 0..args.creates {
        for (i, (name, _, _)) in CLASSES.iter().enumerate() {
            let t0 = Instant::now();
            let s = c.create(&format!("{name}-cold")).await;
            creates[i].push(t0.elapsed());
            let sid = s["session_id"].as_str().unwrap_or_default().to_string();
            anyhow::ensure!(s["start"] == "cold", "expected a cold start: {s}");
            c.delete(&sid).await;
        }
    }

    // Exec round trips, alternating between one session of each.
    let mut sessions = Vec::new();
    for (name, _, _) in CLASSES {
        let s = c.create(name).await;
        sessions.push(s["session_id"].as_str().unwrap_or_default().to_string());
    }
    let mut execs: Vec<Samples> = CLASSES.iter().map(|_| Samples::default()).collect();
    // What the agent reports (spawn to exit, inside the sandbox): the rest of a round trip is
    // the channel, the pool-manager and the gateway.
    let mut inside: Vec<Samples> = CLASSES.iter().map(|_| Samples::default()).collect();
    for round in 0..args.execs + 20 {
        for (i, sid) in sessions.iter().enumerate() {
            let t0 = Instant::now();
            let r = c.exec(sid, json!({"cmd": ["true"]})).await;
            anyhow::ensure!(r.status == 200, "exec: {:?}", r.body);
            if round >= 20 {
                execs[i].push(t0.elapsed());
                let ms = r.body["duration_ms"].as_f64().unwrap_or_default();
                inside[i].push(Duration::from_secs_f64(ms / 1000.0));
            }
        }
    }
    for sid in &sessions {
        c.delete(sid).await;
    }

    println!(
        "| class (runtime, user) | cold create p50 ms | p90 ms | exec `true` p50 ms | p99 ms | of which in the sandbox p50 ms | idle sandbox MiB |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (i, (name, runtime, user)) in CLASSES.iter().enumerate() {
        let (cr, ex, ins) = (creates[i].summary(), execs[i].summary(), inside[i].summary());
        println!(
            "| {name} ({runtime}, {user}) | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.1} |",
            cr.p50_ms, cr.p90_ms, ex.p50_ms, ex.p99_ms, ins.p50_ms, memory[i]
        );
    }
    let [root, user, crun, gvisor, gvisor_root] = [0, 1, 2, 3, 4].map(|i| execs[i].summary());
    let [runc_create, crun_create] = [1, 2].map(|i| creates[i].summary());
    println!("\nexec p50: the unprivileged user adds {:.2} ms to runc as root", user.p50_ms - root.p50_ms);
    println!(
        "crun / runc: cold create p50 {:.2}x, exec p50 {:.2}x",
        crun_create.p50_ms / runc_create.p50_ms,
        crun.p50_ms / user.p50_ms
    );
    println!("exec p50 under gVisor: the unprivileged user adds {:.2} ms to root", gvisor.p50_ms - gvisor_root.p50_ms);
    println!("exec p50: gVisor adds {:.2} ms ({:.1}x runc)", gvisor.p50_ms - user.p50_ms, gvisor.p50_ms / user.p50_ms);
    stack.shutdown().await;
    Ok(())
}

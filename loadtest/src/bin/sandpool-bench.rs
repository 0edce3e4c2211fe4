//! sandpool-bench: the spine's latency benchmark, beside the naive Docker baseline, in one run.
//!
//! Starts a whole stack in this process on the real Redis and Docker (as the end-to-end tests
//! do) and measures, sequentially (one request at a time, so latency is not queueing):
//! warm session create through the gateway, time to first command (create + `exec true`),
//! exec round trip of `true` via the agent and via `docker exec` through the gateway, and
//! the baselines `docker exec <c> true` and `docker run` + `docker exec` with the CLI.
//!
//!     cargo run --release -p loadtest --bin sandpool-bench -- --rounds 3
//!
//! The metrics recorder is on, as in a deployment; `--no-metrics` measures without it.
//!
//! Quotas: the stack's gateway has them on (a sessions limit on the benchmark's tenant, and a
//! call rate too high to refuse anything), and a second gateway on the same stack has them
//! off; warm creates and agent execs alternate between the two, so both see the same machine
//! at the same moment. Redis's own time for the checkout and quota scripts is read from its
//! `SLOWLOG` (threshold 0 for the measurement, restored after).

use std::time::{Duration, Instant};

use clap::Parser;
use loadtest::{Samples, Summary, docker};
use serde_json::json;
use tests::{Stack, StackOpts};

#[derive(Parser)]
struct Args {
    /// Rounds of warm creates; each drains most of the pool and waits for the refill.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Warm pool size (creates per round are 80 % of it).
    #[arg(long, default_value_t = 40)]
    warm: u32,
    /// Exec round trips via the agent.
    #[arg(long, default_value_t = 1000)]
    execs: usize,
    /// Exec round trips via docker exec (gateway and CLI each).
    #[arg(long, default_value_t = 60)]
    docker_execs: usize,
    /// CPU limit of the benchmark's sandboxes. A tight exec loop costs the agent about half a
    /// core; below that, CFS throttling adds ~20 ms stalls (see BENCHMARKS.md).
    #[arg(long, default_value_t = 1.0)]
    cpus: f64,
    /// The agent template's CFS period in ms (`cpu_period`; `config::DEFAULT_CPU_PERIOD` if unset).
    #[arg(long)]
    cpu_period_ms: Option<u64>,
    /// Write the results as JSON here too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Leave the metrics recorder out (by default it is installed and `/metrics` served, as in
    /// a deployment, so the spine's cost includes recording its metrics).
    #[arg(long)]
    no_metrics: bool,
}

/// Round trips of one line through `cat` over the session WebSocket.
async fn ws_round_trips(stack: &Stack, c: &tests::Client, sid: &str, n: usize) -> anyhow::Result<Samples> {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let url = format!("{}/v1/sessions/{sid}/ws?token={}", stack.url.replace("http://", "ws://"), c.token);
    let (mut ws, _) = tokio_tungstenite::connect_async(url).await?;
    let start = json!({"type": "start", "id": "cat", "cmd": ["cat"]});
    ws.send(Message::Text(start.to_string().into())).await?;
    let mut samples = Samples::default();
    for i in 0..n {
        let line = format!("{i}\n");
        let msg = json!({"type": "stdin", "id": "cat", "data": line});
        let t0 = Instant::now();
        ws.send(Message::Text(msg.to_string().into())).await?;
        loop {
            let Some(m) = ws.next().await else { anyhow::bail!("socket closed") };
            if let Message::Text(t) = m? {
                let v: serde_json::Value = serde_json::from_str(&t)?;
                if v["type"] == "stdout" && v["data"] == line.as_str() {
                    break;
                }
            }
        }
        samples.push(t0.elapsed());
    }
    let _ = ws.close(None).await;
    Ok(samples)
}

/// Mean VmRSS and RssAnon (KiB) of the agent (PID 1) of this stack's idle sandboxes.
fn idle_agent_memory(stack: &Stack) -> anyhow::Result<(f64, f64, usize)> {
    let (mut rss, mut anon, mut n) = (0u64, 0u64, 0usize);
    for c in stack.containers() {
        let pid = docker(&["inspect", "-f", "{{.State.Pid}}", &c])?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        rss += field("VmRSS:");
        anon += field("RssAnon:");
        n += 1;
    }
    anyhow::ensure!(n > 0, "no sandboxes to measure");
    Ok((rss as f64 / n as f64, anon as f64 / n as f64, n))
}

/// Redis's own time per call of the checkout script and the quota scripts (median, p99, n),
/// from `SLOWLOG` with a threshold of 0 during `n` warm creates and deletes.
async fn script_server_time(
    stack: &Stack,
    c: &tests::Client,
    n: usize,
) -> anyhow::Result<Vec<(String, (f64, f64, usize))>> {
    let client = redis::Client::open(stack.config.redis.url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let get = |name: &str| redis::cmd("CONFIG").arg("GET").arg(name).to_owned();
    let (_, threshold): (String, String) = get("slowlog-log-slower-than").query_async(&mut conn).await?;
    let (_, max_len): (String, String) = get("slowlog-max-len").query_async(&mut conn).await?;
    let set = |name: &str, v: &str| redis::cmd("CONFIG").arg("SET").arg(name).arg(v).to_owned();
    let _: () = set("slowlog-log-slower-than", "0").query_async(&mut conn).await?;
    let _: () = set("slowlog-max-len", "100000").query_async(&mut conn).await?;
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query_async(&mut conn).await?;
    stack.wait_idle("bb", n, Duration::from_secs(600)).await;
    let mut sessions = Vec::new();
    for _ in 0..n {
        sessions.push(c.create("bb").await["session_id"].as_str().unwrap_or_default().to_string());
    }
    for sid in &sessions {
        c.delete(sid).await;
    }
    let log: Vec<redis::Value> = redis::cmd("SLOWLOG").arg("GET").arg(100_000).query_async(&mut conn).await?;
    let _: () = set("slowlog-log-slower-than", &threshold).query_async(&mut conn).await?;
    let _: () = set("slowlog-max-len", &max_len).query_async(&mut conn).await?;
    let ledger = &stack.node.ledger;
    let mut out = Vec::new();
    for name in ["checkout", "quota_admit", "quota_release"] {
        let sha = ledger.script_hash(name).unwrap_or_default();
        let mut us: Vec<f64> = log
            .iter()
            .filter_map(|e| {
                let redis::Value::Array(fields) = e else { return None };
                let (redis::Value::Int(took), redis::Value::Array(argv)) = (fields.get(2)?, fields.get(3)?) else {
                    return None;
                };
                let arg = |i: usize| match argv.get(i) {
                    Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).to_lowercase(),
                    _ => String::new(),
                };
                (arg(0) == "evalsha" && arg(1) == sha).then_some(*took as f64)
            })
            .collect();
        us.sort_by(f64::total_cmp);
        let at = |q: f64| us.get(((us.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
        out.push((name.to_string(), (at(0.5), at(0.99), us.len())));
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // The stack's logs (warnings and errors by default; `RUST_LOG` to choose), on stderr.
    let _logs = telemetry::trace::init_with("sandpool-bench", None, "warn");
    let opts = StackOpts {
        extra_toml: "[quotas]\ncall_rate = 1000000.0\ncall_burst = 1000000\n".into(),
        warm: args.warm,
        warm_docker: 1,
        max_creates_in_flight: 4,
        cpus: args.cpus,
        cpu_period: args.cpu_period_ms.map(std::time::Duration::from_millis),
        metrics: !args.no_metrics,
        ..Default::default()
    };
    let stack = Stack::start(opts).await;
    eprintln!("metrics: {}", stack.metrics_url.as_deref().unwrap_or("off (--no-metrics)"));
    let c = stack.client("bench");
    let ledger = stack.node.ledger.clone();
    let limits = wire::quotas::QuotaLimits { sessions: Some(100_000), ..Default::default() };
    ledger.quota_set("bench", Some(&limits), &stack.config.quotas.default).await?;
    let mut off = (*stack.config).clone();
    off.quotas.enabled = false;
    off.quotas.call_rate = None;
    let (off_url, _off_gw) = stack.gateway_with(std::sync::Arc::new(off)).await;
    let c_off = tests::Client { url: off_url, ..c.clone() };
    let fill = Duration::from_secs(600);
    stack.wait_idle("bb", args.warm as usize, fill).await;
    stack.wait_idle("bbd", 1, fill).await;

    // Warm up connections and code paths (through both gateways).
    for c in [&c, &c_off, &c, &c_off] {
        let s = c.create("bb").await;
        let sid = s["session_id"].as_str().unwrap_or_default().to_string();
        c.sh(&sid, "true").await;
        c.delete(&sid).await;
    }

    let (mut create, mut ttfc, mut cold) = (Samples::default(), Samples::default(), 0usize);
    let mut create_off = Samples::default();
    let per_round = (args.warm as usize * 4 / 5).max(1);
    for round in 0..args.rounds {
        stack.wait_idle("bb", args.warm as usize, fill).await;
        let mut sessions = Vec::new();
        for i in 0..per_round {
            let quotas_on = i % 2 == 0;
            let c = if quotas_on { &c } else { &c_off };
            let t0 = Instant::now();
            let s = c.create("bb").await;
            let created = t0.elapsed();
            let sid = s["session_id"].as_str().unwrap_or_default().to_string();
            let r = c.exec(&sid, json!({"cmd": ["true"]})).await;
            anyhow::ensure!(r.status == 200, "first exec: {:?}", r.body);
            if s["start"] != "warm" {
                cold += 1;
            } else if quotas_on {
                create.push(created);
                ttfc.push(t0.elapsed());
            } else {
                create_off.push(created);
            }
            sessions.push(sid);
        }
        for sid in sessions {
            c.delete(&sid).await;
        }
        eprintln!("round {} done", round + 1);
    }

    // Containment: another tenant floods creates (4 at a time, non-stop, against a sessions
    // quota of 2) while the benchmark's tenant does warm creates as before.
    let flood_limits = wire::quotas::QuotaLimits { sessions: Some(2), ..Default::default() };
    ledger.quota_set("flood", Some(&flood_limits), &stack.config.quotas.default).await?;
    stack.wait_idle("bb", args.warm as usize, fill).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let flood = stack.client("flood");
    let flooders: Vec<_> = (0..4)
        .map(|_| {
            let (flood, stop) = (flood.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut refused, mut held) = (0u64, Vec::new());
                while !stop.is_cancelled() {
                    let a = flood.call(reqwest::Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
                    refused += u64::from(a.status == 429);
                    if let Some(sid) = a.body["session_id"].as_str() {
                        held.push(sid.to_string());
                    }
                }
                for sid in held {
                    flood.delete(&sid).await;
                }
                refused
            })
        })
        .collect();
    let mut create_flooded = Samples::default();
    let mut sessions = Vec::new();
    for _ in 0..per_round / 2 {
        let t0 = Instant::now();
        let s = c.create("bb").await;
        if s["start"] == "warm" {
            create_flooded.push(t0.elapsed());
        }
        sessions.push(s["session_id"].as_str().unwrap_or_default().to_string());
    }
    stop.cancel();
    let mut flood_refused = 0;
    for f in flooders {
        flood_refused += f.await?;
    }
    for sid in sessions {
        c.delete(&sid).await;
    }

    // Let refills and destroys of the create rounds finish: exec is measured on a quiet node.
    stack.wait_idle("bb", args.warm as usize, fill).await;
    tests::eventually(fill, || async { (stack.containers().len() == args.warm as usize + 1).then_some(()) }).await;
    let idle_rss = idle_agent_memory(&stack)?;

    // Exec round trips in one leased session of each mode.
    let agent_sid = c.create("bb").await["session_id"].as_str().unwrap_or_default().to_string();
    let docker_sid = c.create("bbd").await["session_id"].as_str().unwrap_or_default().to_string();
    // Their checkouts trigger refills: wait for those too (a container start costs both cores).
    stack.wait_idle("bb", args.warm as usize, fill).await;
    stack.wait_idle("bbd", 1, fill).await;
    let true_cmd = json!({"cmd": ["true"]});
    let (mut exec_agent, mut exec_agent_off) = (Samples::default(), Samples::default());
    // (round trip, time inside the sandbox, when it started since the loop's start)
    let mut slowest: Vec<(Duration, f64, Duration)> = Vec::new();
    let loop_start = Instant::now();
    for i in 0..args.execs * 2 {
        let quotas_on = i % 2 == 0;
        let t0 = Instant::now();
        let r = if quotas_on { &c } else { &c_off }.exec(&agent_sid, true_cmd.clone()).await;
        let took = t0.elapsed();
        anyhow::ensure!(r.status == 200, "exec: {:?}", r.body);
        if quotas_on {
            exec_agent.push(took);
            slowest.push((took, r.body["duration_ms"].as_f64().unwrap_or(0.0), t0 - loop_start));
        } else {
            exec_agent_off.push(took);
        }
    }
    slowest.sort_by_key(|s| std::cmp::Reverse(s.0));
    for (took, inside, at) in slowest.iter().take(10) {
        eprintln!(
            "slow exec: {:.2} ms round trip, {inside:.2} ms inside the sandbox, at +{:.3} s",
            took.as_secs_f64() * 1000.0,
            at.as_secs_f64()
        );
    }
    let over = |ms: u64| slowest.iter().filter(|s| s.0 > Duration::from_millis(ms)).count();
    eprintln!(
        "agent exec (quotas on): p99 {:.2} ms, p99.9 {:.2} ms, {} of {} over 3 ms, {} over 10 ms",
        exec_agent.percentile(0.99).as_secs_f64() * 1000.0,
        exec_agent.percentile(0.999).as_secs_f64() * 1000.0,
        over(3),
        exec_agent.len(),
        over(10)
    );
    let mut exec_docker_gw = Samples::default();
    for _ in 0..args.docker_execs {
        let t0 = Instant::now();
        let r = c.exec(&docker_sid, true_cmd.clone()).await;
        exec_docker_gw.push(t0.elapsed());
        anyhow::ensure!(r.status == 200, "exec: {:?}", r.body);
    }

    let script_us = script_server_time(&stack, &c, args.warm as usize / 2).await?;

    // Streaming: a byte's round trip through the session WebSocket (client → stdin of `cat`
    // in the sandbox → its stdout → client); one way is at most this.
    let ws_rtt = ws_round_trips(&stack, &c, &agent_sid, args.execs / 2).await?;
    // A persistent shell: `true`, and a `cd` whose directory the next run sees, alternating
    // with plain execs of `true` in the same session so both see the same moment.
    let shells = format!("/v1/sessions/{agent_sid}/shells");
    let a = c.call(reqwest::Method::POST, &shells, Some(json!({"name": "bench"}))).await;
    anyhow::ensure!(a.status == 201, "open a shell: {:?}", a.body);
    let run = format!("{shells}/bench/run");
    let (mut shell_true, mut shell_cd, mut exec_beside) = (Samples::default(), Samples::default(), Samples::default());
    for i in 0..args.execs / 2 {
        let t0 = Instant::now();
        let a = c.call(reqwest::Method::POST, &run, Some(json!({"cmd": "true"}))).await;
        shell_true.push(t0.elapsed());
        anyhow::ensure!(a.status == 200 && a.body["exit_code"] == 0, "shell run: {:?}", a.body);
        let dir = if i % 2 == 0 { "/tmp" } else { "/work" };
        let t0 = Instant::now();
        let a = c.call(reqwest::Method::POST, &run, Some(json!({"cmd": format!("cd {dir} && pwd")}))).await;
        shell_cd.push(t0.elapsed());
        anyhow::ensure!(a.body["cwd"] == dir, "shell state: {:?}", a.body);
        let t0 = Instant::now();
        let r = c.exec(&agent_sid, true_cmd.clone()).await;
        exec_beside.push(t0.elapsed());
        anyhow::ensure!(r.status == 200, "exec: {:?}", r.body);
    }
    // Pause and resume of a leased session through the gateway.
    // A failed pause or resume is counted, not fatal: dockerd 20.10 sometimes loses a frozen
    // container (see BENCHMARKS.md); the session is replaced and the loop goes on.
    let (mut pause, mut resume, mut pause_failures) = (Samples::default(), Samples::default(), Vec::new());
    let mut paused_sid = agent_sid.clone();
    for _ in 0..20 {
        let t0 = Instant::now();
        let a = c.call(reqwest::Method::POST, &format!("/v1/sessions/{paused_sid}/pause"), None).await;
        let paused = a.status == 200;
        if paused {
            pause.push(t0.elapsed());
            let t0 = Instant::now();
            let a = c.call(reqwest::Method::POST, &format!("/v1/sessions/{paused_sid}/resume"), None).await;
            if a.status == 200 {
                resume.push(t0.elapsed());
                continue;
            }
            pause_failures.push(format!("resume: {} {}", a.status, a.body["message"]));
        } else {
            pause_failures.push(format!("pause: {} {}", a.status, a.body["message"]));
        }
        paused_sid = c.create("bb").await["session_id"].as_str().unwrap_or_default().to_string();
    }

    // Baselines with the plain docker CLI, on a container like a sandbox.
    let image = tests::BUSYBOX_IMAGE;
    let label = format!("sandpool.prefix={}", stack.ledger_prefix());
    let base = docker(&["run", "-d", "--network", "none", "--label", &label, image, "sleep", "3600"])?;
    let mut exec_cli = Samples::default();
    for _ in 0..args.docker_execs {
        let t0 = Instant::now();
        docker(&["exec", &base, "true"])?;
        exec_cli.push(t0.elapsed());
    }
    let mut run_cli = Samples::default();
    for _ in 0..(args.docker_execs / 4).max(5) {
        let t0 = Instant::now();
        let id = docker(&["run", "-d", "--network", "none", "--label", &label, image, "sleep", "3600"])?;
        docker(&["exec", &id, "true"])?;
        run_cli.push(t0.elapsed());
        docker(&["rm", "-f", &id])?;
    }

    let rows: Vec<(&str, Summary)> = vec![
        ("warm session create (gateway)", create.summary()),
        ("warm session create (gateway, quotas off)", create_off.summary()),
        ("warm session create while another tenant floods creates", create_flooded.summary()),
        ("time to first command (create + exec true)", ttfc.summary()),
        ("exec `true` via agent (gateway)", exec_agent.summary()),
        ("exec `true` via agent (gateway, quotas and call rate off)", exec_agent_off.summary()),
        ("exec `true` via docker exec (gateway)", exec_docker_gw.summary()),
        ("WebSocket byte round trip (stdin → cat → stdout)", ws_rtt.summary()),
        ("persistent shell run of `true` (gateway)", shell_true.summary()),
        ("persistent shell run of `cd DIR && pwd` (gateway)", shell_cd.summary()),
        ("exec `true` via agent, alternating with the shell runs", exec_beside.summary()),
        ("pause a session (gateway)", pause.summary()),
        ("resume a session (gateway)", resume.summary()),
        ("baseline: `docker exec c true` (CLI)", exec_cli.summary()),
        ("baseline: `docker run` + `docker exec true` (CLI)", run_cli.summary()),
    ];
    println!("| what | n | p50 ms | p90 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|---|");
    for (name, s) in &rows {
        println!("| {name} | {} | {:.2} | {:.2} | {:.2} | {:.2} |", s.n, s.p50_ms, s.p90_ms, s.p99_ms, s.max_ms);
    }
    let ratio = |a: &Summary, b: &Summary| if b.p50_ms > 0.0 { a.p50_ms / b.p50_ms } else { 0.0 };
    println!();
    println!("exec p50: docker exec (CLI) / agent = {:.1}x", ratio(&exec_cli.summary(), &exec_agent.summary()));
    println!(
        "exec p50: docker exec (gateway) / agent = {:.1}x",
        ratio(&exec_docker_gw.summary(), &exec_agent.summary())
    );
    println!(
        "shell run p50 - exec p50 (same moments) = {:+.2} ms",
        shell_true.summary().p50_ms - exec_beside.summary().p50_ms
    );
    println!("first command p50: docker run+exec / sandpool = {:.1}x", ratio(&run_cli.summary(), &ttfc.summary()));
    println!(
        "idle agent memory per sandbox: VmRSS {:.0} KiB, of which private (RssAnon) {:.0} KiB (mean of {} sandboxes)",
        idle_rss.0, idle_rss.1, idle_rss.2
    );
    println!(
        "quotas: warm create p50 {:+.3} ms, exec p50 {:+.3} ms (on - off)",
        create.summary().p50_ms - create_off.summary().p50_ms,
        exec_agent.summary().p50_ms - exec_agent_off.summary().p50_ms
    );
    if !pause_failures.is_empty() {
        println!("pause/resume failures: {} of 20 pairs: {pause_failures:?}", pause_failures.len());
    }
    println!("flood: the flooding tenant was refused {flood_refused} creates (429) meanwhile");
    for (name, us) in &script_us {
        println!("Redis server time per call, {name}: median {:.1} µs, p99 {:.1} µs (n={})", us.0, us.1, us.2);
    }
    if cold > 0 {
        println!("note: {cold} creates found the pool empty and were cold (not in the warm figures)");
    }
    if let Some(path) = args.json {
        let map: serde_json::Map<String, serde_json::Value> =
            rows.iter().map(|(k, s)| (k.to_string(), serde_json::to_value(s).unwrap_or_default())).collect();
        std::fs::write(path, serde_json::to_string_pretty(&map)?)?;
    }
    stack.shutdown().await;
    Ok(())
}

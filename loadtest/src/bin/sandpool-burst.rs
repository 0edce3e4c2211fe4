//! sandpool-burst: a training step's burst of sessions, declared ahead with a reservation.
//!
//! Starts a whole stack (pool-manager, gateway, autoscaler) in this process on the real Redis
//! and Docker with an empty pool and no network, declares `POST /v1/reservations` for N
//! sandboxes, waits until the autoscaler has them idle, then fires N session creates spread
//! over one second (open loop: each latency counts from its intended send time) and reports
//! warm %, latency percentiles and errors. The naive baseline (`docker run` per episode) runs
//! a smaller burst in the same run for the ratio.
//!
//!     cargo run --release -p loadtest --bin sandpool-burst -- --n 1000

use std::time::{Duration, Instant, SystemTime};

use clap::Parser;
use loadtest::Samples;
use reqwest::Method;
use serde_json::json;
use tests::{Stack, StackOpts};

#[derive(Parser)]
struct Args {
    /// Sessions in the burst.
    #[arg(long, default_value_t = 1000)]
    n: usize,
    /// The burst arrives over this many milliseconds.
    #[arg(long, default_value_t = 1000)]
    spread_ms: u64,
    /// Node create budget (creates per second).
    #[arg(long, default_value_t = 12.0)]
    create_rate: f64,
    /// Size of the plain-Docker baseline burst (docker run + exec per episode).
    #[arg(long, default_value_t = 20)]
    baseline_n: usize,
}

/// The intended send time of request `i` of `n` spread evenly over `spread_ms` from `t0`.
fn intended(t0: tokio::time::Instant, i: usize, n: usize, spread_ms: u64) -> tokio::time::Instant {
    t0 + Duration::from_millis(spread_ms * i as u64 / n.max(1) as u64)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let opts = StackOpts {
        warm: 0,
        autoscaler: true,
        create_rate: args.create_rate,
        max_creates_in_flight: 8,
        max_queue: args.n * 2,
        cpus: 1.0,
        ..Default::default()
    };
    let stack = Stack::start(opts).await;
    let c = stack.client("trainer");
    let fill_s = (args.n as f64 / args.create_rate * 1.5) as u64 + 30;
    let ready_by = SystemTime::now() + Duration::from_secs(fill_s);
    let body = json!({
        "template": "bb", "count": args.n, "hold_s": 600,
        "ready_by": humantime::format_rfc3339(ready_by).to_string(),
    });
    let r = c.call(Method::POST, "/v1/reservations", Some(body)).await;
    anyhow::ensure!(r.status == 201, "reservation: {:?}", r.body);
    eprintln!("reservation: {}", r.body);
    let t_fill = Instant::now();
    stack.wait_idle("bb", args.n, Duration::from_secs(fill_s * 3)).await;
    let filled = t_fill.elapsed();
    eprintln!("{} idle after {:.0} s", args.n, filled.as_secs_f64());

    // The burst: N creates at evenly spread intended times within spread_ms.
    let started_before = stack.node.creates_started();
    let t0 = tokio::time::Instant::now() + Duration::from_millis(200);
    let calls: Vec<_> = (0..args.n)
        .map(|i| {
            let c = c.clone();
            let at = intended(t0, i, args.n, args.spread_ms);
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let a = c.call(Method::POST, "/v1/sessions", Some(json!({"template": "bb"}))).await;
                (a, at.elapsed())
            })
        })
        .collect();
    let (mut lat, mut warm, mut errors, mut sids) = (Samples::default(), 0, 0, Vec::new());
    for call in calls {
        let (a, took) = call.await?;
        if a.status == 201 {
            lat.push(took);
            warm += (a.body["start"] == "warm") as usize;
            sids.push(a.body["session_id"].as_str().unwrap_or_default().to_string());
        } else {
            errors += 1;
        }
    }
    let creates_during = stack.node.creates_started() - started_before;
    let s = lat.summary();
    println!("| burst | n | warm % | errors | p50 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| sandpool, reserved ({} ms spread) | {} | {:.1} | {} | {:.2} | {:.2} | {:.2} |",
        args.spread_ms,
        args.n,
        100.0 * warm as f64 / args.n as f64,
        errors,
        s.p50_ms,
        s.p99_ms,
        s.max_ms
    );
    println!("creates the node started during the burst (refills beside the checkouts): {creates_during}");
    for sid in sids {
        c.delete(&sid).await;
    }

    // Naive baseline: a container started per episode when the episode arrives.
    let label = format!("sandpool.prefix={}", stack.ledger_prefix());
    let t0 = tokio::time::Instant::now() + Duration::from_millis(100);
    let runs: Vec<_> = (0..args.baseline_n)
        .map(|i| {
            let label = label.clone();
            let at = intended(t0, i, args.baseline_n, args.spread_ms);
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let out = tokio::process::Command::new("docker")
                    .args(["run", "-d", "--network", "none", "--label", &label, tests::BUSYBOX_IMAGE, "sleep", "600"])
                    .output()
                    .await;
                (out.map(|o| o.status.success()).unwrap_or(false), at.elapsed())
            })
        })
        .collect();
    let (mut base, mut base_err) = (Samples::default(), 0);
    for r in runs {
        let (ok, took) = r.await?;
        if ok { base.push(took) } else { base_err += 1 }
    }
    let b = base.summary();
    println!(
        "| plain `docker run` per episode | {} | 0.0 | {} | {:.2} | {:.2} | {:.2} |",
        args.baseline_n, base_err, b.p50_ms, b.p99_ms, b.max_ms
    );
    println!();
    println!("pool of {} filled by the autoscaler in {:.0} s from the reservation", args.n, filled.as_secs_f64());
    println!("p50 ratio, docker run / sandpool: {:.0}x", b.p50_ms / s.p50_ms.max(0.001));
    stack.shutdown().await;
    Ok(())
}

//! What reaching a server in a sandbox costs through its port, against the ways there were
//! before ports, in one run on one session: a `network = "none"` busybox sandbox serving a
//! small page with `httpd` on its loopback. Paths, in alternating batches:
//!
//! - `docker exec wget` (the naive baseline): `docker exec <container> wget -qO- URL`, the
//!   operator's way into a container without network;
//! - `exec wget`: the tenant's way before ports, `POST /v1/sessions/{id}/exec` of the same
//!   `wget` through the gateway and the agent;
//! - `port`: `GET /v1/sessions/{id}/ports/8000/index.html` (one tunnel and one connection in
//!   the sandbox per request).
//!
//! Then one large file through the port, for throughput. Figures are medians of the batches'
//! medians.
//!
//!     cargo build --release -p loadtest --bin sandpool-ports-bench
//!     ./target/release/sandpool-ports-bench [--batches 5] [--requests 40] [--mib 64]
//!
//! Needs Redis (SANDPOOL_TEST_REDIS), Docker and the busybox image.

use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::json;
use tests::{Stack, StackOpts};

#[derive(Parser)]
struct Args {
    /// Alternating batches per path.
    #[arg(long, default_value_t = 5)]
    batches: usize,
    /// Requests per batch (the `docker exec` path runs a quarter of them: it is slow).
    #[arg(long, default_value_t = 40)]
    requests: usize,
    /// MiB of the file downloaded through the port.
    #[arg(long, default_value_t = 64)]
    mib: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

const PAGE: &str = "hello from the sandbox";

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let extra = "[templates.web]\nimage = \"sandpool/busybox:latest\"\nexec = \"agent\"\nworkdir = \"/work\"\n\
                 cpus = 1.0\nmemory_mb = 256\npids = 256\nwarm = 1\nports = [8000]\n";
    let stack = Stack::start(StackOpts { warm: 0, extra_toml: extra.into(), ..Default::default() }).await;
    let client = stack.client("bench");
    let s = client.create("web").await;
    let sid = s["session_id"].as_str().expect("a session id").to_string();
    let sandbox = s["sandbox_id"].as_str().expect("a sandbox id").to_string();
    let container = tests::container_inspect(&sandbox)["Id"].as_str().expect("its container").to_string();
    assert_eq!(client.put_file(&sid, "/work/www/index.html", PAGE.as_bytes().to_vec()).await, 204);
    let big = format!("head -c {} /dev/zero > /work/www/big", args.mib << 20);
    client.sh(&sid, &format!("{big} && httpd -p 127.0.0.1:8000 -h /work/www")).await;
    let url = format!("{}/v1/sessions/{sid}/ports/8000/index.html", stack.url);
    let http = reqwest::Client::new();
    let get = || async {
        let r = http.get(&url).bearer_auth(&client.token).send().await.expect("the gateway answers");
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.expect("a body"), PAGE);
    };
    tests::eventually(Duration::from_secs(10), || async {
        let r = http.get(&url).bearer_auth(&client.token).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await
    .expect("the server answers");
    let wget = "wget -qO- http://127.0.0.1:8000/index.html";

    let (mut docker, mut exec, mut port) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.batches {
        let mut times = Vec::new();
        for _ in 0..(args.requests / 4).max(1) {
            let t = Instant::now();
            let out = tokio::process::Command::new("docker")
                .args(["exec", &container, "sh", "-c", wget])
                .output()
                .await
                .expect("docker exec");
            assert_eq!(String::from_utf8_lossy(&out.stdout), PAGE);
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        docker.push(median(times));
        let mut times = Vec::new();
        for _ in 0..args.requests {
            let t = Instant::now();
            let out = client.exec(&sid, json!({ "cmd": wget })).await;
            assert_eq!(out.body["stdout"], PAGE);
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        exec.push(median(times));
        let mut times = Vec::new();
        for _ in 0..args.requests {
            let t = Instant::now();
            get().await;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        port.push(median(times));
    }
    let fmt = |v: &[f64]| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" / ");
    let (d, e, p) = (median(docker.clone()), median(exec.clone()), median(port.clone()));
    println!("| path | ms per request, batch medians | median | vs port |");
    println!("|---|---|---|---|");
    println!("| docker exec wget (baseline) | {} | {d:.2} | {:.1}x |", fmt(&docker), d / p);
    println!("| exec wget through sandpool | {} | {e:.2} | {:.1}x |", fmt(&exec), e / p);
    println!("| port through the gateway | {} | {p:.2} | 1x |", fmt(&port));

    let big_url = format!("{}/v1/sessions/{sid}/ports/8000/big", stack.url);
    let t = Instant::now();
    let r = http.get(&big_url).bearer_auth(&client.token).send().await.expect("the gateway answers");
    let bytes = r.bytes().await.expect("the whole file").len();
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(bytes, args.mib << 20);
    println!("\n{} MiB through the port in {secs:.2} s: {:.0} MiB/s", args.mib, args.mib as f64 / secs);
    let _ = client.delete(&sid).await;
}

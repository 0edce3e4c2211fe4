//! What named egress costs a connection, against the same connection without it, in one run:
//! a busybox container on a plain Docker bridge (the naive baseline: straight to the server,
//! no proxy, no policy) and a sandpool egress sandbox (every connection through the node's
//! proxy, checked against the session's policy). Both run the same loop of `nc` connections
//! against one server of this process, timed inside the container (`/proc/uptime`), in
//! alternating batches; the figures are medians of the batches' per-connection times, so the
//! difference is the proxy's setup cost (`nc`'s own spawn is in both). Then bulk transfers
//! through each path, and this process's CPU time per MiB relayed (the server's own sending
//! is in both; the difference is the proxy's).
//!
//!     cargo build --release -p loadtest --bin sandpool-egress-bench
//!     ./target/release/sandpool-egress-bench [--batches 7] [--conns 100] [--mib 1024]
//!
//! Needs Redis (SANDPOOL_TEST_REDIS), Docker, iptables and the busybox image.

use std::time::Duration;

use clap::Parser;
use loadtest::docker;
use tests::{Stack, StackOpts};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

#[derive(Parser)]
struct Args {
    /// Alternating batches of connections per path.
    #[arg(long, default_value_t = 7)]
    batches: usize,
    /// Connections per batch.
    #[arg(long, default_value_t = 100)]
    conns: usize,
    /// MiB relayed per path for the CPU figure.
    #[arg(long, default_value_t = 1024)]
    mib: usize,
}

/// Port `conn` closes each connection at once; port `bulk` sends `mib` MiB first.
async fn server(mib: usize) -> (u16, u16) {
    let conn = TcpListener::bind("0.0.0.0:0").await.unwrap();
    let bulk = TcpListener::bind("0.0.0.0:0").await.unwrap();
    let ports = (conn.local_addr().unwrap().port(), bulk.local_addr().unwrap().port());
    tokio::spawn(async move {
        while let Ok((s, _)) = conn.accept().await {
            drop(s);
        }
    });
    tokio::spawn(async move {
        let chunk = vec![0u8; 1 << 20];
        while let Ok((mut s, _)) = bulk.accept().await {
            let chunk = chunk.clone();
            tokio::spawn(async move {
                for _ in 0..mib {
                    if s.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    ports
}

/// This process's CPU time (user + system).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // After the command name come fields 3 (state) on: utime and stime are fields 14 and 15.
    let after: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, r)| r).split_whitespace().collect();
    let field = |n: usize| after.get(n - 3).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    let ticks = field(14) + field(15);
    Duration::from_millis(ticks * 10)
}

/// A loop of `n` connections to `host:port`, timed inside the container: ms per connection.
fn conn_loop(host: &str, port: u16, n: usize) -> String {
    format!(
        "s=$(cut -d' ' -f1 /proc/uptime); i=0; while [ $i -lt {n} ]; do nc {host} {port} </dev/null >/dev/null 2>&1; i=$((i+1)); done; \
         e=$(cut -d' ' -f1 /proc/uptime); echo \"$s $e\""
    )
}

fn per_conn_ms(out: &str, n: usize) -> anyhow::Result<f64> {
    let v: Vec<f64> = out.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    anyhow::ensure!(v.len() == 2, "loop output {out:?}");
    Ok((v[1] - v[0]) * 1000.0 / n as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The baseline: a container on a plain bridge network of its own (removed on drop).
struct Direct {
    name: String,
    gateway: String,
}

impl Direct {
    fn start() -> anyhow::Result<Direct> {
        let name = format!("sp-egress-bench-{:08x}", rand::random::<u32>());
        docker(&["network", "create", &name])?;
        let gateway = docker(&["network", "inspect", "-f", "{{(index .IPAM.Config 0).Gateway}}", &name])?;
        docker(&["run", "-d", "--name", &name, "--network", &name, tests::BUSYBOX_IMAGE, "sleep", "3600"])?;
        Ok(Direct { name, gateway })
    }

    fn sh(&self, cmd: &str) -> anyhow::Result<String> {
        docker(&["exec", &self.name, "sh", "-c", cmd])
    }
}

impl Drop for Direct {
    fn drop(&mut self) {
        let _ = docker(&["rm", "-f", &self.name]);
        let _ = docker(&["network", "rm", &self.name]);
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _logs = telemetry::trace::init_with("sandpool-egress-bench", None, "warn");
    let (conn, bulk) = server(args.mib / 4).await;
    let extra_toml = format!(
        "[egress.hosts]\n\"bench.test\" = \"127.0.0.1\"\n[egress.policies.bench]\nallow = [\"bench.test:{conn}\", \"bench.test:{bulk}\"]\n\
         [templates.bbe]\nimage = \"{}\"\nworkdir = \"/work\"\nmemory_mb = 256\ncpus = 1.0\nwarm = 1\negress = \"bench\"\n",
        tests::BUSYBOX_IMAGE
    );
    let stack = Stack::start(StackOpts { warm: 0, extra_toml, ..Default::default() }).await;
    stack.wait_idle("bbe", 1, Duration::from_secs(120)).await;
    let c = stack.client("bench");
    let sid = c.create("bbe").await["session_id"].as_str().unwrap_or_default().to_string();
    let sh = |cmd: String| {
        let c = c.clone();
        let sid = sid.clone();
        async move {
            let r = c.sh(&sid, &cmd).await;
            anyhow::ensure!(r["exit_code"] == 0, "{cmd}: {r}");
            Ok::<String, anyhow::Error>(r["stdout"].as_str().unwrap_or_default().to_string())
        }
    };
    let direct = Direct::start()?;
    // The stand-in address of the server's name: connections to it skip the DNS.
    let stand_in = sh("nslookup bench.test | awk '/^Address/ {a=$NF} END {print a}'".into()).await?.trim().to_string();
    anyhow::ensure!(stand_in.starts_with("198.18."), "nslookup bench.test answered {stand_in:?}");

    let (mut d, mut by_name, mut by_addr) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.batches {
        d.push(per_conn_ms(&direct.sh(&conn_loop(&direct.gateway, conn, args.conns))?, args.conns)?);
        by_addr.push(per_conn_ms(&sh(conn_loop(&stand_in, conn, args.conns)).await?, args.conns)?);
        by_name.push(per_conn_ms(&sh(conn_loop("bench.test", conn, args.conns)).await?, args.conns)?);
    }

    // Bulk: four transfers of mib/4 each per path; this process's CPU during each.
    let quarter = args.mib / 4;
    let fetch = |host: &str| format!("for i in 1 2 3 4; do nc {host} {bulk} </dev/null | wc -c; done");
    let t0 = cpu_time();
    let got = direct.sh(&fetch(&direct.gateway))?;
    let cpu_direct = cpu_time() - t0;
    let t1 = cpu_time();
    let got_proxy = sh(fetch(&stand_in)).await?;
    let cpu_proxy = cpu_time() - t1;
    let bytes = |out: &str| out.split_whitespace().filter_map(|x| x.parse::<u64>().ok()).sum::<u64>();
    anyhow::ensure!(
        bytes(&got) == bytes(&got_proxy) && bytes(&got) == (quarter * 4) as u64 * (1 << 20),
        "{got} / {got_proxy}"
    );
    c.delete(&sid).await;
    stack.shutdown().await;

    let (md, ma, mn) = (median(d), median(by_addr), median(by_name));
    println!(
        "{} batches of {} connections each, alternating; medians of the batches' ms per connection (nc spawn included):\n",
        args.batches, args.conns
    );
    println!("| path | ms per connection | added by egress |");
    println!("|---|---|---|");
    println!("| plain bridge, straight to the server (baseline) | {md:.2} | |");
    println!("| egress, to the stand-in address (proxy, policy check) | {ma:.2} | +{:.2} |", ma - md);
    println!("| egress, by name (node DNS, then proxy) | {mn:.2} | +{:.2} |", mn - md);
    let mib = (quarter * 4) as f64;
    println!(
        "\nbulk: {mib:.0} MiB per path; this process's CPU: direct {:.0} ms, through the proxy {:.0} ms",
        cpu_direct.as_secs_f64() * 1e3,
        cpu_proxy.as_secs_f64() * 1e3
    );
    println!(
        "proxy CPU per MiB relayed: {:.3} ms (the difference over {mib:.0} MiB)",
        (cpu_proxy.as_secs_f64() - cpu_direct.as_secs_f64()) * 1e3 / mib
    );
    Ok(())
}

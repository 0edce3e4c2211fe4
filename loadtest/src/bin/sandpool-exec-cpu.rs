//! sandpool-exec-cpu: what one `exec true` costs the sandbox, in its cgroup's CPU time.
//!
//! Runs the static agent as PID 1 of a container shaped like a sandbox (the template's image,
//! runtime, CPU limit and user), speaks frames to it over the attach stdio as the node does,
//! and reads the container's cgroup CPU usage (`cpuacct.usage` on cgroup v1, `cpu.stat`'s
//! `usage_usec` on v2) around `--execs` sequential `exec true`. Several agent builds
//! (`--agent LABEL=PATH`, e.g. main's copy and the branch's) take turns, one container each
//! per round, so an A/B sees the same machine at the same moments. CPU time of the cgroup is
//! not wall time: a loaded machine stretches the latencies, far less the CPU figure. Each
//! container also measures the floor: a shell in it forking and exec'ing `/bin/true` as
//! often, less the shell loop's own cost.
//!
//!     cargo run --release -p loadtest --bin sandpool-exec-cpu -- \
//!         --agent main=target/ab-main/sandpool-agent \
//!         --agent new=target/agent-build/x86_64-unknown-linux-gnu/agent/sandpool-agent

use std::io::{BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use agent_proto::{ExecSpec, Frame, Kind, PROTOCOL_VERSION};
use anyhow::{Context, bail};
use clap::Parser;
use loadtest::Samples;

#[derive(Parser)]
struct Args {
    /// An agent build to measure, as LABEL=PATH (a static executable); repeat for an A/B.
    #[arg(long, required = true)]
    agent: Vec<String>,
    /// Rounds; each runs one container per agent build, in turn.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Measured `exec true` per container (after `--warmup` unmeasured ones).
    #[arg(long, default_value_t = 500)]
    execs: usize,
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    #[arg(long, default_value = "sandpool/busybox:latest")]
    image: String,
    /// OCI runtime: runc, or runsc for gVisor.
    #[arg(long, default_value = "runc")]
    runtime: String,
    /// CPU limit (the default template's).
    #[arg(long, default_value_t = 0.5)]
    cpus: f64,
    /// The user tenant code runs as (the default template's); "root" for none.
    #[arg(long, default_value = "1000:1000")]
    user: String,
}

/// A container running one agent build as PID 1, spoken to over its stdio.
struct Sandbox {
    name: String,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The container's init, on the host (its cgroup is the container's).
    pid: u32,
    next_id: u32,
}

impl Sandbox {
    fn start(args: &Args, agent: &str, label: &str) -> anyhow::Result<Sandbox> {
        let name = format!("sandpool-exec-cpu-{}-{label}", std::process::id());
        let agent = std::fs::canonicalize(agent).with_context(|| format!("find agent {agent}"))?;
        let mut cmd = Command::new("docker");
        cmd.args(["run", "-i", "--rm", "--name", &name, "--label", "sandpool-exec-cpu=1", "--network", "none"])
            .args(["--runtime", &args.runtime, "--cpus", &args.cpus.to_string(), "--memory", "256m"])
            .args(["--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--user", "0:0", "--log-driver", "none"])
            .arg("-v")
            .arg(format!("{}:/.sandpool/agent:ro", agent.display()))
            .args(["--entrypoint", "/.sandpool/agent"]);
        if args.user != "root" {
            for cap in ["SETUID", "SETGID", "CHOWN", "KILL"] {
                cmd.args(["--cap-add", cap]);
            }
        }
        cmd.arg(&args.image);
        if args.user != "root" {
            cmd.args(["--user", &args.user, "--workdir", "/"]);
        }
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn()?;
        let stdin = child.stdin.take().context("stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("stdout")?);
        let mut sb = Sandbox { name, child, stdin, stdout, pid: 0, next_id: 1 };
        let hello = sb.frame()?;
        if hello.kind != Kind::Hello {
            bail!("the agent said {:?} first", hello.kind);
        }
        let version = agent_proto::Dec::new(&hello.payload).u32()?;
        if version > PROTOCOL_VERSION {
            bail!("agent speaks protocol {version}, this bench {PROTOCOL_VERSION}");
        }
        let out = Command::new("docker").args(["inspect", "-f", "{{.State.Pid}}", &sb.name]).output()?;
        let pid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().context("container pid")?;
        sb.pid = pid;
        Ok(sb)
    }

    fn cpu(&self) -> anyhow::Result<Duration> {
        tests::cgroup_cpu_usage(self.pid).context("read the container's CPU usage")
    }

    fn frame(&mut self) -> anyhow::Result<Frame> {
        Frame::read_from(&mut self.stdout)?.context("the agent's stdout ended")
    }

    /// One `exec true`, waited for; its round trip.
    fn exec_true(&mut self) -> anyhow::Result<Duration> {
        self.exec(&["true"])
    }

    /// One command, waited for; its round trip.
    fn exec(&mut self, argv: &[&str]) -> anyhow::Result<Duration> {
        let id = self.next_id;
        self.next_id += 1;
        let argv = argv.iter().map(|a| a.to_string()).collect();
        let spec = ExecSpec { argv, timeout_ms: 600_000, ..ExecSpec::default() };
        let started = Instant::now();
        self.stdin.write_all(&Frame::new(Kind::Exec, id, spec.encode()).encode())?;
        self.stdin.flush()?;
        loop {
            let f = self.frame()?;
            match f.kind {
                Kind::Exit if f.id == id => return Ok(started.elapsed()),
                Kind::Error if f.id == id => {
                    bail!("exec failed: {:?}", agent_proto::ErrorInfo::decode(&f.payload)?)
                }
                _ => {}
            }
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rm", "-f", &self.name]).stdout(Stdio::null()).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let agents: Vec<(String, String)> = args
        .agent
        .iter()
        .map(|a| a.split_once('=').map(|(l, p)| (l.to_string(), p.to_string())).context("--agent takes LABEL=PATH"))
        .collect::<anyhow::Result<_>>()?;
    println!(
        "sandbox CPU per `exec true`: {} x {} execs, image {}, runtime {}, cpus {}, user {}",
        args.rounds, args.execs, args.image, args.runtime, args.cpus, args.user
    );
    let mut per_exec: Vec<Vec<f64>> = vec![Vec::new(); agents.len()];
    let mut floors = Vec::new();
    for round in 1..=args.rounds {
        for (i, (label, path)) in agents.iter().enumerate() {
            let mut sb = Sandbox::start(&args, path, label)?;
            for _ in 0..args.warmup {
                sb.exec_true()?;
            }
            let mut latency = Samples::default();
            let before = sb.cpu()?;
            for _ in 0..args.execs {
                latency.push(sb.exec_true()?);
            }
            let cpu = sb.cpu()?.saturating_sub(before);
            let us = cpu.as_secs_f64() * 1e6 / args.execs as f64;
            per_exec[i].push(us);
            // The floor: the same number of `/bin/true` forked and exec'd by a shell in the
            // same container (less its loop's own cost, measured alone).
            let n = args.execs.to_string();
            let before = sb.cpu()?;
            sb.exec(&["sh", "-c", "i=0; while [ $i -lt $0 ]; do /bin/true; i=$((i+1)); done", &n])?;
            let spawns = sb.cpu()?.saturating_sub(before);
            let before = sb.cpu()?;
            sb.exec(&["sh", "-c", "i=0; while [ $i -lt $0 ]; do i=$((i+1)); done", &n])?;
            let looping = sb.cpu()?.saturating_sub(before);
            let floor = spawns.saturating_sub(looping).as_secs_f64() * 1e6 / args.execs as f64;
            floors.push(floor);
            let s = latency.summary();
            println!(
                "round {round} {label:>8}: {us:7.1} us CPU/exec; round trip p50 {:.2} ms p99 {:.2} ms; \
                 shell fork+exec of /bin/true {floor:.1} us",
                s.p50_ms, s.p99_ms
            );
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&per_exec[0]);
    for ((label, _), v) in agents.iter().zip(&per_exec) {
        let m = median(v);
        println!("median {label:>8}: {m:7.1} us CPU/exec ({:.2}x {})", m / base, agents[0].0);
    }
    println!("median shell fork+exec of /bin/true: {:.1} us", median(&floors));
    Ok(())
}

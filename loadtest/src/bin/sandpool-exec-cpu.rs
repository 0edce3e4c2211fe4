//! sandpool-exec-cpu: what one `exec true` costs the sandbox, in its cgroup's CPU time.
//!
//! Runs the static agent as PID 1 of a container shaped like a sandbox (the template's image,
//! runtime, CPU limit and user), speaks frames to it over the attach stdio as the node does,
//! and reads the container's cgroup CPU usage (`cpuacct.usage` on cgroup v1, `cpu.stat`'s
//! `usage_usec` on v2) around `--execs` sequential `exec true`. Several agent builds
//! (`--agent LABEL=PATH`, e.g. main's copy and the branch's) take turns, one container each
//! per round, so an A/B sees the same machine at the same moments. CPU time of the cgroup is
//! not wall time: a loaded machine stretches the latencies, far less the CPU figure. Each
//! container also measures a shell in it forking and exec'ing the program as often, less the
//! shell loop's own cost (a reference, not a floor: the shell's `fork` copies its page tables,
//! which the agent's `clone(CLONE_VM | CLONE_VFORK)` does not).
//!
//! Every round measures two programs: the image's `true` (busybox, statically linked with
//! glibc: its exec and start cost ~0.14 ms more than the next one's) and a 129-byte static
//! executable with no libc that only calls `exit(0)`, mounted into the container: the cost of
//! a spawn itself, so what the agent adds is told apart from what the program costs.
//! `--cpuset` keeps the container to some CPUs, to tell the cost of wake-ups between CPUs.
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
    /// Keeps the whole container to these CPUs (`docker run --cpuset-cpus`), e.g. "1": what
    /// the cross-CPU wake-ups of an exec cost, against a container the kernel spreads.
    #[arg(long)]
    cpuset: Option<String>,
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

/// Where the bare `true` is mounted in the container.
const BARE_TRUE: &str = "/.sandpool-bench/true";

/// The programs each round measures: a label and the path the agent and the shell run.
const PROGRAMS: [(&str, &str); 2] = [("busybox true", "/bin/true"), ("bare exit(0)", BARE_TRUE)];

/// A static x86-64 Linux executable with no libc whose whole program is `exit(0)`: an ELF
/// header, one loadable segment (itself) and three instructions.
fn bare_true_elf() -> Vec<u8> {
    const BASE: u64 = 0x40_0000;
    const EHDR: u16 = 64;
    const PHDR: u16 = 56;
    // mov eax, 60 (exit); xor edi, edi; syscall
    const CODE: [u8; 9] = [0xb8, 0x3c, 0, 0, 0, 0x31, 0xff, 0x0f, 0x05];
    let size = (EHDR + PHDR) as u64 + CODE.len() as u64;
    let mut elf = Vec::with_capacity(size as usize);
    elf.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]); // 64-bit, LSB, v1
    elf.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    elf.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    elf.extend_from_slice(&1u32.to_le_bytes());
    elf.extend_from_slice(&(BASE + (EHDR + PHDR) as u64).to_le_bytes()); // entry: the code
    elf.extend_from_slice(&(EHDR as u64).to_le_bytes()); // program headers right after
    elf.extend_from_slice(&0u64.to_le_bytes()); // no section headers
    elf.extend_from_slice(&0u32.to_le_bytes());
    for field in [EHDR, PHDR, 1, 64, 0, 0] {
        elf.extend_from_slice(&field.to_le_bytes());
    }
    elf.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    elf.extend_from_slice(&5u32.to_le_bytes()); // read + execute
    elf.extend_from_slice(&0u64.to_le_bytes()); // from the file's start
    for field in [BASE, BASE, size, size, 0x1000] {
        elf.extend_from_slice(&field.to_le_bytes());
    }
    elf.extend_from_slice(&CODE);
    elf
}

impl Sandbox {
    fn start(args: &Args, agent: &str, label: &str, bare_true: &std::path::Path) -> anyhow::Result<Sandbox> {
        let name = format!("sandpool-exec-cpu-{}-{label}", std::process::id());
        let agent = std::fs::canonicalize(agent).with_context(|| format!("find agent {agent}"))?;
        let mut cmd = Command::new("docker");
        cmd.args(["run", "-i", "--rm", "--name", &name, "--label", "sandpool-exec-cpu=1", "--network", "none"])
            .args(["--runtime", &args.runtime, "--cpus", &args.cpus.to_string(), "--memory", "256m"])
            .args(["--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--user", "0:0", "--log-driver", "none"])
            .arg("-v")
            .arg(format!("{}:/.sandpool/agent:ro", agent.display()))
            .arg("-v")
            .arg(format!("{}:{BARE_TRUE}:ro", bare_true.display()))
            .args(["--entrypoint", "/.sandpool/agent"]);
        if let Some(cpus) = &args.cpuset {
            cmd.args(["--cpuset-cpus", cpus]);
        }
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
        "sandbox CPU per exec: {} x {} execs, image {}, runtime {}, cpus {}, user {}, cpuset {}",
        args.rounds,
        args.execs,
        args.image,
        args.runtime,
        args.cpus,
        args.user,
        args.cpuset.as_deref().unwrap_or("all")
    );
    let bare_true = std::env::temp_dir().join(format!("sandpool-exec-cpu-true-{}", std::process::id()));
    std::fs::write(&bare_true, bare_true_elf()).context("write the bare true")?;
    std::fs::set_permissions(&bare_true, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let measured = measure(&args, &agents, &bare_true);
    let _ = std::fs::remove_file(&bare_true);
    let (per_exec, floors) = measured?;

    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (p, (program, _)) in PROGRAMS.iter().enumerate() {
        let floor = median(&floors[p]);
        println!("{program}: median shell fork+exec {floor:.1} us");
        let base = median(&per_exec[0][p]);
        for ((label, _), runs) in agents.iter().zip(&per_exec) {
            let m = median(&runs[p]);
            println!(
                "  median {label:>8}: {m:7.1} us CPU/exec ({:.2}x {}; {:+.1} us over the floor)",
                m / base,
                agents[0].0,
                m - floor
            );
        }
    }
    Ok(())
}

/// Per agent, per program, the CPU per exec of each round (us); per program, each container's
/// floor (us).
type Measured = (Vec<[Vec<f64>; 2]>, [Vec<f64>; 2]);

fn measure(args: &Args, agents: &[(String, String)], bare_true: &std::path::Path) -> anyhow::Result<Measured> {
    let mut per_exec: Vec<[Vec<f64>; 2]> = vec![Default::default(); agents.len()];
    let mut floors: [Vec<f64>; 2] = Default::default();
    let n = args.execs.to_string();
    for round in 1..=args.rounds {
        for (i, (label, path)) in agents.iter().enumerate() {
            let mut sb = Sandbox::start(args, path, label, bare_true)?;
            for (p, (program, argv0)) in PROGRAMS.iter().enumerate() {
                for _ in 0..args.warmup {
                    sb.exec(&[argv0])?;
                }
                let mut latency = Samples::default();
                let before = sb.cpu()?;
                for _ in 0..args.execs {
                    latency.push(sb.exec(&[argv0])?);
                }
                let cpu = sb.cpu()?.saturating_sub(before);
                let us = cpu.as_secs_f64() * 1e6 / args.execs as f64;
                per_exec[i][p].push(us);
                // The floor: as many forked and exec'd by a shell in the same container (less
                // its loop's own cost, measured alone).
                let before = sb.cpu()?;
                sb.exec(&["sh", "-c", "i=0; while [ $i -lt $0 ]; do $1; i=$((i+1)); done", &n, argv0])?;
                let spawns = sb.cpu()?.saturating_sub(before);
                let before = sb.cpu()?;
                sb.exec(&["sh", "-c", "i=0; while [ $i -lt $0 ]; do i=$((i+1)); done", &n])?;
                let looping = sb.cpu()?.saturating_sub(before);
                let floor = spawns.saturating_sub(looping).as_secs_f64() * 1e6 / args.execs as f64;
                floors[p].push(floor);
                let s = latency.summary();
                println!(
                    "round {round} {label:>8} {program}: {us:7.1} us CPU/exec; round trip p50 {:.2} ms \
                     p99 {:.2} ms; shell fork+exec {floor:.1} us",
                    s.p50_ms, s.p99_ms
                );
            }
        }
    }
    Ok((per_exec, floors))
}

//! `docker exec` for docker-exec templates, with the timeout that kills the command's tree.

use std::collections::HashMap;

use bollard::models::ExecConfig;
use futures::StreamExt;

use super::*;

impl Dock {
    /// Runs a command through `docker exec`, collecting at most `max_output` bytes of each
    /// stream. Returns (exit code, stdout, stderr, stdout cut, stderr cut, timed out).
    pub async fn exec(&self, container: &str, req: DockerExec) -> anyhow::Result<DockerExecOutcome> {
        use bollard::exec::StartExecResults;
        use tokio::io::AsyncWriteExt;
        let program = req.argv.first().cloned().unwrap_or_default();
        let cfg = ExecConfig {
            attach_stdin: Some(req.stdin.is_some()),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            cmd: Some(req.argv),
            env: Some(req.env),
            working_dir: req.cwd,
            user: req.user,
            ..Default::default()
        };
        let exec = timed("create exec", self.docker.create_exec(container, cfg)).await?;
        let started = timed("start exec", self.docker.start_exec(&exec.id, None)).await?;
        let StartExecResults::Attached { mut output, mut input } = started else {
            anyhow::bail!("start exec: not attached");
        };
        let stdin = req.stdin;
        let feed = async move {
            if let Some(data) = stdin {
                let _ = input.write_all(&data).await;
            }
            let _ = input.shutdown().await;
        };
        let max = req.max_output;
        let collect = async {
            let mut out = DockerExecOutcome::default();
            while let Some(item) = output.next().await {
                let (buf, cut, msg) = match item? {
                    bollard::container::LogOutput::StdOut { message } => {
                        (&mut out.stdout, &mut out.stdout_truncated, message)
                    }
                    bollard::container::LogOutput::StdErr { message } => {
                        (&mut out.stderr, &mut out.stderr_truncated, message)
                    }
                    _ => continue,
                };
                let room = max.saturating_sub(buf.len());
                buf.extend_from_slice(&msg[..room.min(msg.len())]);
                *cut |= msg.len() > room;
            }
            anyhow::Ok(out)
        };
        let run = async { tokio::join!(feed, collect).1 };
        let mut outcome = match tokio::time::timeout(req.timeout, run).await {
            Ok(r) => r?,
            Err(_) => {
                // Docker has no exec kill: kill the exec's process tree from the host.
                match timed("inspect exec", self.docker.inspect_exec(&exec.id)).await {
                    // Only a running exec's pid, and only processes in this container's
                    // cgroup: an exec that ended may have left its pid to an unrelated
                    // host process by now.
                    Ok(info) if info.running == Some(true) => {
                        if let Some(pid) = info.pid {
                            kill_tree(pid as i32, container);
                        }
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(container, error = %e, "timed-out exec not killed"),
                }
                DockerExecOutcome { timed_out: true, exit_code: 137, ..Default::default() }
            }
        };
        if !outcome.timed_out {
            let info = timed("inspect exec", self.docker.inspect_exec(&exec.id)).await?;
            outcome.exit_code = info.exit_code.unwrap_or(-1) as i32;
            runtime_refusal_as_shell(&mut outcome, &program);
        }
        Ok(outcome)
    }
}

/// When the OCI runtime cannot start the program, Docker answers 126 with its own message on
/// stdout. Answer as a shell (and the agent) does: 127 for a program that does not exist, 126
/// for one that cannot run, and a short message on stderr.
fn runtime_refusal_as_shell(outcome: &mut DockerExecOutcome, program: &str) {
    const OCI: &[u8] = b"OCI runtime exec failed";
    if outcome.exit_code != 126 || !outcome.stdout.starts_with(OCI) {
        return;
    }
    let text = String::from_utf8_lossy(&outcome.stdout);
    let (code, why) = if text.contains("not found") || text.contains("no such file") {
        (127, "not found")
    } else {
        (126, "cannot execute")
    };
    outcome.exit_code = code;
    outcome.stdout.clear();
    outcome.stderr = format!("{program}: {why}\n").into_bytes();
}

/// Whether host process `pid` belongs to `container` (its cgroup path names the container's
/// id, under Docker's cgroupfs and systemd drivers alike).
pub(super) fn in_container(pid: i32, container: &str) -> bool {
    !container.is_empty()
        && std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|cg| cg.contains(container))
}

/// SIGKILLs a host process of `container` and all its descendants in that container
/// (docker-exec mode timeouts, runc only). A pid not in the container is left alone.
fn kill_tree(root: i32, container: &str) {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
            // Fields after the last ')' (the command may contain spaces): state ppid ...
            let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { continue };
            if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|p| p.parse::<i32>().ok()) {
                children.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut stack = vec![root];
    while let Some(pid) = stack.pop() {
        if !in_container(pid, container) {
            continue;
        }
        // SAFETY: kill(2) with a concrete pid and SIGKILL has no memory-safety preconditions.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
        stack.extend(children.get(&pid).into_iter().flatten());
    }
}

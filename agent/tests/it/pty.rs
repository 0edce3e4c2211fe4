//! Commands on pseudo-terminals: sizing, an interactive shell, resize, Ctrl-C and signals.

use std::time::{Duration, Instant};

use agent_proto::{ExecSpec, Kind, codes};

use crate::support::{Agent, WAIT, dead, ended, error_of, eventually, sh, spec, stdout_of};

const SIGINT: u32 = 2;
const SIGHUP: u32 = 1;
const SIGKILL: u32 = 9;

fn on_pty(s: ExecSpec, rows: u16, cols: u16) -> ExecSpec {
    ExecSpec { pty_rows: rows, pty_cols: cols, ..s }
}

/// The prompt of `shell()`.
const PROMPT: &str = "sp-prompt> ";

/// An interactive shell on a 24 x 80 terminal, in `/`.
fn shell() -> ExecSpec {
    let env = vec![("PS1".to_string(), PROMPT.to_string())];
    ExecSpec { cwd: "/".into(), timeout_ms: 60_000, env, ..on_pty(spec(&["sh"]), 24, 80) }
}

/// Starts `s` (a `shell()`) and waits for its first prompt, so that what is typed next is not
/// echoed ahead of it.
fn start_shell(agent: &mut Agent, s: &ExecSpec) -> u32 {
    let id = agent.start_exec(s);
    agent.wait_stdout(id, "the first prompt", |out| out.ends_with(PROMPT));
    id
}

/// The output's lines, without the terminal's carriage returns.
fn lines(out: &str) -> Vec<&str> {
    out.split('\n').map(|l| l.trim_end_matches('\r')).collect()
}

/// Types `line` into shell `id` at its prompt and waits for the next prompt, after a line that
/// is exactly `want`. The output since typing starts with the terminal's echo of `line`, so a
/// command that prints nothing passes itself as `want`. Returns that output.
fn run_line(agent: &mut Agent, id: u32, line: &str, want: &str) -> String {
    let before = stdout_of(&agent.frames_now(id)).len();
    agent.send(Kind::Stdin, id, format!("{line}\n").as_bytes());
    let out = agent.wait_stdout(id, &format!("{want:?} after {line:?}"), |out| {
        let new = out.get(before..).unwrap_or("");
        lines(new).contains(&want) && new.ends_with(PROMPT)
    });
    out[before..].to_string()
}

/// Does `act` and waits for shell `id` to prompt again.
fn then_prompt(agent: &mut Agent, id: u32, what: &str, act: impl FnOnce(&mut Agent)) {
    let before = stdout_of(&agent.frames_now(id)).len();
    act(agent);
    agent.wait_stdout(id, &format!("a prompt after {what}"), |out| {
        out.get(before..).is_some_and(|new| new.ends_with(PROMPT))
    });
}

/// `(pid, pgrp, session, tpgid, comm)` of every process on the machine.
fn processes() -> Vec<(i32, i32, i32, i32, String)> {
    let mut all = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let comm = stat[open + 1..close].to_string();
        let f: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // state ppid pgrp session tty_nr tpgid
        let num = |i: usize| f.get(i).and_then(|v| v.parse().ok()).unwrap_or(-1);
        all.push((pid, num(2), num(3), num(5), comm));
    }
    all
}

/// Whether `sleep` runs as the foreground job of session `sid`.
fn sleeping_in_foreground(sid: i32) -> bool {
    processes().iter().any(|(_, pgrp, session, tpgid, comm)| *session == sid && comm == "sleep" && pgrp == tpgid)
}

/// The shell's pid, which is its session id.
fn shell_pid(agent: &mut Agent, id: u32) -> i32 {
    let before = stdout_of(&agent.frames_now(id)).len();
    agent.send(Kind::Stdin, id, b"echo pid=$$\n");
    let out = agent.wait_stdout(id, "the shell's pid", |out| {
        out.get(before..).unwrap_or("").ends_with(PROMPT) && lines(out).iter().any(|l| l.starts_with("pid="))
    });
    lines(&out).iter().find_map(|l| l.strip_prefix("pid=")).unwrap().parse().unwrap()
}

#[test]
fn stty_size_tty_and_term() {
    let mut agent = Agent::start();
    let out = agent.exec(&on_pty(spec(&["stty", "size"]), 33, 101));
    assert_eq!(out.stdout_str(), "33 101\r\n");
    assert_eq!(out.exit.exit_code, 0);

    let out = agent.exec(&on_pty(spec(&["tty"]), 24, 80));
    assert!(out.stdout_str().starts_with("/dev/pts/"), "{:?}", out.stdout_str());
    assert_eq!(out.exit.exit_code, 0);

    // One terminal for both streams: everything is stdout.
    let out = agent.exec(&on_pty(sh("echo out; echo err >&2; exit 4"), 24, 80));
    assert_eq!(out.stdout_str(), "out\r\nerr\r\n");
    assert!(out.stderr.is_empty());
    assert_eq!(out.exit.exit_code, 4);

    let out = agent.exec(&on_pty(sh("echo $TERM"), 24, 80));
    assert_eq!(out.stdout_str(), "xterm-256color\r\n");
    let dumb = ExecSpec { env: vec![("TERM".into(), "dumb".into())], ..on_pty(sh("echo $TERM"), 24, 80) };
    assert_eq!(agent.exec(&dumb).stdout_str(), "dumb\r\n");

    // A command that is not found fails the same way as on pipes.
    let id = agent.start_exec(&on_pty(spec(&["sandpool-no-such-command"]), 24, 80));
    assert_eq!(error_of(&agent.finish(id)).unwrap().code, codes::NOT_FOUND);

    // Output written just before exit is all there, for many terminals at once.
    let ids: Vec<u32> = (0..16).map(|_| agent.start_exec(&on_pty(sh("head -c 200000 /dev/zero"), 24, 80))).collect();
    for id in ids {
        let out = agent.exec_result(id);
        assert_eq!(out.stdout.len(), 200_000);
        assert!(!out.exit.stdout_truncated);
    }
}

#[test]
fn interactive_shell_keeps_state_and_resizes() {
    let mut agent = Agent::start();
    let id = start_shell(&mut agent, &shell());
    run_line(&mut agent, id, "cd /tmp", "cd /tmp");
    run_line(&mut agent, id, "pwd", "/tmp");
    run_line(&mut agent, id, "export SP_X=kept", "export SP_X=kept");
    run_line(&mut agent, id, "echo \"x=$SP_X\"", "x=kept");

    run_line(&mut agent, id, "stty size", "24 80");
    agent.resize(id, 50, 132);
    run_line(&mut agent, id, "stty size", "50 132");

    agent.send(Kind::Stdin, id, b"exit 3\n");
    let out = agent.exec_result(id);
    assert_eq!(out.exit.exit_code, 3);
    assert!(lines(&out.stdout_str()).contains(&"/tmp"), "{:?}", out.stdout_str());
    // Resizes and input for a finished exec are dropped.
    agent.resize(id, 10, 10);
    agent.send(Kind::Stdin, id, b"late\n");
    agent.ping();
}

#[test]
fn ctrl_c_and_signals_reach_the_foreground_job() {
    let mut agent = Agent::start();
    let id = start_shell(&mut agent, &shell());
    let sid = shell_pid(&mut agent, id);
    let started = Instant::now();

    // Ctrl-C typed into the terminal: the line discipline sends SIGINT to the foreground job.
    agent.send(Kind::Stdin, id, b"sleep 100\n");
    eventually("sleep to run in the foreground", || sleeping_in_foreground(sid));
    then_prompt(&mut agent, id, "Ctrl-C", |a| a.send(Kind::Stdin, id, b"\x03"));
    run_line(&mut agent, id, "echo rc=$?", "rc=130");

    // A SIGINT frame does the same.
    agent.send(Kind::Stdin, id, b"sleep 100\n");
    eventually("sleep to run in the foreground again", || sleeping_in_foreground(sid));
    then_prompt(&mut agent, id, "SIGINT", |a| a.signal(id, SIGINT));
    run_line(&mut agent, id, "echo rc2=$?", "rc2=130");
    assert!(started.elapsed() < WAIT, "took {:?}", started.elapsed());

    // The shell is alive, and a SIGINT at its prompt does not end it.
    then_prompt(&mut agent, id, "SIGINT at the prompt", |a| a.signal(id, SIGINT));
    run_line(&mut agent, id, "echo alive", "alive");
    // A hang-up ends it.
    agent.signal(id, SIGHUP);
    let out = agent.exec_result(id);
    assert_eq!(out.exit.exit_code, 128 + SIGHUP as i32);
}

#[test]
fn kill_and_timeout_end_every_job_of_the_terminal() {
    let mut agent = Agent::start();
    for by_timeout in [false, true] {
        let s = if by_timeout { ExecSpec { timeout_ms: 1500, ..shell() } } else { shell() };
        let id = start_shell(&mut agent, &s);
        let sid = shell_pid(&mut agent, id);
        // A background job and a foreground one, each in a process group of its own.
        agent.send(Kind::Stdin, id, b"sleep 101 &\n");
        agent.send(Kind::Stdin, id, b"sleep 102\n");
        eventually("sleep to run in the foreground", || sleeping_in_foreground(sid));
        let in_session: Vec<i32> = processes().iter().filter(|p| p.2 == sid).map(|p| p.0).collect();
        let groups: std::collections::HashSet<i32> = processes().iter().filter(|p| p.2 == sid).map(|p| p.1).collect();
        assert!(in_session.len() >= 3 && groups.len() >= 3, "{in_session:?} {groups:?}");
        if !by_timeout {
            agent.signal(id, SIGKILL);
        }
        let out = agent.exec_result(id);
        assert_eq!(out.exit.exit_code, 128 + SIGKILL as i32);
        assert_eq!(out.exit.timed_out, by_timeout);
        for pid in in_session {
            eventually(&format!("{pid} of the terminal's session to die"), || dead(pid as u32));
        }
    }
}

#[test]
fn background_job_holding_the_terminal_does_not_delay_exit() {
    let mut agent = Agent::start();
    let started = Instant::now();
    let out = agent.exec(&on_pty(sh("sleep 30 & echo $!"), 24, 80));
    assert_eq!(out.exit.exit_code, 0);
    assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
    let pid: u32 = out.stdout_str().trim().parse().unwrap();
    let _ = std::process::Command::new("kill").arg(pid.to_string()).status();
}

#[test]
fn bad_terminal_requests() {
    let mut agent = Agent::start();
    for (rows, cols) in [(24, 0), (0, 80)] {
        let id = agent.start_exec(&on_pty(spec(&["true"]), rows, cols));
        let err = error_of(&agent.finish(id)).unwrap();
        assert_eq!(err.code, codes::BAD_REQUEST);
        assert!(err.message.contains("pty_rows"), "{err:?}");
    }
    // Resizing a command without a terminal, or an unknown id, or with a zero or short size:
    // ignored.
    let id = agent.start_exec(&sh("sleep 0.3; echo done"));
    agent.resize(id, 30, 90);
    agent.send(Kind::Resize, id, &[1, 0]);
    agent.resize(9999, 30, 90);
    let frames = agent.wait_frames(id, "the command to end", ended);
    assert_eq!(frames.iter().filter(|f| f.kind == Kind::Error).count(), 0);
    agent.ping();
}

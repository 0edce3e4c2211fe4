//! Flow-controlled execs (`ExecFlow`): output credit and the stdin window.

use std::time::Duration;

use agent_proto::{ExecSpec, Kind, MAX_CHUNK, STDIN_WINDOW};

use crate::support::{Agent, acks_of, bytes_of, ended, noise, sh, spec};

/// How long a stalled command is watched to see that nothing more arrives. A negative check
/// cannot be an `eventually`; this is long enough for `head` to write megabytes if unblocked.
const STALL_WATCH: Duration = Duration::from_millis(300);

/// Grants credit as output arrives, keeping `window` bytes ahead, until the request ends.
fn grant_until_end(agent: &mut Agent, id: u32, mut granted: usize, window: usize) {
    loop {
        let frames = agent.wait_frames(id, "output or the end", |f| {
            ended(f) || bytes_of(f, Kind::Stdout) + bytes_of(f, Kind::Stderr) + window > granted
        });
        if ended(&frames) {
            return;
        }
        let used = bytes_of(&frames, Kind::Stdout) + bytes_of(&frames, Kind::Stderr);
        let more = used + window - granted;
        agent.credit(id, more as u32);
        granted += more;
    }
}

#[test]
fn output_stalls_without_credit_and_resumes_with_it() {
    let mut agent = Agent::start();
    const CREDIT: usize = 64 * 1024;
    const TOTAL: usize = 10 << 20;
    let id = agent.start_flow(&sh(&format!("head -c {TOTAL} /dev/zero; echo done >&2")), CREDIT as u32);
    agent.wait_frames(id, "the first credit's worth", |f| bytes_of(f, Kind::Stdout) >= CREDIT);
    std::thread::sleep(STALL_WATCH);
    let frames = agent.frames_now(id);
    assert_eq!(bytes_of(&frames, Kind::Stdout), CREDIT, "more output than credit");
    assert!(!ended(&frames), "the command ran to the end without credit");

    // Credit arrives in small steps, split across frames as it comes.
    agent.credit(id, 1000);
    agent.wait_frames(id, "1000 more bytes", |f| bytes_of(f, Kind::Stdout) == CREDIT + 1000);
    grant_until_end(&mut agent, id, CREDIT + 1000, 1 << 20);
    let out = agent.exec_result(id);
    assert_eq!(out.stdout.len(), TOTAL);
    assert_eq!(out.stderr, b"done\n");
    assert_eq!(out.exit.exit_code, 0);
    assert!(!out.exit.stdout_truncated && !out.exit.stderr_truncated);
}

#[test]
fn one_budget_for_both_streams() {
    let mut agent = Agent::start();
    let id = agent.start_flow(&sh("head -c 300000 /dev/zero & head -c 300000 /dev/zero >&2; wait"), 100_000);
    agent.wait_frames(id, "the credit's worth", |f| bytes_of(f, Kind::Stdout) + bytes_of(f, Kind::Stderr) >= 100_000);
    std::thread::sleep(STALL_WATCH);
    let frames = agent.frames_now(id);
    assert_eq!(bytes_of(&frames, Kind::Stdout) + bytes_of(&frames, Kind::Stderr), 100_000);
    grant_until_end(&mut agent, id, 100_000, 256 * 1024);
    let out = agent.exec_result(id);
    assert_eq!((out.stdout.len(), out.stderr.len()), (300_000, 300_000));
}

#[test]
fn output_held_at_exit_waits_for_credit() {
    let mut agent = Agent::start();
    // Small enough to sit in the pipe: the command exits while its output waits for credit.
    let id = agent.start_flow(&sh("head -c 50000 /dev/zero"), 1000);
    agent.wait_frames(id, "the first 1000 bytes", |f| bytes_of(f, Kind::Stdout) >= 1000);
    // Well past the idle grace for pipes after exit, which must not apply to held output.
    std::thread::sleep(STALL_WATCH * 2);
    let frames = agent.frames_now(id);
    assert_eq!(bytes_of(&frames, Kind::Stdout), 1000);
    assert!(!ended(&frames));
    agent.credit(id, 1 << 20);
    let out = agent.exec_result(id);
    assert_eq!(out.stdout.len(), 50_000);
    assert_eq!(out.exit.exit_code, 0);
    assert!(!out.exit.stdout_truncated);
}

#[test]
fn max_output_still_applies_and_uses_no_credit() {
    let mut agent = Agent::start();
    let s = ExecSpec { max_output: 10_000, ..sh("head -c 1000000 /dev/zero") };
    let id = agent.start_flow(&s, 10_000);
    let out = agent.exec_result(id);
    assert_eq!(out.stdout.len(), 10_000);
    assert!(out.exit.stdout_truncated);
    assert_eq!(out.exit.exit_code, 0);
}

#[test]
fn a_full_stdin_window_does_not_block_other_requests() {
    let mut agent = Agent::start();
    // `cat` gets no output credit, so it soon stops reading its stdin: a whole window of stdin
    // queues up in the agent.
    let id = agent.start_flow(&ExecSpec { has_stdin: true, ..spec(&["cat"]) }, 0);
    let input = noise(STDIN_WINDOW as usize * MAX_CHUNK, 3);
    agent.send_chunks(Kind::Stdin, id, &input);
    // The agent still serves: requests, and credit for this very command.
    agent.ping();
    let out = agent.exec(&spec(&["echo", "still serving"]));
    assert_eq!(out.stdout_str(), "still serving\n");
    let acked = acks_of(&agent.frames_now(id));
    assert!(acked < STDIN_WINDOW, "all {acked} chunks taken without output credit");

    agent.send(Kind::StdinEof, id, &[]);
    grant_until_end(&mut agent, id, 0, 1 << 20);
    let out = agent.exec_result(id);
    assert_eq!(out.exit.exit_code, 0);
    assert_eq!(out.stdin_acks, STDIN_WINDOW);
    assert!(out.stdout == input, "stdout differs from stdin");
}

#[test]
fn stdin_is_acknowledged_even_when_dropped() {
    let mut agent = Agent::start();
    // Started without stdin: chunks are dropped, but still acknowledged.
    let id = agent.start_flow(&sh("sleep 0.5"), 1 << 20);
    for _ in 0..3 {
        agent.send(Kind::Stdin, id, b"ignored");
    }
    let frames = agent.wait_frames(id, "three acks", |f| acks_of(f) == 3);
    assert!(!ended(&frames));
    assert_eq!(agent.exec_result(id).exit.exit_code, 0);

    // A plain exec is never acknowledged, and credit for it is ignored.
    let id = agent.start_exec(&ExecSpec { has_stdin: true, ..spec(&["cat"]) });
    agent.credit(id, 5);
    agent.send(Kind::Stdin, id, b"abc");
    agent.send(Kind::StdinEof, id, &[]);
    let out = agent.exec_result(id);
    assert_eq!((out.stdout.as_slice(), out.stdin_acks), (&b"abc"[..], 0));
    // Credit for an unknown id, or a malformed one: ignored.
    agent.credit(4242, 5);
    agent.send(Kind::Credit, 4242, &[1]);
    agent.ping();
}

#[test]
fn a_terminal_under_flow_control() {
    let mut agent = Agent::start();
    let s = ExecSpec { pty_rows: 24, pty_cols: 80, ..sh("head -c 1000000 /dev/zero") };
    let id = agent.start_flow(&s, 4096);
    agent.wait_frames(id, "the first 4096 bytes", |f| bytes_of(f, Kind::Stdout) >= 4096);
    std::thread::sleep(STALL_WATCH);
    let frames = agent.frames_now(id);
    assert_eq!(bytes_of(&frames, Kind::Stdout), 4096);
    assert!(!ended(&frames));
    grant_until_end(&mut agent, id, 4096, 256 * 1024);
    let out = agent.exec_result(id);
    assert_eq!(out.stdout.len(), 1_000_000);
    assert_eq!(out.exit.exit_code, 0);
}

//! Exec requests against a real agent process.

use std::time::{Duration, Instant};

use agent_proto::{Dec, Enc, ExecSpec, Kind, PROTOCOL_VERSION, ReadSpec, WriteSpec, codes};

use crate::support::{Agent, dead, error_of, eventually, scratch, sh, spec};

#[test]
fn hello_announces_version_and_pid() {
    let agent = Agent::start();
    let frames = agent.finish(0);
    assert_eq!(frames.len(), 1);
    assert_eq!(frames[0].kind, Kind::Hello);
    let mut d = Dec::new(&frames[0].payload);
    assert_eq!(d.u32().unwrap(), PROTOCOL_VERSION);
    assert_eq!(d.u32().unwrap(), agent.pid());
}

#[test]
fn ping_pong() {
    let mut agent = Agent::start();
    agent.ping();
    agent.ping();
}

#[test]
fn a_command_longer_than_a_frame_travels_in_parts() {
    let mut agent = Agent::start();
    // 300,000 characters of shell: five times a frame.
    let script = format!("echo {} | wc -c", "x".repeat(300_000));
    let id = agent.id();
    for f in agent_proto::Frame::new(Kind::Exec, id, sh(&script).encode()).into_parts() {
        agent.send(f.kind, f.id, &f.payload);
    }
    let out = agent.exec_result(id);
    assert_eq!(out.stdout_str().trim(), "300001");
    agent.ping();
}

#[test]
fn a_bad_frame_is_refused_for_its_request_only() {
    let mut agent = Agent::start();
    // Longer than MAX_FRAME, as an old host would have sent a long command.
    let id = agent.id();
    let big = sh(&format!("echo {}", "y".repeat(agent_proto::MAX_FRAME))).encode();
    agent.send(Kind::Exec, id, &big);
    let e = error_of(&agent.finish(id)).expect("refused");
    assert_eq!(e.code, codes::BAD_REQUEST, "{e:?}");
    // An unknown frame kind: the same.
    let id = agent.id();
    let mut raw = 5u32.to_le_bytes().to_vec();
    raw.push(0x7e);
    raw.extend_from_slice(&id.to_le_bytes());
    agent.send_raw(&raw);
    assert!(error_of(&agent.finish(id)).is_some());
    // The agent serves on.
    agent.ping();
    assert_eq!(agent.exec(&sh("echo still here")).stdout_str(), "still here\n");
}

#[test]
fn echo_exit_codes_env_and_cwd() {
    let mut agent = Agent::start();
    let out = agent.exec(&spec(&["echo", "hello", "world"]));
    assert_eq!(out.stdout_str(), "hello world\n");
    assert_eq!(out.exit.exit_code, 0);
    assert!(!out.exit.timed_out && !out.exit.stdout_truncated && !out.exit.stderr_truncated);
    assert!(out.exit.duration_us > 0);

    let out = agent.exec(&sh("echo oops >&2; exit 3"));
    assert_eq!(out.exit.exit_code, 3);
    assert_eq!(out.stderr, b"oops\n");
    assert!(out.stdout.is_empty());

    assert_eq!(agent.exec(&sh("kill -9 $$")).exit.exit_code, 128 + 9);

    let env = ExecSpec { env: vec![("SP_FOO".into(), "bar baz".into())], ..sh("echo \"$SP_FOO\"") };
    assert_eq!(agent.exec(&env).stdout_str(), "bar baz\n");

    let dir = scratch("cwd");
    let cwd = ExecSpec { cwd: dir.to_str().unwrap().into(), ..spec(&["pwd"]) };
    assert_eq!(agent.exec(&cwd).stdout_str(), format!("{}\n", dir.display()));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn spawn_errors_are_reported() {
    let mut agent = Agent::start();
    let id = agent.start_exec(&spec(&["sandpool-no-such-command"]));
    let err = error_of(&agent.finish(id)).unwrap();
    assert_eq!(err.code, codes::NOT_FOUND);
    assert_eq!(err.message, "executable file not found: sandpool-no-such-command");

    // Through std's fork+exec path too (taken when PATH is overridden, and in the static build
    // whenever cwd is set), where std reaps the failed child itself: the reaper must not race it.
    let dir = scratch("spawn-errors");
    for _ in 0..20 {
        let env = vec![("PATH".to_string(), "/usr/bin:/bin".to_string())];
        let s = ExecSpec { cwd: "/".into(), env, ..spec(&["sandpool-no-such-command"]) };
        let id = agent.start_exec(&s);
        assert_eq!(error_of(&agent.finish(id)).unwrap().code, codes::NOT_FOUND);
    }

    let not_exec = dir.join("data.txt");
    std::fs::write(&not_exec, "just data").unwrap();
    let id = agent.start_exec(&spec(&[not_exec.to_str().unwrap()]));
    assert_eq!(error_of(&agent.finish(id)).unwrap().code, codes::PERMISSION_DENIED);

    let s = ExecSpec { cwd: "/sandpool/no/such/dir".into(), ..spec(&["true"]) };
    let id = agent.start_exec(&s);
    let err = error_of(&agent.finish(id)).unwrap();
    assert_eq!(err.code, codes::NOT_FOUND);
    assert!(err.message.contains("working directory"), "{err:?}");

    let id = agent.start_exec(&spec(&[]));
    assert_eq!(error_of(&agent.finish(id)).unwrap().code, codes::BAD_REQUEST);

    // Still serving after all that.
    assert_eq!(agent.exec(&spec(&["true"])).exit.exit_code, 0);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn stdin_is_fed_and_closed() {
    let mut agent = Agent::start();
    let out = agent.exec_with_stdin(&spec(&["cat"]), b"line one\nline two\n");
    assert_eq!(out.stdout, b"line one\nline two\n");
    // Without has_stdin the command reads /dev/null.
    assert_eq!(agent.exec(&spec(&["wc", "-c"])).stdout_str().trim(), "0");
}

#[test]
fn ten_mib_stdin_round_trip() {
    let mut agent = Agent::start();
    let input = crate::support::noise(10 << 20, 7);
    let started = Instant::now();
    let out = agent.exec_with_stdin(&spec(&["cat"]), &input);
    assert_eq!(out.exit.exit_code, 0);
    assert_eq!(out.stdout.len(), input.len());
    assert!(out.stdout == input, "stdout differs from stdin");
    assert!(started.elapsed() < Duration::from_secs(20));
    let out = agent.exec_with_stdin(&spec(&["wc", "-c"]), &input);
    assert_eq!(out.stdout_str().trim(), (10 << 20).to_string());
}

#[test]
fn sixty_four_concurrent_execs() {
    let mut agent = Agent::start();
    let started = Instant::now();
    let ids: Vec<(u32, usize)> =
        (0..64).map(|i| (agent.start_exec(&sh(&format!("sleep 0.5; echo {i}; echo e{i} >&2"))), i)).collect();
    for (id, i) in ids {
        let out = agent.exec_result(id);
        assert_eq!(out.exit.exit_code, 0);
        assert_eq!(out.stdout_str(), format!("{i}\n"));
        assert_eq!(out.stderr, format!("e{i}\n").into_bytes());
    }
    // Sequentially this would take 32 s.
    assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
    agent.ping();
}

#[test]
fn timeout_kills_the_whole_process_group() {
    let mut agent = Agent::start();
    let started = Instant::now();
    let s = ExecSpec { timeout_ms: 500, ..sh("sleep 60 & echo $!; (sleep 60; echo never) & echo $!; sleep 60") };
    let out = agent.exec(&s);
    assert!(out.exit.timed_out);
    assert_eq!(out.exit.exit_code, 128 + 9);
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    let pids: Vec<u32> = out.stdout_str().lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(pids.len(), 2);
    for pid in pids {
        eventually(&format!("background child {pid} to die"), || dead(pid));
    }
}

#[test]
fn huge_output_is_truncated_but_drained() {
    let mut agent = Agent::start();
    let started = Instant::now();
    let s = ExecSpec { max_output: 1 << 20, ..sh("head -c 104857600 /dev/zero; echo done >&2") };
    let out = agent.exec(&s);
    assert_eq!(out.exit.exit_code, 0);
    assert_eq!(out.stdout.len(), 1 << 20);
    assert!(out.exit.stdout_truncated);
    assert!(!out.exit.stderr_truncated);
    assert_eq!(out.stderr, b"done\n");
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
}

#[test]
fn background_child_holding_the_pipe_does_not_delay_exit() {
    let mut agent = Agent::start();
    let started = Instant::now();
    let out = agent.exec(&sh("sleep 30 & echo $!"));
    assert_eq!(out.exit.exit_code, 0);
    assert!(!out.exit.timed_out);
    assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
    // Left running, as the protocol says; clean up here.
    let pid: i32 = out.stdout_str().trim().parse().unwrap();
    assert!(!dead(pid as u32));
    let _ = std::process::Command::new("kill").arg(pid.to_string()).status();
}

#[test]
fn signal_reaches_the_process_group() {
    let mut agent = Agent::start();
    let id = agent.start_exec(&sh("trap 'echo got TERM; exit 42' TERM; echo ready; while :; do sleep 0.05; done"));
    eventually("the command to start", || agent.frames_so_far(id) > 0);
    agent.send(Kind::Signal, id, &Enc::default().u32(15).finish());
    let out = agent.exec_result(id);
    assert!(out.stdout_str().contains("got TERM"), "{:?}", out.stdout_str());
    assert_eq!(out.exit.exit_code, 42);
    // A signal or stdin for a finished exec is dropped silently.
    agent.send(Kind::Signal, id, &Enc::default().u32(9).finish());
    agent.send(Kind::Stdin, id, b"late");
    agent.ping();
}

#[test]
fn finished_commands_are_reaped() {
    let mut agent = Agent::start();
    for _ in 0..5 {
        let out = agent.exec(&sh("echo $$"));
        let pid: u32 = out.stdout_str().trim().parse().unwrap();
        // The agent is its parent, so only the agent's reaper can make it vanish.
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "{pid} left as a zombie");
    }
}

#[test]
fn stale_fences_are_refused_everywhere() {
    let mut agent = Agent::start();
    let fenced = |fence| ExecSpec { fence, ..spec(&["true"]) };
    assert_eq!(agent.exec(&fenced(10)).exit.exit_code, 0);
    assert_eq!(agent.exec(&fenced(10)).exit.exit_code, 0);

    let id = agent.start_exec(&fenced(9));
    let err = error_of(&agent.finish(id)).unwrap();
    assert_eq!(err.code, codes::STALE_FENCE);

    let read = ReadSpec { fence: 3, path: "/etc/hostname".into(), ..ReadSpec::default() };
    assert_eq!(agent.read(&read).unwrap_err().code, codes::STALE_FENCE);

    let dir = scratch("fence");
    let target = dir.join("f");
    let write = WriteSpec { fence: 4, path: target.to_str().unwrap().into(), mode: 0o644 };
    assert_eq!(agent.write(&write, b"x").unwrap_err().code, codes::STALE_FENCE);
    assert!(!target.exists());

    // A newer fence raises the bar for everyone.
    let write = WriteSpec { fence: 11, ..write };
    assert_eq!(agent.write(&write, b"x").unwrap(), 1);
    let id = agent.start_exec(&fenced(10));
    assert_eq!(error_of(&agent.finish(id)).unwrap().code, codes::STALE_FENCE);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn malformed_requests_get_bad_request() {
    let mut agent = Agent::start();
    for kind in [Kind::Exec, Kind::ReadFile, Kind::WriteFile] {
        agent.send(kind, 500 + kind as u32, &[1, 2, 3]);
        let err = error_of(&agent.finish(500 + kind as u32)).unwrap();
        assert_eq!(err.code, codes::BAD_REQUEST, "{kind:?}");
    }
    agent.send(Kind::Pong, 600, &[]);
    assert_eq!(error_of(&agent.finish(600)).unwrap().code, codes::BAD_REQUEST);
    let pty = ExecSpec { pty_rows: 24, pty_cols: 0, ..spec(&["true"]) };
    let id = agent.start_exec(&pty);
    assert_eq!(error_of(&agent.finish(id)).unwrap().code, codes::BAD_REQUEST);
    agent.send(Kind::ExecFlow, 601, &[1, 2, 3]);
    assert_eq!(error_of(&agent.finish(601)).unwrap().code, codes::BAD_REQUEST);
    agent.send(Kind::StdinAck, 602, &[1, 0, 0, 0]);
    assert_eq!(error_of(&agent.finish(602)).unwrap().code, codes::BAD_REQUEST);
    agent.ping();
}

#[test]
fn broken_framing_stops_serving_but_not_the_agent() {
    let mut agent = Agent::start();
    agent.ping();
    agent.send_raw(&[9, 0, 0, 0, 0x55, 1, 0, 0, 0, 0, 0, 0, 0]);
    std::thread::sleep(Duration::from_millis(200));
    assert!(agent.is_running(), "the agent exited on a framing error");
}

#[test]
fn stdin_eof_keeps_the_agent_alive() {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sandpool-agent"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(child.try_wait().unwrap().is_none(), "the agent exited on stdin EOF");
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn output_written_just_before_exit_is_complete() {
    let mut agent = Agent::start();
    // 32 at once on 2 cores, each writing more than a pipe holds; half leave a background
    // child holding the pipe open, so only draining (not EOF) can end their output.
    let ids: Vec<(u32, bool)> = (0..32)
        .map(|i| {
            let holder = i % 2 == 0;
            let script = if holder { "sleep 3 & head -c 300000 /dev/zero" } else { "head -c 300000 /dev/zero" };
            (agent.start_exec(&sh(script)), holder)
        })
        .collect();
    for (id, holder) in ids {
        let out = agent.exec_result(id);
        assert_eq!(out.exit.exit_code, 0);
        assert_eq!(out.stdout.len(), 300_000, "holder: {holder}");
        assert!(!out.exit.stdout_truncated);
    }
}

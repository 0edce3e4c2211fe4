//! Port connections (`Connect`, protocol version 5): the agent connects to a port on its
//! loopback and relays bytes both ways, within the host's credit and stdin window.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use agent_proto::{ConnectSpec, Kind, codes};

use crate::support::{Agent, acks_of, bytes_of, error_of, noise};

/// How long a stalled connection is watched to see that nothing more arrives.
const STALL_WATCH: Duration = Duration::from_millis(300);

fn connect(agent: &mut Agent, port: u16, credit: u32) -> u32 {
    let id = agent.id();
    agent.send(Kind::Connect, id, &ConnectSpec { fence: 0, port, credit }.encode());
    id
}

fn data_of(frames: &[agent_proto::Frame]) -> Vec<u8> {
    frames.iter().filter(|f| f.kind == Kind::Data).flat_map(|f| f.payload.clone()).collect()
}

#[test]
fn bytes_go_both_ways_and_the_ports_end_is_an_end() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // An echo server that upper-cases what it reads until the client half-closes, then ends.
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        s.write_all(&got.to_ascii_uppercase()).unwrap();
        got.len()
    });
    let mut agent = Agent::start();
    let id = connect(&mut agent, port, 1 << 20);
    agent.wait_frames(id, "opened", |f| f.iter().any(|f| f.kind == Kind::Opened));
    let body: Vec<u8> = noise(200_000, 7).iter().map(|b| b'a' + b % 26).collect();
    agent.send_chunks(Kind::Data, id, &body);
    agent.send(Kind::End, id, &[]);
    let frames = agent.wait_frames(id, "the port's end", |f| f.iter().any(|f| f.kind == Kind::End));
    assert_eq!(server.join().unwrap(), body.len());
    assert_eq!(data_of(&frames), body.to_ascii_uppercase());
    assert_eq!(acks_of(&frames) as usize, body.len().div_ceil(agent_proto::MAX_CHUNK), "every chunk acknowledged");
    assert!(error_of(&frames).is_none());
}

#[test]
fn output_waits_for_credit() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let _ = s.write_all(&vec![b'x'; 1 << 20]);
    });
    let mut agent = Agent::start();
    let id = connect(&mut agent, port, 4096);
    agent.wait_frames(id, "the first credit's worth", |f| bytes_of(f, Kind::Data) >= 4096);
    std::thread::sleep(STALL_WATCH);
    assert_eq!(bytes_of(&agent.frames_now(id), Kind::Data), 4096, "more than the credit");
    agent.credit(id, (1 << 20) - 4096);
    let frames = agent.wait_frames(id, "the rest and the end", |f| f.iter().any(|f| f.kind == Kind::End));
    assert_eq!(bytes_of(&frames, Kind::Data), 1 << 20);
    server.join().unwrap();
}

#[test]
fn a_closed_port_is_refused_and_a_signal_closes_an_open_connection() {
    // A port nothing listens on: bind one, learn its number, close it.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut agent = Agent::start();
    let id = connect(&mut agent, port, 4096);
    let err = error_of(&agent.finish(id)).expect("an error");
    assert_eq!(err.code, codes::REFUSED, "{err:?}");

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 16];
        // The agent's close ends the server's read.
        s.read(&mut buf).unwrap_or(0)
    });
    let id = connect(&mut agent, port, 4096);
    agent.wait_frames(id, "opened", |f| f.iter().any(|f| f.kind == Kind::Opened));
    agent.signal(id, 9);
    assert_eq!(server.join().unwrap(), 0, "the server saw the connection close");
    // The agent serves on.
    assert_eq!(agent.exec(&crate::support::sh("echo still")).stdout_str(), "still\n");
    let bad = agent.id();
    agent.send(Kind::Connect, bad, &ConnectSpec { fence: 0, port: 0, credit: 1 }.encode());
    assert_eq!(error_of(&agent.finish(bad)).unwrap().code, codes::BAD_REQUEST);
}

#[test]
fn a_new_host_channel_closes_the_connections_of_the_old_one() {
    use std::os::unix::net::UnixStream;
    use std::process::{Command, Stdio};

    let dir = crate::support::scratch("ports-socket");
    let sock = dir.join("agent.sock");
    /// Kills the agent however the test ends.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _agent = Killed(
        Command::new(env!("CARGO_BIN_EXE_sandpool-agent"))
            .arg("--socket")
            .arg(&sock)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn agent"),
    );
    let deadline = std::time::Instant::now() + crate::support::WAIT;
    while !sock.exists() {
        assert!(std::time::Instant::now() < deadline, "the agent's socket appears");
        std::thread::sleep(Duration::from_millis(10));
    }
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(crate::support::WAIT)).unwrap();
        let mut buf = [0u8; 16];
        // Only the agent's close ends this read before the timeout.
        s.read(&mut buf).map_err(|e| e.kind())
    });
    let mut first = UnixStream::connect(&sock).unwrap();
    first.set_read_timeout(Some(crate::support::WAIT)).unwrap();
    let spec = ConnectSpec { fence: 0, port, credit: 4096 };
    first.write_all(&agent_proto::Frame::new(Kind::Connect, 5, spec.encode()).encode()).unwrap();
    loop {
        let f = agent_proto::Frame::read_from(&mut first).unwrap().expect("a frame");
        if f.id == 5 {
            assert_eq!(f.kind, Kind::Opened);
            break;
        }
    }
    // A restarted node connects anew; the old channel's connection is nobody's.
    let _second = UnixStream::connect(&sock).unwrap();
    assert_eq!(server.join().unwrap(), Ok(0), "the agent closed the old channel's connection");
    let _ = std::fs::remove_dir_all(&dir);
}

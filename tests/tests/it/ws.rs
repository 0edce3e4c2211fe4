//! The session WebSocket: streaming, PTYs, multiplexing, replicas, shutdown.

use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use reqwest::Method;
use serde_json::{Value, json};
use tests::{Stack, StackOpts};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::FILL;

pub(crate) type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

pub(crate) async fn connect(url: &str, session: &str, token: &str) -> Ws {
    let ws_url = format!("{}/v1/sessions/{session}/ws", url.replace("http://", "ws://"));
    let mut req = ws_url.into_client_request().unwrap();
    req.headers_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    tokio_tungstenite::connect_async(req).await.expect("websocket upgrade").0
}

pub(crate) async fn send(ws: &mut Ws, v: Value) {
    ws.send(Message::Text(v.to_string().into())).await.unwrap();
}

/// Next JSON message, within 10 s.
pub(crate) async fn recv(ws: &mut Ws) -> Value {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), ws.next()).await.expect("message in time");
        match m.expect("socket open").expect("frame") {
            Message::Text(t) => return serde_json::from_str(&t).unwrap(),
            Message::Close(c) => panic!("closed: {c:?}"),
            _ => continue,
        }
    }
}

/// Collects a command's output until its exit; returns (output, exit message).
async fn run(ws: &mut Ws, id: &str) -> (String, Value) {
    let mut out = String::new();
    loop {
        let m = recv(ws).await;
        if m["id"] != id {
            continue;
        }
        match m["type"].as_str().unwrap() {
            "stdout" | "stderr" => out.push_str(m["data"].as_str().unwrap()),
            "exit" => return (out, m),
            "error" => panic!("error: {m}"),
            _ => {}
        }
    }
}

async fn session(stack: &Stack) -> (tests::Client, String) {
    session_of(stack, "bb").await
}

async fn session_of(stack: &Stack, template: &str) -> (tests::Client, String) {
    if template != crate::lazy::TEMPLATE {
        stack.wait_idle(template, 1, FILL).await;
    }
    let c = stack.client("t");
    let sid = c.create(template).await["session_id"].as_str().unwrap().to_string();
    (c, sid)
}

/// A stack whose warm template is `template`: `bb`, or `bbg` (gVisor); or the lazy template
/// (cold: templates from images keep no warm pool).
async fn stack_of(template: &str) -> Stack {
    match template {
        crate::lazy::TEMPLATE => crate::lazy::stack(StackOpts { warm: 0, ..Default::default() }).await,
        "bbg" => {
            Stack::start(StackOpts { warm: 0, extra_toml: crate::exec::gvisor_template(1), ..Default::default() }).await
        }
        _ => Stack::start(StackOpts { warm: 1, ..Default::default() }).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_streams_as_it_is_written_and_commands_multiplex() {
    streams_and_multiplexes("bb").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_streams_and_commands_multiplex_under_gvisor() {
    streams_and_multiplexes("bbg").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_streams_and_commands_multiplex_on_a_lazy_image() {
    streams_and_multiplexes(crate::lazy::TEMPLATE).await;
}

async fn streams_and_multiplexes(template: &str) {
    let stack = stack_of(template).await;
    let (c, sid) = session_of(&stack, template).await;
    let mut ws = connect(&stack.url, &sid, &c.token).await;
    send(&mut ws, json!({"type": "start", "id": "tick", "cmd": "for i in 1 2 3 4 5; do echo $i; sleep 0.1; done"}))
        .await;
    send(&mut ws, json!({"type": "start", "id": "cat", "cmd": ["cat"]})).await;
    let mut arrivals = Vec::new();
    let t0 = Instant::now();
    let mut cat_out = String::new();
    let mut sent_stdin = false;
    let (mut tick_done, mut cat_exit) = (false, None);
    while !tick_done || cat_exit.is_none() {
        let m = recv(&mut ws).await;
        match (m["type"].as_str().unwrap(), m["id"].as_str().unwrap()) {
            ("stdout", "tick") => {
                arrivals.push(t0.elapsed());
                if !sent_stdin {
                    // The second command runs alongside the first.
                    send(&mut ws, json!({"type": "stdin", "id": "cat", "data": "ping\n"})).await;
                    send(&mut ws, json!({"type": "stdin_eof", "id": "cat"})).await;
                    sent_stdin = true;
                }
            }
            ("stdout", "cat") => cat_out.push_str(m["data"].as_str().unwrap()),
            ("exit", "tick") => tick_done = true,
            ("exit", "cat") => cat_exit = Some(m["exit_code"].clone()),
            _ => {}
        }
    }
    assert_eq!(arrivals.len(), 5, "one message per line");
    // Lines arrive ~100 ms apart, not all at the end.
    let spread = arrivals[4] - arrivals[0];
    assert!(spread >= Duration::from_millis(300), "lines arrived together: {arrivals:?}");
    assert_eq!(cat_out, "ping\n");
    assert_eq!(cat_exit, Some(json!(0)));
    // Binary-safe with base64.
    send(&mut ws, json!({"type": "start", "id": "b", "cmd": ["cat"], "encoding": "base64"})).await;
    send(&mut ws, json!({"type": "stdin", "id": "b", "data": wire::b64_encode(&[0, 255, 10, 1])})).await;
    send(&mut ws, json!({"type": "stdin_eof", "id": "b"})).await;
    let mut bytes = Vec::new();
    loop {
        let m = recv(&mut ws).await;
        match m["type"].as_str().unwrap() {
            "stdout" => bytes.extend(wire::b64_decode(m["data"].as_str().unwrap()).unwrap()),
            "exit" => break,
            _ => {}
        }
    }
    assert_eq!(bytes, [0, 255, 10, 1]);
    // A bad message is answered, not fatal.
    ws.send(Message::Text("{nope".into())).await.unwrap();
    assert_eq!(recv(&mut ws).await["type"], "error");
    let _ = c.call(Method::GET, "/v1/templates", None).await;
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_shells_keep_state_and_resize() {
    pty_contract("bb").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_shells_keep_state_and_resize_under_gvisor() {
    pty_contract("bbg").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_shells_keep_state_and_resize_on_a_lazy_image() {
    pty_contract(crate::lazy::TEMPLATE).await;
}

async fn pty_contract(template: &str) {
    let stack = stack_of(template).await;
    let (c, sid) = session_of(&stack, template).await;
    let mut ws = connect(&stack.url, &sid, &c.token).await;
    send(&mut ws, json!({"type": "start", "id": "sz", "cmd": ["stty", "size"], "pty": {"rows": 33, "cols": 101}}))
        .await;
    let (out, _) = run(&mut ws, "sz").await;
    assert_eq!(out.trim(), "33 101");
    send(&mut ws, json!({"type": "start", "id": "sh", "cmd": ["sh"], "pty": {"rows": 24, "cols": 80}})).await;
    for line in ["cd /tmp", "export X=kept", "echo \"at $(pwd) with $X\"", "stty size"] {
        send(&mut ws, json!({"type": "stdin", "id": "sh", "data": format!("{line}\n")})).await;
    }
    // Resize only once the shell has answered at the old size.
    let mut before = String::new();
    while !before.contains("24 80") {
        let m = recv(&mut ws).await;
        if m["type"] == "stdout" {
            before.push_str(m["data"].as_str().unwrap());
        }
    }
    assert!(before.contains("at /tmp with kept"), "{before}");
    send(&mut ws, json!({"type": "resize", "id": "sh", "rows": 50, "cols": 132})).await;
    send(&mut ws, json!({"type": "stdin", "id": "sh", "data": "stty size; exit\n"})).await;
    let (out, exit) = run(&mut ws, "sh").await;
    assert!(out.contains("50 132"), "{out}");
    assert_eq!(exit["exit_code"], 0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_work_through_any_gateway_replica() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let (c, sid) = session(&stack).await;
    let (url2, cancel2) = stack.second_gateway().await;
    let c2 = tests::Client { url: url2.clone(), ..c.clone() };
    c.sh(&sid, "echo one > f").await;
    assert_eq!(c2.sh(&sid, "cat f").await["stdout"], "one\n");
    // Stream through the second, then lose it and reconnect through the first.
    let mut ws = connect(&url2, &sid, &c.token).await;
    send(&mut ws, json!({"type": "start", "id": "a", "cmd": "cat f"})).await;
    assert_eq!(run(&mut ws, "a").await.0, "one\n");
    cancel2.cancel();
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Close(frame))) => return frame.map(|f| f.reason.to_string()),
                Some(Ok(_)) => continue,
                _ => return None,
            }
        }
    })
    .await
    .expect("close in time");
    assert!(closed.unwrap_or_default().contains("shutting down"), "the close frame says why");
    let mut ws = connect(&stack.url, &sid, &c.token).await;
    send(&mut ws, json!({"type": "start", "id": "b", "cmd": "echo two >> f; cat f"})).await;
    assert_eq!(run(&mut ws, "b").await.0, "one\ntwo\n");
    assert_eq!(c.delete(&sid).await, 204);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_slows_the_command() {
    let stack = Stack::start(StackOpts { warm: 1, ..Default::default() }).await;
    let (c, sid) = session(&stack).await;
    let mut ws = connect(&stack.url, &sid, &c.token).await;
    // 256 MiB of output (far more than every buffer on the way holds); we read nothing for a second.
    send(&mut ws, json!({"type": "start", "id": "big", "cmd": "head -c 268435456 /dev/zero | tr '\\0' x"})).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // (busybox shows a forked applet as "{head} /bin/sh -c ...", `tr` by its own name)
    let ps = c.sh(&sid, "ps -o args | grep -c '^tr ' || true").await;
    assert_eq!(ps["stdout"], "1\n", "the writer should be blocked, not finished");
    let mut total = 0usize;
    loop {
        let m = recv(&mut ws).await;
        match m["type"].as_str().unwrap() {
            "stdout" => total += m["data"].as_str().unwrap().len(),
            "exit" => break,
            _ => {}
        }
    }
    assert_eq!(total, 256 << 20);
    // Token in the query string, for clients that cannot set headers; a bad one is refused.
    let url = format!("{}/v1/sessions/{sid}/ws?token={}", stack.url.replace("http://", "ws://"), c.token);
    assert!(tokio_tungstenite::connect_async(url).await.is_ok());
    let bad = format!("{}/v1/sessions/{sid}/ws?token=nope", stack.url.replace("http://", "ws://"));
    assert!(tokio_tungstenite::connect_async(bad).await.is_err());
    stack.shutdown().await;
}

/// 400,000 three-byte characters written in odd-sized writes (so most writes end inside a
/// character) arrive intact, byte for byte, through a plain stream and a terminal alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_text_arrives_whole_however_the_writes_cut_it() {
    let stack = stack_of("bb").await;
    let (c, sid) = session(&stack).await;
    let text = format!("x{}", "€".repeat(400_000));
    assert_eq!(c.put_file(&sid, "/work/euros", text.clone().into_bytes()).await, 204);
    let mut ws = connect(&stack.url, &sid, &c.token).await;
    let cmd = ["sh", "-c", "dd if=/work/euros bs=4093 2>/dev/null"];
    send(&mut ws, json!({"type": "start", "id": "plain", "cmd": cmd})).await;
    let (out, exit) = run(&mut ws, "plain").await;
    assert_eq!(exit["exit_code"], 0);
    assert!(!out.contains('\u{FFFD}'), "{} replacement characters", out.matches('\u{FFFD}').count());
    assert!(out == text, "{} characters arrived of {}", out.chars().count(), text.chars().count());
    send(&mut ws, json!({"type": "start", "id": "tty", "cmd": cmd, "pty": {"rows": 24, "cols": 80}})).await;
    let (out, _) = run(&mut ws, "tty").await;
    assert!(out == text, "terminal: {} characters, {} replaced", out.chars().count(), out.matches('\u{FFFD}').count());
    stack.shutdown().await;
}

/// A client that can set no header (a browser) asks for a ticket and opens the socket with it:
/// the session's owner only, that session only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ws_ticket_opens_its_own_sessions_socket_and_no_other() {
    let stack = Stack::start(StackOpts { warm: 2, ..Default::default() }).await;
    let (c, sid) = session(&stack).await;
    let other_sid = c.create("bb").await["session_id"].as_str().unwrap().to_string();
    let a = c.call(Method::POST, &format!("/v1/sessions/{sid}/ws-ticket"), None).await;
    assert_eq!(a.status, 201, "{:?}", a.body);
    assert_eq!(a.body["expires_in_s"], 30);
    let path = a.body["path"].as_str().unwrap();
    let ticket = a.body["ticket"].as_str().unwrap();
    assert!(path.ends_with(ticket) && !path.contains(&c.token), "{path}");

    let ws_base = stack.url.replace("http://", "ws://");
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("{ws_base}{path}")).await.expect("the ticket opens it");
    send(&mut ws, json!({"type": "start", "id": "t", "cmd": "echo by-ticket"})).await;
    let (out, exit) = run(&mut ws, "t").await;
    assert_eq!((out.as_str(), exit["exit_code"].as_i64()), ("by-ticket\n", Some(0)), "{exit}");

    // Not another session's socket, not a forged ticket, and not another tenant's ticket.
    let elsewhere = format!("{ws_base}/v1/sessions/{other_sid}/ws?ticket={ticket}");
    assert!(tokio_tungstenite::connect_async(elsewhere).await.is_err(), "a ticket for another session");
    let forged = format!("{ws_base}/v1/sessions/{sid}/ws?ticket={}", c.token);
    assert!(tokio_tungstenite::connect_async(forged).await.is_err(), "a bearer token is no ticket");
    let stranger = stack.client("stranger");
    let theirs = stranger.call(Method::POST, &format!("/v1/sessions/{sid}/ws-ticket"), None).await;
    assert_eq!((theirs.status, theirs.body["code"].as_str()), (404, Some("not_found")), "{:?}", theirs.body);
    stack.shutdown().await;
}

//! A session's ports through the gateway, on real Docker: servers in sandboxes without any
//! network (`network = "none"`: loopback only) answer HTTP and WebSockets for their session's
//! owner and for a signed URL until it expires; another tenant gets 404, no token 401, a port
//! the template does not expose 403; the node's bounds on connections and bytes hold.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use reqwest::Method;
use serde_json::{Value, json};
use tests::{Stack, StackOpts, eventually};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// A busybox template exposing 8000 and 8001, a Debian one (python3) exposing 9000; both
/// with the default network, none.
fn opts(pool_manager_toml: &str) -> StackOpts {
    let extra = "[templates.web]\nimage = \"sandpool/busybox:latest\"\nexec = \"agent\"\nworkdir = \"/work\"\n\
                 cpus = 0.5\nmemory_mb = 128\npids = 256\nwarm = 1\nports = [8001, 8000]\n\
                 [templates.debws]\nimage = \"sandpool/debian:bookworm\"\nexec = \"agent\"\nworkdir = \"/work\"\n\
                 cpus = 1.0\nmemory_mb = 256\npids = 256\nwarm = 0\nports = [9000]\n";
    StackOpts { warm: 0, extra_toml: extra.into(), pool_manager_toml: pool_manager_toml.into(), ..Default::default() }
}

/// A CGI script that echoes its request's method and body (busybox httpd runs it).
const ECHO_CGI: &str = "#!/bin/sh\nprintf 'Content-Type: text/plain\\r\\n\\r\\n'\necho \"$REQUEST_METHOD\"\n\
                        head -c \"${CONTENT_LENGTH:-0}\"\n";

/// A WebSocket echo server in the Python standard library only (the sandbox has no network
/// to install anything from).
const WS_ECHO: &str = r#"
import base64, hashlib, socket, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def serve(c):
    try:
        echo(c)
    finally:
        print("closed", flush=True)
def echo(c):
    data = b""
    while b"\r\n\r\n" not in data:
        d = c.recv(4096)
        if not d:
            return
        data += d
    key = [l.split(b":", 1)[1].strip() for l in data.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:")][0]
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    f = c.makefile("rb")
    while True:
        h = f.read(2)
        if len(h) < 2:
            return
        op, n = h[0] & 15, h[1] & 127
        if n == 126:
            n = int.from_bytes(f.read(2), "big")
        elif n == 127:
            n = int.from_bytes(f.read(8), "big")
        mask = f.read(4)
        p = bytes(b ^ mask[i % 4] for i, b in enumerate(f.read(n)))
        if op == 8:
            c.sendall(b"\x88\x00")
            return
        if n < 126:
            head = bytes([0x80 | op, n])
        elif n < 65536:
            head = bytes([0x80 | op, 126]) + n.to_bytes(2, "big")
        else:
            head = bytes([0x80 | op, 127]) + n.to_bytes(8, "big")
        c.sendall(head + p)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 9000))
s.listen(64)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

async fn get(url: &str, token: Option<&str>) -> (u16, String) {
    let mut req = reqwest::Client::new().get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.expect("gateway answers");
    (resp.status().as_u16(), resp.text().await.unwrap_or_default())
}

fn code(body: &str) -> String {
    serde_json::from_str::<Value>(body).ok().and_then(|v| v["code"].as_str().map(String::from)).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_in_a_sandbox_without_network_answers_its_owner_and_signed_urls_only() {
    let stack = Stack::start(opts("")).await;
    let owner = stack.client("acme");
    let s = owner.create("web").await;
    let sid = s["session_id"].as_str().unwrap().to_string();
    let networks = tests::container_inspect(s["sandbox_id"].as_str().unwrap())["HostConfig"]["NetworkMode"].clone();
    assert_eq!(networks, "none", "the sandbox has no network");
    let ifaces = owner.sh(&sid, "ls /sys/class/net").await;
    assert_eq!(ifaces["stdout"].as_str().unwrap().trim(), "lo", "loopback only");

    assert_eq!(owner.put_file(&sid, "/work/www/index.html", b"hello from the sandbox".to_vec()).await, 204);
    assert_eq!(owner.put_file(&sid, "/work/www/cgi-bin/echo", ECHO_CGI.as_bytes().to_vec()).await, 204);
    owner.sh(&sid, "chmod +x /work/www/cgi-bin/echo && httpd -p 127.0.0.1:8000 -h /work/www").await;

    let base = format!("{}/v1/sessions/{sid}/ports/8000", stack.url);
    let page = eventually(Duration::from_secs(10), || async {
        let (status, body) = get(&format!("{base}/index.html"), Some(&owner.token)).await;
        (status == 200).then_some(body)
    })
    .await
    .expect("the sandbox's server answers through the gateway");
    assert_eq!(page, "hello from the sandbox");
    assert_eq!(get(&format!("{base}/"), Some(&owner.token)).await, (200, "hello from the sandbox".into()), "root");

    // A body streams to the port and back (several chunks of the agent's channel each way).
    let body: Vec<u8> = (0..300_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let resp = reqwest::Client::new()
        .post(format!("{base}/cgi-bin/echo"))
        .bearer_auth(&owner.token)
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let echoed = resp.bytes().await.unwrap();
    assert_eq!(&echoed[..5], b"POST\n");
    assert_eq!(&echoed[5..], &body[..], "the body came back whole");

    // Nobody else: another tenant's call is 404 (as for an unknown session), no token 401.
    let other = stack.client("globex");
    let (status, body) = get(&format!("{base}/index.html"), Some(&other.token)).await;
    assert_eq!((status, code(&body).as_str()), (404, "not_found"), "{body}");
    let (status, body) = get(&format!("{base}/index.html"), None).await;
    assert_eq!((status, code(&body).as_str()), (401, "unauthorized"), "{body}");

    // A port the template does not expose is refused; one it exposes but nothing serves, 502.
    let (status, body) = get(&format!("{}/v1/sessions/{sid}/ports/22/", stack.url), Some(&owner.token)).await;
    assert_eq!((status, code(&body).as_str()), (403, "forbidden"), "{body}");
    assert!(body.contains("not exposed") && body.contains("8000, 8001"), "{body}");
    let (status, body) = get(&format!("{}/v1/sessions/{sid}/ports/8001/", stack.url), Some(&owner.token)).await;
    assert_eq!((status, code(&body).as_str()), (502, "bad_gateway"), "{body}");
    assert!(body.contains("nothing listens on port 8001"), "{body}");
    let (status, _) = get(&format!("{}/v1/sessions/{sid}/ports/http/", stack.url), Some(&owner.token)).await;
    assert_eq!(status, 400);

    // A signed URL: no token needed until it expires; only the owner may ask for one.
    let urls = format!("/v1/sessions/{sid}/urls");
    let signed = owner.call(Method::POST, &urls, Some(json!({"port": 8000, "ttl_s": 3}))).await;
    assert_eq!(signed.status, 200, "{:?}", signed.body);
    let path = signed.body["path"].as_str().unwrap().to_string();
    assert!(path.starts_with("/v1/ports/") && path.ends_with('/'), "{path}");
    assert_eq!(get(&format!("{}{path}index.html", stack.url), None).await, (200, "hello from the sandbox".into()));
    let refused = other.call(Method::POST, &urls, Some(json!({"port": 8000}))).await;
    assert_eq!(refused.status, 404);
    let unexposed = owner.call(Method::POST, &urls, Some(json!({"port": 22}))).await;
    assert_eq!(unexposed.status, 403);
    let tampered = path.replacen("/v1/ports/", "/v1/ports/x", 1);
    assert_eq!(get(&format!("{}{tampered}index.html", stack.url), None).await.0, 401);
    let expired = eventually(Duration::from_secs(10), || async {
        let (status, body) = get(&format!("{}{path}index.html", stack.url), None).await;
        (status == 401).then_some(body)
    })
    .await
    .expect("the signed URL expires");
    assert!(expired.contains("expired"), "{expired}");

    // A template made by API lists some of its base's ports, no others.
    let t = json!({"image": "127.0.0.1:5000/sandpool/none:latest", "base": "web", "ports": [8000, 22]});
    let refused = stack.admin_client().call(Method::POST, "/v1/templates", Some(t)).await;
    assert_eq!(refused.status, 400, "{:?}", refused.body);
    let message = refused.body["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("ports:") && message.contains("22"), "{message}");
    let listed = owner.call(Method::GET, "/v1/templates/web", None).await;
    assert_eq!(listed.body["ports"], json!([8000, 8001]), "{:?}", listed.body);

    // An ended session's port is gone with it.
    assert_eq!(owner.delete(&sid).await, 204);
    assert_eq!(get(&format!("{base}/index.html"), Some(&owner.token)).await.0, 404);
}

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn open_ws(url: &str, token: &str) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
    let mut req = url.replace("http://", "ws://").into_client_request().unwrap();
    req.headers_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    tokio_tungstenite::connect_async(req).await.map(|(ws, _)| ws)
}

async fn echo(ws: &mut Ws, m: Message) -> Message {
    ws.send(m).await.expect("send");
    let got = tokio::time::timeout(Duration::from_secs(10), ws.next()).await.expect("an answer in time");
    got.expect("open").expect("a frame")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websockets_pass_through_a_port_within_the_nodes_bounds() {
    let stack = Stack::start(opts("max_port_connections = 2\nmax_port_bytes = 1048576")).await;
    let owner = stack.client("acme");
    let s = owner.create("debws").await;
    let sid = s["session_id"].as_str().unwrap().to_string();
    assert_eq!(owner.put_file(&sid, "/work/ws.py", WS_ECHO.as_bytes().to_vec()).await, 204);
    owner.sh(&sid, "python3 /work/ws.py >/work/ws.log 2>&1 &").await;

    let url = format!("{}/v1/sessions/{sid}/ports/9000/echo", stack.url);
    let mut ws = eventually(Duration::from_secs(15), || async { open_ws(&url, &owner.token).await.ok() })
        .await
        .expect("the WebSocket opens through the gateway");
    assert_eq!(echo(&mut ws, Message::Text("ping".into())).await, Message::Text("ping".into()));
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(echo(&mut ws, Message::Binary(big.clone().into())).await, Message::Binary(big.into()));

    // Two connections per sandbox here: a third is refused with 429 while both are open.
    let mut second = open_ws(&url, &owner.token).await.expect("a second connection");
    let third = open_ws(&url, &owner.token).await;
    match third {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => assert_eq!(resp.status(), 429),
        other => panic!("a third connection should be refused: {other:?}"),
    }
    assert_eq!(echo(&mut second, Message::Text("two".into())).await, Message::Text("two".into()));
    drop(second);

    // 1 MiB per connection, both ways together: the node closes this one past it.
    let chunk = vec![7u8; 200_000];
    let mut cut = false;
    for _ in 0..6 {
        if ws.send(Message::Binary(chunk.clone().into())).await.is_err() {
            cut = true;
            break;
        }
        match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
            Ok(Some(Ok(Message::Binary(_)))) => {}
            _ => {
                cut = true;
                break;
            }
        }
    }
    assert!(cut, "the connection is closed past max_port_bytes");

    // The slot of a closed connection is free again.
    let mut again = eventually(Duration::from_secs(20), || async { open_ws(&url, &owner.token).await.ok() })
        .await
        .expect("a new connection once the others closed");
    assert_eq!(echo(&mut again, Message::Text("again".into())).await, Message::Text("again".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_closes_the_old_connections_and_serves_ports_again() {
    let mut stack = Stack::start(opts("")).await;
    let owner = stack.client("acme");
    let s = owner.create("debws").await;
    let sid = s["session_id"].as_str().unwrap().to_string();
    assert_eq!(owner.put_file(&sid, "/work/ws.py", WS_ECHO.as_bytes().to_vec()).await, 204);
    owner.sh(&sid, "python3 /work/ws.py >/work/ws.log 2>&1 &").await;
    let url = format!("{}/v1/sessions/{sid}/ports/9000/", stack.url);
    let mut ws = eventually(Duration::from_secs(15), || async { open_ws(&url, &owner.token).await.ok() })
        .await
        .expect("the WebSocket opens through the gateway");
    assert_eq!(echo(&mut ws, Message::Text("before".into())).await, Message::Text("before".into()));

    stack.restart_pool_manager().await;
    // The connection the old node held is closed in the sandbox (its agent saw a new channel).
    let closed = eventually(Duration::from_secs(30), || async {
        let a = owner.exec(&sid, json!({"cmd": "cat /work/ws.log"})).await;
        (a.status == 200 && a.body["stdout"].as_str().unwrap_or_default().contains("closed")).then_some(())
    })
    .await;
    assert!(closed.is_some(), "the server saw its connection close");
    drop(ws);
    let mut again = eventually(Duration::from_secs(30), || async { open_ws(&url, &owner.token).await.ok() })
        .await
        .expect("the port serves again through the restarted node");
    assert_eq!(echo(&mut again, Message::Text("after".into())).await, Message::Text("after".into()));
}

//! Named egress end to end on real Docker: sessions on the node's egress network reach what
//! their current policy allows and nothing else, by name (through `HTTP_PROXY` and through
//! the node's DNS) and by address; switches take effect at once and cut open connections the
//! new policy refuses; the node's own services and other sandboxes stay out of reach whatever
//! the policy. The "outside world" is two servers on this machine's loopback (127.0.0.2 and
//! 127.0.0.3), named `task.test` and `other.test` by the config's `[egress.hosts]`.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use tests::{Client, Stack, StackOpts, eventually};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::FILL;

/// A server that greets every connection with `<name>\n`, then answers an HTTP request with
/// `<name>` as its body (or, for a connection that sends no request, holds it open).
pub(crate) async fn server(ip: &str, name: &'static str) -> u16 {
    let listener = TcpListener::bind((ip, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let mut got = Vec::new();
                loop {
                    match tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await {
                        Ok(Ok(0)) | Ok(Err(_)) => return,
                        Ok(Ok(n)) => {
                            got.extend_from_slice(&buf[..n]);
                            if got.windows(4).any(|w| w == b"\r\n\r\n") {
                                let r = format!("HTTP/1.0 200 OK\r\ncontent-length: {}\r\n\r\n{name}", name.len());
                                let _ = s.write_all(r.as_bytes()).await;
                                return;
                            }
                        }
                        // No request: a raw connection. Greet it and hold it until it closes.
                        Err(_) if got.is_empty() => {
                            let _ = s.write_all(format!("{name}\n").as_bytes()).await;
                            while let Ok(n) = s.read(&mut buf).await {
                                if n == 0 {
                                    return;
                                }
                            }
                            return;
                        }
                        Err(_) => {}
                    }
                }
            });
        }
    });
    port
}

/// Host rules carrying this bridge's tag, in the nat and filter tables.
fn tagged_rules(iface: &str) -> usize {
    ["nat", "filter"]
        .iter()
        .map(|t| {
            let out = std::process::Command::new("iptables").args(["-w", "-t", t, "-S"]).output().unwrap();
            let tag = format!("sandpool-egress:{iface}");
            String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains(&tag)).count()
        })
        .sum()
}

struct World {
    stack: Stack,
    task: u16,
    other: u16,
}

async fn world() -> World {
    let task = server("127.0.0.2", "task").await;
    let other = server("127.0.0.3", "other").await;
    let redis_port = tests::redis_url().rsplit(':').next().unwrap().trim_end_matches('/').to_string();
    let extra_toml = format!(
        r#"
[egress.hosts]
"task.test" = "127.0.0.2"
"other.test" = "127.0.0.3"

[egress.policies.task-service]
allow = ["task.test:{task}"]

[egress.policies.both]
allow = ["task.test:{task}", "other.test:{other}", "127.0.0.3:{other}"]

# Everything by address, and the second server and Redis by name: the node's own services
# (and any host port not named exactly) stay out of reach.
[egress.policies.wide]
allow = ["0.0.0.0/0", "127.0.0.3:{other}", "127.0.0.1:{redis_port}"]

[templates.bbe]
image = "{img}"
workdir = "/work"
memory_mb = 64
warm = 2
egress = "task-service"
egress_allowed = ["task-service", "both", "deny-all", "wide", "by-api"]
"#,
        img = tests::BUSYBOX_IMAGE,
    );
    let stack = Stack::start(StackOpts { warm: 0, extra_toml, ..Default::default() }).await;
    stack.wait_idle("bbe", 2, FILL).await;
    World { stack, task, other }
}

async fn sh(c: &Client, sid: &str, cmd: &str) -> (i64, String, String) {
    let r = c.sh(sid, cmd).await;
    let s = |k: &str| r[k].as_str().unwrap_or_default().to_string();
    (r["exit_code"].as_i64().unwrap_or(-1), s("stdout"), s("stderr"))
}

async fn switch(c: &Client, sid: &str, policy: &str) -> (u16, Value) {
    let a = c.call(Method::PUT, &format!("/v1/sessions/{sid}/egress"), Some(json!({ "policy": policy }))).await;
    (a.status, a.body)
}

/// An HTTP GET through the proxy the sandbox's environment names.
fn wget(host: &str, port: u16) -> String {
    format!("wget -q -O - http://{host}:{port}/ 2>&1")
}

/// A raw TCP connection by name (the node's DNS, then the transparent proxy), printing what
/// the server says first.
fn nc(host: &str, port: u16) -> String {
    format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {host} {port} 2>&1; echo \" exit=$?\"")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_reaches_what_its_policy_allows_and_switches_take_effect_at_once() {
    let w = world().await;
    let c = w.stack.client("acme");
    let s = c.create("bbe").await;
    let sid = s["session_id"].as_str().unwrap().to_string();
    assert_eq!(s["egress"], "task-service", "{s}");
    let t = c.call(Method::GET, "/v1/templates", None).await;
    let bbe = t.body["templates"].as_array().unwrap().iter().find(|t| t["name"] == "bbe").unwrap().clone();
    assert_eq!((bbe["network"].as_str(), bbe["egress"]["initial"].as_str()), (Some("egress"), Some("task-service")));

    // Under task-service: the task server by name, through the proxy and directly.
    let (code, out, _) = sh(&c, &sid, &wget("task.test", w.task)).await;
    assert_eq!((code, out.as_str()), (0, "task"), "through the proxy");
    let (_, out, _) = sh(&c, &sid, &nc("task.test", w.task)).await;
    assert!(out.contains("task") && out.ends_with("exit=0\n"), "by name through the node's DNS: {out:?}");
    // Not the second server: a 403 naming the policy, and a name that does not resolve.
    let (code, out, _) = sh(&c, &sid, &wget("other.test", w.other)).await;
    assert!(code != 0 && out.contains("403"), "{out:?}");
    let (code, out, _) = sh(&c, &sid, "nslookup other.test 2>&1").await;
    assert!(code != 0 || out.contains("NXDOMAIN") || out.contains("can't resolve"), "{out:?}");
    let (code, out, _) = sh(&c, &sid, "nslookup task.test 2>&1").await;
    assert!(code == 0 && out.contains("198.18."), "an allowed name resolves (to a stand-in): {out:?}");
    // The proxy's refusal says which policy refused, to a client that reads it.
    let (_, out, _) = sh(&c, &sid, &format!("printf 'GET http://other.test:{}/ HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n' | nc -w 5 $(echo $http_proxy | sed 's|http://||; s|:| |') 2>&1", w.other)).await;
    assert!(out.starts_with("HTTP/1.1 403") && out.contains("task-service"), "{out:?}");

    // Switched to both: the second server too, at once; the session reports it.
    let (status, body) = switch(&c, &sid, "both").await;
    assert_eq!((status, body["egress"].as_str()), (200, Some("both")), "{body}");
    let (code, out, _) = sh(&c, &sid, &wget("other.test", w.other)).await;
    assert_eq!((code, out.as_str()), (0, "other"));
    let got = c.call(Method::GET, &format!("/v1/sessions/{sid}"), None).await;
    assert_eq!(got.body["egress"], "both");

    // deny-all: neither, by name or by DNS, and fast (no hang).
    assert_eq!(switch(&c, &sid, "deny-all").await.0, 200);
    let started = std::time::Instant::now();
    let (code, out, _) = sh(&c, &sid, &wget("task.test", w.task)).await;
    assert!(code != 0 && out.contains("403"), "{out:?}");
    let (_, out, _) = sh(&c, &sid, &nc("task.test", w.task)).await;
    assert!(out.contains("bad address") && out.ends_with("exit=1\n"), "the name no longer resolves: {out:?}");
    assert!(started.elapsed() < Duration::from_secs(4), "refusals are immediate: {:?}", started.elapsed());

    // A policy the template does not name, and bad bodies.
    let (status, body) = switch(&c, &sid, "nope").await;
    assert_eq!((status, body["code"].as_str()), (403, Some("forbidden")), "{body}");
    let a = c.call(Method::PUT, &format!("/v1/sessions/{sid}/egress"), Some(json!({"policy": "both", "x": 1}))).await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    // Another tenant's session is not found.
    let other = w.stack.client("intruder");
    assert_eq!(switch(&other, &sid, "both").await.0, 404);
    assert_eq!(c.delete(&sid).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_cuts_open_connections_the_new_policy_refuses_and_keeps_the_others() {
    let w = world().await;
    let c = w.stack.client("acme");
    let sid = c.create("bbe").await["session_id"].as_str().unwrap().to_string();
    assert_eq!(switch(&c, &sid, "both").await.0, 200);
    // A long-lived connection to the task server, in the background.
    let hold =
        format!("(sleep 60 | (nc task.test {} > /tmp/o 2>&1; echo closed >> /tmp/o)) > /dev/null 2>&1 &", w.task);
    assert_eq!(sh(&c, &sid, &hold).await.0, 0);
    let read = || async { sh(&c, &sid, "cat /tmp/o 2>/dev/null").await.1 };
    let greeted = eventually(Duration::from_secs(5), || async { read().await.contains("task").then_some(()) }).await;
    assert!(greeted.is_some(), "the connection opened: {:?}", read().await);

    // A switch to a policy that still allows it leaves it open.
    assert_eq!(switch(&c, &sid, "task-service").await.0, 200);
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!read().await.contains("closed"), "still open under task-service");
    // deny-all cuts it within a second.
    assert_eq!(switch(&c, &sid, "deny-all").await.0, 200);
    let cut = eventually(Duration::from_secs(1), || async { read().await.contains("closed").then_some(()) }).await;
    assert!(cut.is_some(), "cut by the switch: {:?}", read().await);
    assert_eq!(c.delete(&sid).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whatever_the_policy_no_sandbox_reaches_the_node_or_another_sandbox() {
    let w = world().await;
    let c = w.stack.client("acme");
    let a = c.create("bbe").await["session_id"].as_str().unwrap().to_string();
    let b = c.create("bbe").await["session_id"].as_str().unwrap().to_string();
    assert_eq!(switch(&c, &a, "wide").await.0, 200);
    assert_eq!(switch(&c, &b, "wide").await.0, 200);
    // `wide` allows any address: the second server by address works...
    let (code, out, _) = sh(&c, &a, &wget("127.0.0.3", w.other)).await;
    assert_eq!((code, out.as_str()), (0, "other"));

    // ...but not Redis (named in the policy, even), the pool-manager's internal API or the
    // gateway, by the proxy or directly at the gateway address.
    let gw = sh(&c, &a, "echo $http_proxy | sed 's|http://||; s|:.*||'").await.1.trim().to_string();
    let pm_port = w.stack.node.config.pool_manager.advertise.rsplit(':').next().unwrap().to_string();
    let gw_port = w.stack.url.rsplit(':').next().unwrap().to_string();
    let redis_port = tests::redis_url().rsplit(':').next().unwrap().trim_end_matches('/').to_string();
    for (host, port) in [
        ("127.0.0.1", &redis_port),
        ("127.0.0.1", &pm_port),
        ("127.0.0.1", &gw_port),
        (gw.as_str(), &pm_port),
        (gw.as_str(), &redis_port),
        (gw.as_str(), &gw_port),
    ] {
        let (code, out, _) = sh(&c, &a, &format!("wget -q -O - http://{host}:{port}/ 2>&1")).await;
        assert!(code != 0 && out.contains("403"), "{host}:{port} through the proxy: {out:?}");
        let (_, out, _) =
            sh(&c, &a, &format!("printf 'PING\\r\\n' | nc -w 3 {host} {port} 2>&1; echo \" exit=$?\"")).await;
        assert!(!out.contains("PONG") && !out.contains("HTTP/"), "{host}:{port} directly: {out:?}");
    }

    // Any other service of the host (here one listening on every address, as a node's
    // exporter might): `wide` covers its address, yet nothing reaches it, by the proxy or not.
    let host_service = TcpListener::bind("0.0.0.0:0").await.unwrap();
    let port = host_service.local_addr().unwrap().port();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while host_service.accept().await.is_ok() {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let (code, out, _) = sh(&c, &a, &format!("wget -q -O - http://{gw}:{port}/ 2>&1")).await;
    assert!(code != 0 && out.contains("403"), "{out:?}");
    // Directly: the handshake is the proxy's, which resets the connection at once.
    let started = std::time::Instant::now();
    sh(&c, &a, &format!("echo x | nc -w 3 {gw} {port}")).await;
    assert!(started.elapsed() < Duration::from_secs(2), "reset, not timed out: {:?}", started.elapsed());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 0, "the host service saw no connection");

    // Another sandbox's listening port, by its address on the network (it listens: it
    // reaches itself).
    let listen =
        "(while true; do echo hello | nc -l -p 9000; echo c >> /tmp/conns; done > /dev/null 2>&1 &); sleep 0.3";
    assert_eq!(sh(&c, &b, listen).await.0, 0);
    assert!(sh(&c, &b, "nc -w 3 127.0.0.1 9000").await.1.contains("hello"), "b's listener is up");
    let b_ip = sh(&c, &b, "ip -4 -o addr show eth0 | awk '{print $4}' | cut -d/ -f1").await.1.trim().to_string();
    assert!(b_ip.parse::<std::net::Ipv4Addr>().is_ok(), "{b_ip:?}");
    let (_, out, _) = sh(&c, &a, &format!("nc -w 3 {b_ip} 9000 2>&1; echo \" exit=$?\"")).await;
    assert!(!out.contains("hello"), "{out:?}");
    // (A refused connection is reset right after its handshake with the proxy: the listener
    // never saw it.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(sh(&c, &b, "cat /tmp/conns").await.1, "c\n", "b's listener saw only its own connection");
    for s in [&a, &b] {
        assert_eq!(c.delete(s).await, 204);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_an_admin_defines_apply_to_running_sessions_within_a_second() {
    let w = world().await;
    let c = w.stack.client("acme");
    let admin = w.stack.admin_client();
    let sid = c.create("bbe").await["session_id"].as_str().unwrap().to_string();
    // The template names `by-api` ahead; until an admin defines it a switch is a conflict.
    let (status, body) = switch(&c, &sid, "by-api").await;
    assert_eq!((status, body["code"].as_str()), (409, Some("conflict")), "{body}");

    let put = |who: &Client, name: &str, allow: Value| {
        let (who, path) = (who.clone(), format!("/v1/egress/policies/{name}"));
        async move { who.call(Method::PUT, &path, Some(json!({ "allow": allow }))).await }
    };
    assert_eq!(put(&c, "by-api", json!([])).await.status, 403, "a tenant defines no policy");
    let bad = put(&admin, "by-api", json!(["10.0.0.0/99"])).await;
    assert_eq!((bad.status, bad.body["code"].as_str()), (400, Some("bad_request")), "{:?}", bad.body);
    assert_eq!(put(&admin, "both", json!([])).await.status, 409, "the config's own are read-only here");
    let a = put(&admin, "by-api", json!([format!("other.test:{}", w.other)])).await;
    assert_eq!((a.status, a.body["source"].as_str()), (200, Some("api")), "{:?}", a.body);
    let list = c.call(Method::GET, "/v1/egress/policies", None).await;
    let names: Vec<(&str, &str)> = list.body["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap(), p["source"].as_str().unwrap()))
        .collect();
    assert!(names.contains(&("by-api", "api")) && names.contains(&("deny-all", "config")), "{names:?}");

    // Within a second every node knows it.
    let within = Duration::from_millis(2500);
    let switched = eventually(within, || async { (switch(&c, &sid, "by-api").await.0 == 200).then_some(()) }).await;
    assert!(switched.is_some(), "the switch succeeds once the node has read the policy");
    assert_eq!(sh(&c, &sid, &wget("other.test", w.other)).await.1, "other");
    assert!(sh(&c, &sid, &wget("task.test", w.task)).await.1.contains("403"));

    // Redefined: an open connection the new rules refuse is cut, and the new rules hold.
    let hold =
        format!("(sleep 60 | (nc other.test {} > /tmp/o 2>&1; echo closed >> /tmp/o)) > /dev/null 2>&1 &", w.other);
    assert_eq!(sh(&c, &sid, &hold).await.0, 0);
    let read = || async { sh(&c, &sid, "cat /tmp/o 2>/dev/null").await.1 };
    assert!(
        eventually(Duration::from_secs(5), || async { read().await.contains("other").then_some(()) }).await.is_some()
    );
    assert_eq!(put(&admin, "by-api", json!([format!("task.test:{}", w.task)])).await.status, 200);
    let cut = eventually(within, || async { read().await.contains("closed").then_some(()) }).await;
    assert!(cut.is_some(), "cut when its policy was redefined: {:?}", read().await);
    assert_eq!(sh(&c, &sid, &wget("task.test", w.task)).await.1, "task");

    // Removed: the sessions still under it reach nothing.
    let del = admin.call(Method::DELETE, "/v1/egress/policies/by-api", None).await;
    assert_eq!(del.status, 204);
    let refused =
        eventually(within, || async { sh(&c, &sid, &wget("task.test", w.task)).await.1.contains("403").then_some(()) })
            .await;
    assert!(refused.is_some(), "a removed policy allows nothing");
    assert_eq!(admin.call(Method::DELETE, "/v1/egress/policies/by-api", None).await.status, 404);
    assert_eq!(c.delete(&sid).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_pool_manager_keeps_each_session_under_its_policy() {
    let mut w = world().await;
    let c = w.stack.client("acme");
    let under_both = c.create("bbe").await["session_id"].as_str().unwrap().to_string();
    let under_initial = c.create("bbe").await["session_id"].as_str().unwrap().to_string();
    assert_eq!(switch(&c, &under_both, "both").await.0, 200);

    let iface = w.stack.node.egress.as_ref().expect("an egress node").net.iface.clone();
    assert_eq!(tagged_rules(&iface), 6, "two redirects, three INPUT rules, one DOCKER-USER rule");

    w.stack.restart_pool_manager().await;
    assert_eq!(tagged_rules(&iface), 6, "the previous run's rules were replaced, not added to");

    // The proxy listens on new ports behind the same rules; each sandbox is readopted under
    // the policy the ledger recorded, not its template's initial one.
    assert_eq!(sh(&c, &under_both, &wget("other.test", w.other)).await.1, "other");
    assert!(sh(&c, &under_initial, &wget("other.test", w.other)).await.1.contains("403"));
    assert_eq!(sh(&c, &under_initial, &wget("task.test", w.task)).await.1, "task");
    let got = c.call(Method::GET, &format!("/v1/sessions/{under_both}"), None).await;
    assert_eq!(got.body["egress"], "both");
    // And switches still work.
    assert_eq!(switch(&c, &under_both, "deny-all").await.0, 200);
    assert!(sh(&c, &under_both, &wget("other.test", w.other)).await.1.contains("403"));
    for s in [&under_both, &under_initial] {
        assert_eq!(c.delete(s).await, 204);
    }
}

/// A server that counts the bytes it receives (`received`) and, once a connection has sent
/// some and paused, answers `got <n>\n`.
async fn recorder(ip: &str) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::Ordering;
    let listener = TcpListener::bind((ip, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let received = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let total = received.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let total = total.clone();
            tokio::spawn(async move {
                let (mut buf, mut n) = ([0u8; 4096], 0usize);
                loop {
                    match tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await {
                        Ok(Ok(0)) | Ok(Err(_)) => return,
                        Ok(Ok(k)) => {
                            n += k;
                            total.fetch_add(k, Ordering::SeqCst);
                        }
                        Err(_) if n > 0 => {
                            let _ = s.write_all(format!("got {n}\n").as_bytes()).await;
                            n = 0;
                        }
                        Err(_) => {}
                    }
                }
            });
        }
    });
    (port, received)
}

/// A server on 127.0.0.1 (what `localhost` resolves to on the node) that counts the
/// connections it accepts and answers each with an HTTP 200.
async fn loopback_service() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await;
                let _ = s.write_all(b"HTTP/1.0 200 OK\r\ncontent-length: 8\r\n\r\nloopback").await;
            });
        }
    });
    (port, accepted)
}

/// A raw request to the sandbox's proxy (`$http_proxy`): `input` is a shell command whose
/// output is sent.
fn to_proxy(input: &str) -> String {
    format!("{{ {input}; }} | nc -w 4 $(echo $http_proxy | sed 's|http://||; s|:| |') 2>&1; echo \" exit=$?\"")
}

/// The sum of this node's `sandpool_egress_connections_total` series of `outcome`.
async fn refusals_counted(stack: &Stack, outcome: &str) -> f64 {
    let url = stack.metrics_url.clone().expect("a stack with metrics");
    let text = stack.http.get(url).send().await.expect("metrics answers").text().await.expect("a body");
    let (node, outcome) = (format!("node=\"{}\"", stack.node.id), format!("outcome=\"{outcome}\""));
    text.lines()
        .filter(|l| l.starts_with("sandpool_egress_connections_total{") && l.contains(&node) && l.contains(&outcome))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_never_resolves_past_its_policy_to_loopback_private_or_link_local_addresses() {
    use std::sync::atomic::Ordering;
    // `localhost` resolves on the node (its /etc/hosts, as any name through the host's
    // resolver) to 127.0.0.1: a name rule for it is a tenant-controlled name pointing at the
    // host. Only an address rule naming 127.0.0.1 opens it.
    let (port, accepted) = loopback_service().await;
    let extra_toml = format!(
        r#"
[egress.policies.by-name]
allow = ["localhost:{port}"]

[egress.policies.by-address-too]
allow = ["localhost:{port}", "127.0.0.1:{port}"]

[templates.bbs]
image = "{img}"
memory_mb = 64
warm = 1
egress = "by-name"
egress_allowed = ["by-name", "by-address-too"]
"#,
        img = tests::BUSYBOX_IMAGE,
    );
    let stack = Stack::start(StackOpts { warm: 0, extra_toml, metrics: true, ..Default::default() }).await;
    stack.wait_idle("bbs", 1, FILL).await;
    let c = stack.client("acme");
    let sid = c.create("bbs").await["session_id"].as_str().unwrap().to_string();

    let get = format!("printf 'GET http://localhost:{port}/ HTTP/1.1\\r\\nHost: localhost:{port}\\r\\n\\r\\n'");
    let connect = format!("printf 'CONNECT localhost:{port} HTTP/1.1\\r\\n\\r\\n'; sleep 1");
    for req in [&get, &connect] {
        let (_, out, _) = sh(&c, &sid, &to_proxy(req)).await;
        assert!(out.starts_with("HTTP/1.1 403") && out.contains("127.0.0.1, loopback"), "{req}: {out:?}");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "the proxy never connected to what the name resolved to");
    assert!(refusals_counted(&stack, "screened").await >= 2.0, "the refusals are counted");

    // An address rule allowing 127.0.0.1 by itself opens it to the name too.
    assert_eq!(switch(&c, &sid, "by-address-too").await.0, 200);
    let (_, out, _) = sh(&c, &sid, &to_proxy(&get)).await;
    assert!(out.contains("200 OK") && out.contains("loopback"), "{out:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    assert_eq!(c.delete(&sid).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_and_sni_a_connection_presents_must_be_what_admitted_it() {
    use std::sync::atomic::Ordering;
    let task = server("127.0.0.2", "task").await;
    let other = server("127.0.0.3", "other").await;
    let (tls, received) = recorder("127.0.0.4").await;
    let extra_toml = format!(
        r#"
[egress.hosts]
"task.test" = "127.0.0.2"
"other.test" = "127.0.0.3"
"tls.test" = "127.0.0.4"

[egress.policies.narrow]
allow = ["task.test:{task}", "tls.test:{tls}", "other.test:{other}"]

[templates.bbn]
image = "{img}"
memory_mb = 64
warm = 1
egress = "narrow"
"#,
        img = tests::BUSYBOX_IMAGE,
    );
    let stack = Stack::start(StackOpts { warm: 0, extra_toml, metrics: true, ..Default::default() }).await;
    stack.wait_idle("bbn", 1, FILL).await;
    let c = stack.client("acme");
    let sid = c.create("bbn").await["session_id"].as_str().unwrap().to_string();

    // Plain HTTP through the proxy: admitted for task.test, a Host naming another host (even
    // one the policy allows on another port) is refused before anything goes upstream.
    let get = |host: &str| {
        format!("printf 'GET http://task.test:{task}/ HTTP/1.1\\r\\nHost: {host}\\r\\nAccept: */*\\r\\n\\r\\n'")
    };
    let (_, out, _) = sh(&c, &sid, &to_proxy(&get("other.test"))).await;
    assert!(out.starts_with("HTTP/1.1 403") && out.contains("\"other.test\""), "{out:?}");
    let (_, out, _) = sh(&c, &sid, &to_proxy(&get(&format!("Task.Test:{task}")))).await;
    assert!(out.contains("200 OK") && out.ends_with("task exit=0\n"), "its own name passes: {out:?}");
    // The same straight to the name's address (the node's DNS and the transparent proxy).
    let direct = |host: &str| {
        format!(
            "printf 'GET / HTTP/1.1\\r\\nHost: {host}\\r\\n\\r\\n' | nc -w 4 task.test {task} 2>&1; echo \" exit=$?\""
        )
    };
    let (_, out, _) = sh(&c, &sid, &direct("other.test")).await;
    assert!(!out.contains("200 OK") && !out.contains("task"), "{out:?}");
    let (_, out, _) = sh(&c, &sid, &direct("task.test")).await;
    assert!(out.contains("200 OK") && out.contains("task"), "{out:?}");

    // TLS in a CONNECT tunnel and straight to the name: the ClientHello's SNI must be the
    // admitted name; otherwise not one byte of it reaches the server.
    for (sni, file) in [("other.test", "/tmp/other"), ("tls.test", "/tmp/tls")] {
        let hello = pool_manager::egress::inspect::client_hello(Some(sni));
        assert_eq!(c.put_file(&sid, file, hello).await, 204, "{file}");
    }
    let tunnel = |file: &str| {
        to_proxy(&format!("printf 'CONNECT tls.test:{tls} HTTP/1.1\\r\\n\\r\\n'; sleep 0.5; cat {file}; sleep 1.5"))
    };
    let straight = |file: &str| {
        format!("{{ sleep 0.3; cat {file}; sleep 1.5; }} | nc -w 4 tls.test {tls} 2>&1; echo \" exit=$?\"")
    };
    for (how, cmd) in [("CONNECT", tunnel("/tmp/other")), ("direct", straight("/tmp/other"))] {
        let (_, out, _) = sh(&c, &sid, &cmd).await;
        assert!(!out.contains("got"), "{how}: {out:?}");
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(received.load(Ordering::SeqCst), 0, "no byte of a ClientHello naming other.test went upstream");
    let hello_len = pool_manager::egress::inspect::client_hello(Some("tls.test")).len();
    for (how, cmd) in [("CONNECT", tunnel("/tmp/tls")), ("direct", straight("/tmp/tls"))] {
        let (_, out, _) = sh(&c, &sid, &cmd).await;
        assert!(out.contains(&format!("got {hello_len}")), "{how}: {out:?}");
    }
    assert!(refusals_counted(&stack, "misnamed").await >= 4.0, "the refusals are counted");
    assert_eq!(c.delete(&sid).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_renames_an_egress_bridge_of_another_build_and_closes_egress_networks_it_does_not_serve() {
    let extra_toml = format!(
        "[templates.bbe]\nimage = \"{}\"\nmemory_mb = 64\nwarm = 0\negress = \"deny-all\"\n",
        tests::BUSYBOX_IMAGE
    );
    let mut stack = Stack::start(StackOpts { warm: 0, extra_toml, ..Default::default() }).await;
    let net = stack.node.egress.as_ref().expect("an egress node").net.clone();
    let (prefix, node) = (stack.cleanup.prefix.clone(), stack.node.id.clone());
    let docker = |args: &[&str]| {
        let out = std::process::Command::new("docker").args(args).output().expect("run docker");
        assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let bridge_of = |name: &str| {
        docker(&["network", "inspect", "-f", "{{index .Options \"com.docker.network.bridge.name\"}}", name])
    };
    assert_eq!(bridge_of(&net.name), net.iface);
    // As an earlier build left it: the same network under a bridge name derived otherwise,
    // with that build's host rules; and an egress network of this node no proxy serves.
    let old = format!("spe-old{}", tests::rand_hex(4));
    let stray = format!("spx-{}", tests::rand_hex(6));
    docker(&["network", "rm", &net.name]);
    for (name, iface) in
        [(net.name.clone(), old.clone()), (format!("sandpool-egress-{prefix}-{node}-stray"), stray.clone())]
    {
        let labels =
            [format!("sandpool.prefix={prefix}"), format!("sandpool.node={node}"), "sandpool.managed=true".into()];
        let mut args = vec![
            "network".to_string(),
            "create".into(),
            "-o".into(),
            format!("com.docker.network.bridge.name={iface}"),
        ];
        for l in labels {
            args.extend(["--label".to_string(), l]);
        }
        args.push(name);
        docker(&args.iter().map(String::as_str).collect::<Vec<_>>());
    }
    pool_manager::egress::firewall::install(&old, net.gateway, 1, 2).await.expect("the old build's rules");
    assert_eq!(tagged_rules(&old), 6);

    stack.restart_pool_manager().await;
    let now = stack.node.egress.as_ref().expect("an egress node").net.clone();
    assert_eq!(now.iface, net.iface, "the name is this build's");
    assert_eq!(bridge_of(&net.name), net.iface, "the network was made anew under it");
    assert_eq!(tagged_rules(&old), 0, "the old bridge's rules are gone");
    assert_eq!(tagged_rules(&net.iface), 6, "the proxy's rules name the bridge that exists");
    assert_eq!(tagged_rules(&stray), 2, "a bridge no proxy serves is closed: INPUT and DOCKER-USER");
    // And the network works: an egress session under deny-all is refused at once.
    let c = stack.client("acme");
    let sid = c.create("bbe").await["session_id"].as_str().unwrap().to_string();
    let (code, out, _) = sh(&c, &sid, "wget -q -O - http://task.test:1/ 2>&1").await;
    assert!(code != 0 && out.contains("403"), "{out:?}");
    assert_eq!(c.delete(&sid).await, 204);
}

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
async fn server(ip: &str, name: &'static str) -> u16 {
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

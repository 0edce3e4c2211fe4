//! `network = "bridge"` sandboxes reach the network the host routes for them, but never the
//! node's own services, nor one another.

use std::time::Duration;

use serde_json::json;
use tests::{Stack, StackOpts};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridge_sandboxes_cannot_reach_the_hosts_services_or_each_other() {
    let extra = format!("[templates.br]\nimage = \"{}\"\nnetwork = \"bridge\"\nwarm = 0\n", tests::BUSYBOX_IMAGE);
    let stack = Stack::start(StackOpts { warm: 0, extra_toml: extra, ..Default::default() }).await;
    let c = stack.client("t");
    // A service of the node listening on every address, as a careless one might.
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = tokio::spawn(async move { listener.accept().await.is_ok() });
    let sid = |s: serde_json::Value| s["session_id"].as_str().unwrap().to_string();
    let (a, b) = (sid(c.create("br").await), sid(c.create("br").await));

    let host =
        c.sh(&a, "ip route | awk '/^default/ { print $3 }'").await["stdout"].as_str().unwrap().trim().to_string();
    assert!(!host.is_empty(), "a bridge sandbox has a default route");
    let probe = format!("nc -w 2 {host} {port} </dev/null && echo open || echo closed");
    assert_eq!(c.sh(&a, &probe).await["stdout"], "closed\n", "a sandbox reached a host service at {host}:{port}");
    let host_ip = c.sh(&a, "ip -4 addr show eth0 | awk '/inet/ { print $2 }'").await; // its own, for the message
    // The host's other addresses are the host too.
    for addr in ["172.17.0.1", "127.0.0.1"] {
        let probe = format!("nc -w 2 {addr} {port} </dev/null && echo open || echo closed");
        assert_eq!(c.sh(&a, &probe).await["stdout"], "closed\n", "reached {addr}:{port} from {host_ip}");
    }
    assert!(!accepted.is_finished(), "the host's listener accepted a sandbox's connection");

    // Another sandbox on the same bridge is no neighbour either.
    let b_ip = c.sh(&b, "ip -4 addr show eth0 | awk '/inet/ { split($2, a, \"/\"); print a[1] }'").await["stdout"]
        .as_str()
        .unwrap()
        .trim()
        .to_string();
    let listen = c.exec(&b, json!({"cmd": "nc -l -p 7000 -w 5 >/dev/null 2>&1 & echo started", "timeout_ms": 8000}));
    assert_eq!(listen.await.body["stdout"], "started\n");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let probe = format!("nc -w 2 {b_ip} 7000 </dev/null && echo open || echo closed");
    assert_eq!(c.sh(&a, &probe).await["stdout"], "closed\n", "one bridge sandbox reached another at {b_ip}");

    for s in [&a, &b] {
        assert_eq!(c.delete(s).await, 204);
    }
    stack.shutdown().await;
}

/// A rule standing in for the node's bridge rule while a test takes that one out. Dropped
/// (even when the test fails), it puts the node's rule back if it is missing, then goes.
struct StandIn {
    rule: Vec<String>,
    node_rule: [&'static str; 5],
}

impl Drop for StandIn {
    fn drop(&mut self) {
        if !iptables(&["-C"].into_iter().chain(self.node_rule).collect::<Vec<_>>()) {
            iptables(&["-I"].into_iter().chain(self.node_rule).collect::<Vec<_>>());
        }
        iptables(&["-D"].into_iter().chain(self.rule.iter().map(String::as_str)).collect::<Vec<_>>());
    }
}

fn iptables(args: &[&str]) -> bool {
    std::process::Command::new("iptables").arg("-w").args(args).output().is_ok_and(|o| o.status.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_is_filtered_from_the_start_even_when_no_configured_template_uses_it() {
    let bridge = pool_manager::docker::BRIDGE_IFACE;
    let guard = ["INPUT", "-i", bridge, "-j", "DROP"];
    // Stand in for the node's rule meanwhile (other tests' bridge sandboxes stay filtered),
    // under a comment of this test's, which `-C` of the node's rule does not match.
    let hold = format!("sandpool-test-hold-{}", tests::rand_hex(6));
    let held: Vec<String> =
        ["INPUT", "-i", bridge, "-m", "comment", "--comment", &hold, "-j", "DROP"].map(String::from).to_vec();
    assert!(iptables(&["-I"].into_iter().chain(held.iter().map(String::as_str)).collect::<Vec<_>>()));
    let _held = StandIn { rule: held, node_rule: guard };
    while iptables(&["-D"].into_iter().chain(guard).collect::<Vec<_>>()) {}
    assert!(!iptables(&["-C"].into_iter().chain(guard).collect::<Vec<_>>()), "the node's rule is out of the way");

    // The default test config has no bridge template (nor an egress one).
    let stack = Stack::start(StackOpts { warm: 0, ..Default::default() }).await;
    assert!(
        stack.config.templates.values().all(|t| t.network != wire::Network::Bridge),
        "no configured template uses the bridge"
    );
    assert!(
        iptables(&["-C"].into_iter().chain(guard).collect::<Vec<_>>()),
        "the host refuses the bridge's packets from the start"
    );
    stack.shutdown().await;
}

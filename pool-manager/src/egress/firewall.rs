//! The host rules that make the node's proxy the egress network's only way out. Every rule
//! carries a comment naming the network's bridge, so a restart removes the previous run's
//! (whose ports differ) before adding its own.
//!
//! - nat PREROUTING: every TCP connection from the bridge, whatever its destination, is
//!   redirected to the proxy (which reads the original destination), and every DNS query (UDP
//!   53) to the node's DNS.
//! - filter INPUT: from the bridge, the host accepts only those two ports on the gateway
//!   address; everything else is dropped (the node's services, Redis, Docker, anything).
//! - filter DOCKER-USER (first in FORWARD, kept first by Docker): nothing from the bridge is
//!   forwarded anywhere (UDP, ICMP, other sandboxes), refused at once with an ICMP error.

use std::net::Ipv4Addr;

use std::process::Command;

use anyhow::Context as _;

fn tag(iface: &str) -> String {
    format!("sandpool-egress:{iface}")
}

fn iptables(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("iptables").arg("-w").args(args).output().context("run iptables")?;
    anyhow::ensure!(
        out.status.success(),
        "iptables {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Removes every rule of this bridge (from any earlier run). Blocking (the test harness
/// calls it on drop); `install` runs it off the async threads.
pub fn remove(iface: &str) -> anyhow::Result<()> {
    let tag = tag(iface);
    for (table, chain) in [("nat", "PREROUTING"), ("filter", "INPUT"), ("filter", "DOCKER-USER")] {
        let listed = match iptables(&["-t", table, "-S", chain]) {
            Ok(l) => l,
            // No DOCKER-USER chain: nothing of ours in it.
            Err(_) if chain == "DOCKER-USER" => continue,
            Err(e) => return Err(e),
        };
        for rule in tagged(&listed, &tag) {
            let mut args: Vec<&str> = vec!["-t", table, "-D"];
            args.extend(rule.iter().map(String::as_str));
            iptables(&args)?;
        }
    }
    Ok(())
}

/// The rules of an `iptables -S` listing that carry `tag` as their comment, each as the
/// arguments that name it (after `-A`). iptables prints a comment in double quotes.
fn tagged(listing: &str, tag: &str) -> Vec<Vec<String>> {
    listing
        .lines()
        .filter_map(|l| l.strip_prefix("-A "))
        .map(|l| l.split_whitespace().map(|w| w.trim_matches('"').to_string()).collect::<Vec<_>>())
        .filter(|words| words.iter().any(|w| w == tag))
        .collect()
}

/// Puts this run's rules in place: connections to `proxy_port`, DNS to `dns_port`, both on
/// `gateway`.
pub async fn install(iface: &str, gateway: Ipv4Addr, proxy_port: u16, dns_port: u16) -> anyhow::Result<()> {
    let iface = iface.to_string();
    tokio::task::spawn_blocking(move || install_blocking(&iface, gateway, proxy_port, dns_port)).await?
}

fn install_blocking(iface: &str, gateway: Ipv4Addr, proxy_port: u16, dns_port: u16) -> anyhow::Result<()> {
    remove(iface)?;
    let tag = tag(iface);
    let gw = gateway.to_string();
    let (proxy, dns) = (proxy_port.to_string(), dns_port.to_string());
    let c = ["-m", "comment", "--comment", tag.as_str()];
    let rule = |table: &'static str, chain: &'static str, spec: Vec<&'static str>| (table, chain, spec);
    // Inserted at the top in this order, so the last listed comes first.
    let mut rules = vec![
        rule("nat", "PREROUTING", vec!["-p", "tcp", "-j", "REDIRECT", "--to-ports", "PROXY"]),
        rule("nat", "PREROUTING", vec!["-p", "udp", "--dport", "53", "-j", "REDIRECT", "--to-ports", "DNS"]),
        rule("filter", "INPUT", vec!["-j", "DROP"]),
        rule("filter", "INPUT", vec!["-d", "GW", "-p", "tcp", "--dport", "PROXY", "-j", "ACCEPT"]),
        rule("filter", "INPUT", vec!["-d", "GW", "-p", "udp", "--dport", "DNS", "-j", "ACCEPT"]),
    ];
    if iptables(&["-t", "filter", "-S", "DOCKER-USER"]).is_ok() {
        rules.push(rule("filter", "DOCKER-USER", vec!["-j", "REJECT", "--reject-with", "icmp-admin-prohibited"]));
    } else {
        tracing::warn!("no DOCKER-USER chain: forwarding from the egress network is left to Docker's isolation rules");
    }
    for (table, chain, spec) in rules {
        let spec: Vec<&str> = spec
            .into_iter()
            .map(|w| match w {
                "PROXY" => proxy.as_str(),
                "DNS" => dns.as_str(),
                "GW" => gw.as_str(),
                w => w,
            })
            .collect();
        let mut args = vec!["-t", table, "-I", chain, "-i", iface];
        args.extend(spec);
        args.extend(c);
        iptables(&args)?;
    }
    tracing::info!(iface, %gateway, proxy_port, dns_port, "egress: the proxy is the network's only way out");
    Ok(())
}

/// Closes a bridge no proxy serves (an egress network of an earlier run, kept by Docker):
/// the host accepts nothing from it and forwards nothing from it. Its previous rules go first.
pub async fn close(iface: &str) -> anyhow::Result<()> {
    let iface = iface.to_string();
    tokio::task::spawn_blocking(move || close_blocking(&iface)).await?
}

fn close_blocking(iface: &str) -> anyhow::Result<()> {
    remove(iface)?;
    let tag = tag(iface);
    let c = ["-m", "comment", "--comment", tag.as_str()];
    let mut chains = vec![("filter", "INPUT", "DROP")];
    if iptables(&["-t", "filter", "-S", "DOCKER-USER"]).is_ok() {
        chains.push(("filter", "DOCKER-USER", "REJECT"));
    }
    for (table, chain, target) in chains {
        let mut args = vec!["-t", table, "-I", chain, "-i", iface, "-j", target];
        args.extend(c);
        iptables(&args)?;
    }
    tracing::info!(iface, "egress: a bridge no proxy serves is closed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rules_of_a_bridge_are_found_in_a_listing_whatever_the_quoting() {
        let listing = "-P PREROUTING ACCEPT\n\
-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER\n\
-A PREROUTING -i spe-1 -p tcp -m comment --comment \"sandpool-egress:spe-1\" -j REDIRECT --to-ports 43033\n\
-A PREROUTING -i spe-12 -p tcp -m comment --comment \"sandpool-egress:spe-12\" -j REDIRECT --to-ports 1\n\
-A PREROUTING -i spe-1 -p udp -m udp --dport 53 -m comment --comment sandpool-egress:spe-1 -j REDIRECT --to-ports 2\n";
        let found = tagged(listing, &tag("spe-1"));
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0][0..2], ["PREROUTING", "-i"]);
        assert!(found[0].contains(&"sandpool-egress:spe-1".to_string()), "quotes are stripped: {:?}", found[0]);
        assert!(found.iter().all(|r| r.contains(&"spe-1".to_string())), "not spe-12's");
    }
}

//! Named egress policies: what a sandbox on the egress network may connect to. A policy is a
//! list of rules; a connection is allowed when one rule matches its destination. The node's
//! egress proxy (`pool-manager/src/egress`) checks every new connection against the session's
//! current policy; this module is the one place that says what a rule means.
//!
//! A rule is `HOST[:PORT]`:
//! - HOST is a DNS name (`deb.debian.org`), a wildcard of a name's subdomains
//!   (`*.debian.org`: `a.debian.org`, `a.b.debian.org`, not `debian.org`), an IPv4 address or
//!   an IPv4 CIDR (`10.1.0.0/16`);
//! - PORT is a port number or `*`; no port means any port.
//!
//! A name rule matches connections made by name (through the proxy, or to an address that the
//! node's DNS handed out for that name); an address rule matches connections to an address.

use std::collections::BTreeMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::sync::Arc;

/// The policy every egress template may use, allowing nothing.
pub const DENY_ALL: &str = "deny-all";

/// A policy's name: 1-64 characters of a-z, 0-9, '-' and '_'.
pub fn is_policy_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// Where a connection goes, as the proxy knows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Dest {
    /// By name (lowercase, no trailing dot).
    Name(String),
    Ip(Ipv4Addr),
}

impl fmt::Display for Dest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dest::Name(n) => f.write_str(n),
            Dest::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Host {
    Name(String),
    /// `*.suffix`: stored as `.suffix`.
    Subdomains(String),
    Cidr(Ipv4Addr, u8),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    host: Host,
    /// `None`: any port.
    port: Option<u16>,
}

impl Rule {
    pub fn parse(s: &str) -> Result<Rule, String> {
        let s = s.trim();
        let (host, port) = match s.rsplit_once(':') {
            Some((h, "*")) => (h, None),
            Some((h, p)) => (
                h,
                Some(p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| format!("{s:?}: {p:?} is not a port"))?),
            ),
            None => (s, None),
        };
        let host = if let Some((ip, bits)) = host.split_once('/') {
            let ip: Ipv4Addr = ip.parse().map_err(|_| format!("{s:?}: {ip:?} is not an IPv4 address"))?;
            let bits: u8 = bits
                .parse()
                .ok()
                .filter(|b| *b <= 32)
                .ok_or_else(|| format!("{s:?}: {bits:?} is not a prefix length 0-32"))?;
            Host::Cidr(ip, bits)
        } else if let Ok(ip) = host.parse::<Ipv4Addr>() {
            Host::Cidr(ip, 32)
        } else if let Some(suffix) = host.strip_prefix("*.") {
            Host::Subdomains(format!(".{}", name(s, suffix)?))
        } else {
            Host::Name(name(s, host)?)
        };
        Ok(Rule { host, port })
    }

    pub fn matches(&self, dest: &Dest, port: u16) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        match (&self.host, dest) {
            (Host::Name(n), Dest::Name(d)) => n == d,
            (Host::Subdomains(suffix), Dest::Name(d)) => d.ends_with(suffix.as_str()),
            (Host::Cidr(net, bits), Dest::Ip(ip)) => in_cidr(*ip, *net, *bits),
            _ => false,
        }
    }

    /// Whether this rule can allow some port of the name `dest` (DNS answers only such names).
    pub fn names(&self, dest: &str) -> bool {
        match &self.host {
            Host::Name(n) => n == dest,
            Host::Subdomains(suffix) => dest.ends_with(suffix.as_str()),
            Host::Cidr(..) => false,
        }
    }
}

fn name(rule: &str, n: &str) -> Result<String, String> {
    let n = n.trim_end_matches('.').to_ascii_lowercase();
    let ok = !n.is_empty()
        && n.len() <= 253
        && n.split('.').all(|l| {
            !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if ok { Ok(n) } else { Err(format!("{rule:?}: {n:?} is not a host name, IPv4 address or CIDR")) }
}

pub fn in_cidr(ip: Ipv4Addr, net: Ipv4Addr, bits: u8) -> bool {
    let mask = if bits == 0 { 0 } else { u32::MAX << (32 - bits) };
    u32::from(ip) & mask == u32::from(net) & mask
}

/// A named list of rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub name: String,
    pub rules: Vec<Rule>,
    /// As written in the config, for display.
    pub allow: Vec<String>,
}

impl Policy {
    pub fn new(name: &str, allow: &[String]) -> Result<Policy, String> {
        let rules = allow.iter().map(|r| Rule::parse(r)).collect::<Result<_, _>>()?;
        Ok(Policy { name: name.to_string(), rules, allow: allow.to_vec() })
    }

    pub fn allows(&self, dest: &Dest, port: u16) -> bool {
        self.rules.iter().any(|r| r.matches(dest, port))
    }

    /// Whether a rule names this destination itself: the name (not a wildcard), or the
    /// address as a /32. The node's own addresses are reachable only so, never through a
    /// wider rule (`0.0.0.0/0` does not open the host's loopback).
    pub fn names_exactly(&self, dest: &Dest, port: u16) -> bool {
        self.rules.iter().any(|r| {
            r.matches(dest, port)
                && match (&r.host, dest) {
                    (Host::Name(_), Dest::Name(_)) => true,
                    (Host::Cidr(_, bits), Dest::Ip(_)) => *bits == 32,
                    _ => false,
                }
        })
    }

    /// Whether the node's DNS answers `name` for a sandbox under this policy.
    pub fn names(&self, name: &str) -> bool {
        self.rules.iter().any(|r| r.names(name))
    }
}

/// `[egress]`: the node's named policies (with `deny-all` always present) and the names it
/// resolves itself before asking the host's resolver.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EgressConfig {
    pub policies: BTreeMap<String, Arc<Policy>>,
    pub hosts: BTreeMap<String, Ipv4Addr>,
}

impl EgressConfig {
    pub fn policy(&self, name: &str) -> Option<&Arc<Policy>> {
        self.policies.get(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allows(rule: &str, dest: &str, port: u16) -> bool {
        let dest = dest.parse().map(Dest::Ip).unwrap_or_else(|_| Dest::Name(dest.to_string()));
        Rule::parse(rule).unwrap().matches(&dest, port)
    }

    #[test]
    fn rules_match_names_wildcards_addresses_and_ports() {
        assert!(allows("deb.debian.org", "deb.debian.org", 443));
        assert!(allows("deb.debian.org:80", "deb.debian.org", 80));
        assert!(!allows("deb.debian.org:80", "deb.debian.org", 443));
        assert!(allows("Deb.Debian.org.:*", "deb.debian.org", 1));
        assert!(allows("*.debian.org:443", "a.b.debian.org", 443));
        assert!(!allows("*.debian.org:443", "debian.org", 443));
        assert!(!allows("*.debian.org:443", "evildebian.org", 443));
        assert!(allows("10.1.0.0/16", "10.1.200.3", 22));
        assert!(!allows("10.1.0.0/16", "10.2.0.1", 22));
        assert!(allows("127.0.0.2:8080", "127.0.0.2", 8080));
        assert!(!allows("127.0.0.2:8080", "127.0.0.3", 8080));
        assert!(allows("0.0.0.0/0:443", "192.0.2.1", 443));
        // A name rule never matches a bare address, nor an address rule a name.
        assert!(!allows("task.test", "127.0.0.2", 80));
        assert!(!allows("127.0.0.2", "task.test", 80));
        for bad in ["", "a..b", "x:0", "x:99999", "10.0.0.0/33", "1.2.3.4/x", "*.", "a b"] {
            assert!(Rule::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_policy_names_what_its_name_rules_cover() {
        let p = Policy::new("p", &["task.test:8080".into(), "*.mirror.test".into(), "10.0.0.0/8".into()]).unwrap();
        assert!(p.names("task.test") && p.names("a.mirror.test"));
        assert!(!p.names("other.test") && !p.names("10.0.0.1"));
        assert!(p.allows(&Dest::Name("task.test".into()), 8080));
        assert!(!p.allows(&Dest::Name("task.test".into()), 8081));
        assert!(p.names_exactly(&Dest::Name("task.test".into()), 8080));
        assert!(!p.names_exactly(&Dest::Name("a.mirror.test".into()), 80), "a wildcard is not exact");
        assert!(!p.names_exactly(&Dest::Ip("10.0.0.1".parse().unwrap()), 80), "a /8 is not exact");
        let q = Policy::new("q", &["127.0.0.2:80".into()]).unwrap();
        assert!(q.names_exactly(&Dest::Ip("127.0.0.2".parse().unwrap()), 80));
    }
}

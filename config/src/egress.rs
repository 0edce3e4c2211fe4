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
//!
//! What a name resolves to is not the tenant's to choose: an address the host's resolver gives
//! for a name that is `screened` (loopback, private, link-local, the node's own...) is used
//! only if an address rule of the policy allows it too (`Policy::allows_address`), and the
//! name a connection presents inside (HTTP `Host`, TLS SNI) must be one the rule that admitted
//! it covers (`Policy::admits_as`).

use serde::Deserialize;

use crate::{ConfigError, invalid};
use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
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
    /// By address (a connection to an IP, or an address the node's DNS did not hand out).
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

/// One rule of a policy: a host pattern and a port, or any port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    host: Host,
    /// `None`: any port.
    port: Option<u16>,
}

impl Rule {
    /// Parses `HOST[:PORT]` (see the module doc); the message says what is wrong.
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

    /// Whether a connection to `dest` on `port` is allowed by this rule.
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

/// IPv4 ranges no name may resolve to (unless an address rule allows the address itself): a
/// tenant controlling the DNS of an allowed name must not reach the cloud's metadata service,
/// the LAN or the host through it.
const SCREENED_V4: &[(Ipv4Addr, u8, &str)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8, "unspecified"),
    (Ipv4Addr::new(10, 0, 0, 0), 8, "private"),
    (Ipv4Addr::new(100, 64, 0, 0), 10, "shared (CGNAT)"),
    (Ipv4Addr::new(127, 0, 0, 0), 8, "loopback"),
    (Ipv4Addr::new(169, 254, 0, 0), 16, "link-local"),
    (Ipv4Addr::new(172, 16, 0, 0), 12, "private"),
    (Ipv4Addr::new(192, 0, 0, 0), 24, "IETF protocol assignments"),
    (Ipv4Addr::new(192, 168, 0, 0), 16, "private"),
    (Ipv4Addr::new(198, 18, 0, 0), 15, "benchmarking"),
    (Ipv4Addr::new(224, 0, 0, 0), 4, "multicast"),
    (Ipv4Addr::new(240, 0, 0, 0), 4, "reserved or broadcast"),
];

/// Whether a name may not resolve to `ip` (and why): loopback, private, link-local, shared,
/// unspecified, multicast, broadcast and reserved addresses, of IPv4 and IPv6 (an IPv4-mapped
/// IPv6 address as its IPv4 one). The node's own addresses are for the caller to add.
pub fn screened(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => SCREENED_V4.iter().find(|(net, bits, _)| in_cidr(v4, *net, *bits)).map(|(_, _, why)| *why),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return screened(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unspecified() {
                Some("unspecified")
            } else if first & 0xffc0 == 0xfe80 {
                Some("link-local")
            } else if first & 0xfe00 == 0xfc00 {
                Some("private")
            } else if v6.is_multicast() {
                Some("multicast")
            } else if first == 0x64 && v6.segments()[1] == 0xff9b {
                // NAT64 (RFC 6052): the IPv4 address it embeds.
                let o = v6.octets();
                screened(IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15])))
            } else {
                None
            }
        }
    }
}

/// Whether `ip` lies in the network `net`/`bits`.
pub fn in_cidr(ip: Ipv4Addr, net: Ipv4Addr, bits: u8) -> bool {
    let mask = if bits == 0 { 0 } else { u32::MAX << (32 - bits) };
    u32::from(ip) & mask == u32::from(net) & mask
}

/// A named list of rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The policy's name, as templates and sessions name it.
    pub name: String,
    /// Its rules, parsed; a connection is allowed when one matches.
    pub rules: Vec<Rule>,
    /// As written in the config, for display.
    pub allow: Vec<String>,
}

impl Policy {
    /// A policy of the rules in `allow`; the message names the first rule that does not parse.
    pub fn new(name: &str, allow: &[String]) -> Result<Policy, String> {
        let rules = allow.iter().map(|r| Rule::parse(r)).collect::<Result<_, _>>()?;
        Ok(Policy { name: name.to_string(), rules, allow: allow.to_vec() })
    }

    /// Whether a connection to `dest` on `port` is allowed (one rule matches).
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

    /// Whether an address rule allows `ip:port` by itself; one of the node's own addresses
    /// (`own`) only through a rule naming it as a /32. What decides whether a name may resolve
    /// to a screened address: never to one the policy would not allow by address.
    pub fn allows_address(&self, ip: Ipv4Addr, port: u16, own: bool) -> bool {
        let dest = Dest::Ip(ip);
        if own { self.names_exactly(&dest, port) } else { self.allows(&dest, port) }
    }

    /// Whether the name a connection admitted for `admitted:port` presents inside (its HTTP
    /// `Host`, its TLS SNI) is covered by a name rule that admits it: `*.a.test` admits
    /// `x.a.test` presenting `y.a.test`, `x.a.test:443` does not admit it presenting `y.a.test`.
    pub fn admits_as(&self, admitted: &Dest, port: u16, presented: &str) -> bool {
        let presented = Dest::Name(presented.trim_end_matches('.').to_ascii_lowercase());
        self.rules.iter().any(|r| {
            matches!(r.host, Host::Name(_) | Host::Subdomains(_))
                && r.matches(admitted, port)
                && r.matches(&presented, port)
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
    /// Every policy by name, `deny-all` included.
    pub policies: BTreeMap<String, Arc<Policy>>,
    /// Names the node answers itself, and their addresses.
    pub hosts: BTreeMap<String, Ipv4Addr>,
}

impl EgressConfig {
    /// The policy named `name`, if there is one.
    pub fn policy(&self, name: &str) -> Option<&Arc<Policy>> {
        self.policies.get(name)
    }
}

// ---------- the raw `[egress]` section and its validation ----------

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawEgress {
    policies: BTreeMap<String, RawPolicy>,
    /// Names the node resolves itself (before the host's resolver), to IPv4 addresses.
    hosts: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawPolicy {
    allow: Vec<String>,
}

pub(crate) fn validate_egress(raw: RawEgress) -> Result<EgressConfig, ConfigError> {
    use std::sync::Arc;
    let mut policies = BTreeMap::new();
    policies.insert(DENY_ALL.to_string(), Arc::new(Policy::new(DENY_ALL, &[]).expect("empty")));
    for (name, p) in raw.policies {
        let field = format!("egress.policies.{name}");
        if !is_policy_name(&name) {
            return Err(invalid(&field, "policy names are 1-64 characters of a-z, 0-9, '-' and '_'"));
        }
        if name == DENY_ALL {
            return Err(invalid(&field, "deny-all is built in (it allows nothing)"));
        }
        let policy = Policy::new(&name, &p.allow).map_err(|e| invalid(format!("{field}.allow"), e))?;
        policies.insert(name, Arc::new(policy));
    }
    let mut hosts = BTreeMap::new();
    for (name, ip) in raw.hosts {
        let field = format!("egress.hosts.{name}");
        let rule = Rule::parse(&name).map_err(|e| invalid(&field, e))?;
        if !rule.names(&name.to_ascii_lowercase()) || name.contains(['*', ':']) {
            return Err(invalid(&field, "must be a host name"));
        }
        let ip = ip.parse().map_err(|_| invalid(&field, format!("{ip:?} is not an IPv4 address")))?;
        hosts.insert(name.to_ascii_lowercase(), ip);
    }
    Ok(EgressConfig { policies, hosts })
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
    fn names_may_not_resolve_to_the_metadata_service_the_lan_or_the_host() {
        let v4 = |s: &str| screened(IpAddr::V4(s.parse().unwrap()));
        let v6 = |s: &str| screened(IpAddr::V6(s.parse().unwrap()));
        assert_eq!(v4("169.254.169.254"), Some("link-local"));
        for private in ["10.1.2.3", "172.16.0.1", "172.31.255.255", "192.168.1.1"] {
            assert_eq!(v4(private), Some("private"), "{private}");
        }
        assert_eq!(v4("100.64.0.1"), Some("shared (CGNAT)"));
        assert_eq!(v4("127.0.0.1"), Some("loopback"));
        assert_eq!(v4("0.0.0.0"), Some("unspecified"));
        assert_eq!(v4("224.0.0.251"), Some("multicast"));
        assert_eq!(v4("255.255.255.255"), Some("reserved or broadcast"));
        for public in ["1.1.1.1", "172.32.0.1", "100.128.0.1", "192.0.2.1", "151.101.1.1"] {
            assert_eq!(v4(public), None, "{public}");
        }
        assert_eq!(v6("::1"), Some("loopback"));
        assert_eq!(v6("fe80::1"), Some("link-local"));
        assert_eq!(v6("fd00:ec2::254"), Some("private"));
        assert_eq!(v6("::ffff:169.254.169.254"), Some("link-local"));
        assert_eq!(v6("64:ff9b::a9fe:a9fe"), Some("link-local"));
        assert_eq!(v6("2606:4700::1111"), None);

        // A screened address is still reachable through an address rule allowing it; the
        // node's own only through a /32 naming it.
        let p = Policy::new("p", &["*.a.test".into(), "10.0.0.0/8:443".into(), "127.0.0.1:8080".into()]).unwrap();
        assert!(p.allows_address("10.1.2.3".parse().unwrap(), 443, false));
        assert!(!p.allows_address("10.1.2.3".parse().unwrap(), 80, false));
        assert!(!p.allows_address("169.254.169.254".parse().unwrap(), 80, false));
        assert!(p.allows_address("127.0.0.1".parse().unwrap(), 8080, true));
        let wide = Policy::new("w", &["0.0.0.0/0".into()]).unwrap();
        assert!(!wide.allows_address("127.0.0.1".parse().unwrap(), 8080, true), "a /0 never covers the node");
    }

    #[test]
    fn the_presented_name_must_be_covered_by_the_rule_that_admitted_the_connection() {
        let p = Policy::new("p", &["allowed.test:443".into(), "*.cdn.test".into(), "10.0.0.1".into()]).unwrap();
        let name = |n: &str| Dest::Name(n.into());
        assert!(p.admits_as(&name("allowed.test"), 443, "allowed.test"));
        assert!(p.admits_as(&name("allowed.test"), 443, "Allowed.Test."));
        assert!(!p.admits_as(&name("allowed.test"), 443, "other.test"));
        assert!(p.admits_as(&name("a.cdn.test"), 443, "b.cdn.test"), "the same wildcard");
        assert!(!p.admits_as(&name("a.cdn.test"), 443, "allowed.test"), "another rule's name");
        assert!(!p.admits_as(&Dest::Ip("10.0.0.1".parse().unwrap()), 80, "10.0.0.1"), "no name rule");
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

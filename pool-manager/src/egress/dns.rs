//! The little DNS the egress network's sandboxes see: one question per query, answered from the
//! session's policy. A name the policy allows gets an A record of a stand-in address (see
//! `Names`), which the proxy maps back to the name on connect; any other name is NXDOMAIN, so a
//! denied name fails at once instead of hanging. Only what a stub resolver sends is read.

use std::collections::HashMap;
use std::net::Ipv4Addr;

/// Stand-in addresses come from 198.18.0.0/15 (RFC 2544, benchmarking: never routed on the
/// internet), so a stand-in cannot be mistaken for a real destination.
pub const STAND_IN_NET: (Ipv4Addr, u8) = (Ipv4Addr::new(198, 18, 0, 0), 15);
const STAND_INS: u32 = 1 << 17;
/// Answers are short-lived: a policy switch should reach resolvers' caches quickly.
const TTL_S: u32 = 5;

const TYPE_A: u16 = 1;
const RCODE_FORMERR: u8 = 1;
const RCODE_NXDOMAIN: u8 = 3;
const RCODE_NOTIMP: u8 = 4;

/// Name ↔ stand-in address, shared by the node's sandboxes (the policy check happens on
/// connect, per session). After 131,072 names the oldest stand-ins are reused.
#[derive(Default)]
pub struct Names {
    by_name: HashMap<String, Ipv4Addr>,
    by_ip: HashMap<Ipv4Addr, String>,
    next: u32,
}

impl Names {
    /// The stand-in address for `name`, handing out the next one (and forgetting the name that held
    /// it) the first time.
    pub fn stand_in(&mut self, name: &str) -> Ipv4Addr {
        if let Some(ip) = self.by_name.get(name) {
            return *ip;
        }
        let ip = Ipv4Addr::from(u32::from(STAND_IN_NET.0) + 1 + self.next % (STAND_INS - 2));
        self.next = self.next.wrapping_add(1);
        if let Some(old) = self.by_ip.insert(ip, name.to_string()) {
            self.by_name.remove(&old);
        }
        self.by_name.insert(name.to_string(), ip);
        ip
    }

    /// The name a stand-in address was handed out for, if it is still held.
    pub fn name_of(&self, ip: Ipv4Addr) -> Option<&str> {
        self.by_ip.get(&ip).map(String::as_str)
    }
}

/// A query's question, as far as the answer needs it.
#[derive(Debug, PartialEq, Eq)]
pub struct Question {
    /// The name asked for, its labels joined with dots.
    pub name: String,
    /// The record type asked for (only A, type 1, gets an address).
    pub qtype: u16,
    /// Where the question section ends (the answer copies it).
    end: usize,
}

/// Reads the one question of a standard query; `Err(rcode)` for what is not one.
pub fn parse(q: &[u8]) -> Result<Question, u8> {
    if q.len() < 12 {
        return Err(RCODE_FORMERR);
    }
    let (flags, qdcount) = (u16::from_be_bytes([q[2], q[3]]), u16::from_be_bytes([q[4], q[5]]));
    if flags & 0x8000 != 0 || qdcount != 1 {
        return Err(RCODE_FORMERR);
    }
    if (flags >> 11) & 0xf != 0 {
        return Err(RCODE_NOTIMP);
    }
    let mut i = 12;
    let mut labels = Vec::new();
    loop {
        let len = *q.get(i).ok_or(RCODE_FORMERR)? as usize;
        i += 1;
        if len == 0 {
            break;
        }
        // No compression in a question of a query; labels are at most 63 bytes.
        if len > 63 || i + len > q.len() {
            return Err(RCODE_FORMERR);
        }
        labels.push(String::from_utf8_lossy(&q[i..i + len]).to_ascii_lowercase());
        i += len;
    }
    if i + 4 > q.len() || labels.is_empty() {
        return Err(RCODE_FORMERR);
    }
    let qtype = u16::from_be_bytes([q[i], q[i + 1]]);
    Ok(Question { name: labels.join("."), qtype, end: i + 4 })
}

/// The answer to `query` (whose question is `question`): `Some(ip)` answers A queries with
/// it (other types: no records); `None` is NXDOMAIN.
pub fn answer(query: &[u8], question: &Question, ip: Option<Ipv4Addr>) -> Vec<u8> {
    let mut out = Vec::with_capacity(question.end + 16);
    out.extend_from_slice(&query[..2]);
    let rd = query[2] & 0x01;
    let rcode = if ip.is_some() { 0 } else { RCODE_NXDOMAIN };
    out.extend_from_slice(&[0x84 | rd, 0x80 | rcode]); // QR, AA, RD as asked; RA
    let answers = u16::from(ip.is_some() && question.qtype == TYPE_A);
    out.extend_from_slice(&[0, 1]);
    out.extend_from_slice(&answers.to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&query[12..question.end]);
    if let (Some(ip), 1) = (ip, answers) {
        out.extend_from_slice(&[0xc0, 12]); // the name: a pointer to the question's
        out.extend_from_slice(&TYPE_A.to_be_bytes());
        out.extend_from_slice(&[0, 1]);
        out.extend_from_slice(&TTL_S.to_be_bytes());
        out.extend_from_slice(&[0, 4]);
        out.extend_from_slice(&ip.octets());
    }
    out
}

/// The error answer to a query that `parse` refused (or nothing, if it is too short to say).
pub fn error(query: &[u8], rcode: u8) -> Option<Vec<u8>> {
    if query.len() < 12 {
        return None;
    }
    let mut out = query[..12].to_vec();
    out[2] = 0x80 | (query[2] & 0x79);
    out[3] = 0x80 | rcode;
    out[4..12].fill(0);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query as a stub resolver sends it.
    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0xab, 0xcd, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in name.split('.') {
            q.push(l.len() as u8);
            q.extend_from_slice(l.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&[0, 1]);
        q
    }

    #[test]
    fn an_allowed_name_gets_its_stand_in_and_others_nxdomain() {
        let q = query("Task.Test", TYPE_A);
        let question = parse(&q).unwrap();
        assert_eq!((question.name.as_str(), question.qtype), ("task.test", TYPE_A));
        let ip = Ipv4Addr::new(198, 18, 0, 1);
        let a = answer(&q, &question, Some(ip));
        assert_eq!(&a[..2], &[0xab, 0xcd], "same id");
        assert_eq!((a[3] & 0xf, u16::from_be_bytes([a[6], a[7]])), (0, 1), "NOERROR, one answer");
        assert_eq!(&a[a.len() - 4..], &ip.octets());
        // AAAA of an allowed name: no records, no error (the client falls back to A).
        let q6 = query("task.test", 28);
        let a6 = answer(&q6, &parse(&q6).unwrap(), Some(ip));
        assert_eq!((a6[3] & 0xf, u16::from_be_bytes([a6[6], a6[7]])), (0, 0));
        let nx = answer(&q, &question, None);
        assert_eq!((nx[3] & 0xf, u16::from_be_bytes([nx[6], nx[7]])), (RCODE_NXDOMAIN, 0));
    }

    #[test]
    fn malformed_queries_are_refused_not_trusted() {
        assert_eq!(parse(&[0; 5]), Err(RCODE_FORMERR));
        let mut q = query("a.test", TYPE_A);
        q[12] = 60; // a label running past the end
        assert_eq!(parse(&q), Err(RCODE_FORMERR));
        let mut resp = query("a.test", TYPE_A);
        resp[2] |= 0x80;
        assert_eq!(parse(&resp), Err(RCODE_FORMERR), "a response is no query");
        let e = error(&q, RCODE_FORMERR).unwrap();
        assert_eq!((e.len(), e[3] & 0xf), (12, RCODE_FORMERR));
        assert_eq!(error(&[1, 2], RCODE_FORMERR), None);
    }

    #[test]
    fn stand_ins_are_stable_per_name_and_map_back() {
        let mut n = Names::default();
        let a = n.stand_in("a.test");
        assert_eq!(n.stand_in("a.test"), a);
        let b = n.stand_in("b.test");
        assert_ne!(a, b);
        assert_eq!((n.name_of(a), n.name_of(b)), (Some("a.test"), Some("b.test")));
        assert!(config::egress::in_cidr(a, STAND_IN_NET.0, STAND_IN_NET.1));
        assert_eq!(n.name_of(Ipv4Addr::new(198, 18, 9, 9)), None);
    }
}

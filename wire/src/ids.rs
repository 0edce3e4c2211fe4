//! Sandbox and session ids. Both start with the owning node's id (`<node>.<hex>`), so any
//! gateway can route a request to the right node without a lookup.

/// The node that owns a sandbox or session id, if the id is well-formed.
pub fn node_of(id: &str) -> Option<&str> {
    let (node, rest) = id.split_once('.')?;
    let node_ok = !node.is_empty()
        && node.len() <= 32
        && node.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    let rest_ok = !rest.is_empty() && rest.len() <= 64 && rest.bytes().all(|b| b.is_ascii_hexdigit());
    (node_ok && rest_ok).then_some(node)
}

/// Builds an id from a node and random bytes.
pub fn make(node: &str, random: &[u8]) -> String {
    format!("{node}.{}", hex(random))
}

/// The random part of an id: bytes in lower-case hex.
pub fn hex(random: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(random.len() * 2);
    for b in random {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_their_node() {
        let id = make("node-1", &[0xab, 0x01]);
        assert_eq!(id, "node-1.ab01");
        assert_eq!(node_of(&id), Some("node-1"));
        for bad in ["", "nodot", ".ab", "n.", "N.ab", "n.xyz", "n.ab/../x", "a{b}.ab"] {
            assert_eq!(node_of(bad), None, "{bad}");
        }
    }
}

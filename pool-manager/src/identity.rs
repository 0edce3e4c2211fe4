//! Who this node is: its id (given, or derived from the host) and the holder string of its id's
//! lease in the ledger, which keeps two pool-managers from running as one node.
//!
//! A derived id is the host name (as far as it makes a valid id) and a short hash of Docker's
//! engine id: two hosts with one name, or one host with two Docker engines, get two ids, and a
//! restarted pool-manager gets its old one back.

/// The host name, as the kernel has it.
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "host".to_string())
}

/// The node id of a host: `<host name, as a-z 0-9 '-', at most 23>-<8 hex of the engine id>`.
pub(crate) fn derive(hostname: &str, engine_id: &str) -> String {
    let mut name: String = hostname
        .split('.')
        .next()
        .unwrap_or_default()
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() { c } else { '-' })
        .take(23)
        .collect();
    name = name.trim_matches('-').to_string();
    if name.is_empty() {
        name = "node".into();
    }
    format!("{name}-{:08x}", fnv1a(engine_id.as_bytes()) as u32)
}

/// The lease holder: `<host>/<engine id>|<instance>`. The part before `|` says which machine
/// holds an id (a restart on the same one takes its lease over); the instance tells two
/// processes apart.
pub(crate) fn holder(hostname: &str, engine_id: &str) -> String {
    format!("{hostname}/{engine_id}|{:016x}", rand::random::<u64>())
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_ids_are_valid_stable_and_tell_engines_apart() {
        let a = derive("Worker_07.example.com", "ABCD:EFGH:1234");
        assert!(config::valid_node_id(&a), "{a}");
        assert!(a.starts_with("worker-07-"), "{a}");
        assert_eq!(a, derive("Worker_07.example.com", "ABCD:EFGH:1234"));
        assert_ne!(a, derive("Worker_07.example.com", "ABCD:EFGH:1235"));
        let long = derive(&"x".repeat(80), "e");
        assert!(config::valid_node_id(&long) && long.len() <= 32, "{long}");
        assert!(config::valid_node_id(&derive("---", "e")));
        assert!(config::valid_node_id(&derive("", "")));
    }

    #[test]
    fn holders_name_the_host_and_differ_per_instance() {
        let (a, b) = (holder("h", "e"), holder("h", "e"));
        assert!(a.starts_with("h/e|"));
        assert_ne!(a, b);
    }
}

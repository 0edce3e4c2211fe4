//! Stable hashing, version 1: FNV-1a 64 over the parts of a name, finalised by MurmurHash3's
//! `fmix64`. For every derived name or placement that must agree across builds, processes and
//! restarts (the egress bridge's interface name, an image's rendezvous node). `std`'s
//! `DefaultHasher` promises none of that.
//!
//! **Never change what these functions return**: names derived from them are stored outside
//! the process (interface names, firewall rules, nodes' image caches) and computed by gateways
//! and nodes of different builds. A different hash needs a new function and a migration; the
//! tests pin concrete values so an accidental change fails.

/// The scheme's version, for logs and documents that name it.
pub const VERSION: u32 = 1;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
/// Ends each part: not a byte of UTF-8, so `("ab", "c")` and `("a", "bc")` differ.
const SEPARATOR: u8 = 0xff;

/// FNV-1a, 64 bits, of `bytes` (the reference function: `fnv1a64(b"a") == 0xaf63dc4c8601ec8c`).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fold(FNV_OFFSET, bytes)
}

fn fold(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// MurmurHash3's 64-bit finaliser: every input bit reaches every output bit (FNV alone mixes
/// the last bytes of its input into the high bits weakly).
pub fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h
}

/// The stable hash of a sequence of parts: FNV-1a 64 over each part followed by a separator
/// byte, then `fmix64`.
pub fn hash_parts(parts: &[&str]) -> u64 {
    let h = parts.iter().fold(FNV_OFFSET, |h, p| fold(fold(h, p.as_bytes()), &[SEPARATOR]));
    fmix64(h)
}

/// Eight hex digits naming `parts` (for names with little room, such as a network interface's
/// 15 characters).
pub fn tag32(parts: &[&str]) -> String {
    format!("{:08x}", (hash_parts(parts) >> 32) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pinned: if one of these changes, every egress bridge and image placement moves.
    #[test]
    fn the_values_never_change() {
        // FNV-1a 64 reference vectors.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(hash_parts(&[]), fmix64(FNV_OFFSET));
        assert_ne!(hash_parts(&["ab", "c"]), hash_parts(&["a", "bc"]));
        let pinned = [hash_parts(&["sandpool", "node-1"]), hash_parts(&["a"]), hash_parts(&["a", ""])];
        assert_eq!(pinned, [PIN_0, PIN_1, PIN_2]);
        assert_eq!(tag32(&["sandpool", "node-1"]), TAG_0);
    }

    const PIN_0: u64 = 0xe608c98fd001eb0c;
    const PIN_1: u64 = 0x3aec69d286fbd39b;
    const PIN_2: u64 = 0xf9a05feedc2a7c93;
    const TAG_0: &str = "e608c98f";
}

//! File paths of the files API, checked the same way at the gateway (so a bad path never
//! reaches a node, and no URL normalisation on the way can change it) and at the node.

/// Why a file path from a request is refused, if it is.
pub fn problem(raw: &str) -> Option<&'static str> {
    if raw.contains('\0') {
        return Some("contains NUL");
    }
    if raw.split('/').any(|seg| seg == "..") {
        return Some("'..' is not allowed");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn climbing_and_nul_are_refused() {
        for bad in ["..", "../x", "a/../../b", "/etc/../root", "a\0b"] {
            assert!(problem(bad).is_some(), "{bad:?}");
        }
        for ok in ["a", "/etc/passwd", "a/..b/c", "...", "./x", "dir/"] {
            assert_eq!(problem(ok), None, "{ok:?}");
        }
    }
}

//! Image references as a registry sees them: `host[:port]/repo[:tag][@sha256:hex]`.

use std::fmt;

/// Why an image reference string was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReferenceError {
    /// Not `host[:port]/repository[:tag][@digest]`.
    #[error("image reference {0:?}: expected host[:port]/repository[:tag][@sha256:digest]")]
    Malformed(String),
    /// The digest after `@` is not `sha256:` and 64 lowercase hex digits.
    #[error("image reference {0:?}: digest must be sha256:<64 hex digits>")]
    BadDigest(String),
}

/// A parsed image reference. The registry host is required: a lazy image is always read from
/// a registry by its address, never from a daemon's local store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `host` or `host:port`.
    pub registry: String,
    /// The repository path inside the registry, e.g. `team/debian`.
    pub repository: String,
    /// The tag after the last path component's `:`, if any.
    pub tag: Option<String>,
    /// `sha256:<hex>`.
    pub digest: Option<String>,
}

impl Reference {
    /// Parses `host[:port]/repository[:tag][@sha256:digest]`; the first component must look like a
    /// host (a `.` or `:`, or `localhost`), as Docker decides it.
    pub fn parse(s: &str) -> Result<Self, ReferenceError> {
        let malformed = || ReferenceError::Malformed(s.to_string());
        let (name, digest) = match s.split_once('@') {
            Some((name, digest)) => {
                if !is_sha256_digest(digest) {
                    return Err(ReferenceError::BadDigest(s.to_string()));
                }
                (name, Some(digest.to_string()))
            }
            None => (s, None),
        };
        let (registry, rest) = name.split_once('/').ok_or_else(malformed)?;
        // Docker's rule: the first component is a registry only if it looks like a host.
        let looks_like_host = registry.contains('.') || registry.contains(':') || registry == "localhost";
        if !looks_like_host || rest.is_empty() {
            return Err(malformed());
        }
        // A tag is after the last ':' of the last path component.
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (repository, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => (&rest[..last_slash + i], Some(rest[last_slash + i + 1..].to_string())),
            None => (rest, None),
        };
        let valid_repo = repository.split('/').all(|c| {
            !c.is_empty() && c.chars().all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || "._-".contains(ch))
        });
        let valid_tag = tag.as_deref().is_none_or(|t| {
            !t.is_empty() && t.len() <= 128 && t.chars().all(|ch| ch.is_ascii_alphanumeric() || "._-".contains(ch))
        });
        if !valid_repo || !valid_tag {
            return Err(malformed());
        }
        Ok(Reference { registry: registry.to_string(), repository: repository.to_string(), tag, digest })
    }

    /// What to ask the registry for: the digest when pinned, else the tag (`latest` if none).
    pub fn manifest_reference(&self) -> &str {
        self.digest.as_deref().or(self.tag.as_deref()).unwrap_or("latest")
    }

    /// The same repository pinned to `digest` (the tag dropped: the digest says it all).
    pub fn pinned(&self, digest: &str) -> Reference {
        Reference { digest: Some(digest.to_string()), tag: None, ..self.clone() }
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

/// Whether `s` is `sha256:` followed by 64 lowercase hex digits.
pub fn is_sha256_digest(s: &str) -> bool {
    s.strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_host_port_repo_tag_and_digest() {
        let r = Reference::parse("127.0.0.1:5000/team/debian:bookworm").unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "team/debian");
        assert_eq!(r.tag.as_deref(), Some("bookworm"));
        assert_eq!(r.manifest_reference(), "bookworm");
        assert_eq!(r.to_string(), "127.0.0.1:5000/team/debian:bookworm");

        let d = format!("sha256:{}", "ab".repeat(32));
        let r = Reference::parse(&format!("localhost/x@{d}")).unwrap();
        assert_eq!(r.tag, None);
        assert_eq!(r.manifest_reference(), d);

        let r = Reference::parse("registry.example.com/x").unwrap();
        assert_eq!(r.manifest_reference(), "latest");
    }

    #[test]
    fn rejects_names_without_a_registry_and_bad_digests() {
        assert!(matches!(Reference::parse("debian:bookworm"), Err(ReferenceError::Malformed(_))));
        assert!(matches!(Reference::parse("sandpool/debian"), Err(ReferenceError::Malformed(_))));
        assert!(matches!(Reference::parse("127.0.0.1:5000/"), Err(ReferenceError::Malformed(_))));
        assert!(matches!(Reference::parse("127.0.0.1:5000/Upper"), Err(ReferenceError::Malformed(_))));
        assert!(matches!(Reference::parse("127.0.0.1:5000/x@sha256:12"), Err(ReferenceError::BadDigest(_))));
    }
}

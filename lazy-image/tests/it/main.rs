//! End-to-end tests of lazy images against the real local registry and Docker engine: convert
//! the Debian image, mount it lazily, read files, check digests and bytes fetched. Needs root,
//! `mkfs.erofs`, FUSE and a kernel with file-backed EROFS (scripts/lib.sh installs the tools).

mod lazy;
mod support;

//! Lazy task images: a registry image becomes one EROFS filesystem blob in a registry
//! (`convert`), and a node mounts that blob with its chunks fetched on demand (`LazyRootfs`).
//!
//! The pieces, outside in:
//! - [`reference`]: `host:port/repo:tag@digest` names.
//! - [`registry`]: the few OCI distribution calls we need (manifests, blobs, ranges, uploads).
//! - [`convert`] + [`unpack`]: flatten an image's layers (whiteouts applied) into a directory,
//!   `mkfs.erofs` it, push the blob with a config that pins the source and every chunk's sha256.
//! - [`cache`]: the node's chunk cache on disk, bounded in bytes, least recently used out first.
//! - [`blob`]: reads of the blob at any offset, served from the cache or by HTTP range reads,
//!   each fetched chunk checked against its pinned digest; [`fetch`]: how long a fetch may
//!   wait (retries, backoff, a total bound, the memory of an outage) before its reader gets EIO.
//! - [`fuse`] + [`mount`]: the blob as one read-only FUSE file, and the kernel's file-backed
//!   EROFS mounted on it: the image's root filesystem, read lazily.
//! - [`lazyd`]: the node's daemon holding one such mount per image (`sandpool-lazyd`).
//! - [`oci`]: the OCI runtime wrapper Docker runs lazy sandboxes with (`sandpool-lazy-runtime`):
//!   an overlay over the daemon's mount as the container's root, then runc.

pub mod blob;
pub mod cache;
pub mod convert;
pub mod fetch;
pub mod fuse;
pub mod lazyd;
pub mod manifest;
pub mod mount;
pub mod oci;
pub mod reference;
pub mod registry;
pub mod unpack;

pub use blob::{BlobStats, LazyBlob};
pub use cache::ChunkCache;
pub use convert::{ConvertOptions, Converted, convert};
pub use fetch::FetchPolicy;
pub use manifest::LazyConfig;
pub use mount::LazyRootfs;
pub use reference::Reference;
pub use registry::Registry;

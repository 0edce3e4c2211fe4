//! The lazy image's form in a registry: an OCI image manifest whose one layer is the EROFS
//! blob and whose config (its own media type) pins the source image and every chunk.
//!
//! ```text
//! manifest (application/vnd.oci.image.manifest.v1+json)
//!   config  application/vnd.sandpool.lazy.config.v1+json  -> LazyConfig
//!   layers  [application/vnd.sandpool.erofs.v1]            -> the EROFS filesystem
//!   annotations  org.opencontainers.image.base.{name,digest} = the source image
//! ```
//! A node checks each fetched chunk against `chunks[i]`, so the manifest digest alone pins
//! every byte a sandbox can read.

use serde::{Deserialize, Serialize};

/// Media type of a lazy image's config blob ([`LazyConfig`]).
pub const LAZY_CONFIG_MEDIA_TYPE: &str = "application/vnd.sandpool.lazy.config.v1+json";
/// Media type of a lazy image's one layer: the EROFS filesystem blob.
pub const EROFS_LAYER_MEDIA_TYPE: &str = "application/vnd.sandpool.erofs.v1";
/// Manifest annotation naming the source image the lazy image was converted from.
pub const ANNOTATION_BASE_NAME: &str = "org.opencontainers.image.base.name";
/// Manifest annotation pinning the source image's manifest digest.
pub const ANNOTATION_BASE_DIGEST: &str = "org.opencontainers.image.base.digest";

/// The config blob of a lazy image.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LazyConfig {
    /// The image it was converted from (its manifest digest pins it).
    pub source: Source,
    /// The source image's run config (`Env`, `Cmd`, `User`, `WorkingDir`, ...), unchanged, so a
    /// template made from the lazy image runs as one made from the source would.
    #[serde(default)]
    pub image_config: serde_json::Value,
    /// The EROFS blob a node mounts: its digest, size and per-chunk digests.
    pub rootfs: Rootfs,
}

/// The source image a lazy image was converted from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Source {
    /// The source as named to `convert` (`host:port/repo:tag`).
    pub reference: String,
    /// The source's manifest digest (`sha256:<hex>`), which pins it.
    pub digest: String,
    /// The source's layer bytes as stored in the registry (what a whole pull transfers).
    pub layers_size: u64,
}

/// The lazy image's root filesystem blob and the digests a node checks its chunks against.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Rootfs {
    /// Always "erofs" in this version.
    pub format: String,
    /// The blob's digest and size (the manifest's layer descriptor says the same).
    pub digest: String,
    /// Blob size in bytes.
    pub size: u64,
    /// Fetch granularity in bytes; every chunk but the last is this long.
    pub chunk_size: u64,
    /// The sha256 (hex) of each chunk, in order.
    pub chunks: Vec<String>,
}

impl Rootfs {
    /// Checks the invariants a node relies on before it serves a single read.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.format == "erofs", "lazy rootfs format {:?} is not erofs", self.format);
        anyhow::ensure!(
            self.chunk_size >= 4096 && self.chunk_size.is_power_of_two(),
            "bad chunk size {}",
            self.chunk_size
        );
        let expected = self.size.div_ceil(self.chunk_size);
        anyhow::ensure!(
            self.chunks.len() as u64 == expected,
            "{} chunk digests for a {}-byte blob in {}-byte chunks ({expected} expected)",
            self.chunks.len(),
            self.size,
            self.chunk_size
        );
        anyhow::ensure!(
            self.chunks.iter().all(|c| c.len() == 64 && c.bytes().all(|b| b.is_ascii_hexdigit())),
            "chunk digests must be 64 hex digits"
        );
        Ok(())
    }
}

/// An OCI descriptor (the subset we write and read).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Descriptor {
    /// Media type of the content it points at (`mediaType`).
    #[serde(rename = "mediaType")]
    pub media_type: String,
    /// The content's digest (`sha256:<hex>`).
    pub digest: String,
    /// The content's size in bytes.
    pub size: u64,
    /// The platform of a manifest listed in an index; absent elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
}

/// An index entry's platform: how `convert` narrows an index to this machine's manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Platform {
    /// CPU architecture in Go's terms (`amd64`, `arm64`).
    pub architecture: String,
    /// Operating system (`linux`).
    pub os: String,
}

/// An image manifest, OCI or Docker v2 (same shape for what we read).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageManifest {
    /// The manifest schema version (`schemaVersion`); 2 in every manifest `convert` writes.
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    /// The manifest's own media type, when it says it (`mediaType`).
    #[serde(rename = "mediaType", default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// The config blob.
    pub config: Descriptor,
    /// The layer blobs, lowest first; a lazy image has one, the EROFS blob.
    pub layers: Vec<Descriptor>,
    /// Free-form annotations; on a lazy image, `ANNOTATION_BASE_*` name its source image.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// An image index / manifest list.
#[derive(Debug, Clone, Deserialize)]
pub struct ImageIndex {
    /// One descriptor per platform's manifest.
    pub manifests: Vec<Descriptor>,
}

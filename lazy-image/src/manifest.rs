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

pub const LAZY_CONFIG_MEDIA_TYPE: &str = "application/vnd.sandpool.lazy.config.v1+json";
pub const EROFS_LAYER_MEDIA_TYPE: &str = "application/vnd.sandpool.erofs.v1";
pub const ANNOTATION_BASE_NAME: &str = "org.opencontainers.image.base.name";
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
    pub rootfs: Rootfs,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Source {
    pub reference: String,
    pub digest: String,
    /// The source's layer bytes as stored in the registry (what a whole pull transfers).
    pub layers_size: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Rootfs {
    /// Always "erofs" in this version.
    pub format: String,
    /// The blob's digest and size (the manifest's layer descriptor says the same).
    pub digest: String,
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
    #[serde(rename = "mediaType")]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
}

/// An image manifest, OCI or Docker v2 (same shape for what we read).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageManifest {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    #[serde(rename = "mediaType", default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub annotations: std::collections::BTreeMap<String, String>,
}

/// An image index / manifest list.
#[derive(Debug, Clone, Deserialize)]
pub struct ImageIndex {
    pub manifests: Vec<Descriptor>,
}

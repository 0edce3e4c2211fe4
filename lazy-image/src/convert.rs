//! `convert`: a standard image in a registry becomes a lazy image in a registry. The source's
//! layers are flattened into one directory, `mkfs.erofs` makes that one filesystem blob, and
//! the blob goes up with a config that pins the source's manifest digest and the sha256 of
//! every chunk. Runs anywhere with root, `mkfs.erofs` and both registries in reach (a CI job,
//! an operator's machine); never on a node.

use std::fs::File;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use sha2::Digest as _;

use crate::manifest::{
    ANNOTATION_BASE_DIGEST, ANNOTATION_BASE_NAME, Descriptor, EROFS_LAYER_MEDIA_TYPE, ImageIndex, ImageManifest,
    LAZY_CONFIG_MEDIA_TYPE, LazyConfig, Rootfs, Source,
};
use crate::reference::Reference;
use crate::registry::{BlobBody, OCI_MANIFEST, Registry};
use crate::unpack::{Compression, apply_layer};

/// 1 MiB: a first command reads a few hundred KB scattered over the image; at 1 MiB a chunk
/// costs one round trip of a few ms on a LAN, and a 1 GB image has ~1,000 chunk digests
/// (~70 KB of config).
pub const DEFAULT_CHUNK_SIZE: u64 = 1 << 20;

/// How `convert` builds the lazy image.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// Where the flattened root and the blob are built (needs about twice the image's size).
    pub work_dir: PathBuf,
    /// The blob's fetch granularity in bytes: a power of two, >= 4096 ([`DEFAULT_CHUNK_SIZE`]).
    pub chunk_size: u64,
    /// `mkfs.erofs`'s compressor (`lz4hc`, `lz4`), or none.
    pub compressor: Option<String>,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            work_dir: std::env::temp_dir(),
            chunk_size: DEFAULT_CHUNK_SIZE,
            // Compressed blocks: fewer bytes to fetch per file read; lz4 decompresses at GB/s.
            compressor: Some("lz4hc".to_string()),
        }
    }
}

/// What a conversion made.
#[derive(Debug, Clone)]
pub struct Converted {
    /// The source, pinned to the manifest that was converted.
    pub source: Reference,
    /// The lazy image, pinned to its manifest digest.
    pub destination: Reference,
    /// The lazy image's config as pushed (source, run config, chunk digests).
    pub config: LazyConfig,
    /// Time spent downloading and unpacking, in `mkfs.erofs`, and uploading.
    pub timings: Timings,
}

/// Wall time of a conversion's three phases.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timings {
    /// Downloading the source's layers and applying them to one directory.
    pub unpack: Duration,
    /// Building the blob with `mkfs.erofs` and digesting its chunks.
    pub mkfs: Duration,
    /// Uploading the blob, config and manifest to the destination registry.
    pub push: Duration,
}

/// Converts `src` into a lazy image at `dst` (a tag; a digest cannot be chosen).
pub async fn convert(src: &Reference, dst: &Reference, options: &ConvertOptions) -> anyhow::Result<Converted> {
    if dst.digest.is_some() {
        bail!("destination {dst}: name a tag, not a digest (the digest is the result)");
    }
    let dst_tag = dst.tag.clone().unwrap_or_else(|| "latest".to_string());
    let src_registry = Registry::for_reference(src)?;
    let (manifest, manifest_digest) = resolve_image_manifest(&src_registry, src).await?;
    if manifest.config.media_type == LAZY_CONFIG_MEDIA_TYPE {
        bail!("{src} is already a lazy image");
    }
    let source_config: serde_json::Value = serde_json::from_slice(
        &src_registry.blob(&src.repository, &manifest.config.digest).await.context("fetch the source's config")?,
    )
    .context("parse the source's image config")?;
    let image_config = source_config.get("config").cloned().unwrap_or(serde_json::Value::Null);

    let work = WorkDir::create(&options.work_dir)?;
    let root = work.path.join("rootfs");
    std::fs::create_dir(&root).with_context(|| format!("create {}", root.display()))?;

    let began = Instant::now();
    let mut layers_size = 0;
    for (i, layer) in manifest.layers.iter().enumerate() {
        let compression = Compression::from_media_type(&layer.media_type)?;
        let file = work.path.join(format!("layer-{i}"));
        layers_size += src_registry
            .blob_to_file(&src.repository, &layer.digest, &file)
            .await
            .with_context(|| format!("download layer {}", layer.digest))?;
        let root = root.clone();
        let digest = layer.digest.clone();
        tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
            let reader = File::open(&file).with_context(|| format!("open {}", file.display()))?;
            apply_layer(&root, std::io::BufReader::new(reader), compression)
                .with_context(|| format!("apply layer {digest}"))?;
            std::fs::remove_file(&file).ok();
            Ok(())
        })
        .await
        .context("join the unpack task")??;
    }
    let unpack = began.elapsed();

    let began = Instant::now();
    let blob_path = work.path.join("rootfs.erofs");
    mkfs_erofs(&root, &blob_path, options.compressor.as_deref()).await?;
    // The flattened tree is no longer needed; free its space before the upload.
    let root_for_rm = root.clone();
    tokio::task::spawn_blocking(move || std::fs::remove_dir_all(root_for_rm)).await.ok();
    let chunk_size = options.chunk_size;
    let blob_for_digest = blob_path.clone();
    let (blob_digest, blob_size, chunks) =
        tokio::task::spawn_blocking(move || digest_chunks(&blob_for_digest, chunk_size)).await.context("join")??;
    let mkfs = began.elapsed();

    let source = src.pinned(&manifest_digest);
    let config = LazyConfig {
        source: Source { reference: src.to_string(), digest: manifest_digest.clone(), layers_size },
        image_config,
        rootfs: Rootfs {
            format: "erofs".to_string(),
            digest: blob_digest.clone(),
            size: blob_size,
            chunk_size,
            chunks,
        },
    };
    config.rootfs.validate()?;
    let config_bytes = Bytes::from(serde_json::to_vec(&config)?);
    let config_digest = crate::registry::sha256_digest(&config_bytes);

    let began = Instant::now();
    let dst_registry = Registry::for_reference(dst)?;
    dst_registry.push_blob(&dst.repository, &blob_digest, BlobBody::File(&blob_path)).await?;
    dst_registry.push_blob(&dst.repository, &config_digest, BlobBody::Bytes(&config_bytes)).await?;
    let lazy_manifest = ImageManifest {
        schema_version: 2,
        media_type: Some(OCI_MANIFEST.to_string()),
        config: Descriptor {
            media_type: LAZY_CONFIG_MEDIA_TYPE.to_string(),
            digest: config_digest,
            size: config_bytes.len() as u64,
            platform: None,
        },
        layers: vec![Descriptor {
            media_type: EROFS_LAYER_MEDIA_TYPE.to_string(),
            digest: blob_digest,
            size: blob_size,
            platform: None,
        }],
        annotations: [
            (ANNOTATION_BASE_NAME.to_string(), src.to_string()),
            (ANNOTATION_BASE_DIGEST.to_string(), manifest_digest),
        ]
        .into(),
    };
    let manifest_bytes = Bytes::from(serde_json::to_vec(&lazy_manifest)?);
    let digest = dst_registry.put_manifest(&dst.repository, &dst_tag, OCI_MANIFEST, manifest_bytes).await?;
    let push = began.elapsed();
    Ok(Converted { source, destination: dst.pinned(&digest), config, timings: Timings { unpack, mkfs, push } })
}

/// The image manifest `reference` names; an index is narrowed to this machine's platform.
async fn resolve_image_manifest(registry: &Registry, reference: &Reference) -> anyhow::Result<(ImageManifest, String)> {
    let fetched = registry.manifest(&reference.repository, reference.manifest_reference()).await?;
    let value: serde_json::Value =
        serde_json::from_slice(&fetched.bytes).with_context(|| format!("parse the manifest of {reference}"))?;
    if value.get("manifests").is_none() {
        let manifest = serde_json::from_value(value).with_context(|| format!("parse the manifest of {reference}"))?;
        return Ok((manifest, fetched.digest));
    }
    let index: ImageIndex = serde_json::from_value(value).with_context(|| format!("parse the index of {reference}"))?;
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let chosen = index
        .manifests
        .iter()
        .find(|d| d.platform.as_ref().is_some_and(|p| p.os == "linux" && p.architecture == arch))
        .with_context(|| format!("{reference} has no linux/{arch} image"))?;
    let fetched = registry.manifest(&reference.repository, &chosen.digest).await?;
    let manifest =
        serde_json::from_slice(&fetched.bytes).with_context(|| format!("parse the manifest {}", chosen.digest))?;
    Ok((manifest, fetched.digest))
}

async fn mkfs_erofs(root: &Path, out: &Path, compressor: Option<&str>) -> anyhow::Result<()> {
    let mut cmd = tokio::process::Command::new("mkfs.erofs");
    cmd.arg("--quiet");
    if let Some(c) = compressor {
        cmd.arg(format!("-z{c}"));
    }
    cmd.arg(out).arg(root).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    // A conversion given up (Ctrl-C, a dropped future) stops mkfs too, so its scratch goes.
    cmd.kill_on_drop(true);
    let output = cmd.output().await.context("run mkfs.erofs (install erofs-utils)")?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: String = stderr.chars().rev().take(500).collect::<Vec<_>>().into_iter().rev().collect();
        bail!("mkfs.erofs failed ({}): {}", output.status, tail.trim());
    }
    Ok(())
}

/// The blob's digest, size and per-chunk sha256 (hex), in one pass.
fn digest_chunks(path: &Path, chunk_size: u64) -> anyhow::Result<(String, u64, Vec<String>)> {
    let mut file = File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut whole = sha2::Sha256::new();
    let mut chunks = Vec::new();
    let mut buf = vec![0u8; chunk_size as usize];
    let mut size = 0u64;
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            let n = file.read(&mut buf[filled..])?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        if filled == 0 {
            break;
        }
        whole.update(&buf[..filled]);
        chunks.push(hex::encode(sha2::Sha256::digest(&buf[..filled])));
        size += filled as u64;
        if filled < buf.len() {
            break;
        }
    }
    Ok((format!("sha256:{}", hex::encode(whole.finalize())), size, chunks))
}

/// A scratch directory removed when the conversion ends, however it ends.
struct WorkDir {
    path: PathBuf,
}

impl WorkDir {
    fn create(parent: &Path) -> anyhow::Result<Self> {
        let path = parent.join(format!("sandpool-convert-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&path).with_context(|| format!("create {}", path.display()))?;
        Ok(WorkDir { path })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            tracing::warn!(dir = %self.path.display(), error = %e, "could not remove the conversion's scratch directory");
        }
    }
}

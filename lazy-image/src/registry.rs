//! The OCI distribution calls a lazy image needs: manifests, whole blobs, byte ranges of a
//! blob, and monolithic uploads. Loopback registries only, over plain HTTP, and no auth yet:
//! the workspace's HTTP client is built without TLS (HTTPS and registry credentials are the
//! next step; the registries this project runs are on loopback).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use bytes::Bytes;
use reqwest::{StatusCode, header};

use crate::reference::Reference;

/// Media type of an OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// Media type of an OCI image index (a multi-platform image).
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// Media type of a Docker v2 (schema 2) image manifest.
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Media type of a Docker v2 manifest list (a multi-platform image).
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// One request's bound (manifests, configs, uploads' small steps); a chunk's range read is
/// bounded by its `FetchPolicy` instead (`fetch.rs`).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Whole-blob transfers (convert's layer downloads and uploads) may be gigabytes.
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// A manifest as fetched: its bytes (digested as served), media type and digest.
#[derive(Debug, Clone)]
pub struct FetchedManifest {
    /// The manifest exactly as served (the bytes its digest is over).
    pub bytes: Bytes,
    /// The `Content-Type` the registry served it with (empty if none).
    pub media_type: String,
    /// `sha256:<hex>` of `bytes`, computed here.
    pub digest: String,
}

/// A client for one registry host.
#[derive(Debug, Clone)]
pub struct Registry {
    http: reqwest::Client,
    base: String,
}

impl Registry {
    /// A client for `reference`'s registry.
    pub fn for_reference(reference: &Reference) -> anyhow::Result<Self> {
        Self::new(&reference.registry)
    }

    /// `host` is `host[:port]`, a loopback host (spoken to over plain HTTP, as Docker treats
    /// loopback registries as insecure ones).
    pub fn new(host: &str) -> anyhow::Result<Self> {
        let hostname = host.rsplit_once(':').map_or(host, |(h, _)| h);
        if !matches!(hostname, "localhost" | "127.0.0.1" | "[::1]") {
            bail!("registry {host}: only loopback registries are supported yet (plain HTTP; HTTPS is not built in)");
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .context("build the registry HTTP client")?;
        Ok(Registry { http, base: format!("http://{host}/v2") })
    }

    /// GET a manifest by tag or digest, accepting image manifests and indexes of both the OCI
    /// and Docker forms. The digest is computed over the bytes served, and checked against a
    /// requested digest.
    pub async fn manifest(&self, repository: &str, reference: &str) -> anyhow::Result<FetchedManifest> {
        let url = format!("{}/{repository}/manifests/{reference}", self.base);
        let resp = self
            .http
            .get(&url)
            .header(header::ACCEPT, [OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_MANIFEST_LIST].join(", "))
            .timeout(REQUEST_TIMEOUT)
            .send()
            .await
            .with_context(|| format!("fetch manifest {url}"))?;
        let resp = check(resp, &url).await?;
        let media_type =
            resp.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
        let bytes = resp.bytes().await.with_context(|| format!("read manifest {url}"))?;
        let digest = sha256_digest(&bytes);
        if reference.starts_with("sha256:") {
            ensure!(digest == reference, "manifest {url}: served bytes digest to {digest}");
        }
        Ok(FetchedManifest { bytes, media_type, digest })
    }

    /// A whole (small) blob in memory, its digest checked.
    pub async fn blob(&self, repository: &str, digest: &str) -> anyhow::Result<Bytes> {
        let url = self.blob_url(repository, digest);
        let resp = self.http.get(&url).timeout(REQUEST_TIMEOUT).send().await.with_context(|| format!("fetch {url}"))?;
        let bytes = check(resp, &url).await?.bytes().await.with_context(|| format!("read {url}"))?;
        ensure!(sha256_digest(&bytes) == digest, "blob {url}: content does not match its digest");
        Ok(bytes)
    }

    /// Streams a blob into `file`, returning its size; the digest is checked as it is written.
    pub async fn blob_to_file(&self, repository: &str, digest: &str, file: &Path) -> anyhow::Result<u64> {
        use sha2::Digest as _;
        use tokio::io::AsyncWriteExt as _;
        let url = self.blob_url(repository, digest);
        let resp =
            self.http.get(&url).timeout(TRANSFER_TIMEOUT).send().await.with_context(|| format!("fetch {url}"))?;
        let mut resp = check(resp, &url).await?;
        let mut out = tokio::fs::File::create(file).await.with_context(|| format!("create {}", file.display()))?;
        let mut hasher = sha2::Sha256::new();
        let mut size = 0u64;
        while let Some(chunk) = resp.chunk().await.with_context(|| format!("read {url}"))? {
            hasher.update(&chunk);
            size += chunk.len() as u64;
            out.write_all(&chunk).await.with_context(|| format!("write {}", file.display()))?;
        }
        out.flush().await?;
        let got = format!("sha256:{}", hex::encode(hasher.finalize()));
        ensure!(got == digest, "blob {url}: content digests to {got}");
        Ok(size)
    }

    /// Bytes `start..end` of a blob (one HTTP range request, connect to last byte within
    /// `timeout`). Fails unless exactly that many bytes come back: a registry that ignores
    /// `Range` would otherwise send the whole blob.
    pub async fn blob_range(
        &self,
        repository: &str,
        digest: &str,
        start: u64,
        end: u64,
        timeout: Duration,
    ) -> anyhow::Result<Bytes> {
        ensure!(start < end, "empty range {start}..{end}");
        let url = self.blob_url(repository, digest);
        let resp = self
            .http
            .get(&url)
            .header(header::RANGE, format!("bytes={start}-{}", end - 1))
            .timeout(timeout)
            .send()
            .await
            .with_context(|| format!("range read {url}"))?;
        let resp = check(resp, &url).await?;
        if resp.status() != StatusCode::PARTIAL_CONTENT {
            bail!("range read {url}: the registry answered {} instead of 206", resp.status());
        }
        let bytes = resp.bytes().await.with_context(|| format!("read range of {url}"))?;
        ensure!(bytes.len() as u64 == end - start, "range read {url}: {} bytes for {start}..{end}", bytes.len());
        Ok(bytes)
    }

    /// Whether the repository has the blob (a HEAD request; any non-2xx answer is `false`).
    pub async fn has_blob(&self, repository: &str, digest: &str) -> anyhow::Result<bool> {
        let url = self.blob_url(repository, digest);
        let resp = self.http.head(&url).timeout(REQUEST_TIMEOUT).send().await.with_context(|| format!("HEAD {url}"))?;
        Ok(resp.status().is_success())
    }

    /// Uploads a blob (POST a session, then one PUT with the content), unless the repository
    /// has it already.
    pub async fn push_blob(&self, repository: &str, digest: &str, body: BlobBody<'_>) -> anyhow::Result<()> {
        if self.has_blob(repository, digest).await? {
            return Ok(());
        }
        let url = format!("{}/{repository}/blobs/uploads/", self.base);
        let resp = self.http.post(&url).timeout(REQUEST_TIMEOUT).send().await.with_context(|| format!("POST {url}"))?;
        let resp = check(resp, &url).await?;
        let location = resp
            .headers()
            .get(header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| anyhow!("POST {url}: no Location for the upload"))?;
        let location = self.absolute(location);
        let sep = if location.contains('?') { '&' } else { '?' };
        let put_url = format!("{location}{sep}digest={digest}");
        let (body, len) = match body {
            BlobBody::Bytes(b) => (reqwest::Body::from(b.clone()), b.len() as u64),
            BlobBody::File(path) => {
                let file = tokio::fs::File::open(path).await.with_context(|| format!("open {}", path.display()))?;
                let len = file.metadata().await?.len();
                (reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(file)), len)
            }
        };
        let resp = self
            .http
            .put(&put_url)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .header(header::CONTENT_LENGTH, len)
            .body(body)
            .timeout(TRANSFER_TIMEOUT)
            .send()
            .await
            .with_context(|| format!("upload blob {digest} to {repository}"))?;
        check(resp, &put_url).await?;
        Ok(())
    }

    /// PUTs a manifest under `reference` (a tag or its digest); returns its digest.
    pub async fn put_manifest(
        &self,
        repository: &str,
        reference: &str,
        media_type: &str,
        bytes: Bytes,
    ) -> anyhow::Result<String> {
        let digest = sha256_digest(&bytes);
        let url = format!("{}/{repository}/manifests/{reference}", self.base);
        let resp = self
            .http
            .put(&url)
            .header(header::CONTENT_TYPE, media_type)
            .body(bytes)
            .timeout(REQUEST_TIMEOUT)
            .send()
            .await
            .with_context(|| format!("PUT {url}"))?;
        check(resp, &url).await?;
        Ok(digest)
    }

    fn blob_url(&self, repository: &str, digest: &str) -> String {
        format!("{}/{repository}/blobs/{digest}", self.base)
    }

    /// Upload locations may be relative to the registry's root.
    fn absolute(&self, location: &str) -> String {
        if location.starts_with("http://") || location.starts_with("https://") {
            return location.to_string();
        }
        let root = self.base.strip_suffix("/v2").unwrap_or(&self.base);
        format!("{root}{location}")
    }
}

/// What an upload sends.
pub enum BlobBody<'a> {
    /// Content already in memory.
    Bytes(&'a Bytes),
    /// A file, streamed from disk (a blob too big to hold in memory).
    File(&'a Path),
}

/// Errors keep the registry's status and the start of its error body.
async fn check(resp: reqwest::Response, url: &str) -> anyhow::Result<reqwest::Response> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let body = resp.text().await.unwrap_or_default();
    let body: String = body.chars().take(300).collect();
    bail!("{url}: registry answered {status}: {}", body.trim())
}

/// The OCI digest (`sha256:<hex>`) of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_registries_until_tls_is_built_in() {
        assert!(Registry::new("127.0.0.1:5000").is_ok());
        assert!(Registry::new("localhost").is_ok());
        let err = Registry::new("registry.example.com").unwrap_err().to_string();
        assert!(err.contains("only loopback registries"), "{err}");
    }

    #[test]
    fn upload_locations_may_be_relative() {
        let r = Registry::new("127.0.0.1:5000").unwrap();
        assert_eq!(
            r.absolute("/v2/x/blobs/uploads/abc?_state=1"),
            "http://127.0.0.1:5000/v2/x/blobs/uploads/abc?_state=1"
        );
        assert_eq!(r.absolute("http://127.0.0.1:5000/v2/y"), "http://127.0.0.1:5000/v2/y");
    }
}

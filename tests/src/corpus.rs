//! A corpus of small distinct images in the local registry (`scripts/corpus`), under a
//! repository prefix of its own; dropped, it removes its images from the registry and from
//! the Docker engine.

use std::path::PathBuf;

use serde::Deserialize;

/// The local registry `scripts/lib.sh` (`ensure_registry`) serves.
pub fn registry() -> String {
    let port = std::env::var("SANDPOOL_REGISTRY_PORT").unwrap_or_else(|_| "5000".into());
    format!("127.0.0.1:{port}")
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// One image of a corpus.
#[derive(Debug, Clone, Deserialize)]
pub struct CorpusImage {
    /// `127.0.0.1:5000/<prefix>/task-NNNN:latest`.
    pub image: String,
    /// The manifest's digest.
    pub digest: String,
    /// The image by digest: `127.0.0.1:5000/<prefix>/task-NNNN@sha256:...`.
    #[serde(rename = "ref")]
    pub reference: String,
}

pub struct Corpus {
    pub prefix: String,
    pub images: Vec<CorpusImage>,
}

impl Corpus {
    /// Pushes `count` images of `layer_kb` KiB each under a fresh prefix.
    pub fn build(count: usize, layer_kb: usize) -> Corpus {
        let prefix = format!("sptest-{}", crate::rand_hex(10));
        Corpus::build_named(&prefix, count, layer_kb)
    }

    /// Pushes `count` images under `prefix` (kept by later runs with the same prefix).
    pub fn build_named(prefix: &str, count: usize, layer_kb: usize) -> Corpus {
        let out = std::env::temp_dir().join(format!("{prefix}.jsonl"));
        let status = std::process::Command::new(repo_root().join("scripts/corpus"))
            .args(["--count", &count.to_string(), "--layer-kb", &layer_kb.to_string(), "--repo-prefix", prefix])
            .arg("--out")
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run scripts/corpus");
        assert!(status.success(), "scripts/corpus failed: {status}");
        let text = std::fs::read_to_string(&out).expect("the corpus's list");
        let _ = std::fs::remove_file(&out);
        let images = text.lines().map(|l| serde_json::from_str(l).expect("a corpus line")).collect();
        Corpus { prefix: prefix.to_string(), images }
    }

    /// Local copies of this corpus's images that the Docker engine holds (any reference).
    pub fn local(&self) -> Vec<String> {
        let repo = format!("{}/{}/", registry(), self.prefix);
        let out = std::process::Command::new("docker")
            .args(["images", "--digests", "--format", "{{.Repository}}@{{.Digest}}"])
            .output()
            .expect("docker images");
        String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with(&repo)).map(String::from).collect()
    }

    /// Deletes an image's manifest from the registry (a later pull of it fails).
    pub fn delete_from_registry(&self, image: &CorpusImage) {
        let name = image.image.trim_start_matches(&format!("{}/", registry()));
        let repo = name.rsplit_once(':').map_or(name, |(r, _)| r);
        let url = format!("http://{}/v2/{repo}/manifests/{}", registry(), image.digest);
        let _ = std::process::Command::new("curl").args(["-fsS", "-X", "DELETE", &url]).output();
    }
}

impl Drop for Corpus {
    fn drop(&mut self) {
        for local in self.local() {
            let _ = std::process::Command::new("docker").args(["rmi", "-f", &local]).output();
        }
        for image in &self.images {
            self.delete_from_registry(image);
        }
    }
}

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
        Corpus { prefix: prefix.to_string(), images: push_corpus(&registry(), prefix, count, layer_kb) }
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

/// Pushes `count` images of `layer_kb` KiB each under `prefix` to `registry` (`scripts/corpus`).
fn push_corpus(registry: &str, prefix: &str, count: usize, layer_kb: usize) -> Vec<CorpusImage> {
    let out = std::env::temp_dir().join(format!("{prefix}-{}.jsonl", crate::rand_hex(6)));
    let status = std::process::Command::new(repo_root().join("scripts/corpus"))
        .args(["--registry", registry, "--count", &count.to_string(), "--layer-kb", &layer_kb.to_string()])
        .args(["--repo-prefix", prefix])
        .arg("--out")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run scripts/corpus");
    assert!(status.success(), "scripts/corpus failed: {status}");
    let text = std::fs::read_to_string(&out).expect("the corpus's list");
    let _ = std::fs::remove_file(&out);
    text.lines().map(|l| serde_json::from_str(l).expect("a corpus line")).collect()
}

/// One image built from `sandpool/busybox` plus Dockerfile lines of a test's own, pushed to the
/// local registry under a fresh prefix; dropped, it leaves neither the registry nor the engine.
pub struct Built {
    /// `127.0.0.1:5000/<prefix>/<name>:latest`.
    pub image: String,
}

impl Built {
    pub fn new(name: &str, dockerfile_lines: &str) -> Built {
        let image = format!("{}/sptest-{}/{name}:latest", registry(), crate::rand_hex(10));
        let dir = std::env::temp_dir().join(format!("sptest-build-{}", crate::rand_hex(10)));
        std::fs::create_dir_all(&dir).expect("a build directory");
        let dockerfile = format!("FROM {}\n{dockerfile_lines}\n", crate::BUSYBOX_IMAGE);
        std::fs::write(dir.join("Dockerfile"), dockerfile).expect("write the Dockerfile");
        let built = Built { image };
        let run = |args: &[&str]| {
            let out = std::process::Command::new("docker").args(args).output().expect("run docker");
            assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        run(&["build", "-q", "-t", &built.image, &dir.to_string_lossy()]);
        let _ = std::fs::remove_dir_all(&dir);
        run(&["push", "-q", &built.image]);
        // Only the registry has it now: the node pulls it as it would any task image.
        run(&["rmi", "-f", &built.image]);
        built
    }
}

impl Drop for Built {
    fn drop(&mut self) {
        let repo = self.image.rsplit_once(':').map_or(self.image.as_str(), |(r, _)| r);
        let out = std::process::Command::new("docker")
            .args(["images", "--no-trunc", "--format", "{{.ID}}", repo])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
            .unwrap_or_default();
        for id in out.lines() {
            let _ = std::process::Command::new("docker").args(["rmi", "-f", id]).output();
        }
        let path = repo.trim_start_matches(&format!("{}/", registry())).to_string();
        let head = std::process::Command::new("curl")
            .args(["-fsSI", "-H", "Accept: application/vnd.docker.distribution.manifest.v2+json"])
            .arg(format!("http://{}/v2/{path}/manifests/latest", registry()))
            .output();
        let digest = head.ok().and_then(|o| {
            String::from_utf8_lossy(&o.stdout).lines().find_map(|l| {
                l.to_ascii_lowercase().strip_prefix("docker-content-digest:").map(|d| d.trim().to_string())
            })
        });
        if let Some(d) = digest {
            let url = format!("http://{}/v2/{path}/manifests/{d}", registry());
            let _ = std::process::Command::new("curl").args(["-fsS", "-X", "DELETE", &url]).output();
        }
    }
}

/// A registry of a test's own that asks for a password (Debian's docker-registry with htpasswd
/// auth, on a free loopback port): `count` corpus images are pushed while it is open, then it
/// restarts closed. Dropped, it stops and leaves no data and no local image of it.
pub struct AuthRegistry {
    /// `127.0.0.1:<port>`.
    pub host: String,
    pub user: String,
    pub password: String,
    pub images: Vec<CorpusImage>,
    dir: PathBuf,
    child: Option<std::process::Child>,
}

impl AuthRegistry {
    pub fn start(prefix: &str, count: usize) -> AuthRegistry {
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a port").port();
        let dir = std::env::temp_dir().join(format!("sptest-registry-{}", crate::rand_hex(10)));
        std::fs::create_dir_all(dir.join("data")).expect("the registry's directory");
        let mut r = AuthRegistry {
            host: format!("127.0.0.1:{port}"),
            user: "puller".into(),
            password: crate::rand_hex(16),
            images: Vec::new(),
            dir,
            child: None,
        };
        r.serve(false);
        r.images = push_corpus(&r.host, prefix, count, 4);
        // Closed from now on: a bcrypt entry (what docker-registry's htpasswd auth reads).
        let hash = std::process::Command::new("python3")
            .args([
                "-W",
                "ignore",
                "-c",
                "import crypt,sys; print(crypt.crypt(sys.argv[1], crypt.mksalt(crypt.METHOD_BLOWFISH)))",
            ])
            .arg(&r.password)
            .output()
            .expect("run python3");
        let hash = String::from_utf8_lossy(&hash.stdout).trim().to_string();
        assert!(hash.starts_with("$2"), "a bcrypt hash: {hash:?}");
        std::fs::write(r.dir.join("htpasswd"), format!("{}:{hash}\n", r.user)).expect("write htpasswd");
        r.stop();
        r.serve(true);
        r
    }

    fn serve(&mut self, closed: bool) {
        let auth = if closed {
            format!("auth:\n  htpasswd:\n    realm: sptest\n    path: {}\n", self.dir.join("htpasswd").display())
        } else {
            String::new()
        };
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    \
             rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {}\n{auth}",
            self.dir.join("data").display(),
            self.host
        );
        let path = self.dir.join("config.yml");
        std::fs::write(&path, config).expect("write the registry's config");
        let child = std::process::Command::new("docker-registry")
            .arg("serve")
            .arg(&path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start docker-registry");
        self.child = Some(child);
        let want = if closed { "401" } else { "200" };
        for _ in 0..100 {
            let code = std::process::Command::new("curl")
                .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", &format!("http://{}/v2/", self.host)])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
                .unwrap_or_default();
            if code == want {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("the test registry on {} did not answer {want}", self.host);
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for AuthRegistry {
    fn drop(&mut self) {
        self.stop();
        let out = std::process::Command::new("docker")
            .args(["images", "--digests", "--format", "{{.Repository}}@{{.Digest}}"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
            .unwrap_or_default();
        for image in out.lines().filter(|l| l.starts_with(&format!("{}/", self.host))) {
            let _ = std::process::Command::new("docker").args(["rmi", "-f", image]).output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

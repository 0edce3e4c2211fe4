//! A registry of a test's own (Debian's `docker-registry`, as `scripts/lib.sh ensure_registry`
//! runs the shared one) on a free loopback port with a scratch storage directory, so a test can
//! kill it and start it again on the same port with the same content: the registry going away
//! under a lazy image. Dropped, it is killed and its storage removed, pass or fail.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One `docker-registry serve` process and what it needs to start again alike.
pub struct OwnRegistry {
    /// `127.0.0.1:<port>`: the registry part of image references pushed to it.
    pub host: String,
    dir: PathBuf,
    child: Option<Child>,
}

impl OwnRegistry {
    /// Starts a registry on a free loopback port, storing under a new directory in `parent`,
    /// and waits until it answers.
    pub fn start(parent: &std::path::Path) -> anyhow::Result<OwnRegistry> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir = parent.join(format!("registry-{port}"));
        std::fs::create_dir_all(dir.join("storage"))?;
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    \
             rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n  secret: {}\n",
            dir.join("storage").display(),
            crate::rand_hex(16)
        );
        std::fs::write(dir.join("config.yml"), config)?;
        let mut registry = OwnRegistry { host: format!("127.0.0.1:{port}"), dir, child: None };
        registry.resume()?;
        Ok(registry)
    }

    /// Starts the registry again (same port, same content) and waits until it answers.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(self.child.is_none(), "the registry on {} runs already", self.host);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("registry.log"))?;
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(self.dir.join("config.yml"))
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| anyhow::anyhow!("start docker-registry (scripts/lib.sh installs it): {e}"))?;
        self.child = Some(child);
        let began = Instant::now();
        while !self.answers() {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                self.child = None;
                anyhow::bail!("docker-registry on {} exited at start: {status} (see {})", self.host, self.log());
            }
            anyhow::ensure!(
                began.elapsed() < Duration::from_secs(20),
                "docker-registry on {} did not answer within 20 s (see {})",
                self.host,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// SIGKILL, and reap: the registry is gone (connections refused) until [`resume`].
    ///
    /// [`resume`]: OwnRegistry::resume
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether it answers `GET /v2/` (a blocking probe, bounded at 2 s).
    pub fn answers(&self) -> bool {
        use std::io::{Read as _, Write as _};
        let Ok(addr) = self.host.parse() else { return false };
        let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let request = format!("GET /v2/ HTTP/1.0\r\nHost: {}\r\n\r\n", self.host);
        let mut head = [0u8; 12];
        s.write_all(request.as_bytes()).is_ok() && s.read_exact(&mut head).is_ok() && head.ends_with(b"200")
    }

    fn log(&self) -> String {
        self.dir.join("registry.log").display().to_string()
    }
}

impl Drop for OwnRegistry {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

//! The run's lazy image, for the `registry` fault: a registry of the run's own, a lazy image in
//! it (busybox and `/data.bin`, whose every 4 KiB block says its number), a `lazy` template per
//! tenant made from it and prefetched onto every node, and the episode step that reads one
//! block. With the registry killed, a block not yet fetched fails with an I/O error inside the
//! sandbox: an answered call (counted as `lazy_read_eio`), not a violation; a block read back
//! wrong is one. At each registry fault a probe session reads a block nobody fetched: it must
//! fail with EIO within the bound while the registry is gone, and read back right once it is
//! back (else a `registry` violation).

use std::io::{BufRead as _, Write as _};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::Context as _;
use reqwest::Method;
use serde_json::json;
use tests::own_registry::OwnRegistry;

use crate::api::{Api, Body, Outcome};

/// The blocks of `/data.bin`: 64 MiB. Episodes read the first half; the second half is the
/// probe's, one block [`PROBE_STRIDE`] apart per registry fault (three per run), so each probe
/// reads a chunk nobody fetched.
pub(crate) const DATA_BLOCKS: u64 = 64 * 256;
/// The blocks episodes read from: the first half of the file.
pub(crate) const EPISODE_BLOCKS: u64 = DATA_BLOCKS / 2;
/// 8 MiB between probes: past the daemon's read-ahead (4 chunks) and the kernel's.
const PROBE_STRIDE: u64 = 8 * 256;
const BLOCK: usize = 4096;
/// The template each tenant makes from the lazy image.
pub(crate) const TEMPLATE: &str = "lazy";
/// The node's daemon, which mounts the image (its default socket: the nodes start it).
const LAZYD_SOCKET: &str = "/run/sandpool/lazyd.sock";

/// Block `n` of `/data.bin`: its number on each line.
pub(crate) fn block(n: u64) -> Vec<u8> {
    let line = format!("{n:06}\n");
    let mut b = line.repeat(BLOCK / line.len()).into_bytes();
    b.resize(BLOCK, b'\n');
    b
}

/// The run's registry and lazy image; on drop, the image's mount and stub images go (after
/// the run's containers: `World`'s drop removes those first) and the registry is killed.
pub(crate) struct LazyWorld {
    pub(crate) registry: OwnRegistry,
    /// The lazy image, as the tenants' templates name it (a tag).
    pub(crate) image: String,
    /// ... pinned by digest (what `sandpool images convert` printed).
    pinned: String,
    /// The probe session (tenant, session id): it reads an unfetched block at each fault.
    probe: Option<(String, String)>,
    probes: u64,
}

impl LazyWorld {
    /// Starts the registry, builds and pushes the source image, converts it with `sandpool`,
    /// and installs the lazy runtime (`scripts/lib.sh`) beside which nodes start `sandpool-lazyd`.
    pub(crate) fn build(dir: &Path, sandpool: &Path, lib_sh: &Path) -> anyhow::Result<LazyWorld> {
        let runtime = sandpool.with_file_name("sandpool-lazy-runtime");
        let lazyd = sandpool.with_file_name("sandpool-lazyd");
        anyhow::ensure!(
            runtime.exists() && lazyd.exists(),
            "the registry fault needs sandpool-lazyd and sandpool-lazy-runtime beside {} (cargo build -p lazy-image --bins)",
            sandpool.display()
        );
        let script = format!(
            "source {} && ensure_runtimes >/dev/null && install_lazy_runtime {}",
            lib_sh.display(),
            runtime.display()
        );
        run(Command::new("bash").args(["-c", &script]))?;
        let registry = OwnRegistry::start(dir)?;
        let build = dir.join("lazy-image");
        std::fs::create_dir_all(&build)?;
        let data: Vec<u8> = (0..DATA_BLOCKS).flat_map(block).collect();
        std::fs::write(build.join("data.bin"), data)?;
        // A file naming the run makes its blob (and so its chunks in the node's cache, keyed by
        // the blob's digest) the run's own: an earlier run's chunks would serve the probe's
        // reads with the registry gone.
        std::fs::write(build.join("run-id"), dir.display().to_string())?;
        let dockerfile = format!("FROM {}\nCOPY data.bin /data.bin\nCOPY run-id /run-id\n", tests::BUSYBOX_IMAGE);
        std::fs::write(build.join("Dockerfile"), dockerfile)?;
        let src = format!("{}/chaos/img:src", registry.host);
        let image = format!("{}/chaos/img:lazy", registry.host);
        run(Command::new("docker").args(["build", "-q", "-t", &src]).arg(&build))?;
        run(Command::new("docker").args(["push", "-q", &src]))?;
        let _ = Command::new("docker").args(["rmi", &src]).output();
        let _ = std::fs::remove_dir_all(&build);
        // Uncompressed: the blocks (text, very compressible) keep their 64 MiB, so most chunks
        // are unfetched when the registry goes.
        let convert = ["images", "convert", "--compressor", "none", &src, &image];
        let converted = run(Command::new(sandpool).args(convert))?;
        let pinned = converted.trim().lines().last().unwrap_or_default().to_string();
        anyhow::ensure!(pinned.contains("@sha256:"), "sandpool images convert printed {converted:?}");
        eprintln!("sandpool-chaos: lazy image {pinned} in a registry of the run's own");
        Ok(LazyWorld { registry, image, pinned, probe: None, probes: 0 })
    }

    /// Each tenant's `lazy` template, prefetched (mounted) onto `nodes` before any fault; the
    /// gateways place its sessions on the nodes holding its image first. The caller names the
    /// nodes on the host's dockerd: lazy sandboxes on the second one (overlay2) are covered by
    /// `lazy::a_lazy_session_and_its_fork_run_on_an_overlay2_docker`, not by this run.
    pub(crate) async fn templates(&self, api: &Api, tenants: &[&str], nodes: &[String]) -> anyhow::Result<()> {
        for t in tenants {
            let body = json!({"name": TEMPLATE, "image": self.image});
            let r = api
                .call(0, t, Method::POST, "/v1/templates", Some(Body::Json(body)), crate::CALL_DEADLINE)
                .await
                .map_err(|o| anyhow::anyhow!("{t}: make the lazy template: {o:?}"))?;
            anyhow::ensure!(r.status == 201, "{t}: make the lazy template: {} {}", r.status, r.body);
        }
        // One tenant's template names the image for all.
        let body = json!({"templates": [format!("{}/{TEMPLATE}", tenants[0])], "nodes": nodes});
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let prefetch = Body::Json(body.clone());
            let r = api.call(0, tenants[0], Method::POST, "/v1/images:prefetch", Some(prefetch), crate::CALL_DEADLINE);
            let pulls = r.await.ok().filter(|r| r.status == 202).and_then(|r| r.body["pulls"].as_array().cloned());
            if pulls.is_some_and(|p| !p.is_empty() && p.iter().all(|p| p["state"] == "present")) {
                return Ok(());
            }
            anyhow::ensure!(std::time::Instant::now() < deadline, "the lazy image was not on {nodes:?} within 120 s");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

impl LazyWorld {
    /// Opens the probe session (deleted with every session the run holds at its end).
    pub(crate) async fn open_probe(&mut self, api: &Api, tenant: &str) -> anyhow::Result<()> {
        let template = format!("{tenant}/{TEMPLATE}");
        let (sid, _) = api.create(0, tenant, &template).await.context("open the lazy probe session")?;
        self.probe = Some((tenant.to_string(), sid));
        Ok(())
    }

    /// The next probe's block, if the probe's half of the file has one left.
    fn next_probe_block(&mut self) -> Option<u64> {
        // One stride past the episodes' half too: an episode reading two chunks in a row makes
        // the daemon read 4 more ahead, and chunks do not start where the file's MiBs do.
        let block = EPISODE_BLOCKS + (self.probes + 1) * PROBE_STRIDE;
        self.probes += 1;
        (block < DATA_BLOCKS).then_some(block)
    }

    /// With the registry killed: a block nobody fetched must fail with an I/O error within the
    /// daemon's bound; returns it (to read again once the registry is back), or a violation.
    pub(crate) async fn probe_gone(&mut self, api: &Api) -> Result<Option<u64>, String> {
        let Some((tenant, sid)) = self.probe.clone() else { return Ok(None) };
        let Some(n) = self.next_probe_block() else { return Ok(None) };
        let began = std::time::Instant::now();
        let r = exec_block(api, &tenant, &sid, n).await;
        let took = began.elapsed();
        match r {
            Ok((Read::Eio, _)) if took < PROBE_BOUND => {
                eprintln!("  probe: block {n} read with the registry gone: EIO after {:.1} s", took.as_secs_f64());
                Ok(Some(n))
            }
            Ok((read, body)) => Err(format!("block {n} with the registry gone: {read:?} after {took:?}: {body}")),
            // The session ended (its node died meanwhile): nothing to say about the registry.
            Err(o) if !o.violation() => Ok(None),
            Err(o) => Err(format!("block {n} with the registry gone: {o:?}")),
        }
    }

    /// With the registry back: block `n` reads back right.
    pub(crate) async fn probe_back(&self, api: &Api, n: u64) -> Result<(), String> {
        let Some((tenant, sid)) = &self.probe else { return Ok(()) };
        match exec_block(api, tenant, sid, n).await {
            Ok((Read::Right, _)) => Ok(()),
            Ok((read, body)) => Err(format!("block {n} after the registry came back: {read:?}: {body}")),
            Err(o) if !o.violation() => Ok(()),
            Err(o) => Err(format!("block {n} after the registry came back: {o:?}")),
        }
    }
}

/// The longest a read of an unfetched block may take with the registry gone: the daemon's
/// default fetch bound (10 s, retries included) and slack for a loaded machine.
const PROBE_BOUND: Duration = Duration::from_secs(20);

/// What a block read came to.
#[derive(Debug, PartialEq)]
enum Read {
    Right,
    Eio,
    Wrong,
}

/// Reads block `n` (not counted among the load's calls): how it went, with the answer's body;
/// `Err` with the outcome when the call was not answered 200.
async fn exec_block(api: &Api, tenant: &str, sid: &str, n: u64) -> Result<(Read, serde_json::Value), Outcome> {
    let path = format!("/v1/sessions/{sid}/exec");
    let body = Body::Json(json!({"cmd": block_cmd(n), "timeout_ms": 30_000}));
    let r = api.call(0, tenant, Method::POST, &path, Some(body), crate::CALL_DEADLINE).await?;
    if r.status != 200 {
        return Err(crate::api::classify(&r));
    }
    let read = if is_eio(&r) {
        Read::Eio
    } else if r.body["exit_code"] == 0 && r.body["stdout"].as_str().map(str::as_bytes) == Some(&block(n)[..]) {
        Read::Right
    } else {
        Read::Wrong
    };
    Ok((read, r.body))
}

fn block_cmd(n: u64) -> String {
    format!("dd if=/data.bin bs={BLOCK} skip={n} count=1")
}

/// A read that failed with EIO (dd's message: glibc's or busybox's words for it).
fn is_eio(r: &crate::api::Reply) -> bool {
    let stderr = r.body["stderr"].as_str().unwrap_or_default();
    r.body["exit_code"] != 0 && (stderr.contains("I/O error") || stderr.contains("Input/output error"))
}

impl Drop for LazyWorld {
    fn drop(&mut self) {
        // The mount is the node daemon's cache; this image was this run's alone.
        if let Ok(mut s) = std::os::unix::net::UnixStream::connect(LAZYD_SOCKET) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
            let _ = writeln!(s, "{}", json!({"unmount": {"image": self.pinned}}));
            let _ = std::io::BufReader::new(s).read_line(&mut String::new());
        }
        let hex = self.pinned.rsplit_once("@sha256:").map(|(_, h)| h.to_string()).unwrap_or_default();
        for host in [None, Some(format!("unix://{}", crate::DOCKER2_SOCKET))] {
            let mut rmi = Command::new("docker");
            rmi.args(host.iter().flat_map(|h| ["-H", h.as_str()]));
            let _ = rmi.args(["rmi", &format!("sandpool-lazy:{hex}")]).output();
        }
    }
}

/// Reads block `n` of `/data.bin` in a lazy session: Ok when it reads back right, or when it
/// fails with an I/O error (the registry is gone: counted apart as `lazy_read_eio`); anything
/// else that answers 200 is a wrong answer.
pub(crate) async fn read_block(api: &Api, gw: usize, tenant: &str, sid: &str, n: u64) -> Outcome {
    let path = format!("/v1/sessions/{sid}/exec");
    let body = Body::Json(json!({"cmd": block_cmd(n), "timeout_ms": 30_000}));
    let want = String::from_utf8(block(n)).unwrap_or_default();
    let wrong = |r: &crate::api::Reply| {
        let right = r.body["exit_code"] == 0 && r.body["stdout"].as_str() == Some(&want);
        (!right && !is_eio(r)).then(|| format!("block {n} answered {}", r.body))
    };
    let (o, r) = api.checked_call("lazy_read", gw, tenant, Method::POST, &path, Some(body), 200, wrong).await;
    if o == Outcome::Ok && r.as_ref().is_some_and(is_eio) {
        api.count("lazy_read_eio", Outcome::Ok, String::new);
    }
    o
}

fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

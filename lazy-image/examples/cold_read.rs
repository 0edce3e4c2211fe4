//! The cold-start measurement behind BENCHMARKS.md's lazy-image rows: mount a lazy image on an
//! empty chunk cache, read `BYTES` of `FILE` from it, and print how long each step took and
//! how many bytes came from the registry. With `--runc`, also start a container with runc on
//! an OCI bundle whose root is an overlay over the lazy mount, running `head -c BYTES FILE`
//! (what a sandbox's first command would do), and time that. With `--sh CMD` (implies
//! `--runc`), then run `sh -c CMD` in a second container on the same mount and print its
//! output (e.g. a `sha256sum` of the whole file, to compare with the digest taken at build).
//!
//! ```text
//! cargo run -p lazy-image --example cold_read -- IMAGE FILE BYTES [--runc] [--sh CMD]
//! ```

use std::io::Read as _;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, bail};
use lazy_image::{ChunkCache, LazyRootfs, Reference};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [image, file, bytes, rest @ ..] = args.as_slice() else {
        bail!("usage: cold_read IMAGE FILE BYTES [--runc] [--sh CMD]");
    };
    let shell =
        rest.iter().position(|a| a == "--sh").map(|i| rest.get(i + 1).cloned().context("--sh CMD")).transpose()?;
    let with_runc = shell.is_some() || rest.iter().any(|a| a == "--runc");
    let bytes: usize = bytes.parse().context("BYTES")?;
    let image = Reference::parse(image)?;
    let scratch = std::env::temp_dir().join(format!("lazy-cold-{}", std::process::id()));
    let result = measure(&image, file, bytes, with_runc, shell.as_deref(), &scratch).await;
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

async fn measure(
    image: &Reference,
    file: &str,
    bytes: usize,
    with_runc: bool,
    shell: Option<&str>,
    scratch: &Path,
) -> anyhow::Result<()> {
    let dir = |name: &str| -> anyhow::Result<std::path::PathBuf> {
        let d = scratch.join(name);
        std::fs::create_dir_all(&d)?;
        Ok(d)
    };
    let cache = Arc::new(ChunkCache::open(dir("chunks")?, 2 << 30)?);
    let began = Instant::now();
    let rootfs =
        LazyRootfs::mount(image, cache, lazy_image::FetchPolicy::default(), &dir("state")?, &dir("lower")?).await?;
    let mounted = began.elapsed();
    let blob_size = rootfs.image().config.rootfs.size;
    let image_size = rootfs.image().config.source.layers_size;
    let after_mount = rootfs.stats().bytes_fetched();

    let path = rootfs.target().join(file.trim_start_matches('/'));
    let read_began = Instant::now();
    let data = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<u8>> {
        let mut buf = vec![0u8; bytes];
        let n = std::fs::File::open(&path)?.read(&mut buf)?;
        buf.truncate(n);
        Ok(buf)
    })
    .await??;
    let read = read_began.elapsed();
    println!(
        "mount {:.3}s ({after_mount} bytes fetched), read {} bytes of {file} {:.3}s, total {:.3}s; \
         fetched {} bytes = {:.2}% of the {blob_size}-byte blob ({image_size} bytes of source layers)",
        mounted.as_secs_f64(),
        data.len(),
        read.as_secs_f64(),
        began.elapsed().as_secs_f64(),
        rootfs.stats().bytes_fetched(),
        100.0 * rootfs.stats().bytes_fetched() as f64 / blob_size as f64,
    );

    if with_runc {
        run_container(&rootfs, file, bytes, shell, scratch).await?;
    }
    tokio::task::spawn_blocking(move || rootfs.unmount()).await??;
    Ok(())
}

/// runc on a bundle whose root is an overlay (upper on local disk) over the lazy mount; the
/// container has its own network namespace with loopback only (`network = "none"`).
async fn run_container(
    rootfs: &LazyRootfs,
    file: &str,
    bytes: usize,
    shell: Option<&str>,
    scratch: &Path,
) -> anyhow::Result<()> {
    let bundle = scratch.join("bundle");
    let merged = bundle.join("rootfs");
    for d in [&merged, &scratch.join("upper"), &scratch.join("work")] {
        std::fs::create_dir_all(d)?;
    }
    let options = lazy_image::mount::overlay_options(rootfs.target(), &scratch.join("upper"), &scratch.join("work"));
    let began = Instant::now();
    run(Command::new("mount").args(["-t", "overlay", "overlay", "-o", &options]).arg(&merged))?;
    let overlay = began.elapsed();
    run(Command::new("runc").arg("spec").arg("--bundle").arg(&bundle))?;
    let spec_path = bundle.join("config.json");
    let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&spec_path)?)?;
    spec["process"]["terminal"] = false.into();
    spec["root"]["readonly"] = false.into();
    let id = format!("lazy-cold-{}", std::process::id());
    let result = runc_run(
        &bundle,
        &spec_path,
        &mut spec,
        &id,
        vec!["head".into(), "-c".into(), bytes.to_string(), file.into()],
    )
    .and_then(|(out, took)| {
        println!(
            "overlay {:.3}s, runc run (create, start, `head -c {bytes} {file}`, exit) {took:.3}s, {} bytes out; \
                 fetched so far {} bytes",
            overlay.as_secs_f64(),
            out.len(),
            rootfs.stats().bytes_fetched()
        );
        let Some(cmd) = shell else { return Ok(()) };
        let (out, took) = runc_run(&bundle, &spec_path, &mut spec, &id, vec!["sh".into(), "-c".into(), cmd.into()])?;
        println!(
            "runc run `sh -c {cmd:?}` {took:.3}s; fetched so far {} bytes; output:\n{}",
            rootfs.stats().bytes_fetched(),
            String::from_utf8_lossy(&out).trim_end()
        );
        Ok(())
    });
    let _ = Command::new("umount").arg(&merged).status();
    result
}

/// One container on the bundle with `args`; its stdout and seconds from `runc run` to exit.
fn runc_run(
    bundle: &Path,
    spec_path: &Path,
    spec: &mut serde_json::Value,
    id: &str,
    args: Vec<String>,
) -> anyhow::Result<(Vec<u8>, f64)> {
    spec["process"]["args"] = serde_json::json!(args);
    std::fs::write(spec_path, serde_json::to_vec(&*spec)?)?;
    let began = Instant::now();
    let out = Command::new("runc").args(["run", "--bundle"]).arg(bundle).arg(id).output()?;
    let took = began.elapsed().as_secs_f64();
    let _ = Command::new("runc").args(["delete", "-f", id]).output();
    if !out.status.success() {
        bail!("runc run {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok((out.stdout, took))
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("run {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?}: {status}");
    }
    Ok(())
}

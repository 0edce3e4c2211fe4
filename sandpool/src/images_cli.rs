//! `sandpool images convert SRC DST`: publish a registry image as a lazy image (one EROFS
//! blob whose chunks a node fetches on demand). Runs where the images are built (CI, an
//! operator's machine), as root, with `mkfs.erofs`; needs no config and no Redis.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;
use lazy_image::{ConvertOptions, Reference};

#[derive(Subcommand)]
pub enum ImagesOp {
    /// Converts SRC (an image in a registry) into a lazy image tagged DST in a registry, and
    /// prints DST pinned by digest (the source's digest is pinned inside it).
    Convert {
        /// `host:port/repository[:tag|@sha256:...]`.
        src: String,
        /// `host:port/repository[:tag]`.
        dst: String,
        /// `mkfs.erofs` compressor: lz4hc (smallest blob, slowest to make), lz4, or none.
        #[arg(long, default_value = "lz4hc")]
        compressor: String,
        /// Fetch granularity in bytes (a power of two, at least 4096).
        #[arg(long, default_value_t = lazy_image::convert::DEFAULT_CHUNK_SIZE)]
        chunk_size: u64,
        /// Scratch space for the flattened image and the blob (about twice the image's size);
        /// default: $TMPDIR or /tmp.
        #[arg(long)]
        work_dir: Option<PathBuf>,
        /// Print the result as JSON instead of the pinned reference.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(op: ImagesOp) -> ExitCode {
    let ImagesOp::Convert { src, dst, compressor, chunk_size, work_dir, json } = op;
    let (src, dst) = match (Reference::parse(&src), Reference::parse(&dst)) {
        (Ok(s), Ok(d)) => (s, d),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("sandpool: {e}");
            return ExitCode::from(2);
        }
    };
    if !chunk_size.is_power_of_two() || chunk_size < 4096 {
        eprintln!("sandpool: --chunk-size {chunk_size}: a power of two, at least 4096");
        return ExitCode::from(2);
    }
    let compressor = match compressor.as_str() {
        "none" => None,
        "lz4" | "lz4hc" => Some(compressor),
        other => {
            eprintln!("sandpool: --compressor {other:?}: lz4hc, lz4 or none");
            return ExitCode::from(2);
        }
    };
    let mut options = ConvertOptions { chunk_size, compressor, ..ConvertOptions::default() };
    if let Some(dir) = work_dir {
        options.work_dir = dir;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandpool: start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Ctrl-C or SIGTERM drops the conversion, which stops mkfs.erofs and removes its scratch
    // directory (possibly gigabytes) before the process exits.
    let converted = rt.block_on(async {
        tokio::select! {
            r = lazy_image::convert(&src, &dst, &options) => Some(r),
            () = interrupted() => None,
        }
    });
    let Some(converted) = converted else {
        eprintln!("sandpool: convert {src}: interrupted");
        return ExitCode::from(130);
    };
    match converted {
        Ok(done) => {
            let rootfs = &done.config.rootfs;
            if json {
                let out = serde_json::json!({
                    "source": done.source.to_string(),
                    "destination": done.destination.to_string(),
                    "source_layers_bytes": done.config.source.layers_size,
                    "blob_bytes": rootfs.size,
                    "chunks": rootfs.chunks.len(),
                    "chunk_size": rootfs.chunk_size,
                    "seconds": {
                        "unpack": done.timings.unpack.as_secs_f64(),
                        "mkfs": done.timings.mkfs.as_secs_f64(),
                        "push": done.timings.push.as_secs_f64(),
                    },
                });
                println!("{out}");
            } else {
                eprintln!(
                    "sandpool: converted {} ({} bytes of layers) into a {}-byte EROFS blob in {} chunks \
                     (unpack {:.1}s, mkfs {:.1}s, push {:.1}s)",
                    done.source,
                    done.config.source.layers_size,
                    rootfs.size,
                    rootfs.chunks.len(),
                    done.timings.unpack.as_secs_f64(),
                    done.timings.mkfs.as_secs_f64(),
                    done.timings.push.as_secs_f64()
                );
                println!("{}", done.destination);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sandpool: convert {src}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn interrupted() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

//! `sandpool-lazy-runtime`: the OCI runtime Docker runs lazy sandboxes with (`lazy_image::oci`).
//! Called by containerd's shim with runc's command line; prepares the overlay root on
//! `create`/`run`, unmounts it after `delete`, and otherwise is runc.
//!
//! The real runtime is `runc` from PATH (or /usr/sbin, /usr/bin), or the one named by a first
//! argument `--sandpool-oci=PATH` (a `runtimeArgs` entry in daemon.json: `sandpool-lazy-crun` and
//! `sandpool-lazy-runsc` name crun and runsc so).

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use lazy_image::oci;

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = match args.first().and_then(|a| a.strip_prefix("--sandpool-oci=")) {
        Some(path) => {
            let path = PathBuf::from(path);
            args.remove(0);
            path
        }
        None => find_runc(),
    };
    let inv = oci::parse(&args);
    let roots = Path::new(oci::ROOTS_DIR);
    match (inv.command.as_deref(), &inv.bundle, &inv.id) {
        (Some("create" | "run"), Some(bundle), Some(id)) => {
            if let Err(e) = oci::prepare(bundle, id, roots) {
                // containerd's shim shows runc's stderr in the error Docker returns.
                eprintln!("sandpool-lazy-runtime: {e:#}");
                return ExitCode::FAILURE;
            }
        }
        (Some("delete"), _, Some(id)) => {
            let status = Command::new(&runtime).args(&args).status();
            if let Err(e) = oci::cleanup(id, roots) {
                eprintln!("sandpool-lazy-runtime: {e:#}");
            }
            return match status {
                Ok(s) => ExitCode::from(s.code().unwrap_or(1).clamp(0, 255) as u8),
                Err(e) => {
                    eprintln!("sandpool-lazy-runtime: run {}: {e}", runtime.display());
                    ExitCode::FAILURE
                }
            };
        }
        _ => {}
    }
    let e = Command::new(&runtime).args(&args).exec();
    eprintln!("sandpool-lazy-runtime: exec {}: {e}", runtime.display());
    ExitCode::FAILURE
}

fn find_runc() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|dir| dir.join("runc"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("runc"))
}

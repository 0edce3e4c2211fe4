//! `sandpool-shim`: installed as `containerd-shim-runc-v2` in a directory that comes first on
//! dockerd's (and so containerd's) `PATH` (`scripts/lib.sh`, `ensure_shim_groups`).
//!
//! containerd runs `containerd-shim-runc-v2 ... start` in a new container's bundle directory
//! to get the address of the shim that will serve it; the runc shim answers with the shim of
//! the container's group when the spec's annotations name one (`io.containerd.runc.v2.group`)
//! and starts a new shim otherwise. Docker 20.10 passes no annotations, so the node names the
//! group in the container's environment (`SANDPOOL_SHIM_GROUP`, chosen by the pool-manager's
//! `docker/shim_groups.rs`) and this program copies it into the spec's annotations. Then, for
//! every subcommand and every container, grouped or not, it becomes the real shim (the next
//! `containerd-shim-runc-v2` on `PATH`) with the same arguments and descriptors.
//!
//! It never fails a container: a spec it cannot read or write is left as it is (the container
//! gets a shim of its own) and the reason is appended to a log file (`SANDPOOL_SHIM_LOG`,
//! default `/var/log/sandpool-shim.log`), never to stdout or stderr: containerd takes all that
//! `start` prints, both streams, as the address of the shim, so one line there fails the start.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use agent_proto::layout::SHIM_GROUP_ENV;

/// The name containerd looks up for Docker's runtimes, and the real shim's.
const SHIM_NAME: &str = "containerd-shim-runc-v2";
/// The runc shim's group annotation (containerd 1.4 and later).
const GROUP_ANNOTATION: &str = "io.containerd.runc.v2.group";
/// The longest group name taken.
const MAX_GROUP: usize = 128;
/// Where a spec left ungrouped is told, unless `SANDPOOL_SHIM_LOG` says elsewhere.
const DEFAULT_LOG: &str = "/var/log/sandpool-shim.log";

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    if args.last().is_some_and(|a| a == "start") {
        let spec = Path::new("config.json");
        if let Err(e) = add_group(spec) {
            let dir = std::env::current_dir().unwrap_or_default();
            note(&format!("left {} ungrouped: {e}", dir.join(spec).display()));
        }
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let me = std::env::current_exe().and_then(|p| p.canonicalize()).ok();
    let Some(real) = real_shim(&path, me.as_deref()) else {
        eprintln!("sandpool-shim: no other {SHIM_NAME} on PATH");
        return ExitCode::from(127);
    };
    let err = Command::new(&real).arg0(&args[0]).args(&args[1..]).exec();
    eprintln!("sandpool-shim: cannot run {}: {err}", real.display());
    ExitCode::from(126)
}

/// Appends a line to the log file, if it can.
fn note(line: &str) {
    use std::io::Write;
    let path = std::env::var_os("SANDPOOL_SHIM_LOG").unwrap_or_else(|| DEFAULT_LOG.into());
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "sandpool-shim[{}]: {line}", std::process::id());
    }
}

/// Puts the spec's group, if its environment names one, into its annotations.
fn add_group(spec: &Path) -> Result<(), String> {
    let bytes = std::fs::read(spec).map_err(|e| format!("read: {e}"))?;
    let Some(grouped) = grouped_spec(&bytes)? else { return Ok(()) };
    let tmp = spec.with_extension("json.sandpool-shim");
    let perms = std::fs::metadata(spec).map_err(|e| format!("stat: {e}"))?.permissions();
    std::fs::write(&tmp, grouped).map_err(|e| format!("write: {e}"))?;
    std::fs::set_permissions(&tmp, perms).map_err(|e| format!("chmod: {e}"))?;
    std::fs::rename(&tmp, spec).map_err(|e| format!("rename: {e}"))
}

/// The spec with its group annotation, or `None` when its environment names no group (the
/// variable unset or, last, empty) or the spec already has one.
fn grouped_spec(bytes: &[u8]) -> Result<Option<Vec<u8>>, String> {
    let marker = format!("\"{SHIM_GROUP_ENV}=");
    if !bytes.windows(marker.len()).any(|w| w == marker.as_bytes()) {
        return Ok(None);
    }
    let mut spec: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| format!("parse: {e}"))?;
    let prefix = format!("{SHIM_GROUP_ENV}=");
    let group = spec
        .pointer("/process/env")
        .and_then(|env| env.as_array())
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str()?.strip_prefix(&prefix))
        .next_back()
        .map(str::to_string);
    // Empty: the node names no group for this container (and overrides the image's own).
    let Some(group) = group.filter(|g| !g.is_empty()) else { return Ok(None) };
    if group.len() > MAX_GROUP || !group.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        return Err(format!("{SHIM_GROUP_ENV} {group:?} is not a group name"));
    }
    let root = spec.as_object_mut().ok_or("the spec is not an object")?;
    let annotations = root.entry("annotations").or_insert_with(|| serde_json::json!({}));
    let annotations = annotations.as_object_mut().ok_or("its annotations are not an object")?;
    if annotations.contains_key(GROUP_ANNOTATION) {
        return Ok(None);
    }
    annotations.insert(GROUP_ANNOTATION.into(), group.into());
    serde_json::to_vec(&spec).map(Some).map_err(|e| format!("encode: {e}"))
}

/// The first `containerd-shim-runc-v2` on `path` that is not this program.
fn real_shim(path: &std::ffi::OsStr, me: Option<&Path>) -> Option<PathBuf> {
    std::env::split_paths(path)
        .map(|dir| dir.join(SHIM_NAME))
        .find(|candidate| candidate.is_file() && candidate.canonicalize().is_ok_and(|c| Some(c.as_path()) != me))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_naming_a_group_gets_the_annotation_and_keeps_the_rest() {
        let spec = br#"{"ociVersion":"1.0.2","process":{"env":["PATH=/bin","SANDPOOL_SHIM_GROUP=sandpool-n1-0a-3"],"user":{"uid":0}},"linux":{"resources":{"memory":{"limit":33554432,"swap":18446744073709551615}}}}"#;
        let out: serde_json::Value = serde_json::from_slice(&grouped_spec(spec).unwrap().unwrap()).unwrap();
        assert_eq!(out["annotations"][GROUP_ANNOTATION], "sandpool-n1-0a-3");
        assert_eq!(out["linux"]["resources"]["memory"]["swap"], u64::MAX);
        assert_eq!(out["process"]["env"][0], "PATH=/bin");
        // Existing annotations stay.
        let spec = br#"{"annotations":{"a":"b"},"process":{"env":["SANDPOOL_SHIM_GROUP=g"]}}"#;
        let out: serde_json::Value = serde_json::from_slice(&grouped_spec(spec).unwrap().unwrap()).unwrap();
        assert_eq!(out["annotations"]["a"], "b");
        assert_eq!(out["annotations"][GROUP_ANNOTATION], "g");
    }

    #[test]
    fn other_specs_are_left_alone_and_bad_names_refused() {
        assert_eq!(grouped_spec(br#"{"process":{"env":["PATH=/bin"]}}"#).unwrap(), None);
        // The marker elsewhere than the environment names no group.
        assert_eq!(grouped_spec(br#"{"process":{"args":["\"SANDPOOL_SHIM_GROUP=x"]}}"#).unwrap(), None);
        let named =
            br#"{"annotations":{"io.containerd.runc.v2.group":"k"},"process":{"env":["SANDPOOL_SHIM_GROUP=g"]}}"#;
        assert_eq!(grouped_spec(named).unwrap(), None);
        // An empty value names none, and wins over an earlier one (an image's `ENV`).
        assert_eq!(grouped_spec(br#"{"process":{"env":["SANDPOOL_SHIM_GROUP="]}}"#).unwrap(), None);
        let overridden = br#"{"process":{"env":["SANDPOOL_SHIM_GROUP=tenant","SANDPOOL_SHIM_GROUP="]}}"#;
        assert_eq!(grouped_spec(overridden).unwrap(), None);
        for bad in ["a/b", "../x", "a b"] {
            let spec = format!(r#"{{"process":{{"env":["SANDPOOL_SHIM_GROUP={bad}"]}}}}"#);
            assert!(grouped_spec(spec.as_bytes()).is_err(), "{bad:?}");
        }
        assert!(grouped_spec(br#"{"process":{"env":["SANDPOOL_SHIM_GROUP=g"]"#).is_err());
    }

    #[test]
    fn the_real_shim_is_the_next_one_on_path() {
        let dir = std::env::temp_dir().join(format!("sandpool-shim-test-{}", std::process::id()));
        let (ours, theirs) = (dir.join("ours"), dir.join("theirs"));
        for d in [&ours, &theirs] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join(SHIM_NAME), b"").unwrap();
        }
        let path = std::env::join_paths([dir.join("missing"), ours.clone(), theirs.clone()]).unwrap();
        let me = ours.join(SHIM_NAME).canonicalize().unwrap();
        assert_eq!(real_shim(&path, Some(&me)), Some(theirs.join(SHIM_NAME)));
        assert_eq!(real_shim(&path, None), Some(ours.join(SHIM_NAME)));
        let only_me = std::env::join_paths([ours.clone()]).unwrap();
        assert_eq!(real_shim(&only_me, Some(&me)), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

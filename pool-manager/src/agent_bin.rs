//! The static in-sandbox agent, compiled by `build.rs` and embedded, and the Python function
//! runtime; installed on disk so sandboxes can bind-mount them read-only under `/.sandpool`.

use std::fs::{self, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The agent executable (static, stripped).
pub(crate) const AGENT_BIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sandpool-agent"));

/// File name of the installed agent inside the install directory, before its build's hash.
pub(crate) const FILE_NAME: &str = "sandpool-agent";

/// The installed agent's file name: `FILE_NAME` and a hash of this build's agent. Sandboxes
/// bind-mount the file by path when they are created, so a name per build keeps two
/// pool-managers of different builds sharing a `state_dir` (two on one machine during an
/// upgrade, test stacks of two checkouts) from starting sandboxes with each other's agent (of
/// another protocol version). Builds' files are not removed: a running sandbox may use one.
pub(crate) fn file_name() -> &'static str {
    static NAME: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        // FNV-1a, 64 bits: a name, not a defence (the directory is root's).
        let hash =
            AGENT_BIN.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        format!("{FILE_NAME}-{hash:016x}")
    });
    &NAME
}

/// The Python function runtime (`sdk/runtime/python`), bind-mounted read-only into every
/// agent-mode sandbox at `PYTHON_DIR_IN_SANDBOX`, so `python3 -m sandpool_runtime` works in
/// any image with a python3 (function workers get it on their `PYTHONPATH`).
pub(crate) const PYTHON_RUNTIME: &[u8] = include_bytes!("../../sdk/runtime/python/sandpool_runtime.py");
pub(crate) const PYTHON_DIR_IN_SANDBOX: &str = agent_proto::layout::PYTHON_DIR;

/// Where a sandbox's agent serves its direct channel (`/.sandpool/run` is bind-mounted from
/// the node's `AgentFiles::run_dir`).
pub(crate) const SOCKET_DIR_IN_SANDBOX: &str = agent_proto::layout::SOCKET_DIR;
pub(crate) const SOCKET_NAME: &str = "agent.sock";

/// What the node mounts into agent-mode sandboxes.
#[derive(Debug, Clone)]
pub struct AgentFiles {
    /// The agent executable.
    pub agent: PathBuf,
    /// The directory holding the Python runtime.
    pub python: PathBuf,
    /// One directory per sandbox (mode 0700) for its agent's socket.
    pub run: PathBuf,
}

impl AgentFiles {
    /// The host directory of one sandbox's agent socket.
    pub fn run_dir(&self, sandbox: &str) -> PathBuf {
        self.run.join(sandbox)
    }

    /// Makes a sandbox's socket directory (root only: the sandbox's user cannot reach it).
    pub fn make_run_dir(&self, sandbox: &str) -> io::Result<PathBuf> {
        let dir = self.run_dir(sandbox);
        fs::create_dir_all(&dir)?;
        fs::set_permissions(&dir, Permissions::from_mode(0o700))?;
        Ok(dir)
    }

    /// Where the node records which socket a sandbox's agent made: beside the sandboxes'
    /// directories, outside what any sandbox sees (a name no sandbox id has).
    fn socket_record(&self, sandbox: &str) -> PathBuf {
        self.run.join(format!(".socket-{sandbox}"))
    }

    /// Seals a sandbox's socket directory once its agent serves there, before any tenant code
    /// runs: the socket's identity (device, inode) is recorded outside the sandbox's reach, and
    /// the directory is given to `SEALED_OWNER` with mode 0500, so nothing in the sandbox, root
    /// included (it has no capability to override file permissions), can add, remove or replace
    /// an entry or write there (the host's disk, outside every disk bound).
    pub fn seal_run_dir(&self, sandbox: &str) -> io::Result<()> {
        let dir = self.run_dir(sandbox);
        let socket = agent_socket(&dir.join(SOCKET_NAME))?;
        fs::write(self.socket_record(sandbox), format!("{}:{}\n", socket.dev(), socket.ino()))?;
        std::os::unix::fs::chown(&dir, Some(SEALED_OWNER), Some(SEALED_OWNER))?;
        fs::set_permissions(&dir, Permissions::from_mode(0o500))
    }

    /// Whether a sandbox's socket is the one this node sealed (`seal_run_dir`): a node dials
    /// no socket the sandbox could have put there.
    pub fn check_socket(&self, sandbox: &str) -> SocketCheck {
        let dir = self.run_dir(sandbox);
        let record = match fs::read_to_string(self.socket_record(sandbox)) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return SocketCheck::Unsealed,
            Err(e) => return SocketCheck::Tampered(format!("read the socket's record: {e}")),
        };
        let check = || -> io::Result<Option<String>> {
            let meta = fs::symlink_metadata(&dir)?;
            if !meta.is_dir() || meta.uid() != SEALED_OWNER || meta.mode() & 0o7777 != 0o500 {
                return Ok(Some(format!("directory not sealed (uid {}, mode {:o})", meta.uid(), meta.mode() & 0o7777)));
            }
            let socket = agent_socket(&dir.join(SOCKET_NAME))?;
            let found = format!("{}:{}", socket.dev(), socket.ino());
            Ok((record.trim() != found).then(|| format!("socket {found} is not the recorded {}", record.trim())))
        };
        match check() {
            Ok(None) => SocketCheck::Sealed,
            Ok(Some(problem)) => SocketCheck::Tampered(problem),
            Err(e) => SocketCheck::Tampered(e.to_string()),
        }
    }

    /// Removes a sandbox's socket directory (gone already is fine).
    pub fn remove_run_dir(&self, sandbox: &str) {
        let _ = fs::remove_file(self.socket_record(sandbox));
        let dir = self.run_dir(sandbox);
        if let Err(e) = fs::remove_dir_all(&dir)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %dir.display(), error = %e, "remove a sandbox's socket directory");
        }
    }
}

/// The owner of a sealed socket directory: a uid no sandbox runs as (the config refuses it as
/// a template's user), so no sandbox process owns the directory and may change its mode.
pub(crate) const SEALED_OWNER: u32 = config::SEALED_UID;

/// The agent's socket at `path`: a socket root made, not a link or a file planted in its place.
fn agent_socket(path: &Path) -> io::Result<fs::Metadata> {
    let meta = fs::symlink_metadata(path)?;
    if !meta.file_type().is_socket() || meta.uid() != 0 {
        return Err(io::Error::other(format!("{} is not a socket of root's", path.display())));
    }
    Ok(meta)
}

/// What a node finds of a sandbox's socket when it takes the sandbox back after a restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SocketCheck {
    /// The socket this node recorded, in its sealed directory: dial it.
    Sealed,
    /// No record: a sandbox from a build that did not seal. Dial it only if root serves it
    /// (`Link::connect_socket` checks the peer), then seal it.
    Unsealed,
    /// Not the recorded socket, or the directory was changed: never dial it.
    Tampered(String),
}

/// Installs the agent (`dir/sandpool-agent-<hash>`) and the Python runtime
/// (`dir/python/sandpool_runtime.py`), and makes the sockets' directory (`dir/../run`).
pub(crate) fn install_all(dir: &Path) -> io::Result<AgentFiles> {
    let agent = install(dir)?;
    let python = dir.join("python");
    install_file(&python, "sandpool_runtime.py", PYTHON_RUNTIME, 0o444)?;
    let run = dir.parent().unwrap_or(dir).join("run");
    fs::create_dir_all(&run)?;
    fs::set_permissions(&run, Permissions::from_mode(0o700))?;
    Ok(AgentFiles { agent, python, run })
}

/// Writes the agent to `dir/file_name()` (mode 0555) unless an identical copy is there, and
/// returns its path.
pub(crate) fn install(dir: &Path) -> io::Result<PathBuf> {
    install_file(dir, file_name(), AGENT_BIN, 0o555)
}

/// Writes `bytes` to `dir/name` with `mode` unless an identical copy is there. The new copy is
/// written to a temp file and renamed into place, so concurrent installers never expose a
/// partial file, and containers that already bind-mount the old file keep the inode they
/// mounted.
fn install_file(dir: &Path, name: &str, bytes: &[u8], mode: u32) -> io::Result<PathBuf> {
    let path = dir.join(name);
    if is_current(&path, bytes, mode)? {
        return Ok(path);
    }
    fs::create_dir_all(dir)?;
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(".{name}.{}.{nanos}.{}.tmp", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).mode(0o700).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        f.set_permissions(Permissions::from_mode(mode))?;
        fs::rename(&tmp, &path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map(|()| path)
}

/// Whether `path` holds exactly `bytes` with `mode`.
fn is_current(path: &Path, bytes: &[u8], mode: u32) -> io::Result<bool> {
    let meta = match fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if !meta.is_file() || meta.len() != bytes.len() as u64 || meta.permissions().mode() & 0o7777 != mode {
        return Ok(false);
    }
    Ok(fs::read(path)? == bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installs_once_and_repairs_a_changed_copy() {
        let dir = std::env::temp_dir().join(format!("sandpool-agent-bin-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let path = install(&dir.join("bin")).unwrap();
        assert_eq!(fs::read(&path).unwrap(), AGENT_BIN);
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o7777, 0o555);
        let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).unwrap());
        let first = inode(&path);
        assert_eq!(install(&dir.join("bin")).unwrap(), path);
        assert_eq!(inode(&path), first, "an identical copy is left alone");

        fs::set_permissions(&path, Permissions::from_mode(0o755)).unwrap();
        fs::write(&path, b"stale").unwrap();
        install(&dir.join("bin")).unwrap();
        assert_eq!(fs::read(&path).unwrap(), AGENT_BIN);
        let names: Vec<_> = fs::read_dir(dir.join("bin")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [file_name()], "no temp files left");
        assert!(file_name().starts_with("sandpool-agent-") && file_name().len() == FILE_NAME.len() + 17);
        let _ = fs::remove_dir_all(dir);
    }

    #[test]
    fn embedded_agent_is_a_static_executable() {
        let b = AGENT_BIN;
        assert_eq!(&b[..4], b"\x7fELF");
        assert_eq!(b[4], 2, "64-bit ELF");
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
        let phoff = u64::from_le_bytes(b[0x20..0x28].try_into().unwrap()) as usize;
        let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
        // No PT_INTERP (3) program header: no dynamic loader, so it runs in a bare image.
        for i in 0..phnum {
            let at = phoff + i * phentsize;
            let p_type = u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
            assert_ne!(p_type, 3, "the agent asks for a dynamic loader");
        }
    }
}

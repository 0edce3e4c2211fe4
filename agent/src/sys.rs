//! The libc calls std does not wrap for processes: signalling a process group (or a whole
//! session), waiting for children, and a doorbell for `poll` (`Wake`). Terminal calls are in
//! `pty`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::OnceLock;

/// Tenant code's user (`--user`), once set.
static USER: OnceLock<(u32, u32)> = OnceLock::new();

/// Takes on user `uid:gid` for tenant code: `workdir` (unless `/` or a path the platform
/// mounts, `agent_proto::layout`) is created and, while root owns it, given to them; the agent drops its supplementary groups (its file calls, made as
/// the user by `as_user`, must not carry root's); commands are spawned as them (`exec`).
pub fn set_user(uid: u32, gid: u32, workdir: Option<&str>) -> io::Result<()> {
    // A workdir on a path the platform mounts is never given away (the node refuses such
    // templates; this holds even if one slipped through).
    let workdir = workdir.filter(|w| agent_proto::layout::workdir_problem(w).is_none());
    if let Some(w) = workdir.map(Path::new).filter(|w| *w != Path::new("/")) {
        std::fs::create_dir_all(w)?;
        if std::fs::metadata(w)?.uid() == 0 {
            std::os::unix::fs::chown(w, Some(uid), Some(gid))?;
        }
    }
    // SAFETY: an empty list; setgroups reads nothing else.
    if unsafe { libc::setgroups(0, std::ptr::null()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let _ = USER.set((uid, gid));
    Ok(())
}

/// How much sooner than the agent the kernel's OOM killer takes tenant code: every command
/// starts at this `oom_score_adj`, set in the child before its exec (and what it starts
/// inherits it), while the agent keeps its own (it may not go lower: it has no `CAP_SYS_RESOURCE`). A fork bomb that fills the
/// sandbox's memory then loses its own processes, never the agent, which would end the session.
pub const TENANT_OOM_SCORE_ADJ: i32 = 1000;

/// Runs `f` as the user (when there is one): this thread's effective ids become theirs, so what
/// `f` opens, creates, renames or removes is checked and owned as theirs; then root again (the
/// saved ids are root's, so that is allowed). Per thread: raw system calls, since libc's
/// wrappers change every thread of the process, and the agent's others stay root. (Not
/// `setfsuid`, which gVisor does not implement.) Fails without running `f` if the ids cannot
/// be taken; a thread that cannot return to root ends the agent (it could no longer spawn).
pub fn as_user<T>(f: impl FnOnce() -> T) -> io::Result<T> {
    let Some(&(uid, gid)) = USER.get() else { return Ok(f()) };
    set_effective(gid, uid)?;
    let out = f();
    if let Err(e) = set_effective(0, 0) {
        crate::basics::log(&format!("cannot take back root after a file call: {e}"));
        std::process::exit(1);
    }
    Ok(out)
}

/// This thread's effective gid and uid (in the order each change is allowed in).
fn set_effective(gid: u32, uid: u32) -> io::Result<()> {
    let keep = -1i64 as libc::c_long;
    // SAFETY: system calls on integers only.
    let set = |nr: libc::c_long, id: u32| unsafe { libc::syscall(nr, keep, id as libc::c_long, keep) };
    let rc = if uid != 0 {
        if set(libc::SYS_setresgid, gid) == 0 { set(libc::SYS_setresuid, uid) } else { -1 }
    } else if set(libc::SYS_setresuid, uid) == 0 {
        set(libc::SYS_setresgid, gid)
    } else {
        -1
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// A pipe, both ends close-on-exec: (read end, write end).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut ends = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array, and only that.
    if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both are fresh descriptors owned from here on.
    Ok(unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) })
}

/// A doorbell one thread `poll`s beside its other descriptors and any thread rings: an
/// eventfd, non-blocking, close-on-exec.
pub struct Wake(OwnedFd);

impl Wake {
    pub fn new() -> io::Result<Wake> {
        // SAFETY: creates a descriptor; no memory is passed.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor owned from here on.
        Ok(Wake(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn ring(&self) {
        // SAFETY: writes the 8 bytes of a live local. It can only fail once the counter is
        // near 2^64, when the bell is ringing anyway.
        unsafe { libc::write(self.0.as_raw_fd(), (&1u64 as *const u64).cast(), 8) };
    }

    /// Silences the bell: the next `poll` waits for a new ring.
    pub fn clear(&self) {
        let mut n = 0u64;
        // SAFETY: reads 8 bytes into a live local; EAGAIN (not rung) leaves it alone.
        unsafe { libc::read(self.0.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
    }

    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// The inode of open file `fd` (a pipe's identifies it in `/proc/*/fd` links).
pub fn inode(fd: i32) -> Option<u64> {
    // SAFETY: `fstat` writes into the zeroed struct we own, and only that.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st.st_ino)
}

/// Processes other than the agent holding one of these pipes open (by `/proc/PID/fd`). The
/// agent holds their read ends itself: it is left out by its pid, PID 1 in a sandbox but any
/// pid where it runs as a plain process (its tests).
pub fn pipe_holders(inodes: &[u64]) -> Vec<i32> {
    if inodes.is_empty() {
        return Vec::new();
    }
    let links: Vec<String> = inodes.iter().map(|i| format!("pipe:[{i}]")).collect();
    let me = std::process::id() as i32;
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return out };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<i32>().ok()).filter(|&p| p > 1 && p != me) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { continue };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|l| links.iter().any(|want| l.as_os_str() == want.as_str()))
        });
        if holds {
            out.push(pid);
        }
    }
    out
}

/// Sends `sig` to process `pid` (never the agent, never a group).
pub fn kill_pid(pid: i32, sig: i32) -> io::Result<()> {
    if pid <= 1 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "refusing to signal pid <= 1"));
    }
    // SAFETY: `kill` takes only integers and touches no memory of ours.
    if unsafe { libc::kill(pid, sig) } == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Sends `sig` to every process in process group `pgid`.
pub fn kill_group(pgid: i32, sig: i32) -> io::Result<()> {
    // kill(0, ..) and kill(-1, ..) would hit the agent itself or every process it can see.
    if pgid <= 1 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "refusing to signal pgid <= 1"));
    }
    // SAFETY: `kill` takes only integers and touches no memory of ours.
    if unsafe { libc::kill(-pgid, sig) } == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// Sends `sig` to every process group with a member in session `sid` (found in /proc), and to
/// process group `sid` (the session leader's) even if /proc cannot be read. A shell with job
/// control runs each job in a group of its own, so this is how to reach all of a terminal's
/// processes. Processes that started a session of their own are not reached; a process
/// forked while the scan runs may be missed. Ok if at least one group got the signal.
pub fn kill_session(sid: i32, sig: i32) -> io::Result<()> {
    // Session 0 holds the kernel's threads, session 1 is the agent's own as PID 1.
    if sid <= 1 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "refusing to signal session <= 1"));
    }
    let mut groups = vec![sid];
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().filter(|s| s.bytes().all(|b| b.is_ascii_digit())) else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
            if let Some((pgrp, session)) = group_and_session(&stat)
                && session == sid
                && !groups.contains(&pgrp)
            {
                groups.push(pgrp);
            }
        }
    }
    let mut first_err = None;
    let mut hit = false;
    for pgrp in groups {
        match kill_group(pgrp, sig) {
            Ok(()) => hit = true,
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match first_err {
        Some(e) if !hit => Err(e),
        _ => Ok(()),
    }
}

/// The process group and session ids in the text of a `/proc/<pid>/stat` file.
fn group_and_session(stat: &str) -> Option<(i32, i32)> {
    // The command name, in parentheses, may hold anything; the fields after it are: state,
    // ppid, pgrp, session, ...
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(2);
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

fn wait_id(idtype: libc::idtype_t, id: libc::id_t, options: i32) -> io::Result<Option<libc::siginfo_t>> {
    loop {
        // SAFETY: siginfo_t is plain integers (and padding), for which all zeros is valid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a live, writable siginfo_t for the whole call; the kernel writes
        // nothing else.
        let rc = unsafe { libc::waitid(idtype, id, &mut info, options) };
        if rc == 0 {
            // With WNOHANG and no child ready, the call succeeds leaving si_pid zero.
            // SAFETY: the SIGCHLD fields are the ones waitid fills (or leaves zeroed).
            return Ok((unsafe { info.si_pid() } != 0).then_some(info));
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Blocks until some child has exited and returns its pid WITHOUT reaping it (`WNOWAIT`), so
/// the caller can decide, under its own lock, whether to reap it. `ECHILD` if no children.
pub fn wait_exited() -> io::Result<i32> {
    match wait_id(libc::P_ALL, 0, libc::WEXITED | libc::WNOWAIT)? {
        // SAFETY: a siginfo_t from waitid holds the SIGCHLD fields.
        Some(info) => Ok(unsafe { info.si_pid() }),
        None => Err(io::Error::other("waitid returned no child")),
    }
}

/// Reaps child `pid` if it has exited; returns its shell-style exit code (128 + signal for a
/// signal death). `Ok(None)` if it is still running; `ECHILD` if it is not (or no longer) ours.
pub fn reap(pid: i32) -> io::Result<Option<i32>> {
    if pid <= 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad pid"));
    }
    Ok(wait_id(libc::P_PID, pid as libc::id_t, libc::WEXITED | libc::WNOHANG)?.map(|info| {
        debug_assert_eq!(info.si_signo, libc::SIGCHLD);
        // SAFETY: a siginfo_t from waitid holds the SIGCHLD fields.
        let status = unsafe { info.si_status() };
        // CLD_EXITED: the child called exit; any other code means a signal ended it.
        if info.si_code == libc::CLD_EXITED { status } else { 128 + status }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_group_and_session_from_stat() {
        let stat = "4242 (a) b (c)) S 1 4240 4200 34816 4240 4194304 102 0 0 0";
        assert_eq!(group_and_session(stat), Some((4240, 4200)));
        assert_eq!(group_and_session("12 (x) S 1"), None);
        let own = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(group_and_session(&own).is_some(), "{own}");
    }

    #[test]
    fn refuses_to_signal_everything() {
        assert!(kill_group(0, 0).is_err());
        assert!(kill_group(-1, 0).is_err());
        assert!(kill_group(1, 0).is_err());
        assert!(kill_session(0, 0).is_err());
        assert!(kill_session(1, 0).is_err());
    }

    #[test]
    #[expect(clippy::zombie_processes, reason = "reap() under test is what waits for them")]
    fn reaps_exit_codes_and_signals() {
        // Only this test's own children are touched: reap() waits for one pid, never P_ALL.
        for (script, want) in [("exit 7", 7), ("kill -9 $$", 137), ("true", 0)] {
            let child = std::process::Command::new("sh").args(["-c", script]).spawn().unwrap();
            let pid = child.id() as i32;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let code = loop {
                if let Some(code) = reap(pid).unwrap() {
                    break code;
                }
                assert!(std::time::Instant::now() < deadline, "child {pid} did not exit");
                std::thread::sleep(std::time::Duration::from_millis(5));
            };
            assert_eq!(code, want, "{script}");
            assert_eq!(reap(pid).unwrap_err().raw_os_error(), Some(libc::ECHILD));
        }
    }
}

//! The libc calls std does not wrap for processes: signalling a process group (or a whole
//! session) and waiting for children. Terminal calls are in `pty`.
//!
//! Declared by hand because the agent has no dependencies (it must link statically and run in
//! any image). Constants are Linux's, the same on every architecture we build for.

use std::io;

/// `idtype_t` values for `waitid`.
const P_ALL: i32 = 0;
const P_PID: i32 = 1;
/// `waitid` options.
const WNOHANG: i32 = 1;
const WEXITED: i32 = 4;
const WNOWAIT: i32 = 0x0100_0000;
/// `si_code` of a child that called `exit`; the other exit codes mean killed by a signal.
const CLD_EXITED: i32 = 1;
/// `errno` when the caller has no children to wait for.
pub const ECHILD: i32 = 10;
pub const SIGHUP: i32 = 1;
pub const SIGKILL: i32 = 9;

/// `siginfo_t` as `waitid` fills it on Linux (128 bytes; only the SIGCHLD fields are named).
#[repr(C, align(8))]
struct SigInfo {
    signo: i32,
    errno: i32,
    code: i32,
    _pad: i32,
    pid: i32,
    uid: u32,
    status: i32,
    _rest: [i32; 25],
}

unsafe extern "C" {
    // `kill` takes only integers and touches no memory of ours, so it is safe to call.
    safe fn kill(pid: i32, sig: i32) -> i32;
    fn waitid(idtype: i32, id: u32, infop: *mut SigInfo, options: i32) -> i32;
}

/// Sends `sig` to every process in process group `pgid`.
pub fn kill_group(pgid: i32, sig: i32) -> io::Result<()> {
    // kill(0, ..) and kill(-1, ..) would hit the agent itself or every process it can see.
    if pgid <= 1 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "refusing to signal pgid <= 1"));
    }
    if kill(-pgid, sig) == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
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

fn wait_id(idtype: i32, id: u32, options: i32) -> io::Result<Option<SigInfo>> {
    loop {
        let mut info = SigInfo { signo: 0, errno: 0, code: 0, _pad: 0, pid: 0, uid: 0, status: 0, _rest: [0; 25] };
        // SAFETY: `info` is a live, writable buffer the size of the kernel's siginfo_t (128
        // bytes on Linux) for the whole call; the kernel writes nothing else.
        let rc = unsafe { waitid(idtype, id, &mut info, options) };
        if rc == 0 {
            // With WNOHANG and no child ready, the call succeeds leaving si_pid zero.
            return Ok((info.pid != 0).then_some(info));
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
    match wait_id(P_ALL, 0, WEXITED | WNOWAIT)? {
        Some(info) => Ok(info.pid),
        None => Err(io::Error::other("waitid returned no child")),
    }
}

/// Reaps child `pid` if it has exited; returns its shell-style exit code (128 + signal for a
/// signal death). `Ok(None)` if it is still running; `ECHILD` if it is not (or no longer) ours.
pub fn reap(pid: i32) -> io::Result<Option<i32>> {
    if pid <= 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad pid"));
    }
    Ok(wait_id(P_PID, pid as u32, WEXITED | WNOHANG)?.map(|info| {
        debug_assert_eq!(info.signo, 17); // SIGCHLD
        if info.code == CLD_EXITED { info.status } else { 128 + info.status }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siginfo_has_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<SigInfo>(), 128);
        assert_eq!(std::mem::offset_of!(SigInfo, pid), 16);
        assert_eq!(std::mem::offset_of!(SigInfo, status), 24);
    }

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
            assert_eq!(reap(pid).unwrap_err().raw_os_error(), Some(ECHILD));
        }
    }
}

//! Starting a command without copying the agent: `clone(CLONE_VM | CLONE_VFORK)`, the way
//! `posix_spawn` starts one, with the steps `posix_spawn` cannot take (the user switch, a new
//! session with a controlling terminal, the tenant's OOM score) done in the child.
//!
//! Why not std's `Command`: it forks whenever a uid, a working directory or a `pre_exec` hook
//! is set, which is every command of a non-root template, and a fork copies the agent's page
//! tables and then takes copy-on-write faults on both sides; that was the largest part of
//! what an `exec true` cost the sandbox (see BENCHMARKS.md, "Sandbox CPU per exec"). The
//! child here shares the agent's memory and runs until its `execve` while the calling thread
//! waits (`CLONE_VFORK`), so everything it needs is prepared by the parent beforehand, and
//! the child itself only makes system calls: no allocation, no lock, no libc wrapper that
//! acts on every thread (glibc's `setuid` would signal the agent's threads, hence raw
//! `setresuid`).

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicI32, Ordering};

/// The child's stack (it runs a few system calls and no Rust beyond this module).
const CHILD_STACK: usize = 64 * 1024;

/// How the child joins a process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// A process group of its own (its pid is the group id).
    Own,
    /// A session of its own with fd 0 (a terminal's slave) as controlling terminal; it leads
    /// the session and its group.
    Terminal,
}

/// A command, ready to start: every string already NUL-terminated, so the child allocates
/// nothing.
pub struct Spawn {
    /// Where to look for the program, in order (one path if it contains a `/`, else one per
    /// `PATH` entry, as `execvp` would).
    candidates: Vec<CString>,
    argv: Vec<CString>,
    envp: Vec<CString>,
    cwd: Option<CString>,
    /// Descriptors to become the child's 0, 1 and 2.
    stdio: [RawFd; 3],
    /// A descriptor the command inherits (its close-on-exec flag is cleared in the child).
    inherit: Option<RawFd>,
    group: Group,
    /// (uid, gid) to run as, supplementary groups dropped.
    user: Option<(u32, u32)>,
    /// `oom_score_adj` for the command, as text.
    oom_score_adj: Option<CString>,
}

/// The errno of the step that stopped the child, 0 if none did: read by the parent once the
/// child has exec'd or exited (it shares this memory).
struct Failure {
    errno: AtomicI32,
}

impl Spawn {
    /// `argv[0]` is looked up in `path` (the command's `PATH`) unless it holds a `/`.
    pub fn new(
        argv: &[&OsStr],
        path: &OsStr,
        env: impl IntoIterator<Item = (impl AsRef<OsStr>, impl AsRef<OsStr>)>,
    ) -> io::Result<Spawn> {
        let program = argv.first().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "argv is empty"))?;
        let candidates = if program.as_bytes().contains(&b'/') {
            vec![cstring(program.as_bytes())?]
        } else {
            path.as_bytes()
                .split(|&b| b == b':')
                // An empty entry means the current directory, as for execvp.
                .map(|dir| if dir.is_empty() { &b"."[..] } else { dir })
                .map(|dir| {
                    let mut full = dir.to_vec();
                    full.push(b'/');
                    full.extend_from_slice(program.as_bytes());
                    cstring(&full)
                })
                .collect::<io::Result<_>>()?
        };
        let argv = argv.iter().map(|a| cstring(a.as_bytes())).collect::<io::Result<_>>()?;
        let envp = env
            .into_iter()
            .map(|(k, v)| {
                let mut kv = k.as_ref().as_bytes().to_vec();
                kv.push(b'=');
                kv.extend_from_slice(v.as_ref().as_bytes());
                cstring(&kv)
            })
            .collect::<io::Result<_>>()?;
        Ok(Spawn {
            candidates,
            argv,
            envp,
            cwd: None,
            stdio: [0, 1, 2],
            inherit: None,
            group: Group::Own,
            user: None,
            oom_score_adj: None,
        })
    }

    pub fn cwd(&mut self, dir: &str) -> io::Result<&mut Self> {
        self.cwd = Some(cstring(dir.as_bytes())?);
        Ok(self)
    }

    pub fn stdio(&mut self, fds: [RawFd; 3]) -> &mut Self {
        self.stdio = fds;
        self
    }

    pub fn inherit(&mut self, fd: RawFd) -> &mut Self {
        self.inherit = Some(fd);
        self
    }

    pub fn group(&mut self, group: Group) -> &mut Self {
        self.group = group;
        self
    }

    pub fn user(&mut self, uid: u32, gid: u32) -> &mut Self {
        self.user = Some((uid, gid));
        self
    }

    pub fn oom_score_adj(&mut self, adj: i32) -> &mut Self {
        self.oom_score_adj = CString::new(adj.to_string()).ok();
        self
    }

    /// Starts the command; its pid. An error means nothing ran: the errno of the step that
    /// failed (a missing program is `ENOENT`, a missing working directory too); the failed
    /// child is reaped before this returns.
    pub fn spawn(&self) -> io::Result<i32> {
        let argv = nul_terminated(&self.argv);
        let envp = nul_terminated(&self.envp);
        let candidates = nul_terminated(&self.candidates);
        let failure = Failure { errno: AtomicI32::new(0) };
        let child = Child { spawn: self, argv: &argv, envp: &envp, candidates: &candidates, failure: &failure };
        let mut stack = vec![0u8; CHILD_STACK];
        // Blocking every signal in this thread keeps the agent's handlers from running in the
        // child (which shares this memory) before it has set the command's mask; this
        // thread's mask is restored right after.
        // SAFETY: a sigset_t is plain integers, for which all zeros is valid.
        let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: both sets are live locals the calls write into.
        unsafe {
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        }
        let child = ChildWithMask { child, mask: old };
        // The stack grows down on every platform this runs on; 16-byte aligned top.
        let top = (stack.as_mut_ptr() as usize + CHILD_STACK) & !15;
        // SAFETY: `top` is the aligned end of a live buffer that outlives the child's use of
        // it: with CLONE_VFORK this call returns only once the child has exec'd or exited.
        // `child_main` only reads `child`, which lives on this frame until then.
        let pid = unsafe {
            libc::clone(
                child_main,
                top as *mut libc::c_void,
                libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                &child as *const ChildWithMask as *mut libc::c_void,
            )
        };
        let clone_err = io::Error::last_os_error();
        // SAFETY: restores the mask saved above.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &child.mask, std::ptr::null_mut()) };
        drop(stack);
        if pid < 0 {
            return Err(clone_err);
        }
        match failure.errno.load(Ordering::Acquire) {
            0 => Ok(pid),
            errno => {
                // The child has exited (CLONE_VFORK returned): reap it here, so no caller
                // has to know of a pid that never ran anything. A reaper peeking at children
                // meanwhile finds it gone, which it must handle anyway.
                // SAFETY: waits for this child only, into no memory of ours.
                unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
                Err(io::Error::from_raw_os_error(errno))
            }
        }
    }
}

fn cstring(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "nul byte found in a string"))
}

fn nul_terminated(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings.iter().map(|s| s.as_ptr()).chain(std::iter::once(std::ptr::null())).collect()
}

struct Child<'a> {
    spawn: &'a Spawn,
    argv: &'a [*const libc::c_char],
    envp: &'a [*const libc::c_char],
    candidates: &'a [*const libc::c_char],
    failure: &'a Failure,
}

struct ChildWithMask<'a> {
    child: Child<'a>,
    /// The parent thread's signal mask, which the command starts with.
    mask: libc::sigset_t,
}

/// The child, between `clone` and `execve`. System calls only (see the module doc).
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildWithMask` on the parent's frame, alive while we run.
    let ChildWithMask { child, mask } = unsafe { &*(arg as *const ChildWithMask) };
    let errno = match prepare(child.spawn) {
        Err(errno) => errno,
        Ok(()) => {
            // SAFETY: plain system calls on live, NUL-terminated arrays.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, mask, std::ptr::null_mut()) };
            exec(child)
        }
    };
    child.failure.errno.store(errno, Ordering::Release);
    // SAFETY: ends this child only (it is not a thread of the agent's group).
    unsafe { libc::_exit(127) }
}

fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

fn check(rc: libc::c_long) -> Result<(), i32> {
    if rc < 0 { Err(errno()) } else { Ok(()) }
}

/// Every step before `execve`, in std's order: descriptors, user, working directory.
fn prepare(s: &Spawn) -> Result<(), i32> {
    // SAFETY: each call is one system call on integers or on live NUL-terminated strings.
    unsafe {
        // Ignored signals stay ignored across exec; the agent ignores SIGPIPE (std does), a
        // command must not inherit that.
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        match s.group {
            Group::Own => check(libc::setpgid(0, 0).into())?,
            Group::Terminal => check(libc::setsid().into())?,
        }
        for (target, &fd) in s.stdio.iter().enumerate() {
            let target = target as RawFd;
            if fd == target {
                check(libc::fcntl(fd, libc::F_SETFD, 0).into())?;
            } else {
                check(libc::dup2(fd, target).into())?;
            }
        }
        if s.group == Group::Terminal {
            // 0: do not steal the terminal from another session.
            check(libc::ioctl(0, libc::TIOCSCTTY, 0 as libc::c_int).into())?;
        }
        if let Some(fd) = s.inherit {
            check(libc::fcntl(fd, libc::F_SETFD, 0).into())?;
        }
        if let Some(adj) = &s.oom_score_adj {
            // Best effort: if /proc refuses, the command keeps the agent's score.
            let fd = libc::open(c"/proc/self/oom_score_adj".as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd >= 0 {
                libc::write(fd, adj.as_ptr().cast(), adj.as_bytes().len());
                libc::close(fd);
            }
        }
        if let Some((uid, gid)) = s.user {
            // Raw calls: this child alone changes ids, not the agent's other threads. A
            // refusal to drop supplementary groups (no CAP_SETGID) is not fatal, as for std.
            let rc = libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>());
            if rc < 0 && errno() != libc::EPERM {
                return Err(errno());
            }
            check(libc::syscall(libc::SYS_setresgid, gid, gid, gid))?;
            check(libc::syscall(libc::SYS_setresuid, uid, uid, uid))?;
        }
        if let Some(dir) = &s.cwd {
            check(libc::chdir(dir.as_ptr()).into())?;
        }
    }
    Ok(())
}

/// Tries each candidate as `execvp` does: a missing or unreadable entry moves on, any other
/// failure stops; returns the errno to report (`EACCES` if one candidate refused so, else the
/// last).
fn exec(child: &Child) -> i32 {
    let mut denied = false;
    let mut last = libc::ENOENT;
    for &path in child.candidates.iter().take_while(|p| !p.is_null()) {
        // SAFETY: live NUL-terminated strings and NULL-terminated arrays of them.
        unsafe { libc::execve(path, child.argv.as_ptr(), child.envp.as_ptr()) };
        last = errno();
        match last {
            libc::EACCES => denied = true,
            libc::ENOENT
            | libc::ENOTDIR
            | libc::ENAMETOOLONG
            | libc::ELOOP
            | libc::ESTALE
            | libc::ENODEV
            | libc::ETIMEDOUT => {}
            _ => return last,
        }
    }
    if denied { libc::EACCES } else { last }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    fn pipe() -> (std::fs::File, OwnedFd) {
        let mut ends = [0; 2];
        // SAFETY: pipe2 writes two descriptors into the array.
        assert_eq!(unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both are fresh descriptors owned from here on.
        unsafe { (std::fs::File::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) }
    }

    fn wait(pid: i32) -> i32 {
        let mut status = 0;
        // SAFETY: waits for our own child, writing into a live local.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        libc::WEXITSTATUS(status)
    }

    fn run(argv: &[&str], env: &[(&str, &str)], cwd: Option<&str>) -> io::Result<(String, i32)> {
        let argv: Vec<&OsStr> = argv.iter().map(OsStr::new).collect();
        let mut s = Spawn::new(&argv, OsStr::new("/usr/bin:/bin"), env.iter().copied())?;
        if let Some(dir) = cwd {
            s.cwd(dir)?;
        }
        let (mut out, w) = pipe();
        let devnull = std::fs::File::open("/dev/null").unwrap();
        s.stdio([devnull.as_raw_fd(), w.as_raw_fd(), w.as_raw_fd()]).oom_score_adj(1000);
        let pid = s.spawn();
        drop(w);
        let pid = pid?;
        let mut text = String::new();
        out.read_to_string(&mut text).unwrap();
        Ok((text, wait(pid)))
    }

    #[test]
    fn runs_with_its_own_environment_directory_group_and_oom_score() {
        // Field 5 of /proc/PID/stat is the process group.
        let script = "echo $A:$(pwd):$(cat /proc/self/oom_score_adj); [ $(cut -d' ' -f5 /proc/$$/stat) = $$ ] && echo leader; exit 3";
        let (out, code) = run(&["sh", "-c", script], &[("A", "b"), ("PATH", "/usr/bin:/bin")], Some("/tmp")).unwrap();
        assert_eq!(code, 3, "{out}");
        assert!(out.starts_with("b:/tmp:1000\n"), "{out}");
        assert!(out.contains("leader"), "{out}");
    }

    #[test]
    fn reports_what_stopped_the_exec() {
        let err = run(&["no-such-program-57"], &[], None).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
        let err = run(&["true"], &[], Some("/no/such/dir")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
        let err = run(&["/etc/passwd"], &[], None).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EACCES));
    }
}

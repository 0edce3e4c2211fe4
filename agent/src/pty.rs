//! Pseudo-terminals: allocating a master/slave pair, sizing it, making the slave a child's
//! controlling terminal, and asking which process group is in its foreground.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

fn check(rc: i32) -> io::Result<i32> {
    if rc == -1 { Err(io::Error::last_os_error()) } else { Ok(rc) }
}

/// A fresh pseudo-terminal: the master, which the agent keeps, and the slave, which becomes
/// the command's stdin, stdout, stderr and controlling terminal.
pub struct Pty {
    pub master: File,
    /// Becomes the command's stdin, stdout and stderr, and (`spawn::Group::Terminal`) its
    /// controlling terminal. Once the command has started, the agent drops its copies, so
    /// reading the master fails with EIO as soon as the command and its children have all
    /// closed theirs.
    pub slave: OwnedFd,
}

impl Pty {
    /// Opens a new pseudo-terminal of `rows` x `cols` cells. Both ends are close-on-exec (std
    /// opens everything so), so no other command inherits them.
    pub fn open(rows: u16, cols: u16) -> io::Result<Pty> {
        let master = OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOCTTY).open("/dev/ptmx")?;
        let fd = master.as_raw_fd();
        let unlock: libc::c_int = 0;
        let mut n: libc::c_uint = 0;
        // SAFETY: `fd` is an open descriptor we own; TIOCSPTLCK reads one int through the
        // pointer and TIOCGPTN writes one unsigned int through it, both to live locals.
        unsafe {
            check(libc::ioctl(fd, libc::TIOCSPTLCK, &unlock as *const libc::c_int))?;
            check(libc::ioctl(fd, libc::TIOCGPTN, &mut n as *mut libc::c_uint))?;
        }
        // The devpts instance of /dev/ptmx is the one mounted on /dev/pts (Linux >= 4.7 looks
        // it up next to the ptmx node; Docker's /dev/ptmx is a link to pts/ptmx).
        let slave = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOCTTY)
            .open(format!("/dev/pts/{n}"))?
            .into();
        resize(&master, rows, cols)?;
        Ok(Pty { master, slave })
    }
}

/// Sets the size of the terminal whose master (or slave) is `term`. If the size changed, the
/// kernel sends `SIGWINCH` to its foreground process group.
pub fn resize(term: &File, rows: u16, cols: u16) -> io::Result<()> {
    let size = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCSWINSZ reads one `struct winsize` through the pointer, from a live local.
    check(unsafe { libc::ioctl(term.as_raw_fd(), libc::TIOCSWINSZ, &size as *const libc::winsize) }).map(drop)
}

/// The foreground process group of the terminal whose master is `master`.
pub fn foreground_group(master: &File) -> io::Result<i32> {
    let mut pgrp: libc::pid_t = 0;
    // SAFETY: TIOCGPGRP writes one pid_t through the pointer, to a live local.
    check(unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPGRP, &mut pgrp as *mut libc::pid_t) })?;
    Ok(pgrp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_a_sized_terminal() {
        use crate::spawn::{Group, Spawn};
        use std::ffi::OsStr;
        let Pty { master, slave } = Pty::open(33, 101).unwrap();
        let fd = slave.as_raw_fd();
        let mut cmd =
            Spawn::new(&[OsStr::new("stty"), OsStr::new("size")], OsStr::new("/usr/bin:/bin"), [("A", "b")]).unwrap();
        cmd.stdio([fd, fd, fd]).group(Group::Terminal);
        let pid = cmd.spawn().unwrap();
        drop(slave);
        let mut out = Vec::new();
        let mut buf = [0u8; 256];
        // EIO once stty exited and closed the slave.
        while let Ok(n @ 1..) = io::Read::read(&mut &master, &mut buf) {
            out.extend_from_slice(&buf[..n]);
        }
        let mut status = 0;
        // SAFETY: waits for our own child, into a live local.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(status, 0);
        assert_eq!(String::from_utf8_lossy(&out), "33 101\r\n");
    }
}

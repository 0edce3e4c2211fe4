//! PID 1's reaper: one thread collects every child that exits, publishes the exit codes of the
//! commands the agent started (ringing each one's `Wake`, which its command thread polls beside
//! its output), and silently reaps orphans re-parented to PID 1.
//!
//! The reaper peeks at an exited child with `waitid(P_ALL, WNOWAIT)` and only reaps it under
//! the state lock, which `spawn` also holds. That closes two races at once:
//! - a command that exits before its pid is registered: by the time the reaper holds the lock,
//!   the spawn that created it has registered the pid;
//! - a spawn's own reaping: when a command cannot start (no such program), `Spawn::spawn`
//!   reaps the failed child itself, under the lock; with the peek, the reaper's own reap then
//!   finds nothing, instead of a plain `waitpid(-1)` taking a child its spawner waits for.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::basics::{lock, log, spawn_thread};
use crate::spawn::Spawn;
use crate::sys::{self, Wake};

/// How a command the agent started ended.
#[derive(Debug, Clone, Copy)]
pub struct Exited {
    /// Shell-style: the exit status, or 128 + signal number.
    pub code: i32,
    /// When the reaper collected it.
    pub at: Instant,
}

/// A command the agent started, until its command thread takes its exit.
struct Child {
    /// `None` while it runs.
    exited: Option<Exited>,
    /// Rung when it exits.
    wake: Arc<Wake>,
}

#[derive(Default)]
struct State {
    /// Commands started by `spawn` and not yet taken by `exited` or `forget`.
    children: HashMap<i32, Child>,
    /// Bumped by every spawn, so a reaper with no children knows when to look again.
    spawns: u64,
}

#[derive(Default)]
pub struct Reaper {
    state: Mutex<State>,
    /// Signalled when a child is spawned (for a reaper that had none).
    spawned: Condvar,
}

impl Reaper {
    /// Starts the reaper thread; it runs for the life of the process.
    pub fn start(self: &Arc<Self>) -> io::Result<()> {
        let me = Arc::clone(self);
        spawn_thread("reaper", move || me.run())
    }

    /// Spawns `cmd` and registers its pid, so its exit status is kept for `exited`; `wake` is
    /// rung when it exits.
    pub fn spawn(&self, cmd: &Spawn, wake: Arc<Wake>) -> io::Result<i32> {
        let mut st = lock(&self.state);
        let pid = cmd.spawn()?;
        st.children.insert(pid, Child { exited: None, wake });
        st.spawns += 1;
        drop(st);
        self.spawned.notify_all();
        Ok(pid)
    }

    /// How child `pid` (started by `spawn`) ended, once it has: taken, so asked only once.
    pub fn exited(&self, pid: i32) -> Option<Exited> {
        let mut st = lock(&self.state);
        let exited = st.children.get(&pid)?.exited?;
        st.children.remove(&pid);
        Some(exited)
    }

    /// Stops tracking `pid`: its exit status, whenever it comes, is discarded.
    pub fn forget(&self, pid: i32) {
        lock(&self.state).children.remove(&pid);
    }

    fn run(&self) {
        loop {
            let spawns = lock(&self.state).spawns;
            match sys::wait_exited() {
                Ok(pid) => {
                    let mut st = lock(&self.state);
                    // Ok(None) or ECHILD: a spawn reaped its own failed child while we waited for
                    // the lock (see the module doc). Nothing to do.
                    if let Ok(Some(code)) = sys::reap(pid)
                        && let Some(child) = st.children.get_mut(&pid)
                    {
                        child.exited = Some(Exited { code, at: Instant::now() });
                        child.wake.ring();
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::ECHILD) => {
                    // No children at all: sleep until a spawn makes one.
                    let mut st = lock(&self.state);
                    while st.spawns == spawns {
                        st = self.spawned.wait(st).unwrap_or_else(|e| e.into_inner());
                    }
                }
                Err(e) => {
                    log(&format!("waitid failed: {e}"));
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}

//! The agent's basic utilities, used by every other room: a log line, a lock that survives
//! poisoning, and threads with the agent's small stack.

use std::io::{self, Write};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Stack size of every thread the agent starts. They only shuffle buffers that live on the
/// heap, so a small stack keeps 64 concurrent execs (~200 threads) cheap.
pub const THREAD_STACK: usize = 128 * 1024;

/// Writes one terse line to stderr (never panics, unlike `eprintln!`).
pub fn log(msg: &str) {
    let _ = writeln!(io::stderr(), "sandpool-agent: {msg}");
}

/// Locks a mutex, ignoring poisoning (the agent never unwinds with a lock held on purpose).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Starts a named thread with the agent's small stack.
pub fn spawn_thread(name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<()> {
    std::thread::Builder::new().name(name.into()).stack_size(THREAD_STACK).spawn(f).map(drop)
}

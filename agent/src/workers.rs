//! Threads for per-request work (an exec's pump, a stdin feeder, a file read), kept after
//! their work is done and reused: starting a thread (clone, a stack mapped, guard page, TLS)
//! cost more of the sandbox's CPU than the `exec true` it served (BENCHMARKS.md, "Sandbox
//! CPU per exec"). A thread idle for `IDLE_KEEP` ends, so a burst leaves no crowd behind.

use std::collections::VecDeque;
use std::io;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crate::basics::{THREAD_STACK, lock};

/// How long a finished worker waits for more work before it ends.
const IDLE_KEEP: Duration = Duration::from_secs(10);

type Work = Box<dyn FnOnce() + Send + 'static>;

struct Pool {
    state: Mutex<State>,
    /// Signalled when work is queued.
    more: Condvar,
}

struct State {
    queue: VecDeque<Work>,
    /// Workers waiting for work (each takes one queued item).
    idle: usize,
}

static POOL: Pool = Pool { state: Mutex::new(State { queue: VecDeque::new(), idle: 0 }), more: Condvar::new() };

/// Runs `f` on an idle worker, or on a new one if none is free. Fails only if a thread is
/// needed and cannot be started (the sandbox's pids limit, say); `f` is dropped then.
pub fn run(f: impl FnOnce() + Send + 'static) -> io::Result<()> {
    let mut st = lock(&POOL.state);
    if st.idle > st.queue.len() {
        st.queue.push_back(Box::new(f));
        drop(st);
        POOL.more.notify_one();
        return Ok(());
    }
    drop(st);
    std::thread::Builder::new()
        .name("worker".into())
        .stack_size(THREAD_STACK)
        .spawn(move || work(Box::new(f)))
        .map(drop)
}

/// A worker: its first item, then queued ones until idle for `IDLE_KEEP`.
fn work(first: Work) {
    first();
    loop {
        let mut st = lock(&POOL.state);
        st.idle += 1;
        let next = loop {
            if let Some(w) = st.queue.pop_front() {
                break Some(w);
            }
            let (guard, waited) = POOL.more.wait_timeout(st, IDLE_KEEP).unwrap_or_else(|e| e.into_inner());
            st = guard;
            if waited.timed_out() && st.queue.is_empty() {
                break None;
            }
        };
        st.idle -= 1;
        drop(st);
        match next {
            Some(w) => w(),
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn runs_every_item_and_reuses_idle_workers() {
        let (tx, rx) = mpsc::channel();
        for i in 0..50 {
            let tx = tx.clone();
            run(move || tx.send(i).unwrap()).unwrap();
        }
        let mut got: Vec<i32> = (0..50).map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        got.sort();
        assert_eq!(got, (0..50).collect::<Vec<_>>());
        // Once they are idle, sequential items start no thread: the worker count stays put.
        std::thread::sleep(Duration::from_millis(50));
        let idle = lock(&POOL.state).idle;
        assert!(idle >= 1);
        for i in 0..20 {
            let tx = tx.clone();
            run(move || tx.send(i).unwrap()).unwrap();
            rx.recv_timeout(Duration::from_secs(10)).unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(lock(&POOL.state).idle, idle);
    }
}

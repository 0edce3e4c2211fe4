//! What the tests of the `sandpool` binary share: the child process, killed on drop, and a
//! free loopback port for its gateway.

use std::process::Child;

/// The `sandpool` process; killed on drop if it is still running.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port that was free a moment ago (the child binds it right after).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

//! The in-sandbox agent and the protocol the pool-manager speaks to it.
//!
//! The library half is the codec (`proto`), shared with the pool-manager; the binary half
//! (`main.rs`, the `server` module and its helpers) runs as the sandbox's PID 1. `main.rs`
//! declares the same modules itself, because the pool-manager's build script compiles it
//! with a bare `rustc` into a static executable.

pub mod proto;
pub mod server;
pub mod tar;

mod exec;
mod files;
mod pty;
mod reaper;
mod sys;

//! sandpool-agent: PID 1 of a sandbox, serving exec and file requests over its stdio.
//!
//! Built twice: by cargo, and by the pool-manager's build script as a standalone static
//! executable with plain `rustc`. Hence the `mod` lines here instead of `use agent::...`.

// The codec is shared with the host: its host-side half (request encoders, reply decoders)
// is unused in the agent binary.
#![allow(dead_code)]

mod exec;
mod files;
mod proto;
mod pty;
mod reaper;
mod server;
mod sys;
mod tar;

fn main() {
    server::run()
}

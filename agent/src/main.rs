//! sandpool-agent: PID 1 of a sandbox, serving exec and file requests over its stdio.
//!
//! The protocol is the `agent-proto` crate, shared with the pool-manager. The pool-manager's
//! build script builds this binary statically (cargo profile `agent`) and embeds it.

mod archive;
mod basics;
mod ctx;
mod exec;
mod files;
mod out;
mod ports;
mod pty;
mod reaper;
mod server;
mod spawn;
mod sys;
mod workers;

fn main() {
    match server::Options::parse(std::env::args().skip(1)) {
        Ok(opts) => server::run(opts),
        Err(e) => {
            basics::log(&format!("{e}; usage: sandpool-agent [--user UID:GID] [--workdir DIR]"));
            std::process::exit(2);
        }
    }
}

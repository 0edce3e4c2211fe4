//! Integration tests: the agent binary as a child process, spoken to in frames.
//!
//! The agent is not PID 1 here, so its reaper sees only its own children; orphan reaping as
//! PID 1 is exercised by running the static build in a container.

mod exec;
mod files;
mod flow;
mod ports;
mod pty;
mod support;

//! Handler tests: the whole router called with `oneshot`, on the real Redis ledger, with the
//! nodes replaced by a fake `NodeClient` (a trait this crate owns). No Docker, no server.

mod handlers;
mod leaks;
mod quotas;
mod support;

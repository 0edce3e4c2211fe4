//! Observability shared by every sandpool process: the metric catalog (`names`, the one place
//! metric names and their labels are spelled; dashboards and alerts use only these), the
//! Prometheus recorder and its `/metrics` endpoint, the series that start at 0 (`zeros`), and
//! tracing set-up.

pub mod metrics;
pub mod names;
pub mod trace;
pub mod zeros;

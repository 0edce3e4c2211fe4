//! `sandpool quota get|set|rm|verify`: an operator's view of quotas, straight on the ledger
//! (the same scripts the API uses; no token needed, the Redis URL is the credential).

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use config::Config;
use ledger::{Ledger, SetLimits};
use wire::quotas::{QuotaLimits, path_problem};

#[derive(Subcommand)]
pub enum QuotaOp {
    /// Limits and usage of a path and its children (JSON).
    Get {
        path: String,
        /// Leave the children out.
        #[arg(long)]
        no_children: bool,
    },
    /// Sets limits of a path; the dimensions named are changed, the others kept.
    Set {
        path: String,
        #[command(flatten)]
        limits: Box<LimitArgs>,
    },
    /// Removes a path's own limits (its ancestors' and the defaults still bind it).
    Rm { path: String },
    /// Gives back orphaned leases and reports usage drift (JSON); exits 1 on drift.
    Verify {
        /// Replace the counted usage with the recomputed one.
        #[arg(long)]
        fix: bool,
    },
}

#[derive(Args, Default)]
pub struct LimitArgs {
    /// Concurrent sessions.
    #[arg(long)]
    sessions: Option<u64>,
    /// CPUs held by live sessions (their templates' cpus).
    #[arg(long)]
    cpus: Option<f64>,
    /// Memory held by live sessions: "64GiB", "512MiB", or MiB as a plain number.
    #[arg(long, value_parser = parse_memory_mb)]
    memory: Option<u64>,
    /// Session creates: "5/s", "300/m", or per second as a plain number.
    #[arg(long, value_parser = parse_rate)]
    create_rate: Option<f64>,
    /// Creates allowed at once above the rate.
    #[arg(long)]
    burst: Option<u64>,
    /// Create requests waiting in queues.
    #[arg(long)]
    queued: Option<u64>,
    /// Sandboxes held by live reservations.
    #[arg(long)]
    reserved: Option<u64>,
    /// Private templates (snapshots, forks).
    #[arg(long)]
    private_templates: Option<u64>,
    /// Disk held by private templates: "20GiB", or MiB as a plain number.
    #[arg(long, value_parser = parse_memory_mb)]
    private_template_disk: Option<u64>,
    /// Functions defined.
    #[arg(long)]
    functions: Option<u64>,
    /// Asynchronous invocations in flight.
    #[arg(long)]
    async_in_flight: Option<u64>,
    /// Asynchronous invocation records (results) kept.
    #[arg(long)]
    async_results: Option<u64>,
    /// Bytes of the kept asynchronous invocation records: "1GiB", or MiB as a plain number.
    #[arg(long, value_parser = parse_memory_mb)]
    async_result_size: Option<u64>,
    /// Reservation requests whose hold has not ended.
    #[arg(long)]
    reservations: Option<u64>,
    /// Templates named by live reservations.
    #[arg(long)]
    reservation_items: Option<u64>,
    /// Isolation classes (OCI runtimes) the path may use: "runc,runsc".
    #[arg(long, value_delimiter = ',')]
    isolation: Option<Vec<String>>,
}

impl LimitArgs {
    /// `base` with the limits named here replaced.
    fn over(&self, base: QuotaLimits) -> QuotaLimits {
        QuotaLimits {
            sessions: self.sessions.or(base.sessions),
            cpus: self.cpus.or(base.cpus),
            memory_mb: self.memory.or(base.memory_mb),
            create_rate: self.create_rate.or(base.create_rate),
            create_burst: self.burst.or(base.create_burst),
            queued: self.queued.or(base.queued),
            reserved: self.reserved.or(base.reserved),
            private_templates: self.private_templates.or(base.private_templates),
            private_template_mb: self.private_template_disk.or(base.private_template_mb),
            functions: self.functions.or(base.functions),
            async_in_flight: self.async_in_flight.or(base.async_in_flight),
            async_results: self.async_results.or(base.async_results),
            async_result_mb: self.async_result_size.or(base.async_result_mb),
            reservations: self.reservations.or(base.reservations),
            reservation_items: self.reservation_items.or(base.reservation_items),
            isolation: self.isolation.clone().or(base.isolation),
        }
    }
}

/// "64GiB", "1.5GiB", "512MiB", "512M", "2G", or a plain number of MiB.
pub fn parse_memory_mb(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?}: expected a size such as 64GiB or 512MiB"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "m" | "mb" | "mi" | "mib" => 1.0,
        "g" | "gb" | "gi" | "gib" => 1024.0,
        "t" | "tb" | "ti" | "tib" => 1024.0 * 1024.0,
        other => return Err(format!("{s:?}: unknown unit {other:?} (MiB, GiB, TiB)")),
    };
    Ok((n * mult).round() as u64)
}

/// "5/s", "300/m", "10/h", or a plain number per second.
pub fn parse_rate(s: &str) -> Result<f64, String> {
    let (num, per) = s.trim().split_once('/').unwrap_or((s.trim(), "s"));
    let n: f64 = num.trim().parse().map_err(|_| format!("{s:?}: expected a rate such as 5/s or 300/m"))?;
    let secs = match per.trim() {
        "s" | "sec" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => return Err(format!("{s:?}: unknown period {other:?} (s, m, h)")),
    };
    Ok(n / secs)
}

fn print<T: serde::Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn checked(path: &str) -> anyhow::Result<&str> {
    match path_problem(path) {
        None => Ok(path),
        Some(p) => bail!("{path:?} is not a principal path: {p}"),
    }
}

/// Runs one quota command; the JSON answer goes to stdout. `Ok(false)`: drift was found.
pub async fn run(config: &Config, op: QuotaOp) -> anyhow::Result<bool> {
    let ledger = Ledger::connect(&config.redis.url, &config.redis.prefix)
        .await
        .with_context(|| format!("connect to redis at {}", config.redis.url))?;
    let defaults = &config.quotas.default;
    match op {
        QuotaOp::Get { path, no_children } => {
            print(&ledger.quota_view(checked(&path)?, defaults, !no_children).await?)?;
        }
        QuotaOp::Set { path, limits } => {
            let path = checked(&path)?;
            let current = ledger.quota_view(path, defaults, false).await?.limits;
            let new = limits.over(current);
            if let Some(p) = new.problem() {
                bail!("{p}");
            }
            match ledger.quota_set(path, Some(&new), defaults).await? {
                SetLimits::Ok => {}
                SetLimits::Above { dimension, path: at, limit } => {
                    bail!("{dimension}: may not exceed the limit of {limit} that {at:?} has")
                }
                SetLimits::Outside { path: at, allowed } => {
                    bail!("isolation: must lie within what {at:?} allows ({})", allowed.join(", "))
                }
                // The operator sets as an admin; kept for exhaustiveness.
                SetLimits::AdminSet { path: at, fields } => {
                    bail!("{}: set by an admin on {at:?}", fields.join(", "))
                }
            }
            print(&ledger.quota_view(path, defaults, false).await?)?;
        }
        QuotaOp::Rm { path } => {
            ledger.quota_set(checked(&path)?, None, defaults).await?;
        }
        QuotaOp::Verify { fix } => {
            let drift = ledger.quota_verify(defaults, fix).await?;
            print(&drift)?;
            return Ok(drift.drift.is_empty() || fix);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_rates_parse_as_people_write_them() {
        assert_eq!(parse_memory_mb("64GiB"), Ok(65536));
        assert_eq!(parse_memory_mb("512MiB"), Ok(512));
        assert_eq!(parse_memory_mb("1.5G"), Ok(1536));
        assert_eq!(parse_memory_mb("100"), Ok(100));
        assert!(parse_memory_mb("12 parsecs").is_err());
        assert_eq!(parse_rate("5/s"), Ok(5.0));
        assert_eq!(parse_rate("300/m"), Ok(5.0));
        assert_eq!(parse_rate("2"), Ok(2.0));
        assert!(parse_rate("5/fortnight").is_err());
    }

    #[test]
    fn set_keeps_the_limits_it_does_not_name() {
        let base = QuotaLimits { sessions: Some(10), cpus: Some(4.0), ..Default::default() };
        let args = LimitArgs { cpus: Some(8.0), create_rate: Some(5.0), ..Default::default() };
        let l = args.over(base);
        assert_eq!((l.sessions, l.cpus, l.create_rate), (Some(10), Some(8.0), Some(5.0)));
    }
}

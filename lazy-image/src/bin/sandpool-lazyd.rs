//! `sandpool-lazyd`: the node's lazy-image daemon (`lazy_image::lazyd`). Started by the
//! pool-manager when a template first needs a lazy image, detached, so it outlives
//! pool-manager restarts; one per node (a lock in its state directory).
//!
//! ```text
//! sandpool-lazyd [--socket PATH] [--state-dir DIR] [--cache-mb N] [--fetch-timeout-s S]
//! ```

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use lazy_image::{FetchPolicy, lazyd};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let mut opts = lazyd::Options {
        socket: PathBuf::from(lazyd::DEFAULT_SOCKET),
        state_dir: PathBuf::from(lazyd::DEFAULT_STATE_DIR),
        cache_bytes: lazyd::DEFAULT_CACHE_MB << 20,
        fetch: FetchPolicy::default(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--socket" => opts.socket = value()?.into(),
            "--state-dir" => opts.state_dir = value()?.into(),
            "--cache-mb" => opts.cache_bytes = value()?.parse::<u64>().context("--cache-mb")? << 20,
            "--fetch-timeout-s" => opts.fetch = FetchPolicy::with_total(fetch_timeout(&value()?)?),
            other => {
                bail!(
                    "unknown argument {other} (sandpool-lazyd [--socket PATH] [--state-dir DIR] [--cache-mb N] [--fetch-timeout-s S])"
                )
            }
        }
    }
    lazyd::run(opts).await
}

/// `--fetch-timeout-s`: seconds (a decimal), at least 0.1 and at most an hour.
fn fetch_timeout(value: &str) -> anyhow::Result<Duration> {
    let secs: f64 = value.parse().with_context(|| format!("--fetch-timeout-s {value:?}: not a number of seconds"))?;
    if !(0.1..=3600.0).contains(&secs) {
        bail!("--fetch-timeout-s {value}: must be 0.1 to 3600 seconds");
    }
    Ok(Duration::from_secs_f64(secs))
}

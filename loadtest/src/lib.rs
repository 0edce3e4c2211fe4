//! Measurement helpers shared by sandpool's benchmarks: latency samples and their summary.

pub mod load;
pub mod record;
pub mod scenario;
pub mod target;

use std::time::Duration;

use serde::Serialize;

/// A set of latency samples.
#[derive(Debug, Default, Clone)]
pub struct Samples(Vec<Duration>);

/// Percentiles of a sample set, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub n: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The share of samples under `bound`, in percent (0 when there are none).
    pub fn pct_under(&self, bound: Duration) -> f64 {
        if self.0.is_empty() {
            return 0.0;
        }
        100.0 * self.0.iter().filter(|d| **d < bound).count() as f64 / self.0.len() as f64
    }

    /// Nearest-rank percentile (`q` in 0..=1).
    pub fn percentile(&self, q: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let mut v = self.0.clone();
        v.sort_unstable();
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
        v[rank - 1]
    }

    pub fn summary(&self) -> Summary {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let mean =
            if self.0.is_empty() { 0.0 } else { self.0.iter().map(|d| ms(*d)).sum::<f64>() / self.0.len() as f64 };
        Summary {
            n: self.0.len(),
            p50_ms: ms(self.percentile(0.50)),
            p90_ms: ms(self.percentile(0.90)),
            p99_ms: ms(self.percentile(0.99)),
            max_ms: ms(self.percentile(1.0)),
            mean_ms: mean,
        }
    }
}

/// Runs the docker CLI; its trimmed stdout, or an error with its stderr.
pub fn docker(args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new("docker").args(args).output()?;
    anyhow::ensure!(out.status.success(), "docker {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let mut s = Samples::default();
        for i in 1..=100 {
            s.push(Duration::from_millis(i));
        }
        assert_eq!(s.percentile(0.5), Duration::from_millis(50));
        assert_eq!(s.percentile(0.99), Duration::from_millis(99));
        assert_eq!(s.percentile(1.0), Duration::from_millis(100));
        assert_eq!(Samples::default().percentile(0.5), Duration::ZERO);
    }
}

//! How many environments a function should have: Little's law on its measured load.
//!
//! Invocations in flight on average are `L = λ × W` (arrival rate × mean duration); a function
//! kept at `round(L × HEADROOM)` environments finds one idle for most arrivals (Poisson arrivals
//! above their mean for a moment take a cold start, not a queue). `min_warm` is a floor, the
//! function's `max_concurrency` a ceiling, and with no load (and no floor) the answer is 0:
//! idle environments then end at `env_idle_s` (scale to zero).

/// Environments beyond the mean in flight, for arrivals that bunch up.
pub const HEADROOM: f64 = 1.5;

/// The load the keeper measured over its last window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// Completed invocations per second.
    pub rate: f64,
    /// Their mean duration, in seconds.
    pub duration_s: f64,
}

/// The environments a function should have now.
pub fn environments(load: Load, min_warm: u32, max_concurrency: u32) -> u32 {
    let in_flight = (load.rate.max(0.0) * load.duration_s.max(0.0)).min(f64::from(u32::MAX));
    // Rounded, not ceiled: a trickle (one call a minute) needs no environment kept for it, as
    // the one it used stays warm for `env_idle_s` anyway; and a smoothed rate that decays
    // towards zero reaches it.
    let wanted = (in_flight * HEADROOM).round() as u32;
    wanted.max(min_warm).min(max_concurrency)
}

/// Smooths a rate or duration sample into its running estimate (`alpha` of the new one).
pub fn smooth(old: Option<f64>, sample: f64, alpha: f64) -> f64 {
    match old {
        Some(o) => o * (1.0 - alpha) + sample * alpha,
        None => sample,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn littles_law_with_headroom_a_floor_and_a_ceiling() {
        // 100 invocations/s of 50 ms: 5 in flight on average, 8 with headroom.
        assert_eq!(environments(Load { rate: 100.0, duration_s: 0.05 }, 0, 64), 8);
        assert_eq!(environments(Load { rate: 100.0, duration_s: 0.05 }, 10, 64), 10, "min_warm is a floor");
        assert_eq!(environments(Load { rate: 1000.0, duration_s: 1.0 }, 0, 16), 16, "max_concurrency a ceiling");
        assert_eq!(environments(Load { rate: 0.0, duration_s: 0.2 }, 0, 16), 0, "no load: scale to zero");
        assert_eq!(environments(Load { rate: 0.1, duration_s: 0.01 }, 0, 16), 0, "a trickle keeps none");
        assert_eq!(environments(Load { rate: 10.0, duration_s: 0.05 }, 0, 16), 1);
        assert_eq!(environments(Load { rate: f64::NAN.max(0.0), duration_s: -1.0 }, 2, 16), 2);
    }

    #[test]
    fn smoothing() {
        assert_eq!(smooth(None, 4.0, 0.5), 4.0);
        assert_eq!(smooth(Some(4.0), 0.0, 0.5), 2.0);
    }
}

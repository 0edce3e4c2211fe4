//! A small seeded PRNG (SplitMix64) with the few distributions the trace generators need.
//!
//! Our own rather than `rand`'s `StdRng`, whose stream may change between rand versions: a trace for a
//! seed stays the same trace as long as this file does.

/// SplitMix64: fast, 64-bit state, passes BigCrush; plenty for a simulator.
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x5EED_5A4D_B001_0000)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform integer in [0, n) (0 if n is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.unit(); // (0, 1]
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Exponential with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }

    /// Poisson with the given (small) mean (Knuth's method).
    pub fn poisson(&mut self, mean: f64) -> u32 {
        let l = (-mean).exp();
        let (mut k, mut p) = (0u32, 1.0);
        loop {
            p *= self.unit();
            if p <= l {
                return k;
            }
            k += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_roughly_right() {
        let (mut a, mut b) = (SimRng::new(7), SimRng::new(7));
        assert_eq!((0..5).map(|_| a.next_u64()).collect::<Vec<_>>(), (0..5).map(|_| b.next_u64()).collect::<Vec<_>>());
        let n = 20_000;
        let mean = (0..n).map(|_| a.normal()).sum::<f64>() / f64::from(n);
        assert!(mean.abs() < 0.05);
        let mean = (0..n).map(|_| f64::from(a.poisson(2.0))).sum::<f64>() / f64::from(n);
        assert!((mean - 2.0).abs() < 0.05);
    }
}

//! A deterministic, dependency-free generator for the crate's randomized tests.

/// xorshift64*.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `k` distinct values from `lo..hi` appended to `out` (up to `k` in all).
    pub(crate) fn distinct(&mut self, k: usize, lo: usize, hi: usize, out: &mut Vec<i32>) {
        while out.len() < k {
            let e = (lo + self.below(hi - lo)) as i32;
            if !out.contains(&e) {
                out.push(e);
            }
        }
    }
}

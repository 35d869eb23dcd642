//! The one source of randomness of kvpush's tests, benches and demo: SplitMix64, seeded by a `u64`.
//!
//! Every randomized test, simulator, workload and bench draws from [`Rng`], so that a seed printed on
//! a failure replays the same run everywhere. It is not cryptographic and never used outside test
//! code. The state is the tuple field: `Rng(seed)` is a generator seeded by `seed`, and the stream of
//! a given seed never changes (recorded seeds and corpora depend on it).

/// SplitMix64 (Steele, Lea and Flood): one 64-bit add and a mixing function per draw.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// A generator seeded by `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)] // an infinite stream, not an `Iterator` of `Option`s
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (modulo bias is negligible for test sizes); `0` when `n` is `0`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Uniform in `lo..=hi` (`lo <= hi`).
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// True with probability `pct` in 100.
    pub fn percent(&mut self, pct: u8) -> bool {
        self.next() % 100 < u64::from(pct)
    }

    /// A fair coin.
    pub fn coin(&mut self) -> bool {
        self.next() & 1 == 0
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Shuffles `v` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }

    /// The first `take` entries of a random permutation of `0..n`: `take` distinct block ids, as a
    /// fragmented block pool hands them out.
    pub fn permutation(&mut self, n: u32, take: usize) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        self.shuffle(&mut v);
        v.truncate(take);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn the_stream_of_a_seed_never_changes() {
        // SplitMix64's published first outputs for seed 0 (Vigna's reference implementation).
        let mut r = Rng(0);
        assert_eq!(r.next(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(r.next(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn permutation_is_distinct_and_in_range() {
        let mut r = Rng(7);
        let p = r.permutation(100, 60);
        assert_eq!(p.len(), 60);
        let mut s = p.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 60, "{p:?}");
        assert!(p.iter().all(|&x| x < 100));
    }
}

//! Small, fast pseudo-random generators written for this crate.
//!
//! Nothing here needs cryptographic quality: the generators only have to be
//! fast (fill speed matters for multi-GiB guests), deterministic from a seed
//! (so a fill or a dirtying sequence can be reproduced) and well enough mixed
//! that random pages do not compress.

/// SplitMix64's finaliser: a cheap bijective mix of 64 bits. Used to derive
/// per-page decisions and per-thread seeds from a single user seed.
pub(crate) fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Hash of two words, for "decision about item `b` under seed `a`".
pub(crate) fn hash2(a: u64, b: u64) -> u64 {
    mix64(a ^ mix64(b))
}

/// The wyrand generator: one add and one 64x64->128 multiply per 8 bytes.
/// Its whole state is one `u64`, which keeps the dirtier's saved state small
/// and lets any 64-bit value be a valid state (so decoding cannot produce an
/// invalid generator).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WyRand(pub(crate) u64);

impl WyRand {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "wyrand folds the product's high and low halves"
    )]
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = u128::from(self.0) * u128::from(self.0 ^ 0xe703_7ed1_a0b4_28db);
        (t >> 64) as u64 ^ t as u64
    }

    /// A value in `0..bound` (bound > 0) without a division: the high half of
    /// a 64x64 product. The slight bias is irrelevant here.
    pub(crate) fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wyrand_is_deterministic_and_spread() {
        let mut a = WyRand(7);
        let mut b = WyRand(7);
        let xs: Vec<u64> = (0..1000).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..1000).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        let ones: u32 = xs.iter().map(|x| x.count_ones()).sum();
        // 64000 bits, expect about half set.
        assert!((30_000..34_000).contains(&ones), "{ones}");
        let mut c = WyRand(1);
        assert!((0..1000).all(|_| c.below(10) < 10));
    }
}

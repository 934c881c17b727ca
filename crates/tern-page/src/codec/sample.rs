//! Cheap detection of pages that will not compress.
//!
//! Compressing a page of random (or already compressed, or encrypted) bytes
//! costs the full codec time and gains nothing: on the machine measured in
//! `docs/compression.md`, libdeflate-1 gives up on a random page at only
//! ~220 MB/s. A page that does not shrink goes raw anyway, so deciding that
//! from a small sample, before any codec runs, turns that wasted CPU into a
//! few dozen loads.
//!
//! # The test
//!
//! Read [`SAMPLE_WORDS`] 8-byte words spread evenly over the page (256 bytes,
//! one word per 128-byte stride, so four cache lines of every 64 untouched)
//! and count the distinct byte values among those 256 bytes with a 256-bit
//! bitmap. Uniformly random bytes give about 256·(1 − (1 − 1/256)^256) ≈ 162
//! distinct values; text uses an alphabet of a few dozen; binary data (small
//! integers, pointers, machine code) repeats its zero and high bytes.
//!
//! Measured distinct counts over the test corpus (256-byte sample each; see
//! `sample_distinct_counts` in the tests, which prints them):
//!
//! | page kind | distinct values |
//! |---|---|
//! | random | 146–173 |
//! | English-like text | 23–26 |
//! | binary-like (integers, pointers, instruction bytes) | 62–77 |
//! | zero | 1 |
//!
//! [`INCOMPRESSIBLE_DISTINCT`] = 136 sits between the binary and random
//! clusters with margin on both sides (39 pages of each kind measured). A false "incompressible" costs a
//! missed saving on one page in one iteration; a false "compressible" costs
//! one wasted codec call, exactly what happens without sampling.
//!
//! What the sample cannot see: a page whose bytes look random locally but
//! repeat at long distance (the same 512 random bytes eight times) is
//! compressible and is sent raw. Guest memory rarely looks like that.

use crate::PAGE_SIZE;
use core::ptr::read_unaligned;

/// Number of 8-byte words sampled per page.
pub const SAMPLE_WORDS: usize = 32;

/// A sample with more distinct byte values than this is taken as random.
pub const INCOMPRESSIBLE_DISTINCT: u32 = 136;

const STRIDE: usize = PAGE_SIZE / SAMPLE_WORDS;

/// Number of distinct byte values among the sampled 256 bytes of a page.
///
/// # Safety
///
/// `page` must point to [`PAGE_SIZE`] readable bytes; concurrent writes are
/// tolerated (the answer is a heuristic snapshot), as for
/// [`ZeroChecker::is_zero_page`](crate::ZeroChecker::is_zero_page).
#[inline]
pub unsafe fn sample_distinct_bytes(page: *const u8) -> u32 {
    let mut seen = [0u64; 4];
    for i in 0..SAMPLE_WORDS {
        // SAFETY: i * STRIDE + 8 <= PAGE_SIZE, and the caller guarantees
        // PAGE_SIZE readable bytes at `page`; read_unaligned needs no
        // alignment.
        let w = unsafe { read_unaligned(page.add(i * STRIDE).cast::<u64>()) };
        for b in w.to_le_bytes() {
            seen[usize::from(b >> 6)] |= 1u64 << (b & 63);
        }
    }
    seen.iter().map(|w| w.count_ones()).sum()
}

/// Whether a cheap sample says the page is random-looking and not worth
/// compressing. See the module docs for the test and its thresholds.
///
/// # Safety
///
/// As for [`sample_distinct_bytes`].
#[inline]
pub unsafe fn looks_incompressible(page: *const u8) -> bool {
    // SAFETY: forwarded caller contract.
    unsafe { sample_distinct_bytes(page) > INCOMPRESSIBLE_DISTINCT }
}

/// [`looks_incompressible`] for an owned page.
pub fn looks_incompressible_bytes(page: &[u8; PAGE_SIZE]) -> bool {
    // SAFETY: a &[u8; PAGE_SIZE] is PAGE_SIZE readable bytes.
    unsafe { looks_incompressible(page.as_ptr()) }
}

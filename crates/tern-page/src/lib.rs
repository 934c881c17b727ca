//! Temporary scalar placeholder; replaced by the SIMD module on branch `page`.
#![warn(missing_docs)]

/// Page size.
pub const PAGE_SIZE: usize = 4096;

/// Zero-page checker.
#[derive(Clone, Copy, Debug)]
pub struct ZeroChecker;

impl ZeroChecker {
    /// Best available backend.
    pub fn best() -> Self {
        Self
    }

    /// Whether the page is all zero.
    ///
    /// # Safety
    /// `page` points to PAGE_SIZE readable bytes.
    pub unsafe fn is_zero_page(&self, page: *const u8) -> bool {
        (0..PAGE_SIZE / 8).all(|i| {
            // SAFETY: within the page, per the contract.
            unsafe { page.cast::<u64>().add(i).read_unaligned() == 0 }
        })
    }
}

//! Memory digests, compared at switch-over.
//!
//! The digest is XXH3-128 over, for each region in order, the region's id
//! and the XXH3-64 of each of its pages. Page granularity lets both sides
//! hash on all cores, and lets the destination skip pages it never wrote:
//! they are known to be zero, and reading untouched memory costs a page
//! fault per page for nothing.

use std::sync::OnceLock;

use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::guest::{MemoryRegion, PAGE_SIZE};
use crate::stats::thread_cpu_seconds;

/// XXH3-64 of a zero page, computed once.
pub fn zero_page_hash() -> u64 {
    static HASH: OnceLock<u64> = OnceLock::new();
    *HASH.get_or_init(|| xxh3_64(&[0u8; PAGE_SIZE]))
}

/// A digest and what it cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Digest {
    /// The digest.
    pub value: u128,
    /// CPU seconds of the hashing threads.
    pub cpu_seconds: f64,
    /// Wall-clock time the hashing took.
    pub elapsed: std::time::Duration,
}

/// Computes the digest of `regions` with up to `threads` threads.
/// `is_page_untouched(region_index, page)` may return true for a page known
/// to be all zero, which is then not read.
///
/// # Safety
/// Nothing may write to the regions during the call (the guest is paused and
/// no receiver runs).
pub unsafe fn memory_digest(
    regions: &[MemoryRegion],
    threads: usize,
    is_page_untouched: &(dyn Fn(usize, u64) -> bool + Sync),
) -> Digest {
    let started = std::time::Instant::now();
    let zero_hash = zero_page_hash();
    let mut cpu_seconds = 0.0;
    let mut final_hasher = Xxh3::new();
    for (region_index, region) in regions.iter().enumerate() {
        let pages = region.pages();
        let mut hashes = vec![0u64; usize::try_from(pages).expect("region fits in memory")];
        let threads = threads.clamp(1, hashes.len().max(1));
        let per_thread = hashes.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let mut workers = Vec::new();
            for (part, slots) in hashes.chunks_mut(per_thread).enumerate() {
                workers.push(scope.spawn(move || {
                    let cpu_start = thread_cpu_seconds();
                    let first = (part * per_thread) as u64;
                    for (offset, slot) in slots.iter_mut().enumerate() {
                        let page = first + offset as u64;
                        *slot = if is_page_untouched(region_index, page) {
                            zero_hash
                        } else {
                            let ptr = region
                                .page_ptr(page)
                                .expect("page index below the region's page count");
                            // SAFETY: `page_ptr` bounds-checked the page,
                            // and the caller guarantees nothing writes to it.
                            unsafe { page_hash(ptr) }
                        };
                    }
                    thread_cpu_seconds() - cpu_start
                }));
            }
            for worker in workers {
                cpu_seconds += worker.join().unwrap_or(0.0);
            }
        });
        add_region(&mut final_hasher, region.id(), hashes);
    }
    Digest {
        value: final_hasher.digest128(),
        cpu_seconds,
        elapsed: started.elapsed(),
    }
}

/// Adds one region's page hashes to a digest being built. The destination
/// builds its digest from the hashes its receivers computed as they wrote
/// each page, through the same function, so both sides agree on the format.
pub fn add_region(hasher: &mut Xxh3, region_id: u32, page_hashes: impl IntoIterator<Item = u64>) {
    hasher.update(&region_id.to_le_bytes());
    for hash in page_hashes {
        hasher.update(&hash.to_le_bytes());
    }
}

/// XXH3-64 of one page.
///
/// # Safety
/// `page` points to a readable page that nothing writes during the call.
pub unsafe fn page_hash(page: *const u8) -> u64 {
    // SAFETY: the caller's contract.
    xxh3_64(unsafe { std::slice::from_raw_parts(page, PAGE_SIZE) })
}

/// Threads to use for hashing: all cores.
pub fn digest_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ptr::NonNull;

    #[test]
    fn untouched_hint_does_not_change_digest_of_zero_memory() {
        let mut memory = vec![0u8; 200 * PAGE_SIZE];
        // SAFETY: the vector outlives the region and nothing else accesses it.
        let region = unsafe {
            MemoryRegion::new(0, 0, NonNull::new(memory.as_mut_ptr()).unwrap(), 200 * 4096)
        };
        // SAFETY: nothing writes during the calls.
        let read_all = unsafe { memory_digest(&[region], 2, &|_, _| false) }.value;
        // SAFETY: as above.
        let skip_all = unsafe { memory_digest(&[region], 1, &|_, _| true) }.value;
        assert_eq!(read_all, skip_all);
        memory[150 * PAGE_SIZE + 7] = 1;
        // SAFETY: as above.
        let changed = unsafe { memory_digest(&[region], 3, &|_, _| false) }.value;
        assert_ne!(changed, read_all);
    }
}

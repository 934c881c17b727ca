//! Memory digests, compared at switch-over.
//!
//! The digest is XXH3-128 over the concatenated XXH3-128 digests of
//! fixed-size chunks of each region, in region order. Chunking lets both
//! sides hash in parallel, and lets the destination skip reading chunks it
//! never wrote (they are known to be zero, and reading untouched memory costs
//! a page fault per page).

use xxhash_rust::xxh3::{Xxh3, xxh3_128};

use crate::guest::{MemoryRegion, PAGE_SIZE};
use crate::stats::thread_cpu_seconds;

/// Pages per digest chunk.
pub const CHUNK_PAGES: u64 = 64;
const CHUNK_BYTES: u64 = CHUNK_PAGES * PAGE_SIZE as u64;

/// Computes the digest of `regions` with up to `threads` threads, and the
/// CPU seconds those threads used.
/// `is_chunk_untouched(region_index, chunk_index)` may return true for a
/// chunk known to be all zero, which is then not read.
///
/// # Safety
/// Nothing may write to the regions during the call (the guest is paused and
/// no receiver runs).
pub unsafe fn memory_digest(
    regions: &[MemoryRegion],
    threads: usize,
    is_chunk_untouched: &(dyn Fn(usize, u64) -> bool + Sync),
) -> (u128, f64) {
    let mut cpu_seconds = 0.0;
    let zero_chunk = vec![0u8; CHUNK_BYTES as usize];
    let mut final_hasher = Xxh3::new();
    for (region_index, region) in regions.iter().enumerate() {
        let chunks = region.len().div_ceil(CHUNK_BYTES);
        let mut digests = vec![0u128; chunks as usize];
        let threads = threads.clamp(1, chunks.max(1) as usize);
        let per_thread = digests.len().div_ceil(threads);
        let zero_full = xxh3_128(&zero_chunk);
        std::thread::scope(|scope| {
            let mut workers = Vec::new();
            for (part, slots) in digests.chunks_mut(per_thread).enumerate() {
                let zero_chunk = &zero_chunk;
                workers.push(scope.spawn(move || {
                    let cpu_start = thread_cpu_seconds();
                    for (offset, slot) in slots.iter_mut().enumerate() {
                        let chunk = (part * per_thread + offset) as u64;
                        let start = chunk * CHUNK_BYTES;
                        let len = (region.len() - start).min(CHUNK_BYTES) as usize;
                        *slot = if is_chunk_untouched(region_index, chunk) {
                            if len == CHUNK_BYTES as usize {
                                zero_full
                            } else {
                                xxh3_128(&zero_chunk[..len])
                            }
                        } else {
                            // SAFETY: `start + len` lies inside the region's
                            // mapping, and the caller guarantees nothing
                            // writes to it during the call, so a shared
                            // slice is sound.
                            let bytes = unsafe {
                                std::slice::from_raw_parts(
                                    region.host_ptr().add(start as usize),
                                    len,
                                )
                            };
                            xxh3_128(bytes)
                        };
                    }
                    thread_cpu_seconds() - cpu_start
                }));
            }
            for worker in workers {
                cpu_seconds += worker.join().unwrap_or(0.0);
            }
        });
        final_hasher.update(&region.id().to_le_bytes());
        for digest in digests {
            final_hasher.update(&digest.to_le_bytes());
        }
    }
    (final_hasher.digest128(), cpu_seconds)
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
        let (read_all, _) = unsafe { memory_digest(&[region], 2, &|_, _| false) };
        // SAFETY: as above.
        let (skip_all, _) = unsafe { memory_digest(&[region], 1, &|_, _| true) };
        assert_eq!(read_all, skip_all);
        memory[150 * PAGE_SIZE] = 1;
        // SAFETY: as above.
        let (changed, _) = unsafe { memory_digest(&[region], 3, &|_, _| false) };
        assert_ne!(changed, read_all);
    }
}

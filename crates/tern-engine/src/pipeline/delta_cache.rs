//! The source's cache of pages as last sent, for delta encoding
//! (`--delta-cache-size`, QEMU's xbzrle-cache-size).
//!
//! Direct-mapped: a page has one slot, chosen from its region and index so
//! that a contiguous working set fills consecutive slots. Each slot has one
//! atomic state word (busy bit, valid bit, region, page) and a page of
//! bytes. A worker takes a slot by setting its busy bit with one
//! compare-and-swap and never waits for it: a busy slot is a cache miss. No
//! lock is held on the per-page path and no two workers touch one slot's
//! bytes.
//!
//! The invariant the destination relies on: at the start of every
//! iteration, a valid slot naming page P holds exactly the bytes the
//! destination holds for P. It holds because
//!
//! * a slot is written from the same copy of the page that goes on the wire
//!   (as a delta, compressed or raw: the batch sends from that copy, never
//!   from guest memory, when the cache is on);
//! * a page is in at most one batch per iteration, and the destination
//!   finishes an iteration before the next starts (the sync barrier), so the
//!   delta of iteration *i+1* is applied to what iteration *i* left;
//! * a page sent without updating its slot (zero, duplicate, or its slot
//!   busy with another page) leaves no valid slot naming it: `forget`
//!   clears the slot, and whoever holds a busy slot releases it naming its
//!   own page.

use std::cell::UnsafeCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tern_page::PAGE_SIZE;
use tern_page::delta::create_delta;
use tern_page::dsa::DeltaOffload;

const BUSY: u64 = 1 << 63;
const VALID: u64 = 1 << 62;

/// What the cache did with one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DeltaOutcome {
    /// A delta of this many bytes is in the output; send it.
    Delta(usize),
    /// The page was cached but changed too much: send it whole.
    Overflow,
    /// Not cached (now it is, unless the slot was busy): send it whole.
    Miss,
}

/// One cached page's bytes.
type SlotBytes = UnsafeCell<[u8; PAGE_SIZE]>;

/// The cache: `states.len()` pages of memory, allocated once.
pub(super) struct DeltaCache {
    /// Each slot's state word.
    states: Box<[AtomicU64]>,
    /// Each slot's bytes: zeroed memory from the system, so a slot costs a
    /// page fault only when first written, and with transparent huge pages
    /// one fault per 2 MiB.
    bytes: Box<[SlotBytes]>,
    /// Creates the delta records on DSA (or the software device) instead
    /// of the CPU; the same bytes either way.
    offload: Option<Arc<DeltaOffload>>,
}

// SAFETY: a slot's bytes are accessed only by the worker that set its busy
// bit (an Acquire compare-and-swap) until it clears it (a Release store), so
// no two threads access them at once and each sees the previous holder's
// writes.
unsafe impl Sync for DeltaCache {}

fn tag(region: usize, page: u32) -> u64 {
    VALID | ((region as u64 & 0x3ff) << 32) | u64::from(page)
}

impl DeltaCache {
    /// A cache of `bytes` (whole pages; at least one).
    pub fn new(bytes: u64, offload: Option<Arc<DeltaOffload>>) -> Self {
        let slots = usize::try_from(bytes / PAGE_SIZE as u64)
            .unwrap_or(usize::MAX)
            .max(1);
        Self {
            states: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            bytes: zeroed_slots(slots),
            offload,
        }
    }

    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        (self.states.len() * PAGE_SIZE) as u64
    }

    fn slot(&self, region: usize, page: u32) -> (&AtomicU64, &SlotBytes) {
        // Regions apart by a large odd stride, pages of a region adjacent.
        let key = (region as u64).wrapping_mul(0x9e37_79b9) + u64::from(page);
        let index = (key % self.states.len() as u64) as usize;
        (&self.states[index], &self.bytes[index])
    }

    /// Encodes `copy`, the bytes of page `page` of `region` about to be
    /// sent, against its cached version into `delta`, and caches `copy` in
    /// its place. The caller must send exactly `copy` (as the delta, or
    /// whole for an overflow or a miss).
    pub fn encode(
        &self,
        region: usize,
        page: u32,
        copy: &[u8; PAGE_SIZE],
        delta: &mut [u8],
    ) -> DeltaOutcome {
        let (slot_state, slot_bytes) = self.slot(region, page);
        let wanted = tag(region, page);
        let mut state = slot_state.load(Ordering::Relaxed);
        loop {
            if state & BUSY != 0 {
                // Held for another page, whose holder will name it: this
                // page's old version cannot stay cached.
                return DeltaOutcome::Miss;
            }
            match slot_state.compare_exchange_weak(
                state,
                state | BUSY,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => state = now,
            }
        }
        // SAFETY: this thread set the busy bit, so it alone accesses the
        // bytes until the Release store below.
        let cached = unsafe { &mut *slot_bytes.get() };
        let outcome = if state == wanted {
            let created = match &self.offload {
                Some(offload) => offload.create(cached, copy, delta),
                None => create_delta(cached, copy, delta),
            };
            match created {
                Some(len) => DeltaOutcome::Delta(len),
                None => DeltaOutcome::Overflow,
            }
        } else {
            DeltaOutcome::Miss
        };
        cached.copy_from_slice(copy);
        slot_state.store(wanted, Ordering::Release);
        outcome
    }

    /// Page `page` of `region` is being sent without its bytes passing
    /// through the cache (a zero page, a duplicate): its slot must not name
    /// it any more.
    pub fn forget(&self, region: usize, page: u32) {
        let (slot_state, _) = self.slot(region, page);
        let wanted = tag(region, page);
        // Busy means held for another page, which will be named instead.
        let _ = slot_state.compare_exchange(wanted, 0, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// `slots` zeroed pages, untouched until written, transparent huge pages
/// asked for.
fn zeroed_slots(slots: usize) -> Box<[SlotBytes]> {
    let layout = std::alloc::Layout::array::<SlotBytes>(slots).expect("the cache fits memory");
    // SAFETY: a non-zero-sized layout (at least one slot of PAGE_SIZE).
    let memory = unsafe { std::alloc::alloc_zeroed(layout) };
    if memory.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    // SAFETY: `memory` is the start of `layout.size()` bytes we own; the
    // advice only changes how the kernel backs them. A refusal is harmless.
    unsafe { libc::madvise(memory.cast(), layout.size(), libc::MADV_HUGEPAGE) };
    // SAFETY: the allocation is `slots` elements of `SlotBytes` with its
    // layout, zeroed, and zero bytes are a valid `UnsafeCell<[u8; N]>`; the
    // box frees it with the same layout.
    unsafe {
        Box::from_raw(std::ptr::slice_from_raw_parts_mut(
            memory.cast::<SlotBytes>(),
            slots,
        ))
    }
}

#[cfg(test)]
mod tests {
    use tern_page::delta::{MAX_DELTA_LEN, apply_delta};

    use super::*;

    fn page(fill: u8) -> Box<[u8; PAGE_SIZE]> {
        Box::new([fill; PAGE_SIZE])
    }

    #[test]
    fn a_page_sent_twice_goes_as_a_delta_the_second_time() {
        let cache = DeltaCache::new(4 * PAGE_SIZE as u64, None);
        let mut delta = [0u8; MAX_DELTA_LEN];
        let first = page(1);
        assert_eq!(cache.encode(0, 2, &first, &mut delta), DeltaOutcome::Miss);
        let mut second = first.clone();
        second[100] = 9;
        let DeltaOutcome::Delta(len) = cache.encode(0, 2, &second, &mut delta) else {
            panic!("expected a delta");
        };
        let mut rebuilt = first.clone();
        apply_delta(&delta[..len], &mut rebuilt).unwrap();
        assert_eq!(rebuilt, second);
        assert_eq!(
            cache.encode(0, 2, &page(7), &mut delta),
            DeltaOutcome::Overflow
        );
        // The overflowing page is what is cached now.
        let mut third = page(7);
        third[0] = 1;
        assert!(matches!(
            cache.encode(0, 2, &third, &mut delta),
            DeltaOutcome::Delta(10)
        ));
    }

    #[test]
    fn a_forgotten_or_evicted_page_misses() {
        let cache = DeltaCache::new(2 * PAGE_SIZE as u64, None);
        let mut delta = [0u8; MAX_DELTA_LEN];
        cache.encode(0, 0, &page(1), &mut delta);
        cache.forget(0, 0);
        assert_eq!(cache.encode(0, 0, &page(1), &mut delta), DeltaOutcome::Miss);
        // Pages 0 and 2 share a slot in a two-page cache.
        cache.encode(0, 2, &page(1), &mut delta);
        assert_eq!(cache.encode(0, 0, &page(1), &mut delta), DeltaOutcome::Miss);
        // Forgetting a page another one evicted leaves that one cached.
        cache.forget(0, 2);
        assert!(matches!(
            cache.encode(0, 0, &page(1), &mut delta),
            DeltaOutcome::Delta(_)
        ));
    }

    #[test]
    fn a_busy_slot_is_a_miss_and_its_holder_names_its_own_page() {
        let cache = DeltaCache::new(PAGE_SIZE as u64, None);
        let mut delta = [0u8; MAX_DELTA_LEN];
        cache.encode(0, 0, &page(1), &mut delta);
        let (state, _) = cache.slot(0, 0);
        let held = state.fetch_or(BUSY, Ordering::Acquire);
        assert_eq!(cache.encode(0, 0, &page(2), &mut delta), DeltaOutcome::Miss);
        // The holder (page 1 here) releases naming its page.
        state.store(tag(0, 1), Ordering::Release);
        assert_eq!(held, tag(0, 0));
        assert_eq!(cache.encode(0, 0, &page(2), &mut delta), DeltaOutcome::Miss);
    }
}

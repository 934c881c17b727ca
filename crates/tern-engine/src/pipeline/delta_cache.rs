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
//! Not every page goes through the cache: each worker's [`DeltaGate`]
//! admits a page only from the second pass on, and only a sample of pages
//! while its recent lookups mostly overflow, because caching costs every
//! page it admits whether or not a delta comes of it.
//!
//! The invariant the destination relies on: at the start of every
//! iteration, a valid slot naming page P holds exactly the bytes the
//! destination holds for P. It holds because
//!
//! * a slot is written only for an admitted page, from the same copy of
//!   the page that goes on the wire (as a delta, compressed or raw: the
//!   batch sends an admitted page from that copy, never from guest memory);
//! * a page is in at most one batch per iteration, and the destination
//!   finishes an iteration before the next starts (the sync barrier), so the
//!   delta of iteration *i+1* is applied to what iteration *i* left;
//! * a page sent without updating its slot (not admitted by the gate,
//!   zero, duplicate, or its slot busy with another page) leaves no valid
//!   slot naming it: `forget` clears the slot, and whoever holds a busy
//!   slot releases it naming its own page. So when a closed gate reopens,
//!   the pages it kept out are misses, never deltas against bytes the
//!   destination no longer holds.

use std::cell::UnsafeCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tern_page::delta::create_delta;
use tern_page::{DeltaOffload, PAGE_SIZE};

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

/// Lookups of cached pages (deltas and overflows) a worker's gate counts
/// before it decides again whether caching pays.
const GATE_WINDOW: u32 = 64;
/// The gate closes when fewer than one lookup in this many gives a delta:
/// an overflow costs a copy and a scan of the page (about 2 µs on the
/// 2-core VM), a delta saves most of a page on the wire (about 30 µs of a
/// 1 Gbit/s link), so deltas pay down to a small share.
const CLOSE_BELOW_ONE_IN: u32 = 8;
/// The gate reopens when the sample gives a delta at least once in this
/// many lookups (above the closing share, so that it does not flap).
const REOPEN_FROM_ONE_IN: u32 = 4;
/// While the gate is closed, one page in this many (a fixed sample, by the
/// page's identity) still goes through the cache, to keep measuring.
const PROBE_ONE_IN: u64 = 16;

/// Which of a worker's pages go through the delta cache: its admission
/// policy, one per worker (no shared state on the per-page path).
///
/// Going through the cache costs a page a copy out of guest memory, a copy
/// into its slot and, the first time the slot is used, a page fault: about
/// 2 µs a page on the 2-core VM (docs/benchmarks-qemu.md), paid whether or
/// not a delta ever comes of it. So a page is admitted
///
/// * only from the second pass on (`iteration >= 1`): every page is in the
///   first pass and goes once whatever happens; it is worth caching only
///   if it comes back, and a page in a later pass has come back (QEMU's
///   xbzrle likewise starts after the first pass);
/// * while the worker's recent lookups of cached pages give deltas: when
///   fewer than one in [`CLOSE_BELOW_ONE_IN`] of [`GATE_WINDOW`] lookups
///   did (pages rewritten whole), the gate closes and only a fixed sample
///   of pages ([`PROBE_ONE_IN`]) keeps going through the cache, so the
///   worker goes on measuring and reopens when deltas pay again.
///
/// The cache's invariant does not depend on the gate: a page it does not
/// admit is sent from guest memory and its slot is forgotten
/// ([`DeltaCache::forget`]), as for a zero page.
#[derive(Debug)]
pub(super) struct DeltaGate {
    open: bool,
    lookups: u32,
    deltas: u32,
    /// Times the gate closed, for the log.
    closings: u64,
}

impl Default for DeltaGate {
    fn default() -> Self {
        Self {
            open: true,
            lookups: 0,
            deltas: 0,
            closings: 0,
        }
    }
}

impl DeltaGate {
    /// Whether page `page` of `region`, sent in `iteration`, goes through
    /// the cache.
    pub(super) fn admits(&self, iteration: u32, region: usize, page: u32) -> bool {
        iteration >= 1 && (self.open || is_probe(region, page))
    }

    /// Counts what the cache did with an admitted page.
    pub(super) fn record(&mut self, outcome: DeltaOutcome) {
        match outcome {
            DeltaOutcome::Delta(_) => self.deltas += 1,
            DeltaOutcome::Overflow => {}
            // Says nothing about whether deltas pay.
            DeltaOutcome::Miss => return,
        }
        self.lookups += 1;
        if self.lookups < GATE_WINDOW {
            return;
        }
        let was_open = self.open;
        self.open = if was_open {
            self.deltas * CLOSE_BELOW_ONE_IN >= self.lookups
        } else {
            self.deltas * REOPEN_FROM_ONE_IN >= self.lookups
        };
        if was_open && !self.open {
            self.closings += 1;
            tracing::debug!(
                deltas = self.deltas,
                lookups = self.lookups,
                closings = self.closings,
                "deltas do not pay: only a sample of pages goes through the delta cache"
            );
        } else if !was_open && self.open {
            tracing::debug!(
                deltas = self.deltas,
                "deltas pay again: the delta cache reopens"
            );
        }
        self.lookups = 0;
        self.deltas = 0;
    }
}

/// Whether the page is in the sample that goes through the cache while a
/// gate is closed: a fixed one in [`PROBE_ONE_IN`], by a hash of the page's
/// identity (so strided working sets are sampled too), so that a probe
/// cached in one pass is looked up in the next.
fn is_probe(region: usize, page: u32) -> bool {
    let identity = ((region as u64) << 32) | u64::from(page);
    (identity.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) & (PROBE_ONE_IN - 1) == 0
}

/// Fewer pages dirtied again than this (4 MiB) are not worth a cache: they
/// cost the link little whole, and say little about the working set.
pub(super) const AUTO_MIN_REDIRTIED_PAGES: u64 = 1024;
/// Slots per page dirtied again: the cache is direct-mapped, so twice the
/// working set keeps most of its pages out of each other's slots. Memory is
/// touched only for slots in use (see [`DeltaCache::new`]).
pub(super) const AUTO_SLOTS_PER_PAGE: u64 = 2;

/// What `auto` does about a delta cache at an iteration boundary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum DeltaCacheDecision {
    /// Not yet: too few pages were dirtied again to tell.
    Wait,
    /// No cache, for the reason given.
    Off(String),
    /// A cache of this many bytes, for the reason given.
    On(u64, String),
}

/// Whether and how large a delta cache pays, from `redirtied` (the pages
/// the guest wrote while the previous iteration was sent, which this one
/// sends again: the working set) and `allowance` (the most memory the
/// operator gives it). Pure. The admission gate (`DeltaGate`) then decides
/// page by page whether deltas pay; this sizes the cache to the working
/// set so its slots hold it.
pub(super) fn size_delta_cache(redirtied: u64, allowance: u64) -> DeltaCacheDecision {
    let page = PAGE_SIZE as u64;
    if allowance < page {
        return DeltaCacheDecision::Off("no memory is allowed for a delta cache".into());
    }
    if redirtied < AUTO_MIN_REDIRTIED_PAGES {
        return DeltaCacheDecision::Wait;
    }
    let wanted = redirtied
        .saturating_mul(AUTO_SLOTS_PER_PAGE)
        .saturating_mul(page);
    let bytes = wanted.min(allowance / page * page);
    let reason = format!(
        "{redirtied} pages ({} MiB) were dirtied again while the last iteration was sent: \
         {AUTO_SLOTS_PER_PAGE} slots per page, within the {} MiB allowed",
        (redirtied * page) >> 20,
        allowance >> 20
    );
    DeltaCacheDecision::On(bytes, reason)
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
    offload: Option<Arc<dyn DeltaOffload>>,
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
    pub(super) fn new(bytes: u64, offload: Option<Arc<dyn DeltaOffload>>) -> Self {
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
    pub(super) fn bytes(&self) -> u64 {
        (self.states.len() * PAGE_SIZE) as u64
    }

    fn slot(&self, region: usize, page: u32) -> (&AtomicU64, &SlotBytes) {
        // Regions apart by a large odd stride, pages of a region adjacent.
        let key = (region as u64).wrapping_mul(0x9e37_79b9) + u64::from(page);
        let index = crate::numeric::saturating_usize(key % self.states.len() as u64);
        (&self.states[index], &self.bytes[index])
    }

    /// Encodes `copy`, the bytes of page `page` of `region` about to be
    /// sent, against its cached version into `delta`, and caches `copy` in
    /// its place. The caller must send exactly `copy` (as the delta, or
    /// whole for an overflow or a miss).
    pub(super) fn encode(
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
    pub(super) fn forget(&self, region: usize, page: u32) {
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
mod sizing_tests {
    use super::{AUTO_MIN_REDIRTIED_PAGES, DeltaCacheDecision, size_delta_cache};

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_cache_is_sized_from_the_working_set_within_the_allowance() {
        // 512 MiB dirtied again: a 1 GiB cache when 2 GiB are allowed,
        let DeltaCacheDecision::On(bytes, reason) = size_delta_cache(131_072, 2048 * MIB) else {
            panic!("expected a cache");
        };
        assert_eq!(bytes, 1024 * MIB);
        assert!(reason.contains("131072 pages (512 MiB)"), "{reason}");
        // ...the allowance when less is allowed,
        assert_eq!(
            size_delta_cache(131_072, 300 * MIB),
            DeltaCacheDecision::On(300 * MIB, size_delta_cache(131_072, 300 * MIB).reason())
        );
        // ...none without an allowance, and no decision yet while the
        // guest dirties too little to tell.
        assert!(matches!(
            size_delta_cache(131_072, 0),
            DeltaCacheDecision::Off(_)
        ));
        assert_eq!(
            size_delta_cache(AUTO_MIN_REDIRTIED_PAGES - 1, 2048 * MIB),
            DeltaCacheDecision::Wait
        );
    }

    impl DeltaCacheDecision {
        fn reason(&self) -> String {
            match self {
                Self::Wait => String::new(),
                Self::Off(reason) | Self::On(_, reason) => reason.clone(),
            }
        }
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

    fn gate_after(outcomes: &[(DeltaOutcome, u32)]) -> DeltaGate {
        let mut gate = DeltaGate::default();
        for &(outcome, times) in outcomes {
            for _ in 0..times {
                gate.record(outcome);
            }
        }
        gate
    }

    fn admitted_in(gate: &DeltaGate, iteration: u32, pages: u32) -> usize {
        (0..pages)
            .filter(|&page| gate.admits(iteration, 0, page))
            .count()
    }

    #[test]
    fn the_first_pass_goes_around_the_cache_and_later_passes_through_it() {
        let gate = DeltaGate::default();
        assert_eq!(admitted_in(&gate, 0, 1000), 0);
        assert_eq!(admitted_in(&gate, 1, 1000), 1000);
        assert_eq!(admitted_in(&gate, 7, 1000), 1000);
    }

    #[test]
    fn mostly_overflowing_lookups_close_the_gate_to_a_sample() {
        // Misses say nothing about deltas: the gate stays open.
        let gate = gate_after(&[(DeltaOutcome::Miss, 10 * GATE_WINDOW)]);
        assert_eq!(admitted_in(&gate, 1, 1000), 1000);
        // One delta in eight lookups still pays.
        let gate = gate_after(&[
            (DeltaOutcome::Delta(10), GATE_WINDOW / 8),
            (DeltaOutcome::Overflow, GATE_WINDOW - GATE_WINDOW / 8),
        ]);
        assert_eq!(admitted_in(&gate, 1, 1000), 1000);
        let gate = gate_after(&[
            (DeltaOutcome::Delta(10), GATE_WINDOW / 8 - 1),
            (DeltaOutcome::Overflow, GATE_WINDOW - GATE_WINDOW / 8 + 1),
        ]);
        let sampled = admitted_in(&gate, 1, 16_384);
        assert!((512..=2048).contains(&sampled), "{sampled} of 16384");
        // The sample is fixed: the same pages every pass and every worker.
        let other = gate_after(&[(DeltaOutcome::Overflow, GATE_WINDOW)]);
        assert!((0..16_384).all(|page| gate.admits(2, 3, page) == other.admits(5, 3, page)));
        // Still nothing of the first pass.
        assert_eq!(admitted_in(&gate, 0, 16_384), 0);
    }

    #[test]
    fn deltas_in_the_sample_reopen_the_gate() {
        let closed = [(DeltaOutcome::Overflow, GATE_WINDOW)];
        // One in eight reopens nothing: above the closing share only.
        let gate = gate_after(&[
            closed[0],
            (DeltaOutcome::Delta(10), GATE_WINDOW / 8),
            (DeltaOutcome::Overflow, GATE_WINDOW - GATE_WINDOW / 8),
        ]);
        assert!(admitted_in(&gate, 1, 1000) < 1000);
        let gate = gate_after(&[
            closed[0],
            (DeltaOutcome::Delta(10), GATE_WINDOW / 4),
            (DeltaOutcome::Overflow, GATE_WINDOW - GATE_WINDOW / 4),
        ]);
        assert_eq!(admitted_in(&gate, 1, 1000), 1000);
    }

    /// A worker's steps (as `reuse.rs` takes them) against a model of the
    /// destination: whatever the gate does, after every pass the
    /// destination holds the guest's pages, and a valid slot holds what
    /// the destination holds.
    #[test]
    fn the_destination_keeps_up_while_the_gate_closes_and_reopens() {
        const PAGES: u32 = 1024;
        let cache = DeltaCache::new(u64::from(PAGES) * PAGE_SIZE as u64, None);
        let mut gate = DeltaGate::default();
        let mut guest: Vec<Box<[u8; PAGE_SIZE]>> = (0..PAGES).map(|_| page(0)).collect();
        let mut destination = guest.clone();
        let mut record = [0u8; MAX_DELTA_LEN];
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut closed_passes, mut deltas_after_reopening) = (0, 0);
        // Passes 1-3 rewrite every page whole, passes 4-9 change one word.
        for iteration in 0..10u32 {
            for (index, bytes) in guest.iter_mut().enumerate() {
                if iteration == 0 {
                    bytes.fill(crate::numeric::low_byte(index as u64));
                } else if iteration <= 3 {
                    bytes
                        .iter_mut()
                        .for_each(|byte| *byte = crate::numeric::low_byte(next()));
                } else {
                    bytes[index % PAGE_SIZE] ^= 0x5a;
                }
            }
            if iteration >= 2 && admitted_in(&gate, iteration, PAGES) < PAGES as usize {
                closed_passes += 1;
            }
            for page in 0..PAGES {
                let sent = &guest[page as usize];
                let held = &mut destination[page as usize];
                if !gate.admits(iteration, 0, page) {
                    cache.forget(0, page);
                    **held = **sent;
                    continue;
                }
                let outcome = cache.encode(0, page, sent, &mut record);
                gate.record(outcome);
                match outcome {
                    DeltaOutcome::Delta(len) => {
                        apply_delta(&record[..len], held).unwrap();
                        deltas_after_reopening += u32::from(closed_passes > 0);
                    }
                    DeltaOutcome::Overflow | DeltaOutcome::Miss => **held = **sent,
                }
            }
            assert!(guest == destination, "pass {iteration}");
        }
        assert!(closed_passes >= 2, "the gate never closed");
        assert!(deltas_after_reopening > PAGES, "the gate never reopened");
    }
}

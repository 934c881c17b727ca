//! Memory digests, compared at switch-over.
//!
//! The digest is XXH3-128 over, for each region in order, the region's id
//! and the XXH3-64 of each of its pages. Page granularity lets both sides
//! hash on all cores, and lets the destination skip pages it never wrote:
//! they are known to be zero, and reading untouched memory costs a page
//! fault per page for nothing.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::guest::{MemoryRegion, PAGE_SIZE};
use crate::stats::thread_cpu_seconds;

/// XXH3-64 of a zero page, computed once.
pub(crate) fn zero_page_hash() -> u64 {
    static HASH: OnceLock<u64> = OnceLock::new();
    *HASH.get_or_init(|| xxh3_64(&[0u8; PAGE_SIZE]))
}

/// A digest and what it cost.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub(crate) struct Digest {
    /// The digest.
    pub value: u128,
    /// CPU seconds of the hashing threads.
    pub cpu_seconds: f64,
    /// Wall-clock time the hashing took.
    pub elapsed: std::time::Duration,
}

/// Computes the digest of `regions` with up to `threads` threads, reading
/// all of memory: the reference the incremental digest must agree with.
/// `is_page_untouched(region_index, page)` may return true for a page known
/// to be all zero, which is then not read.
///
/// # Safety
/// Nothing may write to the regions during the call (the guest is paused and
/// no receiver runs).
#[cfg(test)]
pub(crate) unsafe fn memory_digest(
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
pub(crate) fn add_region(
    hasher: &mut Xxh3,
    region_id: u32,
    page_hashes: impl IntoIterator<Item = u64>,
) {
    hasher.update(&region_id.to_le_bytes());
    for hash in page_hashes {
        hasher.update(&hash.to_le_bytes());
    }
}

/// XXH3-64 of one page.
///
/// # Safety
/// `page` points to a readable page that nothing writes during the call.
pub(crate) unsafe fn page_hash(page: *const u8) -> u64 {
    // SAFETY: the caller's contract.
    xxh3_64(unsafe { std::slice::from_raw_parts(page, PAGE_SIZE) })
}

/// Threads to use for hashing: all cores.
pub(crate) fn digest_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Pages per audit slice: the auditor checks its stop flag and its pace
/// between slices.
const AUDIT_SLICE_PAGES: u64 = 64;

/// Pages per word of the stale bitmaps.
const BITS: u64 = 64;

/// The incremental digest: one hash per page, kept up to date while the
/// migration runs, so that taking the digest at switch-over costs little
/// more than combining the hashes. The digest is the same function of
/// memory as [`memory_digest`]'s (the same bytes go into the same hasher).
///
/// A page's hash is recorded by whoever read the page last after its last
/// legitimate change: on the source, the pipeline worker that encodes the
/// page for an iteration; on the destination, the receiver that wrote it.
/// Pages whose hash may no longer describe memory are *stale*: every page
/// of the source until first hashed, and every page an [`audit`] found
/// changed. Stale pages are hashed again from memory by [`finish`], when
/// nothing writes. Nothing ever marks a page fresh except a hash read from
/// memory; docs/verification.md explains why this cannot miss a change.
///
/// [`audit`]: PageHashes::audit
/// [`finish`]: PageHashes::finish
pub(crate) struct PageHashes {
    regions: Vec<MemoryRegion>,
    hashes: Vec<Vec<AtomicU64>>,
    stale: Vec<Vec<AtomicU64>>,
    /// Pages the auditors read, and audits that found a page changed.
    audited: AtomicU64,
    found_changed: AtomicU64,
    /// Complete audit passes over memory.
    audit_passes: AtomicU64,
    /// Tells the auditors to stop.
    audit_stop: AtomicBool,
    /// The auditors running at their lowered priority, by thread id; each
    /// takes itself off before it ends, under the lock, so an id here is
    /// always a live auditor's.
    lowered_auditors: Mutex<Vec<libc::pid_t>>,
}

/// What [`PageHashes::finish`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Finished {
    pub digest: Digest,
    /// Pages hashed again from memory (stale ones).
    pub rehashed_pages: u64,
}

impl PageHashes {
    /// Hashes for `regions`. With `all_stale`, every page starts stale (the
    /// source, whose memory holds anything); otherwise every page starts as
    /// a zero page (the destination's fresh memory).
    pub(crate) fn new(regions: &[MemoryRegion], all_stale: bool) -> Self {
        let zero = zero_page_hash();
        let fill = if all_stale { u64::MAX } else { 0 };
        Self {
            regions: regions.to_vec(),
            hashes: regions
                .iter()
                .map(|region| (0..region.pages()).map(|_| AtomicU64::new(zero)).collect())
                .collect(),
            stale: regions
                .iter()
                .map(|region| {
                    (0..region.pages().div_ceil(BITS))
                        .map(|_| AtomicU64::new(fill))
                        .collect()
                })
                .collect(),
            audited: AtomicU64::new(0),
            found_changed: AtomicU64::new(0),
            audit_passes: AtomicU64::new(0),
            audit_stop: AtomicBool::new(false),
            lowered_auditors: Mutex::new(Vec::new()),
        }
    }

    /// Records `hash` as page `page` of region `region` (an index into the
    /// regions), read from memory by the caller after the page's last
    /// change it knows of. Out-of-range pages are ignored.
    pub(crate) fn record(&self, region: usize, page: u64, hash: u64) {
        let Some(slot) = self
            .hashes
            .get(region)
            .and_then(|h| h.get(crate::numeric::saturating_usize(page)))
        else {
            return;
        };
        // Unmark first, then publish the hash with Release: an auditor that
        // reads this hash (Acquire) and then finds memory different marks
        // the page after this unmarking, so its finding survives.
        if let Some(word) = self.stale[region].get((page / BITS) as usize) {
            word.fetch_and(!(1 << (page % BITS)), Ordering::Relaxed);
        }
        slot.store(hash, Ordering::Release);
    }

    /// Hashes page `page` of region `region` from memory and records it.
    ///
    /// # Safety
    /// The region's mapping is live. Concurrent writes to the page make the
    /// hash stale, never unsound to compute (the bytes are only hashed);
    /// whoever writes must make sure the page is recorded again or marked
    /// stale afterwards.
    pub(crate) unsafe fn hash_and_record(&self, region: usize, page: u64) {
        let Some(ptr) = self.regions.get(region).and_then(|r| r.page_ptr(page)) else {
            return;
        };
        // SAFETY: `page_ptr` bounds-checked the page; the caller's contract.
        let hash = unsafe { page_hash(ptr) };
        self.record(region, page, hash);
    }

    /// Marks every page stale: [`PageHashes::finish`] hashes all of memory
    /// again, except pages recorded after this call.
    pub(crate) fn mark_all_stale(&self) {
        for word in self.stale.iter().flatten() {
            word.store(u64::MAX, Ordering::Relaxed);
        }
    }

    /// Marks a page stale: [`PageHashes::finish`] hashes it again.
    pub(crate) fn mark_stale(&self, region: usize, page: u64) {
        if let Some(word) = self
            .stale
            .get(region)
            .and_then(|words| words.get((page / BITS) as usize))
        {
            word.fetch_or(1 << (page % BITS), Ordering::Relaxed);
        }
    }

    fn is_stale(&self, region: usize, page: u64) -> bool {
        self.stale[region][(page / BITS) as usize].load(Ordering::Relaxed) & (1 << (page % BITS))
            != 0
    }

    /// Ends every [`PageHashes::audit`] soon (within one slice), and gives
    /// each auditor back the caller's priority: the switch-over waits for
    /// the auditors to end, and at the lowest priority on a busy host one
    /// waited for a CPU for 250 ms while the guest was paused (issue 31).
    /// Raising a priority needs the right to (`CAP_SYS_NICE`, or an
    /// `RLIMIT_NICE` that allows it); without it the auditor ends at its
    /// low priority, as before.
    pub(crate) fn stop_audit(&self) {
        self.audit_stop.store(true, Ordering::Relaxed);
        let mut lowered = self
            .lowered_auditors
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for thread in lowered.drain(..) {
            restore_priority(thread);
        }
    }

    /// Reads memory page by page, round and round, within `pace`, until
    /// [`PageHashes::stop_audit`]; a page whose memory no longer
    /// matches its recorded hash is marked stale. `skip(region, page)`
    /// leaves out pages not worth reading (never written on the
    /// destination). Only ever marks pages stale, so it cannot hide a
    /// change; it finds changes nobody reported. Returns its CPU seconds.
    ///
    /// # Safety
    /// The regions' mappings stay live until this returns.
    pub(crate) unsafe fn audit(
        &self,
        pace: &AuditPace<'_>,
        skip: &(dyn Fn(usize, u64) -> bool + Sync),
        on_pass: &(dyn Fn() + Sync),
    ) -> f64 {
        if lower_this_threads_priority() {
            self.lowered_auditors
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(this_thread_id());
        }
        // Taken off the list however the audit ends, before the thread
        // does: `stop_audit` never renices an id a thread no longer has.
        let _off_the_list = OffTheList(self);
        let cpu_start = thread_cpu_seconds();
        let stop = &self.audit_stop;
        let started = Instant::now();
        let mut budget_used = 0u64;
        'passes: while !stop.load(Ordering::Relaxed) {
            for (region_index, region) in self.regions.iter().enumerate() {
                let mut first = 0;
                while first < region.pages() {
                    if stop.load(Ordering::Relaxed) {
                        break 'passes;
                    }
                    let end = (first + AUDIT_SLICE_PAGES).min(region.pages());
                    for page in first..end {
                        if skip(region_index, page) || self.is_stale(region_index, page) {
                            continue;
                        }
                        // SAFETY: the caller keeps the mapping live.
                        unsafe { self.audit_page(region_index, region, page) };
                        budget_used += PAGE_SIZE as u64;
                    }
                    first = end;
                    pace.wait_for_allowance(started, budget_used, stop);
                }
            }
            self.audit_passes.fetch_add(1, Ordering::Relaxed);
            on_pass();
        }
        thread_cpu_seconds() - cpu_start
    }

    /// # Safety
    /// `region` is region `region_index`, whose mapping is live.
    unsafe fn audit_page(&self, region_index: usize, region: &MemoryRegion, page: u64) {
        let recorded = self.hashes[region_index][crate::numeric::saturating_usize(page)]
            .load(Ordering::Acquire);
        let Some(ptr) = region.page_ptr(page) else {
            return;
        };
        // SAFETY: bounds-checked by `page_ptr`; the caller keeps it mapped.
        let actual = unsafe { page_hash(ptr) };
        self.audited.fetch_add(1, Ordering::Relaxed);
        if actual != recorded {
            self.found_changed.fetch_add(1, Ordering::Relaxed);
            self.mark_stale(region_index, page);
        }
    }

    /// About how long [`PageHashes::finish`] would take now with `threads`
    /// threads: the stale pages at the measured hashing speed, spread over
    /// the threads, and combining every page's hash (8 bytes a page, at the
    /// same speed per byte). Pages the last iteration sends are hashed by
    /// the pipeline as it sends them, inside its measured bandwidth.
    pub(crate) fn finish_estimate(&self, threads: usize) -> Duration {
        let stale: u64 = self
            .stale
            .iter()
            .flatten()
            .map(|word| u64::from(word.load(Ordering::Relaxed).count_ones()))
            .sum();
        self.estimate_for(stale, threads)
    }

    /// As [`PageHashes::finish_estimate`] with every page stale: what
    /// `--verify strict` costs.
    pub(crate) fn full_finish_estimate(&self, threads: usize) -> Duration {
        let pages: u64 = self.regions.iter().map(MemoryRegion::pages).sum();
        self.estimate_for(pages, threads)
    }

    fn estimate_for(&self, stale: u64, threads: usize) -> Duration {
        let pages: u64 = self.regions.iter().map(MemoryRegion::pages).sum();
        let rehash_ns = stale as f64 * page_hash_ns() / threads.max(1) as f64;
        let combine_ns = pages as f64 * page_hash_ns() * 8.0 / PAGE_SIZE as f64;
        Duration::from_secs_f64((rehash_ns + combine_ns) / 1e9)
    }

    /// Hashes every stale page again from memory, with up to `threads`
    /// threads, and returns the digest of all recorded hashes.
    ///
    /// # Safety
    /// Nothing writes guest memory or records hashes during the call (the
    /// guest is paused, the pipeline or the receivers are done).
    pub(crate) unsafe fn finish(&self, threads: usize) -> Finished {
        self.stop_audit();
        let started = Instant::now();
        let stale: Vec<(usize, u64)> = self.stale_pages();
        let threads = threads.clamp(1, stale.len().div_ceil(256).max(1));
        let per_thread = stale.len().div_ceil(threads).max(1);
        let mut cpu_seconds = 0.0;
        std::thread::scope(|scope| {
            let workers: Vec<_> = stale
                .chunks(per_thread)
                .map(|part| {
                    scope.spawn(move || {
                        let cpu_start = thread_cpu_seconds();
                        for &(region, page) in part {
                            // SAFETY: the caller guarantees nothing writes.
                            unsafe { self.hash_and_record(region, page) };
                        }
                        thread_cpu_seconds() - cpu_start
                    })
                })
                .collect();
            for worker in workers {
                cpu_seconds += worker.join().unwrap_or(0.0);
            }
        });
        tracing::debug!(
            audited_pages = self.audited.load(Ordering::Relaxed),
            audit_passes = self.audit_passes.load(Ordering::Relaxed),
            found_changed = self.found_changed.load(Ordering::Relaxed),
            rehashed_pages = stale.len(),
            "digest finished"
        );
        let combine_cpu = thread_cpu_seconds();
        let value = self.combine();
        cpu_seconds += thread_cpu_seconds() - combine_cpu;
        Finished {
            digest: Digest {
                value,
                cpu_seconds,
                elapsed: started.elapsed(),
            },
            rehashed_pages: stale.len() as u64,
        }
    }

    /// The digest of the hashes as recorded now, without hashing anything
    /// again: postcopy's destination records each late page's hash from
    /// the bytes it placed, while the guest already writes memory.
    pub(crate) fn recorded_digest(&self) -> u128 {
        self.combine()
    }

    fn stale_pages(&self) -> Vec<(usize, u64)> {
        let mut pages = Vec::new();
        for (region, (words, info)) in self.stale.iter().zip(&self.regions).enumerate() {
            for (index, word) in words.iter().enumerate() {
                let mut bits = word.load(Ordering::Relaxed);
                while bits != 0 {
                    let page = index as u64 * BITS + u64::from(bits.trailing_zeros());
                    bits &= bits - 1;
                    if page < info.pages() {
                        pages.push((region, page));
                    }
                }
            }
        }
        pages
    }

    /// The digest of the recorded hashes, in [`memory_digest`]'s format.
    /// The hashes go through a small buffer, so that combining a million of
    /// them costs about a millisecond.
    fn combine(&self) -> u128 {
        const BATCH: usize = 8192;
        let mut hasher = Xxh3::new();
        let mut buffer = [0u8; BATCH * 8];
        for (region, hashes) in self.regions.iter().zip(&self.hashes) {
            hasher.update(&region.id().to_le_bytes());
            for batch in hashes.chunks(BATCH) {
                for (slot, hash) in buffer.chunks_exact_mut(8).zip(batch) {
                    slot.copy_from_slice(&hash.load(Ordering::Acquire).to_le_bytes());
                }
                hasher.update(&buffer[..batch.len() * 8]);
            }
        }
        hasher.digest128()
    }
}

/// Nanoseconds to hash one page that is not in the caches, measured once
/// on 8 MiB (larger than most L2 caches; a little cache-friendlier than
/// guest memory, so the estimate errs low by a little; the digest's share
/// of the downtime is reported as measured).
fn page_hash_ns() -> f64 {
    static NANOS: OnceLock<f64> = OnceLock::new();
    *NANOS.get_or_init(measure_page_hash_ns)
}

fn measure_page_hash_ns() -> f64 {
    const PAGES: usize = 2048;
    let buffer: Vec<u8> = (0..PAGES * PAGE_SIZE)
        .map(|i| crate::numeric::low_byte(i as u64 % 251))
        .collect();
    let started = Instant::now();
    let mut sink = 0u64;
    for page in buffer.chunks_exact(PAGE_SIZE) {
        sink ^= xxh3_64(page);
    }
    std::hint::black_box(sink);
    started.elapsed().as_nanos() as f64 / PAGES as f64
}

/// Gives the calling thread the lowest scheduling priority (nice 19), so
/// that an audit takes the CPU the migration leaves and slows down rather
/// than the migration when the cores are busy. Best effort.
fn lower_this_threads_priority() -> bool {
    // SAFETY: `gettid` has no preconditions; `setpriority` on a thread id
    // changes only that thread's nice value (Linux), and a failure is
    // harmless, only leaving the priority as it was.
    let failed = unsafe {
        let thread = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, thread.cast_unsigned(), 19) != 0
    };
    if failed {
        tracing::debug!("cannot lower the audit thread's priority");
    }
    !failed
}

fn this_thread_id() -> libc::pid_t {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::gettid() }
}

/// Gives auditor `thread` the calling thread's nice value; a refusal (no
/// right to raise a priority) leaves it as it was.
fn restore_priority(thread: libc::pid_t) {
    // SAFETY: getpriority and setpriority on thread ids only read and set
    // nice values (Linux); `thread` is a live auditor (the caller holds
    // the list it is taken off before it ends). getpriority returns the
    // nice value itself for PRIO_PROCESS, -1 being a valid one: errno
    // tells a failure, which then leaves the auditor as it is.
    let restored = unsafe {
        *libc::__errno_location() = 0;
        let own = libc::getpriority(libc::PRIO_PROCESS, this_thread_id().cast_unsigned());
        *libc::__errno_location() == 0
            && libc::setpriority(libc::PRIO_PROCESS, thread.cast_unsigned(), own) == 0
    };
    if !restored {
        tracing::debug!(
            thread,
            "cannot raise the stopping auditor's priority: it ends at its low one"
        );
    }
}

/// Takes the auditor running on this thread off the lowered list when it
/// ends.
struct OffTheList<'a>(&'a PageHashes);

impl Drop for OffTheList<'_> {
    fn drop(&mut self) {
        let thread = this_thread_id();
        self.0
            .lowered_auditors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|&listed| listed != thread);
    }
}

/// How much an audit may read: its CPU is kept in proportion to the
/// hashing the migration does anyway, whatever the link's speed. On a
/// 1 Gbit/s link a fixed 128 MiB/s pace read all of a 3 GiB guest's data
/// again on each side during a 13-23 s migration, which was most of what
/// verification cost in CPU; tied to the data moved, the audits read an
/// eighth as much again, plus a slow floor that keeps them going while no
/// data moves (a converged guest waiting for its switch-over).
pub(crate) struct AuditPace<'a> {
    /// Never faster than this.
    pub max_bytes_per_second: u64,
    /// Always allowed, whatever the data moved.
    pub floor_bytes_per_second: u64,
    /// The data-page bytes this side has moved (sent or received) so far.
    pub data_bytes: &'a (dyn Fn() -> u64 + Sync),
}

impl AuditPace<'_> {
    /// The share of the data moved that the audit may read again.
    const DATA_SHARE_DIVISOR: u64 = 8;

    /// A pace for the engine's audits, counting `data_bytes`.
    pub(crate) fn proportional(data_bytes: &(dyn Fn() -> u64 + Sync)) -> AuditPace<'_> {
        AuditPace {
            max_bytes_per_second: 128 << 20,
            floor_bytes_per_second: 8 << 20,
            data_bytes,
        }
    }

    /// No limit: tests that want a pass at once.
    #[cfg(test)]
    fn unlimited() -> AuditPace<'static> {
        AuditPace {
            max_bytes_per_second: u64::MAX,
            floor_bytes_per_second: u64::MAX,
            data_bytes: &|| 0,
        }
    }

    /// Bytes the audit may have read `elapsed` after it started.
    fn allowance(&self, elapsed: Duration) -> u64 {
        let seconds = elapsed.as_secs_f64();
        let floor =
            crate::numeric::saturating_u64_from_f64(self.floor_bytes_per_second as f64 * seconds);
        let earned = floor.saturating_add((self.data_bytes)() / Self::DATA_SHARE_DIVISOR);
        earned.min(crate::numeric::saturating_u64_from_f64(
            self.max_bytes_per_second as f64 * seconds,
        ))
    }

    /// Sleeps (in short steps, so `stop` is heard) until `used` bytes are
    /// within the allowance.
    fn wait_for_allowance(&self, started: Instant, used: u64, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) && self.allowance(started.elapsed()) < used {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
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

    fn region_over(memory: &mut [u8]) -> MemoryRegion {
        // SAFETY: the caller's vector outlives the region and only the test
        // accesses it.
        unsafe {
            MemoryRegion::new(
                3,
                0,
                NonNull::new(memory.as_mut_ptr()).unwrap(),
                memory.len() as u64,
            )
        }
    }

    #[test]
    fn the_audit_allowance_follows_the_data_moved_within_floor_and_cap() {
        let moved = AtomicU64::new(0);
        let data_bytes = || moved.load(Ordering::Relaxed);
        let pace = AuditPace {
            max_bytes_per_second: 100,
            floor_bytes_per_second: 10,
            data_bytes: &data_bytes,
        };
        let second = Duration::from_secs(1);
        assert_eq!(pace.allowance(second), 10, "the floor alone");
        moved.store(400, Ordering::Relaxed);
        assert_eq!(pace.allowance(second), 60, "floor + an eighth of the data");
        moved.store(8000, Ordering::Relaxed);
        assert_eq!(pace.allowance(second), 100, "never above the cap");
        assert_eq!(pace.allowance(2 * second), 200);
    }

    #[test]
    fn finishing_all_stale_pages_is_the_full_digest() {
        let mut memory: Vec<u8> = (0..64 * PAGE_SIZE)
            .map(|i| crate::numeric::low_byte(i as u64 * 7 % 251))
            .collect();
        let region = region_over(&mut memory);
        let hashes = PageHashes::new(&[region], true);
        // SAFETY: nothing writes during the calls.
        let finished = unsafe { hashes.finish(2) };
        assert_eq!(finished.rehashed_pages, 64);
        // SAFETY: as above.
        let full = unsafe { memory_digest(&[region], 1, &|_, _| false) };
        assert_eq!(finished.digest.value, full.value);
        // Everything is fresh now: finishing again reads nothing.
        // SAFETY: as above.
        let again = unsafe { hashes.finish(2) };
        assert_eq!(again.rehashed_pages, 0);
        assert_eq!(again.digest.value, full.value);
    }

    fn nice_of(thread: libc::pid_t) -> libc::c_int {
        // SAFETY: getpriority only reads a nice value.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, thread.cast_unsigned()) }
    }

    #[test]
    fn stopping_the_audit_gives_the_auditor_back_the_callers_priority() {
        let mut memory = vec![0u8; 16 * PAGE_SIZE];
        let region = region_over(&mut memory);
        let hashes = PageHashes::new(&[region], false);
        let (at_pass_end, passed) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let released = Mutex::new(released);
        std::thread::scope(|scope| {
            // Dropped as the test fails too: the auditor is never held.
            let release = release;
            scope.spawn(|| {
                let on_pass = || {
                    let _ = at_pass_end.send(this_thread_id());
                    // Held here, still listed, until the test has looked.
                    let _ = released
                        .lock()
                        .unwrap()
                        .recv_timeout(Duration::from_secs(60));
                };
                // SAFETY: the memory outlives the scope; nothing writes.
                unsafe { hashes.audit(&AuditPace::unlimited(), &|_, _| false, &on_pass) };
            });
            let auditor = passed
                .recv_timeout(Duration::from_secs(60))
                .expect("the audit's first pass");
            assert_eq!(
                nice_of(auditor),
                19,
                "the auditor runs at the lowest priority"
            );
            hashes.stop_audit();
            let own = nice_of(this_thread_id());
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } == 0 {
                assert_eq!(
                    nice_of(auditor),
                    own,
                    "stopped, it runs at the caller's priority"
                );
            } else {
                // Not permitted to raise it: nothing fails, it stays low.
                assert!(nice_of(auditor) >= own);
            }
            let _ = release.send(());
        });
    }

    #[test]
    fn a_change_after_hashing_is_found_by_the_audit() {
        let mut memory = vec![0u8; 32 * PAGE_SIZE];
        let region = region_over(&mut memory);
        let hashes = PageHashes::new(&[region], false);
        for page in 0..32 {
            // SAFETY: nothing writes during the call.
            unsafe { hashes.hash_and_record(0, page) };
        }
        memory[9 * PAGE_SIZE + 100] = 0xAB;
        let passes = AtomicU64::new(0);
        // The audit runs until told to stop; stop it after its first pass.
        // SAFETY: the memory outlives the call and nothing writes meanwhile.
        unsafe {
            hashes.audit(&AuditPace::unlimited(), &|_, _| false, &|| {
                passes.fetch_add(1, Ordering::Relaxed);
                hashes.stop_audit();
            })
        };
        assert_eq!(passes.load(Ordering::Relaxed), 1);
        assert!(hashes.is_stale(0, 9));
        assert!(!hashes.is_stale(0, 8));
        // SAFETY: nothing writes.
        let finished = unsafe { hashes.finish(1) };
        assert_eq!(finished.rehashed_pages, 1);
        // SAFETY: as above.
        let full = unsafe { memory_digest(&[region], 1, &|_, _| false) };
        assert_eq!(finished.digest.value, full.value);
    }

    #[test]
    fn a_change_without_audit_or_record_is_not_seen() {
        // The documented limit: the digest trusts recorded hashes unless an
        // audit or a record says otherwise.
        let mut memory = vec![0u8; 8 * PAGE_SIZE];
        let region = region_over(&mut memory);
        let hashes = PageHashes::new(&[region], false);
        memory[PAGE_SIZE] = 1;
        // SAFETY: nothing writes.
        let finished = unsafe { hashes.finish(1) };
        // SAFETY: as above.
        let full = unsafe { memory_digest(&[region], 1, &|_, _| false) };
        assert_ne!(finished.digest.value, full.value);
        hashes.mark_stale(0, 1);
        // SAFETY: as above.
        assert_eq!(unsafe { hashes.finish(1) }.digest.value, full.value);
    }

    #[test]
    fn recording_a_page_leaves_the_other_pages_of_its_word_stale() {
        let mut memory = vec![0u8; 130 * PAGE_SIZE];
        let region = region_over(&mut memory);
        let hashes = PageHashes::new(&[region], true);
        // SAFETY: nothing writes during the call.
        unsafe { hashes.hash_and_record(0, 65) };
        let stale = hashes.stale_pages();
        assert_eq!(stale.len(), 129, "only page 65 is fresh");
        assert!(!hashes.is_stale(0, 65));
        for page in [0, 64, 66, 127, 128, 129] {
            assert!(hashes.is_stale(0, page), "page {page} lost its stale mark");
        }
    }

    #[test]
    fn the_finish_estimate_counts_stale_pages_over_the_threads() {
        // 256 MiB, never touched (the estimate reads no memory).
        let mut memory = vec![0u8; 65_536 * PAGE_SIZE];
        let region = region_over(&mut memory);
        let hashes = PageHashes::new(&[region], false);
        let combine_only = hashes.finish_estimate(1);
        assert!(
            combine_only > Duration::ZERO,
            "combining 65,536 hashes costs time"
        );
        for page in 0..32_768 {
            hashes.mark_stale(0, page);
        }
        let one_thread = hashes.finish_estimate(1);
        let two_threads = hashes.finish_estimate(2);
        let every_page = hashes.full_finish_estimate(1);
        // Rehashing 32,768 pages costs 32,768 page hashes; combining 65,536
        // hashes of 8 bytes costs 128 page hashes: exact ratios of one
        // measured figure.
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
        assert!((ratio(one_thread, combine_only) - 257.0).abs() < 0.5);
        assert!((ratio(one_thread, two_threads) - 32_896.0 / 16_512.0).abs() < 0.01);
        assert!((ratio(every_page, combine_only) - 513.0).abs() < 0.5);
    }

    #[test]
    fn the_recorded_digest_is_the_memory_digest_of_what_was_recorded() {
        // Postcopy's destination takes its digest this way: from the hashes
        // recorded as pages were placed, never reading memory again.
        let mut memory: Vec<u8> = (0..40 * PAGE_SIZE)
            .map(|i| crate::numeric::low_byte(i as u64 * 13 % 253))
            .collect();
        let region = region_over(&mut memory);
        let hashes = PageHashes::new(&[region], true);
        for page in 0..40 {
            // SAFETY: nothing writes during the call.
            unsafe { hashes.hash_and_record(0, page) };
        }
        // SAFETY: as above.
        let full = unsafe { memory_digest(&[region], 1, &|_, _| false) };
        assert_eq!(hashes.recorded_digest(), full.value);
        memory[7 * PAGE_SIZE] ^= 1;
        // SAFETY: as above.
        let changed = unsafe { memory_digest(&[region], 1, &|_, _| false) };
        assert_ne!(
            hashes.recorded_digest(),
            changed.value,
            "nothing was recorded again"
        );
        // SAFETY: as above.
        unsafe { hashes.hash_and_record(0, 7) };
        assert_eq!(hashes.recorded_digest(), changed.value);
    }

    /// The measured cost of hashing a page feeds the downtime estimate: a
    /// 4 KiB xxh3 takes a few hundred ns on today's cores (well over 20 ns
    /// even at 100 GB/s) and far less than 1 ms even under heavy load.
    #[test]
    fn the_measured_page_hash_cost_is_plausible() {
        let nanos = measure_page_hash_ns();
        assert!((20.0..1_000_000.0).contains(&nanos), "{nanos} ns per page");
        assert!((20.0..1_000_000.0).contains(&page_hash_ns()));
    }

    /// The audit waits for its allowance before reading more: 100 bytes at
    /// a floor and cap of 1,000 bytes a second cannot be read before 0.1 s
    /// (a lower bound, which no load can break); a stop ends the wait.
    #[test]
    fn the_audit_waits_for_its_allowance_unless_stopped() {
        let pace = AuditPace {
            max_bytes_per_second: 1_000,
            floor_bytes_per_second: 1_000,
            data_bytes: &|| 0,
        };
        let running = AtomicBool::new(false);
        let started = Instant::now();
        pace.wait_for_allowance(started, 100, &running);
        assert!(started.elapsed() >= Duration::from_millis(100));
        let stopped = AtomicBool::new(true);
        // Returns at once: an allowance of a billion bytes would take 11 days.
        pace.wait_for_allowance(Instant::now(), 1 << 30, &stopped);
    }
}

//! Paying for first-touch page faults in bulk: before a packet's pages are
//! written, each run of contiguous pages that has never held data is
//! populated with one `MADV_POPULATE_WRITE` instead of one fault per page.
//!
//! Measured on the 2-core shared VM (`cargo bench -p tern-engine --bench
//! first_touch`, docs/benchmarks.md): a fault on first write costs about
//! 1.8 µs per 4 KiB page with the copy, populating a run of 8 or more pages
//! first saves about 12 %, while a run of 1 costs about 18 % more (the
//! system call outweighs the one fault it replaces) and a run of 2 is even.
//! So only runs of at least [`MIN_RUN`] pages are populated; shorter ones
//! keep faulting. Zero pages are never populated: a page that stays zero
//! keeps costing nothing.
//!
//! With a userfaultfd (`userfault.rs`), which wins at every run length,
//! none of this runs: fresh pages are placed whole instead.

use std::sync::atomic::Ordering;

use tern_wire::{PageEntry, PageKind};

use super::shared::ReceiverShared;
use crate::error::MigrationError;
use crate::guest::PAGE_SIZE;

/// The shortest run of pages worth one `MADV_POPULATE_WRITE`.
const MIN_RUN: usize = 8;

/// Populates every run of at least [`MIN_RUN`] contiguous pages of `kind`
/// among `entries` (whose pages in memory are `pages`) that no packet has
/// written yet. A kernel that refuses (before Linux 5.14, or memory the
/// call does not apply to) turns populating off for the session: the
/// writes then fault as before. With a userfaultfd (`userfault.rs`) this
/// does nothing: fresh pages are placed there instead.
pub(super) fn populate_runs(
    shared: &ReceiverShared<'_>,
    region: usize,
    entries: &[PageEntry],
    pages: &[*mut u8],
    kind: PageKind,
) {
    if shared.userfault.is_some() || !shared.populate.load(Ordering::Relaxed) {
        return;
    }
    let fresh = |entry: &PageEntry| entry.kind == kind;
    for_each_fresh_run(shared, region, entries, pages, fresh, |start, len| {
        populate(shared, start, len);
        Ok(())
    })
    .unwrap_or(());
}

/// With a userfaultfd, places as zeros every page a packet is about to
/// write other than through the bounce buffer (decompressed, duplicated
/// or rebuilt from a delta) that no packet has written yet, so that the
/// write finds it as a first-touch fault would have.
pub(super) fn place_fresh_as_zeros(
    shared: &ReceiverShared<'_>,
    region: usize,
    entries: &[PageEntry],
    pages: &[*mut u8],
) -> Result<(), MigrationError> {
    let Some(userfault) = &shared.userfault else {
        return Ok(());
    };
    let written_in_place =
        |entry: &PageEntry| !matches!(entry.kind, PageKind::Raw | PageKind::Zero);
    for_each_fresh_run(
        shared,
        region,
        entries,
        pages,
        written_in_place,
        |start, len| {
            // SAFETY: a run of whole pages inside the region (each came from
            // `page_ptr`, and they are contiguous) claimed by the caller's
            // packet for this iteration.
            unsafe { userfault.place_zeros(start, len) }
                .map_err(|error| MigrationError::Internal(format!("placing fresh pages: {error}")))
        },
    )
}

/// Calls `each` with the start and length of every run of contiguous pages
/// among `entries` (whose pages in memory are `pages`) that `wanted`
/// selects and no packet has written yet.
fn for_each_fresh_run(
    shared: &ReceiverShared<'_>,
    region: usize,
    entries: &[PageEntry],
    pages: &[*mut u8],
    wanted: impl Fn(&PageEntry) -> bool,
    mut each: impl FnMut(*mut u8, usize) -> Result<(), MigrationError>,
) -> Result<(), MigrationError> {
    let populated = &shared.populated[region];
    let mut run_start: Option<(*mut u8, usize)> = None;
    let mut previous: *mut u8 = std::ptr::null_mut();
    for (entry, &ptr) in entries.iter().zip(pages) {
        let fresh = wanted(entry) && !populated.get(u64::from(entry.page_index));
        let extends = fresh && run_start.is_some() && ptr == previous.wrapping_add(PAGE_SIZE);
        if !extends {
            if let Some((start, len)) = run_start.take() {
                each(start, len)?;
            }
            if fresh {
                run_start = Some((ptr, 0));
            }
        }
        if let Some((_, len)) = &mut run_start {
            *len += 1;
        }
        previous = ptr;
    }
    match run_start {
        Some((start, len)) => each(start, len),
        None => Ok(()),
    }
}

/// Populates `pages` pages from `start` if the run is long enough to pay.
fn populate(shared: &ReceiverShared<'_>, start: *mut u8, pages: usize) {
    if pages < MIN_RUN {
        return;
    }
    // SAFETY: `start` and the `pages - 1` pages after it are whole pages
    // inside one region (each came from `page_ptr`, and they are
    // contiguous), claimed by the caller's packet. MADV_POPULATE_WRITE
    // faults them in writable without changing their contents, so it
    // cannot disturb anything another thread reads.
    let result =
        unsafe { libc::madvise(start.cast(), pages * PAGE_SIZE, libc::MADV_POPULATE_WRITE) };
    if result != 0 {
        let error = std::io::Error::last_os_error();
        if shared.populate.swap(false, Ordering::Relaxed) {
            tracing::info!(%error, "MADV_POPULATE_WRITE refused: pages fault in on first write");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::destination::ReceiveStats;
    use crate::destination::test_memory::AnonymousMemory;
    use crate::source::CancelToken;

    const PAGES: usize = 32;

    /// Which pages of the `PAGES` pages at `base` are resident.
    fn resident(base: *mut u8) -> Vec<bool> {
        let mut vector = vec![0u8; PAGES];
        // SAFETY: `base` is a mapping of PAGES pages; `vector` has one
        // byte per page.
        let result = unsafe { libc::mincore(base.cast(), PAGES * PAGE_SIZE, vector.as_mut_ptr()) };
        assert_eq!(result, 0, "mincore: {}", std::io::Error::last_os_error());
        vector.iter().map(|&byte| byte & 1 == 1).collect()
    }

    fn entries(kind: PageKind, pages: std::ops::Range<u32>) -> Vec<PageEntry> {
        pages
            .map(|page_index| PageEntry {
                page_index,
                kind,
                encoded_len: 0,
            })
            .collect()
    }

    #[test]
    fn only_long_runs_of_fresh_pages_of_the_kind_are_populated() {
        let memory = AnonymousMemory::new(PAGES);
        let (base, len) = (memory.base, memory.len);
        // SAFETY: the mapping just made; 4 KiB pages so residency is per page.
        unsafe { libc::madvise(base.cast(), len, libc::MADV_NOHUGEPAGE) };
        let regions = [memory.region(5)];
        let setup = memory.setup(5);
        let stats = ReceiveStats::default();
        let cancel = CancelToken::new();
        let shared =
            ReceiverShared::new(&setup, &regions, 1, &stats, Duration::from_secs(1), &cancel);
        // Pages 0-9: a run of ten; 12-14: three (too short); 16-25: ten of
        // another kind; 26-31: six around page 28, which holds data already.
        let mut table = entries(PageKind::Raw, 0..10);
        table.extend(entries(PageKind::Raw, 12..15));
        table.extend(entries(PageKind::Compressed, 16..26));
        table.extend(entries(PageKind::Raw, 26..32));
        shared.populated[0].set(28);
        let pages: Vec<*mut u8> = table
            .iter()
            .map(|entry| regions[0].page_ptr(u64::from(entry.page_index)).unwrap())
            .collect();
        populate_runs(&shared, 0, &table, &pages, PageKind::Raw);
        assert!(
            shared.populate.load(Ordering::Relaxed),
            "MADV_POPULATE_WRITE refused"
        );
        let resident = resident(base);
        let expected: Vec<bool> = (0..PAGES).map(|page| page < 10).collect();
        assert_eq!(resident, expected);
    }
}

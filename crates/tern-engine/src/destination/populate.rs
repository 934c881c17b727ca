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

use std::sync::atomic::Ordering;

use tern_wire::{PageEntry, PageKind};

use super::shared::ReceiverShared;
use crate::guest::PAGE_SIZE;

/// The shortest run of pages worth one `MADV_POPULATE_WRITE`.
const MIN_RUN: usize = 8;

/// Populates every run of at least [`MIN_RUN`] contiguous pages of `kind`
/// among `entries` (whose pages in memory are `pages`) that no packet has
/// written yet. A kernel that refuses (before Linux 5.14, or memory the
/// call does not apply to) turns populating off for the session: the
/// writes then fault as before.
pub(super) fn populate_runs(
    shared: &ReceiverShared<'_>,
    region: usize,
    entries: &[PageEntry],
    pages: &[*mut u8],
    kind: PageKind,
) {
    if !shared.populate.load(Ordering::Relaxed) {
        return;
    }
    let populated = &shared.populated[region];
    let mut run_start: Option<(*mut u8, usize)> = None;
    let mut previous: *mut u8 = std::ptr::null_mut();
    for (entry, &ptr) in entries.iter().zip(pages) {
        let fresh = entry.kind == kind && !populated.get(u64::from(entry.page_index));
        let extends = fresh && run_start.is_some() && ptr == previous.wrapping_add(PAGE_SIZE);
        if !extends {
            if let Some((start, len)) = run_start.take() {
                populate(shared, start, len);
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
    if let Some((start, len)) = run_start {
        populate(shared, start, len);
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

//! The worker's steps for pages the destination can rebuild from what it
//! holds: duplicates (`dedup.rs`) and deltas (`delta_cache.rs`).

use tern_page::delta::MAX_DELTA_LEN;
use tern_wire::{MAX_PAGES_PER_PACKET, PageKind, PageRef};

use super::Shared;
use super::batch::{Batch, page_ptr};
use super::dedup::{DedupIndex, IndexedPage, Reference};
use super::delta_cache::{DeltaGate, DeltaOutcome};
use super::scratch::Scratch;
use crate::guest::PAGE_SIZE;

/// With the delta cache: decides which data pages go through it (the
/// worker's [`DeltaGate`]) and copies each of those once, so that
/// everything after (hash, cache, compression, send) sees the same bytes.
/// The others are read from guest memory, as without the cache.
pub(super) fn copy_admitted_pages(shared: &Shared, batch: &mut Batch, gate: &DeltaGate) {
    if shared.delta_cache.get().is_none() {
        return;
    }
    let region = &shared.regions[batch.region];
    let reuse = &mut batch.reuse;
    reuse.admitted.clear();
    reuse
        .admitted
        .extend(batch.pages.iter().zip(&batch.kinds).map(|(&page, &kind)| {
            kind != PageKind::Zero && gate.admits(batch.iteration, batch.region, page)
        }));
    if !reuse.admitted.contains(&true) {
        return;
    }
    reuse.copies.resize(MAX_PAGES_PER_PACKET * PAGE_SIZE, 0);
    for (position, &page) in batch.pages.iter().enumerate() {
        if !reuse.admitted[position] {
            continue;
        }
        let into = &mut reuse.copies[position * PAGE_SIZE..(position + 1) * PAGE_SIZE];
        // SAFETY: `page_ptr` is a whole page inside the region's mapping,
        // which outlives the migration; a racing guest write only makes the
        // copy stale, and that write is in the next dirty bitmap.
        unsafe {
            std::ptr::copy_nonoverlapping(page_ptr(region, page), into.as_mut_ptr(), PAGE_SIZE)
        };
    }
}

/// Where the batch's page at `position` is read from: its copy, or guest
/// memory.
pub(super) fn data_ptr(shared: &Shared, batch: &Batch, position: usize) -> *const u8 {
    match batch.reuse.copy(position) {
        Some(copy) => copy.as_ptr(),
        None => page_ptr(&shared.regions[batch.region], batch.pages[position]),
    }
}

/// Marks as duplicates the data pages whose bytes the destination already
/// holds, by the rules in `dedup.rs`; the others stay raw.
pub(super) fn find_duplicates(shared: &Shared, batch: &mut Batch, scratch: &mut Scratch) {
    let Some(index) = &shared.dedup else {
        return;
    };
    let Scratch {
        batch_pages,
        compare,
        ..
    } = scratch;
    // Pages of this batch that may be referenced: (hash, position).
    batch_pages.clear();
    for position in 0..batch.pages.len() {
        if batch.kinds[position] != PageKind::Raw {
            continue;
        }
        let hash = batch.reuse.hashes[position];
        let this_page = data_ptr(shared, batch, position);
        let earlier = batch_pages
            .iter()
            .find(|&&(other, at)| {
                other == hash && same_bytes(data_ptr(shared, batch, at), this_page, compare)
            })
            .map(|&(_, at)| (batch.region, batch.pages[at]));
        let source = earlier.or_else(|| indexed_source(shared, index, batch, position, compare));
        match source {
            Some((region, page)) => mark_duplicate(shared, batch, position, region, page),
            None => batch_pages.push((hash, position)),
        }
    }
}

/// A page of the index with the bytes of the batch's page at `position`
/// that this batch may reference (routing it to its channel if needed).
fn indexed_source(
    shared: &Shared,
    index: &DedupIndex,
    batch: &mut Batch,
    position: usize,
    compare: &mut [Vec<u8>; 2],
) -> Option<(usize, u32)> {
    let found = index.candidate(batch.reuse.hashes[position])?;
    if found.region == batch.region && found.page == batch.pages[position] {
        return None;
    }
    let same_iteration = found.in_iteration(batch.iteration);
    if same_iteration
        && batch
            .reuse
            .route
            .is_some_and(|route| route != found.channel)
    {
        return None;
    }
    let source = shared
        .regions
        .get(found.region)?
        .page_ptr(u64::from(found.page))?;
    if !same_bytes(
        source.cast_const(),
        data_ptr(shared, batch, position),
        compare,
    ) {
        return None;
    }
    if same_iteration {
        batch.reuse.route = Some(found.channel);
    }
    Some((found.region, found.page))
}

fn mark_duplicate(shared: &Shared, batch: &mut Batch, position: usize, region: usize, page: u32) {
    batch.kinds[position] = PageKind::Duplicate;
    let reference = PageRef {
        region_id: shared.region_ids[region],
        page_index: page,
    };
    // Found in table order, so their payloads are in table order too.
    batch
        .reuse
        .duplicates
        .extend_from_slice(&reference.encode());
    batch.reuse.references.push(Reference {
        source_region: region,
        source_page: page,
        region: batch.region,
        page: batch.pages[position],
    });
    batch.reuse.counts.duplicate_pages += 1;
}

/// Bytes compared before the whole pages: most candidates are another
/// page that shares only the index's bucket (a 3 GiB guest's first pass
/// met 65,669 candidates for 510 duplicates), and their first cache line
/// already differs.
const PREFIX: usize = 64;

/// Compares two pages through copies: guest memory is never borrowed as a
/// slice while the guest may write it. Their first [`PREFIX`] bytes first,
/// so a page that differs early costs one cache line of each, not two
/// whole pages copied.
fn same_bytes(a: *const u8, b: *const u8, compare: &mut [Vec<u8>; 2]) -> bool {
    let (mut first_prefix, mut second_prefix) = ([0u8; PREFIX], [0u8; PREFIX]);
    // SAFETY: both are whole readable pages, longer than the prefix (see
    // below); the arrays are ours.
    unsafe {
        std::ptr::copy_nonoverlapping(a, first_prefix.as_mut_ptr(), PREFIX);
        std::ptr::copy_nonoverlapping(b, second_prefix.as_mut_ptr(), PREFIX);
    }
    if first_prefix != second_prefix {
        return false;
    }
    let [first, second] = compare;
    first.resize(PAGE_SIZE, 0);
    second.resize(PAGE_SIZE, 0);
    // SAFETY: both are whole readable pages (guest pages inside their
    // region's mapping, or a batch's copy); the copies are ours.
    unsafe {
        std::ptr::copy_nonoverlapping(a, first.as_mut_ptr(), PAGE_SIZE);
        std::ptr::copy_nonoverlapping(b, second.as_mut_ptr(), PAGE_SIZE);
    }
    first == second
}

/// With the delta cache: encodes each admitted raw page against its cached
/// version, keeping the delta when it is shorter than the page, tells the
/// gate how that went, and makes sure no page sent another way (not
/// admitted, zero, duplicate) stays cached.
pub(super) fn encode_deltas(shared: &Shared, batch: &mut Batch, gate: &mut DeltaGate) {
    let Some(cache) = shared.delta_cache.get() else {
        return;
    };
    batch.reuse.delta_lens.resize(batch.pages.len(), 0);
    // Each record is written here, then only its own bytes are appended:
    // the packed buffer is not zero-filled a page's worth per page.
    let mut record = [0u8; MAX_DELTA_LEN];
    for position in 0..batch.pages.len() {
        let page = batch.pages[position];
        let reuse = &mut batch.reuse;
        if batch.kinds[position] != PageKind::Raw || !reuse.admitted[position] {
            cache.forget(batch.region, page);
            continue;
        }
        let copy: &[u8; PAGE_SIZE] = reuse.copies[position * PAGE_SIZE..(position + 1) * PAGE_SIZE]
            .try_into()
            .expect("a page");
        let outcome = cache.encode(batch.region, page, copy, &mut record);
        gate.record(outcome);
        match outcome {
            DeltaOutcome::Delta(len) => {
                reuse.deltas.extend_from_slice(&record[..len]);
                reuse.delta_lens[position] = crate::numeric::saturating_u32(len);
                reuse.counts.delta_pages += 1;
                reuse.counts.delta_bytes += len as u64;
                batch.kinds[position] = PageKind::Delta;
            }
            DeltaOutcome::Overflow => reuse.counts.overflows += 1,
            DeltaOutcome::Miss => reuse.counts.cache_misses += 1,
        }
    }
}

/// Publishes the batch's data pages in the duplicate index once the batch
/// is queued on `channel`.
pub(super) fn publish(shared: &Shared, pages: &[(u64, IndexedPage)]) {
    if let Some(index) = &shared.dedup {
        for &(hash, page) in pages {
            index.publish(hash, page);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_the_same_only_when_every_byte_is() {
        let mut compare = [Vec::new(), Vec::new()];
        let page = vec![7u8; PAGE_SIZE];
        let mut other = page.clone();
        assert!(same_bytes(page.as_ptr(), other.as_ptr(), &mut compare));
        // A difference past the prefix, and one inside it.
        for at in [PAGE_SIZE - 1, PREFIX, PREFIX - 1, 0] {
            other[at] = 8;
            assert!(
                !same_bytes(page.as_ptr(), other.as_ptr(), &mut compare),
                "{at}"
            );
            other[at] = 7;
        }
        assert!(same_bytes(page.as_ptr(), other.as_ptr(), &mut compare));
    }
}

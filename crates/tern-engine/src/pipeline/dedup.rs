//! Duplicate pages: a content-hash index of pages the destination holds,
//! so that a page with the same bytes as one of them goes as a reference.
//!
//! The index is a direct-mapped table of atomic words (one per hash bucket,
//! lossy: a newer page evicts an older one), so workers read and publish
//! without a lock. A bucket names a page, the page channel it went on and
//! the iteration it went in; a hit is only a candidate, confirmed by
//! comparing the two pages' bytes. What may be referenced, and why the
//! destination never copies a stale or racing page, is in
//! docs/protocol.md ("Duplicate pages"):
//!
//! * a page earlier in the same packet;
//! * a page sent earlier in the same iteration *on the same channel*
//!   (published only once its packet is queued on that channel, and the
//!   referencing batch is then routed to that channel: one stream, in
//!   order);
//! * a page sent in an earlier iteration and in no dirty bitmap since
//!   (`sweep` drops every page of the new bitmap before an iteration).
//!
//! A guest write can still race with the comparison; every such write is in
//! the next dirty bitmap, and `resend_referencing_pages` then sends again
//! every page that referenced the written one.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::bitmap::DirtyBitmap;

/// Iteration numbers kept in a bucket: 15 bits; `sweep` drops buckets old
/// enough to be mistaken for the current iteration.
const ITERATION_MASK: u32 = 0x7fff;
const VALID: u64 = 1 << 63;
/// Fewest and most buckets (8 bytes each).
const MIN_BUCKETS: u64 = 1 << 10;
const MAX_BUCKETS: u64 = 1 << 22;

/// Where and when a page went, as a bucket remembers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct IndexedPage {
    pub region: usize,
    pub page: u32,
    /// Page channel (sender index) its packet went on.
    pub channel: usize,
    /// Its iteration, modulo 2^15.
    pub iteration: u32,
}

impl IndexedPage {
    fn pack(self) -> u64 {
        VALID
            | (u64::from(self.iteration & ITERATION_MASK) << 48)
            | ((self.channel as u64 & 0x3f) << 42)
            | ((self.region as u64 & 0x3ff) << 32)
            | u64::from(self.page)
    }

    fn unpack(word: u64) -> Option<Self> {
        #[expect(
            clippy::cast_possible_truncation,
            reason = "the page is the word's low 32 bits (see `pack`)"
        )]
        let page = word as u32;
        (word & VALID != 0).then_some(Self {
            iteration: ((word >> 48) as u32) & ITERATION_MASK,
            channel: ((word >> 42) & 0x3f) as usize,
            region: ((word >> 32) & 0x3ff) as usize,
            page,
        })
    }

    /// Whether it went in `iteration` (else in an earlier one).
    pub(super) fn in_iteration(&self, iteration: u32) -> bool {
        self.iteration == iteration & ITERATION_MASK
    }
}

/// The content-hash index.
pub(super) struct DedupIndex {
    buckets: Box<[AtomicU64]>,
}

impl DedupIndex {
    /// An index sized for `guest_pages` pages (a bucket per page, rounded to
    /// a power of two, between 1 Ki and 4 Mi buckets: at most 32 MiB).
    pub(super) fn new(guest_pages: u64) -> Self {
        let buckets = guest_pages
            .clamp(MIN_BUCKETS, MAX_BUCKETS)
            .next_power_of_two();
        Self {
            buckets: (0..buckets).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn bucket(&self, hash: u64) -> &AtomicU64 {
        #[expect(
            clippy::cast_possible_truncation,
            reason = "the hash's low bits pick the bucket; the length is a power of two"
        )]
        let low_bits = hash as usize;
        &self.buckets[low_bits & (self.buckets.len() - 1)]
    }

    /// The page last published under `hash`'s bucket, if any.
    pub(super) fn candidate(&self, hash: u64) -> Option<IndexedPage> {
        IndexedPage::unpack(self.bucket(hash).load(Ordering::Acquire))
    }

    /// Publishes a page whose packet is already queued on its channel.
    pub(super) fn publish(&self, hash: u64, page: IndexedPage) {
        self.bucket(hash).store(page.pack(), Ordering::Release);
    }

    /// Before `iteration`, with no worker running: drops every page of
    /// `bitmaps` (dirtied since it was sent, or about to be sent again) and
    /// every bucket old enough that its 15-bit iteration would alias.
    pub(super) fn sweep(&self, bitmaps: &[DirtyBitmap], iteration: u32) {
        for bucket in self.buckets.iter() {
            let Some(page) = IndexedPage::unpack(bucket.load(Ordering::Relaxed)) else {
                continue;
            };
            let dirty = bitmaps
                .get(page.region)
                .is_none_or(|bitmap| bitmap.get(u64::from(page.page)));
            if dirty || page.in_iteration(iteration) {
                bucket.store(0, Ordering::Relaxed);
            }
        }
    }
}

/// One reference made in an iteration: `page` of `region` was sent as a
/// copy of `source_page` of `source_region`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Reference {
    pub source_region: usize,
    pub source_page: u32,
    pub region: usize,
    pub page: u32,
}

/// Adds to `bitmaps` every page that referenced a page `bitmaps` holds: a
/// guest write to the referenced page may have landed before its bytes were
/// compared or sent, so the copy may differ from the referencing page.
/// Returns how many pages were added.
pub(super) fn resend_referencing_pages(
    references: &[Reference],
    bitmaps: &mut [DirtyBitmap],
) -> u64 {
    let mut added = 0;
    for reference in references {
        let source_dirty = bitmaps
            .get(reference.source_region)
            .is_some_and(|bitmap| bitmap.get(u64::from(reference.source_page)));
        if source_dirty && let Some(bitmap) = bitmaps.get_mut(reference.region) {
            let page = u64::from(reference.page);
            if !bitmap.get(page) {
                bitmap.set(page);
                added += 1;
            }
        }
    }
    added
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(region: usize, page: u32, channel: usize, iteration: u32) -> IndexedPage {
        IndexedPage {
            region,
            page,
            channel,
            iteration,
        }
    }

    #[test]
    fn buckets_pack_every_field() {
        for indexed in [
            page(0, 0, 0, 0),
            page(1023, u32::MAX, 63, ITERATION_MASK),
            page(7, 12345, 3, 9),
        ] {
            assert_eq!(IndexedPage::unpack(indexed.pack()), Some(indexed));
        }
        assert_eq!(IndexedPage::unpack(0), None);
    }

    #[test]
    fn sweep_drops_dirty_pages_and_aliasing_iterations() {
        let index = DedupIndex::new(1024);
        index.publish(1, page(0, 5, 0, 2));
        index.publish(2, page(0, 6, 1, 2));
        index.publish(3, page(1, 5, 0, 2));
        index.publish(4, page(0, 7, 0, 3 + ITERATION_MASK + 1));
        let mut bitmaps = vec![DirtyBitmap::new(16), DirtyBitmap::new(16)];
        bitmaps[0].set(5);
        index.sweep(&bitmaps, 3);
        assert_eq!(index.candidate(1), None, "dirty since it was sent");
        assert_eq!(index.candidate(2), Some(page(0, 6, 1, 2)));
        assert_eq!(index.candidate(3), Some(page(1, 5, 0, 2)), "another region");
        assert_eq!(index.candidate(4), None, "its iteration aliases the next");
    }

    #[test]
    fn a_written_source_page_sends_its_copies_again() {
        let references = [
            Reference {
                source_region: 0,
                source_page: 1,
                region: 1,
                page: 4,
            },
            Reference {
                source_region: 0,
                source_page: 2,
                region: 0,
                page: 9,
            },
        ];
        let mut bitmaps = vec![DirtyBitmap::new(16), DirtyBitmap::new(16)];
        bitmaps[0].set(1);
        assert_eq!(resend_referencing_pages(&references, &mut bitmaps), 1);
        assert!(bitmaps[1].get(4));
        assert!(!bitmaps[0].get(9));
    }
}

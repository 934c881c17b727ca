//! Applying duplicate and delta pages: pages rebuilt from what the
//! destination already holds. Kept apart from the receiver's decoding.
//!
//! Both are validated before a byte is written:
//!
//! * a duplicate names a page by region id and index; the region must
//!   exist, the page be inside it (`page_ptr`), hold received data, not be
//!   the page itself, and either have been written by this receiver earlier
//!   in this iteration (earlier in this packet, or in an earlier packet of
//!   this channel: one stream, in order) or be written by nobody in this
//!   iteration, which the shared reference bits then enforce until the
//!   barrier (see `ReceiverShared::reference`);
//! * a delta applies to the page's previous version, so the page must hold
//!   received data; the record itself is checked whole by
//!   `tern_page::delta` (length, word indices, order) before it is applied.

use tern_page::delta::apply_delta_to_page;
use tern_wire::PageRef;

use super::shared::ReceiverShared;
use crate::guest::PAGE_SIZE;

/// The pages this receiver wrote in the current iteration (plain bits: only
/// its own thread reads them), with the words to clear at its end.
pub(super) struct WrittenHere {
    regions: Vec<Vec<u64>>,
    touched: Vec<(usize, usize)>,
}

impl WrittenHere {
    pub(super) fn new(shared: &ReceiverShared<'_>) -> Self {
        Self {
            regions: shared
                .regions
                .iter()
                .map(|region| {
                    vec![0; crate::numeric::saturating_usize(region.pages().div_ceil(64))]
                })
                .collect(),
            touched: Vec::new(),
        }
    }

    pub(super) fn set(&mut self, region: usize, page: u64) {
        let word_index = (page / 64) as usize;
        if let Some(word) = self
            .regions
            .get_mut(region)
            .and_then(|r| r.get_mut(word_index))
        {
            if *word == 0 {
                self.touched.push((region, word_index));
            }
            *word |= 1 << (page % 64);
        }
    }

    fn get(&self, region: usize, page: u64) -> bool {
        self.regions
            .get(region)
            .and_then(|r| r.get((page / 64) as usize))
            .is_some_and(|word| word & (1 << (page % 64)) != 0)
    }

    /// Forgets the iteration's pages.
    pub(super) fn clear(&mut self) {
        for (region, word) in self.touched.drain(..) {
            self.regions[region][word] = 0;
        }
    }
}

/// Copies into `target` (page `page` of region index `region`) the page
/// `payload` names, after checking the reference.
///
/// # Safety
///
/// `target` is that page in guest memory, claimed by the caller for this
/// iteration.
pub(super) unsafe fn apply_duplicate(
    shared: &ReceiverShared<'_>,
    written: &WrittenHere,
    (region, page): (usize, u64),
    target: *mut u8,
    payload: &[u8],
) -> Result<(), String> {
    let bytes: &[u8; PageRef::ENCODED_LEN] = payload
        .try_into()
        .map_err(|_| format!("a duplicate's payload of {} bytes", payload.len()))?;
    let reference = PageRef::decode(bytes);
    let source_region = shared
        .setup
        .regions
        .iter()
        .position(|info| info.id == reference.region_id)
        .ok_or_else(|| format!("a duplicate of unknown region {}", reference.region_id))?;
    let source_page = u64::from(reference.page_index);
    let source = shared.regions[source_region]
        .page_ptr(source_page)
        .ok_or_else(|| {
            format!(
                "a duplicate of page {source_page}, outside region {}",
                reference.region_id
            )
        })?;
    let described = || format!("page {source_page} of region {}", reference.region_id);
    if (source_region, source_page) == (region, page) {
        return Err(format!("a duplicate of itself ({})", described()));
    }
    if !shared.populated[source_region].get(source_page) {
        return Err(format!(
            "a duplicate of {}, which holds no data",
            described()
        ));
    }
    if !written.get(source_region, source_page) && !shared.reference(source_region, source_page) {
        return Err(format!(
            "a duplicate of {}, which another channel writes in this iteration",
            described()
        ));
    }
    // SAFETY: `source` is a whole page inside its region (`page_ptr`), which
    // no thread writes until the barrier (written here already, or marked
    // referenced so no packet may claim it); `target` is the caller's claimed
    // page and differs from `source`.
    unsafe { std::ptr::copy_nonoverlapping(source.cast_const(), target, PAGE_SIZE) };
    Ok(())
}

/// Applies the delta record `payload` to `target`, which must hold the
/// page's previous version.
///
/// # Safety
///
/// As for [`apply_duplicate`].
pub(super) unsafe fn apply_delta(
    shared: &ReceiverShared<'_>,
    (region, page): (usize, u64),
    target: *mut u8,
    payload: &[u8],
) -> Result<(), String> {
    if !shared.populated[region].get(page) {
        return Err("a delta for a page that holds no data".into());
    }
    // SAFETY: the caller's claimed page, whole; the record is validated
    // before any write.
    unsafe { apply_delta_to_page(payload, target) }.map_err(|error| error.to_string())
}

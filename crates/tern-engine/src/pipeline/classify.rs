//! Zero-page detection on a batch (CPU, or DSA through the offload).

use tern_wire::PageKind;

use super::Shared;
use super::batch::{Batch, page_ptr};
use super::scratch::Scratch;
use crate::config::ZeroPageDetection;

pub(super) fn classify(shared: &Shared, batch: &mut Batch, scratch: &mut Scratch) {
    let region = &shared.regions[batch.region];
    batch.kinds.clear();
    match (shared.detection, &shared.zero_offload) {
        (ZeroPageDetection::None, _) => batch.kinds.resize(batch.pages.len(), PageKind::Raw),
        (ZeroPageDetection::Dsa, Some(offload)) => {
            scratch.pointers.clear();
            scratch
                .pointers
                .extend(batch.pages.iter().map(|&page| page_ptr(region, page)));
            // SAFETY: the pointers are pages inside the region's mapping,
            // which stays mapped for the whole migration, so past `wait`.
            let answered = unsafe { offload.submit(&scratch.pointers) }
                .and_then(|ticket| offload.wait(ticket, &mut scratch.zero_flags));
            if answered.is_err() || scratch.zero_flags.len() != batch.pages.len() {
                // The offload answers on the CPU itself when a device fails;
                // this is the last resort for a misuse of its interface.
                scratch.zero_flags.clear();
                scratch.zero_flags.extend(batch.pages.iter().map(|&page| {
                    // SAFETY: as above.
                    unsafe { shared.zero_checker.is_zero_page(page_ptr(region, page)) }
                }));
            }
            batch.kinds.extend(
                scratch.zero_flags.iter().map(
                    |&zero| {
                        if zero { PageKind::Zero } else { PageKind::Raw }
                    },
                ),
            );
        }
        _ => {
            for &page in &batch.pages {
                // SAFETY: `page_ptr` checked the page lies inside the
                // region's mapping, which outlives the migration.
                let zero = unsafe { shared.zero_checker.is_zero_page(page_ptr(region, page)) };
                batch
                    .kinds
                    .push(if zero { PageKind::Zero } else { PageKind::Raw });
            }
        }
    }
    if let Some(knob) = &shared.zero_as_normal {
        for kind in &mut batch.kinds {
            if *kind == PageKind::Zero && knob.demote() {
                *kind = PageKind::Raw;
            }
        }
    }
}

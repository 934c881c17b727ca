//! Building a batch's packet: compression of its data pages and the
//! header and page table.

use super::*;

/// A worker's reusable buffers and its compressors (one per codec, made
/// when first needed).
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) pointers: Vec<*const u8>,
    pub(super) zero_flags: Vec<bool>,
    /// Indexed by wire codec id.
    pub(super) compressors: [Option<PageCompressor>; 8],
    /// The level each compressor was asked for.
    pub(super) levels: [i32; 8],
}

pub(super) fn encode(shared: &Shared, batch: &mut Batch, scratch: &mut Scratch) {
    if !batch.prechecked {
        classify(shared, batch, scratch);
    }
    hash_pages(shared, batch);
    compress(shared, batch, scratch);
    batch.entries.clear();
    batch.zero_pages = 0;
    batch.normal_pages = 0;
    let mut outcomes = batch.compressed.outcomes.iter();
    let mut payload = 0u64;
    for (&page, &kind) in batch.pages.iter().zip(&batch.kinds) {
        let (kind, encoded_len) = match kind {
            PageKind::Zero => {
                batch.zero_pages += 1;
                (PageKind::Zero, 0)
            }
            PageKind::Raw | PageKind::Compressed => {
                batch.normal_pages += 1;
                // Data pages have one outcome each when the batch was
                // compressed, in page order.
                match outcomes.next() {
                    Some(&PageOutcome::Compressed { len, .. }) => {
                        (PageKind::Compressed, len as u32)
                    }
                    _ => (PageKind::Raw, PAGE_SIZE as u32),
                }
            }
        };
        payload += u64::from(encoded_len);
        batch.entries.push(PageEntry {
            page_index: page,
            kind,
            encoded_len,
        });
    }
    batch.prefix.clear();
    let header = PagesHeader {
        region_id: shared.region_ids[batch.region],
        iteration: batch.iteration,
        page_count: 0, // taken from the entries
        codec: batch.codec.to_wire(),
        dictionary: batch.dictionary,
    };
    encode_packet_prefix(&mut batch.prefix, &header, &batch.entries);
    batch.wire_bytes = batch.prefix.len() as u64 + payload;
}

/// Records the hash of each of the batch's pages in the incremental
/// digest, as classified: read after the dirty-log sync that put the page
/// in this batch, so any later write shows up in a later sync and the page
/// is hashed again then (docs/verification.md).
fn hash_pages(shared: &Shared, batch: &Batch) {
    let Some(hashes) = &shared.page_hashes else {
        return;
    };
    for (&page, &kind) in batch.pages.iter().zip(&batch.kinds) {
        if kind == PageKind::Zero {
            hashes.record(batch.region, u64::from(page), zero_page_hash());
        } else {
            // SAFETY: the region's mapping outlives the migration; a guest
            // write during the read only makes the hash stale, and such a
            // write is in the next sync's bitmap, which hashes it again.
            unsafe { hashes.hash_and_record(batch.region, u64::from(page)) };
        }
    }
}

/// Compresses the batch's data pages with the batch's codec, each page on
/// its own; pages that would not shrink stay raw.
pub(super) fn compress(shared: &Shared, batch: &mut Batch, scratch: &mut Scratch) {
    batch.compressed.clear();
    batch.codec_stats = CodecStats::default();
    batch.dictionary = 0;
    if batch.codec == CodecId::None {
        return;
    }
    let slot = &mut scratch.compressors[batch.codec as usize];
    let asked = &mut scratch.levels[batch.codec as usize];
    // Auto tunes the level: a compressor asked for another one is made
    // anew (compared with what was asked: QPL, say, rounds levels).
    if *asked != batch.level {
        *slot = None;
        *asked = batch.level;
    }
    if slot.is_none() {
        match shared.compression.compressor_at(batch.codec, batch.level) {
            Ok(compressor) => *slot = Some(compressor),
            Err(error) => {
                // Checked at start-up, so this is unexpected: send raw.
                tracing::warn!(%error, "cannot create a compressor; sending pages raw");
                return;
            }
        }
    }
    let Some(compressor) = slot.as_mut() else {
        return;
    };
    let region = &shared.regions[batch.region];
    scratch.pointers.clear();
    scratch.pointers.extend(
        batch
            .pages
            .iter()
            .zip(&batch.kinds)
            .filter(|(_, kind)| **kind != PageKind::Zero)
            .map(|(&page, _)| page_ptr(region, page)),
    );
    // SAFETY: the pointers are whole pages inside the region's mapping,
    // which outlives the migration; the compressor copies each page before
    // compressing it, so concurrent guest writes only make it stale.
    unsafe { compressor.compress_batch(&scratch.pointers, &mut batch.compressed) };
    batch.codec_stats = compressor.take_stats();
    batch.dictionary = compressor.dictionary_id();
}

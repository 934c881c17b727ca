//! Building a batch's packet: compression of its data pages and the
//! header and page table.

use tern_page::PageCompressor;
use tern_page::codec::{CodecId, CodecStats, PageOutcome};
use tern_wire::{PageEntry, PageKind, PageRef, PagesHeader, encode_packet_prefix};

use super::Shared;
use super::batch::Batch;
use super::classify::classify;
use super::reuse::{copy_admitted_pages, data_ptr, encode_deltas, find_duplicates};
use super::scratch::Scratch;
use crate::digest::{page_hash, zero_page_hash};

/// A duplicate's entry length: a `PageRef` record.
#[expect(
    clippy::cast_possible_truncation,
    reason = "a PageRef record is a dozen bytes"
)]
const PAGE_REF_LEN: u32 = PageRef::ENCODED_LEN as u32;

/// Every step of a batch's packet; a channel stream's batch stops before
/// compression, which needs its channel's stream ([`compress_in_stream`],
/// then [`build_table`], in `worker.rs`).
pub(super) fn encode(shared: &Shared, batch: &mut Batch, scratch: &mut Scratch) {
    if !batch.prechecked {
        classify(shared, batch, scratch);
    }
    copy_admitted_pages(shared, batch, &scratch.delta_gate);
    hash_pages(shared, batch);
    find_duplicates(shared, batch, scratch);
    encode_deltas(shared, batch, &mut scratch.delta_gate);
    if batch.codec.is_stream() {
        return;
    }
    compress(shared, batch, scratch);
    build_table(shared, batch);
}

/// Fills the batch's page table and packet prefix from the pages' kinds
/// and the compressor's outcomes.
pub(super) fn build_table(shared: &Shared, batch: &mut Batch) {
    batch.entries.clear();
    batch.zero_pages = 0;
    batch.normal_pages = 0;
    let mut outcomes = batch.compressed.outcomes.iter();
    let mut payload = 0u64;
    for (position, (&page, &kind)) in batch.pages.iter().zip(&batch.kinds).enumerate() {
        let (kind, encoded_len) = match kind {
            PageKind::Zero => {
                batch.zero_pages += 1;
                (PageKind::Zero, 0)
            }
            PageKind::Duplicate => {
                batch.normal_pages += 1;
                (PageKind::Duplicate, PAGE_REF_LEN)
            }
            PageKind::Delta => {
                batch.normal_pages += 1;
                (PageKind::Delta, batch.reuse.delta_lens[position])
            }
            PageKind::Raw | PageKind::Compressed => {
                batch.normal_pages += 1;
                // Data pages have one outcome each when the batch was
                // compressed, in page order.
                match outcomes.next() {
                    Some(&PageOutcome::Compressed { len, .. }) => {
                        (PageKind::Compressed, crate::numeric::saturating_u32(len))
                    }
                    _ => (PageKind::Raw, tern_wire::PAGE_SIZE),
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
/// With duplicate detection, the same hash is the page's content hash.
fn hash_pages(shared: &Shared, batch: &mut Batch) {
    let dedup = shared.dedup.is_some();
    if shared.page_hashes.is_none() && !dedup {
        return;
    }
    for position in 0..batch.pages.len() {
        let hash = if batch.kinds[position] == PageKind::Zero {
            zero_page_hash()
        } else {
            // SAFETY: a whole page inside the region's mapping, which
            // outlives the migration, or the batch's copy of it; a guest
            // write during the read only makes the hash stale, and such a
            // write is in the next sync's bitmap, which hashes it again.
            unsafe { page_hash(data_ptr(shared, batch, position)) }
        };
        if let Some(hashes) = &shared.page_hashes {
            hashes.record(batch.region, u64::from(batch.pages[position]), hash);
        }
        if dedup {
            batch.reuse.hashes.push(hash);
        }
    }
}

/// Compresses the batch's data pages with the batch's codec, each page on
/// its own; pages that would not shrink stay raw.
pub(super) fn compress(shared: &Shared, batch: &mut Batch, scratch: &mut Scratch) {
    if !start_compressing(batch) {
        return;
    }
    let slot = &mut scratch.compressors[batch.codec as usize];
    let asked = &mut scratch.levels[batch.codec as usize];
    // Auto tunes the level: a compressor asked for another one is made
    // anew (compared with what was asked: QPL, say, rounds levels). So is
    // one whose dictionary is no longer the one in force (a refresh).
    let dictionary = if batch.codec.is_zstd() {
        batch.use_dictionary
    } else {
        0
    };
    if *asked != batch.level
        || slot
            .as_ref()
            .is_some_and(|compressor| compressor.dictionary_id() != dictionary)
    {
        *slot = None;
        *asked = batch.level;
    }
    let Some(compressor) = compressor_in(shared, batch, slot, dictionary) else {
        return;
    };
    run_compressor(shared, batch, &mut scratch.pointers, compressor);
    batch.dictionary = compressor.dictionary_id();
}

/// Compresses a channel stream's batch with the channel's stream
/// compressor `stream` (made at the batch's level when first needed; a new
/// level restarts the stream), and sets the packet's restart flag.
pub(super) fn compress_in_stream(
    shared: &Shared,
    batch: &mut Batch,
    pointers: &mut Vec<*const u8>,
    stream: &mut Option<PageCompressor>,
) {
    if !start_compressing(batch) {
        return;
    }
    if let Some(compressor) = stream.as_mut() {
        compressor.set_level(batch.level);
    }
    let Some(compressor) = compressor_in(shared, batch, stream, 0) else {
        return;
    };
    run_compressor(shared, batch, pointers, compressor);
    batch.dictionary = if batch.compressed.stream_restart {
        tern_wire::codec_id::STREAM_RESTART
    } else {
        0
    };
}

/// Clears the batch's compression; `false` when it has no codec.
fn start_compressing(batch: &mut Batch) -> bool {
    batch.compressed.clear();
    batch.codec_stats = CodecStats::default();
    batch.dictionary = 0;
    batch.codec != CodecId::None
}

/// The compressor in `slot`, made for the batch's codec and level against
/// dictionary `dictionary` when the slot is empty.
fn compressor_in<'s>(
    shared: &Shared,
    batch: &Batch,
    slot: &'s mut Option<PageCompressor>,
    dictionary: u8,
) -> Option<&'s mut PageCompressor> {
    if slot.is_none() {
        let in_force = shared.dictionary(dictionary);
        match shared
            .compression
            .compressor_with(batch.codec, batch.level, in_force.as_ref())
        {
            Ok(compressor) => *slot = Some(compressor),
            Err(error) => {
                // Checked at start-up, so this is unexpected: send raw.
                tracing::warn!(%error, "cannot create a compressor; sending pages raw");
                return None;
            }
        }
    }
    slot.as_mut()
}

/// Runs `compressor` over the batch's data pages.
fn run_compressor(
    shared: &Shared,
    batch: &mut Batch,
    pointers: &mut Vec<*const u8>,
    compressor: &mut PageCompressor,
) {
    pointers.clear();
    pointers.extend(
        (0..batch.pages.len())
            .filter(|&position| batch.kinds[position] == PageKind::Raw)
            .map(|position| data_ptr(shared, batch, position)),
    );
    // SAFETY: the pointers are whole pages inside the region's mapping,
    // which outlives the migration, or the batch's copies; the compressor
    // copies each page before compressing it, so concurrent guest writes
    // only make it stale.
    unsafe { compressor.compress_batch(pointers, &mut batch.compressed) };
    batch.codec_stats = compressor.take_stats();
}

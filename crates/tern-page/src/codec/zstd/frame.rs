//! What a packet frame and a channel stream's packet share: the packet's
//! compressible pages gathered into one input, and one compressed run of
//! bytes for all of them (the first compressed page's outcome holds it,
//! the others none, as the wire's table has it).

use tern_wire::MAX_PAGES_PER_PACKET;

use crate::PAGE_SIZE;
use crate::codec::batch::{CompressedBatch, PageOutcome, RawReason};
use crate::codec::error::CodecError;
use crate::codec::sample::looks_incompressible_bytes;
use crate::codec::stats::CodecCounters;

/// Copies the pages at `pages` into `input` (cleared first), leaving out
/// those the sample finds random, which go raw; one outcome per page in
/// `batch` (the compressed ones filled in by [`settle`]).
///
/// # Safety
///
/// Every pointer in `pages` points to [`PAGE_SIZE`] readable bytes for the
/// duration of the call (the guest may write them: each page is copied
/// before it is looked at).
pub(super) unsafe fn gather(
    input: &mut Vec<u8>,
    pages: &[*const u8],
    batch: &mut CompressedBatch,
    sampling: bool,
) -> CodecCounters {
    let mut counters = CodecCounters {
        pages: pages.len() as u64,
        bytes_in: (pages.len() * PAGE_SIZE) as u64,
        ..CodecCounters::default()
    };
    input.clear();
    for &page in pages.iter().take(MAX_PAGES_PER_PACKET) {
        let start = input.len();
        input.resize(start + PAGE_SIZE, 0);
        // SAFETY: the caller guarantees PAGE_SIZE readable bytes at
        // `page`; the destination is this buffer's last PAGE_SIZE bytes.
        unsafe {
            core::ptr::copy_nonoverlapping(page, input[start..].as_mut_ptr(), PAGE_SIZE);
        }
        let snapshot: &[u8; PAGE_SIZE] =
            input[start..].try_into().expect("a page was just appended");
        if sampling && looks_incompressible_bytes(snapshot) {
            input.truncate(start);
            batch.outcomes.push(PageOutcome::Raw(RawReason::Sampled));
            counters.skipped_by_sampling += 1;
        } else {
            // Filled in by `settle`, once the bytes' fate is known.
            batch
                .outcomes
                .push(PageOutcome::Compressed { offset: 0, len: 0 });
        }
    }
    counters.bytes_out = counters.skipped_by_sampling * PAGE_SIZE as u64;
    counters
}

/// Puts the compressed bytes `compressed` (`None`: the gathered pages go
/// raw) in `batch` for its `members` gathered pages, and counts them.
pub(super) fn settle(
    batch: &mut CompressedBatch,
    compressed: Option<&[u8]>,
    members: u64,
    counters: &mut CodecCounters,
) {
    let len = compressed.map(<[u8]>::len);
    let mut first = true;
    for outcome in &mut batch.outcomes {
        if let PageOutcome::Compressed { .. } = outcome {
            *outcome = match len {
                Some(len) if first => PageOutcome::Compressed { offset: 0, len },
                Some(len) => PageOutcome::Compressed {
                    offset: len,
                    len: 0,
                },
                None => PageOutcome::Raw(RawReason::DidNotShrink),
            };
            first = false;
        }
    }
    match compressed {
        Some(bytes) => {
            batch.data.extend_from_slice(bytes);
            counters.compressed = members;
            counters.bytes_out += bytes.len() as u64;
        }
        None => {
            counters.raw_fallbacks = members;
            counters.bytes_out += members * PAGE_SIZE as u64;
        }
    }
}

/// The bytes `pages` pages decode to, when `frame` may carry them: 1 to
/// [`MAX_PAGES_PER_PACKET`] pages, and fewer bytes than they decode to but
/// at least one; else [`CodecError::BadInputLength`] naming `codec`.
pub(super) fn decoded_len(
    frame: &[u8],
    pages: usize,
    codec: &'static str,
) -> Result<usize, CodecError> {
    let expected = pages.min(MAX_PAGES_PER_PACKET) * PAGE_SIZE;
    if pages == 0 || pages > MAX_PAGES_PER_PACKET || frame.is_empty() || frame.len() >= expected {
        return Err(CodecError::BadInputLength {
            codec,
            len: frame.len(),
        });
    }
    Ok(expected)
}

/// That `decoded` bytes came out where the table says `expected`: else
/// [`CodecError::PacketSize`] naming `codec`.
pub(super) fn exactly(
    decoded: usize,
    expected: usize,
    codec: &'static str,
) -> Result<(), CodecError> {
    if decoded == expected {
        Ok(())
    } else {
        Err(CodecError::PacketSize {
            codec,
            decoded,
            expected,
        })
    }
}

/// `buffer`'s first `len` bytes, growing it (zero-filled) only when it is
/// shorter: packets' lengths vary, and shrinking then growing the buffer
/// again would zero the difference for every packet.
pub(super) fn room(buffer: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if buffer.len() < len {
        buffer.resize(len, 0);
    }
    &mut buffer[..len]
}

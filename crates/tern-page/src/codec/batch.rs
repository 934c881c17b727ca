//! The outcome of compressing a batch of pages.

use crate::PAGE_SIZE;

/// Largest compressed page: a page that does not fit goes raw.
pub const MAX_COMPRESSED: usize = PAGE_SIZE - 1;

/// Why a page goes raw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RawReason {
    /// The session has no codec.
    NoCodec,
    /// The sample said the page is random-looking; the codec did not run.
    Sampled,
    /// The codec ran and the output did not fit in `PAGE_SIZE - 1` bytes.
    DidNotShrink,
}

/// What happened to one page of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PageOutcome {
    /// Compressed: `len` bytes at `offset` in [`CompressedBatch::data`].
    Compressed {
        /// Offset in the batch's data.
        offset: usize,
        /// Length, 1..=`PAGE_SIZE - 1`.
        len: usize,
    },
    /// Send the page raw (straight from guest memory).
    Raw(RawReason),
}

/// The output of [`PageCompressor::compress_batch`](super::PageCompressor::compress_batch): compressed bytes packed
/// back to back, and one outcome per input page. Reuse it across batches.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct CompressedBatch {
    /// Compressed pages, back to back, in page order.
    pub data: Vec<u8>,
    /// One entry per input page.
    pub outcomes: Vec<PageOutcome>,
    /// For a channel stream ([`CodecId::ZstdStream`](super::CodecId::ZstdStream)):
    /// the compressed bytes begin a new stream, which the packet must say
    /// ([`tern_wire::codec_id::STREAM_RESTART`]).
    pub stream_restart: bool,
}

impl CompressedBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the batch, keeping its allocations.
    pub fn clear(&mut self) {
        self.data.clear();
        self.outcomes.clear();
        self.stream_restart = false;
    }

    /// The compressed bytes of page `i`, or `None` if it goes raw.
    pub fn compressed(&self, i: usize) -> Option<&[u8]> {
        match self.outcomes[i] {
            PageOutcome::Compressed { offset, len } => Some(&self.data[offset..offset + len]),
            PageOutcome::Raw(_) => None,
        }
    }

    pub(crate) fn push_compressed(&mut self, bytes: &[u8]) {
        let offset = self.data.len();
        self.data.extend_from_slice(bytes);
        self.outcomes.push(PageOutcome::Compressed {
            offset,
            len: bytes.len(),
        });
    }
}

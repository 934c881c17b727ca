//! What one codec file provides: a [`Backend`] per implementation, made of
//! a page encoder and a page decoder behind two small traits. The registry
//! (`registry.rs`) lists the backends this build has, one line per codec
//! file; [`PageCompressor`](super::PageCompressor) and
//! [`PageDecompressor`](super::PageDecompressor) ask it, so they name no
//! codec.

use super::batch::{CompressedBatch, MAX_COMPRESSED};
use super::dictionary::CodecDictionary;
use super::error::CodecError;
use super::id::CodecImpl;
use super::qpl_path::QplPath;
use super::stats::CodecCounters;
use crate::PAGE_SIZE;

/// Builds a worker's encoder from what an encoder may need, each codec
/// taking its part: the level asked for, already clamped to the wire
/// codec's range ([`CodecId::clamp_level`](super::CodecId::clamp_level); an
/// offload may narrow it further), a dictionary (zstd only; the compressor
/// refuses one for other codecs), and the QPL path (QPL only).
pub(crate) type NewEncoder =
    fn(i32, Option<&CodecDictionary>, QplPath) -> Result<Box<dyn PageEncoder>, CodecError>;

/// One worker's compressor for one codec.
pub(crate) trait PageEncoder: Send {
    /// The level in force.
    fn level(&self) -> i32;

    /// Compresses a private snapshot of a page into `out`: the length
    /// (1..=[`MAX_COMPRESSED`]), or `None` when it does not fit. An offload
    /// that had to hand the page to the CPU counts it in `counters`.
    fn compress(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8; MAX_COMPRESSED],
        counters: &mut CodecCounters,
    ) -> Option<usize>;

    /// A whole batch at once (one frame for a packet, asynchronous jobs),
    /// appending one outcome per page to `batch`, with the counters of the
    /// batch (CPU time left to the caller); `None` when this codec works
    /// page by page.
    ///
    /// # Safety
    ///
    /// Every pointer in `pages` points to [`PAGE_SIZE`] readable bytes for
    /// the call (the guest may write them: a codec copies each first).
    unsafe fn compress_batch(
        &mut self,
        pages: &[*const u8],
        batch: &mut CompressedBatch,
        sampling: bool,
    ) -> Option<CodecCounters> {
        let _ = (pages, batch, sampling);
        None
    }

    /// Takes `level` in place, for an encoder that cannot be rebuilt
    /// without losing state the receiver shares (a channel stream, which
    /// then restarts): `true` if it did; `false` for the others, which are
    /// made anew for a new level.
    fn set_level(&mut self, level: i32) -> bool {
        let _ = level;
        false
    }
}

/// One receiver's decompressor for one codec.
pub(crate) trait PageDecoder: Send {
    /// Decodes `input` (1..=[`MAX_COMPRESSED`] bytes, checked by the
    /// caller), made against dictionary `dictionary` (0: none), into `out`;
    /// returns the bytes decoded (the caller checks for a whole page).
    /// Every write is bounded by `out`: an input that decodes to more is
    /// [`CodecError::OversizedPage`].
    fn decompress(
        &mut self,
        input: &[u8],
        dictionary: u8,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<usize, CodecError>;

    /// Adds (or replaces, by id) a dictionary packets may name. Codecs that
    /// take none ignore it.
    fn add_dictionary(&mut self, dictionary: &CodecDictionary) -> Result<(), CodecError> {
        let _ = dictionary;
        Ok(())
    }

    /// Decodes a packet frame into exactly `pages` pages; only codecs with
    /// packet frames have them.
    fn decompress_packet(
        &mut self,
        frame: &[u8],
        dictionary: u8,
        pages: usize,
    ) -> Result<&[u8], CodecError> {
        let _ = (frame, dictionary, pages);
        Err(CodecError::NoCodec)
    }

    /// Pages an offload engine did not decode, so software did.
    fn offload_fallbacks(&self) -> u64 {
        0
    }
}

/// Trains a dictionary of at most `max_len` bytes on `pages`.
pub(crate) type Trainer = fn(&[&[u8; PAGE_SIZE]], usize) -> Result<Vec<u8>, CodecError>;

/// One implementation of a codec, as a codec file registers it.
#[derive(Debug)]
pub(crate) struct Backend {
    /// Which implementation this is (and so which wire codec it speaks).
    pub(crate) implementation: CodecImpl,
    /// A worker's encoder.
    pub(crate) encoder: NewEncoder,
    /// A receiver's decoder.
    pub(crate) decoder: fn() -> Result<Box<dyn PageDecoder>, CodecError>,
    /// Whether the implementation can run here (a library that loads at
    /// run time may be missing); `None`: linked in, so always.
    pub(crate) available: Option<fn() -> Result<(), CodecError>>,
    /// The dictionary trainer, for codecs that take dictionaries.
    pub(crate) trainer: Option<Trainer>,
}

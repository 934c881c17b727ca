//! A worker's reusable buffers, which every step of its encode
//! (`classify.rs`, `reuse.rs`, `encode.rs`) works in.

use tern_page::PageCompressor;

use super::delta_cache::DeltaGate;

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
    /// Pages of the current batch a later one may duplicate: hash, position.
    pub(super) batch_pages: Vec<(u64, usize)>,
    /// Two pages' worth of room to compare pages in.
    pub(super) compare: [Vec<u8>; 2],
    /// Which pages go through the delta cache.
    pub(super) delta_gate: DeltaGate,
}

//! The batch: pages of one region travelling producer → worker → sender
//! and back, allocated once and recycled.

use super::*;

/// A batch of pages of one region, travelling through the pipeline.
#[derive(Debug)]
pub(crate) struct Batch {
    pub(super) region: usize,
    pub(super) iteration: u32,
    /// Part of the switch-over pass, sent while the guest is paused.
    pub(super) paused: bool,
    pub(super) pages: Vec<u32>,
    /// Filled by the producer in `source` mode, by the worker otherwise.
    pub(super) kinds: Vec<PageKind>,
    pub(super) prechecked: bool,
    /// Codec for this batch's data pages, chosen by the producer.
    pub(super) codec: CodecId,
    /// The dictionary the compressor used (0: none), named in the header.
    pub(super) dictionary: u8,
    /// The level to compress at (auto tunes it).
    pub(super) level: i32,
    pub(super) compressed: CompressedBatch,
    /// What the worker's compressor did for this batch.
    pub(super) codec_stats: CodecStats,
    pub(super) entries: Vec<PageEntry>,
    pub(super) prefix: Vec<u8>,
    pub(super) wire_bytes: u64,
    pub(super) zero_pages: u64,
    pub(super) normal_pages: u64,
}

impl Batch {
    pub(super) fn new() -> Self {
        Self {
            region: 0,
            iteration: 0,
            paused: false,
            pages: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            kinds: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            prechecked: false,
            codec: CodecId::None,
            dictionary: 0,
            level: 1,
            compressed: CompressedBatch::new(),
            codec_stats: CodecStats::default(),
            entries: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            prefix: Vec::with_capacity(64 + MAX_PAGES_PER_PACKET * PageEntry::ENCODED_LEN),
            wire_bytes: 0,
            zero_pages: 0,
            normal_pages: 0,
        }
    }

    pub(super) fn reset(&mut self, region: usize, iteration: u32, paused: bool, codec: CodecId) {
        self.region = region;
        self.iteration = iteration;
        self.paused = paused;
        self.codec = codec;
        self.pages.clear();
        self.kinds.clear();
        self.prechecked = false;
    }
}

pub(super) enum SendItem {
    Batch(Box<Batch>),
    Sync(Sync),
}

pub(super) enum Completion {
    Batch(Box<Batch>),
    Synced,
}

pub(super) fn page_ptr(region: &MemoryRegion, page: u32) -> *const u8 {
    region
        .page_ptr(u64::from(page))
        .expect("the producer only batches pages of the region")
        .cast_const()
}

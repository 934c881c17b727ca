//! The batch: pages of one region travelling producer → worker → sender
//! and back, allocated once and recycled.

use tern_page::codec::{CodecId, CodecStats, CompressedBatch};
use tern_wire::{MAX_PAGES_PER_PACKET, PageEntry, PageKind, Sync};

use super::dedup::Reference;
use crate::guest::{MemoryRegion, PAGE_SIZE};
use crate::stats::ReuseCounts;

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
    /// The dictionary in force for zstd when the producer made the batch
    /// (0: none); changes at an iteration boundary, or within a pass once
    /// `auto`'s first is trained (`dictionary_refresh.rs`).
    pub(super) use_dictionary: u8,
    /// The level to compress at (auto tunes it).
    pub(super) level: i32,
    pub(super) compressed: CompressedBatch,
    /// What the worker's compressor did for this batch.
    pub(super) codec_stats: CodecStats,
    /// The worker's CPU time on encoding the batch, every kind of page
    /// (`encode_cost.rs`), in nanoseconds.
    pub(super) encode_cpu_ns: u64,
    pub(super) entries: Vec<PageEntry>,
    pub(super) prefix: Vec<u8>,
    pub(super) wire_bytes: u64,
    pub(super) zero_pages: u64,
    pub(super) normal_pages: u64,
    /// Duplicate and delta pages: what they cost on the wire and why.
    pub(super) reuse: ReuseBatch,
}

/// A batch's duplicate and delta pages (see `reuse.rs`).
#[derive(Debug, Default)]
pub(crate) struct ReuseBatch {
    /// With the delta cache: whether each page (in batch order) goes
    /// through it. Empty without the cache.
    pub(super) admitted: Vec<bool>,
    /// The bytes of each admitted page as read once, at its position; the
    /// cache, the compressor and the sender all use this copy, so what is
    /// cached is exactly what is sent. Other positions are stale.
    pub(super) copies: Vec<u8>,
    /// Each page's content hash (with duplicate detection), in batch order.
    pub(super) hashes: Vec<u64>,
    /// The payloads of the duplicate pages (a `PageRef` each), in table
    /// order.
    pub(super) duplicates: Vec<u8>,
    /// The delta records of the delta pages, in table order.
    pub(super) deltas: Vec<u8>,
    /// Each page's delta record length (0 for other kinds), in batch order.
    pub(super) delta_lens: Vec<u32>,
    /// The references made, for `resend_referencing_pages`.
    pub(super) references: Vec<Reference>,
    /// The page channel this batch must go on: it references a page sent
    /// there earlier in this iteration.
    pub(super) route: Option<usize>,
    pub(super) counts: ReuseCounts,
}

impl ReuseBatch {
    pub(super) fn reset(&mut self) {
        self.admitted.clear();
        self.hashes.clear();
        self.duplicates.clear();
        self.deltas.clear();
        self.delta_lens.clear();
        self.references.clear();
        self.route = None;
        self.counts = ReuseCounts::default();
    }

    /// The copy of the batch's page at `position`, when it went through
    /// the delta cache.
    pub(super) fn copy(&self, position: usize) -> Option<&[u8; PAGE_SIZE]> {
        if !self.admitted.get(position).copied().unwrap_or(false) {
            return None;
        }
        self.copies
            .get(position * PAGE_SIZE..(position + 1) * PAGE_SIZE)
            .map(|bytes| bytes.try_into().expect("a page"))
    }
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
            use_dictionary: 0,
            level: 1,
            compressed: CompressedBatch::new(),
            codec_stats: CodecStats::default(),
            encode_cpu_ns: 0,
            entries: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            prefix: Vec::with_capacity(64 + MAX_PAGES_PER_PACKET * PageEntry::ENCODED_LEN),
            wire_bytes: 0,
            zero_pages: 0,
            normal_pages: 0,
            reuse: ReuseBatch::default(),
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
        self.reuse.reset();
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

//! The postcopy push's packets, built by the pipeline's own steps: zero
//! pages found as precopy finds them (`classify.rs`), data pages
//! compressed with the codec, level and dictionary precopy had in force at
//! the switch (`encode.rs`), the table and the sender's segments as for
//! any batch (`sender.rs`). What the push leaves out is what needs the
//! live phase: no page hashes (the source's digest was finished over
//! frozen memory before the commit), no duplicate references or deltas
//! (their bookkeeping follows the dirty log, which has stopped).

use std::sync::Arc;

use tern_page::codec::{CodecId, PageOutcome};
#[cfg(test)]
use tern_wire::PageKind;

use super::batch::Batch;
use super::classify::classify;
use super::encode::{build_table, compress};
use super::scratch::Scratch;
use super::sender::batch_segments;
use super::{Pipeline, Shared};
use crate::error::ChannelError;
use crate::transport::{Channel, Segment};

/// How the push encodes: shared by the push threads, each with its own
/// [`PushBatch`].
pub(crate) struct PushEncoder {
    shared: Arc<Shared>,
    codec: CodecId,
    level: i32,
    /// The zstd dictionary in force at the switch (0: none).
    dictionary: u8,
}

/// One push thread's packet and buffers, reused from chunk to chunk.
pub(crate) struct PushBatch {
    batch: Box<Batch>,
    scratch: Scratch,
    segments: Vec<Segment>,
}

/// What one pushed packet held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PushedPacket {
    /// Pages in the packet.
    pub pages: u64,
    /// Of them, pages sent compressed.
    pub compressed_pages: u64,
    /// Of them, zero pages (no payload).
    pub zero_pages: u64,
    /// Bytes on the wire: header, table and payload.
    pub wire_bytes: u64,
}

impl Pipeline<'_> {
    /// The push's encoder: the codec in force now (auto's choice for the
    /// link as last measured, or the fixed one), at its level.
    pub(crate) fn push_encoder(&self) -> PushEncoder {
        PushEncoder {
            shared: self.shared.clone(),
            codec: push_codec(self.codec),
            level: self.batch_level(),
            dictionary: self.dictionaries.in_use,
        }
    }
}

/// The push's packets go on no channel's stream (its threads each send on
/// their own, in no order a stream could follow): a stream's pages go per
/// page instead, with zstd, which a session with the stream announces.
fn push_codec(codec: CodecId) -> CodecId {
    if codec.is_stream() {
        CodecId::Zstd
    } else {
        codec
    }
}

impl PushEncoder {
    /// The codec the push's data pages are compressed with.
    pub(crate) fn codec(&self) -> CodecId {
        self.codec
    }

    /// A push thread's packet and buffers.
    pub(crate) fn batch(&self) -> PushBatch {
        PushBatch {
            batch: Box::new(Batch::new()),
            scratch: Scratch::default(),
            segments: Vec::new(),
        }
    }

    /// Encodes `pages` (at most one packet's, of region `region`, in
    /// rising order) as a packet of `iteration`.
    pub(crate) fn encode(
        &self,
        out: &mut PushBatch,
        region: usize,
        iteration: u32,
        pages: impl IntoIterator<Item = u32>,
    ) -> PushedPacket {
        let batch = &mut out.batch;
        batch.reset(region, iteration, true, self.codec);
        batch.level = self.level;
        batch.use_dictionary = self.dictionary;
        batch.pages.extend(pages);
        classify(&self.shared, batch, &mut out.scratch);
        compress(&self.shared, batch, &mut out.scratch);
        build_table(&self.shared, batch);
        PushedPacket {
            pages: batch.pages.len() as u64,
            compressed_pages: batch
                .compressed
                .outcomes
                .iter()
                .filter(|outcome| matches!(outcome, PageOutcome::Compressed { .. }))
                .count() as u64,
            zero_pages: batch.zero_pages,
            wire_bytes: batch.wire_bytes,
        }
    }

    /// Sends the packet last encoded in `out` on `channel`.
    pub(crate) fn send(
        &self,
        out: &mut PushBatch,
        channel: &mut Channel,
    ) -> Result<(), ChannelError> {
        batch_segments(&self.shared, &out.batch, &mut out.segments);
        // SAFETY: the prefix and the compressed bytes live in the batch,
        // which outlives the call; page pointers come from `page_ptr`,
        // inside the region's mapping, which outlives the migration, and
        // the guest is paused for good, so no page changes meanwhile.
        unsafe { channel.send_vectored(&out.segments) }
    }
}

#[cfg(test)]
impl PushEncoder {
    /// An encoder over `regions` with the fixed codec `codec` at its
    /// default level, as a pipeline with that choice would make it.
    pub(crate) fn for_tests(regions: &[crate::guest::MemoryRegion], codec: CodecId) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicU64};

        use tern_page::codec::{CodecChoice, QplPath};

        let choice = match codec {
            CodecId::None => CodecChoice::None,
            CodecId::Zstd | CodecId::ZstdPacket | CodecId::ZstdStream => CodecChoice::Zstd,
            CodecId::Lz4 => CodecChoice::Lz4,
            _ => CodecChoice::Deflate,
        };
        let compression = super::CompressionSetup {
            choice,
            level: None,
            qpl_path: QplPath::Software,
            deflate_through_qpl: false,
            packet_frames: codec == CodecId::ZstdPacket,
            stream_frames: codec == CodecId::ZstdStream,
            dictionary: None,
            dictionary_report: None,
            dictionary_refresh: None,
            auto_decisions: Vec::new(),
        };
        let setup = super::PipelineSetup {
            regions: regions.to_vec(),
            workers: 1,
            detection: crate::config::ZeroPageDetection::default(),
            zero_offload: None,
            zero_as_normal: 0.0,
            compression,
            max_bandwidth: None,
            bandwidth_cap: Arc::new(AtomicU64::new(0)),
            stats: Arc::new(crate::stats::LiveStats::new()),
            cancel: Arc::new(AtomicBool::new(false)),
            page_hashes: None,
            dedup: false,
            delta_cache_size: 0,
            delta_offload: None,
            delta_cache_allowance: None,
        };
        let level = setup.compression.level_for(codec);
        Self {
            shared: Arc::new(Shared::new(setup, 1, 1)),
            codec: push_codec(codec),
            level,
            dictionary: 0,
        }
    }
}

impl PushBatch {
    /// The table of the packet last encoded (for tests).
    #[cfg(test)]
    pub(crate) fn kinds(&self) -> Vec<PageKind> {
        self.batch.entries.iter().map(|entry| entry.kind).collect()
    }
}

#[cfg(test)]
mod tests {
    use tern_page::codec::CodecId;
    use tern_wire::PageKind;

    use super::PushEncoder;
    use crate::destination::test_memory::AnonymousMemory;
    use crate::guest::PAGE_SIZE;

    /// [`memory`]'s pages as a push with a codec sends them.
    const TEXT_ZERO_RANDOM_TEXT: [PageKind; 4] = [
        PageKind::Compressed,
        PageKind::Zero,
        PageKind::Raw,
        PageKind::Compressed,
    ];

    /// Four pages: text (compresses), zeros, random bytes (does not), text.
    fn memory() -> AnonymousMemory {
        let memory = AnonymousMemory::new(4);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for page in 0..4 {
            // SAFETY: page `page` of the mapping's four, nothing else uses it.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(memory.base.add(page * PAGE_SIZE), PAGE_SIZE)
            };
            match page {
                1 => bytes.fill(0),
                2 => bytes.iter_mut().for_each(|byte| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    *byte = state.to_le_bytes()[0];
                }),
                _ => bytes
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, byte)| *byte = b"postcopy push "[i % 14]),
            }
        }
        memory
    }

    #[test]
    fn the_push_compresses_with_the_codec_in_force_and_keeps_zero_pages() {
        let memory = memory();
        let encoder = PushEncoder::for_tests(&[memory.region(1)], CodecId::Lz4);
        let mut out = encoder.batch();
        let packet = encoder.encode(&mut out, 0, 5, 0..4);
        assert_eq!(out.kinds(), TEXT_ZERO_RANDOM_TEXT);
        assert_eq!(
            (packet.pages, packet.compressed_pages, packet.zero_pages),
            (4, 2, 1)
        );
        assert!(
            packet.wire_bytes < 2 * PAGE_SIZE as u64,
            "two pages compressed, one raw, one zero: {packet:?}"
        );
    }

    /// A session with a zstd stream per channel pushes per-page zstd,
    /// which it announces beside the stream: the push's packets go on no
    /// channel stream.
    #[test]
    fn a_channel_streams_session_pushes_per_page_zstd() {
        let memory = memory();
        let encoder = PushEncoder::for_tests(&[memory.region(1)], CodecId::ZstdStream);
        assert_eq!(encoder.codec(), CodecId::Zstd);
        let mut out = encoder.batch();
        let packet = encoder.encode(&mut out, 0, 5, 0..4);
        assert_eq!(out.kinds(), TEXT_ZERO_RANDOM_TEXT);
        assert_eq!(packet.compressed_pages, 2);
        assert_eq!(out.batch.codec, CodecId::Zstd);
        assert_eq!(
            out.batch.dictionary, 0,
            "per-page zstd names no stream restart"
        );
    }

    #[test]
    fn without_a_codec_the_push_sends_raw_and_zero_pages() {
        let memory = memory();
        let encoder = PushEncoder::for_tests(&[memory.region(1)], CodecId::None);
        let mut out = encoder.batch();
        let packet = encoder.encode(&mut out, 0, 5, 0..4);
        assert_eq!(
            out.kinds(),
            [PageKind::Raw, PageKind::Zero, PageKind::Raw, PageKind::Raw]
        );
        assert_eq!(packet.compressed_pages, 0);
        assert!(packet.wire_bytes > 3 * PAGE_SIZE as u64);
    }
}

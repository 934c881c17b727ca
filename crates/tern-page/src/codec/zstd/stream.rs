//! zstd as one stream per page channel ([`CodecImpl::ZstdStream`]): each
//! packet's compressible pages are the stream's next input, flushed at the
//! packet's end, so a packet's matches reach back over everything the
//! channel sent within the window (QEMU's multifd zstd keeps one stream per
//! channel the same way). A packet decodes only after the channel's earlier
//! ones, in order, with the channel's one decoder.
//!
//! The encoder and decoder agree on where a stream starts through the
//! packet's restart flag ([`CompressedBatch::stream_restart`], on the wire
//! [`tern_wire::codec_id::STREAM_RESTART`]): a restarted encoder begins a
//! new zstd frame, and the decoder resets before decoding it. The encoder
//! restarts for its first packet, for a new level (zstd fixes a frame's
//! parameters when it begins), and after a packet whose bytes it did not
//! send (a flush that did not shrink, an error): the decoder never saw them,
//! so nothing after them may refer to them.
//!
//! The window is [`STREAM_WINDOW_LOG`] on both sides: the decoder refuses a
//! frame that asks for more, so a peer cannot make it allocate more.

use ::zstd::stream::raw::{
    CParameter, DParameter, Decoder, Encoder, InBuffer, Operation, OutBuffer,
};
use tern_wire::codec_id::STREAM_WINDOW_LOG;

use super::frame;
use crate::PAGE_SIZE;
use crate::codec::batch::CompressedBatch;
use crate::codec::error::CodecError;
use crate::codec::stats::CodecCounters;

fn init_error(error: std::io::Error) -> CodecError {
    CodecError::Init {
        codec: "zstd stream",
        detail: error.to_string(),
    }
}

/// A channel's zstd stream encoder and its buffers (at most a packet's
/// pages in, their bound out).
pub(super) struct StreamEncoder {
    encoder: Encoder<'static>,
    level: i32,
    /// The next packet begins a new frame (at `level`).
    restart: bool,
    input: Vec<u8>,
    output: Vec<u8>,
}

impl StreamEncoder {
    pub(super) fn new(level: i32) -> Result<Self, CodecError> {
        let mut encoder = Encoder::new(level).map_err(init_error)?;
        for parameter in [
            CParameter::WindowLog(STREAM_WINDOW_LOG),
            CParameter::ChecksumFlag(false),
            CParameter::ContentSizeFlag(false),
            CParameter::DictIdFlag(false),
        ] {
            encoder.set_parameter(parameter).map_err(init_error)?;
        }
        Ok(Self {
            encoder,
            level,
            restart: true,
            input: Vec::new(),
            output: Vec::new(),
        })
    }

    pub(super) fn level(&self) -> i32 {
        self.level
    }

    /// Takes `level` from the next packet on, which then begins a new frame.
    pub(super) fn set_level(&mut self, level: i32) {
        if level != self.level {
            self.level = level;
            self.restart = true;
        }
    }

    /// Appends the pages at `pages` to the stream (those the sample finds
    /// random go raw) and flushes it: the bytes, in `batch` as a packet
    /// frame's (the first compressed page's outcome holds them all), decode
    /// after this stream's earlier packets. When the flush is not shorter
    /// than its pages (or zstd fails), they all go raw and the stream
    /// restarts at the next packet.
    ///
    /// # Safety
    ///
    /// Every pointer in `pages` points to [`PAGE_SIZE`] readable bytes for
    /// the duration of the call (the guest may write them: each page is
    /// copied first).
    pub(super) unsafe fn compress(
        &mut self,
        pages: &[*const u8],
        batch: &mut CompressedBatch,
        sampling: bool,
    ) -> CodecCounters {
        // SAFETY: forwarded caller contract.
        let mut counters = unsafe { frame::gather(&mut self.input, pages, batch, sampling) };
        let members = (self.input.len() / PAGE_SIZE) as u64;
        if members == 0 {
            return counters;
        }
        let restart = self.restart;
        let flushed = self
            .flush_input()
            .ok()
            .filter(|&len| len < self.input.len());
        // Bytes the receiver does not get must not be referred to.
        self.restart = flushed.is_none();
        batch.stream_restart = restart && flushed.is_some();
        frame::settle(
            batch,
            flushed.map(|len| &self.output[..len]),
            members,
            &mut counters,
        );
        counters
    }

    /// Runs the input through the stream (beginning a new frame first when
    /// restarting) and flushes it; returns the output's length.
    fn flush_input(&mut self) -> std::io::Result<usize> {
        if self.restart {
            self.encoder.reinit()?;
            self.encoder
                .set_parameter(CParameter::CompressionLevel(self.level))?;
        }
        // zstd's bound for the input in one frame; should a flush need more,
        // it fails, and the pages go raw (the stream restarts).
        let bound = ::zstd::zstd_safe::compress_bound(self.input.len());
        let mut input = InBuffer::around(&self.input[..]);
        let mut output = OutBuffer::around(frame::room(&mut self.output, bound));
        while input.pos() < self.input.len() {
            let before = (input.pos(), output.pos());
            self.encoder.run(&mut input, &mut output)?;
            if (input.pos(), output.pos()) == before {
                return Err(std::io::Error::other("zstd made no progress"));
            }
        }
        if self.encoder.flush(&mut output)? > 0 {
            return Err(std::io::Error::other("zstd's flush outgrew its bound"));
        }
        Ok(output.pos())
    }
}

/// A receiver's zstd stream decoder: the channel's one, fed its packets in
/// order.
pub(super) struct StreamDecoder {
    decoder: Decoder<'static>,
    packet: Vec<u8>,
}

impl StreamDecoder {
    pub(super) fn new() -> Result<Self, CodecError> {
        let mut decoder = Decoder::new().map_err(init_error)?;
        decoder
            .set_parameter(DParameter::WindowLogMax(STREAM_WINDOW_LOG))
            .map_err(init_error)?;
        Ok(Self {
            decoder,
            packet: Vec::new(),
        })
    }

    /// Decodes a packet's bytes `frame`, the stream's next (from a new
    /// stream with `restart`), into exactly `pages` pages. The output
    /// buffer is exactly that long and the decoder must end there with all
    /// of `frame` read and nothing more to give: anything else is an error
    /// (and the migration's end: the stream is then out of step).
    pub(super) fn decompress_packet(
        &mut self,
        frame: &[u8],
        restart: bool,
        pages: usize,
    ) -> Result<&[u8], CodecError> {
        let expected = frame::decoded_len(frame, pages, "zstd stream")?;
        if restart {
            self.decoder.reinit().map_err(malformed)?;
        }
        let mut packet = std::mem::take(&mut self.packet);
        let decoded = self.decode_into(frame, frame::room(&mut packet, expected));
        self.packet = packet;
        frame::exactly(decoded?, expected, "zstd stream")?;
        Ok(&self.packet[..expected])
    }

    /// Feeds all of `frame` to the stream, writing into `out`; returns the
    /// bytes written. Output beyond `out` is an error.
    fn decode_into(&mut self, frame: &[u8], out: &mut [u8]) -> Result<usize, CodecError> {
        let capacity = out.len();
        let too_long = || CodecError::PacketSize {
            codec: "zstd stream",
            decoded: capacity + 1,
            expected: capacity,
        };
        let mut input = InBuffer::around(frame);
        let mut output = OutBuffer::around(out);
        while input.pos() < frame.len() {
            let before = (input.pos(), output.pos());
            self.decoder
                .run(&mut input, &mut output)
                .map_err(malformed)?;
            if (input.pos(), output.pos()) == before {
                // Output full, input left: it decodes to more.
                return Err(too_long());
            }
        }
        let written = output.pos();
        if written == capacity {
            // Anything still held back would come out in the next packet.
            let mut probe = [0u8; 1];
            let mut empty = InBuffer::around(&[]);
            let mut extra = OutBuffer::around(&mut probe[..]);
            self.decoder
                .run(&mut empty, &mut extra)
                .map_err(malformed)?;
            if extra.pos() > 0 {
                return Err(too_long());
            }
        }
        Ok(written)
    }
}

fn malformed(error: std::io::Error) -> CodecError {
    CodecError::Malformed {
        codec: "zstd stream",
        detail: error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use tern_wire::MAX_PAGES_PER_PACKET;

    use super::*;
    use crate::codec::batch::{PageOutcome, RawReason};
    use crate::codec::{CodecId, PageCompressor, PageDecompressor, corpus_page};

    /// `count` text pages, each a slice of the corpus text stamped with
    /// its number (as the bench image's): alike across packets.
    fn text_pages(first: u64, count: usize) -> Vec<[u8; PAGE_SIZE]> {
        (0..count as u64)
            .map(|seed| {
                let mut page = corpus_page("text", (first + seed) % 7);
                page[..8].copy_from_slice(&(first + seed).to_le_bytes());
                page
            })
            .collect()
    }

    fn compress(compressor: &mut PageCompressor, pages: &[[u8; PAGE_SIZE]]) -> CompressedBatch {
        let pointers: Vec<*const u8> = pages.iter().map(|page| page.as_ptr()).collect();
        let mut batch = CompressedBatch::new();
        // SAFETY: every pointer is a whole page of `pages`, alive and
        // unwritten during the call.
        unsafe { compressor.compress_batch(&pointers, &mut batch) };
        batch
    }

    fn decode(
        decoder: &mut PageDecompressor,
        batch: &CompressedBatch,
        pages: usize,
    ) -> Result<Vec<u8>, CodecError> {
        decoder
            .decompress_packet(&batch.data, u8::from(batch.stream_restart), pages)
            .map(<[u8]>::to_vec)
    }

    #[test]
    fn packets_decode_in_order_and_later_ones_cost_less_than_alone() {
        let mut compressor = PageCompressor::new(CodecId::ZstdStream, 1).unwrap();
        let mut decoder = PageDecompressor::new(CodecId::ZstdStream).unwrap();
        let mut alone = PageCompressor::new(CodecId::ZstdPacket, 1).unwrap();
        for packet in 0..4 {
            let pages = text_pages(packet * 32, 32);
            let batch = compress(&mut compressor, &pages);
            assert_eq!(batch.stream_restart, packet == 0, "packet {packet}");
            assert_eq!(decode(&mut decoder, &batch, 32).unwrap(), pages.concat());
            let frame = compress(&mut alone, &pages).data.len();
            if packet > 0 {
                // The stream's window holds the earlier packets' text.
                assert!(
                    batch.data.len() * 2 < frame,
                    "packet {packet}: {} bytes in the stream, {frame} alone",
                    batch.data.len()
                );
            }
        }
    }

    #[test]
    fn a_new_level_restarts_the_stream_and_still_decodes() {
        assert_eq!(
            PageCompressor::new(CodecId::ZstdStream, 7).unwrap().level(),
            7
        );
        let mut compressor = PageCompressor::new(CodecId::ZstdStream, 1).unwrap();
        let mut decoder = PageDecompressor::new(CodecId::ZstdStream).unwrap();
        let first = text_pages(0, 16);
        decode(&mut decoder, &compress(&mut compressor, &first), 16).unwrap();
        assert!(compressor.set_level(5));
        assert_eq!(compressor.level(), 5);
        let second = text_pages(16, 16);
        let batch = compress(&mut compressor, &second);
        assert!(batch.stream_restart);
        assert_eq!(decode(&mut decoder, &batch, 16).unwrap(), second.concat());
        // Asking for the level in force changes nothing.
        assert!(compressor.set_level(5));
        assert!(!compress(&mut compressor, &text_pages(32, 4)).stream_restart);
    }

    #[test]
    fn a_packet_decoded_without_the_ones_before_it_fails_or_differs() {
        let mut compressor = PageCompressor::new(CodecId::ZstdStream, 1).unwrap();
        let _first = compress(&mut compressor, &text_pages(0, 32));
        let pages = text_pages(32, 32);
        let second = compress(&mut compressor, &pages);
        let mut fresh = PageDecompressor::new(CodecId::ZstdStream).unwrap();
        let decoded = decode(&mut fresh, &second, 32);
        assert!(decoded.is_err() || decoded.unwrap() != pages.concat());
    }

    #[test]
    fn a_packet_that_does_not_shrink_goes_raw_and_the_next_restarts() {
        let mut compressor = PageCompressor::new(CodecId::ZstdStream, 1).unwrap();
        compressor.set_sampling(false);
        let random: Vec<[u8; PAGE_SIZE]> = (0..4).map(|seed| corpus_page("random", seed)).collect();
        let batch = compress(&mut compressor, &random);
        assert!(batch.data.is_empty());
        assert!(
            batch
                .outcomes
                .iter()
                .all(|outcome| *outcome == PageOutcome::Raw(RawReason::DidNotShrink))
        );
        // Counted as raw: every byte of the four pages went out.
        let counted = compressor.take_stats();
        let counters = counted.get(compressor.implementation());
        assert_eq!((counters.raw_fallbacks, counters.compressed), (4, 0));
        assert_eq!(counters.bytes_out, 4 * PAGE_SIZE as u64);
        let mut decoder = PageDecompressor::new(CodecId::ZstdStream).unwrap();
        let pages = text_pages(0, 8);
        let batch = compress(&mut compressor, &pages);
        assert!(batch.stream_restart);
        assert_eq!(decode(&mut decoder, &batch, 8).unwrap(), pages.concat());
        // Counted as the stream's bytes, beside a random page sampled raw.
        compressor.set_sampling(true);
        compressor.take_stats();
        let mut mixed = text_pages(8, 3);
        mixed.push(corpus_page("random", 9));
        let batch = compress(&mut compressor, &mixed);
        let counted = compressor.take_stats();
        let counters = counted.get(compressor.implementation());
        assert_eq!((counters.compressed, counters.skipped_by_sampling), (3, 1));
        assert_eq!(
            counters.bytes_out,
            (batch.data.len() + PAGE_SIZE) as u64,
            "{counters:?}"
        );
    }

    /// Bytes no packet of `pages` pages can carry are refused before the
    /// stream sees them: none, as many as the pages or more, no pages, more
    /// than a packet holds.
    #[test]
    fn the_decoder_refuses_impossible_lengths_before_decoding() {
        let mut compressor = PageCompressor::new(CodecId::ZstdStream, 1).unwrap();
        let batch = compress(&mut compressor, &text_pages(0, 2));
        let mut decoder = StreamDecoder::new().unwrap();
        let refused = |decoder: &mut StreamDecoder, frame: &[u8], pages: usize| {
            matches!(
                decoder.decompress_packet(frame, true, pages),
                Err(CodecError::BadInputLength { .. })
            )
        };
        assert!(refused(&mut decoder, &[], 2));
        assert!(refused(&mut decoder, &vec![0; 2 * PAGE_SIZE], 2));
        assert!(refused(&mut decoder, &batch.data, 0));
        assert!(refused(&mut decoder, &batch.data, MAX_PAGES_PER_PACKET + 1));
        // The same bytes with their own page count decode, and so does a
        // full packet.
        assert_eq!(
            decoder.decompress_packet(&batch.data, true, 2).unwrap(),
            text_pages(0, 2).concat()
        );
        let full = text_pages(2, MAX_PAGES_PER_PACKET);
        let batch = compress(&mut compressor, &full);
        let decoded = decoder.decompress_packet(&batch.data, false, MAX_PAGES_PER_PACKET);
        assert_eq!(decoded.unwrap(), full.concat());
    }

    /// A frame with a bigger window than [`STREAM_WINDOW_LOG`] allows, or
    /// bytes that decode to more pages than the packet has, are refused.
    #[test]
    fn the_decoder_bounds_its_window_and_its_output() {
        let pages = text_pages(0, 8).concat();
        let mut wide = Encoder::new(1).unwrap();
        wide.set_parameter(CParameter::WindowLog(STREAM_WINDOW_LOG + 2))
            .unwrap();
        let mut out = vec![0u8; pages.len()];
        let mut input = InBuffer::around(&pages[..]);
        let mut output = OutBuffer::around(&mut out[..]);
        wide.run(&mut input, &mut output).unwrap();
        while wide.flush(&mut output).unwrap() > 0 {}
        let len = output.pos();
        let mut decoder = StreamDecoder::new().unwrap();
        assert!(matches!(
            decoder.decompress_packet(&out[..len], true, 8),
            Err(CodecError::Malformed { .. })
        ));
        let mut compressor = PageCompressor::new(CodecId::ZstdStream, 1).unwrap();
        let batch = compress(&mut compressor, &text_pages(0, 8));
        let mut decoder = StreamDecoder::new().unwrap();
        assert!(matches!(
            decoder.decompress_packet(&batch.data, true, 7),
            Err(CodecError::PacketSize { decoded, expected, .. })
                if expected == 7 * PAGE_SIZE && decoded == expected + 1
        ));
        let mut decoder = StreamDecoder::new().unwrap();
        assert!(matches!(
            decoder.decompress_packet(&batch.data, true, 9),
            Err(CodecError::PacketSize { .. })
        ));
    }
}

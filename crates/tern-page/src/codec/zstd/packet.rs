//! zstd beyond one page: a packet's pages in one frame, and decoding
//! against the session's dictionaries.
//!
//! A packet frame trades independence for ratio: the pages of a packet
//! share one frame, so a page decodes only with the packet's others, on one
//! thread. The decoder never produces more than the packet's compressed
//! pages × `PAGE_SIZE` bytes: its output buffer is exactly that long and
//! zstd stops at its end.

use super::frame;
use crate::PAGE_SIZE;
use crate::codec::batch::CompressedBatch;
use crate::codec::dictionary::CodecDictionary;
use crate::codec::error::CodecError;
use crate::codec::stats::CodecCounters;

/// A worker's buffers for packet frames: the packet's pages as one input,
/// and the frame. Allocated once, at most a packet's worth each.
#[derive(Debug, Default)]
pub(super) struct PacketFrame {
    input: Vec<u8>,
    output: Vec<u8>,
}

impl PacketFrame {
    /// Compresses the pages at `pages` into one frame in `batch`: the first
    /// compressed page's outcome holds the whole frame, the others hold no
    /// bytes (as the wire's packet-frame entries). Pages the sample finds
    /// random go raw; when the frame would not be shorter than its pages,
    /// they all go raw.
    ///
    /// # Safety
    ///
    /// Every pointer in `pages` points to [`PAGE_SIZE`] readable bytes for
    /// the duration of the call (the guest may write them: each page is
    /// copied first).
    pub(super) unsafe fn compress(
        &mut self,
        compressor: &mut ::zstd::bulk::Compressor<'static>,
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
        let output = frame::room(&mut self.output, self.input.len() - 1);
        let frame = match compressor.compress_to_buffer(&self.input[..], output) {
            Ok(len) if len > 0 && len < self.input.len() => Some(&self.output[..len]),
            _ => None,
        };
        frame::settle(batch, frame, members, &mut counters);
        counters
    }
}

/// A destination's zstd decoders: one without a dictionary, one per
/// dictionary of the session, and the output of packet frames.
pub(super) struct ZstdDecoders {
    plain: ::zstd::bulk::Decompressor<'static>,
    with_dictionary: Vec<(u8, ::zstd::bulk::Decompressor<'static>)>,
    packet: Vec<u8>,
}

fn init_error(error: std::io::Error) -> CodecError {
    CodecError::Init {
        codec: "zstd",
        detail: error.to_string(),
    }
}

/// A zstd decoding error: a full output buffer means the input decodes
/// to more than it may.
fn decode_error(error: std::io::Error, too_long: CodecError) -> CodecError {
    let detail = error.to_string();
    if detail.contains("too small") {
        too_long
    } else {
        CodecError::Malformed {
            codec: "zstd",
            detail,
        }
    }
}

impl ZstdDecoders {
    pub(super) fn new() -> Result<Self, CodecError> {
        Ok(Self {
            plain: ::zstd::bulk::Decompressor::new().map_err(init_error)?,
            with_dictionary: Vec::new(),
            packet: Vec::new(),
        })
    }

    pub(super) fn add_dictionary(
        &mut self,
        dictionary: &CodecDictionary,
    ) -> Result<(), CodecError> {
        let decoder = ::zstd::bulk::Decompressor::with_dictionary(dictionary.bytes())
            .map_err(|error| CodecError::Dictionary(format!("libzstd refuses it: {error}")))?;
        self.with_dictionary
            .retain(|(id, _)| *id != dictionary.id());
        self.with_dictionary.push((dictionary.id(), decoder));
        Ok(())
    }

    fn decoder(
        &mut self,
        dictionary: u8,
    ) -> Result<&mut ::zstd::bulk::Decompressor<'static>, CodecError> {
        if dictionary == 0 {
            return Ok(&mut self.plain);
        }
        self.with_dictionary
            .iter_mut()
            .find(|(id, _)| *id == dictionary)
            .map(|(_, decoder)| decoder)
            .ok_or(CodecError::UnknownDictionary {
                codec: "zstd",
                id: dictionary,
            })
    }

    /// One page; returns the bytes decoded (the caller checks for a whole
    /// page).
    pub(super) fn decompress_page(
        &mut self,
        input: &[u8],
        dictionary: u8,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<usize, CodecError> {
        self.decoder(dictionary)?
            .decompress_to_buffer(input, &mut out[..])
            .map_err(|error| decode_error(error, CodecError::OversizedPage { codec: "zstd" }))
    }

    pub(super) fn decompress_packet(
        &mut self,
        frame: &[u8],
        dictionary: u8,
        pages: usize,
    ) -> Result<&[u8], CodecError> {
        let expected = frame::decoded_len(frame, pages, "zstd packet")?;
        let mut packet = std::mem::take(&mut self.packet);
        frame::room(&mut packet, expected);
        let too_long = CodecError::PacketSize {
            codec: "zstd",
            decoded: expected + 1,
            expected,
        };
        let decoded = self.decoder(dictionary).and_then(|decoder| {
            decoder
                .decompress_to_buffer(frame, &mut packet[..expected])
                .map_err(|error| decode_error(error, too_long))
        });
        self.packet = packet;
        frame::exactly(decoded?, expected, "zstd")?;
        Ok(&self.packet[..expected])
    }
}

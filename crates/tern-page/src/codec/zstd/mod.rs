//! zstd ([`zstd`](::zstd) crate, libzstd): per page ([`CodecImpl::Zstd`])
//! and one frame per packet ([`CodecImpl::ZstdPacket`], in `packet.rs`),
//! both with the session's dictionaries, which it also trains; and one
//! stream per channel ([`CodecImpl::ZstdStream`], in `stream.rs`).
//!
//! Frames carry no checksum, no content size and no dictionary id (the page
//! size is known, the packet names its dictionary; bytes saved per page).
//! Compressing a 4 KiB input with a known size makes zstd size its window
//! to the input.

mod frame;
mod packet;
mod stream;

use packet::{PacketFrame, ZstdDecoders};
use stream::{StreamDecoder, StreamEncoder};

use crate::PAGE_SIZE;
use crate::codec::backend::{Backend, PageDecoder, PageEncoder};
use crate::codec::batch::CompressedBatch;
use crate::codec::batch::MAX_COMPRESSED;
use crate::codec::dictionary::CodecDictionary;
use crate::codec::error::CodecError;
use crate::codec::id::CodecImpl;
use crate::codec::stats::CodecCounters;

/// zstd per page and per packet.
pub(super) const BACKENDS: &[Backend] = &[
    Backend {
        implementation: CodecImpl::Zstd,
        encoder: |level, dictionary, _| Ok(Box::new(ZstdEncoder::new(level, dictionary, false)?)),
        decoder: || Ok(Box::new(ZstdDecoder::new(false)?)),
        available: None,
        trainer: Some(train),
    },
    Backend {
        implementation: CodecImpl::ZstdPacket,
        encoder: |level, dictionary, _| Ok(Box::new(ZstdEncoder::new(level, dictionary, true)?)),
        decoder: || Ok(Box::new(ZstdDecoder::new(true)?)),
        available: None,
        trainer: Some(train),
    },
    Backend {
        implementation: CodecImpl::ZstdStream,
        encoder: |level, _, _| Ok(Box::new(StreamEncoder::new(level)?)),
        decoder: || Ok(Box::new(StreamDecoder::new()?)),
        available: None,
        trainer: None,
    },
];

fn init_error(error: std::io::Error) -> CodecError {
    CodecError::Init {
        codec: "zstd",
        detail: error.to_string(),
    }
}

/// A zstd compressor for pages (and, with `packet`, packet frames).
struct ZstdEncoder {
    compressor: ::zstd::bulk::Compressor<'static>,
    level: i32,
    /// The packet's pages and its frame, for packet frames.
    packet: Option<Box<PacketFrame>>,
}

impl ZstdEncoder {
    fn new(
        level: i32,
        dictionary: Option<&CodecDictionary>,
        packet: bool,
    ) -> Result<Self, CodecError> {
        Ok(Self {
            compressor: new_compressor(level, dictionary)?,
            level,
            packet: packet.then(Box::default),
        })
    }
}

fn new_compressor(
    level: i32,
    dictionary: Option<&CodecDictionary>,
) -> Result<::zstd::bulk::Compressor<'static>, CodecError> {
    let mut c = match dictionary {
        Some(dictionary) => ::zstd::bulk::Compressor::with_dictionary(level, dictionary.bytes())
            .map_err(init_error)?,
        None => ::zstd::bulk::Compressor::new(level).map_err(init_error)?,
    };
    c.include_checksum(false).map_err(init_error)?;
    c.include_contentsize(false).map_err(init_error)?;
    c.include_dictid(false).map_err(init_error)?;
    Ok(c)
}

impl PageEncoder for ZstdEncoder {
    fn level(&self) -> i32 {
        self.level
    }

    fn compress(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8; MAX_COMPRESSED],
        _: &mut CodecCounters,
    ) -> Option<usize> {
        match self.compressor.compress_to_buffer(&page[..], &mut out[..]) {
            Ok(n) if n > 0 && n <= MAX_COMPRESSED => Some(n),
            _ => None,
        }
    }

    unsafe fn compress_batch(
        &mut self,
        pages: &[*const u8],
        batch: &mut CompressedBatch,
        sampling: bool,
    ) -> Option<CodecCounters> {
        let packet = self.packet.as_mut()?;
        // SAFETY: forwarded caller contract.
        Some(unsafe { packet.compress(&mut self.compressor, pages, batch, sampling) })
    }
}

/// A receiver's zstd decoders; packet frames only for
/// [`CodecImpl::ZstdPacket`].
struct ZstdDecoder {
    decoders: ZstdDecoders,
    packets: bool,
}

impl ZstdDecoder {
    fn new(packets: bool) -> Result<Self, CodecError> {
        Ok(Self {
            decoders: ZstdDecoders::new()?,
            packets,
        })
    }
}

impl PageDecoder for ZstdDecoder {
    fn decompress(
        &mut self,
        input: &[u8],
        dictionary: u8,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<usize, CodecError> {
        self.decoders.decompress_page(input, dictionary, out)
    }

    fn add_dictionary(&mut self, dictionary: &CodecDictionary) -> Result<(), CodecError> {
        self.decoders.add_dictionary(dictionary)
    }

    fn decompress_packet(
        &mut self,
        frame: &[u8],
        dictionary: u8,
        pages: usize,
    ) -> Result<&[u8], CodecError> {
        if !self.packets {
            return Err(CodecError::NoCodec);
        }
        self.decoders.decompress_packet(frame, dictionary, pages)
    }
}

impl PageEncoder for StreamEncoder {
    fn level(&self) -> i32 {
        StreamEncoder::level(self)
    }

    /// A page alone is not a stream packet: this codec compresses batches.
    fn compress(
        &mut self,
        _: &[u8; PAGE_SIZE],
        _: &mut [u8; MAX_COMPRESSED],
        _: &mut CodecCounters,
    ) -> Option<usize> {
        None
    }

    unsafe fn compress_batch(
        &mut self,
        pages: &[*const u8],
        batch: &mut CompressedBatch,
        sampling: bool,
    ) -> Option<CodecCounters> {
        // SAFETY: forwarded caller contract.
        Some(unsafe { self.compress(pages, batch, sampling) })
    }

    fn set_level(&mut self, level: i32) -> bool {
        StreamEncoder::set_level(self, level);
        true
    }
}

impl PageDecoder for StreamDecoder {
    /// A stream's pages come in packets only.
    fn decompress(
        &mut self,
        _: &[u8],
        _: u8,
        _: &mut [u8; PAGE_SIZE],
    ) -> Result<usize, CodecError> {
        Err(CodecError::NoCodec)
    }

    fn decompress_packet(
        &mut self,
        frame: &[u8],
        restart: u8,
        pages: usize,
    ) -> Result<&[u8], CodecError> {
        let restart = match restart {
            0 => false,
            tern_wire::codec_id::STREAM_RESTART => true,
            other => {
                return Err(CodecError::Malformed {
                    codec: "zstd stream",
                    detail: format!("restart flag {other}"),
                });
            }
        };
        StreamDecoder::decompress_packet(self, frame, restart, pages)
    }
}

/// zstd's trainer on whole pages.
fn train(pages: &[&[u8; PAGE_SIZE]], max_len: usize) -> Result<Vec<u8>, CodecError> {
    let mut continuous = Vec::with_capacity(pages.len() * PAGE_SIZE);
    for page in pages {
        continuous.extend_from_slice(&page[..]);
    }
    let sizes = vec![PAGE_SIZE; pages.len()];
    ::zstd::dict::from_continuous(&continuous, &sizes, max_len)
        .map_err(|error| CodecError::Dictionary(format!("zstd's trainer failed: {error}")))
}

#[cfg(test)]
mod tests {
    use crate::codec::id::{CodecId, ZSTD_DEFAULT_LEVEL, ZSTD_LEVELS};

    #[test]
    fn the_level_table_is_libzstds() {
        let range = ::zstd::compression_level_range();
        assert_eq!(ZSTD_LEVELS, (*range.start(), *range.end()));
        assert_eq!(ZSTD_DEFAULT_LEVEL, ::zstd::DEFAULT_COMPRESSION_LEVEL);
        assert_eq!(
            CodecId::Zstd.clamp_level(0),
            ::zstd::DEFAULT_COMPRESSION_LEVEL
        );
    }
}

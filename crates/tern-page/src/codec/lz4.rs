//! lz4 ([`lz4_flex`], block format): pure Rust, no C to build, and with its
//! `safe-decode` feature the decoder bounds-checks every write, which
//! matters for a decoder fed from the network. The block format has no
//! frame header (nothing wasted per page). It has a single speed: the C
//! `lz4` crate's HC levels would compress better but slower than zstd-1,
//! which already covers that point, so lz4 reports level 1.

use crate::PAGE_SIZE;
use crate::codec::backend::{Backend, PageDecoder, PageEncoder};
use crate::codec::batch::MAX_COMPRESSED;
use crate::codec::error::CodecError;
use crate::codec::id::CodecImpl;
use crate::codec::stats::CodecCounters;

/// lz4_flex.
pub(super) const BACKENDS: &[Backend] = &[Backend {
    implementation: CodecImpl::Lz4,
    encoder: |level, _, _| Ok(Box::new(Lz4Encoder::new(level))),
    decoder: || Ok(Box::new(Lz4Decoder)),
    available: None,
    trainer: None,
}];

/// lz4's compressor: a scratch buffer as large as lz4 may write.
struct Lz4Encoder {
    scratch: Box<[u8]>,
    level: i32,
}

impl Lz4Encoder {
    fn new(level: i32) -> Self {
        Self {
            scratch: vec![0u8; lz4_flex::block::get_maximum_output_size(PAGE_SIZE)].into(),
            level,
        }
    }
}

impl PageEncoder for Lz4Encoder {
    fn level(&self) -> i32 {
        self.level
    }

    fn compress(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8; MAX_COMPRESSED],
        _: &mut CodecCounters,
    ) -> Option<usize> {
        match lz4_flex::block::compress_into(page, &mut self.scratch) {
            Ok(n) if n > 0 && n <= MAX_COMPRESSED => {
                out[..n].copy_from_slice(&self.scratch[..n]);
                Some(n)
            }
            _ => None,
        }
    }
}

struct Lz4Decoder;

impl PageDecoder for Lz4Decoder {
    fn decompress(
        &mut self,
        input: &[u8],
        dictionary: u8,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<usize, CodecError> {
        const CODEC: &str = "lz4";
        let _ = dictionary;
        match lz4_flex::block::decompress_into(input, out) {
            Ok(n) => Ok(n),
            Err(lz4_flex::block::DecompressError::OutputTooSmall { .. }) => {
                Err(CodecError::OversizedPage { codec: CODEC })
            }
            Err(e) => Err(CodecError::Malformed {
                codec: CODEC,
                detail: e.to_string(),
            }),
        }
    }
}

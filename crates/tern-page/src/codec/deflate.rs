//! Raw deflate ([`libdeflater`], libdeflate): RFC 1951, no zlib or gzip
//! header. The input is one 4 KiB page, so no match distance can exceed
//! 4095 bytes: every stream fits a 4 KiB history window, which is what Intel
//! IAA's decompressor (and QPL) accept. This is the IAA-compatible format,
//! and the QPL codec produces the same format, so either side may lack IAA.
//! libdeflate is 2-3× faster than zlib at the same level for whole-buffer
//! compression.

use crate::PAGE_SIZE;
use crate::codec::backend::{Backend, PageDecoder, PageEncoder};
use crate::codec::batch::MAX_COMPRESSED;
use crate::codec::error::CodecError;
use crate::codec::id::CodecImpl;
use crate::codec::stats::CodecCounters;

/// libdeflate.
pub(super) const BACKENDS: &[Backend] = &[Backend {
    implementation: CodecImpl::Deflate,
    encoder: |level, _, _| Ok(Box::new(DeflateEncoder::new(level))),
    decoder: || Ok(Box::new(DeflateDecoder(libdeflater::Decompressor::new()))),
    available: None,
    trainer: None,
}];

/// libdeflate's compressor at `level` (1 if libdeflate refuses it).
pub(super) fn new_deflate(level: i32) -> libdeflater::Compressor {
    let lvl = libdeflater::CompressionLvl::new(level)
        .or_else(|_| libdeflater::CompressionLvl::new(1))
        .unwrap_or_default();
    libdeflater::Compressor::new(lvl)
}

/// Software deflate of one page into `out`; `None` when it does not fit.
pub(super) fn deflate_page(
    c: &mut libdeflater::Compressor,
    page: &[u8; PAGE_SIZE],
    out: &mut [u8; MAX_COMPRESSED],
) -> Option<usize> {
    match c.deflate_compress(page, out) {
        Ok(n) if n > 0 && n <= MAX_COMPRESSED => Some(n),
        _ => None,
    }
}

/// libdeflate's inflate of one page, its errors as [`CodecError`]s.
pub(super) fn inflate(
    d: &mut libdeflater::Decompressor,
    input: &[u8],
    out: &mut [u8; PAGE_SIZE],
) -> Result<usize, CodecError> {
    const CODEC: &str = "deflate";
    match d.deflate_decompress(input, out) {
        Ok(n) => Ok(n),
        Err(libdeflater::DecompressionError::InsufficientSpace) => {
            Err(CodecError::OversizedPage { codec: CODEC })
        }
        Err(e) => Err(CodecError::Malformed {
            codec: CODEC,
            detail: e.to_string(),
        }),
    }
}

struct DeflateEncoder {
    compressor: libdeflater::Compressor,
    level: i32,
}

impl DeflateEncoder {
    fn new(level: i32) -> Self {
        Self {
            compressor: new_deflate(level),
            level,
        }
    }
}

impl PageEncoder for DeflateEncoder {
    fn level(&self) -> i32 {
        self.level
    }

    fn compress(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8; MAX_COMPRESSED],
        _: &mut CodecCounters,
    ) -> Option<usize> {
        deflate_page(&mut self.compressor, page, out)
    }
}

struct DeflateDecoder(libdeflater::Decompressor);

impl PageDecoder for DeflateDecoder {
    fn decompress(
        &mut self,
        input: &[u8],
        dictionary: u8,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<usize, CodecError> {
        let _ = dictionary;
        inflate(&mut self.0, input, out)
    }
}

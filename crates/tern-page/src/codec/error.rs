//! Codec errors.

use super::batch::MAX_COMPRESSED;
use crate::PAGE_SIZE;

/// Codec errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// A name that is not a codec.
    #[error("unknown codec {0:?} (expected none, zstd, deflate, lz4, qpl or auto)")]
    UnknownCodec(String),
    /// `zlib`, QEMU's multifd compression, which tern does not speak.
    #[error(
        "zlib is not a tern codec: QEMU's multifd zlib is one zlib stream per channel, tern \
         compresses each page on its own; use deflate (raw deflate per page, 4 KiB window) \
         or zstd"
    )]
    Zlib,
    /// A wire codec byte that is not a codec.
    #[error("unknown codec id {0} on the wire")]
    UnknownCodecId(u8),
    /// Compressed input that the codec rejects.
    #[error("{codec} page malformed: {detail}")]
    Malformed {
        /// Codec name.
        codec: &'static str,
        /// What the decoder said.
        detail: String,
    },
    /// Input that decodes to fewer than `PAGE_SIZE` bytes.
    #[error("{codec} page decodes to {decoded} bytes, expected {PAGE_SIZE}")]
    ShortPage {
        /// Codec name.
        codec: &'static str,
        /// Bytes decoded.
        decoded: usize,
    },
    /// Input that decodes to more than `PAGE_SIZE` bytes (decoding stopped at
    /// the page end).
    #[error("{codec} page decodes to more than {PAGE_SIZE} bytes")]
    OversizedPage {
        /// Codec name.
        codec: &'static str,
    },
    /// A compressed page must be 1..PAGE_SIZE-1 bytes.
    #[error("{codec} compressed page of {len} bytes (must be 1..={MAX_COMPRESSED})")]
    BadInputLength {
        /// Codec name.
        codec: &'static str,
        /// Input length.
        len: usize,
    },
    /// A packet names a dictionary this decoder was not given.
    #[error("{codec} packet names dictionary {id}, which this session does not have")]
    UnknownDictionary {
        /// Codec name.
        codec: &'static str,
        /// The dictionary id.
        id: u8,
    },
    /// A dictionary that cannot be used (size, id, codec, or training).
    #[error("dictionary: {0}")]
    Dictionary(String),
    /// A packet frame that decodes to another size than its pages.
    #[error("{codec} packet frame decodes to {decoded} bytes, expected {expected}")]
    PacketSize {
        /// Codec name.
        codec: &'static str,
        /// Bytes decoded (at most `expected` + 1: decoding stops there).
        decoded: usize,
        /// Compressed pages × `PAGE_SIZE`.
        expected: usize,
    },
    /// Compressed data arrived for a session without a codec.
    #[error("compressed page but the session has no codec")]
    NoCodec,
    /// A codec library failed to initialise.
    #[error("{codec} initialisation failed: {detail}")]
    Init {
        /// Codec name.
        codec: &'static str,
        /// Detail.
        detail: String,
    },
    /// QPL was requested but `libqpl.so` could not be loaded.
    #[error("QPL unavailable: {0}")]
    QplUnavailable(String),
    /// libqpl loaded, but this build cannot drive it (job layout, path).
    #[error("QPL unusable: {0}")]
    QplUnsupported(String),
    /// A QPL call failed.
    #[error("QPL {call} failed with status {status}")]
    Qpl {
        /// The QPL function.
        call: &'static str,
        /// Its `qpl_status`.
        status: u32,
    },
    /// The codec's cargo feature was off when tern-page was built.
    #[error("tern-page was built without the {feature} feature")]
    NotBuilt {
        /// The feature (and codec) name: `zstd`, `deflate`, `lz4` or `qpl`.
        feature: &'static str,
    },
    /// `auto` must be resolved to a concrete codec (see [`AutoSelector`](super::AutoSelector)).
    #[error(
        "codec choice 'auto' must be resolved by the AutoSelector before building a compressor"
    )]
    AutoUnresolved,
}

//! Per-page compression.
//!
//! Every page is compressed on its own: no dictionary or history is shared
//! between pages, so the destination can decode any page alone, in any
//! order, on any receiver thread, and an offload engine such as Intel IAA can
//! work on all the pages of a packet at once.
//!
//! # Shape
//!
//! * [`PageCompressor`] is owned by one worker thread (no locks). It copies
//!   the guest page to a private 4 KiB buffer (the guest may be writing it),
//!   asks [`looks_incompressible`] whether the codec is worth running, runs
//!   it with the output capped at `PAGE_SIZE - 1` bytes, and reports `None`
//!   when the page did not shrink: the caller sends it raw (`PageKind::Raw`).
//!   A compressed page is therefore always 1..=`PAGE_SIZE - 1` bytes, which
//!   is exactly what the wire's `PageKind::Compressed` allows.
//! * [`PageDecompressor`] is owned by one receiver thread. It decodes into
//!   an exact 4096-byte output and fails, without writing past the page, on
//!   malformed input or on any decoded size other than 4096.
//! * [`AutoSelector`] picks the codec for the next iteration from the
//!   measured link bandwidth and codec throughput.
//!
//! # Codecs and why these crates
//!
//! * **zstd** ([`zstd`] crate, libzstd): best ratio per CPU second at low
//!   levels. Frames carry no checksum and no content size (the page size is
//!   known; 2 bytes per page saved). Compressing a 4 KiB input with a known
//!   size makes zstd size its window to the input.
//! * **deflate** ([`libdeflater`], libdeflate): raw deflate (RFC 1951, no
//!   zlib or gzip header). The input is one 4 KiB page, so no match distance
//!   can exceed 4095 bytes: every stream fits a 4 KiB history window, which
//!   is what Intel IAA's decompressor (and QPL) accept. This is the
//!   IAA-compatible format, and [`CodecChoice::Qpl`] produces the same bytes
//!   format, so either side may lack IAA. libdeflate is 2-3× faster than zlib
//!   at the same level for whole-buffer compression.
//! * **lz4** ([`lz4_flex`], block format): pure Rust, no C to build, and with
//!   its `safe-decode` feature the decoder bounds-checks every write, which
//!   matters for a decoder fed from the network. The block format has no
//!   frame header (nothing wasted per page). It has a single speed: the C
//!   `lz4` crate's HC levels would compress better but slower than zstd-1,
//!   which already covers that point, so [`CodecId::Lz4`] reports level 1.
//!
//! Levels are honoured and reported: [`PageCompressor::level`] is the level
//! in force after clamping to [`CodecId::level_range`].
//!
//! # Cargo features
//!
//! Each codec has a feature of the same name (`zstd`, `deflate`, `lz4`,
//! `qpl`; all on by default). A codec left out keeps its [`CodecId`] and
//! [`CodecChoice`] variants and still parses, so code naming it compiles;
//! building a compressor or decompressor for it fails with
//! [`CodecError::NotBuilt`], and [`CodecId::is_built`] says so up front.
//!
//! # Example
//!
//! A page round trip through zstd:
//!
//! ```
//! use tern_page::codec::{CodecId, MAX_COMPRESSED, PageCompressor, PageDecompressor};
//! use tern_page::PAGE_SIZE;
//!
//! # if !CodecId::Zstd.is_built() { return Ok(()); }
//! let mut page = [0u8; PAGE_SIZE];
//! page[..12].copy_from_slice(b"hello, guest");
//! let mut compressor = PageCompressor::new(CodecId::Zstd, 1)?;
//! let mut wire = [0u8; MAX_COMPRESSED];
//! // `None` would mean "send this page raw": it did not shrink.
//! let len = compressor.compress(&page, &mut wire).expect("a mostly empty page shrinks");
//!
//! let mut decompressor = PageDecompressor::new(CodecId::Zstd)?;
//! let mut decoded = [0xffu8; PAGE_SIZE];
//! decompressor.decompress(&wire[..len], &mut decoded)?;
//! assert_eq!(decoded, page);
//! # Ok::<(), tern_page::CodecError>(())
//! ```

// A build without any codec leaves the codec-specific paths empty.
#![cfg_attr(
    not(any(feature = "zstd", feature = "deflate", feature = "lz4")),
    allow(unused_variables, unreachable_code)
)]

mod auto;
mod bench;
mod bench_dictionary;
mod dictionary;
mod packet;
#[cfg(feature = "qpl")]
mod qpl;
mod qpl_path;
mod sample;
mod stats;
#[cfg(all(test, feature = "zstd", feature = "deflate", feature = "lz4"))]
mod tests;

use std::fmt;
use std::str::FromStr;

use tern_wire::codec_id;

use crate::PAGE_SIZE;

pub use auto::{
    AUTO_MAX_LEVEL, AutoDecision, AutoSelector, CodecMeasurement, OFFLOAD_RATIO_TOLERANCE,
    calibrate, calibrate_qpl, calibrate_with_dictionary, choose_codec, prefer_offload, tune_level,
};
pub use bench::{CodecBenchRow, bench_codecs, corpus_page, default_bench_levels};
pub use bench_dictionary::{PacketCorpus, ZstdVariantRow, bench_zstd_variants};
pub use dictionary::{
    CodecDictionary, DEFAULT_DICTIONARY_LEN, DICTIONARY_SAMPLE_PAGES, train_dictionary,
};
pub use packet::PacketFrame;
#[cfg(feature = "qpl")]
pub use qpl::{QplCompressor, QplDecompressor, qpl_available};
pub use qpl_path::QplPath;
#[cfg(not(feature = "qpl"))]
pub use qpl_path::qpl_available;
pub use sample::{
    INCOMPRESSIBLE_DISTINCT, SAMPLE_WORDS, looks_incompressible, looks_incompressible_bytes,
    sample_distinct_bytes,
};
pub use stats::{CodecCounters, CodecImpl, CodecStats, thread_cpu_ns};

/// Largest compressed page: a page that does not fit goes raw.
pub const MAX_COMPRESSED: usize = PAGE_SIZE - 1;

/// Codec errors.
#[derive(Debug, thiserror::Error)]
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
    /// `auto` must be resolved to a concrete codec (see [`AutoSelector`]).
    #[error(
        "codec choice 'auto' must be resolved by the AutoSelector before building a compressor"
    )]
    AutoUnresolved,
}

/// A codec as the wire names it (a page packet's codec byte, a bit of the
/// hello's codec mask); the ids are the protocol's, [`tern_wire::codec_id`].
/// QPL is not here: it produces [`CodecId::Deflate`]'s format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum CodecId {
    /// No compression.
    None = codec_id::NONE,
    /// zstd frames.
    Zstd = codec_id::ZSTD,
    /// Raw deflate, 4 KiB window (IAA-compatible).
    Deflate = codec_id::DEFLATE,
    /// lz4 block format.
    Lz4 = codec_id::LZ4,
    /// zstd, one frame for all compressed pages of a packet (ratio over
    /// independence: the pages of a packet decode together).
    ZstdPacket = codec_id::ZSTD_PACKET,
}

impl CodecId {
    /// Every wire codec.
    pub const ALL: [CodecId; 5] = [
        CodecId::None,
        CodecId::Zstd,
        CodecId::Deflate,
        CodecId::Lz4,
        CodecId::ZstdPacket,
    ];

    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            CodecId::None => "none",
            CodecId::Zstd => "zstd",
            CodecId::Deflate => "deflate",
            CodecId::Lz4 => "lz4",
            CodecId::ZstdPacket => "zstd-packet",
        }
    }

    /// Whether the codec is zstd, per page or per packet (the codecs that
    /// take a dictionary).
    pub fn is_zstd(self) -> bool {
        matches!(self, CodecId::Zstd | CodecId::ZstdPacket)
    }

    /// The wire byte.
    pub fn to_wire(self) -> u8 {
        self as u8
    }

    /// Parses the wire byte.
    pub fn from_wire(b: u8) -> Result<Self, CodecError> {
        match b {
            codec_id::NONE => Ok(CodecId::None),
            codec_id::ZSTD => Ok(CodecId::Zstd),
            codec_id::DEFLATE => Ok(CodecId::Deflate),
            codec_id::LZ4 => Ok(CodecId::Lz4),
            codec_id::ZSTD_PACKET => Ok(CodecId::ZstdPacket),
            other => Err(CodecError::UnknownCodecId(other)),
        }
    }

    /// Whether this build of tern-page has the codec (its cargo feature was
    /// on). [`CodecId::None`] always is.
    pub fn is_built(self) -> bool {
        match self {
            CodecId::None => true,
            CodecId::Zstd | CodecId::ZstdPacket => cfg!(feature = "zstd"),
            CodecId::Deflate => cfg!(feature = "deflate"),
            CodecId::Lz4 => cfg!(feature = "lz4"),
        }
    }

    /// [`is_built`](Self::is_built) as a result, with the error that names
    /// the missing feature.
    pub fn check_built(self) -> Result<(), CodecError> {
        if self.is_built() {
            Ok(())
        } else {
            Err(CodecError::NotBuilt {
                feature: self.name(),
            })
        }
    }

    /// Levels this build accepts for the codec; others are clamped.
    pub fn level_range(self) -> (i32, i32) {
        match self {
            CodecId::None => (0, 0),
            // Negative levels are zstd's "fast" levels.
            CodecId::Zstd | CodecId::ZstdPacket => zstd_level_range(),
            // libdeflate: 0 is store-only (never shrinks), so start at 1.
            CodecId::Deflate => (1, 12),
            CodecId::Lz4 => (1, 1),
        }
    }

    /// Default level: the fast end, which is what live migration wants.
    pub fn default_level(self) -> i32 {
        match self {
            CodecId::None => 0,
            _ => 1,
        }
    }

    /// The level actually used when `requested` is asked for.
    /// zstd's 0 means its default, 3.
    pub fn clamp_level(self, requested: i32) -> i32 {
        if self.is_zstd() && requested == 0 {
            return ZSTD_DEFAULT_LEVEL;
        }
        let (lo, hi) = self.level_range();
        requested.clamp(lo, hi)
    }
}

#[cfg(feature = "zstd")]
fn zstd_level_range() -> (i32, i32) {
    let r = zstd::compression_level_range();
    (*r.start(), *r.end())
}

/// Without libzstd to ask, the range of the zstd releases this crate has been
/// used with; no compressor can be built anyway.
#[cfg(not(feature = "zstd"))]
fn zstd_level_range() -> (i32, i32) {
    (-131072, 22)
}

#[cfg(feature = "zstd")]
const ZSTD_DEFAULT_LEVEL: i32 = zstd::DEFAULT_COMPRESSION_LEVEL;
#[cfg(not(feature = "zstd"))]
const ZSTD_DEFAULT_LEVEL: i32 = 3;

impl fmt::Display for CodecId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CodecId {
    type Err = CodecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "none" => Ok(CodecId::None),
            "zstd" => Ok(CodecId::Zstd),
            "deflate" => Ok(CodecId::Deflate),
            "lz4" => Ok(CodecId::Lz4),
            "zstd-packet" => Ok(CodecId::ZstdPacket),
            _ => Err(CodecError::UnknownCodec(s.to_owned())),
        }
    }
}

/// What the user asked for on the command line (`--compression`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CodecChoice {
    /// No compression.
    None,
    /// zstd.
    Zstd,
    /// libdeflate raw deflate.
    Deflate,
    /// lz4.
    Lz4,
    /// Deflate through Intel QPL (IAA when present), same wire format as
    /// [`CodecChoice::Deflate`].
    Qpl,
    /// Chosen per iteration by [`AutoSelector`].
    Auto,
}

impl CodecChoice {
    /// Every choice.
    pub const ALL: [CodecChoice; 6] = [
        CodecChoice::None,
        CodecChoice::Zstd,
        CodecChoice::Deflate,
        CodecChoice::Lz4,
        CodecChoice::Qpl,
        CodecChoice::Auto,
    ];

    /// Short lowercase name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            CodecChoice::None => "none",
            CodecChoice::Zstd => "zstd",
            CodecChoice::Deflate => "deflate",
            CodecChoice::Lz4 => "lz4",
            CodecChoice::Qpl => "qpl",
            CodecChoice::Auto => "auto",
        }
    }

    /// Whether this build of tern-page has what the choice needs (`auto`
    /// always is: it only picks among the codecs built).
    pub fn is_built(self) -> bool {
        match self {
            CodecChoice::Qpl => cfg!(feature = "qpl"),
            CodecChoice::Auto => true,
            other => other.wire().is_some_and(CodecId::is_built),
        }
    }

    /// The wire codec, if fixed. `None` for auto, which may change between
    /// iterations: the wire names one codec per session, so the engine must
    /// either announce a per-packet codec or restrict auto to switching
    /// between the session's codec and raw pages (see `docs/compression.md`).
    pub fn wire(self) -> Option<CodecId> {
        match self {
            CodecChoice::None => Some(CodecId::None),
            CodecChoice::Zstd => Some(CodecId::Zstd),
            CodecChoice::Deflate | CodecChoice::Qpl => Some(CodecId::Deflate),
            CodecChoice::Lz4 => Some(CodecId::Lz4),
            CodecChoice::Auto => None,
        }
    }
}

impl fmt::Display for CodecChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CodecChoice {
    type Err = CodecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "none" => Ok(CodecChoice::None),
            "zstd" => Ok(CodecChoice::Zstd),
            "deflate" => Ok(CodecChoice::Deflate),
            "lz4" => Ok(CodecChoice::Lz4),
            "qpl" => Ok(CodecChoice::Qpl),
            "auto" => Ok(CodecChoice::Auto),
            "zlib" => Err(CodecError::Zlib),
            _ => Err(CodecError::UnknownCodec(s.to_owned())),
        }
    }
}

/// Why a page goes raw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawReason {
    /// The session has no codec.
    NoCodec,
    /// The sample said the page is random-looking; the codec did not run.
    Sampled,
    /// The codec ran and the output did not fit in `PAGE_SIZE - 1` bytes.
    DidNotShrink,
}

/// What happened to one page of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageOutcome {
    /// Compressed: `len` bytes at `offset` in [`CompressedBatch::data`].
    Compressed {
        /// Offset in the batch's data.
        offset: usize,
        /// Length, 1..=`PAGE_SIZE - 1`.
        len: usize,
    },
    /// Send the page raw (straight from guest memory).
    Raw(RawReason),
}

/// The output of [`PageCompressor::compress_batch`]: compressed bytes packed
/// back to back, and one outcome per input page. Reuse it across batches.
#[derive(Debug, Default)]
pub struct CompressedBatch {
    /// Compressed pages, back to back, in page order.
    pub data: Vec<u8>,
    /// One entry per input page.
    pub outcomes: Vec<PageOutcome>,
}

impl CompressedBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the batch, keeping its allocations.
    pub fn clear(&mut self) {
        self.data.clear();
        self.outcomes.clear();
    }

    /// The compressed bytes of page `i`, or `None` if it goes raw.
    pub fn compressed(&self, i: usize) -> Option<&[u8]> {
        match self.outcomes[i] {
            PageOutcome::Compressed { offset, len } => Some(&self.data[offset..offset + len]),
            PageOutcome::Raw(_) => None,
        }
    }

    pub(crate) fn push_compressed(&mut self, bytes: &[u8]) {
        let offset = self.data.len();
        self.data.extend_from_slice(bytes);
        self.outcomes.push(PageOutcome::Compressed {
            offset,
            len: bytes.len(),
        });
    }
}

enum Engine {
    None,
    #[cfg(feature = "zstd")]
    Zstd(Box<zstd::bulk::Compressor<'static>>),
    #[cfg(feature = "deflate")]
    Deflate(Box<libdeflater::Compressor>),
    #[cfg(feature = "lz4")]
    Lz4(Box<[u8]>),
    #[cfg(feature = "qpl")]
    Qpl(Box<QplCompressor>),
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Engine::None => "None",
            #[cfg(feature = "zstd")]
            Engine::Zstd(_) => "Zstd",
            #[cfg(feature = "deflate")]
            Engine::Deflate(_) => "Deflate",
            #[cfg(feature = "lz4")]
            Engine::Lz4(_) => "Lz4",
            #[cfg(feature = "qpl")]
            Engine::Qpl(_) => "Qpl",
        })
    }
}

/// Compresses pages one at a time, each independently. One per worker thread.
#[derive(Debug)]
pub struct PageCompressor {
    codec: CodecId,
    which: CodecImpl,
    level: i32,
    sampling: bool,
    engine: Engine,
    page: Box<[u8; PAGE_SIZE]>,
    out: Box<[u8; MAX_COMPRESSED]>,
    stats: CodecStats,
    last_raw_reason: RawReason,
    /// The dictionary id packets name (0: none).
    dictionary: u8,
    /// With [`CodecId::ZstdPacket`]: the packet's pages and its frame.
    packet: Option<Box<PacketFrame>>,
}

#[cfg(feature = "zstd")]
fn new_zstd(
    level: i32,
    dictionary: Option<&CodecDictionary>,
) -> Result<zstd::bulk::Compressor<'static>, CodecError> {
    let init = |e: std::io::Error| CodecError::Init {
        codec: "zstd",
        detail: e.to_string(),
    };
    let mut c = match dictionary {
        Some(dictionary) => {
            zstd::bulk::Compressor::with_dictionary(level, dictionary.bytes()).map_err(init)?
        }
        None => zstd::bulk::Compressor::new(level).map_err(init)?,
    };
    c.include_checksum(false).map_err(init)?;
    c.include_contentsize(false).map_err(init)?;
    c.include_dictid(false).map_err(init)?;
    Ok(c)
}

#[cfg(feature = "deflate")]
pub(crate) fn new_deflate(level: i32) -> libdeflater::Compressor {
    let lvl = libdeflater::CompressionLvl::new(level)
        .or_else(|_| libdeflater::CompressionLvl::new(1))
        .unwrap_or_default();
    libdeflater::Compressor::new(lvl)
}

/// Software deflate of one page into `out`; `None` when it does not fit.
#[cfg(feature = "deflate")]
pub(crate) fn deflate_page(
    c: &mut libdeflater::Compressor,
    page: &[u8; PAGE_SIZE],
    out: &mut [u8; MAX_COMPRESSED],
) -> Option<usize> {
    match c.deflate_compress(page, out) {
        Ok(n) if n > 0 && n <= MAX_COMPRESSED => Some(n),
        _ => None,
    }
}

impl PageCompressor {
    /// A software compressor for `codec` at `level` (clamped: see
    /// [`level`](Self::level)). Sampling of incompressible pages is on.
    ///
    /// # Errors
    ///
    /// [`CodecError::NotBuilt`] for a codec whose feature is off;
    /// [`CodecError::Init`] if the codec library cannot start.
    pub fn new(codec: CodecId, level: i32) -> Result<Self, CodecError> {
        Self::with_dictionary(codec, level, None)
    }

    /// As [`new`](Self::new), compressing against `dictionary` (zstd
    /// only); packets then name its id ([`dictionary_id`](Self::dictionary_id)).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new); [`CodecError::Dictionary`] for a dictionary
    /// with another codec than zstd.
    pub fn with_dictionary(
        codec: CodecId,
        level: i32,
        dictionary: Option<&CodecDictionary>,
    ) -> Result<Self, CodecError> {
        if dictionary.is_some() && !codec.is_zstd() {
            return Err(CodecError::Dictionary(format!(
                "{codec} takes no dictionary"
            )));
        }
        let level = codec.clamp_level(level);
        let (engine, which) = match codec {
            CodecId::None => (Engine::None, CodecImpl::None),
            #[cfg(feature = "zstd")]
            CodecId::Zstd => (
                Engine::Zstd(Box::new(new_zstd(level, dictionary)?)),
                CodecImpl::Zstd,
            ),
            #[cfg(feature = "zstd")]
            CodecId::ZstdPacket => (
                Engine::Zstd(Box::new(new_zstd(level, dictionary)?)),
                CodecImpl::ZstdPacket,
            ),
            #[cfg(feature = "deflate")]
            CodecId::Deflate => (
                Engine::Deflate(Box::new(new_deflate(level))),
                CodecImpl::Deflate,
            ),
            #[cfg(feature = "lz4")]
            CodecId::Lz4 => (
                Engine::Lz4(vec![0u8; lz4_flex::block::get_maximum_output_size(PAGE_SIZE)].into()),
                CodecImpl::Lz4,
            ),
            #[allow(unreachable_patterns)] // reachable when a codec feature is off
            not_built => {
                return Err(CodecError::NotBuilt {
                    feature: not_built.name(),
                });
            }
        };
        let mut compressor = Self::with_engine(codec, which, level, engine);
        compressor.dictionary = dictionary.map_or(0, CodecDictionary::id);
        if codec == CodecId::ZstdPacket {
            compressor.packet = Some(Box::default());
        }
        Ok(compressor)
    }

    /// A compressor for a command-line choice. `Qpl` uses the given path
    /// (and fails with [`CodecError::QplUnavailable`] without libqpl);
    /// `Auto` is an error: resolve it with [`AutoSelector`] first.
    pub fn for_choice(
        choice: CodecChoice,
        level: i32,
        qpl_path: QplPath,
    ) -> Result<Self, CodecError> {
        match choice {
            CodecChoice::None => Self::new(CodecId::None, level),
            CodecChoice::Zstd => Self::new(CodecId::Zstd, level),
            CodecChoice::Deflate => Self::new(CodecId::Deflate, level),
            CodecChoice::Lz4 => Self::new(CodecId::Lz4, level),
            CodecChoice::Qpl => Self::with_qpl(qpl_path, level),
            CodecChoice::Auto => Err(CodecError::AutoUnresolved),
        }
    }

    /// A compressor that offloads to Intel QPL (IAA hardware, QPL's software
    /// path, or auto) and produces [`CodecId::Deflate`]'s wire format.
    /// Without the `qpl` feature: [`CodecError::NotBuilt`].
    #[cfg(not(feature = "qpl"))]
    pub fn with_qpl(path: QplPath, level: i32) -> Result<Self, CodecError> {
        let _ = (path, level);
        Err(CodecError::NotBuilt { feature: "qpl" })
    }

    /// A compressor that offloads to Intel QPL (IAA hardware, QPL's software
    /// path, or auto) and produces [`CodecId::Deflate`]'s wire format.
    #[cfg(feature = "qpl")]
    pub fn with_qpl(path: QplPath, level: i32) -> Result<Self, CodecError> {
        let q = QplCompressor::new(path, level)?;
        let level = q.level();
        Ok(Self::with_engine(
            CodecId::Deflate,
            CodecImpl::Qpl,
            level,
            Engine::Qpl(Box::new(q)),
        ))
    }

    fn with_engine(codec: CodecId, which: CodecImpl, level: i32, engine: Engine) -> Self {
        Self {
            codec,
            which,
            level,
            sampling: true,
            engine,
            page: Box::new([0; PAGE_SIZE]),
            out: Box::new([0; MAX_COMPRESSED]),
            stats: CodecStats::default(),
            last_raw_reason: RawReason::NoCodec,
            dictionary: 0,
            packet: None,
        }
    }

    /// The dictionary id its packets name: 0 without a dictionary.
    pub fn dictionary_id(&self) -> u8 {
        self.dictionary
    }

    /// Turns the incompressible-page sampling on or off (on by default).
    pub fn set_sampling(&mut self, on: bool) {
        self.sampling = on;
    }

    /// The wire codec this compressor produces.
    pub fn codec(&self) -> CodecId {
        self.codec
    }

    /// The implementation (differs from the wire codec for QPL).
    pub fn implementation(&self) -> CodecImpl {
        self.which
    }

    /// The level in force, after clamping the requested one to the codec's
    /// range.
    pub fn level(&self) -> i32 {
        self.level
    }

    /// This worker's counters.
    pub fn stats(&self) -> &CodecStats {
        &self.stats
    }

    /// Returns this worker's counters and resets them (for per-iteration
    /// reporting).
    pub fn take_stats(&mut self) -> CodecStats {
        std::mem::take(&mut self.stats)
    }

    /// Compresses the page at `page` into `out`. Returns the compressed
    /// length (1..=`PAGE_SIZE - 1`), or `None` when the page should be sent
    /// raw (no codec, sampled as random, or did not shrink).
    ///
    /// # Safety
    ///
    /// `page` must point to [`PAGE_SIZE`] readable bytes for the duration of
    /// the call. The guest may write them concurrently: the page is copied to
    /// a private buffer first and the codec only sees that snapshot (a page
    /// written during the copy is dirty and sent again later).
    pub unsafe fn compress_page(
        &mut self,
        page: *const u8,
        out: &mut [u8; MAX_COMPRESSED],
    ) -> Option<usize> {
        // SAFETY: the caller guarantees PAGE_SIZE readable bytes at `page`;
        // `self.page` is a private PAGE_SIZE buffer that cannot overlap guest
        // memory.
        unsafe { core::ptr::copy_nonoverlapping(page, self.page.as_mut_ptr(), PAGE_SIZE) };
        let (result, reason) = self.compress_snapshot(out);
        self.count(result, reason);
        result
    }

    /// [`compress_page`](Self::compress_page) for an owned page.
    pub fn compress(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8; MAX_COMPRESSED],
    ) -> Option<usize> {
        // SAFETY: a &[u8; PAGE_SIZE] is PAGE_SIZE readable bytes.
        unsafe { self.compress_page(page.as_ptr(), out) }
    }

    /// Compresses a batch (e.g. one packet's pages) into `batch` (cleared
    /// first), measuring the thread's CPU time around the whole batch. With
    /// QPL, all pages are submitted before waiting for any.
    ///
    /// # Safety
    ///
    /// Every pointer in `pages` must satisfy [`compress_page`](Self::compress_page)'s
    /// contract.
    pub unsafe fn compress_batch(&mut self, pages: &[*const u8], batch: &mut CompressedBatch) {
        batch.clear();
        let t0 = thread_cpu_ns();
        #[cfg(feature = "zstd")]
        if let (Some(packet), Engine::Zstd(c)) = (self.packet.as_mut(), &mut self.engine) {
            // SAFETY: forwarded caller contract.
            let counters = unsafe { packet.compress(c, pages, batch, self.sampling) };
            let c = self.stats.get_mut(CodecImpl::ZstdPacket);
            c.add(&counters);
            c.cpu_ns += thread_cpu_ns().saturating_sub(t0);
            return;
        }
        #[cfg(feature = "qpl")]
        if let Engine::Qpl(q) = &mut self.engine {
            let sampling = self.sampling;
            // SAFETY: forwarded caller contract.
            let counts = unsafe { q.compress_batch(pages, batch, sampling) };
            let c = self.stats.get_mut(CodecImpl::Qpl);
            c.pages += pages.len() as u64;
            c.bytes_in += (pages.len() * PAGE_SIZE) as u64;
            c.compressed += counts.compressed;
            c.raw_fallbacks += counts.did_not_shrink;
            c.skipped_by_sampling += counts.sampled;
            c.offload_fallbacks += counts.software;
            c.bytes_out += batch.data.len() as u64
                + (counts.did_not_shrink + counts.sampled) * PAGE_SIZE as u64;
            c.cpu_ns += thread_cpu_ns().saturating_sub(t0);
            return;
        }
        let mut out = std::mem::replace(&mut self.out, Box::new([0; MAX_COMPRESSED]));
        for &p in pages {
            // SAFETY: forwarded caller contract.
            match unsafe { self.compress_page(p, &mut out) } {
                Some(n) => batch.push_compressed(&out[..n]),
                None => batch.outcomes.push(PageOutcome::Raw(self.last_raw_reason)),
            }
        }
        self.out = out;
        self.stats.get_mut(self.which).cpu_ns += thread_cpu_ns().saturating_sub(t0);
    }

    fn compress_snapshot(&mut self, out: &mut [u8; MAX_COMPRESSED]) -> (Option<usize>, RawReason) {
        if matches!(self.engine, Engine::None) {
            return (None, RawReason::NoCodec);
        }
        if self.sampling && looks_incompressible_bytes(&self.page) {
            return (None, RawReason::Sampled);
        }
        let page: &[u8; PAGE_SIZE] = &self.page;
        let n = match &mut self.engine {
            Engine::None => None,
            #[cfg(feature = "zstd")]
            Engine::Zstd(c) => match c.compress_to_buffer(&page[..], &mut out[..]) {
                Ok(n) if n > 0 && n <= MAX_COMPRESSED => Some(n),
                _ => None,
            },
            #[cfg(feature = "deflate")]
            Engine::Deflate(c) => deflate_page(c, page, out),
            #[cfg(feature = "lz4")]
            Engine::Lz4(scratch) => match lz4_flex::block::compress_into(page, scratch) {
                Ok(n) if n > 0 && n <= MAX_COMPRESSED => {
                    out[..n].copy_from_slice(&scratch[..n]);
                    Some(n)
                }
                _ => None,
            },
            #[cfg(feature = "qpl")]
            Engine::Qpl(q) => {
                let (n, software) = q.compress_one(page, out);
                if software {
                    self.stats.get_mut(CodecImpl::Qpl).offload_fallbacks += 1;
                }
                n
            }
        };
        (n, RawReason::DidNotShrink)
    }

    fn count(&mut self, result: Option<usize>, reason: RawReason) {
        let c = self.stats.get_mut(self.which);
        c.pages += 1;
        c.bytes_in += PAGE_SIZE as u64;
        match result {
            Some(n) => {
                c.compressed += 1;
                c.bytes_out += n as u64;
            }
            None => {
                c.bytes_out += PAGE_SIZE as u64;
                match reason {
                    RawReason::Sampled => c.skipped_by_sampling += 1,
                    RawReason::DidNotShrink => c.raw_fallbacks += 1,
                    RawReason::NoCodec => {}
                }
                self.last_raw_reason = reason;
            }
        }
    }
}

enum DecoderEngine {
    None,
    #[cfg(feature = "zstd")]
    Zstd(Box<packet::ZstdDecoders>),
    #[cfg(feature = "deflate")]
    Deflate(Box<libdeflater::Decompressor>),
    #[cfg(feature = "lz4")]
    Lz4,
    /// QPL's inflate (IAA), with libdeflate for what it does not decode.
    #[cfg(feature = "qpl")]
    Qpl(Box<QplDecompressor>, Box<libdeflater::Decompressor>),
}

impl fmt::Debug for DecoderEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DecoderEngine::None => "None",
            #[cfg(feature = "zstd")]
            DecoderEngine::Zstd(_) => "Zstd",
            #[cfg(feature = "deflate")]
            DecoderEngine::Deflate(_) => "Deflate",
            #[cfg(feature = "lz4")]
            DecoderEngine::Lz4 => "Lz4",
            #[cfg(feature = "qpl")]
            DecoderEngine::Qpl(..) => "Qpl",
        })
    }
}

/// Decodes single pages. One per receiver thread; receivers decode in
/// parallel, each page on its own.
#[derive(Debug)]
pub struct PageDecompressor {
    codec: CodecId,
    engine: DecoderEngine,
    offload_fallbacks: u64,
}

/// Which inflate the destination uses for deflate pages, from its QPL path
/// (`--qpl-path`) and an attempt to open QPL's hardware path
/// (`open_hardware`, called only when the path allows IAA). Pure apart from
/// that call:
///
/// * `software`: libdeflate (QPL's software inflate gains nothing over it);
/// * `auto`: IAA when it opens, libdeflate otherwise;
/// * `hardware`: IAA, or the error that says why it cannot be had.
///
/// `Some` is the opened hardware engine, `None` libdeflate.
pub fn choose_inflate<T>(
    path: QplPath,
    open_hardware: impl FnOnce() -> Result<T, CodecError>,
) -> Result<Option<T>, CodecError> {
    match path {
        QplPath::Software => Ok(None),
        QplPath::Auto => Ok(open_hardware().ok()),
        QplPath::Hardware => open_hardware().map(Some),
    }
}

impl PageDecompressor {
    /// A decoder for the session's wire codec. A session whose pages came
    /// from QPL uses [`CodecId::Deflate`].
    ///
    /// # Errors
    ///
    /// [`CodecError::NotBuilt`] for a codec whose feature is off;
    /// [`CodecError::Init`] if the codec library cannot start.
    pub fn new(codec: CodecId) -> Result<Self, CodecError> {
        let engine = match codec {
            CodecId::None => DecoderEngine::None,
            #[cfg(feature = "zstd")]
            CodecId::Zstd | CodecId::ZstdPacket => {
                DecoderEngine::Zstd(Box::new(packet::ZstdDecoders::new()?))
            }
            #[cfg(feature = "deflate")]
            CodecId::Deflate => DecoderEngine::Deflate(Box::new(libdeflater::Decompressor::new())),
            #[cfg(feature = "lz4")]
            CodecId::Lz4 => DecoderEngine::Lz4,
            #[allow(unreachable_patterns)] // reachable when a codec feature is off
            not_built => {
                return Err(CodecError::NotBuilt {
                    feature: not_built.name(),
                });
            }
        };
        Ok(Self {
            codec,
            engine,
            offload_fallbacks: 0,
        })
    }

    /// A destination's decoder for `codec`: for deflate, IAA through QPL
    /// when `qpl_path` allows it and the hardware opens (see
    /// [`choose_inflate`]), libdeflate otherwise; other codecs as
    /// [`new`](Self::new).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new); with [`QplPath::Hardware`], why IAA cannot be
    /// used ([`CodecError::QplUnavailable`], a QPL status, or
    /// [`CodecError::NotBuilt`] without the `qpl` feature).
    pub fn for_destination(codec: CodecId, qpl_path: QplPath) -> Result<Self, CodecError> {
        if codec != CodecId::Deflate {
            return Self::new(codec);
        }
        #[cfg(feature = "qpl")]
        let hardware = choose_inflate(qpl_path, || QplDecompressor::new(QplPath::Hardware))?;
        #[cfg(not(feature = "qpl"))]
        let hardware: Option<std::convert::Infallible> =
            choose_inflate(qpl_path, || Err(CodecError::NotBuilt { feature: "qpl" }))?;
        match hardware {
            #[cfg(feature = "qpl")]
            Some(qpl) => Ok(Self {
                codec,
                engine: DecoderEngine::Qpl(
                    Box::new(qpl),
                    Box::new(libdeflater::Decompressor::new()),
                ),
                offload_fallbacks: 0,
            }),
            #[cfg(not(feature = "qpl"))]
            Some(never) => match never {},
            None => Self::new(codec),
        }
    }

    /// Adds the session's dictionaries, so packets may name them (zstd;
    /// other codecs take none).
    ///
    /// # Errors
    ///
    /// [`CodecError::Dictionary`] when libzstd rejects one.
    #[cfg_attr(not(feature = "zstd"), allow(unused_mut))]
    pub fn with_dictionaries(
        mut self,
        dictionaries: &[CodecDictionary],
    ) -> Result<Self, CodecError> {
        self.add_dictionaries(dictionaries)?;
        Ok(self)
    }

    /// Adds dictionaries to a decoder in use (a refresh during the
    /// session); one with the id of a known one replaces it.
    ///
    /// # Errors
    ///
    /// [`CodecError::Dictionary`] when libzstd rejects one.
    pub fn add_dictionaries(&mut self, dictionaries: &[CodecDictionary]) -> Result<(), CodecError> {
        #[cfg(feature = "zstd")]
        if let DecoderEngine::Zstd(decoders) = &mut self.engine {
            for dictionary in dictionaries {
                decoders.add_dictionary(dictionary)?;
            }
        }
        let _ = dictionaries;
        Ok(())
    }

    /// Decodes the frame of a [`CodecId::ZstdPacket`] packet made with
    /// dictionary `dictionary` (0: none) into exactly `pages` pages, and
    /// returns them back to back. Never decodes more than `pages` ×
    /// `PAGE_SIZE` bytes; any other size is an error.
    ///
    /// # Errors
    ///
    /// [`CodecError::PacketSize`], [`CodecError::Malformed`],
    /// [`CodecError::UnknownDictionary`], [`CodecError::BadInputLength`]
    /// for a frame no shorter than its pages; [`CodecError::NoCodec`] for a
    /// decoder of another codec.
    pub fn decompress_packet(
        &mut self,
        frame: &[u8],
        dictionary: u8,
        pages: usize,
    ) -> Result<&[u8], CodecError> {
        match &mut self.engine {
            #[cfg(feature = "zstd")]
            DecoderEngine::Zstd(decoders) if self.codec == CodecId::ZstdPacket => {
                decoders.decompress_packet(frame, dictionary, pages)
            }
            _ => {
                let _ = (frame, dictionary, pages);
                Err(CodecError::NoCodec)
            }
        }
    }

    /// The wire codec this decoder reads.
    pub fn codec(&self) -> CodecId {
        self.codec
    }

    /// What decodes: [`CodecImpl::Qpl`] when deflate pages go to IAA.
    pub fn implementation(&self) -> CodecImpl {
        match self.engine {
            #[cfg(feature = "qpl")]
            DecoderEngine::Qpl(..) => CodecImpl::Qpl,
            _ => CodecImpl::ALL
                .into_iter()
                .find(|which| which.wire() == self.codec && *which != CodecImpl::Qpl)
                .unwrap_or(CodecImpl::None),
        }
    }

    /// Pages the offload engine did not decode, so libdeflate did.
    pub fn offload_fallbacks(&self) -> u64 {
        self.offload_fallbacks
    }

    /// Decodes one compressed page into `out`. Errors unless `input` is a
    /// valid stream of 1..=`PAGE_SIZE - 1` bytes decoding to exactly
    /// `PAGE_SIZE` bytes. On error `out` holds unspecified bytes (the
    /// migration fails anyway); nothing outside `out` is ever written.
    pub fn decompress(
        &mut self,
        input: &[u8],
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<(), CodecError> {
        self.decompress_with(input, 0, out)
    }

    /// [`decompress`](Self::decompress) of a page compressed against
    /// dictionary `dictionary` (0: none), which must be one of
    /// [`with_dictionaries`](Self::with_dictionaries)'s.
    pub fn decompress_with(
        &mut self,
        input: &[u8],
        dictionary: u8,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<(), CodecError> {
        let codec = self.codec.name();
        if matches!(self.engine, DecoderEngine::None) {
            return Err(CodecError::NoCodec);
        }
        if input.is_empty() || input.len() > MAX_COMPRESSED {
            return Err(CodecError::BadInputLength {
                codec,
                len: input.len(),
            });
        }
        // Every decoder below takes `out` as an exact-size slice and checks
        // each write against its length.
        let decoded = match &mut self.engine {
            DecoderEngine::None => unreachable!("checked above"),
            #[cfg(feature = "zstd")]
            DecoderEngine::Zstd(d) => d.decompress_page(input, dictionary, out)?,
            // Unreachable in a build without any codec.
            #[allow(unreachable_patterns)]
            _ if dictionary != 0 => {
                return Err(CodecError::UnknownDictionary {
                    codec,
                    id: dictionary,
                });
            }
            #[cfg(feature = "deflate")]
            DecoderEngine::Deflate(d) => inflate(d, input, out, codec)?,
            #[cfg(feature = "qpl")]
            DecoderEngine::Qpl(qpl, d) => match qpl.decompress(input, out) {
                Some(PAGE_SIZE) => PAGE_SIZE,
                _ => {
                    self.offload_fallbacks += 1;
                    inflate(d, input, out, codec)?
                }
            },
            #[cfg(feature = "lz4")]
            DecoderEngine::Lz4 => match lz4_flex::block::decompress_into(input, out) {
                Ok(n) => n,
                Err(lz4_flex::block::DecompressError::OutputTooSmall { .. }) => {
                    return Err(CodecError::OversizedPage { codec });
                }
                Err(e) => {
                    return Err(CodecError::Malformed {
                        codec,
                        detail: e.to_string(),
                    });
                }
            },
        };
        if decoded != PAGE_SIZE {
            return Err(CodecError::ShortPage { codec, decoded });
        }
        Ok(())
    }

    /// [`decompress`](Self::decompress) straight into guest memory, no
    /// bounce buffer.
    ///
    /// # Safety
    ///
    /// `page_out` must point to [`PAGE_SIZE`] writable bytes that no other
    /// thread reads or writes during the call (on the destination the guest
    /// is not running and each page belongs to one receiver per iteration).
    pub unsafe fn decompress_page(
        &mut self,
        input: &[u8],
        page_out: *mut u8,
    ) -> Result<(), CodecError> {
        // SAFETY: forwarded caller contract.
        unsafe { self.decompress_page_with(input, 0, page_out) }
    }

    /// [`decompress_page`](Self::decompress_page) of a page compressed
    /// against dictionary `dictionary` (0: none).
    ///
    /// # Safety
    ///
    /// As [`decompress_page`](Self::decompress_page).
    pub unsafe fn decompress_page_with(
        &mut self,
        input: &[u8],
        dictionary: u8,
        page_out: *mut u8,
    ) -> Result<(), CodecError> {
        // SAFETY: the caller guarantees PAGE_SIZE writable, unaliased bytes
        // at `page_out`, and u8 has alignment 1. The decoders write only
        // through this exact-size reference and bound every write by its
        // length, so nothing past the page can be written.
        let out = unsafe { &mut *page_out.cast::<[u8; PAGE_SIZE]>() };
        self.decompress_with(input, dictionary, out)
    }
}

/// libdeflate's inflate of one page, its errors as [`CodecError`]s.
#[cfg(feature = "deflate")]
fn inflate(
    d: &mut libdeflater::Decompressor,
    input: &[u8],
    out: &mut [u8; PAGE_SIZE],
    codec: &'static str,
) -> Result<usize, CodecError> {
    match d.deflate_decompress(input, out) {
        Ok(n) => Ok(n),
        Err(libdeflater::DecompressionError::InsufficientSpace) => {
            Err(CodecError::OversizedPage { codec })
        }
        Err(e) => Err(CodecError::Malformed {
            codec,
            detail: e.to_string(),
        }),
    }
}

#[cfg(test)]
mod feature_tests {
    use super::*;

    /// Stands in for QPL's hardware path in [`choose_inflate`].
    #[derive(Debug, PartialEq)]
    struct StandInIaa;

    fn no_iaa() -> Result<StandInIaa, CodecError> {
        Err(CodecError::QplUnavailable("no IAA work queue".into()))
    }

    #[test]
    fn the_destination_inflates_on_iaa_only_when_its_path_allows_and_iaa_opens() {
        let never = || -> Result<StandInIaa, CodecError> {
            panic!("the software path must not open the hardware")
        };
        assert_eq!(choose_inflate(QplPath::Software, never).unwrap(), None);
        assert_eq!(choose_inflate(QplPath::Auto, no_iaa).unwrap(), None);
        assert_eq!(
            choose_inflate(QplPath::Auto, || Ok(StandInIaa)).unwrap(),
            Some(StandInIaa)
        );
        assert_eq!(
            choose_inflate(QplPath::Hardware, || Ok(StandInIaa)).unwrap(),
            Some(StandInIaa)
        );
        let error = choose_inflate(QplPath::Hardware, no_iaa).unwrap_err();
        assert!(error.to_string().contains("no IAA work queue"), "{error}");
    }

    #[test]
    fn without_iaa_the_destination_inflates_with_libdeflate() {
        if qpl_available().is_ok() {
            tern_test_skip::skip(
                tern_test_skip::Need::NoQpl,
                "libqpl loads here; this checks the machine without it",
            );
            return;
        }
        let mut page = [0u8; PAGE_SIZE];
        for (i, byte) in page.iter_mut().enumerate() {
            *byte = u8::try_from(i / 64).unwrap_or(u8::MAX);
        }
        let mut compressed = [0u8; MAX_COMPRESSED];
        let len = PageCompressor::new(CodecId::Deflate, 1)
            .unwrap()
            .compress(&page, &mut compressed)
            .expect("compressible");
        for path in [QplPath::Auto, QplPath::Software] {
            let mut decoder = PageDecompressor::for_destination(CodecId::Deflate, path).unwrap();
            assert_eq!(decoder.implementation(), CodecImpl::Deflate);
            let mut out = [0u8; PAGE_SIZE];
            decoder.decompress(&compressed[..len], &mut out).unwrap();
            assert_eq!(out, page);
            assert_eq!(decoder.offload_fallbacks(), 0);
        }
        let error = PageDecompressor::for_destination(CodecId::Deflate, QplPath::Hardware)
            .expect_err("asked for IAA without libqpl");
        assert!(
            matches!(
                error,
                CodecError::QplUnavailable(_) | CodecError::NotBuilt { .. }
            ),
            "{error}"
        );
        // Other codecs are not affected by the QPL path.
        let zstd = PageDecompressor::for_destination(CodecId::Zstd, QplPath::Hardware);
        assert_eq!(zstd.is_ok(), CodecId::Zstd.is_built());
    }

    #[test]
    fn a_codec_left_out_is_a_typed_error_naming_its_feature() {
        for codec in CodecId::ALL {
            let compressor = PageCompressor::new(codec, 1);
            let decompressor = PageDecompressor::new(codec);
            assert_eq!(compressor.is_ok(), codec.is_built(), "{codec}");
            assert_eq!(decompressor.is_ok(), codec.is_built(), "{codec}");
            if let Err(e) = compressor {
                assert!(
                    matches!(e, CodecError::NotBuilt { feature } if feature == codec.name()),
                    "{e}"
                );
                assert_eq!(
                    e.to_string(),
                    format!("tern-page was built without the {codec} feature")
                );
            }
        }
        let qpl = PageCompressor::with_qpl(QplPath::Auto, 1);
        if !cfg!(feature = "qpl") {
            assert!(matches!(qpl, Err(CodecError::NotBuilt { feature: "qpl" })));
            assert!(matches!(
                qpl_available(),
                Err(CodecError::NotBuilt { feature: "qpl" })
            ));
        }
        assert_eq!(CodecChoice::Qpl.is_built(), cfg!(feature = "qpl"));
        assert!(CodecChoice::Auto.is_built());
    }
}

#[cfg(all(test, feature = "zstd"))]
mod dictionary_tests;

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
//! # Codecs, one file each
//!
//! Each codec is a file (`zstd/`, `deflate.rs`, `lz4.rs`, `qpl.rs`) behind
//! its cargo feature, which registers its implementations (an encoder and a
//! decoder behind two small traits, `backend.rs`) with one line in
//! `registry.rs`; [`PageCompressor`] and [`PageDecompressor`] name no codec.
//! Adding a codec is its file, its line in the registry, and its wire id
//! ([`CodecId`], from `tern_wire::codec_id`). Why these crates:
//!
//! * **zstd** (the `zstd` crate, libzstd): best ratio per CPU second at low
//!   levels; per page, or one frame per packet, with trained dictionaries.
//! * **deflate** (`libdeflater`, libdeflate): raw deflate whose streams fit
//!   a 4 KiB window, the IAA-compatible format; [`CodecChoice::Qpl`]
//!   produces the same format, so either side may lack IAA.
//! * **lz4** (`lz4_flex`, block format): pure Rust, bounds-checked decoder,
//!   a single speed ([`CodecId::Lz4`] reports level 1).
//! * **qpl** (Intel QPL, loaded at run time): deflate through IAA.
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

mod auto;
mod backend;
mod batch;
mod bench;
mod bench_dictionary;
mod compressor;
mod decompressor;
#[cfg(feature = "deflate")]
mod deflate;
mod dictionary;
mod error;
mod id;
#[cfg(feature = "lz4")]
mod lz4;
#[cfg(feature = "qpl")]
mod qpl;
mod qpl_path;
mod registry;
mod sample;
mod stats;
#[cfg(all(test, feature = "zstd", feature = "deflate", feature = "lz4"))]
mod tests;
mod training;
#[cfg(feature = "zstd")]
mod zstd;

pub use auto::{
    AUTO_MAX_LEVEL, AutoDecision, AutoSelector, CodecMeasurement, ContentWatch,
    OFFLOAD_RATIO_TOLERANCE, Steadiness, SteadyChoice, calibrate, calibrate_qpl,
    calibrate_with_dictionary, choose_codec, prefer_offload, tune_level,
};
pub use batch::{CompressedBatch, MAX_COMPRESSED, PageOutcome, RawReason};
pub use bench::{CodecBenchRow, bench_codecs, corpus_page, default_bench_levels};
pub use bench_dictionary::{PacketCorpus, ZstdVariantRow, bench_zstd_variants};
pub use compressor::PageCompressor;
pub use decompressor::{PageDecompressor, choose_inflate};
pub use dictionary::{CodecDictionary, DEFAULT_DICTIONARY_LEN, DICTIONARY_SAMPLE_PAGES};
pub use error::CodecError;
pub use id::{CodecChoice, CodecId, CodecImpl};
#[cfg(feature = "qpl")]
pub use qpl::{QplCompressor, QplDecompressor};
pub use qpl_path::QplPath;
pub use registry::qpl_available;
pub use sample::{
    INCOMPRESSIBLE_DISTINCT, SAMPLE_WORDS, looks_incompressible, looks_incompressible_bytes,
    sample_distinct_bytes,
};
pub use stats::{CodecCounters, CodecStats};
pub use training::train_dictionary;

#[cfg(all(test, feature = "zstd"))]
mod dictionary_tests;

//! What happens to one page of guest memory during migration.
//!
//! Every page the engine sends passes through this crate first. The cheapest
//! page to send is one we do not send at all: zero pages are announced with a
//! flag instead of 4 KiB of payload, so [`zero`] decides that as fast as the
//! memory system allows, and [`dsa`] can hand the same question to an Intel
//! DSA accelerator (or its software stand-in) in batches, asynchronously.
//! Non-zero pages then go through [`codec`]: each page compressed on its own
//! (zstd, IAA-compatible deflate, lz4, or Intel QPL), or sent raw when it
//! would not shrink.

#![warn(missing_docs)]

pub mod codec;
pub mod cpu_time;
pub mod dsa;
pub mod zero;

pub use codec::{
    AutoSelector, CodecChoice, CodecError, CodecId, CodecStats, CompressedBatch, PageCompressor,
    PageDecompressor, PageOutcome,
};
pub use zero::{
    PAGE_SIZE, ZeroCheckBackend, ZeroCheckError, ZeroChecker, is_zero_page_qemu_style,
    read_bandwidth_probe,
};

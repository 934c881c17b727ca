//! What happens to one page of guest memory during migration.
//!
//! Every page the engine sends passes through this crate first. The cheapest
//! page to send is one we do not send at all: zero pages are announced with a
//! flag instead of 4 KiB of payload, so [`zero`] decides that as fast as the
//! memory system allows, and [`offload`] is the interface through which an
//! accelerator (Intel DSA, in the `tern-dsa` crate) answers the same
//! question in batches, asynchronously. Non-zero pages then go through
//! [`codec`]: each page compressed on its own (zstd, IAA-compatible deflate,
//! lz4, or Intel QPL), or sent raw when it would not shrink. A page sent
//! before may go as a [`delta`] against its previous version instead.
//!
//! # Example
//!
//! Zero-page detection with the fastest backend this CPU has:
//!
//! ```
//! use tern_page::{PAGE_SIZE, ZeroChecker};
//!
//! let checker = ZeroChecker::best();
//! let mut page = vec![0u8; PAGE_SIZE];
//! assert!(checker.is_zero(&page));
//! page[PAGE_SIZE - 1] = 1;
//! assert!(!checker.is_zero(&page));
//! // Guest memory that the guest may be writing is checked through a
//! // pointer instead (see `zero`'s module docs for why).
//! // SAFETY: `page` is PAGE_SIZE readable bytes.
//! assert!(!unsafe { checker.is_zero_page(page.as_ptr()) });
//! ```
//!
//! [`codec`] shows a compression round trip.
//!
//! # Cargo features
//!
//! `zstd`, `deflate`, `lz4` and `qpl` (Intel QPL, loaded at run time;
//! implies `deflate`), all on by default, one per codec. A codec left out
//! keeps its enum variants; choosing it is a [`CodecError::NotBuilt`] at run
//! time. The Intel DSA driver is a crate of its own, `tern-dsa`, which
//! implements [`offload`]'s traits.

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
// Items visible outside the crate are exactly those reachable from its root.
#![warn(unreachable_pub)]
// Numeric casts that can truncate or change sign are spelled out (try_from,
// or an `expect` attribute with the reason); see docs/publishing.md.
#![warn(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::cast_lossless,
    clippy::ptr_as_ptr
)]

pub mod codec;
pub mod cpu_time;
pub mod delta;
pub mod offload;
pub mod zero;

pub use codec::{
    AutoSelector, CodecChoice, CodecError, CodecId, CodecStats, CompressedBatch, PageCompressor,
    PageDecompressor, PageOutcome,
};
pub use offload::{
    CpuOffload, DeltaOffload, DeltaOffloadStats, MAX_BATCH_PAGES, OffloadError, OffloadId, Ticket,
    TicketState, ZeroOffloadStats, ZeroPageOffload, cpu_offload,
};
pub use zero::{
    PAGE_SIZE, ZeroCheckBackend, ZeroCheckError, ZeroChecker, is_zero_page_qemu_style,
    read_bandwidth_probe,
};

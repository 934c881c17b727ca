//! tern's live-migration engine.
//!
//! A VMM implements the traits in [`guest`]; the engine moves the guest's
//! memory and state to a destination over one main channel and several page
//! channels, with dirty iterations, convergence and a verified switch-over.
//!
//! ```text
//! source                                   destination
//! producer ─ring→ workers ─ring→ senders ══TCP/Unix══> receivers → guest memory
//!     ↑______ completion ring ______|                     (sync barrier per iteration)
//! main channel: hello, state sections, complete ═══> verify digest, restore, resume
//! ```
#![warn(missing_docs)]

pub mod bitmap;
pub mod config;
pub mod destination;
pub mod digest;
pub mod error;
pub mod guest;
mod pipeline;
pub mod ring;
pub mod source;
pub mod stats;
pub mod transport;
pub mod uring_zc;
pub mod zerocopy;

pub use bitmap::DirtyBitmap;
pub use config::{
    LimitPolicy, MigrationConfig, ReceiveConfig, Verify, ZeroCopyBackend, ZeroPageDetection,
};
pub use destination::{Destination, ReceivePhase, ReceiveStats, Received};
pub use error::{ChannelError, MigrationError};
pub use guest::{
    DestinationGuest, DeviceState, DirtyLog, GuestControl, GuestError, GuestMemory, GuestResult,
    MemoryRegion, PAGE_SIZE, SourceGuest, StateSection,
};
pub use source::{CancelToken, MigrationFailure, Source};
pub use stats::{DestinationStats, LiveStats, MigrationStats, MigrationStatus, RamStats};
pub use transport::{Address, Channel, Listener};

// Foreign types that appear in this crate's API, so that an embedder needs
// no direct dependency on tern-page or tern-wire.
pub use tern_page::codec::{CodecChoice, QplPath};
pub use tern_page::dsa::ZeroPageOffload;
pub use tern_wire::{AbortReason, RegionInfo, SessionSetup};

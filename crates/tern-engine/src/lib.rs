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
//!
//! # Example
//!
//! Migrate a small guest from one thread to another over a Unix socket. The
//! guest here is `tern-synthetic`'s (memory with a known content mix); a VMM
//! implements [`SourceGuest`] and [`DestinationGuest`] for its own.
//!
//! ```
//! use tern_engine::{
//!     Address, Destination, GuestControl, Listener, MigrationConfig, MigrationStatus,
//!     ReceiveConfig, Source,
//! };
//! use tern_synthetic::{SyntheticConfig, SyntheticGuest};
//!
//! let dir = tempfile::tempdir()?;
//! let address = Address::Unix(dir.path().join("migration.sock"));
//! let listener = Listener::bind(&address)?;
//!
//! // The destination builds an empty guest shaped like the source's regions,
//! // receives into it and resumes it.
//! let destination = std::thread::spawn(move || {
//!     Destination::new(ReceiveConfig::default()).receive(&listener, |setup| {
//!         let lens: Vec<u64> = setup.regions.iter().map(|region| region.len).collect();
//!         Ok(SyntheticGuest::empty(&lens)?)
//!     })
//! });
//!
//! let mut guest = SyntheticGuest::new(&SyntheticConfig {
//!     memory_bytes: 4 << 20,
//!     dirty_rate_bytes_per_sec: 0,
//!     ..SyntheticConfig::default()
//! })?;
//! let stats = Source::new(MigrationConfig::default())?.migrate(&mut guest, &address)?;
//! assert_eq!(stats.status, MigrationStatus::Completed);
//! assert!(stats.digest_verified);
//!
//! let mut received = destination.join().expect("destination thread")?;
//! received.guest.pause()?;
//! assert_eq!(received.guest.digest(), guest.digest());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
// Items visible outside the crate are exactly those reachable from its root.
#![warn(unreachable_pub)]

pub mod bitmap;
mod cancel;
pub mod config;
pub mod control;
mod deadline;
pub mod destination;
mod digest;
pub mod error;
pub mod fault;
#[doc(hidden)]
pub mod fuzzing;
pub mod guest;
pub mod handover;
mod numeric;
mod pipeline;
pub mod postcopy;
mod ring;
pub mod snapshot;
pub mod source;
pub mod stats;
mod switch_over_timeline;
pub mod transport;
#[cfg(feature = "vm-memory")]
pub mod vm_memory;

pub use bitmap::DirtyBitmap;
pub use config::{
    DEFAULT_DELTA_CACHE_ALLOWANCE_MAX, DEFAULT_SWITCH_OVER_TIMEOUT, DictionaryRefresh, LimitPolicy,
    MigrationConfig, ReceiveConfig, UnauthenticatedPolicy, UnknownName, Verify, ZeroCopyBackend,
    ZeroPageDetection,
};
pub use control::{
    CONTRACT_VERSION, ControlError, EVENT_HISTORY, Event, EventBody, EventHistory, MigrationHandle,
    MigrationParameters, ReceiveReport, Subscription,
};
pub use destination::{Destination, ReceiveHandle, ReceivePhase, ReceiveStats, Received};
pub use error::{ChannelError, MigrationError};
pub use guest::{
    DestinationGuest, DeviceState, DirtyLog, GuestControl, GuestError, GuestMemory, GuestResult,
    MemoryRegion, PAGE_SIZE, RegionFile, SourceGuest, StateSection,
};
pub use handover::HandedFile;
pub use postcopy::{PostcopyMode, PostcopyReport, PostcopyTrigger};
pub use snapshot::{
    DirtyTracker, LazyRestore, RestoreConfig, Restored, SaveConfig, SnapshotError, SnapshotFile,
    restore, restore_lazy, restore_lazy_prepared, save, save_tracked,
};
pub use source::{CancelToken, MigrationFailure, Source};
pub use stats::{
    DedupStats, DestinationCatchUp, DestinationStats, DigestComparison, DowntimeCause,
    DowntimeParts, DowntimeSide, ExpectedDowntimeParts, LiveStats, MigrationStats, MigrationStatus,
    RamStats, SessionSecurity, XbzrleCacheStats,
};
pub use switch_over_timeline::{SwitchOverTimeline, TimelineStep};
#[cfg(feature = "ring")]
pub use transport::auth::RingCrypto;
pub use transport::auth::{AuthCrypto, AuthKey};
pub use transport::security::{ChannelSecurity, Security, TlsInfo};
pub use transport::tls::{KernelTls, TlsConfig};
/// The zero-copy senders, at their historical path.
pub use transport::zerocopy;
/// The io_uring zero-copy sender, at its historical path.
pub use transport::zerocopy::uring as uring_zc;
pub use transport::{Accept, Address, Channel, Connect, Connector, Listener};

// Foreign types that appear in this crate's API, so that an embedder needs
// no direct dependency on tern-page, tern-wire or tern-dsa.
/// The Intel DSA driver (feature `dsa`): `open_dsa`, `software_dsa`,
/// `DsaConfig`, the delta offload, for [`MigrationConfig::zero_page_offload`]
/// and [`MigrationConfig::delta_offload`].
#[cfg(feature = "dsa")]
pub use tern_dsa as dsa;
pub use tern_page::codec::{CodecChoice, CodecError, CodecId, QplPath};
/// The offload traits and their types (tickets, statistics, errors), for an
/// embedder's own zero-page or delta accelerator
/// ([`MigrationConfig::zero_page_offload`], [`MigrationConfig::delta_offload`]).
pub use tern_page::offload;
pub use tern_page::{DeltaOffload, ZeroPageOffload};
/// The snapshot file format's own errors (the source of
/// [`SnapshotError`]'s format variant).
pub use tern_wire::snapshot::SnapshotError as SnapshotFormatError;
pub use tern_wire::{
    AbortReason, DigestAlgorithm, HandoverCoverage, PROTOCOL_VERSION, RegionInfo, SessionSetup,
    WireError,
};

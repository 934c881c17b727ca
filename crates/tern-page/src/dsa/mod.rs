//! Zero-page detection offloaded to Intel DSA (Data Streaming Accelerator),
//! with a software device for machines without one and the CPU as fallback.
//!
//! The layers, bottom up:
//!
//! * [`desc`]: the 64-byte descriptor and 32-byte completion record, as in
//!   `<linux/idxd.h>`, with the constants the engine uses.
//! * [`sysfs`]: finding enabled user work queues under `/sys/bus/dsa`, DSA
//!   (`dsaN`) and IAA (`iaxN`) apart.
//! * [`select`]: the user's device/queue list and the NUMA preference.
//! * [`queue`]: the [`DsaQueue`] trait and [`HardwareQueue`] (MOVDIR64B,
//!   ENQCMD or write(), chosen at start-up).
//! * [`soft`]: [`SoftwareDsa`], a thread that executes the same descriptors,
//!   with injectable faults, delays and errors.
//! * [`offload`]: the asynchronous batch API workers use
//!   ([`ZeroPageOffload`]), its DSA implementation with a completion thread
//!   and CPU fallback, and a CPU-only implementation with the same shape.
//! * [`delta`]: create- and apply-delta-record descriptors for delta pages
//!   ([`DeltaOffload`]), on a queue or the software device, CPU fallback.
//! * [`mod@bench`]: throughput of every backend for `tern bench zero`.
//!
//! See `docs/zero-page-detection.md` for the design and the DSA set-up.
//!
//! # Cargo feature
//!
//! The `dsa` feature (on by default) decides whether tern opens DSA
//! hardware: without it [`open_dsa`] fails with [`OffloadError::NotBuilt`].
//! The engine, the descriptors and the software device are plain Rust with
//! no dependency, so they are always built (the software device is what the
//! tests run).

pub mod bench;
pub mod delta;
pub mod desc;
pub mod offload;
pub mod queue;
pub mod select;
pub mod soft;
pub mod sysfs;

use std::path::PathBuf;

pub use bench::{ZeroBenchRow, bench_zero};
pub use delta::{
    DELTA_DEADLINE, DeltaOffload, DeltaOffloadStats, open_delta_offload, software_delta_offload,
};
pub use desc::{CompletionRecord, Descriptor, DsaStatus};
pub use offload::{
    CpuOffload, DsaConfig, MAX_BATCH_PAGES, OffloadConfig, Ticket, ZeroAsNormal, ZeroOffloadStats,
    ZeroPageOffload, cpu_offload, open_dsa,
};
pub use offload::{DsaOffload, software_dsa};
pub use queue::{CpuSubmitFeatures, DsaQueue, HardwareQueue, SubmissionMethod, SubmitError};
pub use select::{BadSelection, DsaDevice, DsaSelection, NumaPolicy};
pub use soft::{SoftwareDsa, SoftwareDsaConfig, StallGate};
pub use sysfs::{AccelKind, WorkQueueInfo, WqMode, discover_iaa_work_queues, discover_work_queues};

/// Why the offload could not be set up or a call was refused.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    /// Discovery found nothing usable.
    #[error(
        "no DSA work queue found in {root} (is the idxd driver loaded and a user work queue \
         enabled with accel-config?)"
    )]
    NoWorkQueue {
        /// The sysfs root that was searched.
        root: String,
    },
    /// Queues were found, but none is in the user's selection.
    #[error("no DSA work queue matches --dsa-device {selection} (found: {found})")]
    NoMatch {
        /// The selection, as given.
        selection: String,
        /// The usable queues found.
        found: String,
    },
    /// Discovery found no IAA queue.
    #[error(
        "no IAA work queue found in {root} (is the idxd driver loaded and a user work queue \
         enabled on an iax device with accel-config?)"
    )]
    NoIaaQueue {
        /// The sysfs root that was searched.
        root: String,
    },
    /// A dedicated work queue is already open (by another process): it takes
    /// one opener.
    #[error(
        "DSA work queue {queue} is dedicated and already in use by another process (EBUSY); \
         configure a shared queue (accel-config config-wq --mode=shared) so several \
         processes can submit, or pick a free queue with --dsa-device"
    )]
    QueueBusy {
        /// The queue, e.g. `dsa0/wq0.0`.
        queue: String,
    },
    /// A work queue's device node could not be opened.
    #[error("cannot open DSA work queue {}: {source}", path.display())]
    Open {
        /// The device node.
        path: PathBuf,
        /// What open() said.
        source: std::io::Error,
    },
    /// Work queues were found but none could be opened.
    #[error("no DSA work queue could be opened: {0}")]
    NoneOpened(String),
    /// More pages than one submission takes.
    #[error("{0} pages in one submission; at most {MAX_BATCH_PAGES}")]
    TooManyPages(usize),
    /// DSA was asked for but the `dsa` feature was off when tern-page was
    /// built.
    #[error("tern-page was built without the {feature} feature")]
    NotBuilt {
        /// The feature: `dsa`.
        feature: &'static str,
    },
    /// A ticket from another offload, or one already waited on.
    #[error("ticket does not belong to this offload or was already waited on")]
    BadTicket,
}

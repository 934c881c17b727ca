//! Zero-page detection offloaded to Intel DSA (Data Streaming Accelerator),
//! with a software device for machines without one and the CPU as fallback.
//!
//! The layers, bottom up:
//!
//! * [`desc`]: the 64-byte descriptor and 32-byte completion record, as in
//!   `<linux/idxd.h>`, with the constants the engine uses.
//! * [`sysfs`]: finding enabled user work queues under `/sys/bus/dsa`.
//! * [`queue`]: the [`DsaQueue`] trait and [`HardwareQueue`] (MOVDIR64B,
//!   ENQCMD or write(), chosen at start-up).
//! * [`soft`]: [`SoftwareDsa`], a thread that executes the same descriptors,
//!   with injectable faults, delays and errors.
//! * [`offload`]: the asynchronous batch API workers use
//!   ([`ZeroPageOffload`]), its DSA implementation with a completion thread
//!   and CPU fallback, and a CPU-only implementation with the same shape.
//! * [`mod@bench`]: throughput of every backend for `tern bench zero`.
//!
//! See `docs/zero-page-detection.md` for the design and the DSA set-up.
//!
//! # Cargo feature
//!
//! Everything DSA-specific (descriptors, queues, the software device, the
//! engine) is behind the `dsa` feature, on by default. Without it the
//! asynchronous API and its CPU implementation remain, and [`open_dsa`]
//! fails with [`OffloadError::NotBuilt`].

pub mod bench;
#[cfg(feature = "dsa")]
pub mod desc;
pub mod offload;
#[cfg(feature = "dsa")]
pub mod queue;
#[cfg(feature = "dsa")]
pub mod soft;
#[cfg(feature = "dsa")]
pub mod sysfs;

use std::path::PathBuf;

pub use bench::{ZeroBenchRow, bench_zero};
#[cfg(feature = "dsa")]
pub use desc::{CompletionRecord, Descriptor, DsaStatus};
pub use offload::{
    CpuOffload, DsaConfig, MAX_BATCH_PAGES, OffloadConfig, Ticket, ZeroAsNormal, ZeroOffloadStats,
    ZeroPageOffload, cpu_offload, open_dsa,
};
#[cfg(feature = "dsa")]
pub use offload::{DsaOffload, software_dsa};
#[cfg(feature = "dsa")]
pub use queue::{CpuSubmitFeatures, DsaQueue, HardwareQueue, SubmissionMethod, SubmitError};
#[cfg(feature = "dsa")]
pub use soft::{SoftwareDsa, SoftwareDsaConfig};
#[cfg(feature = "dsa")]
pub use sysfs::{WorkQueueInfo, WqMode, discover_work_queues};

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

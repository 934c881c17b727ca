//! tern's Intel DSA (Data Streaming Accelerator) driver: zero-page checks
//! and delta records on DSA work queues, with a software device for machines
//! without one and the CPU as fallback. It implements the offload traits of
//! `tern-page` ([`tern_page::ZeroPageOffload`], [`tern_page::DeltaOffload`]);
//! the dependency points one way, from here to tern-page.
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
//! * [`engine`]: [`DsaOffload`], the asynchronous batch engine behind
//!   [`ZeroPageOffload`](tern_page::ZeroPageOffload): batch slots, the
//!   submission path, the completion thread, and the decoding of records
//!   with CPU fallback; [`open_dsa`] and [`software_dsa`] build one.
//! * [`delta`]: create- and apply-delta-record descriptors for delta pages
//!   ([`DsaDeltaOffload`]), on a queue or the software device, CPU fallback.
//! * [`mod@bench`]: throughput of every backend for `tern bench zero`.
//!
//! See `docs/zero-page-detection.md` for the design and the DSA set-up.
//! **DSA hardware: not yet run**; the software device runs the tests.
//!
//! # Example
//!
//! ```
//! use tern_dsa::{SoftwareDsaConfig, software_dsa};
//! use tern_page::PAGE_SIZE;
//!
//! let offload = software_dsa(SoftwareDsaConfig::default());
//! let pages = [vec![0u8; PAGE_SIZE], vec![1u8; PAGE_SIZE]];
//! let pointers: Vec<*const u8> = pages.iter().map(|page| page.as_ptr()).collect();
//! // SAFETY: the pages stay readable until `wait` returns.
//! let ticket = unsafe { offload.submit(&pointers) }?;
//! let mut is_zero = Vec::new();
//! offload.wait(ticket, &mut is_zero)?;
//! assert_eq!(is_zero, [true, false]);
//! # Ok::<(), tern_page::OffloadError>(())
//! ```

#![warn(missing_docs)]
// Numeric casts that can truncate or change sign are spelled out (try_from,
// or an `expect` attribute with the reason), as in tern-page.
#![warn(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::cast_lossless,
    clippy::ptr_as_ptr
)]

pub mod bench;
pub mod delta;
pub mod desc;
pub mod engine;
pub mod queue;
pub mod select;
pub mod soft;
pub mod sysfs;

use std::path::PathBuf;

pub use bench::{DsaBench, ZeroBench, ZeroBenchRow, bench_zero, bench_zero_report};
pub use delta::{DELTA_DEADLINE, DsaDeltaOffload, open_delta_offload, software_delta_offload};
pub use desc::{CompletionRecord, Descriptor, DsaStatus};
pub use engine::{DsaConfig, DsaOffload, OffloadConfig, open_dsa, open_dsa_engine, software_dsa};
pub use queue::{CpuSubmitFeatures, DsaQueue, HardwareQueue, SubmissionMethod, SubmitError};
pub use select::{BadSelection, DsaDevice, DsaSelection, NumaPolicy};
pub use soft::{SoftwareDsa, SoftwareDsaConfig, StallGate};
pub use sysfs::{AccelKind, WorkQueueInfo, WqMode, discover_iaa_work_queues, discover_work_queues};

/// Why DSA could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum DsaError {
    /// Discovery found nothing usable.
    #[error(
        "no DSA work queue found in {root} (is the idxd driver loaded and a user work queue \
         enabled with accel-config?)"
    )]
    NoWorkQueue {
        /// The sysfs root that was searched.
        root: String,
    },
    /// Devices exist but shared virtual addressing is off on them
    /// (`pasid_enabled` is 0): the IOMMU is not in scalable mode.
    #[error(
        "{devices}: shared virtual addressing is off (pasid_enabled = 0), so user work queues \
         cannot take this process's addresses; enable VT-d in the firmware, boot with \
         intel_iommu=on,sm_on on the kernel command line, reboot, and check that \
         /sys/bus/dsa/devices/<device>/pasid_enabled reads 1"
    )]
    NoSva {
        /// The devices without SVA, e.g. `dsa0, dsa2`.
        devices: String,
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
}

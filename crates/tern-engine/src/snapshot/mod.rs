//! Snapshots: a guest saved to a file and brought back from it.
//!
//! The file format is tern-wire's [`tern_wire::snapshot`]
//! (docs/snapshot-format.md): every page has a slot at a fixed offset, so
//! [`save`] writes with several threads at once and, saving a running
//! guest, precopies into the file: a page dirtied again is written again
//! into the same slot, and the file never grows past memory plus metadata.
//! Zero pages are holes. The header says "incomplete" until the very last
//! write, so a save that failed (full disk, crash) leaves a file every
//! restore refuses.
//!
//! [`restore`] reads every page into a fresh guest with several threads,
//! compares the memory digest and only then resumes the guest.
//! [`restore_lazy`] resumes the guest at once and lets the fault service
//! (`crate::fault`) bring pages in as the guest touches them, while
//! loaders prefetch the recorded working set and then everything else;
//! every chunk fetched is checked against its hash first.
//!
//! A *diff* ([`SaveConfig::diff_base`]) holds only the chunks whose hash
//! differs from its base's and names the base by its memory digest; both
//! restores take it on its bases ([`RestoreConfig::bases`]), each page
//! from the topmost file that defines it, and [`merge`] writes the whole
//! as one full snapshot. [`save_tracked`] keeps the guest's dirty log
//! running after a save ([`DirtyTracker`]), and a diff it saves next holds
//! exactly the pages written since, not whole chunks.

mod file;
mod lazy;
mod merge;
mod restore;
mod save;
mod tracker;
mod writer;

use std::path::PathBuf;

pub use file::SnapshotFile;
pub use lazy::{LazyRestore, LazyStats, StartupTimes};
pub use merge::{MergeStats, merge};
pub use restore::{RestoreConfig, RestoreStats, Restored, restore};
pub use save::{SaveConfig, SaveStats, default_writers, save, save_tracked};
pub use tracker::DirtyTracker;

pub use lazy::{restore_lazy, restore_lazy_prepared};

use crate::fault::FaultError;
use crate::guest::GuestError;

/// Why a save or restore failed. Displayed with its sources, one line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The file could not be opened or created.
    #[error("cannot open {path}")]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Reading the file failed.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Writing the file failed (a full disk ends here); the file stays
    /// marked incomplete.
    #[error("cannot write {path} (the file stays marked incomplete)")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a usable snapshot.
    #[error("{path} is not a usable snapshot")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: tern_wire::snapshot::SnapshotError,
    },
    /// A chunk's pages do not hash to the value recorded for it: the file
    /// was corrupted or changed after the save.
    #[error(
        "{path}{}: chunk {chunk} of region {region} does not match its hash (corrupted or changed since the save)",
        with_bases(*bases)
    )]
    Corrupted {
        /// The file (the top one of a diff and its bases).
        path: PathBuf,
        /// The files under it (a diff's bases) the chunk was read from too.
        bases: usize,
        /// Region index.
        region: usize,
        /// Chunk index.
        chunk: u64,
    },
    /// The memory restored does not hash to the digest saved; the guest
    /// was not resumed.
    #[error(
        "memory digest mismatch after restore (snapshot {expected:032x}, memory {actual:032x}); the guest was not resumed"
    )]
    DigestMismatch {
        /// The digest in the file.
        expected: u128,
        /// The digest of memory.
        actual: u128,
    },
    /// The memory a lazy restore loaded does not hash to the digest saved;
    /// the guest, which ran meanwhile, was paused.
    #[error(
        "memory digest mismatch after a lazy restore (snapshot {expected:032x}, loaded {actual:032x}); the guest was paused"
    )]
    LazyDigestMismatch {
        /// The digest in the file.
        expected: u128,
        /// The digest of the pages loaded.
        actual: u128,
    },
    /// The files named are not a full snapshot with diffs layered on it,
    /// each taken on the memory of the one below.
    #[error("{0}")]
    Chain(String),
    /// The guest built for the restore does not have the snapshot's shape.
    #[error("the snapshot does not fit this guest: {0}")]
    Shape(String),
    /// The guest (VMM) failed.
    #[error("the guest failed")]
    Guest(#[from] GuestError),
    /// The fault service failed (lazy restore).
    #[error("lazy restore failed; the guest was paused")]
    Fault(#[from] FaultError),
    /// A configuration field holds an impossible value.
    #[error("invalid snapshot configuration: {0}")]
    Config(String),
}

fn with_bases(bases: usize) -> String {
    match bases {
        0 => String::new(),
        1 => " (on its base)".into(),
        more => format!(" (on its {more} bases)"),
    }
}

/// Checks that `guest_regions` are the snapshot's regions, in order.
pub(crate) fn check_shape(
    file: &SnapshotFile,
    guest_regions: &[crate::guest::MemoryRegion],
    guest_kind: &str,
) -> Result<(), SnapshotError> {
    shape_mismatch(file.metadata(), file.trailer(), guest_regions, guest_kind)
        .map_or(Ok(()), |detail| Err(SnapshotError::Shape(detail)))
}

/// [`check_shape`] for one file (a diff's base): the mismatch, if any.
pub(crate) fn check_layer_shape(
    layer: &file::Layer,
    guest_regions: &[crate::guest::MemoryRegion],
    guest_kind: &str,
) -> Result<(), String> {
    shape_mismatch(layer.metadata(), layer.trailer(), guest_regions, guest_kind).map_or(Ok(()), Err)
}

/// How a snapshot's regions and guest kind differ from a guest's.
fn shape_mismatch(
    metadata: &tern_wire::snapshot::SnapshotMetadata,
    trailer: &tern_wire::snapshot::Trailer,
    guest_regions: &[crate::guest::MemoryRegion],
    guest_kind: &str,
) -> Option<String> {
    let saved = &metadata.regions;
    let kind = &trailer.guest_kind;
    if !kind.is_empty() && !guest_kind.is_empty() && kind != guest_kind {
        return Some(format!("it holds a {kind} guest, not a {guest_kind} one"));
    }
    if saved.len() != guest_regions.len() {
        return Some(format!(
            "{} regions saved, the guest has {}",
            saved.len(),
            guest_regions.len()
        ));
    }
    saved
        .iter()
        .zip(guest_regions)
        .enumerate()
        .find(|(_, (saved, guest))| saved.len != guest.len() || saved.id != guest.id())
        .map(|(index, (saved, guest))| {
            format!(
                "region {index} was saved as id {} of {} bytes, the guest has id {} of {} bytes",
                saved.id,
                saved.len,
                guest.id(),
                guest.len()
            )
        })
}

/// The engine's state sections from the file's.
pub(crate) fn sections(file: &SnapshotFile) -> Vec<crate::guest::StateSection> {
    file.trailer()
        .sections
        .iter()
        .map(|section| crate::guest::StateSection {
            name: section.name.clone(),
            version: section.version,
            data: section.data.clone(),
        })
        .collect()
}

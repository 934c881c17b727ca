//! A dirty log kept running from one snapshot to the next, so a diff
//! writes exactly the pages written since its base (Firecracker's
//! `track_dirty_pages` with `snapshot_type: Diff`).
//!
//! A diff compared by content ([`crate::snapshot::SaveConfig::diff_base`]
//! with [`crate::snapshot::save`]) hashes all memory and writes whole
//! 16-page chunks. A tracked diff reads and writes only the pages the log
//! reports; the hashes of every other page are the ones the previous
//! save computed, kept here, so the diff's chunk hashes and memory digest
//! still describe the whole memory (docs/snapshot-format.md) without a
//! page of it being read again.

use crate::bitmap::DirtyBitmap;
use crate::guest::MemoryRegion;

/// What [`crate::snapshot::save_tracked`] keeps between saves of one guest:
/// the snapshot the dirty log runs since, every page's hash in it, and the
/// pages the log reported that no finished snapshot holds yet.
///
/// Use one tracker with one guest only. While it tracks, the guest's dirty
/// log must stay running: a log stopped or reset by anyone else (a
/// migration, another save) loses pages, and a tracked diff taken after
/// that would be wrong; take a diff by content then
/// ([`crate::snapshot::save`] with `diff_base`).
#[derive(Debug, Default)]
pub struct DirtyTracker {
    since: Option<Tracked>,
}

#[derive(Debug)]
pub(crate) struct Tracked {
    /// The memory digest of the snapshot the log runs since.
    pub(crate) digest: u128,
    /// That snapshot's file, for error messages.
    pub(crate) path: std::path::PathBuf,
    /// Region ids and lengths it was taken of.
    pub(crate) shape: Vec<(u32, u64)>,
    /// Every page's hash in it, per region.
    pub(crate) page_hashes: Vec<Vec<u64>>,
    /// Pages synced from the log by a save that then failed: the log no
    /// longer reports them, so the next diff must write them anyway.
    pub(crate) owed: Vec<DirtyBitmap>,
}

impl DirtyTracker {
    /// A tracker that tracks nothing yet: the next
    /// [`crate::snapshot::save_tracked`] must be a full save.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The memory digest of the snapshot the dirty log runs since, if any.
    #[must_use]
    pub fn base_digest(&self) -> Option<u128> {
        self.since.as_ref().map(|tracked| tracked.digest)
    }

    /// Whether the guest's dirty log was started by a tracked save and is
    /// still owned by this tracker.
    #[must_use]
    pub fn is_tracking(&self) -> bool {
        self.since.is_some()
    }

    pub(crate) fn since(&self) -> Option<&Tracked> {
        self.since.as_ref()
    }

    pub(crate) fn since_mut(&mut self) -> Option<&mut Tracked> {
        self.since.as_mut()
    }

    pub(crate) fn set(&mut self, tracked: Tracked) {
        self.since = Some(tracked);
    }

    /// Forgets the base; the caller stops the log.
    pub(crate) fn clear(&mut self) {
        self.since = None;
    }
}

/// Region ids and lengths, as a tracker records them.
pub(crate) fn shape(regions: &[MemoryRegion]) -> Vec<(u32, u64)> {
    regions
        .iter()
        .map(|region| (region.id(), region.len()))
        .collect()
}

/// One empty bitmap per region.
pub(crate) fn empty_bitmaps(regions: &[MemoryRegion]) -> Vec<DirtyBitmap> {
    regions
        .iter()
        .map(|region| DirtyBitmap::new(region.pages()))
        .collect()
}

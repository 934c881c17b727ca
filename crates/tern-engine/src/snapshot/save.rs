//! Saving a guest to a snapshot file, paused or live.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::Serialize;
use tern_wire::snapshot::{SnapshotSection, Trailer, WorkingSet};

use crate::bitmap::DirtyBitmap;
use crate::guest::SourceGuest;
use crate::snapshot::SnapshotError;
use crate::snapshot::check_layer_shape;
use crate::snapshot::file::Layer;
use crate::snapshot::tracker::{self, DirtyTracker, Tracked};
use crate::snapshot::writer::{DiffBase, SlotWriter};
use std::os::unix::fs::MetadataExt;

/// How to save.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SaveConfig {
    /// Writer threads (at least 1). Default: the cores this process may
    /// run on, at most 4 ([`default_writers`]).
    pub writers: usize,
    /// Open the page slots with `O_DIRECT` (bypassing the page cache).
    pub direct: bool,
    /// Precopy while the guest runs, pausing it only for the last pass;
    /// otherwise pause first and write once.
    pub live: bool,
    /// Live: most passes before the final one.
    pub max_passes: u32,
    /// Live: pause for the final pass once a pass finds at most this many
    /// dirty pages.
    pub final_pass_pages: u64,
    /// Resume the guest after the save (the guest keeps running, as after
    /// QEMU's `savevm`); otherwise it stays paused.
    pub resume: bool,
    /// Save a diff on this snapshot (full or itself a diff): only the
    /// chunks whose content differs from the base's are written, and the
    /// file names the base by its memory digest (Firecracker's
    /// `snapshot_type: Diff`, compared by content instead of a dirty log
    /// kept since the base).
    pub diff_base: Option<std::path::PathBuf>,
    /// Wait until the file is on the disk before the save returns (and
    /// before its header says complete). Off, as QEMU's migration to a
    /// file: the kernel writes the file back later, and a crash before
    /// then may lose the snapshot; a file torn that way is refused at
    /// restore by its chunk hashes, never restored.
    pub sync: bool,
}

/// Writers a save uses unless told: one per core this process may run
/// on, at most 4. Buffered writes to one file take its inode lock in turn
/// (ext4), so writers beyond the cores only wait for the lock, or hold it
/// while descheduled: on 2 loaded cores a paused 1 GiB save took 2.30 s
/// (median of 7, interleaved) with 2 writers against 2.98 s with 4
/// (docs/snapshots.md, "Measured").
pub fn default_writers() -> usize {
    std::thread::available_parallelism().map_or(1, |cores| cores.get().min(4))
}

impl Default for SaveConfig {
    fn default() -> Self {
        Self {
            writers: default_writers(),
            direct: false,
            live: false,
            max_passes: 8,
            final_pass_pages: 1024,
            resume: true,
            diff_base: None,
            sync: true,
        }
    }
}

/// What a save did.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct SaveStats {
    /// Wall-clock time of the whole save.
    pub total_time_ms: f64,
    /// Time the guest was paused: to its resume, which comes before the
    /// file is finished (trailer, fsync, header); with `resume` off, to
    /// the end of the save.
    pub downtime_ms: f64,
    /// Passes over memory (1 for a paused save).
    pub passes: u32,
    /// Page writes, over all passes (QMP's `normal`).
    pub normal: u64,
    /// Zero pages found, over all passes (QMP's `duplicate`): holes.
    pub duplicate: u64,
    /// Slots punched back to holes because their page became zero.
    pub holes_punched: u64,
    /// The file's length (its apparent size; holes take no disk).
    pub file_bytes: u64,
    /// Guest memory in bytes.
    pub memory_bytes: u64,
    /// The memory digest saved.
    pub digest: String,
    /// Pages recorded as the working set (live: dirtied in the last pass).
    pub working_set_pages: u64,
    /// Diff: pages left to the base (their chunk had the base's hash).
    pub unchanged_pages: u64,
    /// Diff: the memory digest of the base it was taken on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_digest: Option<String>,
    /// The dirty log was left running for the next save
    /// ([`save_tracked`]); a diff then holds exactly the pages the log
    /// reported since its base.
    pub tracked: bool,
}

/// Saves `guest` to `path`. On any error the guest runs on as it did
/// before (it is resumed if the save paused it) and the file stays marked
/// incomplete.
pub fn save<G: SourceGuest + ?Sized>(
    guest: &mut G,
    path: &Path,
    config: &SaveConfig,
) -> Result<SaveStats, SnapshotError> {
    if config.writers == 0 {
        return Err(SnapshotError::Config("writers must be at least 1".into()));
    }
    let base = match &config.diff_base {
        Some(base) => Some(open_base(base, path, guest.regions(), guest.guest_kind())?),
        None => None,
    };
    save_with(guest, path, config, base, None)
}

/// Saves `guest` to `path` and leaves its dirty log running for the next
/// save (Firecracker's `track_dirty_pages`). Without
/// [`SaveConfig::diff_base`] the save is full and `tracker` then tracks
/// from it; with it, the save is a diff of exactly the pages the log
/// reported since that base (Firecracker's `snapshot_type: Diff`), which
/// must be the snapshot `tracker` tracks from: any other is refused. After
/// a diff, `tracker` tracks from the diff. On any error the guest runs on,
/// the file stays marked incomplete, and `tracker` still tracks from its
/// snapshot, owing the pages the failed save took from the log.
pub fn save_tracked<G: SourceGuest + ?Sized>(
    guest: &mut G,
    path: &Path,
    config: &SaveConfig,
    tracker: &mut DirtyTracker,
) -> Result<SaveStats, SnapshotError> {
    if config.writers == 0 {
        return Err(SnapshotError::Config("writers must be at least 1".into()));
    }
    let base = match &config.diff_base {
        Some(base_path) => {
            let base = open_base(base_path, path, guest.regions(), guest.guest_kind())?;
            check_tracked_base(tracker, base_path, base.digest, guest.regions())?;
            Some(base)
        }
        None => None,
    };
    save_with(guest, path, config, base, Some(tracker))
}

/// A tracked diff's base must be the snapshot the log runs since.
fn check_tracked_base(
    tracker: &DirtyTracker,
    base_path: &Path,
    base_digest: u128,
    regions: &[crate::guest::MemoryRegion],
) -> Result<(), SnapshotError> {
    let Some(since) = tracker.since() else {
        return Err(SnapshotError::Chain(format!(
            "no dirty log runs since {}: save it with tracking first, or take the diff by content",
            base_path.display()
        )));
    };
    if since.digest != base_digest {
        return Err(SnapshotError::Chain(format!(
            "{} holds the memory with digest {base_digest:032x}, but the dirty log runs since {} (digest {:032x}): not the base of a tracked diff",
            base_path.display(),
            since.path.display(),
            since.digest
        )));
    }
    if since.shape != tracker::shape(regions) {
        return Err(SnapshotError::Shape(
            "the guest's regions changed since the tracked snapshot".into(),
        ));
    }
    Ok(())
}

// long: the one save path (full, diff by content, tracked) with its bookkeeping
fn save_with<G: SourceGuest + ?Sized>(
    guest: &mut G,
    path: &Path,
    config: &SaveConfig,
    base: Option<DiffBase>,
    mut tracker: Option<&mut DirtyTracker>,
) -> Result<SaveStats, SnapshotError> {
    let started = Instant::now();
    let base_digest = base.as_ref().map(|base| format!("{:032x}", base.digest));
    let is_diff = base.is_some();
    let writer = SlotWriter::create(path, guest.regions(), config.direct, config.sync, base)?;
    let track = tracker.as_deref().map(|tracker| {
        let since = tracker.since();
        if is_diff && let Some(since) = since {
            writer.seed_hashes(&since.page_hashes);
        }
        Track {
            was_logging: since.is_some(),
            owed: match (is_diff, since) {
                (true, Some(since)) => Some(since.owed.clone()),
                _ => None,
            },
            synced: tracker::empty_bitmaps(guest.regions()),
        }
    });
    let mut session = Session {
        guest,
        writer: &writer,
        config,
        paused_at: None,
        resumed_at: None,
        logging: false,
        passes: 0,
        track,
    };
    let result = session.run();
    let paused_for = session.paused_at.map(|at| {
        session
            .resumed_at
            .map_or_else(|| at.elapsed(), |resumed| resumed - at)
    });
    let undo = session.undo(result.is_ok());
    if let (Some(tracker), Some(track)) = (tracker.as_deref_mut(), session.track.take()) {
        settle(
            tracker,
            track,
            result.is_ok() && undo.is_ok(),
            &writer,
            path,
            session.guest.regions(),
        );
    }
    let (file_bytes, working_set) = result?;
    undo?;
    let counters = &writer.counters;
    let memory_pages: u64 = session.guest.regions().iter().map(|r| r.pages()).sum();
    let unchanged_pages = if tracker.is_some() && is_diff {
        memory_pages - writer.changed_pages()
    } else {
        counters.unchanged_pages.load(Ordering::Relaxed)
    };
    Ok(SaveStats {
        total_time_ms: millis(started.elapsed()),
        downtime_ms: paused_for.map_or(0.0, millis),
        passes: session.passes,
        normal: counters.pages_written.load(Ordering::Relaxed),
        duplicate: counters.zero_pages.load(Ordering::Relaxed),
        holes_punched: counters.holes_punched.load(Ordering::Relaxed),
        file_bytes,
        memory_bytes: session.guest.regions().iter().map(|r| r.len()).sum(),
        digest: format!("{:032x}", writer.digest()),
        working_set_pages: working_set as u64,
        unchanged_pages,
        base_digest,
        tracked: tracker.is_some(),
    })
}

/// After a tracked save: on success the tracker tracks from the new file;
/// on failure it keeps its snapshot and owes every page the save took
/// from the log (a first tracked save that failed stopped the log, and
/// the tracker stays empty).
fn settle(
    tracker: &mut DirtyTracker,
    track: Track,
    succeeded: bool,
    writer: &SlotWriter,
    path: &Path,
    regions: &[crate::guest::MemoryRegion],
) {
    if succeeded {
        tracker.set(Tracked {
            digest: writer.digest(),
            path: path.to_owned(),
            shape: tracker::shape(regions),
            page_hashes: writer.page_hashes(),
            owed: tracker::empty_bitmaps(regions),
        });
    } else if let Some(since) = tracker.since_mut() {
        for (owed, synced) in since.owed.iter_mut().zip(&track.synced) {
            owed.merge(synced);
        }
    } else {
        tracker.clear();
    }
}

/// Opens and checks the base of a diff to be saved at `output`: a
/// complete snapshot of this guest's regions and kind, and not the file
/// the diff would replace.
fn open_base(
    base: &Path,
    output: &Path,
    regions: &[crate::guest::MemoryRegion],
    guest_kind: &str,
) -> Result<DiffBase, SnapshotError> {
    let layer = Layer::open(base)?;
    if let (Ok(base_meta), Ok(output_meta)) = (std::fs::metadata(base), std::fs::metadata(output))
        && base_meta.dev() == output_meta.dev()
        && base_meta.ino() == output_meta.ino()
    {
        return Err(SnapshotError::Config(format!(
            "the diff would replace its own base {}",
            base.display()
        )));
    }
    check_layer_shape(&layer, regions, guest_kind)
        .map_err(|error| SnapshotError::Shape(format!("the base {}: {error}", base.display())))?;
    let metadata = layer.metadata();
    Ok(DiffBase {
        digest: metadata.header.digest,
        chunk_hashes: metadata.chunk_hashes.clone(),
    })
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

struct Session<'a, G: SourceGuest + ?Sized> {
    guest: &'a mut G,
    writer: &'a SlotWriter,
    config: &'a SaveConfig,
    paused_at: Option<Instant>,
    /// Set when the guest was resumed before the file was finished.
    resumed_at: Option<Instant>,
    logging: bool,
    passes: u32,
    /// A tracked save ([`save_tracked`]); `None` for a plain one.
    track: Option<Track>,
}

/// A tracked save's dirty-log bookkeeping.
struct Track {
    /// The log ran before this save (a tracker's): it is synced, never
    /// started, and never stopped.
    was_logging: bool,
    /// A tracked diff: the pages earlier failed saves took from the log.
    owed: Option<Vec<DirtyBitmap>>,
    /// Every page this save took from the log (owed if it fails).
    synced: Vec<DirtyBitmap>,
}

impl<G: SourceGuest + ?Sized> Session<'_, G> {
    /// The passes, the state and the trailer. Returns the file's length
    /// and the size of the working set recorded.
    fn run(&mut self) -> Result<(u64, usize), SnapshotError> {
        let mut working_set = WorkingSet::default();
        if self.config.live {
            working_set = self.precopy()?;
        } else {
            self.pause()?;
            self.passes = 1;
            let first = self.start_log()?;
            self.writer
                .write_pages(first.as_deref(), self.config.writers)?;
        }
        let sections = self.guest.save_state()?;
        // Memory and state are captured: the guest need not wait for the
        // trailer, the fsync and the header. Should they fail, it runs on
        // and the file stays marked incomplete.
        if self.config.resume && self.paused_at.is_some() {
            self.guest.resume()?;
            self.resumed_at = Some(Instant::now());
        }
        let trailer = Trailer {
            guest_kind: self.guest.guest_kind().to_owned(),
            sections: sections
                .into_iter()
                .map(|section| SnapshotSection {
                    name: section.name,
                    version: section.version,
                    data: section.data,
                })
                .collect(),
            working_set,
        };
        let recorded = trailer.working_set.pages.len();
        let file_bytes = self
            .writer
            .finish(self.writer.digest(), &trailer.encode())?;
        Ok((file_bytes, recorded))
    }

    /// Live passes, then the final one paused. Returns the pages the last
    /// live pass found dirty: the guest's write working set.
    fn precopy(&mut self) -> Result<WorkingSet, SnapshotError> {
        if self.track.is_none() {
            self.guest.start_dirty_log()?;
            self.logging = true;
        }
        let first = self.start_log()?;
        let mut bitmaps = tracker::empty_bitmaps(self.guest.regions());
        self.passes = 1;
        self.writer
            .write_pages(first.as_deref(), self.config.writers)?;
        loop {
            for bitmap in &mut bitmaps {
                bitmap.clear();
            }
            self.sync(&mut bitmaps)?;
            let dirty: u64 = bitmaps.iter().map(DirtyBitmap::count).sum();
            if dirty <= self.config.final_pass_pages || self.passes >= self.config.max_passes {
                break;
            }
            self.passes += 1;
            self.writer
                .write_pages(Some(&bitmaps), self.config.writers)?;
        }
        let working_set = WorkingSet {
            pages: bitmaps
                .iter()
                .enumerate()
                .flat_map(|(region, bitmap)| {
                    bitmap.iter_dirty().map(move |page| {
                        (
                            crate::numeric::saturating_u32(region),
                            crate::numeric::saturating_u32(page),
                        )
                    })
                })
                .collect(),
        };
        // The pages written so far go to the disk while the guest runs;
        // pages it dirties meanwhile are in the sync after the pause.
        self.writer.write_back()?;
        self.pause()?;
        // Pages dirtied before the pause and after the last sync.
        let mut last: Vec<DirtyBitmap> = bitmaps
            .iter()
            .map(|b| DirtyBitmap::new(b.pages()))
            .collect();
        self.sync(&mut last)?;
        for (bitmap, extra) in bitmaps.iter_mut().zip(&last) {
            bitmap.merge(extra);
        }
        self.passes += 1;
        self.writer
            .write_pages(Some(&bitmaps), self.config.writers)?;
        Ok(working_set)
    }

    /// A tracked save's log at its first pass: started if no tracker
    /// started it (the pages written from now on are what the next diff
    /// holds), synced if one did. Returns the first pass's selection:
    /// `None` (every page) but for a tracked diff, whose first pass writes
    /// the pages the log and earlier failed saves report.
    fn start_log(&mut self) -> Result<Option<Vec<DirtyBitmap>>, SnapshotError> {
        let Some(track) = &self.track else {
            return Ok(None);
        };
        if !track.was_logging {
            self.guest.start_dirty_log()?;
            self.logging = true;
            return Ok(None);
        }
        self.logging = true;
        let mut first = tracker::empty_bitmaps(self.guest.regions());
        self.sync(&mut first)?;
        let owed = self.track.as_ref().and_then(|track| track.owed.as_ref());
        Ok(owed.map(|owed| {
            for (bitmap, owed) in first.iter_mut().zip(owed) {
                bitmap.merge(owed);
            }
            first
        }))
    }

    /// Syncs the dirty log into `bitmaps`, recording the pages for a
    /// tracked save (they are owed to the next diff if this one fails).
    fn sync(&mut self, bitmaps: &mut [DirtyBitmap]) -> Result<(), SnapshotError> {
        self.guest.sync_dirty_log(bitmaps)?;
        if let Some(track) = &mut self.track {
            for (synced, bitmap) in track.synced.iter_mut().zip(bitmaps.iter()) {
                synced.merge(bitmap);
            }
        }
        Ok(())
    }

    fn pause(&mut self) -> Result<(), SnapshotError> {
        self.guest.pause()?;
        self.paused_at = Some(Instant::now());
        Ok(())
    }

    /// Stops the dirty log and resumes the guest if this save paused it
    /// (always after a failure: the source guest keeps running).
    fn undo(&mut self, succeeded: bool) -> Result<(), SnapshotError> {
        let mut first_error = None;
        // A tracked save leaves the log running, for the next diff, unless
        // it started the log and failed (nothing tracks from it then).
        let keep_log = self
            .track
            .as_ref()
            .is_some_and(|track| succeeded || track.was_logging);
        if self.logging
            && !keep_log
            && let Err(error) = self.guest.stop_dirty_log()
        {
            first_error.get_or_insert(error);
        }
        if self.paused_at.is_some()
            && self.resumed_at.is_none()
            && (self.config.resume || !succeeded)
            && let Err(error) = self.guest.resume()
        {
            first_error.get_or_insert(error);
        }
        first_error.map_or(Ok(()), |error| Err(error.into()))
    }
}

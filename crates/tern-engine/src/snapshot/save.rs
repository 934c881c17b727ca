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
use crate::snapshot::writer::{DiffBase, SlotWriter};
use std::os::unix::fs::MetadataExt;

/// How to save.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SaveConfig {
    /// Writer threads (at least 1).
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

impl Default for SaveConfig {
    fn default() -> Self {
        Self {
            writers: 4,
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
    let started = Instant::now();
    let base = match &config.diff_base {
        Some(base) => Some(open_base(base, path, guest.regions(), guest.guest_kind())?),
        None => None,
    };
    let base_digest = base.as_ref().map(|base| format!("{:032x}", base.digest));
    let writer = SlotWriter::create(path, guest.regions(), config.direct, config.sync, base)?;
    let mut session = Session {
        guest,
        writer: &writer,
        config,
        paused_at: None,
        resumed_at: None,
        logging: false,
        passes: 0,
    };
    let result = session.run();
    let paused_for = session.paused_at.map(|at| {
        session
            .resumed_at
            .map_or_else(|| at.elapsed(), |resumed| resumed - at)
    });
    let undo = session.undo(result.is_ok());
    let (file_bytes, working_set) = result?;
    undo?;
    let counters = &writer.counters;
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
        unchanged_pages: counters.unchanged_pages.load(Ordering::Relaxed),
        base_digest,
    })
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
            self.writer.write_pages(None, self.config.writers)?;
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
        self.guest.start_dirty_log()?;
        self.logging = true;
        let mut bitmaps: Vec<DirtyBitmap> = self
            .guest
            .regions()
            .iter()
            .map(|region| DirtyBitmap::new(region.pages()))
            .collect();
        self.passes = 1;
        self.writer.write_pages(None, self.config.writers)?;
        loop {
            for bitmap in &mut bitmaps {
                bitmap.clear();
            }
            self.guest.sync_dirty_log(&mut bitmaps)?;
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
        self.guest.sync_dirty_log(&mut last)?;
        for (bitmap, extra) in bitmaps.iter_mut().zip(&last) {
            bitmap.merge(extra);
        }
        self.passes += 1;
        self.writer
            .write_pages(Some(&bitmaps), self.config.writers)?;
        Ok(working_set)
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
        if self.logging
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

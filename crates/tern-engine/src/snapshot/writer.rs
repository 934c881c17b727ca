//! Writing pages into their slots with several threads at once.
//!
//! Every page's slot is at a fixed offset, so the writers need no
//! coordination: each takes the next batch of pages and `pwrite`s each
//! run of non-zero pages straight from guest memory to its slots (no
//! bounce copy). A page that is zero is not written; if its slot held
//! data from an earlier pass, the slot is punched back into a hole. A
//! page written while the guest runs may be torn, but the dirty log
//! reports it and a later pass (the last one with the guest paused)
//! writes it again, with its hash: the hashes always describe the bytes
//! of the final write.
//!
//! A diff snapshot's first pass compares each chunk's hash with its base's
//! and writes only the chunks that differ (all their pages, marked
//! changed); later passes of a live save write the pages the dirty log
//! reports, page by page, and mark them changed. A tracked diff
//! (`save_tracked`) starts from its base's page hashes and writes only
//! the pages its dirty log reports, page by page, from the first pass on.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use tern_page::zero::ZeroChecker;
use tern_wire::snapshot::{
    CHUNK_PAGES, Layout, SnapshotMetadata, chunk_hash, plan_diff_layout, plan_layout,
};
use xxhash_rust::xxh3::Xxh3;

use crate::bitmap::DirtyBitmap;
use crate::digest::{add_region, page_hash};
use crate::guest::{MemoryRegion, PAGE_SIZE};
use crate::snapshot::SnapshotError;

const PAGE: u64 = PAGE_SIZE as u64;
/// A page's length as the `off_t` `fallocate` takes.
#[expect(clippy::cast_possible_wrap, reason = "4096 is far below i64::MAX")]
const PAGE_OFF: libc::off_t = PAGE_SIZE as libc::off_t;
/// Pages one writer takes at a time (1 MiB).
const BATCH_PAGES: u64 = 256;

/// What the writers did, summed over passes.
#[derive(Debug, Default)]
pub(crate) struct WriteCounters {
    pub(crate) pages_written: AtomicU64,
    pub(crate) zero_pages: AtomicU64,
    pub(crate) holes_punched: AtomicU64,
    /// Diff: pages of chunks equal to the base's, not written.
    pub(crate) unchanged_pages: AtomicU64,
}

/// What a diff is compared with: its base's memory digest and chunk
/// hashes (which describe the base's whole memory, diff or not).
#[derive(Debug)]
pub(crate) struct DiffBase {
    pub(crate) digest: u128,
    pub(crate) chunk_hashes: Vec<Vec<u64>>,
}

/// A snapshot file being written.
pub(crate) struct SlotWriter {
    path: PathBuf,
    /// For the metadata and the trailer (never `O_DIRECT`: neither is
    /// block-aligned).
    file: File,
    /// For the slots: `file` again, or an `O_DIRECT` descriptor.
    slots: File,
    /// The slots bypass the page cache: nothing to write back.
    direct: bool,
    /// Wait for the disk: start writeback as batches are written and
    /// fsync before the complete header. Off, the kernel writes the file
    /// back when it will (QEMU's migration to a file does the same).
    sync: bool,
    layout: Layout,
    regions: Vec<MemoryRegion>,
    present: Vec<Vec<AtomicU64>>,
    hashes: Vec<Vec<AtomicU64>>,
    zero: ZeroChecker,
    /// Cleared when the filesystem cannot punch holes: zeros are then
    /// written into the slot instead.
    punch: AtomicBool,
    /// A diff's base; `None` for a full snapshot.
    base: Option<DiffBase>,
    /// Diff: one bit per page, per region: the diff defines the page.
    changed: Vec<Vec<AtomicU64>>,
    pub(crate) counters: WriteCounters,
}

impl SlotWriter {
    /// Creates (or truncates) `path` for `regions`, sized to its layout (a
    /// sparse file: nothing is allocated yet), with an incomplete header;
    /// a diff on `base` if there is one.
    // long: one constructor opens the file, writes its first header and fills every field
    pub(crate) fn create(
        path: &Path,
        regions: &[MemoryRegion],
        direct: bool,
        sync: bool,
        base: Option<DiffBase>,
    ) -> Result<Self, SnapshotError> {
        let shape: Vec<_> = regions
            .iter()
            .map(|region| (region.id(), region.guest_addr(), region.len()))
            .collect();
        let plan = if base.is_some() {
            plan_diff_layout
        } else {
            plan_layout
        };
        let layout = plan(&shape).map_err(|source| SnapshotError::Format {
            path: path.to_owned(),
            source,
        })?;
        let open = |direct: bool| {
            let mut options = OpenOptions::new();
            options.read(true).write(true).create(true);
            if direct {
                options.custom_flags(libc::O_DIRECT);
            }
            options.open(path).map_err(|source| SnapshotError::Open {
                path: path.to_owned(),
                source,
            })
        };
        let file = open(false)?;
        let write_error = |source| SnapshotError::Write {
            path: path.to_owned(),
            source,
        };
        file.set_len(0).map_err(write_error)?;
        file.set_len(layout.data_end).map_err(write_error)?;
        file.write_all_at(&SnapshotMetadata::new(&layout).encode(), 0)
            .map_err(write_error)?;
        // The incomplete header reaches the disk before any page does.
        if sync {
            file.sync_data().map_err(write_error)?;
        }
        let slots = if direct {
            open(true)?
        } else {
            file.try_clone().map_err(write_error)?
        };
        let atomics = |count: u64| (0..count).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        Ok(Self {
            path: path.to_owned(),
            file,
            slots,
            direct,
            sync,
            present: layout
                .regions
                .iter()
                .map(|region| atomics(region.pages().div_ceil(64)))
                .collect(),
            hashes: layout
                .regions
                .iter()
                .map(|region| atomics(region.pages()))
                .collect(),
            changed: layout
                .regions
                .iter()
                .map(|region| {
                    atomics(if layout.diff {
                        region.pages().div_ceil(64)
                    } else {
                        0
                    })
                })
                .collect(),
            base,
            layout,
            regions: regions.to_vec(),
            zero: ZeroChecker::best(),
            punch: AtomicBool::new(true),
            counters: WriteCounters::default(),
        })
    }

    fn write_error(&self, source: std::io::Error) -> SnapshotError {
        SnapshotError::Write {
            path: self.path.clone(),
            source,
        }
    }

    /// Writes the pages `selection` marks (every page with `None`) with
    /// `threads` writers. Returns the pages looked at.
    ///
    /// The guest may run meanwhile (see the module's comment).
    pub(crate) fn write_pages(
        &self,
        selection: Option<&[DirtyBitmap]>,
        threads: usize,
    ) -> Result<u64, SnapshotError> {
        let batches: Vec<(usize, u64)> = self
            .regions
            .iter()
            .enumerate()
            .flat_map(|(index, region)| {
                (0..region.pages().div_ceil(BATCH_PAGES)).map(move |batch| (index, batch))
            })
            .collect();
        let next = AtomicUsize::new(0);
        let failure: Mutex<Option<SnapshotError>> = Mutex::new(None);
        let looked = AtomicU64::new(0);
        std::thread::scope(|scope| {
            for _ in 0..threads.max(1) {
                scope.spawn(|| {
                    while let Some(&(region, batch)) =
                        batches.get(next.fetch_add(1, Ordering::Relaxed))
                    {
                        if failure.lock().is_ok_and(|failure| failure.is_some()) {
                            return;
                        }
                        let selected = selection.map(|bitmaps| &bitmaps[region]);
                        match self.write_batch(region, batch, selected) {
                            Ok(count) => {
                                looked.fetch_add(count, Ordering::Relaxed);
                            }
                            Err(error) => {
                                if let Ok(mut failure) = failure.lock() {
                                    failure.get_or_insert(error);
                                }
                                return;
                            }
                        }
                    }
                });
            }
        });
        match failure.into_inner().ok().flatten() {
            Some(error) => Err(error),
            None => Ok(looked.into_inner()),
        }
    }

    /// One batch: hashes and zero-checks the selected pages, writes runs
    /// of data pages, punches slots of pages that became zero.
    fn write_batch(
        &self,
        region: usize,
        batch: u64,
        selected: Option<&DirtyBitmap>,
    ) -> Result<u64, SnapshotError> {
        let memory = self.regions[region];
        let first = batch * BATCH_PAGES;
        let end = (first + BATCH_PAGES).min(memory.pages());
        let looked = if let (Some(base), None) = (&self.base, selected) {
            self.write_changed_chunks(base, region, first, end)?
        } else {
            self.write_selected(region, first, end, selected)?
        };
        if looked > 0 {
            self.start_writeback(region, first, end);
        }
        Ok(looked)
    }

    /// Starts writing back the page-cache pages of slots `first..end` of
    /// `region` without waiting for them. The writer thread does the
    /// filesystem's share of the work (block allocation, building the
    /// I/O) now, in parallel with the other writers and while the disk
    /// writes the earlier batches, instead of one fsync doing all of it
    /// at the end. Only a hint: an error here is not reported, the fsync
    /// in `finish` reports any failed write.
    fn start_writeback(&self, region: usize, first: u64, end: u64) {
        if self.direct || !self.sync {
            return;
        }
        let slots = self.layout.regions[region].slots_offset;
        let (Ok(at), Ok(len)) = (
            crate::numeric::file_offset(slots + first * PAGE),
            crate::numeric::file_offset((end - first) * PAGE),
        ) else {
            return;
        };
        // SAFETY: sync_file_range on our descriptor only schedules I/O of
        // the file's own cached pages; it reads no memory of ours.
        unsafe {
            libc::sync_file_range(self.slots.as_raw_fd(), at, len, libc::SYNC_FILE_RANGE_WRITE);
        }
    }

    /// Writes the selected pages of `first..end` of `region` (every page
    /// with `None`); returns how many it looked at.
    fn write_selected(
        &self,
        region: usize,
        first: u64,
        end: u64,
        selected: Option<&DirtyBitmap>,
    ) -> Result<u64, SnapshotError> {
        let memory = self.regions[region];
        let mut looked = 0;
        let mut run: Option<(u64, u64)> = None;
        for page in first..end {
            if selected.is_some_and(|bitmap| !bitmap.get(page)) {
                self.flush_run(region, run.take())?;
                continue;
            }
            looked += 1;
            let Some(ptr) = memory.page_ptr(page) else {
                continue;
            };
            self.mark_changed(region, page);
            // SAFETY: `page_ptr` bounds-checked the page; the guest may
            // write it concurrently, which only makes the answer stale
            // (the dirty log then reports the page again).
            let is_zero = unsafe { self.zero.is_zero_page(ptr) };
            if is_zero {
                self.flush_run(region, run.take())?;
                self.make_hole(region, page)?;
                continue;
            }
            // SAFETY: as above; the hash describes the bytes written below
            // unless the page changes meanwhile, when it is written again.
            let hash = unsafe { page_hash(ptr) };
            self.hashes[region][crate::numeric::saturating_usize(page)]
                .store(hash, Ordering::Relaxed);
            self.present[region][crate::numeric::saturating_usize(page / 64)]
                .fetch_or(1 << (page % 64), Ordering::Relaxed);
            run = match run {
                Some((start, count)) if start + count == page => Some((start, count + 1)),
                other => {
                    self.flush_run(region, other)?;
                    Some((page, 1))
                }
            };
        }
        self.flush_run(region, run)?;
        Ok(looked)
    }

    /// A diff's first pass over pages `first..end` of `region` (whole
    /// chunks): hashes every page, leaves the chunks whose hash is the
    /// base's, and writes the others whole, their pages marked changed.
    fn write_changed_chunks(
        &self,
        base: &DiffBase,
        region: usize,
        first: u64,
        end: u64,
    ) -> Result<u64, SnapshotError> {
        let memory = self.regions[region];
        let mut chunk_start = first;
        while chunk_start < end {
            let chunk_end = (chunk_start + CHUNK_PAGES).min(end);
            let mut hashes = Vec::with_capacity(crate::numeric::saturating_usize(CHUNK_PAGES));
            let mut zero = Vec::with_capacity(crate::numeric::saturating_usize(CHUNK_PAGES));
            for page in chunk_start..chunk_end {
                let ptr = memory.page_ptr(page).ok_or_else(|| {
                    self.write_error(std::io::Error::other("page outside the region"))
                })?;
                // SAFETY: `page_ptr` bounds-checked the page; a concurrent
                // guest write only makes the answer stale (see write_batch).
                let is_zero = unsafe { self.zero.is_zero_page(ptr) };
                zero.push(is_zero);
                hashes.push(if is_zero {
                    crate::digest::zero_page_hash()
                } else {
                    // SAFETY: as above.
                    unsafe { page_hash(ptr) }
                });
            }
            let chunk = (chunk_start / CHUNK_PAGES) as usize;
            for (page, &hash) in (chunk_start..chunk_end).zip(&hashes) {
                self.hashes[region][crate::numeric::saturating_usize(page)]
                    .store(hash, Ordering::Relaxed);
            }
            if base.chunk_hashes[region].get(chunk) == Some(&chunk_hash(&hashes)) {
                self.counters
                    .unchanged_pages
                    .fetch_add(chunk_end - chunk_start, Ordering::Relaxed);
                chunk_start = chunk_end;
                continue;
            }
            let mut run: Option<(u64, u64)> = None;
            for (page, &is_zero) in (chunk_start..chunk_end).zip(&zero) {
                self.mark_changed(region, page);
                if is_zero {
                    self.flush_run(region, run.take())?;
                    self.make_hole(region, page)?;
                    continue;
                }
                self.present[region][(page / 64) as usize]
                    .fetch_or(1 << (page % 64), Ordering::Relaxed);
                run = match run {
                    Some((start, count)) if start + count == page => Some((start, count + 1)),
                    other => {
                        self.flush_run(region, other)?;
                        Some((page, 1))
                    }
                };
            }
            self.flush_run(region, run)?;
            chunk_start = chunk_end;
        }
        Ok(end - first)
    }

    /// A tracked diff: every page's hash as the base holds it, so that the
    /// pages the diff does not write keep their place in the chunk hashes
    /// and the digest without being read.
    pub(crate) fn seed_hashes(&self, page_hashes: &[Vec<u64>]) {
        for (atomics, hashes) in self.hashes.iter().zip(page_hashes) {
            for (atomic, &hash) in atomics.iter().zip(hashes) {
                atomic.store(hash, Ordering::Relaxed);
            }
        }
    }

    /// Every page's hash as the slots (and, for a diff, its base) hold it.
    pub(crate) fn page_hashes(&self) -> Vec<Vec<u64>> {
        self.hashes
            .iter()
            .map(|hashes| hashes.iter().map(|h| h.load(Ordering::Relaxed)).collect())
            .collect()
    }

    /// Diff: the pages it defines.
    pub(crate) fn changed_pages(&self) -> u64 {
        self.changed
            .iter()
            .flatten()
            .map(|word| u64::from(word.load(Ordering::Relaxed).count_ones()))
            .sum()
    }

    /// Diff: records that the diff defines `page` (no-op for a full save).
    fn mark_changed(&self, region: usize, page: u64) {
        if let Some(word) = self
            .changed
            .get(region)
            .and_then(|words| words.get((page / 64) as usize))
        {
            word.fetch_or(1 << (page % 64), Ordering::Relaxed);
        }
    }

    /// Writes `count` pages from `start` of `region` to their slots.
    fn flush_run(&self, region: usize, run: Option<(u64, u64)>) -> Result<(), SnapshotError> {
        let Some((start, count)) = run else {
            return Ok(());
        };
        let memory = self.regions[region];
        let offset = self.layout.regions[region].slots_offset + start * PAGE;
        let ptr = memory
            .page_ptr(start)
            .ok_or_else(|| self.write_error(std::io::Error::other("page outside the region")))?;
        let len = crate::numeric::saturating_usize(count * PAGE);
        let mut done = 0;
        while done < len {
            let at = crate::numeric::file_offset(offset + done as u64)
                .map_err(|error| self.write_error(error))?;
            // SAFETY: `count` pages from `start` lie in the region (the run
            // was built from bounds-checked pages); pwrite only reads them.
            let wrote = unsafe {
                libc::pwrite(self.slots.as_raw_fd(), ptr.add(done).cast(), len - done, at)
            };
            if wrote < 0 {
                let error = std::io::Error::last_os_error();
                if error.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(self.write_error(error));
            }
            if wrote == 0 {
                return Err(self.write_error(std::io::ErrorKind::WriteZero.into()));
            }
            done += crate::numeric::syscall_count(wrote);
        }
        self.counters
            .pages_written
            .fetch_add(count, Ordering::Relaxed);
        Ok(())
    }

    /// Records `page` as zero; punches its slot if an earlier pass wrote it.
    fn make_hole(&self, region: usize, page: u64) -> Result<(), SnapshotError> {
        self.counters.zero_pages.fetch_add(1, Ordering::Relaxed);
        self.hashes[region][crate::numeric::saturating_usize(page)]
            .store(crate::digest::zero_page_hash(), Ordering::Relaxed);
        let bit = 1 << (page % 64);
        let word = &self.present[region][crate::numeric::saturating_usize(page / 64)];
        if word.load(Ordering::Relaxed) & bit == 0 {
            return Ok(());
        }
        let offset = self.layout.regions[region].slots_offset + page * PAGE;
        if self.punch.load(Ordering::Relaxed) {
            let at =
                crate::numeric::file_offset(offset).map_err(|error| self.write_error(error))?;
            // SAFETY: fallocate on our descriptor, within the file.
            let result = unsafe {
                libc::fallocate(
                    self.file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    at,
                    PAGE_OFF,
                )
            };
            if result == 0 {
                word.fetch_and(!bit, Ordering::Relaxed);
                self.counters.holes_punched.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            self.punch.store(false, Ordering::Relaxed);
        }
        // No holes here: the slot keeps a zero page, still marked present.
        self.hashes[region][crate::numeric::saturating_usize(page)]
            .store(crate::digest::zero_page_hash(), Ordering::Relaxed);
        self.file
            .write_all_at(&[0u8; PAGE_SIZE], offset)
            .map_err(|error| self.write_error(error))
    }

    /// Waits until every page written so far is on the disk (a live save
    /// calls this while the guest still runs, so that the fsync in
    /// `finish`, with the guest paused, has only the last pass left).
    pub(crate) fn write_back(&self) -> Result<(), SnapshotError> {
        if !self.sync {
            return Ok(());
        }
        self.file
            .sync_data()
            .map_err(|source| self.write_error(source))
    }

    /// The memory digest of what the slots hold now.
    pub(crate) fn digest(&self) -> u128 {
        let mut hasher = Xxh3::new();
        for (region, hashes) in self.layout.regions.iter().zip(&self.hashes) {
            add_region(
                &mut hasher,
                region.id,
                hashes.iter().map(|h| h.load(Ordering::Relaxed)),
            );
        }
        hasher.digest128()
    }

    /// Writes the trailer, then (after an fsync of everything else) the
    /// complete header: the file is valid only once this returns.
    pub(crate) fn finish(&self, digest: u128, trailer: &[u8]) -> Result<u64, SnapshotError> {
        let error = |source| self.write_error(source);
        self.file
            .write_all_at(trailer, self.layout.data_end)
            .map_err(error)?;
        let file_len = self.layout.data_end + trailer.len() as u64;
        self.file.set_len(file_len).map_err(error)?;
        // One fsync covers both descriptors: they are the same file.
        if self.sync {
            self.file.sync_data().map_err(error)?;
        }
        let mut metadata = SnapshotMetadata::new(&self.layout);
        for (index, region) in self.layout.regions.iter().enumerate() {
            for (word, atomic) in metadata.present[index].iter_mut().zip(&self.present[index]) {
                *word = atomic.load(Ordering::Relaxed);
            }
            for (word, atomic) in metadata.changed[index].iter_mut().zip(&self.changed[index]) {
                *word = atomic.load(Ordering::Relaxed);
            }
            let hashes: Vec<u64> = self.hashes[index]
                .iter()
                .map(|h| h.load(Ordering::Relaxed))
                .collect();
            for (chunk, slot) in metadata.chunk_hashes[index].iter_mut().enumerate() {
                let first = chunk * crate::numeric::saturating_usize(CHUNK_PAGES);
                let end = (first + crate::numeric::saturating_usize(CHUNK_PAGES))
                    .min(crate::numeric::saturating_usize(region.pages()));
                *slot = chunk_hash(&hashes[first..end]);
            }
        }
        metadata.header.base_digest = self.base.as_ref().map(|base| base.digest);
        metadata.complete(digest, trailer);
        self.file
            .write_all_at(&metadata.encode(), 0)
            .map_err(error)?;
        if self.sync {
            self.file.sync_data().map_err(error)?;
        }
        Ok(file_len)
    }
}

//! A synthetic guest for tern.
//!
//! Demos, tests and benchmarks need a guest to migrate without a real VMM.
//! [`SyntheticGuest`] maps anonymous memory, fills it with a reproducible mix
//! of zero, random and text-like pages (so compression and zero-page
//! detection have realistic work), and runs dirtier threads that keep writing
//! a working set at a configured rate, like a busy guest does during a live
//! migration. It implements the engine's guest traits on both sides: the
//! source created with [`SyntheticGuest::new`], the destination with
//! [`SyntheticGuest::empty`]. The dirtier's configuration and progress travel
//! in a state section, so the destination continues the same dirtying
//! sequence when it resumes.
#![warn(missing_docs)]

mod dirtier;
mod fill;
mod mapping;
mod rng;
mod state;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tern_engine::{
    DeviceState, DirtyBitmap, DirtyLog, GuestControl, GuestError, GuestMemory, GuestResult,
    HandedFile, MemoryRegion, PAGE_SIZE, RegionFile, StateSection,
};

use crate::dirtier::{Dirtier, Memory};
use crate::mapping::Mapping;
use crate::state::{DirtierConfig, SavedState};
pub use crate::state::{MAX_DIRTIER_THREADS, SECTION_NAME, SECTION_VERSION};

const PAGE: u64 = PAGE_SIZE as u64;

/// This guest's [`DeviceState::guest_kind`]: a destination of another kind
/// (a KVM guest) refuses it at the handshake.
pub const GUEST_KIND: &str = "synthetic";

/// Errors from building or driving a synthetic guest.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SyntheticError {
    /// The content mix shares do not add up to 100 percent.
    #[error("content mix {zero}:{random}:{text} sums to {sum}%, the shares must sum to 100")]
    MixSum {
        /// Share of zero pages.
        zero: u8,
        /// Share of random pages.
        random: u8,
        /// Share of text pages.
        text: u8,
        /// Their sum.
        sum: u32,
    },
    /// A content mix string could not be parsed.
    #[error(
        "invalid content mix {input:?}: {reason} (expected zero:random:text percentages such as 50:25:25)"
    )]
    MixSyntax {
        /// The text given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Memory size of zero.
    #[error("memory size must be greater than zero")]
    ZeroMemory,
    /// Memory size not a multiple of the page size.
    #[error("memory size {0} bytes is not a multiple of the page size ({PAGE_SIZE} bytes)")]
    UnalignedMemory(u64),
    /// Memory size that does not fit this process's address space.
    #[error("memory size {0} bytes is too large for this host")]
    MemoryTooLarge(u64),
    /// Zero regions requested.
    #[error("region count must be at least 1")]
    ZeroRegions,
    /// More regions than pages.
    #[error("{pages} pages of memory cannot be split into {regions} regions of at least one page")]
    RegionsTooSmall {
        /// Pages of memory.
        pages: u64,
        /// Regions requested.
        regions: u32,
    },
    /// A region length given to [`SyntheticGuest::empty`] is zero or unaligned.
    #[error(
        "region {index} length {len} bytes is not a non-zero multiple of the page size ({PAGE_SIZE} bytes)"
    )]
    BadRegionLength {
        /// Index of the region.
        index: usize,
        /// Length given.
        len: u64,
    },
    /// Dirtier thread count outside `1..=MAX_DIRTIER_THREADS`.
    #[error("dirtier thread count {0} is outside 1..={MAX_DIRTIER_THREADS}")]
    DirtierThreads(u32),
    /// The operation needs the guest paused.
    #[error("the guest must be paused for this operation")]
    NotPaused,
    /// A page index past the guest's memory.
    #[error("page {page} is outside the guest's {total} pages")]
    PageOutOfRange {
        /// The page asked for.
        page: u64,
        /// The guest's pages.
        total: u64,
    },
    /// mmap failed.
    #[error("cannot map {bytes} bytes of guest memory: {error}")]
    Mmap {
        /// Size requested.
        bytes: u64,
        /// The OS error.
        error: std::io::Error,
    },
    /// A dirtier thread could not be started.
    #[error("cannot start a dirtier thread: {0}")]
    Spawn(std::io::Error),
    /// Handed-over files this guest cannot map as its memory.
    #[error("cannot take the handed-over memory: {0}")]
    Handover(String),
}

impl From<SyntheticError> for GuestError {
    fn from(error: SyntheticError) -> Self {
        GuestError::new(error.to_string())
    }
}

/// Shares (percent) of zero, random and text-like pages in a fresh guest.
///
/// Each kind exercises a different path of a migration: zero pages are
/// detected and skipped, random pages defeat compression, text pages
/// compress a few times over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContentMix {
    /// Percent of pages left zero (and never touched).
    pub zero: u8,
    /// Percent of pages of incompressible random bytes.
    pub random: u8,
    /// Percent of pages of English-like words, compressing roughly 2-4x.
    pub text: u8,
}

impl ContentMix {
    /// A mix, checked to sum to 100.
    pub fn new(zero: u8, random: u8, text: u8) -> Result<Self, SyntheticError> {
        let mix = Self { zero, random, text };
        mix.validate()?;
        Ok(mix)
    }

    /// Checks the shares sum to 100; the fields are public, so a mix built
    /// directly is checked again when a guest is created.
    pub fn validate(&self) -> Result<(), SyntheticError> {
        let sum = u32::from(self.zero) + u32::from(self.random) + u32::from(self.text);
        if sum == 100 {
            Ok(())
        } else {
            Err(SyntheticError::MixSum {
                zero: self.zero,
                random: self.random,
                text: self.text,
                sum,
            })
        }
    }
}

impl Default for ContentMix {
    /// Half zero pages, a quarter each of random and text: roughly what an
    /// idle-ish VM with some data looks like.
    fn default() -> Self {
        Self {
            zero: 50,
            random: 25,
            text: 25,
        }
    }
}

impl fmt::Display for ContentMix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.zero, self.random, self.text)
    }
}

impl FromStr for ContentMix {
    type Err = SyntheticError;

    /// Parses `zero:random:text`, for example `50:25:25`.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let syntax = |reason: String| SyntheticError::MixSyntax {
            input: input.to_owned(),
            reason,
        };
        let parts: Vec<&str> = input.split(':').collect();
        if parts.len() != 3 {
            return Err(syntax(format!("found {} fields, need 3", parts.len())));
        }
        let mut shares = [0u8; 3];
        for (share, part) in shares.iter_mut().zip(&parts) {
            let part = part.trim();
            *share = part
                .parse::<u8>()
                .ok()
                .filter(|&value| value <= 100)
                .ok_or_else(|| syntax(format!("{part:?} is not a percentage from 0 to 100")))?;
        }
        Self::new(shares[0], shares[1], shares[2])
    }
}

/// How to build a source guest with [`SyntheticGuest::new`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntheticConfig {
    /// Guest memory size; a non-zero multiple of [`PAGE_SIZE`].
    pub memory_bytes: u64,
    /// Number of regions memory is split into, to exercise multi-region
    /// migration. Equal sizes, the last taking the remainder; ids `0..n` at
    /// contiguous guest addresses from 0.
    pub regions: u32,
    /// Content of the initial fill.
    pub mix: ContentMix,
    /// Seed of the fill and of the dirtier: equal seeds give equal guests.
    pub seed: u64,
    /// Bytes per second the dirtier writes (in pages: rate / 4096 pages
    /// dirtied per second); 0 disables the dirtier.
    pub dirty_rate_bytes_per_sec: u64,
    /// The dirtier writes pages `[0, working_set)` of the whole memory,
    /// rounded up to pages; 0 or more than the memory means all of it.
    pub working_set_bytes: u64,
    /// Threads the dirty rate is split across.
    pub dirtier_threads: u32,
}

impl Default for SyntheticConfig {
    /// 1 GiB in one region, default mix, seed 0, no dirtier.
    fn default() -> Self {
        Self {
            memory_bytes: 1 << 30,
            regions: 1,
            mix: ContentMix::default(),
            seed: 0,
            dirty_rate_bytes_per_sec: 0,
            working_set_bytes: 0,
            dirtier_threads: 1,
        }
    }
}

/// A guest made of anonymous memory and dirtier threads; see the crate docs.
///
/// Guest memory is only ever accessed through raw pointers, as the engine
/// does, because the dirtier threads write it concurrently.
pub struct SyntheticGuest {
    regions: Vec<MemoryRegion>,
    // Field order is drop order: the regions (which point into the mapping)
    // go first, then the dirtier joins its threads, then the last `Arc` of
    // the memory unmaps it.
    dirtier: Dirtier,
    memory: Arc<Memory>,
}

impl fmt::Debug for SyntheticGuest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyntheticGuest")
            .field("regions", &self.regions)
            .field("running", &self.is_running())
            .field("dirtied_pages", &self.dirtied_pages())
            .finish_non_exhaustive()
    }
}

impl SyntheticGuest {
    /// Source side: maps memory, fills it with `config.mix` (deterministic
    /// from the seed, using all cores) and, if the dirty rate is non-zero,
    /// starts the dirtiers: the guest is live before the migration begins,
    /// as a VMM's guest would be.
    pub fn new(config: &SyntheticConfig) -> Result<Self, SyntheticError> {
        Self::new_with_fill_progress(config, &AtomicU64::new(0))
    }

    /// [`SyntheticGuest::new`], counting the bytes filled so far in
    /// `filled` (it reaches `config.memory_bytes` when the fill is done), so
    /// another thread can show the fill's progress: a fill of GiBs takes
    /// seconds.
    pub fn new_with_fill_progress(
        config: &SyntheticConfig,
        filled: &AtomicU64,
    ) -> Result<Self, SyntheticError> {
        Self::build(config, filled, false)
    }

    /// [`SyntheticGuest::new`] with memory in a memfd, mapped shared, so
    /// that it can be handed over to a destination on this host
    /// ([`GuestMemory::region_files`] gives the file) instead of copied.
    pub fn new_memfd(config: &SyntheticConfig) -> Result<Self, SyntheticError> {
        Self::build(config, &AtomicU64::new(0), true)
    }

    /// [`SyntheticGuest::new_memfd`], counting the bytes filled as
    /// [`SyntheticGuest::new_with_fill_progress`] does.
    pub fn new_memfd_with_fill_progress(
        config: &SyntheticConfig,
        filled: &AtomicU64,
    ) -> Result<Self, SyntheticError> {
        Self::build(config, filled, true)
    }

    fn build(
        config: &SyntheticConfig,
        filled: &AtomicU64,
        memfd: bool,
    ) -> Result<Self, SyntheticError> {
        config.mix.validate()?;
        if config.memory_bytes == 0 {
            return Err(SyntheticError::ZeroMemory);
        }
        if !config.memory_bytes.is_multiple_of(PAGE) {
            return Err(SyntheticError::UnalignedMemory(config.memory_bytes));
        }
        if config.regions == 0 {
            return Err(SyntheticError::ZeroRegions);
        }
        let pages = config.memory_bytes / PAGE;
        if pages < u64::from(config.regions) {
            return Err(SyntheticError::RegionsTooSmall {
                pages,
                regions: config.regions,
            });
        }
        if config.dirtier_threads == 0 || config.dirtier_threads > MAX_DIRTIER_THREADS {
            return Err(SyntheticError::DirtierThreads(config.dirtier_threads));
        }
        let regions = u64::from(config.regions);
        let mut region_pages = vec![pages / regions; config.regions as usize];
        if let Some(last) = region_pages.last_mut() {
            *last += pages % regions;
        }
        let working_set_pages = match config.working_set_bytes.div_ceil(PAGE) {
            0 => pages,
            ws => ws.min(pages),
        };
        let mapping = if memfd {
            map_memfd(config.memory_bytes)?
        } else {
            map(config.memory_bytes)?
        };
        fill::fill(&mapping, config.mix, config.seed, filled);
        let mut guest = Self::assemble(
            mapping,
            region_pages,
            DirtierConfig {
                seed: config.seed,
                rate: config.dirty_rate_bytes_per_sec,
                working_set_pages,
                threads: config.dirtier_threads,
            },
        );
        if config.dirty_rate_bytes_per_sec > 0 {
            guest.dirtier.resume().map_err(SyntheticError::Spawn)?;
        }
        Ok(guest)
    }

    /// Destination side: zeroed memory with regions of `region_lens` bytes
    /// (ids `0..n`, contiguous guest addresses from 0), paused, with no
    /// dirtier until [`DeviceState::restore_state`] brings the source's.
    pub fn empty(region_lens: &[u64]) -> Result<Self, SyntheticError> {
        if region_lens.is_empty() {
            return Err(SyntheticError::ZeroRegions);
        }
        let mut region_pages = Vec::with_capacity(region_lens.len());
        for (index, &len) in region_lens.iter().enumerate() {
            if len == 0 || len % PAGE != 0 {
                return Err(SyntheticError::BadRegionLength { index, len });
            }
            region_pages.push(len / PAGE);
        }
        let bytes = region_lens
            .iter()
            .try_fold(0u64, |sum, &len| sum.checked_add(len))
            .ok_or(SyntheticError::MemoryTooLarge(u64::MAX))?;
        let mapping = map(bytes)?;
        Ok(Self::assemble(
            mapping,
            region_pages,
            DirtierConfig {
                seed: 0,
                rate: 0,
                working_set_pages: bytes / PAGE,
                threads: 1,
            },
        ))
    }

    /// Destination side of a hand-over: the source's memory, from the
    /// files it handed over, mapped shared; paused, with no dirtier until
    /// [`DeviceState::restore_state`] brings the source's. A synthetic
    /// guest keeps its memory in one file, so the regions (ids `0..n`,
    /// contiguous from guest address 0) must lie one after the other in
    /// one file.
    pub fn from_handed_files(files: Vec<HandedFile>) -> Result<Self, SyntheticError> {
        let refuse = |reason: String| SyntheticError::Handover(reason);
        let mut region_pages = Vec::with_capacity(files.len());
        let mut identity = None;
        let mut bytes = 0u64;
        let mut start = None;
        for (index, handed) in files.iter().enumerate() {
            if u64::from(handed.region_id) != index as u64 || handed.guest_addr != bytes {
                return Err(refuse(format!(
                    "region {} at {:#x} is not region {index} at {bytes:#x}",
                    handed.region_id, handed.guest_addr
                )));
            }
            let first = *start.get_or_insert(handed.offset);
            if handed.offset != first + bytes {
                return Err(refuse(format!(
                    "region {} starts at file offset {}, not right after region {}",
                    handed.region_id,
                    handed.offset,
                    index.saturating_sub(1)
                )));
            }
            let id = file_identity(&handed.file).map_err(|error| refuse(error.to_string()))?;
            if *identity.get_or_insert(id) != id {
                return Err(refuse(format!(
                    "region {} is in another file than region 0",
                    handed.region_id
                )));
            }
            region_pages.push(handed.len / PAGE);
            bytes = bytes
                .checked_add(handed.len)
                .ok_or(SyntheticError::MemoryTooLarge(u64::MAX))?;
        }
        let Some(first) = files.into_iter().next() else {
            return Err(SyntheticError::ZeroRegions);
        };
        let len = usize::try_from(bytes).map_err(|_| SyntheticError::MemoryTooLarge(bytes))?;
        let mapping = Mapping::map_file(first.file, first.offset, len)
            .map_err(|error| SyntheticError::Mmap { bytes, error })?;
        Ok(Self::assemble(
            mapping,
            region_pages,
            DirtierConfig {
                seed: 0,
                rate: 0,
                working_set_pages: bytes / PAGE,
                threads: 1,
            },
        ))
    }

    fn assemble(mapping: Mapping, region_pages: Vec<u64>, config: DirtierConfig) -> Self {
        let base = mapping.non_null();
        let mut regions = Vec::with_capacity(region_pages.len());
        let mut first = 0u64;
        for (id, &pages) in region_pages.iter().enumerate() {
            // Inside the mapping, whose length is a usize.
            #[expect(
                clippy::cast_possible_truncation,
                reason = "an offset into the mapping"
            )]
            let offset = (first * PAGE) as usize;
            // SAFETY: regions tile the mapping without overlap, so `first` is
            // inside it; the mapping lives in `memory`, which the guest keeps
            // until after the regions are dropped (see the field order).
            let host = unsafe { base.add(offset) };
            // The guest has a handful of regions.
            #[expect(clippy::cast_possible_truncation, reason = "a handful of regions")]
            let id = id as u32;
            // SAFETY: as above, `host..host + pages * PAGE` is a readable and
            // writable part of the mapping, alive as long as the guest, and
            // `pages > 0`.
            regions.push(unsafe { MemoryRegion::new(id, first * PAGE, host, pages * PAGE) });
            first += pages;
        }
        let memory = Arc::new(Memory::new(mapping, region_pages));
        Self {
            regions,
            dirtier: Dirtier::new(Arc::clone(&memory), config),
            memory,
        }
    }

    /// Gives every page of the guest its own memory: pages the fill left zero
    /// (never touched, so without a page-table entry, or mapped to the
    /// kernel's shared zero page) are written without changing a byte.
    ///
    /// A DSA work queue uses the process's page tables (shared virtual
    /// addressing): a page without an entry makes its COMPVAL stop with a
    /// page fault and the CPU finish it, and the CPU reading an untouched
    /// page reads one cached shared zero page. After this, zero pages are
    /// real memory for both, so a zero-page measurement compares like with
    /// like. Costs one page fault and 4 KiB of memory per zero page. Returns
    /// the pages touched.
    pub fn touch_zero_pages(&self) -> u64 {
        let mapping = self.memory.mapping();
        let pages = mapping.len() / PAGE_SIZE;
        for page in 0..pages {
            // SAFETY: `page < pages`, so the byte lies inside the mapping,
            // which `self.memory` keeps alive.
            unsafe { write_access(mapping.ptr().add(page * PAGE_SIZE)) };
        }
        pages as u64
    }

    /// Whether the guest runs (between `resume` and `pause`).
    pub fn is_running(&self) -> bool {
        self.dirtier.is_running()
    }

    /// Page writes the dirtier has made in this process, for rate checks in
    /// tests and progress displays; it does not travel with the state.
    pub fn dirtied_pages(&self) -> u64 {
        self.memory.dirtied()
    }

    /// Number of pages of memory.
    pub fn total_pages(&self) -> u64 {
        self.memory.total_pages()
    }

    /// Pages `[0, n)` the dirtier writes.
    pub fn working_set_pages(&self) -> u64 {
        self.dirtier.snapshot().0.working_set_pages
    }

    /// The dirtier's current throttle, percent.
    pub fn throttle(&self) -> u8 {
        self.memory.throttle()
    }

    /// XXH3-128 of all memory, to compare source and destination after a
    /// migration. Reads through raw pointers into a small buffer, so it is
    /// safe to call while the guest runs, but the result is only meaningful
    /// (stable) while it is paused.
    pub fn digest(&self) -> u128 {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut buf = vec![0u8; 1 << 16];
        let mapping = self.memory.mapping();
        let mut offset = 0;
        while offset < mapping.len() {
            let n = buf.len().min(mapping.len() - offset);
            // SAFETY: `offset + n <= len`, so the source is inside the
            // mapping, which `self.memory` keeps alive; `buf` is a separate
            // allocation. Concurrent dirtier writes can only make the copy
            // torn, never unsound to read as bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(mapping.ptr().add(offset), buf.as_mut_ptr(), n);
            }
            hasher.update(&buf[..n]);
            offset += n;
        }
        hasher.digest128()
    }

    /// A copy of region `region`'s bytes (`None` if there is no such region),
    /// for tests that compare contents page by page.
    pub fn region_bytes(&self, region: usize) -> Option<Vec<u8>> {
        let region = self.regions.get(region)?;
        let len = usize::try_from(region.len()).ok()?;
        let mut bytes = vec![0u8; len];
        // SAFETY: the region lies inside the live mapping and `bytes` is a
        // fresh allocation of the same length.
        unsafe {
            std::ptr::copy_nonoverlapping(region.host_ptr(), bytes.as_mut_ptr(), len);
        }
        Some(bytes)
    }

    /// Makes `pages` dirtying steps on the calling thread, continuing the
    /// dirtier threads' sequences in turn (and marking the dirty log). Lets
    /// tests and benchmarks dirty memory deterministically, independent of
    /// timing; the guest must be paused.
    pub fn step_dirtier(&mut self, pages: u64) -> Result<(), SyntheticError> {
        if self.is_running() {
            return Err(SyntheticError::NotPaused);
        }
        self.dirtier.step(pages);
        Ok(())
    }

    /// Changes each page of `pages` (indices over all regions, in order)
    /// and marks it in the dirty log, as a guest write would: tests and
    /// benchmarks dirty a known set, e.g. pages spread across memory. The
    /// guest must be paused; pages past the end are refused.
    pub fn dirty_pages(&mut self, pages: &[u64]) -> Result<(), SyntheticError> {
        if self.is_running() {
            return Err(SyntheticError::NotPaused);
        }
        let total = self.memory.total_pages();
        if let Some(&page) = pages.iter().find(|&&page| page >= total) {
            return Err(SyntheticError::PageOutOfRange { page, total });
        }
        for &page in pages {
            self.memory.change_page(page);
        }
        Ok(())
    }

    fn saved_state(&self) -> SavedState {
        let (config, threads) = self.dirtier.snapshot();
        SavedState {
            config,
            total_pages: self.memory.total_pages(),
            throttle: self.memory.throttle(),
            threads,
        }
    }
}

fn map(bytes: u64) -> Result<Mapping, SyntheticError> {
    let len = usize::try_from(bytes).map_err(|_| SyntheticError::MemoryTooLarge(bytes))?;
    Mapping::new(len).map_err(|error| SyntheticError::Mmap { bytes, error })
}

/// Memory in a new memfd, shared.
fn map_memfd(bytes: u64) -> Result<Mapping, SyntheticError> {
    let len = usize::try_from(bytes).map_err(|_| SyntheticError::MemoryTooLarge(bytes))?;
    Mapping::new_memfd(len).map_err(|error| SyntheticError::Mmap { bytes, error })
}

/// Device and inode: what tells two descriptors of one file.
fn file_identity(file: &std::os::fd::OwnedFd) -> std::io::Result<(u64, u64)> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero stat is a valid buffer for fstat to fill.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `file` is open and `stat` writable.
    if unsafe { libc::fstat(file.as_raw_fd(), &raw mut stat) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((stat.st_dev, stat.st_ino))
}

impl GuestMemory for SyntheticGuest {
    fn regions(&self) -> &[MemoryRegion] {
        &self.regions
    }

    /// The memfd, when the guest was built with one
    /// ([`SyntheticGuest::new_memfd`], [`SyntheticGuest::from_handed_files`]):
    /// each region at its place in it.
    fn region_files(&self) -> Option<Vec<RegionFile<'_>>> {
        let (file, start) = self.memory.mapping().file()?;
        Some(
            self.regions
                .iter()
                .map(|region| RegionFile::new(region.id(), file, start + region.guest_addr()))
                .collect(),
        )
    }
}

impl DirtyLog for SyntheticGuest {
    fn start_dirty_log(&mut self) -> GuestResult<()> {
        self.memory.start_log();
        Ok(())
    }

    /// Fails if the log is not started (nothing would be tracked) or the
    /// bitmaps do not match the regions in number and size.
    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
        self.memory.sync_log(bitmaps)
    }

    fn stop_dirty_log(&mut self) -> GuestResult<()> {
        self.memory.stop_log();
        Ok(())
    }
}

impl GuestControl for SyntheticGuest {
    fn pause(&mut self) -> GuestResult<()> {
        self.dirtier.pause()
    }

    fn resume(&mut self) -> GuestResult<()> {
        self.dirtier
            .resume()
            .map_err(|error| GuestError::from(SyntheticError::Spawn(error)))
    }

    /// Takes `percent` (0..=99) of the dirty rate away, as the engine does to
    /// make a busy guest converge.
    fn set_throttle(&mut self, percent: u8) -> GuestResult<()> {
        if percent > 99 {
            return Err(GuestError::new(format!(
                "throttle {percent}% is above the maximum of 99%"
            )));
        }
        self.memory.set_throttle(percent);
        Ok(())
    }
}

impl DeviceState for SyntheticGuest {
    /// One section, [`SECTION_NAME`], with the dirtier's configuration,
    /// throttle and per-thread progress. The guest must be paused so the
    /// threads' progress is settled.
    fn save_state(&mut self) -> GuestResult<Vec<StateSection>> {
        if self.is_running() {
            return Err(GuestError::new("save_state needs a paused guest"));
        }
        Ok(vec![self.saved_state().encode()])
    }

    fn state_size_hint(&self) -> u64 {
        self.saved_state().encode().data.len() as u64
    }

    /// Takes over the source's dirtier (including its throttle, until
    /// `set_throttle` changes it); it starts on the next `resume`.
    fn restore_state(&mut self, sections: &[StateSection]) -> GuestResult<()> {
        if self.is_running() {
            return Err(GuestError::new("restore_state needs a paused guest"));
        }
        let mut found = None;
        for section in sections {
            if section.name != SECTION_NAME {
                return Err(GuestError::new(format!(
                    "unknown state section {:?}: the synthetic guest only has {SECTION_NAME:?}",
                    section.name
                )));
            }
            if found.replace(section).is_some() {
                return Err(GuestError::new(format!(
                    "state section {SECTION_NAME:?} appears more than once"
                )));
            }
        }
        let section = found
            .ok_or_else(|| GuestError::new(format!("missing state section {SECTION_NAME:?}")))?;
        let saved = SavedState::decode(section, self.memory.total_pages())?;
        self.memory.set_throttle(saved.throttle);
        self.dirtier.replace(saved.config, saved.threads);
        Ok(())
    }

    fn guest_kind(&self) -> &str {
        GUEST_KIND
    }
}

#[cfg(test)]
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "test data and bounds are made by truncating numbers"
)]
mod tests;

/// Writes to the byte at `byte` without changing it, whatever another
/// thread writes there meanwhile: a locked OR of 0, which the MMU treats as
/// a write (so the kernel gives the page its own frame). Written as an
/// instruction because the compiler turns an atomic `fetch_or(0)` into a
/// plain load.
///
/// # Safety
///
/// `byte` must be valid for writes.
#[cfg(target_arch = "x86_64")]
unsafe fn write_access(byte: *mut u8) {
    // SAFETY: the caller guarantees a writable byte; the locked OR of 0
    // leaves its value unchanged and only sets flags.
    unsafe {
        std::arch::asm!("lock or byte ptr [{0}], 0", in(reg) byte, options(nostack));
    }
}

/// See the x86_64 version: a compare-exchange of 0 with 0 elsewhere.
///
/// # Safety
///
/// `byte` must be valid for writes.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn write_access(byte: *mut u8) {
    // SAFETY: the caller guarantees a writable, aligned (u8) byte.
    let atomic = unsafe { std::sync::atomic::AtomicU8::from_ptr(byte) };
    let _ = atomic.compare_exchange(
        0,
        0,
        std::sync::atomic::Ordering::Relaxed,
        std::sync::atomic::Ordering::Relaxed,
    );
}

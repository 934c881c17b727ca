//! rust-vmm `vm-memory` interop (the `vm-memory` feature): tern regions over
//! any vm-memory guest memory whose regions are `MmapRegion`s, and a dirty
//! log over their [`AtomicBitmap`]s.
//!
//! What fits, with no `unsafe` and no trait to implement in the VMM:
//!
//! - vm-memory's own `GuestMemoryMmap<B>` for `B` = `()`, [`AtomicBitmap`] or
//!   `Option<AtomicBitmap>`;
//! - any `GuestRegionCollection<R>` whose region type dereferences to
//!   `MmapRegion<B>` (Firecracker's `GuestRegionCollection<GuestRegionMmapExt>`,
//!   whose regions wrap `GuestRegionMmap<Option<AtomicBitmap>>`), or any other
//!   [`GuestMemoryBackend`] with such regions;
//! - a [`GuestMemoryAtomic`] over one of those (Cloud Hypervisor's), through
//!   [`VmMemory::from_atomic`]: tern migrates the collection current at the
//!   start, and the dirty log fails the migration (the source keeps running)
//!   if the VMM swaps the collection meanwhile (memory hot-plug).
//!
//! The host address, length and protection of a region are read from its
//! `MmapRegion`, whose mapping vm-memory guarantees, never from a method the
//! VMM could implement; that is why the region type must dereference to one.
//! A VMM whose regions hold memory that must not be read (Firecracker's
//! unplugged hot-plug slots, mapped `PROT_NONE`) says which byte ranges of
//! each region to migrate with [`VmMemory::with_ranges`]; each range becomes
//! one tern region.
//!
//! The `AtomicBitmap` sees only writes made through vm-memory (device
//! emulation, virtio queues, the VMM itself). Writes by the guest's vCPUs
//! under KVM go to KVM's dirty log (`KVM_GET_DIRTY_LOG`); a VMM running a
//! real guest merges both into the bitmaps it hands to tern, as
//! `tern-vmm` does with KVM's.
//!
//! vm-memory is part of this module's API: tern-engine 0.1 builds against
//! vm-memory 0.18 (docs/embedding.md, "vm-memory versions", says how
//! upgrades are released).

use std::ops::{Deref, Range};
use std::ptr::NonNull;
use std::sync::Arc;

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{
    GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryRegion, MmapRegion,
};

use crate::bitmap::DirtyBitmap;
use crate::guest::{DirtyLog, GuestError, GuestMemory, GuestResult, MemoryRegion, PAGE_SIZE};

/// The bitmaps an `MmapRegion` can carry that tern knows how to read: none
/// (`()`), an [`AtomicBitmap`], or an optional one (`Option<AtomicBitmap>`,
/// Firecracker's choice: `None` when `track_dirty_pages` is off).
pub trait RegionBitmap: vm_memory::bitmap::Bitmap + sealed::SealedBitmap {
    /// The bitmap of writes made through vm-memory, if there is one.
    fn atomic_bitmap(&self) -> Option<&AtomicBitmap>;
}

impl RegionBitmap for () {
    fn atomic_bitmap(&self) -> Option<&AtomicBitmap> {
        None
    }
}

impl RegionBitmap for AtomicBitmap {
    fn atomic_bitmap(&self) -> Option<&AtomicBitmap> {
        Some(self)
    }
}

impl RegionBitmap for Option<AtomicBitmap> {
    fn atomic_bitmap(&self) -> Option<&AtomicBitmap> {
        self.as_ref()
    }
}

/// A vm-memory region backed by an `MmapRegion`: vm-memory's
/// `GuestRegionMmap<B>`, or a VMM's wrapper that dereferences to the
/// `MmapRegion` (Firecracker's `GuestRegionMmapExt`). Implemented for every
/// such type and sealed: tern reads the mapping only from the `MmapRegion`.
pub trait MmapBackedRegion: GuestMemoryRegion + sealed::SealedRegion {
    /// The bitmap type of the mapping.
    type Bitmap: RegionBitmap;

    /// The `MmapRegion` holding the region's mapping.
    fn mmap_region(&self) -> &MmapRegion<Self::Bitmap>;
}

impl<R, B> MmapBackedRegion for R
where
    R: GuestMemoryRegion + Deref<Target = MmapRegion<B>>,
    B: RegionBitmap,
{
    type Bitmap = B;

    fn mmap_region(&self) -> &MmapRegion<B> {
        self
    }
}

mod sealed {
    use std::ops::Deref;

    use vm_memory::bitmap::AtomicBitmap;
    use vm_memory::{GuestMemoryRegion, MmapRegion};

    pub trait SealedBitmap {}
    impl SealedBitmap for () {}
    impl SealedBitmap for AtomicBitmap {}
    impl SealedBitmap for Option<AtomicBitmap> {}

    pub trait SealedRegion {}
    impl<R, B> SealedRegion for R
    where
        R: GuestMemoryRegion + Deref<Target = MmapRegion<B>>,
        B: super::RegionBitmap,
    {
    }
}

/// One tern region: a range of pages of one vm-memory region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    /// Index of the vm-memory region in the collection's order.
    region: usize,
    /// First page of the range within the vm-memory region.
    first_page: u64,
    pages: u64,
}

/// tern's view of a vm-memory guest memory. It holds the collection (an
/// `Arc`, sharing the mappings), so the regions stay mapped for as long as
/// it, or a dirty log made from it, lives.
#[derive(Debug)]
pub struct VmMemory<M: GuestMemoryBackend> {
    memory: Arc<M>,
    /// The `GuestMemoryAtomic` the collection was loaded from, to notice a
    /// swap during the migration.
    atomic: Option<GuestMemoryAtomic<M>>,
    pieces: Vec<Piece>,
    regions: Vec<MemoryRegion>,
}

impl<M> VmMemory<M>
where
    M: GuestMemoryBackend,
    M::R: MmapBackedRegion,
{
    /// Describes every region of `memory` (a clone of it is kept: vm-memory's
    /// collections share their regions). Fails on a region whose length or
    /// guest address is not a multiple of tern's 4 KiB page, or that is not
    /// mapped readable and writable.
    pub fn new(memory: &M) -> GuestResult<Self>
    where
        M: Clone,
    {
        Self::describe(Arc::new(memory.clone()), None, whole_region)
    }

    /// Like [`VmMemory::new`], migrating only the byte ranges `ranges`
    /// returns for each region (offsets from the region's start, whole 4 KiB
    /// pages, in increasing order, not overlapping); each range is one tern
    /// region, ids in order. An empty list skips the region. For memory that
    /// must not be read, such as Firecracker's unplugged hot-plug slots.
    pub fn with_ranges(
        memory: &M,
        ranges: impl FnMut(&M::R) -> Vec<Range<u64>>,
    ) -> GuestResult<Self>
    where
        M: Clone,
    {
        Self::describe(Arc::new(memory.clone()), None, ranges)
    }

    /// The collection current in `atomic` (Cloud Hypervisor keeps its guest
    /// memory in a `GuestMemoryAtomic`). The regions are those of that
    /// collection; a dirty log made from this value fails its next sync if
    /// the VMM has swapped the collection since (memory hot-plug), so that
    /// the migration stops with the source running instead of missing the
    /// new memory.
    pub fn from_atomic(atomic: &GuestMemoryAtomic<M>) -> GuestResult<Self> {
        Self::from_atomic_with_ranges(atomic, whole_region)
    }

    /// [`VmMemory::from_atomic`] with the ranges of [`VmMemory::with_ranges`].
    pub fn from_atomic_with_ranges(
        atomic: &GuestMemoryAtomic<M>,
        ranges: impl FnMut(&M::R) -> Vec<Range<u64>>,
    ) -> GuestResult<Self> {
        let memory = atomic.memory().into_inner();
        Self::describe(memory, Some(atomic.clone()), ranges)
    }

    fn describe(
        memory: Arc<M>,
        atomic: Option<GuestMemoryAtomic<M>>,
        mut ranges: impl FnMut(&M::R) -> Vec<Range<u64>>,
    ) -> GuestResult<Self> {
        let mut pieces = Vec::new();
        let mut regions = Vec::new();
        for (index, region) in memory.iter().enumerate() {
            let host = checked_mapping(index, region)?;
            let mut end_of_previous = 0;
            for range in ranges(region) {
                let piece = checked_piece(index, region, &range, end_of_previous)?;
                end_of_previous = range.end;
                let id = u32::try_from(regions.len())
                    .map_err(|_| GuestError::new("more than 2^32 regions"))?;
                let offset = usize::try_from(range.start)
                    .map_err(|_| GuestError::new("region offset beyond the address space"))?;
                // SAFETY: `checked_piece` showed `range` lies inside the
                // region, whose `len` bytes `checked_mapping` showed lie
                // inside the `MmapRegion`'s mapping, so the offset stays in
                // the same allocation.
                let start = unsafe { host.add(offset) };
                // SAFETY: `start..start + len` is part of the `MmapRegion`'s
                // mapping, readable and writable (checked); `Self` keeps the
                // collection (and so the `MmapRegion`) alive while the
                // regions are used; `len` is a non-zero multiple of the page
                // size (checked).
                regions.push(unsafe {
                    MemoryRegion::new(
                        id,
                        region.start_addr().0 + range.start,
                        start,
                        range_len(&range),
                    )
                });
                pieces.push(piece);
            }
        }
        if regions.is_empty() {
            return Err(GuestError::new("the guest memory has no region to migrate"));
        }
        Ok(Self {
            memory,
            atomic,
            pieces,
            regions,
        })
    }

    /// The vm-memory guest memory (for a `GuestMemoryAtomic`, the
    /// collection that was current when this value was made).
    pub fn memory(&self) -> &M {
        &self.memory
    }

    /// A dirty log over the regions' `AtomicBitmap`s, for the same ranges.
    /// Fails if a migrated region has no bitmap (Firecracker without
    /// `track_dirty_pages`, or `B = ()`) or one that does not track 4 KiB
    /// pages.
    pub fn dirty_log(&self) -> GuestResult<AtomicBitmapLog<M>> {
        for (index, region) in self.memory.iter().enumerate() {
            if !self.pieces.iter().any(|piece| piece.region == index) {
                continue;
            }
            let Some(bitmap) = region.mmap_region().bitmap().atomic_bitmap() else {
                return Err(GuestError::new(format!(
                    "region {index} at {:#x} has no dirty bitmap (build its MmapRegion with an \
                     AtomicBitmap; in Firecracker, enable track_dirty_pages)",
                    region.start_addr().0
                )));
            };
            let pages = region.len() / PAGE_SIZE as u64;
            let bits = bitmap.len() as u64;
            if bits != pages {
                return Err(GuestError::new(format!(
                    "region {index}: its dirty bitmap has {bits} bits for {pages} pages of 4 KiB \
                     (tern tracks 4 KiB pages; build the bitmap with that page size)"
                )));
            }
        }
        Ok(AtomicBitmapLog {
            memory: self.memory.clone(),
            atomic: self.atomic.clone(),
            pieces: self.pieces.clone(),
        })
    }
}

fn whole_region<R: GuestMemoryRegion>(region: &R) -> Vec<Range<u64>> {
    std::iter::once(0..region.len()).collect()
}

fn range_len(range: &Range<u64>) -> u64 {
    range.end - range.start
}

/// The start of `region`'s mapping, after checking that the mapping covers
/// the region, is readable and writable, and is made of whole pages.
fn checked_mapping<R: MmapBackedRegion>(index: usize, region: &R) -> GuestResult<NonNull<u8>> {
    let mmap = region.mmap_region();
    let guest_addr = region.start_addr().0;
    let len = region.len();
    let page = PAGE_SIZE as u64;
    if len == 0 || !len.is_multiple_of(page) || !guest_addr.is_multiple_of(page) {
        return Err(GuestError::new(format!(
            "region {index} at {guest_addr:#x} of {len} bytes is not made of whole 4 KiB pages"
        )));
    }
    if u64::try_from(mmap.size()).map_or(true, |size| size < len) {
        return Err(GuestError::new(format!(
            "region {index} at {guest_addr:#x}: its mapping ({} bytes) is shorter than the \
             region ({len} bytes)",
            mmap.size()
        )));
    }
    // The destination writes received pages into the mapping: a read-only
    // one (`MmapRegionBuilder::with_mmap_prot`) would fault instead of failing.
    let read_write = libc::PROT_READ | libc::PROT_WRITE;
    if mmap.prot() & read_write != read_write {
        return Err(GuestError::new(format!(
            "region {index} at {guest_addr:#x} is not mapped readable and writable"
        )));
    }
    NonNull::new(mmap.as_ptr()).ok_or_else(|| GuestError::new("null host mapping"))
}

fn checked_piece<R: GuestMemoryRegion>(
    index: usize,
    region: &R,
    range: &Range<u64>,
    end_of_previous: u64,
) -> GuestResult<Piece> {
    let page = PAGE_SIZE as u64;
    if range.start < end_of_previous
        || range.start >= range.end
        || range.end > region.len()
        || !range.start.is_multiple_of(page)
        || !range.end.is_multiple_of(page)
    {
        return Err(GuestError::new(format!(
            "region {index}: range {:#x}..{:#x} is empty, overlaps or precedes the previous one, \
             is not whole 4 KiB pages, or ends past the region's {:#x} bytes",
            range.start,
            range.end,
            region.len()
        )));
    }
    Ok(Piece {
        region: index,
        first_page: range.start / page,
        pages: range_len(range) / page,
    })
}

impl<M> GuestMemory for VmMemory<M>
where
    M: GuestMemoryBackend + Send + Sync,
    M::R: MmapBackedRegion,
{
    fn regions(&self) -> &[MemoryRegion] {
        &self.regions
    }

    /// The files of regions built over a file (vm-memory's `FileOffset`:
    /// Cloud Hypervisor's `shared=on` memfds), for a same-host hand-over;
    /// `None` when any migrated region is anonymous memory.
    fn region_files(&self) -> Option<Vec<crate::guest::RegionFile<'_>>> {
        let page = crate::guest::PAGE_SIZE as u64;
        let regions: Vec<&M::R> = self.memory.iter().collect();
        self.pieces
            .iter()
            .zip(&self.regions)
            .map(|(piece, region)| {
                let file = regions.get(piece.region)?.mmap_region().file_offset()?;
                Some(crate::guest::RegionFile::new(
                    region.id(),
                    std::os::fd::AsFd::as_fd(file.file()),
                    file.start().checked_add(piece.first_page * page)?,
                ))
            })
            .collect()
    }
}

/// A dirty log over the `AtomicBitmap`s of a vm-memory guest memory (made by
/// [`VmMemory::dirty_log`]): each sync moves the bits vm-memory set into
/// tern's bitmaps and clears them, atomically per 64-page word, so a write
/// racing the sync is either in this sync or in the next.
#[derive(Debug)]
pub struct AtomicBitmapLog<M: GuestMemoryBackend> {
    memory: Arc<M>,
    atomic: Option<GuestMemoryAtomic<M>>,
    pieces: Vec<Piece>,
}

impl<M> AtomicBitmapLog<M>
where
    M: GuestMemoryBackend,
    M::R: MmapBackedRegion,
{
    fn bitmap(&self, index: usize) -> GuestResult<&AtomicBitmap> {
        self.memory
            .iter()
            .nth(index)
            .and_then(|region| region.mmap_region().bitmap().atomic_bitmap())
            .ok_or_else(|| GuestError::new(format!("region {index} lost its dirty bitmap")))
    }

    fn check_not_swapped(&self) -> GuestResult<()> {
        let Some(atomic) = &self.atomic else {
            return Ok(());
        };
        if Arc::ptr_eq(&atomic.memory().into_inner(), &self.memory) {
            return Ok(());
        }
        Err(GuestError::new(
            "the VMM replaced the guest memory map (GuestMemoryAtomic) during the migration, \
             as memory hot-plug does; tern migrates the regions it started with, so it stops",
        ))
    }
}

impl<M> DirtyLog for AtomicBitmapLog<M>
where
    M: GuestMemoryBackend + Send + Sync,
    M::R: MmapBackedRegion,
{
    fn start_dirty_log(&mut self) -> GuestResult<()> {
        self.check_not_swapped()?;
        // Everything is sent in the first iteration; earlier marks are moot.
        let mut previous = None;
        for piece in &self.pieces {
            if previous != Some(piece.region) {
                self.bitmap(piece.region)?.reset();
                previous = Some(piece.region);
            }
        }
        Ok(())
    }

    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
        self.check_not_swapped()?;
        if bitmaps.len() != self.pieces.len() {
            return Err(GuestError::new(format!(
                "{} bitmaps for {} regions",
                bitmaps.len(),
                self.pieces.len()
            )));
        }
        // One swap of each vm-memory bitmap per sync, then its words go to
        // every tern region cut from it.
        let mut taken: Option<(usize, Vec<u64>)> = None;
        for (piece, bitmap) in self.pieces.iter().zip(bitmaps.iter_mut()) {
            if taken.as_ref().map(|(region, _)| *region) != Some(piece.region) {
                taken = Some((piece.region, self.bitmap(piece.region)?.get_and_reset()));
            }
            let (_, words) = taken.as_ref().expect("taken just above");
            or_bit_range(words, piece.first_page, piece.pages, bitmap.words_mut());
        }
        Ok(())
    }

    fn stop_dirty_log(&mut self) -> GuestResult<()> {
        Ok(())
    }
}

/// ORs bits `first..first + count` of `source` into bits `0..count` of
/// `target`, a word at a time (two source words per target word when
/// `first` is not a multiple of 64).
fn or_bit_range(source: &[u64], first: u64, count: u64, target: &mut [u64]) {
    let shift = (first % 64) as u32;
    let base = usize::try_from(first / 64).expect("bitmap index fits in memory");
    let word_at = |index: usize| source.get(index).copied().unwrap_or(0);
    for (index, word) in target.iter_mut().enumerate() {
        let done = index as u64 * 64;
        if done >= count {
            break;
        }
        let mut bits = word_at(base + index) >> shift;
        if shift != 0 {
            bits |= word_at(base + index + 1) << (64 - shift);
        }
        let remaining = count - done;
        if remaining < 64 {
            bits &= (1u64 << remaining) - 1;
        }
        *word |= bits;
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap};

    use super::{AtomicBitmap, GuestMemory, VmMemory, or_bit_range};
    use crate::bitmap::DirtyBitmap;
    use crate::guest::DirtyLog;

    fn memory() -> GuestMemoryMmap<AtomicBitmap> {
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 1 << 20),
            (GuestAddress(1 << 32), 64 << 10),
        ])
        .expect("guest memory")
    }

    #[test]
    fn regions_follow_the_collection() {
        let memory = memory();
        let tern = VmMemory::new(&memory).unwrap();
        let regions = tern.regions();
        assert_eq!(regions.len(), 2);
        assert_eq!(
            (regions[0].id(), regions[0].guest_addr(), regions[0].len()),
            (0, 0, 1 << 20)
        );
        assert_eq!(
            (regions[1].id(), regions[1].guest_addr(), regions[1].len()),
            (1, 1 << 32, 64 << 10)
        );
        memory
            .write_obj(0xabu8, GuestAddress((1 << 32) + 3 * 4096))
            .unwrap();
        let page = regions[1].page_ptr(3).unwrap();
        // SAFETY: the page lies in a live mapping (held by `tern`) and nothing
        // writes it during the read.
        assert_eq!(unsafe { page.read() }, 0xab);
    }

    #[test]
    fn vm_memory_writes_reach_tern_bitmaps_once() {
        let memory = memory();
        let mut log = VmMemory::new(&memory).unwrap().dirty_log().unwrap();
        memory.write_obj(1u8, GuestAddress(5 * 4096)).unwrap();
        log.start_dirty_log().unwrap();
        memory
            .write_obj(1u64, GuestAddress(7 * 4096 + 4092))
            .unwrap(); // spans pages 7 and 8
        memory
            .write_obj(2u8, GuestAddress((1 << 32) + 15 * 4096))
            .unwrap();
        let mut bitmaps = [DirtyBitmap::new(256), DirtyBitmap::new(16)];
        log.sync_dirty_log(&mut bitmaps).unwrap();
        assert_eq!(bitmaps[0].iter_dirty().collect::<Vec<_>>(), [7, 8]);
        assert_eq!(bitmaps[1].iter_dirty().collect::<Vec<_>>(), [15]);
        let mut again = [DirtyBitmap::new(256), DirtyBitmap::new(16)];
        log.sync_dirty_log(&mut again).unwrap();
        assert_eq!(
            again[0].count() + again[1].count(),
            0,
            "a sync clears the marks"
        );
        assert!(log.sync_dirty_log(&mut again[..1]).is_err());
    }

    #[test]
    fn ranges_cut_regions_and_their_bitmaps() {
        let memory = memory();
        // Region 0 (256 pages) migrates pages 3..70 and 200..256; region 1
        // not at all.
        let tern = VmMemory::with_ranges(&memory, |region| {
            if region.start_addr().0 == 0 {
                vec![3 * 4096..70 * 4096, 200 * 4096..256 * 4096]
            } else {
                Vec::new()
            }
        })
        .unwrap();
        let regions = tern.regions();
        assert_eq!(
            regions
                .iter()
                .map(|region| (region.id(), region.guest_addr(), region.pages()))
                .collect::<Vec<_>>(),
            [(0, 3 * 4096, 67), (1, 200 * 4096, 56)]
        );
        let mut log = tern.dirty_log().unwrap();
        log.start_dirty_log().unwrap();
        for page in [2u64, 3, 66, 69, 70, 199, 200, 255] {
            memory.write_obj(1u8, GuestAddress(page * 4096)).unwrap();
        }
        let mut bitmaps = [DirtyBitmap::new(67), DirtyBitmap::new(56)];
        log.sync_dirty_log(&mut bitmaps).unwrap();
        assert_eq!(bitmaps[0].iter_dirty().collect::<Vec<_>>(), [0, 63, 66]);
        assert_eq!(bitmaps[1].iter_dirty().collect::<Vec<_>>(), [0, 55]);
    }

    #[test]
    #[expect(
        clippy::single_range_in_vec_init,
        reason = "lists of byte ranges, one range each"
    )]
    fn bad_ranges_are_refused() {
        let memory = memory();
        for bad in [
            vec![0..4096 + 1],
            vec![4096..4096],
            vec![8192..12288, 4096..8192],
            vec![0..(2 << 20)],
        ] {
            let error = VmMemory::with_ranges(&memory, |_| bad.clone()).unwrap_err();
            assert!(error.to_string().contains("range"), "{error}");
        }
    }

    #[test]
    fn bit_ranges_shift_across_words() {
        let source = [u64::MAX << 60, 0b1011];
        let mut target = [0u64; 1];
        or_bit_range(&source, 60, 6, &mut target);
        assert_eq!(target[0], 0b11_1111);
        let mut target = [0u64; 1];
        or_bit_range(&source, 62, 4, &mut target);
        assert_eq!(target[0], 0b1111, "bits 62..66: 1, 1, then 1, 1");
        let mut target = [0u64; 2];
        or_bit_range(&[u64::MAX, u64::MAX], 0, 70, &mut target);
        assert_eq!(target, [u64::MAX, 0b11_1111]);
    }

    #[test]
    fn a_region_without_a_bitmap_has_no_dirty_log() {
        let mapping = vm_memory::mmap::MmapRegionBuilder::new_with_bitmap(1 << 20, None)
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS)
            .build()
            .unwrap();
        let region =
            GuestRegionMmap::<Option<AtomicBitmap>>::new(mapping, GuestAddress(0)).unwrap();
        let memory = GuestMemoryMmap::from_regions(vec![region]).unwrap();
        let error = VmMemory::new(&memory).unwrap().dirty_log().unwrap_err();
        assert!(error.to_string().contains("no dirty bitmap"), "{error}");
    }

    #[test]
    fn read_only_mappings_are_refused() {
        let mapping = vm_memory::mmap::MmapRegionBuilder::<()>::new(1 << 20)
            .with_mmap_prot(libc::PROT_READ)
            .build()
            .unwrap();
        let region = GuestRegionMmap::new(mapping, GuestAddress(0)).unwrap();
        let memory = GuestMemoryMmap::from_regions(vec![region]).unwrap();
        let error = VmMemory::new(&memory).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("not mapped readable and writable"),
            "{error}"
        );
    }

    #[test]
    fn regions_must_be_whole_pages() {
        let odd: GuestMemoryMmap<()> =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4096 + 512)]).unwrap();
        assert!(VmMemory::new(&odd).is_err());
    }
}

//! rust-vmm `vm-memory` interop (the `vm-memory` feature): tern regions over
//! a [`GuestMemoryMmap`], and a dirty log over its [`AtomicBitmap`]s.
//!
//! A VMM built on vm-memory already has everything the engine needs: the
//! mappings (one tern [`MemoryRegion`] per vm-memory region, ids in the
//! collection's order) and, with `GuestMemoryMmap<AtomicBitmap>`, a bitmap
//! that vm-memory's write paths mark. What it adds is pausing and throttling
//! its vCPUs ([`GuestControl`](crate::GuestControl)) and its device state
//! ([`DeviceState`](crate::DeviceState)); see `examples/embed_vm_memory.rs`.
//!
//! The `AtomicBitmap` sees only writes made through vm-memory (device
//! emulation, virtio queues, the VMM itself). Writes by the guest's vCPUs
//! under KVM go to KVM's dirty log (`KVM_GET_DIRTY_LOG`); a VMM running a
//! real guest merges both into the bitmaps it hands to tern, as
//! `tern-vmm` does with KVM's.

use std::ptr::NonNull;

use vm_memory::bitmap::{AtomicBitmap, Bitmap};
use vm_memory::{
    GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap, MemoryRegionAddress,
};

use crate::bitmap::DirtyBitmap;
use crate::guest::{DirtyLog, GuestError, GuestMemory, GuestResult, MemoryRegion, PAGE_SIZE};

/// tern's view of a vm-memory guest memory. It holds a clone of the
/// `GuestMemoryMmap` (which shares the mappings), so the regions stay mapped
/// for as long as it lives.
#[derive(Debug)]
pub struct VmMemory<B: Bitmap + 'static = ()> {
    memory: GuestMemoryMmap<B>,
    regions: Vec<MemoryRegion>,
}

impl<B: Bitmap + 'static> VmMemory<B> {
    /// Describes every region of `memory`. Fails on a region whose length or
    /// guest address is not a multiple of tern's 4 KiB page, or that is not
    /// mapped in this process.
    pub fn new(memory: &GuestMemoryMmap<B>) -> GuestResult<Self> {
        let regions = memory
            .iter()
            .enumerate()
            .map(|(index, region)| describe(index, region))
            .collect::<GuestResult<Vec<_>>>()?;
        if regions.is_empty() {
            return Err(GuestError::new("the guest memory has no region"));
        }
        Ok(Self {
            memory: memory.clone(),
            regions,
        })
    }

    /// The vm-memory guest memory.
    pub fn memory(&self) -> &GuestMemoryMmap<B> {
        &self.memory
    }
}

fn describe<B: Bitmap>(index: usize, region: &GuestRegionMmap<B>) -> GuestResult<MemoryRegion> {
    let id = u32::try_from(index).map_err(|_| GuestError::new("more than 2^32 regions"))?;
    let guest_addr = region.start_addr().0;
    let len = region.len();
    let page = PAGE_SIZE as u64;
    if len == 0 || !len.is_multiple_of(page) || !guest_addr.is_multiple_of(page) {
        return Err(GuestError::new(format!(
            "region {id} at {guest_addr:#x} of {len} bytes is not made of whole 4 KiB pages"
        )));
    }
    let host = region
        .get_host_address(MemoryRegionAddress(0))
        .map_err(|error| {
            GuestError::with_source(format!("region {id} has no host mapping"), error)
        })?;
    let host = NonNull::new(host).ok_or_else(|| GuestError::new("null host mapping"))?;
    // The destination writes received pages into the mapping: a read-only
    // one (`MmapRegionBuilder::with_mmap_prot`) would fault instead of failing.
    let read_write = libc::PROT_READ | libc::PROT_WRITE;
    if region.prot() & read_write != read_write {
        return Err(GuestError::new(format!(
            "region {id} at {guest_addr:#x} is not mapped readable and writable"
        )));
    }
    // SAFETY: `host..host + len` is the region's mapping, readable and
    // writable (checked above); `VmMemory` keeps a clone of
    // the memory (sharing the mapping), so it stays mapped while the regions
    // are used; `len` is a non-zero multiple of the page size (checked).
    Ok(unsafe { MemoryRegion::new(id, guest_addr, host, len) })
}

impl<B: Bitmap + Send + Sync + 'static> GuestMemory for VmMemory<B> {
    fn regions(&self) -> &[MemoryRegion] {
        &self.regions
    }
}

/// A dirty log over the `AtomicBitmap`s of a
/// `GuestMemoryMmap<AtomicBitmap>`: each sync moves the bits vm-memory set
/// into tern's bitmaps, word by word, and clears them, atomically per word,
/// so a write racing the sync is either in this sync or in the next.
#[derive(Debug)]
pub struct AtomicBitmapLog {
    memory: GuestMemoryMmap<AtomicBitmap>,
}

impl AtomicBitmapLog {
    /// A log over `memory`'s bitmaps (a clone sharing them). Each bitmap must
    /// track 4 KiB pages, as vm-memory's default does on x86-64.
    pub fn new(memory: &GuestMemoryMmap<AtomicBitmap>) -> GuestResult<Self> {
        for (index, region) in memory.iter().enumerate() {
            let pages = region.len() / PAGE_SIZE as u64;
            let bits = std::ops::Deref::deref(region).bitmap().len() as u64;
            if bits != pages {
                return Err(GuestError::new(format!(
                    "region {index}: its dirty bitmap has {bits} bits for {pages} pages of 4 KiB \
                     (tern tracks 4 KiB pages; build the bitmap with that page size)"
                )));
            }
        }
        Ok(Self {
            memory: memory.clone(),
        })
    }
}

impl DirtyLog for AtomicBitmapLog {
    fn start_dirty_log(&mut self) -> GuestResult<()> {
        // Everything is sent in the first iteration; earlier marks are moot.
        for region in self.memory.iter() {
            std::ops::Deref::deref(region).bitmap().reset();
        }
        Ok(())
    }

    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
        if bitmaps.len() != self.memory.num_regions() {
            return Err(GuestError::new(format!(
                "{} bitmaps for {} regions",
                bitmaps.len(),
                self.memory.num_regions()
            )));
        }
        for (region, bitmap) in self.memory.iter().zip(bitmaps.iter_mut()) {
            let dirty = std::ops::Deref::deref(region).bitmap().get_and_reset();
            for (word, bits) in bitmap.words_mut().iter_mut().zip(dirty) {
                *word |= bits;
            }
        }
        Ok(())
    }

    fn stop_dirty_log(&mut self) -> GuestResult<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestAddress};

    use super::*;

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
        let mut log = AtomicBitmapLog::new(&memory).unwrap();
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

//! Guest RAM as rust-vmm's [`GuestMemoryMmap`], the way an embedding VMM
//! holds it, and the engine's view of it.
//!
//! The RAM is one anonymous mapping at guest address 0, optionally starting
//! from the contents of a memory-image file mapped privately (copy-on-write:
//! the guest's writes never reach the file). For a same-host hand-over
//! (`memory_handover`) it is instead a memfd mapped shared ([`memfd`]),
//! which the destination maps in turn ([`from_handed_file`]). Each region carries an
//! [`AtomicBitmap`] with one bit per tern page: vm-memory marks it on every
//! write the VMM makes through its accessors (loading the test program,
//! [`crate::KvmGuest::write_memory`]), which KVM's dirty log cannot see, and
//! the dirty log ORs it in next to KVM's (see [`crate::dirty`]). The guest's
//! own writes are only in KVM's log.

use std::fs::File;
use std::io::Read;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use tern_engine::{DirtyBitmap, HandedFile, MemoryRegion, PAGE_SIZE, RegionFile};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap, MmapRegion,
};

use crate::{Result, VmmError};

/// Guest RAM: vm-memory regions whose bitmaps record the VMM's own writes.
pub type GuestRam = GuestMemoryMmap<AtomicBitmap>;

/// One region of [`GuestRam`].
pub type RamRegion = GuestRegionMmap<AtomicBitmap>;

/// Maps `len` bytes of zeroed anonymous memory at guest address 0.
pub fn anonymous(len: u64) -> Result<GuestRam> {
    into_ram(anonymous_mapping(len)?, len)
}

/// Maps `len` bytes at guest address 0 whose start holds the contents of
/// `image`, mapped with `MAP_PRIVATE`: pages are read from the file on first
/// touch and copied on write, so the file is never modified. Past the end of
/// the file (when it is shorter than `len`) memory is zero; a longer file is
/// used up to `len`.
pub fn from_image(len: u64, image: &Path) -> Result<GuestRam> {
    let image_error = |source| VmmError::Image {
        path: image.display().to_string(),
        source,
    };
    let file = File::open(image).map_err(image_error)?;
    let file_len = file.metadata().map_err(image_error)?.len();
    let mapping = anonymous_mapping(len)?;
    // A file mapping of the whole RAM would fault (SIGBUS) past the end of a
    // shorter file, so the file covers only the start of the anonymous
    // mapping; vm-memory builds no such layered mapping itself.
    let mapped = file_len
        .min(len)
        .next_multiple_of(PAGE_SIZE as u64)
        .min(len);
    // At most `len`, which the anonymous mapping above holds.
    #[expect(
        clippy::cast_possible_truncation,
        reason = "at most the mapping's length"
    )]
    let mapped_len = mapped as usize;
    if mapped > 0 {
        // SAFETY: MAP_FIXED replaces the first `mapped` bytes of the
        // anonymous mapping built just above (`mapped <= len`), which
        // nothing refers to yet; `MmapRegion` unmaps the whole range on drop,
        // file pages included. Bytes of the last page past the end of the
        // file read as zero, and no page lies wholly past it.
        let ptr = unsafe {
            libc::mmap(
                mapping.as_ptr().cast(),
                mapped_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(image_error(std::io::Error::last_os_error()));
        }
    }
    into_ram(mapping, len)
}

/// Maps `len` bytes of zeroed memory at guest address 0 that live in a new
/// memfd (close-on-exec, sealable), mapped shared: the memory a same-host
/// hand-over passes to the destination. With `image`, the memfd starts
/// with the image's contents (at most `len` bytes of it); the image file
/// itself is never written.
pub fn memfd(len: u64, image: Option<&Path>) -> Result<GuestRam> {
    let size = checked_size(len)?;
    let mmap_error = |error: std::io::Error| VmmError::Mmap {
        bytes: len,
        source: Box::new(error),
    };
    // SAFETY: a NUL-terminated name and plain flags; the result is checked.
    let raw = unsafe {
        libc::memfd_create(
            c"tern-vmm guest RAM".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(mmap_error(std::io::Error::last_os_error()));
    }
    // SAFETY: memfd_create returned a new descriptor that nothing else owns.
    let mut file = File::from(unsafe { OwnedFd::from_raw_fd(raw) });
    file.set_len(len).map_err(mmap_error)?;
    if let Some(image) = image {
        let image_error = |source| VmmError::Image {
            path: image.display().to_string(),
            source,
        };
        let source = File::open(image).map_err(image_error)?;
        std::io::copy(&mut source.take(len), &mut file).map_err(image_error)?;
    }
    let mapping = shared_mapping(size, FileOffset::new(file, 0), len)?;
    into_ram(mapping, len)
}

/// Maps the file a same-host source handed over for its one region, shared,
/// at guest address 0: the destination's RAM is the source's memory.
pub fn from_handed_file(handed: HandedFile) -> Result<GuestRam> {
    let size = checked_size(handed.len)?;
    if handed.guest_addr != 0 {
        return Err(VmmError::Config(format!(
            "the handed-over region starts at guest address {:#x}; this VMM's RAM starts at 0",
            handed.guest_addr
        )));
    }
    let file = FileOffset::from_arc(Arc::new(File::from(handed.file)), handed.offset);
    into_ram(shared_mapping(size, file, handed.len)?, handed.len)
}

/// `size` bytes of `file` from its offset, mapped shared, with a dirty
/// bitmap of tern pages as [`anonymous_mapping`]'s.
fn shared_mapping(size: usize, file: FileOffset, len: u64) -> Result<MmapRegion<AtomicBitmap>> {
    let page = NonZeroUsize::new(PAGE_SIZE).expect("PAGE_SIZE is not zero");
    MmapRegionBuilder::new_with_bitmap(size, AtomicBitmap::new(size, page))
        .with_file_offset(file)
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
        .build()
        .map_err(|error| VmmError::Mmap {
            bytes: len,
            source: Box::new(error),
        })
}

/// The files behind `ram`'s regions, numbered as [`engine_regions`] numbers
/// them; `None` when any region is anonymous memory.
pub(crate) fn region_files(ram: &GuestRam) -> Option<Vec<RegionFile<'_>>> {
    ram.iter()
        .zip(0..)
        .map(|(region, id)| {
            let file = region.file_offset()?;
            Some(RegionFile::new(id, file.file().as_fd(), file.start()))
        })
        .collect()
}

fn anonymous_mapping(len: u64) -> Result<MmapRegion<AtomicBitmap>> {
    let size = checked_size(len)?;
    // The bitmap's page is tern's page, so its words are laid out as a
    // `DirtyBitmap`'s whatever the host's page size.
    let page = NonZeroUsize::new(PAGE_SIZE).expect("PAGE_SIZE is not zero");
    MmapRegionBuilder::new_with_bitmap(size, AtomicBitmap::new(size, page))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE)
        .build()
        .map_err(|error| VmmError::Mmap {
            bytes: len,
            source: Box::new(error),
        })
}

fn into_ram(mapping: MmapRegion<AtomicBitmap>, len: u64) -> Result<GuestRam> {
    let mmap_error = |error: Box<dyn std::error::Error + Send + Sync>| VmmError::Mmap {
        bytes: len,
        source: error,
    };
    let region = GuestRegionMmap::new(mapping, GuestAddress(0))
        .ok_or_else(|| mmap_error("the region overflows the guest address space".into()))?;
    GuestMemoryMmap::from_regions(vec![region]).map_err(|error| mmap_error(Box::new(error)))
}

fn checked_size(len: u64) -> Result<usize> {
    if len == 0 || !len.is_multiple_of(PAGE_SIZE as u64) {
        return Err(VmmError::Config(format!(
            "memory size {len} is not a non-zero multiple of {PAGE_SIZE}"
        )));
    }
    usize::try_from(len)
        .map_err(|_| VmmError::Config(format!("memory size {len} is too large for this host")))
}

/// The engine's regions over `ram`: one per vm-memory region, numbered in
/// guest-address order.
///
/// # Safety
/// The regions must not be used after `ram` (its last clone) is dropped.
pub(crate) unsafe fn engine_regions(ram: &GuestRam) -> Vec<MemoryRegion> {
    ram.iter()
        .zip(0..)
        .map(|(region, id)| {
            let host = NonNull::new(region.as_ptr()).expect("a mapping never starts at address 0");
            // SAFETY: a vm-memory mapping is readable and writable (built
            // above), a non-zero multiple of the page size long
            // (`checked_size`), and stays mapped as long as `ram`, which the
            // caller promised outlives the regions.
            unsafe { MemoryRegion::new(id, region.start_addr().0, host, region.len()) }
        })
        .collect()
}

/// ORs the pages the VMM wrote through vm-memory since the last call into
/// `bitmap`, and forgets them.
pub(crate) fn take_vmm_writes(region: &RamRegion, bitmap: &mut DirtyBitmap) {
    let written: &MmapRegion<AtomicBitmap> = region;
    for (mine, theirs) in bitmap
        .words_mut()
        .iter_mut()
        .zip(written.bitmap().get_and_reset())
    {
        *mine |= theirs;
    }
}

/// Forgets the pages the VMM wrote so far (the first pass sends them all).
pub(crate) fn forget_vmm_writes(region: &RamRegion) {
    let written: &MmapRegion<AtomicBitmap> = region;
    written.bitmap().reset();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::atomic::Ordering;
    use vm_memory::Bytes;

    fn byte(ram: &GuestRam, addr: u64) -> u8 {
        ram.load(GuestAddress(addr), Ordering::Relaxed).unwrap()
    }

    #[test]
    fn image_is_mapped_privately() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        let content: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
        file.write_all(&content).unwrap();
        let ram = from_image(4 * PAGE_SIZE as u64, file.path()).unwrap();
        assert_eq!(byte(&ram, 5000), content[5000]);
        assert_eq!(byte(&ram, 7000), 0, "past the end of the file is zero");
        assert_eq!(byte(&ram, 3 * PAGE_SIZE as u64), 0);
        ram.write_slice(&[0xAA; 16], GuestAddress(0)).unwrap();
        assert_eq!(byte(&ram, 0), 0xAA);
        drop(ram);
        assert_eq!(
            std::fs::read(file.path()).unwrap(),
            content,
            "file untouched"
        );
    }

    #[test]
    fn memfd_ram_is_a_shared_file_starting_from_the_image() {
        let mut image = tempfile::NamedTempFile::new().unwrap();
        let content: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
        image.write_all(&content).unwrap();
        let ram = memfd(4 * PAGE_SIZE as u64, Some(image.path())).unwrap();
        assert_eq!(byte(&ram, 5000), content[5000]);
        assert_eq!(byte(&ram, 7000), 0, "past the end of the image is zero");
        ram.write_slice(&[0xAA; 16], GuestAddress(0)).unwrap();
        let files = region_files(&ram).expect("a memfd backs the RAM");
        let [file] = &files[..] else {
            panic!("one region, one file: {files:?}")
        };
        assert_eq!((file.region_id, file.offset), (0, 0));
        // The guest's writes are in the file (shared), not in the image.
        let mut first = [0u8; 16];
        // SAFETY: an open descriptor and a 16-byte buffer.
        let read = unsafe { libc::pread(file.file.as_raw_fd(), first.as_mut_ptr().cast(), 16, 0) };
        assert_eq!(read, 16);
        assert_eq!(first, [0xAA; 16]);
        assert_eq!(
            std::fs::read(image.path()).unwrap(),
            content,
            "image untouched"
        );
        assert!(region_files(&anonymous(PAGE_SIZE as u64).unwrap()).is_none());
    }

    #[test]
    fn rejects_unaligned_sizes() {
        assert!(anonymous(1000).is_err());
        assert!(anonymous(0).is_err());
    }

    #[test]
    fn vmm_writes_reach_the_dirty_bitmap_once() {
        let pages = 200;
        let ram = anonymous(pages * PAGE_SIZE as u64).unwrap();
        let region = ram.iter().next().unwrap();
        ram.write_slice(&[1; 8], GuestAddress(0)).unwrap();
        forget_vmm_writes(region);
        // Across a page boundary, and a page in the second word.
        ram.write_slice(&[2; 8], GuestAddress(5 * PAGE_SIZE as u64 - 4))
            .unwrap();
        ram.write_slice(&[3], GuestAddress(130 * PAGE_SIZE as u64))
            .unwrap();
        let mut bitmap = DirtyBitmap::new(pages);
        take_vmm_writes(region, &mut bitmap);
        assert_eq!(bitmap.iter_dirty().collect::<Vec<_>>(), [4, 5, 130]);
        let mut again = DirtyBitmap::new(pages);
        take_vmm_writes(region, &mut again);
        assert_eq!(again.count(), 0, "taken writes are forgotten");
    }
}

//! Same-host migration by memory hand-over: what source and destination
//! share (docs/embedding.md, "Same-host hand-over").
//!
//! When both processes run on one host (a VMM upgrade), guest memory need
//! not move: the source passes the files that back it (memfd, hugetlbfs,
//! tmpfs) as descriptors over the main Unix channel, the destination maps
//! them, and only the device state travels while the guest is paused. This
//! file holds the checks both sides run on those files, the switch-over
//! digest of a hand-over, and what the source does with its own mapping
//! once the destination runs the guest.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use tern_wire::{HANDOVER_SAMPLE_PAGES, HandoverCoverage};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::guest::{MemoryRegion, PAGE_SIZE};

/// One region's file as the destination received it, checked: a regular
/// file (memfd, hugetlbfs, tmpfs) at least `offset + len` bytes long that
/// may be written. The VMM maps it `MAP_SHARED` at the region.
#[derive(Debug)]
#[non_exhaustive]
pub struct HandedFile {
    /// The region's id, as in the session setup.
    pub region_id: u32,
    /// The region's guest-physical address, as in the session setup.
    pub guest_addr: u64,
    /// The region's length in bytes.
    pub len: u64,
    /// Where the region starts in the file.
    pub offset: u64,
    /// The file, close-on-exec, owned by this process now.
    pub file: OwnedFd,
}

/// Why a file cannot back a region, in words for an error: `None` when it
/// can. A hand-over file must be a regular file (a socket, pipe or device
/// is refused), hold `offset + len` bytes, and not be sealed against
/// writes (the guest writes it).
pub(crate) fn file_problem(file: BorrowedFd<'_>, offset: u64, len: u64) -> Option<String> {
    // SAFETY: an all-zero stat is a valid buffer for fstat to fill.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `file` is an open descriptor and `stat` is writable.
    if unsafe { libc::fstat(file.as_raw_fd(), &raw mut stat) } != 0 {
        return Some(format!(
            "cannot inspect it: {}",
            std::io::Error::last_os_error()
        ));
    }
    if stat.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Some("it is not a regular file (a memfd, hugetlbfs or tmpfs file)".into());
    }
    let size = u64::try_from(stat.st_size).unwrap_or(0);
    let needed = offset.saturating_add(len);
    if size < needed {
        return Some(format!(
            "it has {size} bytes; the region needs {needed} (offset {offset} + {len})"
        ));
    }
    // SAFETY: F_GET_SEALS reads flags of an open descriptor; a file that
    // cannot be sealed answers EINVAL, which means no seals.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals > 0 && seals & (libc::F_SEAL_WRITE | libc::F_SEAL_FUTURE_WRITE) != 0 {
        return Some("it is sealed against writes (F_SEAL_WRITE)".into());
    }
    None
}

/// The switch-over digest of a hand-over: XXH3-128 over, for each region
/// in order, its id, then each covered page's index and XXH3-64. Both
/// sides read the same pages of the same files, so it shows that the
/// destination mapped every file at its region; sampling keeps it out of
/// the downtime's way (1024 pages of a region cost microseconds).
///
/// # Safety
/// The regions must be mapped; nothing may write them during the call
/// (the guest is paused).
pub(crate) unsafe fn digest(regions: &[MemoryRegion], coverage: HandoverCoverage) -> u128 {
    let mut hasher = Xxh3::new();
    for region in regions {
        hasher.update(&region.id().to_le_bytes());
        let pages = region.pages();
        let covered = match coverage {
            HandoverCoverage::All => pages,
            HandoverCoverage::Sampled => pages.min(HANDOVER_SAMPLE_PAGES),
        };
        for step in 0..covered {
            // Evenly spread, first and last page included.
            let page = if covered < 2 {
                0
            } else {
                step * (pages - 1) / (covered - 1)
            };
            let Some(ptr) = region.page_ptr(page) else {
                continue;
            };
            // SAFETY: `page_ptr` bounds-checked the page; the caller
            // guarantees the mapping and that nothing writes it.
            let bytes = unsafe { std::slice::from_raw_parts(ptr, PAGE_SIZE) };
            hasher.update(&page.to_le_bytes());
            hasher.update(&xxh3_64(bytes).to_le_bytes());
        }
    }
    hasher.digest128()
}

/// After the destination resumed the guest on the handed-over files, the
/// source's mapping of them is the same memory: a vCPU or device thread of
/// the source that the VMM failed to stop would write the running guest.
/// The source's regions are therefore made inaccessible (`PROT_NONE`):
/// such a write faults in the source instead. The VMM may still unmap
/// them (or exit); it must never resume its guest.
pub(crate) fn revoke(regions: &[MemoryRegion]) {
    for region in regions {
        let Ok(len) = usize::try_from(region.len()) else {
            continue;
        };
        // SAFETY: the region describes a live mapping of `len` bytes (the
        // `MemoryRegion::new` contract); removing access changes no memory.
        let status = unsafe { libc::mprotect(region.host_ptr().cast(), len, libc::PROT_NONE) };
        if status != 0 {
            tracing::error!(
                region = region.id(),
                error = %std::io::Error::last_os_error(),
                "cannot revoke the source's access to handed-over memory"
            );
        }
    }
}

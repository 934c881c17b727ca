//! Guest memory for the destination's unit tests: a private anonymous
//! mapping of whole pages, so first touches, residency and userfaultfd
//! registration behave as they do on a real guest's memory.

use std::ptr::NonNull;

use tern_wire::{DigestAlgorithm, RegionInfo, SessionSetup};

use crate::guest::{MemoryRegion, PAGE_SIZE};

/// A private anonymous mapping, unmapped on drop.
pub(crate) struct AnonymousMemory {
    pub(crate) base: *mut u8,
    pub(crate) len: usize,
}

impl AnonymousMemory {
    /// `pages` pages, none touched yet.
    pub(crate) fn new(pages: usize) -> Self {
        let len = pages * PAGE_SIZE;
        // SAFETY: a new private anonymous mapping, unmapped in `drop`.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        Self {
            base: base.cast(),
            len,
        }
    }

    /// The whole mapping as region `id`.
    pub(crate) fn region(&self, id: u32) -> MemoryRegion {
        // SAFETY: the mapping outlives every region a test makes of it.
        unsafe { MemoryRegion::new(id, 0, NonNull::new(self.base).unwrap(), self.len as u64) }
    }

    /// A one-channel session's setup whose one region, `id`, is this
    /// whole mapping.
    pub(crate) fn setup(&self, id: u32) -> SessionSetup {
        one_region_setup(id, self.len as u64)
    }

    /// Page `index`, which must be readable now.
    pub(crate) fn page(&self, index: usize) -> &[u8] {
        // SAFETY: a page inside the mapping.
        unsafe { std::slice::from_raw_parts(self.base.add(index * PAGE_SIZE), PAGE_SIZE) }
    }

    /// Every byte, for a test that has the mapping to itself.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the whole mapping, borrowed mutably with `self`.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }
}

impl Drop for AnonymousMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer used.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// A one-channel session's setup with one region, `id`, of `len` bytes,
/// without digest, codecs or dictionaries.
pub(crate) fn one_region_setup(id: u32, len: u64) -> SessionSetup {
    SessionSetup {
        page_size: tern_wire::PAGE_SIZE,
        channel_count: 1,
        codecs: 0,
        digest: DigestAlgorithm::None,
        regions: vec![RegionInfo {
            id,
            guest_addr: 0,
            len,
        }],
        guest_kind: String::new(),
        dictionaries: 0,
        vmm_config_len: 0,
    }
}

//! The anonymous mapping that backs guest memory.

use std::io;
use std::ptr::{self, NonNull};

/// An anonymous, private, `MAP_NORESERVE` mapping, unmapped on drop.
///
/// Guest memory is written by dirtier threads and read by the engine at the
/// same time, so this type never hands out Rust references to its bytes: all
/// access goes through [`Mapping::ptr`] and raw-pointer operations.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain process memory owned by this value; it is only
// accessed through raw pointers whose users accept concurrent (possibly torn)
// access, and it is unmapped exactly once, in `Drop`.
unsafe impl Send for Mapping {}
// SAFETY: see `Send` above; `&Mapping` only exposes the address and length.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes (non-zero) of zeroed memory. `MAP_NORESERVE` so a
    /// large guest that is mostly zero pages costs no commit charge. No
    /// `MADV_HUGEPAGE`: a huge page backs 2 MiB at the first write, so zero
    /// pages would no longer stay untouched, and on the KVM guests we run on
    /// a huge-page fault measured 8-9 µs per 4 KiB against 1.5-5 µs for a
    /// plain page fault (see docs/benchmarks.md).
    pub(crate) fn new(len: usize) -> io::Result<Self> {
        // SAFETY: an anonymous mapping with a null hint touches no existing
        // memory; the result is checked against MAP_FAILED below.
        let addr = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(addr.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Self { ptr, len })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn non_null(&self) -> NonNull<u8> {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr + len` is the mapping created in `new`, unmapped
        // only here. Every user (regions, dirtier threads) holds the mapping
        // through the owning guest or an `Arc`, so none outlives it.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

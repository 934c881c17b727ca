//! The anonymous mapping that backs guest memory.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::{self, NonNull};

/// An anonymous, private, `MAP_NORESERVE` mapping, or a shared mapping of
/// a file (a memfd this guest created, or one handed over by a source),
/// unmapped on drop.
///
/// Guest memory is written by dirtier threads and read by the engine at the
/// same time, so this type never hands out Rust references to its bytes: all
/// access goes through [`Mapping::ptr`] and raw-pointer operations.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// The file mapped and where the mapping starts in it; `None` for
    /// anonymous memory.
    file: Option<(OwnedFd, u64)>,
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
        Self::from_address(addr, len, None)
    }

    /// Maps `len` bytes (non-zero) of a new memfd, shared: memory another
    /// process can be handed (same-host migration by hand-over). Zero until
    /// written, like [`Mapping::new`].
    pub(crate) fn new_memfd(len: usize) -> io::Result<Self> {
        // SAFETY: the name is a NUL-terminated string; the result is
        // checked below.
        let raw = unsafe { libc::memfd_create(c"tern-synthetic".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor memfd_create just returned, owned
        // by nothing else.
        let file = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len).map_err(|_| io::Error::other("too large"))?;
        // SAFETY: sizing an open memfd has no memory effects.
        if unsafe { libc::ftruncate(file.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Self::map_file(file, 0, len)
    }

    /// Maps `len` bytes (non-zero) of `file` from `offset` on, shared.
    pub(crate) fn map_file(file: OwnedFd, offset: u64, len: usize) -> io::Result<Self> {
        let at = libc::off_t::try_from(offset).map_err(|_| io::Error::other("offset too large"))?;
        // SAFETY: a shared mapping of an open file with a null hint touches
        // no existing memory; the result is checked against MAP_FAILED.
        let addr = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                at,
            )
        };
        Self::from_address(addr, len, Some((file, offset)))
    }

    fn from_address(
        addr: *mut libc::c_void,
        len: usize,
        file: Option<(OwnedFd, u64)>,
    ) -> io::Result<Self> {
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(addr.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Self { ptr, len, file })
    }

    /// The file mapped and the mapping's offset in it, if any.
    pub(crate) fn file(&self) -> Option<(BorrowedFd<'_>, u64)> {
        use std::os::fd::AsFd;
        self.file
            .as_ref()
            .map(|(file, offset)| (file.as_fd(), *offset))
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

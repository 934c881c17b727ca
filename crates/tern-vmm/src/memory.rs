//! Guest RAM: an anonymous mapping, optionally starting from the contents of
//! a memory-image file mapped privately (copy-on-write: the guest's writes
//! never reach the file).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;

use tern_engine::PAGE_SIZE;

use crate::{Result, VmmError};

/// One mapping of guest RAM, unmapped on drop.
#[derive(Debug)]
pub struct GuestRam {
    ptr: NonNull<u8>,
    len: u64,
}

// SAFETY: the mapping is plain memory owned by this value; every access goes
// through raw pointers (the vCPU writes it concurrently anyway), so moving or
// sharing the owner between threads is sound.
unsafe impl Send for GuestRam {}
// SAFETY: see `Send`; `GuestRam` has no interior state besides the mapping.
unsafe impl Sync for GuestRam {}

impl GuestRam {
    /// Maps `len` bytes of zeroed anonymous memory.
    pub fn anonymous(len: u64) -> Result<Self> {
        let size = checked_size(len)?;
        // SAFETY: a fresh anonymous mapping at an address of the kernel's
        // choosing; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(VmmError::Mmap {
                bytes: len,
                source: std::io::Error::last_os_error(),
            });
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| VmmError::Mmap {
            bytes: len,
            source: std::io::Error::other("mmap returned null"),
        })?;
        Ok(Self { ptr, len })
    }

    /// Maps `len` bytes whose start holds the contents of `image`, mapped
    /// with `MAP_PRIVATE`: pages are read from the file on first touch and
    /// copied on write, so the file is never modified. Past the end of the
    /// file (when it is shorter than `len`) memory is zero; a longer file is
    /// used up to `len`.
    pub fn from_image(len: u64, image: &Path) -> Result<Self> {
        let image_error = |source| VmmError::Image {
            path: image.display().to_string(),
            source,
        };
        let file = File::open(image).map_err(image_error)?;
        let file_len = file.metadata().map_err(image_error)?.len();
        let ram = Self::anonymous(len)?;
        let mapped = file_len
            .min(len)
            .next_multiple_of(PAGE_SIZE as u64)
            .min(len);
        if mapped > 0 {
            // SAFETY: MAP_FIXED replaces the first `mapped` bytes of the
            // anonymous mapping this function owns (`mapped <= len`); nothing
            // refers to that memory yet. Bytes of the last page past the end
            // of the file read as zero, and no page lies wholly past it.
            let ptr = unsafe {
                libc::mmap(
                    ram.ptr.as_ptr().cast(),
                    checked_size(mapped)?,
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
        Ok(ram)
    }

    /// Host address of the first byte.
    pub fn host_ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never true; for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `bytes` into guest memory at guest offset `offset`.
    ///
    /// # Panics
    /// When the range lies outside the mapping.
    pub fn write(&self, offset: u64, bytes: &[u8]) {
        let end = offset + bytes.len() as u64;
        assert!(end <= self.len, "write of {offset:#x}..{end:#x} past RAM");
        // SAFETY: the range is inside the mapping (checked above); the guest
        // may run concurrently, so no reference is formed, only a raw copy.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.ptr.as_ptr().add(offset as usize),
                bytes.len(),
            );
        }
    }

    /// Reads one byte at guest offset `offset` (volatile: the guest may be
    /// writing it).
    ///
    /// # Panics
    /// When the offset lies outside the mapping.
    pub fn read_u8(&self, offset: u64) -> u8 {
        assert!(offset < self.len, "read at {offset:#x} past RAM");
        // SAFETY: inside the mapping (checked above); a volatile read of one
        // byte tolerates concurrent writes by the vCPU.
        unsafe { self.ptr.as_ptr().add(offset as usize).read_volatile() }
    }

    /// Reads a little-endian `u32` at guest offset `offset`, which must be
    /// 4-byte aligned (the read is then a single, untorn load).
    ///
    /// # Panics
    /// When the offset is unaligned or outside the mapping.
    pub fn read_u32(&self, offset: u64) -> u32 {
        assert!(offset.is_multiple_of(4) && offset + 4 <= self.len);
        // SAFETY: inside the mapping and aligned (checked above; the mapping
        // is page aligned); volatile because the vCPU writes it.
        unsafe {
            self.ptr
                .as_ptr()
                .add(offset as usize)
                .cast::<u32>()
                .read_volatile()
        }
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by this value with this length and
        // nothing uses it any more (the VM and the regions handed out are
        // dropped before the memory, see `KvmGuest`).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len as usize);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn image_is_mapped_privately() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        let content: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
        file.write_all(&content).unwrap();
        let ram = GuestRam::from_image(4 * PAGE_SIZE as u64, file.path()).unwrap();
        assert_eq!(ram.read_u8(5000), content[5000]);
        assert_eq!(ram.read_u8(7000), 0, "past the end of the file is zero");
        assert_eq!(ram.read_u8(3 * PAGE_SIZE as u64), 0);
        ram.write(0, &[0xAA; 16]);
        assert_eq!(ram.read_u8(0), 0xAA);
        drop(ram);
        assert_eq!(
            std::fs::read(file.path()).unwrap(),
            content,
            "file untouched"
        );
    }

    #[test]
    fn rejects_unaligned_sizes() {
        assert!(GuestRam::anonymous(1000).is_err());
        assert!(GuestRam::anonymous(0).is_err());
    }
}

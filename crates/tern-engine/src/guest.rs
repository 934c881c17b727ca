//! The traits a VMM implements so tern can migrate its guest.
//!
//! The engine knows nothing of KVM or of any particular VMM. A VMM hands it
//! memory regions ([`GuestMemory`]), a dirty log ([`DirtyLog`]), control over
//! the guest's execution ([`GuestControl`]) and its device state as opaque,
//! named, versioned blobs ([`DeviceState`]).
//!
//! Guest memory is shared with running vCPUs (or, for the synthetic guest,
//! dirtier threads) that write it concurrently. The engine therefore never
//! forms Rust references into guest memory: it reads and writes through raw
//! pointers and system calls only, the same discipline as rust-vmm's
//! `VolatileSlice`. A page read while it is being written may be torn; that is
//! harmless because the write marks the page dirty and it is sent again.

use std::fmt;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;

use crate::bitmap::DirtyBitmap;

/// Size of the pages tern tracks and transfers, as the protocol defines it
/// ([`tern_wire::PAGE_SIZE`]).
pub const PAGE_SIZE: usize = tern_wire::PAGE_SIZE as usize;

/// An error reported by a VMM's implementation of the guest traits.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct GuestError {
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl GuestError {
    /// An error with a message only.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
        }
    }

    /// An error with a message and the underlying cause.
    pub fn with_source(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }
}

/// Result of a guest-trait call.
pub type GuestResult<T> = Result<T, GuestError>;

/// One contiguous range of guest RAM, mapped in this process.
#[derive(Clone, Copy)]
pub struct MemoryRegion {
    id: u32,
    guest_addr: u64,
    host_addr: NonNull<u8>,
    len: u64,
}

// SAFETY: a region is a description of a mapping (address and length). The
// creator of the region promised (see `MemoryRegion::new`) that the mapping
// stays valid while the region is in use; the engine only accesses it through
// raw pointers and system calls, so sharing the description across threads is
// sound.
unsafe impl Send for MemoryRegion {}
// SAFETY: see the `Send` implementation above; the type has no interior state.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Describes a region of guest memory mapped at `host_addr`.
    ///
    /// # Safety
    /// `host_addr..host_addr + len` must be a readable and writable mapping
    /// that stays mapped for as long as any copy of this region is used by
    /// the engine (in practice: as long as the [`GuestMemory`] that returned
    /// it lives). `len` must be a non-zero multiple of [`PAGE_SIZE`].
    pub unsafe fn new(id: u32, guest_addr: u64, host_addr: NonNull<u8>, len: u64) -> Self {
        debug_assert!(len > 0 && len.is_multiple_of(PAGE_SIZE as u64));
        Self {
            id,
            guest_addr,
            host_addr,
            len,
        }
    }

    /// The VMM's identifier for this region, agreed with the destination.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Guest-physical address of the first byte.
    pub fn guest_addr(&self) -> u64 {
        self.guest_addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Regions are never empty; provided for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of pages in the region.
    pub fn pages(&self) -> u64 {
        self.len / PAGE_SIZE as u64
    }

    /// Host pointer to the first byte of page `page_index`, or `None` when the
    /// index lies outside the region. This is the only way the engine turns a
    /// page index into an address, so every access is bounds-checked here.
    pub fn page_ptr(&self, page_index: u64) -> Option<*mut u8> {
        if page_index >= self.pages() {
            return None;
        }
        let offset = usize::try_from(page_index * PAGE_SIZE as u64).ok()?;
        // SAFETY: `offset` is below `len`, so the result stays inside the
        // mapping promised by `new`.
        Some(unsafe { self.host_addr.as_ptr().add(offset) })
    }

    /// Host pointer to the first byte of the region.
    pub fn host_ptr(&self) -> *mut u8 {
        self.host_addr.as_ptr()
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("id", &self.id)
            .field("guest_addr", &format_args!("{:#x}", self.guest_addr))
            .field("len", &self.len)
            .finish()
    }
}

/// The file that backs one region, for a same-host hand-over
/// ([`crate::MigrationConfig::memory_handover`]): the region is `file`
/// mapped shared from `offset` on.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct RegionFile<'a> {
    /// The region's id ([`MemoryRegion::id`]).
    pub region_id: u32,
    /// The file (a memfd, a hugetlbfs or tmpfs file), mapped `MAP_SHARED`.
    pub file: BorrowedFd<'a>,
    /// Where the region starts in the file; a multiple of [`PAGE_SIZE`].
    pub offset: u64,
}

impl<'a> RegionFile<'a> {
    /// Region `region_id` is `file` mapped shared from `offset` on.
    pub fn new(region_id: u32, file: BorrowedFd<'a>, offset: u64) -> Self {
        Self {
            region_id,
            file,
            offset,
        }
    }
}

/// The guest's RAM as a list of regions.
pub trait GuestMemory: Send + Sync {
    /// The regions, in a stable order. Their ids are unique.
    fn regions(&self) -> &[MemoryRegion];

    /// The files backing the regions, one per region, for a same-host
    /// hand-over: the source passes them to the destination instead of
    /// copying pages. The default, `None`, means memory is not backed by
    /// files this process can pass (anonymous memory); a hand-over is then
    /// refused before anything connects.
    fn region_files(&self) -> Option<Vec<RegionFile<'_>>> {
        None
    }
}

/// Dirty-page tracking.
pub trait DirtyLog: Send {
    /// Starts tracking writes. Pages written after this call are reported by
    /// the next [`DirtyLog::sync_dirty_log`].
    fn start_dirty_log(&mut self) -> GuestResult<()>;

    /// Adds the pages written since the previous sync (or since
    /// [`DirtyLog::start_dirty_log`]) to `bitmaps`, one bitmap per region in
    /// the order of [`GuestMemory::regions`], and resets the log.
    ///
    /// A page must be reported if any write to it may have landed after the
    /// previous sync returned.
    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()>;

    /// Stops tracking writes.
    fn stop_dirty_log(&mut self) -> GuestResult<()>;
}

/// Control over guest execution.
pub trait GuestControl: Send {
    /// Stops the guest from running (and so from writing memory). Returns once
    /// no write is in flight.
    fn pause(&mut self) -> GuestResult<()>;

    /// Lets the guest run again.
    fn resume(&mut self) -> GuestResult<()>;

    /// Slows the guest down so it dirties memory more slowly: `percent` of its
    /// time is taken away (0 = full speed, 99 = nearly stopped).
    fn set_throttle(&mut self, percent: u8) -> GuestResult<()>;
}

/// A named, versioned, opaque piece of device or vCPU state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateSection {
    /// Unique name, such as `"vcpu0"` or `"serial"`.
    pub name: String,
    /// Version of the blob's layout, checked by the destination.
    pub version: u32,
    /// The saved state.
    pub data: Vec<u8>,
}

/// Saving and restoring device and vCPU state at switch-over.
pub trait DeviceState: Send {
    /// Saves all state sections. Called while the guest is paused.
    fn save_state(&mut self) -> GuestResult<Vec<StateSection>>;

    /// Restores the sections saved by the source, before the destination
    /// resumes the guest.
    fn restore_state(&mut self, sections: &[StateSection]) -> GuestResult<()>;

    /// About how many bytes [`DeviceState::save_state`] will return, asked
    /// while the guest runs: the source counts sending them in the downtime
    /// it expects, so a large device state delays the switch-over instead
    /// of breaking the downtime limit. The default, 0, means small or
    /// unknown.
    fn state_size_hint(&self) -> u64 {
        0
    }

    /// What kind of guest this is, in words that read well in an error
    /// ("the destination expects a synthetic guest"): guests of one kind can
    /// restore each other's state sections. The source announces it in its
    /// hello, and a destination of another kind refuses the session before
    /// any page moves instead of failing at restore. Printable ASCII, at
    /// most [`tern_wire::MAX_GUEST_KIND_LEN`] bytes. The default, empty,
    /// means the VMM does not say; the kinds are then not compared.
    fn guest_kind(&self) -> &str {
        ""
    }
}

/// Everything the source side needs from a VMM.
pub trait SourceGuest: GuestMemory + DirtyLog + GuestControl + DeviceState {}
impl<T: GuestMemory + DirtyLog + GuestControl + DeviceState> SourceGuest for T {}

/// Everything the destination side needs from a VMM.
pub trait DestinationGuest: GuestMemory + GuestControl + DeviceState {}
impl<T: GuestMemory + GuestControl + DeviceState> DestinationGuest for T {}

//! The hand-written userfaultfd wrapper shared by the destination's
//! `UFFDIO_COPY` placement and the fault service (`fault/`): registration
//! for missing pages, copies and zero pages placed atomically, events read
//! and faulting threads woken.
//!
//! The destination places fresh pages whole with `UFFDIO_COPY` instead of
//! faulting them in: a page that has never held data is read from the
//! socket into a bounce buffer, then one `UFFDIO_COPY` per run of
//! contiguous pages allocates each page and fills it with its contents,
//! with no zero-fill and no exception per page.
//!
//! Measured on the 2-core shared VM (`cargo bench -p tern-engine --bench
//! first_touch`, docs/benchmarks.md): the bounce copy plus `UFFDIO_COPY`
//! costs 0.6-0.8x of a first-write fault and copy per page, for runs of
//! one page as for whole packets, where `MADV_POPULATE_WRITE` pays only
//! from runs of 8 (`populate.rs`).
//!
//! The guest's regions are registered for missing pages for the live phase
//! only. While they are, any access to a page no packet has written waits
//! for this process to resolve it. The receivers never touch such a page
//! directly: raw pages go through the bounce buffer, and every other kind
//! of write to a fresh page (a decompression, a duplicate) first has the
//! page placed as zeros ([`Userfault::place_zeros`]), which leaves it as a
//! fault would have. Anything else that touches guest memory meanwhile (the
//! VMM, a test reading the destination's memory) is served by
//! [`Userfault::serve_faults`] on its own thread, which places the page as
//! zeros, what an unregistered first touch finds: nobody waits longer than
//! a system call. The registration ends ([`Userfault::release`])
//! before the receivers are joined, on success as on failure, which also
//! wakes any thread still waiting and stops the serving thread; the
//! descriptor is closed when the session's shared state drops.
//!
//! When the kernel has no userfaultfd for this process (no
//! `/dev/userfaultfd` access and `vm.unprivileged_userfaultfd` = 0, a
//! seccomp filter, memory it cannot register), the destination faults pages
//! in as before.
//!
//! The fault service uses the other half: [`Userfault::copy_missing`] and
//! [`Userfault::zero_missing`] never write a page that is there already
//! (`EEXIST` means another placer won, and its copy is the right one), and
//! [`Userfault::next_event`] reads page faults and `UFFD_EVENT_REMOVE`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::guest::{MemoryRegion, PAGE_SIZE};

/// `ioctl` numbers and structures of `<linux/userfaultfd.h>`, in the
/// generic `_IOC` encoding (x86-64 and aarch64; powerpc, mips and sparc
/// encode directions differently and would need their own numbers).
mod abi {
    pub(super) const USERFAULTFD_IOC_NEW: libc::c_ulong = 0xaa00;
    pub(super) const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
    pub(super) const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
    pub(super) const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_aa01;
    pub(super) const UFFDIO_COPY: libc::c_ulong = 0xc028_aa03;
    pub(super) const UFFDIO_WAKE: libc::c_ulong = 0x8010_aa02;
    pub(super) const UFFDIO_ZEROPAGE: libc::c_ulong = 0xc020_aa04;
    pub(super) const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
    pub(super) const UFFD_EVENT_REMOVE: u8 = 0x15;
    pub(super) const UFFD_API: u64 = 0xaa;
    #[cfg(test)]
    pub(super) const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
    pub(super) const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
    /// The bit of `UFFDIO_COPY` in a registration's `ioctls`.
    pub(super) const NEEDED_IOCTL_BITS: u64 = 1 << 3;

    #[repr(C)]
    pub(super) struct Api {
        pub(super) api: u64,
        pub(super) features: u64,
        pub(super) ioctls: u64,
    }

    #[repr(C)]
    pub(super) struct Range {
        pub(super) start: u64,
        pub(super) len: u64,
    }

    #[repr(C)]
    pub(super) struct Register {
        pub(super) range: Range,
        pub(super) mode: u64,
        pub(super) ioctls: u64,
    }

    /// A `struct uffd_msg` of a page fault: the event, then (after 7
    /// reserved bytes) the fault's flags and address, then its thread id.
    #[repr(C)]
    pub(super) struct Message {
        pub(super) event: u8,
        pub(super) reserved: [u8; 7],
        pub(super) flags: u64,
        pub(super) address: u64,
        pub(super) rest: u64,
    }

    #[repr(C)]
    pub(super) struct ZeroPage {
        pub(super) range: Range,
        pub(super) mode: u64,
        /// Bytes zeroed, or a negated errno when none were.
        pub(super) zeropage: i64,
    }

    #[repr(C)]
    pub(super) struct Copy {
        pub(super) dst: u64,
        pub(super) src: u64,
        pub(super) len: u64,
        pub(super) mode: u64,
        /// Bytes copied, or a negated errno when none were.
        pub(super) copy: i64,
    }
}

/// How often one placement retries a copy the kernel asked to repeat
/// (`EAGAIN` with no progress, `EINTR`) before giving up.
const MAX_RETRIES: usize = 1000;

/// Zeros that fresh pages are placed from, this many pages per call.
static ZEROS: [u8; 16 * PAGE_SIZE] = [0; 16 * PAGE_SIZE];

/// How long the serving thread waits between looks at the release flag,
/// in milliseconds (the release also wakes it at once).
const SERVE_POLL_MS: libc::c_int = 100;

/// A userfaultfd with the guest's regions registered for missing pages.
pub(crate) struct Userfault {
    fd: OwnedFd,
    /// Written on release, to wake [`Userfault::serve_faults`].
    wake: OwnedFd,
    /// Each registered region's start and length.
    ranges: Vec<(u64, u64)>,
    /// Set once the regions are unregistered: copies that fail then fall
    /// back to plain writes, which fault as usual.
    released: AtomicBool,
}

impl Userfault {
    /// Registers every region for missing pages; an error says why this
    /// process cannot (the caller then faults pages in as before).
    pub(crate) fn register(regions: &[MemoryRegion]) -> io::Result<Self> {
        Self::register_with_features(regions, 0)
    }

    /// [`Userfault::register`] asking also for `UFFD_EVENT_REMOVE`, as
    /// Firecracker's descriptors do: a test of the service's handling of
    /// removes needs one in this process.
    #[cfg(test)]
    pub(crate) fn register_reporting_removes(regions: &[MemoryRegion]) -> io::Result<Self> {
        Self::register_with_features(regions, abi::UFFD_FEATURE_EVENT_REMOVE)
    }

    fn register_with_features(regions: &[MemoryRegion], features: u64) -> io::Result<Self> {
        let fd = open()?;
        let mut api = abi::Api {
            api: abi::UFFD_API,
            features,
            ioctls: 0,
        };
        // SAFETY: `api` is the structure UFFDIO_API reads and writes.
        if unsafe { libc::ioctl(fd.as_raw_fd(), abi::UFFDIO_API, &mut api) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut this = Self {
            fd,
            wake: wake_eventfd()?,
            ranges: Vec::with_capacity(regions.len()),
            released: AtomicBool::new(false),
        };
        for region in regions.iter().filter(|region| !region.is_empty()) {
            let range = (region.host_ptr() as u64, region.len());
            let mut register = abi::Register {
                range: abi::Range {
                    start: range.0,
                    len: range.1,
                },
                mode: abi::UFFDIO_REGISTER_MODE_MISSING,
                ioctls: 0,
            };
            // SAFETY: `register` is the structure UFFDIO_REGISTER reads and
            // writes; the range is guest memory this process maps.
            let result =
                unsafe { libc::ioctl(this.fd.as_raw_fd(), abi::UFFDIO_REGISTER, &mut register) };
            if result != 0 {
                // Dropping `this` closes the descriptor, which unregisters
                // the regions registered so far.
                return Err(io::Error::last_os_error());
            }
            this.ranges.push(range);
            if register.ioctls & abi::NEEDED_IOCTL_BITS != abi::NEEDED_IOCTL_BITS {
                return Err(io::Error::other(
                    "UFFDIO_COPY is not offered for this memory",
                ));
            }
        }
        Ok(this)
    }

    /// Whether [`Userfault::release`] has begun: from then on a missing
    /// page may fault in as zeros, so nothing placed since can be trusted.
    pub(crate) fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Ends the registration: from now on a missing page faults in as
    /// usual, and a thread waiting on one is woken. Idempotent.
    pub(crate) fn release(&self) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        for &(start, len) in &self.ranges {
            let mut range = abi::Range { start, len };
            // SAFETY: `range` is the structure UFFDIO_UNREGISTER reads; a
            // failure leaves the registration to the descriptor's close.
            unsafe { libc::ioctl(self.fd.as_raw_fd(), abi::UFFDIO_UNREGISTER, &mut range) };
        }
        let one = 1u64.to_ne_bytes();
        // SAFETY: eight readable bytes, what an eventfd write takes; a full
        // counter (impossible here) only leaves the thread to its poll.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Serves the page faults of anyone but the receivers until the release:
    /// each missing page touched is mapped as zeros, what a first touch of
    /// unregistered memory finds. Run on a thread of its own for the live
    /// phase.
    pub(crate) fn serve_faults(&self) {
        let mut fds = [
            libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        while !self.released.load(Ordering::Acquire) {
            // SAFETY: two valid pollfd structures.
            let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, SERVE_POLL_MS) };
            if ready > 0 && fds[0].revents & libc::POLLIN != 0 {
                self.serve_pending();
            }
        }
    }

    /// Serves every fault waiting now (the descriptor does not block).
    fn serve_pending(&self) {
        loop {
            let mut message = std::mem::MaybeUninit::<abi::Message>::zeroed();
            let size = std::mem::size_of::<abi::Message>();
            // SAFETY: `message` has room for one `uffd_msg`.
            let read =
                unsafe { libc::read(self.fd.as_raw_fd(), message.as_mut_ptr().cast(), size) };
            if usize::try_from(read) != Ok(size) {
                return;
            }
            // SAFETY: the kernel wrote a whole message; every bit pattern
            // is a valid `Message`.
            let message = unsafe { message.assume_init() };
            if message.event == abi::UFFD_EVENT_PAGEFAULT {
                self.map_zero_page(message.address & !(PAGE_SIZE as u64 - 1));
            }
        }
    }

    /// Places the page at `address` as zeros, or wakes its waiters if a
    /// receiver placed it meanwhile. (A copy, not `UFFDIO_ZEROPAGE`: a
    /// write to the shared zero page of a registered range faults again.)
    fn map_zero_page(&self, address: u64) {
        let mut copy = abi::Copy {
            dst: address,
            src: ZEROS.as_ptr() as u64,
            len: PAGE_SIZE as u64,
            mode: 0,
            copy: 0,
        };
        // SAFETY: `copy` is the structure UFFDIO_COPY reads and writes; the
        // page is one of a registered region's (the kernel reports faults
        // in registered ranges only) and missing, so placing zeros there
        // overwrites nothing.
        let result = unsafe { libc::ioctl(self.fd.as_raw_fd(), abi::UFFDIO_COPY, &mut copy) };
        if result != 0 {
            let mut range = abi::Range {
                start: address,
                len: PAGE_SIZE as u64,
            };
            // SAFETY: `range` is the structure UFFDIO_WAKE reads.
            unsafe { libc::ioctl(self.fd.as_raw_fd(), abi::UFFDIO_WAKE, &mut range) };
        }
    }

    /// Places `pages` contiguous pages at `destination` with the contents
    /// at `source`. A page that is there already (memory written before the
    /// session, or a page zeroed in an earlier iteration) is written in
    /// place instead.
    ///
    /// # Safety
    /// `destination` is `pages` whole pages inside one registered region,
    /// which nothing else accesses during the call; `source` is
    /// `pages * PAGE_SIZE` readable bytes outside them.
    pub(crate) unsafe fn place(
        &self,
        destination: *mut u8,
        source: *const u8,
        pages: usize,
    ) -> io::Result<()> {
        let mut done = 0;
        let mut retries = 0;
        while done < pages {
            let offset = done * PAGE_SIZE;
            let (to, from) = (
                destination.wrapping_add(offset),
                source.wrapping_add(offset),
            );
            let len = (pages - done) * PAGE_SIZE;
            let mut copy = abi::Copy {
                dst: to as u64,
                src: from as u64,
                len: len as u64,
                mode: 0,
                copy: 0,
            };
            // SAFETY: `copy` is the structure UFFDIO_COPY reads and writes;
            // the ranges are the caller's.
            let result = unsafe { libc::ioctl(self.fd.as_raw_fd(), abi::UFFDIO_COPY, &mut copy) };
            if result == 0 {
                return Ok(());
            }
            let error = io::Error::last_os_error();
            if copy.copy > 0 {
                done += crate::numeric::saturating_usize(copy.copy.unsigned_abs()) / PAGE_SIZE;
                continue;
            }
            match error.raw_os_error() {
                Some(libc::EEXIST) => {
                    // SAFETY: the page is mapped (that is what EEXIST says)
                    // and the caller's; `from` holds a page.
                    unsafe { std::ptr::copy_nonoverlapping(from, to, PAGE_SIZE) };
                    done += 1;
                }
                Some(libc::EAGAIN | libc::EINTR) if retries < MAX_RETRIES => retries += 1,
                _ if self.released.load(Ordering::Acquire) => {
                    // SAFETY: unregistered, so the write faults the pages in
                    // as usual; the ranges are the caller's.
                    unsafe { std::ptr::copy_nonoverlapping(from, to, len) };
                    return Ok(());
                }
                _ => return Err(error),
            }
        }
        Ok(())
    }

    /// Places `pages` contiguous pages at `destination` as zeros: what a
    /// write to a fresh page would have found, now without waiting.
    ///
    /// # Safety
    /// As [`Userfault::place`] for `destination`.
    pub(crate) unsafe fn place_zeros(&self, destination: *mut u8, pages: usize) -> io::Result<()> {
        let chunk = ZEROS.len() / PAGE_SIZE;
        for first in (0..pages).step_by(chunk) {
            let count = chunk.min(pages - first);
            // SAFETY: the caller's range, `ZEROS` holds `chunk` pages.
            unsafe {
                self.place(
                    destination.wrapping_add(first * PAGE_SIZE),
                    ZEROS.as_ptr(),
                    count,
                )
            }?;
        }
        Ok(())
    }
}

/// What [`Userfault::next_event`] read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// A thread touched the missing page at this (page-aligned) address.
    PageFault(u64),
    /// `MADV_DONTNEED`/`MADV_REMOVE` (a balloon) dropped `start..end`:
    /// those pages are missing again.
    Remove { start: u64, end: u64 },
    /// Another event (fork, remap, unmap), which the service ignores.
    Other(u8),
}

/// What [`Userfault::wait`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// An event may be read.
    Ready,
    /// [`Userfault::stop_waiting`] was called.
    Stopped,
    /// Nothing within the timeout.
    Timeout,
    /// The descriptor's other end is gone or broken (`POLLHUP`/`POLLERR`).
    Closed,
}

impl Userfault {
    /// Takes over a userfaultfd another process created, registered and
    /// handed over (Firecracker's page-fault handler protocol): no
    /// `UFFDIO_API` or registration here, the creator did both. `ranges`
    /// are the registered ranges as the creator declared them, in *its*
    /// address space.
    pub(crate) fn adopt(fd: OwnedFd, ranges: Vec<(u64, u64)>) -> io::Result<Self> {
        Ok(Self {
            fd,
            wake: wake_eventfd()?,
            ranges,
            released: AtomicBool::new(false),
        })
    }

    /// Waits up to `timeout_ms` for an event or [`Userfault::stop_waiting`].
    pub(crate) fn wait(&self, timeout_ms: i32) -> Wait {
        let mut fds = [
            libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfd structures.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if ready <= 0 {
            Wait::Timeout
        } else if fds[1].revents != 0 {
            Wait::Stopped
        } else if fds[0].revents & libc::POLLIN != 0 {
            Wait::Ready
        } else if fds[0].revents & (libc::POLLHUP | libc::POLLERR) != 0 {
            Wait::Closed
        } else {
            Wait::Timeout
        }
    }

    /// Ends every [`Userfault::wait`], now and later, without touching the
    /// registration.
    pub(crate) fn stop_waiting(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: eight readable bytes, what an eventfd write takes.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Reads one event, or `None` when none is pending (or the read failed).
    pub(crate) fn next_event(&self) -> Option<Event> {
        let mut message = std::mem::MaybeUninit::<abi::Message>::zeroed();
        let size = std::mem::size_of::<abi::Message>();
        // SAFETY: `message` has room for one `uffd_msg`.
        let read = unsafe { libc::read(self.fd.as_raw_fd(), message.as_mut_ptr().cast(), size) };
        if usize::try_from(read) != Ok(size) {
            return None;
        }
        // SAFETY: the kernel wrote a whole message; every bit pattern is a
        // valid `Message`.
        let message = unsafe { message.assume_init() };
        Some(match message.event {
            abi::UFFD_EVENT_PAGEFAULT => {
                Event::PageFault(message.address & !(PAGE_SIZE as u64 - 1))
            }
            // The remove event's range sits where a fault's flags and
            // address do.
            abi::UFFD_EVENT_REMOVE => Event::Remove {
                start: message.flags,
                end: message.address,
            },
            other => Event::Other(other),
        })
    }

    /// Places `pages` pages at address `destination` (in the registering
    /// process) from `source`, skipping pages that are there already
    /// (`EEXIST`: someone placed them first, and theirs stays). Returns how
    /// many pages this call placed. Waiting threads are woken.
    ///
    /// # Safety
    /// `destination` is `pages` whole pages of a registered range;
    /// `source` is `pages * PAGE_SIZE` readable bytes of this process.
    pub(crate) unsafe fn copy_missing(
        &self,
        destination: u64,
        source: *const u8,
        pages: usize,
    ) -> io::Result<usize> {
        let fd = self.fd.as_raw_fd();
        // SAFETY: the caller's contract, passed on.
        unsafe {
            place_skipping_existing(pages, |done, len| {
                let mut copy = abi::Copy {
                    dst: destination + (done * PAGE_SIZE) as u64,
                    src: source.wrapping_add(done * PAGE_SIZE) as u64,
                    len: len as u64,
                    mode: 0,
                    copy: 0,
                };
                let result = libc::ioctl(fd, abi::UFFDIO_COPY, &mut copy);
                (result, copy.copy)
            })
        }
    }

    /// Maps `pages` pages at `destination` to the zero page, skipping pages
    /// that are there already. Returns how many pages this call mapped.
    ///
    /// # Safety
    /// `destination` is `pages` whole pages of a registered range.
    pub(crate) unsafe fn zero_missing(&self, destination: u64, pages: usize) -> io::Result<usize> {
        let fd = self.fd.as_raw_fd();
        // SAFETY: the caller's contract, passed on.
        unsafe {
            place_skipping_existing(pages, |done, len| {
                let mut zero = abi::ZeroPage {
                    range: abi::Range {
                        start: destination + (done * PAGE_SIZE) as u64,
                        len: len as u64,
                    },
                    mode: 0,
                    zeropage: 0,
                };
                let result = libc::ioctl(fd, abi::UFFDIO_ZEROPAGE, &mut zero);
                (result, zero.zeropage)
            })
        }
    }

    /// Wakes threads waiting on `len` bytes at `start` (their page was
    /// placed by someone else).
    pub(crate) fn wake_range(&self, start: u64, len: u64) {
        let mut range = abi::Range { start, len };
        // SAFETY: `range` is the structure UFFDIO_WAKE reads; a failure
        // (nothing waits, or the range left) changes nothing.
        unsafe { libc::ioctl(self.fd.as_raw_fd(), abi::UFFDIO_WAKE, &mut range) };
    }
}

/// Drives a placing ioctl over `pages` pages: `ioctl(done, len)` places
/// from page `done` on and returns the ioctl's result and the structure's
/// progress field (bytes placed, or a negated errno). Pages the kernel
/// says exist are skipped; interrupted calls are retried; `EAGAIN` is
/// returned (pages already placed stay placed, a retry skips them).
///
/// # Safety
/// `ioctl` only issues a placing ioctl within the caller's range.
unsafe fn place_skipping_existing(
    pages: usize,
    mut ioctl: impl FnMut(usize, usize) -> (libc::c_int, i64),
) -> io::Result<usize> {
    let (mut done, mut placed, mut retries) = (0, 0, 0);
    while done < pages {
        let len = (pages - done) * PAGE_SIZE;
        let (result, progress) = ioctl(done, len);
        if result == 0 {
            return Ok(placed + pages - done);
        }
        let error = io::Error::last_os_error();
        if progress > 0 {
            let moved = crate::numeric::saturating_usize(progress.unsigned_abs()) / PAGE_SIZE;
            done += moved;
            placed += moved;
            continue;
        }
        match error.raw_os_error() {
            Some(libc::EEXIST) => done += 1,
            Some(libc::EINTR) if retries < MAX_RETRIES => retries += 1,
            // EAGAIN: the memory map is changing (a remove event waits to
            // be read). Only the caller can read it, so it retries.
            _ => return Err(error),
        }
    }
    Ok(placed)
}

/// The eventfd that ends a fault thread's poll: closed on `exec`, and
/// never blocking, so a wake counter that is somehow full cannot stall
/// the thread that writes it.
fn wake_eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes an initial value and flags only.
    owned(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })
}

/// A new userfaultfd: through `/dev/userfaultfd` (its owner may use it
/// whatever `vm.unprivileged_userfaultfd` says), else the system call.
fn open() -> io::Result<OwnedFd> {
    open_through_device().or_else(|_| open_through_system_call())
}

/// A new userfaultfd from `/dev/userfaultfd` (Linux 6.1 and later).
fn open_through_device() -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated path; the result is checked.
    let device =
        unsafe { libc::open(c"/dev/userfaultfd".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    let device = owned(device)?;
    // SAFETY: the ioctl takes the new descriptor's flags as its argument.
    owned(unsafe {
        libc::ioctl(
            device.as_raw_fd(),
            abi::USERFAULTFD_IOC_NEW,
            libc::O_CLOEXEC | libc::O_NONBLOCK,
        )
    })
}

/// A new userfaultfd from the `userfaultfd(2)` system call.
fn open_through_system_call() -> io::Result<OwnedFd> {
    // SAFETY: the system call takes flags only.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    // A descriptor or -1: both fit an int.
    owned(libc::c_int::try_from(fd).unwrap_or(-1))
}

/// Owns a descriptor a system call just returned, or its error.
fn owned(fd: libc::c_int) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::{MemoryRegion, PAGE_SIZE, Userfault, Wait};
    use crate::destination::test_memory::AnonymousMemory;

    /// `regions` registered, or `None` after a visible skip where this
    /// process has no userfaultfd.
    fn registered(regions: &[MemoryRegion]) -> Option<Userfault> {
        Userfault::register(regions)
            .map_err(|error| {
                tern_test_skip::skip(
                    tern_test_skip::Need::Userfaultfd,
                    format!("no userfaultfd for this process: {error}"),
                );
            })
            .ok()
    }

    #[test]
    fn pages_are_placed_with_their_contents_and_present_ones_written_in_place() {
        let memory = AnonymousMemory::new(8);
        // Page 2 is there before the registration; page 3 was read (it
        // maps the shared zero page).
        // SAFETY: pages of the mapping, nothing else uses them.
        unsafe {
            memory.base.add(2 * PAGE_SIZE).write_bytes(7, PAGE_SIZE);
            assert_eq!(memory.base.add(3 * PAGE_SIZE).read_volatile(), 0);
        }
        let regions = [memory.region(1)];
        let Some(userfault) = registered(&regions) else {
            return;
        };
        let source: Vec<u8> = (0..4 * PAGE_SIZE)
            .map(|i| u8::try_from(i / PAGE_SIZE + 1).unwrap())
            .collect();
        // SAFETY: pages 1-4 of the registered mapping; `source` holds 4.
        unsafe { userfault.place(memory.base.add(PAGE_SIZE), source.as_ptr(), 4) }.unwrap();
        // SAFETY: page 6 of the registered mapping.
        unsafe { userfault.place_zeros(memory.base.add(6 * PAGE_SIZE), 1) }.unwrap();
        userfault.release();
        for (page, expected) in [(1, 1), (2, 2), (3, 3), (4, 4), (6, 0), (0, 0), (7, 0)] {
            assert!(
                memory.page(page).iter().all(|&byte| byte == expected),
                "page {page}"
            );
        }
    }

    #[test]
    fn another_thread_touching_a_missing_page_is_served_zeros() {
        let memory = AnonymousMemory::new(4);
        let regions = [memory.region(1)];
        let Some(userfault) = registered(&regions) else {
            return;
        };
        let source = vec![5u8; PAGE_SIZE];
        // SAFETY: page 1 of the registered mapping; `source` holds a page.
        unsafe { userfault.place(memory.base.add(PAGE_SIZE), source.as_ptr(), 1) }.unwrap();
        let base = memory.base as usize;
        // The reader's fault ends only when the handler serves it.
        tern_test_skip::wait::scope_within("the reader's faults are served", |scope| {
            scope.spawn(|| userfault.serve_faults());
            let reader = scope.spawn(move || {
                // Pages 2 and 3 differ in the address bit above the page
                // offset, so a fault's address rounded to the wrong page
                // leaves one of them waiting whatever the mapping's base.
                // SAFETY: pages 0-3 of the mapping, which outlives the
                // scope; pages 2 and 3 are written (first touches of fresh
                // pages).
                unsafe {
                    let base = base as *mut u8;
                    base.add(2 * PAGE_SIZE).write(3);
                    base.add(3 * PAGE_SIZE).write(4);
                    (
                        *base,
                        *base.add(PAGE_SIZE),
                        *base.add(2 * PAGE_SIZE),
                        *base.add(3 * PAGE_SIZE),
                    )
                }
            });
            assert_eq!(reader.join().unwrap(), (0, 5, 3, 4));
            userfault.release();
        });
    }

    #[test]
    fn after_release_placing_writes_the_pages_anyway() {
        let memory = AnonymousMemory::new(2);
        let regions = [memory.region(1)];
        let Some(userfault) = registered(&regions) else {
            return;
        };
        userfault.release();
        let source = vec![9u8; 2 * PAGE_SIZE];
        // SAFETY: both pages of the mapping; `source` holds two.
        unsafe { userfault.place(memory.base, source.as_ptr(), 2) }.unwrap();
        assert!(memory.page(1).iter().all(|&byte| byte == 9));
    }

    /// The registration's check that UFFDIO_COPY is offered reads the bit
    /// the kernel sets for it: bit `_UFFDIO_COPY`, the ioctl's number.
    #[test]
    fn the_needed_ioctl_bit_is_the_copy_ioctl_s_number() {
        let copy_number = super::abi::UFFDIO_COPY & 0xff;
        assert_eq!(super::abi::NEEDED_IOCTL_BITS, 1 << copy_number);
    }

    fn assert_close_on_exec_and_non_blocking(name: &str, fd: &std::os::fd::OwnedFd) {
        use std::os::fd::AsRawFd;
        // SAFETY: fcntl reads the flags of a descriptor we own.
        let (descriptor_flags, status_flags) = unsafe {
            (
                libc::fcntl(fd.as_raw_fd(), libc::F_GETFD),
                libc::fcntl(fd.as_raw_fd(), libc::F_GETFL),
            )
        };
        assert!(
            descriptor_flags & libc::FD_CLOEXEC != 0,
            "{name} is inherited"
        );
        assert!(status_flags & libc::O_NONBLOCK != 0, "{name} blocks");
    }

    /// Neither descriptor outlives an `exec` (a helper the VMM starts must
    /// not hold guest memory's fault descriptor), and neither blocks: the
    /// fault threads read until `EAGAIN` and must never sleep in a read.
    #[test]
    fn both_descriptors_close_on_exec_and_never_block() {
        let memory = AnonymousMemory::new(1);
        let regions = [memory.region(1)];
        let Some(userfault) = registered(&regions) else {
            return;
        };
        assert_close_on_exec_and_non_blocking("userfaultfd", &userfault.fd);
        assert_close_on_exec_and_non_blocking("wake eventfd", &userfault.wake);
    }

    /// Both ways of opening a userfaultfd give the same descriptor: the
    /// device where it exists, the system call elsewhere (each skipped
    /// visibly where this machine refuses it).
    #[test]
    fn the_device_and_the_system_call_each_open_a_close_on_exec_non_blocking_descriptor() {
        let opened = [
            ("/dev/userfaultfd", super::open_through_device()),
            ("userfaultfd(2)", super::open_through_system_call()),
        ];
        // Neither way: no userfaultfd here at all. One way: a host
        // property (a kernel before 6.1 has no device; an unprivileged
        // process may be refused the system call).
        let need = if opened.iter().all(|(_, result)| result.is_err()) {
            tern_test_skip::Need::Userfaultfd
        } else {
            tern_test_skip::Need::Host
        };
        for (name, result) in opened {
            match result {
                Ok(fd) => assert_close_on_exec_and_non_blocking(name, &fd),
                Err(error) => tern_test_skip::skip(need, format!("{name} refused: {error}")),
            }
        }
    }

    /// A wait ends at once, and says why, once `stop_waiting` was called,
    /// however long its timeout: the service's stop must not wait out a
    /// poll.
    #[test]
    fn a_wait_after_stop_waiting_ends_at_once_as_stopped() {
        let memory = AnonymousMemory::new(1);
        let regions = [memory.region(1)];
        let Some(userfault) = registered(&regions) else {
            return;
        };
        userfault.stop_waiting();
        assert_eq!(userfault.wait(60_000), Wait::Stopped);
        // And every later wait too.
        assert_eq!(userfault.wait(60_000), Wait::Stopped);
    }

    /// A peer's descriptor that never had its `UFFDIO_API` handshake polls
    /// as an error, which the wait reports as closed: the fault thread
    /// then fails the service instead of spinning on events it can never
    /// read.
    #[test]
    fn an_adopted_descriptor_without_its_handshake_waits_as_closed() {
        let fd = match super::open() {
            Ok(fd) => fd,
            Err(error) => {
                tern_test_skip::skip(
                    tern_test_skip::Need::Userfaultfd,
                    format!("no userfaultfd for this process: {error}"),
                );
                return;
            }
        };
        let userfault = Userfault::adopt(fd, Vec::new()).unwrap();
        assert_eq!(userfault.wait(60_000), Wait::Closed);
    }

    #[test]
    fn memory_that_is_not_page_aligned_is_refused() {
        let mut heap = vec![0u8; 3 * PAGE_SIZE];
        let misaligned = heap.as_mut_ptr().wrapping_add(1);
        // SAFETY: the bytes lie inside `heap`, which outlives the region.
        let region = unsafe {
            MemoryRegion::new(
                1,
                0,
                std::ptr::NonNull::new(misaligned).unwrap(),
                PAGE_SIZE as u64,
            )
        };
        assert!(Userfault::register(&[region]).is_err());
    }
}

//! The handler's side of Firecracker's page-fault handler handshake, and
//! a page source over a raw Firecracker memory file.
//!
//! Followed from Firecracker's `docs/snapshotting/
//! handling-page-faults-on-snapshot-resume.md` and its example handler's
//! `GuestRegionUffdMapping` (main branch, read 2026-11-25; the fields
//! have been the same since v1.7, when `page_size_kib` became
//! `page_size`, which is accepted too): the handler listens on a Unix
//! socket; Firecracker creates the userfaultfd, registers guest memory for
//! missing pages, connects, and sends in one message the descriptor
//! (`SCM_RIGHTS`) and a JSON array of regions, each
//! `{"base_host_virt_addr", "size", "offset", "page_size"}` (addresses in
//! Firecracker's address space, `offset` into the memory file, page size
//! in bytes). Nothing else travels on the socket. The handler must handle
//! `UFFD_EVENT_REMOVE` (a balloon): removed pages fault again later and
//! are then served as zeros.
//!
//! Not yet run against a real Firecracker: tested with a stand-in process
//! that follows the same documented steps (`crates/tern/tests/serve_pages.rs`).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tern_page::zero::ZeroChecker;

use crate::fault::{PageSource, PageSourceError, ServedRegion};
use crate::guest::PAGE_SIZE;

/// Longest handshake message accepted (1024 regions of JSON fit).
const MAX_MESSAGE: usize = 256 << 10;
/// Most regions accepted.
const MAX_REGIONS: usize = 1024;

/// One region as Firecracker describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct FirecrackerRegion {
    /// Where the region is mapped in Firecracker's address space.
    pub base_host_virt_addr: u64,
    /// Length in bytes.
    pub size: u64,
    /// Where its contents start in the memory file.
    pub offset: u64,
    /// Page size in bytes (`page_size_kib` × 1024 from older versions).
    #[serde(default)]
    pub page_size: u64,
    /// The older field, in KiB.
    #[serde(default)]
    pub page_size_kib: u64,
}

impl FirecrackerRegion {
    fn page_bytes(&self) -> u64 {
        if self.page_size != 0 {
            self.page_size
        } else {
            self.page_size_kib.saturating_mul(1024)
        }
    }

    /// The range the fault service serves.
    pub fn served(&self) -> ServedRegion {
        ServedRegion {
            base: self.base_host_virt_addr,
            len: self.size,
        }
    }
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// No VMM connected in time.
    #[error("no VMM connected within {0:?}")]
    AcceptTimeout(Duration),
    /// Socket I/O failed.
    #[error("the handshake socket failed")]
    Io(#[from] io::Error),
    /// The VMM closed the connection before sending its message.
    #[error("the VMM closed the socket before sending the userfaultfd and regions")]
    Closed,
    /// The message came without a descriptor.
    #[error("the VMM's message carried no userfaultfd (SCM_RIGHTS)")]
    NoDescriptor,
    /// The JSON did not parse or describes impossible regions.
    #[error("the VMM's region list is invalid: {0}")]
    Regions(String),
}

/// What the VMM handed over.
#[derive(Debug)]
pub struct Handshake {
    /// The userfaultfd, with the regions registered.
    pub uffd: OwnedFd,
    /// The regions.
    pub regions: Vec<FirecrackerRegion>,
    /// The VMM's process id (`SO_PEERCRED`), to notice when it exits.
    pub peer_pid: Option<i32>,
}

/// Accepts one VMM on `listener` within `deadline` and reads its
/// handshake: the userfaultfd and the regions, checked.
pub fn accept_handshake(
    listener: &UnixListener,
    deadline: Duration,
) -> Result<Handshake, HandshakeError> {
    let until = Instant::now() + deadline;
    listener.set_nonblocking(true)?;
    let stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(HandshakeError::AcceptTimeout(deadline));
                }
                poll_readable(listener.as_raw_fd(), left)?;
            }
            Err(error) => return Err(error.into()),
        }
    };
    stream.set_nonblocking(false)?;
    let left = until
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left))?;
    let peer_pid = peer_pid(&stream);
    let (bytes, uffd) = read_message(&stream)?;
    let uffd = uffd.ok_or(HandshakeError::NoDescriptor)?;
    let regions = parse_regions(&bytes)?;
    Ok(Handshake {
        uffd,
        regions,
        peer_pid,
    })
}

/// Parses and checks the JSON region list.
pub fn parse_regions(bytes: &[u8]) -> Result<Vec<FirecrackerRegion>, HandshakeError> {
    let invalid = |detail: String| HandshakeError::Regions(detail);
    let regions: Vec<FirecrackerRegion> =
        serde_json::from_slice(bytes).map_err(|error| invalid(error.to_string()))?;
    if regions.is_empty() || regions.len() > MAX_REGIONS {
        return Err(invalid(format!(
            "{} regions (1 to {MAX_REGIONS})",
            regions.len()
        )));
    }
    let page = PAGE_SIZE as u64;
    for (index, region) in regions.iter().enumerate() {
        if region.page_bytes() != page {
            return Err(invalid(format!(
                "region {index} has pages of {} bytes; only {page}-byte pages are served (no huge pages)",
                region.page_bytes()
            )));
        }
        let aligned = |value: u64| value.is_multiple_of(page);
        if region.size == 0
            || !aligned(region.size)
            || !aligned(region.base_host_virt_addr)
            || !aligned(region.offset)
            || region
                .base_host_virt_addr
                .checked_add(region.size)
                .is_none()
            || region.offset.checked_add(region.size).is_none()
        {
            return Err(invalid(format!(
                "region {index} is not page-aligned or overflows"
            )));
        }
        let overlaps = regions[..index].iter().any(|other| {
            region.base_host_virt_addr < other.base_host_virt_addr + other.size
                && other.base_host_virt_addr < region.base_host_virt_addr + region.size
        });
        if overlaps {
            return Err(invalid(format!("region {index} overlaps another")));
        }
    }
    Ok(regions)
}

/// One `recvmsg` with room for one descriptor, then plain reads until the
/// JSON is complete (it parses) or the VMM stops sending.
fn read_message(stream: &UnixStream) -> Result<(Vec<u8>, Option<OwnedFd>), HandshakeError> {
    let mut buf = vec![0u8; 64 << 10];
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: a zeroed msghdr is a valid empty one; the pointers set below
    // stay valid for the call.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    header.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: `header` describes `buf` and `control`, both live and ours.
    let got = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut header, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io::Error::last_os_error().into());
    }
    if got == 0 {
        return Err(HandshakeError::Closed);
    }
    let uffd = received_descriptor(&header);
    let mut message = buf[..crate::numeric::syscall_count(got)].to_vec();
    while serde_json::from_slice::<serde_json::Value>(&message).is_err() {
        if message.len() >= MAX_MESSAGE {
            return Err(HandshakeError::Regions("the message is too long".into()));
        }
        let more = match io::Read::read(&mut &*stream, &mut buf) {
            Ok(0) => break,
            Ok(more) => more,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
            Err(error) => return Err(error.into()),
        };
        message.extend_from_slice(&buf[..more]);
    }
    Ok((message, uffd))
}

/// The descriptor an `SCM_RIGHTS` message carried, if any; any others are
/// closed.
fn received_descriptor(header: &libc::msghdr) -> Option<OwnedFd> {
    let mut found = None;
    // SAFETY: `header` was filled by recvmsg; the CMSG macros walk its
    // control buffer within `msg_controllen`.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(header) };
    while !cmsg.is_null() {
        // SAFETY: a control message header inside the buffer.
        let (level, kind, len) =
            unsafe { ((*cmsg).cmsg_level, (*cmsg).cmsg_type, (*cmsg).cmsg_len) };
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            // SAFETY: the data of an SCM_RIGHTS message is an array of ints.
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<libc::c_int>();
            // SAFETY: CMSG_LEN(0) is the header's length, a constant.
            let header_len = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = len.saturating_sub(header_len) / std::mem::size_of::<libc::c_int>();
            for index in 0..count {
                // SAFETY: `index < count` ints lie in the message's data.
                let fd = unsafe { data.add(index).read_unaligned() };
                // SAFETY: the kernel installed this descriptor for us.
                let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                if found.is_none() {
                    found = Some(owned);
                }
            }
        }
        // SAFETY: as above.
        cmsg = unsafe { libc::CMSG_NXTHDR(header, cmsg) };
    }
    found
}

fn peer_pid(stream: &UnixStream) -> Option<i32> {
    let mut credentials = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = crate::numeric::socklen_of::<libc::ucred>();
    // SAFETY: `credentials` has room for a ucred, `len` says so.
    let result = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut credentials as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (result == 0 && credentials.pid > 0).then_some(credentials.pid)
}

fn poll_readable(fd: i32, within: Duration) -> io::Result<bool> {
    let mut pollfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let timeout = i32::try_from(within.as_millis()).unwrap_or(i32::MAX).max(1);
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut pollfd, 1, timeout) };
    if ready < 0 {
        let error = io::Error::last_os_error();
        return if error.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(error)
        };
    }
    Ok(ready > 0)
}

/// Watches a process for its exit (a pidfd): the page server's peer.
#[derive(Debug)]
pub struct ProcessWatch {
    pidfd: OwnedFd,
}

impl ProcessWatch {
    /// Watches process `pid`.
    pub fn new(pid: i32) -> io::Result<Self> {
        // SAFETY: the system call takes a pid and flags.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = libc::c_int::try_from(fd)
            .map_err(|_| io::Error::other("pidfd_open returned a descriptor past an int"))?;
        // SAFETY: a new descriptor nothing else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { pidfd })
    }

    /// Waits up to `within` for the process to exit; true once it has.
    pub fn exited_within(&self, within: Duration) -> io::Result<bool> {
        poll_readable(self.pidfd.as_raw_fd(), within)
    }
}

/// A raw memory file (Firecracker's snapshot memory file): region `i`'s
/// page `n` is at `regions[i].offset + n * 4096`. Zero pages are placed
/// as zero pages. No hashes: such a file proves nothing about itself.
#[derive(Debug)]
pub struct RawMemoryFile {
    path: PathBuf,
    file: File,
    offsets: Vec<u64>,
    zero: ZeroChecker,
}

impl RawMemoryFile {
    /// Opens `path` for `regions`, refusing a file too short for them.
    pub fn open(
        path: &std::path::Path,
        regions: &[FirecrackerRegion],
    ) -> Result<Self, PageSourceError> {
        let file = File::open(path).map_err(|error| {
            PageSourceError::io(format!("cannot open {}", path.display()), error)
        })?;
        let len = file
            .metadata()
            .map_err(|error| PageSourceError::io(format!("cannot read {}", path.display()), error))?
            .len();
        if let Some(region) = regions
            .iter()
            .find(|region| region.offset + region.size > len)
        {
            return Err(PageSourceError::new(format!(
                "{} holds {len} bytes, but a region needs bytes up to {}",
                path.display(),
                region.offset + region.size
            )));
        }
        Ok(Self {
            path: path.to_owned(),
            file,
            offsets: regions.iter().map(|region| region.offset).collect(),
            zero: ZeroChecker::best(),
        })
    }
}

impl PageSource for RawMemoryFile {
    fn fetch(
        &self,
        region: usize,
        first: u64,
        buf: &mut [u8],
        zero: &mut [bool],
    ) -> Result<(), PageSourceError> {
        let offset = self
            .offsets
            .get(region)
            .ok_or_else(|| PageSourceError::new(format!("no region {region}")))?;
        self.file
            .read_exact_at(buf, offset + first * PAGE_SIZE as u64)
            .map_err(|error| {
                PageSourceError::io(format!("cannot read {}", self.path.display()), error)
            })?;
        for (page, is_zero) in buf.chunks(PAGE_SIZE).zip(zero.iter_mut()) {
            *is_zero = self.zero.is_zero(page);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::parse_regions;

    #[test]
    fn regions_parse_in_both_spellings_and_bad_ones_are_refused() {
        let json = br#"[{"base_host_virt_addr":4096,"size":8192,"offset":0,"page_size":4096},
                        {"base_host_virt_addr":65536,"size":4096,"offset":8192,"page_size_kib":4}]"#;
        let regions = parse_regions(json).unwrap();
        assert_eq!(regions[1].offset, 8192);
        for bad in [
            &br#"[]"#[..],
            br#"[{"base_host_virt_addr":4096,"size":8192,"offset":0,"page_size":2097152}]"#,
            br#"[{"base_host_virt_addr":4095,"size":8192,"offset":0,"page_size":4096}]"#,
            br#"[{"base_host_virt_addr":4096,"size":8192,"offset":0,"page_size":4096},
                 {"base_host_virt_addr":8192,"size":4096,"offset":0,"page_size":4096}]"#,
            br#"{"not":"a list"}"#,
        ] {
            assert!(
                parse_regions(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}

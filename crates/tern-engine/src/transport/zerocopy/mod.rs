//! Zero-copy sends on the page channels, shared by both backends:
//! `MSG_ZEROCOPY` ([`msg`]) and io_uring `SENDMSG_ZC` ([`uring`], cargo
//! feature `io-uring`). This file holds what they share (errors, counters,
//! the [`ZeroCopyTransport`] trait the pipeline uses, the window's kernel
//! charge, the `RLIMIT_MEMLOCK` check); `measure` compares them.
//!
//! Dependencies point one way: `measure` → `msg`, `uring` → this file →
//! [`crate::transport`].
//!
//! # Why later guest writes are harmless
//! With zero-copy sends the NIC reads the page some time after the send
//! returned, so a vCPU write in between may be transmitted. That is the same
//! situation as a write just before a copying `sendmsg`: the page was dirtied
//! after the dirty log was harvested, so it is in the next iteration's dirty
//! set and is sent again, and the channel's sync barrier orders the two
//! copies. In the final iteration the guest is paused, so nothing changes
//! under the send, and the sender's `flush` runs before switch-over.
//! Memory safety does not depend on completion either: the kernel holds its
//! own references on the pinned pages, so even an unmapped page stays valid
//! for the kernel until it is sent.

mod measure;
pub mod msg;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(feature = "io-uring")]
pub mod uring;
/// Stand-in for the io_uring backend when the `io-uring` feature is off:
/// choosing it fails with [`ZeroCopyError::UringUnavailable`].
#[cfg(not(feature = "io-uring"))]
#[path = "uring_disabled.rs"]
pub mod uring;

pub use measure::{CpuMeasurement, SendMode, measure_cpu_per_gib};
pub use msg::{Notification, ZeroCopySender, parse_notifications};
pub use msg::{SO_EE_CODE_ZEROCOPY_COPIED, SO_EE_ORIGIN_ZEROCOPY};

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use crate::error::ChannelError;
use crate::transport::{Channel, Segment};

/// The 4 KiB pages the senders' tests and measurements send (and the
/// kernel's page size where `sysconf` cannot say).
const KERNEL_PAGE: usize = 4096;
/// `CAP_IPC_LOCK` bit in `CapEff`.
const CAP_IPC_LOCK: u32 = 14;
/// Smallest window accepted: a few pages per send must fit.
pub const MIN_WINDOW_BYTES: usize = 256 * 1024;
/// Default time a sender's `flush` (and a full window) may wait.
pub const DEFAULT_FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// What can go wrong with zero-copy sends.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ZeroCopyError {
    /// `setsockopt(SO_ZEROCOPY)` failed.
    #[error(
        "the kernel refused SO_ZEROCOPY on channel {index}: {source}; zero-copy needs Linux ≥ 4.14 and a TCP socket"
    )]
    Refused {
        /// Page channel number (1-based, as in the other channel errors).
        index: usize,
        /// The kernel's error.
        source: io::Error,
    },
    /// The channel is a Unix socket.
    #[error(
        "zero_copy needs TCP page channels, but channel {index} is a Unix socket (unix:): Unix sockets do not support MSG_ZEROCOPY; use a tcp: address or set zero_copy = false"
    )]
    UnixSocket {
        /// Page channel number.
        index: usize,
    },
    /// The window is too small to send anything.
    #[error("the zero-copy window of {window} bytes is too small: use at least {minimum} bytes")]
    WindowTooSmall {
        /// Requested window.
        window: usize,
        /// Smallest accepted window.
        minimum: usize,
    },
    /// Not enough lockable memory for the in-flight window.
    #[error(
        "RLIMIT_MEMLOCK is {current} but zero_copy keeps up to {needed} bytes of guest memory pinned in flight; raise the limit (`ulimit -l {needed_kib}` in the shell, LimitMEMLOCK={needed} in a systemd unit), grant CAP_IPC_LOCK, or lower zero_copy_window"
    )]
    Memlock {
        /// The soft limit, in bytes, as text.
        current: String,
        /// Bytes needed.
        needed: u64,
        /// The same in KiB, the unit of `ulimit -l`.
        needed_kib: u64,
    },
    /// Sending failed.
    #[error("zero-copy send on channel {index} failed")]
    Send {
        /// Page channel number.
        index: usize,
        /// The error.
        source: io::Error,
    },
    /// The kernel kept answering ENOBUFS.
    #[error(
        "zero-copy send on channel {index} still failed with ENOBUFS after {retries} retries with {outstanding} sends in flight: the per-socket notification memory (net.core.optmem_max) or the locked-memory limit (RLIMIT_MEMLOCK) is exhausted; raise them or lower zero_copy_window"
    )]
    NoBuffers {
        /// Page channel number.
        index: usize,
        /// Retries made.
        retries: u32,
        /// Sends still in flight at the end.
        outstanding: usize,
    },
    /// Reading the error queue failed.
    #[error("reading zero-copy notifications on channel {index} failed")]
    ErrorQueue {
        /// Page channel number.
        index: usize,
        /// The error.
        source: io::Error,
    },
    /// A notification named ids that are not in flight.
    #[error(
        "channel {index}: zero-copy notification for ids {first}..={last}, but only {in_flight} sends from id {oldest} are in flight"
    )]
    UnknownIds {
        /// Page channel number.
        index: usize,
        /// First id reported.
        first: u32,
        /// Last id reported.
        last: u32,
        /// Oldest id in flight.
        oldest: u32,
        /// Sends in flight.
        in_flight: usize,
    },
    /// Completions did not arrive in time.
    #[error(
        "channel {index}: {outstanding} zero-copy sends ({bytes} bytes) were not completed within {seconds:.1} s; is the peer still reading?"
    )]
    CompletionTimeout {
        /// Page channel number.
        index: usize,
        /// Sends still in flight.
        outstanding: usize,
        /// Their payload bytes.
        bytes: u64,
        /// How long we waited.
        seconds: f64,
    },
    /// The peer hung up (or this side shut the socket down) while sends it
    /// never acknowledged were in flight: they can no longer complete.
    #[error(
        "channel {index}: the peer hung up with {outstanding} zero-copy sends in flight ({unacknowledged} bytes never acknowledged)"
    )]
    PeerHungUp {
        /// Page channel number.
        index: usize,
        /// Sends still in flight.
        outstanding: usize,
        /// Bytes in the socket's send queue the peer never acknowledged.
        unacknowledged: u64,
    },
    /// io_uring, or its `SENDMSG_ZC` opcode, cannot be used here.
    #[error("io_uring SENDMSG_ZC is not available: {reason}")]
    UringUnavailable {
        /// Why, with what to do about it.
        reason: String,
    },
    /// The io_uring instance of a channel failed.
    #[error("io_uring on channel {index} failed")]
    Ring {
        /// Page channel number.
        index: usize,
        /// The error.
        source: io::Error,
    },
}

impl ZeroCopyError {
    /// The error as a [`ChannelError`], for `MigrationError::Channel`.
    pub fn into_channel_error(self) -> ChannelError {
        match self {
            Self::Send { source, .. }
                if matches!(
                    source.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                ChannelError::Timeout("the peer (I/O timed out)")
            }
            Self::Send { source, .. } => ChannelError::Io(source),
            other => ChannelError::Io(io::Error::other(other)),
        }
    }
}

/// Accounting of one channel's zero-copy sends.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct ZeroCopyStats {
    /// `sendmsg(MSG_ZEROCOPY)` calls that sent something (one id each).
    pub sends_queued: u64,
    /// Of those, completed (notification received).
    pub sends_completed: u64,
    /// Of those, completed with `SO_EE_CODE_ZEROCOPY_COPIED`: the kernel
    /// copied after all. When the kernel merges adjacent completions into
    /// one range, the whole range carries the flag of its first completion.
    pub sends_copied: u64,
    /// Payload bytes sent with `MSG_ZEROCOPY` (copied or not).
    pub zero_copy_bytes: u64,
    /// Of those, bytes in sends reported as copied.
    pub copied_bytes: u64,
    /// Header bytes sent with ordinary, copying sends.
    pub header_bytes: u64,
    /// Notifications read from the error queue.
    pub notifications: u64,
    /// Seconds blocked waiting for completions (full window, ENOBUFS, flush).
    pub wait_seconds: f64,
    /// ENOBUFS answers that were handled by reaping and retrying.
    pub enobufs_retries: u64,
    /// Largest kernel-charged in-flight bytes seen (never above the window).
    pub max_outstanding_bytes: u64,
    /// Iteration syncs these counters were taken at (every send before a
    /// sync has completed when it is counted). The largest over channels.
    #[serde(default)]
    pub syncs: u64,
    /// Sends completed between the sync before the last one and the last
    /// one: the last iteration's share of `sends_completed`.
    #[serde(default)]
    pub last_sync_sends_completed: u64,
    /// Of those, completed with `SO_EE_CODE_ZEROCOPY_COPIED`.
    #[serde(default)]
    pub last_sync_sends_copied: u64,
    /// Payload bytes of the last iteration's sends.
    #[serde(default)]
    pub last_sync_zero_copy_bytes: u64,
    /// Of those, bytes in sends reported as copied.
    #[serde(default)]
    pub last_sync_copied_bytes: u64,
}

impl ZeroCopyStats {
    /// Adds another channel's counters (maximum for the high-water mark).
    pub fn add(&mut self, other: &Self) {
        self.sends_queued += other.sends_queued;
        self.sends_completed += other.sends_completed;
        self.sends_copied += other.sends_copied;
        self.zero_copy_bytes += other.zero_copy_bytes;
        self.copied_bytes += other.copied_bytes;
        self.header_bytes += other.header_bytes;
        self.notifications += other.notifications;
        self.wait_seconds += other.wait_seconds;
        self.enobufs_retries += other.enobufs_retries;
        self.max_outstanding_bytes = self.max_outstanding_bytes.max(other.max_outstanding_bytes);
        self.syncs = self.syncs.max(other.syncs);
        self.last_sync_sends_completed += other.last_sync_sends_completed;
        self.last_sync_sends_copied += other.last_sync_sends_copied;
        self.last_sync_zero_copy_bytes += other.last_sync_zero_copy_bytes;
        self.last_sync_copied_bytes += other.last_sync_copied_bytes;
    }

    /// These counters taken at a sync, `previous` being the ones taken at
    /// the sync before (or the default at the first): counts the sync and
    /// fills the `last_sync_*` fields with what happened in between.
    pub fn at_sync(mut self, previous: &Self) -> Self {
        self.syncs = previous.syncs + 1;
        self.last_sync_sends_completed = self
            .sends_completed
            .saturating_sub(previous.sends_completed);
        self.last_sync_sends_copied = self.sends_copied.saturating_sub(previous.sends_copied);
        self.last_sync_zero_copy_bytes = self
            .zero_copy_bytes
            .saturating_sub(previous.zero_copy_bytes);
        self.last_sync_copied_bytes = self.copied_bytes.saturating_sub(previous.copied_bytes);
        self
    }

    /// These counters with the sync fields of `at_last_sync` (for the
    /// totals at the end, which come after the last sync).
    pub fn with_sync_fields_of(mut self, at_last_sync: &Self) -> Self {
        self.syncs = at_last_sync.syncs;
        self.last_sync_sends_completed = at_last_sync.last_sync_sends_completed;
        self.last_sync_sends_copied = at_last_sync.last_sync_sends_copied;
        self.last_sync_zero_copy_bytes = at_last_sync.last_sync_zero_copy_bytes;
        self.last_sync_copied_bytes = at_last_sync.last_sync_copied_bytes;
        self
    }
}

/// How often a wait that cannot be woken by a hang-up (io_uring's) stops to
/// look for one.
pub const HANG_UP_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// Whether the socket is hung up (the peer closed or shut down its side,
/// or this side was shut down) with bytes in its send queue the peer never
/// acknowledged, which can then never complete: returns those bytes.
///
/// A hang-up with an empty send queue is not reported: everything sent was
/// acknowledged, and its notifications are on their way.
pub(crate) fn hung_up_with_unacknowledged(fd: RawFd, revents: libc::c_short) -> Option<u64> {
    if revents & (libc::POLLHUP | libc::POLLRDHUP) == 0 {
        return None;
    }
    let mut queued: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one c_int, the bytes in the send
    // queue not yet acknowledged, through a valid pointer.
    let result = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut queued as *mut libc::c_int) };
    if result != 0 {
        // Cannot tell: let the caller's deadline decide.
        return None;
    }
    u64::try_from(queued).ok().filter(|&bytes| bytes > 0)
}

/// `poll` events of `fd` now (hang-up and error bits included), without
/// waiting.
#[cfg(feature = "io-uring")]
pub(crate) fn socket_events(fd: RawFd) -> libc::c_short {
    let mut poll_fd = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `poll_fd` is a valid pollfd for the duration of the call.
    let ready = unsafe { libc::poll(&mut poll_fd, 1, 0) };
    if ready > 0 { poll_fd.revents } else { 0 }
}

/// What the page channels need of a zero-copy sender; implemented by the
/// `MSG_ZEROCOPY` sender and by the io_uring `SENDMSG_ZC` one, which the
/// pipeline then treats alike.
pub trait ZeroCopyTransport: Send {
    /// Sends `header` (copied) then `pages` (zero-copy).
    ///
    /// # Safety
    /// Every page segment must stay mapped and readable until
    /// [`ZeroCopyTransport::flush`] returns.
    unsafe fn send(&mut self, header: &[u8], pages: &[Segment]) -> Result<(), ZeroCopyError>;
    /// Waits until every send is completed.
    fn flush(&mut self) -> Result<(), ZeroCopyError>;
    /// The accounting so far.
    fn stats(&self) -> ZeroCopyStats;
    /// The channel.
    fn channel(&self) -> &Channel;
    /// The channel, for control messages (sent with ordinary copies).
    fn channel_mut(&mut self) -> &mut Channel;
    /// Sends not completed yet.
    fn outstanding_sends(&self) -> usize;
    /// Kernel-charged bytes in flight.
    fn outstanding_charge(&self) -> usize;
}

/// Implements [`ZeroCopyTransport`] by delegating to the inherent methods.
macro_rules! impl_zero_copy_transport {
    ($sender:ty) => {
        impl $crate::transport::zerocopy::ZeroCopyTransport for $sender {
            unsafe fn send(
                &mut self,
                header: &[u8],
                pages: &[$crate::transport::Segment],
            ) -> Result<(), $crate::transport::zerocopy::ZeroCopyError> {
                // SAFETY: the caller upholds the same contract.
                unsafe { <$sender>::send(self, header, pages) }
            }
            fn flush(&mut self) -> Result<(), $crate::transport::zerocopy::ZeroCopyError> {
                <$sender>::flush(self)
            }
            fn stats(&self) -> $crate::transport::zerocopy::ZeroCopyStats {
                <$sender>::stats(self)
            }
            fn channel(&self) -> &$crate::transport::Channel {
                <$sender>::channel(self)
            }
            fn channel_mut(&mut self) -> &mut $crate::transport::Channel {
                <$sender>::channel_mut(self)
            }
            fn outstanding_sends(&self) -> usize {
                <$sender>::outstanding_sends(self)
            }
            fn outstanding_charge(&self) -> usize {
                <$sender>::outstanding_charge(self)
            }
        }
    };
}
pub(crate) use impl_zero_copy_transport;

/// Bytes the kernel charges against `RLIMIT_MEMLOCK` for one zero-copy send
/// of `len` bytes: whole pages plus two (the kernel's own rounding slack,
/// `mm_account_pinned_pages`), in the kernel's page size, which is 16 or
/// 64 KiB on some arm64 kernels.
pub fn kernel_charge(len: usize) -> usize {
    charge_in_pages_of(len, system_page_size())
}

/// [`kernel_charge`] for a kernel whose pages are `page` bytes.
fn charge_in_pages_of(len: usize, page: usize) -> usize {
    (len / page + 2) * page
}

/// The kernel's page size (`sysconf(_SC_PAGESIZE)`), read once.
fn system_page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf reads a constant of the running system.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(page)
            .ok()
            .filter(|&page| page > 0)
            .unwrap_or(KERNEL_PAGE)
    })
}

/// Checks that `window_bytes` (the total over all zero-copy channels) can be
/// pinned: the `RLIMIT_MEMLOCK` soft limit is at least that large, or the
/// process has `CAP_IPC_LOCK` (the kernel then does not account).
pub fn check_memlock(window_bytes: usize) -> Result<(), ZeroCopyError> {
    // SAFETY: an all-zero rlimit is valid.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: `limit` is valid for writes.
    let result = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    let soft = if result != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(limit.rlim_cur)
    };
    memlock_verdict(window_bytes, soft, has_cap_ipc_lock())
}

/// The decision of [`check_memlock`]: `soft_limit` is `None` for unlimited.
pub fn memlock_verdict(
    window_bytes: usize,
    soft_limit: Option<u64>,
    cap_ipc_lock: bool,
) -> Result<(), ZeroCopyError> {
    let needed = window_bytes as u64;
    match soft_limit {
        _ if cap_ipc_lock => Ok(()),
        None => Ok(()),
        Some(limit) if limit >= needed => Ok(()),
        Some(limit) => Err(ZeroCopyError::Memlock {
            current: format!("{limit} bytes"),
            needed,
            needed_kib: needed.div_ceil(1024),
        }),
    }
}

/// Whether the calling thread's effective capability set holds
/// `CAP_IPC_LOCK` (capabilities are per thread, and the kernel checks the
/// sending thread's; `/proc/self` would show the main thread's).
pub fn has_cap_ipc_lock() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/thread-self/status")
        .or_else(|_| std::fs::read_to_string("/proc/self/status"))
    else {
        return false;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_charge_is_in_the_kernels_pages() {
        // Two pages of slack, whatever the page size.
        assert_eq!(charge_in_pages_of(8192, 4096), 4 * 4096);
        assert_eq!(charge_in_pages_of(8192, 16384), 2 * 16384);
        assert_eq!(charge_in_pages_of(65536, 65536), 3 * 65536);
        // SAFETY: sysconf reads a constant.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
        assert_eq!(kernel_charge(8192), charge_in_pages_of(8192, page));
    }

    #[test]
    fn memlock_check_names_the_limit() {
        let error = memlock_verdict(64 << 20, Some(8 << 20), false).unwrap_err();
        let message = error.to_string();
        assert!(message.contains("RLIMIT_MEMLOCK"), "{message}");
        assert!(message.contains("8388608 bytes"), "{message}");
        assert!(message.contains("ulimit -l 65536"), "{message}");
        assert!(message.contains("LimitMEMLOCK=67108864"), "{message}");
        assert!(message.contains("CAP_IPC_LOCK"), "{message}");
        assert!(memlock_verdict(8 << 20, Some(8 << 20), false).is_ok());
        assert!(memlock_verdict(64 << 20, Some(8 << 20), true).is_ok());
        assert!(memlock_verdict(64 << 20, None, false).is_ok());
        // The real check agrees with the capability and the real limit.
        let huge = usize::MAX / 2;
        assert_eq!(
            check_memlock(huge).is_ok(),
            has_cap_ipc_lock() || {
                // SAFETY: an all-zero rlimit is valid and getrlimit writes it.
                let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
                // SAFETY: `limit` is valid for writes.
                unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
                limit.rlim_cur == libc::RLIM_INFINITY
            }
        );
    }
}

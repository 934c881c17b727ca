//! `MSG_ZEROCOPY` sends with continuous reaping of completion
//! notifications and honest accounting.
//!
//! # How it works
//! A page batch goes out as a small header, copied with an ordinary
//! `send(MSG_MORE)`, then the data pages with
//! `sendmsg(MSG_ZEROCOPY | MSG_NOSIGNAL)` straight from guest memory. The
//! kernel pins the pages instead of copying them, and later queues a
//! completion notification on the socket's error queue. Every successful
//! zero-copy `sendmsg` (even a partial one) consumes the next 32-bit
//! notification id; the kernel numbers them per socket from 0 and may report
//! a range of ids in one notification (`ee_info..=ee_data`).
//!
//! * **Continuous reaping**: after every send the error queue is drained
//!   without blocking, so notification buffers (charged to
//!   `net.core.optmem_max`) never pile up until a sync.
//! * **Window**: the bytes the kernel charges for pinned pages
//!   (`RLIMIT_MEMLOCK` accounting, see [`kernel_charge`]) are tracked; when
//!   the next send would exceed `window_bytes` the sender blocks on
//!   `poll(POLLERR)` and reaps first. Locked memory never exceeds the window.
//! * **ENOBUFS** (optmem or locked-memory limit hit anyway) is handled by
//!   waiting for and reaping notifications, then retrying, a bounded number of
//!   times.
//! * **Accounting**: sends queued, completed, and completed with
//!   `SO_EE_CODE_ZEROCOPY_COPIED` (the kernel fell back to copying, which is
//!   always the case on loopback), bytes, time blocked waiting.
//! * **Flush**: [`ZeroCopySender::flush`] waits for every outstanding send;
//!   call it at each iteration sync and before switch-over.
//! * **Hang-up**: the waits poll for `POLLRDHUP` and `POLLHUP` too. A
//!   hang-up while the send queue still holds bytes the peer never
//!   acknowledged fails at once ([`ZeroCopyError::PeerHungUp`]) instead of
//!   waiting out the flush timeout: those sends can never complete.
//!
//! Why later guest writes are harmless is explained in
//! [`crate::transport::zerocopy`].

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use super::{
    DEFAULT_FLUSH_TIMEOUT, KERNEL_PAGE, MIN_WINDOW_BYTES, ZeroCopyError, ZeroCopyStats,
    hung_up_with_unacknowledged, kernel_charge,
};
use crate::transport::{Channel, Segment};

/// `SO_ZEROCOPY` socket option (asm-generic value, x86-64 and aarch64).
const SO_ZEROCOPY: libc::c_int = 60;
/// `ee_origin` of a zero-copy completion notification.
pub const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
/// `ee_code` bit: the kernel copied the data after all.
pub const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;
/// How many ENOBUFS in a row (with reaping in between) before giving up.
const MAX_ENOBUFS_RETRIES: u32 = 200;
/// How long one ENOBUFS retry waits for notifications.
const ENOBUFS_WAIT: Duration = Duration::from_millis(10);

super::impl_zero_copy_transport!(ZeroCopySender);

/// One completion notification: ids `first..=last` (modulo 2³²) are done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Notification {
    /// First completed id (`ee_info`).
    pub first: u32,
    /// Last completed id (`ee_data`), possibly below `first` after wrapping.
    pub last: u32,
    /// `SO_EE_CODE_ZEROCOPY_COPIED` was set.
    pub copied: bool,
}

impl Notification {
    /// Number of ids in the range.
    pub fn count(&self) -> u64 {
        u64::from(self.last.wrapping_sub(self.first)) + 1
    }
}

/// Parses a `recvmsg(MSG_ERRQUEUE)` control buffer into zero-copy
/// notifications. Control messages of other kinds (timestamps, ICMP errors)
/// are skipped.
pub fn parse_notifications(control: &[u8]) -> Vec<Notification> {
    let header_len = std::mem::size_of::<libc::cmsghdr>();
    let align = std::mem::size_of::<usize>();
    let data_offset = header_len.next_multiple_of(align);
    let err_len = std::mem::size_of::<libc::sock_extended_err>();
    let mut found = Vec::new();
    let mut offset = 0;
    while offset + header_len <= control.len() {
        // SAFETY: `offset + header_len <= control.len()`, so the bytes are in
        // bounds; cmsghdr is plain old data, read unaligned from a byte copy.
        let cmsg: libc::cmsghdr =
            unsafe { std::ptr::read_unaligned(control.as_ptr().add(offset).cast()) };
        let cmsg_len = cmsg.cmsg_len as usize;
        if cmsg_len < header_len || offset + cmsg_len > control.len() {
            break;
        }
        let is_recverr = (cmsg.cmsg_level == libc::SOL_IP && cmsg.cmsg_type == libc::IP_RECVERR)
            || (cmsg.cmsg_level == libc::SOL_IPV6 && cmsg.cmsg_type == libc::IPV6_RECVERR);
        if is_recverr && cmsg_len >= data_offset + err_len {
            // SAFETY: `offset + data_offset + err_len <= offset + cmsg_len
            // <= control.len()`; sock_extended_err is plain old data.
            let err: libc::sock_extended_err = unsafe {
                std::ptr::read_unaligned(control.as_ptr().add(offset + data_offset).cast())
            };
            if err.ee_origin == SO_EE_ORIGIN_ZEROCOPY && err.ee_errno == 0 {
                found.push(Notification {
                    first: err.ee_info,
                    last: err.ee_data,
                    copied: err.ee_code & SO_EE_CODE_ZEROCOPY_COPIED != 0,
                });
            }
        }
        offset += cmsg_len.next_multiple_of(align);
    }
    found
}

#[derive(Clone, Copy, Debug)]
struct InFlight {
    bytes: usize,
    charge: usize,
    done: bool,
}

/// A page channel that sends payloads with `MSG_ZEROCOPY`.
///
/// Use from the channel's sender thread: [`send`](Self::send) per batch,
/// [`flush`](Self::flush) at each iteration sync and before switch-over,
/// [`channel_mut`](Self::channel_mut) for control messages (copied).
#[derive(Debug)]
pub struct ZeroCopySender {
    channel: Channel,
    fd: RawFd,
    index: usize,
    window_bytes: usize,
    max_send_bytes: usize,
    flush_timeout: Duration,
    /// Id the kernel gives the next successful zero-copy `sendmsg`.
    next_id: u32,
    /// Sends not yet popped, with consecutive ids ending at `next_id - 1`.
    in_flight: VecDeque<InFlight>,
    outstanding_sends: usize,
    outstanding_charge: usize,
    outstanding_bytes: u64,
    stats: ZeroCopyStats,
    reap_continuously: bool,
    iovecs: Vec<libc::iovec>,
    call: Vec<libc::iovec>,
    control: Vec<u64>,
}

// SAFETY: the iovec pointers held between calls are scratch only: they are
// rebuilt from the caller's segments at the start of every `send` and never
// dereferenced outside it. Everything else is owned data.
unsafe impl Send for ZeroCopySender {}

impl ZeroCopySender {
    /// Enables `SO_ZEROCOPY` on page channel `index` (1-based, for messages)
    /// and keeps at most `window_bytes` (kernel-charged, see
    /// [`kernel_charge`]) pinned in flight.
    ///
    /// Call when the channel connects, so a refusal fails the migration
    /// before anything is sent. Pass the window to [`check_memlock`](super::check_memlock)
    /// (multiplied by the number of channels) first.
    pub fn enable(
        channel: Channel,
        index: usize,
        window_bytes: usize,
    ) -> Result<Self, ZeroCopyError> {
        if window_bytes < MIN_WINDOW_BYTES {
            return Err(ZeroCopyError::WindowTooSmall {
                window: window_bytes,
                minimum: MIN_WINDOW_BYTES,
            });
        }
        let fd = channel.raw_fd();
        match socket_family(fd) {
            Ok(family) if family == libc::AF_UNIX => {
                return Err(ZeroCopyError::UnixSocket { index });
            }
            Ok(_) => {}
            Err(source) => return Err(ZeroCopyError::Refused { index, source }),
        }
        let one: libc::c_int = 1;
        // SAFETY: `fd` is the channel's open socket; the value is a c_int
        // that outlives the call.
        let result = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                SO_ZEROCOPY,
                (&one as *const libc::c_int).cast(),
                crate::numeric::socklen_of::<libc::c_int>(),
            )
        };
        if result != 0 {
            return Err(ZeroCopyError::Refused {
                index,
                source: io::Error::last_os_error(),
            });
        }
        // One send may use at most a quarter of the window (page-aligned),
        // so its kernel charge always fits once the window has drained.
        let max_send_bytes = (window_bytes / 4) / KERNEL_PAGE * KERNEL_PAGE;
        Ok(Self {
            channel,
            fd,
            index,
            window_bytes,
            max_send_bytes,
            flush_timeout: DEFAULT_FLUSH_TIMEOUT,
            next_id: 0,
            in_flight: VecDeque::new(),
            outstanding_sends: 0,
            outstanding_charge: 0,
            outstanding_bytes: 0,
            stats: ZeroCopyStats::default(),
            reap_continuously: true,
            iovecs: Vec::new(),
            call: Vec::new(),
            // Room for a few cmsgs of sock_extended_err + sockaddr.
            control: vec![0u64; 32],
        })
    }

    /// How long [`flush`](Self::flush), or a send waiting for window room,
    /// waits for completions before failing.
    pub fn set_flush_timeout(&mut self, timeout: Duration) {
        self.flush_timeout = timeout;
    }

    /// The channel, for copied control messages (sync, end of stream). They
    /// keep their place in the byte stream; no flush is needed for order.
    /// The channel.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// The channel, for control messages (sent with ordinary copies).
    pub fn channel_mut(&mut self) -> &mut Channel {
        &mut self.channel
    }

    /// Flushes, then gives the channel back.
    pub fn into_channel(mut self) -> Result<Channel, ZeroCopyError> {
        self.flush()?;
        Ok(self.channel)
    }

    /// Counters so far.
    pub fn stats(&self) -> ZeroCopyStats {
        self.stats
    }

    /// Zero-copy sends not yet completed.
    pub fn outstanding_sends(&self) -> usize {
        self.outstanding_sends
    }

    /// Kernel-charged bytes of the sends not yet completed.
    pub fn outstanding_charge(&self) -> usize {
        self.outstanding_charge
    }

    /// Sends `header` with an ordinary (copying) send, then the `pages` with
    /// `MSG_ZEROCOPY`, reaping notifications after every `sendmsg`.
    ///
    /// Returns once every byte is queued in the kernel; the pages may still
    /// be read by the kernel afterwards, until their completion arrives
    /// (see [`flush`](Self::flush)).
    ///
    /// # Safety
    /// Every segment must point to `len` readable bytes of mapped memory for
    /// the duration of the call. After the call the kernel holds its own
    /// page references, so unmapping is memory-safe, but the bytes actually
    /// transmitted are those present when the NIC reads them: the caller
    /// must be prepared to resend pages written after this call (guest
    /// memory under a dirty log is; see the module documentation).
    pub unsafe fn send(&mut self, header: &[u8], pages: &[Segment]) -> Result<(), ZeroCopyError> {
        self.iovecs.clear();
        self.iovecs.extend(pages.iter().filter_map(Segment::iovec));
        if !header.is_empty() {
            let more = if self.iovecs.is_empty() {
                0
            } else {
                libc::MSG_MORE
            };
            self.send_copied(header, more)?;
            self.stats.header_bytes += header.len() as u64;
        }
        let mut first = 0;
        let mut enobufs = 0u32;
        while first < self.iovecs.len() {
            // Gather at most `max_send_bytes` into this call.
            self.call.clear();
            let mut budget = self.max_send_bytes;
            for iov in &self.iovecs[first..] {
                if budget == 0 || self.call.len() == libc::UIO_MAXIOV as usize {
                    break;
                }
                let len = iov.iov_len.min(budget);
                self.call.push(libc::iovec {
                    iov_base: iov.iov_base,
                    iov_len: len,
                });
                budget -= len;
            }
            let call_bytes = self.max_send_bytes - budget;
            self.make_room(kernel_charge(call_bytes))?;
            // SAFETY: an all-zero msghdr is a valid empty message.
            let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
            message.msg_iov = self.call.as_mut_ptr();
            message.msg_iovlen = self.call.len();
            // SAFETY: the iovecs point into the caller's segments, readable
            // for the duration of this call (caller's contract), and live
            // until sendmsg returns. MSG_NOSIGNAL turns a closed peer into
            // EPIPE instead of a signal.
            let sent = unsafe {
                libc::sendmsg(self.fd, &message, libc::MSG_ZEROCOPY | libc::MSG_NOSIGNAL)
            };
            if sent < 0 {
                let error = io::Error::last_os_error();
                match error.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::ENOBUFS) => {
                        // No id was consumed. Reap what completed and retry.
                        enobufs += 1;
                        if enobufs > MAX_ENOBUFS_RETRIES {
                            return Err(ZeroCopyError::NoBuffers {
                                index: self.index,
                                retries: enobufs - 1,
                                outstanding: self.outstanding_sends,
                            });
                        }
                        self.stats.enobufs_retries += 1;
                        self.wait_for_notifications(ENOBUFS_WAIT)?;
                        continue;
                    }
                    _ => {
                        return Err(ZeroCopyError::Send {
                            index: self.index,
                            source: error,
                        });
                    }
                }
            }
            enobufs = 0;
            let sent = crate::numeric::syscall_count(sent);
            self.record_send(sent);
            first = crate::transport::advance(&mut self.iovecs, first, sent);
            if self.reap_continuously {
                self.reap()?;
            }
        }
        Ok(())
    }

    /// Waits until every zero-copy send so far has completed: at each
    /// iteration sync and before switch-over.
    pub fn flush(&mut self) -> Result<(), ZeroCopyError> {
        self.reap()?;
        let deadline = Instant::now() + self.flush_timeout;
        while self.outstanding_sends > 0 {
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timeout_error());
            }
            self.wait_for_notifications(deadline - now)?;
        }
        Ok(())
    }

    /// Drains the error queue without blocking; returns how many
    /// notifications were read.
    pub fn reap(&mut self) -> Result<usize, ZeroCopyError> {
        let mut read = 0;
        loop {
            // SAFETY: an all-zero msghdr is a valid empty message.
            let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
            message.msg_control = self.control.as_mut_ptr().cast();
            message.msg_controllen = self.control.len() * std::mem::size_of::<u64>();
            // SAFETY: `message` points to the owned control buffer of the
            // stated length and to no data buffers; the kernel writes at most
            // `msg_controllen` bytes.
            let result = unsafe {
                libc::recvmsg(
                    self.fd,
                    &mut message,
                    libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT,
                )
            };
            if result < 0 {
                let error = io::Error::last_os_error();
                match error.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EAGAIN) => return Ok(read),
                    _ => {
                        return Err(ZeroCopyError::ErrorQueue {
                            index: self.index,
                            source: error,
                        });
                    }
                }
            }
            if message.msg_flags & libc::MSG_CTRUNC != 0 {
                return Err(ZeroCopyError::ErrorQueue {
                    index: self.index,
                    source: io::Error::other("control message truncated"),
                });
            }
            let len = message.msg_controllen;
            // SAFETY: the kernel filled `len <= control.len() * 8` bytes of
            // the control buffer, which is owned and initialised.
            let bytes =
                unsafe { std::slice::from_raw_parts(self.control.as_ptr().cast::<u8>(), len) };
            for notification in parse_notifications(bytes) {
                self.complete(notification)?;
                read += 1;
            }
        }
    }

    /// Sends `bytes` with ordinary copying sends, looping on partial sends.
    fn send_copied(&mut self, bytes: &[u8], flags: libc::c_int) -> Result<(), ZeroCopyError> {
        let mut done = 0;
        while done < bytes.len() {
            let rest = &bytes[done..];
            // SAFETY: `rest` is a live slice of `len` readable bytes.
            let sent = unsafe {
                libc::send(
                    self.fd,
                    rest.as_ptr().cast(),
                    rest.len(),
                    flags | libc::MSG_NOSIGNAL,
                )
            };
            if sent < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(ZeroCopyError::Send {
                    index: self.index,
                    source: error,
                });
            }
            done += crate::numeric::syscall_count(sent);
        }
        Ok(())
    }

    fn record_send(&mut self, bytes: usize) {
        let charge = kernel_charge(bytes);
        self.in_flight.push_back(InFlight {
            bytes,
            charge,
            done: false,
        });
        self.next_id = self.next_id.wrapping_add(1);
        self.outstanding_sends += 1;
        self.outstanding_charge += charge;
        self.outstanding_bytes += bytes as u64;
        self.stats.sends_queued += 1;
        self.stats.zero_copy_bytes += bytes as u64;
        self.stats.max_outstanding_bytes = self
            .stats
            .max_outstanding_bytes
            .max(self.outstanding_charge as u64);
    }

    fn oldest_id(&self) -> u32 {
        #[expect(
            clippy::cast_possible_truncation,
            reason = "ids count modulo 2^32 as the kernel's do; the window bounds the length"
        )]
        let in_flight = self.in_flight.len() as u32;
        self.next_id.wrapping_sub(in_flight)
    }

    fn complete(&mut self, notification: Notification) -> Result<(), ZeroCopyError> {
        self.stats.notifications += 1;
        let oldest = self.oldest_id();
        let start = u64::from(notification.first.wrapping_sub(oldest));
        let count = notification.count();
        if start + count > self.in_flight.len() as u64 {
            return Err(ZeroCopyError::UnknownIds {
                index: self.index,
                first: notification.first,
                last: notification.last,
                oldest,
                in_flight: self.in_flight.len(),
            });
        }
        let range = crate::numeric::saturating_usize(start)
            ..crate::numeric::saturating_usize(start + count);
        for entry in self.in_flight.range_mut(range) {
            if entry.done {
                continue;
            }
            entry.done = true;
            self.outstanding_sends -= 1;
            self.outstanding_charge -= entry.charge;
            self.outstanding_bytes -= entry.bytes as u64;
            self.stats.sends_completed += 1;
            if notification.copied {
                self.stats.sends_copied += 1;
                self.stats.copied_bytes += entry.bytes as u64;
            }
        }
        while self.in_flight.front().is_some_and(|entry| entry.done) {
            self.in_flight.pop_front();
        }
        Ok(())
    }

    /// Blocks until `charge` more bytes fit in the window.
    fn make_room(&mut self, charge: usize) -> Result<(), ZeroCopyError> {
        if self.outstanding_charge + charge <= self.window_bytes {
            return Ok(());
        }
        self.reap()?;
        let deadline = Instant::now() + self.flush_timeout;
        while self.outstanding_sends > 0 && self.outstanding_charge + charge > self.window_bytes {
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timeout_error());
            }
            self.wait_for_notifications(deadline - now)?;
        }
        Ok(())
    }

    /// Waits up to `timeout` for the error queue, then reaps it. Time spent
    /// is accounted as waiting.
    fn wait_for_notifications(&mut self, timeout: Duration) -> Result<usize, ZeroCopyError> {
        let started = Instant::now();
        let result = self.wait_inner(timeout);
        self.stats.wait_seconds += started.elapsed().as_secs_f64();
        result
    }

    fn wait_inner(&mut self, timeout: Duration) -> Result<usize, ZeroCopyError> {
        // POLLERR and POLLHUP are always reported; POLLRDHUP adds the
        // peer's half-close. Nothing else is asked for, so poll wakes only
        // for the error queue or a hang-up.
        let mut poll_fd = libc::pollfd {
            fd: self.fd,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        let millis = libc::c_int::try_from(timeout.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: `poll_fd` is a valid pollfd for the duration of the call.
        let ready = unsafe { libc::poll(&mut poll_fd, 1, millis) };
        if ready < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                return Ok(0);
            }
            return Err(ZeroCopyError::ErrorQueue {
                index: self.index,
                source: error,
            });
        }
        let read = self.reap()?;
        if read == 0 && ready > 0 {
            // Woken without a notification: a pending socket error or a
            // hang-up. Report the error; otherwise avoid spinning.
            if let Some(error) = socket_error(self.fd) {
                return Err(ZeroCopyError::Send {
                    index: self.index,
                    source: error,
                });
            }
            if let Some(unacknowledged) = hung_up_with_unacknowledged(self.fd, poll_fd.revents) {
                return Err(ZeroCopyError::PeerHungUp {
                    index: self.index,
                    outstanding: self.outstanding_sends,
                    unacknowledged,
                });
            }
            // Hung up with everything acknowledged: the notifications are
            // on their way, and poll would return at once again.
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(read)
    }

    fn timeout_error(&self) -> ZeroCopyError {
        ZeroCopyError::CompletionTimeout {
            index: self.index,
            outstanding: self.outstanding_sends,
            bytes: self.outstanding_bytes,
            seconds: self.flush_timeout.as_secs_f64(),
        }
    }
}

fn socket_family(fd: RawFd) -> io::Result<libc::c_int> {
    // SAFETY: an all-zero sockaddr_storage is valid.
    let mut address: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = crate::numeric::socklen_of::<libc::sockaddr_storage>();
    // SAFETY: `address` and `len` are valid for writes and describe a
    // buffer of the stated size.
    let result = unsafe {
        libc::getsockname(
            fd,
            (&mut address as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    if result != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(libc::c_int::from(address.ss_family))
}

fn socket_error(fd: RawFd) -> Option<io::Error> {
    let mut value: libc::c_int = 0;
    let mut len = crate::numeric::socklen_of::<libc::c_int>();
    // SAFETY: `value` and `len` are valid for writes of a c_int.
    let result = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if result != 0 {
        return Some(io::Error::last_os_error());
    }
    (value != 0).then(|| io::Error::from_raw_os_error(value))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::test_support::{
        HangUp, flush_after_hang_up, round_trip as round_trip_with, tcp_pair,
    };
    use super::*;
    use crate::transport::{Address, Listener};

    fn round_trip(window: usize, pages: usize, slow_reader: bool) -> ZeroCopyStats {
        round_trip_with(
            |client| ZeroCopySender::enable(client, 1, window).unwrap(),
            window,
            pages,
            slow_reader,
        )
    }

    #[test]
    fn loopback_round_trip_is_accounted_and_copied() {
        let stats = round_trip(4 << 20, 1024, false);
        assert!(stats.sends_queued >= 1024 / 48);
        assert_eq!(stats.sends_queued, stats.sends_completed);
        // Loopback never sends from the pinned pages: every completion is
        // flagged SO_EE_CODE_ZEROCOPY_COPIED.
        assert_eq!(stats.sends_copied, stats.sends_queued, "{stats:?}");
        assert_eq!(stats.copied_bytes, stats.zero_copy_bytes);
        assert!(stats.notifications >= 1);
        assert!(stats.notifications <= stats.sends_queued);
    }

    fn hung_up(how: HangUp) -> ZeroCopyError {
        let outcome = flush_after_hang_up(
            |client| {
                let mut sender = ZeroCopySender::enable(client, 1, 4 << 20).unwrap();
                sender.set_flush_timeout(Duration::from_secs(120));
                sender
            },
            how,
        );
        outcome.expect_err("sends the peer never acknowledged cannot complete")
    }

    #[test]
    fn a_peer_shutting_down_fails_the_flush_long_before_its_timeout() {
        let error = hung_up(HangUp::PeerShutsDown);
        assert!(
            matches!(error, ZeroCopyError::PeerHungUp { outstanding, unacknowledged, .. }
                if outstanding > 0 && unacknowledged > 0),
            "{error:?}"
        );
        assert!(error.to_string().contains("hung up"), "{error}");
    }

    #[test]
    fn shutting_this_side_down_fails_the_flush_long_before_its_timeout() {
        let error = hung_up(HangUp::LocalShutdown);
        assert!(
            matches!(
                error,
                ZeroCopyError::PeerHungUp { .. } | ZeroCopyError::Send { .. }
            ),
            "{error:?}"
        );
    }

    #[test]
    fn small_window_is_respected_with_a_slow_reader() {
        let stats = round_trip(MIN_WINDOW_BYTES, 2048, true);
        assert_eq!(stats.sends_queued, stats.sends_completed);
        assert_eq!(stats.sends_copied, stats.sends_queued);
        // A batch of 48 pages is charged 50 pages: more than a quarter of
        // the window, so sends are split.
        assert!(stats.sends_queued > 2048 / 48, "{stats:?}");
    }

    #[test]
    fn unix_socket_is_refused_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let address = Address::Unix(dir.path().join("s"));
        let listener = Listener::bind(&address).unwrap();
        let client = Channel::connect(&address, Duration::from_secs(1)).unwrap();
        let _server = listener.accept_timeout(Duration::from_secs(1)).unwrap();
        let error = ZeroCopySender::enable(client, 3, 1 << 20).unwrap_err();
        assert!(matches!(error, ZeroCopyError::UnixSocket { index: 3 }));
        let message = error.to_string();
        assert!(message.contains("zero_copy") && message.contains("unix:"));
        assert!(message.contains("channel 3"));
    }

    #[test]
    fn tiny_window_is_refused() {
        let (client, _server) = tcp_pair();
        let error = ZeroCopySender::enable(client, 1, 4096).unwrap_err();
        assert!(matches!(error, ZeroCopyError::WindowTooSmall { .. }));
    }

    /// first, last)`.
    fn control(entries: &[(i32, i32, u8, u8, u32, u32)]) -> Vec<u8> {
        let align = std::mem::size_of::<usize>();
        let header = std::mem::size_of::<libc::cmsghdr>().next_multiple_of(align);
        let err = std::mem::size_of::<libc::sock_extended_err>();
        let mut bytes = Vec::new();
        for &(level, kind, origin, code, first, last) in entries {
            let start = bytes.len();
            bytes.resize(start + (header + err).next_multiple_of(align), 0);
            // SAFETY: an all-zero cmsghdr is valid.
            let mut cmsg: libc::cmsghdr = unsafe { std::mem::zeroed() };
            cmsg.cmsg_len = (header + err) as _;
            cmsg.cmsg_level = level;
            cmsg.cmsg_type = kind;
            let ee = libc::sock_extended_err {
                ee_errno: 0,
                ee_origin: origin,
                ee_type: 0,
                ee_code: code,
                ee_pad: 0,
                ee_info: first,
                ee_data: last,
            };
            // SAFETY: both writes stay inside the bytes just resized.
            unsafe {
                std::ptr::write_unaligned(bytes.as_mut_ptr().add(start).cast(), cmsg);
                std::ptr::write_unaligned(bytes.as_mut_ptr().add(start + header).cast(), ee);
            }
        }
        bytes
    }

    #[test]
    fn parses_crafted_notifications() {
        let bytes = control(&[
            (
                libc::SOL_IP,
                libc::IP_RECVERR,
                SO_EE_ORIGIN_ZEROCOPY,
                0,
                0,
                9,
            ),
            // A timestamp-like error of another origin is skipped.
            (libc::SOL_IP, libc::IP_RECVERR, 4, 0, 100, 100),
            (
                libc::SOL_IPV6,
                libc::IPV6_RECVERR,
                SO_EE_ORIGIN_ZEROCOPY,
                SO_EE_CODE_ZEROCOPY_COPIED,
                u32::MAX - 1,
                2,
            ),
        ]);
        let found = parse_notifications(&bytes);
        assert_eq!(
            found,
            [
                Notification {
                    first: 0,
                    last: 9,
                    copied: false
                },
                Notification {
                    first: u32::MAX - 1,
                    last: 2,
                    copied: true
                },
            ]
        );
        assert_eq!(found[0].count(), 10);
        assert_eq!(found[1].count(), 5);
        // Truncated buffers yield what is complete, and never panic.
        for cut in 0..bytes.len() {
            assert!(parse_notifications(&bytes[..cut]).len() <= 2);
        }
        assert!(parse_notifications(&[]).is_empty());
    }

    #[test]
    fn completion_ranges_wrap_and_come_out_of_order() {
        let (client, _server) = tcp_pair();
        let mut sender = ZeroCopySender::enable(client, 2, 1 << 20).unwrap();
        // Pretend the socket has already used almost all 2^32 ids.
        sender.next_id = u32::MAX - 2;
        for _ in 0..6 {
            sender.record_send(8192);
        }
        // Ids in flight: MAX-2, MAX-1, MAX, 0, 1, 2.
        assert_eq!(sender.oldest_id(), u32::MAX - 2);
        assert_eq!(sender.outstanding_charge(), 6 * kernel_charge(8192));
        sender
            .complete(Notification {
                first: u32::MAX,
                last: 1,
                copied: true,
            })
            .unwrap();
        assert_eq!(sender.outstanding_sends(), 3);
        assert_eq!(sender.in_flight.len(), 6, "the oldest is still pending");
        sender
            .complete(Notification {
                first: u32::MAX - 2,
                last: u32::MAX - 1,
                copied: false,
            })
            .unwrap();
        assert_eq!(sender.in_flight.len(), 1);
        assert_eq!(sender.oldest_id(), 2);
        // Ids that were never sent (or already popped) are an error.
        let error = sender
            .complete(Notification {
                first: 1,
                last: 3,
                copied: false,
            })
            .unwrap_err();
        assert!(matches!(error, ZeroCopyError::UnknownIds { .. }), "{error}");
        sender
            .complete(Notification {
                first: 2,
                last: 2,
                copied: false,
            })
            .unwrap();
        let stats = sender.stats();
        assert_eq!(stats.sends_queued, 6);
        assert_eq!(stats.sends_completed, 6);
        assert_eq!(stats.sends_copied, 3);
        assert_eq!(stats.copied_bytes, 3 * 8192);
        assert_eq!(sender.outstanding_sends(), 0);
        assert_eq!(sender.outstanding_charge(), 0);
    }
}

/// ENOBUFS from the locked-memory limit, provoked for real in a child
/// process (the limit is process-wide, the capability per thread).
#[cfg(test)]
mod enobufs_tests {
    use super::super::{CAP_IPC_LOCK, check_memlock};
    use super::*;
    use crate::transport::{Address, Listener};

    const CHILD_ENV: &str = "TERN_ZEROCOPY_ENOBUFS_CHILD";

    #[repr(C)]
    struct CapHeader {
        version: u32,
        pid: libc::c_int,
    }

    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct CapData {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }

    /// Drops CAP_IPC_LOCK from this thread's effective set.
    fn drop_cap_ipc_lock() {
        let mut header = CapHeader {
            version: 0x2008_0522,
            pid: 0,
        };
        let mut data = [CapData::default(); 2];
        // SAFETY: capget writes one header and two data structs, as sized.
        let result = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
        assert_eq!(result, 0, "capget: {}", io::Error::last_os_error());
        data[0].effective &= !(1 << CAP_IPC_LOCK);
        // SAFETY: capset reads the same structures.
        let result = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
        assert_eq!(result, 0, "capset: {}", io::Error::last_os_error());
    }

    /// The child: a memlock limit that holds one send but not two.
    #[test]
    #[ignore = "run by `enobufs_is_reaped_and_retried` in a child process"]
    fn enobufs_child() {
        if std::env::var_os(CHILD_ENV).is_none() {
            return;
        }
        // SAFETY: an all-zero rlimit is valid.
        let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: `limit` is valid for writes.
        let result = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
        assert_eq!(result, 0);
        // Lowering only the soft limit needs no privilege.
        limit.rlim_cur = 100 * 1024;
        // SAFETY: `limit` is a valid rlimit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) }, 0);
        drop_cap_ipc_lock();
        assert!(check_memlock(MIN_WINDOW_BYTES).is_err());

        let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap();
        let address = listener.local_address().unwrap();
        let client = Channel::connect(&address, Duration::from_secs(5)).unwrap();
        let mut server = listener.accept_timeout(Duration::from_secs(5)).unwrap();
        let total = 32usize << 20;
        let reader = std::thread::spawn(move || {
            let mut buffer = vec![0u8; 1 << 20];
            let mut sum = 0u64;
            for _ in 0..total / buffer.len() {
                server.read_exact(&mut buffer).unwrap();
                sum += buffer.iter().map(|&b| u64::from(b)).sum::<u64>();
            }
            sum
        });
        let memory: Vec<u8> = (0..4usize << 20)
            .map(|i| crate::numeric::low_byte(i as u64 % 251))
            .collect();
        let mut sender = ZeroCopySender::enable(client, 1, MIN_WINDOW_BYTES).unwrap();
        for _ in 0..total / memory.len() {
            for piece in memory.chunks(64 * 1024) {
                let segment = Segment {
                    ptr: piece.as_ptr(),
                    len: piece.len(),
                };
                // SAFETY: `memory` outlives the sender, flushed below.
                unsafe { sender.send(&[], &[segment]) }.unwrap();
            }
        }
        sender.flush().unwrap();
        let stats = sender.stats();
        let expected: u64 =
            memory.iter().map(|&b| u64::from(b)).sum::<u64>() * (total / memory.len()) as u64;
        assert_eq!(
            tern_test_skip::wait::join_within(reader, "the reader"),
            expected
        );
        assert_eq!(stats.sends_queued, stats.sends_completed);
        // Two sends in flight (2 x 72 KiB charged) exceed the 100 KiB limit.
        assert!(stats.enobufs_retries > 0, "{stats:?}");
        println!("ENOBUFS-STATS {stats:?}");
    }

    #[test]
    fn enobufs_is_reaped_and_retried() {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "transport::zerocopy::msg::enobufs_tests::enobufs_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "child failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let line = stdout
            .lines()
            .find(|line| line.contains("ENOBUFS-STATS"))
            .expect("the child ran");
        println!("{line}");
    }
}

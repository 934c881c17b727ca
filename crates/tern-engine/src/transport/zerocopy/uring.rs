//! Zero-copy sends through io_uring: `IORING_OP_SENDMSG_ZC` with
//! `IORING_SEND_ZC_REPORT_USAGE`, the same shape and accounting as the
//! `MSG_ZEROCOPY` sender in [`super::msg`].
//!
//! # How it works
//! A page batch goes out as **one** `SENDMSG_ZC` request per piece of at most
//! a quarter of the window: the header, copied into a buffer the sender owns
//! (the caller may reuse its header buffer as soon as `send` returns, and the
//! kernel reads zero-copy bytes later), followed by the page iovecs straight
//! from guest memory. Each request produces two completions with the
//! request's `user_data`:
//!
//! * the **result** CQE: bytes sent (or `-errno`), with `IORING_CQE_F_MORE`
//!   set when a notification will follow. A short send is resubmitted from
//!   where it stopped (`MSG_WAITALL` makes the kernel retry internally first,
//!   so that is rare);
//! * the **notification** CQE (`IORING_CQE_F_NOTIF`), once the kernel no
//!   longer references the pages. With `IORING_SEND_ZC_REPORT_USAGE` its `res`
//!   has `IORING_NOTIF_USAGE_ZC_COPIED` set when the kernel copied after all
//!   (always the case on loopback).
//!
//! [`UringZeroCopySender::send`] returns once every byte is queued (all
//! result CQEs seen), like `sendmsg`; notifications are reaped from the
//! completion queue after every request, the kernel-charged in-flight bytes
//! stay within the window (the sender waits for notifications before a
//! request that would exceed it), and [`UringZeroCopySender::flush`] waits
//! for every notification. The counters are the same [`ZeroCopyStats`] as the
//! `MSG_ZEROCOPY` sender's; `header_bytes` counts header bytes, which here are
//! copied into a sender-owned buffer and sent in the same request.
//!
//! io_uring ignores `SO_SNDTIMEO`, so waiting for a result is bounded by the
//! flush timeout instead. A ring wait is not woken by the socket hanging up,
//! so every wait is cut into slices of [`HANG_UP_CHECK_INTERVAL`] and the
//! socket is polled between them: a hang-up with unacknowledged bytes fails
//! within one slice ([`ZeroCopyError::PeerHungUp`]).
//!
//! Why later guest writes are harmless is explained in [`crate::transport::zerocopy`];
//! the same argument holds here.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use io_uring::types::{CancelBuilder, SubmitArgs, Timespec};
use io_uring::{IoUring, Probe, cqueue, opcode, types};

use crate::transport::zerocopy::{
    DEFAULT_FLUSH_TIMEOUT, HANG_UP_CHECK_INTERVAL, MIN_WINDOW_BYTES, ZeroCopyError, ZeroCopyStats,
    hung_up_with_unacknowledged, kernel_charge, socket_events,
};
use crate::transport::{Channel, Segment};

/// `IORING_SEND_ZC_REPORT_USAGE` (Linux 6.2): the notification tells whether
/// the kernel copied.
pub const IORING_SEND_ZC_REPORT_USAGE: u16 = 1 << 3;
/// `IORING_NOTIF_USAGE_ZC_COPIED`: bit in a notification's `res`.
pub const IORING_NOTIF_USAGE_ZC_COPIED: u32 = 1 << 31;
/// Page size of the kernel's accounting.
const KERNEL_PAGE: usize = 4096;
/// Submission queue depth: one send request (plus a cancel) at a time.
const SQ_ENTRIES: u32 = 8;
/// Completion queue size: room for many notifications between reaps.
const CQ_ENTRIES: u32 = 1024;
/// `user_data` of cancel requests (never a send id).
const CANCEL_USER_DATA: u64 = u64::MAX;
/// Where the administrator switches io_uring off (Linux 6.6).
const DISABLED_SYSCTL: &str = "/proc/sys/kernel/io_uring_disabled";

/// Decides whether `SENDMSG_ZC` can be used, from what was observed: the
/// result of creating a ring and probing it (`Ok(supported)` when the probe
/// ran), and the content of `kernel.io_uring_disabled` if readable.
pub fn availability(
    probe: Result<bool, io::Error>,
    disabled_sysctl: Option<&str>,
) -> Result<(), ZeroCopyError> {
    let disabled = disabled_sysctl.map(str::trim).unwrap_or("0");
    let reason = match probe {
        Ok(true) => return Ok(()),
        Ok(false) => "the kernel's io_uring does not support IORING_OP_SENDMSG_ZC (needs \
             Linux ≥ 6.1, and ≥ 6.2 for IORING_SEND_ZC_REPORT_USAGE); use \
             zero_copy_backend = msg"
            .to_string(),
        Err(error) if disabled != "0" => format!(
            "io_uring is disabled on this host (kernel.io_uring_disabled = {disabled}: {error}); \
             set the sysctl to 0 (or to 1 and add this user to kernel.io_uring_group), or use \
             zero_copy_backend = msg"
        ),
        Err(error) if error.raw_os_error() == Some(libc::ENOSYS) => {
            format!("the kernel has no io_uring ({error}); use zero_copy_backend = msg")
        }
        Err(error) if error.raw_os_error() == Some(libc::EPERM) => format!(
            "creating an io_uring instance was refused ({error}): a seccomp filter or \
             container policy may block io_uring; use zero_copy_backend = msg"
        ),
        Err(error) => format!("creating an io_uring instance failed ({error})"),
    };
    Err(ZeroCopyError::UringUnavailable { reason })
}

/// Probes the running kernel; `Ok` when `SENDMSG_ZC` can be used.
pub fn check_available() -> Result<(), ZeroCopyError> {
    let probe = IoUring::new(2).and_then(|ring| {
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        Ok(probe.is_supported(opcode::SendMsgZc::CODE))
    });
    let sysctl = std::fs::read_to_string(DISABLED_SYSCTL).ok();
    availability(probe, sysctl.as_deref())
}

#[derive(Debug)]
struct Request {
    /// Header bytes at the start of this request's iovecs.
    header: usize,
    /// Page payload bytes sent by this request (header bytes excluded),
    /// known from the result CQE.
    payload: usize,
    /// The notification said the kernel copied.
    copied: bool,
    /// Kernel charge reserved for this request.
    charge: usize,
    /// The result CQE has not arrived yet.
    result_pending: bool,
    /// The notification CQE has not arrived yet (and will).
    notification_pending: bool,
    /// Header buffer to recycle when this request is popped.
    buffer: Option<Vec<u8>>,
}

impl Request {
    fn done(&self) -> bool {
        !self.result_pending && !self.notification_pending
    }
}

/// A page channel that sends payloads with io_uring `SENDMSG_ZC`.
///
/// Use like [`crate::transport::zerocopy::ZeroCopySender`]: [`send`](Self::send) per
/// batch, [`flush`](Self::flush) at each iteration sync and before
/// switch-over, [`channel_mut`](Self::channel_mut) for (copied) control
/// messages after a flush.
pub struct UringZeroCopySender {
    channel: Channel,
    fd: RawFd,
    index: usize,
    ring: IoUring,
    window_bytes: usize,
    max_send_bytes: usize,
    flush_timeout: Duration,
    /// `user_data` of the next request; requests in `in_flight` have
    /// consecutive ids ending at `next_id - 1`.
    next_id: u64,
    in_flight: VecDeque<Request>,
    /// Requests whose notification is pending.
    outstanding_sends: usize,
    outstanding_charge: usize,
    outstanding_bytes: u64,
    stats: ZeroCopyStats,
    header_pool: Vec<Vec<u8>>,
    iovecs: Vec<libc::iovec>,
    call: Vec<libc::iovec>,
    message: libc::msghdr,
    completions: Vec<(u64, i32, u32)>,
}

impl std::fmt::Debug for UringZeroCopySender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringZeroCopySender")
            .field("index", &self.index)
            .field("window_bytes", &self.window_bytes)
            .field("outstanding_sends", &self.outstanding_sends)
            .field("outstanding_charge", &self.outstanding_charge)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

// SAFETY: the iovec and msghdr pointers held between calls are scratch only:
// they are rebuilt at the start of every request and not used by the kernel
// after the request's result CQE, which `send` waits for. The ring and the
// header buffers are owned; the ring is not created with SINGLE_ISSUER, so
// it may be used from another thread than the one that created it.
unsafe impl Send for UringZeroCopySender {}

impl UringZeroCopySender {
    /// Sets up an io_uring instance for page channel `index` (1-based, for
    /// messages) that keeps at most `window_bytes` (kernel-charged, see
    /// [`kernel_charge`]) in flight.
    ///
    /// Fails with "io_uring SENDMSG_ZC is not available: …" when io_uring is
    /// disabled or the kernel lacks the opcode. Call when the channel
    /// connects; check `RLIMIT_MEMLOCK` with
    /// [`check_memlock`](crate::transport::zerocopy::check_memlock) first, as for the
    /// `MSG_ZEROCOPY` sender.
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
        // SAFETY: an all-zero sockaddr_storage is valid.
        let mut address: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = crate::numeric::socklen_of::<libc::sockaddr_storage>();
        // SAFETY: `address` and `len` describe a writable buffer of that size.
        let result = unsafe {
            libc::getsockname(
                fd,
                (&mut address as *mut libc::sockaddr_storage).cast(),
                &mut len,
            )
        };
        if result != 0 {
            return Err(ZeroCopyError::Refused {
                index,
                source: io::Error::last_os_error(),
            });
        }
        if libc::c_int::from(address.ss_family) == libc::AF_UNIX {
            return Err(ZeroCopyError::UnixSocket { index });
        }
        let built = IoUring::builder()
            .setup_cqsize(CQ_ENTRIES)
            .setup_coop_taskrun()
            .build(SQ_ENTRIES)
            .or_else(|_| {
                IoUring::builder()
                    .setup_cqsize(CQ_ENTRIES)
                    .build(SQ_ENTRIES)
            });
        let sysctl = std::fs::read_to_string(DISABLED_SYSCTL).ok();
        let ring = match built {
            Ok(ring) => ring,
            Err(error) => {
                availability(Err(error), sysctl.as_deref())?;
                unreachable!("availability accepts no error");
            }
        };
        let mut probe = Probe::new();
        let supported = ring
            .submitter()
            .register_probe(&mut probe)
            .map(|()| probe.is_supported(opcode::SendMsgZc::CODE));
        availability(supported, sysctl.as_deref())?;
        Ok(Self {
            channel,
            fd,
            index,
            ring,
            window_bytes,
            max_send_bytes: (window_bytes / 4) / KERNEL_PAGE * KERNEL_PAGE,
            flush_timeout: DEFAULT_FLUSH_TIMEOUT,
            next_id: 0,
            in_flight: VecDeque::new(),
            outstanding_sends: 0,
            outstanding_charge: 0,
            outstanding_bytes: 0,
            stats: ZeroCopyStats::default(),
            header_pool: Vec::new(),
            iovecs: Vec::new(),
            call: Vec::new(),
            // SAFETY: an all-zero msghdr is a valid empty message.
            message: unsafe { std::mem::zeroed() },
            completions: Vec::new(),
        })
    }

    /// How long [`flush`](Self::flush), a send waiting for window room, or a
    /// request waiting for its result may wait before failing.
    pub fn set_flush_timeout(&mut self, timeout: Duration) {
        self.flush_timeout = timeout;
    }

    /// The channel.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// The channel, for control messages (sent with ordinary copies).
    /// Nothing is mid-request between calls, so the byte stream stays
    /// ordered; flush first if the peer must have everything before them.
    pub fn channel_mut(&mut self) -> &mut Channel {
        &mut self.channel
    }

    /// Flushes, then gives the channel back.
    pub fn into_channel(mut self) -> Result<Channel, ZeroCopyError> {
        self.flush()?;
        let channel = self
            .channel
            .try_clone()
            .map_err(|error| ZeroCopyError::Ring {
                index: self.index,
                source: io::Error::other(error),
            })?;
        Ok(channel)
    }

    /// Counters so far.
    pub fn stats(&self) -> ZeroCopyStats {
        self.stats
    }

    /// Requests whose notification has not arrived.
    pub fn outstanding_sends(&self) -> usize {
        self.outstanding_sends
    }

    /// Kernel-charged bytes of the requests not yet notified.
    pub fn outstanding_charge(&self) -> usize {
        self.outstanding_charge
    }

    /// Sends `header` (copied into a sender-owned buffer) and the `pages`
    /// (zero-copy) with `SENDMSG_ZC` requests, reaping notifications after
    /// each.
    ///
    /// Returns once every byte is queued in the kernel; the pages may still
    /// be read afterwards, until their notification arrives (see
    /// [`flush`](Self::flush)).
    ///
    /// # Safety
    /// As for [`crate::transport::zerocopy::ZeroCopySender::send`]: every segment must
    /// point to `len` readable bytes of mapped memory for the duration of
    /// the call, and the caller must be prepared to resend pages written
    /// after it.
    pub unsafe fn send(&mut self, header: &[u8], pages: &[Segment]) -> Result<(), ZeroCopyError> {
        let header_buffer = if header.is_empty() {
            None
        } else {
            let mut buffer = self.header_pool.pop().unwrap_or_default();
            buffer.clear();
            buffer.extend_from_slice(header);
            Some(buffer)
        };
        self.iovecs.clear();
        if let Some(buffer) = &header_buffer {
            self.iovecs.push(libc::iovec {
                iov_base: buffer.as_ptr() as *mut libc::c_void,
                iov_len: buffer.len(),
            });
        }
        self.iovecs.extend(pages.iter().filter_map(Segment::iovec));
        let first_id = self.next_id;
        let result = self.send_iovecs(header.len());
        // The header buffer must outlive every request that references it.
        // Requests are popped from the front only, so attaching it to the
        // batch's last request keeps it until all of them are done.
        if let Some(buffer) = header_buffer {
            match self.in_flight.back_mut() {
                Some(last) if self.next_id > first_id && !last.done() => last.buffer = Some(buffer),
                _ => self.header_pool.push(buffer),
            }
        }
        result
    }

    fn send_iovecs(&mut self, mut header_left: usize) -> Result<(), ZeroCopyError> {
        let mut first = 0;
        while first < self.iovecs.len() {
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
            let charge = kernel_charge(call_bytes);
            self.make_room(charge)?;
            let sent = self.submit_and_await(charge, header_left)?;
            let header_part = sent.min(header_left);
            header_left -= header_part;
            self.stats.header_bytes += header_part as u64;
            first = crate::transport::advance(&mut self.iovecs, first, sent);
        }
        Ok(())
    }

    /// Submits one request for `self.call` and waits for its result CQE;
    /// returns the bytes sent.
    fn submit_and_await(&mut self, charge: usize, header: usize) -> Result<usize, ZeroCopyError> {
        self.message.msg_iov = self.call.as_mut_ptr();
        self.message.msg_iovlen = self.call.len();
        let id = self.next_id;
        let entry = opcode::SendMsgZc::new(types::Fd(self.fd), &self.message)
            .ioprio(IORING_SEND_ZC_REPORT_USAGE)
            .flags((libc::MSG_NOSIGNAL | libc::MSG_WAITALL) as u32)
            .build()
            .user_data(id);
        // SAFETY: the msghdr and iovecs live in `self` and are not touched
        // until the request's result CQE has been seen (waited for below, or
        // cancelled on drop); the data they point to is the caller's
        // (readable for the duration of `send`) or an owned header buffer
        // kept until the notification.
        unsafe { self.ring.submission().push(&entry) }.map_err(|_| ZeroCopyError::Ring {
            index: self.index,
            source: io::Error::other("submission queue full"),
        })?;
        self.next_id += 1;
        self.in_flight.push_back(Request {
            header,
            payload: 0,
            copied: false,
            charge,
            result_pending: true,
            notification_pending: true,
            buffer: None,
        });
        self.outstanding_sends += 1;
        self.outstanding_charge += charge;
        self.stats.max_outstanding_bytes = self
            .stats
            .max_outstanding_bytes
            .max(self.outstanding_charge as u64);
        let deadline = Instant::now() + self.flush_timeout;
        let mut result = None;
        while result.is_none() {
            self.enter(1, deadline, false)?;
            result = self.drain(Some(id))?;
        }
        let (res, more) = result.expect("loop ends with a result");
        if res < 0 {
            let error = io::Error::from_raw_os_error(-res);
            let error = if res == -libc::EINVAL {
                io::Error::new(
                    error.kind(),
                    format!(
                        "{error} (IORING_SEND_ZC_REPORT_USAGE needs Linux ≥ 6.2; use \
                         zero_copy_backend = msg)"
                    ),
                )
            } else {
                error
            };
            return Err(ZeroCopyError::Send {
                index: self.index,
                source: error,
            });
        }
        if res == 0 && !more {
            return Err(ZeroCopyError::Send {
                index: self.index,
                source: io::Error::new(io::ErrorKind::WriteZero, "SENDMSG_ZC sent nothing"),
            });
        }
        Ok(usize::try_from(res).unwrap_or(0))
    }

    /// Waits until every request so far has been notified: at each
    /// iteration sync and before switch-over.
    pub fn flush(&mut self) -> Result<(), ZeroCopyError> {
        self.drain(None)?;
        let deadline = Instant::now() + self.flush_timeout;
        while !self.in_flight.is_empty() {
            self.enter(1, deadline, true)?;
            self.drain(None)?;
        }
        Ok(())
    }

    /// Processes the completions already in the queue, without blocking;
    /// returns how many notifications were read.
    pub fn reap(&mut self) -> Result<usize, ZeroCopyError> {
        let before = self.stats.notifications;
        self.drain(None)?;
        Ok(crate::numeric::saturating_usize(
            self.stats.notifications - before,
        ))
    }

    /// Blocks until `charge` more bytes fit in the window.
    fn make_room(&mut self, charge: usize) -> Result<(), ZeroCopyError> {
        self.drain(None)?;
        let deadline = Instant::now() + self.flush_timeout;
        while self.outstanding_sends > 0 && self.outstanding_charge + charge > self.window_bytes {
            self.enter(1, deadline, true)?;
            self.drain(None)?;
        }
        Ok(())
    }

    /// Submits pending entries and waits for `want` completions or the
    /// deadline; `waiting` accounts the time in `wait_seconds`.
    fn enter(
        &mut self,
        want: usize,
        deadline: Instant,
        waiting: bool,
    ) -> Result<(), ZeroCopyError> {
        self.enter_watching(want, deadline, waiting, true)
    }

    /// [`enter`](Self::enter); `watch_hang_up` false waits out the deadline
    /// even on a hung-up socket (for cancellations, which must be seen).
    fn enter_watching(
        &mut self,
        want: usize,
        deadline: Instant,
        waiting: bool,
        watch_hang_up: bool,
    ) -> Result<(), ZeroCopyError> {
        let started = Instant::now();
        if started >= deadline {
            return Err(self.timeout_error());
        }
        // A ring wait is not woken by a hang-up: wait in slices and look
        // for one between them.
        let timespec = Timespec::from((deadline - started).min(HANG_UP_CHECK_INTERVAL));
        let args = SubmitArgs::new().timespec(&timespec);
        let result = self.ring.submitter().submit_with_args(want, &args);
        if waiting {
            self.stats.wait_seconds += started.elapsed().as_secs_f64();
        }
        match result {
            Ok(_) => Ok(()),
            Err(error) => match error.raw_os_error() {
                Some(libc::EINTR | libc::EBUSY) => Ok(()),
                Some(libc::ETIME) => {
                    if Instant::now() >= deadline {
                        Err(self.timeout_error())
                    } else if watch_hang_up {
                        self.check_hang_up()
                    } else {
                        Ok(())
                    }
                }
                _ => Err(ZeroCopyError::Ring {
                    index: self.index,
                    source: error,
                }),
            },
        }
    }

    /// Handles every completion in the queue; returns the result of request
    /// `wanted` (`res`, `F_MORE`) if it was among them.
    fn drain(&mut self, wanted: Option<u64>) -> Result<Option<(i32, bool)>, ZeroCopyError> {
        self.completions.clear();
        self.completions.extend(
            self.ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result(), cqe.flags())),
        );
        let mut found = None;
        for index in 0..self.completions.len() {
            let (id, res, flags) = self.completions[index];
            if id == CANCEL_USER_DATA {
                continue;
            }
            if cqueue::notif(flags) {
                self.on_notification(id, res)?;
            } else {
                let more = cqueue::more(flags);
                self.on_result(id, res, more)?;
                if Some(id) == wanted {
                    found = Some((res, more));
                }
            }
        }
        while self.in_flight.front().is_some_and(Request::done) {
            let request = self.in_flight.pop_front().expect("front exists");
            if let Some(buffer) = request.buffer {
                self.header_pool.push(buffer);
            }
        }
        Ok(found)
    }

    /// The request in flight a completion names; a completion for any
    /// other is the kernel breaking the ring's contract.
    fn in_flight_request(&mut self, id: u64) -> Result<&mut Request, ZeroCopyError> {
        let oldest = self.next_id - self.in_flight.len() as u64;
        let (index, len) = (self.index, self.in_flight.len());
        id.checked_sub(oldest)
            .and_then(|offset| self.in_flight.get_mut(usize::try_from(offset).ok()?))
            .ok_or_else(|| ZeroCopyError::Ring {
                index,
                source: io::Error::other(format!(
                    "completion for request {id}, but only {len} from {oldest} are in flight"
                )),
            })
    }

    /// Request `id`'s notification: the kernel let go of its pages.
    fn on_notification(&mut self, id: u64, res: i32) -> Result<(), ZeroCopyError> {
        let index = self.index;
        let request = self.in_flight_request(id)?;
        if !request.notification_pending {
            return Err(ZeroCopyError::Ring {
                index,
                source: io::Error::other(format!("second notification for request {id}")),
            });
        }
        request.notification_pending = false;
        request.copied = res.cast_unsigned() & IORING_NOTIF_USAGE_ZC_COPIED != 0;
        let (payload, charge, copied) = (request.payload, request.charge, request.copied);
        self.stats.notifications += 1;
        self.stats.sends_completed += 1;
        if copied {
            self.stats.sends_copied += 1;
            // Before the result CQE the payload is not known yet;
            // the result handler adds it then.
            self.stats.copied_bytes += payload as u64;
        }
        self.outstanding_sends -= 1;
        self.outstanding_charge -= charge;
        self.outstanding_bytes -= payload as u64;
        Ok(())
    }

    /// Request `id`'s result: `res` bytes sent (or an error), and whether a
    /// notification follows (`more`).
    fn on_result(&mut self, id: u64, res: i32, more: bool) -> Result<(), ZeroCopyError> {
        let request = self.in_flight_request(id)?;
        request.result_pending = false;
        let sent = usize::try_from(res).unwrap_or(0);
        let payload = sent - sent.min(request.header);
        request.payload = payload;
        let (pending, copied, charge) =
            (request.notification_pending, request.copied, request.charge);
        if !more {
            // No notification will come (the request failed).
            request.notification_pending = false;
        }
        if more {
            self.stats.sends_queued += 1;
            self.stats.zero_copy_bytes += payload as u64;
            if pending {
                self.outstanding_bytes += payload as u64;
            } else if copied {
                self.stats.copied_bytes += payload as u64;
            }
        } else if pending {
            self.outstanding_sends -= 1;
            self.outstanding_charge -= charge;
        }
        Ok(())
    }

    /// Fails when the socket is hung up with bytes the peer never
    /// acknowledged (see [`hung_up_with_unacknowledged`]).
    fn check_hang_up(&self) -> Result<(), ZeroCopyError> {
        match hung_up_with_unacknowledged(self.fd, socket_events(self.fd)) {
            Some(unacknowledged) => Err(ZeroCopyError::PeerHungUp {
                index: self.index,
                outstanding: self.in_flight.len(),
                unacknowledged,
            }),
            None => Ok(()),
        }
    }

    fn timeout_error(&self) -> ZeroCopyError {
        ZeroCopyError::CompletionTimeout {
            index: self.index,
            outstanding: self.in_flight.len(),
            bytes: self.outstanding_bytes,
            seconds: self.flush_timeout.as_secs_f64(),
        }
    }
}

impl Drop for UringZeroCopySender {
    fn drop(&mut self) {
        // A request still waiting for its result (after a timeout) may read
        // our msghdr and header buffers: cancel it and wait a little.
        if !self.in_flight.iter().any(|request| request.result_pending) {
            return;
        }
        let cancel = opcode::AsyncCancel2::new(CancelBuilder::any())
            .build()
            .user_data(CANCEL_USER_DATA);
        // SAFETY: the cancel request carries no pointers.
        if unsafe { self.ring.submission().push(&cancel) }.is_err() {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(1);
        while self.in_flight.iter().any(|request| request.result_pending)
            && self.enter_watching(1, deadline, false, false).is_ok()
            && self.drain(None).is_ok()
        {}
    }
}

super::impl_zero_copy_transport!(UringZeroCopySender);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::zerocopy::test_support::{
        HangUp, flush_after_hang_up, round_trip as round_trip_with, tcp_pair,
    };
    use crate::transport::{Address, Listener};

    fn round_trip(window: usize, pages: usize, slow_reader: bool) -> ZeroCopyStats {
        round_trip_with(
            |client| UringZeroCopySender::enable(client, 1, window).unwrap(),
            window,
            pages,
            slow_reader,
        )
    }

    fn available() -> bool {
        match check_available() {
            Ok(()) => true,
            Err(error) => {
                tern_test_skip::skip(tern_test_skip::Need::IoUring, error);
                false
            }
        }
    }

    #[test]
    fn loopback_round_trip_is_accounted_and_copied() {
        if !available() {
            return;
        }
        let stats = round_trip(4 << 20, 1024, false);
        assert!(stats.sends_queued >= 1024 / 48);
        assert_eq!(stats.sends_queued, stats.sends_completed);
        assert_eq!(stats.notifications, stats.sends_completed);
        // Loopback always copies: IORING_NOTIF_USAGE_ZC_COPIED on every one.
        assert_eq!(stats.sends_copied, stats.sends_queued, "{stats:?}");
        assert_eq!(stats.copied_bytes, stats.zero_copy_bytes);
    }

    #[test]
    fn a_hang_up_fails_the_flush_long_before_its_timeout() {
        if !available() {
            return;
        }
        for how in [HangUp::PeerShutsDown, HangUp::LocalShutdown] {
            let outcome = flush_after_hang_up(
                |client| {
                    let mut sender = UringZeroCopySender::enable(client, 1, 4 << 20).unwrap();
                    sender.set_flush_timeout(Duration::from_secs(120));
                    sender
                },
                how,
            );
            let error = outcome.expect_err("unacknowledged sends cannot complete");
            assert!(
                matches!(
                    error,
                    ZeroCopyError::PeerHungUp { .. } | ZeroCopyError::Send { .. }
                ),
                "{how:?}: {error:?}"
            );
        }
    }

    #[test]
    fn small_window_is_respected_with_a_slow_reader() {
        if !available() {
            return;
        }
        let stats = round_trip(MIN_WINDOW_BYTES, 2048, true);
        assert_eq!(stats.sends_queued, stats.sends_completed);
        assert_eq!(stats.sends_copied, stats.sends_queued);
        // 48 pages plus a header exceed a quarter of the window: split.
        assert!(stats.sends_queued > 2048 / 48, "{stats:?}");
    }

    #[test]
    fn unix_socket_and_tiny_window_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let address = Address::Unix(dir.path().join("s"));
        let listener = Listener::bind(&address).unwrap();
        let client = Channel::connect(&address, Duration::from_secs(1)).unwrap();
        let _server = listener.accept_timeout(Duration::from_secs(1)).unwrap();
        let error = UringZeroCopySender::enable(client, 3, 1 << 20).unwrap_err();
        assert!(matches!(error, ZeroCopyError::UnixSocket { index: 3 }));
        let (client, _server) = tcp_pair();
        let error = UringZeroCopySender::enable(client, 1, 4096).unwrap_err();
        assert!(matches!(error, ZeroCopyError::WindowTooSmall { .. }));
    }

    #[test]
    fn unavailable_is_explained() {
        assert!(availability(Ok(true), Some("0\n")).is_ok());
        assert!(availability(Ok(true), None).is_ok());
        let message = availability(Ok(false), Some("0")).unwrap_err().to_string();
        assert!(
            message.starts_with("io_uring SENDMSG_ZC is not available: "),
            "{message}"
        );
        assert!(message.contains("6.1") && message.contains("zero_copy_backend = msg"));
        let eperm = || io::Error::from_raw_os_error(libc::EPERM);
        let message = availability(Err(eperm()), Some("2\n"))
            .unwrap_err()
            .to_string();
        assert!(message.starts_with("io_uring SENDMSG_ZC is not available: "));
        assert!(
            message.contains("kernel.io_uring_disabled = 2"),
            "{message}"
        );
        let message = availability(Err(eperm()), Some("0"))
            .unwrap_err()
            .to_string();
        assert!(message.contains("seccomp"), "{message}");
        let enosys = io::Error::from_raw_os_error(libc::ENOSYS);
        let message = availability(Err(enosys), None).unwrap_err().to_string();
        assert!(message.contains("no io_uring"), "{message}");
    }

    #[test]
    fn measurement_helper_runs() {
        if !available() {
            return;
        }
        let measured = crate::transport::zerocopy::measure_cpu_per_gib(
            8 << 20,
            crate::transport::zerocopy::SendMode::UringZeroCopy {
                window_bytes: 1 << 20,
            },
        )
        .unwrap();
        let stats = measured.stats.unwrap();
        assert_eq!(stats.zero_copy_bytes, 8 << 20);
        assert_eq!(stats.sends_completed, stats.sends_queued);
        assert!(measured.sender_cpu_per_gib() > 0.0);
    }
}

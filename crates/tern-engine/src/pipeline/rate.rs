//! The bandwidth cap, shared by every sender without a lock, and changeable
//! while the migration runs (`migrate-set-parameters max-bandwidth`).

use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Serialises the channels' writes to a byte rate without a lock: each
/// packet reserves a time slot with one atomic update and sleeps until it.
/// The rate is read before each packet, so a new cap applies from the next
/// packet; 0 means no cap.
#[derive(Debug)]
pub(super) struct RateLimiter {
    bytes_per_second: Arc<AtomicU64>,
    origin: Instant,
    next_free_ns: AtomicU64,
}

impl RateLimiter {
    pub(super) fn new(bytes_per_second: Arc<AtomicU64>) -> Self {
        Self {
            bytes_per_second,
            origin: Instant::now(),
            next_free_ns: AtomicU64::new(0),
        }
    }

    /// Waits for the slot of a packet of `bytes`.
    pub(super) fn acquire(&self, bytes: u64) {
        let rate = self.bytes_per_second.load(Ordering::Relaxed);
        if rate == 0 {
            return;
        }
        let cost =
            u64::try_from(u128::from(bytes) * 1_000_000_000 / u128::from(rate)).unwrap_or(u64::MAX);
        let now = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let mut slot = self.next_free_ns.load(Ordering::Relaxed);
        loop {
            let start = slot.max(now);
            match self.next_free_ns.compare_exchange_weak(
                slot,
                start.saturating_add(cost),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    slot = start;
                    break;
                }
                Err(current) => slot = current,
            }
        }
        if slot > now {
            thread::sleep(Duration::from_nanos(slot - now));
        }
    }
}

/// What the senders see of the link's queue, for `auto`'s link estimate:
/// the bytes each channel's socket still holds unsent or unacknowledged
/// (`SIOCOUTQ`), read before each packet is written. Counting what was
/// handed to the socket overstates a saturated link whenever its buffers
/// have room (docs/compression.md: 300-560 MB/s estimated for a 125 MB/s
/// link); what left it does not.
#[derive(Debug)]
pub(super) struct LinkQueue {
    unsent: Box<[AtomicU64]>,
    samples: AtomicU64,
    standing: AtomicU64,
    /// Per channel, the kernel's TCP counters at its last sample
    /// (microseconds since the connection opened): time with data in
    /// flight, and of that, time the peer's receive window held it back.
    busy_us: Box<[AtomicU64]>,
    receiver_limited_us: Box<[AtomicU64]>,
}

/// A queue this long when the next packet is written means the link (or
/// the peer) has not caught up with the last ones: it is the bottleneck.
/// Four of loopback's 64 KiB segments; a link that keeps up leaves less.
pub(super) const STANDING_QUEUE_BYTES: u64 = 256 * 1024;

/// The link queue's counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct QueueSamples {
    /// Packets written so far (each sampled the queue before).
    pub samples: u64,
    /// Of those, how many found a standing queue.
    pub standing: u64,
    /// Bytes the channels' sockets held, at each one's last sample.
    pub unsent: u64,
    /// TCP only: the channels' time with data in flight, and the part of
    /// it the peer's receive window was full (the peer did not read as
    /// fast as the link delivered), summed over channels, microseconds.
    pub busy_us: u64,
    pub receiver_limited_us: u64,
}

impl LinkQueue {
    pub(super) fn new(channels: usize) -> Self {
        Self {
            unsent: (0..channels).map(|_| AtomicU64::new(0)).collect(),
            samples: AtomicU64::new(0),
            standing: AtomicU64::new(0),
            busy_us: (0..channels).map(|_| AtomicU64::new(0)).collect(),
            receiver_limited_us: (0..channels).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Reads channel `index`'s socket queue before a packet is written.
    pub(super) fn sample(&self, index: usize, fd: RawFd) {
        let Some(unsent) = socket_unsent(fd) else {
            return;
        };
        if let Some(slot) = self.unsent.get(index) {
            slot.store(unsent, Ordering::Relaxed);
        }
        self.samples.fetch_add(1, Ordering::Relaxed);
        if unsent >= STANDING_QUEUE_BYTES {
            self.standing.fetch_add(1, Ordering::Relaxed);
        }
        if let Some((busy, receiver_limited)) = tcp_busy_and_receiver_limited(fd)
            && let (Some(busy_slot), Some(limited_slot)) =
                (self.busy_us.get(index), self.receiver_limited_us.get(index))
        {
            busy_slot.store(busy, Ordering::Relaxed);
            limited_slot.store(receiver_limited, Ordering::Relaxed);
        }
    }

    pub(super) fn snapshot(&self) -> QueueSamples {
        QueueSamples {
            samples: self.samples.load(Ordering::Relaxed),
            standing: self.standing.load(Ordering::Relaxed),
            unsent: self.unsent.iter().map(|u| u.load(Ordering::Relaxed)).sum(),
            busy_us: self.busy_us.iter().map(|u| u.load(Ordering::Relaxed)).sum(),
            receiver_limited_us: self
                .receiver_limited_us
                .iter()
                .map(|u| u.load(Ordering::Relaxed))
                .sum(),
        }
    }
}

/// A TCP socket's `tcpi_busy_time` and `tcpi_rwnd_limited` (Linux 4.10+,
/// microseconds, counted in jiffies), or `None` for another socket.
fn tcp_busy_and_receiver_limited(fd: RawFd) -> Option<(u64, u64)> {
    // SAFETY: tcp_info is plain integers; all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::tcp_info>()).ok()?;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, a live
    // local of that size, and stores the length it wrote in `len`; a bad
    // descriptor or a socket that is not TCP only fails.
    let result = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::from_mut(&mut info).cast(),
            &mut len,
        )
    };
    // An older kernel fills less: without the two fields, no answer.
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_rwnd_limited) + 8;
    (result == 0 && usize::try_from(len).ok()? >= needed)
        .then_some((info.tcpi_busy_time, info.tcpi_rwnd_limited))
}

/// Bytes a socket holds that the peer has not yet acknowledged (TCP) or
/// read (Unix), or `None` when the kernel does not say.
fn socket_unsent(fd: RawFd) -> Option<u64> {
    let mut unsent: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one int through the pointer, which
    // points at a live local; a bad or closed descriptor only fails.
    let result = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut unsent) };
    (result == 0).then(|| u64::try_from(unsent).unwrap_or(0))
}

/// One decision window as the link saw it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct LinkWindow {
    pub seconds: f64,
    /// Bytes handed to the sockets during the window.
    pub written: u64,
    /// The share of the window's time the senders were busy (0.05..=1).
    pub busy_share: f64,
    pub queue_at_start: QueueSamples,
    pub queue_at_end: QueueSamples,
    /// Whether the window's pages went raw: only then does a peer that
    /// limits count (see [`link_estimate`]).
    pub raw: bool,
}

/// The rate [`link_estimate`] gives a window in which the peer, not the
/// link, set the pace: faster than any codec, so auto sends raw. A codec
/// shortens only the wire's part; where the peer's receive window is full,
/// the peer's work is what takes the time (placing pages: allocating and
/// mapping them), and decoding adds to it. Issue 31: on loopback auto
/// read 53-5195 MB/s from such windows and sent zstd, lz4 and raw in turn.
pub(super) const PEER_BOUND_LINK_RATE: f64 = 1e11;

/// The link's rate as one window shows it, bytes per second. Pure.
///
/// When raw was in force and the channels spent at least half of their
/// busy time waiting for the peer's receive window, the peer was the
/// bottleneck: see [`PEER_BOUND_LINK_RATE`]. Only raw's windows count: on
/// the bench's shaped 1 Gbit/s link, a window at the start of a run (zstd
/// in force, the destination still setting up) was receiver-limited too,
/// and sent raw for 188 ms (10 MiB more) before the link pushed back.
///
/// When at least half of the window's packets found a standing queue, the
/// link was the bottleneck all along and what left the sockets per second
/// is its rate. Otherwise the link had room: it could carry the written
/// bytes in the share of time the senders were busy, which is the estimate
/// (an upper one: a send into a buffer with room returns at once).
pub(super) fn link_estimate(window: &LinkWindow) -> f64 {
    let seconds = window.seconds.max(1e-6);
    if window.raw && peer_bound(window) {
        return PEER_BOUND_LINK_RATE;
    }
    if link_pushed_back(window) {
        let left = window.written as f64 + window.queue_at_start.unsent as f64
            - window.queue_at_end.unsent as f64;
        return left.max(0.0) / seconds;
    }
    written_rate(window) / window.busy_share.clamp(0.05, 1.0)
}

/// Channels' busy time below this in a window says nothing about who
/// limited them (the kernel counts in jiffies, 4 ms at HZ=250).
const PEER_BOUND_MIN_BUSY_US: u64 = 20_000;

/// Whether the peer limited the window: the channels' receive-window-limited
/// time is at least half of their busy time, over enough busy time to
/// count. On a shaped 1 Gbit/s link the share is about 2 %, on loopback with a
/// slower reader 47-91 % (measured with a sender and a reader in Python,
/// 0.5 s each). Pure.
pub(super) fn peer_bound(window: &LinkWindow) -> bool {
    let busy = window
        .queue_at_end
        .busy_us
        .saturating_sub(window.queue_at_start.busy_us);
    let limited = window
        .queue_at_end
        .receiver_limited_us
        .saturating_sub(window.queue_at_start.receiver_limited_us);
    busy >= PEER_BOUND_MIN_BUSY_US && limited * 2 >= busy
}

/// Whether the window measured the link itself: it pushed back (a standing
/// queue), and not because the peer did not read (whatever the codec: on
/// loopback a destination still setting up makes a queue stand at the
/// rate it reads, which says nothing of the link). Pure.
pub(super) fn link_measured(window: &LinkWindow) -> bool {
    !peer_bound(window) && link_pushed_back(window)
}

/// What the window handed to the sockets per second. Pure.
pub(super) fn written_rate(window: &LinkWindow) -> f64 {
    window.written as f64 / window.seconds.max(1e-6)
}

/// Whether the link (or the peer) pushed back during the window: at least
/// half of its packets, and four or more, found a standing queue in their
/// socket. Pure.
fn link_pushed_back(window: &LinkWindow) -> bool {
    let samples = window
        .queue_at_end
        .samples
        .saturating_sub(window.queue_at_start.samples);
    let standing = window
        .queue_at_end
        .standing
        .saturating_sub(window.queue_at_start.standing);
    samples >= 4 && standing * 2 >= samples
}

#[cfg(test)]
mod tests {
    use super::{LinkWindow, QueueSamples, RateLimiter, link_estimate, link_pushed_back};

    #[test]
    fn a_standing_queue_measures_what_left_the_sockets() {
        // A 1 Gbit/s link: 20 MB written in 100 ms, all sends quick (the
        // buffers had room), but the queue grew by 7.5 MB and stood.
        let saturated = LinkWindow {
            raw: false,
            seconds: 0.1,
            written: 20_000_000,
            busy_share: 0.2,
            queue_at_start: QueueSamples {
                samples: 100,
                standing: 90,
                unsent: 1_000_000,
                ..QueueSamples::default()
            },
            queue_at_end: QueueSamples {
                samples: 140,
                standing: 130,
                unsent: 8_500_000,
                ..QueueSamples::default()
            },
        };
        assert_eq!(link_estimate(&saturated), 125_000_000.0);
        assert!(link_pushed_back(&saturated));
        // The blocked-time estimate would have been 1 GB/s.
        let room = LinkWindow {
            queue_at_end: QueueSamples {
                standing: 100,
                ..saturated.queue_at_end
            },
            ..saturated
        };
        assert_eq!(link_estimate(&room), 1_000_000_000.0);
        assert!(!link_pushed_back(&room));
    }
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A 50 ms window of two channels, busy 90 ms together, of which
    /// `limited_ms` the peer's receive window was full.
    fn window_with_receiver_limited(limited_ms: u64) -> LinkWindow {
        LinkWindow {
            raw: true,
            seconds: 0.05,
            written: 40_000_000,
            busy_share: 0.9,
            queue_at_start: QueueSamples {
                samples: 10,
                busy_us: 1_000_000,
                receiver_limited_us: 500_000,
                ..QueueSamples::default()
            },
            queue_at_end: QueueSamples {
                samples: 90,
                busy_us: 1_090_000,
                receiver_limited_us: 500_000 + limited_ms * 1000,
                ..QueueSamples::default()
            },
        }
    }

    #[test]
    fn a_peer_that_limits_makes_the_link_faster_than_any_codec() {
        // Loopback: the receiver's window was full 60 of 90 busy ms.
        let loopback = window_with_receiver_limited(60);
        assert!(super::peer_bound(&loopback));
        assert_eq!(link_estimate(&loopback), super::PEER_BOUND_LINK_RATE);
        // A shaped link: the window was full 2 ms; the estimate is the
        // written bytes over the busy share, as before.
        let shaped = window_with_receiver_limited(2);
        assert!(!super::peer_bound(&shaped));
        assert_eq!(link_estimate(&shaped), 40_000_000.0 / 0.05 / 0.9);
        // Too little busy time says nothing: 12 of 16 ms.
        let idle = LinkWindow {
            queue_at_end: QueueSamples {
                busy_us: 1_016_000,
                receiver_limited_us: 512_000,
                ..loopback.queue_at_end
            },
            ..loopback
        };
        assert!(!super::peer_bound(&idle));
        // A codec in force: the peer's limit says nothing of the link (a
        // destination still setting up on a slow link); the estimate is
        // the usual one.
        let compressed = LinkWindow {
            raw: false,
            ..loopback
        };
        assert_eq!(link_estimate(&compressed), 40_000_000.0 / 0.05 / 0.9);
    }

    #[test]
    fn the_link_queue_sees_a_peer_that_does_not_read() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut sender = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        // The peer accepts and never reads: its receive window fills.
        let (_peer, _) = listener.accept().unwrap();
        sender.set_nonblocking(true).unwrap();
        let chunk = vec![7u8; 1 << 16];
        while sender.write(&chunk).is_ok() {}
        let queue = super::LinkQueue::new(1);
        tern_test_skip::wait::wait_until("the kernel counts receiver-limited time", || {
            queue.sample(0, sender.as_raw_fd());
            queue.snapshot().receiver_limited_us >= super::PEER_BOUND_MIN_BUSY_US
        });
        let samples = queue.snapshot();
        assert!(
            samples.receiver_limited_us <= samples.busy_us,
            "{samples:?}"
        );
    }

    #[test]
    fn a_tcp_socket_reports_its_busy_and_receiver_limited_time() {
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let sender = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (busy, limited) = super::tcp_busy_and_receiver_limited(sender.as_raw_fd())
            .expect("Linux 4.10+ reports tcpi_busy_time and tcpi_rwnd_limited");
        assert!(limited <= busy, "{limited} of {busy}");
        // Not a TCP socket: no answer.
        let (unix, _) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(super::tcp_busy_and_receiver_limited(unix.as_raw_fd()), None);
    }

    #[test]
    fn rate_limiter_spaces_packets() {
        let limiter = RateLimiter::new(Arc::new(AtomicU64::new(1_000_000)));
        limiter.acquire(10_000);
        limiter.acquire(10_000);
        // Two 10 kB packets at 1 MB/s reserve 20 ms of link time.
        assert!(limiter.next_free_ns.load(Ordering::Relaxed) >= 20_000_000);
    }

    #[test]
    fn a_new_rate_applies_to_the_next_packet_and_zero_lifts_the_cap() {
        let cap = Arc::new(AtomicU64::new(0));
        let limiter = RateLimiter::new(cap.clone());
        limiter.acquire(1 << 30);
        assert_eq!(limiter.next_free_ns.load(Ordering::Relaxed), 0, "no cap");
        cap.store(1_000_000_000, Ordering::Relaxed);
        limiter.acquire(1_000_000);
        let reserved = limiter.next_free_ns.load(Ordering::Relaxed);
        // 1 MB at 1 GB/s: a millisecond of link time after now.
        let now = u64::try_from(limiter.origin.elapsed().as_nanos()).unwrap();
        assert!(
            reserved >= 1_000_000 && reserved <= now + 1_000_000,
            "{reserved}"
        );
    }
}

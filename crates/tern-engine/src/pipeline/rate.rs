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
}

impl LinkQueue {
    pub(super) fn new(channels: usize) -> Self {
        Self {
            unsent: (0..channels).map(|_| AtomicU64::new(0)).collect(),
            samples: AtomicU64::new(0),
            standing: AtomicU64::new(0),
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
    }

    pub(super) fn snapshot(&self) -> QueueSamples {
        QueueSamples {
            samples: self.samples.load(Ordering::Relaxed),
            standing: self.standing.load(Ordering::Relaxed),
            unsent: self.unsent.iter().map(|u| u.load(Ordering::Relaxed)).sum(),
        }
    }
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
}

/// The link's rate as one window shows it, bytes per second. Pure.
///
/// When at least half of the window's packets found a standing queue, the
/// link was the bottleneck all along and what left the sockets per second
/// is its rate. Otherwise the link had room: it could carry the written
/// bytes in the share of time the senders were busy, which is the estimate
/// (an upper one: a send into a buffer with room returns at once).
pub(super) fn link_estimate(window: &LinkWindow) -> f64 {
    let seconds = window.seconds.max(1e-6);
    if link_pushed_back(window) {
        let left = window.written as f64 + window.queue_at_start.unsent as f64
            - window.queue_at_end.unsent as f64;
        return left.max(0.0) / seconds;
    }
    window.written as f64 / seconds / window.busy_share.clamp(0.05, 1.0)
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
            seconds: 0.1,
            written: 20_000_000,
            busy_share: 0.2,
            queue_at_start: QueueSamples {
                samples: 100,
                standing: 90,
                unsent: 1_000_000,
            },
            queue_at_end: QueueSamples {
                samples: 140,
                standing: 130,
                unsent: 8_500_000,
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

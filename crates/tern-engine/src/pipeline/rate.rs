//! The bandwidth cap, shared by every sender without a lock, and changeable
//! while the migration runs (`migrate-set-parameters max-bandwidth`).

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

#[cfg(test)]
mod tests {
    use super::RateLimiter;
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

//! The `max_bandwidth` limit shared by every sender.

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Serialises the channels' writes to a byte rate without a lock: each
/// packet reserves a time slot with one atomic update and sleeps until it.
#[derive(Debug)]
pub(super) struct RateLimiter {
    bytes_per_second: u64,
    origin: Instant,
    next_free_ns: AtomicU64,
}

impl RateLimiter {
    pub(super) fn new(bytes_per_second: u64) -> Self {
        Self {
            bytes_per_second,
            origin: Instant::now(),
            next_free_ns: AtomicU64::new(0),
        }
    }

    pub(super) fn acquire(&self, bytes: u64) {
        let cost =
            u64::try_from(u128::from(bytes) * 1_000_000_000 / u128::from(self.bytes_per_second))
                .unwrap_or(u64::MAX);
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
    use super::*;

    #[test]
    fn rate_limiter_spaces_packets() {
        let limiter = RateLimiter {
            bytes_per_second: 1_000_000,
            origin: Instant::now(),
            next_free_ns: AtomicU64::new(0),
        };
        limiter.acquire(10_000);
        limiter.acquire(10_000);
        // Two 10 kB packets at 1 MB/s reserve 20 ms of link time.
        assert!(limiter.next_free_ns.load(Ordering::Relaxed) >= 20_000_000);
    }
}

//! Bounded lock-free rings between pipeline threads, and the doorbells that
//! wake a thread when there is something for it.
//!
//! The per-page path takes no lock: items move through
//! `crossbeam_queue::ArrayQueue` (a bounded lock-free queue) and a waiting
//! thread sleeps in `thread::park`, woken by `unpark`, which costs a futex
//! call only when the thread really sleeps. A thread announces that it is
//! about to sleep, then looks at its rings once more, so a push that races
//! with the announcement is never missed; a short timeout on the park is a
//! second safety net.

use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::thread::{self, Thread};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;

/// How long a thread spins before it parks.
const SPIN_ROUNDS: u32 = 64;
/// Upper bound on one park, so a lost wakeup costs at most this much.
const PARK_TIMEOUT: Duration = Duration::from_millis(2);

/// Wakes one thread.
#[derive(Debug)]
pub(crate) struct Doorbell {
    thread: Thread,
    sleeping: AtomicBool,
}

impl Doorbell {
    /// A doorbell for the calling thread.
    pub(crate) fn for_current_thread() -> Self {
        Self::new(thread::current())
    }

    /// A doorbell for `thread`, which alone may wait on it.
    pub(crate) fn new(thread: Thread) -> Self {
        Self {
            thread,
            sleeping: AtomicBool::new(false),
        }
    }

    /// Wakes the thread if it sleeps.
    pub(crate) fn ring(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) {
            self.thread.unpark();
        }
    }

    /// Called by the owning thread: returns once `ready()` is true (checked
    /// first while spinning, then between parks).
    pub(crate) fn wait_until(&self, mut ready: impl FnMut() -> bool) {
        for _ in 0..SPIN_ROUNDS {
            if ready() {
                return;
            }
            std::hint::spin_loop();
        }
        loop {
            self.sleeping.store(true, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if ready() {
                self.sleeping.store(false, Ordering::Relaxed);
                return;
            }
            thread::park_timeout(PARK_TIMEOUT);
            self.sleeping.store(false, Ordering::Relaxed);
        }
    }
}

/// A bounded multi-producer multi-consumer lock-free ring.
#[derive(Debug)]
pub(crate) struct Ring<T> {
    queue: ArrayQueue<T>,
}

impl<T> Ring<T> {
    /// A ring holding at most `capacity` items.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            queue: ArrayQueue::new(capacity.max(1)),
        }
    }

    /// Adds an item, or gives it back when the ring is full.
    pub(crate) fn push(&self, item: T) -> Result<(), T> {
        self.queue.push(item)
    }

    /// Takes the oldest item.
    pub(crate) fn pop(&self) -> Option<T> {
        self.queue.pop()
    }

    /// Whether the ring has room for another item.
    pub(crate) fn has_room(&self) -> bool {
        !self.queue.is_full()
    }

    /// Whether the ring is empty.
    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Number of items queued.
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn producer_consumer_moves_every_item_once() {
        let ring = Arc::new(Ring::new(4));
        let doorbell = Arc::new(std::sync::OnceLock::<Doorbell>::new());
        let sum = Arc::new(AtomicU64::new(0));
        let consumer = {
            let ring = ring.clone();
            let doorbell = doorbell.clone();
            let sum = sum.clone();
            thread::spawn(move || {
                let bell = doorbell.get_or_init(Doorbell::for_current_thread);
                let mut received = 0;
                while received < 10_000 {
                    let mut item = None;
                    bell.wait_until(|| {
                        item = ring.pop();
                        item.is_some()
                    });
                    sum.fetch_add(item.unwrap(), Ordering::Relaxed);
                    received += 1;
                }
            })
        };
        tern_test_skip::wait::wait_until("the consumer has its doorbell", || {
            doorbell.get().is_some()
        });
        // A consumer that a ring did not wake stops taking items: the ring
        // stays full and the test fails at the deadline, not spinning.
        let deadline = std::time::Instant::now() + tern_test_skip::wait::DEADLINE;
        for value in 1..=10_000u64 {
            let mut item = value;
            loop {
                match ring.push(item) {
                    Ok(()) => break,
                    Err(back) => {
                        assert!(
                            std::time::Instant::now() < deadline,
                            "the consumer stopped taking items at {value}"
                        );
                        item = back;
                        thread::yield_now();
                    }
                }
            }
            doorbell.get().unwrap().ring();
        }
        tern_test_skip::wait::join_within(consumer, "the consumer");
        assert_eq!(sum.load(Ordering::Relaxed), 10_000 * 10_001 / 2);
    }
}

//! The engine's queues with their health book-keeping, and the round-robin
//! choice of a queue with room for a batch.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tern_page::MAX_BATCH_PAGES;

use crate::queue::DsaQueue;
use crate::select::{NumaPolicy, is_local};

/// A queue with the engine's health book-keeping.
#[derive(Debug)]
pub(super) struct QueueEntry {
    pub(super) queue: Arc<dyn DsaQueue>,
    /// Descriptors in flight (submitted, completion not yet seen), at most
    /// `capacity` on every submission path: a dedicated queue drops what
    /// does not fit without a word, whether fed by MOVDIR64B or by the
    /// kernel's write().
    pub(super) in_flight: AtomicU32,
    capacity: u32,
    /// Whether `capacity` is enforced; only tests lift it, to show what the
    /// bound prevents.
    bounded: bool,
    pub(super) numa_node: Option<u32>,
    pub(super) consecutive_errors: AtomicU32,
    pub(super) disabled: AtomicBool,
    /// Submissions refused for good in a row (reset by an acceptance).
    refusals: AtomicU32,
    /// Nanoseconds after [`Queues::epoch`] before which the queue is
    /// skipped: its back-off after a refusal.
    skip_until: AtomicU64,
}

impl QueueEntry {
    pub(super) fn new(queue: Arc<dyn DsaQueue>, bounded: bool) -> Self {
        QueueEntry {
            capacity: u32::try_from(queue.capacity().max(1)).unwrap_or(u32::MAX),
            bounded,
            numa_node: queue.numa_node(),
            queue,
            in_flight: AtomicU32::new(0),
            consecutive_errors: AtomicU32::new(0),
            disabled: AtomicBool::new(false),
            refusals: AtomicU32::new(0),
            skip_until: AtomicU64::new(0),
        }
    }

    /// The queue accepted a descriptor: its run of refusals is over.
    pub(super) fn accepted(&self) {
        if self.refusals.load(Ordering::Relaxed) != 0 {
            self.refusals.store(0, Ordering::Relaxed);
        }
    }

    /// The queue refused a descriptor for good: skip it for `base` times
    /// 2^(refusals in a row - 1), at most [`MAX_BACKOFF`]. Returns the
    /// refusals in a row.
    pub(super) fn refused(&self, queues: &Queues, base: Duration) -> u32 {
        let n = self.refusals.fetch_add(1, Ordering::Relaxed) + 1;
        let backoff = base
            .saturating_mul(1u32 << (n - 1).min(16))
            .min(MAX_BACKOFF);
        let until = queues.now_nanos().saturating_add(nanos(backoff));
        self.skip_until.fetch_max(until, Ordering::Relaxed);
        n
    }

    /// Whether the queue is backing off at `now` (nanoseconds after the
    /// epoch).
    fn backing_off(&self, now: u64) -> bool {
        self.skip_until.load(Ordering::Relaxed) > now
    }

    /// Reserves up to `wanted` descriptors of room; returns how many (0 when
    /// the queue is full).
    pub(super) fn reserve(&self, wanted: usize) -> u32 {
        let wanted = u32::try_from(wanted).unwrap_or(u32::MAX);
        if !self.bounded {
            self.in_flight.fetch_add(wanted, Ordering::AcqRel);
            return wanted;
        }
        let take = |n: u32| self.capacity.saturating_sub(n).min(wanted);
        match self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (take(n) > 0).then(|| n + take(n))
            }) {
            Ok(before) => take(before),
            Err(_) => 0,
        }
    }
}

/// The longest a refusing queue is skipped before it is tried again.
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(1);

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Room reserved on a queue for (the head of) a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Reservation {
    pub(super) queue: usize,
    /// Descriptors reserved: one per chunk.
    pub(super) chunks: u32,
    /// Pages the chunks carry: the whole batch, or the head that fits.
    pub(super) pages: usize,
}

/// Why no queue took a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NoRoom {
    /// Every usable queue is full.
    Full,
    /// Every queue is disabled (or filtered out).
    Disabled,
}

/// The engine's queues and where the next round-robin pick starts.
#[derive(Debug)]
pub(super) struct Queues {
    pub(super) entries: Vec<QueueEntry>,
    next: AtomicUsize,
    numa: NumaPolicy,
    /// Whether the queues are on different known NUMA nodes, so the
    /// submitter's node is worth asking.
    pub(super) numa_matters: bool,
    /// Origin of the back-off deadlines.
    epoch: Instant,
}

impl Queues {
    pub(super) fn new(entries: Vec<QueueEntry>, numa: NumaPolicy) -> Self {
        let first_node = entries.first().and_then(|q| q.numa_node);
        let numa_matters = numa == NumaPolicy::PreferLocal
            && entries
                .iter()
                .any(|q| q.numa_node.is_some() && q.numa_node != first_node);
        Queues {
            entries,
            next: AtomicUsize::new(0),
            numa,
            numa_matters,
            epoch: Instant::now(),
        }
    }

    /// Nanoseconds since the epoch, on the monotonic clock.
    fn now_nanos(&self) -> u64 {
        nanos(self.epoch.elapsed())
    }

    /// Reserves room for up to `len` pages on the next enabled queue with
    /// any room, round-robin; with [`NumaPolicy::PreferLocal`] the queues on
    /// `cpu_node` (or of unknown node) are tried before the others. A queue
    /// with room for only part of the batch takes its head.
    pub(super) fn pick(&self, len: usize, cpu_node: Option<u32>) -> Result<Reservation, NoRoom> {
        let n = self.entries.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let tiered = self.numa == NumaPolicy::PreferLocal && cpu_node.is_some();
        let mut saw_enabled = false;
        let mut now = None;
        for pass in 0..if tiered { 2 } else { 1 } {
            for k in 0..n {
                let qi = (start + k) % n;
                let q = &self.entries[qi];
                if tiered && is_local(q.numa_node, cpu_node) != (pass == 0) {
                    continue;
                }
                if q.disabled.load(Ordering::Relaxed) {
                    continue;
                }
                saw_enabled = true;
                if q.skip_until.load(Ordering::Relaxed) != 0
                    && q.backing_off(*now.get_or_insert_with(|| self.now_nanos()))
                {
                    continue;
                }
                if let Some(reservation) = Self::reserve_on(q, qi, len) {
                    return Ok(reservation);
                }
            }
        }
        Err(if saw_enabled {
            NoRoom::Full
        } else {
            NoRoom::Disabled
        })
    }

    /// Room for `len` pages (or their head) on queue `qi`, in chunks of its
    /// maximum batch size; `None` when it is full.
    fn reserve_on(q: &QueueEntry, qi: usize, len: usize) -> Option<Reservation> {
        let max = q.queue.max_batch_size().clamp(1, MAX_BATCH_PAGES);
        let needed = if max == 1 { len } else { len.div_ceil(max) };
        let chunks = q.reserve(needed);
        if chunks == 0 {
            return None;
        }
        let chunks_usize = chunks as usize;
        let pages = if chunks_usize == needed {
            len
        } else {
            chunks_usize * max
        };
        Some(Reservation {
            queue: qi,
            chunks,
            pages,
        })
    }
}

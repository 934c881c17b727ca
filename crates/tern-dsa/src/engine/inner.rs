//! The engine's shared state: queues, slots, the free and pending slot
//! queues, and the counters; shared by submitters, waiters and the
//! completion thread.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use tern_page::{OffloadError, OffloadId, Ticket, TicketState, ZeroOffloadStats};

use super::config::OffloadConfig;
use super::queues::{QueueEntry, Queues};
use super::slot::{FREE, IN_FLIGHT, Slot};
use crate::queue::{CpuSubmitFeatures, DsaQueue};

/// Atomic counterparts of [`ZeroOffloadStats`].
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) pages_device: AtomicU64,
    pub(super) pages_fallback: AtomicU64,
    pub(super) page_faults: AtomicU64,
    pub(super) device_errors: AtomicU64,
    pub(super) descriptors_submitted: AtomicU64,
    pub(super) batches: AtomicU64,
    pub(super) submit_failures: AtomicU64,
    pub(super) slots_exhausted: AtomicU64,
    pub(super) queues_disabled: AtomicU64,
    pub(super) slots_retired: AtomicU64,
    pub(super) pages_queue_full: AtomicU64,
    pub(super) umwaits: AtomicU64,
    pub(super) completion_cpu_ns: AtomicU64,
}

impl Counters {
    pub(super) fn snapshot(&self) -> ZeroOffloadStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        // Built field by field: the struct is non_exhaustive (tern-page may add
        // counters this engine leaves at zero).
        let mut stats = ZeroOffloadStats::default();
        stats.pages_device = l(&self.pages_device);
        stats.pages_fallback = l(&self.pages_fallback);
        stats.page_faults = l(&self.page_faults);
        stats.device_errors = l(&self.device_errors);
        stats.descriptors_submitted = l(&self.descriptors_submitted);
        stats.batches = l(&self.batches);
        stats.submit_failures = l(&self.submit_failures);
        stats.slots_exhausted = l(&self.slots_exhausted);
        stats.queues_disabled = l(&self.queues_disabled);
        stats.slots_retired = l(&self.slots_retired);
        stats.pages_queue_full = l(&self.pages_queue_full);
        stats.umwaits = l(&self.umwaits);
        stats.completion_thread_cpu = Duration::from_nanos(l(&self.completion_cpu_ns));
        stats
    }
}

pub(super) struct Inner {
    pub(super) owner: OffloadId,
    pub(super) queues: Queues,
    /// UMWAIT allowed and supported.
    pub(super) umwait_available: bool,
    pub(super) slots: Box<[Slot]>,
    pub(super) free: ArrayQueue<u32>,
    pub(super) pending: ArrayQueue<u32>,
    pub(super) config: OffloadConfig,
    pub(super) counters: Counters,
    pub(super) stop: AtomicBool,
    pub(super) poller: OnceLock<Thread>,
}

// SAFETY: the raw pointers and UnsafeCells in the slots are handed between
// threads by the slot protocol: a slot's memory and meta are written only by
// the thread that popped it from `free` (exclusive), published with a
// Release store of IN_FLIGHT and a push to `pending`; afterwards meta is
// read-only until the waiter, after an Acquire load of DONE, frees it again.
// The device touches only descriptors and records, which are accessed
// through raw pointers and atomic status loads, never references.
unsafe impl Send for Inner {}
// SAFETY: see Send.
unsafe impl Sync for Inner {}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inner")
            .field("queues", &self.queues)
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for slot in self.slots.iter() {
            if slot.state.load(Ordering::Acquire) == IN_FLIGHT
                || slot.timed_out.load(Ordering::Acquire)
            {
                // The device may still write into this memory: leaking it is
                // the only safe choice.
                continue;
            }
            // SAFETY: allocated by Box::into_raw in Slot::new, freed once,
            // and no device work is outstanding on it.
            drop(unsafe { Box::from_raw(slot.mem) });
        }
    }
}

impl Inner {
    /// The shared state over `queues` (not empty), with `config.slots`
    /// slots (at least one), every slot free; `bounded` false lifts the
    /// per-queue in-flight bound (tests only).
    pub(super) fn new(
        queues: Vec<Arc<dyn DsaQueue>>,
        config: OffloadConfig,
        bounded: bool,
    ) -> Arc<Self> {
        let slots = u32::try_from(config.slots.max(1)).unwrap_or(u32::MAX);
        let free = ArrayQueue::new(slots as usize);
        for i in 0..slots {
            let _ = free.push(i);
        }
        let entries = queues
            .into_iter()
            .map(|queue| QueueEntry::new(queue, bounded))
            .collect();
        Arc::new(Inner {
            owner: OffloadId::unique(),
            queues: Queues::new(entries, config.numa),
            umwait_available: config.umwait && CpuSubmitFeatures::detect().waitpkg,
            slots: (0..slots).map(Slot::new).collect(),
            free,
            pending: ArrayQueue::new(slots as usize),
            config,
            counters: Counters::default(),
            stop: AtomicBool::new(false),
            poller: OnceLock::new(),
        })
    }

    /// The slot a ticket names; `None` for a ticket answered at submission.
    pub(super) fn slot_of(&self, ticket: &Ticket) -> Result<Option<&Slot>, OffloadError> {
        match ticket.state_for(self.owner)? {
            TicketState::Ready { .. } => Ok(None),
            TicketState::Pending { index, generation } => {
                let slot = self
                    .slots
                    .get(index as usize)
                    .ok_or(OffloadError::BadTicket)?;
                if slot.generation.load(Ordering::Acquire) != generation
                    || slot.state.load(Ordering::Acquire) == FREE
                {
                    return Err(OffloadError::BadTicket);
                }
                Ok(Some(slot))
            }
            // A state a newer tern-page defines names no slot of this engine.
            _ => Err(OffloadError::BadTicket),
        }
    }
}

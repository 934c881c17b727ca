//! The submission path: take a free slot, reserve room on a queue, write
//! the descriptors, hand one BATCH per chunk (a lone page as a plain
//! COMPVAL) to the queue, check on the CPU what did not fit, and publish
//! the slot to the completion thread. No lock on the way.

use std::sync::atomic::Ordering;
use std::time::Instant;

use tern_page::offload::zero_mask_on_cpu;
use tern_page::{MAX_BATCH_PAGES, OffloadError, Ticket};

use super::inner::Inner;
use super::queues::{NoRoom, QueueEntry, Reservation};
use super::slot::{IN_FLIGHT, Slot, SlotArrays, SlotMeta, Watch};
use crate::desc::{CompletionRecord, Descriptor};
use crate::queue::SubmitError;
use crate::select::current_numa_node;

/// The page size as the descriptors' `u32` transfer size.
const PAGE_SIZE_U32: u32 = tern_wire::PAGE_SIZE;

impl Inner {
    /// Answers `pages` on the CPU at once, as a fallback.
    fn cpu_ticket(&self, pages: &[*const u8]) -> Ticket {
        // SAFETY: the caller of submit guaranteed the pages are readable.
        let zero = unsafe { zero_mask_on_cpu(&self.config.checker, pages) };
        self.counters
            .pages_fallback
            .fetch_add(pages.len() as u64, Ordering::Relaxed);
        Ticket::ready(self.owner, zero, pages.len())
    }

    /// # Safety
    ///
    /// As [`tern_page::ZeroPageOffload::submit`].
    pub(super) unsafe fn submit(&self, pages: &[*const u8]) -> Result<Ticket, OffloadError> {
        if pages.len() > MAX_BATCH_PAGES {
            return Err(OffloadError::TooManyPages(pages.len()));
        }
        if pages.is_empty() {
            return Ok(self.cpu_ticket(pages));
        }
        let Some(index) = self.free.pop() else {
            self.counters
                .slots_exhausted
                .fetch_add(1, Ordering::Relaxed);
            return Ok(self.cpu_ticket(pages));
        };
        let cpu_node = if self.queues.numa_matters {
            current_numa_node()
        } else {
            None
        };
        let reservation = match self.queues.pick(pages.len(), cpu_node) {
            Ok(reservation) => reservation,
            Err(why) => {
                let _ = self.free.push(index);
                if why == NoRoom::Full {
                    self.counters
                        .pages_queue_full
                        .fetch_add(pages.len() as u64, Ordering::Relaxed);
                }
                return Ok(self.cpu_ticket(pages));
            }
        };
        let slot = &self.slots[index as usize];
        // SAFETY: popping `index` from `free` made this thread the slot's
        // only user until it is published below.
        let meta = unsafe { &mut *slot.meta.get() };
        // SAFETY: the pages are readable (the caller's contract).
        unsafe { Self::fill(slot, meta, pages, reservation) };
        self.send_chunks(slot, meta, reservation);
        if reservation.pages < pages.len() {
            // SAFETY: as above.
            unsafe { self.check_tail(meta, pages) };
        }
        Ok(self.publish(slot))
    }

    /// Writes the slot's book-keeping and one COMPVAL descriptor (with a
    /// zeroed record, so "status 0" means "not written yet") per page that
    /// goes to the device.
    ///
    /// # Safety
    ///
    /// The slot is this thread's (popped from `free`, not yet published);
    /// the pages are readable for `PAGE_SIZE` bytes.
    unsafe fn fill(slot: &Slot, meta: &mut SlotMeta, pages: &[*const u8], r: Reservation) {
        let SlotArrays { descs, recs, .. } = slot.arrays();
        for (i, &page) in pages.iter().enumerate() {
            meta.pages[i] = page as usize;
            if i >= r.pages {
                continue;
            }
            // SAFETY: i < MAX_BATCH_PAGES, inside the slot's arrays, which
            // no device reads yet.
            unsafe {
                recs.add(i).write(CompletionRecord::default());
                descs.add(i).write(Descriptor::compval(
                    page as u64,
                    PAGE_SIZE_U32,
                    0,
                    recs.add(i) as u64,
                ));
            }
        }
        meta.len = pages.len();
        meta.device_len = r.pages;
        meta.cpu_zero = 0;
        meta.queue = r.queue;
        meta.reserved = r.chunks;
        meta.watch.clear();
        meta.submitted_at = Instant::now();
        slot.timed_out.store(false, Ordering::Relaxed);
    }

    /// Hands the device pages to the reserved queue: `r.chunks` chunks of
    /// near-equal size, each a BATCH, or a lone COMPVAL for a one-page
    /// chunk. A chunk the queue refuses is left unwatched: its pages are
    /// finished on the CPU when the slot is decoded.
    fn send_chunks(&self, slot: &Slot, meta: &mut SlotMeta, r: Reservation) {
        let queue = &self.queues.entries[r.queue];
        let chunks = r.chunks as usize;
        if chunks == r.pages {
            // One COMPVAL per page (the write() path, or a queue without
            // batches): the descriptors lie side by side in the slot and go
            // in one call, one write() for all on that path.
            self.send_singles(slot, meta, queue, r.pages);
            return;
        }
        let mut start = 0;
        let mut submitted = 0u64;
        for c in 0..chunks {
            let size = r.pages / chunks + usize::from(c < r.pages % chunks);
            let (desc, watch) = Self::chunk_descriptor(slot, c, start, size);
            // SAFETY: the descriptor points at slot memory and at the
            // caller's pages, both valid until the slot is DONE and waited.
            match unsafe { queue.queue.submit(&desc) } {
                Ok(()) => {
                    meta.watch.push(watch);
                    submitted += 1;
                }
                Err(e) => {
                    // The rest would most likely be refused too: it goes to
                    // the CPU with this chunk, without more attempts.
                    self.note_refusal(queue, &e);
                    break;
                }
            }
            start += size;
        }
        self.count_sent(queue, submitted);
    }

    /// Submits pages `..pages` of the slot as lone COMPVALs in one call.
    fn send_singles(&self, slot: &Slot, meta: &mut SlotMeta, queue: &QueueEntry, pages: usize) {
        let SlotArrays { descs, .. } = slot.arrays();
        // SAFETY: `fill` wrote descriptors 0..pages; no device reads them
        // yet, and the slice is dropped before the next write to them.
        let list = unsafe { std::slice::from_raw_parts(descs.cast_const(), pages) };
        // SAFETY: the descriptors point at slot memory and at the caller's
        // pages, valid until the slot is DONE and waited.
        let (accepted, error) = unsafe { queue.queue.submit_many(list) };
        meta.watch.extend((0..accepted).map(Watch::Single));
        if let Some(e) = error {
            self.note_refusal(queue, &e);
        }
        self.count_sent(queue, accepted as u64);
    }

    /// Counts `submitted` descriptors handed to `queue`; any acceptance
    /// ends the queue's run of refusals.
    fn count_sent(&self, queue: &QueueEntry, submitted: u64) {
        self.counters
            .descriptors_submitted
            .fetch_add(submitted, Ordering::Relaxed);
        if submitted > 0 {
            self.counters.batches.fetch_add(1, Ordering::Relaxed);
            queue.accepted();
        }
    }

    /// The descriptor of chunk `c` (pages `start..start + size`) and the
    /// record that says it is finished.
    fn chunk_descriptor(slot: &Slot, c: usize, start: usize, size: usize) -> (Descriptor, Watch) {
        let SlotArrays {
            descs,
            batch_descs,
            batch_recs,
            ..
        } = slot.arrays();
        if size == 1 {
            // SAFETY: start < len, written by `fill`.
            return (unsafe { descs.add(start).read() }, Watch::Single(start));
        }
        // Chunks of a batch have at most MAX_BATCH_PAGES descriptors.
        let count = u32::try_from(size).unwrap_or(u32::MAX);
        // SAFETY: c < chunks <= MAX_CHUNKS (size >= 2 for every chunk when
        // batching); the list starts at a 64-byte aligned descriptor.
        unsafe {
            batch_recs.add(c).write(CompletionRecord::default());
            let b = Descriptor::batch(descs.add(start) as u64, count, batch_recs.add(c) as u64);
            batch_descs.add(c).write(b);
            (b, Watch::Batch(c))
        }
    }

    /// A queue refused a descriptor for good: its pages go to the CPU, the
    /// queue is skipped for a while (longer after each refusal in a row)
    /// and retired after `refusals_before_retire` of them, or at once when
    /// the kernel refused it outright (an I/O error, a stopped device).
    pub(super) fn note_refusal(&self, queue: &QueueEntry, error: &SubmitError) {
        self.counters
            .submit_failures
            .fetch_add(1, Ordering::Relaxed);
        let hard = matches!(error, SubmitError::Io(_) | SubmitError::Stopped);
        let refusals = queue.refused(&self.queues, self.config.refusal_backoff);
        let limit = self.config.refusals_before_retire;
        if (hard || (limit > 0 && refusals >= limit))
            && !queue.disabled.swap(true, Ordering::Relaxed)
        {
            self.counters
                .queues_disabled
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "DSA queue {} retired after {refusals} refused submission(s) in a row ({error}); \
                 its pages are checked on the CPU",
                queue.queue.name()
            );
        }
    }

    /// The queue had room for the head only: the tail is checked here,
    /// while the device works on the head.
    ///
    /// # Safety
    ///
    /// The pages are readable for `PAGE_SIZE` bytes.
    unsafe fn check_tail(&self, meta: &mut SlotMeta, pages: &[*const u8]) {
        let head = meta.device_len;
        // SAFETY: forwarded from the caller.
        let tail = unsafe { zero_mask_on_cpu(&self.config.checker, &pages[head..]) };
        meta.cpu_zero = tail << head;
        let n = (pages.len() - head) as u64;
        self.counters.pages_fallback.fetch_add(n, Ordering::Relaxed);
        self.counters
            .pages_queue_full
            .fetch_add(n, Ordering::Relaxed);
    }

    /// Hands the filled slot to the completion thread and returns its ticket.
    fn publish(&self, slot: &Slot) -> Ticket {
        let generation = slot.generation.load(Ordering::Relaxed);
        slot.state.store(IN_FLIGHT, Ordering::Release);
        if self.pending.push(slot.index).is_err() {
            unreachable!("pending holds every slot at most once");
        }
        if let Some(t) = self.poller.get() {
            // Cheap when the thread is not parked (an atomic swap).
            t.unpark();
        }
        Ticket::pending(self.owner, slot.index, generation)
    }
}

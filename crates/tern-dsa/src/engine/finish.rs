//! The waiting side: wait for a slot to be DONE, decode its records into
//! one answer per page (finishing on the CPU what the device did not),
//! account errors against the queue, and free (or retire) the slot.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tern_page::offload::write_ready;
use tern_page::{OffloadError, PAGE_SIZE, Ticket, TicketState, ZeroChecker};

use super::inner::Inner;
use super::slot::{DONE, FREE, Slot, SlotMeta, Watch};
use crate::desc::{CompletionRecord, DsaStatus};

/// What the records of one slot said.
#[derive(Debug, Default)]
struct Decoded {
    device: u64,
    fallback: u64,
    faults: u64,
    /// The last error status seen, if any.
    error: Option<u8>,
}

impl Inner {
    pub(super) fn wait(&self, ticket: Ticket, out: &mut Vec<bool>) -> Result<(), OffloadError> {
        let Some(slot) = self.slot_of(&ticket)? else {
            if let TicketState::Ready { zero, len } = ticket.state_for(self.owner)? {
                write_ready(zero, len, out);
            }
            return Ok(());
        };
        let mut spins = 0u32;
        while slot.state.load(Ordering::Acquire) != DONE {
            spins += 1;
            if spins < 128 {
                std::hint::spin_loop();
            } else {
                // Register, re-check, park: the completion thread stores DONE
                // before taking the waiter, so either we see DONE or it sees
                // us (and a pending unpark makes park return at once).
                *slot.waiter.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(std::thread::current());
                if slot.state.load(Ordering::Acquire) == DONE {
                    break;
                }
                std::thread::park_timeout(Duration::from_millis(10));
            }
        }
        *slot.waiter.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.finish(slot, out);
        Ok(())
    }

    /// Decodes a DONE slot into `out`, finishing on the CPU what the device
    /// did not, then frees (or retires) the slot.
    fn finish(&self, slot: &Slot, out: &mut Vec<bool>) {
        // SAFETY: the slot is DONE (Acquire in `wait`): the submitter's
        // writes are visible and nobody writes meta until we free it.
        let meta = unsafe { &*slot.meta.get() };
        let timed_out = slot.timed_out.load(Ordering::Acquire);
        let mut decoded = Decoded::default();
        out.clear();
        for i in 0..meta.len {
            let zero = if i < meta.device_len {
                Self::page_answer(&self.config.checker, slot, meta, i, timed_out, &mut decoded)
            } else {
                // Checked on the CPU at submission (and counted there).
                meta.cpu_zero & (1 << i) != 0
            };
            out.push(zero);
        }
        if !timed_out {
            Self::batch_errors(slot, meta, &mut decoded);
        }
        self.account(meta, &decoded, timed_out);
        if timed_out {
            // Retired: the device may still write into it some day.
            return;
        }
        slot.generation.fetch_add(1, Ordering::Relaxed);
        slot.state.store(FREE, Ordering::Release);
        let _ = self.free.push(slot.index);
    }

    /// Whether device page `i` is zero: the device's answer, or the CPU's
    /// where the device faulted, failed or never answered.
    fn page_answer(
        checker: &ZeroChecker,
        slot: &Slot,
        meta: &SlotMeta,
        i: usize,
        timed_out: bool,
        decoded: &mut Decoded,
    ) -> bool {
        let page = meta.pages[i] as *const u8;
        let rec = if timed_out {
            // The device may still write these records: do not read them.
            None
        } else {
            // SAFETY: record i of a DONE slot; its chunk's watch record was
            // written last, so this one is final.
            Some(unsafe { slot.rec(i).read() })
        };
        match (rec.map_or(DsaStatus::Pending, |r| r.decoded()), rec) {
            (DsaStatus::Success, Some(r)) => {
                decoded.device += 1;
                r.result == 0
            }
            (DsaStatus::PageFault { .. }, Some(r)) => {
                // The first bytes_completed bytes matched the pattern; the
                // CPU reads the rest (and takes the fault itself).
                decoded.faults += 1;
                decoded.fallback += 1;
                let done = (r.bytes_completed as usize).min(PAGE_SIZE);
                // SAFETY: page..page+PAGE_SIZE is readable (submit's
                // contract), so is its tail.
                unsafe { checker.is_zero_range(page.add(done), PAGE_SIZE - done) }
            }
            (status, _) => {
                if let DsaStatus::Error(code) = status {
                    decoded.error = Some(code);
                }
                decoded.fallback += 1;
                // SAFETY: submit's contract.
                unsafe { checker.is_zero_page(page) }
            }
        }
    }

    /// Error statuses of the slot's BATCH records.
    fn batch_errors(slot: &Slot, meta: &SlotMeta, decoded: &mut Decoded) {
        for &w in &meta.watch {
            if let Watch::Batch(_) = w {
                // SAFETY: DONE slot, batch record final.
                let st = unsafe { CompletionRecord::load_status(slot.watch_rec(w)) };
                match DsaStatus::decode(st) {
                    DsaStatus::Error(code) => decoded.error = Some(code),
                    DsaStatus::BatchPageFault => decoded.error = Some(st),
                    _ => {}
                }
            }
        }
    }

    /// Counts the slot's outcome, and disables its queue after
    /// `error_threshold` failed submissions in a row.
    fn account(&self, meta: &SlotMeta, decoded: &Decoded, timed_out: bool) {
        let c = &self.counters;
        c.pages_device.fetch_add(decoded.device, Ordering::Relaxed);
        c.pages_fallback
            .fetch_add(decoded.fallback, Ordering::Relaxed);
        c.page_faults.fetch_add(decoded.faults, Ordering::Relaxed);
        let q = &self.queues.entries[meta.queue];
        if decoded.error.is_none() && !timed_out {
            if decoded.device > 0 {
                q.consecutive_errors.store(0, Ordering::Relaxed);
            }
            return;
        }
        c.device_errors.fetch_add(1, Ordering::Relaxed);
        let n = q.consecutive_errors.fetch_add(1, Ordering::Relaxed) + 1;
        let what = match decoded.error {
            Some(code) => format!("status {code:#04x}"),
            None => format!(
                "no completion within {:?} (queue and slot retired)",
                self.config.completion_timeout
            ),
        };
        tracing::warn!(
            "DSA queue {}: {what}; {} of {} pages checked on the CPU",
            q.queue.name(),
            decoded.fallback,
            meta.len
        );
        let limit = self.config.error_threshold;
        if limit > 0 && n >= limit && !q.disabled.swap(true, Ordering::Relaxed) {
            c.queues_disabled.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "DSA queue {} disabled after {n} failed submissions in a row",
                q.queue.name()
            );
        }
    }
}

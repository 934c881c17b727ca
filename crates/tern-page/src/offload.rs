//! The offload interfaces: what a migration worker asks of an accelerator,
//! defined here so that an accelerator's driver depends on tern-page and
//! never the other way round.
//!
//! * [`ZeroPageOffload`]: asynchronous zero-page checks of batches of pages,
//!   redeemed with a [`Ticket`]. [`CpuOffload`] is the CPU behind the same
//!   interface; the `tern-dsa` crate implements it on Intel DSA work queues
//!   and on its software device. A driver makes its tickets with
//!   [`Ticket::ready`] (answered at submission) or [`Ticket::pending`] (a
//!   handle of its own, such as a slot and its generation), each tied to the
//!   driver's [`OffloadId`] so a ticket shown to another offload is refused.
//! * [`DeltaOffload`]: create and apply delta records (the format of
//!   [`crate::delta`]) on a device, the CPU codec being the reference.
//!
//! # How a worker uses it
//!
//! ```
//! use tern_page::offload::{ZeroPageOffload, cpu_offload};
//! use tern_page::{PAGE_SIZE, ZeroChecker};
//!
//! let offload = cpu_offload(ZeroChecker::best());
//! let pages = [vec![0u8; PAGE_SIZE], vec![1u8; PAGE_SIZE]];
//! let pointers: Vec<*const u8> = pages.iter().map(|page| page.as_ptr()).collect();
//! // SAFETY: both pages stay readable until `wait` returns.
//! let ticket = unsafe { offload.submit(&pointers) }?;
//! let mut is_zero = Vec::new();
//! offload.wait(ticket, &mut is_zero)?;
//! assert_eq!(is_zero, [true, false]);
//! # Ok::<(), tern_page::offload::OffloadError>(())
//! ```

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::delta::DeltaError;
use crate::zero::{PAGE_SIZE, ZeroChecker};

/// Most pages one [`ZeroPageOffload::submit`] takes: one engine batch.
pub const MAX_BATCH_PAGES: usize = 128;

/// Why an offload refused a call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OffloadError {
    /// More pages than one submission takes.
    #[error("{0} pages in one submission; at most {MAX_BATCH_PAGES}")]
    TooManyPages(usize),
    /// A ticket from another offload, or one already waited on.
    #[error("ticket does not belong to this offload or was already waited on")]
    BadTicket,
}

/// Zero-page checks for batches of pages, answered now or later.
pub trait ZeroPageOffload: Send + Sync + fmt::Debug {
    /// Starts checking `pages` (pointers to 4 KiB pages, at most
    /// [`MAX_BATCH_PAGES`]) and returns a ticket for [`wait`](Self::wait).
    ///
    /// # Errors
    ///
    /// Only [`OffloadError::TooManyPages`]; device trouble is absorbed by
    /// answering on the CPU.
    ///
    /// # Safety
    ///
    /// Every pointer must be readable for [`PAGE_SIZE`] bytes until `wait`
    /// for the returned ticket has returned (the device reads the pages in
    /// between). Concurrent writes are fine, as for
    /// [`ZeroChecker::is_zero_page`]. A ticket that is dropped without
    /// `wait` may keep its device resources forever; pages must then stay
    /// mapped for the life of the offload.
    unsafe fn submit(&self, pages: &[*const u8]) -> Result<Ticket, OffloadError>;

    /// Waits for the ticket's batch and writes one bool per page into `out`
    /// (cleared first), true = zero page, in submission order. Pages the
    /// device could not finish are finished on the CPU here.
    ///
    /// # Errors
    ///
    /// [`OffloadError::BadTicket`] for a ticket from another offload.
    fn wait(&self, ticket: Ticket, out: &mut Vec<bool>) -> Result<(), OffloadError>;

    /// Whether `wait` would return without blocking.
    fn is_done(&self, ticket: &Ticket) -> bool;

    /// Counters so far.
    fn stats(&self) -> ZeroOffloadStats;

    /// One line for logs: the backend and its queues.
    fn describe(&self) -> String;
}

/// The identity of one offload, which its tickets carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OffloadId(u64);

impl OffloadId {
    /// An id no other offload of this process has.
    pub fn unique() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        OffloadId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A submitted batch; redeem with [`ZeroPageOffload::wait`].
#[must_use = "pass the ticket to wait(), or its batch's resources may never be reused"]
#[derive(Debug)]
pub struct Ticket {
    owner: OffloadId,
    state: TicketState,
}

/// What a [`Ticket`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TicketState {
    /// Answered at submission: bit i of `zero` set = page i is zero.
    Ready {
        /// One bit per page.
        zero: u128,
        /// Pages in the batch, at most [`MAX_BATCH_PAGES`].
        len: usize,
    },
    /// Still with the offload, under a handle of its choosing (a batch slot
    /// and that slot's generation, say).
    Pending {
        /// Which of the offload's batches.
        index: u32,
        /// Which use of it, so a stale ticket is told apart.
        generation: u32,
    },
}

impl Ticket {
    /// A ticket answered at submission: bit i of `zero` set = page i of the
    /// `len` pages is zero (`len` is capped at [`MAX_BATCH_PAGES`]).
    pub fn ready(owner: OffloadId, zero: u128, len: usize) -> Self {
        Ticket {
            owner,
            state: TicketState::Ready {
                zero,
                len: len.min(MAX_BATCH_PAGES),
            },
        }
    }

    /// A ticket for a batch still in flight, named by `index` and
    /// `generation` as the offload `owner` chooses.
    pub fn pending(owner: OffloadId, index: u32, generation: u32) -> Self {
        Ticket {
            owner,
            state: TicketState::Pending { index, generation },
        }
    }

    /// The ticket's state, if `owner` issued it.
    ///
    /// # Errors
    ///
    /// [`OffloadError::BadTicket`] for a ticket of another offload.
    pub fn state_for(&self, owner: OffloadId) -> Result<TicketState, OffloadError> {
        if self.owner == owner {
            Ok(self.state)
        } else {
            Err(OffloadError::BadTicket)
        }
    }
}

/// Writes the answers of a [`TicketState::Ready`] into `out` (cleared
/// first): one bool per page, true = zero.
pub fn write_ready(zero: u128, len: usize, out: &mut Vec<bool>) {
    out.clear();
    out.extend((0..len.min(MAX_BATCH_PAGES)).map(|i| zero & (1 << i) != 0));
}

/// Checks `pages` (at most [`MAX_BATCH_PAGES`]) on the CPU; bit i of the
/// result set = page i is zero.
///
/// # Safety
///
/// Every pointer readable for [`PAGE_SIZE`] bytes.
pub unsafe fn zero_mask_on_cpu(checker: &ZeroChecker, pages: &[*const u8]) -> u128 {
    let mut bits = 0u128;
    for (i, &p) in pages.iter().take(MAX_BATCH_PAGES).enumerate() {
        // SAFETY: forwarded from the caller.
        if unsafe { checker.is_zero_page(p) } {
            bits |= 1 << i;
        }
    }
    bits
}

/// Counters of a [`ZeroPageOffload`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct ZeroOffloadStats {
    /// Pages the device answered.
    pub pages_device: u64,
    /// Pages checked on the CPU because that is the backend.
    pub pages_cpu: u64,
    /// Pages a device could not answer, finished on the CPU (page faults,
    /// errors, refused submissions, no free slot, disabled devices).
    pub pages_fallback: u64,
    /// Pages that came back with a page fault.
    pub page_faults: u64,
    /// Submissions that came back with a device error status or timed out.
    pub device_errors: u64,
    /// Descriptors handed to queues (BATCH or lone COMPVAL).
    pub descriptors_submitted: u64,
    /// Submissions (calls to `submit`) that reached at least one queue.
    pub batches: u64,
    /// Submission attempts refused and retried (ENQCMD retry, full queue).
    pub submit_retries: u64,
    /// Descriptors a queue finally refused (pages went to the CPU).
    pub submit_failures: u64,
    /// Submissions answered on the CPU because every slot was in flight.
    pub slots_exhausted: u64,
    /// Queues disabled after repeated errors, or retired after a timeout.
    pub queues_disabled: u64,
    /// Slots retired after a timeout: their memory is never reused, since
    /// the device may still write it.
    pub slots_retired: u64,
    /// Pages checked on the CPU because their queue had no room left for
    /// them (in-flight descriptors bounded by the queue's size); also
    /// counted in `pages_fallback`.
    pub pages_queue_full: u64,
    /// Times the completion thread waited with UMWAIT (WAITPKG CPUs).
    pub umwaits: u64,
    /// CPU time of the completion thread.
    pub completion_thread_cpu: Duration,
}

impl ZeroOffloadStats {
    /// Pages answered, by whatever means.
    pub fn pages_checked(&self) -> u64 {
        self.pages_device + self.pages_cpu + self.pages_fallback
    }

    /// Completion-thread CPU time per GiB of pages checked, the price of
    /// polling; `None` before any page.
    pub fn completion_cpu_per_gib(&self) -> Option<Duration> {
        const GIB: f64 = (1u64 << 30) as f64;
        let pages = self.pages_checked();
        #[expect(
            clippy::cast_precision_loss,
            reason = "a ratio for a report: 2^52 pages are far beyond any run"
        )]
        let bytes = pages as f64 * PAGE_SIZE as f64;
        (pages > 0).then(|| self.completion_thread_cpu.mul_f64(GIB / bytes))
    }
}

/// The CPU behind the same asynchronous interface, so workers have one code
/// path for every mode: `submit` does the work, `wait` hands it over.
#[derive(Debug)]
pub struct CpuOffload {
    owner: OffloadId,
    checker: ZeroChecker,
    pages: AtomicU64,
}

impl CpuOffload {
    /// A CPU offload with `checker`.
    pub fn new(checker: ZeroChecker) -> Self {
        CpuOffload {
            owner: OffloadId::unique(),
            checker,
            pages: AtomicU64::new(0),
        }
    }
}

/// [`CpuOffload`] behind an `Arc<dyn ZeroPageOffload>`.
pub fn cpu_offload(checker: ZeroChecker) -> Arc<dyn ZeroPageOffload> {
    Arc::new(CpuOffload::new(checker))
}

impl ZeroPageOffload for CpuOffload {
    unsafe fn submit(&self, pages: &[*const u8]) -> Result<Ticket, OffloadError> {
        if pages.len() > MAX_BATCH_PAGES {
            return Err(OffloadError::TooManyPages(pages.len()));
        }
        // SAFETY: forwarded from the caller.
        let zero = unsafe { zero_mask_on_cpu(&self.checker, pages) };
        self.pages.fetch_add(pages.len() as u64, Ordering::Relaxed);
        Ok(Ticket::ready(self.owner, zero, pages.len()))
    }

    fn wait(&self, ticket: Ticket, out: &mut Vec<bool>) -> Result<(), OffloadError> {
        match ticket.state_for(self.owner)? {
            TicketState::Ready { zero, len } => {
                write_ready(zero, len, out);
                Ok(())
            }
            TicketState::Pending { .. } => Err(OffloadError::BadTicket),
        }
    }

    fn is_done(&self, _: &Ticket) -> bool {
        true
    }

    fn stats(&self) -> ZeroOffloadStats {
        ZeroOffloadStats {
            pages_cpu: self.pages.load(Ordering::Relaxed),
            ..ZeroOffloadStats::default()
        }
    }

    fn describe(&self) -> String {
        format!("cpu ({})", self.checker.backend())
    }
}

/// Delta records ([`crate::delta`]'s format) made and applied on a device.
/// Whatever the device does, the results are the CPU codec's: an
/// implementation falls back to [`crate::delta::create_delta`] and
/// [`crate::delta::apply_delta`] on any trouble.
pub trait DeltaOffload: Send + Sync + fmt::Debug {
    /// [`create_delta`](crate::delta::create_delta) on the device: the same
    /// contract and the same bytes.
    fn create(&self, old: &[u8; PAGE_SIZE], new: &[u8; PAGE_SIZE], out: &mut [u8])
    -> Option<usize>;

    /// [`apply_delta`](crate::delta::apply_delta) on the device; a bad
    /// record is refused as the CPU codec refuses it, before the page is
    /// touched.
    ///
    /// # Errors
    ///
    /// The [`DeltaError`] that [`crate::delta::validate_delta`] gives.
    fn apply(&self, record: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), DeltaError>;

    /// Counters so far.
    fn stats(&self) -> DeltaOffloadStats;
}

/// Counters of a [`DeltaOffload`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeltaOffloadStats {
    /// Operations the device completed.
    pub on_device: u64,
    /// Operations the CPU did instead.
    pub fallbacks: u64,
    /// Jobs left to a device that did not answer in time (their memory is
    /// never reused).
    pub abandoned: u64,
}

#[cfg(test)]
mod tests {
    use super::{
        CpuOffload, MAX_BATCH_PAGES, OffloadError, OffloadId, Ticket, TicketState,
        ZeroOffloadStats, ZeroPageOffload, write_ready,
    };
    use crate::zero::{PAGE_SIZE, ZeroChecker};

    #[test]
    fn cpu_offload_answers_at_submission() {
        let pages = [vec![0u8; PAGE_SIZE], vec![7u8; PAGE_SIZE]];
        let pointers: Vec<*const u8> = pages.iter().map(|page| page.as_ptr()).collect();
        let offload = CpuOffload::new(ZeroChecker::best());
        // SAFETY: the pages outlive the wait below.
        let ticket = unsafe { offload.submit(&pointers) }.unwrap();
        assert!(offload.is_done(&ticket));
        let mut out = Vec::new();
        offload.wait(ticket, &mut out).unwrap();
        assert_eq!(out, [true, false]);
        assert_eq!(offload.stats().pages_cpu, 2);
        assert_eq!(offload.stats().pages_checked(), 2);
        let too_many = vec![pointers[0]; MAX_BATCH_PAGES + 1];
        // SAFETY: refused before any page is read.
        let refused = unsafe { offload.submit(&too_many) };
        assert!(matches!(refused, Err(OffloadError::TooManyPages(129))));
    }

    #[test]
    fn a_ticket_is_redeemed_only_by_its_offload() {
        let (one, other) = (OffloadId::unique(), OffloadId::unique());
        assert_ne!(one, other);
        let ticket = Ticket::ready(one, 0b101, 3);
        assert!(matches!(
            ticket.state_for(other),
            Err(OffloadError::BadTicket)
        ));
        let TicketState::Ready { zero, len } = ticket.state_for(one).unwrap() else {
            panic!("made ready");
        };
        let mut out = Vec::new();
        write_ready(zero, len, &mut out);
        assert_eq!(out, [true, false, true]);
        let foreign = Ticket::ready(other, 0, 1);
        let offload = CpuOffload::new(ZeroChecker::best());
        assert!(matches!(
            offload.wait(foreign, &mut out),
            Err(OffloadError::BadTicket)
        ));
        let pending = Ticket::pending(one, 4, 9);
        assert_eq!(
            pending.state_for(one).unwrap(),
            TicketState::Pending {
                index: 4,
                generation: 9
            }
        );
    }

    #[test]
    fn completion_cpu_is_priced_per_gib() {
        let mut stats = ZeroOffloadStats::default();
        assert_eq!(stats.completion_cpu_per_gib(), None);
        stats.pages_device = (1 << 30) / PAGE_SIZE as u64;
        stats.completion_thread_cpu = std::time::Duration::from_millis(3);
        assert_eq!(
            stats.completion_cpu_per_gib(),
            Some(std::time::Duration::from_millis(3))
        );
    }
}

//! The asynchronous batch API used by migration workers, and its DSA engine.
//!
//! # How a worker uses it
//!
//! ```text
//! let offload: Arc<dyn ZeroPageOffload> = open_dsa(&cfg)?;   // or cpu_offload(..)
//! // per batch of up to 128 pages:
//! let ticket = unsafe { offload.submit(&page_ptrs) }?;       // returns at once
//! ...                                                         // other work
//! offload.wait(ticket, &mut is_zero)?;                        // one bool per page
//! ```
//!
//! `submit` never fails for device reasons: a device that is missing,
//! disabled, full or out of batch slots makes it answer on the CPU instead
//! (counted in [`ZeroOffloadStats`]). `wait` finishes on the CPU whatever the
//! device could not (page faults from `bytes_completed`, error statuses).
//!
//! # DSA engine
//!
//! A fixed pool of *slots*, each owning the memory of one submission (128
//! COMPVAL descriptors, their records, and the batch descriptors/records),
//! 64-byte aligned. A submitter takes a free slot from a lock-free queue, so
//! the per-batch path takes no lock, fills it, submits one BATCH per chunk of
//! at most `max_batch_size` pages (a lone page goes as a plain COMPVAL), and
//! hands the slot to the completion thread. The completion thread polls the
//! status byte of each chunk's record (spinning with `spin_loop`, yielding
//! when nothing progresses, parking when nothing is outstanding), marks the
//! slot done and unparks the waiting worker. The worker decodes the records
//! and returns the slot. Queues (devices) are taken round-robin per submit.
//!
//! TODO(umwait): on CPUs with WAITPKG the completion thread could
//! UMONITOR/UMWAIT on the oldest outstanding record instead of spinning and
//! yielding; not done because no machine here has WAITPKG to test it.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
#[cfg(feature = "dsa")]
use std::{
    cell::UnsafeCell,
    ptr::addr_of_mut,
    sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicUsize},
    sync::{Mutex, OnceLock},
    thread::{JoinHandle, Thread},
    time::Instant,
};

#[cfg(feature = "dsa")]
use crossbeam_queue::ArrayQueue;

use super::OffloadError;
#[cfg(feature = "dsa")]
use super::desc::{CompletionRecord, Descriptor, DsaStatus};
#[cfg(feature = "dsa")]
use super::queue::{DsaQueue, HardwareQueue, SubmissionMethod, SubmitError};
#[cfg(feature = "dsa")]
use super::soft::{SoftwareDsa, SoftwareDsaConfig};
#[cfg(feature = "dsa")]
use super::sysfs::discover_work_queues;
#[cfg(feature = "dsa")]
use crate::codec::thread_cpu_ns;
use crate::zero::{PAGE_SIZE, ZeroChecker};

/// Most pages one [`ZeroPageOffload::submit`] takes: one engine batch.
pub const MAX_BATCH_PAGES: usize = 128;
/// Batch descriptors per slot: chunks have at least 2 pages when batching.
#[cfg(feature = "dsa")]
const MAX_CHUNKS: usize = MAX_BATCH_PAGES / 2;

/// [`PAGE_SIZE`] as a descriptor's `u32` transfer size.
#[cfg(feature = "dsa")]
const PAGE_SIZE_U32: u32 = 4096;
#[cfg(feature = "dsa")]
const _: () = assert!(PAGE_SIZE_U32 as usize == PAGE_SIZE);

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
    /// `wait` keeps its slot forever; pages must then stay mapped for the
    /// life of the offload.
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

/// A submitted batch; redeem with [`ZeroPageOffload::wait`].
#[must_use = "pass the ticket to wait(), or its batch slot is never reused"]
#[derive(Debug)]
pub struct Ticket {
    owner: u64,
    kind: TicketKind,
}

#[derive(Debug)]
enum TicketKind {
    /// Answered at submission (CPU): bit i set = page i is zero.
    Ready { zero: u128, len: u8 },
    /// In a DSA slot.
    #[cfg(feature = "dsa")]
    Slot { index: u32, generation: u32 },
}

/// Ids that tie tickets to the offload that issued them.
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// Counters of a [`ZeroPageOffload`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
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
    /// Queues disabled after repeated errors.
    pub queues_disabled: u64,
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
        let bytes = self.pages_checked() * PAGE_SIZE as u64;
        (bytes > 0).then(|| {
            self.completion_thread_cpu
                .mul_f64((1u64 << 30) as f64 / bytes as f64)
        })
    }
}

/// Atomic counterparts of [`ZeroOffloadStats`].
#[derive(Debug, Default)]
struct Counters {
    pages_device: AtomicU64,
    pages_cpu: AtomicU64,
    pages_fallback: AtomicU64,
    page_faults: AtomicU64,
    device_errors: AtomicU64,
    descriptors_submitted: AtomicU64,
    batches: AtomicU64,
    submit_failures: AtomicU64,
    slots_exhausted: AtomicU64,
    queues_disabled: AtomicU64,
    completion_cpu_ns: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> ZeroOffloadStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ZeroOffloadStats {
            pages_device: l(&self.pages_device),
            pages_cpu: l(&self.pages_cpu),
            pages_fallback: l(&self.pages_fallback),
            page_faults: l(&self.page_faults),
            device_errors: l(&self.device_errors),
            descriptors_submitted: l(&self.descriptors_submitted),
            batches: l(&self.batches),
            submit_retries: 0,
            submit_failures: l(&self.submit_failures),
            slots_exhausted: l(&self.slots_exhausted),
            queues_disabled: l(&self.queues_disabled),
            completion_thread_cpu: Duration::from_nanos(l(&self.completion_cpu_ns)),
        }
    }
}

/// Checks `pages` on the CPU; bit i of the result set = page i is zero.
///
/// # Safety
///
/// Every pointer readable for [`PAGE_SIZE`] bytes.
unsafe fn check_on_cpu(checker: &ZeroChecker, pages: &[*const u8]) -> u128 {
    let mut bits = 0u128;
    for (i, &p) in pages.iter().enumerate() {
        // SAFETY: forwarded from the caller.
        if unsafe { checker.is_zero_page(p) } {
            bits |= 1 << i;
        }
    }
    bits
}

fn ready_out(zero: u128, len: u8, out: &mut Vec<bool>) {
    out.clear();
    out.extend((0..len).map(|i| zero & (1 << i) != 0));
}

/// The CPU backend behind the same asynchronous interface, so workers have
/// one code path for every mode: `submit` does the work, `wait` hands it
/// over.
#[derive(Debug)]
pub struct CpuOffload {
    owner: u64,
    checker: ZeroChecker,
    counters: Counters,
}

impl CpuOffload {
    /// A CPU offload with `checker`.
    pub fn new(checker: ZeroChecker) -> Self {
        CpuOffload {
            owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
            checker,
            counters: Counters::default(),
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
        let zero = unsafe { check_on_cpu(&self.checker, pages) };
        self.counters
            .pages_cpu
            .fetch_add(pages.len() as u64, Ordering::Relaxed);
        Ok(Ticket {
            owner: self.owner,
            kind: TicketKind::Ready {
                zero,
                len: u8::try_from(pages.len()).expect("at most MAX_BATCH_PAGES"),
            },
        })
    }

    fn wait(&self, ticket: Ticket, out: &mut Vec<bool>) -> Result<(), OffloadError> {
        match ticket.kind {
            TicketKind::Ready { zero, len } if ticket.owner == self.owner => {
                ready_out(zero, len, out);
                Ok(())
            }
            _ => Err(OffloadError::BadTicket),
        }
    }

    fn is_done(&self, _: &Ticket) -> bool {
        true
    }

    fn stats(&self) -> ZeroOffloadStats {
        self.counters.snapshot()
    }

    fn describe(&self) -> String {
        format!("cpu ({})", self.checker.backend())
    }
}

/// Tuning of the DSA engine.
#[derive(Clone, Copy, Debug)]
pub struct OffloadConfig {
    /// Submissions in flight at once, over all workers and queues.
    pub slots: usize,
    /// Consecutive failed submissions (error status or timeout) after which
    /// a queue is disabled; 0 never disables.
    pub error_threshold: u32,
    /// A submission not complete after this long is abandoned to the CPU and
    /// its slot retired (a dedicated queue silently drops descriptors when
    /// overfilled, and a wedged device never answers).
    pub completion_timeout: Duration,
    /// Checker for CPU fallbacks.
    pub checker: ZeroChecker,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        OffloadConfig {
            slots: 256,
            error_threshold: 3,
            completion_timeout: Duration::from_secs(5),
            checker: ZeroChecker::best(),
        }
    }
}

/// Where to look for DSA and how to open it.
#[derive(Clone, Debug)]
pub struct DsaConfig {
    /// sysfs bus directory, normally `/sys/bus/dsa`.
    pub sysfs_root: PathBuf,
    /// Device node directory, normally `/dev/dsa`.
    pub dev_root: PathBuf,
    /// Only these queues (`dsa0/wq0.0` or `wq0.0`), if given.
    pub only: Option<Vec<String>>,
    /// Submit with write() even if the portal could be mapped.
    pub force_write: bool,
    /// ENQCMD / write() attempts before a submission is given up.
    pub submit_attempts: u32,
    /// Engine tuning.
    pub offload: OffloadConfig,
}

impl Default for DsaConfig {
    fn default() -> Self {
        DsaConfig {
            sysfs_root: "/sys/bus/dsa".into(),
            dev_root: "/dev/dsa".into(),
            only: None,
            force_write: false,
            submit_attempts: 64,
            offload: OffloadConfig::default(),
        }
    }
}

/// Would open DSA, but this build has the `dsa` feature off: always
/// [`OffloadError::NotBuilt`].
#[cfg(not(feature = "dsa"))]
pub fn open_dsa(config: &DsaConfig) -> Result<Arc<dyn ZeroPageOffload>, OffloadError> {
    let _ = config;
    Err(OffloadError::NotBuilt { feature: "dsa" })
}

/// Discovers and opens every usable DSA work queue and starts the engine.
///
/// An explicitly requested DSA that is missing is an error here, at start-up,
/// with a hint on how to set one up; later device trouble only makes pages go
/// to the CPU.
///
/// # Errors
///
/// [`OffloadError::NoWorkQueue`] if sysfs has no enabled user queue (after
/// the `only` filter), [`OffloadError::NoneOpened`] if none could be opened.
/// Without the `dsa` feature it always fails with [`OffloadError::NotBuilt`].
#[cfg(feature = "dsa")]
pub fn open_dsa(config: &DsaConfig) -> Result<Arc<dyn ZeroPageOffload>, OffloadError> {
    let mut wqs = discover_work_queues(&config.sysfs_root, &config.dev_root)?;
    if let Some(only) = &config.only {
        wqs.retain(|w| only.iter().any(|o| *o == w.full_name() || *o == w.queue));
        if wqs.is_empty() {
            return Err(OffloadError::NoWorkQueue {
                root: config.sysfs_root.display().to_string(),
            });
        }
    }
    let mut queues: Vec<Arc<dyn DsaQueue>> = Vec::new();
    let mut errors = Vec::new();
    for wq in &wqs {
        match HardwareQueue::open(wq, config.force_write, config.submit_attempts) {
            Ok(q) => {
                tracing::info!(
                    "DSA work queue {} ({}, size {}, max batch {}): submitting with {}",
                    wq.full_name(),
                    wq.mode.name(),
                    wq.size,
                    wq.max_batch_size,
                    q.method()
                );
                queues.push(Arc::new(q));
            }
            Err(e) => {
                tracing::warn!("{e}");
                errors.push(e.to_string());
            }
        }
    }
    if queues.is_empty() {
        return Err(OffloadError::NoneOpened(errors.join("; ")));
    }
    Ok(Arc::new(DsaOffload::new(queues, config.offload)?))
}

/// One software DSA device behind the engine, for tests and demos.
#[cfg(feature = "dsa")]
pub fn software_dsa(config: SoftwareDsaConfig) -> Arc<dyn ZeroPageOffload> {
    let queue: Arc<dyn DsaQueue> = Arc::new(SoftwareDsa::new(config));
    Arc::new(
        DsaOffload::new(vec![queue], OffloadConfig::default())
            .expect("one queue is enough to start"),
    )
}

/// Test knob like the seed's normal-page ratio: treats a share of the zero
/// pages as normal pages, so benchmarks can load the network with a known
/// amount of payload. Deterministic and lock-free: of every 1000 zero pages
/// seen, exactly `per_mille` are demoted, spread evenly.
#[derive(Debug)]
pub struct ZeroAsNormal {
    per_mille: u64,
    seen: AtomicU64,
}

impl ZeroAsNormal {
    /// `ratio` in 0.0..=1.0 (clamped): the share of zero pages to send as
    /// normal pages.
    pub fn new(ratio: f64) -> Self {
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a whole number in 0..=1000"
        )]
        let per_mille = (ratio.clamp(0.0, 1.0) * 1000.0).round() as u64;
        ZeroAsNormal {
            per_mille,
            seen: AtomicU64::new(0),
        }
    }

    /// Called for each zero page; true = send it as a normal page.
    pub fn demote(&self) -> bool {
        if self.per_mille == 0 {
            return false;
        }
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        (n + 1) * self.per_mille / 1000 != n * self.per_mille / 1000
    }
}

#[cfg(feature = "dsa")]
/// Memory of one submission. Everything the device reads or writes lives
/// here, 64-byte aligned (descriptor lists must be; records need 32).
#[repr(C, align(64))]
struct SlotMem {
    descs: [Descriptor; MAX_BATCH_PAGES],
    batch_descs: [Descriptor; MAX_CHUNKS],
    recs: [CompletionRecord; MAX_BATCH_PAGES],
    batch_recs: [CompletionRecord; MAX_CHUNKS],
}

#[cfg(feature = "dsa")]
/// A record whose status says a chunk is finished.
#[derive(Clone, Copy, Debug)]
enum Watch {
    /// A lone COMPVAL: its own record.
    Single(u8),
    /// A BATCH: its batch record (written after all its descriptors').
    Batch(u8),
}

#[cfg(feature = "dsa")]
/// Book-keeping of one submission, written by the submitter before the slot
/// is published and read-only afterwards.
struct SlotMeta {
    pages: [usize; MAX_BATCH_PAGES],
    len: usize,
    watch: Vec<Watch>,
    queue: usize,
    reserved: u32,
    submitted_at: Instant,
}

#[cfg(feature = "dsa")]
const FREE: u8 = 0;
#[cfg(feature = "dsa")]
const IN_FLIGHT: u8 = 1;
#[cfg(feature = "dsa")]
const DONE: u8 = 2;

#[cfg(feature = "dsa")]
struct Slot {
    mem: *mut SlotMem,
    meta: UnsafeCell<SlotMeta>,
    state: AtomicU8,
    generation: AtomicU32,
    timed_out: AtomicBool,
    waiter: Mutex<Option<Thread>>,
}

#[cfg(feature = "dsa")]
impl Slot {
    fn new() -> Self {
        let mem = Box::new(SlotMem {
            descs: [Descriptor::default(); MAX_BATCH_PAGES],
            batch_descs: [Descriptor::default(); MAX_CHUNKS],
            recs: [CompletionRecord::default(); MAX_BATCH_PAGES],
            batch_recs: [CompletionRecord::default(); MAX_CHUNKS],
        });
        Slot {
            mem: Box::into_raw(mem),
            meta: UnsafeCell::new(SlotMeta {
                pages: [0; MAX_BATCH_PAGES],
                len: 0,
                watch: Vec::with_capacity(MAX_BATCH_PAGES),
                queue: 0,
                reserved: 0,
                submitted_at: Instant::now(),
            }),
            state: AtomicU8::new(FREE),
            generation: AtomicU32::new(0),
            timed_out: AtomicBool::new(false),
            waiter: Mutex::new(None),
        }
    }

    fn rec(&self, i: usize) -> *const CompletionRecord {
        // SAFETY: in-bounds projection of the slot's live allocation; no
        // reference is created, so concurrent device writes are not aliased.
        unsafe {
            addr_of_mut!((*self.mem).recs)
                .cast::<CompletionRecord>()
                .add(i)
        }
    }

    fn batch_rec(&self, c: usize) -> *const CompletionRecord {
        // SAFETY: as in `rec`.
        unsafe {
            addr_of_mut!((*self.mem).batch_recs)
                .cast::<CompletionRecord>()
                .add(c)
        }
    }

    fn watch_rec(&self, w: Watch) -> *const CompletionRecord {
        match w {
            Watch::Single(i) => self.rec(usize::from(i)),
            Watch::Batch(c) => self.batch_rec(usize::from(c)),
        }
    }
}

#[cfg(feature = "dsa")]
/// A queue with the engine's health book-keeping.
#[derive(Debug)]
struct QueueEntry {
    queue: Arc<dyn DsaQueue>,
    /// Descriptors in flight, bounded by `capacity` for dedicated queues
    /// (MOVDIR64B gets no "queue full" answer: overfilling drops work).
    in_flight: AtomicU32,
    capacity: Option<u32>,
    consecutive_errors: AtomicU32,
    disabled: AtomicBool,
}

#[cfg(feature = "dsa")]
struct Inner {
    owner: u64,
    queues: Vec<QueueEntry>,
    next_queue: AtomicUsize,
    slots: Box<[Slot]>,
    free: ArrayQueue<u32>,
    pending: ArrayQueue<u32>,
    config: OffloadConfig,
    counters: Counters,
    stop: AtomicBool,
    poller: OnceLock<Thread>,
}

#[cfg(feature = "dsa")]
// SAFETY: the raw pointers and UnsafeCells in the slots are handed between
// threads by the slot protocol: a slot's memory and meta are written only by
// the thread that popped it from `free` (exclusive), published with a
// Release store of IN_FLIGHT and a push to `pending`; afterwards meta is
// read-only until the waiter, after an Acquire load of DONE, frees it again.
// The device touches only descriptors and records, which are accessed
// through raw pointers and atomic status loads, never references.
unsafe impl Send for Inner {}
#[cfg(feature = "dsa")]
// SAFETY: see Send.
unsafe impl Sync for Inner {}

#[cfg(feature = "dsa")]
impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inner")
            .field("queues", &self.queues)
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "dsa")]
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

#[cfg(feature = "dsa")]
/// The DSA engine: queues, slots and the completion thread.
#[derive(Debug)]
pub struct DsaOffload {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

#[cfg(feature = "dsa")]
impl DsaOffload {
    /// Starts the engine over `queues` (hardware or software), used
    /// round-robin.
    ///
    /// # Errors
    ///
    /// [`OffloadError::NoneOpened`] if `queues` is empty.
    pub fn new(
        queues: Vec<Arc<dyn DsaQueue>>,
        config: OffloadConfig,
    ) -> Result<Self, OffloadError> {
        if queues.is_empty() {
            return Err(OffloadError::NoneOpened("no queue given".into()));
        }
        let slots = config.slots.clamp(1, u32::MAX as usize);
        let free = ArrayQueue::new(slots);
        for i in 0..slots {
            let index = u32::try_from(i).expect("slots fit in u32");
            free.push(index).expect("capacity is slots");
        }
        let queues = queues
            .into_iter()
            .map(|queue| {
                // Only MOVDIR64B lacks a "queue full" answer.
                let capacity = match queue.method() {
                    SubmissionMethod::Movdir64b => queue
                        .capacity()
                        .map(|c| u32::try_from(c).unwrap_or(u32::MAX)),
                    _ => None,
                };
                QueueEntry {
                    queue,
                    in_flight: AtomicU32::new(0),
                    capacity,
                    consecutive_errors: AtomicU32::new(0),
                    disabled: AtomicBool::new(false),
                }
            })
            .collect();
        let inner = Arc::new(Inner {
            owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
            queues,
            next_queue: AtomicUsize::new(0),
            slots: (0..slots).map(|_| Slot::new()).collect(),
            free,
            pending: ArrayQueue::new(slots),
            config,
            counters: Counters::default(),
            stop: AtomicBool::new(false),
            poller: OnceLock::new(),
        });
        let poller_inner = inner.clone();
        let thread = std::thread::Builder::new()
            .name("tern-dsa-completion".into())
            .spawn(move || completion_thread(&poller_inner))
            .expect("spawning the DSA completion thread");
        let _ = inner.poller.set(thread.thread().clone());
        Ok(DsaOffload {
            inner,
            thread: Some(thread),
        })
    }

    /// Names and methods of the queues, e.g. `["dsa0/wq0.0 (movdir64b)"]`.
    pub fn queue_names(&self) -> Vec<String> {
        self.inner
            .queues
            .iter()
            .map(|q| format!("{} ({})", q.queue.name(), q.queue.method()))
            .collect()
    }
}

#[cfg(feature = "dsa")]
impl Drop for DsaOffload {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(feature = "dsa")]
impl Inner {
    /// Picks the next enabled queue with room for `len` pages; returns its
    /// index, chunk count and chunk limit, with the chunks reserved.
    fn pick_queue(&self, len: usize) -> Option<(usize, usize)> {
        let n = self.queues.len();
        let start = self.next_queue.fetch_add(1, Ordering::Relaxed);
        for k in 0..n {
            let qi = (start + k) % n;
            let q = &self.queues[qi];
            if q.disabled.load(Ordering::Relaxed) {
                continue;
            }
            let max = q.queue.max_batch_size().clamp(1, MAX_BATCH_PAGES);
            let chunks = if max == 1 { len } else { len.div_ceil(max) };
            if let Some(cap) = q.capacity {
                let chunks = u32::try_from(chunks).expect("at most MAX_BATCH_PAGES");
                let before = q.in_flight.fetch_add(chunks, Ordering::AcqRel);
                if before + chunks > cap {
                    q.in_flight.fetch_sub(chunks, Ordering::AcqRel);
                    continue;
                }
            }
            return Some((qi, chunks));
        }
        None
    }

    fn cpu_ticket(&self, pages: &[*const u8]) -> Ticket {
        // SAFETY: the caller of submit guaranteed the pages are readable.
        let zero = unsafe { check_on_cpu(&self.config.checker, pages) };
        self.counters
            .pages_fallback
            .fetch_add(pages.len() as u64, Ordering::Relaxed);
        Ticket {
            owner: self.owner,
            kind: TicketKind::Ready {
                zero,
                len: u8::try_from(pages.len()).expect("at most MAX_BATCH_PAGES"),
            },
        }
    }

    /// # Safety
    ///
    /// As [`ZeroPageOffload::submit`].
    unsafe fn submit(&self, pages: &[*const u8]) -> Result<Ticket, OffloadError> {
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
        let Some((qi, chunks)) = self.pick_queue(pages.len()) else {
            let _ = self.free.push(index);
            return Ok(self.cpu_ticket(pages));
        };
        let slot = &self.slots[index as usize];
        // SAFETY: popping `index` from `free` made this thread the slot's
        // only user until it is published below.
        let meta = unsafe { &mut *slot.meta.get() };
        let mem = slot.mem;
        let len = pages.len();
        // Raw pointers only from here on: once the first chunk is submitted
        // the device reads descriptors and writes records concurrently, so a
        // `&mut SlotMem` would be aliased.
        // SAFETY: `mem` is the slot's live allocation; addr_of_mut! projects
        // fields without creating references.
        let (descs, batch_descs, recs, batch_recs) = unsafe {
            (
                addr_of_mut!((*mem).descs).cast::<Descriptor>(),
                addr_of_mut!((*mem).batch_descs).cast::<Descriptor>(),
                addr_of_mut!((*mem).recs).cast::<CompletionRecord>(),
                addr_of_mut!((*mem).batch_recs).cast::<CompletionRecord>(),
            )
        };
        for (i, &page) in pages.iter().enumerate() {
            meta.pages[i] = page as usize;
            // SAFETY: i < MAX_BATCH_PAGES; records are zeroed before any
            // submission so "status 0" means "not written yet".
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
        meta.len = len;
        meta.queue = qi;
        meta.reserved = u32::try_from(chunks).expect("at most MAX_BATCH_PAGES");
        meta.watch.clear();
        meta.submitted_at = Instant::now();
        slot.timed_out.store(false, Ordering::Relaxed);
        let queue = &self.queues[qi];
        let mut start = 0;
        let mut submitted = 0u64;
        for c in 0..chunks {
            let size = len / chunks + usize::from(c < len % chunks);
            let (desc, watch) = if size == 1 {
                // SAFETY: start < len, initialised above.
                (
                    unsafe { descs.add(start).read() },
                    Watch::Single(u8::try_from(start).expect("below MAX_BATCH_PAGES")),
                )
            } else {
                // SAFETY: c < chunks <= MAX_CHUNKS (size >= 2 for every
                // chunk when batching); the list starts at a 64-byte aligned
                // descriptor.
                unsafe {
                    batch_recs.add(c).write(CompletionRecord::default());
                    let b = Descriptor::batch(
                        descs.add(start) as u64,
                        u32::try_from(size).expect("at most MAX_BATCH_PAGES"),
                        batch_recs.add(c) as u64,
                    );
                    batch_descs.add(c).write(b);
                    (b, Watch::Batch(u8::try_from(c).expect("below MAX_CHUNKS")))
                }
            };
            // SAFETY: the descriptor points at slot memory and at the
            // caller's pages, both valid until the slot is DONE and waited.
            match unsafe { queue.queue.submit(&desc) } {
                Ok(()) => {
                    meta.watch.push(watch);
                    submitted += 1;
                }
                Err(e) => {
                    self.counters
                        .submit_failures
                        .fetch_add(1, Ordering::Relaxed);
                    if let SubmitError::Io(_) | SubmitError::Stopped = e {
                        tracing::warn!(
                            "DSA queue {}: {e}; checking on the CPU",
                            queue.queue.name()
                        );
                    }
                }
            }
            start += size;
        }
        self.counters
            .descriptors_submitted
            .fetch_add(submitted, Ordering::Relaxed);
        if submitted > 0 {
            self.counters.batches.fetch_add(1, Ordering::Relaxed);
        }
        let generation = slot.generation.load(Ordering::Relaxed);
        slot.state.store(IN_FLIGHT, Ordering::Release);
        if self.pending.push(index).is_err() {
            unreachable!("pending holds every slot at most once");
        }
        if let Some(t) = self.poller.get() {
            // Cheap when the thread is not parked (an atomic swap).
            t.unpark();
        }
        Ok(Ticket {
            owner: self.owner,
            kind: TicketKind::Slot { index, generation },
        })
    }

    fn slot_of(&self, ticket: &Ticket) -> Result<Option<&Slot>, OffloadError> {
        if ticket.owner != self.owner {
            return Err(OffloadError::BadTicket);
        }
        match ticket.kind {
            TicketKind::Ready { .. } => Ok(None),
            TicketKind::Slot { index, generation } => {
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
        }
    }

    fn wait(&self, ticket: Ticket, out: &mut Vec<bool>) -> Result<(), OffloadError> {
        let Some(slot) = self.slot_of(&ticket)? else {
            if let TicketKind::Ready { zero, len } = ticket.kind {
                ready_out(zero, len, out);
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
        // SAFETY: the slot is DONE (Acquire above): the submitter's writes
        // are visible and nobody writes meta until we free it.
        let meta = unsafe { &*slot.meta.get() };
        let timed_out = slot.timed_out.load(Ordering::Acquire);
        let checker = &self.config.checker;
        out.clear();
        let (mut device, mut fallback, mut faults) = (0u64, 0u64, 0u64);
        let mut error: Option<u8> = None;
        for i in 0..meta.len {
            let page = meta.pages[i] as *const u8;
            let rec = if timed_out {
                // The device may still write these records: do not read them.
                None
            } else {
                // SAFETY: record i of a DONE slot; its chunk's watch record
                // was written last, so this one is final.
                Some(unsafe { slot.rec(i).read() })
            };
            let status = rec.map_or(DsaStatus::Pending, |r| r.decoded());
            let zero = match (status, rec) {
                (DsaStatus::Success, Some(r)) => {
                    device += 1;
                    r.result == 0
                }
                (DsaStatus::PageFault { .. }, Some(r)) => {
                    // The first bytes_completed bytes matched the pattern;
                    // the CPU reads the rest (and takes the fault itself).
                    faults += 1;
                    fallback += 1;
                    let done = (r.bytes_completed as usize).min(PAGE_SIZE);
                    // SAFETY: page..page+PAGE_SIZE is readable (submit's
                    // contract), so is its tail.
                    unsafe { checker.is_zero_range(page.add(done), PAGE_SIZE - done) }
                }
                (s, _) => {
                    if let DsaStatus::Error(code) = s {
                        error = Some(code);
                    }
                    fallback += 1;
                    // SAFETY: submit's contract.
                    unsafe { checker.is_zero_page(page) }
                }
            };
            out.push(zero);
        }
        if !timed_out {
            for &w in &meta.watch {
                if let Watch::Batch(_) = w {
                    // SAFETY: DONE slot, batch record final.
                    let st = unsafe { CompletionRecord::load_status(slot.watch_rec(w)) };
                    match DsaStatus::decode(st) {
                        DsaStatus::Error(code) => error = Some(code),
                        DsaStatus::BatchPageFault => error = Some(st),
                        _ => {}
                    }
                }
            }
        }
        let c = &self.counters;
        c.pages_device.fetch_add(device, Ordering::Relaxed);
        c.pages_fallback.fetch_add(fallback, Ordering::Relaxed);
        c.page_faults.fetch_add(faults, Ordering::Relaxed);
        let q = &self.queues[meta.queue];
        if error.is_some() || timed_out {
            c.device_errors.fetch_add(1, Ordering::Relaxed);
            let n = q.consecutive_errors.fetch_add(1, Ordering::Relaxed) + 1;
            let what = match error {
                Some(code) => format!("status {code:#04x}"),
                None => format!("no completion within {:?}", self.config.completion_timeout),
            };
            tracing::warn!(
                "DSA queue {}: {what}; {fallback} of {} pages checked on the CPU",
                q.queue.name(),
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
        } else if device > 0 {
            q.consecutive_errors.store(0, Ordering::Relaxed);
        }
        if timed_out {
            // Retired: the device may still write into it some day.
            return;
        }
        slot.generation.fetch_add(1, Ordering::Relaxed);
        slot.state.store(FREE, Ordering::Release);
        let _ = self.free.push(self.slot_index(slot));
    }

    fn slot_index(&self, slot: &Slot) -> u32 {
        // SAFETY: `slot` is an element of `self.slots` (callers only pass
        // slots obtained from it), so both pointers are in one allocation.
        let off = unsafe { (slot as *const Slot).offset_from(self.slots.as_ptr()) };
        u32::try_from(off).expect("a slot index, below the u32 slot count")
    }

    /// Whether every watched record of the slot has been written.
    fn slot_complete(&self, slot: &Slot) -> bool {
        // SAFETY: the slot is IN_FLIGHT and was received through `pending`
        // (which synchronises with the submitter's push): meta is read-only.
        let meta = unsafe { &*slot.meta.get() };
        meta.watch.iter().all(|&w| {
            // SAFETY: a record of the slot's live memory.
            unsafe { CompletionRecord::load_status(slot.watch_rec(w)) != 0 }
        })
    }

    fn mark_done(&self, slot: &Slot, timed_out: bool) {
        // SAFETY: as in slot_complete.
        let meta = unsafe { &*slot.meta.get() };
        let q = &self.queues[meta.queue];
        if q.capacity.is_some() {
            q.in_flight.fetch_sub(meta.reserved, Ordering::AcqRel);
        }
        slot.timed_out.store(timed_out, Ordering::Release);
        slot.state.store(DONE, Ordering::Release);
        if let Some(t) = slot.waiter.lock().unwrap_or_else(|e| e.into_inner()).take() {
            t.unpark();
        }
    }
}

#[cfg(feature = "dsa")]
/// Polls outstanding slots until stopped (and drained, within a bound).
fn completion_thread(inner: &Inner) {
    let mut active: Vec<u32> = Vec::with_capacity(inner.slots.len());
    let mut idle_polls = 0u32;
    let mut stop_deadline: Option<Instant> = None;
    let publish_cpu = || {
        inner
            .counters
            .completion_cpu_ns
            .store(thread_cpu_ns(), Ordering::Relaxed);
    };
    loop {
        while let Some(i) = inner.pending.pop() {
            active.push(i);
        }
        if inner.stop.load(Ordering::Acquire) {
            let deadline = *stop_deadline.get_or_insert_with(|| {
                Instant::now() + inner.config.completion_timeout.min(Duration::from_secs(2))
            });
            if active.is_empty() || Instant::now() > deadline {
                break;
            }
        }
        if active.is_empty() {
            publish_cpu();
            // Submitters unpark us after every push; the timeout is a
            // safety net only.
            std::thread::park_timeout(Duration::from_millis(100));
            continue;
        }
        let before = active.len();
        let check_timeouts = idle_polls % 1024 == 1023;
        active.retain(|&i| {
            let slot = &inner.slots[i as usize];
            if inner.slot_complete(slot) {
                inner.mark_done(slot, false);
                return false;
            }
            if check_timeouts {
                // SAFETY: as in slot_complete.
                let meta = unsafe { &*slot.meta.get() };
                if meta.submitted_at.elapsed() > inner.config.completion_timeout {
                    inner.mark_done(slot, true);
                    return false;
                }
            }
            true
        });
        if active.len() < before {
            idle_polls = 0;
            publish_cpu();
        } else {
            idle_polls = idle_polls.wrapping_add(1);
            if idle_polls < 64 {
                std::hint::spin_loop();
            } else {
                // Nothing moved for a while: let the device (or, with the
                // software device, its thread) have the core.
                std::thread::yield_now();
            }
        }
    }
    publish_cpu();
}

#[cfg(feature = "dsa")]
impl ZeroPageOffload for DsaOffload {
    unsafe fn submit(&self, pages: &[*const u8]) -> Result<Ticket, OffloadError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.submit(pages) }
    }

    fn wait(&self, ticket: Ticket, out: &mut Vec<bool>) -> Result<(), OffloadError> {
        self.inner.wait(ticket, out)
    }

    fn is_done(&self, ticket: &Ticket) -> bool {
        match self.inner.slot_of(ticket) {
            Ok(Some(slot)) => slot.state.load(Ordering::Acquire) == DONE,
            _ => true,
        }
    }

    fn stats(&self) -> ZeroOffloadStats {
        let mut s = self.inner.counters.snapshot();
        s.submit_retries = self.inner.queues.iter().map(|q| q.queue.retries()).sum();
        s
    }

    fn describe(&self) -> String {
        format!("dsa [{}]", self.queue_names().join(", "))
    }
}

#[cfg(all(test, feature = "dsa"))]
mod tests {
    use super::*;
    use crate::dsa::desc::STATUS_TRANSLATION_FAIL;

    /// Page-aligned test pages; page i is non-zero when `nonzero(i)`, at a
    /// byte that varies with i so every position class is covered.
    struct Pages {
        storage: Vec<u8>,
        start: usize,
        n: usize,
    }

    impl Pages {
        fn new(n: usize, nonzero: impl Fn(usize) -> bool) -> Self {
            let storage = vec![0u8; (n + 1) * PAGE_SIZE];
            let start = storage.as_ptr().align_offset(PAGE_SIZE);
            let mut p = Pages { storage, start, n };
            for i in 0..n {
                if nonzero(i) {
                    let pos = (i * 977) % PAGE_SIZE;
                    p.storage[p.start + i * PAGE_SIZE + pos] = 0x5a;
                }
            }
            p
        }

        fn ptrs(&self) -> Vec<*const u8> {
            (0..self.n)
                .map(|i| self.storage[self.start + i * PAGE_SIZE..].as_ptr())
                .collect()
        }

        fn expected(&self) -> Vec<bool> {
            self.storage[self.start..self.start + self.n * PAGE_SIZE]
                .chunks_exact(PAGE_SIZE)
                .map(|p| p.iter().all(|&b| b == 0))
                .collect()
        }
    }

    fn check(off: &dyn ZeroPageOffload, pages: &Pages) -> Vec<bool> {
        let mut out = Vec::new();
        // SAFETY: `pages` outlives the wait.
        let t = unsafe { off.submit(&pages.ptrs()) }.unwrap();
        off.wait(t, &mut out).unwrap();
        assert_eq!(out, pages.expected());
        out
    }

    fn soft(cfg: SoftwareDsaConfig) -> Arc<dyn DsaQueue> {
        Arc::new(SoftwareDsa::new(cfg))
    }

    #[test]
    fn all_zero_mixed_and_single() {
        let off = software_dsa(SoftwareDsaConfig::default());
        assert!(off.describe().starts_with("dsa [soft-dsa (software)]"));
        check(&*off, &Pages::new(128, |_| false));
        check(&*off, &Pages::new(128, |i| i % 3 == 0));
        check(&*off, &Pages::new(1, |_| false));
        check(&*off, &Pages::new(1, |_| true));
        check(&*off, &Pages::new(2, |i| i == 1));
        let s = off.stats();
        assert_eq!(s.pages_device, 128 + 128 + 1 + 1 + 2);
        assert_eq!(s.pages_fallback, 0);
        assert_eq!(s.batches, 5);
        // 128 pages at max batch 32 = 4 BATCH descriptors each; lone pages
        // go as one COMPVAL.
        assert_eq!(s.descriptors_submitted, 4 + 4 + 1 + 1 + 1);
        let mut out = vec![true];
        // SAFETY: no pages.
        let t = unsafe { off.submit(&[]) }.unwrap();
        off.wait(t, &mut out).unwrap();
        assert!(out.is_empty());
    }

    #[test]
    fn batches_larger_than_max_are_split() {
        for max in [2, 3, 7, 127, 128] {
            let off = DsaOffload::new(
                vec![soft(SoftwareDsaConfig {
                    max_batch_size: max,
                    ..Default::default()
                })],
                OffloadConfig::default(),
            )
            .unwrap();
            check(&off, &Pages::new(128, |i| i % 5 == 1));
            check(&off, &Pages::new(5, |i| i == 4));
            let s = off.stats();
            assert_eq!(s.pages_device, 133, "max {max}");
            assert_eq!(
                s.descriptors_submitted,
                (128usize.div_ceil(max) + 5usize.div_ceil(max)) as u64
            );
        }
    }

    #[test]
    fn write_path_submits_every_page_alone() {
        let off = DsaOffload::new(
            vec![soft(SoftwareDsaConfig {
                method: SubmissionMethod::Write,
                ..Default::default()
            })],
            OffloadConfig::default(),
        )
        .unwrap();
        check(&off, &Pages::new(40, |i| i % 2 == 0));
        assert_eq!(off.stats().descriptors_submitted, 40);
        assert!(off.describe().contains("(write)"));
    }

    #[test]
    fn page_faults_are_finished_on_the_cpu() {
        // Fault on every third descriptor, after 1000 bytes: a page whose
        // only non-zero byte lies beyond that must still be reported
        // non-zero, and one before it is found by the device.
        let off = DsaOffload::new(
            vec![soft(SoftwareDsaConfig {
                fault_if: Some(Arc::new(|n, _| n % 3 == 0)),
                fault_after_bytes: 1000,
                ..Default::default()
            })],
            OffloadConfig::default(),
        )
        .unwrap();
        let pages = Pages::new(96, |i| i % 2 == 0);
        check(&off, &pages);
        let s = off.stats();
        assert!(s.page_faults > 0, "{s:?}");
        assert_eq!(s.pages_fallback, s.page_faults);
        assert_eq!(s.pages_device + s.pages_fallback, 96);
        assert_eq!(s.device_errors, 0, "faults are not device errors");
    }

    #[test]
    fn device_errors_fall_back_then_disable_the_queue() {
        let off = DsaOffload::new(
            vec![soft(SoftwareDsaConfig {
                error_if: Some(Arc::new(|n, _| n % 10 == 0)),
                error_status: STATUS_TRANSLATION_FAIL,
                ..Default::default()
            })],
            OffloadConfig {
                error_threshold: 2,
                ..Default::default()
            },
        )
        .unwrap();
        let pages = Pages::new(64, |i| i % 4 == 3);
        // Each submission hits descriptors 10, 20, ... so every one errs.
        check(&off, &pages);
        let s = off.stats();
        assert_eq!(s.device_errors, 1);
        assert!(s.pages_fallback >= 6, "{s:?}");
        assert_eq!(s.queues_disabled, 0);
        check(&off, &pages);
        assert_eq!(off.stats().queues_disabled, 1);
        // Disabled: everything on the CPU, still correct.
        let before = off.stats();
        check(&off, &pages);
        let after = off.stats();
        assert_eq!(after.pages_fallback - before.pages_fallback, 64);
        assert_eq!(after.pages_device, before.pages_device);
    }

    #[test]
    fn refused_submissions_fall_back() {
        let off = DsaOffload::new(
            vec![soft(SoftwareDsaConfig {
                refuse_every: Some(2),
                max_batch_size: 16,
                ..Default::default()
            })],
            OffloadConfig::default(),
        )
        .unwrap();
        check(&off, &Pages::new(128, |i| i % 7 == 0));
        let s = off.stats();
        assert_eq!(s.submit_failures, 4, "{s:?}");
        assert_eq!(s.pages_fallback, 64);
        assert_eq!(s.pages_device, 64);
    }

    #[test]
    fn delays_still_correct_and_completion_cpu_measured() {
        let off = DsaOffload::new(
            vec![soft(SoftwareDsaConfig {
                delay_per_descriptor: Duration::from_micros(200),
                ..Default::default()
            })],
            OffloadConfig::default(),
        )
        .unwrap();
        let a = Pages::new(64, |i| i % 2 == 1);
        let b = Pages::new(64, |_| false);
        let mut out = Vec::new();
        // SAFETY: pages outlive the waits.
        let (ta, tb) = unsafe {
            (
                off.submit(&a.ptrs()).unwrap(),
                off.submit(&b.ptrs()).unwrap(),
            )
        };
        // Whether `tb` is still pending here depends on how long this thread
        // was descheduled since the submit, so only the outcome is checked.
        off.wait(tb, &mut out).unwrap();
        assert_eq!(out, b.expected());
        assert!(off.is_done(&ta), "FIFO device: a finished before b");
        off.wait(ta, &mut out).unwrap();
        assert_eq!(out, a.expected());
        // The completion thread publishes its CPU time after each batch.
        let s = off.stats();
        assert!(s.completion_thread_cpu > Duration::ZERO, "{s:?}");
        assert!(s.completion_cpu_per_gib().is_some());
    }

    #[test]
    fn concurrent_workers_share_two_devices_round_robin() {
        let devs: Vec<Arc<SoftwareDsa>> = (0..2)
            .map(|i| {
                Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
                    name: format!("soft{i}"),
                    queue_depth: 8,
                    ..Default::default()
                }))
            })
            .collect();
        let queues: Vec<Arc<dyn DsaQueue>> = devs
            .iter()
            .map(|d| d.clone() as Arc<dyn DsaQueue>)
            .collect();
        let off = Arc::new(
            DsaOffload::new(
                queues,
                OffloadConfig {
                    slots: 16,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let pages = Arc::new(Pages::new(128, |i| i % 3 == 2));
        let workers: Vec<_> = (0..4)
            .map(|w| {
                let off = off.clone();
                let pages = pages.clone();
                std::thread::spawn(move || {
                    let ptrs = pages.ptrs();
                    let want = pages.expected();
                    let mut out = Vec::new();
                    for round in 0..25 {
                        let n = 1 + (w * 31 + round * 17) % 128;
                        // Two in flight per worker.
                        // SAFETY: pages outlive the waits.
                        let t1 = unsafe { off.submit(&ptrs[..n]) }.unwrap();
                        // SAFETY: as above.
                        let t2 = unsafe { off.submit(&ptrs[128 - n..]) }.unwrap();
                        off.wait(t1, &mut out).unwrap();
                        assert_eq!(out, want[..n]);
                        off.wait(t2, &mut out).unwrap();
                        assert_eq!(out, want[128 - n..]);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        let s = off.stats();
        let total: usize = (0..4)
            .flat_map(|w| (0..25).map(move |r| 2 * (1 + (w * 31 + r * 17) % 128)))
            .sum();
        assert_eq!(s.pages_checked(), total as u64);
        // A submission whose every chunk was refused (queue full) counts in
        // neither.
        assert!(
            s.batches > 0 && s.batches + s.slots_exhausted <= 200,
            "{s:?}"
        );
        let (a, b) = (devs[0].compval_executed(), devs[1].compval_executed());
        assert!(a > 0 && b > 0, "both devices used: {a} / {b}");
        assert_eq!(a + b, s.pages_device);
    }

    #[test]
    fn bad_tickets_and_too_many_pages() {
        let a = software_dsa(SoftwareDsaConfig::default());
        let b = cpu_offload(ZeroChecker::best());
        let pages = Pages::new(3, |_| false);
        let mut out = Vec::new();
        // SAFETY: pages outlive the waits.
        let t = unsafe { a.submit(&pages.ptrs()) }.unwrap();
        assert!(matches!(b.wait(t, &mut out), Err(OffloadError::BadTicket)));
        let too_many = vec![pages.ptrs()[0]; MAX_BATCH_PAGES + 1];
        // SAFETY: rejected before any page is read.
        let r = unsafe { a.submit(&too_many) };
        assert!(matches!(r, Err(OffloadError::TooManyPages(129))));
        // SAFETY: as above.
        assert!(unsafe { b.submit(&too_many) }.is_err());
    }

    #[test]
    fn cpu_offload_same_shape() {
        let off = cpu_offload(ZeroChecker::best());
        check(&*off, &Pages::new(128, |i| i % 2 == 0));
        let s = off.stats();
        assert_eq!(s.pages_cpu, 128);
        assert_eq!(s.pages_checked(), 128);
        assert!(off.describe().starts_with("cpu ("));
    }

    #[test]
    fn slot_exhaustion_answers_on_the_cpu() {
        let off = DsaOffload::new(
            vec![soft(SoftwareDsaConfig {
                delay_per_descriptor: Duration::from_millis(2),
                ..Default::default()
            })],
            OffloadConfig {
                slots: 1,
                ..Default::default()
            },
        )
        .unwrap();
        let pages = Pages::new(4, |i| i == 0);
        let mut out = Vec::new();
        // SAFETY: pages outlive the waits.
        let t1 = unsafe { off.submit(&pages.ptrs()) }.unwrap();
        // SAFETY: as above.
        let t2 = unsafe { off.submit(&pages.ptrs()) }.unwrap();
        assert!(off.is_done(&t2), "answered on the CPU at once");
        off.wait(t2, &mut out).unwrap();
        assert_eq!(out, pages.expected());
        off.wait(t1, &mut out).unwrap();
        assert_eq!(out, pages.expected());
        assert_eq!(off.stats().slots_exhausted, 1);
    }

    #[test]
    fn open_dsa_errors_are_clear() {
        let t = tempfile::tempdir().unwrap();
        let cfg = DsaConfig {
            sysfs_root: t.path().join("sys/bus/dsa"),
            dev_root: t.path().join("dev/dsa"),
            ..Default::default()
        };
        let err = open_dsa(&cfg).unwrap_err().to_string();
        assert!(err.starts_with("no DSA work queue found in"), "{err}");
        assert!(err.contains("accel-config"), "{err}");
        crate::dsa::sysfs::tests::fake_wq(
            &cfg.sysfs_root,
            true,
            0,
            0,
            "enabled",
            "user",
            "dedicated",
            32,
        );
        let err = open_dsa(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("could be opened") && err.contains("wq0.0"),
            "{err}"
        );
        let only = DsaConfig {
            only: Some(vec!["dsa1/wq1.0".into()]),
            ..cfg
        };
        assert!(matches!(
            open_dsa(&only),
            Err(OffloadError::NoWorkQueue { .. })
        ));
    }

    #[test]
    fn zero_as_normal_ratio() {
        for (ratio, want) in [(0.0, 0), (0.25, 250), (0.5, 500), (1.0, 1000)] {
            let k = ZeroAsNormal::new(ratio);
            let n = (0..1000).filter(|_| k.demote()).count();
            assert_eq!(n, want, "ratio {ratio}");
        }
        let k = ZeroAsNormal::new(0.5);
        let first: Vec<bool> = (0..4).map(|_| k.demote()).collect();
        assert_eq!(first, [false, true, false, true], "spread evenly");
    }
}

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
//! status byte of each chunk's record (spinning with `spin_loop` for a few
//! rounds, then, when nothing progresses, UMONITOR/UMWAIT on the oldest
//! pending record where the CPU has WAITPKG, else `yield_now`; it parks when
//! nothing is outstanding), marks the slot done and unparks the waiting
//! worker. The worker decodes the records and returns the slot.
//!
//! Queues are taken round-robin per submit, those on the submitting CPU's
//! NUMA node first ([`NumaPolicy`]). Each queue carries at most its
//! [`capacity`](DsaQueue::capacity) descriptors in flight whatever the
//! submission path; pages of a batch that do not fit are checked on the CPU
//! by the submitter while the device works on the rest.
//!
//! A submission not complete [`completion_timeout`](OffloadConfig) after it
//! was made (measured on the monotonic clock at every polling round) is
//! answered on the CPU; since the device may still write its records some
//! day, its slot memory is never reused (leaked) and its queue is retired
//! with its reservation kept, so nothing is ever handed to that queue again.

// The DSA rework landed after the cast lints; its casts (descriptor fields
// of the device's fixed widths, bounded by MAX_BATCH_PAGES and queue sizes)
// are still to be spelled out with try_from, as elsewhere in this crate.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::cast_lossless,
    clippy::ptr_as_ptr
)]

use std::cell::UnsafeCell;
use std::fmt;
use std::path::PathBuf;
use std::ptr::addr_of_mut;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use super::OffloadError;
use super::desc::{CompletionRecord, Descriptor, DsaStatus};
use super::queue::{CpuSubmitFeatures, DsaQueue, HardwareQueue, SubmitError};
use super::select::{DsaSelection, NumaPolicy, current_numa_node, is_local};
use super::soft::{SoftwareDsa, SoftwareDsaConfig};
use super::sysfs::{WorkQueueInfo, WqMode, discover_work_queues};
use crate::zero::{PAGE_SIZE, ZeroChecker};

/// Most pages one [`ZeroPageOffload::submit`] takes: one engine batch.
pub const MAX_BATCH_PAGES: usize = 128;
/// Batch descriptors per slot: chunks have at least 2 pages when batching.
const MAX_CHUNKS: usize = MAX_BATCH_PAGES / 2;

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
    slots_retired: AtomicU64,
    pages_queue_full: AtomicU64,
    umwaits: AtomicU64,
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
            slots_retired: l(&self.slots_retired),
            pages_queue_full: l(&self.pages_queue_full),
            umwaits: l(&self.umwaits),
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
                len: pages.len() as u8,
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
    /// A submission not complete this long after it was made is answered
    /// on the CPU, its slot retired (never reused) and its queue retired (a
    /// lost descriptor leaves the queue's occupancy unknown, and a wedged
    /// device never answers).
    pub completion_timeout: Duration,
    /// Checker for CPU fallbacks.
    pub checker: ZeroChecker,
    /// Which queues a submission prefers, by NUMA node.
    pub numa: NumaPolicy,
    /// Let the completion thread UMWAIT on a pending record when the CPU
    /// has WAITPKG (else it yields).
    pub umwait: bool,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        OffloadConfig {
            slots: 256,
            error_threshold: 3,
            completion_timeout: Duration::from_secs(5),
            checker: ZeroChecker::best(),
            numa: NumaPolicy::PreferLocal,
            umwait: true,
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
    /// Only these devices or queues (`dsa0`, `dsa0/wq0.0`, `wq0.0`); the
    /// default selects every usable queue.
    pub devices: DsaSelection,
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
            devices: DsaSelection::all(),
            force_write: false,
            submit_attempts: 64,
            offload: OffloadConfig::default(),
        }
    }
}

/// Discovers and opens the DSA work queues to use and starts the engine.
///
/// Of the usable queues (limited to [`DsaConfig::devices`]), shared ones
/// come first: when the whole host is selected and a shared queue opens,
/// dedicated queues are left alone, since each takes a single process and
/// another tern (another VM migrating) may need it. A dedicated queue held
/// by another process is reported by name ([`OffloadError::QueueBusy`]).
///
/// An explicitly requested DSA that is missing is an error here, at start-up,
/// with a hint on how to set one up; later device trouble only makes pages go
/// to the CPU.
///
/// # Errors
///
/// [`OffloadError::NoWorkQueue`] if sysfs has no enabled user queue,
/// [`OffloadError::NoMatch`] if none is in the selection,
/// [`OffloadError::QueueBusy`] if the one candidate is a dedicated queue in
/// use, [`OffloadError::NoneOpened`] if none could be opened.
pub fn open_dsa(config: &DsaConfig) -> Result<Arc<dyn ZeroPageOffload>, OffloadError> {
    if !cfg!(feature = "dsa") {
        return Err(OffloadError::NotBuilt { feature: "dsa" });
    }
    let found = discover_work_queues(&config.sysfs_root, &config.dev_root)?;
    let wqs = select_queues(&found, &config.devices).ok_or_else(|| OffloadError::NoMatch {
        selection: config.devices.to_string(),
        found: found
            .iter()
            .map(WorkQueueInfo::full_name)
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    let mut queues: Vec<Arc<dyn DsaQueue>> = Vec::new();
    let mut errors = Vec::new();
    let mut shared_opened = false;
    for wq in &wqs {
        if wq.mode == WqMode::Dedicated && shared_opened && config.devices.is_all() {
            tracing::info!(
                "DSA work queue {} (dedicated) left to other processes: a shared queue is in use",
                wq.full_name()
            );
            continue;
        }
        match HardwareQueue::open(wq, config.force_write, config.submit_attempts) {
            Ok(q) => {
                tracing::info!(
                    "DSA work queue {} ({}, size {}, max batch {}, NUMA node {}): submitting with {}",
                    wq.full_name(),
                    wq.mode.name(),
                    wq.size,
                    wq.max_batch_size,
                    wq.numa_node
                        .map_or_else(|| "unknown".to_owned(), |n| n.to_string()),
                    q.method()
                );
                shared_opened |= wq.mode == WqMode::Shared;
                queues.push(Arc::new(q));
            }
            Err(e) => {
                tracing::warn!("{e}");
                errors.push(e);
            }
        }
    }
    if queues.is_empty() {
        if let [OffloadError::QueueBusy { .. }] = errors[..] {
            return Err(errors.remove(0));
        }
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        return Err(OffloadError::NoneOpened(text.join("; ")));
    }
    Ok(Arc::new(DsaOffload::new(queues, config.offload)?))
}

/// The queues of `found` that `selection` names, shared ones first (stable
/// otherwise); `None` if it names none.
fn select_queues(found: &[WorkQueueInfo], selection: &DsaSelection) -> Option<Vec<WorkQueueInfo>> {
    let mut wqs: Vec<WorkQueueInfo> = found
        .iter()
        .filter(|w| selection.matches(w))
        .cloned()
        .collect();
    wqs.sort_by_key(|w| w.mode != WqMode::Shared);
    (!wqs.is_empty()).then_some(wqs)
}

/// One software DSA device behind the engine, for tests and demos.
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
        ZeroAsNormal {
            per_mille: (ratio.clamp(0.0, 1.0) * 1000.0).round() as u64,
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

/// Memory of one submission. Everything the device reads or writes lives
/// here, 64-byte aligned (descriptor lists must be; records need 32).
#[repr(C, align(64))]
struct SlotMem {
    descs: [Descriptor; MAX_BATCH_PAGES],
    batch_descs: [Descriptor; MAX_CHUNKS],
    recs: [CompletionRecord; MAX_BATCH_PAGES],
    batch_recs: [CompletionRecord; MAX_CHUNKS],
}

/// A record whose status says a chunk is finished.
#[derive(Clone, Copy, Debug)]
enum Watch {
    /// A lone COMPVAL: its own record.
    Single(u8),
    /// A BATCH: its batch record (written after all its descriptors').
    Batch(u8),
}

/// Book-keeping of one submission, written by the submitter before the slot
/// is published and read-only afterwards.
struct SlotMeta {
    pages: [usize; MAX_BATCH_PAGES],
    len: usize,
    /// Pages `..device_len` went to the device; the rest did not fit in the
    /// queue and were checked on the CPU at submission, into `cpu_zero`.
    device_len: usize,
    /// Bit i set = page i (>= `device_len`) is zero.
    cpu_zero: u128,
    watch: Vec<Watch>,
    queue: usize,
    reserved: u32,
    submitted_at: Instant,
}

const FREE: u8 = 0;
const IN_FLIGHT: u8 = 1;
const DONE: u8 = 2;

struct Slot {
    mem: *mut SlotMem,
    meta: UnsafeCell<SlotMeta>,
    state: AtomicU8,
    generation: AtomicU32,
    timed_out: AtomicBool,
    waiter: Mutex<Option<Thread>>,
}

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
                device_len: 0,
                cpu_zero: 0,
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

/// A queue with the engine's health book-keeping.
#[derive(Debug)]
struct QueueEntry {
    queue: Arc<dyn DsaQueue>,
    /// Descriptors in flight (submitted, completion not yet seen), at most
    /// `capacity` on every submission path: a dedicated queue drops what
    /// does not fit without a word, whether fed by MOVDIR64B or by the
    /// kernel's write().
    in_flight: AtomicU32,
    capacity: u32,
    /// Whether `capacity` is enforced; only tests lift it, to show what the
    /// bound prevents.
    bounded: bool,
    numa_node: Option<u32>,
    consecutive_errors: AtomicU32,
    disabled: AtomicBool,
}

impl QueueEntry {
    /// Reserves up to `wanted` descriptors of room; returns how many (0 when
    /// the queue is full).
    fn reserve(&self, wanted: usize) -> usize {
        let wanted = u32::try_from(wanted).unwrap_or(u32::MAX);
        if !self.bounded {
            self.in_flight.fetch_add(wanted, Ordering::AcqRel);
            return wanted as usize;
        }
        let take = |n: u32| self.capacity.saturating_sub(n).min(wanted);
        match self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (take(n) > 0).then(|| n + take(n))
            }) {
            Ok(before) => take(before) as usize,
            Err(_) => 0,
        }
    }
}

/// Room reserved on a queue for (the head of) a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Reservation {
    queue: usize,
    chunks: usize,
    /// Pages the chunks carry: the whole batch, or the head that fits.
    pages: usize,
}

/// Why no queue took a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NoRoom {
    /// Every usable queue is full.
    Full,
    /// Every queue is disabled (or filtered out).
    Disabled,
}

struct Inner {
    owner: u64,
    queues: Vec<QueueEntry>,
    /// Whether the queues are on different known NUMA nodes, so the
    /// submitter's node is worth asking.
    numa_matters: bool,
    /// UMWAIT allowed and supported.
    umwait_available: bool,
    next_queue: AtomicUsize,
    slots: Box<[Slot]>,
    free: ArrayQueue<u32>,
    pending: ArrayQueue<u32>,
    config: OffloadConfig,
    counters: Counters,
    stop: AtomicBool,
    poller: OnceLock<Thread>,
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

/// The DSA engine: queues, slots and the completion thread.
#[derive(Debug)]
pub struct DsaOffload {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

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
        Self::with_bound(queues, config, true)
    }

    /// [`new`](Self::new), with the per-queue in-flight bound lifted when
    /// `bounded` is false (tests only: shows the overfill it prevents).
    fn with_bound(
        queues: Vec<Arc<dyn DsaQueue>>,
        config: OffloadConfig,
        bounded: bool,
    ) -> Result<Self, OffloadError> {
        if queues.is_empty() {
            return Err(OffloadError::NoneOpened("no queue given".into()));
        }
        let slots = config.slots.clamp(1, u32::MAX as usize);
        let free = ArrayQueue::new(slots);
        for i in 0..slots {
            free.push(i as u32).expect("capacity is slots");
        }
        let queues: Vec<QueueEntry> = queues
            .into_iter()
            .map(|queue| QueueEntry {
                capacity: u32::try_from(queue.capacity().max(1)).unwrap_or(u32::MAX),
                bounded,
                numa_node: queue.numa_node(),
                queue,
                in_flight: AtomicU32::new(0),
                consecutive_errors: AtomicU32::new(0),
                disabled: AtomicBool::new(false),
            })
            .collect();
        let first_node = queues.first().and_then(|q| q.numa_node);
        let numa_matters = config.numa == NumaPolicy::PreferLocal
            && queues
                .iter()
                .any(|q| q.numa_node.is_some() && q.numa_node != first_node);
        let inner = Arc::new(Inner {
            owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
            queues,
            numa_matters,
            umwait_available: config.umwait && CpuSubmitFeatures::detect().waitpkg,
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

impl Drop for DsaOffload {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Inner {
    /// Reserves room for up to `len` pages on the next enabled queue with
    /// any room, round-robin; with [`NumaPolicy::PreferLocal`] the queues on
    /// `cpu_node` (or of unknown node) are tried before the others. A queue
    /// with room for only part of the batch takes its head.
    fn pick_queue(&self, len: usize, cpu_node: Option<u32>) -> Result<Reservation, NoRoom> {
        let n = self.queues.len();
        let start = self.next_queue.fetch_add(1, Ordering::Relaxed);
        let tiered = self.config.numa == NumaPolicy::PreferLocal && cpu_node.is_some();
        let mut saw_enabled = false;
        for pass in 0..if tiered { 2 } else { 1 } {
            for k in 0..n {
                let qi = (start + k) % n;
                let q = &self.queues[qi];
                if tiered && is_local(q.numa_node, cpu_node) != (pass == 0) {
                    continue;
                }
                if q.disabled.load(Ordering::Relaxed) {
                    continue;
                }
                saw_enabled = true;
                let max = q.queue.max_batch_size().clamp(1, MAX_BATCH_PAGES);
                let needed = if max == 1 { len } else { len.div_ceil(max) };
                let chunks = q.reserve(needed);
                if chunks == 0 {
                    continue;
                }
                let pages = if chunks == needed { len } else { chunks * max };
                return Ok(Reservation {
                    queue: qi,
                    chunks,
                    pages,
                });
            }
        }
        Err(if saw_enabled {
            NoRoom::Full
        } else {
            NoRoom::Disabled
        })
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
                len: pages.len() as u8,
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
        let cpu_node = if self.numa_matters {
            current_numa_node()
        } else {
            None
        };
        let Reservation {
            queue: qi,
            chunks,
            pages: device_len,
        } = match self.pick_queue(pages.len(), cpu_node) {
            Ok(r) => r,
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
            if i >= device_len {
                continue;
            }
            // SAFETY: i < MAX_BATCH_PAGES; records are zeroed before any
            // submission so "status 0" means "not written yet".
            unsafe {
                recs.add(i).write(CompletionRecord::default());
                descs.add(i).write(Descriptor::compval(
                    page as u64,
                    PAGE_SIZE as u32,
                    0,
                    recs.add(i) as u64,
                ));
            }
        }
        meta.len = len;
        meta.device_len = device_len;
        meta.cpu_zero = 0;
        meta.queue = qi;
        meta.reserved = chunks as u32;
        meta.watch.clear();
        meta.submitted_at = Instant::now();
        slot.timed_out.store(false, Ordering::Relaxed);
        let queue = &self.queues[qi];
        let mut start = 0;
        let mut submitted = 0u64;
        for c in 0..chunks {
            let size = device_len / chunks + usize::from(c < device_len % chunks);
            let (desc, watch) = if size == 1 {
                // SAFETY: start < len, initialised above.
                (
                    unsafe { descs.add(start).read() },
                    Watch::Single(start as u8),
                )
            } else {
                // SAFETY: c < chunks <= MAX_CHUNKS (size >= 2 for every
                // chunk when batching); the list starts at a 64-byte aligned
                // descriptor.
                unsafe {
                    batch_recs.add(c).write(CompletionRecord::default());
                    let b = Descriptor::batch(
                        descs.add(start) as u64,
                        size as u32,
                        batch_recs.add(c) as u64,
                    );
                    batch_descs.add(c).write(b);
                    (b, Watch::Batch(c as u8))
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
        if device_len < len {
            // The queue had room for the head only: the tail is checked here,
            // while the device works on the head.
            // SAFETY: the caller of submit guaranteed the pages are readable.
            let tail = unsafe { check_on_cpu(&self.config.checker, &pages[device_len..]) };
            meta.cpu_zero = tail << device_len;
            let n = (len - device_len) as u64;
            self.counters.pages_fallback.fetch_add(n, Ordering::Relaxed);
            self.counters
                .pages_queue_full
                .fetch_add(n, Ordering::Relaxed);
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
            if i >= meta.device_len {
                // Checked on the CPU at submission (and counted there).
                out.push(meta.cpu_zero & (1 << i) != 0);
                continue;
            }
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
                None => format!(
                    "no completion within {:?} (queue and slot retired)",
                    self.config.completion_timeout
                ),
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
        off as u32
    }

    /// The first watched record of the slot not written yet, `None` when
    /// the slot is complete.
    fn first_pending(&self, slot: &Slot) -> Option<*const CompletionRecord> {
        // SAFETY: the slot is IN_FLIGHT and was received through `pending`
        // (which synchronises with the submitter's push): meta is read-only.
        let meta = unsafe { &*slot.meta.get() };
        meta.watch.iter().map(|&w| slot.watch_rec(w)).find(|&rec| {
            // SAFETY: a record of the slot's live memory.
            unsafe { CompletionRecord::load_status(rec) == 0 }
        })
    }

    fn mark_done(&self, slot: &Slot, timed_out: bool) {
        // SAFETY: as in first_pending.
        let meta = unsafe { &*slot.meta.get() };
        let q = &self.queues[meta.queue];
        if timed_out {
            // The device may still hold these descriptors (or have dropped
            // them: nobody can tell), so the queue's occupancy is unknown:
            // keep the reservation and hand the queue nothing more.
            self.counters.slots_retired.fetch_add(1, Ordering::Relaxed);
            if !q.disabled.swap(true, Ordering::Relaxed) {
                self.counters
                    .queues_disabled
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "DSA queue {} retired: a submission got no completion within {:?}",
                    q.queue.name(),
                    self.config.completion_timeout
                );
            }
        } else {
            q.in_flight.fetch_sub(meta.reserved, Ordering::AcqRel);
        }
        slot.timed_out.store(timed_out, Ordering::Release);
        slot.state.store(DONE, Ordering::Release);
        if let Some(t) = slot.waiter.lock().unwrap_or_else(|e| e.into_inner()).take() {
            t.unpark();
        }
    }
}

/// CPU time of the calling thread.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Idle polling rounds spent spinning before the completion thread waits
/// more politely (UMWAIT or yield).
const SPIN_ROUNDS: u32 = 64;

/// TSC cycles one UMWAIT may last (about 30-50 µs; the kernel's default
/// limit, `umwait_control/max_time`, is 100 000 as well).
const UMWAIT_CYCLES: u32 = 100_000;

/// What the completion thread does after a round in which nothing completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IdleStep {
    /// `spin_loop` and poll again: completions are usually microseconds away.
    Spin,
    /// UMONITOR the oldest pending record, UMWAIT until it is written (or a
    /// short deadline): the core idles in C0.2 instead of burning cycles.
    Umwait,
    /// No WAITPKG: give the core away (to the device's software thread, or
    /// anyone) and poll again.
    Yield,
}

/// The idle step after `idle_rounds` rounds without progress.
fn idle_step(idle_rounds: u32, umwait_available: bool) -> IdleStep {
    if idle_rounds < SPIN_ROUNDS {
        IdleStep::Spin
    } else if umwait_available {
        IdleStep::Umwait
    } else {
        IdleStep::Yield
    }
}

/// Polls outstanding slots until stopped (and drained, within a bound).
fn completion_thread(inner: &Inner) {
    let mut active: Vec<u32> = Vec::with_capacity(inner.slots.len());
    let mut idle_rounds = 0u32;
    let mut stop_deadline: Option<Instant> = None;
    let publish_cpu = || {
        inner
            .counters
            .completion_cpu_ns
            .store(thread_cpu_time().as_nanos() as u64, Ordering::Relaxed);
    };
    let timeout = inner.config.completion_timeout;
    loop {
        while let Some(i) = inner.pending.pop() {
            active.push(i);
        }
        if inner.stop.load(Ordering::Acquire) {
            let deadline = *stop_deadline
                .get_or_insert_with(|| Instant::now() + timeout.min(Duration::from_secs(2)));
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
        // One clock read per round: every outstanding submission is judged
        // by its own age, however many others complete meanwhile.
        let now = Instant::now();
        let mut oldest_pending: Option<*const CompletionRecord> = None;
        active.retain(|&i| {
            let slot = &inner.slots[i as usize];
            let Some(rec) = inner.first_pending(slot) else {
                inner.mark_done(slot, false);
                return false;
            };
            // SAFETY: as in first_pending.
            let meta = unsafe { &*slot.meta.get() };
            if now.saturating_duration_since(meta.submitted_at) > timeout {
                inner.mark_done(slot, true);
                return false;
            }
            oldest_pending.get_or_insert(rec);
            true
        });
        if active.len() < before {
            idle_rounds = 0;
            publish_cpu();
            continue;
        }
        idle_rounds = idle_rounds.saturating_add(1);
        match (
            idle_step(idle_rounds, inner.umwait_available),
            oldest_pending,
        ) {
            (IdleStep::Umwait, Some(rec)) => {
                inner.counters.umwaits.fetch_add(1, Ordering::Relaxed);
                // SAFETY: umwait_available implies the CPU has WAITPKG
                // (CPUID); `rec` is a record of a live slot (slot memory is
                // freed only when the engine is dropped, after this thread).
                unsafe { waitpkg::wait_for_write(rec.cast(), UMWAIT_CYCLES) };
            }
            (IdleStep::Spin, _) => std::hint::spin_loop(),
            // Nothing moved for a while: let the device (or, with the
            // software device, its thread) have the core.
            _ => std::thread::yield_now(),
        }
    }
    publish_cpu();
}

#[cfg(target_arch = "x86_64")]
mod waitpkg {
    /// Arms UMONITOR on `addr`'s cache line and, unless the byte at `addr`
    /// is already non-zero, UMWAITs (C0.2) until the line is written, an
    /// interrupt arrives, or `cycles` TSC cycles pass.
    ///
    /// # Safety
    ///
    /// The CPU must have WAITPKG and `addr` must be readable.
    pub(super) unsafe fn wait_for_write(addr: *const u8, cycles: u32) {
        // SAFETY: caller guarantees WAITPKG and a readable address. The
        // status is re-read after arming the monitor so a write between the
        // caller's poll and UMONITOR is not slept through. UMWAIT takes the
        // TSC deadline in EDX:EAX and the C-state hint in its operand (0 =
        // C0.2); it only sets flags.
        unsafe {
            core::arch::asm!(
                "umonitor {addr}",
                "cmp byte ptr [{addr}], 0",
                "jne 2f",
                "rdtsc",
                "add eax, {cycles:e}",
                "adc edx, 0",
                "umwait {hint:e}",
                "2:",
                addr = in(reg) addr,
                cycles = in(reg) cycles,
                hint = in(reg) 0u32,
                out("eax") _,
                out("edx") _,
                options(nostack),
            );
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod waitpkg {
    /// Never called: WAITPKG is only detected on x86_64.
    pub(super) unsafe fn wait_for_write(_: *const u8, _: u32) {}
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dsa::desc::STATUS_TRANSLATION_FAIL;
    use crate::dsa::queue::SubmissionMethod;
    use crate::dsa::soft::StallGate;

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
            devices: "dsa1/wq1.0".parse().unwrap(),
            ..cfg
        };
        let err = open_dsa(&only).unwrap_err();
        assert!(matches!(err, OffloadError::NoMatch { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("dsa1/wq1.0") && msg.contains("found: dsa0/wq0.0"),
            "{msg}"
        );
    }

    #[test]
    fn shared_queues_are_preferred_and_the_selection_is_honoured() {
        let t = tempfile::tempdir().unwrap();
        let cfg = DsaConfig {
            sysfs_root: t.path().join("sys/bus/dsa"),
            dev_root: t.path().join("dev/dsa"),
            ..Default::default()
        };
        let fake = crate::dsa::sysfs::tests::fake_wq;
        fake(
            &cfg.sysfs_root,
            true,
            0,
            0,
            "enabled",
            "user",
            "dedicated",
            32,
        );
        fake(&cfg.sysfs_root, true, 0, 1, "enabled", "user", "shared", 32);
        fake(
            &cfg.sysfs_root,
            true,
            2,
            1,
            "enabled",
            "user",
            "dedicated",
            32,
        );
        // Regular files stand in for the device nodes: they open, and with
        // no portal instruction used (nothing is submitted) that is enough.
        std::fs::create_dir_all(&cfg.dev_root).unwrap();
        for q in ["wq0.0", "wq0.1", "wq2.1"] {
            std::fs::write(cfg.dev_root.join(q), b"").unwrap();
        }
        let found = discover_work_queues(&cfg.sysfs_root, &cfg.dev_root).unwrap();
        let order: Vec<String> = select_queues(&found, &DsaSelection::all())
            .unwrap()
            .iter()
            .map(WorkQueueInfo::full_name)
            .collect();
        assert_eq!(order, ["dsa0/wq0.1", "dsa0/wq0.0", "dsa2/wq2.1"]);
        // Whole host: the shared queue only, dedicated ones left to others.
        let off = open_dsa(&cfg).unwrap();
        let d = off.describe();
        assert!(
            d.contains("dsa0/wq0.1") && !d.contains("wq0.0") && !d.contains("wq2.1"),
            "{d}"
        );
        // A list: exactly what it names, dedicated or not.
        let listed = DsaConfig {
            devices: "dsa2,dsa0/wq0.0".parse().unwrap(),
            ..cfg.clone()
        };
        let d = open_dsa(&listed).unwrap().describe();
        assert!(
            d.contains("dsa0/wq0.0") && d.contains("dsa2/wq2.1") && !d.contains("wq0.1"),
            "{d}"
        );
    }

    /// A software device whose first COMPVAL holds it until the gate opens.
    fn stalled_device(
        depth: usize,
        max_batch: usize,
        mode: WqMode,
    ) -> (Arc<SoftwareDsa>, Arc<StallGate>) {
        let gate = Arc::new(StallGate::default());
        let dev = Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
            mode,
            method: if mode == WqMode::Dedicated {
                SubmissionMethod::Movdir64b
            } else {
                SubmissionMethod::Enqcmd
            },
            queue_depth: depth,
            max_batch_size: max_batch,
            stall_if: Some(Arc::new(|n, _| n == 1)),
            stall_gate: gate.clone(),
            ..Default::default()
        }));
        (dev, gate)
    }

    #[test]
    fn a_dedicated_queue_is_never_overfilled_and_would_drop_without_the_bound() {
        for bounded in [true, false] {
            // The device holds its first descriptor until the gate opens, so
            // the queue stays as full as the submissions make it.
            let (dev, gate) = stalled_device(4, 2, WqMode::Dedicated);
            let off = DsaOffload::with_bound(
                vec![dev.clone() as Arc<dyn DsaQueue>],
                OffloadConfig {
                    // Bounded: nothing may time out, even on a loaded
                    // machine. Unbounded: the dropped descriptors must.
                    completion_timeout: Duration::from_millis(if bounded { 60_000 } else { 200 }),
                    ..Default::default()
                },
                bounded,
            )
            .unwrap();
            let pages = Pages::new(16, |i| i % 3 == 0);
            // 16 pages at max batch 2 = 8 BATCH descriptors: twice the queue.
            // SAFETY: pages outlive the wait.
            let t = unsafe { off.submit(&pages.ptrs()) }.unwrap();
            if bounded {
                assert_eq!(dev.dropped(), 0, "bounded: nothing dropped");
            } else {
                assert_eq!(dev.dropped(), 4, "unbounded: the overfill is dropped");
            }
            gate.open();
            let mut out = Vec::new();
            off.wait(t, &mut out).unwrap();
            assert_eq!(out, pages.expected(), "bounded {bounded}");
            let s = off.stats();
            if bounded {
                assert_eq!(s.pages_device, 8, "{s:?}");
                assert_eq!(s.pages_queue_full, 8, "{s:?}");
                assert_eq!(s.pages_fallback, 8, "{s:?}");
                assert_eq!(s.device_errors, 0, "{s:?}");
                assert!(dev.peak_occupancy() <= 4);
            } else {
                assert_eq!(s.device_errors, 1, "{s:?}");
                assert_eq!(s.slots_retired, 1, "{s:?}");
            }
        }
    }

    #[test]
    fn a_full_shared_queue_refuses_instead_of_dropping() {
        let (dev, gate) = stalled_device(4, 2, WqMode::Shared);
        let off = DsaOffload::with_bound(
            vec![dev.clone() as Arc<dyn DsaQueue>],
            OffloadConfig {
                completion_timeout: Duration::from_secs(60),
                ..Default::default()
            },
            false,
        )
        .unwrap();
        let pages = Pages::new(16, |i| i % 4 == 1);
        // SAFETY: pages outlive the wait.
        let t = unsafe { off.submit(&pages.ptrs()) }.unwrap();
        gate.open();
        let mut out = Vec::new();
        off.wait(t, &mut out).unwrap();
        assert_eq!(out, pages.expected());
        assert_eq!(dev.dropped(), 0);
        let s = off.stats();
        assert_eq!(s.submit_failures, 4, "{s:?}");
        assert_eq!(s.device_errors, 0, "{s:?}");
    }

    #[test]
    fn write_path_on_a_small_dedicated_queue_checks_the_rest_on_the_cpu() {
        let dev = Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
            mode: WqMode::Dedicated,
            method: SubmissionMethod::Write,
            queue_depth: 32,
            ..Default::default()
        }));
        let off = DsaOffload::new(
            vec![dev.clone() as Arc<dyn DsaQueue>],
            OffloadConfig::default(),
        )
        .unwrap();
        for _ in 0..3 {
            check(&off, &Pages::new(128, |i| i % 9 == 4));
        }
        let s = off.stats();
        assert_eq!(dev.dropped(), 0);
        assert_eq!(s.pages_device, 3 * 32, "{s:?}");
        assert_eq!(s.pages_queue_full, 3 * 96, "{s:?}");
        assert_eq!(s.descriptors_submitted, 3 * 32);
    }

    #[test]
    fn a_lost_descriptor_times_out_on_the_clock_while_others_complete() {
        let lossy = Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
            name: "lossy".into(),
            lose_if: Some(Arc::new(|k, _| k == 1)),
            ..Default::default()
        }));
        let healthy = soft(SoftwareDsaConfig {
            name: "healthy".into(),
            ..Default::default()
        });
        let off = DsaOffload::new(
            vec![lossy.clone() as Arc<dyn DsaQueue>, healthy],
            OffloadConfig {
                completion_timeout: Duration::from_secs(1),
                ..Default::default()
            },
        )
        .unwrap();
        let pages = Pages::new(8, |i| i == 5);
        // Round-robin starts at the lossy queue.
        // SAFETY: pages outlive the waits.
        let lost = unsafe { off.submit(&pages.ptrs()) }.unwrap();
        assert_eq!(lossy.lost(), 1);
        // Completions keep flowing on both queues meanwhile: the lost one
        // must still give up on its own clock, not when polling goes idle.
        let deadline = Instant::now() + Duration::from_secs(60);
        while !off.is_done(&lost) {
            assert!(
                Instant::now() < deadline,
                "the lost submission never timed out"
            );
            check(&off, &pages);
        }
        let mut out = Vec::new();
        off.wait(lost, &mut out).unwrap();
        assert_eq!(out, pages.expected());
        // At least the lost one; on a machine loaded enough to delay a
        // healthy batch past the timeout too, that one is retired as well.
        let s = off.stats();
        assert!(s.device_errors >= 1, "{s:?}");
        assert!(s.slots_retired >= 1, "{s:?}");
        assert!(s.queues_disabled >= 1, "the lossy queue is retired: {s:?}");
        let before = lossy.compval_executed();
        check(&off, &pages);
        check(&off, &pages);
        assert_eq!(lossy.compval_executed(), before, "nothing more to it");
    }

    #[test]
    fn a_stalled_submission_is_retired_and_its_late_completion_is_harmless() {
        let (dev, gate) = stalled_device(128, 32, WqMode::Shared);
        let off = DsaOffload::new(
            vec![dev.clone() as Arc<dyn DsaQueue>],
            OffloadConfig {
                slots: 2,
                completion_timeout: Duration::from_millis(100),
                ..Default::default()
            },
        )
        .unwrap();
        let pages = Pages::new(64, |i| i % 2 == 0);
        // SAFETY: pages outlive the wait.
        let stalled = unsafe { off.submit(&pages.ptrs()) }.unwrap();
        let mut out = Vec::new();
        // Returns once the timeout has passed, answered on the CPU.
        off.wait(stalled, &mut out).unwrap();
        assert_eq!(out, pages.expected());
        let s = off.stats();
        assert_eq!((s.slots_retired, s.queues_disabled), (1, 1), "{s:?}");
        assert_eq!(off.inner.free.len(), 1, "the retired slot is not free");
        // The device wakes up and writes its records late, into the retired
        // slot; a NOOP behind them (FIFO) says when it is done.
        gate.open();
        let rec = Box::new(CompletionRecord::default());
        let noop = Descriptor::noop(&*rec as *const CompletionRecord as u64);
        // SAFETY: the record outlives the poll below.
        unsafe { dev.submit(&noop) }.unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        // SAFETY: a live record.
        while unsafe { CompletionRecord::load_status(&*rec) } == 0 {
            assert!(Instant::now() < deadline, "the device never finished");
            std::thread::yield_now();
        }
        assert_eq!(dev.compval_executed(), 64, "the stalled batch ran late");
        for _ in 0..4 {
            check(&off, &pages);
        }
        assert_eq!(off.inner.free.len(), 1, "still never reused");
    }

    #[test]
    fn numa_local_queues_first_then_all() {
        let on_node = |name: &str, node| {
            soft(SoftwareDsaConfig {
                name: name.into(),
                numa_node: Some(node),
                queue_depth: 4,
                ..Default::default()
            })
        };
        let off = DsaOffload::new(
            vec![on_node("n0", 0), on_node("n1", 1)],
            OffloadConfig::default(),
        )
        .unwrap();
        let inner = &off.inner;
        assert!(inner.numa_matters);
        // 32 pages = one chunk; node 1's queue takes four, then is full.
        for _ in 0..4 {
            assert_eq!(inner.pick_queue(32, Some(1)).unwrap().queue, 1);
        }
        assert_eq!(inner.pick_queue(32, Some(1)).unwrap().queue, 0, "fall back");
        assert_eq!(inner.pick_queue(32, Some(0)).unwrap().queue, 0);
        // Partial room: two chunks left on node 0, a four-chunk batch gets
        // its head there.
        let r = inner.pick_queue(128, Some(0)).unwrap();
        assert_eq!((r.queue, r.chunks, r.pages), (0, 2, 64));
        assert_eq!(inner.pick_queue(1, Some(0)), Err(NoRoom::Full));
        // Unknown node, or the Any policy: round-robin over both.
        let any = DsaOffload::new(
            vec![on_node("a0", 0), on_node("a1", 1)],
            OffloadConfig {
                numa: NumaPolicy::Any,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(!any.inner.numa_matters);
        let picked: Vec<usize> = (0..4)
            .map(|_| any.inner.pick_queue(32, Some(1)).unwrap().queue)
            .collect();
        assert_eq!(picked, [0, 1, 0, 1]);
    }

    #[test]
    fn completion_thread_waits_with_umwait_only_where_waitpkg_exists() {
        use IdleStep::*;
        assert_eq!(idle_step(0, true), Spin);
        assert_eq!(idle_step(SPIN_ROUNDS - 1, true), Spin);
        assert_eq!(idle_step(SPIN_ROUNDS, true), Umwait);
        assert_eq!(idle_step(SPIN_ROUNDS, false), Yield);
        assert_eq!(idle_step(u32::MAX, false), Yield);
        let waitpkg = CpuSubmitFeatures::detect().waitpkg;
        let on = DsaOffload::new(vec![soft(Default::default())], OffloadConfig::default()).unwrap();
        assert_eq!(on.inner.umwait_available, waitpkg);
        let off = DsaOffload::new(
            vec![soft(Default::default())],
            OffloadConfig {
                umwait: false,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(!off.inner.umwait_available);
        check(&off, &Pages::new(64, |i| i == 3));
        assert_eq!(off.stats().umwaits, 0);
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

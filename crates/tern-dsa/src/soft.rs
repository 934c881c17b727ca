//! A software DSA device: consumes the same 64-byte descriptors as the
//! hardware and writes the same completion records, from its own thread, so
//! the whole asynchronous path (submission, batching, completion polling,
//! CPU fallback) runs in tests on machines without DSA.
//!
//! Behaviour follows the DSA specification for the operations the engine
//! uses (NOOP, BATCH, COMPVAL), and so does the queue: it holds
//! [`queue_depth`](SoftwareDsaConfig::queue_depth) descriptors (from
//! submission until executed); a *shared* queue refuses one more (ENQCMD's
//! retry answer) and a *dedicated* one silently drops it, as MOVDIR64B to a
//! full dedicated queue does. It can misbehave on request: page faults,
//! delays, stalls until released, lost descriptors, error statuses and
//! refused submissions are injectable through [`SoftwareDsaConfig`].

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::{addr_of_mut, read_unaligned};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::desc::{
    CompletionRecord, DELTA_RESULT_DIFFERENT, DELTA_RESULT_EQUAL, DELTA_RESULT_OVERFLOW,
    Descriptor, FLAG_CRAV, FLAG_RCR, OPCODE_AP_DELTA, OPCODE_BATCH, OPCODE_COMPVAL,
    OPCODE_CR_DELTA, OPCODE_NOOP, STATUS_BAD_OPCODE, STATUS_BATCH_FAIL, STATUS_DESC_CNT_ERANGE,
    STATUS_DESCLIST_ALIGN, STATUS_HW_ERR1, STATUS_PAGE_FAULT_NOBOF, STATUS_SUCCESS,
    STATUS_XFER_ERANGE,
};
use crate::queue::{DsaQueue, SubmissionMethod, SubmitError};
use crate::sysfs::WqMode;

/// Chooses descriptors for an injected fault or error: called with the
/// 1-based index of the COMPVAL descriptor among all the device executed,
/// and its source address.
pub type InjectPredicate = Arc<dyn Fn(u64, u64) -> bool + Send + Sync>;

/// How the software device behaves.
#[derive(Clone)]
pub struct SoftwareDsaConfig {
    /// Name in logs and stats.
    pub name: String,
    /// Largest BATCH accepted (the sysfs `max_batch_size`); batches outside
    /// 2..=this complete with DESC_CNT_ERANGE.
    pub max_batch_size: usize,
    /// Descriptors the queue holds (the sysfs `size`): one is held from
    /// submission until the device has executed it.
    pub queue_depth: usize,
    /// Shared: a submission to a full queue is refused (retried up to
    /// [`submit_attempts`](Self::submit_attempts), then
    /// [`SubmitError::QueueFull`]). Dedicated: it is accepted and silently
    /// dropped, never executed, no record written, as the hardware does.
    pub mode: WqMode,
    /// Submission method to emulate: [`SubmissionMethod::Write`] refuses
    /// BATCH descriptors and reports a max batch size of 1, like the kernel's
    /// write() path. Any other value accepts batches.
    pub method: SubmissionMethod,
    /// Submission attempts on a full queue before giving up (the ENQCMD
    /// retry bound).
    pub submit_attempts: u32,
    /// Time each COMPVAL descriptor takes.
    pub delay_per_descriptor: Duration,
    /// COMPVAL descriptors for which this returns true stop with
    /// PAGE_FAULT_NOBOF after [`fault_after_bytes`](Self::fault_after_bytes).
    pub fault_if: Option<InjectPredicate>,
    /// Bytes compared before an injected fault (clamped to the transfer).
    pub fault_after_bytes: u32,
    /// COMPVAL descriptors for which this returns true complete with
    /// [`error_status`](Self::error_status).
    pub error_if: Option<InjectPredicate>,
    /// Status written for injected errors (default HW_ERR1).
    pub error_status: u8,
    /// Every n-th call to `submit` (1-based) is refused as if the queue had
    /// stayed full.
    pub refuse_every: Option<u64>,
    /// Descriptors for which this returns true (called with the 1-based
    /// number of the descriptor among those the queue accepted, a BATCH
    /// counting as one, and its `src_addr`) are accepted and lost: never
    /// executed, no record, as a wedged or reset device would.
    pub lose_if: Option<InjectPredicate>,
    /// COMPVAL descriptors for which this returns true hold the device
    /// (every later descriptor waits too) until
    /// [`stall_gate`](Self::stall_gate) is opened; they then complete
    /// normally, late.
    pub stall_if: Option<InjectPredicate>,
    /// The gate stalled descriptors wait for; opened when the device is
    /// dropped.
    pub stall_gate: Arc<StallGate>,
    /// NUMA node the device reports.
    pub numa_node: Option<u32>,
}

/// A gate the software device's stalled descriptors wait on.
#[derive(Debug, Default)]
pub struct StallGate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl StallGate {
    /// Lets stalled descriptors (now and later) run.
    pub fn open(&self) {
        *self.open.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.opened.notify_all();
    }

    fn wait_open(&self) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        while !*open {
            open = self.opened.wait(open).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Default for SoftwareDsaConfig {
    fn default() -> Self {
        SoftwareDsaConfig {
            name: "soft-dsa".to_owned(),
            max_batch_size: 32,
            queue_depth: 128,
            mode: WqMode::Shared,
            method: SubmissionMethod::Software,
            submit_attempts: 64,
            delay_per_descriptor: Duration::ZERO,
            fault_if: None,
            fault_after_bytes: 1024,
            error_if: None,
            error_status: STATUS_HW_ERR1,
            refuse_every: None,
            lose_if: None,
            stall_if: None,
            stall_gate: Arc::default(),
            numa_node: None,
        }
    }
}

impl fmt::Debug for SoftwareDsaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SoftwareDsaConfig")
            .field("name", &self.name)
            .field("max_batch_size", &self.max_batch_size)
            .field("queue_depth", &self.queue_depth)
            .field("mode", &self.mode)
            .field("method", &self.method)
            .field("delay_per_descriptor", &self.delay_per_descriptor)
            .field("fault_if", &self.fault_if.is_some())
            .field("error_if", &self.error_if.is_some())
            .field("refuse_every", &self.refuse_every)
            .field("lose_if", &self.lose_if.is_some())
            .field("stall_if", &self.stall_if.is_some())
            .field("numa_node", &self.numa_node)
            .finish_non_exhaustive()
    }
}

/// Counters of what the software device did.
#[derive(Debug, Default)]
struct DeviceCounters {
    compval: AtomicU64,
    /// Create- and apply-delta descriptors.
    delta: AtomicU64,
    submits: AtomicU64,
    accepted: AtomicU64,
    retries: AtomicU64,
    dropped: AtomicU64,
    lost: AtomicU64,
    /// Descriptors in the queue: accepted and not yet executed.
    occupancy: AtomicUsize,
    /// Highest occupancy seen.
    peak: AtomicUsize,
    /// Calls to `submit` or `submit_many` (one write() each on that path).
    calls: AtomicU64,
    /// Set by [`SoftwareDsa::disable`]: nothing more runs or is accepted.
    disabled: AtomicBool,
}

/// The software device: a queue plus the thread that executes it.
pub struct SoftwareDsa {
    config: SoftwareDsaConfig,
    tx: Mutex<Option<Sender<Descriptor>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    counters: Arc<DeviceCounters>,
    /// Polls readable once the device is disabled, like the idxd driver's
    /// queue fd.
    events: OwnedFd,
}

impl fmt::Debug for SoftwareDsa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SoftwareDsa")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl SoftwareDsa {
    /// Starts the device thread.
    pub fn new(config: SoftwareDsaConfig) -> Self {
        let (tx, rx) = channel();
        let counters = Arc::new(DeviceCounters::default());
        let device = Device {
            config: config.clone(),
            counters: counters.clone(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("{}-engine", config.name))
            .spawn(move || device.run(rx))
            .expect("spawning the software DSA thread");
        // SAFETY: eventfd takes no pointers; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        assert!(raw >= 0, "eventfd: {}", std::io::Error::last_os_error());
        // SAFETY: `raw` is a fresh descriptor owned by nobody else.
        let events = unsafe { OwnedFd::from_raw_fd(raw) };
        SoftwareDsa {
            config,
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            counters,
            events,
        }
    }

    /// Disables the queue, as `accel-config disable-wq` or a device halt
    /// would: descriptors not yet executed are dropped without a record,
    /// later submissions are refused, and the event fd polls readable.
    pub fn disable(&self) {
        self.counters.disabled.store(true, Ordering::Release);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to the eventfd.
        let _ = unsafe {
            libc::write(
                std::os::fd::AsRawFd::as_raw_fd(&self.events),
                (&raw const one).cast(),
                8,
            )
        };
    }

    /// Calls to `submit` and `submit_many` so far (write() calls, on that
    /// path).
    pub fn submit_calls(&self) -> u64 {
        self.counters.calls.load(Ordering::Relaxed)
    }

    /// Descriptors offered to the queue so far, accepted or not.
    pub fn descriptors_offered(&self) -> u64 {
        self.counters.submits.load(Ordering::Relaxed)
    }

    /// COMPVAL descriptors executed so far.
    pub fn compval_executed(&self) -> u64 {
        self.counters.compval.load(Ordering::Relaxed)
    }

    /// Descriptors a full dedicated queue dropped.
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Descriptors lost on purpose ([`SoftwareDsaConfig::lose_if`]).
    pub fn lost(&self) -> u64 {
        self.counters.lost.load(Ordering::Relaxed)
    }

    /// Most descriptors the queue held at once.
    pub fn peak_occupancy(&self) -> usize {
        self.counters.peak.load(Ordering::Relaxed)
    }

    /// Takes a place in the queue if one is free.
    fn take_place(&self) -> bool {
        let depth = self.config.queue_depth.max(1);
        let taken =
            self.counters
                .occupancy
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < depth).then_some(n + 1)
                });
        match taken {
            Ok(before) => {
                self.counters.peak.fetch_max(before + 1, Ordering::Relaxed);
                true
            }
            Err(_) => false,
        }
    }
}

impl Drop for SoftwareDsa {
    fn drop(&mut self) {
        // Closing the channel ends the device thread after it drained the
        // queue, so no completion record is written after we return; a
        // stalled descriptor must be let go for that.
        self.config.stall_gate.open();
        self.tx.lock().map(|mut t| t.take()).ok();
        if let Ok(mut t) = self.thread.lock()
            && let Some(h) = t.take()
        {
            let _ = h.join();
        }
    }
}

impl SoftwareDsa {
    /// One descriptor into the queue (see [`DsaQueue::submit`]).
    fn submit_one(&self, desc: &Descriptor) -> Result<(), SubmitError> {
        if self.config.method == SubmissionMethod::Write && desc.opcode == OPCODE_BATCH {
            return Err(SubmitError::BatchRefused);
        }
        let n = self.counters.submits.fetch_add(1, Ordering::Relaxed) + 1;
        if self.counters.disabled.load(Ordering::Acquire) {
            // A disabled queue accepts nothing (ENQCMD keeps answering
            // retry; write() fails).
            return Err(SubmitError::QueueFull(self.config.submit_attempts));
        }
        if self
            .config
            .refuse_every
            .is_some_and(|k| k > 0 && n.is_multiple_of(k))
        {
            return Err(SubmitError::QueueFull(self.config.submit_attempts));
        }
        let tx = self
            .tx
            .lock()
            .ok()
            .and_then(|t| t.clone())
            .ok_or(SubmitError::Stopped)?;
        let mut placed = self.take_place();
        if !placed && self.config.mode == WqMode::Dedicated {
            // A posted write to a full dedicated queue: the submitter is
            // told nothing and the descriptor is gone.
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let attempts = self.config.submit_attempts.max(1);
        let mut attempt = 1;
        while !placed {
            if attempt >= attempts {
                return Err(SubmitError::QueueFull(self.config.submit_attempts));
            }
            self.counters.retries.fetch_add(1, Ordering::Relaxed);
            // A full software queue drains only if its thread runs.
            std::thread::yield_now();
            placed = self.take_place();
            attempt += 1;
        }
        let k = self.counters.accepted.fetch_add(1, Ordering::Relaxed) + 1;
        if self
            .config
            .lose_if
            .as_ref()
            .is_some_and(|f| f(k, desc.src_addr))
        {
            self.counters.lost.fetch_add(1, Ordering::Relaxed);
            self.counters.occupancy.fetch_sub(1, Ordering::AcqRel);
            return Ok(());
        }
        tx.send(*desc).map_err(|_| {
            self.counters.occupancy.fetch_sub(1, Ordering::AcqRel);
            SubmitError::Stopped
        })
    }
}

impl DsaQueue for SoftwareDsa {
    unsafe fn submit(&self, desc: &Descriptor) -> Result<(), SubmitError> {
        self.counters.calls.fetch_add(1, Ordering::Relaxed);
        self.submit_one(desc)
    }

    unsafe fn submit_many(&self, descs: &[Descriptor]) -> (usize, Option<SubmitError>) {
        self.counters.calls.fetch_add(1, Ordering::Relaxed);
        for (i, desc) in descs.iter().enumerate() {
            if let Err(e) = self.submit_one(desc) {
                return (i, Some(e));
            }
        }
        (descs.len(), None)
    }

    fn event_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.events.as_fd())
    }

    fn is_disabled(&self) -> bool {
        self.counters.disabled.load(Ordering::Acquire)
    }

    fn method(&self) -> SubmissionMethod {
        self.config.method
    }

    fn max_batch_size(&self) -> usize {
        if self.config.method.supports_batch() {
            self.config.max_batch_size.max(1)
        } else {
            1
        }
    }

    fn name(&self) -> String {
        self.config.name.clone()
    }

    fn retries(&self) -> u64 {
        self.counters.retries.load(Ordering::Relaxed)
    }

    fn capacity(&self) -> usize {
        self.config.queue_depth.max(1)
    }

    fn numa_node(&self) -> Option<u32> {
        self.config.numa_node
    }
}

/// The device thread's state.
struct Device {
    config: SoftwareDsaConfig,
    counters: Arc<DeviceCounters>,
}

/// What one descriptor produced, before it is written to its record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Outcome {
    status: u8,
    result: u8,
    bytes_completed: u32,
    fault_addr: u64,
    /// Create delta record: bytes of the record written.
    delta_rec_size: u32,
}

impl Outcome {
    fn status(status: u8) -> Self {
        Outcome {
            status,
            result: 0,
            bytes_completed: 0,
            fault_addr: 0,
            delta_rec_size: 0,
        }
    }
}

impl Device {
    fn run(self, rx: Receiver<Descriptor>) {
        while let Ok(desc) = rx.recv() {
            if self.counters.disabled.load(Ordering::Acquire) {
                // Disabled: what was queued is dropped, no record written.
                self.counters.occupancy.fetch_sub(1, Ordering::AcqRel);
                continue;
            }
            // SAFETY: submitters promised (DsaQueue::submit) that every
            // address in the descriptor is valid until its record is written.
            unsafe { self.execute(&desc, false) };
            self.counters.occupancy.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Executes one descriptor and writes its completion record as the spec
    /// says: always when RCR is set, otherwise only when it did not succeed,
    /// and never without CRAV. Returns the status for the enclosing batch.
    ///
    /// # Safety
    ///
    /// The descriptor's addresses must be valid (see `DsaQueue::submit`).
    unsafe fn execute(&self, desc: &Descriptor, in_batch: bool) -> u8 {
        let outcome = match desc.opcode {
            OPCODE_NOOP => Outcome::status(STATUS_SUCCESS),
            // SAFETY: forwarded from the caller.
            OPCODE_COMPVAL => unsafe { self.compval(desc) },
            // SAFETY: forwarded from the caller.
            OPCODE_CR_DELTA => unsafe { self.create_delta(desc) },
            // SAFETY: forwarded from the caller.
            OPCODE_AP_DELTA => unsafe { self.apply_delta(desc) },
            // A batch inside a batch is not allowed.
            OPCODE_BATCH if in_batch => Outcome::status(STATUS_BAD_OPCODE),
            // SAFETY: forwarded from the caller.
            OPCODE_BATCH => unsafe { self.batch(desc) },
            _ => Outcome::status(STATUS_BAD_OPCODE),
        };
        let flags = desc.flags();
        let wanted = flags & FLAG_RCR != 0 || outcome.status != STATUS_SUCCESS;
        // A misaligned record address cannot be written; real hardware
        // reports that through its software error register, which user
        // space does not see, so the record simply never arrives.
        if flags & FLAG_CRAV != 0 && wanted && desc.completion_addr.is_multiple_of(32) {
            // SAFETY: the record address is valid and aligned (caller,
            // checked just above).
            unsafe { write_record(desc.completion_addr as *mut CompletionRecord, outcome) };
        }
        outcome.status
    }

    /// COMPVAL: compares `xfer_size` bytes at `src_addr` with the 8-byte
    /// pattern in `dst_addr` (little-endian, repeating from the first byte).
    /// Result 0 if equal, 1 if not, with `bytes_completed` the offset of the
    /// first difference.
    ///
    /// # Safety
    ///
    /// `src_addr` must be readable for `xfer_size` bytes.
    unsafe fn compval(&self, desc: &Descriptor) -> Outcome {
        let n = self.counters.compval.fetch_add(1, Ordering::Relaxed) + 1;
        if self
            .config
            .stall_if
            .as_ref()
            .is_some_and(|f| f(n, desc.src_addr))
        {
            self.config.stall_gate.wait_open();
        }
        if !self.config.delay_per_descriptor.is_zero() {
            std::thread::sleep(self.config.delay_per_descriptor);
        }
        let src = desc.src_addr;
        if self.config.error_if.as_ref().is_some_and(|f| f(n, src)) {
            return Outcome::status(self.config.error_status);
        }
        let len = desc.xfer_size;
        let limit = if self.config.fault_if.as_ref().is_some_and(|f| f(n, src)) {
            Some(self.config.fault_after_bytes.min(len))
        } else {
            None
        };
        let scan = limit.unwrap_or(len);
        // SAFETY: scan <= xfer_size, readable (caller).
        let mismatch = unsafe { first_mismatch(src as *const u8, scan, desc.comp_pattern()) };
        match (mismatch, limit) {
            (Some(off), _) => Outcome {
                result: 1,
                bytes_completed: off,
                ..Outcome::status(STATUS_SUCCESS)
            },
            // Everything before the fault matched: report how far we got and
            // where we stopped, the rest is the submitter's job.
            (None, Some(done)) => Outcome {
                bytes_completed: done,
                fault_addr: src + u64::from(done),
                ..Outcome::status(STATUS_PAGE_FAULT_NOBOF)
            },
            (None, None) => Outcome {
                bytes_completed: len,
                ..Outcome::status(STATUS_SUCCESS)
            },
        }
    }

    /// Whether the injection predicates fault or fail delta descriptor
    /// number `n` (counted apart from COMPVAL's) on `addr`: the outcome to
    /// report instead of running it, faults stopping at byte
    /// `fault_after_bytes`.
    fn injected(&self, n: u64, addr: u64, len: u32) -> Option<Outcome> {
        if !self.config.delay_per_descriptor.is_zero() {
            std::thread::sleep(self.config.delay_per_descriptor);
        }
        if self.config.error_if.as_ref().is_some_and(|f| f(n, addr)) {
            return Some(Outcome::status(self.config.error_status));
        }
        if self.config.fault_if.as_ref().is_some_and(|f| f(n, addr)) {
            let done = self.config.fault_after_bytes.min(len);
            return Some(Outcome {
                bytes_completed: done,
                fault_addr: addr + u64::from(done),
                ..Outcome::status(STATUS_PAGE_FAULT_NOBOF)
            });
        }
        None
    }

    /// CR_DELTA: compares `xfer_size` bytes (whole 8-byte words, at most
    /// 65536 of them) of `src_addr` and `dst_addr` and writes, for each
    /// differing word, its index and `dst_addr`'s value to `delta_addr`.
    /// Result 0 equal, 1 different (`delta_rec_size` bytes written), 2 the
    /// record would pass `max_delta_size`.
    ///
    /// # Safety
    ///
    /// Both sources readable for `xfer_size` bytes, the record writable for
    /// `max_delta_size` bytes.
    unsafe fn create_delta(&self, desc: &Descriptor) -> Outcome {
        let n = self.counters.delta.fetch_add(1, Ordering::Relaxed) + 1;
        let len = desc.xfer_size;
        if let Some(injected) = self.injected(n, desc.src_addr, len) {
            return injected;
        }
        if !len.is_multiple_of(8) || len / 8 > 65536 {
            return Outcome::status(STATUS_XFER_ERANGE);
        }
        let (old, new) = (desc.src_addr as *const u8, desc.dst_addr as *const u8);
        let (record, max) = (desc.delta_addr() as *mut u8, desc.max_delta_size() as usize);
        let mut written = 0usize;
        for word in 0..(len / 8) as usize {
            // SAFETY: word * 8 + 8 <= len, readable (caller).
            let (a, b) = unsafe {
                (
                    read_unaligned(old.add(word * 8).cast::<u64>()),
                    read_unaligned(new.add(word * 8).cast::<u64>()),
                )
            };
            if a == b {
                continue;
            }
            if written + 10 > max {
                return Outcome {
                    result: DELTA_RESULT_OVERFLOW,
                    ..Outcome::status(STATUS_SUCCESS)
                };
            }
            let index = u16::try_from(word).expect("at most 65536 words");
            // SAFETY: written + 10 <= max_delta_size, writable (caller).
            unsafe {
                record
                    .add(written)
                    .cast::<[u8; 2]>()
                    .write_unaligned(index.to_le_bytes());
                record.add(written + 2).cast::<u64>().write_unaligned(b);
            }
            written += 10;
        }
        Outcome {
            result: if written == 0 {
                DELTA_RESULT_EQUAL
            } else {
                DELTA_RESULT_DIFFERENT
            },
            bytes_completed: len,
            delta_rec_size: u32::try_from(written).expect("at most max_delta_size"),
            ..Outcome::status(STATUS_SUCCESS)
        }
    }

    /// AP_DELTA: writes each entry of the `delta_rec_size`-byte record at
    /// `src_addr` into the `xfer_size` bytes at `dst_addr`. A record that is
    /// not whole entries, or names a word outside the destination, is
    /// refused before any write (`XFER_ERANGE`, tern's choice of code).
    ///
    /// # Safety
    ///
    /// The record readable, the destination writable, for their sizes.
    unsafe fn apply_delta(&self, desc: &Descriptor) -> Outcome {
        let n = self.counters.delta.fetch_add(1, Ordering::Relaxed) + 1;
        let size = desc.delta_rec_size() as usize;
        if let Some(injected) = self.injected(n, desc.dst_addr, desc.xfer_size) {
            return injected;
        }
        let record = desc.src_addr as *const u8;
        let words = (desc.xfer_size / 8) as usize;
        // SAFETY: the record is readable for `size` bytes (caller).
        let entry = |at: usize| unsafe {
            (
                u16::from_le_bytes(record.add(at).cast::<[u8; 2]>().read_unaligned()),
                read_unaligned(record.add(at + 2).cast::<u64>()),
            )
        };
        if !size.is_multiple_of(10)
            || (0..size)
                .step_by(10)
                .any(|at| usize::from(entry(at).0) >= words)
        {
            return Outcome::status(STATUS_XFER_ERANGE);
        }
        for at in (0..size).step_by(10) {
            let (word, value) = entry(at);
            // SAFETY: word < xfer_size / 8, writable (caller).
            unsafe {
                (desc.dst_addr as *mut u8)
                    .add(usize::from(word) * 8)
                    .cast::<u64>()
                    .write_unaligned(value);
            }
        }
        Outcome {
            bytes_completed: desc.xfer_size,
            ..Outcome::status(STATUS_SUCCESS)
        }
    }

    /// BATCH: checks count and list alignment, runs every listed descriptor
    /// (each writes its own record), then reports SUCCESS if all succeeded,
    /// else BATCH_FAIL, with the number of descriptors processed.
    ///
    /// # Safety
    ///
    /// The list must be readable for `desc_count` descriptors, each valid.
    unsafe fn batch(&self, desc: &Descriptor) -> Outcome {
        let count = desc.desc_count() as usize;
        if !(2..=self.config.max_batch_size).contains(&count) {
            return Outcome::status(STATUS_DESC_CNT_ERANGE);
        }
        let list = desc.desc_list_addr();
        if !list.is_multiple_of(64) {
            return Outcome::status(STATUS_DESCLIST_ALIGN);
        }
        let mut all_ok = true;
        for i in 0..count {
            // SAFETY: the list holds `count` aligned descriptors (caller);
            // copied out so the device never holds a reference into memory
            // the submitter owns.
            let child = unsafe { (list as *const Descriptor).add(i).read() };
            // SAFETY: forwarded from the caller.
            let st = unsafe { self.execute(&child, true) };
            all_ok &= st == STATUS_SUCCESS;
        }
        Outcome {
            bytes_completed: desc.desc_count(),
            ..Outcome::status(if all_ok {
                STATUS_SUCCESS
            } else {
                STATUS_BATCH_FAIL
            })
        }
    }
}

/// Offset of the first byte at `p` (of `len`) that differs from the repeating
/// little-endian `pattern`, or `None`.
///
/// # Safety
///
/// `p` must be readable for `len` bytes.
unsafe fn first_mismatch(p: *const u8, len: u32, pattern: u64) -> Option<u32> {
    let len = len as usize;
    let pat = pattern.to_le_bytes();
    let mut off = 0;
    while len - off >= 8 {
        // SAFETY: off + 8 <= len.
        let w = unsafe { read_unaligned(p.add(off).cast::<u64>()) };
        if w != pattern {
            let diff = (w ^ pattern).to_le_bytes();
            let first = diff.iter().position(|&b| b != 0).unwrap_or(0);
            return Some(u32::try_from(off + first).expect("below len, a u32"));
        }
        off += 8;
    }
    while off < len {
        // SAFETY: off < len.
        if unsafe { p.add(off).read() } != pat[off % 8] {
            return Some(u32::try_from(off).expect("below len, a u32"));
        }
        off += 1;
    }
    None
}

/// Writes a record: the payload fields first, then the status byte with a
/// Release store, so a poller that reads a non-zero status (Acquire) also
/// sees the payload. This mirrors the device, which writes the status last.
///
/// # Safety
///
/// `rec` must be valid for writes and 32-byte aligned.
unsafe fn write_record(rec: *mut CompletionRecord, o: Outcome) {
    // SAFETY: valid record (caller); the fields other than `status` are not
    // read by anyone until the status is non-zero.
    unsafe {
        addr_of_mut!((*rec).result).write(o.result);
        addr_of_mut!((*rec).bytes_completed).write(o.bytes_completed);
        addr_of_mut!((*rec).fault_addr).write(o.fault_addr);
        addr_of_mut!((*rec).op_specific)
            .cast::<[u8; 4]>()
            .write(o.delta_rec_size.to_le_bytes());
    }
    // SAFETY: the status byte of a valid record; pollers access it only
    // atomically (CompletionRecord::load_status).
    let status = unsafe { &*addr_of_mut!((*rec).status).cast::<AtomicU8>() };
    status.store(o.status, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{SoftwareDsa, SoftwareDsaConfig, StallGate};
    use crate::desc::{
        CompletionRecord, Descriptor, DsaStatus, FLAG_CRAV, FLAG_RCR, STATUS_BAD_OPCODE,
        STATUS_BATCH_FAIL, STATUS_DESC_CNT_ERANGE, STATUS_DESCLIST_ALIGN, STATUS_HW_ERR1,
        STATUS_NONE, STATUS_SUCCESS, STATUS_TRANSLATION_FAIL,
    };
    use crate::queue::{DsaQueue, SubmissionMethod, SubmitError};
    use crate::sysfs::WqMode;

    /// Descriptors and records for direct device tests.
    #[repr(C, align(64))]
    struct Mem {
        list: [Descriptor; 8],
        recs: [CompletionRecord; 8],
        batch_rec: CompletionRecord,
    }

    fn mem() -> Box<Mem> {
        Box::new(Mem {
            list: [Descriptor::default(); 8],
            recs: [CompletionRecord::default(); 8],
            batch_rec: CompletionRecord::default(),
        })
    }

    fn wait(rec: *const CompletionRecord) -> CompletionRecord {
        let t = Instant::now();
        // SAFETY: `rec` points into a live Mem.
        while unsafe { CompletionRecord::load_status(rec) } == 0 {
            // Generous: the device thread may wait long for a CPU on a
            // loaded machine; only a lost completion should fail here.
            assert!(t.elapsed() < Duration::from_secs(60), "no completion");
            std::thread::yield_now();
        }
        // SAFETY: as above; status is non-zero so the device is done.
        unsafe { rec.read() }
    }

    fn addr<T>(r: &T) -> u64 {
        r as *const T as u64
    }

    #[test]
    fn compval_equal_and_different() {
        let dev = SoftwareDsa::new(SoftwareDsaConfig::default());
        let mut page = vec![0u8; 4096];
        let mut m = mem();
        let d = Descriptor::compval(page.as_ptr() as u64, 4096, 0, addr(&m.recs[0]));
        // SAFETY: page and record outlive the wait below.
        unsafe { dev.submit(&d).unwrap() };
        let r = wait(&m.recs[0]);
        assert_eq!((r.status, r.result), (STATUS_SUCCESS, 0));
        assert_eq!(r.bytes_completed, 4096);

        page[1234] = 9;
        m.recs[1] = CompletionRecord::default();
        let d = Descriptor::compval(page.as_ptr() as u64, 4096, 0, addr(&m.recs[1]));
        // SAFETY: as above.
        unsafe { dev.submit(&d).unwrap() };
        let r = wait(&m.recs[1]);
        assert_eq!((r.status, r.result), (STATUS_SUCCESS, 1));
        assert_eq!(r.bytes_completed, 1234, "offset of the first difference");
    }

    #[test]
    fn compval_nonzero_pattern_and_odd_length() {
        let dev = SoftwareDsa::new(SoftwareDsaConfig::default());
        let pattern = 0x0807_0605_0403_0201u64;
        let buf: Vec<u8> = (0..21u8).map(|i| i % 8 + 1).collect();
        let m = mem();
        let d = Descriptor::compval(buf.as_ptr() as u64, 21, pattern, addr(&m.recs[0]));
        // SAFETY: buffer and record outlive the wait.
        unsafe { dev.submit(&d).unwrap() };
        let r = wait(&m.recs[0]);
        assert_eq!((r.status, r.result), (STATUS_SUCCESS, 0));
    }

    #[test]
    fn batch_success_fail_and_count_errors() {
        let dev = SoftwareDsa::new(SoftwareDsaConfig {
            max_batch_size: 4,
            ..Default::default()
        });
        let zero = vec![0u8; 4096];
        let mut m = mem();
        for i in 0..3 {
            let rec = addr(&m.recs[i]);
            m.list[i] = Descriptor::compval(zero.as_ptr() as u64, 4096, 0, rec);
        }
        let d = Descriptor::batch(addr(&m.list[0]), 3, addr(&m.batch_rec));
        // SAFETY: list, pages and records outlive the wait.
        unsafe { dev.submit(&d).unwrap() };
        let r = wait(&m.batch_rec);
        assert_eq!(r.status, STATUS_SUCCESS);
        assert_eq!(r.bytes_completed, 3, "descriptors completed");
        assert!(m.recs[..3].iter().all(|r| r.status == STATUS_SUCCESS));

        // One bad opcode makes the batch fail; the others still ran.
        m.list[1].opcode = 0x7f;
        m.recs = [CompletionRecord::default(); 8];
        m.batch_rec = CompletionRecord::default();
        // SAFETY: as above.
        unsafe { dev.submit(&d).unwrap() };
        let r = wait(&m.batch_rec);
        assert_eq!(r.status, STATUS_BATCH_FAIL);
        assert_eq!(m.recs[1].status, STATUS_BAD_OPCODE);
        assert_eq!(m.recs[0].status, STATUS_SUCCESS);
        assert_eq!(m.recs[2].status, STATUS_SUCCESS);

        // Counts outside 2..=max.
        for count in [1, 5] {
            m.batch_rec = CompletionRecord::default();
            let d = Descriptor::batch(addr(&m.list[0]), count, addr(&m.batch_rec));
            // SAFETY: as above.
            unsafe { dev.submit(&d).unwrap() };
            assert_eq!(wait(&m.batch_rec).status, STATUS_DESC_CNT_ERANGE);
        }
        // Misaligned list.
        m.batch_rec = CompletionRecord::default();
        let d = Descriptor::batch(addr(&m.list[0]) + 8, 2, addr(&m.batch_rec));
        // SAFETY: the device rejects the list before reading it.
        unsafe { dev.submit(&d).unwrap() };
        assert_eq!(wait(&m.batch_rec).status, STATUS_DESCLIST_ALIGN);
        // Nested batch.
        m.list[0] = Descriptor::batch(addr(&m.list[0]), 2, addr(&m.recs[0]));
        m.list[1] = Descriptor::noop(addr(&m.recs[1]));
        m.recs = [CompletionRecord::default(); 8];
        m.batch_rec = CompletionRecord::default();
        let d = Descriptor::batch(addr(&m.list[0]), 2, addr(&m.batch_rec));
        // SAFETY: as above.
        unsafe { dev.submit(&d).unwrap() };
        assert_eq!(wait(&m.batch_rec).status, STATUS_BATCH_FAIL);
        assert_eq!(m.recs[0].status, STATUS_BAD_OPCODE);
        assert_eq!(m.recs[1].status, STATUS_SUCCESS);
    }

    #[test]
    fn record_only_on_error_without_rcr_and_never_without_crav() {
        let dev = SoftwareDsa::new(SoftwareDsaConfig::default());
        let m = mem();
        let mut ok = Descriptor::noop(addr(&m.recs[0]));
        ok.set_flags(FLAG_CRAV);
        let mut bad = Descriptor::noop(addr(&m.recs[1]));
        bad.set_flags(FLAG_CRAV);
        bad.opcode = 0x7f;
        let mut silent = Descriptor::noop(addr(&m.recs[2]));
        silent.set_flags(FLAG_RCR);
        silent.opcode = 0x7f;
        let fence = Descriptor::noop(addr(&m.recs[3]));
        for d in [ok, bad, silent, fence] {
            // SAFETY: records outlive the wait below.
            unsafe { dev.submit(&d).unwrap() };
        }
        // The queue is FIFO, so once the last one completes the rest ran.
        wait(&m.recs[3]);
        assert_eq!(m.recs[0].status, STATUS_NONE, "success, no RCR: no record");
        assert_eq!(m.recs[1].status, STATUS_BAD_OPCODE, "error: record");
        assert_eq!(m.recs[2].status, STATUS_NONE, "no CRAV: no record");
    }

    #[test]
    fn injected_fault_reports_partial_progress() {
        let dev = SoftwareDsa::new(SoftwareDsaConfig {
            fault_if: Some(Arc::new(|_, _| true)),
            fault_after_bytes: 512,
            ..Default::default()
        });
        let mut page = vec![0u8; 4096];
        let m = mem();
        let d = Descriptor::compval(page.as_ptr() as u64, 4096, 0, addr(&m.recs[0]));
        // SAFETY: page and record outlive the wait.
        unsafe { dev.submit(&d).unwrap() };
        let r = wait(&m.recs[0]);
        assert_eq!(r.decoded(), DsaStatus::PageFault { write: false });
        assert_eq!(r.bytes_completed, 512);
        assert_eq!(r.fault_addr, page.as_ptr() as u64 + 512);
        // A difference before the fault point is found before the fault.
        page[100] = 1;
        let d = Descriptor::compval(page.as_ptr() as u64, 4096, 0, addr(&m.recs[1]));
        // SAFETY: as above.
        unsafe { dev.submit(&d).unwrap() };
        let r = wait(&m.recs[1]);
        assert_eq!(
            (r.status, r.result, r.bytes_completed),
            (STATUS_SUCCESS, 1, 100)
        );
    }

    #[test]
    fn default_injected_error_is_hardware_error_1() {
        let cfg = SoftwareDsaConfig::default();
        assert_eq!(cfg.error_status, 0x20, "DSA_COMP_HW_ERR1 in <linux/idxd.h>");
        let dev = SoftwareDsa::new(SoftwareDsaConfig {
            error_if: Some(Arc::new(|_, _| true)),
            ..cfg
        });
        let page = vec![0u8; 4096];
        let m = mem();
        let d = Descriptor::compval(page.as_ptr() as u64, 4096, 0, addr(&m.recs[0]));
        // SAFETY: page and record outlive the wait.
        unsafe { dev.submit(&d).unwrap() };
        assert_eq!(wait(&m.recs[0]).decoded(), DsaStatus::Error(STATUS_HW_ERR1));
    }

    /// A device of `depth` whose first COMPVAL holds it until the gate
    /// opens, in `mode`.
    fn held_device(depth: usize, mode: WqMode) -> (SoftwareDsa, Arc<StallGate>) {
        let gate = Arc::new(StallGate::default());
        let dev = SoftwareDsa::new(SoftwareDsaConfig {
            queue_depth: depth,
            mode,
            submit_attempts: 3,
            stall_if: Some(Arc::new(|n, _| n == 1)),
            stall_gate: gate.clone(),
            ..Default::default()
        });
        (dev, gate)
    }

    #[test]
    fn a_full_dedicated_queue_drops_silently_and_a_shared_one_refuses() {
        let page = vec![0u8; 4096];
        for mode in [WqMode::Dedicated, WqMode::Shared] {
            let (dev, gate) = held_device(2, mode);
            let m = mem();
            let d = |i: usize| Descriptor::compval(page.as_ptr() as u64, 4096, 0, addr(&m.recs[i]));
            // SAFETY: page and records outlive the waits (the device is
            // dropped, and so drained, before them).
            unsafe {
                dev.submit(&d(0)).unwrap();
                dev.submit(&d(1)).unwrap();
            }
            // The first is held, so both places stay taken.
            // SAFETY: as above.
            let third = unsafe { dev.submit(&d(2)) };
            match mode {
                WqMode::Dedicated => {
                    assert!(third.is_ok(), "no feedback on a dedicated queue");
                    assert_eq!(dev.dropped(), 1);
                }
                WqMode::Shared => {
                    assert!(matches!(third, Err(SubmitError::QueueFull(3))), "{third:?}");
                    assert_eq!(dev.dropped(), 0);
                    assert_eq!(dev.retries(), 2);
                }
            }
            gate.open();
            assert_eq!(wait(&m.recs[0]).status, STATUS_SUCCESS);
            assert_eq!(wait(&m.recs[1]).status, STATUS_SUCCESS);
            // Room again once executed: a NOOP behind proves the third never ran.
            let m2 = mem();
            // SAFETY: record outlives the wait.
            unsafe { dev.submit(&Descriptor::noop(addr(&m2.recs[0]))).unwrap() };
            wait(&m2.recs[0]);
            assert_eq!(m.recs[2].status, STATUS_NONE, "{mode:?}: never executed");
            assert_eq!(dev.peak_occupancy(), 2);
        }
    }

    #[test]
    fn lost_descriptors_never_complete() {
        let dev = SoftwareDsa::new(SoftwareDsaConfig {
            lose_if: Some(Arc::new(|k, _| k == 1)),
            numa_node: Some(3),
            ..Default::default()
        });
        assert_eq!(dev.numa_node(), Some(3));
        assert_eq!(dev.capacity(), 128);
        let m = mem();
        // SAFETY: records outlive the wait.
        unsafe {
            dev.submit(&Descriptor::noop(addr(&m.recs[0]))).unwrap();
            dev.submit(&Descriptor::noop(addr(&m.recs[1]))).unwrap();
        }
        wait(&m.recs[1]);
        assert_eq!(m.recs[0].status, STATUS_NONE);
        assert_eq!(dev.lost(), 1);
    }

    #[test]
    fn injected_error_and_refusal_and_write_mode() {
        let dev = SoftwareDsa::new(SoftwareDsaConfig {
            error_if: Some(Arc::new(|n, _| n == 1)),
            error_status: STATUS_TRANSLATION_FAIL,
            refuse_every: Some(2),
            method: SubmissionMethod::Write,
            ..Default::default()
        });
        assert_eq!(dev.max_batch_size(), 1);
        let page = vec![0u8; 4096];
        let m = mem();
        let d = Descriptor::compval(page.as_ptr() as u64, 4096, 0, addr(&m.recs[0]));
        // SAFETY: page and record outlive the wait.
        unsafe { dev.submit(&d).unwrap() };
        assert_eq!(wait(&m.recs[0]).status, STATUS_TRANSLATION_FAIL);
        // SAFETY: refused before the device sees it.
        let refused = unsafe { dev.submit(&d) };
        assert!(matches!(refused, Err(SubmitError::QueueFull(_))));
        let b = Descriptor::batch(addr(&m.list[0]), 2, addr(&m.batch_rec));
        // SAFETY: refused before the device sees it.
        let r = unsafe { dev.submit(&b) };
        assert!(matches!(r, Err(SubmitError::BatchRefused)));
    }
}

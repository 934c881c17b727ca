//! Submitting descriptors: the [`DsaQueue`] abstraction and the hardware
//! implementation over `/dev/dsa/wqD.Q`.
//!
//! Three ways to hand a descriptor to a work queue, picked once at start-up:
//!
//! * **MOVDIR64B** to the mmap-ed portal of a *dedicated* queue: a posted
//!   64-byte store; the queue's configured PASID is used. Software must not
//!   have more descriptors outstanding than the queue holds, or they are
//!   dropped silently; the offload engine bounds its in-flight descriptors
//!   per queue to [`DsaQueue::capacity`] on every path.
//! * **ENQCMD** to the portal of a *shared* queue: a non-posted store that
//!   reports (ZF) whether the queue accepted; on refusal we retry a bounded
//!   number of times and then report [`SubmitError::QueueFull`].
//! * **write()** of the 64 bytes to the queue's file descriptor: for kernels
//!   that refuse to map the portal (the INTEL-SA-01084 mitigation makes mmap
//!   fail with EPERM without CAP_SYS_RAWIO). The kernel validates and submits
//!   each descriptor itself and refuses BATCH descriptors, so on this path
//!   [`DsaQueue::max_batch_size`] is 1 and every page is its own descriptor.
//!   On a dedicated queue the kernel submits with MOVDIR64B without checking
//!   fullness, so the same bound applies.
//!
//! A dedicated queue takes one opener: a second process gets EBUSY, reported
//! as [`DsaError::QueueBusy`] naming the queue. Shared queues take many.

use std::fmt;
use std::fs::OpenOptions;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::DsaError;
use crate::desc::{Descriptor, OPCODE_BATCH};
use crate::sysfs::{WorkQueueInfo, WqMode};

/// How descriptors reach a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SubmissionMethod {
    /// MOVDIR64B to a dedicated queue's portal.
    Movdir64b,
    /// ENQCMD (with bounded retry) to a shared queue's portal.
    Enqcmd,
    /// `write()` to the queue's character device; no batches.
    Write,
    /// The in-process software device (tests, demos).
    Software,
}

impl SubmissionMethod {
    /// Short name for logs and reports.
    pub fn name(self) -> &'static str {
        match self {
            SubmissionMethod::Movdir64b => "movdir64b",
            SubmissionMethod::Enqcmd => "enqcmd",
            SubmissionMethod::Write => "write",
            SubmissionMethod::Software => "software",
        }
    }

    /// Whether BATCH descriptors can be submitted this way.
    pub fn supports_batch(self) -> bool {
        self != SubmissionMethod::Write
    }
}

impl fmt::Display for SubmissionMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a descriptor was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The queue stayed full (ENQCMD kept reporting retry, or the software
    /// device's queue was full) for every allowed attempt.
    #[error("work queue still full after {0} attempts")]
    QueueFull(u32),
    /// A BATCH descriptor on a path that cannot carry one (write()).
    #[error("batch descriptors cannot be submitted with write()")]
    BatchRefused,
    /// The queue's file descriptor refused the write.
    #[error("submitting to the work queue failed: {0}")]
    Io(#[from] std::io::Error),
    /// The (software) device has shut down.
    #[error("the device has stopped")]
    Stopped,
}

/// A work queue descriptors can be submitted to.
pub trait DsaQueue: Send + Sync + fmt::Debug {
    /// Hands one descriptor to the queue. Returns once the queue has it (not
    /// once it is executed: completion is signalled through the record).
    ///
    /// # Safety
    ///
    /// Every address in `desc` (and, for BATCH, in every listed descriptor)
    /// must stay valid for what the device does with it (read the source,
    /// read the list, write the completion record) until the completion
    /// record(s) have been written. The descriptor itself is copied during
    /// the call and may be reused afterwards.
    unsafe fn submit(&self, desc: &Descriptor) -> Result<(), SubmitError>;

    /// How this queue submits.
    fn method(&self) -> SubmissionMethod;

    /// Largest BATCH this queue takes; 1 means "no batches" (write path or a
    /// queue configured without batching).
    fn max_batch_size(&self) -> usize;

    /// Human-readable name, e.g. `dsa0/wq0.0`.
    fn name(&self) -> String;

    /// Submission attempts that were refused and retried so far.
    fn retries(&self) -> u64;

    /// Descriptors the queue holds (its sysfs `size`). The engine never has
    /// more than this in flight on the queue, whatever the submission path:
    /// a dedicated queue silently drops a descriptor past its size (MOVDIR64B
    /// is a posted write, and the kernel's write() on a dedicated queue uses
    /// it too without checking), and on a shared queue the bound keeps one
    /// process from filling what others share.
    fn capacity(&self) -> usize;

    /// NUMA node of the device, when known.
    fn numa_node(&self) -> Option<u32> {
        None
    }

    /// A file descriptor that polls readable when the driver reports trouble
    /// on the queue (the idxd driver wakes pollers of the queue's character
    /// device when the device or queue errs or is disabled); `None` when
    /// there is none.
    fn event_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    /// Whether the queue is no longer enabled (its sysfs `state`), asked by
    /// the completion thread when [`event_fd`](Self::event_fd) polls ready or
    /// a submission is overdue.
    fn is_disabled(&self) -> bool {
        false
    }

    /// Hands several descriptors over at once where the path allows it (one
    /// write() for all); returns how many the queue accepted, in order. The
    /// default submits them one by one and stops at the first refusal.
    ///
    /// # Safety
    ///
    /// As [`submit`](Self::submit), for every descriptor.
    unsafe fn submit_many(&self, descs: &[Descriptor]) -> (usize, Option<SubmitError>) {
        for (i, desc) in descs.iter().enumerate() {
            // SAFETY: forwarded from the caller.
            if let Err(e) = unsafe { self.submit(desc) } {
                return (i, Some(e));
            }
        }
        (descs.len(), None)
    }
}

/// Submission-related CPU features, read from CPUID leaf 7 directly because
/// `is_x86_feature_detected!` does not know all of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuSubmitFeatures {
    /// MOVDIR64B (CPUID.7.0:ECX bit 28).
    pub movdir64b: bool,
    /// ENQCMD (CPUID.7.0:ECX bit 29).
    pub enqcmd: bool,
    /// UMONITOR/UMWAIT/TPAUSE (CPUID.7.0:ECX bit 5).
    pub waitpkg: bool,
}

impl CpuSubmitFeatures {
    /// Reads the features of the running CPU (all false off x86_64).
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            // The CPUID intrinsics became safe functions after the MSRV
            // (1.89), where they still need `unsafe`.
            #[allow(unused_unsafe)]
            // SAFETY: CPUID exists on every x86_64 CPU and only reads
            // identification registers.
            let max_leaf = unsafe { core::arch::x86_64::__cpuid(0) }.eax;
            if max_leaf < 7 {
                return Self::default();
            }
            #[allow(unused_unsafe)]
            // SAFETY: as above; leaf 7 exists since max_leaf >= 7.
            let ecx = unsafe { core::arch::x86_64::__cpuid_count(7, 0) }.ecx;
            Self {
                movdir64b: ecx & (1 << 28) != 0,
                enqcmd: ecx & (1 << 29) != 0,
                waitpkg: ecx & (1 << 5) != 0,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Self::default()
    }
}

/// Picks the submission method for a queue: the portal instruction that
/// matches the queue's mode when the portal is mapped and the CPU has it,
/// else write().
pub fn choose_method(
    mode: WqMode,
    cpu: CpuSubmitFeatures,
    portal_mapped: bool,
) -> SubmissionMethod {
    match (portal_mapped, mode) {
        (true, WqMode::Dedicated) if cpu.movdir64b => SubmissionMethod::Movdir64b,
        (true, WqMode::Shared) if cpu.enqcmd => SubmissionMethod::Enqcmd,
        _ => SubmissionMethod::Write,
    }
}

/// Size of the portal mapping (one page; any 64-byte store into it submits).
const PORTAL_SIZE: usize = 4096;

/// A mapped work-queue portal.
#[derive(Debug)]
struct Portal(*mut u8);

// SAFETY: the portal is device MMIO; 64-byte MOVDIR64B/ENQCMD stores from
// any thread are each atomic submissions, there is no Rust-visible state
// behind the pointer.
unsafe impl Send for Portal {}
// SAFETY: as above; concurrent submissions are what shared queues are for,
// and dedicated-queue users bound their own outstanding count.
unsafe impl Sync for Portal {}

impl Drop for Portal {
    fn drop(&mut self) {
        // SAFETY: self.0 came from a successful mmap of PORTAL_SIZE bytes and
        // is unmapped exactly once.
        unsafe {
            libc::munmap(self.0.cast(), PORTAL_SIZE);
        }
    }
}

/// The error for a failed open of `info`'s device node: EBUSY is a
/// dedicated queue someone else holds (the driver allows one opener), named
/// so the user knows which queue and what to do.
fn open_error(info: &WorkQueueInfo, source: std::io::Error) -> DsaError {
    if source.raw_os_error() == Some(libc::EBUSY) {
        DsaError::QueueBusy {
            queue: info.full_name(),
        }
    } else {
        DsaError::Open {
            path: info.dev_path.clone(),
            source,
        }
    }
}

/// Says, at warn, that the portal of `info` could not be mapped and what
/// that costs: on Sapphire and Emerald Rapids (INTEL-SA-01084) the kernel
/// maps portals only for processes with CAP_SYS_RAWIO, and without the
/// portal every page goes as its own descriptor through write(), with no
/// BATCH, which can be slower than checking on the CPU.
fn warn_portal_refused(info: &WorkQueueInfo, err: &std::io::Error) {
    let why = if err.raw_os_error() == Some(libc::EPERM) {
        "the kernel maps work-queue portals only for processes with CAP_SYS_RAWIO on this CPU \
         (INTEL-SA-01084): run tern as root or grant it CAP_SYS_RAWIO"
    } else {
        "see `tern doctor`"
    };
    tracing::warn!(
        "cannot map the portal of DSA work queue {} ({err}): submitting with write(), one \
         descriptor per page and no batches, which may be slower than the CPU; {why}",
        info.full_name()
    );
}

/// A real work queue opened from `/dev/dsa`.
#[derive(Debug)]
pub struct HardwareQueue {
    info: WorkQueueInfo,
    fd: OwnedFd,
    portal: Option<Portal>,
    method: SubmissionMethod,
    enqcmd_attempts: u32,
    retries: AtomicU64,
    write_calls: AtomicU64,
    portal_refused: Option<std::io::Error>,
}

impl HardwareQueue {
    /// Opens the queue's device node and maps its portal; falls back to
    /// write() submission if mapping is refused (or `force_write`), and to
    /// write() if the CPU lacks the instruction the queue's mode needs.
    ///
    /// `enqcmd_attempts` bounds ENQCMD retries on a shared queue.
    ///
    /// # Errors
    ///
    /// [`DsaError::Open`] if the device node cannot be opened (missing,
    /// or permissions: the node is root-owned unless udev rules say
    /// otherwise).
    pub fn open(
        info: &WorkQueueInfo,
        force_write: bool,
        enqcmd_attempts: u32,
    ) -> Result<Self, DsaError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&info.dev_path)
            .map_err(|source| open_error(info, source))?;
        let fd: OwnedFd = file.into();
        let mut portal_refused = None;
        let portal = if force_write {
            None
        } else {
            // SAFETY: mapping a fresh region (addr NULL) of the queue's
            // portal; the kernel validates offset and size. MAP_POPULATE
            // avoids a fault on the first submission.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    PORTAL_SIZE,
                    libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_POPULATE,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                let err = std::io::Error::last_os_error();
                warn_portal_refused(info, &err);
                portal_refused = Some(err);
                None
            } else {
                Some(Portal(p.cast()))
            }
        };
        let method = choose_method(info.mode, CpuSubmitFeatures::detect(), portal.is_some());
        Ok(HardwareQueue {
            info: info.clone(),
            fd,
            portal: if method == SubmissionMethod::Write {
                None
            } else {
                portal
            },
            method,
            enqcmd_attempts: enqcmd_attempts.max(1),
            retries: AtomicU64::new(0),
            write_calls: AtomicU64::new(0),
            portal_refused,
        })
    }

    /// Why the portal could not be mapped (so descriptors go through
    /// write()), when it was tried and refused: EPERM is the
    /// INTEL-SA-01084 mitigation (no CAP_SYS_RAWIO).
    pub fn portal_refused(&self) -> Option<&std::io::Error> {
        self.portal_refused.as_ref()
    }

    /// What sysfs said about this queue.
    pub fn info(&self) -> &WorkQueueInfo {
        &self.info
    }

    /// write() submission of several descriptors in one call: the idxd
    /// driver takes any multiple of 64 bytes and submits each descriptor in
    /// turn, returning the bytes of those it accepted. EAGAIN (nothing
    /// accepted) is retried like a refused ENQCMD; a short count is the
    /// queue filling up, and the rest is left to the caller.
    fn submit_write_many(&self, descs: &[Descriptor]) -> (usize, Option<SubmitError>) {
        if descs.iter().any(|d| d.opcode == OPCODE_BATCH) {
            return (0, Some(SubmitError::BatchRefused));
        }
        if descs.is_empty() {
            return (0, None);
        }
        let bytes = std::mem::size_of_val(descs);
        for attempt in 0..self.enqcmd_attempts {
            self.write_calls.fetch_add(1, Ordering::Relaxed);
            // SAFETY: `descs` is a live slice of initialised 64-byte
            // descriptors, contiguous (the type's size is its alignment).
            let n = unsafe { libc::write(self.fd.as_raw_fd(), descs.as_ptr().cast(), bytes) };
            if let Ok(written) = usize::try_from(n) {
                let accepted = written / std::mem::size_of::<Descriptor>();
                if accepted == descs.len() {
                    return (accepted, None);
                }
                if accepted > 0 {
                    return (accepted, Some(SubmitError::QueueFull(attempt + 1)));
                }
            }
            let err = std::io::Error::last_os_error();
            if n < 0 && err.kind() != std::io::ErrorKind::WouldBlock {
                return (0, Some(SubmitError::Io(err)));
            }
            if attempt > 0 {
                self.retries.fetch_add(1, Ordering::Relaxed);
            }
            std::hint::spin_loop();
        }
        (0, Some(SubmitError::QueueFull(self.enqcmd_attempts)))
    }

    /// write() calls made so far (each carries one or more descriptors).
    pub fn write_calls(&self) -> u64 {
        self.write_calls.load(Ordering::Relaxed)
    }

    /// write() submission: one descriptor per call, EAGAIN retried like a
    /// refused ENQCMD.
    fn submit_write(&self, desc: &Descriptor) -> Result<(), SubmitError> {
        if desc.opcode == OPCODE_BATCH {
            return Err(SubmitError::BatchRefused);
        }
        let bytes = desc.as_bytes();
        for attempt in 0..self.enqcmd_attempts {
            self.write_calls.fetch_add(1, Ordering::Relaxed);
            // SAFETY: writing 64 initialised bytes from a live buffer to an
            // open fd.
            let n = unsafe { libc::write(self.fd.as_raw_fd(), bytes.as_ptr().cast(), 64) };
            if n == 64 {
                return Ok(());
            }
            let err = std::io::Error::last_os_error();
            if n < 0 && err.kind() == std::io::ErrorKind::WouldBlock {
                if attempt > 0 {
                    self.retries.fetch_add(1, Ordering::Relaxed);
                }
                std::hint::spin_loop();
                continue;
            }
            return Err(SubmitError::Io(err));
        }
        Err(SubmitError::QueueFull(self.enqcmd_attempts))
    }
}

impl DsaQueue for HardwareQueue {
    unsafe fn submit(&self, desc: &Descriptor) -> Result<(), SubmitError> {
        match (self.method, &self.portal) {
            (SubmissionMethod::Movdir64b, Some(portal)) => {
                // SAFETY: the portal is mapped and the CPU has MOVDIR64B
                // (choose_method); `desc` is 64-byte aligned (type).
                unsafe { x86::movdir64b(portal.0, desc) };
                Ok(())
            }
            (SubmissionMethod::Enqcmd, Some(portal)) => {
                for attempt in 0..self.enqcmd_attempts {
                    // SAFETY: as above, with ENQCMD.
                    if unsafe { x86::enqcmd(portal.0, desc) } {
                        return Ok(());
                    }
                    if attempt + 1 < self.enqcmd_attempts {
                        self.retries.fetch_add(1, Ordering::Relaxed);
                    }
                    std::hint::spin_loop();
                }
                Err(SubmitError::QueueFull(self.enqcmd_attempts))
            }
            _ => self.submit_write(desc),
        }
    }

    fn method(&self) -> SubmissionMethod {
        self.method
    }

    fn max_batch_size(&self) -> usize {
        if self.method.supports_batch() {
            (self.info.max_batch_size as usize).max(1)
        } else {
            1
        }
    }

    fn name(&self) -> String {
        self.info.full_name()
    }

    fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    fn capacity(&self) -> usize {
        self.info.size as usize
    }

    fn numa_node(&self) -> Option<u32> {
        self.info.numa_node
    }

    fn event_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.fd.as_fd())
    }

    fn is_disabled(&self) -> bool {
        std::fs::read_to_string(self.info.sysfs_dir.join("state"))
            .is_ok_and(|state| state.trim() != "enabled")
    }

    unsafe fn submit_many(&self, descs: &[Descriptor]) -> (usize, Option<SubmitError>) {
        if self.method == SubmissionMethod::Write {
            return self.submit_write_many(descs);
        }
        for (i, desc) in descs.iter().enumerate() {
            // SAFETY: forwarded from the caller.
            if let Err(e) = unsafe { self.submit(desc) } {
                return (i, Some(e));
            }
        }
        (descs.len(), None)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Descriptor;

    /// MOVDIR64B `desc` to `portal`.
    ///
    /// # Safety
    ///
    /// The CPU must support MOVDIR64B and `portal` must be a mapped portal.
    pub(super) unsafe fn movdir64b(portal: *mut u8, desc: &Descriptor) {
        // SAFETY: caller guarantees CPU support and a mapped portal; the
        // SFENCE orders the descriptor list and zeroed completion records
        // (ordinary stores) before the weakly-ordered portal write, so the
        // device never reads stale memory.
        unsafe {
            core::arch::asm!(
                "sfence",
                "movdir64b {dst}, zmmword ptr [{src}]",
                dst = in(reg) portal,
                src = in(reg) desc as *const Descriptor,
                options(nostack),
            );
        }
    }

    /// ENQCMD `desc` to `portal`; `true` if the queue accepted it (ZF = 0).
    ///
    /// # Safety
    ///
    /// The CPU must support ENQCMD and `portal` must be a mapped portal of a
    /// shared queue.
    pub(super) unsafe fn enqcmd(portal: *mut u8, desc: &Descriptor) -> bool {
        let retry: u8;
        // SAFETY: caller guarantees CPU support and a mapped portal; SFENCE
        // as for MOVDIR64B.
        unsafe {
            core::arch::asm!(
                "sfence",
                "enqcmd {dst}, zmmword ptr [{src}]",
                "setz {retry}",
                dst = in(reg) portal,
                src = in(reg) desc as *const Descriptor,
                retry = out(reg_byte) retry,
                options(nostack),
            );
        }
        retry == 0
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::Descriptor;

    /// Never called: choose_method needs CPU features only x86_64 reports.
    pub(super) unsafe fn movdir64b(_: *mut u8, _: &Descriptor) {}

    /// Never called, see above.
    pub(super) unsafe fn enqcmd(_: *mut u8, _: &Descriptor) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::{
        CpuSubmitFeatures, DsaQueue, HardwareQueue, SubmissionMethod, SubmitError, choose_method,
        open_error,
    };
    use crate::DsaError;
    use crate::desc::Descriptor;
    use crate::sysfs::{WorkQueueInfo, WqMode};

    #[test]
    fn method_choice() {
        let all = CpuSubmitFeatures {
            movdir64b: true,
            enqcmd: true,
            waitpkg: true,
        };
        let none = CpuSubmitFeatures::default();
        use SubmissionMethod::*;
        assert_eq!(choose_method(WqMode::Dedicated, all, true), Movdir64b);
        assert_eq!(choose_method(WqMode::Shared, all, true), Enqcmd);
        assert_eq!(choose_method(WqMode::Dedicated, all, false), Write);
        assert_eq!(choose_method(WqMode::Shared, all, false), Write);
        assert_eq!(choose_method(WqMode::Dedicated, none, true), Write);
        assert_eq!(choose_method(WqMode::Shared, none, true), Write);
        assert!(!Write.supports_batch());
        assert!(Movdir64b.supports_batch() && Enqcmd.supports_batch());
        assert_eq!(Enqcmd.to_string(), "enqcmd");
    }

    #[test]
    fn the_write_path_writes_several_descriptors_in_one_call() {
        // A regular file stands in for the queue's node: it takes the bytes
        // as the driver would, and shows how many calls carried them.
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("wq0.0");
        std::fs::write(&node, b"").unwrap();
        let info = WorkQueueInfo {
            kind: crate::sysfs::AccelKind::Dsa,
            device: "dsa0".into(),
            queue: "wq0.0".into(),
            label: String::new(),
            mode: WqMode::Shared,
            size: 128,
            max_batch_size: 32,
            block_on_fault: None,
            dev_path: node.clone(),
            sysfs_dir: dir.path().join("sys"),
            numa_node: None,
        };
        let queue = HardwareQueue::open(&info, true, 8).unwrap();
        assert_eq!(queue.method(), SubmissionMethod::Write);
        let descs: Vec<Descriptor> = (0..5u64)
            .map(|i| Descriptor::compval(0x1000 * i, 4096, 0, 0x40 * i))
            .collect();
        // SAFETY: nothing executes these descriptors: the file only stores
        // them.
        let (accepted, error) = unsafe { queue.submit_many(&descs) };
        assert_eq!((accepted, error.is_none()), (5, true));
        assert_eq!(queue.write_calls(), 1);
        let written = std::fs::read(&node).unwrap();
        assert_eq!(written.len(), 5 * 64);
        assert_eq!(&written[64..128], descs[1].as_bytes());
        // A BATCH is refused before anything is written.
        let batch = [Descriptor::batch(0, 2, 0)];
        // SAFETY: as above.
        let (accepted, error) = unsafe { queue.submit_many(&batch) };
        assert!(accepted == 0 && matches!(error, Some(SubmitError::BatchRefused)));
        // No sysfs state: not reported disabled.
        assert!(!queue.is_disabled());
        std::fs::create_dir_all(dir.path().join("sys")).unwrap();
        std::fs::write(dir.path().join("sys/state"), "disabled\n").unwrap();
        assert!(queue.is_disabled());
    }

    #[test]
    fn cpuid_reads() {
        // Only checks it does not crash; prints what this host has.
        eprintln!("{:?}", CpuSubmitFeatures::detect());
    }

    #[test]
    fn opening_a_missing_node_is_an_error() {
        let info = WorkQueueInfo {
            kind: crate::sysfs::AccelKind::Dsa,
            device: "dsa9".into(),
            queue: "wq9.0".into(),
            label: String::new(),
            mode: WqMode::Dedicated,
            size: 16,
            max_batch_size: 32,
            block_on_fault: None,
            dev_path: "/nonexistent/dsa/wq9.0".into(),
            sysfs_dir: "/nonexistent/sys/wq9.0".into(),
            numa_node: None,
        };
        let err = HardwareQueue::open(&info, false, 8).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/dsa/wq9.0"), "{err}");
        // A dedicated queue another process holds: EBUSY, named.
        let busy = open_error(&info, std::io::Error::from_raw_os_error(libc::EBUSY));
        assert!(matches!(busy, DsaError::QueueBusy { .. }), "{busy:?}");
        let msg = busy.to_string();
        assert!(
            msg.contains("dsa9/wq9.0") && msg.contains("shared"),
            "{msg}"
        );
    }
}

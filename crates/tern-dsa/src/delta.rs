//! Delta records on DSA: create-delta-record and apply-delta-record, on a
//! DSA work queue or the software device (which runs the same
//! descriptors), with the CPU codec of [`tern_page::delta`] as fallback.
//!
//! Both produce the same bytes: the wire format *is* DSA's record format.
//! Each call is synchronous: one descriptor, polled until its completion
//! record is written or a deadline passes. The device works on a job of its
//! own (copies of the inputs, the record, the completion record), never on
//! the caller's memory, so a descriptor that never completes (a lost one, a
//! stalled device) cannot write into anything the caller reuses: its job
//! is leaked (counted in [`DeltaOffloadStats::abandoned`]) and the CPU
//! answers. Anything but a clean completion (a page fault, an error, a
//! refused submission, a record that fails validation) also falls back to
//! the CPU, so the result never depends on the device behaving.
//!
//! [`DsaDeltaOffload`] implements tern-page's [`DeltaOffload`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tern_page::delta::{DeltaError, MAX_DELTA_LEN, apply_delta, create_delta, validate_delta};
use tern_page::{DeltaOffload, DeltaOffloadStats, PAGE_SIZE};

use crate::DsaError;
use crate::desc::{
    CompletionRecord, DELTA_RESULT_DIFFERENT, DELTA_RESULT_EQUAL, DELTA_RESULT_OVERFLOW,
    Descriptor, DsaStatus, STATUS_NONE,
};
use crate::engine::{DsaConfig, DsaOffload, OffloadConfig, open_dsa_engine};
use crate::queue::DsaQueue;
use crate::soft::{SoftwareDsa, SoftwareDsaConfig};

/// The page size as the descriptors' `u32` sizes.
const PAGE_SIZE_U32: u32 = tern_wire::PAGE_SIZE;

/// What one device job works on: copies of the inputs and room for the
/// output, 32-byte aligned for the completion record.
#[repr(C, align(64))]
struct Job {
    record: CompletionRecord,
    old: [u8; PAGE_SIZE],
    new: [u8; PAGE_SIZE],
    delta: [u8; MAX_DELTA_LEN],
}

impl Job {
    fn new() -> Box<Self> {
        Box::new(Self {
            record: CompletionRecord::default(),
            old: [0; PAGE_SIZE],
            new: [0; PAGE_SIZE],
            delta: [0; MAX_DELTA_LEN],
        })
    }
}

/// Delta records through the DSA engine's queues, the CPU as fallback.
///
/// It shares the queues of a zero-page engine ([`DsaDeltaOffload::sharing`]):
/// the same device list, the same open handles (a dedicated queue takes one
/// opener, so a second handle would be refused), and the same per-queue
/// in-flight bound, so delta and zero-page descriptors together never
/// overfill a queue. When every queue is full, backing off or retired, the
/// CPU answers.
#[derive(Debug)]
pub struct DsaDeltaOffload {
    engine: Arc<DsaOffload>,
    deadline: Duration,
    on_device: AtomicU64,
    fallbacks: AtomicU64,
    abandoned: AtomicU64,
}

/// How long a delta operation waits for the device before the CPU does
/// it: far beyond a 4 KiB operation's microseconds, so only a stalled or
/// lost descriptor reaches it.
pub const DELTA_DEADLINE: Duration = Duration::from_millis(100);

/// Delta records on tern's software DSA device.
pub fn software_delta_offload(config: SoftwareDsaConfig) -> Arc<DsaDeltaOffload> {
    Arc::new(DsaDeltaOffload::new(
        Arc::new(SoftwareDsa::new(config)),
        DELTA_DEADLINE,
    ))
}

/// Delta records on the DSA work queues `config` selects, opened for this
/// offload alone. When zero-page detection also uses DSA, share its engine
/// with [`DsaDeltaOffload::sharing`] instead: a dedicated queue takes a
/// single opener.
///
/// # Errors
///
/// As [`open_dsa_engine`].
pub fn open_delta_offload(config: &DsaConfig) -> Result<Arc<DsaDeltaOffload>, DsaError> {
    Ok(Arc::new(DsaDeltaOffload::sharing(
        open_dsa_engine(config)?,
        DELTA_DEADLINE,
    )))
}

impl DsaDeltaOffload {
    /// Uses `queue` alone, waiting at most `deadline` for each completion.
    ///
    /// # Panics
    ///
    /// If the engine's completion thread cannot be started.
    pub fn new(queue: Arc<dyn DsaQueue>, deadline: Duration) -> Self {
        let engine = DsaOffload::new(vec![queue], OffloadConfig::default())
            .expect("one queue is enough to start");
        Self::sharing(Arc::new(engine), deadline)
    }

    /// Shares the queues (and their in-flight bound) of a zero-page engine,
    /// waiting at most `deadline` for each completion.
    pub fn sharing(engine: Arc<DsaOffload>, deadline: Duration) -> Self {
        Self {
            engine,
            deadline,
            on_device: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            abandoned: AtomicU64::new(0),
        }
    }

    fn cpu_create(
        &self,
        old: &[u8; PAGE_SIZE],
        new: &[u8; PAGE_SIZE],
        out: &mut [u8],
    ) -> Option<usize> {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
        create_delta(old, new, out)
    }

    /// Submits `desc` (whose addresses all point into `job`) and waits for
    /// a successful completion; `None` for anything else. A job the device
    /// has not answered by the deadline is leaked, so it may still write it.
    ///
    /// Room for the descriptor is reserved on the engine's queues first;
    /// an abandoned descriptor keeps its reservation (it may still occupy
    /// the queue), so the bound holds.
    fn run(&self, job: Box<Job>, desc: &Descriptor) -> Option<Box<Job>> {
        let (queue_index, queue) = self.engine.reserve_one()?;
        // SAFETY: every address in `desc` points into `job`, which stays
        // allocated until its record is written: it is returned (and freed)
        // only after the status is non-zero, and leaked otherwise.
        if let Err(error) = unsafe { queue.submit(desc) } {
            self.engine.release_one(queue_index, Some(&error));
            return None;
        }
        let started = Instant::now();
        loop {
            // SAFETY: the job's record is live; the device writes it.
            let status = unsafe { CompletionRecord::load_status(&job.record) };
            if status != STATUS_NONE {
                self.engine.release_one(queue_index, None);
                return (DsaStatus::decode(status) == DsaStatus::Success).then_some(job);
            }
            if started.elapsed() > self.deadline {
                self.abandoned.fetch_add(1, Ordering::Relaxed);
                Box::leak(job);
                return None;
            }
            std::hint::spin_loop();
            std::thread::yield_now();
        }
    }
}

impl DeltaOffload for DsaDeltaOffload {
    fn stats(&self) -> DeltaOffloadStats {
        let mut stats = DeltaOffloadStats::default();
        stats.on_device = self.on_device.load(Ordering::Relaxed);
        stats.fallbacks = self.fallbacks.load(Ordering::Relaxed);
        stats.abandoned = self.abandoned.load(Ordering::Relaxed);
        stats
    }

    fn create(
        &self,
        old: &[u8; PAGE_SIZE],
        new: &[u8; PAGE_SIZE],
        out: &mut [u8],
    ) -> Option<usize> {
        let limit = out.len().min(MAX_DELTA_LEN);
        let mut job = Job::new();
        job.old.copy_from_slice(old);
        job.new.copy_from_slice(new);
        let desc = Descriptor::create_delta(
            job.old.as_ptr() as u64,
            job.new.as_ptr() as u64,
            PAGE_SIZE_U32,
            job.delta.as_mut_ptr() as u64,
            u32::try_from(limit).expect("at most MAX_DELTA_LEN"),
            std::ptr::addr_of!(job.record) as u64,
        );
        let Some(job) = self.run(job, &desc) else {
            return self.cpu_create(old, new, out);
        };
        let size = job.record.delta_rec_size() as usize;
        match (job.record.result, size) {
            (DELTA_RESULT_OVERFLOW, _) => {
                self.on_device.fetch_add(1, Ordering::Relaxed);
                None
            }
            // Equal pages still get one entry (a record is never empty):
            // the CPU codec writes it, identically.
            (DELTA_RESULT_EQUAL, 0) => {
                self.on_device.fetch_add(1, Ordering::Relaxed);
                create_delta(old, new, out)
            }
            (DELTA_RESULT_DIFFERENT, size)
                if size <= limit && validate_delta(&job.delta[..size]).is_ok() =>
            {
                self.on_device.fetch_add(1, Ordering::Relaxed);
                out[..size].copy_from_slice(&job.delta[..size]);
                Some(size)
            }
            _ => self.cpu_create(old, new, out),
        }
    }

    // The record is validated on the CPU first, so a bad record is refused
    // the same way whatever runs it.
    fn apply(&self, record: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), DeltaError> {
        validate_delta(record)?;
        let mut job = Job::new();
        job.delta[..record.len()].copy_from_slice(record);
        job.new.copy_from_slice(page);
        let desc = Descriptor::apply_delta(
            job.delta.as_ptr() as u64,
            u32::try_from(record.len()).expect("validated: at most MAX_DELTA_LEN"),
            job.new.as_mut_ptr() as u64,
            PAGE_SIZE_U32,
            std::ptr::addr_of!(job.record) as u64,
        );
        match self.run(job, &desc) {
            Some(job) => {
                self.on_device.fetch_add(1, Ordering::Relaxed);
                page.copy_from_slice(&job.new);
                Ok(())
            }
            None => {
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                apply_delta(record, page)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tern_page::delta::{MAX_DELTA_LEN, create_delta};
    use tern_page::{DeltaOffload, DeltaOffloadStats, PAGE_SIZE};

    use super::DsaDeltaOffload;
    use crate::soft::{SoftwareDsa, SoftwareDsaConfig};

    fn page(seed: u8) -> Box<[u8; PAGE_SIZE]> {
        let mut page = Box::new([0u8; PAGE_SIZE]);
        for (index, byte) in page.iter_mut().enumerate() {
            *byte = index.to_le_bytes()[0].wrapping_mul(31).wrapping_add(seed);
        }
        page
    }

    fn offload(config: SoftwareDsaConfig) -> DsaDeltaOffload {
        DsaDeltaOffload::new(Arc::new(SoftwareDsa::new(config)), Duration::from_secs(30))
    }

    #[test]
    fn the_software_device_writes_the_cpu_codecs_bytes() {
        let offload = offload(SoftwareDsaConfig::default());
        let old = page(1);
        let mut new = old.clone();
        new[17] ^= 0xff;
        new[4000..4040].fill(3);
        let (mut cpu, mut device) = ([0u8; MAX_DELTA_LEN], [0u8; MAX_DELTA_LEN]);
        let cpu_len = create_delta(&old, &new, &mut cpu).unwrap();
        let device_len = offload.create(&old, &new, &mut device).unwrap();
        assert_eq!(&device[..device_len], &cpu[..cpu_len]);
        let mut rebuilt = old.clone();
        offload.apply(&device[..device_len], &mut rebuilt).unwrap();
        assert_eq!(rebuilt, new);
        // Equal pages and overflows agree too.
        assert_eq!(
            offload.create(&old, &old, &mut device),
            create_delta(&old, &old, &mut cpu)
        );
        assert_eq!(offload.create(&old, &page(2), &mut device), None);
        assert_eq!(offload.stats().on_device, 4);
        assert_eq!(offload.stats().fallbacks, 0);
    }

    #[test]
    fn faults_and_errors_fall_back_to_the_cpu_with_the_same_result() {
        let faulting = offload(SoftwareDsaConfig {
            fault_if: Some(Arc::new(|n, _| n % 2 == 1)),
            fault_after_bytes: 1000,
            error_if: Some(Arc::new(|n, _| n % 4 == 2)),
            ..SoftwareDsaConfig::default()
        });
        let old = page(3);
        let mut new = old.clone();
        new[2048] = 0;
        let mut cpu = [0u8; MAX_DELTA_LEN];
        let expected = create_delta(&old, &new, &mut cpu).unwrap();
        for _ in 0..4 {
            let mut out = [0u8; MAX_DELTA_LEN];
            assert_eq!(faulting.create(&old, &new, &mut out), Some(expected));
            assert_eq!(&out[..expected], &cpu[..expected]);
            let mut target = old.clone();
            faulting.apply(&cpu[..expected], &mut target).unwrap();
            assert_eq!(target, new);
        }
        let stats = faulting.stats();
        assert!(stats.fallbacks >= 4, "{stats:?}");
        assert!(stats.on_device >= 1, "{stats:?}");
    }

    #[test]
    fn a_lost_descriptor_is_abandoned_and_the_cpu_answers() {
        let losing = DsaDeltaOffload::new(
            Arc::new(SoftwareDsa::new(SoftwareDsaConfig {
                lose_if: Some(Arc::new(|_, _| true)),
                ..SoftwareDsaConfig::default()
            })),
            Duration::from_millis(50),
        );
        let old = page(4);
        let mut out = [0u8; MAX_DELTA_LEN];
        assert_eq!(losing.create(&old, &old, &mut out), Some(10));
        assert_eq!(losing.stats().abandoned, 1);
    }

    #[test]
    fn a_malicious_record_is_refused_before_the_device_sees_it() {
        let offload = offload(SoftwareDsaConfig::default());
        let mut target = page(5);
        let mut bad = 600u16.to_le_bytes().to_vec();
        bad.extend_from_slice(&[0; 8]);
        assert!(offload.apply(&bad, &mut target).is_err());
        assert_eq!(target, page(5));
        assert_eq!(offload.stats(), DeltaOffloadStats::default());
    }
}

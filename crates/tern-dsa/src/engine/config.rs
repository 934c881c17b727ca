//! The engine's tuning and where to find DSA.

use std::path::PathBuf;
use std::time::Duration;

use tern_page::ZeroChecker;

use crate::select::{DsaSelection, NumaPolicy};

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
    /// How long a queue that refused a submission for good is skipped; it
    /// doubles with each refusal in a row, up to a second.
    pub refusal_backoff: Duration,
    /// Refusals in a row after which a queue is retired for the rest of the
    /// run (a disabled or persistently saturated shared queue); 0 never
    /// retires.
    pub refusals_before_retire: u32,
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
            refusal_backoff: Duration::from_millis(1),
            refusals_before_retire: 16,
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

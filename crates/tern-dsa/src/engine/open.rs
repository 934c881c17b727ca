//! Building an engine: over the host's DSA work queues (discovered in
//! sysfs, selected, opened) or over one software device.

use std::sync::Arc;

use tern_page::ZeroPageOffload;

use super::config::{DsaConfig, OffloadConfig};
use super::offload::DsaOffload;
use crate::DsaError;
use crate::queue::{DsaQueue, HardwareQueue};
use crate::select::DsaSelection;
use crate::soft::{SoftwareDsa, SoftwareDsaConfig};
use crate::sysfs::{WorkQueueInfo, WqMode, discover_work_queues};

/// Discovers and opens the DSA work queues to use and starts the engine.
///
/// Of the usable queues (limited to [`DsaConfig::devices`]), shared ones
/// come first: when the whole host is selected and a shared queue opens,
/// dedicated queues are left alone, since each takes a single process and
/// another tern (another VM migrating) may need it. A dedicated queue held
/// by another process is reported by name ([`DsaError::QueueBusy`]).
///
/// An explicitly requested DSA that is missing is an error here, at start-up,
/// with a hint on how to set one up; later device trouble only makes pages go
/// to the CPU.
///
/// # Errors
///
/// [`DsaError::NoWorkQueue`] if sysfs has no enabled user queue,
/// [`DsaError::NoMatch`] if none is in the selection,
/// [`DsaError::QueueBusy`] if the one candidate is a dedicated queue in
/// use, [`DsaError::NoneOpened`] if none could be opened.
pub fn open_dsa(config: &DsaConfig) -> Result<Arc<dyn ZeroPageOffload>, DsaError> {
    Ok(open_dsa_engine(config)?)
}

/// [`open_dsa`], returning the engine itself, so the delta offload can
/// share its queues ([`crate::DsaDeltaOffload::sharing`]).
///
/// # Errors
///
/// As [`open_dsa`].
pub fn open_dsa_engine(config: &DsaConfig) -> Result<Arc<DsaOffload>, DsaError> {
    let found = discover_work_queues(&config.sysfs_root, &config.dev_root)?;
    let wqs = select_queues(&found, &config.devices).ok_or_else(|| DsaError::NoMatch {
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
        if let [DsaError::QueueBusy { .. }] = errors[..] {
            return Err(errors.remove(0));
        }
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        return Err(DsaError::NoneOpened(text.join("; ")));
    }
    Ok(Arc::new(DsaOffload::new(queues, config.offload)?))
}

/// The queues of `found` that `selection` names, shared ones first (stable
/// otherwise); `None` if it names none.
pub(super) fn select_queues(
    found: &[WorkQueueInfo],
    selection: &DsaSelection,
) -> Option<Vec<WorkQueueInfo>> {
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

//! Switch-over: everything has arrived; check it, compare digests, restore
//! the guest's state, resume it and tell the source.

use std::time::Instant;

use tern_wire::{DigestAlgorithm, Message, Outcome, OutcomeStats};

use super::live::Delivered;
use super::shared::ReceiverShared;
use super::stream::FrameSink;
use super::{Destination, ReceivePhase};
use crate::error::MigrationError;
use crate::guest::{DestinationGuest, StateSection};
use crate::stats::thread_cpu_seconds;

impl Destination {
    /// Verifies what was delivered, then restores and resumes `guest`.
    /// Returns the statistics sent to the source with the verdict.
    pub(super) fn switch_over<G: DestinationGuest>(
        &self,
        shared: &ReceiverShared<'_>,
        main: &mut impl FrameSink,
        guest: &mut G,
        delivered: Delivered,
        cpu_start: f64,
    ) -> Result<OutcomeStats, MigrationError> {
        let Delivered {
            sections,
            complete,
            final_iterations,
        } = delivered;
        check_complete(&final_iterations, sections.len(), &complete)?;
        tracing::debug!("all pages and state received");
        self.stats.set_phase(ReceivePhase::Verifying);
        let digest_started = Instant::now();
        let digest = memory_digest(shared);
        let digest_time = digest_started.elapsed();
        if shared.setup.digest != DigestAlgorithm::None && digest != complete.digest {
            let error = MigrationError::DigestMismatch {
                source_digest: complete.digest,
                destination: digest,
            };
            refuse(main, digest, error.to_string());
            return Err(error);
        }
        if let Err(error) = restore_and_resume(guest, &sections) {
            refuse(main, digest, error.chain());
            return Err(error);
        }
        self.stats.record_main_cpu(thread_cpu_seconds() - cpu_start);
        let stats = self.stats.snapshot(digest_time);
        main.send_message(&Message::Outcome(Outcome {
            verified: true,
            digest,
            detail: String::new(),
            stats: stats.clone(),
        }))
        .map_err(MigrationError::channel(0))?;
        self.stats.set_phase(ReceivePhase::Resumed);
        Ok(stats)
    }
}

/// Every channel must have ended at the source's final iteration, and every
/// state section the source counted must have arrived.
fn check_complete(
    final_iterations: &[u32],
    sections: usize,
    complete: &tern_wire::Complete,
) -> Result<(), MigrationError> {
    if final_iterations
        .iter()
        .any(|&iteration| iteration != complete.final_iteration)
    {
        return Err(MigrationError::Protocol(format!(
            "channels ended at iterations {final_iterations:?}, the source says {}",
            complete.final_iteration
        )));
    }
    if sections != complete.sections as usize {
        return Err(MigrationError::Protocol(format!(
            "received {sections} state sections, the source sent {}",
            complete.sections
        )));
    }
    Ok(())
}

/// The digest of the memory as it is now: the page hashes the receivers
/// recorded, with the pages the audit found changed since hashed again;
/// 0 when the session does not verify.
fn memory_digest(shared: &ReceiverShared<'_>) -> u128 {
    let Some(hashes) = &shared.page_hashes else {
        return 0;
    };
    // SAFETY: every receiver has ended, so nothing writes guest memory or
    // records hashes any more.
    let finished = unsafe { hashes.finish(crate::digest::digest_threads()) };
    finished.digest.value
}

fn restore_and_resume<G: DestinationGuest>(
    guest: &mut G,
    sections: &[StateSection],
) -> Result<(), MigrationError> {
    guest
        .restore_state(sections)
        .map_err(MigrationError::guest("restore state"))?;
    // Auto-converge throttling belongs to the migration, not to the guest's
    // life on the destination.
    guest
        .set_throttle(0)
        .map_err(MigrationError::guest("throttle"))?;
    guest.resume().map_err(MigrationError::guest("resume"))
}

/// Tells the source the guest will not run here. Best effort: the error
/// that caused it is what the caller reports.
fn refuse(main: &mut impl FrameSink, digest: u128, detail: String) {
    let _ = main.send_message(&Message::Outcome(Outcome {
        verified: false,
        digest,
        detail,
        stats: OutcomeStats::default(),
    }));
}

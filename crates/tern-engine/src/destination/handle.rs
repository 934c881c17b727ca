//! The destination's handle ([`ReceiveHandle`]): what it shares with the
//! destination, and how its report is built from the live counters and the
//! recorded outcome.

use std::sync::{Arc, Mutex, MutexGuard};

use super::{ReceivePhase, ReceiveStats};
use crate::control::{CancelToken, EventHub, GuestState, ReceiveReport, Side, Subscription};
use crate::stats::{CONTRACT_VERSION, DestinationStats, MigrationStatus, SessionSecurity};

/// What the destination's handle and the destination share.
#[derive(Debug)]
pub(crate) struct DestinationControl {
    pub stats: Arc<ReceiveStats>,
    pub cancel: CancelToken,
    pub events: EventHub,
    report: Mutex<ReceiveOutcome>,
}

impl DestinationControl {
    pub(crate) fn new(stats: Arc<ReceiveStats>, cancel: CancelToken) -> Self {
        Self {
            stats,
            cancel,
            events: EventHub::new(Side::Destination),
            report: Mutex::new(ReceiveOutcome::default()),
        }
    }

    pub(crate) fn outcome(&self) -> MutexGuard<'_, ReceiveOutcome> {
        self.report.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A handle on a destination, from [`crate::Destination::handle`]: cheap to
/// clone, usable from any thread.
#[derive(Clone, Debug)]
pub struct ReceiveHandle {
    control: Arc<DestinationControl>,
}

impl ReceiveHandle {
    pub(crate) fn new(control: Arc<DestinationControl>) -> Self {
        Self { control }
    }

    /// The destination's report as it stands (the document `tern receive
    /// --json` prints at the end).
    pub fn query(&self) -> ReceiveReport {
        build(&self.control)
    }

    /// Stops the reception: the source is told, and the guest is not
    /// resumed here.
    pub fn cancel(&self) {
        self.control.cancel.cancel();
    }

    /// Events from now on, in order, ending after the final status change.
    pub fn subscribe(&self) -> Subscription {
        self.control.events.subscribe()
    }

    /// Records that the embedder resumed a guest the destination handed
    /// over paused ([`crate::ReceiveConfig::keep_paused`]), for the report.
    pub fn note_resumed(&self) {
        self.control.outcome().guest = Some(GuestState::Running);
    }
}

/// What the destination records as it ends.
#[derive(Debug, Default)]
pub(crate) struct ReceiveOutcome {
    pub status: Option<MigrationStatus>,
    pub failed_in: Option<MigrationStatus>,
    pub error_desc: Option<String>,
    pub digest_verified: bool,
    pub guest: Option<GuestState>,
    pub stats: Option<DestinationStats>,
    pub security: Option<SessionSecurity>,
}

/// The status a destination phase reports as.
pub(super) fn phase_status(phase: ReceivePhase) -> MigrationStatus {
    match phase {
        ReceivePhase::Waiting => MigrationStatus::Setup,
        ReceivePhase::Receiving => MigrationStatus::Active,
        ReceivePhase::Verifying => MigrationStatus::Device,
        ReceivePhase::Resumed | ReceivePhase::Paused => MigrationStatus::Completed,
        ReceivePhase::Failed => MigrationStatus::Failed,
    }
}

fn build(control: &DestinationControl) -> ReceiveReport {
    let outcome = control.outcome();
    let live = &control.stats;
    ReceiveReport {
        version: CONTRACT_VERSION,
        status: outcome.status.unwrap_or_else(|| phase_status(live.phase())),
        failed_in: outcome.failed_in,
        memory: live.total_bytes(),
        iterations: live.iterations_done(),
        digest_verified: outcome.digest_verified,
        digest_comparison: live.digest_comparison(),
        guest: outcome.guest,
        refused_connections: live.refused_connections(),
        stats: outcome
            .stats
            .clone()
            .unwrap_or_else(|| live.live_destination_stats()),
        security: outcome.security.clone(),
        error_desc: outcome.error_desc.clone(),
    }
}

//! The destination's handle ([`ReceiveHandle`]): what it shares with the
//! destination, and how its report is built from the live counters and the
//! recorded outcome.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::{ReceivePhase, ReceiveStats};
use crate::control::{
    CancelToken, Empty, Event, EventBody, EventHistory, EventHub, GuestState, PassFigures,
    ReceiveReport, ReceivedPass, Side, Subscription,
};
use crate::stats::{CONTRACT_VERSION, DestinationStats, MigrationStatus, SessionSecurity};
use crate::transport::Listener;

/// What the destination's handle and the destination share.
#[derive(Debug)]
pub(crate) struct DestinationControl {
    pub stats: Arc<ReceiveStats>,
    pub cancel: CancelToken,
    pub events: EventHub,
    report: Mutex<ReceiveOutcome>,
    /// `migrate-recover`: accept a paused postcopy's reconnection again.
    postcopy_recover: std::sync::atomic::AtomicBool,
    /// `migrate-recover` with an address: a listener bound there, for the
    /// paused reception to accept the source's reconnection on too.
    recover_listener: Mutex<Option<Listener>>,
}

impl DestinationControl {
    pub(crate) fn new(stats: Arc<ReceiveStats>, cancel: CancelToken) -> Self {
        Self {
            stats,
            cancel,
            events: EventHub::new(Side::Destination),
            report: Mutex::new(ReceiveOutcome::default()),
            postcopy_recover: std::sync::atomic::AtomicBool::new(false),
            recover_listener: Mutex::new(None),
        }
    }

    /// Takes the listener an operator's `migrate-recover` bound, if any.
    pub(crate) fn take_recover_listener(&self) -> Option<Listener> {
        self.recover_listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Takes an operator's request to accept a reconnection again.
    pub(crate) fn take_postcopy_recover(&self) -> bool {
        self.postcopy_recover.swap(false, Ordering::AcqRel)
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

    /// Accepts a `postcopy-paused` migration's reconnection again, for a
    /// new recovery window (QEMU's `migrate-recover`, `tern ctl ...
    /// migrate-recover`; the listener stays the one the reception
    /// started on). Refused unless postcopy is paused here.
    pub fn recover_postcopy(&self) -> Result<(), crate::ControlError> {
        self.check_postcopy_paused()?;
        self.control.postcopy_recover.store(true, Ordering::Release);
        Ok(())
    }

    /// [`ReceiveHandle::recover_postcopy`] on a new address as well (QEMU's
    /// `migrate-recover` with its URI): for when the path the source used
    /// is gone. Binds `address` now, so a bad or busy address is this
    /// call's error, and returns where it listens (the actual port when
    /// `address` asks for port 0). The reception accepts the source's
    /// reconnection there, from now on, as well as on the listener it
    /// started with, with the same protections (TLS, the shared key, the
    /// session); a session without authentication takes a new listener
    /// only where it would take the first (the unauthenticated policy).
    /// Refused unless postcopy is paused here.
    pub fn recover_postcopy_at(
        &self,
        address: &crate::transport::Address,
    ) -> Result<crate::transport::Address, crate::ControlError> {
        self.check_postcopy_paused()?;
        let failed = |error: std::io::Error| {
            crate::ControlError::Unsupported(format!("cannot listen on {address}: {error}"))
        };
        let listener = Listener::bind(address).map_err(failed)?;
        let bound = listener.local_address().map_err(failed)?;
        *self
            .control
            .recover_listener
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(listener);
        self.control.postcopy_recover.store(true, Ordering::Release);
        Ok(bound)
    }

    fn check_postcopy_paused(&self) -> Result<(), crate::ControlError> {
        if self.control.stats.phase() != ReceivePhase::PostcopyPaused {
            return Err(crate::ControlError::Unsupported(format!(
                "Only a postcopy-paused migration recovers (this destination is {})",
                self.control.stats.phase().as_str()
            )));
        }
        Ok(())
    }

    /// Events from now on, in order, ending after the final status change.
    pub fn subscribe(&self) -> Subscription {
        self.control.events.subscribe()
    }

    /// The events kept so far, then the events from now on (see
    /// [`crate::MigrationHandle::subscribe_with_history`]).
    pub fn subscribe_with_history(&self) -> Subscription {
        self.control.events.subscribe_with_history()
    }

    /// The events kept so far (`query-events`; see
    /// [`crate::MigrationHandle::history`]).
    pub fn history(&self) -> EventHistory {
        self.control.events.history()
    }

    /// Records that the embedder resumed a guest the destination handed
    /// over paused ([`crate::ReceiveConfig::keep_paused`]), for the report,
    /// and keeps a `RESUME` event in the history. Returns that event, for
    /// a caller that forwards events itself: live subscriptions ended with
    /// the final status change, before the resume.
    pub fn note_resumed(&self) -> Event {
        self.control.outcome().guest = Some(GuestState::Running);
        self.control
            .events
            .publish(EventBody::Resume(Empty::default()))
            .unwrap_or_else(|| Event::now(Side::Destination, EventBody::Resume(Empty::default())))
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
        ReceivePhase::PostcopyPaused => MigrationStatus::PostcopyPaused,
        ReceivePhase::PostcopyActive => MigrationStatus::PostcopyActive,
        ReceivePhase::PostcopyRecover => MigrationStatus::PostcopyRecover,
    }
}

/// The status a report gives before the outcome is recorded: a final one
/// only comes with the outcome, together with its `MIGRATION` event, so
/// a client that saw `completed` finds that event in the history. Until
/// then a finished phase is still `device`.
fn live_status(phase: ReceivePhase) -> MigrationStatus {
    match phase_status(phase) {
        status if status.is_final() => MigrationStatus::Device,
        status => status,
    }
}

fn build(control: &DestinationControl) -> ReceiveReport {
    let outcome = control.outcome();
    let live = &control.stats;
    ReceiveReport {
        version: CONTRACT_VERSION,
        status: outcome.status.unwrap_or_else(|| live_status(live.phase())),
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

/// Publishes the destination's `MIGRATION_PASS` events: each iteration's
/// figures, the counters' growth since the previous one.
#[derive(Debug)]
pub(super) struct PassReporter<'a> {
    events: &'a EventHub,
    previous: Mutex<PassMark>,
}

/// The counters at the previous pass (or when the channels were set up).
#[derive(Debug)]
struct PassMark {
    received_bytes: u64,
    normal_pages: u64,
    zero_pages: u64,
    at: Instant,
}

impl PassMark {
    fn now(stats: &ReceiveStats) -> Self {
        Self {
            received_bytes: stats.received.load(Ordering::Relaxed),
            normal_pages: stats.normal_pages.load(Ordering::Relaxed),
            zero_pages: stats.zero_pages.load(Ordering::Relaxed),
            at: Instant::now(),
        }
    }
}

impl<'a> PassReporter<'a> {
    pub(super) fn new(events: &'a EventHub, stats: &ReceiveStats) -> Self {
        Self {
            events,
            previous: Mutex::new(PassMark::now(stats)),
        }
    }

    /// Publishes pass `pass` (iterations finished, counting this one),
    /// while no receiver counts anything.
    pub(super) fn report(&self, pass: u64, stats: &ReceiveStats) {
        let now = PassMark::now(stats);
        let mut previous = self.previous.lock().unwrap_or_else(|e| e.into_inner());
        let received_bytes = now.received_bytes.saturating_sub(previous.received_bytes);
        let zero_pages = now.zero_pages.saturating_sub(previous.zero_pages);
        let normal_pages = now.normal_pages.saturating_sub(previous.normal_pages);
        let seconds = now.at.duration_since(previous.at).as_secs_f64();
        let bandwidth = if seconds > 0.0 {
            // A rate is never negative; an overflow saturates.
            crate::numeric::saturating_u64_from_f64(received_bytes as f64 / seconds)
        } else {
            0
        };
        *previous = now;
        drop(previous);
        self.events
            .publish(EventBody::MigrationPass(PassFigures::Destination(
                ReceivedPass {
                    pass,
                    received_pages: normal_pages + zero_pages,
                    zero_pages,
                    received_bytes,
                    bandwidth,
                },
            )));
    }
}

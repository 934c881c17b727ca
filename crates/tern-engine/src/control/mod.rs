//! Steering a migration from outside: a handle on each side, usable from
//! any thread, to query the live report, cancel, change parameters that
//! take effect at the next window, and subscribe to events.
//!
//! ```text
//! Source::handle() ──► MigrationHandle ── query()            MigrationStats, live
//!                                      ├─ cancel()
//!                                      ├─ set_parameters()   next packet / next sync
//!                                      ├─ switch_over_now()  next sync
//!                                      ├─ subscribe()        Event, in order
//!                                      └─ history()          the events so far (bounded)
//! Destination::handle() ─► ReceiveHandle ─ query() / cancel() / subscribe() / history()
//!                           (crate::destination::ReceiveHandle)
//! ```
//!
//! The report, the events and the parameters are the contract scripts rely
//! on: they carry [`CONTRACT_VERSION`], their JSON schema is generated from
//! these types, and docs/control.md documents them.

mod events;
mod parameters;
mod report;

pub use crate::cancel::CancelToken;

use std::sync::{Arc, Mutex};

pub(crate) use events::EventHub;
pub use events::{
    EVENT_HISTORY, Empty, Event, EventBody, EventHistory, Pass, PassFigures, ReceivedPass, Side,
    StatusChange, Subscription, ThrottleChange, Timestamp,
};
pub(crate) use parameters::{ConvergenceSettings, LiveParameters};
pub use parameters::{MAX_DOWNTIME_LIMIT_MS, MigrationParameters, ParameterError};
pub use report::{GuestState, ReceiveReport};

use crate::config::MigrationConfig;
use crate::stats::{LiveStats, MigrationStats, MigrationStatus};

pub use crate::stats::CONTRACT_VERSION;

/// Why a control request was refused; the migration is untouched.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ControlError {
    /// A parameter's value is out of range.
    #[error(transparent)]
    Parameter(#[from] ParameterError),
    /// The request needs a feature this build or session does not have.
    #[error("{0}")]
    Unsupported(String),
    /// The migration has ended; nothing can change it any more.
    #[error("The migration has ended ({0})")]
    Ended(&'static str),
}

/// What the source's handle and the source share.
#[derive(Debug)]
pub(crate) struct SourceControl {
    pub stats: Arc<LiveStats>,
    pub parameters: LiveParameters,
    pub cancel: CancelToken,
    pub events: EventHub,
    /// The report as returned to the caller, once the migration ended.
    final_report: Mutex<Option<MigrationStats>>,
    /// Postcopy's mode, and whether `migrate-start-postcopy` was called.
    postcopy_mode: crate::postcopy::PostcopyMode,
    postcopy_requested: std::sync::atomic::AtomicBool,
    /// `migrate` with `resume=true`: reconnect a paused postcopy now.
    postcopy_resume: std::sync::atomic::AtomicBool,
    /// `migrate` with `resume=true` and a URI: where to reconnect from now
    /// on, when the destination listens somewhere new.
    postcopy_resume_address: Mutex<Option<crate::transport::Address>>,
}

impl SourceControl {
    pub(crate) fn new(
        config: &MigrationConfig,
        stats: Arc<LiveStats>,
        cancel: CancelToken,
    ) -> Self {
        Self {
            stats,
            parameters: LiveParameters::new(config),
            cancel,
            events: EventHub::new(Side::Source),
            final_report: Mutex::new(None),
            postcopy_mode: config.postcopy,
            postcopy_requested: std::sync::atomic::AtomicBool::new(false),
            postcopy_resume: std::sync::atomic::AtomicBool::new(false),
            postcopy_resume_address: Mutex::new(None),
        }
    }

    /// Whether `migrate-start-postcopy` was called.
    pub(crate) fn postcopy_requested(&self) -> bool {
        self.postcopy_requested
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Takes an operator's request to reconnect a paused postcopy.
    pub(crate) fn take_postcopy_resume(&self) -> bool {
        self.postcopy_resume
            .swap(false, std::sync::atomic::Ordering::AcqRel)
    }

    /// Takes the address an operator's resume named, if any.
    pub(crate) fn take_postcopy_resume_address(&self) -> Option<crate::transport::Address> {
        self.postcopy_resume_address
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Keeps the final report for later queries and sends the final event.
    pub(crate) fn finish(&self, report: &MigrationStats) {
        let mut final_report = self.final_report.lock().unwrap_or_else(|e| e.into_inner());
        *final_report = Some(report.clone());
        // Under the report's lock: a query that says the status never
        // comes before the history holds its event.
        self.events.status(report.status, report.error_desc.clone());
    }
}

/// A handle on a source's migration, from [`crate::Source::handle`]: cheap
/// to clone, usable from any thread, before, during and after
/// [`crate::Source::migrate`].
#[derive(Clone, Debug)]
pub struct MigrationHandle {
    control: Arc<SourceControl>,
}

impl MigrationHandle {
    pub(crate) fn new(control: Arc<SourceControl>) -> Self {
        Self { control }
    }

    /// The report as it stands: the same document as the final one
    /// (`query-migrate`), with the status it has now; after the end, the
    /// final report, the destination's figures included.
    pub fn query(&self) -> MigrationStats {
        if let Some(report) = self
            .control
            .final_report
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            return report.clone();
        }
        let mut report = self.control.stats.snapshot();
        // A final status only comes with the final report and its event;
        // until then the migration is still finishing its switch-over.
        if report.status.is_final() {
            report.status = MigrationStatus::Device;
        }
        report
    }

    /// The status now.
    pub fn status(&self) -> MigrationStatus {
        self.control.stats.status()
    }

    /// Asks the migration to stop (`migrate_cancel`): it ends `cancelled`
    /// with the source guest running, and the destination is told.
    pub fn cancel(&self) {
        self.control.cancel.cancel();
    }

    /// The parameters in force (`query-migrate-parameters`).
    pub fn parameters(&self) -> MigrationParameters {
        self.control.parameters.current()
    }

    /// Changes parameters (`migrate-set-parameters`): all or none. The
    /// bandwidth cap applies from the next packet; the others at the next
    /// dirty-log sync.
    pub fn set_parameters(&self, patch: &MigrationParameters) -> Result<(), ControlError> {
        self.check_running()?;
        self.control.parameters.apply(patch)?;
        tracing::info!(?patch, "migration parameters changed");
        self.control
            .events
            .publish(EventBody::MigrationParameters(self.parameters()));
        Ok(())
    }

    /// Switches over at the next dirty-log sync, whatever the expected
    /// downtime (reported as a forced switch-over).
    pub fn switch_over_now(&self) -> Result<(), ControlError> {
        self.check_running()?;
        self.control.parameters.request_switch_over();
        Ok(())
    }

    /// Starts postcopy at the next dirty-log sync
    /// (`migrate-start-postcopy`): the migration must have been started
    /// with postcopy on (`MigrationConfig::postcopy` not `Off`, as QEMU
    /// requires its `postcopy-ram` capability); otherwise
    /// [`ControlError::Unsupported`]. A precopy that has converged by then
    /// still switches over as precopy.
    pub fn start_postcopy(&self) -> Result<(), ControlError> {
        self.check_running()?;
        if self.control.postcopy_mode == crate::postcopy::PostcopyMode::Off {
            return Err(ControlError::Unsupported(
                "Postcopy is off for this migration (start it with a postcopy mode)".into(),
            ));
        }
        self.control
            .postcopy_requested
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Reconnects a `postcopy-paused` migration now, with a new recovery
    /// window (QEMU's `migrate` with `resume=true`, `tern ctl ...
    /// migrate-resume`): what an operator does once the network is back,
    /// or after the recovery timeout left the migration paused. Refused
    /// unless the status is `postcopy-paused`.
    pub fn resume_postcopy(&self) -> Result<(), ControlError> {
        self.check_postcopy_paused()?;
        self.control
            .postcopy_resume
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// [`MigrationHandle::resume_postcopy`] towards a new address (QEMU's
    /// `migrate` with `resume=true` and a URI): the destination listens
    /// there after its `migrate-recover` with that address. Every
    /// reconnection from now on dials `address`, at once if a recovery
    /// window is open, with the same protections as the first connection
    /// (TLS with the same certificate names, the shared key, the session).
    /// `fd:` addresses are refused: the sockets behind them were taken by
    /// the first connection. Refused unless the status is
    /// `postcopy-paused`.
    pub fn resume_postcopy_to(
        &self,
        address: crate::transport::Address,
    ) -> Result<(), ControlError> {
        self.check_postcopy_paused()?;
        if matches!(address, crate::transport::Address::Fd(_)) {
            return Err(ControlError::Unsupported(
                "a postcopy resumes on an address to dial (tcp:, unix:, vsock:), not fd:".into(),
            ));
        }
        *self
            .control
            .postcopy_resume_address
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(address);
        self.control
            .postcopy_resume
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    fn check_postcopy_paused(&self) -> Result<(), ControlError> {
        self.check_running()?;
        if self.control.stats.status() != MigrationStatus::PostcopyPaused {
            return Err(ControlError::Unsupported(format!(
                "Only a postcopy-paused migration resumes (the status is {})",
                self.control.stats.status().as_str()
            )));
        }
        Ok(())
    }

    /// Events from now on, in order, ending after the final status change
    /// (a subscription taken after the end gets that one event).
    pub fn subscribe(&self) -> Subscription {
        self.control.events.subscribe()
    }

    /// The events kept so far, then the events from now on, with neither
    /// gap nor repeat: what a watcher that starts late needs. The history
    /// holds every status change and the latest [`EVENT_HISTORY`] other
    /// events.
    pub fn subscribe_with_history(&self) -> Subscription {
        self.control.events.subscribe_with_history()
    }

    /// The events kept so far (`query-events`): every status change and
    /// the latest [`EVENT_HISTORY`] other events, numbered by `seq`.
    pub fn history(&self) -> EventHistory {
        self.control.events.history()
    }

    fn check_running(&self) -> Result<(), ControlError> {
        let status = self.status();
        if status.is_final() {
            return Err(ControlError::Ended(status.as_str()));
        }
        Ok(())
    }
}

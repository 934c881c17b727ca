//! How a command ends: the errors that carry what became of the guest, and
//! tern's exit statuses for them (docs/cli.md, "Exit status").

use tern_engine::{MigrationError, MigrationStats};

use super::interrupt::interrupted_by;

/// A migration that started and did not complete, with what became of the
/// guest. `tern` exits with [`exit::FAILED`] for it, [`exit::NOTHING_SENT`]
/// when it never got past the handshake, [`exit::OUTCOME_UNKNOWN`] when the
/// switch-over's outcome is unknown, [`exit::CANCELLED`] when a control
/// command cancelled it, or 128 + the signal that cancelled it; any other
/// error is a usage or setup error ([`exit::USAGE`]).
#[derive(Debug)]
pub(crate) struct Incomplete(pub String);

impl std::fmt::Display for Incomplete {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Incomplete {
    /// A failed or cancelled migration whose cause is `error`.
    pub(crate) fn error(error: impl Into<anyhow::Error>, what: impl Into<String>) -> anyhow::Error {
        error.into().context(Self(what.into()))
    }

    /// A failed source migration, with the exit status its report implies.
    pub(crate) fn source(failure: tern_engine::MigrationFailure, what: &str) -> anyhow::Error {
        Self::source_error(failure.error, what, &failure.stats)
    }

    /// A source's `error`, with `stats` its report: a [`NothingSent`] when
    /// it failed before anything was sent.
    pub(crate) fn source_error(
        error: MigrationError,
        what: &str,
        stats: &MigrationStats,
    ) -> anyhow::Error {
        let nothing_sent = stats.failed_in == Some(tern_engine::MigrationStatus::Setup)
            && !matches!(
                error,
                MigrationError::Cancelled | MigrationError::OutcomeUnknown(_)
            );
        if nothing_sent {
            anyhow::Error::from(error).context(NothingSent)
        } else {
            Self::error(error, what)
        }
    }
}

/// A migration that failed before anything was sent: the destination could
/// not be reached, or the handshake with it failed. The source guest runs
/// on.
#[derive(Debug)]
pub(super) struct NothingSent;

impl std::fmt::Display for NothingSent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("nothing was sent; the source guest runs on")
    }
}

/// tern's exit statuses (docs/cli.md, "Exit status").
pub(super) mod exit {
    /// It failed mid-migration; the source guest runs on.
    pub(crate) const FAILED: u8 = 1;
    /// A usage or setup error: nothing was started.
    pub(crate) const USAGE: u8 = 2;
    /// The source committed and the destination did not confirm: the source
    /// guest stays paused, the outcome is unknown.
    pub(crate) const OUTCOME_UNKNOWN: u8 = 3;
    /// Nothing was sent: the destination could not be reached, or it did
    /// not complete the handshake (not a tern destination, refused, timed
    /// out). The source guest runs on.
    pub(crate) const NOTHING_SENT: u8 = 4;
    /// Cancelled by a control command (`migrate_cancel`); the source guest
    /// runs on.
    pub(crate) const CANCELLED: u8 = 5;
    /// Postcopy failed after the point of no return (or its digests
    /// differed): the guest no longer runs on the source, which stays
    /// paused; see the error line for where the guest is.
    pub(crate) const POSTCOPY_FAILED: u8 = 6;
}

/// The exit status for an error: see [`Incomplete`] and docs/cli.md.
pub(crate) fn exit_code(error: &anyhow::Error) -> u8 {
    let cause_is = |test: fn(&MigrationError) -> bool| {
        error
            .chain()
            .any(|cause| cause.downcast_ref::<MigrationError>().is_some_and(test))
    };
    if error.downcast_ref::<NothingSent>().is_some() {
        match interrupted_by() {
            Some(signal) => signal_exit_code(signal),
            None => exit::NOTHING_SENT,
        }
    } else if error.downcast_ref::<Incomplete>().is_none() {
        exit::USAGE
    } else if cause_is(|error| matches!(error, MigrationError::OutcomeUnknown(_))) {
        exit::OUTCOME_UNKNOWN
    } else if cause_is(|error| {
        matches!(
            error,
            MigrationError::PostcopyFailed { .. } | MigrationError::PostcopyDigestMismatch { .. }
        )
    }) {
        exit::POSTCOPY_FAILED
    } else if let Some(signal) = interrupted_by() {
        signal_exit_code(signal)
    } else if cause_is(|error| matches!(error, MigrationError::Cancelled)) {
        exit::CANCELLED
    } else {
        exit::FAILED
    }
}

/// The shell's exit status for a process ended by `signal`: 128 plus the
/// signal's number (signals are 1..=64, so it fits; past that, 255).
pub(crate) fn signal_exit_code(signal: i32) -> u8 {
    u8::try_from(signal.saturating_add(128)).unwrap_or(u8::MAX)
}

/// What became of the source guest after `error`, for the one error line.
pub(crate) fn source_guest_after(error: &MigrationError) -> &'static str {
    if matches!(error, MigrationError::OutcomeUnknown(_)) {
        "the switch-over's outcome is unknown; the source guest stays paused"
    } else if matches!(error, MigrationError::PostcopyFailed { .. }) {
        "postcopy failed after the point of no return; the source guest stays paused and the guest is lost unless the destination still runs it whole"
    } else if matches!(error, MigrationError::PostcopyDigestMismatch { .. }) {
        "the guest runs on the destination, whose memory differs from the source's; the source guest stays paused"
    } else {
        "the migration did not complete; the source guest runs on"
    }
}

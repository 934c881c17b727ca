//! What the destination says, or is told, on the main channel outside the
//! normal flow: heartbeats and passes applied from it, aborts in both
//! directions.

use std::time::{Duration, Instant};

use tern_wire::{HEARTBEAT_INTERVAL, LiveFigures, Message, PassApplied};

use crate::error::{ChannelError, MigrationError};
use crate::transport::{Channel, Expected};

/// What the source knows of the destination's liveness during the live
/// phase: the destination sends a heartbeat about once a second on the main
/// channel, and otherwise speaks there before the end only to abort.
///
/// Heartbeats are counted, not timed on arrival: the source reads them only
/// between iterations, when a stopped destination's last ones may still sit
/// in the socket. The destination sends one per [`HEARTBEAT_INTERVAL`] on a
/// fixed schedule from the start of its live phase (a little before the
/// source's), so `heard` intervals cover at least as long as the source has
/// watched, less the time the destination has been silent.
pub(super) struct PeerWatch {
    started: Instant,
    heard: u32,
    silence_limit: Duration,
    /// What the destination's last heartbeat said it measured.
    figures: LiveFigures,
    /// Passes the destination said it applied (its latest
    /// `PassApplied`, protocol 12): every page of them is in its memory.
    passes_applied: u32,
    /// The latest of them's lag behind the link, by its word (protocol
    /// 13).
    pass_lag: Duration,
}

impl PeerWatch {
    /// Starts watching; `silence_limit` is the longest silence tolerated.
    pub(super) fn new(silence_limit: Duration) -> Self {
        Self {
            started: Instant::now(),
            heard: 0,
            silence_limit,
            figures: LiveFigures::default(),
            passes_applied: 0,
            pass_lag: Duration::ZERO,
        }
    }

    /// The figures of the destination's latest heartbeat (zeros before
    /// any): advice for the downtime estimate, clamped there.
    pub(super) fn figures(&self) -> LiveFigures {
        self.figures
    }

    /// Passes the destination has applied, by its word.
    pub(super) fn passes_applied(&self) -> u32 {
        self.passes_applied
    }

    /// How far behind the link the destination was at the end of the
    /// latest pass it applied, by its word: advice, clamped where used.
    pub(super) fn pass_lag(&self) -> Duration {
        self.pass_lag
    }

    /// Reads what the destination sent since the last look (`passes_sent`
    /// passes so far): heartbeats renew its liveness, passes applied are
    /// counted, an abort or anything else fails the migration, and so does
    /// silence beyond the limit.
    pub(super) fn check(
        &mut self,
        main: &mut Channel,
        passes_sent: u32,
    ) -> Result<(), MigrationError> {
        while main
            .wait_readable(Duration::ZERO)
            .map_err(MigrationError::channel(0))?
        {
            self.read_one(main, passes_sent)?;
        }
        let silent = self
            .started
            .elapsed()
            .saturating_sub(HEARTBEAT_INTERVAL * self.heard);
        if silent > self.silence_limit {
            return Err(MigrationError::Channel {
                index: 0,
                source: ChannelError::Timeout("a heartbeat from the destination"),
            });
        }
        Ok(())
    }

    /// Waits until the destination says it applied `passes` passes (of
    /// `passes_sent`), reading what it sends meanwhile, until `until`.
    /// Returns whether it did.
    pub(super) fn wait_for_passes(
        &mut self,
        main: &mut Channel,
        passes: u32,
        passes_sent: u32,
        until: Instant,
    ) -> Result<bool, MigrationError> {
        while self.passes_applied < passes {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            if main
                .wait_readable(left)
                .map_err(MigrationError::channel(0))?
            {
                self.read_one(main, passes_sent)?;
            }
        }
        Ok(true)
    }

    /// Reads one message the destination sent during the live phase.
    fn read_one(&mut self, main: &mut Channel, passes_sent: u32) -> Result<(), MigrationError> {
        match main
            .read_expected(Expected::LIVE)
            .map_err(MigrationError::channel(0))?
        {
            Message::Heartbeat(figures) => {
                self.heard = self.heard.saturating_add(1);
                self.figures = figures;
            }
            Message::PassApplied(applied) => {
                self.passes_applied = checked_passes(applied, self.passes_applied, passes_sent)?;
                self.pass_lag = Duration::from_micros(u64::from(applied.lag_micros));
            }
            Message::Abort(abort) => {
                return Err(MigrationError::from_peer_abort(abort));
            }
            other => {
                return Err(MigrationError::Protocol(format!(
                    "unexpected {:?} from the destination during the live phase",
                    other.kind()
                )));
            }
        }
        Ok(())
    }
}

/// A destination's count of passes applied, which can neither go back nor
/// pass what was sent: either is a protocol error (the count only ever
/// delays a switch-over, but a peer that says such things is not trusted
/// with the rest).
fn checked_passes(applied: PassApplied, before: u32, sent: u32) -> Result<u32, MigrationError> {
    if applied.passes < before || applied.passes > sent {
        return Err(MigrationError::Protocol(format!(
            "the destination says it applied {} passes, after {before}, of {sent} sent",
            applied.passes
        )));
    }
    Ok(applied.passes)
}

/// Tells the destination why the migration stops (unless it told us).
pub(super) fn send_abort(main: &mut Channel, error: &MigrationError) {
    if !matches!(error, MigrationError::PeerAborted { .. }) {
        let _ = main.send_message(&Message::Abort(tern_wire::Abort {
            reason: error.abort_reason(),
            message: error.chain(),
        }));
    }
}

/// Reads an abort message the destination may have sent, waiting briefly
/// and skipping its heartbeats.
pub(super) fn peer_reason(main: &mut Channel) -> Option<MigrationError> {
    let deadline = Instant::now() + Duration::from_millis(500);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if !main.wait_readable(left).ok()? {
            return None;
        }
        match main.read_expected(Expected::LIVE) {
            Ok(Message::Heartbeat(_) | Message::PassApplied(_)) if !left.is_zero() => {}
            Ok(Message::Abort(abort)) => {
                return Some(MigrationError::from_peer_abort(abort));
            }
            _ => return None,
        }
    }
}

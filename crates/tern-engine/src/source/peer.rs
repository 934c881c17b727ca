//! What the destination says, or is told, on the main channel outside the
//! normal flow: aborts in both directions.

use std::time::{Duration, Instant};

use tern_wire::{HEARTBEAT_INTERVAL, LiveFigures, Message};

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
}

impl PeerWatch {
    /// Starts watching; `silence_limit` is the longest silence tolerated.
    pub(super) fn new(silence_limit: Duration) -> Self {
        Self {
            started: Instant::now(),
            heard: 0,
            silence_limit,
            figures: LiveFigures::default(),
        }
    }

    /// The figures of the destination's latest heartbeat (zeros before
    /// any): advice for the downtime estimate, clamped there.
    pub(super) fn figures(&self) -> LiveFigures {
        self.figures
    }

    /// Reads what the destination sent since the last look: heartbeats
    /// renew its liveness, an abort or anything else fails the migration,
    /// and so does silence beyond the limit.
    pub(super) fn check(&mut self, main: &mut Channel) -> Result<(), MigrationError> {
        while main
            .wait_readable(Duration::ZERO)
            .map_err(MigrationError::channel(0))?
        {
            match main
                .read_expected(Expected::LIVE)
                .map_err(MigrationError::channel(0))?
            {
                Message::Heartbeat(figures) => {
                    self.heard = self.heard.saturating_add(1);
                    self.figures = figures;
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
            Ok(Message::Heartbeat(_)) if !left.is_zero() => {}
            Ok(Message::Abort(abort)) => {
                return Some(MigrationError::from_peer_abort(abort));
            }
            _ => return None,
        }
    }
}

//! The destination's half of postcopy recovery (docs/postcopy.md,
//! "Recovery"): after the point of no return a lost connection pauses
//! postcopy. The guest runs on; a thread that touches a missing page waits
//! (its memory never leaves userfaultfd while both processes live). This
//! side listens on: for `postcopy_recover_timeout` it accepts the source's
//! reconnection, then it stays `postcopy-paused` until the operator asks
//! again (`ReceiveHandle::recover_postcopy`, `migrate-recover`).
//!
//! A reconnection passes the same protections as the first connection
//! (the handshake threads run TLS and the shared-key proof, bound to the
//! session and channel 0), must present the main channel's identity, and
//! must name this session in `PostcopyResume`: anything else is refused
//! with a reason and counted, and the wait goes on.

use std::time::{Duration, Instant};

use tern_wire::{
    AbortReason, FrameDecoder, MAX_STALE_RUNS, Message, PageRun, PostcopyMissing, Welcome,
};

use super::handshake::{Handshakes, refuse};
use super::{Destination, POLL_INTERVAL, ReceivePhase};
use crate::error::MigrationError;
use crate::stats::MigrationStatus;
use crate::transport::Channel;

/// How often a paused destination past its recovery window looks at the
/// operator's requests.
const PAUSED_POLL: Duration = Duration::from_millis(20);

/// What the first connection settled, which a reconnection must match.
pub(super) struct Session<'a, 'l> {
    pub session_id: u64,
    /// The main channel's peer identity (its TLS certificate).
    pub identity: Option<Vec<u8>>,
    pub channel_count: u16,
    pub handshakes: &'a mut Handshakes<'l>,
}

/// The source's new connection.
pub(super) struct Reconnected {
    pub main: Channel,
    pub decoder: FrameDecoder,
    pub page_channels: Vec<Channel>,
}

impl Destination {
    /// Waits for the source's reconnection, window after window (each
    /// `postcopy_recover_timeout`, the next one opened by the operator),
    /// until it comes, has been told the `missing` pages, or the reception
    /// is cancelled. `cause` is why postcopy paused.
    pub(super) fn await_reconnection(
        &self,
        session: &mut Session<'_, '_>,
        cause: &MigrationError,
        missing: &[PageRun],
    ) -> Result<Reconnected, MigrationError> {
        self.enter_postcopy_phase(ReceivePhase::PostcopyPaused, Some(cause.chain()));
        tracing::warn!(
            error = %cause.chain(),
            "postcopy paused: the connection to the source broke; the guest runs on, \
             threads that touch a missing page wait for the source to reconnect"
        );
        loop {
            let until = Instant::now() + self.config.postcopy_recover_timeout;
            while Instant::now() < until {
                if self.cancel.is_cancelled() {
                    return Err(MigrationError::Cancelled);
                }
                self.adopt_recover_listener(session);
                let slice = until
                    .saturating_duration_since(Instant::now())
                    .min(POLL_INTERVAL);
                match self.accept_reconnection(session, slice, missing) {
                    Ok(Some(reconnected)) => return Ok(reconnected),
                    Ok(None) => {}
                    Err(error) if crate::postcopy::is_recoverable(&error) => {
                        tracing::debug!(error = %error.chain(), "a reconnection failed");
                        self.back_to_paused(&error);
                    }
                    Err(error) => return Err(error),
                }
            }
            let text = format!(
                "postcopy recovery timed out after {} s: the migration stays postcopy-paused \
                 (the guest runs here without all of its memory); accept the source again with \
                 migrate-recover (tern ctl ... migrate-recover) or cancel",
                self.config.postcopy_recover_timeout.as_secs_f64()
            );
            tracing::error!("{text}");
            self.control
                .events
                .status(MigrationStatus::PostcopyPaused, Some(text));
            loop {
                if self.cancel.is_cancelled() {
                    return Err(MigrationError::Cancelled);
                }
                if self.control.take_postcopy_recover() {
                    break;
                }
                std::thread::sleep(PAUSED_POLL);
            }
        }
    }

    /// A reconnection that failed after its resume was welcomed
    /// (`postcopy-recover`) leaves postcopy paused again, saying why.
    fn back_to_paused(&self, error: &MigrationError) {
        if self.stats.phase() == ReceivePhase::PostcopyRecover {
            self.enter_postcopy_phase(
                ReceivePhase::PostcopyPaused,
                Some(format!("the reconnection failed: {}", error.chain())),
            );
        }
    }

    /// Enters a postcopy phase: the report's status and the `MIGRATION`
    /// event that announces it, always the pair, so watchers never see
    /// one without the other. `error_desc` says why, for a pause.
    pub(super) fn enter_postcopy_phase(&self, phase: ReceivePhase, error_desc: Option<String>) {
        self.stats.set_phase(phase);
        self.control
            .events
            .status(super::handle::phase_status(phase), error_desc);
    }

    /// Accepts on the listener an operator's `migrate-recover` bound, if
    /// there is a new one and the unauthenticated policy allows it (else
    /// it is closed, with an error line and event: the wait goes on).
    fn adopt_recover_listener(&self, session: &mut Session<'_, '_>) {
        let Some(listener) = self.control.take_recover_listener() else {
            return;
        };
        let address = listener
            .local_address()
            .map_or_else(|_| "a new listener".into(), |address| address.to_string());
        match self.check_policy(&listener) {
            Ok(()) => {
                tracing::info!(%address, "postcopy recovery: also accepting the source on a new address");
                session.handshakes.listen_also(listener);
            }
            Err(error) => {
                let text = format!(
                    "migrate-recover: not listening on {address}: {}",
                    error.chain()
                );
                tracing::error!("{text}");
                self.control
                    .events
                    .status(MigrationStatus::PostcopyPaused, Some(text));
            }
        }
    }

    /// One connection, if one finished its handshake within `wait`: a
    /// resume of this session is welcomed (`postcopy-recover` from then
    /// on), its page channels accepted, and the `missing` pages named to
    /// it; anything else is refused.
    fn accept_reconnection(
        &self,
        session: &mut Session<'_, '_>,
        wait: Duration,
        missing: &[PageRun],
    ) -> Result<Option<Reconnected>, MigrationError> {
        let Some(mut arrived) = session
            .handshakes
            .next(wait)
            .map_err(MigrationError::channel(0))?
        else {
            return Ok(None);
        };
        let verdict = match &arrived.message {
            _ if arrived.channel.security().peer_identity != session.identity => {
                Err("the reconnection presented another certificate than the main channel".into())
            }
            Message::PostcopyResume(resume)
                if resume.handshake.session_id == session.session_id =>
            {
                Ok(())
            }
            Message::PostcopyResume(resume) => Err(format!(
                "session {:#x} is not the paused postcopy ({:#x})",
                resume.handshake.session_id, session.session_id
            )),
            other => Err(format!(
                "postcopy is paused: expected the source's resume, got {:?}",
                other.kind()
            )),
        };
        if let Err(reason) = verdict {
            refuse(
                &self.stats,
                &mut arrived,
                AbortReason::ProtocolError,
                reason,
            );
            return Ok(None);
        }
        let mut main = arrived.channel;
        let mut decoder = arrived.decoder;
        main.set_timeouts(self.config.io_timeout)
            .map_err(MigrationError::channel(0))?;
        self.enter_postcopy_phase(ReceivePhase::PostcopyRecover, None);
        main.send_message(&Message::Welcome(Welcome {
            session_id: session.session_id,
            channel_index: 0,
        }))
        .map_err(MigrationError::channel(0))?;
        let page_channels = self.accept_page_channels(
            session.handshakes,
            &mut main,
            &mut decoder,
            session.session_id,
            session.channel_count,
        )?;
        send_missing(&mut main, missing)?;
        Ok(Some(Reconnected {
            main,
            decoder,
            page_channels,
        }))
    }
}

/// Tells the reconnected source which stale pages are still missing, in as
/// many frames as they take.
fn send_missing(main: &mut Channel, runs: &[PageRun]) -> Result<(), MigrationError> {
    let mut frames = runs.chunks(MAX_STALE_RUNS).peekable();
    if frames.peek().is_none() {
        return main
            .send_message(&Message::PostcopyMissing(PostcopyMissing {
                more: false,
                missing: Vec::new(),
            }))
            .map_err(MigrationError::channel(0));
    }
    while let Some(frame) = frames.next() {
        main.send_message(&Message::PostcopyMissing(PostcopyMissing {
            more: frames.peek().is_some(),
            missing: frame.to_vec(),
        }))
        .map_err(MigrationError::channel(0))?;
    }
    Ok(())
}

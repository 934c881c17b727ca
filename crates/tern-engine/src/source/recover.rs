//! The source's half of postcopy recovery (docs/postcopy.md, "Recovery"):
//! after the point of no return a broken or silent connection pauses
//! postcopy instead of ending it. The guest runs on the destination, the
//! source's memory stays frozen, and this side, the one that connects,
//! connects again: with backoff for `postcopy_recover_timeout`, then once
//! more each time the operator asks (`MigrationHandle::resume_postcopy`).
//! A reconnection runs the protections of the first connection (TLS, the
//! shared key bound to the same session and channel), must meet the same
//! destination identity, and names the session in `PostcopyResume`; the
//! destination answers with the stale pages it still lacks, which are
//! checked against this side's own stale set before anything is resent.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tern_wire::{ChannelHello, Handshake, Message, PageRun, PostcopyResume, SessionSetup};

use super::connect::{expect_welcome, open_and_greet, open_channel};
use crate::cancel::CancelToken;
use crate::config::MigrationConfig;
use crate::control::SourceControl;
use crate::error::{ChannelError, MigrationError};
use crate::postcopy::StaleSet;
pub(super) use crate::postcopy::is_recoverable;
use crate::stats::MigrationStatus;
use crate::transport::{Channel, Connect, Connector, Expected};

/// The first pause between reconnection attempts; it doubles up to
/// [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// How often a paused wait looks at the operator's requests.
const PAUSED_POLL: Duration = Duration::from_millis(20);

/// What a reconnection needs from the first connection.
pub(super) struct Session<'a> {
    pub config: &'a MigrationConfig,
    pub connector: &'a dyn Connect,
    pub session_id: u64,
    /// The destination's identity on the first main channel (its TLS
    /// certificate): a reconnection must meet the same one.
    pub identity: Option<Vec<u8>>,
    pub setup: &'a SessionSetup,
    /// Where an operator's resume redirected the reconnections (QEMU's
    /// `migrate` with `resume=true` and a URI), kept for later recoveries
    /// of this migration.
    pub redirected: Mutex<Option<Arc<Connector>>>,
}

/// A mended connection: the new channels and what the destination lacks.
pub(super) struct Mended {
    pub main: Channel,
    pub page_channels: Vec<Channel>,
    pub missing: StaleSet,
}

impl Session<'_> {
    /// Reconnects until it works, the operator cancels, or forever while
    /// the operator keeps the migration paused: each window lasts
    /// `postcopy_recover_timeout`, after which the status stays
    /// `postcopy-paused` (said in an event and an error line) until
    /// `resume_postcopy` opens the next window. `stale` is what this side
    /// still serves; `cause` is why postcopy paused.
    pub(super) fn recover(
        &self,
        control: &SourceControl,
        cancel: &CancelToken,
        stale: &StaleSet,
        cause: &MigrationError,
    ) -> Result<Mended, MigrationError> {
        control.stats.set_status(MigrationStatus::PostcopyPaused);
        control
            .events
            .status(MigrationStatus::PostcopyPaused, Some(cause.chain()));
        tracing::warn!(
            error = %cause.chain(),
            "postcopy paused: the connection to the destination broke; reconnecting"
        );
        loop {
            match self.reconnect_for(
                self.config.postcopy_recover_timeout,
                control,
                cancel,
                stale,
            )? {
                Attempts::Mended(mended) => return Ok(*mended),
                Attempts::TimedOut { all_refused } => {
                    // Refused at every attempt: the host answers and
                    // nothing listens, as when the destination's process
                    // is gone. Still no proof (a firewall may refuse too),
                    // and giving up would lose a guest that may yet be
                    // mended: the operator decides, knowing this.
                    let seen = if all_refused {
                        "; every attempt was refused (nothing listens at the destination's \
                         address: if its process is gone, so is the guest)"
                    } else {
                        ""
                    };
                    let text = format!(
                        "postcopy recovery timed out after {} s{seen}: the migration stays \
                         postcopy-paused (the guest runs on the destination without all of its \
                         memory); reconnect with migrate resume=true (tern ctl ... \
                         migrate-resume) or cancel (exit status 6)",
                        self.config.postcopy_recover_timeout.as_secs_f64()
                    );
                    tracing::error!("{text}");
                    control
                        .events
                        .status(MigrationStatus::PostcopyPaused, Some(text));
                }
            }
            loop {
                if cancel.is_cancelled() {
                    return Err(MigrationError::Cancelled);
                }
                if control.take_postcopy_resume() {
                    break;
                }
                std::thread::sleep(PAUSED_POLL);
            }
        }
    }

    /// Attempts with backoff for `window`.
    fn reconnect_for(
        &self,
        window: Duration,
        control: &SourceControl,
        cancel: &CancelToken,
        stale: &StaleSet,
    ) -> Result<Attempts, MigrationError> {
        let until = Instant::now() + window;
        let mut backoff = FIRST_BACKOFF;
        let mut all_refused = true;
        loop {
            if cancel.is_cancelled() {
                return Err(MigrationError::Cancelled);
            }
            self.redirect(control)?;
            match self.reconnect_once(control, stale, until) {
                Ok(mended) => return Ok(Attempts::Mended(Box::new(mended))),
                // A destination that answers with nonsense is not mended by
                // trying again.
                Err(error @ MigrationError::Protocol(_)) => return Err(error),
                Err(error) => {
                    all_refused &= refused_at_connect(&error);
                    tracing::debug!(error = %error.chain(), "postcopy reconnection failed");
                    back_to_paused(control, &error);
                }
            }
            let now = Instant::now();
            if now + backoff >= until {
                return Ok(Attempts::TimedOut { all_refused });
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// Dials the address an operator's resume named from now on, if a new
    /// one came.
    fn redirect(&self, control: &SourceControl) -> Result<(), MigrationError> {
        let Some(address) = control.take_postcopy_resume_address() else {
            return Ok(());
        };
        let connector = Connector::for_address(&address).map_err(MigrationError::channel(0))?;
        tracing::info!(%address, "postcopy recovery: reconnecting to a new address");
        *self.redirected.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(connector));
        Ok(())
    }

    /// One attempt: the main channel (protections, `PostcopyResume`,
    /// welcome, then `postcopy-recover`), the page channels, then the
    /// destination's missing pages.
    fn reconnect_once(
        &self,
        control: &SourceControl,
        stale: &StaleSet,
        until: Instant,
    ) -> Result<Mended, MigrationError> {
        let redirected = self
            .redirected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let connector: &dyn Connect = match &redirected {
            Some(connector) => connector.as_ref(),
            None => self.connector,
        };
        let mut main = open_channel(
            self.config,
            connector,
            self.session_id,
            0,
            Some(until.max(Instant::now() + Duration::from_millis(1))),
        )?;
        if main.security().peer_identity != self.identity {
            return Err(MigrationError::Channel {
                index: 0,
                source: ChannelError::Auth(
                    "the destination presented another certificate than before the pause".into(),
                ),
            });
        }
        let handshake = Handshake {
            session_id: self.session_id,
            channel_index: 0,
        };
        main.send_message(&Message::PostcopyResume(PostcopyResume { handshake }))
            .map_err(MigrationError::channel(0))?;
        expect_welcome(&mut main, self.session_id, 0, Some(until))?;
        control.stats.set_status(MigrationStatus::PostcopyRecover);
        control
            .events
            .status(MigrationStatus::PostcopyRecover, None);
        main.set_timeouts(self.config.io_timeout)
            .map_err(MigrationError::channel(0))?;
        let identity = main.security().peer_identity.clone();
        let page_channels = (1..=self.config.channels)
            .map(|index| {
                let hello = Message::ChannelHello(ChannelHello {
                    handshake: Handshake {
                        session_id: self.session_id,
                        channel_index: index,
                    },
                });
                open_and_greet(
                    self.config,
                    connector,
                    self.session_id,
                    index,
                    &hello,
                    Some(&identity),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let missing = read_missing(&mut main, self.setup, stale)?;
        Ok(Mended {
            main,
            page_channels,
            missing,
        })
    }
}

/// An attempt that failed after the destination welcomed it
/// (`postcopy-recover`) leaves postcopy paused again, saying why.
fn back_to_paused(control: &SourceControl, error: &MigrationError) {
    if control.stats.status() == MigrationStatus::PostcopyRecover {
        control.stats.set_status(MigrationStatus::PostcopyPaused);
        control.events.status(
            MigrationStatus::PostcopyPaused,
            Some(format!("the reconnection failed: {}", error.chain())),
        );
    }
}

/// How a window of reconnection attempts ended.
enum Attempts {
    Mended(Box<Mended>),
    /// None worked; `all_refused` when each was refused at connect.
    TimedOut {
        all_refused: bool,
    },
}

/// Whether a reconnection was refused before any byte moved: the host
/// answered and nothing listens at the address.
fn refused_at_connect(error: &MigrationError) -> bool {
    matches!(
        error,
        MigrationError::Channel {
            source: ChannelError::Connect(_, io),
            ..
        } if matches!(io.kind(), std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound)
    )
}

/// Reads the destination's missing pages: every run must lie inside this
/// side's stale set (so the list is bounded by guest memory this side
/// knows, never by what the peer declares), and no page may be named twice.
fn read_missing(
    main: &mut Channel,
    setup: &SessionSetup,
    stale: &StaleSet,
) -> Result<StaleSet, MigrationError> {
    let mut runs: Vec<PageRun> = Vec::new();
    let mut pages = 0u64;
    loop {
        let frame = match main
            .read_expected(Expected::POSTCOPY_MISSING)
            .map_err(MigrationError::channel(0))?
        {
            Message::PostcopyMissing(frame) => frame,
            Message::Abort(abort) => return Err(MigrationError::from_peer_abort(abort)),
            other => {
                return Err(MigrationError::Protocol(format!(
                    "expected the missing pages after the reconnection, got {:?}",
                    other.kind()
                )));
            }
        };
        for run in &frame.missing {
            let region = setup
                .regions
                .iter()
                .position(|region| region.id == run.region_id)
                .ok_or_else(|| {
                    MigrationError::Protocol(format!(
                        "the destination lacks pages of unknown region {}",
                        run.region_id
                    ))
                })?;
            if let Some(page) =
                (u64::from(run.first_page)..run.end()).find(|&page| !stale.contains(region, page))
            {
                return Err(MigrationError::Protocol(format!(
                    "the destination says it lacks page {page} of region {}, which was not stale \
                     or was already complete",
                    run.region_id
                )));
            }
            pages += u64::from(run.pages);
        }
        if pages > stale.total() {
            return Err(MigrationError::Protocol(format!(
                "the destination says it lacks more pages than the {} stale ones",
                stale.total()
            )));
        }
        if frame.more && frame.missing.is_empty() {
            return Err(MigrationError::Protocol(
                "an empty frame of missing pages announces more".into(),
            ));
        }
        runs.extend_from_slice(&frame.missing);
        if !frame.more {
            break;
        }
    }
    StaleSet::from_runs(setup, &runs).map_err(MigrationError::Protocol)
}

#[cfg(test)]
mod tests {

    use tern_wire::{Message, PageRun, PostcopyMissing, SessionSetup};

    use super::read_missing;
    use crate::bitmap::DirtyBitmap;
    use crate::postcopy::StaleSet;
    use crate::transport::Channel;

    fn setup() -> SessionSetup {
        crate::destination::test_memory::one_region_setup(3, 64 << 12)
    }

    /// What `read_missing` makes of `frames`, against pages 8..16 stale.
    fn missing(frames: &[PostcopyMissing]) -> Result<StaleSet, String> {
        let mut dirty = DirtyBitmap::new(64);
        (8..16).for_each(|page| dirty.set(page));
        let stale = StaleSet::from_dirty(&[dirty]);
        let (mut ours, mut theirs) = Channel::pair();
        for frame in frames {
            theirs
                .send_message(&Message::PostcopyMissing(frame.clone()))
                .unwrap();
        }
        read_missing(&mut ours, &setup(), &stale).map_err(|error| error.chain())
    }

    fn run(first_page: u32, pages: u32) -> PageRun {
        PageRun {
            region_id: 3,
            first_page,
            pages,
        }
    }

    #[test]
    fn the_missing_pages_must_lie_in_our_own_stale_set() {
        let frame = |more, missing| PostcopyMissing { more, missing };
        let fine =
            missing(&[frame(true, vec![run(8, 2)]), frame(false, vec![run(12, 4)])]).unwrap();
        assert_eq!(fine.total(), 6);
        for (frames, says) in [
            (vec![frame(false, vec![run(7, 2)])], "page 7 of region 3"),
            (vec![frame(false, vec![run(60, 8)])], "page 60 of region 3"),
            (
                vec![frame(
                    false,
                    vec![PageRun {
                        region_id: 9,
                        ..run(8, 1)
                    }],
                )],
                "unknown region 9",
            ),
            (vec![frame(true, Vec::new())], "empty frame"),
            (
                vec![frame(false, vec![run(8, 8), run(8, 8)])],
                "more pages than the 8 stale",
            ),
            (
                vec![frame(false, vec![run(8, 2), run(9, 1)])],
                "named twice",
            ),
        ] {
            let error = missing(&frames).unwrap_err();
            assert!(error.contains(says), "{frames:?}: {error}");
        }
    }
}

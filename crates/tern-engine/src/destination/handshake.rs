//! Handshake and setup: the main channel's hello, the guest, the page
//! channels.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use tern_page::codec::CodecId;
use tern_wire::{Abort, AbortReason, ChannelHello, FrameDecoder, Message, SessionSetup, Welcome};

use super::stream::{FrameSink, FrameSource, read_message};
use super::{Destination, POLL_INTERVAL, ReceivePhase};
use crate::error::{ChannelError, MigrationError};
use crate::guest::{DestinationGuest, GuestError, MemoryRegion};
use crate::transport::{Channel, Listener};

/// What the main channel's handshake settled.
pub(super) struct Greeted<G> {
    pub(super) setup: SessionSetup,
    pub(super) session_id: u64,
    /// The codecs the source announced, each of which this build decodes.
    pub(super) codecs: Vec<CodecId>,
    pub(super) guest: G,
    /// The guest's regions, in the setup's order.
    pub(super) regions: Vec<MemoryRegion>,
}

impl Destination {
    /// Waits for the source's main channel, looking at the cancel token
    /// meanwhile.
    pub(super) fn accept_main(&self, listener: &Listener) -> Result<Channel, MigrationError> {
        let deadline = Instant::now() + self.config.accept_timeout;
        loop {
            if self.cancel.is_cancelled() {
                return Err(MigrationError::Cancelled);
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(MigrationError::Channel {
                    index: 0,
                    source: ChannelError::Timeout("the source to connect"),
                });
            }
            match listener.accept_timeout(remaining.min(POLL_INTERVAL)) {
                Ok(channel) => return Ok(channel),
                Err(ChannelError::Timeout(_)) => continue,
                Err(error) => return Err(MigrationError::channel(0)(error)),
            }
        }
    }

    /// Reads the source's hello, builds the guest for it, checks that both
    /// sides agree, and welcomes the source.
    pub(super) fn greet<G, F>(
        &self,
        main: &mut (impl FrameSource + FrameSink),
        decoder: &mut FrameDecoder,
        make_guest: F,
    ) -> Result<Greeted<G>, MigrationError>
    where
        G: DestinationGuest,
        F: FnOnce(&SessionSetup) -> Result<G, GuestError>,
    {
        let hello = match read_message(main, decoder).map_err(MigrationError::channel(0))? {
            Message::Hello(hello) => hello,
            Message::Abort(abort) => return Err(peer_aborted(abort)),
            other => {
                return Err(MigrationError::Protocol(format!(
                    "expected a hello on the main channel, got {:?}",
                    other.kind()
                )));
            }
        };
        let setup = hello.setup;
        let session_id = hello.handshake.session_id;
        let codecs = announced_codecs(setup.codecs)?;
        let guest = make_guest(&setup).map_err(MigrationError::guest("create guest"))?;
        check_guest_kind(&setup.guest_kind, guest.guest_kind())?;
        let regions: Vec<MemoryRegion> = guest.regions().to_vec();
        check_layout(&setup, &regions)?;
        self.stats
            .total
            .store(setup.total_bytes(), std::sync::atomic::Ordering::Relaxed);
        self.stats.set_phase(ReceivePhase::Receiving);
        main.send_message(&Message::Welcome(Welcome {
            session_id,
            channel_index: 0,
        }))
        .map_err(MigrationError::channel(0))?;
        Ok(Greeted {
            setup,
            session_id,
            codecs,
            guest,
            regions,
        })
    }

    /// Accepts the page channels. The source may give up meanwhile (a page
    /// channel it cannot set up, a cancel): it says so on the main channel,
    /// which is therefore watched too, so the reason ends the wait at once.
    pub(super) fn accept_page_channels(
        &self,
        listener: &Listener,
        main: &mut Channel,
        decoder: &mut FrameDecoder,
        session_id: u64,
        count: u16,
    ) -> Result<Vec<Channel>, MigrationError> {
        let mut slots: Vec<Option<Channel>> = (0..count).map(|_| None).collect();
        let mut seen = HashSet::new();
        let deadline = Instant::now() + self.config.accept_timeout;
        while seen.len() < usize::from(count) {
            if self.cancel.is_cancelled() {
                return Err(MigrationError::Cancelled);
            }
            if main
                .wait_readable(Duration::ZERO)
                .map_err(MigrationError::channel(0))?
            {
                return Err(match read_message(main, decoder) {
                    Ok(Message::Abort(abort)) => peer_aborted(abort),
                    Ok(other) => MigrationError::Protocol(format!(
                        "expected page channels, got {:?} on the main channel",
                        other.kind()
                    )),
                    Err(error) => MigrationError::channel(0)(error),
                });
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(MigrationError::Channel {
                    index: seen.len() + 1,
                    source: ChannelError::Timeout("the source's page channels"),
                });
            }
            let mut channel = match listener.accept_timeout(remaining.min(POLL_INTERVAL)) {
                Ok(channel) => channel,
                Err(ChannelError::Timeout(_)) => continue,
                Err(error) => return Err(MigrationError::channel(0)(error)),
            };
            let _ = channel.set_timeouts(self.config.io_timeout);
            let verdict = match read_message(&mut channel, &mut FrameDecoder::new()) {
                Ok(Message::ChannelHello(hello)) => {
                    check_channel_hello(&hello, session_id, count, &mut seen)
                }
                Ok(other) => Err(format!("expected a channel hello, got {:?}", other.kind())),
                Err(error) => Err(error.to_string()),
            };
            match verdict {
                Ok(index) => {
                    channel
                        .send_message(&Message::Welcome(Welcome {
                            session_id,
                            channel_index: index,
                        }))
                        .map_err(MigrationError::channel(usize::from(index)))?;
                    slots[usize::from(index) - 1] = Some(channel);
                }
                Err(reason) => {
                    // A stray or broken connection must not end the migration.
                    tracing::warn!("rejected a connection: {reason}");
                    let _ = channel.send_message(&Message::Abort(Abort {
                        reason: AbortReason::ProtocolError,
                        message: reason,
                    }));
                }
            }
        }
        Ok(slots.into_iter().flatten().collect())
    }
}

/// Accepts a page channel's hello when it belongs to this session and names
/// a channel not connected yet; returns the channel index.
pub(super) fn check_channel_hello(
    hello: &ChannelHello,
    session_id: u64,
    count: u16,
    seen: &mut HashSet<u16>,
) -> Result<u16, String> {
    let index = hello.handshake.channel_index;
    if hello.handshake.session_id != session_id {
        Err(format!(
            "session {:#x} is not the migration in progress ({session_id:#x})",
            hello.handshake.session_id
        ))
    } else if index == 0 || index > count {
        Err(format!("channel index {index} is outside 1..={count}"))
    } else if !seen.insert(index) {
        Err(format!("channel {index} connected twice"))
    } else {
        Ok(index)
    }
}

pub(super) fn peer_aborted(abort: Abort) -> MigrationError {
    MigrationError::PeerAborted {
        reason: abort.reason,
        message: abort.message,
    }
}

/// A destination refuses a guest of another kind than its own, unless one
/// side does not say what its kind is.
fn check_guest_kind(offered: &str, expected: &str) -> Result<(), MigrationError> {
    if offered.is_empty() || expected.is_empty() || offered == expected {
        return Ok(());
    }
    Err(MigrationError::GuestKindMismatch {
        expected: expected.to_string(),
        offered: offered.to_string(),
    })
}

/// The codecs the hello announces, each of which this build must decode.
fn announced_codecs(bits: u8) -> Result<Vec<CodecId>, MigrationError> {
    (1..8u8)
        .filter(|id| bits & (1 << id) != 0)
        .map(|id| {
            CodecId::from_wire(id).map_err(|_| {
                MigrationError::Incompatible(format!(
                    "the source compresses with codec {id}, which this destination cannot decode"
                ))
            })
        })
        .collect()
}

/// The destination's regions must be exactly the source's.
fn check_layout(setup: &SessionSetup, regions: &[MemoryRegion]) -> Result<(), MigrationError> {
    if setup.regions.len() != regions.len() {
        return Err(MigrationError::Incompatible(format!(
            "the source has {} memory regions, the destination {}",
            setup.regions.len(),
            regions.len()
        )));
    }
    for (theirs, ours) in setup.regions.iter().zip(regions) {
        if theirs.id != ours.id()
            || theirs.len != ours.len()
            || theirs.guest_addr != ours.guest_addr()
        {
            return Err(MigrationError::Incompatible(format!(
                "source region {} at {:#x} has {} bytes; destination region {} at {:#x} has {}",
                theirs.id,
                theirs.guest_addr,
                theirs.len,
                ours.id(),
                ours.guest_addr(),
                ours.len()
            )));
        }
    }
    Ok(())
}

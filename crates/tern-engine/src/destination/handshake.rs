//! Handshake and setup: the main channel's hello, the guest, the page
//! channels.

use crate::deadline::Deadline;
use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use tern_page::codec::CodecId;
use tern_wire::{
    Abort, AbortReason, AuthChallenge, AuthHello, ChannelHello, DigestAlgorithm, FrameDecoder,
    FrameKind, MAX_OPENING_FRAME, MAX_PROOF_FRAME, Message, OPENING_KINDS, PROOF_KINDS,
    SessionSetup, Welcome, WireError,
};

use super::stream::{FrameSink, read_message, read_message_within};
use super::{Destination, POLL_INTERVAL, ReceivePhase, ReceiveStats};
use crate::config::{ReceiveConfig, UnauthenticatedPolicy};
use crate::error::{ChannelError, MigrationError};
use crate::guest::{DestinationGuest, GuestError, MemoryRegion};
use crate::transport::auth::{self, AuthKey, Bound};
use crate::transport::security::Security;
use crate::transport::{Channel, Listener, ShutdownHandle, tls};

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

/// A connection whose first message arrived within its deadline: the end
/// of one connection's handshake ([`open`]), run on a thread of its own
/// with its own deadline. Before the peer proved anything, only the opening
/// kinds are read, and none longer than the largest legal hello.
///
/// ```mermaid
/// stateDiagram-v2
///     [*] --> Accepted
///     Accepted --> Opening: TLS accepted (with --tls-dir), or none
///     Opening --> Challenged: AuthHello (with a key), AuthChallenge sent
///     Challenged --> Proved: AuthProof matches (main channel: frames sealed from now on)
///     Proved --> Arrived: Hello or ChannelHello naming the proofs' session and channel
///     Opening --> Arrived: Hello or ChannelHello (no key), or Abort
///     Opening --> Refused: other kind, too long, AuthHello without a key, hello with a key
///     Challenged --> Refused: bad proof, Abort, timeout
///     Proved --> Refused: other session or channel
///     Accepted --> Refused: handshake timeout, dropped to make room
///     Arrived --> [*]: Welcome (or Abort) from the session
///     Refused --> [*]: Abort with the reason, connection closed
/// ```
pub(crate) struct Arrived {
    pub(super) channel: Channel,
    pub(super) decoder: FrameDecoder,
    pub(crate) message: Message,
}

/// A connection still in handshake: a handle to close it at its deadline.
struct Pending {
    id: u64,
    closer: ShutdownHandle,
    deadline: Instant,
    /// Where it comes from (TCP), for the per-address limit.
    peer: Option<IpAddr>,
    /// Set once the peer proved the shared key: such a handshake is never
    /// dropped to make room (only a real source can get there).
    proved: Arc<AtomicBool>,
}

type Outcome = (u64, Result<Arrived, ChannelError>);

/// Accepts connections and reads each one's first message on a thread of
/// its own, with a deadline per connection, so that a silent, slow or broken
/// connection costs one thread for at most the handshake timeout and delays
/// no other. At most `limit` connections are in handshake at once, and at
/// most half of them from one address; when a new connection finds no
/// room, a pending handshake that has proved nothing yet, chosen at random,
/// is dropped for it (as OpenSSH's `MaxStartups` drops at random), so an
/// attacker holding every slot cannot keep them: a real source's
/// connection gets in, proves the key within a round trip (after which it
/// is never dropped), and a source that is dropped anyway retries.
pub(super) struct Handshakes<'a> {
    listener: &'a Listener,
    /// Listeners an operator added while postcopy was paused
    /// (`migrate-recover` with an address), accepted on as well.
    added: Vec<Listener>,
    security: Security,
    timeout: Duration,
    limit: usize,
    pending: Vec<Pending>,
    sender: mpsc::Sender<Outcome>,
    outcomes: mpsc::Receiver<Outcome>,
    next_id: u64,
    /// Where refused connections are counted.
    stats: Arc<ReceiveStats>,
    /// Handshakes dropped to make room since the last line about them: a
    /// flood is logged once a second, not once a connection.
    dropped_unlogged: u64,
    dropped_logged_at: Option<Instant>,
    /// Wakes the accept loop when a handshake finishes; `None` when the
    /// socket pair could not be made (the loop then looks every
    /// [`ACCEPT_POLL`]).
    waker: Option<HandshakeWaker>,
}

/// How long one accept poll waits before looking at finished handshakes
/// and deadlines. A finished handshake wakes the loop at once
/// ([`HandshakeWaker`]) where the listener has a socket to poll beside.
const ACCEPT_POLL: Duration = Duration::from_millis(10);

/// A socket pair a handshake thread writes a byte to when it has sent its
/// outcome, polled beside the listener. Without it every channel waited
/// out a 10 ms accept poll: 20 ms of each 2-channel migration's setup
/// (a paused 1 GiB migration at 1 Gbit/s set up in 33 ms, strace showed
/// both channels' hellos read within 0.3 ms, then the loop asleep).
struct HandshakeWaker {
    readable: std::os::unix::net::UnixStream,
    writable: Arc<std::os::unix::net::UnixStream>,
}

impl HandshakeWaker {
    fn new() -> std::io::Result<Self> {
        let (readable, writable) = std::os::unix::net::UnixStream::pair()?;
        // A full buffer means a wake is pending already: never block on it.
        readable.set_nonblocking(true)?;
        writable.set_nonblocking(true)?;
        Ok(Self {
            readable,
            writable: Arc::new(writable),
        })
    }

    /// Empties the pending wakes.
    fn drain(&self) {
        let mut bytes = [0u8; 64];
        while matches!(std::io::Read::read(&mut &self.readable, &mut bytes), Ok(n) if n > 0) {}
    }
}

/// How often a flood of dropped handshakes is logged.
const DROP_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// A uniformly random index below `len` (0 when `len` is 0).
fn random_index(len: usize) -> usize {
    let mut bytes = [0u8; 8];
    if crate::transport::auth::random_bytes(&mut bytes).is_err() {
        return 0;
    }
    usize::try_from(u64::from_le_bytes(bytes) % len.max(1) as u64).unwrap_or(0)
}

impl<'a> Handshakes<'a> {
    pub(super) fn new(
        listener: &'a Listener,
        config: &ReceiveConfig,
        stats: &Arc<ReceiveStats>,
    ) -> Self {
        let (sender, outcomes) = mpsc::channel();
        Self {
            listener,
            added: Vec::new(),
            security: config.security.clone(),
            timeout: config.handshake_timeout,
            limit: config.max_pending_handshakes.max(1),
            pending: Vec::new(),
            sender,
            outcomes,
            next_id: 0,
            stats: stats.clone(),
            dropped_unlogged: 0,
            dropped_logged_at: None,
            waker: HandshakeWaker::new()
                .inspect_err(|error| {
                    tracing::debug!(%error, "handshakes wake the accept loop by its poll only")
                })
                .ok(),
        }
    }

    /// The next connection that sent a whole first message, or `None` when
    /// none did within `wait`. Connections that fail their handshake are
    /// logged and closed here.
    pub(super) fn next(&mut self, wait: Duration) -> Result<Option<Arrived>, ChannelError> {
        let until = Instant::now() + wait;
        loop {
            if let Some(arrived) = self.collect() {
                return Ok(Some(arrived));
            }
            self.close_overdue();
            self.accept_added()?;
            let remaining = until.saturating_duration_since(Instant::now());
            match self.accept_or_wake(remaining.min(ACCEPT_POLL)) {
                Ok(channel) => self.start(channel),
                Err(ChannelError::Timeout(_)) => {}
                Err(error) => return Err(error),
            }
            if remaining.is_zero() {
                return Ok(self.collect());
            }
        }
    }

    /// A connection on the listener within `wait`, or a timeout, ended
    /// early when a handshake finishes.
    fn accept_or_wake(&self, wait: Duration) -> Result<Channel, ChannelError> {
        let (Some(waker), Some(listener)) = (&self.waker, self.listener.readiness_fd()) else {
            return self.listener.accept_timeout(wait);
        };
        let [connection, woken] = crate::transport::poll_readable_any(
            [listener, std::os::fd::AsRawFd::as_raw_fd(&waker.readable)],
            wait,
        )
        .map_err(ChannelError::Io)?;
        if woken {
            waker.drain();
        }
        if connection {
            return self.listener.accept_timeout(Duration::ZERO);
        }
        Err(ChannelError::Timeout("a connection"))
    }

    /// Accepts on `listener` too from now on, with the same protections.
    pub(super) fn listen_also(&mut self, listener: Listener) {
        self.added.push(listener);
    }

    /// Starts the handshake of a connection already waiting on an added
    /// listener, without waiting for one.
    fn accept_added(&mut self) -> Result<(), ChannelError> {
        for index in 0..self.added.len() {
            match self.added[index].accept_timeout(Duration::ZERO) {
                Ok(channel) => self.start(channel),
                Err(ChannelError::Timeout(_)) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// Takes the first finished handshake that succeeded; logs the failed.
    fn collect(&mut self) -> Option<Arrived> {
        while let Ok((id, outcome)) = self.outcomes.try_recv() {
            let Some(position) = self.pending.iter().position(|p| p.id == id) else {
                // Already closed at its deadline, and logged then.
                continue;
            };
            self.pending.swap_remove(position);
            match outcome {
                Ok(arrived) => return Some(arrived),
                // Its reads are bounded by the handshake timeout (a frame
                // trickled past it is cut off there): the same deadline.
                Err(ChannelError::Timeout(_)) => self.stats.record_refusal(format!(
                    "closed a connection that did not finish its handshake within {:?}",
                    self.timeout
                )),
                Err(error) => self.stats.record_refusal(format!(
                    "closed a connection that failed its handshake: {}",
                    error.chain()
                )),
            }
        }
        None
    }

    fn close_overdue(&mut self) {
        let now = Instant::now();
        self.pending.retain(|pending| {
            if pending.deadline > now {
                return true;
            }
            self.stats.record_refusal(format!(
                "closed a connection that did not finish its handshake within {:?}",
                self.timeout
            ));
            pending.closer.shutdown();
            false
        });
    }

    /// Makes room for a connection from `peer` when the slots, or its
    /// address's share of them, are taken: drops a random pending handshake
    /// that proved nothing yet (from the same address when that address is
    /// at its share). Returns false when there is nothing to drop.
    fn make_room(&mut self, peer: Option<IpAddr>) -> bool {
        let per_address = (self.limit / 2).max(1);
        let from_peer = |pending: &Pending| peer.is_some() && pending.peer == peer;
        let same_address = self.pending.iter().filter(|p| from_peer(p)).count();
        let crowded_address = same_address >= per_address;
        if self.pending.len() < self.limit && !crowded_address {
            return true;
        }
        let candidates: Vec<usize> = (0..self.pending.len())
            .filter(|&index| {
                let pending = &self.pending[index];
                !pending.proved.load(Ordering::Acquire) && (!crowded_address || from_peer(pending))
            })
            .collect();
        let Some(&victim) = candidates.get(random_index(candidates.len())) else {
            return false;
        };
        let dropped = self.pending.swap_remove(victim);
        dropped.closer.shutdown();
        let due = self
            .dropped_logged_at
            .is_none_or(|at| at.elapsed() >= DROP_LOG_INTERVAL);
        if !due {
            self.dropped_unlogged += 1;
            self.stats.count_refusal();
            return true;
        }
        self.stats.record_refusal(format!(
            "dropped a connection that had proved nothing in its handshake to make room: {} \
             connections were in handshake ({same_address} from the new one's address; limits \
             {} and {per_address} per address); {} more dropped since the last such line",
            self.pending.len() + 1,
            self.limit,
            self.dropped_unlogged
        ));
        self.dropped_unlogged = 0;
        self.dropped_logged_at = Some(Instant::now());
        true
    }

    fn start(&mut self, mut channel: Channel) {
        let peer = channel.peer_ip();
        if !self.make_room(peer) {
            self.stats.record_refusal(format!(
                "closed a new connection: {} connections are already in handshake, each past \
                 its key proof",
                self.pending.len()
            ));
            return;
        }
        // The closer ends a read blocked past the deadline; the per-read
        // timeout only bounds each read, and a slow peer could otherwise keep
        // the handshake alive with one byte per timeout.
        let Ok(closer) = channel.shutdown_handle() else {
            tracing::warn!("closed a new connection: cannot duplicate its socket");
            return;
        };
        let _ = channel.set_timeouts(self.timeout);
        let id = self.next_id;
        self.next_id += 1;
        let proved = Arc::new(AtomicBool::new(false));
        self.pending.push(Pending {
            id,
            closer,
            deadline: Instant::now() + self.timeout,
            peer,
            proved: proved.clone(),
        });
        let sender = self.sender.clone();
        let security = self.security.clone();
        let wake = self.waker.as_ref().map(|waker| waker.writable.clone());
        let spawned = std::thread::Builder::new()
            .name("tern-handshake".into())
            .spawn(move || {
                let outcome = open_marking(channel, &security, &proved);
                // The accept loop may be gone; the connection closes then.
                let _ = sender.send((id, outcome));
                if let Some(wake) = wake {
                    // A full buffer is a wake already pending.
                    let _ = std::io::Write::write(&mut &*wake, &[1]);
                }
            });
        if let Err(error) = spawned {
            tracing::warn!("closed a new connection: cannot start its handshake: {error}");
            self.pending.pop();
        }
    }
}

impl Drop for Handshakes<'_> {
    fn drop(&mut self) {
        for pending in &self.pending {
            pending.closer.shutdown();
        }
    }
}

/// How a refused opening kind is named.
const OPENING_NAMES: &str = "a hello, a channel hello or an auth hello";

/// What may follow a key exchange.
const HELLO_KINDS: [FrameKind; 4] = [
    FrameKind::Hello,
    FrameKind::ChannelHello,
    FrameKind::PostcopyResume,
    FrameKind::Abort,
];

/// The first byte of a TLS ClientHello record, which no tern frame kind
/// uses.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Runs a new connection's protections (TLS, the shared-key handshake) and
/// reads its first message after them.
pub(crate) fn open(channel: Channel, security: &Security) -> Result<Arrived, ChannelError> {
    open_marking(channel, security, &AtomicBool::new(false))
}

/// [`open`], setting `proved` as soon as the peer proved the shared key.
fn open_marking(
    channel: Channel,
    security: &Security,
    proved: &AtomicBool,
) -> Result<Arrived, ChannelError> {
    let mut channel = match &security.tls {
        Some(config) => {
            let channel = tls::accept(channel, config)?;
            // Mutual TLS: the peer proved a certificate of the CA.
            proved.store(true, Ordering::Release);
            channel
        }
        None => channel,
    };
    // Nothing before the proof may cost more than the largest legal hello:
    // any other kind is refused at its header.
    let mut decoder = FrameDecoder::new().only(&OPENING_KINDS, OPENING_NAMES);
    let result = first_message(
        &mut channel,
        &mut decoder,
        security.auth_key.as_deref(),
        proved,
    )
    .map_err(|error| match error {
        ChannelError::Protocol(WireError::UnknownFrameKind(TLS_HANDSHAKE_RECORD))
            if security.tls.is_none() =>
        {
            ChannelError::Tls(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the source speaks TLS and this destination does not: start it with --tls-dir",
            ))
        }
        other => other,
    });
    // What follows an accepted opening is the session's own business.
    decoder.restrict(None);
    match result {
        Ok(message) => Ok(Arrived {
            channel,
            decoder,
            message,
        }),
        Err(error) => {
            let message = match &error {
                ChannelError::Protocol(wire) => Some(format!("{error}: {wire}")),
                ChannelError::Auth(_) => Some(error.to_string()),
                // A TLS source reads no frame, but the bytes tell it that
                // this side does not speak TLS.
                ChannelError::Tls(_) if security.tls.is_none() => Some(error.chain()),
                _ => None,
            };
            if let Some(message) = message {
                // The peer hears why before the connection closes.
                let _ = channel.send_message(&Message::Abort(Abort {
                    reason: AbortReason::ProtocolError,
                    message,
                }));
            }
            Err(error)
        }
    }
}

/// The first message of a connection, after the shared-key handshake when
/// this destination has a key: then the hello must name the session and
/// channel the proofs covered.
fn first_message(
    channel: &mut Channel,
    decoder: &mut FrameDecoder,
    key: Option<&AuthKey>,
    proved: &AtomicBool,
) -> Result<Message, ChannelError> {
    let first = read_message_within(channel, decoder, MAX_OPENING_FRAME)?;
    match (key, first) {
        (Some(key), Message::AuthHello(hello)) => {
            let bound = server_auth(channel, decoder, key, hello)?;
            proved.store(true, Ordering::Release);
            if hello.handshake.channel_index == 0 {
                // The main channel: every control frame from the hello on is
                // sealed with the session's keys.
                let (sealer, opener) = key.session_keys(&bound).for_destination();
                channel.seal_control(sealer, None);
                decoder.seal_with(Box::new(opener));
            }
            decoder.restrict(Some((&HELLO_KINDS, "a hello or a channel hello")));
            // The bound is the plain frame's: a sealed frame's reader adds
            // the seal's own bytes to it.
            let message = read_message_within(channel, decoder, MAX_OPENING_FRAME)?;
            let named = match &message {
                Message::Hello(hello) => Some(hello.handshake),
                Message::ChannelHello(hello) => Some(hello.handshake),
                Message::PostcopyResume(resume) => Some(resume.handshake),
                _ => None,
            };
            if named.is_some_and(|named| named != hello.handshake) {
                return Err(ChannelError::Auth(
                    "the hello names another session or channel than the authentication".into(),
                ));
            }
            channel.mark_key_authenticated();
            Ok(message)
        }
        (_, Message::Abort(abort)) => Ok(Message::Abort(abort)),
        (Some(_), _) => Err(ChannelError::Auth(
            "this destination requires an auth key: start the source with --auth-key".into(),
        )),
        (None, Message::AuthHello(_)) => Err(ChannelError::Auth(
            "the source authenticates with a key but this destination has none: start it with \
             --auth-key"
                .into(),
        )),
        (None, message) => Ok(message),
    }
}

/// The destination's half of the shared-key handshake.
fn server_auth(
    channel: &mut Channel,
    decoder: &mut FrameDecoder,
    key: &AuthKey,
    hello: AuthHello,
) -> Result<Bound, ChannelError> {
    let destination_nonce = auth::nonce().map_err(|error| ChannelError::Auth(error.to_string()))?;
    let bound = Bound {
        handshake: hello.handshake,
        source_nonce: hello.nonce,
        destination_nonce,
    };
    channel.send_message(&Message::AuthChallenge(AuthChallenge {
        nonce: destination_nonce,
        proof: key.destination_proof(&bound),
    }))?;
    decoder.restrict(Some((&PROOF_KINDS, "an auth proof")));
    match read_message_within(channel, decoder, MAX_PROOF_FRAME)? {
        Message::AuthProof(proof) => key
            .verify_source(&bound, &proof.proof)
            .map(|()| bound)
            .map_err(|_| {
                ChannelError::Auth(
                    "the source's proof does not match this destination's auth key".into(),
                )
            }),
        Message::Abort(abort) => Err(ChannelError::Auth(format!(
            "the source gave up authenticating: {}",
            abort.message
        ))),
        other => Err(ChannelError::Auth(format!(
            "expected an auth proof, got {:?}",
            other.kind()
        ))),
    }
}

/// Refuses a whole session with this reason, on the connection that
/// proposed it, and logs it.
pub(super) fn refuse(
    stats: &ReceiveStats,
    arrived: &mut Arrived,
    reason: AbortReason,
    message: String,
) {
    stats.record_refusal(format!("refused a connection: {message}"));
    let _ = arrived
        .channel
        .send_message(&Message::Abort(Abort { reason, message }));
}

impl Destination {
    /// Waits for the source's main channel: the first connection whose
    /// hello this destination can serve. Other connections are closed and
    /// logged, and the wait goes on.
    pub(super) fn accept_main(
        &self,
        handshakes: &mut Handshakes<'_>,
    ) -> Result<Arrived, MigrationError> {
        let deadline = Deadline::after(self.config.accept_timeout, "the source to connect");
        loop {
            let slice = deadline.next_slice_unless(&self.cancel, 0, POLL_INTERVAL)?;
            let Some(mut arrived) = handshakes.next(slice).map_err(MigrationError::channel(0))?
            else {
                continue;
            };
            match &arrived.message {
                Message::Hello(hello) => match self.check_resources(&hello.setup) {
                    Ok(()) => return Ok(arrived),
                    Err(reason) => refuse(
                        &self.stats,
                        &mut arrived,
                        AbortReason::IncompatibleSetup,
                        reason,
                    ),
                },
                Message::Abort(abort) => self.stats.record_refusal(format!(
                    "a connection aborted before its hello ({:?}): {}",
                    abort.reason, abort.message
                )),
                other => {
                    let reason = format!(
                        "expected a hello on a new connection, got {:?}",
                        other.kind()
                    );
                    refuse(
                        &self.stats,
                        &mut arrived,
                        AbortReason::ProtocolError,
                        reason,
                    );
                }
            }
        }
    }

    /// Refuses, before anything is allocated for it, a session larger than
    /// this destination accepts.
    pub(super) fn check_resources(&self, setup: &SessionSetup) -> Result<(), String> {
        if setup.digest == DigestAlgorithm::None && !self.config.allow_unverified {
            return Err(
                "the source skips the memory digest (--verify none), which this \
                        destination does not allow (see --allow-unverified)"
                    .into(),
            );
        }
        let total = setup.total_bytes();
        if let Some(limit) = self.config.memory_limit()
            && total > limit
        {
            return Err(format!(
                "the guest has {total} bytes of memory, more than this destination accepts \
                 ({limit} bytes; see --max-memory)"
            ));
        }
        Ok(())
    }

    /// Builds the guest for the source's hello, checks that both sides
    /// agree, and welcomes the source.
    pub(super) fn greet<G, F>(
        &self,
        main: &mut impl FrameSink,
        hello: Message,
        make_guest: F,
    ) -> Result<Greeted<G>, MigrationError>
    where
        G: DestinationGuest,
        F: FnOnce(&SessionSetup) -> Result<G, GuestError>,
    {
        let Message::Hello(hello) = hello else {
            return Err(MigrationError::Internal(
                "the main channel's first message is not a hello".into(),
            ));
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

    /// Accepts the page channels, matched by the session id of their
    /// channel hello; their handshakes run concurrently, so a stray
    /// connection delays none of them. The source may give up meanwhile (a
    /// page channel it cannot set up, a cancel): it says so on the main
    /// channel, which is therefore watched too, so the reason ends the wait
    /// at once.
    pub(super) fn accept_page_channels(
        &self,
        handshakes: &mut Handshakes<'_>,
        main: &mut Channel,
        decoder: &mut FrameDecoder,
        session_id: u64,
        count: u16,
    ) -> Result<Vec<Channel>, MigrationError> {
        let mut slots: Vec<Option<Channel>> = (0..count).map(|_| None).collect();
        let mut seen = HashSet::new();
        let deadline = Deadline::after(self.config.accept_timeout, "the source's page channels");
        while seen.len() < usize::from(count) {
            let slice = deadline.next_slice_unless(&self.cancel, seen.len() + 1, POLL_INTERVAL)?;
            if main
                .wait_readable(Duration::ZERO)
                .map_err(MigrationError::channel(0))?
            {
                return Err(match read_message(main, decoder) {
                    Ok(Message::Abort(abort)) => peer_aborted(abort),
                    Ok(Message::MemoryHandover(_)) => MigrationError::Incompatible(
                        "the source hands its memory over (memory_handover), this destination \
                         copies it (it should receive with Destination::receive_handover)"
                            .into(),
                    ),
                    Ok(other) => MigrationError::Protocol(format!(
                        "expected page channels, got {:?} on the main channel",
                        other.kind()
                    )),
                    Err(error) => MigrationError::channel(0)(error),
                });
            }
            let Some(mut arrived) = handshakes.next(slice).map_err(MigrationError::channel(0))?
            else {
                continue;
            };
            let verdict = match &arrived.message {
                _ if arrived.channel.security().peer_identity != main.security().peer_identity => {
                    Err("the channel presented another certificate than the main channel".into())
                }
                Message::ChannelHello(hello) => {
                    check_channel_hello(hello, session_id, count, &mut seen)
                }
                other => Err(format!("expected a channel hello, got {:?}", other.kind())),
            };
            match verdict {
                Ok(index) => {
                    let mut channel = arrived.channel;
                    channel
                        .set_timeouts(self.config.io_timeout)
                        .map_err(MigrationError::channel(usize::from(index)))?;
                    channel
                        .send_message(&Message::Welcome(Welcome {
                            session_id,
                            channel_index: index,
                        }))
                        .map_err(MigrationError::channel(usize::from(index)))?;
                    slots[usize::from(index) - 1] = Some(channel);
                }
                // A stray or broken connection must not end the migration.
                Err(reason) => refuse(
                    &self.stats,
                    &mut arrived,
                    AbortReason::ProtocolError,
                    reason,
                ),
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

impl Destination {
    /// Refuses to receive where the policy says nobody unauthenticated may
    /// connect and this destination authenticates nobody.
    pub(super) fn check_policy(&self, listener: &Listener) -> Result<(), MigrationError> {
        if self.config.security.authenticates() {
            return Ok(());
        }
        let refused = match self.config.unauthenticated {
            UnauthenticatedPolicy::Allow => false,
            UnauthenticatedPolicy::Refuse => true,
            UnauthenticatedPolicy::LocalOnly => !listener.is_local_only(),
        };
        if !refused {
            return Ok(());
        }
        let address = listener.local_address().map_or_else(
            |_| "this listener".to_string(),
            |address| address.to_string(),
        );
        Err(MigrationError::InvalidConfig {
            field: "unauthenticated",
            reason: format!(
                "{address} can be reached from other machines and this destination \
                 authenticates nobody: give it an auth key or TLS certificates (--auth-key, \
                 --tls-dir), or accept unauthenticated sessions (--insecure)"
            ),
        })
    }
}

pub(super) fn peer_aborted(abort: Abort) -> MigrationError {
    MigrationError::from_peer_abort(abort)
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

#[cfg(test)]
mod tests {
    use super::{Handshakes, Pending, random_index};
    use crate::config::ReceiveConfig;
    use crate::destination::ReceiveStats;
    use crate::transport::{Address, Channel, Listener};
    use std::net::{IpAddr, Ipv4Addr};
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    fn address(last: u8) -> Option<IpAddr> {
        Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, last)))
    }

    /// A TLS source is recognised by its first byte only because no frame
    /// kind is 0x16 (protocol 12 numbered `PassApplied` 23 for this).
    #[test]
    fn no_frame_kind_is_a_tls_record_s_first_byte() {
        let header = [super::TLS_HANDSHAKE_RECORD, 0, 0, 0, 0, 0, 0, 0];
        assert!(tern_wire::FrameHeader::decode(&header).is_err());
    }

    /// A pending handshake from `peer` over a socket pair: the entry, the
    /// channel its handshake thread would hold (kept open by the test, so
    /// only a shutdown ends the connection) and the peer's end.
    fn pending_held(id: u64, peer: Option<IpAddr>, proved: bool) -> (Pending, Channel, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let channel = Channel::from_socket(ours.into()).unwrap();
        let entry = Pending {
            id,
            closer: channel.shutdown_handle().unwrap(),
            deadline: Instant::now() + Duration::from_secs(600),
            peer,
            proved: Arc::new(AtomicBool::new(proved)),
        };
        (entry, channel, theirs)
    }

    fn pending(id: u64, peer: Option<IpAddr>, proved: bool) -> (Pending, (Channel, UnixStream)) {
        let (entry, channel, theirs) = pending_held(id, peer, proved);
        (entry, (channel, theirs))
    }

    /// Whether the peer's end reads the end of the connection (waits up to
    /// a minute; a connection left open fails the test, never hangs it).
    fn reads_end(peer: &mut UnixStream) -> bool {
        peer.set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut byte = [0u8; 1];
        matches!(std::io::Read::read(peer, &mut byte), Ok(0))
    }

    /// Setup waited out a 10 ms accept poll per channel after its hello
    /// had been read. A wake ends a wait of a day; the test's own minute
    /// fails it (and the waiting thread is left behind) when none does.
    #[test]
    fn a_finished_handshake_wakes_the_accept_loop() {
        let listener: &'static Listener = Box::leak(Box::new(
            Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap(),
        ));
        let stats = Arc::new(ReceiveStats::default());
        let handshakes = Handshakes::new(listener, &ReceiveConfig::default(), &stats);
        let wake = handshakes.waker.as_ref().unwrap().writable.clone();
        let (done, waited) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let outcome = handshakes.accept_or_wake(Duration::from_secs(86_400));
            let _ = done.send((outcome.map(|_| ()), handshakes));
        });
        // What a handshake thread does once its outcome is sent.
        std::io::Write::write(&mut &*wake, &[1]).unwrap();
        let (outcome, handshakes) = waited
            .recv_timeout(Duration::from_secs(60))
            .expect("the wake ended the accept loop's wait");
        assert!(
            matches!(outcome, Err(crate::error::ChannelError::Timeout(_))),
            "{outcome:?}"
        );
        // The wake was taken: the next wait is not ended by it again (the
        // loop would spin until the next connection).
        let waker = handshakes.waker.as_ref().unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&waker.readable);
        assert!(!crate::transport::poll_readable(fd, Duration::ZERO).unwrap());
    }

    fn with_table(limit: usize, check: impl FnOnce(&mut Handshakes<'_>)) {
        let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap();
        let mut config = ReceiveConfig::default();
        config.max_pending_handshakes(limit);
        let stats = Arc::new(ReceiveStats::default());
        check(&mut Handshakes::new(&listener, &config, &stats));
    }

    fn ids(table: &Handshakes<'_>) -> Vec<u64> {
        let mut ids: Vec<u64> = table.pending.iter().map(|p| p.id).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn a_full_table_drops_a_handshake_that_proved_nothing_and_never_a_proved_one() {
        with_table(4, |table| {
            let mut peers = Vec::new();
            for id in 0..4 {
                let (entry, peer) = pending(id, address(u8::try_from(id).unwrap() + 1), id != 2);
                table.pending.push(entry);
                peers.push(peer);
            }
            assert!(
                table.make_room(address(9)),
                "the unproved handshake makes room"
            );
            assert_eq!(
                ids(table),
                [0, 1, 3],
                "only the one that proved nothing goes"
            );
            let (entry, peer) = pending(4, address(9), true);
            table.pending.push(entry);
            peers.push(peer);
            assert!(
                !table.make_room(address(10)),
                "every slot has proved the key"
            );
            assert_eq!(ids(table), [0, 1, 3, 4]);
        });
    }

    #[test]
    fn one_address_holds_at_most_half_the_slots() {
        with_table(8, |table| {
            let mut peers = Vec::new();
            for id in 0..4 {
                let (entry, peer) = pending(id, address(1), false);
                table.pending.push(entry);
                peers.push(peer);
            }
            assert!(table.make_room(address(2)), "another address finds room");
            assert_eq!(table.pending.len(), 4, "and nothing is dropped for it");
            assert!(
                table.make_room(address(1)),
                "a fifth from the first address"
            );
            assert_eq!(table.pending.len(), 3, "costs one of its own four");
            assert!(table.pending.iter().all(|p| p.peer == address(1)));
        });
    }

    #[test]
    fn a_connection_past_its_deadline_is_closed() {
        with_table(4, |table| {
            let (mut overdue, _held, mut peer) = pending_held(0, address(1), false);
            overdue.deadline = Instant::now();
            let (current, _current_peer) = pending(1, address(1), false);
            table.pending.push(overdue);
            table.pending.push(current);
            table.close_overdue();
            assert_eq!(ids(table), [1]);
            // The handshake's own thread holds the socket: only the
            // shutdown ends it, and the peer reads its end.
            assert!(reads_end(&mut peer));
            assert_eq!(
                table.stats.refused_connections(),
                1,
                "the close is recorded"
            );
        });
    }

    /// The handshake to drop for room is drawn at random, so that a flood
    /// cannot aim the drops at the real source's connection (a fixed choice,
    /// with `swap_remove` moving the newest connection into the freed slot,
    /// would drop the same newcomer every time).
    #[test]
    fn the_dropped_handshake_is_drawn_uniformly_below_the_count() {
        const SLOTS: usize = 8;
        const DRAWS: usize = 16_000;
        let mut counts = [0usize; SLOTS];
        for _ in 0..DRAWS {
            let index = random_index(SLOTS);
            assert!(index < SLOTS, "{index} is not below {SLOTS}");
            counts[index] += 1;
        }
        // 2,000 expected per slot, standard deviation about 42: a slot
        // outside 1,500..2,500 is more than ten deviations away.
        for (slot, &count) in counts.iter().enumerate() {
            assert!(
                (1_500..2_500).contains(&count),
                "slot {slot} drawn {count} times: {counts:?}"
            );
        }
        assert_eq!(random_index(0), 0, "nothing to draw from");
        assert_eq!(random_index(1), 0);
    }

    /// Outcomes find their connection by id: two connections with one id
    /// would let a finished handshake leave its twin's entry behind, to be
    /// shut down at its deadline while the session uses it.
    #[test]
    fn every_connection_in_handshake_has_its_own_id() {
        with_table(8, |table| {
            let mut peers = Vec::new();
            for _ in 0..3 {
                let (ours, theirs) = UnixStream::pair().unwrap();
                table.start(Channel::from_socket(ours.into()).unwrap());
                peers.push(theirs);
            }
            assert_eq!(ids(table), [0, 1, 2]);
        });
    }

    /// When the accept loop ends (the session started or failed), every
    /// handshake still in progress is cut, not left to its deadline.
    #[test]
    fn the_handshakes_in_progress_end_with_the_table() {
        let (entry, _held, mut peer) = pending_held(0, address(1), false);
        with_table(4, |table| table.pending.push(entry));
        assert!(reads_end(&mut peer));
    }

    /// A guest of exactly the destination's limit is taken; one page more
    /// is refused before anything is allocated for it.
    #[test]
    fn the_memory_limit_takes_a_guest_of_its_size_and_refuses_one_page_more() {
        use tern_wire::{DigestAlgorithm, RegionInfo, SessionSetup};
        const LIMIT: u64 = 8 << 20;
        let mut config = ReceiveConfig::default();
        config.max_memory(Some(LIMIT));
        let destination = crate::Destination::new(config);
        let setup = |len| SessionSetup {
            page_size: 4096,
            channel_count: 1,
            codecs: 0,
            digest: DigestAlgorithm::Xxh3Pages,
            regions: vec![RegionInfo {
                id: 0,
                guest_addr: 0,
                len,
            }],
            guest_kind: String::new(),
            dictionaries: 0,
            vmm_config_len: 0,
        };
        assert_eq!(destination.check_resources(&setup(LIMIT)), Ok(()));
        let refusal = destination
            .check_resources(&setup(LIMIT + 4096))
            .unwrap_err();
        assert!(
            refusal.contains("more than this destination accepts"),
            "{refusal}"
        );
    }
}

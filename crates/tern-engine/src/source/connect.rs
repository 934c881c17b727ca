//! Connecting: the session setup, the main channel and the page channels,
//! each greeted and welcomed.

use std::time::{Duration, Instant};

use tern_page::codec::{CodecDictionary, CodecId};
use tern_wire::{
    ChannelHello, Dictionary, DigestAlgorithm, Handshake, Hello, Message, RegionInfo, SessionSetup,
    Welcome,
};

use crate::config::{MigrationConfig, Verify, ZeroCopyBackend};
use crate::error::ChannelError;
use crate::error::MigrationError;
use crate::guest::MemoryRegion;
use crate::pipeline::{CompressionSetup, PageSender};
use crate::transport::security::secure_client;
use crate::transport::{Channel, Connect, Expected};
use crate::uring_zc::UringZeroCopySender;
use crate::zerocopy::{self, ZeroCopySender};

/// Opens the main channel into `main_slot` (so that a later failure can
/// still tell the destination why) and returns the page channels.
pub(super) fn connect(
    config: &MigrationConfig,
    connector: &dyn Connect,
    setup: &SessionSetup,
    session_id: u64,
    main_slot: &mut Option<Channel>,
    dictionary: Option<&CodecDictionary>,
) -> Result<Vec<PageSender>, MigrationError> {
    let zero_copy_window = if config.zero_copy {
        Some(zero_copy_window(config)?)
    } else {
        None
    };
    let hello = Message::Hello(Hello {
        handshake: Handshake {
            session_id,
            channel_index: 0,
        },
        setup: setup.clone(),
    });
    let main = main_slot.insert(open_and_greet(
        config, connector, session_id, 0, &hello, None,
    )?);
    // Before any page channel: every receiver has it before its first packet.
    if let Some(dictionary) = dictionary {
        main.send_message(&Message::Dictionary(Dictionary {
            id: dictionary.id(),
            codec: CodecId::Zstd.to_wire(),
            data: dictionary.bytes().to_vec(),
        }))
        .map_err(MigrationError::channel(0))?;
    }
    let identity = main.security().peer_identity.clone();
    (1..=config.channels)
        .map(|index| {
            let hello = Message::ChannelHello(ChannelHello {
                handshake: Handshake {
                    session_id,
                    channel_index: index,
                },
            });
            let channel = open_and_greet(
                config,
                connector,
                session_id,
                index,
                &hello,
                Some(&identity),
            )?;
            page_sender(config, channel, index, zero_copy_window)
        })
        .collect()
}

/// The VMM's configuration, right after the hello when it announced one.
fn send_vmm_config(main: &mut Channel, config: &MigrationConfig) -> Result<(), MigrationError> {
    if config.vmm_config.is_empty() {
        return Ok(());
    }
    main.send_message(&Message::VmmConfig(tern_wire::VmmConfig {
        data: config.vmm_config.clone(),
    }))
    .map_err(MigrationError::channel(0))
}

/// Connects channel `index` and runs its protections (TLS, the shared-key
/// handshake); its hello comes next. `until`, on a second or later
/// attempt, is the connect timeout's deadline: neither the connection nor
/// the handshake may wait past it.
pub(super) fn open_channel(
    config: &MigrationConfig,
    connector: &dyn Connect,
    session_id: u64,
    index: u16,
    until: Option<Instant>,
) -> Result<Channel, MigrationError> {
    let failed = || MigrationError::channel(usize::from(index));
    let within = |timeout: Duration| match until {
        // Never zero: a zero socket timeout would wait forever.
        Some(until) => timeout
            .min(until.saturating_duration_since(Instant::now()))
            .max(Duration::from_millis(1)),
        None => timeout,
    };
    let mut channel = connector
        .connect(index, within(config.connect_timeout))
        .map_err(failed())?;
    // Until the welcome: a peer that is not a tern destination is named
    // within the handshake timeout (`open_and_greet` restores io_timeout).
    channel
        .set_timeouts(within(config.handshake_timeout.min(config.io_timeout)))
        .map_err(failed())?;
    let address = connector.address();
    let handshake = Handshake {
        session_id,
        channel_index: index,
    };
    secure_client(channel, &config.security, address.host(), handshake).map_err(failed())
}

/// Connects channel `index`, runs its protections, checks that the
/// destination is the one of the main channel (`main_identity`) and sends
/// `hello`, until the destination welcomes it.
///
/// A busy destination may drop a connection that has proved nothing yet to
/// make room for another (its defence against connections held hostage,
/// docs/security.md), and under a flood a connection may wait in the
/// destination's accept queue, unanswered, past the handshake timeout. So
/// a channel is opened again, after 10 ms, then twice as long each time
/// (at most 320 ms), for as long as the connect timeout allows (no later
/// attempt waits past that deadline), when the destination closed it
/// before its welcome, or did not answer its handshake in time: any
/// channel whose TLS handshake or key exchange went unanswered (the
/// destination cannot have read its hello), and a page channel whose
/// welcome did not come. A main channel whose welcome did not come is not
/// opened again: the destination may be building the guest for its hello,
/// and a peer that is not tern is named by that silence
/// (`MigrationError::NotTern`). When the last attempt cannot even connect
/// (the destination gone, or sockets handed over once), the error is the
/// one that made the channel try again.
pub(super) fn open_and_greet(
    config: &MigrationConfig,
    connector: &dyn Connect,
    session_id: u64,
    index: u16,
    hello: &Message,
    main_identity: Option<&Option<Vec<u8>>>,
) -> Result<Channel, MigrationError> {
    let until = Instant::now() + config.connect_timeout;
    let mut backoff = Duration::from_millis(10);
    let mut cause: Option<MigrationError> = None;
    loop {
        let limit = cause.is_some().then_some(until);
        let attempt = greet_once(
            config,
            connector,
            session_id,
            index,
            hello,
            main_identity,
            limit,
        );
        match attempt {
            Err(failed) if failed.retryable(index) && Instant::now() + backoff < until => {
                tracing::debug!(
                    channel = index,
                    error = %failed.error.chain(),
                    "the destination closed the connection or did not answer it before \
                     welcoming it; retrying"
                );
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(320));
                cause = Some(failed.error);
            }
            Err(Failed { error, .. }) if is_connect_failure(&error) && cause.is_some() => {
                tracing::debug!(
                    channel = index,
                    error = %error.chain(),
                    "cannot connect the channel again"
                );
                return Err(cause.unwrap_or(error));
            }
            Err(failed) => return Err(failed.error),
            Ok(channel) => return Ok(channel),
        }
    }
}

/// Why one attempt of [`open_and_greet`] failed, and whether the hello had
/// been sent by then.
struct Failed {
    error: MigrationError,
    hello_sent: bool,
}

impl Failed {
    /// Whether channel `index` may be opened again after this: the
    /// destination closed it before its welcome, or did not answer in time
    /// before the hello (any channel) or after it (a page channel).
    fn retryable(&self, index: u16) -> bool {
        dropped_before_welcome(&self.error)
            || (handshake_timed_out(&self.error) && (!self.hello_sent || index > 0))
    }
}

/// One attempt of [`open_and_greet`]; `until` as in [`open_channel`].
fn greet_once(
    config: &MigrationConfig,
    connector: &dyn Connect,
    session_id: u64,
    index: u16,
    hello: &Message,
    main_identity: Option<&Option<Vec<u8>>>,
    until: Option<Instant>,
) -> Result<Channel, Failed> {
    let before_hello = |error| Failed {
        error,
        hello_sent: false,
    };
    let mut channel =
        open_channel(config, connector, session_id, index, until).map_err(before_hello)?;
    // Before the hello: a destination that is not the one on the main
    // channel learns nothing of the session.
    if let Some(identity) = main_identity
        && channel.security().peer_identity != *identity
    {
        return Err(before_hello(MigrationError::Channel {
            index: usize::from(index),
            source: ChannelError::Auth(
                "the destination presented another certificate than on the main channel".into(),
            ),
        }));
    }
    let after_hello = |error| Failed {
        error,
        hello_sent: true,
    };
    channel
        .send_message(hello)
        .map_err(MigrationError::channel(usize::from(index)))
        .map_err(after_hello)?;
    if index == 0 {
        send_vmm_config(&mut channel, config).map_err(after_hello)?;
    }
    expect_welcome(&mut channel, session_id, index, until).map_err(after_hello)?;
    channel
        .set_timeouts(config.io_timeout)
        .map_err(MigrationError::channel(usize::from(index)))
        .map_err(after_hello)?;
    Ok(channel)
}

/// Whether a channel failed because its handshake (TLS, the key exchange
/// or the welcome) was not answered within the handshake timeout.
fn handshake_timed_out(error: &MigrationError) -> bool {
    matches!(
        error,
        MigrationError::Channel {
            source: ChannelError::Timeout(_),
            ..
        }
    )
}

/// Whether a channel failed before it was connected at all.
fn is_connect_failure(error: &MigrationError) -> bool {
    matches!(
        error,
        MigrationError::Channel {
            source: ChannelError::Connect(..),
            ..
        }
    )
}

/// Whether a channel failed because the destination closed it (reset or
/// end of stream) before welcoming it, with no reason given: what a
/// destination short of handshake slots does.
fn dropped_before_welcome(error: &MigrationError) -> bool {
    let MigrationError::Channel { source, .. } = error else {
        return false;
    };
    match source {
        ChannelError::Closed => true,
        ChannelError::Io(error) => matches!(
            error.kind(),
            std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::ConnectionAborted
        ),
        _ => false,
    }
}

fn page_sender(
    config: &MigrationConfig,
    channel: Channel,
    index: u16,
    zero_copy_window: Option<usize>,
) -> Result<PageSender, MigrationError> {
    let Some(window) = zero_copy_window else {
        return Ok(PageSender::Plain(channel));
    };
    // Enabled as the channel connects, so a refusal fails here.
    Ok(PageSender::ZeroCopy(match config.zero_copy_backend {
        ZeroCopyBackend::Msg => Box::new(
            ZeroCopySender::enable(channel, usize::from(index), window)
                .map_err(MigrationError::ZeroCopy)?,
        ),
        ZeroCopyBackend::Uring => Box::new(
            UringZeroCopySender::enable(channel, usize::from(index), window)
                .map_err(MigrationError::ZeroCopy)?,
        ),
    }))
}

/// The per-channel zero-copy window: the configured one, or the largest
/// that lets every channel's window fit in `RLIMIT_MEMLOCK` together, capped
/// at 16 MiB; checked against the limit either way.
fn zero_copy_window(config: &MigrationConfig) -> Result<usize, MigrationError> {
    const PREFERRED: usize = 16 << 20;
    let channels = usize::from(config.channels);
    let window = if config.zero_copy_window != 0 {
        config.zero_copy_window
    } else if zerocopy::has_cap_ipc_lock() {
        PREFERRED
    } else {
        let soft = memlock_soft_limit().unwrap_or(u64::MAX);
        let share = usize::try_from(soft / channels as u64).unwrap_or(usize::MAX);
        // Leave a quarter for the rest of the process.
        (share / 4 * 3).clamp(zerocopy::MIN_WINDOW_BYTES, PREFERRED)
    };
    zerocopy::check_memlock(window * channels).map_err(MigrationError::ZeroCopy)?;
    Ok(window)
}

fn memlock_soft_limit() -> Option<u64> {
    // SAFETY: an all-zero rlimit is a valid value to overwrite.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: `limit` is valid for writes.
    let result = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    (result == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

/// Builds the session setup from the guest's regions and kind.
pub(super) fn session_setup(
    regions: &[MemoryRegion],
    guest_kind: &str,
    config: &MigrationConfig,
    compression: &CompressionSetup,
) -> Result<SessionSetup, MigrationError> {
    let setup = SessionSetup {
        page_size: tern_wire::PAGE_SIZE,
        channel_count: config.channels,
        codecs: compression
            .codecs()
            .iter()
            .fold(0, |bits, codec| bits | 1 << codec.to_wire()),
        digest: match config.verify {
            Verify::Full | Verify::Strict => DigestAlgorithm::Xxh3Pages,
            Verify::None => DigestAlgorithm::None,
        },
        regions: regions
            .iter()
            .map(|region| RegionInfo {
                id: region.id(),
                guest_addr: region.guest_addr(),
                len: region.len(),
            })
            .collect(),
        guest_kind: guest_kind.to_string(),
        dictionaries: u8::from(compression.dictionary.is_some()),
        // Checked against the protocol's maximum by `MigrationConfig::validate`.
        vmm_config_len: u32::try_from(config.vmm_config.len()).unwrap_or(u32::MAX),
    };
    setup.validate().map_err(|error| {
        MigrationError::Incompatible(format!("the guest's memory layout or kind: {error}"))
    })?;
    Ok(setup)
}

/// Reads channel `index`'s welcome, by `until` at the latest when given.
pub(super) fn expect_welcome(
    channel: &mut Channel,
    session_id: u64,
    index: u16,
    until: Option<Instant>,
) -> Result<(), MigrationError> {
    match channel
        .read_expected_until(Expected::WELCOME, until)
        .map_err(MigrationError::channel(usize::from(index)))?
    {
        Message::Welcome(Welcome {
            session_id: id,
            channel_index,
        }) if id == session_id && channel_index == index => Ok(()),
        Message::Abort(abort) => Err(MigrationError::from_peer_abort(abort)),
        other => Err(MigrationError::Protocol(format!(
            "expected a welcome on channel {index}, got {other:?}"
        ))),
    }
}

pub(super) fn random_session_id() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: `bytes` is writable for its length.
    let filled = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if usize::try_from(filled) == Ok(bytes.len()) {
        u64::from_le_bytes(bytes)
    } else {
        // Uniqueness, not secrecy, is what matters here.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        crate::numeric::saturating_u64(now.as_nanos())
            ^ u64::from(std::process::id()).rotate_left(32)
    }
}

/// Opens the main channel of a memory hand-over into `main_slot`: the
/// hello, the VMM configuration, the hand-over with the files attached,
/// then the destination's welcome and its echo of the hand-over (it has
/// mapped the files and built its guest). No page channel is opened.
pub(super) fn connect_handover(
    config: &MigrationConfig,
    connector: &dyn Connect,
    setup: &SessionSetup,
    session_id: u64,
    main_slot: &mut Option<Channel>,
    handover: &tern_wire::MemoryHandover,
    files: &[std::os::fd::RawFd],
) -> Result<(), MigrationError> {
    let failed = MigrationError::channel(0);
    let main = main_slot.insert(open_channel(config, connector, session_id, 0, None)?);
    if !main.carries_descriptors() {
        return Err(MigrationError::UnsupportedTransport {
            field: "memory_handover",
            address: connector.address().to_string(),
            reason: "the main channel is not a plain Unix socket, so it cannot carry the \
                     memory's file descriptors",
        });
    }
    main.send_message(&Message::Hello(Hello {
        handshake: Handshake {
            session_id,
            channel_index: 0,
        },
        setup: setup.clone(),
    }))
    .map_err(failed)?;
    send_vmm_config(main, config)?;
    let message = Message::MemoryHandover(handover.clone());
    main.send_message_with_files(&message, files)
        .map_err(MigrationError::channel(0))?;
    expect_welcome(main, session_id, 0, None)?;
    match main
        .read_expected(Expected::HANDOVER_ECHO)
        .map_err(MigrationError::channel(0))?
    {
        Message::MemoryHandover(echo) if echo == *handover => {}
        Message::Abort(abort) => return Err(MigrationError::from_peer_abort(abort)),
        other => {
            return Err(MigrationError::Protocol(format!(
                "expected the destination to confirm the memory hand-over, got {:?}",
                other.kind()
            )));
        }
    }
    main.set_timeouts(config.io_timeout)
        .map_err(MigrationError::channel(0))
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::OwnedFd;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    use tern_wire::{ChannelHello, FRAME_HEADER_LEN, FrameHeader, Handshake, Message, Welcome};

    use super::open_and_greet;
    use crate::config::MigrationConfig;
    use crate::error::{ChannelError, MigrationError};
    use crate::transport::{Address, Channel, Connect, Connector};

    /// Each migration's session id is its own: a destination tells a
    /// stray or stale connection from the session in progress by it.
    #[test]
    fn session_ids_differ_from_one_migration_to_the_next() {
        let ids: std::collections::HashSet<u64> =
            (0..64).map(|_| super::random_session_id()).collect();
        assert_eq!(ids.len(), 64);
    }

    const SESSION: u64 = 0x7e57_c0de;

    /// What the fake destination does with one connection.
    #[derive(Clone, Copy, Debug)]
    enum Answer {
        /// Holds it open and says nothing.
        Silent,
        /// Closes it at once.
        Close,
        /// Reads the channel hello whole, then closes it: the source's
        /// read of the welcome meets the end of the stream, not a reset.
        ReadThenClose,
        /// Reads the channel hello and welcomes it.
        Welcome,
    }

    /// A destination on 127.0.0.1 that answers its n-th connection as
    /// `plan(n)` says.
    struct FakeDestination {
        address: String,
        stop: Arc<AtomicBool>,
        thread: Option<JoinHandle<()>>,
    }

    impl FakeDestination {
        fn start(plan: fn(usize) -> Answer) -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let address = listener.local_addr().unwrap().to_string();
            let stop = Arc::new(AtomicBool::new(false));
            let stopped = stop.clone();
            let thread = std::thread::spawn(move || {
                let mut held = Vec::new();
                for connection in 0.. {
                    let Ok((stream, _)) = listener.accept() else {
                        return;
                    };
                    if stopped.load(Ordering::Acquire) {
                        return;
                    }
                    match plan(connection) {
                        Answer::Silent => held.push(stream),
                        Answer::Close => drop(stream),
                        Answer::ReadThenClose => drop(read_hello(&stream)),
                        Answer::Welcome => welcome(stream),
                    }
                }
            });
            Self {
                address,
                stop,
                thread: Some(thread),
            }
        }

        fn address(&self) -> Address {
            Address::Tcp(self.address.clone())
        }
    }

    impl Drop for FakeDestination {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Release);
            // Wakes the accept.
            let _ = TcpStream::connect(&self.address);
            if let Some(thread) = self.thread.take() {
                let _ = thread.join();
            }
        }
    }

    /// Reads a channel hello whole; `None` if the source gave up first.
    fn read_hello(mut stream: &TcpStream) -> Option<ChannelHello> {
        let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
        let mut head = [0u8; FRAME_HEADER_LEN];
        stream.read_exact(&mut head).ok()?;
        let header = FrameHeader::decode(&head).unwrap();
        let mut body = vec![0u8; header.body_len as usize];
        stream.read_exact(&mut body).ok()?;
        let Message::ChannelHello(hello) = Message::decode(header.kind, &body).unwrap() else {
            panic!("expected a channel hello");
        };
        Some(hello)
    }

    /// Reads a channel hello and answers it with its welcome; a source that
    /// gave up meanwhile is no error here.
    fn welcome(mut stream: TcpStream) {
        let Some(hello) = read_hello(&stream) else {
            return;
        };
        let welcome = Message::Welcome(Welcome {
            session_id: hello.handshake.session_id,
            channel_index: hello.handshake.channel_index,
        });
        let _ = stream.write_all(&welcome.to_bytes());
    }

    /// A connector that counts its connection attempts.
    #[derive(Debug)]
    struct Counting {
        inner: Connector,
        attempts: AtomicUsize,
    }

    impl Counting {
        fn new(inner: Connector) -> Self {
            Self {
                inner,
                attempts: AtomicUsize::new(0),
            }
        }

        fn attempts(&self) -> usize {
            self.attempts.load(Ordering::Relaxed)
        }
    }

    impl Connect for Counting {
        fn connect(&self, index: u16, timeout: Duration) -> Result<Channel, ChannelError> {
            self.attempts.fetch_add(1, Ordering::Relaxed);
            self.inner.connect(index, timeout)
        }

        fn address(&self) -> Address {
            self.inner.address()
        }
    }

    fn config(connect_timeout: Duration, handshake_timeout: Duration) -> MigrationConfig {
        MigrationConfig {
            connect_timeout,
            handshake_timeout,
            io_timeout: Duration::from_secs(60),
            ..MigrationConfig::default()
        }
    }

    fn hello(index: u16) -> Message {
        Message::ChannelHello(ChannelHello {
            handshake: Handshake {
                session_id: SESSION,
                channel_index: index,
            },
        })
    }

    fn is_timeout(result: &Result<Channel, MigrationError>, index: usize) -> bool {
        matches!(
            result,
            Err(MigrationError::Channel {
                index: failed,
                source: ChannelError::Timeout(_),
            }) if *failed == index
        )
    }

    /// A page channel whose first two connections are never answered
    /// (they sat in a flooded destination's accept queue) is opened again
    /// until one is welcomed.
    #[test]
    fn a_page_channel_whose_handshake_times_out_is_opened_again() {
        let destination = FakeDestination::start(|connection| {
            if connection < 2 {
                Answer::Silent
            } else {
                Answer::Welcome
            }
        });
        let connector = Counting::new(Connector::Dial(destination.address()));
        // A short handshake timeout: each silent connection costs one. An
        // answered attempt that a loaded machine delays past it is retried
        // too, within the minute.
        let config = config(Duration::from_secs(60), Duration::from_millis(200));
        let result = open_and_greet(&config, &connector, SESSION, 1, &hello(1), None);
        assert!(result.is_ok(), "{:?}", result.err().map(|e| e.chain()));
        assert!(
            connector.attempts() >= 3,
            "{} attempts",
            connector.attempts()
        );
    }

    /// Retries stop at the connect timeout's deadline, whatever the
    /// handshake timeout: the second connection (the first was closed) is
    /// given only what is left of one second, not its minute; the error
    /// names the timeout.
    #[test]
    fn retries_never_wait_past_the_connect_timeout() {
        let destination = FakeDestination::start(|connection| {
            if connection == 0 {
                Answer::Close
            } else {
                Answer::Silent
            }
        });
        let connector = Counting::new(Connector::Dial(destination.address()));
        let config = config(Duration::from_secs(1), Duration::from_secs(60));
        let started = Instant::now();
        let result = open_and_greet(&config, &connector, SESSION, 1, &hello(1), None);
        let took = started.elapsed();
        assert!(
            is_timeout(&result, 1),
            "{:?}",
            result.err().map(|e| e.chain())
        );
        assert!(
            connector.attempts() >= 2,
            "{} attempts",
            connector.attempts()
        );
        // Far below the 60 s handshake timeout a retry without the
        // deadline would wait, far above the 1 s it should take.
        assert!(took < Duration::from_secs(30), "took {took:?}");
    }

    /// A destination short of handshake slots closes a page channel after
    /// reading its hello, without a word: the end of the stream, where a
    /// welcome was due, is retried like a reset.
    #[test]
    fn a_page_channel_closed_after_its_hello_is_opened_again() {
        let destination = FakeDestination::start(|connection| {
            if connection == 0 {
                Answer::ReadThenClose
            } else {
                Answer::Welcome
            }
        });
        let connector = Counting::new(Connector::Dial(destination.address()));
        let config = config(Duration::from_secs(60), Duration::from_secs(60));
        let result = open_and_greet(&config, &connector, SESSION, 1, &hello(1), None);
        assert!(result.is_ok(), "{:?}", result.err().map(|e| e.chain()));
        assert_eq!(connector.attempts(), 2);
    }

    /// A main channel's silence after its hello is how a peer that is not
    /// tern is named (and a destination may be building the guest for that
    /// hello): it is not retried.
    #[test]
    fn the_main_channel_is_not_retried_after_silence() {
        let destination = FakeDestination::start(|_| Answer::Silent);
        let connector = Counting::new(Connector::Dial(destination.address()));
        let config = config(Duration::from_secs(60), Duration::from_millis(200));
        let result = open_and_greet(&config, &connector, SESSION, 0, &hello(0), None);
        assert!(
            is_timeout(&result, 0),
            "{:?}",
            result.err().map(|e| e.chain())
        );
        assert_eq!(connector.attempts(), 1);
    }

    /// With a key, a main channel whose key exchange goes unanswered (its
    /// connection still in a flooded destination's accept queue) is opened
    /// again: the destination cannot have read its hello. The last
    /// timeout is the error.
    #[test]
    fn a_main_channel_whose_key_exchange_goes_unanswered_is_opened_again() {
        let destination = FakeDestination::start(|_| Answer::Silent);
        let connector = Counting::new(Connector::Dial(destination.address()));
        let mut config = config(Duration::from_secs(1), Duration::from_millis(200));
        config.security.auth_key = Some(Arc::new(
            crate::transport::auth::AuthKey::from_bytes(&[7; 32]).unwrap(),
        ));
        let result = open_and_greet(&config, &connector, SESSION, 0, &hello(0), None);
        assert!(
            is_timeout(&result, 0),
            "{:?}",
            result.err().map(|e| e.chain())
        );
        assert!(
            connector.attempts() >= 2,
            "{} attempts",
            connector.attempts()
        );
    }

    /// Sockets handed over once cannot be connected again: the error is
    /// the timeout that made the channel try, not the missing socket.
    #[test]
    fn a_retry_that_cannot_connect_reports_what_made_it_retry() {
        let destination = FakeDestination::start(|_| Answer::Silent);
        let sockets = (0..2)
            .map(|_| OwnedFd::from(TcpStream::connect(&destination.address).unwrap()))
            .collect();
        let connector = Counting::new(Connector::from_sockets(destination.address(), sockets));
        let config = config(Duration::from_secs(60), Duration::from_millis(200));
        let result = open_and_greet(&config, &connector, SESSION, 1, &hello(1), None);
        assert!(
            is_timeout(&result, 1),
            "{:?}",
            result.err().map(|e| e.chain())
        );
        assert_eq!(connector.attempts(), 2);
    }
}

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
use crate::guest::{MemoryRegion, PAGE_SIZE};
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
/// handshake); its hello comes next.
fn open_channel(
    config: &MigrationConfig,
    connector: &dyn Connect,
    session_id: u64,
    index: u16,
) -> Result<Channel, MigrationError> {
    let failed = || MigrationError::channel(usize::from(index));
    let mut channel = connector
        .connect(index, config.connect_timeout)
        .map_err(failed())?;
    // Until the welcome: a peer that is not a tern destination is named
    // within the handshake timeout (`open_and_greet` restores io_timeout).
    channel
        .set_timeouts(config.handshake_timeout.min(config.io_timeout))
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
/// `hello`, until the destination welcomes it. A busy destination may drop a connection
/// that has proved nothing yet to make room for another (its defence
/// against connections held hostage, docs/security.md): a channel closed
/// before its welcome is opened again, after 10 ms, then twice as long
/// each time (at most 320 ms), for as long as the connect timeout allows.
fn open_and_greet(
    config: &MigrationConfig,
    connector: &dyn Connect,
    session_id: u64,
    index: u16,
    hello: &Message,
    main_identity: Option<&Option<Vec<u8>>>,
) -> Result<Channel, MigrationError> {
    let until = Instant::now() + config.connect_timeout;
    let mut backoff = Duration::from_millis(10);
    loop {
        let attempt = open_channel(config, connector, session_id, index).and_then(|mut channel| {
            // Before the hello: a destination that is not the one on the
            // main channel learns nothing of the session.
            if let Some(identity) = main_identity
                && channel.security().peer_identity != *identity
            {
                return Err(MigrationError::Channel {
                    index: usize::from(index),
                    source: ChannelError::Auth(
                        "the destination presented another certificate than on the main channel"
                            .into(),
                    ),
                });
            }
            channel
                .send_message(hello)
                .map_err(MigrationError::channel(usize::from(index)))?;
            if index == 0 {
                send_vmm_config(&mut channel, config)?;
            }
            expect_welcome(&mut channel, session_id, index)?;
            channel
                .set_timeouts(config.io_timeout)
                .map_err(MigrationError::channel(usize::from(index)))?;
            Ok(channel)
        });
        match attempt {
            Err(error) if dropped_before_welcome(&error) && Instant::now() + backoff < until => {
                tracing::debug!(
                    channel = index,
                    error = %error.chain(),
                    "the destination dropped the connection before welcoming it; retrying"
                );
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(320));
            }
            other => return other,
        }
    }
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
        page_size: PAGE_SIZE as u32,
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

fn expect_welcome(
    channel: &mut Channel,
    session_id: u64,
    index: u16,
) -> Result<(), MigrationError> {
    match channel
        .read_expected(Expected::WELCOME)
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
    if filled == bytes.len() as isize {
        u64::from_le_bytes(bytes)
    } else {
        // Uniqueness, not secrecy, is what matters here.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        now.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32)
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
    let main = main_slot.insert(open_channel(config, connector, session_id, 0)?);
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
    expect_welcome(main, session_id, 0)?;
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

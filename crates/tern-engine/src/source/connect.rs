//! Connecting: the session setup, the main channel and the page channels,
//! each greeted and welcomed.

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
use crate::transport::{Channel, Connect};
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
    let main = main_slot.insert(open_channel(config, connector, session_id, 0)?);
    main.send_message(&Message::Hello(Hello {
        handshake: Handshake {
            session_id,
            channel_index: 0,
        },
        setup: setup.clone(),
    }))
    .map_err(MigrationError::channel(0))?;
    send_vmm_config(main, config)?;
    expect_welcome(main, session_id, 0)?;
    main.set_timeouts(config.io_timeout)
        .map_err(MigrationError::channel(0))?;
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
            let channel = open_channel(config, connector, session_id, index)?;
            if channel.security().peer_identity != identity {
                return Err(MigrationError::Channel {
                    index: usize::from(index),
                    source: ChannelError::Auth(
                        "the destination presented another certificate than on the main channel"
                            .into(),
                    ),
                });
            }
            connect_page_channel(config, channel, session_id, index, zero_copy_window)
        })
        .collect()
}

/// Connects channel `index` and runs its protections (TLS, the shared-key
/// handshake); its hello comes next.
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
    // within the handshake timeout (`expect_welcome` restores io_timeout).
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

fn connect_page_channel(
    config: &MigrationConfig,
    mut channel: Channel,
    session_id: u64,
    index: u16,
    zero_copy_window: Option<usize>,
) -> Result<PageSender, MigrationError> {
    channel
        .send_message(&Message::ChannelHello(ChannelHello {
            handshake: Handshake {
                session_id,
                channel_index: index,
            },
        }))
        .map_err(MigrationError::channel(usize::from(index)))?;
    expect_welcome(&mut channel, session_id, index)?;
    channel
        .set_timeouts(config.io_timeout)
        .map_err(MigrationError::channel(usize::from(index)))?;
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
        .read_message()
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

//! tern's migration protocol.
//!
//! Pure encoding, decoding and validation: no I/O and no `unsafe`. Every
//! message travels in a frame: an 8-byte [`FrameHeader`] (kind, flags,
//! body length) followed by the body. Page packets are special: the engine
//! reads their fixed header and page table first and then reads the payload
//! straight into guest memory, so they are described by [`PagesHeader`] and
//! [`PageEntry`] instead of being decoded into one value.
//!
//! All integers are little-endian. Every decoder validates every field and
//! returns a [`WireError`]; no input makes it panic (a fuzz target checks
//! that, see `fuzz/`).
//!
//! See `docs/protocol.md` for the message sequence.
//!
//! # Example
//!
//! Encode a control message into a frame, then read it back the way a
//! receiver does: the fixed-size header first, then exactly the body it
//! announces.
//!
//! ```
//! use tern_wire::{FRAME_HEADER_LEN, FrameHeader, FrameKind, Message, Sync};
//!
//! let sent = Message::Sync(Sync { iteration: 3, last: false, dictionaries: 0 });
//! let bytes = sent.to_bytes();
//!
//! let (head, body) = bytes.split_first_chunk::<FRAME_HEADER_LEN>().unwrap();
//! let header = FrameHeader::decode(head)?;
//! assert_eq!(header.kind, FrameKind::Sync);
//! assert_eq!(header.body_len as usize, body.len());
//! assert_eq!(Message::decode(header.kind, body)?, sent);
//!
//! // Whole streams decode in one call, and malformed input is an error,
//! // never a panic.
//! let frames = tern_wire::decode_stream(&bytes, None)?;
//! assert_eq!(frames, [tern_wire::Frame::Message(sent)]);
//! assert!(tern_wire::decode_stream(&bytes[..bytes.len() - 1], None).is_err());
//! # Ok::<(), tern_wire::WireError>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]
// Numeric casts that can truncate or change sign are spelled out; see
// docs/publishing.md.
#![warn(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::cast_lossless,
    clippy::ptr_as_ptr
)]

mod codec;
mod decoder;
mod error;
mod handover;
mod layout;
mod message;
mod pages;
mod postcopy;
mod seal;
pub mod snapshot;

pub use codec::{MAX_PEER_TEXT_CHARS, Reader, Writer, sanitise_peer_text};
pub use decoder::{Decoded, Event, Expect, FrameDecoder, PagePacket};
pub use error::{AbortReason, WireError};
pub use handover::{
    HANDOVER_FORMAT, HANDOVER_SAMPLE_PAGES, HandedRegion, HandoverCoverage, MAX_HANDOVER_FILES,
    MemoryHandover,
};
pub use message::{
    Abort, AuthChallenge, AuthHello, AuthProof, ChannelHello, Complete, Dictionary,
    DigestAlgorithm, Handshake, Hello, LiveFigures, Message, Outcome, OutcomeStats, PassApplied,
    Ready, RegionInfo, SessionSetup, StateSectionMsg, Sync, VmmConfig, Welcome,
};
pub use pages::{
    DELTA_ENTRY_LEN, PageEntry, PageKind, PageRef, PagesHeader, decode_page_table,
    encode_packet_prefix, encode_pages_prefix,
};
pub use postcopy::{
    LATENCY_BUCKETS, MAX_REQUEST_PAGES, MAX_STALE_RUNS, PageRequest, PageRun, PostcopyComplete,
    PostcopyMissing, PostcopyResume, PostcopySwitch, UrgentPages,
};
pub use seal::{
    FRAME_SEALED, FrameOpener, MAX_OPENING_FRAME, MAX_PROOF_FRAME, OPENING_KINDS, PROOF_KINDS,
    SEAL_LEN, SEAL_TAG_LEN, Seal, header_is_sealed, mark_sealed,
};

/// First bytes of every handshake.
pub const MAGIC: [u8; 8] = *b"TERNMIG\0";
/// Protocol version spoken by this build.
pub const PROTOCOL_VERSION: u16 = 14;
/// The only page size this version supports: the one definition of tern's
/// page size (`tern_page::PAGE_SIZE` and `tern_engine::PAGE_SIZE` are this
/// value as a `usize`).
pub const PAGE_SIZE: u32 = 4096;

/// Page codec ids: the byte a page packet names its codec with
/// ([`PagesHeader::codec`]) and the bit numbers of [`SessionSetup::codecs`].
/// `tern-page` implements the codecs (its `CodecId` uses these values).
pub mod codec_id {
    /// No compression: a packet without compressed pages.
    pub const NONE: u8 = 0;
    /// zstd frames without checksum or content size.
    pub const ZSTD: u8 = 1;
    /// Raw deflate (RFC 1951) with a 4 KiB window, as Intel IAA decodes it.
    pub const DEFLATE: u8 = 2;
    /// lz4 block format.
    pub const LZ4: u8 = 3;
    /// zstd, one frame for all compressed pages of a packet: the first
    /// compressed entry carries the frame, the others carry no bytes, and
    /// the frame decodes to exactly 4096 bytes per compressed entry.
    pub const ZSTD_PACKET: u8 = 4;
    /// zstd, one stream per page channel: a packet's compressed pages are
    /// the stream's next bytes, flushed at the packet's end (the table as
    /// for [`ZSTD_PACKET`]), so they decode only after every earlier
    /// packet of the stream, on that channel, in order. The packet
    /// header's dictionary byte is the stream's restart flag
    /// ([`STREAM_RESTART`]): the receiver starts a new stream with it.
    pub const ZSTD_STREAM: u8 = 5;
    /// The dictionary byte of a [`ZSTD_STREAM`] packet whose bytes begin a
    /// new stream (a new zstd frame, perhaps at another level).
    pub const STREAM_RESTART: u8 = 1;
    /// The largest window a [`ZSTD_STREAM`] stream may use, as a power of
    /// two (2 MiB): what a receiver keeps of each channel's history.
    pub const STREAM_WINDOW_LOG: u32 = 21;
    /// Whether a codec may name a [`crate::Dictionary`] in a packet.
    pub fn takes_dictionary(codec: u8) -> bool {
        codec == ZSTD || codec == ZSTD_PACKET
    }
    /// The dictionary a packet of `codec` with dictionary byte `byte`
    /// names: the byte for a codec that takes dictionaries, else 0 (the
    /// byte then means something else, [`STREAM_RESTART`], or nothing).
    pub fn named_dictionary(codec: u8, byte: u8) -> u8 {
        if takes_dictionary(codec) { byte } else { 0 }
    }
    /// Whether a packet of `codec` with dictionary byte `byte` begins a new
    /// channel stream ([`ZSTD_STREAM`] with [`STREAM_RESTART`]).
    pub fn restarts_stream(codec: u8, byte: u8) -> bool {
        codec == ZSTD_STREAM && byte == STREAM_RESTART
    }
    /// Whether a packet's compressed pages share one frame, carried by its
    /// first compressed entry ([`ZSTD_PACKET`], [`ZSTD_STREAM`]).
    pub fn one_frame_per_packet(codec: u8) -> bool {
        codec == ZSTD_PACKET || codec == ZSTD_STREAM
    }
}
/// Largest compression dictionary ([`Dictionary`]); the destination refuses
/// a longer one at its frame header, before reading the body.
pub const MAX_DICTIONARY_LEN: usize = 128 << 10;
/// Largest VMM configuration blob ([`VmmConfig`], announced by
/// [`SessionSetup::vmm_config_len`]); a destination may accept less.
pub const MAX_VMM_CONFIG_LEN: usize = 1 << 20;
/// Most dictionaries a session may announce ([`SessionSetup::dictionaries`]).
pub const MAX_DICTIONARIES: u8 = 8;
/// Most pages one packet may carry.
pub const MAX_PAGES_PER_PACKET: usize = 128;
/// Most page channels a session may use.
pub const MAX_CHANNELS: u16 = 64;
/// Most memory regions a session may describe.
pub const MAX_REGIONS: usize = 1024;
/// Largest region: page indices are 32-bit.
pub const MAX_REGION_BYTES: u64 = (u32::MAX as u64 + 1) * PAGE_SIZE as u64;
/// Longest state-section name, in bytes.
pub const MAX_NAME_LEN: usize = 255;
/// Longest guest-kind name in a [`SessionSetup`], in bytes.
pub const MAX_GUEST_KIND_LEN: usize = 64;
/// Largest state section.
pub const MAX_SECTION_BYTES: usize = 64 << 20;
/// Longest free-text message (abort reasons, outcome details).
pub const MAX_TEXT_LEN: usize = 4096;
/// Largest frame body of any kind.
pub const MAX_FRAME_BODY: usize = MAX_SECTION_BYTES + MAX_NAME_LEN + 16;

/// Length of an authentication nonce ([`AuthHello`], [`AuthChallenge`]).
pub const AUTH_NONCE_LEN: usize = 32;
/// Length of an authentication proof: an HMAC-SHA256 tag.
pub const AUTH_PROOF_LEN: usize = 32;
/// How often the destination sends a heartbeat during the live phase. A
/// protocol constant: the source counts heartbeats against its own clock.
pub const HEARTBEAT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Length of a [`FrameHeader`] on the wire.
pub const FRAME_HEADER_LEN: usize = 8;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Main-channel handshake with the session setup (source to destination).
    Hello = 1,
    /// Page-channel handshake (source to destination).
    ChannelHello = 2,
    /// Handshake accepted (destination to source).
    Welcome = 3,
    /// A packet of pages (source to destination, page channels).
    Pages = 4,
    /// End of a dirty iteration on this channel.
    Sync = 5,
    /// One device/vCPU state section (main channel).
    StateSection = 6,
    /// All memory and state sent, with the source's digest (main channel).
    Complete = 7,
    /// The destination's verdict (main channel).
    Outcome = 8,
    /// The sender gives up, with a reason (either direction).
    Abort = 9,
    /// The destination verified and restored the guest and waits for the
    /// source's [`FrameKind::Commit`] to resume it (main channel).
    Ready = 10,
    /// The source will never resume its guest: the destination may
    /// (main channel).
    Commit = 11,
    /// Liveness during the live phase (main channel, destination to source).
    Heartbeat = 12,
    /// A compression dictionary, after the welcome and before any page
    /// channel connects (main channel, source to destination).
    Dictionary = 13,
    /// The source VMM's opaque configuration, right after the hello and
    /// before the welcome, when the setup announces one (main channel,
    /// source to destination).
    VmmConfig = 14,
    /// The source switches to postcopy: the destination's stale pages
    /// (main channel, source to destination; see [`PostcopySwitch`]).
    PostcopySwitch = 15,
    /// Pages a destination guest thread waits on (main channel,
    /// destination to source, postcopy).
    PageRequest = 16,
    /// Requested pages, ahead of the background push (main channel,
    /// source to destination, postcopy).
    UrgentPages = 17,
    /// The destination holds every page, with its digest (main channel,
    /// destination to source, postcopy).
    PostcopyComplete = 18,
    /// The source's guest memory as files, their descriptors attached
    /// (main channel of a Unix socket, source to destination, same-host
    /// hand-over; see [`MemoryHandover`]).
    MemoryHandover = 19,
    /// A paused postcopy's source connects its main channel again
    /// (first frame of the connection, after the protections; see
    /// [`PostcopyResume`]).
    PostcopyResume = 20,
    /// The stale pages a paused postcopy's destination still lacks, after
    /// a [`FrameKind::PostcopyResume`] was welcomed (main channel,
    /// destination to source; see [`PostcopyMissing`]).
    PostcopyMissing = 21,
    /// The destination has applied every page of the first passes (main
    /// channel, destination to source, live phase; see [`PassApplied`]).
    /// Not 22: that is 0x16, the first byte of a TLS record, by which a
    /// destination without TLS recognises a TLS source.
    PassApplied = 23,
    /// Authentication, first on a channel when the sides share a key:
    /// the source's nonce, bound to a session and channel (source to
    /// destination). Numbered apart from the session's own kinds.
    AuthHello = 32,
    /// The destination's nonce and its proof of the key (destination to
    /// source).
    AuthChallenge = 33,
    /// The source's proof of the key (source to destination).
    AuthProof = 34,
}

impl FrameKind {
    fn from_u8(value: u8) -> Result<Self, WireError> {
        Ok(match value {
            1 => Self::Hello,
            2 => Self::ChannelHello,
            3 => Self::Welcome,
            4 => Self::Pages,
            5 => Self::Sync,
            6 => Self::StateSection,
            7 => Self::Complete,
            8 => Self::Outcome,
            9 => Self::Abort,
            10 => Self::Ready,
            11 => Self::Commit,
            12 => Self::Heartbeat,
            13 => Self::Dictionary,
            14 => Self::VmmConfig,
            15 => Self::PostcopySwitch,
            16 => Self::PageRequest,
            17 => Self::UrgentPages,
            18 => Self::PostcopyComplete,
            19 => Self::MemoryHandover,
            20 => Self::PostcopyResume,
            21 => Self::PostcopyMissing,
            23 => Self::PassApplied,
            32 => Self::AuthHello,
            33 => Self::AuthChallenge,
            34 => Self::AuthProof,
            other => return Err(WireError::UnknownFrameKind(other)),
        })
    }

    /// Largest body a frame of this kind may have.
    pub const fn max_body(self) -> usize {
        match self {
            Self::Hello => {
                32 + 2 + MAX_REGIONS * RegionInfo::ENCODED_LEN + 4 + MAX_GUEST_KIND_LEN + 1 + 4
            }
            Self::ChannelHello => Handshake::ENCODED_LEN,
            Self::Welcome => 16,
            Self::Pages => {
                PagesHeader::ENCODED_LEN
                    + MAX_PAGES_PER_PACKET * (PageEntry::ENCODED_LEN + PAGE_SIZE as usize)
            }
            Self::Sync => 8,
            Self::StateSection => MAX_FRAME_BODY,
            Self::Complete => 32,
            Self::Outcome => 32 + MAX_TEXT_LEN + OutcomeStats::MAX_ENCODED_LEN,
            Self::Abort => 8 + MAX_TEXT_LEN,
            Self::Ready => 16,
            Self::Commit | Self::Heartbeat | Self::PassApplied => 8,
            Self::Dictionary => Dictionary::HEADER_LEN + MAX_DICTIONARY_LEN,
            Self::VmmConfig => VmmConfig::HEADER_LEN + MAX_VMM_CONFIG_LEN,
            Self::AuthHello => Handshake::ENCODED_LEN + AUTH_NONCE_LEN,
            Self::AuthChallenge => AUTH_NONCE_LEN + AUTH_PROOF_LEN,
            Self::AuthProof => AUTH_PROOF_LEN,
            Self::PostcopySwitch
            | Self::PageRequest
            | Self::UrgentPages
            | Self::PostcopyComplete
            | Self::PostcopyResume
            | Self::PostcopyMissing => match postcopy::max_body(self) {
                Some(max) => max,
                None => 0,
            },
            Self::MemoryHandover => match handover::max_body(self) {
                Some(max) => max,
                None => 0,
            },
        }
    }
}

/// The 8 bytes in front of every frame body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the body holds.
    pub kind: FrameKind,
    /// Body length in bytes.
    pub body_len: u32,
}

impl FrameHeader {
    /// Encodes the header: kind, flags (zero), two reserved bytes, length.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut out = [0u8; FRAME_HEADER_LEN];
        out[0] = self.kind as u8;
        out[4..8].copy_from_slice(&self.body_len.to_le_bytes());
        out
    }

    /// Decodes and validates a header: known kind, no flag but
    /// [`FRAME_SEALED`] (and that not on a page packet), zero reserved
    /// bytes, and a body no longer than the kind allows. Whether a sealed
    /// frame is expected is the reader's decision ([`header_is_sealed`]).
    pub fn decode(bytes: &[u8; FRAME_HEADER_LEN]) -> Result<Self, WireError> {
        let kind = FrameKind::from_u8(bytes[0])?;
        let flags_allowed = if kind == FrameKind::Pages {
            0
        } else {
            FRAME_SEALED
        };
        if bytes[1] & !flags_allowed != 0 || bytes[2..4] != [0, 0] {
            return Err(WireError::ReservedNotZero("frame header"));
        }
        let body_len = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        let max = kind.max_body();
        if body_len as usize > max {
            return Err(WireError::FrameTooLong {
                kind,
                len: body_len as usize,
                max,
            });
        }
        Ok(Self { kind, body_len })
    }
}

/// One frame decoded by [`decode_stream`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// A control message.
    Message(Message),
    /// A page packet: its header and table (the payload is skipped).
    Pages(PagesHeader, Vec<PageEntry>),
}

/// Decodes a whole byte stream of frames with a [`FrameDecoder`]: control
/// messages are decoded; page packets are checked against `setup` (or
/// against the setup of a [`Hello`] earlier in the stream) and their payload
/// is skipped. Used by the fuzz target and by tests; the engine's receivers
/// drive the same decoder from their sockets.
pub fn decode_stream(
    mut bytes: &[u8],
    setup: Option<&SessionSetup>,
) -> Result<Vec<Frame>, WireError> {
    let mut decoder = match setup {
        Some(setup) => FrameDecoder::with_setup(setup.clone()),
        None => FrameDecoder::new(),
    };
    let mut frames = Vec::new();
    while let Some(decoded) = decoder.decode(&mut bytes)? {
        match decoded {
            Decoded::Event(Event::Message(message)) => frames.push(Frame::Message(message)),
            Decoded::Event(Event::Pages(packet)) => {
                frames.push(Frame::Pages(packet.header, decoder.entries().to_vec()));
            }
            Decoded::Payload { .. } => {}
        }
    }
    decoder.finish()?;
    Ok(frames)
}

#[cfg(test)]
mod dictionary_tests;
#[cfg(test)]
mod tests;

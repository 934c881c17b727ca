//! Protocol errors and abort reasons.

use crate::FrameKind;

/// Why a frame or message was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The frame kind byte names no known frame.
    #[error("Unknown frame kind {0}")]
    UnknownFrameKind(u8),
    /// A body is longer than its kind allows.
    #[error("{kind:?} frame of {len} bytes exceeds the limit of {max}")]
    FrameTooLong {
        /// Frame kind.
        kind: FrameKind,
        /// Announced length.
        len: usize,
        /// Limit for the kind.
        max: usize,
    },
    /// The input ended inside a structure.
    #[error("Truncated {0}")]
    Truncated(&'static str),
    /// Bytes were left after a complete structure.
    #[error("{extra} unexpected trailing bytes after {what}")]
    TrailingBytes {
        /// The structure.
        what: &'static str,
        /// How many bytes were left.
        extra: usize,
    },
    /// Reserved bytes were not zero.
    #[error("Reserved bytes are not zero in {0}")]
    ReservedNotZero(&'static str),
    /// The handshake did not start with tern's magic.
    #[error("Bad magic: this peer does not speak the tern migration protocol")]
    BadMagic,
    /// The peer speaks another protocol version.
    #[error("Protocol version {theirs} is not supported (this build speaks {ours})")]
    VersionMismatch {
        /// The peer's version.
        theirs: u16,
        /// Ours.
        ours: u16,
    },
    /// A length-prefixed field is too long.
    #[error("Field {field} of {len} bytes exceeds the limit of {max}")]
    FieldTooLong {
        /// The field.
        field: &'static str,
        /// Announced length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A string was not UTF-8.
    #[error("Field {0} is not valid UTF-8")]
    InvalidUtf8(&'static str),
    /// A field has a value the protocol does not allow.
    #[error("Invalid {field}: {detail}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// A page packet names a region the session does not have.
    #[error("Page packet names unknown region {0}")]
    UnknownRegion(u32),
    /// A page lies outside its region.
    #[error("Page {page} is outside region {region} of {pages} pages")]
    PageOutOfRange {
        /// Region id.
        region: u32,
        /// Page index.
        page: u32,
        /// Pages in the region.
        pages: u64,
    },
    /// The payload length does not match the page table.
    #[error("Page payload is {actual} bytes but the page table describes {expected}")]
    PayloadMismatch {
        /// Sum of the table's encoded lengths.
        expected: usize,
        /// Bytes the frame carries.
        actual: usize,
    },
    /// A message arrived where the protocol does not allow it.
    #[error("Unexpected {got:?} frame while waiting for {expected}")]
    Unexpected {
        /// What arrived.
        got: FrameKind,
        /// What was expected.
        expected: &'static str,
    },
    /// A control frame without a seal where every control frame must carry
    /// one (protocol version 7, a shared key).
    #[error(
        "an unauthenticated {0:?} frame where every control frame must carry the session's MAC: \
         forged or injected on the way"
    )]
    Unsealed(FrameKind),
    /// A sealed frame where no session key was agreed.
    #[error("a sealed {0:?} frame on a channel without a session key")]
    SealUnexpected(FrameKind),
    /// A sealed frame out of order.
    #[error(
        "control frame number {got} arrived where number {expected} was due: replayed, dropped \
         or reordered on the way"
    )]
    SealSequence {
        /// The frame's sequence number.
        got: u64,
        /// The one due.
        expected: u64,
    },
    /// A sealed frame whose MAC does not match.
    #[error(
        "a {0:?} frame failed its authentication (its MAC does not match the session key): \
         forged or altered on the way"
    )]
    SealForged(FrameKind),
}

/// Why a side aborted the migration, carried by [`crate::Abort`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum AbortReason {
    /// The operator or the embedding program cancelled.
    Cancelled = 1,
    /// The peer sent something invalid.
    ProtocolError = 2,
    /// The session setup cannot be accepted (regions, page size, channels).
    IncompatibleSetup = 3,
    /// The guest (VMM) reported an error.
    GuestError = 4,
    /// An I/O error on another channel.
    ChannelFailed = 5,
    /// The memory digests differ.
    DigestMismatch = 6,
    /// The iteration or time limit was reached with the cancel policy.
    LimitReached = 7,
    /// Anything else.
    Other = 99,
}

impl AbortReason {
    /// Decodes a reason code; unknown codes map to [`AbortReason::Other`] so
    /// that a newer peer's reason is still reported.
    pub fn from_u16(value: u16) -> Self {
        match value {
            1 => Self::Cancelled,
            2 => Self::ProtocolError,
            3 => Self::IncompatibleSetup,
            4 => Self::GuestError,
            5 => Self::ChannelFailed,
            6 => Self::DigestMismatch,
            7 => Self::LimitReached,
            _ => Self::Other,
        }
    }

    /// A short human-readable name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cancelled => "cancelled",
            Self::ProtocolError => "protocol error",
            Self::IncompatibleSetup => "incompatible setup",
            Self::GuestError => "guest error",
            Self::ChannelFailed => "channel failed",
            Self::DigestMismatch => "digest mismatch",
            Self::LimitReached => "limit reached",
            Self::Other => "other",
        }
    }
}

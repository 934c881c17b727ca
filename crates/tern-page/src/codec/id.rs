//! Codecs as the wire names them ([`CodecId`]) and as a user chooses them
//! ([`CodecChoice`]): names, wire bytes and level ranges, the same in every
//! build; whether this build has one is the registry's answer.

use std::fmt;
use std::str::FromStr;

use tern_wire::codec_id;

use super::error::CodecError;

/// A codec as the wire names it (a page packet's codec byte, a bit of the
/// hello's codec mask); the ids are the protocol's, [`tern_wire::codec_id`].
/// QPL is not here: it produces [`CodecId::Deflate`]'s format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
#[non_exhaustive]
pub enum CodecId {
    /// No compression.
    None = codec_id::NONE,
    /// zstd frames.
    Zstd = codec_id::ZSTD,
    /// Raw deflate, 4 KiB window (IAA-compatible).
    Deflate = codec_id::DEFLATE,
    /// lz4 block format.
    Lz4 = codec_id::LZ4,
    /// zstd, one frame for all compressed pages of a packet (ratio over
    /// independence: the pages of a packet decode together).
    ZstdPacket = codec_id::ZSTD_PACKET,
    /// zstd, one stream per page channel, flushed at each packet's end
    /// (ratio over independence: a packet decodes after the channel's
    /// earlier ones, in order).
    ZstdStream = codec_id::ZSTD_STREAM,
}

impl CodecId {
    /// Every wire codec.
    pub const ALL: [CodecId; 6] = [
        CodecId::None,
        CodecId::Zstd,
        CodecId::Deflate,
        CodecId::Lz4,
        CodecId::ZstdPacket,
        CodecId::ZstdStream,
    ];

    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            CodecId::None => "none",
            CodecId::Zstd => "zstd",
            CodecId::Deflate => "deflate",
            CodecId::Lz4 => "lz4",
            CodecId::ZstdPacket => "zstd-packet",
            CodecId::ZstdStream => "zstd-stream",
        }
    }

    /// Whether the codec is zstd, per page or per packet (the codecs that
    /// take a dictionary; a channel stream takes none: its window holds
    /// what the channel sent before).
    pub fn is_zstd(self) -> bool {
        matches!(self, CodecId::Zstd | CodecId::ZstdPacket)
    }

    /// Whether a compressor of this codec carries state from packet to
    /// packet, so that its packets must go on one channel in the order it
    /// made them ([`CodecId::ZstdStream`]).
    pub fn is_stream(self) -> bool {
        self == CodecId::ZstdStream
    }

    /// The wire byte.
    pub fn to_wire(self) -> u8 {
        self as u8
    }

    /// Parses the wire byte.
    pub fn from_wire(b: u8) -> Result<Self, CodecError> {
        match b {
            codec_id::NONE => Ok(CodecId::None),
            codec_id::ZSTD => Ok(CodecId::Zstd),
            codec_id::DEFLATE => Ok(CodecId::Deflate),
            codec_id::LZ4 => Ok(CodecId::Lz4),
            codec_id::ZSTD_PACKET => Ok(CodecId::ZstdPacket),
            codec_id::ZSTD_STREAM => Ok(CodecId::ZstdStream),
            other => Err(CodecError::UnknownCodecId(other)),
        }
    }

    /// Levels this build accepts for the codec; others are clamped.
    pub fn level_range(self) -> (i32, i32) {
        match self {
            CodecId::None => (0, 0),
            // Negative levels are zstd's "fast" levels.
            CodecId::Zstd | CodecId::ZstdPacket | CodecId::ZstdStream => ZSTD_LEVELS,
            // libdeflate: 0 is store-only (never shrinks), so start at 1.
            CodecId::Deflate => (1, 12),
            CodecId::Lz4 => (1, 1),
        }
    }

    /// Default level: the fast end, which is what live migration wants.
    pub fn default_level(self) -> i32 {
        match self {
            CodecId::None => 0,
            _ => 1,
        }
    }

    /// The level actually used when `requested` is asked for.
    /// zstd's 0 means its default, 3.
    pub fn clamp_level(self, requested: i32) -> i32 {
        if (self.is_zstd() || self.is_stream()) && requested == 0 {
            return ZSTD_DEFAULT_LEVEL;
        }
        let (lo, hi) = self.level_range();
        requested.clamp(lo, hi)
    }
}

/// libzstd's level range (`ZSTD_minCLevel()`, `ZSTD_maxCLevel()`), known
/// whether or not this build links libzstd; the zstd codec's tests check it
/// against the library.
pub(crate) const ZSTD_LEVELS: (i32, i32) = (-131_072, 22);

/// libzstd's default level (`ZSTD_CLEVEL_DEFAULT`), what level 0 asks for.
pub(crate) const ZSTD_DEFAULT_LEVEL: i32 = 3;

impl fmt::Display for CodecId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CodecId {
    type Err = CodecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "none" => Ok(CodecId::None),
            "zstd" => Ok(CodecId::Zstd),
            "deflate" => Ok(CodecId::Deflate),
            "lz4" => Ok(CodecId::Lz4),
            "zstd-packet" => Ok(CodecId::ZstdPacket),
            "zstd-stream" => Ok(CodecId::ZstdStream),
            _ => Err(CodecError::UnknownCodec(s.to_owned())),
        }
    }
}

/// What the user asked for on the command line (`--compression`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CodecChoice {
    /// No compression.
    None,
    /// zstd.
    Zstd,
    /// libdeflate raw deflate.
    Deflate,
    /// lz4.
    Lz4,
    /// Deflate through Intel QPL (IAA when present), same wire format as
    /// [`CodecChoice::Deflate`].
    Qpl,
    /// Chosen per iteration by [`AutoSelector`](super::AutoSelector).
    Auto,
}

impl CodecChoice {
    /// Every choice.
    pub const ALL: [CodecChoice; 6] = [
        CodecChoice::None,
        CodecChoice::Zstd,
        CodecChoice::Deflate,
        CodecChoice::Lz4,
        CodecChoice::Qpl,
        CodecChoice::Auto,
    ];

    /// Short lowercase name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            CodecChoice::None => "none",
            CodecChoice::Zstd => "zstd",
            CodecChoice::Deflate => "deflate",
            CodecChoice::Lz4 => "lz4",
            CodecChoice::Qpl => "qpl",
            CodecChoice::Auto => "auto",
        }
    }

    /// The wire codec, if fixed. `None` for auto, which may change between
    /// iterations: the wire names one codec per session, so the engine must
    /// either announce a per-packet codec or restrict auto to switching
    /// between the session's codec and raw pages (see `docs/compression.md`).
    pub fn wire(self) -> Option<CodecId> {
        match self {
            CodecChoice::None => Some(CodecId::None),
            CodecChoice::Zstd => Some(CodecId::Zstd),
            CodecChoice::Deflate | CodecChoice::Qpl => Some(CodecId::Deflate),
            CodecChoice::Lz4 => Some(CodecId::Lz4),
            CodecChoice::Auto => None,
        }
    }
}

impl fmt::Display for CodecChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CodecChoice {
    type Err = CodecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "none" => Ok(CodecChoice::None),
            "zstd" => Ok(CodecChoice::Zstd),
            "deflate" => Ok(CodecChoice::Deflate),
            "lz4" => Ok(CodecChoice::Lz4),
            "qpl" => Ok(CodecChoice::Qpl),
            "auto" => Ok(CodecChoice::Auto),
            "zlib" => Err(CodecError::Zlib),
            _ => Err(CodecError::UnknownCodec(s.to_owned())),
        }
    }
}

/// Which implementation did the work; statistics are kept per implementation
/// so QPL offload and software deflate can be compared even though they share
/// a wire format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CodecImpl {
    /// No compression: every page raw.
    None = 0,
    /// zstd.
    Zstd = 1,
    /// libdeflate, raw deflate.
    Deflate = 2,
    /// lz4 block format.
    Lz4 = 3,
    /// Intel QPL (IAA hardware or QPL's software path), deflate format.
    Qpl = 4,
    /// zstd, one frame per packet.
    ZstdPacket = 5,
    /// zstd, one stream per channel.
    ZstdStream = 6,
}

impl CodecImpl {
    /// Every implementation, in index order.
    pub const ALL: [CodecImpl; 7] = [
        CodecImpl::None,
        CodecImpl::Zstd,
        CodecImpl::Deflate,
        CodecImpl::Lz4,
        CodecImpl::Qpl,
        CodecImpl::ZstdPacket,
        CodecImpl::ZstdStream,
    ];

    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            CodecImpl::None => "none",
            CodecImpl::Zstd => "zstd",
            CodecImpl::Deflate => "deflate",
            CodecImpl::Lz4 => "lz4",
            CodecImpl::Qpl => "qpl",
            CodecImpl::ZstdPacket => "zstd-packet",
            CodecImpl::ZstdStream => "zstd-stream",
        }
    }

    /// The software implementation of a wire codec (QPL is the offload
    /// that also speaks deflate).
    pub fn software(codec: CodecId) -> CodecImpl {
        match codec {
            CodecId::None => CodecImpl::None,
            CodecId::Zstd => CodecImpl::Zstd,
            CodecId::Deflate => CodecImpl::Deflate,
            CodecId::Lz4 => CodecImpl::Lz4,
            CodecId::ZstdPacket => CodecImpl::ZstdPacket,
            CodecId::ZstdStream => CodecImpl::ZstdStream,
        }
    }

    /// The wire codec this implementation produces.
    pub fn wire(self) -> CodecId {
        match self {
            CodecImpl::None => CodecId::None,
            CodecImpl::Zstd => CodecId::Zstd,
            CodecImpl::Deflate | CodecImpl::Qpl => CodecId::Deflate,
            CodecImpl::Lz4 => CodecId::Lz4,
            CodecImpl::ZstdPacket => CodecId::ZstdPacket,
            CodecImpl::ZstdStream => CodecId::ZstdStream,
        }
    }
}

//! Control messages: handshakes, syncs, state sections, completion, aborts.

use crate::codec::{Reader, Writer};
use crate::error::{AbortReason, WireError};
use crate::handover::{self, MemoryHandover};
use crate::layout::{
    CompleteRecord, DictionaryRecord, HandshakeRecord, OutcomeRecord, RegionRecord, SetupRecord,
    SyncRecord, WelcomeRecord,
};
use crate::postcopy::{
    self, PageRequest, PostcopyComplete, PostcopyMissing, PostcopyResume, PostcopySwitch,
    UrgentPages,
};
use crate::{
    AUTH_NONCE_LEN, AUTH_PROOF_LEN, FRAME_HEADER_LEN, FrameHeader, FrameKind, MAGIC, MAX_CHANNELS,
    MAX_DICTIONARIES, MAX_DICTIONARY_LEN, MAX_GUEST_KIND_LEN, MAX_NAME_LEN, MAX_REGION_BYTES,
    MAX_REGIONS, MAX_SECTION_BYTES, MAX_TEXT_LEN, MAX_VMM_CONFIG_LEN, PAGE_SIZE, PROTOCOL_VERSION,
};

/// The part of the handshake every channel sends first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handshake {
    /// Random identifier of the migration; page channels must repeat the
    /// main channel's.
    pub session_id: u64,
    /// 0 for the main channel, 1..=channel_count for page channels.
    pub channel_index: u16,
}

impl Handshake {
    /// Encoded size: magic, version, channel index, reserved, session id.
    pub const ENCODED_LEN: usize = 24;

    fn encode(&self, w: &mut Writer<'_>) {
        w.record(&HandshakeRecord {
            magic: MAGIC,
            version: PROTOCOL_VERSION.into(),
            channel_index: self.channel_index.into(),
            reserved: [0; 4],
            session_id: self.session_id.into(),
        });
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let record: HandshakeRecord = r.record()?;
        if record.magic != MAGIC {
            return Err(WireError::BadMagic);
        }
        let version = record.version.get();
        if version != PROTOCOL_VERSION {
            return Err(WireError::VersionMismatch {
                theirs: version,
                ours: PROTOCOL_VERSION,
            });
        }
        r.check_reserved(&record.reserved)?;
        Ok(Self {
            session_id: record.session_id.get(),
            channel_index: record.channel_index.get(),
        })
    }

    /// Refuses a channel index outside `allowed`; `detail` says why.
    fn require_channel(
        self,
        allowed: std::ops::RangeInclusive<u16>,
        detail: impl FnOnce(u16) -> String,
    ) -> Result<Self, WireError> {
        if allowed.contains(&self.channel_index) {
            return Ok(self);
        }
        Err(WireError::InvalidField {
            field: "channel index",
            detail: detail(self.channel_index),
        })
    }
}

/// How memory digests are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum DigestAlgorithm {
    /// No verification: the destination resumes without comparing memory.
    None = 0,
    /// XXH3-128 over each region's id and the XXH3-64 of each of its pages.
    Xxh3Pages = 1,
}

impl DigestAlgorithm {
    fn from_u8(value: u8) -> Result<Self, WireError> {
        match value {
            0 => Ok(Self::None),
            1 => Ok(Self::Xxh3Pages),
            other => Err(WireError::InvalidField {
                field: "digest algorithm",
                detail: format!("unknown algorithm {other}"),
            }),
        }
    }
}

/// One memory region as both sides must agree on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionInfo {
    /// The VMM's region identifier.
    pub id: u32,
    /// Guest-physical start address.
    pub guest_addr: u64,
    /// Length in bytes.
    pub len: u64,
}

impl RegionInfo {
    /// Encoded size: id, reserved, guest address, length.
    pub const ENCODED_LEN: usize = 24;

    /// Number of pages.
    pub fn pages(&self) -> u64 {
        self.len / u64::from(PAGE_SIZE)
    }
}

/// What both sides agree on before any page moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionSetup {
    /// Page size in bytes.
    pub page_size: u32,
    /// Number of page channels (the main channel is not counted).
    pub channel_count: u16,
    /// Codecs the source may use, one bit per codec id (bit 1 = codec 1;
    /// ids are in [`crate::codec_id`]); 0 = no compression. Each page packet
    /// names the one it uses, so the source may switch between iterations.
    pub codecs: u8,
    /// How the final digest is computed.
    pub digest: DigestAlgorithm,
    /// The guest's memory regions.
    pub regions: Vec<RegionInfo>,
    /// What kind of guest the source sends, such as `"synthetic"`: the
    /// destination refuses a guest whose state sections it could not
    /// restore before any page moves. Printable ASCII, at most
    /// [`MAX_GUEST_KIND_LEN`] bytes; empty when the VMM does not say.
    pub guest_kind: String,
    /// How many [`Dictionary`] frames (ids 1..=this) the source sends on
    /// the main channel right after the welcome, at most
    /// [`MAX_DICTIONARIES`]; the destination expects exactly these and
    /// refuses any other. Non-zero only with a zstd codec announced.
    pub dictionaries: u8,
    /// Bytes of the source VMM's opaque configuration ([`VmmConfig`]) sent
    /// right after the hello, at most [`MAX_VMM_CONFIG_LEN`]; 0: none is
    /// sent. A destination refuses more than it accepts before reading it.
    pub vmm_config_len: u32,
}

impl SessionSetup {
    /// Looks a region up by id.
    pub fn region(&self, id: u32) -> Option<&RegionInfo> {
        self.regions.iter().find(|region| region.id == id)
    }

    /// Total guest memory in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.regions.iter().map(|region| region.len).sum()
    }

    /// Checks every rule the protocol imposes on a setup.
    pub fn validate(&self) -> Result<(), WireError> {
        let invalid = |field, detail: String| Err(WireError::InvalidField { field, detail });
        if self.page_size != PAGE_SIZE {
            return invalid(
                "page size",
                format!("{} (only {PAGE_SIZE} is supported)", self.page_size),
            );
        }
        if self.channel_count == 0 || self.channel_count > MAX_CHANNELS {
            return invalid(
                "channel count",
                format!("{} (must be 1..={MAX_CHANNELS})", self.channel_count),
            );
        }
        if self.regions.is_empty() || self.regions.len() > MAX_REGIONS {
            return invalid(
                "region count",
                format!("{} (must be 1..={MAX_REGIONS})", self.regions.len()),
            );
        }
        self.validate_regions()?;
        self.validate_guest_kind()?;
        if self.vmm_config_len as usize > MAX_VMM_CONFIG_LEN {
            return invalid(
                "vmm config length",
                format!(
                    "{} bytes (at most {MAX_VMM_CONFIG_LEN})",
                    self.vmm_config_len
                ),
            );
        }
        self.validate_dictionaries()
    }

    /// Each region's length and address, no two overlapping, no two ids
    /// alike.
    fn validate_regions(&self) -> Result<(), WireError> {
        let invalid = |field, detail: String| Err(WireError::InvalidField { field, detail });
        let mut spans = Vec::with_capacity(self.regions.len());
        for region in &self.regions {
            if region.len == 0
                || region.len % u64::from(PAGE_SIZE) != 0
                || region.len > MAX_REGION_BYTES
            {
                return invalid(
                    "region length",
                    format!(
                        "region {} has {} bytes (must be a non-zero multiple of {PAGE_SIZE}, at most {MAX_REGION_BYTES})",
                        region.id, region.len
                    ),
                );
            }
            let Some(end) = region.guest_addr.checked_add(region.len) else {
                return invalid(
                    "region address",
                    format!("region {} wraps around the address space", region.id),
                );
            };
            spans.push((region.guest_addr, end, region.id));
        }
        spans.sort_unstable();
        for pair in spans.windows(2) {
            if pair[1].0 < pair[0].1 {
                return invalid(
                    "region address",
                    format!("regions {} and {} overlap", pair[0].2, pair[1].2),
                );
            }
        }
        let mut ids: Vec<u32> = self.regions.iter().map(|region| region.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|pair| pair[0] == pair[1]) {
            return invalid("region id", "two regions share an id".to_string());
        }
        Ok(())
    }

    /// Short, printable text.
    fn validate_guest_kind(&self) -> Result<(), WireError> {
        if self.guest_kind.len() > MAX_GUEST_KIND_LEN {
            return Err(WireError::FieldTooLong {
                field: "guest kind",
                len: self.guest_kind.len(),
                max: MAX_GUEST_KIND_LEN,
            });
        }
        // Both sides print it in their errors, so it must be plain text.
        if !self
            .guest_kind
            .bytes()
            .all(|byte| byte.is_ascii_graphic() || byte == b' ')
        {
            return Err(WireError::InvalidField {
                field: "guest kind",
                detail: "must be printable ASCII".to_string(),
            });
        }
        Ok(())
    }

    fn validate_dictionaries(&self) -> Result<(), WireError> {
        if self.dictionaries > MAX_DICTIONARIES {
            return Err(WireError::InvalidField {
                field: "dictionaries",
                detail: format!("{} (at most {MAX_DICTIONARIES})", self.dictionaries),
            });
        }
        let zstd_announced = (0..8u8)
            .any(|id| self.codecs & (1 << id) != 0 && crate::codec_id::takes_dictionary(id));
        if self.dictionaries > 0 && !zstd_announced {
            return Err(WireError::InvalidField {
                field: "dictionaries",
                detail: "dictionaries announced without a codec that uses them".into(),
            });
        }
        Ok(())
    }
}

/// Main-channel handshake: who we are and what we are about to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Session and channel (index 0).
    pub handshake: Handshake,
    /// The session setup.
    pub setup: SessionSetup,
}

/// Page-channel handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelHello {
    /// Session and channel index (1..=channel_count).
    pub handshake: Handshake,
}

/// The destination accepts a channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Welcome {
    /// Echo of the session id.
    pub session_id: u64,
    /// Echo of the channel index.
    pub channel_index: u16,
}

/// A compression dictionary for the session's pages: packets name it by
/// `id` in their header. Sent on the main channel after the welcome, before
/// the page channels connect, as many as the setup announced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dictionary {
    /// 1..=[`SessionSetup::dictionaries`] (0 means "no dictionary" in a
    /// packet header).
    pub id: u8,
    /// The codec it is for (zstd: [`crate::codec_id::ZSTD`]).
    pub codec: u8,
    /// The dictionary, 1..=[`MAX_DICTIONARY_LEN`] bytes.
    pub data: Vec<u8>,
}

impl Dictionary {
    /// Bytes before the data: id, codec, two reserved, data length.
    pub const HEADER_LEN: usize = 8;
}

/// The source VMM's configuration, opaque to tern (Cloud Hypervisor's
/// `Config`): sent on the main channel right after the hello, before the
/// welcome, so that the destination builds its guest from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmmConfig {
    /// Exactly [`SessionSetup::vmm_config_len`] bytes.
    pub data: Vec<u8>,
}

impl VmmConfig {
    /// Bytes before the data: its length.
    pub const HEADER_LEN: usize = 4;
}

/// End of a dirty iteration on one page channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sync {
    /// The iteration that ends (0 = the first full pass).
    pub iteration: u32,
    /// Whether this is the final iteration, sent with the guest paused.
    pub last: bool,
    /// How many dictionaries (ids 1..=this) packets of the next iteration
    /// may name: every one the source has sent on the main channel, at
    /// most [`MAX_DICTIONARIES`]. It never decreases within a session.
    pub dictionaries: u8,
}

/// One saved device/vCPU state section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateSectionMsg {
    /// Section name.
    pub name: String,
    /// Layout version.
    pub version: u32,
    /// The state.
    pub data: Vec<u8>,
}

/// Everything has been sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Complete {
    /// The final iteration number (matches the last [`Sync`]).
    pub final_iteration: u32,
    /// How many state sections were sent.
    pub sections: u32,
    /// Digest of the source's memory.
    pub digest: u128,
}

/// The destination's verdict on the migration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Whether the destination's digest equals the source's and the guest
    /// was restored; the source stops its guest only then.
    pub verified: bool,
    /// The destination's digest.
    pub digest: u128,
    /// Explanation when not verified.
    pub detail: String,
    /// The destination's statistics (all zero when not verified).
    pub stats: OutcomeStats,
}

/// The destination's statistics, carried by its [`Outcome`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutcomeStats {
    /// Bytes read from the page channels (frame headers included).
    pub received_bytes: u64,
    /// Zero pages received.
    pub zero_pages: u64,
    /// Zero pages written over data received earlier.
    pub zero_pages_cleared: u64,
    /// Pages received with data.
    pub normal_pages: u64,
    /// Time spent computing the memory digest, in microseconds.
    pub digest_micros: u64,
    /// CPU time of the destination's main thread, in nanoseconds.
    pub main_cpu_nanos: u64,
    /// CPU time of each page channel's receiver thread, in channel order, in
    /// nanoseconds; at most [`MAX_CHANNELS`] entries.
    pub receiver_cpu_nanos: Vec<u64>,
}

impl OutcomeStats {
    /// Most bytes the statistics take in an outcome: six counters, the
    /// receiver count with reserved bytes, and one counter per channel.
    pub const MAX_ENCODED_LEN: usize = 6 * 8 + 8 + MAX_CHANNELS as usize * 8;

    fn encode(&self, w: &mut Writer<'_>) {
        w.u64(self.received_bytes)
            .u64(self.zero_pages)
            .u64(self.zero_pages_cleared)
            .u64(self.normal_pages)
            .u64(self.digest_micros)
            .u64(self.main_cpu_nanos);
        let count = self.receiver_cpu_nanos.len().min(usize::from(MAX_CHANNELS));
        w.u16(u16::try_from(count).unwrap_or(MAX_CHANNELS)).zeros(6);
        for &nanos in &self.receiver_cpu_nanos[..count] {
            w.u64(nanos);
        }
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let received_bytes = r.u64()?;
        let zero_pages = r.u64()?;
        let zero_pages_cleared = r.u64()?;
        let normal_pages = r.u64()?;
        let digest_micros = r.u64()?;
        let main_cpu_nanos = r.u64()?;
        let count = r.u16()?;
        r.reserved(6)?;
        if count > MAX_CHANNELS {
            return Err(WireError::FieldTooLong {
                field: "receiver CPU times",
                len: usize::from(count),
                max: usize::from(MAX_CHANNELS),
            });
        }
        let receiver_cpu_nanos = (0..count).map(|_| r.u64()).collect::<Result<_, _>>()?;
        Ok(Self {
            received_bytes,
            zero_pages,
            zero_pages_cleared,
            normal_pages,
            digest_micros,
            main_cpu_nanos,
            receiver_cpu_nanos,
        })
    }
}

/// The destination's answer to [`Complete`] when everything checked out:
/// memory verified, state restored, guest not yet resumed. It resumes the
/// guest only on [`Message::Commit`], so the guest never runs on both hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ready {
    /// The destination's digest (0 when the session does not verify).
    pub digest: u128,
}

/// What the destination measured of its own speed during the live phase,
/// carried by each heartbeat (version 10) so the source's downtime estimate
/// includes the destination's share of the switch-over. Advice only: the
/// source clamps both figures, and nothing is allocated from them. Zero
/// means "not measured yet".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveFigures {
    /// Pages per second the destination's receivers placed (decoded and
    /// written into guest memory) while busy, all receivers together, over
    /// the last heartbeat interval.
    pub placed_pages_per_sec: u32,
    /// Microseconds the destination expects to need after the last page
    /// to be ready and resumed (verification, state, resume), from what it
    /// measured of its own scheduling delay. Since version 13 without its
    /// lag behind the link, which each [`PassApplied`] carries instead.
    pub finish_micros: u32,
}

/// The destination has applied every page of the first `passes` dirty
/// passes: each of its receivers has passed those passes' syncs, so the
/// pages are in guest memory. Sent on the main channel during the live
/// phase each time the count grows (since version 12). The source pauses
/// its guest only when the destination is within one pass of what it sent
/// (issue 31: a destination two passes behind at the pause, its receivers
/// waiting for a CPU, broke the downtime limit with little unread).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassApplied {
    /// Passes applied, counting from the first (pass 0 applied: 1).
    pub passes: u32,
    /// How long after the last of the pass's bytes reached the destination
    /// (at the latest) its pages were all in memory, in microseconds
    /// (since version 13): the destination's lag behind the link at that
    /// pass's end, which the last pass would see again. Advice, clamped by
    /// the source like the heartbeat's figures.
    pub lag_micros: u32,
}

/// The sender gives up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Abort {
    /// Reason class.
    pub reason: AbortReason,
    /// Human-readable explanation.
    pub message: String,
}

/// The first message on a channel when the sides share a key: the
/// session and channel it is for, and the source's fresh nonce. Both sides'
/// proofs cover these, so a proof made for one channel or session is
/// worthless on another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthHello {
    /// Session and channel index (0 for the main channel).
    pub handshake: Handshake,
    /// The source's random nonce.
    pub nonce: [u8; AUTH_NONCE_LEN],
}

/// The destination's answer to an [`AuthHello`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthChallenge {
    /// The destination's random nonce.
    pub nonce: [u8; AUTH_NONCE_LEN],
    /// The destination's proof that it holds the key.
    pub proof: [u8; AUTH_PROOF_LEN],
}

/// The source's proof that it holds the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthProof {
    /// HMAC-SHA256 tag over both nonces, the session and the channel.
    pub proof: [u8; AUTH_PROOF_LEN],
}

/// A control message (everything except page packets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`ChannelHello`].
    ChannelHello(ChannelHello),
    /// See [`Welcome`].
    Welcome(Welcome),
    /// See [`Sync`].
    Sync(Sync),
    /// See [`StateSectionMsg`].
    StateSection(StateSectionMsg),
    /// See [`Complete`].
    Complete(Complete),
    /// See [`Outcome`].
    Outcome(Outcome),
    /// See [`Abort`].
    Abort(Abort),
    /// See [`Ready`].
    Ready(Ready),
    /// The source's answer to [`Ready`]: from now on it never resumes its
    /// guest by itself, and the destination resumes it; the destination
    /// acknowledges with its [`Outcome`].
    Commit,
    /// Sent by the destination about once a second while the live phase
    /// runs, so the source notices a destination that stopped or is cut off
    /// even when no connection reset ever arrives. Since version 10 it
    /// carries what the destination measured: [`LiveFigures`].
    Heartbeat(LiveFigures),
    /// See [`AuthHello`].
    AuthHello(AuthHello),
    /// See [`AuthChallenge`].
    AuthChallenge(AuthChallenge),
    /// See [`AuthProof`].
    AuthProof(AuthProof),
    /// See [`Dictionary`].
    Dictionary(Dictionary),
    /// See [`VmmConfig`].
    VmmConfig(VmmConfig),
    /// See [`PostcopySwitch`].
    PostcopySwitch(PostcopySwitch),
    /// See [`PageRequest`].
    PageRequest(PageRequest),
    /// See [`UrgentPages`].
    UrgentPages(UrgentPages),
    /// See [`PostcopyComplete`].
    PostcopyComplete(PostcopyComplete),
    /// See [`MemoryHandover`].
    MemoryHandover(MemoryHandover),
    /// See [`PostcopyResume`].
    PostcopyResume(PostcopyResume),
    /// See [`PostcopyMissing`].
    PostcopyMissing(PostcopyMissing),
    /// See [`PassApplied`].
    PassApplied(PassApplied),
}

impl Message {
    /// The frame kind this message travels in.
    pub fn kind(&self) -> FrameKind {
        match self {
            Self::Hello(_) => FrameKind::Hello,
            Self::ChannelHello(_) => FrameKind::ChannelHello,
            Self::Welcome(_) => FrameKind::Welcome,
            Self::Sync(_) => FrameKind::Sync,
            Self::StateSection(_) => FrameKind::StateSection,
            Self::Complete(_) => FrameKind::Complete,
            Self::Outcome(_) => FrameKind::Outcome,
            Self::Abort(_) => FrameKind::Abort,
            Self::Ready(_) => FrameKind::Ready,
            Self::Commit => FrameKind::Commit,
            Self::Heartbeat(_) => FrameKind::Heartbeat,
            Self::AuthHello(_) => FrameKind::AuthHello,
            Self::AuthChallenge(_) => FrameKind::AuthChallenge,
            Self::AuthProof(_) => FrameKind::AuthProof,
            Self::Dictionary(_) => FrameKind::Dictionary,
            Self::VmmConfig(_) => FrameKind::VmmConfig,
            Self::PostcopySwitch(_) => FrameKind::PostcopySwitch,
            Self::PageRequest(_) => FrameKind::PageRequest,
            Self::UrgentPages(_) => FrameKind::UrgentPages,
            Self::PostcopyComplete(_) => FrameKind::PostcopyComplete,
            Self::MemoryHandover(_) => FrameKind::MemoryHandover,
            Self::PostcopyResume(_) => FrameKind::PostcopyResume,
            Self::PostcopyMissing(_) => FrameKind::PostcopyMissing,
            Self::PassApplied(_) => FrameKind::PassApplied,
        }
    }

    /// Appends the frame header and body to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0; FRAME_HEADER_LEN]);
        self.encode_body(&mut Writer::new(out));
        let body_len = u32::try_from(out.len() - start - FRAME_HEADER_LEN).unwrap_or(u32::MAX);
        let header = FrameHeader {
            kind: self.kind(),
            body_len,
        };
        out[start..start + FRAME_HEADER_LEN].copy_from_slice(&header.encode());
    }

    fn encode_body(&self, w: &mut Writer<'_>) {
        match self {
            Self::Hello(hello) => {
                hello.handshake.encode(w);
                hello.setup.encode(w);
            }
            Self::ChannelHello(hello) => hello.handshake.encode(w),
            Self::Welcome(welcome) => welcome.encode(w),
            Self::Sync(sync) => sync.encode(w),
            Self::StateSection(section) => section.encode(w),
            Self::Complete(complete) => complete.encode(w),
            Self::Outcome(outcome) => outcome.encode(w),
            Self::Abort(abort) => abort.encode(w),
            Self::Ready(ready) => {
                w.u128(ready.digest);
            }
            Self::Commit => {
                w.zeros(8);
            }
            Self::Heartbeat(figures) => {
                w.u32(figures.placed_pages_per_sec)
                    .u32(figures.finish_micros);
            }
            Self::AuthHello(hello) => {
                hello.handshake.encode(w);
                w.bytes(&hello.nonce);
            }
            Self::AuthChallenge(challenge) => {
                w.bytes(&challenge.nonce).bytes(&challenge.proof);
            }
            Self::AuthProof(proof) => {
                w.bytes(&proof.proof);
            }
            Self::Dictionary(dictionary) => dictionary.encode(w),
            Self::VmmConfig(config) => {
                w.bytes_u32(&config.data);
            }
            Self::PostcopySwitch(switch) => postcopy::encode_switch(switch, w),
            Self::PageRequest(request) => postcopy::encode_request(request, w),
            Self::UrgentPages(urgent) => postcopy::encode_urgent(urgent, w),
            Self::PostcopyComplete(complete) => postcopy::encode_complete(complete, w),
            Self::MemoryHandover(handover) => handover::encode(handover, w),
            Self::PostcopyResume(resume) => resume.handshake.encode(w),
            Self::PostcopyMissing(missing) => postcopy::encode_missing(missing, w),
            Self::PassApplied(applied) => {
                w.u32(applied.passes).u32(applied.lag_micros);
            }
        }
    }

    /// Encodes into a fresh buffer.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Decodes and validates the body of a control frame of kind `kind`.
    pub fn decode(kind: FrameKind, body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body, kind_name(kind));
        let message = match kind {
            FrameKind::Hello => Self::Hello(Hello::decode(&mut r)?),
            FrameKind::ChannelHello => {
                let handshake = Handshake::decode(&mut r)?
                    .require_channel(1..=MAX_CHANNELS, |index| {
                        format!("page channel index {index} (must be 1..={MAX_CHANNELS})")
                    })?;
                Self::ChannelHello(ChannelHello { handshake })
            }
            FrameKind::Welcome => Self::Welcome(Welcome::decode(&mut r)?),
            FrameKind::Sync => Self::Sync(Sync::decode(&mut r)?),
            FrameKind::StateSection => Self::StateSection(StateSectionMsg::decode(&mut r)?),
            FrameKind::Complete => Self::Complete(Complete::decode(&mut r)?),
            FrameKind::Outcome => Self::Outcome(Outcome::decode(&mut r)?),
            FrameKind::Abort => Self::Abort(Abort::decode(&mut r)?),
            FrameKind::Ready => Self::Ready(Ready { digest: r.u128()? }),
            FrameKind::Commit => {
                r.reserved(8)?;
                Self::Commit
            }
            FrameKind::Heartbeat => Self::Heartbeat(LiveFigures {
                placed_pages_per_sec: r.u32()?,
                finish_micros: r.u32()?,
            }),
            FrameKind::AuthHello => {
                let handshake = Handshake::decode(&mut r)?
                    .require_channel(0..=MAX_CHANNELS, |index| {
                        format!("channel index {index} (must be 0..={MAX_CHANNELS})")
                    })?;
                Self::AuthHello(AuthHello {
                    handshake,
                    nonce: r.array()?,
                })
            }
            FrameKind::AuthChallenge => Self::AuthChallenge(AuthChallenge {
                nonce: r.array()?,
                proof: r.array()?,
            }),
            FrameKind::AuthProof => Self::AuthProof(AuthProof { proof: r.array()? }),
            FrameKind::Dictionary => Self::Dictionary(Dictionary::decode(&mut r)?),
            FrameKind::VmmConfig => Self::VmmConfig(VmmConfig {
                data: r.bytes_u32(MAX_VMM_CONFIG_LEN, "vmm config")?.to_vec(),
            }),
            FrameKind::PostcopySwitch => Self::PostcopySwitch(postcopy::decode_switch(&mut r)?),
            FrameKind::PageRequest => Self::PageRequest(postcopy::decode_request(&mut r)?),
            FrameKind::UrgentPages => Self::UrgentPages(postcopy::decode_urgent(&mut r)?),
            FrameKind::PostcopyComplete => {
                Self::PostcopyComplete(postcopy::decode_complete(&mut r)?)
            }
            FrameKind::MemoryHandover => Self::MemoryHandover(handover::decode(&mut r)?),
            FrameKind::PostcopyResume => {
                let handshake = Handshake::decode(&mut r)?.require_channel(0..=0, |index| {
                    format!("postcopy resume on channel {index} (must be the main channel, 0)")
                })?;
                Self::PostcopyResume(PostcopyResume { handshake })
            }
            FrameKind::PostcopyMissing => Self::PostcopyMissing(postcopy::decode_missing(&mut r)?),
            FrameKind::PassApplied => Self::PassApplied(PassApplied {
                passes: r.u32()?,
                lag_micros: r.u32()?,
            }),
            FrameKind::Pages => {
                return Err(WireError::Unexpected {
                    got: FrameKind::Pages,
                    expected: "a control message",
                });
            }
        };
        r.finish()?;
        Ok(message)
    }
}

/// A flag byte that must be 0 or 1.
fn flag(value: u8, field: &'static str, show: fn(u8) -> String) -> Result<bool, WireError> {
    match value {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(WireError::InvalidField {
            field,
            detail: show(other),
        }),
    }
}

impl Hello {
    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let handshake = Handshake::decode(r)?.require_channel(0..=0, |index| {
            format!("main-channel hello names channel {index}")
        })?;
        let setup = SessionSetup::decode(r)?;
        setup.validate()?;
        Ok(Self { handshake, setup })
    }
}

impl SessionSetup {
    fn encode(&self, w: &mut Writer<'_>) {
        w.record(&SetupRecord {
            page_size: self.page_size.into(),
            channel_count: self.channel_count.into(),
            codecs: self.codecs,
            digest: self.digest as u8,
            region_count: u16::try_from(self.regions.len()).unwrap_or(u16::MAX).into(),
        });
        for region in &self.regions {
            w.record(&RegionRecord {
                id: region.id.into(),
                reserved: [0; 4],
                guest_addr: region.guest_addr.into(),
                len: region.len.into(),
            });
        }
        w.bytes_u32(self.guest_kind.as_bytes());
        w.u8(self.dictionaries);
        w.u32(self.vmm_config_len);
    }

    /// The setup's fields as sent; [`SessionSetup::validate`] checks them.
    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let fixed: SetupRecord = r.record()?;
        if fixed.codecs & 1 != 0 {
            return Err(WireError::InvalidField {
                field: "codecs",
                detail: "bit 0 (no codec) must not be set".into(),
            });
        }
        let digest = DigestAlgorithm::from_u8(fixed.digest)?;
        let region_count = usize::from(fixed.region_count.get());
        if region_count > MAX_REGIONS {
            return Err(WireError::FieldTooLong {
                field: "regions",
                len: region_count,
                max: MAX_REGIONS,
            });
        }
        let mut regions = Vec::with_capacity(region_count);
        for _ in 0..region_count {
            let region: RegionRecord = r.record()?;
            r.check_reserved(&region.reserved)?;
            regions.push(RegionInfo {
                id: region.id.get(),
                guest_addr: region.guest_addr.get(),
                len: region.len.get(),
            });
        }
        Ok(Self {
            page_size: fixed.page_size.get(),
            channel_count: fixed.channel_count.get(),
            codecs: fixed.codecs,
            digest,
            regions,
            guest_kind: r.string(MAX_GUEST_KIND_LEN, "guest kind")?,
            dictionaries: r.u8()?,
            vmm_config_len: r.u32()?,
        })
    }
}

impl Welcome {
    fn encode(&self, w: &mut Writer<'_>) {
        w.record(&WelcomeRecord {
            session_id: self.session_id.into(),
            channel_index: self.channel_index.into(),
            reserved: [0; 6],
        });
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let record: WelcomeRecord = r.record()?;
        r.check_reserved(&record.reserved)?;
        Ok(Self {
            session_id: record.session_id.get(),
            channel_index: record.channel_index.get(),
        })
    }
}

impl Sync {
    fn encode(&self, w: &mut Writer<'_>) {
        w.record(&SyncRecord {
            iteration: self.iteration.into(),
            last: u8::from(self.last),
            dictionaries: self.dictionaries,
            reserved: [0; 2],
        });
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let record: SyncRecord = r.record()?;
        let last = flag(record.last, "sync flags", |other| format!("{other:#x}"))?;
        let dictionaries = record.dictionaries;
        if dictionaries > MAX_DICTIONARIES {
            return Err(WireError::InvalidField {
                field: "sync dictionaries",
                detail: format!("{dictionaries} (at most {MAX_DICTIONARIES})"),
            });
        }
        r.check_reserved(&record.reserved)?;
        Ok(Self {
            iteration: record.iteration.get(),
            last,
            dictionaries,
        })
    }
}

impl StateSectionMsg {
    fn encode(&self, w: &mut Writer<'_>) {
        w.u32(self.version)
            .bytes_u32(self.name.as_bytes())
            .bytes_u32(&self.data);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let version = r.u32()?;
        let name = r.string(MAX_NAME_LEN, "section name")?;
        if name.is_empty() {
            return Err(WireError::InvalidField {
                field: "section name",
                detail: "empty".to_string(),
            });
        }
        let data = r.bytes_u32(MAX_SECTION_BYTES, "section data")?.to_vec();
        Ok(Self {
            name,
            version,
            data,
        })
    }
}

impl Complete {
    fn encode(&self, w: &mut Writer<'_>) {
        w.record(&CompleteRecord {
            final_iteration: self.final_iteration.into(),
            sections: self.sections.into(),
            reserved: [0; 8],
            digest: self.digest.into(),
        });
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let record: CompleteRecord = r.record()?;
        r.check_reserved(&record.reserved)?;
        Ok(Self {
            final_iteration: record.final_iteration.get(),
            sections: record.sections.get(),
            digest: record.digest.get(),
        })
    }
}

impl Outcome {
    fn encode(&self, w: &mut Writer<'_>) {
        w.record(&OutcomeRecord {
            verified: u8::from(self.verified),
            reserved: [0; 7],
            digest: self.digest.into(),
        })
        .bytes_u32(self.detail.as_bytes());
        self.stats.encode(w);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let record: OutcomeRecord = r.record()?;
        let verified = flag(record.verified, "verified flag", |other| format!("{other}"))?;
        r.check_reserved(&record.reserved)?;
        Ok(Self {
            verified,
            digest: record.digest.get(),
            detail: r.peer_text(MAX_TEXT_LEN, "outcome detail")?,
            stats: OutcomeStats::decode(r)?,
        })
    }
}

impl Abort {
    fn encode(&self, w: &mut Writer<'_>) {
        w.u16(self.reason as u16)
            .zeros(2)
            .bytes_u32(self.message.as_bytes());
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let reason = AbortReason::from_u16(r.u16()?);
        r.reserved(2)?;
        let message = r.peer_text(MAX_TEXT_LEN, "abort message")?;
        Ok(Self { reason, message })
    }
}

fn kind_name(kind: FrameKind) -> &'static str {
    match kind {
        FrameKind::Hello => "hello",
        FrameKind::ChannelHello => "channel hello",
        FrameKind::Welcome => "welcome",
        FrameKind::Pages => "pages",
        FrameKind::Sync => "sync",
        FrameKind::StateSection => "state section",
        FrameKind::Complete => "complete",
        FrameKind::Outcome => "outcome",
        FrameKind::Abort => "abort",
        FrameKind::Ready => "ready",
        FrameKind::Commit => "commit",
        FrameKind::Heartbeat => "heartbeat",
        FrameKind::AuthHello => "auth hello",
        FrameKind::AuthChallenge => "auth challenge",
        FrameKind::AuthProof => "auth proof",
        FrameKind::Dictionary => "dictionary",
        FrameKind::VmmConfig => "vmm config",
        FrameKind::PostcopySwitch => "postcopy switch",
        FrameKind::PageRequest => "page request",
        FrameKind::UrgentPages => "urgent pages",
        FrameKind::PostcopyComplete => "postcopy complete",
        FrameKind::MemoryHandover => "memory hand-over",
        FrameKind::PostcopyResume => "postcopy resume",
        FrameKind::PostcopyMissing => "postcopy missing pages",
        FrameKind::PassApplied => "pass applied",
    }
}

impl Dictionary {
    fn encode(&self, w: &mut Writer<'_>) {
        w.record(&DictionaryRecord {
            id: self.id,
            codec: self.codec,
            reserved: [0; 2],
        })
        .bytes_u32(&self.data);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let DictionaryRecord {
            id,
            codec,
            reserved,
        } = r.record()?;
        r.check_reserved(&reserved)?;
        let data = r.bytes_u32(MAX_DICTIONARY_LEN, "dictionary")?.to_vec();
        if id == 0 || id > MAX_DICTIONARIES {
            return Err(WireError::InvalidField {
                field: "dictionary id",
                detail: format!("{id} (must be 1..={MAX_DICTIONARIES})"),
            });
        }
        if codec != crate::codec_id::ZSTD {
            return Err(WireError::InvalidField {
                field: "dictionary codec",
                detail: format!("codec {codec} takes no dictionary"),
            });
        }
        if data.is_empty() {
            return Err(WireError::InvalidField {
                field: "dictionary",
                detail: "empty".into(),
            });
        }
        Ok(Self { id, codec, data })
    }
}

//! Migration settings.

use std::sync::Arc;
use std::time::Duration;

use tern_page::codec::{CodecChoice, QplPath};
use tern_page::{DeltaOffload, ZeroPageOffload};

use crate::error::MigrationError;
use crate::transport::Address;
use crate::transport::security::Security;

/// A name that is none of an enum's values (the `FromStr` error of the
/// config enums).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not a known value")]
#[non_exhaustive]
pub struct UnknownName(pub String);

impl UnknownName {
    fn new(text: &str) -> Self {
        Self(text.to_string())
    }
}

/// `as_str`: the name on the command line and in statistics, from the
/// enum's `strum` names.
macro_rules! named {
    ($($name:ident),*) => {$(
        impl $name {
            /// The name used on the command line and in statistics.
            pub fn as_str(self) -> &'static str {
                self.into()
            }
        }
    )*};
}

named!(ZeroPageDetection, LimitPolicy, Verify, ZeroCopyBackend);

/// Who looks for zero pages.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = UnknownName,
    parse_err_fn = UnknownName::new
)]
#[non_exhaustive]
pub enum ZeroPageDetection {
    /// Nobody: every page is sent with its data.
    None,
    /// The producer thread, before pages reach the workers (QEMU's legacy
    /// mode; a bottleneck kept for comparison).
    #[strum(to_string = "source", serialize = "legacy")]
    Source,
    /// The channel workers, in parallel (QEMU's multifd mode).
    #[default]
    #[strum(to_string = "workers", serialize = "multifd")]
    Workers,
    /// The workers hand batches to Intel DSA (or a software stand-in) and
    /// finish on the CPU what the device cannot.
    Dsa,
}

/// What to do when the iteration or time limit is reached before the
/// remaining dirty memory fits in the downtime limit.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
#[strum(
    serialize_all = "kebab-case",
    parse_err_ty = UnknownName,
    parse_err_fn = UnknownName::new
)]
#[non_exhaustive]
pub enum LimitPolicy {
    /// Give up; the source guest runs on.
    #[default]
    Cancel,
    /// Switch over anyway, accepting a longer downtime.
    SwitchOver,
}

/// Whether the session's zstd dictionary is trained again during the live
/// phase when the pages sent stop resembling what it was trained on
/// (docs/compression.md, "Refresh").
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
#[strum(
    serialize_all = "kebab-case",
    parse_err_ty = UnknownName,
    parse_err_fn = UnknownName::new
)]
#[non_exhaustive]
pub enum DictionaryRefresh {
    /// Never: the setup's dictionary serves the whole session.
    Off,
    /// On a background thread; the workers keep the dictionary in force
    /// until the new one is announced at an iteration boundary.
    #[default]
    Background,
    /// At the iteration boundary itself, holding the next iteration until
    /// training ends: the refresh happens at a known iteration (tests).
    AtBoundary,
}

/// Whether the destination's memory is compared with the source's before
/// the guest resumes there.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = UnknownName,
    parse_err_fn = UnknownName::new
)]
#[non_exhaustive]
pub enum Verify {
    /// Both sides keep a hash of every page up to date while the guest
    /// runs (the source as it sends a page, the destination as it writes
    /// one, and an audit on each side for changes nobody reported), and
    /// compare the digest of all memory before the destination resumes (see
    /// docs/verification.md). A mismatch fails the migration and the source
    /// guest runs on.
    #[default]
    Full,
    /// As [`Verify::Full`], and the source hashes all of its memory again
    /// while paused, so a write its dirty log forgot is always found, not
    /// only when an audit reads the page in time; costs the time to hash
    /// all memory (spread over the digest threads) in the downtime, which
    /// the convergence estimate counts.
    Strict,
    /// No digest: the shortest downtime, trusting the dirty log.
    None,
}

impl Verify {
    /// Whether the destination's memory is compared with the source's.
    pub fn compares(self) -> bool {
        self != Self::None
    }
}

/// How zero-copy sends are made.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = UnknownName,
    parse_err_fn = UnknownName::new
)]
#[non_exhaustive]
pub enum ZeroCopyBackend {
    /// `sendmsg(MSG_ZEROCOPY)` with completions read from the error queue.
    #[default]
    Msg,
    /// io_uring `SENDMSG_ZC` (Linux 6.2 or later).
    Uring,
}

/// Source-side settings.
///
/// `#[non_exhaustive]`, so that settings can be added in a minor release:
/// start from [`MigrationConfig::default()`] and set fields, or chain the
/// setters of the same names (quinn-proto's style):
///
/// ```
/// let mut config = tern_engine::MigrationConfig::default();
/// config.channels(4).auto_converge(false);
/// config.max_bandwidth = Some(1 << 30);
/// assert_eq!((config.channels, config.auto_converge), (4, false));
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct MigrationConfig {
    /// Number of page channels (the main channel comes on top).
    pub channels: u16,
    /// Number of worker threads classifying and encoding pages; 0 = one per
    /// channel.
    pub workers: usize,
    /// Largest acceptable downtime; the switch-over waits until the
    /// remaining dirty memory can be sent within it.
    pub downtime_limit: Duration,
    /// Cap on the bytes per second written to all channels together.
    pub max_bandwidth: Option<u64>,
    /// Most dirty iterations before the limit policy applies.
    pub max_iterations: Option<u32>,
    /// Longest live phase before the limit policy applies.
    pub max_time: Option<Duration>,
    /// What happens at a limit.
    pub limit_policy: LimitPolicy,
    /// Throttle the guest when it dirties memory faster than we send it.
    pub auto_converge: bool,
    /// Throttle applied the first time auto-converge steps in (percent).
    pub throttle_initial: u8,
    /// Throttle added each further time (percent).
    pub throttle_increment: u8,
    /// Zero-page detection mode.
    pub zero_page_detection: ZeroPageDetection,
    /// The offload used in `dsa` mode; `None` opens the DSA work queues
    /// found in sysfs (an error when there are none, or when tern-engine was
    /// built without its `dsa` feature). Any [`ZeroPageOffload`] will do:
    /// `tern_dsa::software_dsa`, say, or an embedder's own.
    pub zero_page_offload: Option<Arc<dyn ZeroPageOffload>>,
    /// Benchmark knob, not part of the stable API: the share (0.0..=1.0) of
    /// zero pages sent as normal pages, to load the network with a known
    /// amount of data (as the DSA series' benchmarks do).
    #[doc(hidden)]
    pub zero_page_as_normal: f64,
    /// Page compression.
    pub compression: CodecChoice,
    /// Compression level; `None` is the codec's default (fast) level.
    pub compression_level: Option<i32>,
    /// QPL path for `CodecChoice::Qpl`.
    pub qpl_path: QplPath,
    /// Send a page whose bytes the destination already holds (in another
    /// page) as a reference to that page (see docs/protocol.md). Not with
    /// zero-copy, whose sends must come from guest memory.
    pub dedup: bool,
    /// Bytes of the cache of pages as last sent, against which re-sent
    /// pages go as deltas (QEMU's xbzrle-cache-size); 0 turns deltas off.
    /// Not with zero-copy.
    pub delta_cache_size: u64,
    /// Where delta records are created: a DSA queue or the software DSA
    /// device (`tern_dsa::DsaDeltaOffload`: create-delta-record
    /// descriptors, the CPU as fallback), or any other [`DeltaOffload`];
    /// `None` is the CPU.
    pub delta_offload: Option<Arc<dyn DeltaOffload>>,
    /// Train a zstd dictionary of at most this many bytes on sampled guest
    /// pages at setup and compress every zstd page against it (pages stay
    /// independent); `None`: no dictionary. Only with zstd or `auto`.
    pub compression_dictionary: Option<usize>,
    /// Whether that dictionary is trained again, on the pages being sent,
    /// when its ratio drops (only with `compression_dictionary`).
    pub dictionary_refresh: DictionaryRefresh,
    /// zstd with all compressible pages of a packet in one frame (ratio over
    /// independence). Only with zstd; `auto` weighs both framings itself.
    pub packet_frames: bool,
    /// zstd as one stream per page channel, flushed at each packet's end:
    /// a packet's matches reach back over what its channel sent before
    /// (QEMU's multifd zstd), and a channel's packets decode in order on
    /// its receiver. Only with zstd, without packet frames or a
    /// dictionary; `auto` uses it as its zstd framing for whole packets.
    pub stream_frames: bool,
    /// With `compression: Auto` and no `compression_dictionary`: auto
    /// decides the session's zstd dictionary itself: trained in the
    /// background once the measured link has it keep per-page zstd, in use
    /// once it pays on pages the training did not see; none with its zstd
    /// stream per channel, nor with `dictionary_refresh` off. See
    /// docs/compression.md, "Auto".
    pub auto_dictionary: bool,
    /// With `compression: Auto` and `delta_cache_size` 0: the most memory
    /// auto may give the delta cache, which it sizes from the pages the
    /// guest dirties again; `None`: half of guest memory, at most
    /// [`DEFAULT_DELTA_CACHE_ALLOWANCE_MAX`]; `Some(0)`: no delta cache.
    pub delta_cache_allowance: Option<u64>,
    /// Memory verification at switch-over.
    pub verify: Verify,
    /// Threads hashing again, while the guest is paused, the pages whose
    /// hash went stale (see docs/verification.md); 0 uses every core.
    /// Usually there are few such pages and one thread is as fast.
    pub digest_threads: usize,
    /// Send page data with zero-copy sends straight from guest memory.
    pub zero_copy: bool,
    /// Which zero-copy mechanism (measured to a tie on loopback; see
    /// docs/zero-copy.md).
    pub zero_copy_backend: ZeroCopyBackend,
    /// Bytes each zero-copy channel may keep pinned in flight; 0 picks a
    /// window that fits `RLIMIT_MEMLOCK` (or 16 MiB with `CAP_IPC_LOCK`).
    pub zero_copy_window: usize,
    /// Timeout of any single blocking send or receive.
    pub io_timeout: Duration,
    /// How long to keep trying to reach the destination.
    pub connect_timeout: Duration,
    /// How long the destination has to answer each channel's handshake
    /// (the welcome, or the key exchange's challenge): a peer silent that
    /// long is reported as not a tern destination.
    pub handshake_timeout: Duration,
    /// How long the paused source waits for each of the destination's
    /// switch-over answers: "ready" after the last bytes were sent (without
    /// it, the source resumes its guest), then the acknowledgement of its
    /// commit (without it, the outcome is reported unknown and the guest
    /// stays paused).
    pub switch_over_timeout: Duration,
    /// TLS and the shared-key handshake on every channel.
    pub security: Security,
    /// The VMM's own configuration, opaque to tern, sent before any memory
    /// and given to the destination's setup callback
    /// (`Destination::receive_with_vmm_config`); at most
    /// `tern_wire::MAX_VMM_CONFIG_LEN` bytes; empty: none is sent.
    pub vmm_config: Vec<u8>,
    // Postcopy (docs/postcopy.md).
    /// When precopy hands over to postcopy; `Off` by default.
    pub postcopy: crate::postcopy::PostcopyMode,
    /// With `postcopy` `OnRequest`: start postcopy this long after the live
    /// phase began even without a request; `None`: only on request.
    pub postcopy_after: Option<Duration>,
    /// With `postcopy` `Auto`: the highest auto-converge throttle (percent)
    /// precopy may set; where it would throttle more, postcopy starts.
    pub postcopy_max_throttle: u8,
    /// After the point of no return, how long the source keeps
    /// reconnecting to a destination whose channels broke (backoff from
    /// 50 ms to 1 s) before it stays `postcopy-paused` for the operator
    /// (`MigrationHandle::resume_postcopy`, `migrate` with `resume=true`).
    /// It never gives the guest up by itself (docs/postcopy.md,
    /// "Recovery").
    pub postcopy_recover_timeout: Duration,
    /// Same-host migration by memory hand-over: instead of copying pages,
    /// pass the files backing guest memory ([`crate::GuestMemory::region_files`])
    /// over the main channel, a Unix socket, and send only the device state
    /// while the guest is paused (docs/embedding.md, "Same-host
    /// hand-over"). The destination receives with
    /// [`crate::Destination::receive_handover`]. Off by default.
    pub memory_handover: bool,
}

/// The most memory `auto` gives a delta cache without
/// `delta_cache_allowance` (it also stays within half of guest memory).
pub const DEFAULT_DELTA_CACHE_ALLOWANCE_MAX: u64 = 2 << 30;

/// Default of both sides' `switch_over_timeout`: the destination checks and
/// restores in milliseconds, and a guest paused this long is already an
/// outage worth reporting.
pub const DEFAULT_SWITCH_OVER_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for MigrationConfig {
    fn default() -> Self {
        Self {
            channels: 2,
            workers: 0,
            downtime_limit: Duration::from_millis(300),
            max_bandwidth: None,
            max_iterations: None,
            max_time: None,
            limit_policy: LimitPolicy::Cancel,
            auto_converge: true,
            throttle_initial: 20,
            throttle_increment: 10,
            zero_page_detection: ZeroPageDetection::Workers,
            zero_page_offload: None,
            zero_page_as_normal: 0.0,
            compression: CodecChoice::None,
            compression_level: None,
            qpl_path: QplPath::Auto,
            dedup: true,
            delta_cache_size: 0,
            delta_offload: None,
            compression_dictionary: None,
            dictionary_refresh: DictionaryRefresh::default(),
            packet_frames: false,
            stream_frames: false,
            auto_dictionary: true,
            delta_cache_allowance: None,
            verify: Verify::Full,
            digest_threads: 0,
            zero_copy: false,
            zero_copy_backend: ZeroCopyBackend::Msg,
            zero_copy_window: 0,
            io_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            security: Security::default(),
            vmm_config: Vec::new(),
            switch_over_timeout: DEFAULT_SWITCH_OVER_TIMEOUT,
            postcopy: crate::postcopy::PostcopyMode::Off,
            postcopy_after: None,
            postcopy_max_throttle: 0,
            postcopy_recover_timeout: Duration::from_secs(60),
            memory_handover: false,
        }
    }
}

/// Chained setters, one per public field: `config.channels(4).verify(..)`
/// sets the fields of the same names and returns the config again.
macro_rules! setters {
    ($config:ident { $($field:ident: $type:ty),* $(,)? }) => {
        impl $config {
            $(
                #[doc = concat!("Sets `", stringify!($field), "`; returns the config for chaining.")]
                pub fn $field(&mut self, value: $type) -> &mut Self {
                    self.$field = value;
                    self
                }
            )*
        }
    };
}

setters!(MigrationConfig {
    channels: u16,
    workers: usize,
    downtime_limit: Duration,
    max_bandwidth: Option<u64>,
    max_iterations: Option<u32>,
    max_time: Option<Duration>,
    limit_policy: LimitPolicy,
    auto_converge: bool,
    throttle_initial: u8,
    throttle_increment: u8,
    zero_page_detection: ZeroPageDetection,
    zero_page_offload: Option<Arc<dyn ZeroPageOffload>>,
    zero_page_as_normal: f64,
    compression: CodecChoice,
    compression_level: Option<i32>,
    qpl_path: QplPath,
    dedup: bool,
    delta_cache_size: u64,
    delta_offload: Option<Arc<dyn DeltaOffload>>,
    compression_dictionary: Option<usize>,
    dictionary_refresh: DictionaryRefresh,
    packet_frames: bool,
    stream_frames: bool,
    verify: Verify,
    digest_threads: usize,
    zero_copy: bool,
    zero_copy_backend: ZeroCopyBackend,
    zero_copy_window: usize,
    io_timeout: Duration,
    connect_timeout: Duration,
    handshake_timeout: Duration,
    switch_over_timeout: Duration,
    security: Security,
    vmm_config: Vec<u8>,
    memory_handover: bool,
});

// `decode_threads` has no setter: `ReceiveConfig::decode_threads()` is the
// count in force (the field's `None` resolved); set the field.
setters!(ReceiveConfig {
    accept_timeout: Duration,
    io_timeout: Duration,
    handshake_timeout: Duration,
    max_pending_handshakes: usize,
    max_memory: Option<u64>,
    qpl_path: QplPath,
    switch_over_timeout: Duration,
    security: Security,
    unauthenticated: UnauthenticatedPolicy,
    allow_unverified: bool,
    keep_paused: bool,
    max_vmm_config: usize,
});

impl MigrationConfig {
    /// Worker threads actually used.
    pub fn worker_count(&self) -> usize {
        if self.workers == 0 {
            usize::from(self.channels)
        } else {
            self.workers
        }
    }

    /// Threads actually used to hash guest memory.
    pub fn digest_thread_count(&self) -> usize {
        if self.digest_threads == 0 {
            crate::digest::digest_threads()
        } else {
            self.digest_threads
        }
    }

    /// Rejects unusable values up front, naming the field.
    pub fn validate(&self) -> Result<(), MigrationError> {
        let bad = |field: &'static str, reason: String| {
            Err(MigrationError::InvalidConfig { field, reason })
        };
        if self.vmm_config.len() > tern_wire::MAX_VMM_CONFIG_LEN {
            return bad(
                "vmm_config",
                format!(
                    "{} bytes (at most {})",
                    self.vmm_config.len(),
                    tern_wire::MAX_VMM_CONFIG_LEN
                ),
            );
        }
        if self.channels == 0 || self.channels > tern_wire::MAX_CHANNELS {
            return bad(
                "channels",
                format!(
                    "{} is out of range (1..={})",
                    self.channels,
                    tern_wire::MAX_CHANNELS
                ),
            );
        }
        if self.worker_count() > 256 {
            return bad(
                "workers",
                format!("{} is too many (at most 256)", self.workers),
            );
        }
        if self.downtime_limit.is_zero() {
            return bad("downtime_limit", "must be positive".into());
        }
        if self.max_bandwidth == Some(0) {
            return bad("max_bandwidth", "must be positive".into());
        }
        if self.max_iterations == Some(0) {
            return bad("max_iterations", "must be at least 1".into());
        }
        if self.throttle_initial > 99 {
            return bad("throttle_initial", "a percentage of at most 99".into());
        }
        if self.throttle_increment > 99 {
            return bad("throttle_increment", "a percentage of at most 99".into());
        }
        if self.io_timeout.is_zero() {
            return bad("io_timeout", "must be positive".into());
        }
        if self.switch_over_timeout.is_zero() {
            return bad("switch_over_timeout", "must be positive".into());
        }
        if self.postcopy_max_throttle > 99 {
            return bad("postcopy_max_throttle", "a percentage of at most 99".into());
        }
        self.validate_zero_pages()?;
        self.validate_zstd_options()?;
        self.validate_handover()?;
        self.validate_zero_copy()
    }

    /// The zero-page benchmark knob and the DSA device it may be given.
    fn validate_zero_pages(&self) -> Result<(), MigrationError> {
        let bad = |field: &'static str, reason: String| {
            Err(MigrationError::InvalidConfig { field, reason })
        };
        if !(0.0..=1.0).contains(&self.zero_page_as_normal) {
            return bad(
                "zero_page_as_normal",
                format!("{} is not a fraction from 0 to 1", self.zero_page_as_normal),
            );
        }
        if self.zero_page_offload.is_some() && self.zero_page_detection != ZeroPageDetection::Dsa {
            return bad(
                "zero_page_offload",
                format!(
                    "a DSA device was given but zero_page_detection is {}",
                    self.zero_page_detection.as_str()
                ),
            );
        }
        Ok(())
    }

    /// Zero-copy sends only from guest memory: nothing that builds pages in
    /// a private buffer goes with it.
    fn validate_zero_copy(&self) -> Result<(), MigrationError> {
        let bad = |field: &'static str, reason: String| {
            Err(MigrationError::InvalidConfig { field, reason })
        };
        if self.zero_copy && self.compression != CodecChoice::None {
            return bad(
                "zero_copy",
                format!(
                    "cannot be combined with compression ({}): compressed pages are built \
                     in a private buffer, there is nothing to send from guest memory",
                    self.compression
                ),
            );
        }
        if self.zero_copy && self.delta_cache_size > 0 {
            return bad(
                "zero_copy",
                "cannot be combined with a delta cache: delta pages and the pages it \
                 caches are sent from private copies, not from guest memory"
                    .into(),
            );
        }
        Ok(())
    }

    /// Whether duplicate pages are looked for: zero-copy sends only from
    /// guest memory, and a reference lives in a private buffer.
    pub fn dedup_active(&self) -> bool {
        self.dedup && !self.zero_copy
    }

    /// A hand-over moves no page: options about moving pages cannot apply.
    fn validate_handover(&self) -> Result<(), MigrationError> {
        if !self.memory_handover {
            return Ok(());
        }
        let conflict = if self.postcopy != crate::postcopy::PostcopyMode::Off {
            "postcopy"
        } else if self.zero_copy {
            "zero_copy"
        } else if self.security.tls.is_some() {
            "security.tls (descriptors cannot pass through TLS)"
        } else {
            return Ok(());
        };
        Err(MigrationError::InvalidConfig {
            field: "memory_handover",
            reason: format!("a hand-over copies no page, so it cannot be combined with {conflict}"),
        })
    }

    /// The dictionary and packet frames are zstd's; `auto` picks the framing.
    fn validate_zstd_options(&self) -> Result<(), MigrationError> {
        let bad = |field, reason: String| Err(MigrationError::InvalidConfig { field, reason });
        if self.packet_frames && self.compression != CodecChoice::Zstd {
            return bad(
                "packet_frames",
                format!(
                    "packet frames are a zstd framing; compression is {} (auto chooses the \
                     framing itself)",
                    self.compression
                ),
            );
        }
        if self.stream_frames
            && (self.compression != CodecChoice::Zstd
                || self.packet_frames
                || self.compression_dictionary.is_some())
        {
            return bad(
                "stream_frames",
                format!(
                    "a stream per channel is a zstd framing without packet frames or a \
                     dictionary (its window holds what the channel sent); compression is {}{}{}",
                    self.compression,
                    if self.packet_frames {
                        ", with packet frames"
                    } else {
                        ""
                    },
                    if self.compression_dictionary.is_some() {
                        ", with a dictionary"
                    } else {
                        ""
                    },
                ),
            );
        }
        if let Some(len) = self.compression_dictionary {
            if !matches!(self.compression, CodecChoice::Zstd | CodecChoice::Auto) {
                return bad(
                    "compression_dictionary",
                    format!(
                        "dictionaries are zstd's; compression is {}",
                        self.compression
                    ),
                );
            }
            if !(256..=tern_wire::MAX_DICTIONARY_LEN).contains(&len) {
                return bad(
                    "compression_dictionary",
                    format!(
                        "{len} bytes (must be 256 to {} bytes)",
                        tern_wire::MAX_DICTIONARY_LEN
                    ),
                );
            }
        }
        Ok(())
    }

    /// Rejects settings the transport to `address` cannot carry, before
    /// anything connects: [`crate::Source::migrate`] calls it first, and a
    /// front end may call it earlier still (before building its guest).
    pub fn check_address(&self, address: &Address) -> Result<(), MigrationError> {
        if self.memory_handover && !matches!(address, Address::Unix(_) | Address::Fd(_)) {
            return Err(MigrationError::UnsupportedTransport {
                field: "memory_handover",
                address: address.to_string(),
                reason: "memory is handed over as file descriptors, which only a Unix socket \
                         on this host carries",
            });
        }
        if self.zero_copy && self.security.tls.is_some() {
            return Err(MigrationError::UnsupportedTransport {
                field: "zero_copy",
                address: address.to_string(),
                reason: "TLS encrypts the pages into its own records before they leave, so the \
                         kernel cannot send them from guest memory; kernel TLS does not take \
                         MSG_ZEROCOPY either (see docs/security.md)",
            });
        }
        if self.zero_copy && matches!(address, Address::Unix(_) | Address::Vsock { .. }) {
            return Err(MigrationError::UnsupportedTransport {
                field: "zero_copy",
                address: address.to_string(),
                reason: "zero-copy sends (MSG_ZEROCOPY, io_uring SENDMSG_ZC) need TCP; \
                         a Unix socket copies either way",
            });
        }
        Ok(())
    }
}

/// Destination-side settings. `#[non_exhaustive]` like [`MigrationConfig`]:
/// start from [`ReceiveConfig::default()`] and set fields or chain setters.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ReceiveConfig {
    /// How long to wait for the source's connections.
    pub accept_timeout: Duration,
    /// Timeout of any single blocking receive once data flows, and the
    /// longest silence tolerated on a page channel.
    pub io_timeout: Duration,
    /// How long a new connection has to deliver its first message (a hello
    /// or a channel hello) in full. Each connection has its own deadline, so
    /// a slow or silent one delays nobody else.
    pub handshake_timeout: Duration,
    /// At most this many connections in handshake at once; beyond, new ones
    /// are closed at once.
    pub max_pending_handshakes: usize,
    /// The largest guest accepted, in bytes: a bigger one is refused at the
    /// handshake, before anything is allocated. `None`: what the machine
    /// can hold now (`MemAvailable` + `SwapFree`).
    pub max_memory: Option<u64>,
    /// How deflate pages are inflated: `Auto` uses IAA through QPL when
    /// libqpl loads and its hardware path opens, libdeflate otherwise;
    /// `Hardware` requires IAA; `Software` always uses libdeflate. The wire
    /// format is the same either way.
    pub qpl_path: QplPath,
    /// How long, once it has said "ready", the destination waits for the
    /// source's commit; without one in time the guest is not resumed here.
    pub switch_over_timeout: Duration,
    /// TLS and the shared-key handshake required of every channel.
    pub security: Security,
    /// Whether sessions nobody authenticated (no key, no TLS) are accepted.
    pub unauthenticated: UnauthenticatedPolicy,
    /// Whether a source may skip the memory digest (`Verify::None`); the
    /// destination decides, since it is the one that runs the guest.
    pub allow_unverified: bool,
    /// Threads that decompress pages for every channel's receiver; `None`:
    /// one per core the process may use. `Some(0)`: each receiver
    /// decompresses its own packets, one core per channel at most.
    pub decode_threads: Option<usize>,
    /// Keep the guest paused after a verified, committed switch-over and
    /// hand it over paused ([`crate::Received::resumed`] is false): for a
    /// VMM that resumes it itself (Cloud Hypervisor's `CompletePaused`,
    /// libvirt's paused start).
    pub keep_paused: bool,
    /// The largest VMM configuration accepted from the source
    /// ([`crate::MigrationConfig::vmm_config`]), at most
    /// `tern_wire::MAX_VMM_CONFIG_LEN`: a larger one is refused at the hello
    /// that announces it, before it is read.
    pub max_vmm_config: usize,
    /// During postcopy, how long a guest thread that touched a missing
    /// page waits for it (the source's answer or the background push)
    /// before the migration fails: the longest a silent source can stall
    /// the guest.
    pub postcopy_request_timeout: Duration,
    /// After the point of no return, how long a destination whose
    /// channels broke (or whose source went silent past
    /// `postcopy_request_timeout`) accepts the source's reconnection
    /// before it stays `postcopy-paused` for the operator
    /// (`ReceiveHandle::recover_postcopy`, `migrate-recover`). Guest
    /// threads touching a missing page wait meanwhile; nothing fails by
    /// itself (docs/postcopy.md, "Recovery").
    pub postcopy_recover_timeout: Duration,
}

/// Whether a destination without an auth key or TLS accepts sessions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum UnauthenticatedPolicy {
    /// Only on a listener no other machine reaches (loopback TCP, a Unix
    /// socket); anywhere else receiving fails before anything is accepted.
    #[default]
    LocalOnly,
    /// Everywhere (`tern receive --insecure`; or an embedder's channels
    /// that it authenticated itself).
    Allow,
    /// Nowhere.
    Refuse,
}

impl Default for ReceiveConfig {
    fn default() -> Self {
        Self {
            accept_timeout: Duration::from_secs(60),
            io_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(5),
            max_pending_handshakes: 64,
            max_memory: None,
            qpl_path: QplPath::Auto,
            security: Security::default(),
            unauthenticated: UnauthenticatedPolicy::default(),
            allow_unverified: false,
            switch_over_timeout: DEFAULT_SWITCH_OVER_TIMEOUT,
            decode_threads: None,
            keep_paused: false,
            max_vmm_config: 64 << 10,
            postcopy_request_timeout: Duration::from_secs(10),
            postcopy_recover_timeout: Duration::from_secs(60),
        }
    }
}

impl ReceiveConfig {
    /// The decoder threads to start: [`Self::decode_threads`], or one per
    /// core the process may use.
    pub fn decode_threads(&self) -> usize {
        self.decode_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
    }

    /// The largest guest this destination accepts now, if there is a limit.
    pub fn memory_limit(&self) -> Option<u64> {
        self.max_memory.or_else(available_memory)
    }
}

/// Memory the machine can give a new guest now: `MemAvailable` plus
/// `SwapFree` from `/proc/meminfo`. `None` where that file is missing.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = meminfo.lines().find(|line| line.starts_with(name))?;
        let kib: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    };
    Some(field("MemAvailable:")? + field("SwapFree:").unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_values() {
        assert!(MigrationConfig::default().validate().is_ok());
        for (field, config) in [
            (
                "channels",
                MigrationConfig {
                    channels: 0,
                    ..Default::default()
                },
            ),
            (
                "downtime_limit",
                MigrationConfig {
                    downtime_limit: Duration::ZERO,
                    ..Default::default()
                },
            ),
            (
                "max_bandwidth",
                MigrationConfig {
                    max_bandwidth: Some(0),
                    ..Default::default()
                },
            ),
            (
                "max_iterations",
                MigrationConfig {
                    max_iterations: Some(0),
                    ..Default::default()
                },
            ),
            (
                "zero_page_as_normal",
                MigrationConfig {
                    zero_page_as_normal: 1.5,
                    ..Default::default()
                },
            ),
            (
                "zero_copy",
                MigrationConfig {
                    zero_copy: true,
                    compression: CodecChoice::Lz4,
                    ..Default::default()
                },
            ),
        ] {
            match config.validate() {
                Err(MigrationError::InvalidConfig {
                    field: named,
                    reason,
                }) => {
                    assert_eq!(named, field, "{reason}");
                    assert!(!reason.contains("--"), "names a CLI flag: {reason}");
                }
                other => panic!("{config:?} gave {other:?}"),
            }
        }
        assert_eq!("workers".parse(), Ok(ZeroPageDetection::Workers));
        assert_eq!("dsa".parse(), Ok(ZeroPageDetection::Dsa));
        assert!("magic".parse::<ZeroPageDetection>().is_err());
        assert_eq!("legacy".parse(), Ok(ZeroPageDetection::Source));
        assert_eq!("multifd".parse(), Ok(ZeroPageDetection::Workers));
        assert_eq!("switch-over".parse(), Ok(LimitPolicy::SwitchOver));
    }

    #[test]
    fn zero_copy_is_refused_for_a_unix_destination_naming_the_field() {
        let config = MigrationConfig {
            zero_copy: true,
            ..Default::default()
        };
        let unix = Address::Unix("/tmp/tern.sock".into());
        let error = config.check_address(&unix).unwrap_err();
        assert!(
            matches!(
                error,
                MigrationError::UnsupportedTransport {
                    field: "zero_copy",
                    ..
                }
            ),
            "{error:?}"
        );
        let message = error.to_string();
        assert!(
            message.contains("zero_copy") && message.contains("unix:/tmp/tern.sock"),
            "{message}"
        );
        assert!(!message.contains("--"), "names a CLI flag: {message}");
        assert!(
            config
                .check_address(&Address::Tcp("127.0.0.1:4444".into()))
                .is_ok()
        );
        assert!(MigrationConfig::default().check_address(&unix).is_ok());
    }
}

//! The options of everything that migrates, and their conversion to the
//! engine's settings. Pure: the offload devices they name are opened by
//! the session module (`crate::session::migration_config`).

use std::str::FromStr;
use std::time::Duration;

use clap::Args;
use tern_engine::{
    DictionaryRefresh, LimitPolicy, MigrationConfig, Verify, ZeroCopyBackend, ZeroPageDetection,
};
use tern_page::codec::{CodecChoice, QplPath};

use super::values::{
    Choices, compression_values, parse_channels, postcopy_values, qpl_path_values, verify_values,
};
use crate::units::{parse_rate, parse_size};

/// Options shared by everything that migrates.
#[derive(Debug, Args, Clone)]
pub(crate) struct TransferArgs {
    /// Page channels (the main channel comes on top), 1 to 64. QEMU:
    /// multifd-channels.
    #[arg(long, default_value_t = 2, value_parser = parse_channels)]
    pub channels: u16,
    /// Worker threads classifying pages (0: one per channel).
    #[arg(long, default_value_t = 0)]
    pub workers: usize,
    /// Largest acceptable downtime, in milliseconds. QEMU: downtime-limit.
    #[arg(long, default_value_t = 300)]
    pub downtime_limit: u64,
    /// Cap on bytes per second over all channels (e.g. 1Gbps, 1Gbit,
    /// 100MiB). QEMU: max-bandwidth.
    #[arg(long, value_parser = parse_rate)]
    pub max_bandwidth: Option<u64>,
    /// Most dirty iterations before --on-limit applies.
    #[arg(long)]
    pub max_iterations: Option<u32>,
    /// Longest live phase in seconds before --on-limit applies.
    #[arg(long)]
    pub max_time: Option<f64>,
    /// What to do at a limit.
    #[arg(long, default_value = "cancel", value_parser = Choices::<LimitPolicy>::new(&[
        ("cancel", "give up; the source guest runs on"),
        ("switch-over", "switch over anyway, with a longer downtime"),
    ]))]
    pub on_limit: LimitPolicy,
    /// Who detects zero pages. QEMU: zero-page-detection.
    #[arg(long, default_value = "workers", value_parser = Choices::<ZeroPageDetection>::new(&[
        ("none", "nobody: every page is sent with its data"),
        ("source", "the producer thread, before the workers"),
        ("workers", "the channel workers, in parallel"),
        ("dsa", "Intel DSA (see --dsa-device), finished on the CPU"),
        ("legacy", "QEMU's name for source"),
        ("multifd", "QEMU's name for workers"),
    ]))]
    pub zero_page_detection: ZeroPageDetection,
    /// With `--zero-page-detection dsa`: the work queues found in sysfs
    /// (`hw`: shared queues first, NUMA-local devices first), only the
    /// listed devices or queues (`dsa0,dsa2/wq2.1`), or tern's software DSA
    /// device (`software`, for machines without DSA; it runs the same
    /// descriptors on a CPU thread).
    #[arg(long, default_value = "hw", value_parser = Choices::<tern_dsa::DsaDevice>::new(&[
        ("hw", "every usable DSA work queue in sysfs"),
        ("software", "tern's software DSA device"),
        ("dsa0,dsa2/wq2.1", "only these devices or work queues"),
    ]))]
    pub dsa_device: tern_dsa::DsaDevice,
    /// Benchmark knob: percent of zero pages sent as normal pages.
    #[arg(long, default_value_t = 0.0)]
    pub zero_page_as_normal: f64,
    /// Page compression, each page on its own. The default, auto, picks
    /// what the link needs: the codec, level and framing that move guest
    /// memory fastest over the measured link, nothing where the link is
    /// faster than the codecs, with a trained dictionary and a delta cache
    /// when they pay (none with --zero-copy, which sends from guest
    /// memory). QEMU: multifd-compression (its zlib is a stream per
    /// channel: use deflate).
    #[arg(long, default_value = "auto", value_parser = compression_values())]
    pub compression: CodecChoice,
    /// Compression level, clamped to the codec's range (zstd up to 22,
    /// negative levels faster; deflate 1 to 12; lz4 1; qpl 1 or 3); the
    /// level in force is reported.
    /// QEMU: multifd-zstd-level, multifd-zlib-level.
    #[arg(long, allow_negative_numbers = true)]
    pub compression_level: Option<i32>,
    /// Where QPL runs deflate, for --compression qpl and for auto's QPL
    /// candidate. QEMU: no parameter.
    #[arg(long, default_value = "auto", value_parser = qpl_path_values())]
    pub qpl_path: QplPath,
    /// Send a page whose bytes the destination already holds in another
    /// page as an 8-byte reference to it (off with --zero-copy). Looking
    /// costs a hash of every data page, which a verified migration computes
    /// anyway. QEMU: no parameter.
    #[arg(long, default_value = "auto", value_parser = Choices::<Dedup>::new(&[
        ("auto", "on unless --verify none (then the page hashes would be an extra cost)"),
        ("on", "look for duplicate pages"),
        ("off", "send every page's bytes"),
    ]))]
    pub dedup: Dedup,
    /// Cache of pages as last sent, against which re-sent pages go as
    /// deltas (DSA delta records), with multifd; 0 turns deltas off; auto
    /// (with --compression auto) sizes it from the pages the guest dirties
    /// again, within --delta-cache-allowance. QEMU: xbzrle-cache-size (with
    /// the xbzrle capability, without multifd).
    #[arg(long, default_value = "auto", value_parser = parse_delta_cache_size)]
    pub delta_cache_size: DeltaCacheSize,
    /// The most memory auto may give the delta cache (default: half of
    /// guest memory, at most 2GiB). QEMU: no parameter.
    #[arg(long, value_parser = parse_size)]
    pub delta_cache_allowance: Option<u64>,
    /// Where delta records are created: the CPU, tern's software DSA
    /// device, or the first DSA work queue (create-delta-record
    /// descriptors; the CPU redoes any that fail). QEMU: no parameter.
    #[arg(long, default_value = "cpu", value_parser = Choices::<DeltaOffloadChoice>::new(&[
        ("cpu", "the CPU"),
        ("software", "tern's software DSA device"),
        ("hw", "the first usable DSA work queue"),
    ]))]
    pub delta_offload: DeltaOffloadChoice,
    /// Train a zstd dictionary of at most this size (256B to 128KiB) on
    /// sampled guest pages at setup and compress every zstd page against it;
    /// pages stay independent. With zstd or auto; auto (with --compression
    /// auto) trains 64KiB in the background once the measured link has it
    /// keep per-page zstd, in use once it pays on pages the training did
    /// not see; none when it compresses whole packets as a zstd stream per
    /// channel, whose window holds what the channel sent. QEMU: no
    /// parameter.
    #[arg(long, default_value = "auto", value_parser = parse_dictionary_choice)]
    pub compression_dictionary: DictionaryChoice,
    /// Train the dictionary again, on the pages being sent, when its ratio
    /// drops by more than 10 % (new one announced at an iteration
    /// boundary). With --compression-dictionary. QEMU: no parameter.
    #[arg(long, default_value = "background", value_parser = Choices::<DictionaryRefresh>::new(&[
        ("off", "never: the setup's dictionary serves the whole migration"),
        ("background", "train on a background thread, switch at the next iteration boundary"),
        ("at-boundary", "train at the iteration boundary, holding the next iteration"),
    ]))]
    pub dictionary_refresh: DictionaryRefresh,
    /// zstd with all compressible pages of a packet in one frame: better
    /// ratio, a packet decodes on one thread. With --compression zstd (auto
    /// weighs both framings itself). QEMU: multifd zstd is one stream per
    /// channel.
    #[arg(long)]
    pub packet_frames: bool,
    /// zstd as one stream per page channel, flushed at each packet's end:
    /// a packet's matches reach back over what its channel sent before
    /// (as QEMU's multifd zstd); a channel's packets decode in order. With
    /// --compression zstd, without --packet-frames or a dictionary (auto
    /// uses it as its zstd framing).
    #[arg(long)]
    pub stream_frames: bool,
    /// Compare memory digests before resuming on the destination.
    #[arg(long, default_value = "full", value_parser = verify_values())]
    pub verify: Verify,
    /// Threads hashing stale pages again at switch-over, --verify full (0: every core).
    #[arg(long, default_value_t = 0)]
    pub digest_threads: usize,
    /// Send page data with MSG_ZEROCOPY straight from guest memory (TCP only;
    /// pays off on a real NIC, not on loopback, where the kernel copies).
    #[arg(long)]
    pub zero_copy: bool,
    /// Zero-copy mechanism.
    #[arg(long, default_value = "msg", value_parser = Choices::<ZeroCopyBackend>::new(&[
        ("msg", "sendmsg with MSG_ZEROCOPY"),
        ("uring", "io_uring SENDMSG_ZC (Linux 6.2 or later)"),
    ]))]
    pub zero_copy_backend: ZeroCopyBackend,
    /// Throttle a guest that dirties memory faster than it is sent. QEMU:
    /// the auto-converge capability.
    #[arg(long, default_value = "on", value_parser = Choices::<OnOff>::new(&[
        ("on", "throttle when needed"),
        ("off", "never throttle"),
    ]))]
    pub auto_converge: OnOff,
    /// The same as `--auto-converge off`.
    #[arg(long, hide = true, conflicts_with = "auto_converge")]
    pub no_auto_converge: bool,
    /// Throttle, in percent of the guest's time, applied the first time
    /// auto-converge steps in. QEMU: cpu-throttle-initial.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u8).range(1..=99))]
    pub cpu_throttle_initial: u8,
    /// Throttle added each further time auto-converge steps in, in percent
    /// (the total stops at 99). QEMU: cpu-throttle-increment.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u8).range(1..=99))]
    pub cpu_throttle_increment: u8,
    /// Timeout of a blocked send or receive, in seconds.
    #[arg(long, default_value_t = 30)]
    pub io_timeout: u64,
    /// How long to keep trying to reach the destination, in seconds.
    #[arg(long, default_value_t = 10)]
    pub connect_timeout: u64,
    /// How long the destination has to answer the handshake, in seconds;
    /// a peer silent that long is reported as not a tern destination.
    #[arg(long = "handshake-timeout", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub handshake_timeout: u64,
    /// How long the paused source waits for each switch-over answer of the
    /// destination, in seconds: without its "ready" the source guest
    /// resumes; without the acknowledgement of the commit the outcome is
    /// unknown and the guest stays paused (exit status 3).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub switch_over_timeout: u64,
    // Postcopy (issue 24, docs/postcopy.md): one block.
    /// When precopy hands over to postcopy (QEMU: the postcopy-ram
    /// capability with migrate-start-postcopy; the names of libvirt,
    /// KubeVirt and Cloud Hypervisor are in docs/cli.md).
    #[arg(long, default_value = "off", value_parser = postcopy_values())]
    pub postcopy: tern_engine::PostcopyMode,
    /// With --postcopy on-request: start postcopy this many seconds after
    /// the live phase began, without waiting for migrate-start-postcopy.
    #[arg(long)]
    pub postcopy_after: Option<f64>,
    /// With --postcopy auto: the highest auto-converge throttle (percent)
    /// precopy may set; where it would throttle more, postcopy starts.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=99))]
    pub postcopy_max_throttle: u8,
    /// After the point of no return, how long the source keeps
    /// reconnecting to a destination whose channels broke, in seconds;
    /// then the migration stays postcopy-paused until `tern ctl ...
    /// migrate-resume` (QEMU: migrate resume=true). Never a failure.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub postcopy_recover_timeout: u64,
}

impl TransferArgs {
    /// The postcopy flags, applied to `config`.
    fn apply_postcopy(&self, config: &mut MigrationConfig) -> anyhow::Result<()> {
        config.postcopy = self.postcopy;
        config.postcopy_max_throttle = self.postcopy_max_throttle;
        config.postcopy_recover_timeout = Duration::from_secs(self.postcopy_recover_timeout);
        config.postcopy_after = match self.postcopy_after {
            Some(seconds) if seconds.is_finite() && seconds >= 0.0 => {
                Some(Duration::from_secs_f64(seconds))
            }
            Some(seconds) => anyhow::bail!("--postcopy-after {seconds} must be 0 or more seconds"),
            None => None,
        };
        if config.postcopy_after.is_some() && self.postcopy != tern_engine::PostcopyMode::OnRequest
        {
            anyhow::bail!("--postcopy-after needs --postcopy on-request");
        }
        Ok(())
    }

    /// What `--compression-level` turns into, when that is not what was
    /// asked for (the codec clamps it; the summary reports the level in
    /// force).
    pub(crate) fn compression_level_note(&self) -> Option<String> {
        use tern_page::codec::CodecId;
        let requested = self.compression_level?;
        let clamped = |codec: CodecId| {
            let level = codec.clamp_level(requested);
            let (low, high) = codec.level_range();
            (level != requested).then(|| format!("{codec} {low}..={high}, so {level}"))
        };
        let notes: Vec<String> = match self.compression {
            CodecChoice::None => {
                return Some(format!(
                    "--compression-level {requested} has no effect without --compression"
                ));
            }
            CodecChoice::Qpl if requested != 1 && requested != 3 => {
                vec![format!(
                    "qpl 1 or 3, so {}",
                    if requested < 3 { 1 } else { 3 }
                )]
            }
            CodecChoice::Qpl => Vec::new(),
            // lz4 has a single level; auto uses it as it is.
            CodecChoice::Auto => [CodecId::Zstd, CodecId::Deflate]
                .into_iter()
                .filter_map(clamped)
                .collect(),
            fixed => fixed.wire().and_then(clamped).into_iter().collect(),
        };
        (!notes.is_empty()).then(|| {
            format!(
                "--compression-level {requested} is out of range: {}",
                notes.join("; ")
            )
        })
    }

    /// The DSA set-up `--dsa-device` names (every queue unless a list is
    /// given).
    pub(crate) fn dsa_config(&self) -> tern_dsa::DsaConfig {
        tern_dsa::DsaConfig {
            devices: match &self.dsa_device {
                tern_dsa::DsaDevice::Only(devices) => devices.clone(),
                _ => tern_dsa::DsaSelection::all(),
            },
            ..Default::default()
        }
    }

    /// Whether zero-page detection runs on hardware DSA queues (not the
    /// software device).
    pub(crate) fn zero_pages_on_hardware_dsa(&self) -> bool {
        self.zero_page_detection == ZeroPageDetection::Dsa
            && self.dsa_device != tern_dsa::DsaDevice::Software
    }

    /// The engine's settings these options ask for, without the offload
    /// devices: converting arguments opens nothing (the session module
    /// opens `--dsa-device` and `--delta-offload` afterwards).
    pub(crate) fn migration_settings(&self) -> anyhow::Result<MigrationConfig> {
        if let Some(note) = self.compression_level_note() {
            eprintln!("tern: warning: {note}");
        }
        let max_time = match self.max_time {
            Some(seconds) if seconds.is_finite() && seconds > 0.0 => {
                Some(Duration::from_secs_f64(seconds))
            }
            Some(seconds) => anyhow::bail!("--max-time {seconds} must be a positive number"),
            None => None,
        };
        if !(0.0..=100.0).contains(&self.zero_page_as_normal) {
            anyhow::bail!(
                "--zero-page-as-normal {} must be a percentage from 0 to 100",
                self.zero_page_as_normal
            );
        }
        let mut config = MigrationConfig::default();
        config.channels = self.channels;
        config.workers = self.workers;
        config.downtime_limit = Duration::from_millis(self.downtime_limit);
        config.max_bandwidth = self.max_bandwidth;
        config.max_iterations = self.max_iterations;
        config.max_time = max_time;
        config.limit_policy = self.on_limit;
        config.auto_converge = self.auto_converge == OnOff::On && !self.no_auto_converge;
        config.throttle_initial = self.cpu_throttle_initial;
        config.throttle_increment = self.cpu_throttle_increment;
        config.zero_page_detection = self.zero_page_detection;
        config.zero_page_as_normal = self.zero_page_as_normal / 100.0;
        self.apply_page_encoding(&mut config);
        config.verify = self.verify;
        config.digest_threads = self.digest_threads;
        config.zero_copy = self.zero_copy;
        config.zero_copy_backend = self.zero_copy_backend;
        config.io_timeout = Duration::from_secs(self.io_timeout);
        config.connect_timeout = Duration::from_secs(self.connect_timeout);
        config.handshake_timeout = Duration::from_secs(self.handshake_timeout);
        config.switch_over_timeout = Duration::from_secs(self.switch_over_timeout);
        self.apply_postcopy(&mut config)?;
        Ok(config)
    }

    /// How pages are encoded: compression, dictionaries, duplicates and
    /// deltas, applied to `config`.
    fn apply_page_encoding(&self, config: &mut MigrationConfig) {
        // Zero-copy sends from guest memory: no codec can run, and auto
        // would pick none.
        config.compression = match self.compression {
            CodecChoice::Auto if self.zero_copy => CodecChoice::None,
            choice => choice,
        };
        config.compression_level = self.compression_level;
        config.qpl_path = self.qpl_path;
        config.dedup = match self.dedup {
            Dedup::On => true,
            Dedup::Off => false,
            Dedup::Auto => self.verify != Verify::None,
        };
        config.delta_cache_size = self.delta_cache_size.0.unwrap_or(0);
        config.delta_cache_allowance = match self.delta_cache_size.0 {
            Some(0) => Some(0),
            _ => self.delta_cache_allowance,
        };
        config.compression_dictionary = match self.compression_dictionary {
            DictionaryChoice::Size(bytes) => Some(bytes),
            DictionaryChoice::Auto | DictionaryChoice::Off => None,
        };
        config.auto_dictionary = self.compression_dictionary == DictionaryChoice::Auto;
        config.dictionary_refresh = self.dictionary_refresh;
        config.packet_frames = self.packet_frames;
        config.stream_frames = self.stream_frames;
    }
}

/// `--compression-dictionary`: a size, or `off` (`None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DictionarySize(pub Option<usize>);

pub(super) fn parse_dictionary_size(text: &str) -> Result<DictionarySize, String> {
    if text.trim() == "off" {
        return Ok(DictionarySize(None));
    }
    let bytes = parse_size(text)?;
    let max = tern_wire::MAX_DICTIONARY_LEN as u64;
    if !(256..=max).contains(&bytes) {
        return Err(format!(
            "--compression-dictionary {text} is out of range (256B to {}KiB, or off)",
            max >> 10
        ));
    }
    Ok(DictionarySize(usize::try_from(bytes).ok()))
}

/// `--compression-dictionary` of `vm migrate`: `auto`, `off` or a size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DictionaryChoice {
    /// Auto trains one and keeps it when it pays (with `--compression auto`).
    Auto,
    /// None.
    Off,
    /// At most this many bytes.
    Size(usize),
}

fn parse_dictionary_choice(text: &str) -> Result<DictionaryChoice, String> {
    if text.trim() == "auto" {
        return Ok(DictionaryChoice::Auto);
    }
    Ok(parse_dictionary_size(text)?
        .0
        .map_or(DictionaryChoice::Off, DictionaryChoice::Size))
}

/// `--delta-cache-size`: a size, or `auto` (`None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeltaCacheSize(pub Option<u64>);

fn parse_delta_cache_size(text: &str) -> Result<DeltaCacheSize, String> {
    if text.trim() == "auto" {
        return Ok(DeltaCacheSize(None));
    }
    parse_size(text).map(|bytes| DeltaCacheSize(Some(bytes)))
}

/// Where `--delta-offload` creates delta records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeltaOffloadChoice {
    Cpu,
    Software,
    Hardware,
}

impl FromStr for DeltaOffloadChoice {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "cpu" => Ok(Self::Cpu),
            "software" => Ok(Self::Software),
            "hw" => Ok(Self::Hardware),
            other => Err(format!("'{other}' is none of cpu, software, hw")),
        }
    }
}

/// `--dedup`: whether duplicate pages go as references.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dedup {
    /// On when the memory is verified: its page hashes are computed
    /// anyway, so the index costs little; with `--verify none` hashing
    /// every data page only for duplicates costs more CPU than the few
    /// duplicates of a typical guest save (measured: docs/compression.md).
    Auto,
    On,
    Off,
}

impl FromStr for Dedup {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            other => Err(format!("'{other}' is none of auto, on, off")),
        }
    }
}

/// `on` or `off`, as QEMU writes capabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnOff {
    On,
    Off,
}

impl FromStr for OnOff {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            other => Err(format!("'{other}' is neither on nor off")),
        }
    }
}

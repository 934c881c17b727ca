//! Command-line syntax.

use std::ffi::OsStr;
use std::str::FromStr;
use std::time::Duration;

use clap::builder::{PossibleValue, TypedValueParser};
use clap::{Args, ColorChoice, Parser, Subcommand};
use tern_engine::{
    Address, DictionaryRefresh, LimitPolicy, MigrationConfig, Verify, ZeroCopyBackend,
    ZeroPageDetection,
};
use tern_page::codec::{CodecChoice, QplPath};
use tern_synthetic::{ContentMix, SyntheticConfig};

use crate::units::{parse_rate, parse_size};

/// Live migration of virtual-machine memory over parallel channels.
#[derive(Debug, Parser)]
#[command(name = "tern", version)]
pub struct Cli {
    /// Log what happens (or set RUST_LOG), and print the statistics table
    /// after a failed migration too.
    #[arg(short, long, global = true)]
    pub verbose: bool,
    #[command(flatten)]
    pub progress: crate::report::ProgressArgs,
    /// Colour in log lines: auto (only on a terminal, and not when NO_COLOR
    /// is set), always or never.
    #[arg(long, global = true, value_enum, default_value_t = ColorChoice::Auto)]
    pub color: ColorChoice,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// Whether log lines on stderr carry colour.
    pub fn log_colour(&self) -> bool {
        use std::io::IsTerminal;
        match self.color {
            ColorChoice::Always => true,
            ColorChoice::Never => false,
            ColorChoice::Auto => {
                std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty())
                    && std::io::stderr().is_terminal()
            }
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Migrate a built-in synthetic guest to a destination on this machine,
    /// both ends in one process, with progress and a summary.
    Demo(DemoArgs),
    /// Migrate a synthetic guest to a `tern receive` destination.
    Migrate(Box<MigrateArgs>),
    /// Receive one migration and verify it.
    Receive(ReceiveArgs),
    /// Save a synthetic guest to a snapshot file (paused or live).
    Save(crate::save::SaveArgs),
    /// Restore a synthetic guest from a snapshot file, eagerly or lazily.
    Restore(crate::restore::RestoreArgs),
    /// Serve a snapshot's pages to a VMM over Firecracker's userfaultfd
    /// page-fault handler protocol.
    ServePages(crate::serve_pages::ServePagesArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// A real KVM guest: run, migrate, receive, demo.
    #[command(subcommand)]
    Vm(crate::vm::VmCommand),
    /// Print a shell completion script: `tern completions bash >
    /// /etc/bash_completion.d/tern`.
    Completions(CompletionsArgs),
    /// Send one command to the control socket of a running migrate, receive
    /// or vm command, or print its events (docs/control.md).
    Ctl(crate::ctl::CtlArgs),
    /// Report what this machine offers tern (KVM, DSA, IAA, QPL, kernel TLS,
    /// io_uring, memlock limit, huge pages, NUMA) and how to fix what is
    /// missing.
    Doctor(DoctorArgs),
    /// The host coordinator: slots and a shared bandwidth budget for every
    /// migration on this host that joins with --agent (docs/fleet.md).
    Agent(crate::agent::AgentArgs),
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub guest: GuestArgs,
    #[command(flatten)]
    pub transfer: TransferArgs,
    /// Use a Unix socket instead of TCP on 127.0.0.1.
    #[arg(long)]
    pub unix: bool,
    /// Run TLS 1.3 on every channel, with certificates from a CA made for
    /// this run only.
    #[arg(long)]
    pub tls: bool,
    /// Print one JSON document instead of the summary table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Destination: HOST:PORT, tcp:HOST:PORT, tcp::PORT (this machine),
    /// unix:PATH, vsock:CID:PORT or fd:N,M,... (inherited connected
    /// sockets, one per channel, main first).
    #[arg(long, value_parser = parse_address)]
    pub to: Address,
    #[command(flatten)]
    pub security: crate::secure::SourceSecurityArgs,
    #[command(flatten)]
    pub guest: GuestArgs,
    #[command(flatten)]
    pub transfer: TransferArgs,
    /// Print one JSON document instead of the summary table.
    #[arg(long)]
    pub json: bool,
    /// Print a `migrating` event, one JSON line on stdout, as the migration
    /// starts, before the report (docs/cli.md, "Events").
    #[arg(long)]
    pub events: bool,
    #[command(flatten)]
    pub steering: crate::steering::SteeringArgs,
    /// A file whose bytes go to the destination before any memory, as the
    /// VMM's configuration (opaque to tern, at most 1 MiB): `tern receive
    /// --save-vmm-config` writes them out.
    #[arg(long, value_name = "FILE")]
    pub vmm_config: Option<std::path::PathBuf>,
    /// Same-host migration: hand guest memory over as file descriptors
    /// over the unix: socket instead of copying it (the synthetic guest is
    /// then memfd-backed); the destination runs `tern receive --local`.
    #[arg(long)]
    pub local: bool,
}

/// Where and how a destination waits (`tern receive`, `tern vm receive`).
#[derive(Debug, Args)]
pub struct ListenArgs {
    /// Where to listen: HOST:PORT, tcp:HOST:PORT, tcp::PORT (every
    /// interface), unix:PATH, vsock:CID:PORT or fd:N (an inherited
    /// listening socket, or connected ones).
    #[arg(long, value_parser = parse_address)]
    pub listen: Address,
    #[command(flatten)]
    pub security: crate::secure::DestinationSecurityArgs,
    /// How long to wait for the source, in seconds.
    #[arg(long, default_value_t = 300)]
    pub accept_timeout: u64,
    /// Longest silence tolerated from the source once it is connected, in
    /// seconds.
    #[arg(long, default_value_t = 30)]
    pub io_timeout: u64,
    /// How long each new connection has to send its whole first message, in
    /// seconds; a connection that does not is closed, and the wait goes on.
    #[arg(long, default_value_t = 5)]
    pub handshake_timeout: u64,
    /// The largest guest accepted (e.g. 16G); a bigger one is refused at the
    /// handshake, before anything is allocated. Default: the memory this
    /// machine has available now (MemAvailable + SwapFree).
    #[arg(long, value_parser = crate::units::parse_size)]
    pub max_memory: Option<u64>,
    /// Serve migrations one after another instead of exiting after the
    /// first; a failed one is reported and the next awaited. Stop with
    /// SIGINT or SIGTERM.
    #[arg(long)]
    pub keep_listening: bool,
    /// Where deflate pages are inflated: IAA through QPL when present
    /// (auto), IAA or fail (hardware), or libdeflate (software). The wire
    /// format is the same either way.
    #[arg(long, default_value = "auto", value_parser = qpl_path_values())]
    pub qpl_path: QplPath,
    /// Threads that decompress pages for every channel (default: one per
    /// core); 0 leaves each channel's receiver to decompress its own
    /// packets. QEMU: no parameter.
    #[arg(long, value_parser = clap::value_parser!(u16).range(0..=256))]
    pub decode_threads: Option<u16>,
    /// How long, after saying it is ready, to wait for the source's commit,
    /// in seconds; without it the guest is not resumed here.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub switch_over_timeout: u64,
    #[command(flatten)]
    pub steering: crate::steering::SteeringArgs,
    /// Keep the guest paused after a verified switch-over and hand it over:
    /// `cont` on the control socket resumes it (needs --control-socket).
    #[arg(long, requires = "control_socket")]
    pub keep_paused: bool,
    /// With --keep-paused: how long to wait for `cont`, in seconds; then
    /// the guest is resumed anyway, never left paused.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub paused_timeout: u64,
    /// The largest VMM configuration accepted from the source (at most
    /// 1MiB); a larger one is refused before it is read.
    #[arg(long, default_value = "64KiB", value_parser = crate::units::parse_size)]
    pub max_vmm_config: u64,
}

impl ListenArgs {
    /// Binds the listener and builds the destination's settings.
    pub fn bind(&self) -> anyhow::Result<(tern_engine::Listener, tern_engine::ReceiveConfig)> {
        use anyhow::Context;
        // Refused before binding: a refusal must not have held the port.
        self.security.check_before_bind(&self.listen)?;
        let listener = tern_engine::Listener::bind(&self.listen)
            .with_context(|| format!("cannot listen on {}", self.listen))?;
        let mut config = tern_engine::ReceiveConfig::default();
        config.accept_timeout = Duration::from_secs(self.accept_timeout);
        config.io_timeout = Duration::from_secs(self.io_timeout);
        config.handshake_timeout = Duration::from_secs(self.handshake_timeout);
        config.max_memory = self.max_memory;
        config.qpl_path = self.qpl_path;
        config.switch_over_timeout = Duration::from_secs(self.switch_over_timeout);
        config.decode_threads = self.decode_threads.map(usize::from);
        config.keep_paused = self.keep_paused;
        config.max_vmm_config = usize::try_from(self.max_vmm_config).unwrap_or(usize::MAX);
        if self.qpl_path == QplPath::Hardware {
            // Asked for IAA: say now, not when a source connects, if it
            // cannot be had.
            tern_page::codec::PageDecompressor::for_destination(
                tern_page::codec::CodecId::Deflate,
                QplPath::Hardware,
            )
            .context("--qpl-path hardware")?;
        }
        self.security.apply(&listener, &mut config)?;
        Ok((listener, config))
    }
}

#[derive(Debug, Args)]
pub struct ReceiveArgs {
    #[command(flatten)]
    pub listen: ListenArgs,
    /// How long to let the resumed guest run before exiting, in
    /// milliseconds (shows it carries on dirtying memory here).
    #[arg(long, default_value_t = 200)]
    pub run_after: u64,
    /// Write the VMM configuration the source sent (`tern migrate
    /// --vmm-config`) to this file.
    #[arg(long, value_name = "FILE")]
    pub save_vmm_config: Option<std::path::PathBuf>,
    /// Print one JSON document instead of the summary table.
    #[arg(long)]
    pub json: bool,
    /// Same-host migration: take guest memory over from the source's file
    /// descriptors (`tern migrate --local`) instead of receiving a copy;
    /// needs a unix: address.
    #[arg(long)]
    pub local: bool,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Zero-page detection throughput per backend (CPU SIMD backends,
    /// QEMU's method, the software DSA device) beside a plain read loop.
    Zero(BenchZeroArgs),
    /// Per-page codec speed and ratio on a mixed corpus.
    Codec(BenchCodecArgs),
    /// Localhost migrations of a synthetic guest, paused and dirtying, over
    /// several channel counts; medians of several runs.
    Migrate(BenchMigrateArgs),
}

#[derive(Debug, Args)]
pub struct BenchZeroArgs {
    /// Buffer size: larger than the caches, so pages come from DRAM.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub buffer: u64,
    /// Rounds per case (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Print JSON instead of a Markdown table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchCodecArgs {
    /// Pages per corpus.
    #[arg(long, default_value_t = 1024)]
    pub pages: usize,
    /// Also measure zstd's variants (dictionary, packet frames) on this
    /// guest memory image (a raw file, as `vm migrate --image` maps),
    /// about --pages data pages of it in packets as the pipeline cuts it.
    #[arg(long)]
    pub image: Option<std::path::PathBuf>,
    /// Dictionary size for the zstd variant rows.
    #[arg(long, default_value = "64KiB", value_parser = parse_dictionary_size)]
    pub dictionary: DictionarySize,
    /// Print JSON instead of a Markdown table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchMigrateArgs {
    /// Guest memory size.
    #[arg(long, default_value = "4GiB", value_parser = parse_size)]
    pub memory: u64,
    /// Content mix: percent of zero, random and text-like pages.
    #[arg(long, default_value = "50:25:25")]
    pub mix: ContentMix,
    /// Channel counts to compare, comma-separated.
    #[arg(long, default_value = "1,2,4", value_delimiter = ',', value_parser = parse_channels)]
    pub channels: Vec<u16>,
    /// Runs per case (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Dirty rate of the running-guest case.
    #[arg(long, default_value = "256MiB", value_parser = parse_rate)]
    pub dirty_rate: u64,
    /// Working set of the running-guest case.
    #[arg(long, default_value = "512MiB", value_parser = parse_size)]
    pub working_set: u64,
    /// Skip the running-guest case.
    #[arg(long)]
    pub paused_only: bool,
    /// Memory verification settings to compare, comma-separated (e.g.
    /// `full,none`; the cases are interleaved run by run).
    #[arg(long, default_value = "full", value_delimiter = ',', value_parser = verify_values())]
    pub verify: Vec<Verify>,
    /// Compression settings to compare, comma-separated.
    #[arg(long, default_value = "none", value_delimiter = ',', value_parser = compression_values())]
    pub compression: Vec<CodecChoice>,
    /// Cap on bytes per second (e.g. 1Gbit), as through a slower link.
    #[arg(long, value_parser = parse_rate)]
    pub max_bandwidth: Option<u64>,
    /// Also run each case with --zero-copy.
    #[arg(long)]
    pub zero_copy: bool,
    /// Destination decoder thread counts to compare, comma-separated (0:
    /// each receiver decompresses its own channel's pages) [default: one
    /// per core].
    #[arg(long, value_delimiter = ',')]
    pub decode_threads: Vec<usize>,
    /// Print JSON instead of a Markdown table.
    #[arg(long)]
    pub json: bool,
}

/// The synthetic guest's working set unless `--working-set` says otherwise.
const DEFAULT_WORKING_SET: u64 = 256 << 20;

/// The synthetic guest's options.
#[derive(Debug, Args, Clone)]
pub struct GuestArgs {
    /// Guest memory size (binary units: 512M, 4GiB).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub memory: u64,
    /// Content mix: percent of zero, random and text-like pages.
    #[arg(long, default_value = "50:25:25")]
    pub mix: ContentMix,
    /// Bytes of pages the guest dirties per second (0: none).
    #[arg(long, default_value = "64MiB", value_parser = parse_rate)]
    pub dirty_rate: u64,
    /// The part of memory the guest dirties, from its start, at most
    /// --memory [default: 256MiB, or --memory if smaller].
    #[arg(long, value_parser = parse_size)]
    pub working_set: Option<u64>,
    /// Dirtier threads.
    #[arg(long, default_value_t = 1)]
    pub dirtier_threads: u32,
    /// Memory regions the guest is split into.
    #[arg(long, default_value_t = 1)]
    pub regions: u32,
    /// Seed of the content and of the dirtier.
    #[arg(long, default_value_t = 0x7e57)]
    pub seed: u64,
    /// Write every zero page once (without changing it) after the fill, so
    /// each has its own memory: DSA then finds real page-table entries
    /// instead of faulting, and the CPU reads real memory instead of one
    /// cached shared zero page (docs/hardware.md).
    #[arg(long)]
    pub touch_zero_pages: bool,
}

impl GuestArgs {
    /// Rejects combinations the guest would otherwise quietly reinterpret.
    pub fn check(&self) -> anyhow::Result<()> {
        use crate::units::human_bytes;
        if let Some(working_set) = self.working_set {
            anyhow::ensure!(
                working_set <= self.memory,
                "--working-set {} is larger than --memory {}",
                human_bytes(working_set),
                human_bytes(self.memory)
            );
        }
        Ok(())
    }

    /// The working set in force.
    pub fn working_set(&self) -> u64 {
        self.working_set
            .unwrap_or(DEFAULT_WORKING_SET)
            .min(self.memory)
    }

    /// Bytes of memory one end will have touched: the pages with data, and
    /// the zero pages the dirtier writes to (untouched zero pages cost
    /// nothing).
    pub fn resident_estimate(&self) -> u64 {
        let share = |bytes: u64, percent: u8| {
            u64::try_from(u128::from(bytes) * u128::from(percent) / 100).unwrap_or(u64::MAX)
        };
        if self.touch_zero_pages {
            return self.memory;
        }
        share(self.memory, 100 - self.mix.zero)
            .saturating_add(share(self.working_set(), self.mix.zero))
    }

    pub fn synthetic_config(&self) -> SyntheticConfig {
        SyntheticConfig {
            memory_bytes: self.memory,
            regions: self.regions,
            mix: self.mix,
            seed: self.seed,
            dirty_rate_bytes_per_sec: self.dirty_rate,
            working_set_bytes: self.working_set(),
            dirtier_threads: self.dirtier_threads,
        }
    }
}

/// Options shared by everything that migrates.
#[derive(Debug, Args, Clone)]
pub struct TransferArgs {
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
    /// auto) trains 64KiB and keeps it when it improves zstd's ratio on
    /// pages the training did not see. QEMU: no parameter.
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
}

impl TransferArgs {
    /// The postcopy flags, applied to `config`.
    fn apply_postcopy(&self, config: &mut MigrationConfig) -> anyhow::Result<()> {
        config.postcopy = self.postcopy;
        config.postcopy_max_throttle = self.postcopy_max_throttle;
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
    pub fn compression_level_note(&self) -> Option<String> {
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
    fn dsa_config(&self) -> tern_dsa::DsaConfig {
        tern_dsa::DsaConfig {
            devices: match &self.dsa_device {
                tern_dsa::DsaDevice::Only(devices) => devices.clone(),
                _ => tern_dsa::DsaSelection::all(),
            },
            ..Default::default()
        }
    }

    /// One DSA engine over the hardware queues `--dsa-device` names, shared
    /// by zero-page detection and the delta offload (a dedicated queue takes
    /// a single opener); `None` when neither uses hardware DSA.
    fn open_dsa_engine(&self) -> anyhow::Result<Option<std::sync::Arc<tern_dsa::DsaOffload>>> {
        let zero = self.zero_page_detection == ZeroPageDetection::Dsa
            && self.dsa_device != tern_dsa::DsaDevice::Software;
        if !zero && self.delta_offload != DeltaOffloadChoice::Hardware {
            return Ok(None);
        }
        use anyhow::Context as _;
        tern_dsa::open_dsa_engine(&self.dsa_config())
            .map(Some)
            .with_context(|| format!("--dsa-device {}", self.dsa_device))
    }

    pub fn migration_config(&self) -> anyhow::Result<MigrationConfig> {
        let dsa_engine = self.open_dsa_engine()?;
        use anyhow::Context;
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
        config.zero_page_offload = match (self.zero_page_detection, &self.dsa_device, &dsa_engine) {
            (ZeroPageDetection::Dsa, tern_dsa::DsaDevice::Software, _) => Some(
                tern_dsa::software_dsa(tern_dsa::SoftwareDsaConfig::default()),
            ),
            (ZeroPageDetection::Dsa, _, Some(engine)) => {
                Some(engine.clone() as std::sync::Arc<dyn tern_page::ZeroPageOffload>)
            }
            _ => None,
        };
        config.zero_page_as_normal = self.zero_page_as_normal / 100.0;
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
        config.delta_offload = match self.delta_offload {
            DeltaOffloadChoice::Cpu => None,
            DeltaOffloadChoice::Software => Some(tern_dsa::software_delta_offload(
                tern_dsa::SoftwareDsaConfig::default(),
            )),
            DeltaOffloadChoice::Hardware => Some(match &dsa_engine {
                Some(engine) => std::sync::Arc::new(tern_dsa::DsaDeltaOffload::sharing(
                    engine.clone(),
                    tern_dsa::DELTA_DEADLINE,
                )),
                None => tern_dsa::open_delta_offload(&self.dsa_config())
                    .context("--delta-offload hw")?,
            }),
        };
        config.compression_dictionary = match self.compression_dictionary {
            DictionaryChoice::Size(bytes) => Some(bytes),
            DictionaryChoice::Auto | DictionaryChoice::Off => None,
        };
        config.auto_dictionary = self.compression_dictionary == DictionaryChoice::Auto;
        config.dictionary_refresh = self.dictionary_refresh;
        config.packet_frames = self.packet_frames;
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
}

/// `--compression-dictionary`: a size, or `off` (`None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DictionarySize(pub Option<usize>);

fn parse_dictionary_size(text: &str) -> Result<DictionarySize, String> {
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
pub enum DictionaryChoice {
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
pub struct DeltaCacheSize(pub Option<u64>);

fn parse_delta_cache_size(text: &str) -> Result<DeltaCacheSize, String> {
    if text.trim() == "auto" {
        return Ok(DeltaCacheSize(None));
    }
    parse_size(text).map(|bytes| DeltaCacheSize(Some(bytes)))
}

/// The `--qpl-path` values.
fn qpl_path_values() -> Choices<QplPath> {
    Choices::new(&[
        ("auto", "IAA when present, else QPL's software path"),
        ("hardware", "IAA only; fail without a usable IAA work queue"),
        (
            "software",
            "QPL's software path (libdeflate on a destination)",
        ),
    ])
}

pub fn parse_address(text: &str) -> Result<Address, String> {
    text.parse()
}

/// The engine's range, checked while parsing so that every command says
/// the same.
fn parse_channels(text: &str) -> Result<u16, String> {
    let max = tern_wire::MAX_CHANNELS;
    match text.trim().parse::<u64>() {
        Ok(channels) if (1..=u64::from(max)).contains(&channels) => Ok(channels as u16),
        _ => Err(format!("--channels {text} is out of range (1..={max})")),
    }
}

/// Where `--delta-offload` creates delta records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaOffloadChoice {
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
pub enum Dedup {
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
pub enum OnOff {
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

/// The `--workload` values of the test guest.
pub(crate) fn workload_values() -> Choices<tern_vmm::guest_code::Workload> {
    Choices::new(&[
        (
            "increment",
            "add one to each page's first byte (a one-byte change)",
        ),
        (
            "rewrite",
            "also rewrite the rest of each page with new random words",
        ),
    ])
}

fn compression_values() -> Choices<CodecChoice> {
    Choices::new(&[
        ("none", "pages go as they are"),
        ("zstd", "zstd, level 1 unless --compression-level"),
        ("deflate", "raw deflate, 4 KiB window (IAA-compatible)"),
        ("lz4", "lz4 block format"),
        ("qpl", "deflate through Intel QPL (IAA when present)"),
        ("auto", "picked from the measured link and codec speeds"),
    ])
}

fn postcopy_values() -> Choices<tern_engine::PostcopyMode> {
    Choices::new(&[
        ("off", "precopy only: throttle, or give up at a limit"),
        (
            "on-request",
            "precopy until migrate-start-postcopy (tern ctl) or --postcopy-after, then postcopy",
        ),
        (
            "auto",
            "postcopy instead of throttling past --postcopy-max-throttle or giving up at a limit",
        ),
        ("after-first-pass", "one full precopy pass, then postcopy"),
    ])
}

fn verify_values() -> Choices<Verify> {
    Choices::new(&[
        ("full", "compare digests of all memory before resuming"),
        (
            "strict",
            "full, and the source hashes all memory again while paused: a write its dirty log forgot is always found, at a longer downtime",
        ),
        ("none", "shortest downtime; trusts the dirty log"),
    ])
}

/// A value parser that lists its possible values (for help, completions
/// and docs/cli.md) but parses with the type's own `FromStr`, so that
/// aliases and helpful errors (`zlib`, `legacy`) stay in one place.
#[derive(Clone, Debug)]
pub struct Choices<T> {
    values: &'static [(&'static str, &'static str)],
    parsed: std::marker::PhantomData<fn() -> T>,
}

impl<T> Choices<T> {
    fn new(values: &'static [(&'static str, &'static str)]) -> Self {
        Self {
            values,
            parsed: std::marker::PhantomData,
        }
    }
}

impl<T, E> TypedValueParser for Choices<T>
where
    T: FromStr<Err = E> + Clone + Send + Sync + 'static,
    E: std::fmt::Display,
{
    type Value = T;

    fn parse_ref(
        &self,
        command: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<T, clap::Error> {
        let names: Vec<&str> = self.values.iter().map(|(name, _)| *name).collect();
        let names = names.join(", ");
        let parse = move |text: &str| {
            text.parse::<T>()
                .map_err(|error| format!("{error} (possible values: {names})"))
        };
        parse.parse_ref(command, arg, value)
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(
            self.values
                .iter()
                .map(|(name, help)| PossibleValue::new(*name).help(*help)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_a_migrate_command() {
        let cli = Cli::try_parse_from([
            "tern",
            "migrate",
            "--to",
            "127.0.0.1:7000",
            "--memory",
            "64M",
            "--mix",
            "10:80:10",
            "--channels",
            "4",
            "--max-bandwidth",
            "1Gbit",
        ])
        .unwrap();
        let Command::Migrate(args) = cli.command else {
            panic!("not migrate")
        };
        assert_eq!(args.guest.memory, 64 << 20);
        assert_eq!(args.transfer.channels, 4);
        assert_eq!(args.transfer.max_bandwidth, Some(125_000_000));
        assert!(Cli::try_parse_from(["tern", "migrate", "--to", "nowhere"]).is_err());
        assert!(Cli::try_parse_from(["tern", "demo", "--zero-page-detection", "magic"]).is_err());
    }

    fn demo(options: &[&str]) -> Result<DemoArgs, clap::Error> {
        let cli = Cli::try_parse_from(["tern", "demo"].iter().chain(options))?;
        let Command::Demo(args) = cli.command else {
            panic!("not demo")
        };
        Ok(args)
    }

    #[test]
    fn dedup_auto_follows_verification() {
        let dedup = |options: &[&str]| {
            demo(options)
                .unwrap()
                .transfer
                .migration_config()
                .unwrap()
                .dedup
        };
        assert!(dedup(&[]));
        assert!(!dedup(&["--verify", "none"]));
        assert!(dedup(&["--verify", "none", "--dedup", "on"]));
        assert!(!dedup(&["--dedup", "off"]));
        assert!(demo(&["--dedup", "sometimes"]).is_err());
    }

    #[test]
    fn accepts_qemu_spellings() {
        let cli = Cli::try_parse_from(["tern", "migrate", "--to", "tcp::4444"]).unwrap();
        let Command::Migrate(args) = cli.command else {
            panic!("not migrate")
        };
        assert_eq!(args.to, Address::Tcp(":4444".into()));
        let args = demo(&[
            "--zero-page-detection",
            "legacy",
            "--max-bandwidth",
            "1Gbps",
            "--auto-converge",
            "off",
            "--cpu-throttle-initial",
            "35",
            "--cpu-throttle-increment",
            "5",
        ])
        .unwrap();
        let config = args.transfer.migration_config().unwrap();
        assert_eq!(config.zero_page_detection, ZeroPageDetection::Source);
        assert_eq!(config.max_bandwidth, Some(125_000_000));
        assert!(!config.auto_converge);
        assert_eq!(
            (config.throttle_initial, config.throttle_increment),
            (35, 5)
        );
        let config = demo(&["--zero-page-detection", "multifd"])
            .unwrap()
            .transfer
            .migration_config()
            .unwrap();
        assert_eq!(config.zero_page_detection, ZeroPageDetection::Workers);
        assert!(config.auto_converge);
        let hidden_alias = demo(&["--no-auto-converge"]).unwrap();
        assert!(
            !hidden_alias
                .transfer
                .migration_config()
                .unwrap()
                .auto_converge
        );
        assert!(demo(&["--cpu-throttle-initial", "100"]).is_err());
        assert!(demo(&["--auto-converge", "maybe"]).is_err());
    }

    #[test]
    fn zlib_points_to_deflate() {
        let error = demo(&["--compression", "zlib"]).unwrap_err().to_string();
        assert!(error.contains("use deflate"), "{error}");
    }

    #[test]
    fn one_channel_range_everywhere() {
        for count in ["0", "65", "100000", "-1"] {
            let error = demo(&[&format!("--channels={count}")])
                .unwrap_err()
                .to_string();
            assert!(error.contains("out of range (1..=64)"), "{error}");
        }
        assert_eq!(demo(&["--channels", "64"]).unwrap().transfer.channels, 64);
        let engine = {
            let mut config = MigrationConfig::default();
            config.channels = 65;
            config
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(engine.contains("out of range (1..=64)"), "{engine}");
        let bench = Cli::try_parse_from(["tern", "bench", "migrate", "--channels", "1,0"]);
        assert!(
            bench
                .unwrap_err()
                .to_string()
                .contains("out of range (1..=64)")
        );
    }

    #[test]
    fn dsa_device_takes_hw_software_or_a_list() {
        use tern_dsa::DsaDevice;
        assert_eq!(demo(&[]).unwrap().transfer.dsa_device, DsaDevice::Hardware);
        let args = demo(&["--dsa-device", "software"]).unwrap();
        assert_eq!(args.transfer.dsa_device, DsaDevice::Software);
        let args = demo(&["--dsa-device", "dsa0,dsa2/wq2.1"]).unwrap();
        assert_eq!(args.transfer.dsa_device.to_string(), "dsa0,dsa2/wq2.1");
        let error = demo(&["--dsa-device", "gpu0"]).unwrap_err().to_string();
        assert!(
            error.contains("gpu0") && error.contains("dsa2/wq2.1"),
            "{error}"
        );
    }

    #[test]
    fn every_choice_option_lists_its_values() {
        use clap::CommandFactory;
        let mut command = Cli::command();
        command.build();
        let demo = command.find_subcommand("demo").unwrap();
        for name in [
            "on_limit",
            "zero_page_detection",
            "dsa_device",
            "compression",
            "verify",
            "zero_copy_backend",
            "auto_converge",
            "color",
        ] {
            let arg = demo
                .get_arguments()
                .find(|arg| arg.get_id() == name)
                .unwrap_or_else(|| panic!("no option {name}"));
            assert!(
                arg.get_possible_values().len() >= 2,
                "--{name} lists no values"
            );
        }
    }

    #[test]
    fn top_level_help_lists_every_command() {
        use clap::CommandFactory;
        let mut command = Cli::command();
        let help = command.render_help().to_string();
        for subcommand in command.get_subcommands() {
            assert!(
                help.contains(&format!("  {}", subcommand.get_name())),
                "{} is missing from:\n{help}",
                subcommand.get_name()
            );
        }
        assert!(help.contains("  vm "), "{help}");
    }

    #[test]
    fn working_set_must_fit_in_memory() {
        let error = demo(&["--memory", "64MiB", "--working-set", "4GiB"])
            .unwrap()
            .guest
            .check()
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            "--working-set 4.00 GiB is larger than --memory 64.00 MiB"
        );
        let small = demo(&["--memory", "32MiB"]).unwrap().guest;
        small.check().unwrap();
        assert_eq!(small.working_set(), 32 << 20);
        assert_eq!(demo(&[]).unwrap().guest.working_set(), 256 << 20);
    }

    #[test]
    fn resident_estimate_skips_untouched_zero_pages() {
        let guest = demo(&[
            "--memory",
            "1GiB",
            "--mix",
            "50:25:25",
            "--working-set",
            "0",
        ])
        .unwrap()
        .guest;
        assert_eq!(guest.resident_estimate(), 512 << 20);
        let guest = demo(&["--memory", "1GiB", "--mix", "0:100:0"])
            .unwrap()
            .guest;
        assert_eq!(guest.resident_estimate(), 1 << 30);
    }

    #[test]
    fn out_of_range_levels_are_named() {
        let note = |options: &[&str]| demo(options).unwrap().transfer.compression_level_note();
        let zstd = note(&["--compression", "zstd", "--compression-level", "99"]).unwrap();
        assert!(zstd.ends_with("so 22"), "{zstd}");
        let deflate = note(&["--compression", "deflate", "--compression-level", "0"]).unwrap();
        assert!(deflate.ends_with("so 1"), "{deflate}");
        let qpl = note(&["--compression", "qpl", "--compression-level", "9"]).unwrap();
        assert!(qpl.ends_with("so 3"), "{qpl}");
        assert!(
            note(&["--compression", "none", "--compression-level", "3"])
                .unwrap()
                .contains("no effect")
        );
        // The default is auto, which clamps per codec.
        assert_eq!(note(&["--compression-level", "3"]), None);
        assert_eq!(
            note(&["--compression", "zstd", "--compression-level", "-5"]),
            None
        );
        assert_eq!(note(&["--compression", "zstd"]), None);
    }

    #[test]
    fn colour_follows_the_option() {
        let cli = Cli::try_parse_from(["tern", "--color", "never", "bench", "codec"]).unwrap();
        assert!(!cli.log_colour());
        let cli = Cli::try_parse_from(["tern", "bench", "codec", "--color", "always"]).unwrap();
        assert!(cli.log_colour());
    }
}

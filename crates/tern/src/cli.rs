//! Command-line syntax.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tern_engine::{
    Address, LimitPolicy, MigrationConfig, Verify, ZeroCopyBackend, ZeroPageDetection,
};
use tern_page::codec::CodecChoice;
use tern_synthetic::{ContentMix, SyntheticConfig};

use crate::units::{parse_rate, parse_size};

/// Live migration of virtual-machine memory over parallel channels.
#[derive(Debug, Parser)]
#[command(name = "tern", version, about)]
pub struct Cli {
    /// Log what happens (or set RUST_LOG).
    #[arg(short, long, global = true)]
    pub verbose: bool,
    #[command(flatten)]
    pub progress: crate::report::ProgressArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Migrate a built-in synthetic guest to a destination on this machine,
    /// both ends in one process, with progress and a summary.
    Demo(DemoArgs),
    /// Migrate a synthetic guest to a `tern receive` destination.
    Migrate(MigrateArgs),
    /// Receive one migration and verify it.
    Receive(ReceiveArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// A real KVM guest: run, migrate, receive, demo.
    #[command(subcommand)]
    Vm(crate::vm::VmCommand),
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
    /// Print one JSON document instead of the summary table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Destination: HOST:PORT, tcp:HOST:PORT or unix:PATH.
    #[arg(long, value_parser = parse_address)]
    pub to: Address,
    #[command(flatten)]
    pub guest: GuestArgs,
    #[command(flatten)]
    pub transfer: TransferArgs,
    /// Print one JSON document instead of the summary table.
    #[arg(long)]
    pub json: bool,
}

/// Where and how a destination waits (`tern receive`, `tern vm receive`).
#[derive(Debug, Args)]
pub struct ListenArgs {
    /// Where to listen: HOST:PORT, tcp:HOST:PORT or unix:PATH.
    #[arg(long, value_parser = parse_address)]
    pub listen: Address,
    /// How long to wait for the source, in seconds.
    #[arg(long, default_value_t = 300)]
    pub accept_timeout: u64,
    /// Longest silence tolerated from the source once it is connected, in
    /// seconds.
    #[arg(long, default_value_t = 30)]
    pub io_timeout: u64,
}

impl ListenArgs {
    /// Binds the listener and builds the destination's settings.
    pub fn bind(&self) -> anyhow::Result<(tern_engine::Listener, tern_engine::ReceiveConfig)> {
        use anyhow::Context;
        let listener = tern_engine::Listener::bind(&self.listen)
            .with_context(|| format!("cannot listen on {}", self.listen))?;
        let config = tern_engine::ReceiveConfig {
            accept_timeout: Duration::from_secs(self.accept_timeout),
            io_timeout: Duration::from_secs(self.io_timeout),
        };
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
    /// Print one JSON document instead of the summary table.
    #[arg(long)]
    pub json: bool,
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
    #[arg(long, default_value = "1,2,4", value_delimiter = ',')]
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
    /// Memory verification at switch-over: full or none.
    #[arg(long, default_value = "full", value_parser = parse_verify)]
    pub verify: Verify,
    /// Compression settings to compare, comma-separated.
    #[arg(long, default_value = "none", value_delimiter = ',', value_parser = parse_compression)]
    pub compression: Vec<CodecChoice>,
    /// Cap on bytes per second (e.g. 1Gbit), as through a slower link.
    #[arg(long, value_parser = parse_rate)]
    pub max_bandwidth: Option<u64>,
    /// Also run each case with --zero-copy.
    #[arg(long)]
    pub zero_copy: bool,
    /// Print JSON instead of a Markdown table.
    #[arg(long)]
    pub json: bool,
}

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
    /// The part of memory the guest dirties, from its start.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub working_set: u64,
    /// Dirtier threads.
    #[arg(long, default_value_t = 1)]
    pub dirtier_threads: u32,
    /// Memory regions the guest is split into.
    #[arg(long, default_value_t = 1)]
    pub regions: u32,
    /// Seed of the content and of the dirtier.
    #[arg(long, default_value_t = 0x7e57)]
    pub seed: u64,
}

impl GuestArgs {
    pub fn synthetic_config(&self) -> SyntheticConfig {
        SyntheticConfig {
            memory_bytes: self.memory,
            regions: self.regions,
            mix: self.mix,
            seed: self.seed,
            dirty_rate_bytes_per_sec: self.dirty_rate,
            working_set_bytes: self.working_set,
            dirtier_threads: self.dirtier_threads,
        }
    }
}

/// Options shared by everything that migrates.
#[derive(Debug, Args, Clone)]
pub struct TransferArgs {
    /// Page channels (the main channel comes on top).
    #[arg(long, default_value_t = 2)]
    pub channels: u16,
    /// Worker threads classifying pages (0: one per channel).
    #[arg(long, default_value_t = 0)]
    pub workers: usize,
    /// Largest acceptable downtime, in milliseconds.
    #[arg(long, default_value_t = 300)]
    pub downtime_limit: u64,
    /// Cap on bytes per second over all channels (e.g. 1Gbit, 100MiB).
    #[arg(long, value_parser = parse_rate)]
    pub max_bandwidth: Option<u64>,
    /// Most dirty iterations before --on-limit applies.
    #[arg(long)]
    pub max_iterations: Option<u32>,
    /// Longest live phase in seconds before --on-limit applies.
    #[arg(long)]
    pub max_time: Option<f64>,
    /// What to do at a limit: cancel, or switch-over anyway.
    #[arg(long, default_value = "cancel", value_parser = parse_policy)]
    pub on_limit: LimitPolicy,
    /// Who detects zero pages: none, source, workers, dsa.
    #[arg(long, default_value = "workers", value_parser = parse_detection)]
    pub zero_page_detection: ZeroPageDetection,
    /// With `--zero-page-detection dsa`: the work queues found in sysfs
    /// (`hw`), or tern's software DSA device (`software`, for machines
    /// without DSA; it runs the same descriptors on a CPU thread).
    #[arg(long, default_value = "hw", value_parser = ["hw", "software"])]
    pub dsa_device: String,
    /// Benchmark knob: percent of zero pages sent as normal pages.
    #[arg(long, default_value_t = 0.0)]
    pub zero_page_as_normal: f64,
    /// Page compression: none, zstd, deflate, lz4, qpl, auto.
    #[arg(long, default_value = "none", value_parser = parse_compression)]
    pub compression: CodecChoice,
    /// Compression level (clamped to the codec's range; reported).
    #[arg(long)]
    pub compression_level: Option<i32>,
    /// Compare memory digests before resuming on the destination: full, or
    /// none (shortest downtime, trusts the dirty log).
    #[arg(long, default_value = "full", value_parser = parse_verify)]
    pub verify: Verify,
    /// Send page data with MSG_ZEROCOPY straight from guest memory (TCP only;
    /// pays off on a real NIC, not on loopback, where the kernel copies).
    #[arg(long)]
    pub zero_copy: bool,
    /// Zero-copy mechanism: msg (MSG_ZEROCOPY) or uring (io_uring SENDMSG_ZC).
    #[arg(long, default_value = "msg", value_parser = parse_zero_copy_backend)]
    pub zero_copy_backend: ZeroCopyBackend,
    /// Do not throttle a guest that dirties memory faster than it is sent.
    #[arg(long)]
    pub no_auto_converge: bool,
    /// Timeout of a blocked send or receive, in seconds.
    #[arg(long, default_value_t = 30)]
    pub io_timeout: u64,
    /// How long to keep trying to reach the destination, in seconds.
    #[arg(long, default_value_t = 10)]
    pub connect_timeout: u64,
}

impl TransferArgs {
    pub fn migration_config(&self) -> anyhow::Result<MigrationConfig> {
        let max_time = match self.max_time {
            Some(seconds) if seconds.is_finite() && seconds > 0.0 => {
                Some(Duration::from_secs_f64(seconds))
            }
            Some(seconds) => anyhow::bail!("--max-time {seconds} must be a positive number"),
            None => None,
        };
        Ok(MigrationConfig {
            channels: self.channels,
            workers: self.workers,
            downtime_limit: Duration::from_millis(self.downtime_limit),
            max_bandwidth: self.max_bandwidth,
            max_iterations: self.max_iterations,
            max_time,
            limit_policy: self.on_limit,
            auto_converge: !self.no_auto_converge,
            zero_page_detection: self.zero_page_detection,
            zero_page_offload: match (self.zero_page_detection, self.dsa_device.as_str()) {
                (ZeroPageDetection::Dsa, "software") => Some(tern_page::dsa::software_dsa(
                    tern_page::dsa::SoftwareDsaConfig::default(),
                )),
                _ => None,
            },
            zero_page_as_normal: self.zero_page_as_normal / 100.0,
            compression: self.compression,
            compression_level: self.compression_level,
            verify: self.verify,
            zero_copy: self.zero_copy,
            zero_copy_backend: self.zero_copy_backend,
            io_timeout: Duration::from_secs(self.io_timeout),
            connect_timeout: Duration::from_secs(self.connect_timeout),
            ..MigrationConfig::default()
        })
    }
}

fn parse_address(text: &str) -> Result<Address, String> {
    text.parse()
}

fn parse_policy(text: &str) -> Result<LimitPolicy, String> {
    text.parse()
}

fn parse_compression(text: &str) -> Result<CodecChoice, String> {
    text.parse()
        .map_err(|error: tern_page::CodecError| error.to_string())
}

fn parse_zero_copy_backend(text: &str) -> Result<ZeroCopyBackend, String> {
    text.parse()
}

fn parse_verify(text: &str) -> Result<Verify, String> {
    text.parse()
}

fn parse_detection(text: &str) -> Result<ZeroPageDetection, String> {
    text.parse()
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
}

//! `tern bench`'s syntax.

use clap::{Args, Subcommand};
use tern_engine::Verify;
use tern_page::codec::CodecChoice;
use tern_synthetic::ContentMix;

use super::transfer::{DictionarySize, parse_dictionary_size};
use super::values::{compression_values, parse_channels, verify_values};
use crate::units::{parse_rate, parse_size};

#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
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
pub(crate) struct BenchZeroArgs {
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
pub(crate) struct BenchCodecArgs {
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
pub(crate) struct BenchMigrateArgs {
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

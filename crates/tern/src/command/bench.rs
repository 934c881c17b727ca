//! `tern bench`: measured, not claimed. Every figure is a median over
//! several runs made side by side in one invocation.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use serde::Serialize;
use tern_engine::{
    Address, GuestControl, Listener, MigrationConfig, ReceiveConfig, Source, Verify,
};
use tern_page::codec::CodecChoice;
use tern_synthetic::{SyntheticConfig, SyntheticGuest};

use crate::args::bench::{BenchCodecArgs, BenchCommand, BenchMigrateArgs, BenchZeroArgs};
use crate::report::print_json;
use crate::session::{destination_guest, spawn_local_destination};

/// `tern bench ...`.
pub(crate) fn run(command: BenchCommand) -> anyhow::Result<ExitCode> {
    match command {
        BenchCommand::Migrate(args) => bench_migrate(&args),
        BenchCommand::Zero(args) => bench_zero(&args),
        BenchCommand::Codec(args) => bench_codec(&args),
    }
}

#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct ZeroRow {
    backend: String,
    case: &'static str,
    /// GiB of pages checked per second, from the median round.
    gib_per_s: f64,
    /// `gib_per_s` over the plain read loop's rate (the report's
    /// `read-loop-gib-per-s`): 1.0 is reading every byte at memory speed.
    times_read_loop: f64,
}

/// The cases of `tern_dsa::bench_zero`, with the words a table uses.
const ZERO_CASES: [(&str, &str); 3] = [
    ("zero", "zero pages"),
    ("first-byte", "first byte non-zero"),
    ("last-byte", "last byte non-zero"),
];

// long: one report read top to bottom: the rows, the JSON document or the table, the DSA line
fn bench_zero(args: &BenchZeroArgs) -> anyhow::Result<ExitCode> {
    let buffer = usize::try_from(args.buffer).context("--buffer is too large")?;
    if buffer < tern_page::PAGE_SIZE || args.rounds == 0 {
        bail!("--buffer must hold at least one page and --rounds must be at least 1");
    }
    const GIB: f64 = (1u64 << 30) as f64;
    let tern_dsa::ZeroBench { rows, dsa } = tern_dsa::bench_zero_report(buffer, args.rounds);
    let dsa_report = DsaReport::from(&dsa);
    // The read loop reads every byte whatever the pages hold, so its three
    // measurements (one per case) are one figure; their median is the
    // steadiest baseline on a shared machine.
    let mut read_loop: Vec<f64> = rows
        .iter()
        .filter(|row| row.backend == "read-bandwidth")
        .map(|row| row.gb_per_s * 1e9 / GIB)
        .collect();
    let read_loop_gib_per_s = median(&mut read_loop);
    let rows: Vec<ZeroRow> = rows
        .into_iter()
        .map(|row| {
            let gib_per_s = row.gb_per_s * 1e9 / GIB;
            ZeroRow {
                times_read_loop: if read_loop_gib_per_s > 0.0 {
                    gib_per_s / read_loop_gib_per_s
                } else {
                    0.0
                },
                backend: row.backend,
                case: row.case,
                gib_per_s,
            }
        })
        .collect();
    let default_backend = tern_page::zero::ZeroChecker::best().backend().name();
    if args.json {
        #[derive(Serialize)]
        #[serde(rename_all = "kebab-case")]
        struct Report<'a> {
            machine: String,
            buffer_bytes: u64,
            rounds: usize,
            default_backend: &'a str,
            /// A plain loop reading every byte of the buffer: the baseline
            /// of every row's `times-read-loop`.
            read_loop_gib_per_s: f64,
            rows: &'a [ZeroRow],
            /// What the hardware DSA did, or why it has no row.
            dsa: &'a DsaReport,
        }
        print_json(&Report {
            machine: machine_name(),
            buffer_bytes: args.buffer,
            rounds: args.rounds,
            default_backend,
            read_loop_gib_per_s,
            rows: &rows,
            dsa: &dsa_report,
        })?;
    } else {
        println!(
            "Machine: {}. Buffer {}, median of {} rounds, one thread.\n",
            machine_name(),
            crate::units::human_bytes(args.buffer),
            args.rounds
        );
        println!(
            "GiB of pages checked per second and, in brackets, that speed as a multiple of a\n\
             plain loop reading every byte of the same buffer ({read_loop_gib_per_s:.1} GiB/s here; with a\n\
             buffer larger than the caches, the memory's read bandwidth). A zero page must be\n\
             read in full, so 1.0x is its ceiling; a non-zero page is rejected after a few\n\
             words, so those rows beat the read loop.\n"
        );
        println!(
            "| backend | {} | {} | {} |",
            ZERO_CASES[0].1, ZERO_CASES[1].1, ZERO_CASES[2].1
        );
        println!("|---|---:|---:|---:|");
        let mut backends: Vec<&str> = Vec::new();
        for row in &rows {
            if row.backend != "read-bandwidth" && !backends.contains(&row.backend.as_str()) {
                backends.push(&row.backend);
            }
        }
        for backend in backends {
            let cells: Vec<String> = ZERO_CASES
                .iter()
                .map(|(case, _)| {
                    rows.iter()
                        .find(|row| row.backend == backend && row.case == *case)
                        .map_or_else(
                            || "-".to_string(),
                            |row| {
                                format!("{:.1} GiB/s ({:.1}x)", row.gib_per_s, row.times_read_loop)
                            },
                        )
                })
                .collect();
            let label = if backend == default_backend {
                format!("{backend} (default here)")
            } else {
                backend.to_string()
            };
            println!("| {label} | {} |", cells.join(" | "));
        }
        println!();
        dsa_report.print();
    }
    Ok(ExitCode::SUCCESS)
}

/// The hardware DSA's part of `tern bench zero`: its counters over every
/// round, or why it was not measured.
#[derive(Serialize, Default)]
#[serde(rename_all = "kebab-case")]
struct DsaReport {
    /// Why there is no `dsa` row (the error opening it); absent when
    /// measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    missing: Option<String>,
    /// The engine: queues and submission method.
    describe: String,
    pages_device: u64,
    cpu_fallbacks: u64,
    page_faults: u64,
    device_errors: u64,
    queues_disabled: u64,
}

impl DsaReport {
    /// The line under the table: the device's counters, or why it has no
    /// row.
    fn print(&self) {
        match &self.missing {
            Some(why) => println!("No dsa row: {why}"),
            None => println!(
                "dsa: {}; {} pages on the device, {} device errors, {} page faults, {} CPU \
                 fallbacks, {} queues retired",
                self.describe,
                self.pages_device,
                self.device_errors,
                self.page_faults,
                self.cpu_fallbacks,
                self.queues_disabled
            ),
        }
    }
}

impl From<&tern_dsa::DsaBench> for DsaReport {
    fn from(dsa: &tern_dsa::DsaBench) -> Self {
        match dsa {
            tern_dsa::DsaBench::Missing(why) => DsaReport {
                missing: Some(why.clone()),
                ..DsaReport::default()
            },
            tern_dsa::DsaBench::Measured { describe, stats } => DsaReport {
                missing: None,
                describe: describe.clone(),
                pages_device: stats.pages_device,
                cpu_fallbacks: stats.pages_fallback,
                page_faults: stats.page_faults,
                device_errors: stats.device_errors,
                queues_disabled: stats.queues_disabled,
            },
        }
    }
}

#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct CodecRow {
    corpus: &'static str,
    codec: &'static str,
    level: i32,
    sampling: bool,
    compress_mb_s: f64,
    /// `None` (JSON `null`) when every page went raw: nothing was
    /// decompressed.
    decompress_mb_s: Option<f64>,
    ratio: f64,
    raw_pages: usize,
    pages: usize,
}

fn bench_codec(args: &BenchCodecArgs) -> anyhow::Result<ExitCode> {
    if args.pages == 0 {
        bail!("--pages must be at least 1");
    }
    let rows: Vec<CodecRow> =
        tern_page::codec::bench_codecs(args.pages, &tern_page::codec::default_bench_levels())?
            .into_iter()
            .map(|row| CodecRow {
                corpus: row.corpus,
                codec: row.codec.name(),
                level: row.level,
                sampling: row.sampling,
                compress_mb_s: row.compress_mb_s,
                decompress_mb_s: row.decompress_mb_s,
                ratio: row.ratio,
                raw_pages: row.raw_pages,
                pages: row.pages,
            })
            .collect();
    let variants = zstd_variant_rows(args)?;
    if args.json {
        #[derive(Serialize)]
        #[serde(rename_all = "kebab-case")]
        struct Report<'a> {
            machine: String,
            rows: &'a [CodecRow],
            zstd_variants: &'a [ZstdVariantRow],
        }
        print_json(&Report {
            machine: machine_name(),
            rows: &rows,
            zstd_variants: &variants,
        })?;
    } else {
        println!(
            "Machine: {}. One thread, {} pages per corpus, median of 5 rounds.\n",
            machine_name(),
            args.pages
        );
        println!(
            "MB/s are 10^6 bytes of guest memory per second. Decompress counts only the pages\n\
             that were compressed; \"- (all raw)\" where every page went raw and nothing was\n\
             decompressed. Ratio is guest bytes over wire bytes (a raw page costs 4096).\n\
             Sampling skips pages that look incompressible after a cheap probe.\n"
        );
        println!(
            "| corpus | codec | level | sampling | compress MB/s | decompress MB/s | ratio | pages sent raw |"
        );
        println!("|---|---|---:|---|---:|---:|---:|---:|");
        for row in &rows {
            println!(
                "| {} | {} | {} | {} | {:.0} | {} | {:.2} | {} of {} |",
                row.corpus,
                row.codec,
                row.level,
                if row.sampling { "on" } else { "off" },
                row.compress_mb_s,
                row.decompress_mb_s
                    .map_or_else(|| "- (all raw)".to_string(), |rate| format!("{rate:.0}")),
                row.ratio,
                row.raw_pages,
                row.pages
            );
        }
        print_zstd_variants(&variants);
    }
    Ok(ExitCode::SUCCESS)
}

/// zstd per page, with a dictionary, in packet frames, and both: level 1,
/// on the mixed corpus and on `--image`; median of 3 rounds.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct ZstdVariantRow {
    corpus: String,
    variant: &'static str,
    level: i32,
    dictionary_bytes: Option<usize>,
    training_ms: Option<f64>,
    compress_mb_s: f64,
    decompress_mb_s: Option<f64>,
    ratio: f64,
    pages: usize,
}

fn zstd_variant_rows(args: &BenchCodecArgs) -> anyhow::Result<Vec<ZstdVariantRow>> {
    use tern_page::codec::{DICTIONARY_SAMPLE_PAGES, PacketCorpus, bench_zstd_variants};
    let dictionary = args.dictionary.0.unwrap_or(64 << 10);
    let mut corpora = vec![PacketCorpus::synthetic(
        "mixed",
        &["random", "text", "binary"],
        args.pages,
    )];
    if let Some(path) = &args.image {
        let image = std::fs::read(path)
            .with_context(|| format!("cannot read --image {}", path.display()))?;
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |name| name.to_string_lossy().into_owned(),
        );
        corpora.push(PacketCorpus::from_image(
            &name,
            &image,
            args.pages,
            DICTIONARY_SAMPLE_PAGES,
        ));
    }
    let mut rows = Vec::new();
    for corpus in &corpora {
        for row in bench_zstd_variants(corpus, 1, dictionary, 3)? {
            rows.push(ZstdVariantRow {
                corpus: row.corpus,
                variant: row.variant,
                level: row.level,
                dictionary_bytes: row.dictionary_bytes,
                training_ms: row.training_ms,
                compress_mb_s: row.compress_mb_s,
                decompress_mb_s: row.decompress_mb_s,
                ratio: row.ratio,
                pages: row.pages,
            });
        }
    }
    Ok(rows)
}

fn print_zstd_variants(rows: &[ZstdVariantRow]) {
    println!(
        "\nzstd beyond one page (level 1, data pages only, in packets of up to 128 pages as\n\
         the pipeline cuts memory; the dictionary is trained on other pages of the corpus;\n\
         median of 3 rounds):\n"
    );
    println!(
        "| corpus | variant | dictionary bytes | training ms | compress MB/s | decompress MB/s | ratio | pages |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let or_dash = |value: Option<String>| value.unwrap_or_else(|| "-".into());
    for row in rows {
        println!(
            "| {} | {} | {} | {} | {:.0} | {} | {:.2} | {} |",
            row.corpus,
            row.variant,
            or_dash(row.dictionary_bytes.map(|bytes| bytes.to_string())),
            or_dash(row.training_ms.map(|ms| format!("{ms:.0}"))),
            row.compress_mb_s,
            or_dash(row.decompress_mb_s.map(|rate| format!("{rate:.0}"))),
            row.ratio,
            row.pages
        );
    }
}

/// One run's figures.
#[derive(Clone, Copy, Debug, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
struct RunFigures {
    total_ms: f64,
    downtime_ms: f64,
    setup_ms: f64,
    iterations: f64,
    /// Guest memory per second of total time.
    throughput_gib_s: f64,
    /// Wire throughput.
    mbps: f64,
    transferred_gib: f64,
    source_cpu_s_per_gib: f64,
    destination_cpu_s_per_gib: f64,
    destination_digest_ms: f64,
    source_digest_ms: f64,
    expected_downtime_ms: f64,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
struct CaseResult {
    guest: &'static str,
    channels: u16,
    compression: &'static str,
    zero_copy: bool,
    verify: &'static str,
    /// Destination decoder threads: a count, or `auto` (one per core).
    decode_threads: String,
    runs: usize,
    median: RunFigures,
    all: Vec<RunFigures>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
struct BenchReport {
    machine: String,
    max_bandwidth_bytes_per_sec: Option<u64>,
    memory_bytes: u64,
    mix: String,
    dirty_rate_bytes_per_sec: u64,
    working_set_bytes: u64,
    cases: Vec<CaseResult>,
}

fn bench_migrate(args: &BenchMigrateArgs) -> anyhow::Result<ExitCode> {
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let mut cases = Vec::new();
    let modes: &[(&'static str, u64)] = if args.paused_only {
        &[("paused", 0)]
    } else {
        &[("paused", 0), ("dirtying", args.dirty_rate)]
    };
    let settings = bench_cases(args);
    for &(mode, dirty_rate) in modes {
        eprintln!(
            "bench: filling a {} {mode} guest...",
            crate::units::human_bytes(args.memory)
        );
        let mut guest = SyntheticGuest::new(&SyntheticConfig {
            memory_bytes: args.memory,
            regions: 1,
            mix: args.mix,
            seed: 42,
            dirty_rate_bytes_per_sec: dirty_rate,
            working_set_bytes: args.working_set,
            dirtier_threads: 1,
        })
        .context("cannot create the guest")?;
        let runs = run_interleaved(&mut guest, mode, dirty_rate, &settings, args)?;
        for (case, all) in settings.iter().zip(runs) {
            cases.push(CaseResult {
                guest: mode,
                channels: case.channels,
                compression: case.compression.name(),
                zero_copy: case.zero_copy,
                verify: case.verify.as_str(),
                decode_threads: case.decoders(),
                runs: all.len(),
                median: median_figures(&all),
                all,
            });
        }
    }
    let report = BenchReport {
        machine: machine_name(),
        max_bandwidth_bytes_per_sec: args.max_bandwidth,
        memory_bytes: args.memory,
        mix: format!("{}:{}:{}", args.mix.zero, args.mix.random, args.mix.text),
        dirty_rate_bytes_per_sec: args.dirty_rate,
        working_set_bytes: args.working_set,
        cases,
    };
    if args.json {
        print_json(&report)?;
    } else {
        print_markdown(&report);
    }
    Ok(ExitCode::SUCCESS)
}

/// Every combination of the options' lists, less zero-copy with a codec
/// (zero-copy sends pages as they are).
fn bench_cases(args: &BenchMigrateArgs) -> Vec<Case> {
    let zero_copy_settings: &[bool] = if args.zero_copy {
        &[false, true]
    } else {
        &[false]
    };
    let decode_settings: Vec<Option<usize>> = if args.decode_threads.is_empty() {
        vec![None]
    } else {
        args.decode_threads.iter().copied().map(Some).collect()
    };
    let mut settings = Vec::new();
    for &channels in &args.channels {
        for &compression in &args.compression {
            for &zero_copy in zero_copy_settings {
                for &verify in &args.verify {
                    for &decode_threads in &decode_settings {
                        if !(zero_copy && compression != CodecChoice::None) {
                            settings.push(Case {
                                channels,
                                compression,
                                zero_copy,
                                verify,
                                decode_threads,
                            });
                        }
                    }
                }
            }
        }
    }
    settings
}

/// Runs every case `--runs` times, interleaved run by run so that slow
/// drifts of a shared machine spread over every case instead of one; the
/// figures of each case's runs, in the order of `settings`.
fn run_interleaved(
    guest: &mut SyntheticGuest,
    mode: &str,
    dirty_rate: u64,
    settings: &[Case],
    args: &BenchMigrateArgs,
) -> anyhow::Result<Vec<Vec<RunFigures>>> {
    let mut runs: Vec<Vec<RunFigures>> = vec![Vec::new(); settings.len()];
    for run in 0..args.runs {
        for (index, case) in settings.iter().enumerate() {
            let figures = one_run(guest, case, args).with_context(|| {
                format!(
                    "{mode} run {run} with {} channels, compression {}",
                    case.channels, case.compression
                )
            })?;
            eprintln!(
                "bench: {mode:>8} {} ch {:>7}{} verify {} decoders {} run {run}: total {:.0} ms, downtime {:.0} ms (expected {:.0}), {:.2} GiB/s",
                case.channels,
                case.compression.name(),
                if case.zero_copy { " zero-copy" } else { "" },
                case.verify.as_str(),
                case.decoders(),
                figures.total_ms,
                figures.downtime_ms,
                figures.expected_downtime_ms,
                figures.throughput_gib_s
            );
            runs[index].push(figures);
            if dirty_rate > 0 {
                guest.resume().context("cannot resume the source guest")?;
            }
        }
    }
    Ok(runs)
}

/// One configuration compared by `bench migrate`.
struct Case {
    channels: u16,
    compression: CodecChoice,
    zero_copy: bool,
    verify: Verify,
    /// `ReceiveConfig::decode_threads`.
    decode_threads: Option<usize>,
}

impl Case {
    /// The decoder thread count as the report shows it.
    fn decoders(&self) -> String {
        self.decode_threads
            .map_or_else(|| "auto".to_string(), |threads| threads.to_string())
    }
}

fn one_run(
    guest: &mut SyntheticGuest,
    case: &Case,
    args: &BenchMigrateArgs,
) -> anyhow::Result<RunFigures> {
    let memory = args.memory;
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into()))?;
    let address = listener.local_address()?;
    let mut receive_config = ReceiveConfig::default();
    // The benchmark's own source: its --verify choice stands.
    receive_config.allow_unverified = true;
    receive_config.decode_threads = case.decode_threads;
    let destination = spawn_local_destination(listener, receive_config, destination_guest);
    let source = Source::new({
        let mut config = MigrationConfig::default();
        config.channels = case.channels;
        config.compression = case.compression;
        config.zero_copy = case.zero_copy;
        config.max_bandwidth = args.max_bandwidth;
        config.verify = case.verify;
        config
    })?;
    let result = source.migrate(guest, &address);
    let received = destination.finish(result.is_ok());
    let stats = result.map_err(|failure| anyhow::anyhow!(failure.error.chain()))?;
    let received = received?;
    let gib = memory as f64 / (1u64 << 30) as f64;
    let figures = RunFigures {
        total_ms: stats.total_time as f64,
        downtime_ms: stats.downtime as f64,
        setup_ms: stats.setup_time as f64,
        iterations: stats.ram.iterations as f64,
        throughput_gib_s: gib / (stats.total_time as f64 / 1000.0).max(1e-3),
        mbps: stats.ram.mbps,
        transferred_gib: stats.ram.transferred as f64 / (1u64 << 30) as f64,
        source_cpu_s_per_gib: stats.cpu_seconds.values().sum::<f64>() / gib,
        destination_cpu_s_per_gib: received.stats.cpu_seconds.values().sum::<f64>() / gib,
        destination_digest_ms: received.stats.digest_time as f64,
        source_digest_ms: stats.digest_time as f64,
        expected_downtime_ms: stats.expected_downtime as f64,
    };
    // Free the destination's memory before the next run.
    drop(received);
    std::thread::sleep(Duration::from_millis(200));
    Ok(figures)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn median_figures(all: &[RunFigures]) -> RunFigures {
    let pick = |field: fn(&RunFigures) -> f64| {
        let mut values: Vec<f64> = all.iter().map(field).collect();
        median(&mut values)
    };
    RunFigures {
        total_ms: pick(|f| f.total_ms),
        downtime_ms: pick(|f| f.downtime_ms),
        setup_ms: pick(|f| f.setup_ms),
        iterations: pick(|f| f.iterations),
        throughput_gib_s: pick(|f| f.throughput_gib_s),
        mbps: pick(|f| f.mbps),
        transferred_gib: pick(|f| f.transferred_gib),
        source_cpu_s_per_gib: pick(|f| f.source_cpu_s_per_gib),
        destination_cpu_s_per_gib: pick(|f| f.destination_cpu_s_per_gib),
        destination_digest_ms: pick(|f| f.destination_digest_ms),
        source_digest_ms: pick(|f| f.source_digest_ms),
        expected_downtime_ms: pick(|f| f.expected_downtime_ms),
    }
}

/// CPU model, core count and memory, for the record.
pub(crate) fn machine_name() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split(':').nth(1))
                .map(|name| name.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let memory_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|line| line.starts_with("MemTotal:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map_or(0.0, |kib| kib as f64 / (1u64 << 20) as f64);
    format!("{cpu}, {cores} cores, {memory_gib:.0} GiB")
}

fn print_markdown(report: &BenchReport) {
    println!(
        "Machine: {}. Guest: {} ({} zero:random:text), dirtying case {} /s over {}.\n",
        report.machine,
        crate::units::human_bytes(report.memory_bytes),
        report.mix,
        crate::units::human_bytes(report.dirty_rate_bytes_per_sec),
        crate::units::human_bytes(report.working_set_bytes),
    );
    if let Some(cap) = report.max_bandwidth_bytes_per_sec {
        println!("Bandwidth cap: {:.0} Mbit/s.\n", cap as f64 * 8.0 / 1e6);
    }
    println!(
        "| guest | channels | compression | zero-copy | verify | decoders | runs | total (ms) | downtime (ms) | expected downtime (ms) | of which source digest (ms) | iterations | GiB/s | wire Mbit/s | transferred (GiB) | source CPU s/GiB | destination CPU s/GiB |"
    );
    println!("|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for case in &report.cases {
        let m = &case.median;
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} | {:.3} | {:.3} |",
            case.guest,
            case.channels,
            case.compression,
            if case.zero_copy { "yes" } else { "no" },
            case.verify,
            case.decode_threads,
            case.runs,
            m.total_ms,
            m.downtime_ms,
            m.expected_downtime_ms,
            m.source_digest_ms,
            m.iterations,
            m.throughput_gib_s,
            m.mbps,
            m.transferred_gib,
            m.source_cpu_s_per_gib,
            m.destination_cpu_s_per_gib
        );
    }
}

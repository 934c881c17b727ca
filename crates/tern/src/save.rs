//! `tern save` and `tern vm save`: a guest saved to a snapshot file.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde::Serialize;
use tern_engine::SourceGuest;
use tern_engine::snapshot::{SaveConfig, SaveStats};
use tern_synthetic::SyntheticGuest;

use crate::run::Incomplete;
use crate::units::human_bytes;

/// How to write the file (both guests).
#[derive(Debug, Args, Clone)]
pub struct SaveFileArgs {
    /// The snapshot file to write (replaced if it exists).
    #[arg(long, short)]
    pub output: PathBuf,
    /// Save while the guest runs (precopy into the file, the guest paused
    /// only for the last pass); default: pause, then write.
    #[arg(long)]
    pub live: bool,
    /// Writer threads.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub writers: u16,
    /// Write pages with O_DIRECT, bypassing the page cache.
    #[arg(long)]
    pub direct: bool,
    /// Leave the guest paused after the save (it is discarded on exit).
    #[arg(long)]
    pub stop: bool,
    /// How long the guest runs before the save starts, in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub warmup: u64,
    /// Print one JSON document instead of the summary.
    #[arg(long)]
    pub json: bool,
}

impl SaveFileArgs {
    fn config(&self) -> SaveConfig {
        {
            let mut config = SaveConfig::default();
            config.writers = usize::from(self.writers);
            config.direct = self.direct;
            config.live = self.live;
            config.resume = !self.stop;
            config
        }
    }
}

#[derive(Debug, Args)]
pub struct SaveArgs {
    #[command(flatten)]
    pub guest: crate::cli::GuestArgs,
    #[command(flatten)]
    pub file: SaveFileArgs,
}

#[derive(Debug, Args)]
pub struct VmSaveArgs {
    #[command(flatten)]
    pub vm: crate::vm::VmArgs,
    #[command(flatten)]
    pub file: SaveFileArgs,
}

/// The JSON document: the save's statistics and what became of the guest.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct SaveReport {
    #[serde(flatten)]
    stats: SaveStats,
    file: PathBuf,
    guest_runs: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pass_count: Option<u64>,
}

/// `tern save`: a synthetic guest built from the arguments, saved.
pub fn save(args: &SaveArgs) -> anyhow::Result<ExitCode> {
    args.guest.check()?;
    crate::run::check_memory_fits(args.guest.resident_estimate(), "the guest")?;
    let mut guest = SyntheticGuest::new(&args.guest.synthetic_config())
        .context("cannot create the synthetic guest")?;
    std::thread::sleep(Duration::from_millis(args.file.warmup));
    let stats = save_guest(&mut guest, &args.file)?;
    report(&args.file, stats, guest.is_running(), None)
}

/// `tern vm save`: the KVM test guest booted, run, saved.
pub fn vm_save(args: &VmSaveArgs) -> anyhow::Result<ExitCode> {
    let mut guest = args.vm.start(1)?;
    std::thread::sleep(Duration::from_millis(args.file.warmup));
    let stats = save_guest(&mut guest, &args.file)?;
    let passes = guest.pass_count();
    report(&args.file, stats, guest.is_running(), Some(passes))
}

fn save_guest<G: SourceGuest>(guest: &mut G, args: &SaveFileArgs) -> anyhow::Result<SaveStats> {
    tern_engine::save(guest, &args.output, &args.config())
        .map_err(|error| Incomplete::error(error, "the save did not complete; the guest runs on"))
}

fn report(
    args: &SaveFileArgs,
    stats: SaveStats,
    guest_runs: bool,
    pass_count: Option<u64>,
) -> anyhow::Result<ExitCode> {
    if args.json {
        crate::report::print_json(&SaveReport {
            stats,
            file: args.output.clone(),
            guest_runs,
            pass_count,
        })?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut rows = vec![
        ("file", args.output.display().to_string()),
        (
            "memory / file",
            format!(
                "{} / {} (zero pages are holes)",
                human_bytes(stats.memory_bytes),
                human_bytes(stats.file_bytes)
            ),
        ),
        ("total time", format!("{:.1} ms", stats.total_time_ms)),
        ("guest paused for", format!("{:.1} ms", stats.downtime_ms)),
        ("passes", stats.passes.to_string()),
        (
            "pages written / zero",
            format!("{} / {}", stats.normal, stats.duplicate),
        ),
        ("digest", stats.digest.clone()),
        ("guest runs", guest_runs.to_string()),
    ];
    if let Some(passes) = pass_count {
        rows.push(("pass count", passes.to_string()));
    }
    print_rows("tern save", &rows);
    Ok(ExitCode::SUCCESS)
}

/// Prints `rows` as an aligned two-column summary under `title`.
pub fn print_rows(title: &str, rows: &[(&str, String)]) {
    let width = rows.iter().map(|(key, _)| key.len()).max().unwrap_or(0);
    println!("{title}");
    for (key, value) in rows {
        println!("  {key:width$}  {value}");
    }
}

//! `tern save` and `tern vm save`: a guest saved to a snapshot file.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tern_engine::SourceGuest;
use tern_engine::snapshot::SaveStats;
use tern_synthetic::SyntheticGuest;

use crate::args::snapshot::{SaveArgs, SaveFileArgs, VmSaveArgs};
use crate::report::print_rows;
use crate::session::{self, Incomplete};
use crate::units::human_bytes;

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
pub(crate) fn save(args: &SaveArgs) -> anyhow::Result<ExitCode> {
    args.guest.check()?;
    session::check_memory_fits(args.guest.resident_estimate(), "the guest")?;
    let mut guest = SyntheticGuest::new(&args.guest.synthetic_config())
        .context("cannot create the synthetic guest")?;
    std::thread::sleep(Duration::from_millis(args.file.warmup));
    let stats = save_guest(&mut guest, &args.file)?;
    report(&args.file, stats, guest.is_running(), None)
}

/// `tern vm save`: the KVM test guest booted, run, saved.
pub(crate) fn vm_save(args: &VmSaveArgs) -> anyhow::Result<ExitCode> {
    let mut guest = session::start_kvm_guest(&args.vm, 1)?;
    std::thread::sleep(Duration::from_millis(args.file.warmup));
    let stats = save_guest(&mut guest, &args.file)?;
    let passes = guest.pass_count();
    // The vCPU takes up a resume on its own thread: the guest runs once its
    // pass counter moves, not when `resume` returns.
    let runs = args.file.config().resume
        && guest.wait_for_pass_count_above(passes, Duration::from_secs(5));
    report(&args.file, stats, runs, Some(guest.pass_count()))
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
    ];
    if let Some(base) = &stats.base_digest {
        rows.push(("diff on base", base.clone()));
        rows.push(("pages left to the base", stats.unchanged_pages.to_string()));
    }
    rows.extend([("guest runs", guest_runs.to_string())]);
    if let Some(passes) = pass_count {
        rows.push(("pass count", passes.to_string()));
    }
    print_rows("tern save", &rows);
    Ok(ExitCode::SUCCESS)
}

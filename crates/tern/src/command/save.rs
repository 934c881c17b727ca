//! `tern save` and `tern vm save`: a guest saved to a snapshot file.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tern_engine::snapshot::{SaveConfig, SaveStats};
use tern_engine::{DirtyTracker, GuestControl, SourceGuest};
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
    /// The diffs of --diff-output, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    diffs: Vec<DiffReport>,
}

/// One --diff-output.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct DiffReport {
    #[serde(flatten)]
    stats: SaveStats,
    file: PathBuf,
    /// Pages written before it (--diff-dirty-spread).
    #[serde(skip_serializing_if = "Option::is_none")]
    pages_dirtied: Option<u64>,
}

/// `tern save`: a synthetic guest built from the arguments, saved.
pub(crate) fn save(args: &SaveArgs) -> anyhow::Result<ExitCode> {
    args.guest.check()?;
    session::check_memory_fits(args.guest.resident_estimate(), "the guest")?;
    let mut guest = SyntheticGuest::new(&args.guest.synthetic_config())
        .context("cannot create the synthetic guest")?;
    std::thread::sleep(Duration::from_millis(args.file.warmup));
    let mut spread = |guest: &mut SyntheticGuest| -> anyhow::Result<Option<u64>> {
        let Some(percent) = args.diff_dirty_spread else {
            return Ok(None);
        };
        let pages = spread_pages(guest.total_pages(), percent);
        guest.pause().context("cannot pause the guest")?;
        guest
            .dirty_pages(&pages)
            .context("cannot dirty the guest's pages")?;
        Ok(Some(pages.len() as u64))
    };
    let (stats, diffs) = save_with_diffs(&mut guest, &args.file, &mut spread)?;
    report(&args.file, stats, diffs, guest.is_running(), None)
}

/// `percent` % of `total` pages, one every `100 / percent`, spread evenly
/// from the first page to the last.
fn spread_pages(total: u64, percent: u8) -> Vec<u64> {
    let count = (total * u64::from(percent)).div_ceil(100).max(1);
    (0..count).map(|index| index * total / count).collect()
}

/// `tern vm save`: the KVM test guest booted, run, saved.
pub(crate) fn vm_save(args: &VmSaveArgs) -> anyhow::Result<ExitCode> {
    let mut guest = session::start_kvm_guest(&args.vm, 1)?;
    std::thread::sleep(Duration::from_millis(args.file.warmup));
    let (stats, diffs) = save_with_diffs(&mut guest, &args.file, &mut |_| Ok(None))?;
    let passes = guest.pass_count();
    // The vCPU takes up a resume on its own thread: the guest runs once its
    // pass counter moves, not when `resume` returns.
    let runs = args.file.config().resume
        && guest.wait_for_pass_count_above(passes, Duration::from_secs(5));
    report(&args.file, stats, diffs, runs, Some(guest.pass_count()))
}

/// The save, then each --diff-output on the file before it, the guest
/// running --diff-after between them (and `before_diff` called, which
/// may dirty pages and returns how many).
fn save_with_diffs<G: SourceGuest>(
    guest: &mut G,
    args: &SaveFileArgs,
    before_diff: &mut dyn FnMut(&mut G) -> anyhow::Result<Option<u64>>,
) -> anyhow::Result<(SaveStats, Vec<DiffReport>)> {
    let mut tracker = DirtyTracker::new();
    let last = args.diff_output.len();
    let mut config = args.config();
    // Only the last save leaves the guest paused (--stop).
    config.resume = config.resume || last > 0;
    let first = save_one(guest, &args.output, &config, args, &mut tracker)?;
    let mut diffs = Vec::with_capacity(last);
    let mut below = args.output.clone();
    for (index, output) in args.diff_output.iter().enumerate() {
        std::thread::sleep(Duration::from_millis(args.diff_after));
        let pages_dirtied = before_diff(guest)?;
        config.diff_base = Some(below.clone());
        config.resume = index + 1 < last || args.config().resume;
        let stats = save_one(guest, output, &config, args, &mut tracker)?;
        diffs.push(DiffReport {
            stats,
            file: output.clone(),
            pages_dirtied,
        });
        below.clone_from(output);
    }
    Ok((first, diffs))
}

fn save_one<G: SourceGuest>(
    guest: &mut G,
    output: &Path,
    config: &SaveConfig,
    args: &SaveFileArgs,
    tracker: &mut DirtyTracker,
) -> anyhow::Result<SaveStats> {
    let saved = if args.track_dirty_pages {
        tern_engine::save_tracked(guest, output, config, tracker)
    } else {
        tern_engine::save(guest, output, config)
    };
    saved.map_err(|error| Incomplete::error(error, "the save did not complete; the guest runs on"))
}

fn report(
    args: &SaveFileArgs,
    stats: SaveStats,
    diffs: Vec<DiffReport>,
    guest_runs: bool,
    pass_count: Option<u64>,
) -> anyhow::Result<ExitCode> {
    if args.json {
        crate::report::print_json(&SaveReport {
            stats,
            file: args.output.clone(),
            guest_runs,
            pass_count,
            diffs,
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
    for diff in &diffs {
        rows.push(("diff", diff.file.display().to_string()));
        rows.push((
            "  pages written / zero / left to the base",
            format!(
                "{} / {} / {}",
                diff.stats.normal, diff.stats.duplicate, diff.stats.unchanged_pages
            ),
        ));
        rows.push((
            "  total time",
            format!("{:.1} ms", diff.stats.total_time_ms),
        ));
        rows.push(("  digest", diff.stats.digest.clone()));
    }
    rows.extend([("guest runs", guest_runs.to_string())]);
    if let Some(passes) = pass_count {
        rows.push(("pass count", passes.to_string()));
    }
    print_rows("tern save", &rows);
    Ok(ExitCode::SUCCESS)
}

//! The KVM test guest's evidence: its own write rate, the consistency check
//! of its working set, the proof that it runs on the destination, and the
//! destination VM built before the source connects.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tern_engine::{GuestControl, GuestError, HandedFile, MigrationStats};
use tern_vmm::{ConsistencyReport, DestinationVm, KvmGuest};

use crate::session;
use crate::units::human_bytes;

/// The consistency check, as JSON.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) struct ConsistencyJson {
    pub(super) passed: bool,
    pub(super) pages: u32,
    pub(super) edges: u32,
    pub(super) first_byte: u8,
    pub(super) last_byte: u8,
    pub(super) pass_count: u64,
    pub(super) counter_matches: bool,
    /// Serial bytes received, plus the pass whose byte is still owed when
    /// the pause landed between its count and its `out`, equal the pass
    /// counter: no `out` was lost or repeated across the migration.
    pub(super) serial_matches: bool,
    /// 1 when the paused vCPU had counted a pass and not yet sent its
    /// serial byte, else 0.
    pub(super) unreported_passes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) failure: Option<String>,
}

impl ConsistencyJson {
    pub(super) fn new(
        report: ConsistencyReport,
        serial_bytes: u64,
        unreported_passes: u64,
    ) -> Self {
        let serial_matches = serial_bytes + unreported_passes == report.pass_count;
        Self {
            passed: report.passed && serial_matches,
            pages: report.pages,
            edges: report.edges,
            first_byte: report.first_byte,
            last_byte: report.last_byte,
            pass_count: report.pass_count,
            counter_matches: report.counter_matches,
            serial_matches,
            unreported_passes,
            failure: report.failure.or_else(|| {
                (!serial_matches).then(|| {
                    format!(
                        "{serial_bytes} serial bytes for {} passes ({unreported_passes} not yet reported)",
                        report.pass_count
                    )
                })
            }),
        }
    }
}

/// The test guest's own speed, from its pass counter: passes per second,
/// and page writes per second (each pass writes every working-set page
/// once). Not the engine's dirty rate (`ram.dirty-pages-rate`), which counts
/// distinct pages found dirty per second between dirty-log syncs: a page
/// written many times between two syncs counts once there, and dirty
/// logging itself slows the guest.
#[derive(Clone, Copy, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) struct GuestRate {
    pub(super) passes_per_second: f64,
    pub(super) page_writes_per_second: f64,
}

/// The summary row of the guest's own rate, labelled apart from the
/// engine's "dirty rate (engine)".
pub(super) fn guest_write_rate_row(rate: &GuestRate) -> (&'static str, String) {
    (
        "guest write rate",
        format!(
            "{:.0} pages/s (test guest's own counter, before the migration)",
            rate.page_writes_per_second
        ),
    )
}

pub(super) fn measure(guest: &KvmGuest, during: Duration) -> GuestRate {
    let (start, passes) = (Instant::now(), guest.pass_count());
    std::thread::sleep(during);
    let passes_per_second =
        (guest.pass_count() - passes) as f64 / start.elapsed().as_secs_f64().max(1e-9);
    GuestRate {
        passes_per_second,
        page_writes_per_second: passes_per_second * f64::from(guest.working_set_pages()),
    }
}

/// Pauses a guest, checks it, and lets it run again.
pub(super) fn check_paused(guest: &mut KvmGuest) -> anyhow::Result<ConsistencyJson> {
    guest.pause().context("cannot pause the guest")?;
    let report = guest
        .consistency_check()
        .map_err(|reason| anyhow::anyhow!("consistency check: {reason}"))?;
    let serial = guest.serial_transmitted();
    let unreported = guest
        .unreported_passes()
        .context("cannot read the paused vCPU")?;
    guest.resume().context("cannot resume the guest")?;
    Ok(ConsistencyJson::new(report, serial, unreported))
}

/// What the destination shows after the switch-over: a consistent working
/// set, and a pass counter that advances.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) struct DestinationProof {
    pub(super) consistency_check: ConsistencyJson,
    pub(super) pass_count_before: u64,
    pub(super) pass_count_after: u64,
    /// From the resume to the first pass completed on the destination;
    /// `None` when none came within [`FIRST_PASS_DEADLINE`].
    pub(super) first_pass_after_ms: Option<u64>,
    pub(super) guest_runs_on_destination: bool,
    pub(super) serial_bytes: u64,
}

/// How long the destination's proof waits for the guest's first pass there
/// (a pass writes the whole working set; a loaded 2-core host has taken
/// over a second).
const FIRST_PASS_DEADLINE: Duration = Duration::from_secs(30);

pub(super) fn prove_on_destination(
    guest: &mut KvmGuest,
    run_after: Duration,
) -> anyhow::Result<DestinationProof> {
    let consistency_check = check_paused(guest)?;
    let pass_count_before = consistency_check.pass_count;
    // A pass over a large working set can take seconds on a loaded host:
    // the proof waits for one with its own deadline, so a slow host is not
    // reported as a guest that does not run, then lets it run `run_after`.
    let resumed = Instant::now();
    let advanced =
        guest.wait_for_pass_count_above(pass_count_before, run_after.max(FIRST_PASS_DEADLINE));
    let first_pass_after_ms =
        advanced.then(|| u64::try_from(resumed.elapsed().as_millis()).unwrap_or(u64::MAX));
    std::thread::sleep(run_after);
    let pass_count_after = guest.pass_count();
    Ok(DestinationProof {
        consistency_check,
        pass_count_before,
        pass_count_after,
        first_pass_after_ms,
        guest_runs_on_destination: pass_count_after > pass_count_before && guest.is_running(),
        serial_bytes: guest.serial_transmitted(),
    })
}

impl DestinationProof {
    pub(super) fn passed(&self) -> bool {
        self.consistency_check.passed && self.guest_runs_on_destination
    }

    pub(super) fn rows(&self) -> Vec<(&'static str, String)> {
        let check = &self.consistency_check;
        vec![
            (
                "consistency check",
                if check.passed {
                    format!(
                        "passed ({} pages, {} edge, serial = counter)",
                        check.pages, check.edges
                    )
                } else {
                    format!("FAILED: {}", check.failure.as_deref().unwrap_or("unknown"))
                },
            ),
            ("pass count before", self.pass_count_before.to_string()),
            ("pass count after", self.pass_count_after.to_string()),
            (
                "first pass on destination",
                self.first_pass_after_ms.map_or_else(
                    || format!("none within {} s", FIRST_PASS_DEADLINE.as_secs()),
                    |ms| format!("after {ms} ms"),
                ),
            ),
            (
                "guest runs on destination",
                self.guest_runs_on_destination.to_string(),
            ),
        ]
    }
}

/// Builds the destination VM now, before the source connects (VM creation
/// can take a long time on a loaded host, docs/vmm.md), and returns the
/// `make_guest` step that checks the announced size and only adds the
/// memory the source announces.
pub(super) fn prepare_destination()
-> anyhow::Result<impl FnOnce(&tern_wire::SessionSetup) -> Result<KvmGuest, GuestError>> {
    let vm = DestinationVm::new().context("cannot create the destination VM")?;
    Ok(move |setup: &tern_wire::SessionSetup| {
        session::check_memory_fits(
            setup.total_bytes(),
            &format!("a {} guest", human_bytes(setup.total_bytes())),
        )
        .map_err(|error| GuestError::new(error.to_string()))?;
        let lens: Vec<u64> = setup.regions.iter().map(|region| region.len).collect();
        vm.with_memory(&lens)
            .map_err(|error| GuestError::with_source("cannot create the destination VM", error))
    })
}

/// [`prepare_destination`] for `--local`: the VM maps the memory the
/// source on this host hands over instead of allocating its own.
pub(super) fn prepare_handover_destination()
-> anyhow::Result<impl crate::command::receive::Adopt<KvmGuest>> {
    let vm = DestinationVm::new().context("cannot create the destination VM")?;
    Ok(move |_: &tern_wire::SessionSetup, files: Vec<HandedFile>| {
        vm.with_handed_files(files).map_err(|error| {
            GuestError::with_source("cannot map the handed-over memory into the VM", error)
        })
    })
}

/// The source side's report.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) struct SourceReport {
    #[serde(flatten)]
    pub(super) stats: MigrationStats,
    pub(super) guest_before_migration: GuestRate,
    /// The pass count as the migration started (the end of the warm-up):
    /// with `source-pass-count` and the destination's counts, the work the
    /// guest did during the migration (bench/compare/postcopy.py).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) source_pass_count_at_start: Option<u64>,
    /// The pass count where the source stopped (it runs on the destination
    /// from there), or where it ran on after a failure; none after a
    /// hand-over (`--local`), whose memory the source may no longer read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) source_pass_count: Option<u64>,
    /// After a failed migration: whether the source guest still runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) source_guest_runs: Option<bool>,
}

/// What became of the source guest after a failed migration, for the one
/// error line.
pub(super) fn source_guest_after_failure(runs: bool, paused: bool) -> &'static str {
    match (runs, paused) {
        (true, _) => "the migration did not complete; the source guest runs on",
        (false, true) => "the migration did not complete; the source guest stays paused",
        (false, false) => "the migration did not complete; the source guest does not run",
    }
}

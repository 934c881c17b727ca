//! `tern restore` and `tern vm restore`: a guest brought back from a
//! snapshot file, eagerly (digest checked before it resumes) or lazily
//! (resumed at once, memory faulted in and prefetched).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tern_engine::snapshot::LazyStats;
use tern_engine::{DestinationGuest, GuestError, RestoreConfig};
use tern_synthetic::SyntheticGuest;
use tern_vmm::{DestinationVm, KvmGuest};
use tern_wire::snapshot::WorkingSet;

use crate::args::snapshot::{MergeSnapshotArgs, RestoreArgs};
use crate::report::print_rows;
use crate::session::{self, Incomplete};

/// The JSON document.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct RestoreReport {
    snapshot: PathBuf,
    /// A diff's bases, oldest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    bases: Vec<PathBuf>,
    mode: &'static str,
    /// Opening the file to the guest running.
    resumed_after_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    lazy: Option<LazyStats>,
    /// --touch-spread: the working set read right after the resume.
    #[serde(skip_serializing_if = "Option::is_none")]
    touched: Option<Touched>,
    digest: String,
    digest_verified: bool,
    guest_runs: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pass_count_before: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pass_count_after: Option<u64>,
}

/// The spread working set read after the resume (--touch-spread).
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct Touched {
    pages: u64,
    /// From the guest resumed (the return of the restore) to the last
    /// page read.
    after_ms: f64,
}

/// What the command needs from either guest.
trait Restorable: DestinationGuest + Sized {
    /// What can be built before the snapshot's sizes are known (a lazy
    /// restore builds it while the file is opened).
    type Prepared: Send;
    fn prepare() -> Result<Self::Prepared, GuestError>;
    fn make_prepared(prepared: Self::Prepared, lens: &[u64]) -> Result<Self, GuestError>;
    fn make(lens: &[u64]) -> Result<Self, GuestError>;
    /// A progress measure that grows while the guest runs.
    fn progress(&self) -> u64;
    fn pass_count(&self) -> Option<u64>;
}

impl Restorable for SyntheticGuest {
    type Prepared = ();
    fn prepare() -> Result<(), GuestError> {
        Ok(())
    }
    fn make_prepared((): (), lens: &[u64]) -> Result<Self, GuestError> {
        Self::make(lens)
    }
    fn make(lens: &[u64]) -> Result<Self, GuestError> {
        let total = lens.iter().sum();
        session::check_memory_fits(total, "the snapshot's guest")
            .map_err(|error| GuestError::new(error.to_string()))?;
        SyntheticGuest::empty(lens)
            .map_err(|error| GuestError::with_source("cannot create the guest", error))
    }
    fn progress(&self) -> u64 {
        self.dirtied_pages()
    }
    fn pass_count(&self) -> Option<u64> {
        None
    }
}

impl Restorable for KvmGuest {
    /// The VM and its vCPU: milliseconds of KVM work that need no size.
    type Prepared = DestinationVm;
    fn prepare() -> Result<DestinationVm, GuestError> {
        DestinationVm::new().map_err(GuestError::from)
    }
    fn make_prepared(vm: DestinationVm, lens: &[u64]) -> Result<Self, GuestError> {
        let total = lens.iter().sum();
        session::check_memory_fits(total, "the snapshot's guest")
            .map_err(|error| GuestError::new(error.to_string()))?;
        vm.with_memory(lens).map_err(GuestError::from)
    }
    fn make(lens: &[u64]) -> Result<Self, GuestError> {
        let total = lens.iter().sum();
        session::check_memory_fits(total, "the snapshot's guest")
            .map_err(|error| GuestError::new(error.to_string()))?;
        KvmGuest::for_destination(lens).map_err(GuestError::from)
    }
    fn progress(&self) -> u64 {
        KvmGuest::pass_count(self)
    }
    fn pass_count(&self) -> Option<u64> {
        Some(KvmGuest::pass_count(self))
    }
}

/// `tern restore`: a synthetic guest.
pub(crate) fn restore(args: &RestoreArgs) -> anyhow::Result<ExitCode> {
    run::<SyntheticGuest>(args)
}

/// `tern vm restore`: the KVM test guest.
pub(crate) fn vm_restore(args: &RestoreArgs) -> anyhow::Result<ExitCode> {
    run::<KvmGuest>(args)
}

fn run<G: Restorable>(args: &RestoreArgs) -> anyhow::Result<ExitCode> {
    let config = restore_config(args)?;
    let failed = |error| Incomplete::error(error, "the restore failed; no guest runs");
    let touched;
    let (mut guest, resumed_after_ms, lazy, digest) = if args.lazy {
        let mut restore = tern_engine::restore_lazy_prepared(
            &args.snapshot,
            &config,
            G::prepare,
            G::make_prepared,
        )
        .map_err(failed)?;
        touched = touch(restore.guest(), args.touch_spread)?;
        if let Some(ms) = args.load_after {
            let resumed = restore.resumed_after();
            let since_resume = Duration::from_millis(ms);
            let ran = restore.elapsed().saturating_sub(resumed);
            std::thread::sleep(since_resume.saturating_sub(ran));
            restore.start_loading(config.threads).map_err(failed)?;
        }
        let resumed_after_ms = restore.resumed_after().as_secs_f64() * 1000.0;
        let (guest, stats) = restore
            .wait_loaded(Duration::from_secs(args.load_timeout))
            .map_err(failed)?;
        if let Some(path) = &args.record_working_set {
            let set = WorkingSet {
                pages: stats.faulted_pages.clone(),
            };
            std::fs::write(path, set.encode_file())
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        let digest = stats.digest.clone();
        (guest, resumed_after_ms, Some(stats), digest)
    } else {
        let restored = tern_engine::restore(&args.snapshot, &config, G::make).map_err(failed)?;
        touched = touch(&restored.guest, args.touch_spread)?;
        let stats = restored.stats;
        (restored.guest, stats.total_time_ms, None, stats.digest)
    };
    let before = guest.progress();
    let pass_count_before = guest.pass_count();
    std::thread::sleep(Duration::from_millis(args.run_after));
    let guest_runs = guest.progress() > before;
    let pass_count_after = guest.pass_count();
    guest.pause().context("cannot pause the restored guest")?;
    let report = RestoreReport {
        snapshot: args.snapshot.clone(),
        bases: args.base.clone(),
        mode: if args.lazy { "lazy" } else { "eager" },
        resumed_after_ms,
        lazy,
        touched,
        digest,
        digest_verified: true,
        guest_runs,
        pass_count_before,
        pass_count_after,
    };
    print_report(args, &report)?;
    Ok(ExitCode::SUCCESS)
}

fn print_report(args: &RestoreArgs, report: &RestoreReport) -> anyhow::Result<()> {
    if args.json {
        return crate::report::print_json(report);
    }
    let mut rows = vec![("snapshot", report.snapshot.display().to_string())];
    if !report.bases.is_empty() {
        let bases: Vec<String> = report
            .bases
            .iter()
            .map(|path| path.display().to_string())
            .collect();
        rows.push(("on bases", bases.join(", ")));
    }
    rows.extend([
        ("mode", report.mode.to_string()),
        (
            "guest running after",
            format!("{:.1} ms", report.resumed_after_ms),
        ),
        ("digest", format!("{} (verified)", report.digest)),
        ("guest runs", report.guest_runs.to_string()),
    ]);
    if let Some(lazy) = &report.lazy {
        rows.push((
            "fully loaded after",
            format!("{:.1} ms", lazy.loaded_after_ms),
        ));
        rows.push((
            "faults",
            format!(
                "{} (p50 {:.0} µs, p99 {:.0} µs)",
                lazy.faults.faults,
                lazy.faults.fault_latency_p50_us,
                lazy.faults.fault_latency_p99_us
            ),
        ));
        rows.push((
            "pages by fault / prefetch",
            format!(
                "{} / {}",
                lazy.faults.fault_pages, lazy.faults.prefetched_pages
            ),
        ));
    }
    if let (Some(before), Some(after)) = (report.pass_count_before, report.pass_count_after) {
        rows.push(("pass count", format!("{before} -> {after}")));
    }
    print_rows("tern restore", &rows);
    Ok(())
}

/// Pages of a working set of `bytes` spread across `total` pages: runs of
/// one chunk (16 pages), evenly spaced from the first page to the last.
fn spread_working_set(total: u64, bytes: u64) -> Vec<u64> {
    const RUN: u64 = 16;
    let runs = bytes.div_ceil(RUN * 4096).clamp(1, (total / RUN).max(1));
    (0..runs)
        .flat_map(|run| {
            let first = (run * total / runs) / RUN * RUN;
            first..(first + RUN).min(total)
        })
        .collect()
}

/// Reads one byte of every page of a spread working set of `bytes`
/// (pages over all regions, in order), as the guest would: each missing
/// page faults in through the restore. None without --touch-spread.
fn touch<G: DestinationGuest>(guest: &G, bytes: Option<u64>) -> anyhow::Result<Option<Touched>> {
    let Some(bytes) = bytes else {
        return Ok(None);
    };
    let started = std::time::Instant::now();
    let regions = guest.regions();
    let total = regions.iter().map(tern_engine::MemoryRegion::pages).sum();
    let pages = spread_working_set(total, bytes);
    let (mut region, mut first) = (0, 0);
    for &page in &pages {
        while page - first >= regions[region].pages() {
            first += regions[region].pages();
            region += 1;
        }
        let ptr = regions[region]
            .page_ptr(page - first)
            .context("a page outside the guest")?;
        // SAFETY: a page of guest memory, mapped for the guest's lifetime
        // (`guest` is borrowed); read atomically, as the running guest may
        // write it.
        let byte = unsafe { std::sync::atomic::AtomicU8::from_ptr(ptr) };
        std::hint::black_box(byte.load(std::sync::atomic::Ordering::Relaxed));
    }
    Ok(Some(Touched {
        pages: pages.len() as u64,
        after_ms: started.elapsed().as_secs_f64() * 1000.0,
    }))
}

/// The engine's settings for the restore, with the working set
/// `--working-set` names read from its file.
fn restore_config(args: &RestoreArgs) -> anyhow::Result<RestoreConfig> {
    let working_set = match &args.working_set {
        Some(path) => {
            let bytes =
                std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
            let set = WorkingSet::decode_file(&bytes)
                .with_context(|| format!("--working-set {}", path.display()))?;
            Some(set.pages)
        }
        None => None,
    };
    Ok({
        let mut config = RestoreConfig::default();
        config.threads = usize::from(args.threads);
        config.prefetch_working_set = !args.no_prefetch;
        config.working_set = working_set;
        config.background = args.load_after.is_none();
        config.resume = true;
        config.bases = args.base.clone();
        config
    })
}

/// `tern merge-snapshot`: a diff and its bases written as one full
/// snapshot, every chunk checked on the way.
pub(crate) fn merge(args: &MergeSnapshotArgs) -> anyhow::Result<ExitCode> {
    let stats = tern_engine::snapshot::merge(&args.base, &args.snapshot, &args.output).map_err(
        |error| {
            Incomplete::error(
                error,
                "the merge did not complete; the output stays incomplete",
            )
        },
    )?;
    if args.json {
        crate::report::print_json(&stats)?;
        return Ok(ExitCode::SUCCESS);
    }
    print_rows(
        "tern merge-snapshot",
        &[
            ("output", args.output.display().to_string()),
            ("files merged", stats.layers.to_string()),
            (
                "pages written / zero",
                format!("{} / {}", stats.pages_written, stats.zero_pages),
            ),
            ("total time", format!("{:.1} ms", stats.total_time_ms)),
            ("digest", format!("{} (verified)", stats.digest)),
        ],
    );
    Ok(ExitCode::SUCCESS)
}

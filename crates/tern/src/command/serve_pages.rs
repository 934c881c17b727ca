//! `tern serve-pages`: an external page-fault handler in Firecracker's
//! protocol (docs/snapshots.md), serving a tern snapshot or a raw
//! Firecracker memory file through the fault service.

use std::os::unix::net::UnixListener;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tern_engine::fault::firecracker::{
    FirecrackerRegion, ProcessWatch, RawMemoryFile, accept_handshake,
};
use tern_engine::fault::{FaultConfig, FaultService, FaultStats, PageSource};
use tern_engine::snapshot::SnapshotFile;
use tern_wire::snapshot::CHUNK_PAGES;

use crate::args::snapshot::ServePagesArgs;
use crate::report::print_rows;
use crate::session::{self, Incomplete};

#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct ServeReport {
    peer_pid: Option<i32>,
    regions: usize,
    memory_bytes: u64,
    served_for_ms: f64,
    #[serde(flatten)]
    stats: FaultStats,
}

pub(crate) fn serve(args: &ServePagesArgs) -> anyhow::Result<ExitCode> {
    // Before anything else: a signal must always end the serving cleanly.
    let stop = Arc::new(AtomicBool::new(false));
    let on_signal = Arc::clone(&stop);
    session::install_interrupt_handler(move || on_signal.store(true, Ordering::Relaxed));
    let listener = UnixListener::bind(&args.socket)
        .with_context(|| format!("cannot listen on {}", args.socket.display()))?;
    let handshake = accept_handshake(&listener, Duration::from_secs(args.accept_timeout))
        .context("the VMM's handshake failed")?;
    drop(listener);
    let _ = std::fs::remove_file(&args.socket);
    // Watch the VMM from now on: it may exit before serving even starts.
    let peer = handshake.peer_pid.map(|pid| (pid, ProcessWatch::new(pid)));
    let (source, working_set, unit_pages) = open_source(args, &handshake.regions)?;
    let served = handshake
        .regions
        .iter()
        .map(FirecrackerRegion::served)
        .collect();
    let service = FaultService::adopt_and_start(
        handshake.uffd,
        served,
        source,
        FaultConfig {
            unit_pages,
            loaders: usize::from(args.loaders),
            working_set,
            release_on_failure: false,
        },
    )
    .context("cannot start serving")?;
    let started = Instant::now();
    let outcome = wait_for_peer(&service, peer, &stop);
    let stats = service.stop();
    outcome?;
    let report = ServeReport {
        peer_pid: handshake.peer_pid,
        regions: handshake.regions.len(),
        memory_bytes: handshake.regions.iter().map(|region| region.size).sum(),
        served_for_ms: started.elapsed().as_secs_f64() * 1000.0,
        stats,
    };
    print_report(args, &report)?;
    Ok(ExitCode::SUCCESS)
}

type Source = (Arc<dyn PageSource>, Vec<(u32, u32)>, u64);

/// The page source the arguments name, checked against the VMM's regions.
fn open_source(args: &ServePagesArgs, regions: &[FirecrackerRegion]) -> anyhow::Result<Source> {
    if let Some(path) = &args.memory_file {
        let file = RawMemoryFile::open(path, regions)?;
        return Ok((Arc::new(file), Vec::new(), 16));
    }
    let path = args
        .snapshot
        .as_ref()
        .context("--snapshot or --memory-file")?;
    let file = SnapshotFile::open_layers(&args.base, path)?;
    let saved = &file.metadata().regions;
    anyhow::ensure!(
        saved.len() == regions.len(),
        "the VMM has {} regions, the snapshot {}",
        regions.len(),
        saved.len()
    );
    // The VMM's offsets are into a flat memory file: region i starts where
    // the regions before it end.
    let mut flat = 0;
    for (index, (ours, theirs)) in saved.iter().zip(regions).enumerate() {
        anyhow::ensure!(
            ours.len == theirs.size && flat == theirs.offset,
            "region {index} of the VMM (offset {}, {} bytes) is not the snapshot's (offset {flat}, {} bytes)",
            theirs.offset,
            theirs.size,
            ours.len
        );
        flat += ours.len;
    }
    let working_set = if args.no_prefetch {
        Vec::new()
    } else {
        file.trailer().working_set.pages.clone()
    };
    Ok((Arc::new(file), working_set, CHUNK_PAGES))
}

/// Serves until the VMM exits (its pidfd), the service fails, or a signal.
fn wait_for_peer(
    service: &FaultService,
    peer: Option<(i32, std::io::Result<ProcessWatch>)>,
    stop: &AtomicBool,
) -> anyhow::Result<()> {
    let pid = peer.as_ref().map_or(0, |(pid, _)| *pid);
    let watch = match peer {
        Some((_, Ok(watch))) => Some(watch),
        Some((pid, Err(error))) if error.raw_os_error() == Some(libc::ESRCH) => {
            eprintln!("tern serve-pages: the VMM (pid {pid}) exited");
            return Ok(());
        }
        // No pidfd here (kernel before 5.3): serve until a signal.
        _ => None,
    };
    loop {
        if let Some(error) = service.take_failure() {
            return Err(Incomplete::error(error, "serving pages failed"));
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        match &watch {
            Some(watch) => {
                if watch.exited_within(Duration::from_millis(100))? {
                    eprintln!("tern serve-pages: the VMM (pid {pid}) exited");
                    return Ok(());
                }
            }
            None => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn print_report(args: &ServePagesArgs, report: &ServeReport) -> anyhow::Result<()> {
    if args.json {
        return crate::report::print_json(report);
    }
    let stats = &report.stats;
    print_rows(
        "tern serve-pages",
        &[
            ("regions", report.regions.to_string()),
            ("memory", crate::units::human_bytes(report.memory_bytes)),
            ("faults", stats.faults.to_string()),
            (
                "fault latency",
                format!(
                    "p50 {:.0} µs, p99 {:.0} µs",
                    stats.fault_latency_p50_us, stats.fault_latency_p99_us
                ),
            ),
            (
                "pages by fault / prefetch / zero",
                format!(
                    "{} / {} / {}",
                    stats.fault_pages, stats.prefetched_pages, stats.zero_pages
                ),
            ),
            ("removes", stats.removes.to_string()),
        ],
    );
    Ok(())
}

//! Live progress and the final summary.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use tern_engine::{LiveStats, MigrationStats};

use crate::units::human_bytes;

/// A progress bar fed from the live statistics by a thread of its own, so
/// the migration never waits for the terminal.
pub struct Progress {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Progress {
    /// Starts drawing on stderr (nothing is drawn when stderr is not a
    /// terminal).
    pub fn start(stats: Arc<LiveStats>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let bar = ProgressBar::with_draw_target(Some(1), ProgressDrawTarget::stderr_with_hz(10));
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} {prefix:>9} [{bar:30}] {bytes:>10}/{total_bytes:<10} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("tern-progress".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let snapshot = stats.snapshot();
                        let ram = &snapshot.ram;
                        let sent = (ram.normal + ram.duplicate) * tern_engine::PAGE_SIZE as u64;
                        bar.set_length(ram.total.max(1));
                        bar.set_position(sent.min(ram.total));
                        bar.set_prefix(snapshot.status.as_str());
                        bar.set_message(format!(
                            "iter {} | {:.0} Mbit/s | dirty {} | {} zero | throttle {}%",
                            ram.iterations,
                            ram.mbps,
                            human_bytes(ram.remaining),
                            ram.duplicate,
                            snapshot.throttle_percent
                        ));
                        bar.tick();
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    bar.finish_and_clear();
                })
                .ok()
        };
        Self { stop, thread }
    }

    /// Stops drawing and clears the bar.
    pub fn finish(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Prints a JSON document to stdout.
pub fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints the human summary of a migration.
pub fn print_summary(stats: &MigrationStats, extra: &[(&str, String)]) {
    let ram = &stats.ram;
    let rows: Vec<(&str, String)> = vec![
        ("status", stats.status.as_str().to_string()),
        ("total time", format!("{} ms", stats.total_time)),
        ("setup time", format!("{} ms", stats.setup_time)),
        ("downtime", format!("{} ms", stats.downtime)),
        (
            "expected downtime",
            format!("{} ms", stats.expected_downtime),
        ),
        ("source digest", format!("{} ms", stats.digest_time)),
        ("memory", human_bytes(ram.total)),
        ("transferred", human_bytes(ram.transferred)),
        ("throughput", format!("{:.0} Mbit/s", ram.mbps)),
        (
            "pages",
            format!("{} with data, {} zero", ram.normal, ram.duplicate),
        ),
        ("iterations", ram.iterations.to_string()),
        ("dirty syncs", ram.dirty_sync_count.to_string()),
        ("dirty rate", format!("{} pages/s", ram.dirty_pages_rate)),
        ("throttle", format!("{}%", stats.throttle_percent)),
        ("forced switch-over", stats.forced_switch_over.to_string()),
        ("digest verified", stats.digest_verified.to_string()),
        (
            "source CPU",
            format!("{:.2} s", stats.cpu_seconds.values().sum::<f64>()),
        ),
    ];
    let destination_cpu = stats
        .destination
        .as_ref()
        .map(|destination| {
            vec![
                (
                    "destination CPU",
                    format!("{:.2} s", destination.cpu_seconds.values().sum::<f64>()),
                ),
                (
                    "destination digest",
                    format!("{} ms", destination.digest_time),
                ),
            ]
        })
        .unwrap_or_default();
    let zero_copy: Vec<(&str, String)> = stats
        .zero_copy
        .iter()
        .map(|zc| {
            (
                "zero-copy",
                format!(
                    "{} sends, {} copied by the kernel, {:.3} s waiting",
                    zc.sends_queued, zc.sends_copied, zc.wait_seconds
                ),
            )
        })
        .collect();
    let compression: Vec<(&str, String)> = stats
        .compression
        .iter()
        .flat_map(|report| {
            report.codecs.iter().map(move |(name, codec)| {
                (
                    "compression",
                    format!(
                        "{name}{}: {} of {} pages compressed, ratio {:.2}, {} skipped by sampling, {:.2} CPU s ({} switches)",
                        report.level.map_or(String::new(), |level| format!(" level {level}")),
                        codec.compressed,
                        codec.pages,
                        codec.ratio,
                        codec.skipped_by_sampling,
                        codec.cpu_seconds,
                        report.codec_switches
                    ),
                )
            })
        })
        .collect();
    let zero_detection: Vec<(&str, String)> = stats
        .zero_page_detection
        .iter()
        .map(|report| {
            let offload = report.offload.as_ref().map_or(String::new(), |offload| {
                format!(
                    ", {} pages on the device, {} CPU fallbacks, completion thread {:.3} CPU s",
                    offload.pages_device,
                    offload.cpu_fallbacks,
                    offload.completion_thread_cpu_seconds
                )
            });
            (
                "zero pages found by",
                format!("{} ({}){offload}", report.mode, report.backend),
            )
        })
        .collect();
    let all: Vec<&(&str, String)> = rows
        .iter()
        .chain(zero_detection.iter())
        .chain(compression.iter())
        .chain(zero_copy.iter())
        .chain(destination_cpu.iter())
        .chain(extra.iter())
        .collect();
    let width = all.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    for (name, value) in all {
        println!("{name:>width$}  {value}");
    }
    if let Some(error) = &stats.error {
        println!("{:>width$}  {error}", "error");
    }
}

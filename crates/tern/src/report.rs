//! Live progress, the JSON events and the final summary.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use tern_engine::{
    Address, LiveStats, MigrationStats, MigrationStatus, PAGE_SIZE, ReceivePhase, ReceiveStats,
    SessionSecurity,
};

use crate::args::progress::ProgressMode;
use crate::units::human_bytes;

static PROGRESS_MODE: OnceLock<ProgressMode> = OnceLock::new();

/// Sets how progress is shown, once, before any command runs.
pub(crate) fn set_progress_mode(mode: ProgressMode) {
    let _ = PROGRESS_MODE.set(mode);
}

/// The mode in force, `auto` resolved.
fn progress_mode() -> ProgressMode {
    match PROGRESS_MODE.get().copied().unwrap_or_default() {
        ProgressMode::Auto if std::io::stderr().is_terminal() => ProgressMode::Bar,
        ProgressMode::Auto => ProgressMode::Plain,
        mode => mode,
    }
}

/// Seconds between two lines of `plain` progress.
const PLAIN_INTERVAL: Duration = Duration::from_secs(2);

/// What the progress display shows at one moment.
struct View {
    /// The phase, as a short word (`filling`, `active`, `receiving`, …).
    phase: &'static str,
    /// Bytes done of `length`; `length` 0 when the size is not known.
    position: u64,
    length: u64,
    /// What `position` counts, for the plain line.
    what: &'static str,
    detail: String,
}

/// Progress drawn from live counters by a thread of its own, so the work
/// never waits for the terminal: a bar, or a periodic line (`--progress`).
pub(crate) struct Progress {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Progress {
    /// A migration's source side, from its live statistics.
    pub(crate) fn start(stats: Arc<LiveStats>) -> Self {
        Self::spawn(move || source_view(&stats))
    }

    /// A destination, from its live counters.
    pub(crate) fn receiving(stats: Arc<ReceiveStats>) -> Self {
        Self::spawn(move || destination_view(&stats))
    }

    /// Filling `total` bytes of guest memory, `filled` of them done.
    pub(crate) fn filling(total: u64, filled: Arc<AtomicU64>) -> Self {
        Self::spawn(move || View {
            phase: "filling",
            position: filled.load(Ordering::Relaxed).min(total),
            length: total,
            what: "of guest memory written",
            detail: String::new(),
        })
    }

    fn spawn(view: impl FnMut() -> View + Send + 'static) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = match progress_mode() {
            ProgressMode::None => None,
            ProgressMode::Plain => {
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name("tern-progress".into())
                    .spawn(move || draw_plain(&stop, view))
                    .ok()
            }
            _ => {
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name("tern-progress".into())
                    .spawn(move || draw_bar(&stop, view))
                    .ok()
            }
        };
        Self { stop, thread }
    }

    /// Stops drawing and clears the bar.
    pub(crate) fn finish(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sleeps `period` in short steps, returning early once `stop` is set.
fn pause(stop: &AtomicBool, period: Duration) {
    let until = Instant::now() + period;
    while !stop.load(Ordering::Relaxed) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(100)));
    }
}

fn draw_bar(stop: &AtomicBool, mut view: impl FnMut() -> View) {
    let bar = ProgressBar::with_draw_target(Some(1), ProgressDrawTarget::stderr_with_hz(10));
    let sized = ProgressStyle::with_template(
        "{spinner} {prefix:>9} [{bar:30}] {bytes:>10}/{total_bytes:<10} {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    let unsized_style = ProgressStyle::with_template("{spinner} {prefix:>9} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let mut showing_size = None;
    while !stop.load(Ordering::Relaxed) {
        let now = view();
        let sized_now = now.length > 0;
        if showing_size != Some(sized_now) {
            bar.set_style(if sized_now {
                sized.clone()
            } else {
                unsized_style.clone()
            });
            showing_size = Some(sized_now);
        }
        bar.set_length(now.length.max(1));
        bar.set_position(now.position);
        bar.set_prefix(now.phase);
        bar.set_message(now.detail);
        bar.tick();
        pause(stop, Duration::from_millis(100));
    }
    bar.finish_and_clear();
}

fn draw_plain(stop: &AtomicBool, mut view: impl FnMut() -> View) {
    // The first line after one interval: short runs print nothing.
    pause(stop, PLAIN_INTERVAL);
    while !stop.load(Ordering::Relaxed) {
        eprintln!("tern: {}", plain_line(&view()));
        pause(stop, PLAIN_INTERVAL);
    }
}

/// One line of `plain` progress.
fn plain_line(view: &View) -> String {
    let mut line = view.phase.to_string();
    if view.length > 0 {
        line += &format!(
            " {:.0}%: {} of {} {}",
            view.position as f64 * 100.0 / view.length as f64,
            human_bytes(view.position),
            human_bytes(view.length),
            view.what
        );
    }
    if !view.detail.is_empty() {
        line += if view.length > 0 { "; " } else { ": " };
        line += &view.detail;
    }
    line
}

/// The source: the bar is the current iteration (its dirty bytes sent of
/// those it started with); the line says which iteration, what went over
/// the wire in all, and the engine's measured dirty rate.
fn source_view(stats: &LiveStats) -> View {
    let snapshot = stats.snapshot();
    let ram = &snapshot.ram;
    let (sent, size) = stats.iteration_progress();
    let phase = snapshot.status.as_str();
    if snapshot.status == MigrationStatus::Setup {
        return View {
            phase,
            position: 0,
            length: 0,
            what: "",
            detail: "connecting".into(),
        };
    }
    let iteration = if snapshot.status == MigrationStatus::Device {
        "final pass (guest paused)".to_string()
    } else {
        format!("iteration {}", ram.iterations)
    };
    let mut detail = format!(
        "{iteration} | {} sent in all | {:.0} Mbit/s",
        human_bytes(ram.transferred),
        ram.mbps
    );
    if ram.dirty_sync_count > 0 {
        detail += &format!(" | dirty rate {} pages/s", ram.dirty_pages_rate);
    }
    if snapshot.cpu_throttle_percentage > 0 {
        detail += &format!(" | throttle {}%", snapshot.cpu_throttle_percentage);
    }
    if let Some(zero_copy) = snapshot.zero_copy.filter(|zero_copy| zero_copy.syncs > 0) {
        detail += &format!(" | zero-copy: {}", zero_copy_at_last_sync(&zero_copy));
    }
    View {
        phase,
        position: sent,
        length: size,
        what: "of this iteration's dirty memory sent",
        detail,
    }
}

/// What the kernel did with the zero-copy sends of the iteration that the
/// last sync ended: on loopback, or a NIC without scatter-gather, all copied.
fn zero_copy_at_last_sync(zero_copy: &tern_engine::zerocopy::ZeroCopyStats) -> String {
    format!(
        "{} of {} sends copied by the kernel at sync {}",
        zero_copy.last_sync_sends_copied, zero_copy.last_sync_sends_completed, zero_copy.syncs
    )
}

/// The destination: while the first copy arrives (every page once), the bar
/// is its progress; later iterations resend an amount only the source
/// knows, so they show counts only.
fn destination_view(stats: &ReceiveStats) -> View {
    let phase = stats.phase();
    let received = human_bytes(stats.received_bytes());
    let pages = stats.pages();
    let iterations = stats.iterations_done();
    let total = stats.total_bytes();
    match phase {
        ReceivePhase::Waiting => View {
            phase: phase.as_str(),
            position: 0,
            length: 0,
            what: "",
            detail: "waiting for the source".into(),
        },
        ReceivePhase::Receiving if iterations == 0 && total > 0 => View {
            phase: phase.as_str(),
            position: (pages * PAGE_SIZE as u64).min(total),
            length: total,
            what: "of guest memory received (first copy)",
            detail: format!("{received} read | {pages} pages"),
        },
        _ => View {
            phase: phase.as_str(),
            position: 0,
            length: 0,
            what: "",
            detail: format!("{received} read | {pages} pages | {iterations} iterations done"),
        },
    }
}

/// Runs `make` (which fills guest memory, counting bytes in its argument)
/// with fill progress shown.
pub(crate) fn with_fill_progress<T>(total: u64, make: impl FnOnce(&AtomicU64) -> T) -> T {
    let filled = Arc::new(AtomicU64::new(0));
    let progress = Progress::filling(total, filled.clone());
    let made = make(&filled);
    progress.finish();
    made
}

/// An event that names an address (docs/cli.md, "Events"): `listening`,
/// the ready event of `tern receive` and `tern vm receive`, and
/// `migrating`, printed by `tern migrate --events` and `tern vm migrate
/// --events` as the migration starts.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct AddressEvent {
    /// `listening` or `migrating`.
    event: &'static str,
    /// The contract's version.
    version: u32,
    /// What to give `tern migrate --to`.
    address: String,
    /// `tcp`, `unix`, `vsock` or `fd`.
    transport: &'static str,
    /// The bound port (TCP, vsock).
    #[serde(skip_serializing_if = "Option::is_none")]
    port: Option<u32>,
}

fn address_event(event: &'static str, address: &Address) -> AddressEvent {
    match address {
        Address::Tcp(host_port) => AddressEvent {
            event,
            version: tern_engine::CONTRACT_VERSION,
            address: host_port.clone(),
            transport: "tcp",
            port: host_port
                .rsplit_once(':')
                .and_then(|(_, port)| port.parse().ok()),
        },
        Address::Unix(_) => AddressEvent {
            event,
            version: tern_engine::CONTRACT_VERSION,
            address: address.to_string(),
            transport: "unix",
            port: None,
        },
        Address::Vsock { port, .. } => AddressEvent {
            event,
            version: tern_engine::CONTRACT_VERSION,
            address: address.to_string(),
            transport: "vsock",
            port: Some(*port),
        },
        // `Fd`, and any kind a newer engine adds: its own transport name.
        _ => AddressEvent {
            event,
            version: tern_engine::CONTRACT_VERSION,
            address: address.to_string(),
            transport: address.transport(),
            port: None,
        },
    }
}

/// Prints an event as one JSON line on stdout and flushes it, so a script
/// that waits for the line sees it at once.
fn print_address_event(event: &'static str, address: &Address) -> anyhow::Result<()> {
    let line = serde_json::to_string(&address_event(event, address))?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")?;
    stdout.flush()?;
    Ok(())
}

/// The ready event: the destination accepts connections (and on which
/// port).
pub(crate) fn print_listening(address: &Address) -> anyhow::Result<()> {
    print_address_event("listening", address)
}

/// The source's start event: from this line on, the source connects to
/// `address` and sends pages; the guest's warm-up and fill are over.
pub(crate) fn print_migrating(address: &Address) -> anyhow::Result<()> {
    print_address_event("migrating", address)
}

/// Prints a JSON document to stdout.
pub(crate) fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints the human summary of a migration.
pub(crate) fn print_summary(stats: &MigrationStats, extra: &[(&str, String)]) {
    let rows = summary_rows(stats);
    let postcopy = stats
        .postcopy
        .as_ref()
        .map(postcopy_rows)
        .unwrap_or_default();
    let zero_detection = zero_detection_rows(stats);
    let compression = compression_rows(stats);
    let zero_copy = zero_copy_rows(stats);
    let destination_cpu = destination_rows(stats);
    let all: Vec<&(&str, String)> = rows
        .iter()
        .chain(postcopy.iter())
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
    if let Some(error) = &stats.error_desc {
        println!("{:>width$}  {error}", "error");
    }
    if let Some(warning) = downtime_warning(stats) {
        println!("{:>width$}  {warning}", "WARNING");
    }
}

/// The summary's rows every migration has.
fn summary_rows(stats: &MigrationStats) -> Vec<(&'static str, String)> {
    let ram = &stats.ram;
    vec![
        ("status", stats.status.as_str().to_string()),
        ("total time", format!("{} ms", stats.total_time)),
        ("setup time", format!("{} ms", stats.setup_time)),
        ("downtime", downtime_row(stats)),
        (
            "expected downtime",
            format!("{} ms", stats.expected_downtime),
        ),
        ("waited for destination", catch_up_row(stats)),
        (
            "source digest",
            format!(
                "{} ms ({} pages hashed again while paused)",
                stats.digest_time, stats.digest_rehashed_pages
            ),
        ),
        ("memory", human_bytes(ram.total)),
        ("transferred", human_bytes(ram.transferred)),
        ("throughput", format!("{:.0} Mbit/s", ram.mbps)),
        (
            "pages",
            format!("{} with data, {} zero", ram.normal, ram.duplicate),
        ),
        ("iterations", ram.iterations.to_string()),
        ("dirty syncs", ram.dirty_sync_count.to_string()),
        (
            "dirty rate (engine)",
            format!(
                "{} pages/s at the last dirty-log sync",
                ram.dirty_pages_rate
            ),
        ),
        (
            "bytes live / paused",
            format!(
                "{} / {}",
                human_bytes(ram.precopy_bytes),
                human_bytes(ram.downtime_bytes)
            ),
        ),
        ("throttle", format!("{}%", stats.cpu_throttle_percentage)),
        ("forced switch-over", stats.forced_switch_over.to_string()),
        ("digest verified", digest_line(stats)),
        (
            "security",
            stats
                .security
                .as_ref()
                .map_or_else(|| "not connected".into(), security_line),
        ),
        (
            "source CPU",
            format!("{:.2} s", stats.cpu_seconds.values().sum::<f64>()),
        ),
    ]
}

/// The destination's CPU and digest time, when it reported them.
fn destination_rows(stats: &MigrationStats) -> Vec<(&'static str, String)> {
    stats
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
        .unwrap_or_default()
}

/// One row per zero-copy sender.
fn zero_copy_rows(stats: &MigrationStats) -> Vec<(&'static str, String)> {
    stats
        .zero_copy
        .iter()
        .map(|zc| {
            (
                "zero-copy",
                format!(
                    "{} sends, {} copied by the kernel, {:.3} s waiting; last iteration: {}",
                    zc.sends_queued,
                    zc.sends_copied,
                    zc.wait_seconds,
                    zero_copy_at_last_sync(zc)
                ),
            )
        })
        .collect()
}

/// One row per codec used.
fn compression_rows(stats: &MigrationStats) -> Vec<(&'static str, String)> {
    stats
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
        .collect()
}

/// Who found the zero pages, with the offload device's figures.
fn zero_detection_rows(stats: &MigrationStats) -> Vec<(&'static str, String)> {
    stats
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
        .collect()
}

/// The postcopy lines of the summary, with QEMU's names in brackets.
fn postcopy_rows(report: &tern_engine::PostcopyReport) -> Vec<(&'static str, String)> {
    let trigger = report.trigger.map_or("unknown", |trigger| match trigger {
        tern_engine::PostcopyTrigger::Requested => "requested",
        tern_engine::PostcopyTrigger::Timer => "--postcopy-after",
        tern_engine::PostcopyTrigger::Throttle => "instead of throttling",
        tern_engine::PostcopyTrigger::Limit => "at a limit",
        tern_engine::PostcopyTrigger::FirstPass => "after the first pass",
        _ => "other",
    });
    vec![
        (
            "postcopy",
            format!(
                "{trigger}: {} stale pages, {} pushed ({} skipped: sent urgently), {} requested in {} requests ({} skipped: pushed), {} sent twice; {} (postcopy-bytes)",
                report.stale_pages,
                report.pushed_pages,
                report.push_skipped_pages,
                report.requested_pages,
                report.postcopy_requests,
                report.answer_skipped_pages,
                report.resent_pages,
                human_bytes(report.postcopy_bytes)
            ),
        ),
        (
            "postcopy push",
            format!(
                "{} pages in {} ({} compressed with {}, {} zero pages)",
                report.pushed_pages,
                human_bytes(report.push_bytes),
                report.push_compressed_pages,
                report.push_codec.as_deref().unwrap_or("no codec"),
                report.push_zero_pages
            ),
        ),
        (
            "page faults",
            format!(
                "{} on the destination, {:.0} µs average, blocktime {:.1} ms; histogram (µs, powers of 2): {:?}",
                report.faults,
                report.fault_latency_avg_us,
                report.postcopy_blocktime,
                report.fault_latency_histogram_us
            ),
        ),
        (
            "all memory delivered",
            format!(
                "{:.1} ms after the guest resumed",
                report.delivered_after_ms
            ),
        ),
    ]
}

/// How the session's channels were carried and protected, in one line:
/// `tcp, TLSv1_3 TLS13_AES_256_GCM_SHA384 in user space, authenticated`.
pub(crate) fn security_line(security: &SessionSecurity) -> String {
    let mut line = security.transport.clone();
    match &security.tls {
        Some(tls) => {
            let records = if tls.kernel_offload {
                "by the kernel"
            } else {
                "in user space"
            };
            line += &format!(", {} {} {records}", tls.version, tls.cipher);
        }
        None => line += ", no TLS",
    }
    line += if security.authenticated {
        ", authenticated"
    } else {
        ", not authenticated"
    };
    line
}

/// The downtime, its limit, and where it went.
fn downtime_row(stats: &MigrationStats) -> String {
    let mut row = format!("{} ms", stats.downtime);
    if stats.downtime_limit > 0 {
        row += &format!(" (limit {} ms)", stats.downtime_limit);
    }
    if let Some(parts) = &stats.downtime_parts {
        row += &format!(
            ": last pages {} ms, final rehash {} ms, state {} ms, destination {} ms",
            parts.final_pages, parts.final_rehash, parts.state, parts.destination
        );
    }
    row
}

/// How long the switch-over waited, the guest running, for the destination
/// to apply every pass but the last (protocol 12), and whether it paused
/// with the destination still behind.
fn catch_up_row(stats: &MigrationStats) -> String {
    match stats.destination_catch_up {
        None => "no".into(),
        Some(catch_up) if catch_up.behind_at_pause > 0 => format!(
            "{:.0} ms, then paused with it {} passes behind (the wait's budget ran out)",
            catch_up.waited_ms, catch_up.behind_at_pause
        ),
        Some(catch_up) => format!("{:.0} ms, until it caught up", catch_up.waited_ms),
    }
}

/// The warning line of a downtime that broke its limit.
fn downtime_warning(stats: &MigrationStats) -> Option<String> {
    let cause = stats
        .downtime_exceeded_cause
        .filter(|_| stats.downtime_exceeded)?;
    let overran = match (stats.downtime_overrun, stats.expected_downtime_parts) {
        (Some(side), Some(expected)) => format!(
            "; the {} overran its part (expected: source {} ms, destination {} ms)",
            side.as_str(),
            expected.source,
            expected.destination
        ),
        _ => String::new(),
    };
    // The destination's lag is downtime no estimate saw: name it.
    let lag = match stats.destination_catch_up {
        Some(catch_up) if catch_up.behind_at_pause > 0 => format!(
            "; the destination was {} passes behind at the pause, after a wait of {:.0} ms",
            catch_up.behind_at_pause, catch_up.waited_ms
        ),
        _ => String::new(),
    };
    Some(format!(
        "the downtime of {} ms broke the {} ms limit (expected {} ms); most of it: {}{overran}{lag}{}",
        stats.downtime,
        stats.downtime_limit,
        stats.expected_downtime,
        cause.as_str(),
        if stats.forced_switch_over {
            " (the switch-over was forced by a limit)"
        } else {
            ""
        }
    ))
}

/// Whether the digests matched, with the values compared: the evidence, not
/// the setting.
fn digest_line(stats: &MigrationStats) -> String {
    match stats.digest_comparison {
        Some(comparison) => format!(
            "{} (source {:032x}, destination {:032x})",
            stats.digest_verified, comparison.source, comparison.destination
        ),
        None => format!("{} (not compared)", stats.digest_verified),
    }
}

/// Prints `rows` as an aligned two-column summary under `title`.
pub(crate) fn print_rows(title: &str, rows: &[(&str, String)]) {
    let width = rows.iter().map(|(key, _)| key.len()).max().unwrap_or(0);
    println!("{title}");
    for (key, value) in rows {
        println!("  {key:width$}  {value}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_event_gives_an_address_to_migrate_to() {
        let event = address_event("listening", &Address::Tcp("127.0.0.1:4444".into()));
        assert_eq!(
            serde_json::to_string(&event).unwrap(),
            r#"{"event":"listening","version":1,"address":"127.0.0.1:4444","transport":"tcp","port":4444}"#
        );
        let event = address_event("listening", &Address::Unix("/tmp/t.sock".into()));
        assert_eq!(event.address, "unix:/tmp/t.sock");
        assert!(event.address.parse::<Address>().is_ok());
        assert_eq!(event.port, None);
    }

    #[test]
    fn migrating_event_has_the_listening_event_shape() {
        let event = address_event("migrating", &Address::Tcp("10.0.0.2:4444".into()));
        assert_eq!(
            serde_json::to_string(&event).unwrap(),
            r#"{"event":"migrating","version":1,"address":"10.0.0.2:4444","transport":"tcp","port":4444}"#
        );
    }

    #[test]
    fn a_broken_downtime_limit_prints_a_warning_with_its_cause() {
        let stats_json = serde_json::json!({
            "status": "completed", "total-time": 900, "setup-time": 3,
            "downtime": 420, "downtime-limit": 300, "downtime-exceeded": true,
            "downtime-exceeded-cause": "final-rehash",
            "downtime-parts": {"final-pages": 20, "final-rehash": 380, "state": 1, "destination": 19},
            "expected-downtime": 40, "digest-time": 380,
            "ram": {"transferred": 0, "precopy-bytes": 0, "downtime-bytes": 0,
                    "multifd-bytes": 0, "page-size": 4096, "remaining": 0, "total": 0,
                    "duplicate": 0, "normal": 0, "normal-bytes": 0, "mbps": 0.0,
                    "pages-per-second": 0, "dirty-sync-count": 1, "dirty-pages-rate": 0,
                    "iterations": 1},
            "cpu-throttle-percentage": 0, "forced-switch-over": false,
            "digest-verified": true, "cpu-seconds": {}
        });
        let mut stats: MigrationStats = serde_json::from_value(stats_json).unwrap();
        let warning = downtime_warning(&stats).expect("a warning");
        assert!(
            warning.contains("420 ms broke the 300 ms limit"),
            "{warning}"
        );
        assert!(warning.ends_with("final-rehash"), "{warning}");
        assert!(downtime_row(&stats).contains("final rehash 380 ms"));
        assert_eq!(catch_up_row(&stats), "no");
        // Paused with the destination behind: the warning names its lag.
        let behind: tern_engine::DestinationCatchUp =
            serde_json::from_value(serde_json::json!({"waited-ms": 3000.0, "behind-at-pause": 2}))
                .unwrap();
        stats.destination_catch_up = Some(behind);
        let warning = downtime_warning(&stats).expect("a warning");
        assert!(
            warning.contains("the destination was 2 passes behind at the pause"),
            "{warning}"
        );
        assert!(catch_up_row(&stats).contains("2 passes behind"));
        stats.downtime_exceeded = false;
        assert_eq!(downtime_warning(&stats), None);
    }

    #[test]
    fn plain_line_shows_the_share_done() {
        let line = plain_line(&View {
            phase: "active",
            position: 1 << 30,
            length: 4 << 30,
            what: "of this iteration's dirty memory sent",
            detail: "iteration 0".into(),
        });
        assert!(
            line.starts_with("active 25%: 1.00 GiB of 4.00 GiB"),
            "{line}"
        );
        assert!(line.ends_with("; iteration 0"), "{line}");
    }

    #[test]
    fn zero_copy_is_reported_per_sync() {
        let mut stats = tern_engine::zerocopy::ZeroCopyStats::default();
        stats.sends_completed = 30;
        stats.sends_copied = 30;
        let counters = stats.at_sync(&Default::default());
        assert_eq!(
            zero_copy_at_last_sync(&counters),
            "30 of 30 sends copied by the kernel at sync 1"
        );
    }
}

//! Migration statistics: one struct of atomics updated by the pipeline, and
//! one place that renders it with QEMU's `query-migrate` names.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tern_wire::OutcomeStats;

use crate::zerocopy::ZeroCopyStats;

/// Version of the report, event and parameter contract scripts rely on
/// (docs/control.md): raised when a field changes meaning or goes away; new
/// fields may appear within a version.
pub const CONTRACT_VERSION: u32 = 1;

/// Where a migration is.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    strum::IntoStaticStr,
    schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
#[repr(u8)]
#[non_exhaustive]
pub enum MigrationStatus {
    /// Connecting and handshaking.
    Setup = 0,
    /// Sending pages while the guest runs.
    Active = 1,
    /// Guest paused, sending the last pages and state.
    Device = 2,
    /// Done; the destination verified and resumed the guest.
    Completed = 3,
    /// Failed; the source guest runs on.
    Failed = 4,
    /// Cancelled; the source guest runs on.
    Cancelled = 5,
    /// The source committed the switch-over, and the destination did not
    /// confirm it resumed the guest; the source guest stays paused (see
    /// [`crate::MigrationError::OutcomeUnknown`]).
    OutcomeUnknown = 6,
    /// The guest runs on the destination, which fetches the pages it
    /// still lacks from the paused source (docs/postcopy.md).
    PostcopyActive = 7,
    /// Postcopy lost its connection: the guest runs on the destination
    /// (threads touching a missing page wait), the source's copy stays
    /// frozen, and the sides reconnect (QEMU's `postcopy-paused`;
    /// docs/postcopy.md, "Recovery").
    PostcopyPaused = 8,
    /// A paused postcopy reconnects: the destination welcomed the
    /// source's resume, and the sides exchange what is missing before
    /// postcopy goes on (QEMU's `postcopy-recover`; a failed attempt
    /// goes back to `postcopy-paused`).
    PostcopyRecover = 9,
}

impl MigrationStatus {
    fn from_u8(value: u8) -> Self {
        match value {
            0 => Self::Setup,
            1 => Self::Active,
            2 => Self::Device,
            3 => Self::Completed,
            4 => Self::Failed,
            5 => Self::Cancelled,
            7 => Self::PostcopyActive,
            8 => Self::PostcopyPaused,
            9 => Self::PostcopyRecover,
            _ => Self::OutcomeUnknown,
        }
    }

    /// The name users see.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Whether the migration has ended in this status.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            Self::Completed | Self::Failed | Self::Cancelled | Self::OutcomeUnknown
        )
    }
}

/// Live counters, shared by the migration's threads and readable at any
/// time (for progress display) through [`LiveStats::snapshot`].
#[derive(Debug)]
pub struct LiveStats {
    origin: Instant,
    /// The switch-over's steps (`switch_over_timeline.rs`).
    pub(crate) timeline: crate::switch_over_timeline::TimelineRecorder,
    /// When the migration started, as nanoseconds after `origin`.
    start_offset_ns: AtomicU64,
    status: AtomicU8,
    /// Bytes written to all channels.
    pub(crate) transferred: AtomicU64,
    /// Of those, bytes written while the guest ran (live iterations).
    pub(crate) precopy_bytes: AtomicU64,
    /// Of those, bytes written while the guest was paused (the last pages,
    /// the device state and the completion message).
    pub(crate) downtime_bytes: AtomicU64,
    /// Of those, bytes written to the page channels (everything but the main
    /// channel).
    pub(crate) multifd_bytes: AtomicU64,
    /// Pages sent as zero pages.
    pub(crate) duplicate: AtomicU64,
    /// Pages sent with their data.
    pub(crate) normal: AtomicU64,
    /// Guest bytes of those pages.
    pub(crate) normal_bytes: AtomicU64,
    /// Dirty bytes not sent yet: set from the dirty bitmap when an
    /// iteration starts, lowered as its pages are sent.
    pub(crate) remaining: AtomicU64,
    /// Dirty bytes the current iteration started with (its whole size).
    pub(crate) iteration_bytes: AtomicU64,
    /// Guest memory size.
    pub(crate) total: AtomicU64,
    /// Dirty-log syncs done.
    pub(crate) dirty_sync_count: AtomicU64,
    /// The engine's measured dirty rate: pages the last dirty-log sync found
    /// dirty, divided by the time since the sync before it (or since dirty
    /// logging started), as QEMU's `dirty-pages-rate`.
    pub(crate) dirty_pages_rate: AtomicU64,
    /// Migration bandwidth in guest bytes per second (last iteration).
    pub(crate) bandwidth: AtomicU64,
    /// Expected downtime in milliseconds.
    pub(crate) expected_downtime_ms: AtomicU64,
    /// The source's and the destination's parts of it.
    expected_source_ms: AtomicU64,
    expected_destination_ms: AtomicU64,
    /// Current iteration.
    pub(crate) iteration: AtomicU64,
    /// Current auto-converge throttle, in percent.
    pub(crate) cpu_throttle_percentage: AtomicU64,
    /// Whether the switch-over was forced by a limit.
    pub(crate) forced_switch_over: AtomicBool,
    /// Microseconds the source waited, its guest running, for the
    /// destination to apply every pass but the last before pausing.
    catch_up_micros: AtomicU64,
    /// Whether the source held its switch-over for the destination at
    /// all (a wait can round to 0 µs, and the live query shows a hold from
    /// its start).
    held_for_destination: AtomicBool,
    /// Passes the destination was behind (beyond the one in flight) when
    /// the guest paused anyway: the wait's budget had run out.
    behind_at_pause: AtomicU64,
    setup_time_ms: AtomicU64,
    downtime_ms: AtomicU64,
    downtime_limit_ms: AtomicU64,
    /// Milliseconds of the downtime spent sending the last pages and
    /// sending the device state.
    final_pages_ms: AtomicU64,
    state_ms: AtomicU64,
    digest_time_ms: AtomicU64,
    digest_rehashed_pages: AtomicU64,
    digest_audit_passes: AtomicU64,
    total_time_ms: AtomicU64,
    digest_verified: AtomicBool,
    digest_comparison: Mutex<Option<DigestComparison>>,
    cpu_seconds: Mutex<BTreeMap<String, f64>>,
    /// What postcopy did, once it started.
    postcopy: Mutex<Option<crate::postcopy::PostcopyReport>>,
    zero_copy: Mutex<Option<ZeroCopyStats>>,
    /// Each zero-copy channel's latest counters (published at every sync
    /// and at the end), by page channel index.
    zero_copy_channels: Mutex<BTreeMap<usize, ZeroCopyStats>>,
    compression: Mutex<Option<CompressionReport>>,
    zero_detection: Mutex<Option<ZeroDetectionReport>>,
    session_security: Mutex<Option<SessionSecurity>>,
    /// Duplicate pages sent as references (`--dedup`).
    dedup_pages: AtomicU64,
    /// The delta cache's size, 0 without one, and its counters.
    xbzrle_cache_size: AtomicU64,
    xbzrle_pages: AtomicU64,
    xbzrle_bytes: AtomicU64,
    xbzrle_cache_miss: AtomicU64,
    xbzrle_overflow: AtomicU64,
    /// The transfer rate over the last window, for live queries.
    rate_window: Mutex<RateWindow>,
}

/// Bytes per second written over the latest window of at least
/// [`RATE_WINDOW`], updated when a query finds the window over.
#[derive(Debug, Default)]
struct RateWindow {
    started: Option<Instant>,
    transferred_at_start: u64,
    rate: u64,
}

/// The shortest window the live transfer rate is measured over.
pub const RATE_WINDOW: Duration = Duration::from_secs(1);

impl RateWindow {
    /// The rate of the last complete window, starting a new one when the
    /// current one is over.
    fn sample(&mut self, now: Instant, transferred: u64) -> u64 {
        match self.started {
            Some(started) if now.duration_since(started) >= RATE_WINDOW => {
                let seconds = now.duration_since(started).as_secs_f64();
                let bytes = transferred.saturating_sub(self.transferred_at_start);
                self.rate = crate::numeric::saturating_u64_from_f64(bytes as f64 / seconds);
                self.started = Some(now);
                self.transferred_at_start = transferred;
            }
            Some(_) => {}
            None => {
                self.started = Some(now);
                self.transferred_at_start = transferred;
            }
        }
        self.rate
    }
}

/// How the session's channels were carried and protected, as the main
/// channel's handshake established it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct SessionSecurity {
    /// `tcp`, `unix`, `vsock` or `fd`.
    pub transport: String,
    /// Whether the destination proved who it is (key or certificate).
    pub authenticated: bool,
    /// TLS, when the channels run it.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tls: Option<crate::transport::security::TlsInfo>,
}

impl Default for LiveStats {
    fn default() -> Self {
        Self::new()
    }
}

impl LiveStats {
    /// Fresh counters; the clock starts now.
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
            timeline: Default::default(),
            start_offset_ns: AtomicU64::new(0),
            status: AtomicU8::new(MigrationStatus::Setup as u8),
            transferred: AtomicU64::new(0),
            precopy_bytes: AtomicU64::new(0),
            downtime_bytes: AtomicU64::new(0),
            multifd_bytes: AtomicU64::new(0),
            duplicate: AtomicU64::new(0),
            normal: AtomicU64::new(0),
            normal_bytes: AtomicU64::new(0),
            remaining: AtomicU64::new(0),
            iteration_bytes: AtomicU64::new(0),
            total: AtomicU64::new(0),
            dirty_sync_count: AtomicU64::new(0),
            dirty_pages_rate: AtomicU64::new(0),
            bandwidth: AtomicU64::new(0),
            expected_downtime_ms: AtomicU64::new(0),
            expected_source_ms: AtomicU64::new(0),
            expected_destination_ms: AtomicU64::new(0),
            iteration: AtomicU64::new(0),
            cpu_throttle_percentage: AtomicU64::new(0),
            forced_switch_over: AtomicBool::new(false),
            catch_up_micros: AtomicU64::new(0),
            held_for_destination: AtomicBool::new(false),
            behind_at_pause: AtomicU64::new(0),
            setup_time_ms: AtomicU64::new(0),
            downtime_ms: AtomicU64::new(0),
            downtime_limit_ms: AtomicU64::new(0),
            final_pages_ms: AtomicU64::new(0),
            state_ms: AtomicU64::new(0),
            digest_time_ms: AtomicU64::new(0),
            digest_rehashed_pages: AtomicU64::new(0),
            digest_audit_passes: AtomicU64::new(0),
            total_time_ms: AtomicU64::new(0),
            digest_verified: AtomicBool::new(false),
            digest_comparison: Mutex::new(None),
            cpu_seconds: Mutex::new(BTreeMap::new()),
            postcopy: Mutex::new(None),
            zero_copy: Mutex::new(None),
            zero_copy_channels: Mutex::new(BTreeMap::new()),
            compression: Mutex::new(None),
            zero_detection: Mutex::new(None),
            session_security: Mutex::new(None),
            dedup_pages: AtomicU64::new(0),
            xbzrle_cache_size: AtomicU64::new(0),
            xbzrle_pages: AtomicU64::new(0),
            xbzrle_bytes: AtomicU64::new(0),
            xbzrle_cache_miss: AtomicU64::new(0),
            xbzrle_overflow: AtomicU64::new(0),
            rate_window: Mutex::new(RateWindow::default()),
        }
    }

    /// Bytes per second written to all channels over the latest complete
    /// window of at least [`RATE_WINDOW`] (0 before one completed; a window
    /// ends at the first query after it is over).
    pub fn transfer_rate(&self) -> u64 {
        let transferred = self.transferred.load(Ordering::Relaxed);
        self.rate_window
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .sample(Instant::now(), transferred)
    }

    /// Adds one batch's duplicate and delta counts.
    pub(crate) fn add_reuse(&self, counts: &ReuseCounts) {
        self.dedup_pages
            .fetch_add(counts.duplicate_pages, Ordering::Relaxed);
        self.xbzrle_pages
            .fetch_add(counts.delta_pages, Ordering::Relaxed);
        self.xbzrle_bytes
            .fetch_add(counts.delta_bytes, Ordering::Relaxed);
        self.xbzrle_cache_miss
            .fetch_add(counts.cache_misses, Ordering::Relaxed);
        self.xbzrle_overflow
            .fetch_add(counts.overflows, Ordering::Relaxed);
    }

    /// The delta cache's size (it is reported only when it exists).
    pub(crate) fn set_delta_cache_size(&self, bytes: u64) {
        self.xbzrle_cache_size.store(bytes, Ordering::Relaxed);
    }

    fn dedup_stats(&self) -> Option<DedupStats> {
        let pages = self.dedup_pages.load(Ordering::Relaxed);
        (pages > 0).then(|| DedupStats {
            pages,
            bytes_saved: pages * (crate::guest::PAGE_SIZE - tern_wire::PageRef::ENCODED_LEN) as u64,
        })
    }

    fn xbzrle_stats(&self) -> Option<XbzrleCacheStats> {
        let cache_size = self.xbzrle_cache_size.load(Ordering::Relaxed);
        if cache_size == 0 {
            return None;
        }
        let pages = self.xbzrle_pages.load(Ordering::Relaxed);
        let bytes = self.xbzrle_bytes.load(Ordering::Relaxed);
        let cache_miss = self.xbzrle_cache_miss.load(Ordering::Relaxed);
        let overflow = self.xbzrle_overflow.load(Ordering::Relaxed);
        let looked_up = pages + cache_miss + overflow;
        Some(XbzrleCacheStats {
            cache_size,
            bytes,
            pages,
            cache_miss,
            cache_miss_rate: if looked_up == 0 {
                0.0
            } else {
                cache_miss as f64 / looked_up as f64
            },
            encoding_rate: if bytes == 0 {
                0.0
            } else {
                (pages * crate::guest::PAGE_SIZE as u64) as f64 / bytes as f64
            },
            overflow,
        })
    }

    /// When the migration started.
    pub fn started(&self) -> Instant {
        self.origin + Duration::from_nanos(self.start_offset_ns.load(Ordering::Relaxed))
    }

    /// Starts the clock now (the stats may be created well before).
    pub(crate) fn start_clock(&self) {
        let offset = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.start_offset_ns.store(offset, Ordering::Relaxed);
    }

    /// Current status.
    pub fn status(&self) -> MigrationStatus {
        MigrationStatus::from_u8(self.status.load(Ordering::Acquire))
    }

    pub(crate) fn set_status(&self, status: MigrationStatus) {
        self.status.store(status as u8, Ordering::Release);
        if matches!(
            status,
            MigrationStatus::Completed | MigrationStatus::Failed | MigrationStatus::Cancelled
        ) {
            self.total_time_ms
                .store(millis(self.started().elapsed()), Ordering::Relaxed);
        }
    }

    pub(crate) fn set_setup_time(&self, time: Duration) {
        self.setup_time_ms.store(millis(time), Ordering::Relaxed);
    }

    pub(crate) fn set_downtime(&self, time: Duration) {
        self.downtime_ms.store(millis(time), Ordering::Relaxed);
    }

    /// The source holds its switch-over for the destination from now on.
    pub(crate) fn record_hold(&self) {
        self.held_for_destination.store(true, Ordering::Relaxed);
    }

    /// The source waited `waited` for the destination to catch up.
    pub(crate) fn record_catch_up(&self, waited: Duration) {
        self.record_hold();
        self.catch_up_micros.fetch_add(
            crate::numeric::saturating_u64(waited.as_micros()),
            Ordering::Relaxed,
        );
    }

    /// The guest paused with the destination `passes` behind.
    pub(crate) fn record_behind_at_pause(&self, passes: u32) {
        self.record_hold();
        self.behind_at_pause
            .store(u64::from(passes), Ordering::Relaxed);
    }

    pub(crate) fn destination_catch_up(&self) -> Option<DestinationCatchUp> {
        self.held_for_destination
            .load(Ordering::Relaxed)
            .then(|| DestinationCatchUp {
                waited_ms: self.catch_up_micros.load(Ordering::Relaxed) as f64 / 1000.0,
                behind_at_pause: self.behind_at_pause.load(Ordering::Relaxed),
            })
    }

    pub(crate) fn set_downtime_limit(&self, limit: Duration) {
        self.downtime_limit_ms
            .store(millis(limit), Ordering::Relaxed);
    }

    /// The downtime limit in force, in milliseconds.
    pub(crate) fn downtime_limit_ms(&self) -> u64 {
        self.downtime_limit_ms.load(Ordering::Relaxed)
    }

    /// Records the last sync's expected downtime in its two parts.
    pub(crate) fn set_expected_split(&self, source_ms: u64, destination_ms: u64) {
        self.expected_source_ms.store(source_ms, Ordering::Relaxed);
        self.expected_destination_ms
            .store(destination_ms, Ordering::Relaxed);
    }

    pub(crate) fn set_final_pages_time(&self, time: Duration) {
        self.final_pages_ms.store(millis(time), Ordering::Relaxed);
    }

    pub(crate) fn set_state_time(&self, time: Duration) {
        self.state_ms.store(millis(time), Ordering::Relaxed);
    }

    /// Where the downtime went; the destination's part is what the others
    /// leave.
    fn downtime_parts(&self, downtime: u64) -> DowntimeParts {
        let final_pages = self.final_pages_ms.load(Ordering::Relaxed);
        let final_rehash = self.digest_time_ms.load(Ordering::Relaxed);
        let state = self.state_ms.load(Ordering::Relaxed);
        DowntimeParts {
            final_pages,
            final_rehash,
            state,
            destination: downtime.saturating_sub(final_pages + final_rehash + state),
        }
    }

    pub(crate) fn set_digest_time(&self, time: Duration) {
        self.digest_time_ms.store(millis(time), Ordering::Relaxed);
    }

    pub(crate) fn record_digest_rehash(&self, pages: u64) {
        self.digest_rehashed_pages.store(pages, Ordering::Relaxed);
    }

    /// Records the digests the switch-over compared; the migration counts
    /// as verified only once [`Self::set_digest_verified`] says the
    /// destination acknowledged the commit as well.
    pub(crate) fn set_digest_comparison(&self, comparison: DigestComparison) {
        *self
            .digest_comparison
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(comparison);
    }

    /// The migration is verified when the digests were compared and
    /// matched, and the destination, which compared them too before it said
    /// ready, resumed the guest: evidence, never configuration.
    pub(crate) fn set_digest_verified_from_comparison(&self) {
        let matched = self
            .digest_comparison
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|comparison| comparison.matched());
        self.digest_verified.store(matched, Ordering::Relaxed);
    }

    /// Records the CPU time a thread used; called by each thread as it ends.
    pub(crate) fn record_cpu(&self, thread: &str, seconds: f64) {
        let mut map = self.cpu_seconds.lock().unwrap_or_else(|e| e.into_inner());
        *map.entry(thread.to_string()).or_insert(0.0) += seconds;
    }

    /// Records how the session's channels are carried and protected.
    pub(crate) fn record_security(&self, security: SessionSecurity) {
        *self
            .session_security
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(security);
    }

    /// Replaces page channel `channel`'s zero-copy counters with newer ones
    /// (its sender publishes them at every sync and when it ends), so the
    /// live statistics show them while the migration runs.
    pub(crate) fn publish_zero_copy(&self, channel: usize, counters: &ZeroCopyStats) {
        self.zero_copy_channels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(channel, *counters);
    }

    /// Everything recorded and published, summed over channels.
    fn zero_copy_total(&self) -> Option<ZeroCopyStats> {
        let recorded = *self.zero_copy.lock().unwrap_or_else(|e| e.into_inner());
        let channels = self
            .zero_copy_channels
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        channels.values().fold(recorded, |total, channel| {
            let mut total = total.unwrap_or_default();
            total.add(channel);
            Some(total)
        })
    }

    /// Replaces the compression report (the producer publishes it after each
    /// iteration).
    pub(crate) fn set_compression(&self, report: CompressionReport) {
        *self.compression.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
    }

    /// Replaces the zero-page detection report.
    pub(crate) fn set_zero_detection(&self, report: ZeroDetectionReport) {
        *self
            .zero_detection
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(report);
    }

    /// Counts `bytes` written to a channel: to `transferred`, and to
    /// `downtime-bytes` when the guest was paused (`paused`), to
    /// `precopy-bytes` otherwise; to `multifd-bytes` too for a page channel.
    pub(crate) fn add_sent(&self, bytes: u64, paused: bool, page_channel: bool) {
        self.transferred.fetch_add(bytes, Ordering::Relaxed);
        let phase = if paused {
            &self.downtime_bytes
        } else {
            &self.precopy_bytes
        };
        phase.fetch_add(bytes, Ordering::Relaxed);
        if page_channel {
            self.multifd_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// Counts `bytes` written after the switch to postcopy: part of
    /// `transferred` (and of `multifd-bytes` on a page channel), in neither
    /// `precopy-bytes` nor `downtime-bytes`.
    pub(crate) fn add_postcopy_sent(&self, bytes: u64, page_channel: bool) {
        self.transferred.fetch_add(bytes, Ordering::Relaxed);
        if page_channel {
            self.multifd_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// Records what postcopy did (replacing the previous record).
    pub(crate) fn set_postcopy(&self, report: crate::postcopy::PostcopyReport) {
        *self.postcopy.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
    }

    /// Starts an iteration of `bytes` dirty bytes: the progress of an
    /// iteration is `iteration_bytes - remaining` of `iteration_bytes`.
    pub(crate) fn start_iteration(&self, bytes: u64) {
        self.iteration_bytes.store(bytes, Ordering::Relaxed);
        self.remaining.store(bytes, Ordering::Relaxed);
    }

    /// Counts `bytes` of the current iteration as sent.
    pub(crate) fn sent_dirty(&self, bytes: u64) {
        let _ = self
            .remaining
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |remaining| {
                Some(remaining.saturating_sub(bytes))
            });
    }

    /// Complete passes the dirty-log audit made over memory (a write the
    /// dirty log forgot is found by the first pass that starts after it).
    pub fn audit_passes(&self) -> u64 {
        self.digest_audit_passes.load(Ordering::Relaxed)
    }

    pub(crate) fn record_audit_pass(&self) {
        self.digest_audit_passes.fetch_add(1, Ordering::Relaxed);
    }

    /// The current dirty iteration, counting from 0.
    pub fn iteration(&self) -> u64 {
        self.iteration.load(Ordering::Relaxed)
    }

    /// Bytes written to all channels so far.
    pub fn transferred_bytes(&self) -> u64 {
        self.transferred.load(Ordering::Relaxed)
    }

    /// Dirty bytes not sent yet in the current iteration.
    pub fn remaining_bytes(&self) -> u64 {
        self.remaining.load(Ordering::Relaxed)
    }

    /// The current iteration's progress: bytes sent of the bytes it started
    /// with.
    pub fn iteration_progress(&self) -> (u64, u64) {
        let size = self.iteration_bytes.load(Ordering::Relaxed);
        let remaining = self.remaining.load(Ordering::Relaxed).min(size);
        (size - remaining, size)
    }

    /// The `ram` part of a snapshot; `seconds` is the time the averages
    /// are over.
    fn ram_stats(&self, status: MigrationStatus, seconds: f64) -> RamStats {
        let transferred = self.transferred.load(Ordering::Relaxed);
        let normal = self.normal.load(Ordering::Relaxed);
        let duplicate = self.duplicate.load(Ordering::Relaxed);
        RamStats {
            transferred,
            precopy_bytes: self.precopy_bytes.load(Ordering::Relaxed),
            downtime_bytes: self.downtime_bytes.load(Ordering::Relaxed),
            multifd_bytes: self.multifd_bytes.load(Ordering::Relaxed),
            page_size: crate::guest::PAGE_SIZE as u64,
            remaining: self.remaining.load(Ordering::Relaxed),
            total: self.total.load(Ordering::Relaxed),
            duplicate,
            normal,
            normal_bytes: self.normal_bytes.load(Ordering::Relaxed),
            mbps: transferred as f64 * 8.0 / 1e6 / seconds,
            pages_per_second: crate::numeric::saturating_u64_from_f64(
                (normal + duplicate) as f64 / seconds,
            ),
            dirty_sync_count: self.dirty_sync_count.load(Ordering::Relaxed),
            dirty_pages_rate: self.dirty_pages_rate.load(Ordering::Relaxed),
            iterations: self.iteration.load(Ordering::Relaxed),
            transfer_rate: if status.is_final() {
                0
            } else {
                self.transfer_rate()
            },
        }
    }

    /// A consistent-enough copy for display or the final report.
    // long: one line per field of the report
    pub fn snapshot(&self) -> MigrationStats {
        let status = self.status();
        let total_time_ms = if matches!(
            status,
            MigrationStatus::Completed | MigrationStatus::Failed | MigrationStatus::Cancelled
        ) {
            self.total_time_ms.load(Ordering::Relaxed)
        } else {
            millis(self.started().elapsed())
        };
        let seconds = (total_time_ms as f64 / 1000.0).max(1e-3);
        let cpu_seconds = self
            .cpu_seconds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let downtime = self.downtime_ms.load(Ordering::Relaxed);
        let downtime_limit = self.downtime_limit_ms.load(Ordering::Relaxed);
        let parts = self.downtime_parts(downtime);
        let expected = ExpectedDowntimeParts {
            source: self.expected_source_ms.load(Ordering::Relaxed),
            destination: self.expected_destination_ms.load(Ordering::Relaxed),
        };
        let exceeded = downtime_limit > 0 && downtime > downtime_limit;
        MigrationStats {
            version: CONTRACT_VERSION,
            status,
            failed_in: None,
            total_time: total_time_ms,
            setup_time: self.setup_time_ms.load(Ordering::Relaxed),
            downtime,
            downtime_limit,
            downtime_exceeded: exceeded,
            downtime_exceeded_cause: exceeded.then(|| parts.largest()),
            downtime_parts: (downtime > 0).then_some(parts),
            expected_downtime: self.expected_downtime_ms.load(Ordering::Relaxed),
            expected_downtime_parts: (downtime > 0).then_some(expected),
            downtime_overrun: exceeded.then(|| expected.overrun(&parts)),
            destination_catch_up: self.destination_catch_up(),
            switch_over_timeline: self.timeline.report(),
            digest_time: self.digest_time_ms.load(Ordering::Relaxed),
            digest_rehashed_pages: self.digest_rehashed_pages.load(Ordering::Relaxed),
            ram: self.ram_stats(status, seconds),
            cpu_throttle_percentage: self.cpu_throttle_percentage.load(Ordering::Relaxed),
            forced_switch_over: self.forced_switch_over.load(Ordering::Relaxed),
            digest_verified: self.digest_verified.load(Ordering::Relaxed),
            digest_comparison: *self
                .digest_comparison
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
            cpu_seconds,
            zero_copy: self.zero_copy_total(),
            security: self
                .session_security
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            compression: self
                .compression
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            zero_page_detection: self
                .zero_detection
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            dedup: self.dedup_stats(),
            xbzrle_cache: self.xbzrle_stats(),
            postcopy: self
                .postcopy
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            destination: None,
            error_desc: None,
        }
    }
}

/// Pages sent as references to a page with the same bytes (`--dedup`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct DedupStats {
    /// Pages sent as duplicates.
    pub pages: u64,
    /// Guest bytes they did not send (a page less its 8-byte reference).
    pub bytes_saved: u64,
}

/// The delta cache's counters under QEMU's `xbzrle-cache` names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct XbzrleCacheStats {
    /// Cache size in bytes (`--delta-cache-size`).
    pub cache_size: u64,
    /// Bytes of the delta records sent.
    pub bytes: u64,
    /// Pages sent as deltas.
    pub pages: u64,
    /// Data pages not in the cache (sent whole, then cached). Pages the
    /// cache does not admit (the first pass; while deltas mostly overflow,
    /// pages outside the probed sample) are not looked up: they count in
    /// none of these.
    pub cache_miss: u64,
    /// Share of looked-up pages that missed.
    pub cache_miss_rate: f64,
    /// Guest bytes per delta byte of the delta pages.
    pub encoding_rate: f64,
    /// Cached pages that changed too much for a delta (sent whole).
    pub overflow: u64,
}

/// Per-batch counters of duplicate and delta pages, added to the live
/// counters when the batch completes (defined here so that the statistics
/// depend on no part of the pipeline).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ReuseCounts {
    pub(crate) duplicate_pages: u64,
    pub(crate) delta_pages: u64,
    pub(crate) delta_bytes: u64,
    pub(crate) cache_misses: u64,
    pub(crate) overflows: u64,
}

/// Milliseconds, saturating.
pub(crate) fn millis(time: Duration) -> u64 {
    u64::try_from(time.as_millis()).unwrap_or(u64::MAX)
}

/// Where the downtime went, in milliseconds.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct DowntimeParts {
    /// Sending the pages dirtied since the last sync (the link).
    pub final_pages: u64,
    /// Finishing the digest: hashing stale pages again and combining.
    pub final_rehash: u64,
    /// Saving and sending the device state.
    pub state: u64,
    /// Waiting for the destination: its last pages, its verification,
    /// restoring and resuming the guest, and the answer's way back.
    pub destination: u64,
}

impl DowntimeParts {
    /// The part that took the longest.
    pub fn largest(&self) -> DowntimeCause {
        [
            (self.final_pages, DowntimeCause::Link),
            (self.final_rehash, DowntimeCause::FinalRehash),
            (self.state, DowntimeCause::State),
            (self.destination, DowntimeCause::Peer),
        ]
        .into_iter()
        .max_by_key(|&(ms, _)| ms)
        .map_or(DowntimeCause::Link, |(_, cause)| cause)
    }
}

/// The source held its switch-over because the destination had not yet
/// applied every pass but the last one sent (it says which it applied,
/// protocol 12): the guest ran on, and the source sent more passes, until
/// it caught up or the wait's budget ran out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct DestinationCatchUp {
    /// Time the source waited for it in all, its guest running, in
    /// milliseconds.
    pub waited_ms: f64,
    /// Passes the destination was still behind, beyond the one in flight,
    /// when the guest paused: 0 when it caught up; more when the budget
    /// ran out, which then explains a downtime over the limit.
    pub behind_at_pause: u64,
}

/// The downtime the last sync expected, by who spends it, in milliseconds.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct ExpectedDowntimeParts {
    /// The source's part: the last pages (link or codec, the slower) and
    /// finishing the digest; compare with `final-pages + final-rehash +
    /// state` of [`DowntimeParts`].
    pub source: u64,
    /// The destination's part: placing the last pages where slower than
    /// the source sends them, then verification, state and resume, from
    /// the figures its heartbeats and passes applied carried; compare with
    /// [`DowntimeParts::destination`].
    pub destination: u64,
}

impl ExpectedDowntimeParts {
    /// The side whose measured part overran its expected part by more.
    pub fn overrun(&self, actual: &DowntimeParts) -> DowntimeSide {
        let source =
            (actual.final_pages + actual.final_rehash + actual.state).saturating_sub(self.source);
        let destination = actual.destination.saturating_sub(self.destination);
        if destination > source {
            DowntimeSide::Destination
        } else {
            DowntimeSide::Source
        }
    }
}

/// Which side of the switch-over overran what the estimate gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum DowntimeSide {
    /// The source: its last pages, digest or state took longer than
    /// expected.
    Source,
    /// The destination: placing the last pages, verifying or resuming took
    /// longer than its figures said.
    Destination,
}

impl DowntimeSide {
    /// The name in JSON and in the summary.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Source => "source",
            Self::Destination => "destination",
        }
    }
}

/// Why the downtime broke its limit: the part of the switch-over that took
/// the longest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum DowntimeCause {
    /// Sending the last dirty pages: more than the link carried in time.
    Link,
    /// Finishing the digest.
    FinalRehash,
    /// Saving and sending the device state.
    State,
    /// The destination: slow to verify, restore or resume, or stalled.
    Peer,
}

impl DowntimeCause {
    /// The name in JSON and in the summary.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Link => "link",
            Self::FinalRehash => "final-rehash",
            Self::State => "state",
            Self::Peer => "peer",
        }
    }
}

/// Memory counters, named as in QEMU's `query-migrate` `ram` object.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct RamStats {
    /// Bytes written to the channels (headers included).
    pub transferred: u64,
    /// Bytes written while the guest ran (the live iterations).
    pub precopy_bytes: u64,
    /// Bytes written while the guest was paused; with `precopy-bytes` it
    /// makes up `transferred`.
    pub downtime_bytes: u64,
    /// Bytes written to the page channels (tern's counterpart of QEMU's
    /// multifd channels); the rest went over the main channel.
    pub multifd_bytes: u64,
    /// Guest page size in bytes.
    pub page_size: u64,
    /// Dirty bytes not sent yet.
    pub remaining: u64,
    /// Guest memory size.
    pub total: u64,
    /// Pages sent as zero pages.
    pub duplicate: u64,
    /// Pages sent with data.
    pub normal: u64,
    /// Guest bytes of the normal pages.
    pub normal_bytes: u64,
    /// Average wire throughput in megabits per second.
    pub mbps: f64,
    /// Pages (zero or not) per second.
    pub pages_per_second: u64,
    /// Dirty-log syncs.
    pub dirty_sync_count: u64,
    /// The engine's measured dirty rate: pages the last dirty-log sync of
    /// the live phase found dirty, per second since the sync before it.
    pub dirty_pages_rate: u64,
    /// Dirty iterations done (tern's addition).
    pub iterations: u64,
    /// Bytes per second written to all channels over the latest window of
    /// at least a second, while the migration runs (tern's addition).
    #[serde(default)]
    pub transfer_rate: u64,
}

/// The statistics of one side of a migration. Durations are milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct MigrationStats {
    /// The report contract's version ([`CONTRACT_VERSION`]).
    #[serde(default)]
    pub version: u32,
    /// Final or current status.
    pub status: MigrationStatus,
    /// The status the migration was in when it failed: `setup` means
    /// nothing was sent (the destination could not be reached, or the
    /// handshake failed).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub failed_in: Option<MigrationStatus>,
    /// From start to the end (or to now).
    pub total_time: u64,
    /// Connecting and handshaking.
    pub setup_time: u64,
    /// Guest paused on the source until it runs on the destination
    /// (including the digest comparison).
    pub downtime: u64,
    /// The downtime the migration was asked to keep (`--downtime-limit`).
    #[serde(default)]
    pub downtime_limit: u64,
    /// Whether the measured downtime broke the limit.
    #[serde(default)]
    pub downtime_exceeded: bool,
    /// When the limit was broken, the part of the downtime that took the
    /// longest (see [`DowntimeCause`]).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub downtime_exceeded_cause: Option<DowntimeCause>,
    /// Where the downtime went, once the guest resumed on the destination.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub downtime_parts: Option<DowntimeParts>,
    /// Downtime the last dirty-log sync predicted: the dirty pages still to
    /// send at the measured bandwidth, plus finishing the digest and the
    /// device state (see `docs/verification.md`), and the destination's
    /// share from the figures of its heartbeats and passes applied.
    pub expected_downtime: u64,
    /// The expected downtime in its two parts, to set beside
    /// `downtime-parts`, once the guest resumed on the destination.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub expected_downtime_parts: Option<ExpectedDowntimeParts>,
    /// When the limit was broken, the side whose part overran its
    /// expectation by more (see [`DowntimeSide`]).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub downtime_overrun: Option<DowntimeSide>,
    /// When the source held its switch-over for the destination to catch
    /// up (see [`DestinationCatchUp`]); absent when it never had to.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub destination_catch_up: Option<DestinationCatchUp>,
    /// The switch-over's steps as the source took them, from the pause
    /// (its origin) to the destination's outcome, each with the recording
    /// thread's CPU and run-queue time since its previous step.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub switch_over_timeline: Option<crate::SwitchOverTimeline>,
    /// Time the source spent finishing its incremental digest after the
    /// last pages were sent (`--verify full`): hashing the pages marked
    /// stale again and combining the page hashes; part of the downtime.
    pub digest_time: u64,
    /// Pages the source hashed again while paused to finish the digest
    /// (pages the dirty-log audit found changed, and any never hashed).
    #[serde(default)]
    pub digest_rehashed_pages: u64,
    /// Memory counters.
    pub ram: RamStats,
    /// Auto-converge throttle at the end, in percent.
    pub cpu_throttle_percentage: u64,
    /// Whether an iteration or time limit forced the switch-over.
    pub forced_switch_over: bool,
    /// Whether the destination's memory digest matched the source's: true
    /// only when both digests were compared (see `digest-comparison`) and
    /// equal, and the destination resumed the guest.
    pub digest_verified: bool,
    /// The two digests the switch-over compared, when it compared them
    /// (also on a mismatch): the evidence behind `digest-verified`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub digest_comparison: Option<DigestComparison>,
    /// CPU seconds per thread of this side.
    pub cpu_seconds: BTreeMap<String, f64>,
    /// Compression counters, when compression was on.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub compression: Option<CompressionReport>,
    /// How zero pages were found.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub zero_page_detection: Option<ZeroDetectionReport>,
    /// Zero-copy accounting over all channels, when `--zero-copy` was on.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub zero_copy: Option<ZeroCopyStats>,
    /// Duplicate pages sent as references, when there were any.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dedup: Option<DedupStats>,
    /// The delta cache, when it was on (QEMU's `xbzrle-cache`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub xbzrle_cache: Option<XbzrleCacheStats>,
    /// What postcopy did, when the migration switched to it
    /// (docs/postcopy.md).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub postcopy: Option<crate::postcopy::PostcopyReport>,
    /// The destination's own statistics, when it sent them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub destination: Option<DestinationStats>,
    /// The transport and security of the session (`transport`,
    /// `authenticated`, `tls`), once the main channel is connected.
    #[serde(flatten, default)]
    pub security: Option<SessionSecurity>,
    /// What went wrong, when something did.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error_desc: Option<String>,
}

/// Compression of one codec implementation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct CodecReport {
    /// Data pages given to the codec (raw fallbacks included).
    pub pages: u64,
    /// Pages sent compressed.
    pub compressed: u64,
    /// Pages compressed but sent raw because they did not shrink.
    pub raw_fallbacks: u64,
    /// Pages sent raw without compressing: the sample looked random.
    pub skipped_by_sampling: u64,
    /// Pages an accelerator could not take, compressed in software.
    pub offload_fallbacks: u64,
    /// Guest bytes in.
    pub bytes_in: u64,
    /// Bytes out (raw pages count whole).
    pub bytes_out: u64,
    /// bytes-in / bytes-out.
    pub ratio: f64,
    /// Worker CPU seconds spent in the codec (sampling included).
    pub cpu_seconds: f64,
}

impl From<&tern_page::codec::CodecCounters> for CodecReport {
    /// The JSON shape of a worker's counters (tern-page stays free of serde).
    fn from(counters: &tern_page::codec::CodecCounters) -> Self {
        Self {
            pages: counters.pages,
            compressed: counters.compressed,
            raw_fallbacks: counters.raw_fallbacks,
            skipped_by_sampling: counters.skipped_by_sampling,
            offload_fallbacks: counters.offload_fallbacks,
            bytes_in: counters.bytes_in,
            bytes_out: counters.bytes_out,
            ratio: counters.ratio(),
            cpu_seconds: counters.cpu_seconds(),
        }
    }
}

/// Compression over the whole migration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct CompressionReport {
    /// What was asked for: a codec, or `auto`.
    pub choice: String,
    /// Level in force, after the codec clamped it (with `auto`: the level
    /// asked for, which each codec clamps; `None`: each codec's default).
    pub level: Option<i32>,
    /// Times adaptive compression changed codec.
    pub codec_switches: u64,
    /// Per codec implementation (zstd's packet frames count as zstd).
    pub codecs: BTreeMap<String, CodecReport>,
    /// The zstd dictionary trained at setup, if any, and its refreshes.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub dictionary: Option<DictionaryReport>,
    /// With `auto`: what it decided and why (docs/compression.md, "Auto").
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub auto: Option<AutoReport>,
}

/// What adaptive compression (`auto`) decided during a migration.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub struct AutoReport {
    /// Every decision that changed something, in order (at most
    /// [`AutoReport::MAX_DECISIONS`]; later ones are counted in
    /// `decisions-dropped`).
    pub decisions: Vec<AutoDecisionReport>,
    /// Decisions left out of `decisions` for its bound.
    #[serde(default)]
    pub decisions_dropped: u64,
    /// Times the codec changed.
    pub codec_switches: u64,
    /// Times the level changed.
    pub level_changes: u64,
    /// Changes a decision window proposed and hysteresis confirmed, but
    /// that were refused because the switches allowed were spent.
    pub switches_held: u64,
    /// Times the guest's content changed character (the ratio of the codec
    /// in force moved by more than 30 % for two windows), which renews the
    /// switches allowed.
    pub content_changes: u64,
    /// The link rate auto last decided on, in bytes per second (0: not yet
    /// measured).
    pub link_rate: u64,
}

impl AutoReport {
    /// Bound of [`AutoReport::decisions`].
    pub const MAX_DECISIONS: usize = 64;

    /// Appends a decision, within the bound.
    pub fn record(&mut self, decision: AutoDecisionReport) {
        if self.decisions.len() < Self::MAX_DECISIONS {
            self.decisions.push(decision);
        } else {
            self.decisions_dropped += 1;
        }
    }
}

/// One of `auto`'s decisions.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub struct AutoDecisionReport {
    /// Milliseconds since the migration started.
    pub at_ms: u64,
    /// What was decided: `codec` (zstd's packet frames are the codec
    /// `zstd-packet`), `level`, `dictionary`, `delta-cache` or `content`.
    pub subject: String,
    /// The choice: a codec name, a level, `on`/`off` or a size in bytes.
    pub choice: String,
    /// Why, from what was measured.
    pub reason: String,
}

/// The zstd dictionary a migration trained at setup and sent, and the
/// ones it trained again during the live phase.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct DictionaryReport {
    /// Its size on the wire, in bytes.
    pub bytes: u64,
    /// Guest pages sampled to train it (zero and random-looking pages are
    /// then left out).
    pub sample_pages: u64,
    /// Wall-clock time of sampling and training, in milliseconds (part of
    /// the setup time).
    pub training_ms: f64,
    /// Dictionaries trained in all: the setup's and the refreshes.
    #[serde(default)]
    pub trained: u64,
    /// Dictionaries trained again on the pages being sent and announced
    /// during the live phase (docs/compression.md, "Refresh").
    #[serde(default)]
    pub refreshes: u64,
    /// Wall-clock time the refreshes' training took in all, in
    /// milliseconds, on a background thread (not the per-page path).
    #[serde(default)]
    pub refresh_training_ms: f64,
}

/// How zero pages were found.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct ZeroDetectionReport {
    /// `none`, `source`, `workers` or `dsa`.
    pub mode: String,
    /// The CPU backend (`avx512`, …) or the offload's description.
    pub backend: String,
    /// Accelerator counters in `dsa` mode.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub offload: Option<OffloadReport>,
}

/// Accelerator counters.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct OffloadReport {
    /// Pages the device answered.
    pub pages_device: u64,
    /// Pages checked on the CPU because that is the backend.
    pub pages_cpu: u64,
    /// Pages the device could not answer, finished on the CPU.
    pub cpu_fallbacks: u64,
    /// Pages that came back with a page fault.
    pub page_faults: u64,
    /// Device errors and timeouts.
    pub device_errors: u64,
    /// Submissions that reached a device.
    pub batches: u64,
    /// Submission attempts refused and retried.
    pub submit_retries: u64,
    /// Descriptors a queue refused for good (after its retries), their
    /// pages checked on the CPU.
    #[serde(default)]
    pub submit_failures: u64,
    /// Pages checked on the CPU because every queue was full.
    #[serde(default)]
    pub pages_queue_full: u64,
    /// Queues taken out of use (errors, timeouts, refusals, or disabled by
    /// the kernel).
    #[serde(default)]
    pub queues_disabled: u64,
    /// Batch slots never reused because the device may still write them.
    #[serde(default)]
    pub slots_retired: u64,
    /// CPU seconds of the completion thread.
    pub completion_thread_cpu_seconds: f64,
    /// Completion-thread CPU seconds per GiB checked.
    pub cpu_seconds_per_gib: f64,
}

/// The two memory digests a switch-over compared (docs/verification.md),
/// each 32 hexadecimal digits in JSON.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct DigestComparison {
    /// The source's digest of its memory, paused.
    #[serde(with = "hex_digest")]
    #[schemars(with = "String")]
    pub source: u128,
    /// The destination's digest of the memory it received.
    #[serde(with = "hex_digest")]
    #[schemars(with = "String")]
    pub destination: u128,
}

impl DigestComparison {
    /// Whether the two digests are the same.
    pub fn matched(&self) -> bool {
        self.source == self.destination
    }
}

/// A 128-bit digest as 32 hexadecimal digits: JSON numbers that large lose
/// precision in most readers.
mod hex_digest {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub(super) fn serialize<S: Serializer>(
        digest: &u128,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&format!("{digest:032x}"))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<u128, D::Error> {
        let text = String::deserialize(deserializer)?;
        u128::from_str_radix(&text, 16).map_err(D::Error::custom)
    }
}

/// What the destination reports back at the end.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct DestinationStats {
    /// Bytes read from all channels.
    pub received: u64,
    /// Zero pages received.
    pub zero_pages: u64,
    /// Zero pages that had to be cleared because the page held data.
    pub zero_pages_cleared: u64,
    /// Pages received with data.
    pub normal_pages: u64,
    /// Milliseconds spent computing the memory digest.
    pub digest_time: u64,
    /// CPU seconds per thread; on the destination's own copy
    /// (`Received::stats`) also `decoders`, the decoder pool's threads
    /// together, which the outcome message does not carry to the source.
    pub cpu_seconds: BTreeMap<String, f64>,
    /// What postcopy did here, on the destination's own copy, when the
    /// migration switched to it.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub postcopy: Option<crate::postcopy::PostcopyReport>,
    /// On the destination's own copy, the switch-over's steps as it took
    /// them, from reading the source's `Complete` (its origin) to sending
    /// its outcome, each receiver's last iteration included.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub switch_over_timeline: Option<crate::SwitchOverTimeline>,
}

impl DestinationStats {
    /// The statistics the destination's outcome message carries, with CPU
    /// times under the thread names `main` and `receiver-<n>`.
    pub(crate) fn from_wire(stats: &OutcomeStats) -> Self {
        let seconds = |nanos: u64| nanos as f64 / 1e9;
        let mut cpu_seconds = BTreeMap::new();
        cpu_seconds.insert("main".to_string(), seconds(stats.main_cpu_nanos));
        for (index, &nanos) in stats.receiver_cpu_nanos.iter().enumerate() {
            cpu_seconds.insert(format!("receiver-{index}"), seconds(nanos));
        }
        Self {
            received: stats.received_bytes,
            zero_pages: stats.zero_pages,
            zero_pages_cleared: stats.zero_pages_cleared,
            normal_pages: stats.normal_pages,
            digest_time: stats.digest_micros / 1000,
            cpu_seconds,
            postcopy: None,
            switch_over_timeline: None,
        }
    }
}

/// CPU time used so far by the calling thread.
pub fn thread_cpu_seconds() -> f64 {
    // The one CPU-clock helper of the workspace, in nanoseconds.
    tern_page::cpu_time::thread_cpu_ns() as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_copy_counters_published_at_syncs_are_live_and_summed() {
        let stats = LiveStats::new();
        assert!(stats.snapshot().zero_copy.is_none());
        let first_sync = ZeroCopyStats {
            sends_queued: 10,
            sends_completed: 10,
            sends_copied: 4,
            zero_copy_bytes: 1000,
            copied_bytes: 400,
            ..ZeroCopyStats::default()
        }
        .at_sync(&ZeroCopyStats::default());
        stats.publish_zero_copy(0, &first_sync);
        let live = stats.snapshot().zero_copy.expect("published");
        assert_eq!((live.syncs, live.last_sync_sends_copied), (1, 4));
        let second_sync = ZeroCopyStats {
            sends_queued: 16,
            sends_completed: 16,
            sends_copied: 5,
            zero_copy_bytes: 1600,
            copied_bytes: 500,
            ..ZeroCopyStats::default()
        }
        .at_sync(&first_sync);
        stats.publish_zero_copy(0, &second_sync);
        stats.publish_zero_copy(1, &first_sync);
        let live = stats.snapshot().zero_copy.expect("published");
        assert_eq!(live.syncs, 2);
        assert_eq!(live.sends_completed, 26);
        assert_eq!(live.last_sync_sends_completed, 6 + 10);
        assert_eq!(live.last_sync_sends_copied, 1 + 4);
        assert_eq!(live.last_sync_copied_bytes, 100 + 400);
        let json = serde_json::to_value(stats.snapshot()).unwrap();
        assert_eq!(json["zero-copy"]["last-sync-sends-copied"], 5);
        assert_eq!(json["zero-copy"]["syncs"], 2);
    }

    #[test]
    fn json_uses_qemu_names() {
        let stats = LiveStats::new();
        stats.normal.store(3, Ordering::Relaxed);
        stats.set_status(MigrationStatus::Completed);
        let json = serde_json::to_value(stats.snapshot()).unwrap();
        assert_eq!(json["status"], "completed");
        for key in [
            "total-time",
            "setup-time",
            "downtime",
            "expected-downtime",
            "digest-verified",
        ] {
            assert!(json.get(key).is_some(), "{key}");
        }
        for key in [
            "transferred",
            "remaining",
            "total",
            "duplicate",
            "normal",
            "normal-bytes",
            "mbps",
            "pages-per-second",
            "dirty-sync-count",
            "dirty-pages-rate",
            "page-size",
            "precopy-bytes",
            "downtime-bytes",
            "multifd-bytes",
        ] {
            assert!(json["ram"].get(key).is_some(), "{key}");
        }
        assert_eq!(json["ram"]["normal"], 3);
        assert_eq!(json["ram"]["page-size"], 4096);
        assert_eq!(json["cpu-throttle-percentage"], 0);
        assert!(json.get("error-desc").is_none());
        let mut failed = stats.snapshot();
        failed.error_desc = Some("broken".into());
        let json = serde_json::to_value(&failed).unwrap();
        assert_eq!(json["error-desc"], "broken");
        let back: MigrationStats = serde_json::from_value(json).unwrap();
        assert_eq!(back, failed);
    }

    #[test]
    fn sent_bytes_split_by_phase_and_channel() {
        let stats = LiveStats::new();
        stats.add_sent(1000, false, true);
        stats.add_sent(200, false, false);
        stats.add_sent(30, true, true);
        stats.add_sent(4, true, false);
        let ram = stats.snapshot().ram;
        assert_eq!(ram.transferred, 1234);
        assert_eq!(ram.precopy_bytes, 1200);
        assert_eq!(ram.downtime_bytes, 34);
        assert_eq!(ram.precopy_bytes + ram.downtime_bytes, ram.transferred);
        assert_eq!(ram.multifd_bytes, 1030);
    }

    #[test]
    fn remaining_falls_as_an_iteration_is_sent() {
        let stats = LiveStats::new();
        stats.start_iteration(10 * 4096);
        assert_eq!(stats.iteration_progress(), (0, 10 * 4096));
        stats.sent_dirty(3 * 4096);
        assert_eq!(stats.remaining.load(Ordering::Relaxed), 7 * 4096);
        assert_eq!(stats.iteration_progress(), (3 * 4096, 10 * 4096));
        // Never below zero, even if more is counted than was dirty.
        stats.sent_dirty(20 * 4096);
        assert_eq!(stats.iteration_progress(), (10 * 4096, 10 * 4096));
        stats.start_iteration(4096);
        assert_eq!(stats.iteration_progress(), (0, 4096));
    }

    #[test]
    fn thread_cpu_time_moves() {
        let before = thread_cpu_seconds();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(thread_cpu_seconds() > before);
    }
}

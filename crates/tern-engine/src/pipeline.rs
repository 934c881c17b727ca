//! The source's page pipeline: producer → workers → channel senders.
//!
//! The producer (the migration thread) cuts dirty pages into batches of up
//! to [`MAX_PAGES_PER_PACKET`] pages of one region and gives each batch to a
//! worker whose request ring has room, scanning from where it last placed
//! one rather than strictly round-robin (seed 003's lesson: a busy worker
//! should not stall the producer while another is idle). A worker
//! classifies the batch's pages (zero or data; compression plugs in here),
//! encodes the packet's header and page table, and hands the batch to the
//! least-loaded channel sender. The sender writes the header, table and the
//! data pages straight from guest memory with one `sendmsg`, and returns the
//! batch on the completion ring, from which the producer recycles it.
//!
//! Batches are allocated once, up front: their number bounds the data in
//! flight, and no allocation happens on the per-page path.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

use tern_page::codec::{CodecChoice, CodecId, CodecStats, CompressedBatch, PageOutcome, QplPath};
use tern_page::dsa::{ZeroAsNormal, ZeroPageOffload};
use tern_page::{PageCompressor, ZeroChecker};
use tern_wire::{MAX_PAGES_PER_PACKET, Message, PageEntry, PageKind, Sync, encode_pages_prefix};

use crate::bitmap::DirtyBitmap;
use crate::config::ZeroPageDetection;
use crate::error::ChannelError;
use crate::error::MigrationError;
use crate::guest::{MemoryRegion, PAGE_SIZE};
use crate::ring::{Doorbell, Ring};
use crate::stats::{
    CodecReport, CompressionReport, LiveStats, OffloadReport, ZeroDetectionReport,
    thread_cpu_seconds,
};
use crate::transport::{Channel, Segment};
use crate::zerocopy::{ZeroCopyError, ZeroCopyStats, ZeroCopyTransport};

/// Requests a worker may have queued.
const WORKER_RING_CAPACITY: usize = 4;
/// Batches in flight per worker, on top of the ring's capacity.
const BATCHES_PER_WORKER: usize = 8;

/// A batch of pages of one region, travelling through the pipeline.
#[derive(Debug)]
pub(crate) struct Batch {
    region: usize,
    iteration: u32,
    /// Part of the switch-over pass, sent while the guest is paused.
    paused: bool,
    pages: Vec<u32>,
    /// Filled by the producer in `source` mode, by the worker otherwise.
    kinds: Vec<PageKind>,
    prechecked: bool,
    /// Codec for this batch's data pages, chosen by the producer.
    codec: CodecId,
    compressed: CompressedBatch,
    /// What the worker's compressor did for this batch.
    codec_stats: CodecStats,
    entries: Vec<PageEntry>,
    prefix: Vec<u8>,
    wire_bytes: u64,
    zero_pages: u64,
    normal_pages: u64,
}

impl Batch {
    fn new() -> Self {
        Self {
            region: 0,
            iteration: 0,
            paused: false,
            pages: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            kinds: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            prechecked: false,
            codec: CodecId::None,
            compressed: CompressedBatch::new(),
            codec_stats: CodecStats::default(),
            entries: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            prefix: Vec::with_capacity(64 + MAX_PAGES_PER_PACKET * PageEntry::ENCODED_LEN),
            wire_bytes: 0,
            zero_pages: 0,
            normal_pages: 0,
        }
    }

    fn reset(&mut self, region: usize, iteration: u32, paused: bool, codec: CodecId) {
        self.region = region;
        self.iteration = iteration;
        self.paused = paused;
        self.codec = codec;
        self.pages.clear();
        self.kinds.clear();
        self.prechecked = false;
    }
}

/// How a sender writes its channel.
pub(crate) enum PageSender {
    /// `sendmsg` copying from guest memory.
    Plain(Channel),
    /// Zero-copy sends from guest memory (`MSG_ZEROCOPY` or io_uring).
    ZeroCopy(Box<dyn ZeroCopyTransport>),
}

impl PageSender {
    fn channel(&self) -> &Channel {
        match self {
            Self::Plain(channel) => channel,
            Self::ZeroCopy(sender) => sender.channel(),
        }
    }

    /// Zero-copy accounting, for the zero-copy variants.
    fn zero_copy_stats(&self) -> Option<ZeroCopyStats> {
        match self {
            Self::Plain(_) => None,
            Self::ZeroCopy(sender) => Some(sender.stats()),
        }
    }

    fn write_control(&mut self, bytes: &[u8]) -> Result<(), ChannelError> {
        match self {
            Self::Plain(channel) => channel.write_all(bytes),
            Self::ZeroCopy(sender) => {
                // Everything sent before a sync completes before it: at each
                // iteration's end and before switch-over nothing is pending.
                sender.flush().map_err(ZeroCopyError::into_channel_error)?;
                sender.channel_mut().write_all(bytes)
            }
        }
    }
}

enum SendItem {
    Batch(Box<Batch>),
    Sync(Sync),
}

enum Completion {
    Batch(Box<Batch>),
    Synced,
}

/// Serialises the channels' writes to a byte rate without a lock: each
/// packet reserves a time slot with one atomic update and sleeps until it.
#[derive(Debug)]
struct RateLimiter {
    bytes_per_second: u64,
    origin: Instant,
    next_free_ns: AtomicU64,
}

impl RateLimiter {
    fn acquire(&self, bytes: u64) {
        let cost =
            u64::try_from(u128::from(bytes) * 1_000_000_000 / u128::from(self.bytes_per_second))
                .unwrap_or(u64::MAX);
        let now = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let mut slot = self.next_free_ns.load(Ordering::Relaxed);
        loop {
            let start = slot.max(now);
            match self.next_free_ns.compare_exchange_weak(
                slot,
                start.saturating_add(cost),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    slot = start;
                    break;
                }
                Err(current) => slot = current,
            }
        }
        if slot > now {
            thread::sleep(Duration::from_nanos(slot - now));
        }
    }
}

/// State shared by the pipeline's threads.
struct Shared {
    regions: Vec<MemoryRegion>,
    region_ids: Vec<u32>,
    stats: Arc<LiveStats>,
    zero_checker: ZeroChecker,
    detection: ZeroPageDetection,
    /// The accelerator (or its software stand-in) in `dsa` mode.
    zero_offload: Option<Arc<dyn ZeroPageOffload>>,
    /// Benchmark knob: a share of zero pages sent as normal pages.
    zero_as_normal: Option<ZeroAsNormal>,
    compression: CompressionSetup,
    /// Nanoseconds senders spent sending (blocked included), for the link
    /// estimate of adaptive compression.
    sender_busy_ns: AtomicU64,
    worker_rings: Vec<Ring<Box<Batch>>>,
    worker_bells: Vec<OnceLock<Doorbell>>,
    sender_rings: Vec<Ring<SendItem>>,
    sender_bells: Vec<OnceLock<Doorbell>>,
    completions: Ring<Completion>,
    producer_bell: Doorbell,
    stopping: AtomicBool,
    /// The first error of any pipeline thread; not on the per-page path.
    failure: Mutex<Option<MigrationError>>,
    limiter: Option<RateLimiter>,
}

impl Shared {
    fn fail(&self, error: MigrationError) {
        let mut slot = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(error);
        }
        drop(slot);
        self.stop();
    }

    fn take_failure(&self) -> Option<MigrationError> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.ring_all();
    }

    fn ring_all(&self) {
        self.producer_bell.ring();
        for bell in self.worker_bells.iter().chain(&self.sender_bells) {
            if let Some(bell) = bell.get() {
                bell.ring();
            }
        }
    }

    fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }
}

/// Totals of one dirty iteration, for convergence decisions.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IterationTotals {
    pub pages: u64,
    pub wire_bytes: u64,
}

/// What the workers compress with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CompressionSetup {
    pub choice: CodecChoice,
    pub level: Option<i32>,
    pub qpl_path: QplPath,
}

impl CompressionSetup {
    /// Codecs the session may use (announced in the hello as a bitmask).
    pub fn codecs(&self) -> Vec<CodecId> {
        match self.choice.wire() {
            Some(CodecId::None) => Vec::new(),
            Some(codec) => vec![codec],
            // auto: the codecs this build has (see tern-page's features).
            None => [CodecId::Zstd, CodecId::Deflate, CodecId::Lz4]
                .into_iter()
                .filter(|codec| codec.is_built())
                .collect(),
        }
    }

    /// A compressor for `codec`, as the user's choice asks (QPL for deflate
    /// when `qpl` was chosen).
    pub fn compressor(&self, codec: CodecId) -> Result<PageCompressor, tern_page::CodecError> {
        let level = self.level.unwrap_or_else(|| codec.default_level());
        if self.choice == CodecChoice::Qpl && codec == CodecId::Deflate {
            PageCompressor::with_qpl(self.qpl_path, level)
        } else {
            PageCompressor::new(codec, level)
        }
    }
}

/// Adaptive compression: the producer re-decides the codec every so many
/// batches from the link rate and the codecs' measured speed and ratio.
struct AutoCodec {
    selector: tern_page::AutoSelector,
    /// Calibrated at start, then updated from the workers' counters.
    measurements: Vec<tern_page::codec::CodecMeasurement>,
    batches_since: u64,
    window_started: Instant,
    wire_at_start: u64,
    busy_at_start: u64,
    switches: u64,
}

/// Adaptive compression decides again after at least this many batches and
/// this much time: enough to measure the link, often enough to follow it.
const AUTO_DECISION_BATCHES: u64 = 16;
const AUTO_DECISION_INTERVAL: Duration = Duration::from_millis(50);

/// The producer's handle on a running pipeline.
pub(crate) struct Pipeline<'scope> {
    shared: Arc<Shared>,
    // Boxed so that rings move a pointer, not the batch's vectors' headers.
    #[allow(clippy::vec_box)]
    pool: Vec<Box<Batch>>,
    in_flight: usize,
    next_worker: usize,
    channel_count: usize,
    handles: Vec<ScopedJoinHandle<'scope, ()>>,
    shutdown_handles: Vec<Channel>,
    cancel: Arc<AtomicBool>,
    totals: IterationTotals,
    codec: CodecId,
    auto: Option<AutoCodec>,
    codec_stats: CodecStats,
    /// For zero-page detection in `source` mode.
    scratch: Scratch,
}

/// Settings of the pipeline.
pub(crate) struct PipelineSetup {
    pub regions: Vec<MemoryRegion>,
    pub workers: usize,
    pub detection: ZeroPageDetection,
    pub zero_offload: Option<Arc<dyn ZeroPageOffload>>,
    pub zero_as_normal: f64,
    pub compression: CompressionSetup,
    pub max_bandwidth: Option<u64>,
    pub stats: Arc<LiveStats>,
    pub cancel: Arc<AtomicBool>,
}

impl<'scope> Pipeline<'scope> {
    /// Starts workers and one sender per page channel inside `scope`.
    pub fn start<'env>(
        scope: &'scope Scope<'scope, 'env>,
        setup: PipelineSetup,
        channels: Vec<PageSender>,
    ) -> Result<Self, MigrationError> {
        let channel_count = channels.len();
        let pool_size = setup.workers * (WORKER_RING_CAPACITY + BATCHES_PER_WORKER);
        let shared = Arc::new(Shared {
            region_ids: setup.regions.iter().map(MemoryRegion::id).collect(),
            regions: setup.regions,
            stats: setup.stats,
            zero_checker: ZeroChecker::best(),
            detection: setup.detection,
            zero_offload: setup.zero_offload,
            zero_as_normal: (setup.zero_as_normal > 0.0)
                .then(|| ZeroAsNormal::new(setup.zero_as_normal)),
            compression: setup.compression,
            sender_busy_ns: AtomicU64::new(0),
            worker_rings: (0..setup.workers)
                .map(|_| Ring::new(WORKER_RING_CAPACITY))
                .collect(),
            worker_bells: (0..setup.workers).map(|_| OnceLock::new()).collect(),
            // Every batch and one sync fit, so workers never wait for room.
            sender_rings: (0..channel_count)
                .map(|_| Ring::new(pool_size + 1))
                .collect(),
            sender_bells: (0..channel_count).map(|_| OnceLock::new()).collect(),
            completions: Ring::new(pool_size + channel_count),
            producer_bell: Doorbell::for_current_thread(),
            stopping: AtomicBool::new(false),
            failure: Mutex::new(None),
            limiter: setup.max_bandwidth.map(|bytes_per_second| RateLimiter {
                bytes_per_second,
                origin: Instant::now(),
                next_free_ns: AtomicU64::new(0),
            }),
        });
        let mut pipeline = Self {
            shared: shared.clone(),
            pool: (0..pool_size).map(|_| Box::new(Batch::new())).collect(),
            in_flight: 0,
            next_worker: 0,
            channel_count,
            handles: Vec::new(),
            shutdown_handles: Vec::new(),
            cancel: setup.cancel,
            totals: IterationTotals::default(),
            codec: setup.compression.choice.wire().unwrap_or(CodecId::None),
            auto: None,
            codec_stats: CodecStats::default(),
            scratch: Scratch::default(),
        };
        if setup.compression.choice == CodecChoice::Auto {
            pipeline.auto = Some(AutoCodec {
                selector: tern_page::AutoSelector::new(setup.workers),
                measurements: calibrate_codecs(&shared.regions),
                batches_since: 0,
                window_started: Instant::now(),
                wire_at_start: 0,
                busy_at_start: 0,
                switches: 0,
            });
        }
        for index in 0..shared.worker_rings.len() {
            let shared_for_thread = shared.clone();
            let handle = thread::Builder::new()
                .name(format!("tern-worker-{index}"))
                .spawn_scoped(scope, move || run_worker(&shared_for_thread, index))
                .map_err(MigrationError::Thread)?;
            let _ = shared.worker_bells[index].set(Doorbell::new(handle.thread().clone()));
            pipeline.handles.push(handle);
        }
        for (index, channel) in channels.into_iter().enumerate() {
            pipeline.shutdown_handles.push(
                channel
                    .channel()
                    .try_clone()
                    .map_err(MigrationError::channel(index + 1))?,
            );
            let shared_for_thread = shared.clone();
            let handle = thread::Builder::new()
                .name(format!("tern-sender-{index}"))
                .spawn_scoped(scope, move || {
                    run_sender(&shared_for_thread, index, channel)
                })
                .map_err(MigrationError::Thread)?;
            let _ = shared.sender_bells[index].set(Doorbell::new(handle.thread().clone()));
            pipeline.handles.push(handle);
        }
        Ok(pipeline)
    }

    /// Sends every page set in `bitmaps` (one per region) as part of
    /// `iteration`, then ends the iteration on every channel with a sync.
    /// `last` is the switch-over pass, sent with the guest paused.
    pub fn send_iteration(
        &mut self,
        bitmaps: &[DirtyBitmap],
        iteration: u32,
        last: bool,
    ) -> Result<IterationTotals, MigrationError> {
        self.totals = IterationTotals::default();
        let dirty_pages: u64 = bitmaps.iter().map(DirtyBitmap::count).sum();
        self.shared
            .stats
            .start_iteration(dirty_pages * PAGE_SIZE as u64);
        for (region, bitmap) in bitmaps.iter().enumerate() {
            let mut batch: Option<Box<Batch>> = None;
            for page in bitmap.iter_dirty() {
                let current = match batch.as_mut() {
                    Some(current) => current,
                    None => {
                        let mut fresh = self.take_batch()?;
                        fresh.reset(region, iteration, last, self.codec);
                        batch.insert(fresh)
                    }
                };
                // Region sizes are validated against the protocol's 32-bit
                // page indices before the migration starts.
                current.pages.push(page as u32);
                if current.pages.len() == MAX_PAGES_PER_PACKET
                    && let Some(full) = batch.take()
                {
                    self.submit(full)?;
                }
            }
            if let Some(partial) = batch.take() {
                self.submit(partial)?;
            }
        }
        self.sync_channels(iteration, last)?;
        self.publish_reports();
        Ok(self.totals)
    }

    fn check(&self) -> Result<(), MigrationError> {
        if self.shared.is_stopping() {
            return Err(self.take_failure());
        }
        if self.cancel.load(Ordering::Relaxed) {
            return Err(MigrationError::Cancelled);
        }
        Ok(())
    }

    fn take_failure(&self) -> MigrationError {
        self.shared
            .take_failure()
            .unwrap_or_else(|| MigrationError::Protocol("the pipeline stopped".into()))
    }

    fn take_batch(&mut self) -> Result<Box<Batch>, MigrationError> {
        loop {
            if let Some(batch) = self.pool.pop() {
                return Ok(batch);
            }
            self.wait_for_completion()?;
        }
    }

    /// Adaptive compression: every [`AUTO_DECISION_INTERVAL`], picks
    /// the codec that moves guest memory fastest over the link as measured.
    fn maybe_switch_codec(&mut self) {
        let Some(auto) = self.auto.as_mut() else {
            return;
        };
        auto.batches_since += 1;
        if auto.batches_since < AUTO_DECISION_BATCHES
            || auto.window_started.elapsed() < AUTO_DECISION_INTERVAL
        {
            return;
        }
        let elapsed = auto.window_started.elapsed().as_secs_f64().max(1e-6);
        let wire = self.shared.stats.transferred.load(Ordering::Relaxed);
        let busy = self.shared.sender_busy_ns.load(Ordering::Relaxed);
        let wire_rate = (wire - auto.wire_at_start) as f64 / elapsed;
        // The share of time the senders were busy: near 1 the link is the
        // bottleneck and the wire rate is its capacity; lower, the link
        // could carry proportionally more.
        let busy_share =
            ((busy - auto.busy_at_start) as f64 / 1e9 / (elapsed * self.channel_count as f64))
                .clamp(0.05, 1.0);
        let link = wire_rate / busy_share;
        if self.codec != CodecId::None {
            let level = self
                .shared
                .compression
                .level
                .unwrap_or_else(|| self.codec.default_level());
            let counters = self
                .codec_stats
                .used()
                .find(|(which, _)| which.wire() == self.codec)
                .map(|(_, counters)| *counters);
            if let Some(measured) = counters.and_then(|counters| {
                tern_page::codec::CodecMeasurement::from_counters(self.codec, level, &counters)
            }) {
                auto.measurements.retain(|known| known.codec != self.codec);
                auto.measurements.push(measured);
            }
        }
        let decision = auto.selector.next(link, &auto.measurements);
        if decision.codec != self.codec {
            auto.switches += 1;
            tracing::info!(
                from = self.codec.name(),
                to = decision.codec.name(),
                link_mb_s = link / 1e6,
                "adaptive compression switches codec"
            );
            self.codec = decision.codec;
        }
        auto.batches_since = 0;
        auto.window_started = Instant::now();
        auto.wire_at_start = wire;
        auto.busy_at_start = busy;
    }

    /// Publishes the compression and zero-page detection counters to the
    /// live statistics (once per iteration: not on the per-page path).
    fn publish_reports(&self) {
        let shared = &self.shared;
        if shared.compression.choice != CodecChoice::None {
            shared.stats.set_compression(CompressionReport {
                choice: shared.compression.choice.name().to_string(),
                level: shared.compression.level,
                codec_switches: self.auto.as_ref().map_or(0, |auto| auto.switches),
                codecs: self
                    .codec_stats
                    .used()
                    .map(|(which, counters)| {
                        (which.name().to_string(), CodecReport::from(counters))
                    })
                    .collect(),
            });
        }
        let offload = shared.zero_offload.as_ref().map(|offload| {
            let stats = offload.stats();
            let checked = stats.pages_device + stats.pages_cpu + stats.pages_fallback;
            let gib = (checked * PAGE_SIZE as u64) as f64 / (1u64 << 30) as f64;
            let cpu = stats.completion_thread_cpu.as_secs_f64();
            OffloadReport {
                pages_device: stats.pages_device,
                pages_cpu: stats.pages_cpu,
                cpu_fallbacks: stats.pages_fallback,
                page_faults: stats.page_faults,
                device_errors: stats.device_errors,
                batches: stats.batches,
                submit_retries: stats.submit_retries,
                completion_thread_cpu_seconds: cpu,
                cpu_seconds_per_gib: if gib > 0.0 { cpu / gib } else { 0.0 },
            }
        });
        shared.stats.set_zero_detection(ZeroDetectionReport {
            mode: shared.detection.as_str().to_string(),
            backend: match (&shared.zero_offload, shared.detection) {
                (Some(offload), _) => offload.describe(),
                (None, ZeroPageDetection::None) => "none".to_string(),
                (None, _) => shared.zero_checker.backend().name().to_string(),
            },
            offload,
        });
    }

    fn submit(&mut self, mut batch: Box<Batch>) -> Result<(), MigrationError> {
        self.maybe_switch_codec();
        if self.shared.detection == ZeroPageDetection::Source {
            classify(&self.shared, &mut batch, &mut self.scratch);
            batch.prechecked = true;
        }
        let workers = self.shared.worker_rings.len();
        loop {
            self.check()?;
            self.reap_completions();
            for offset in 0..workers {
                let index = (self.next_worker + offset) % workers;
                if self.shared.worker_rings[index].has_room() {
                    match self.shared.worker_rings[index].push(batch) {
                        Ok(()) => {
                            self.in_flight += 1;
                            self.next_worker = (index + 1) % workers;
                            if let Some(bell) = self.shared.worker_bells[index].get() {
                                bell.ring();
                            }
                            return Ok(());
                        }
                        Err(back) => batch = back,
                    }
                }
            }
            let shared = &self.shared;
            shared.producer_bell.wait_until(|| {
                shared.is_stopping()
                    || !shared.completions.is_empty()
                    || shared.worker_rings.iter().any(Ring::has_room)
            });
        }
    }

    fn reap_completions(&mut self) -> usize {
        let mut synced = 0;
        while let Some(completion) = self.shared.completions.pop() {
            match completion {
                Completion::Batch(batch) => {
                    self.in_flight -= 1;
                    self.codec_stats.merge(&batch.codec_stats);
                    self.totals.pages += batch.pages.len() as u64;
                    self.totals.wire_bytes += batch.wire_bytes;
                    let stats = &self.shared.stats;
                    stats
                        .duplicate
                        .fetch_add(batch.zero_pages, Ordering::Relaxed);
                    stats
                        .normal
                        .fetch_add(batch.normal_pages, Ordering::Relaxed);
                    stats
                        .normal_bytes
                        .fetch_add(batch.normal_pages * PAGE_SIZE as u64, Ordering::Relaxed);
                    stats.sent_dirty(batch.pages.len() as u64 * PAGE_SIZE as u64);
                    self.pool.push(batch);
                }
                Completion::Synced => synced += 1,
            }
        }
        synced
    }

    fn wait_for_completion(&mut self) -> Result<usize, MigrationError> {
        self.check()?;
        let shared = &self.shared;
        shared
            .producer_bell
            .wait_until(|| shared.is_stopping() || !shared.completions.is_empty());
        self.check()?;
        Ok(self.reap_completions())
    }

    fn sync_channels(&mut self, iteration: u32, last: bool) -> Result<(), MigrationError> {
        // A page sent in the next iteration must never overtake its older
        // copy, so the iteration's packets all leave before its syncs.
        while self.in_flight > 0 {
            self.wait_for_completion()?;
        }
        for (index, ring) in self.shared.sender_rings.iter().enumerate() {
            if ring.push(SendItem::Sync(Sync { iteration, last })).is_err() {
                return Err(MigrationError::Protocol(
                    "sender ring unexpectedly full".into(),
                ));
            }
            if let Some(bell) = self.shared.sender_bells[index].get() {
                bell.ring();
            }
        }
        let mut synced = 0;
        while synced < self.channel_count {
            synced += self.wait_for_completion()?;
        }
        Ok(())
    }

    /// Stops every thread and waits for them. Safe to call after a failure:
    /// channels are shut down so no thread stays blocked in the kernel.
    pub fn shut_down(mut self, abort_channels: bool) {
        if abort_channels {
            for channel in &self.shutdown_handles {
                channel.shutdown();
            }
        }
        self.shared.stop();
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
    }
}

fn page_ptr(region: &MemoryRegion, page: u32) -> *const u8 {
    region
        .page_ptr(u64::from(page))
        .expect("the producer only batches pages of the region")
        .cast_const()
}

fn classify(shared: &Shared, batch: &mut Batch, scratch: &mut Scratch) {
    let region = &shared.regions[batch.region];
    batch.kinds.clear();
    match (shared.detection, &shared.zero_offload) {
        (ZeroPageDetection::None, _) => batch.kinds.resize(batch.pages.len(), PageKind::Raw),
        (ZeroPageDetection::Dsa, Some(offload)) => {
            scratch.pointers.clear();
            scratch
                .pointers
                .extend(batch.pages.iter().map(|&page| page_ptr(region, page)));
            // SAFETY: the pointers are pages inside the region's mapping,
            // which stays mapped for the whole migration, so past `wait`.
            let answered = unsafe { offload.submit(&scratch.pointers) }
                .and_then(|ticket| offload.wait(ticket, &mut scratch.zero_flags));
            if answered.is_err() || scratch.zero_flags.len() != batch.pages.len() {
                // The offload answers on the CPU itself when a device fails;
                // this is the last resort for a misuse of its interface.
                scratch.zero_flags.clear();
                scratch.zero_flags.extend(batch.pages.iter().map(|&page| {
                    // SAFETY: as above.
                    unsafe { shared.zero_checker.is_zero_page(page_ptr(region, page)) }
                }));
            }
            batch.kinds.extend(
                scratch.zero_flags.iter().map(
                    |&zero| {
                        if zero { PageKind::Zero } else { PageKind::Raw }
                    },
                ),
            );
        }
        _ => {
            for &page in &batch.pages {
                // SAFETY: `page_ptr` checked the page lies inside the
                // region's mapping, which outlives the migration.
                let zero = unsafe { shared.zero_checker.is_zero_page(page_ptr(region, page)) };
                batch
                    .kinds
                    .push(if zero { PageKind::Zero } else { PageKind::Raw });
            }
        }
    }
    if let Some(knob) = &shared.zero_as_normal {
        for kind in &mut batch.kinds {
            if *kind == PageKind::Zero && knob.demote() {
                *kind = PageKind::Raw;
            }
        }
    }
}

/// A worker's reusable buffers and its compressors (one per codec, made
/// when first needed).
#[derive(Default)]
struct Scratch {
    pointers: Vec<*const u8>,
    zero_flags: Vec<bool>,
    compressors: [Option<PageCompressor>; 4],
}

fn encode(shared: &Shared, batch: &mut Batch, scratch: &mut Scratch) {
    if !batch.prechecked {
        classify(shared, batch, scratch);
    }
    compress(shared, batch, scratch);
    batch.entries.clear();
    batch.zero_pages = 0;
    batch.normal_pages = 0;
    let mut outcomes = batch.compressed.outcomes.iter();
    let mut payload = 0u64;
    for (&page, &kind) in batch.pages.iter().zip(&batch.kinds) {
        let (kind, encoded_len) = match kind {
            PageKind::Zero => {
                batch.zero_pages += 1;
                (PageKind::Zero, 0)
            }
            PageKind::Raw | PageKind::Compressed => {
                batch.normal_pages += 1;
                // Data pages have one outcome each when the batch was
                // compressed, in page order.
                match outcomes.next() {
                    Some(&PageOutcome::Compressed { len, .. }) => {
                        (PageKind::Compressed, len as u32)
                    }
                    _ => (PageKind::Raw, PAGE_SIZE as u32),
                }
            }
        };
        payload += u64::from(encoded_len);
        batch.entries.push(PageEntry {
            page_index: page,
            kind,
            encoded_len,
        });
    }
    batch.prefix.clear();
    encode_pages_prefix(
        &mut batch.prefix,
        shared.region_ids[batch.region],
        batch.iteration,
        batch.codec.to_wire(),
        &batch.entries,
    );
    batch.wire_bytes = batch.prefix.len() as u64 + payload;
}

/// Compresses the batch's data pages with the batch's codec, each page on
/// its own; pages that would not shrink stay raw.
fn compress(shared: &Shared, batch: &mut Batch, scratch: &mut Scratch) {
    batch.compressed.clear();
    batch.codec_stats = CodecStats::default();
    if batch.codec == CodecId::None {
        return;
    }
    let slot = &mut scratch.compressors[batch.codec as usize];
    if slot.is_none() {
        match shared.compression.compressor(batch.codec) {
            Ok(compressor) => *slot = Some(compressor),
            Err(error) => {
                // Checked at start-up, so this is unexpected: send raw.
                tracing::warn!(%error, "cannot create a compressor; sending pages raw");
                return;
            }
        }
    }
    let Some(compressor) = slot.as_mut() else {
        return;
    };
    let region = &shared.regions[batch.region];
    scratch.pointers.clear();
    scratch.pointers.extend(
        batch
            .pages
            .iter()
            .zip(&batch.kinds)
            .filter(|(_, kind)| **kind != PageKind::Zero)
            .map(|(&page, _)| page_ptr(region, page)),
    );
    // SAFETY: the pointers are whole pages inside the region's mapping,
    // which outlives the migration; the compressor copies each page before
    // compressing it, so concurrent guest writes only make it stale.
    unsafe { compressor.compress_batch(&scratch.pointers, &mut batch.compressed) };
    batch.codec_stats = compressor.take_stats();
}

/// Measures the candidate codecs on pages sampled across guest memory, so
/// adaptive compression starts from numbers of this guest and this machine.
fn calibrate_codecs(regions: &[MemoryRegion]) -> Vec<tern_page::codec::CodecMeasurement> {
    const SAMPLES: u64 = 64;
    let total: u64 = regions.iter().map(MemoryRegion::pages).sum();
    let mut sample = Vec::with_capacity(SAMPLES as usize);
    for index in 0..SAMPLES {
        let mut global = index * total.max(1) / SAMPLES;
        for region in regions {
            if global < region.pages() {
                if let Some(ptr) = region.page_ptr(global) {
                    let mut page = [0u8; PAGE_SIZE];
                    // SAFETY: a whole page inside the region's mapping; the
                    // guest may write it meanwhile, which only makes the
                    // sample a little stale.
                    unsafe { std::ptr::copy_nonoverlapping(ptr, page.as_mut_ptr(), PAGE_SIZE) };
                    sample.push(page);
                }
                break;
            }
            global -= region.pages();
        }
    }
    let candidates = [
        (CodecId::Zstd, CodecId::Zstd.default_level()),
        (CodecId::Deflate, CodecId::Deflate.default_level()),
        (CodecId::Lz4, CodecId::Lz4.default_level()),
    ];
    tern_page::codec::calibrate(&sample, &candidates).unwrap_or_default()
}

fn run_worker(shared: &Shared, index: usize) {
    let cpu_start = thread_cpu_seconds();
    let mut scratch = Scratch::default();
    let bell = shared.worker_bells[index].wait();
    let ring = &shared.worker_rings[index];
    loop {
        let mut item = None;
        bell.wait_until(|| {
            item = ring.pop();
            item.is_some() || shared.is_stopping()
        });
        let Some(mut batch) = item else { break };
        shared.producer_bell.ring();
        encode(shared, &mut batch, &mut scratch);
        let target = least_loaded_sender(shared, index);
        let mut item = SendItem::Batch(batch);
        loop {
            match shared.sender_rings[target].push(item) {
                Ok(()) => break,
                Err(back) => {
                    // Cannot happen while rings hold the whole pool; stay
                    // correct anyway.
                    if shared.is_stopping() {
                        return;
                    }
                    item = back;
                    thread::yield_now();
                }
            }
        }
        if let Some(bell) = shared.sender_bells[target].get() {
            bell.ring();
        }
    }
    shared
        .stats
        .record_cpu(&format!("worker-{index}"), thread_cpu_seconds() - cpu_start);
}

fn least_loaded_sender(shared: &Shared, worker: usize) -> usize {
    let senders = shared.sender_rings.len();
    let mut best = worker % senders;
    let mut best_len = shared.sender_rings[best].len();
    for offset in 1..senders {
        let candidate = (worker + offset) % senders;
        let len = shared.sender_rings[candidate].len();
        if len < best_len {
            best = candidate;
            best_len = len;
        }
    }
    best
}

fn run_sender(shared: &Shared, index: usize, mut channel: PageSender) {
    let cpu_start = thread_cpu_seconds();
    let bell = shared.sender_bells[index].wait();
    let ring = &shared.sender_rings[index];
    let mut segments: Vec<Segment> = Vec::with_capacity(MAX_PAGES_PER_PACKET + 1);
    loop {
        let mut item = None;
        bell.wait_until(|| {
            item = ring.pop();
            item.is_some() || shared.is_stopping()
        });
        let Some(item) = item else { break };
        let result = match item {
            SendItem::Batch(batch) => {
                let started = Instant::now();
                if let Some(limiter) = &shared.limiter {
                    limiter.acquire(batch.wire_bytes);
                }
                let result = send_batch(shared, &mut channel, &batch, &mut segments);
                shared.sender_busy_ns.fetch_add(
                    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
                    Ordering::Relaxed,
                );
                if result.is_ok() {
                    shared.stats.add_sent(batch.wire_bytes, batch.paused, true);
                    let _ = shared.completions.push(Completion::Batch(batch));
                }
                result
            }
            SendItem::Sync(sync) => {
                let bytes = Message::Sync(sync).to_bytes();
                let result = channel.write_control(&bytes);
                if result.is_ok() {
                    shared.stats.add_sent(bytes.len() as u64, sync.last, true);
                    let _ = shared.completions.push(Completion::Synced);
                }
                result
            }
        };
        if let Err(error) = result {
            shared.fail(MigrationError::channel(index + 1)(error));
            break;
        }
        shared.producer_bell.ring();
    }
    if let Some(zero_copy) = channel.zero_copy_stats() {
        shared.stats.record_zero_copy(&zero_copy);
    }
    shared
        .stats
        .record_cpu(&format!("sender-{index}"), thread_cpu_seconds() - cpu_start);
}

fn send_batch(
    shared: &Shared,
    channel: &mut PageSender,
    batch: &Batch,
    segments: &mut Vec<Segment>,
) -> Result<(), ChannelError> {
    let region = &shared.regions[batch.region];
    segments.clear();
    segments.push(Segment {
        ptr: batch.prefix.as_ptr(),
        len: batch.prefix.len(),
    });
    let mut compressed_offset = 0;
    for entry in &batch.entries {
        let (ptr, len) = match entry.kind {
            PageKind::Zero => continue,
            PageKind::Raw => (page_ptr(region, entry.page_index), PAGE_SIZE),
            PageKind::Compressed => {
                let len = entry.encoded_len as usize;
                let bytes = &batch.compressed.data[compressed_offset..compressed_offset + len];
                compressed_offset += len;
                (bytes.as_ptr(), len)
            }
        };
        // Adjacent pieces (neighbouring guest pages, or compressed pages
        // packed back to back) go out as one iovec.
        let has_payload_segment = segments.len() > 1;
        match segments.last_mut() {
            Some(last) if has_payload_segment && last.ptr.wrapping_add(last.len) == ptr => {
                last.len += len;
            }
            _ => segments.push(Segment { ptr, len }),
        }
    }
    match channel {
        // SAFETY: the prefix lives in the batch, which outlives the call;
        // page pointers come from `page_ptr`, inside the region's mapping,
        // which outlives the migration. Concurrent guest writes are
        // acceptable (see `send_vectored`).
        PageSender::Plain(channel) => unsafe { channel.send_vectored(segments) },
        // SAFETY: as above; the data segments point into guest memory,
        // which stays mapped until the sender flushes at the next sync.
        PageSender::ZeroCopy(sender) => unsafe {
            sender
                .send(&batch.prefix, &segments[1..])
                .map_err(ZeroCopyError::into_channel_error)
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limiter_spaces_packets() {
        let limiter = RateLimiter {
            bytes_per_second: 1_000_000,
            origin: Instant::now(),
            next_free_ns: AtomicU64::new(0),
        };
        limiter.acquire(10_000);
        limiter.acquire(10_000);
        // Two 10 kB packets at 1 MB/s reserve 20 ms of link time.
        assert!(limiter.next_free_ns.load(Ordering::Relaxed) >= 20_000_000);
    }
}

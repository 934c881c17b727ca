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

use tern_page::codec::{CodecChoice, CodecId, CodecStats};
use tern_page::{DeltaOffload, ZeroChecker, ZeroPageOffload};
use tern_wire::{MAX_PAGES_PER_PACKET, Sync};

use crate::bitmap::DirtyBitmap;
use crate::config::ZeroPageDetection;
use crate::digest::PageHashes;
use crate::error::MigrationError;
use crate::guest::{MemoryRegion, PAGE_SIZE};
use crate::ring::{Doorbell, Ring};
use crate::stats::LiveStats;
use crate::transport::{Channel, ShutdownHandle};

mod auto_codec;
mod batch;
mod classify;
mod cpu_share;
mod dedup;
mod delta_cache;
mod dictionary_refresh;
mod encode;
mod encode_cost;
mod push;
mod rate;
mod refresher;
mod report;
mod reuse;
mod scratch;
mod sender;
mod worker;
mod zero_as_normal;

use auto_codec::{AutoCodec, calibrate_codecs};
pub(crate) use auto_codec::{CodecCost, CompressionSetup, sample_pages};
use batch::{Batch, Completion, SendItem};
use classify::classify;
use dedup::{DedupIndex, Reference, resend_referencing_pages};
use delta_cache::DeltaCache;
pub(crate) use push::{PushEncoder, PushedPacket};
use rate::{LinkQueue, RateLimiter};
use refresher::{DictionaryRefresher, RatioWindow};
use scratch::Scratch;
pub(crate) use sender::PageSender;
use sender::run_sender;
use worker::run_worker;
use zero_as_normal::ZeroAsNormal;

/// Requests a worker may have queued.
const WORKER_RING_CAPACITY: usize = 4;
/// Batches in flight per worker, on top of the ring's capacity.
const BATCHES_PER_WORKER: usize = 8;

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
    /// The sockets' queues, for the link estimate of adaptive compression.
    link_queue: Option<LinkQueue>,
    /// How much of a CPU the workers get, for the last pages' codec time.
    worker_cpu: cpu_share::WorkerCpuShare,
    worker_rings: Vec<Ring<Box<Batch>>>,
    worker_bells: Vec<OnceLock<Doorbell>>,
    sender_rings: Vec<Ring<SendItem>>,
    sender_bells: Vec<OnceLock<Doorbell>>,
    completions: Ring<Completion>,
    producer_bell: Doorbell,
    stopping: AtomicBool,
    /// The first error of any pipeline thread; not on the per-page path.
    failure: Mutex<Option<MigrationError>>,
    limiter: RateLimiter,
    /// The incremental digest the workers keep, with verification.
    page_hashes: Option<Arc<PageHashes>>,
    /// Pages the destination holds, by content hash (`--dedup`).
    dedup: Option<DedupIndex>,
    /// Pages as last sent, for deltas (`--delta-cache-size`); with `auto`,
    /// set at an iteration boundary once auto sized it.
    delta_cache: OnceLock<DeltaCache>,
    /// The session's zstd dictionaries, ids 1, 2, …: the setup's and the
    /// refreshes announced so far. Read when a worker makes a compressor.
    dictionaries: Mutex<Vec<tern_page::codec::CodecDictionary>>,
    /// Each page channel's stream compressor ([`CodecId::ZstdStream`]),
    /// made when first needed: a worker holds it from compressing a batch
    /// until the batch is on the channel's ring, so the channel sends the
    /// stream's packets in the order they were made (`worker.rs`). Taken
    /// once per batch, never per page.
    streams: Vec<Mutex<Option<tern_page::PageCompressor>>>,
}

impl Shared {
    fn new(setup: PipelineSetup, channel_count: usize, pool_size: usize) -> Self {
        Self {
            region_ids: setup.regions.iter().map(MemoryRegion::id).collect(),
            stats: setup.stats,
            zero_checker: ZeroChecker::best(),
            detection: setup.detection,
            zero_offload: setup.zero_offload,
            zero_as_normal: (setup.zero_as_normal > 0.0)
                .then(|| ZeroAsNormal::new(setup.zero_as_normal)),
            sender_busy_ns: AtomicU64::new(0),
            link_queue: (setup.compression.choice == CodecChoice::Auto)
                .then(|| LinkQueue::new(channel_count)),
            worker_cpu: cpu_share::WorkerCpuShare::new(setup.workers),
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
            limiter: RateLimiter::new(setup.bandwidth_cap),
            dedup: setup
                .dedup
                .then(|| DedupIndex::new(setup.regions.iter().map(MemoryRegion::pages).sum())),
            delta_cache: {
                let cache = OnceLock::new();
                if setup.delta_cache_size > 0 {
                    let _ = cache.set(DeltaCache::new(
                        setup.delta_cache_size,
                        setup.delta_offload.clone(),
                    ));
                }
                cache
            },
            page_hashes: setup.page_hashes,
            regions: setup.regions,
            dictionaries: Mutex::new(setup.compression.dictionary.iter().cloned().collect()),
            streams: (0..channel_count).map(|_| Mutex::new(None)).collect(),
            compression: setup.compression,
        }
    }

    /// Dictionary `id` (0, or one not announced: none).
    fn dictionary(&self, id: u8) -> Option<tern_page::codec::CodecDictionary> {
        let index = usize::from(id).checked_sub(1)?;
        self.dictionaries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(index)
            .cloned()
    }

    fn fail(&self, error: MigrationError) {
        let mut slot = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(error);
        }
        drop(slot);
        self.stop();
    }

    /// Runs a pipeline thread's `body`; a panic in it fails the migration
    /// with the panic's message. The producer waits on the failure flag,
    /// never on a thread that is gone: without this, a worker that
    /// panicked (cargo-mutants made one index out of range) left the
    /// producer waiting for its batches until the caller's own deadline.
    fn failing_on_panic(&self, thread: &str, body: impl FnOnce()) {
        if let Err(message) = crate::error::catching_panic(body) {
            self.fail(MigrationError::Internal(format!(
                "the pipeline's {thread} thread panicked: {message}"
            )));
        }
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
    /// Pages sent with data (not as zero pages).
    pub data_pages: u64,
    pub wire_bytes: u64,
}

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
    shutdown_handles: Vec<ShutdownHandle>,
    cancel: Arc<AtomicBool>,
    totals: IterationTotals,
    codec: CodecId,
    auto: Option<AutoCodec>,
    codec_stats: CodecStats,
    /// For zero-page detection in `source` mode.
    scratch: Scratch,
    /// The duplicate references of the iteration being sent, checked
    /// against the next dirty bitmap.
    references: Vec<Reference>,
    /// Dictionaries: the one zstd batches use, refreshes.
    dictionaries: DictionaryState,
    /// Auto's delta cache, until it decided: its allowance and offload.
    delta_auto: Option<(u64, Option<Arc<dyn DeltaOffload>>)>,
    /// The workers' encoding cost per page, by pass (the last pages'
    /// codec time in the downtime estimate).
    encode_cost: encode_cost::PassEncodeCost,
}

/// The producer's view of the session's dictionaries.
struct DictionaryState {
    /// The id zstd batches are compressed against (0: none).
    in_use: u8,
    /// The highest id announced on the main channel; in use from the
    /// iteration after the sync that counts it (`auto`'s first: at once,
    /// see `dictionary_refresh.rs`).
    announced: u8,
    /// Dictionary-compressed data pages of the iteration being sent.
    window: RatioWindow,
    refresher: Option<DictionaryRefresher>,
    /// The first dictionary, when `auto` trained it during the migration
    /// rather than at setup: its bytes, sample pages and training time.
    deferred: Option<crate::stats::DictionaryReport>,
    refreshes: u64,
    refresh_training_ms: f64,
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
    /// The cap the senders read before each packet (bytes per second, 0:
    /// none); the handle changes it while the migration runs.
    pub bandwidth_cap: Arc<AtomicU64>,
    pub stats: Arc<LiveStats>,
    pub cancel: Arc<AtomicBool>,
    pub page_hashes: Option<Arc<PageHashes>>,
    pub dedup: bool,
    pub delta_cache_size: u64,
    pub delta_offload: Option<Arc<dyn DeltaOffload>>,
    /// With `auto` and no delta cache configured: the most memory auto may
    /// give one (see `delta_cache.rs`, `size_delta_cache`).
    pub delta_cache_allowance: Option<u64>,
}

impl PipelineSetup {
    /// The allowance and offload of a delta cache auto decides, if it does.
    fn delta_auto(&self) -> Option<(u64, Option<Arc<dyn DeltaOffload>>)> {
        self.delta_cache_allowance
            .filter(|_| self.delta_cache_size == 0 && self.compression.choice == CodecChoice::Auto)
            .map(|allowance| (allowance, self.delta_offload.clone()))
    }
}

impl<'scope> Pipeline<'scope> {
    /// Starts workers and one sender per page channel inside `scope`.
    // long: the producer's whole state is built here, in the order it depends on
    pub(crate) fn start<'env>(
        scope: &'scope Scope<'scope, 'env>,
        mut setup: PipelineSetup,
        channels: Vec<PageSender>,
    ) -> Result<Self, MigrationError> {
        let channel_count = channels.len();
        // Before the workers exist: they build their compressors from the
        // setup, which calibration may switch to QPL's deflate.
        let calibration = (setup.compression.choice == CodecChoice::Auto).then(|| {
            calibrate_codecs(
                &setup.regions,
                setup.compression.qpl_path,
                setup.compression.dictionary.as_ref(),
            )
        });
        if let Some(calibration) = &calibration {
            setup.compression.deflate_through_qpl = calibration.deflate_through_qpl;
        }
        let pool_size = setup.workers * (WORKER_RING_CAPACITY + BATCHES_PER_WORKER);
        let workers = setup.workers;
        let choice = setup.compression.choice;
        // A fixed choice names one codec (zstd in packet frames included);
        // auto starts with what calibration found best for a slow link.
        let auto = (choice == CodecChoice::Auto).then(|| {
            AutoCodec::start(
                workers,
                calibration.map(|c| c.measurements).unwrap_or_default(),
                setup.max_bandwidth,
                &setup.compression,
            )
        });
        let initial_codec = match &auto {
            Some(auto) => auto.selector.current(),
            None => setup
                .compression
                .codecs()
                .first()
                .copied()
                .unwrap_or(CodecId::None),
        };
        let dictionary_id = setup
            .compression
            .dictionary
            .as_ref()
            .map_or(0, tern_page::codec::CodecDictionary::id);
        let refresh = setup.compression.dictionary_refresh;
        let delta_auto = setup.delta_auto();
        let cancel = setup.cancel.clone();
        let shared = Arc::new(Shared::new(setup, channel_count, pool_size));
        if let Some(cache) = shared.delta_cache.get() {
            shared.stats.set_delta_cache_size(cache.bytes());
        }
        let mut pipeline = Self {
            shared: shared.clone(),
            pool: (0..pool_size).map(|_| Box::new(Batch::new())).collect(),
            in_flight: 0,
            next_worker: 0,
            channel_count,
            handles: Vec::new(),
            shutdown_handles: Vec::new(),
            cancel,
            totals: IterationTotals::default(),
            codec: initial_codec,
            auto,
            codec_stats: CodecStats::default(),
            scratch: Scratch::default(),
            references: Vec::new(),
            dictionaries: DictionaryState {
                in_use: dictionary_id,
                announced: dictionary_id,
                window: RatioWindow::default(),
                refresher: refresh.and_then(|(mode, max_len)| {
                    if dictionary_id == 0 {
                        DictionaryRefresher::deferred(mode, max_len)
                    } else {
                        DictionaryRefresher::new(mode, max_len)
                    }
                }),
                deferred: None,
                refreshes: 0,
                refresh_training_ms: 0.0,
            },
            delta_auto,
            encode_cost: encode_cost::PassEncodeCost::default(),
        };
        pipeline.spawn_workers(scope)?;
        pipeline.spawn_senders(scope, channels)?;
        Ok(pipeline)
    }

    fn spawn_workers<'env>(
        &mut self,
        scope: &'scope Scope<'scope, 'env>,
    ) -> Result<(), MigrationError> {
        let shared = &self.shared;
        for index in 0..shared.worker_rings.len() {
            let shared_for_thread = shared.clone();
            let handle = thread::Builder::new()
                .name(format!("tern-worker-{index}"))
                .spawn_scoped(scope, move || {
                    shared_for_thread.worker_cpu.register(index);
                    shared_for_thread.failing_on_panic(&format!("worker-{index}"), || {
                        run_worker(&shared_for_thread, index);
                    });
                })
                .map_err(MigrationError::Thread)?;
            let _ = shared.worker_bells[index].set(Doorbell::new(handle.thread().clone()));
            self.handles.push(handle);
        }
        Ok(())
    }

    fn spawn_senders<'env>(
        &mut self,
        scope: &'scope Scope<'scope, 'env>,
        channels: Vec<PageSender>,
    ) -> Result<(), MigrationError> {
        let shared = self.shared.clone();
        for (index, channel) in channels.into_iter().enumerate() {
            self.shutdown_handles.push(
                channel
                    .channel()
                    .shutdown_handle()
                    .map_err(MigrationError::channel(index + 1))?,
            );
            let shared_for_thread = shared.clone();
            let handle = thread::Builder::new()
                .name(format!("tern-sender-{index}"))
                .spawn_scoped(scope, move || {
                    shared_for_thread.failing_on_panic(&format!("sender-{index}"), || {
                        run_sender(&shared_for_thread, index, channel);
                    });
                })
                .map_err(MigrationError::Thread)?;
            let _ = shared.sender_bells[index].set(Doorbell::new(handle.thread().clone()));
            self.handles.push(handle);
        }
        Ok(())
    }

    /// The incremental digest the workers keep (with verification).
    /// Bytes written to the page channels that the destination's kernel
    /// has not acknowledged yet, all channels together.
    pub(crate) fn unacknowledged_bytes(&self) -> Option<u64> {
        self.shutdown_handles
            .iter()
            .map(ShutdownHandle::unacknowledged_bytes)
            .sum()
    }

    pub(crate) fn page_hashes(&self) -> Option<&PageHashes> {
        self.shared.page_hashes.as_deref()
    }

    /// Sends every page set in `bitmaps` (one per region) as part of
    /// `iteration`, then ends the iteration on every channel with a sync.
    /// `last` is the switch-over pass, sent with the guest paused. With
    /// the `main` channel (live iterations), a refreshed dictionary may be
    /// announced there before the syncs (see `dictionary_refresh.rs`).
    pub(crate) fn send_iteration(
        &mut self,
        bitmaps: &mut [DirtyBitmap],
        iteration: u32,
        last: bool,
        mut main: Option<&mut Channel>,
    ) -> Result<IterationTotals, MigrationError> {
        self.totals = IterationTotals::default();
        if !last {
            self.size_delta_cache(bitmaps, iteration);
        }
        self.prepare_reuse(bitmaps, iteration);
        let bitmaps = &*bitmaps;
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
                        fresh.level = self.batch_level();
                        fresh.use_dictionary = self.dictionaries.in_use;
                        batch.insert(fresh)
                    }
                };
                #[expect(
                    clippy::cast_possible_truncation,
                    reason = "region sizes are validated against the protocol's \
                              32-bit page indices before the migration starts"
                )]
                let page = page as u32;
                current.pages.push(page);
                if current.pages.len() == MAX_PAGES_PER_PACKET
                    && let Some(full) = batch.take()
                {
                    self.submit(full)?;
                    if let Some(main) = main.as_deref_mut() {
                        self.announce_first_dictionary(main)?;
                    }
                }
            }
            if let Some(partial) = batch.take() {
                self.submit(partial)?;
            }
        }
        self.sync_channels(iteration, last, bitmaps, main)?;
        self.encode_cost.end_pass();
        self.publish_reports();
        Ok(self.totals)
    }

    /// Before an iteration, while no worker runs: sends again the pages
    /// whose duplicate source was written since (it is in `bitmaps`), then
    /// forgets indexed pages that are in `bitmaps` (see `dedup.rs`).
    fn prepare_reuse(&mut self, bitmaps: &mut [DirtyBitmap], iteration: u32) {
        let Some(index) = &self.shared.dedup else {
            return;
        };
        let added = resend_referencing_pages(&self.references, bitmaps);
        if added > 0 {
            tracing::debug!(added, iteration, "duplicates of written pages sent again");
        }
        self.references.clear();
        index.sweep(bitmaps, iteration);
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
            .unwrap_or_else(|| MigrationError::Internal("the pipeline stopped".into()))
    }

    fn take_batch(&mut self) -> Result<Box<Batch>, MigrationError> {
        loop {
            if let Some(batch) = self.pool.pop() {
                return Ok(batch);
            }
            self.wait_for_completion()?;
        }
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
                    self.encode_cost.add(
                        batch.pages.len() as u64,
                        batch.encode_cpu_ns,
                        batch.codec,
                        batch.level,
                    );
                    self.totals.pages += batch.pages.len() as u64;
                    self.totals.data_pages += batch.normal_pages;
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
                    stats.add_reuse(&batch.reuse.counts);
                    self.references.extend_from_slice(&batch.reuse.references);
                    self.dictionaries.count(&batch);
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

    fn sync_channels(
        &mut self,
        iteration: u32,
        last: bool,
        bitmaps: &[DirtyBitmap],
        main: Option<&mut Channel>,
    ) -> Result<(), MigrationError> {
        // A page sent in the next iteration must never overtake its older
        // copy, so the iteration's packets all leave before its syncs.
        while self.in_flight > 0 {
            self.wait_for_completion()?;
        }
        if let Some(main) = main
            && !last
        {
            self.refresh_dictionary(bitmaps, main)?;
        }
        let dictionaries = self.dictionaries.announced;
        let sync = Sync {
            iteration,
            last,
            dictionaries,
        };
        for (index, ring) in self.shared.sender_rings.iter().enumerate() {
            if ring.push(SendItem::Sync(sync)).is_err() {
                return Err(MigrationError::Internal(
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
        // Every channel carries the sync that counts the announced
        // dictionary before any packet naming it.
        self.dictionaries.in_use = dictionaries;
        Ok(())
    }

    /// Stops every thread and waits for them. Safe to call after a failure:
    /// channels are shut down so no thread stays blocked in the kernel.
    pub(crate) fn shut_down(mut self, abort_channels: bool) {
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

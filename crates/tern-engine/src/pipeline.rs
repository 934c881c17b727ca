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

use tern_page::ZeroChecker;
use tern_wire::{MAX_PAGES_PER_PACKET, Message, PageEntry, PageKind, Sync, encode_pages_prefix};

use crate::bitmap::DirtyBitmap;
use crate::config::ZeroPageDetection;
use crate::error::ChannelError;
use crate::error::MigrationError;
use crate::guest::{MemoryRegion, PAGE_SIZE};
use crate::ring::{Doorbell, Ring};
use crate::stats::{LiveStats, thread_cpu_seconds};
use crate::transport::{Channel, Segment};
use crate::zerocopy::{ZeroCopyError, ZeroCopySender};

/// Requests a worker may have queued.
const WORKER_RING_CAPACITY: usize = 4;
/// Batches in flight per worker, on top of the ring's capacity.
const BATCHES_PER_WORKER: usize = 8;

/// A batch of pages of one region, travelling through the pipeline.
#[derive(Debug)]
pub(crate) struct Batch {
    region: usize,
    iteration: u32,
    pages: Vec<u32>,
    /// Filled by the producer in `source` mode, by the worker otherwise.
    kinds: Vec<PageKind>,
    prechecked: bool,
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
            pages: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            kinds: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            prechecked: false,
            entries: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            prefix: Vec::with_capacity(64 + MAX_PAGES_PER_PACKET * PageEntry::ENCODED_LEN),
            wire_bytes: 0,
            zero_pages: 0,
            normal_pages: 0,
        }
    }

    fn reset(&mut self, region: usize, iteration: u32) {
        self.region = region;
        self.iteration = iteration;
        self.pages.clear();
        self.kinds.clear();
        self.prechecked = false;
    }
}

/// How a sender writes its channel.
pub(crate) enum PageSender {
    /// `sendmsg` copying from guest memory.
    Plain(Channel),
    /// `MSG_ZEROCOPY` from guest memory.
    ZeroCopy(Box<ZeroCopySender>),
}

impl PageSender {
    fn channel(&self) -> &Channel {
        match self {
            Self::Plain(channel) => channel,
            Self::ZeroCopy(sender) => sender.channel(),
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
}

/// Settings of the pipeline.
pub(crate) struct PipelineSetup {
    pub regions: Vec<MemoryRegion>,
    pub workers: usize,
    pub detection: ZeroPageDetection,
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
        };
        for index in 0..setup_workers(&shared) {
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
    pub fn send_iteration(
        &mut self,
        bitmaps: &[DirtyBitmap],
        iteration: u32,
        last: bool,
    ) -> Result<IterationTotals, MigrationError> {
        self.totals = IterationTotals::default();
        for (region, bitmap) in bitmaps.iter().enumerate() {
            let mut batch: Option<Box<Batch>> = None;
            for page in bitmap.iter_dirty() {
                let current = match batch.as_mut() {
                    Some(current) => current,
                    None => {
                        let mut fresh = self.take_batch()?;
                        fresh.reset(region, iteration);
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

    fn submit(&mut self, mut batch: Box<Batch>) -> Result<(), MigrationError> {
        if self.shared.detection == ZeroPageDetection::Source {
            classify(&self.shared, &mut batch);
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
    pub fn shut_down(mut self, abort_channels: bool) -> Option<MigrationError> {
        if abort_channels {
            for channel in &self.shutdown_handles {
                channel.shutdown();
            }
        }
        self.shared.stop();
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
        self.shared.take_failure()
    }
}

fn setup_workers(shared: &Shared) -> usize {
    shared.worker_rings.len()
}

fn classify(shared: &Shared, batch: &mut Batch) {
    let region = &shared.regions[batch.region];
    batch.kinds.clear();
    for &page in &batch.pages {
        let kind = match shared.detection {
            ZeroPageDetection::None => PageKind::Raw,
            ZeroPageDetection::Source | ZeroPageDetection::Workers => {
                let ptr = region
                    .page_ptr(u64::from(page))
                    .expect("the producer only batches pages of the region");
                // SAFETY: `page_ptr` checked the page lies inside the
                // region's mapping, which outlives the migration.
                if unsafe { shared.zero_checker.is_zero_page(ptr) } {
                    PageKind::Zero
                } else {
                    PageKind::Raw
                }
            }
        };
        batch.kinds.push(kind);
    }
}

fn encode(shared: &Shared, batch: &mut Batch) {
    if !batch.prechecked {
        classify(shared, batch);
    }
    batch.entries.clear();
    batch.zero_pages = 0;
    batch.normal_pages = 0;
    for (&page, &kind) in batch.pages.iter().zip(&batch.kinds) {
        let encoded_len = match kind {
            PageKind::Zero => {
                batch.zero_pages += 1;
                0
            }
            PageKind::Raw | PageKind::Compressed => {
                batch.normal_pages += 1;
                PAGE_SIZE as u32
            }
        };
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
        0,
        &batch.entries,
    );
    batch.wire_bytes = batch.prefix.len() as u64 + batch.normal_pages * PAGE_SIZE as u64;
}

fn run_worker(shared: &Shared, index: usize) {
    let cpu_start = thread_cpu_seconds();
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
        encode(shared, &mut batch);
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
                if let Some(limiter) = &shared.limiter {
                    limiter.acquire(batch.wire_bytes);
                }
                let result = send_batch(shared, &mut channel, &batch, &mut segments);
                if result.is_ok() {
                    shared
                        .stats
                        .transferred
                        .fetch_add(batch.wire_bytes, Ordering::Relaxed);
                    let _ = shared.completions.push(Completion::Batch(batch));
                }
                result
            }
            SendItem::Sync(sync) => {
                let bytes = Message::Sync(sync).to_bytes();
                let result = channel.write_control(&bytes);
                if result.is_ok() {
                    shared
                        .stats
                        .transferred
                        .fetch_add(bytes.len() as u64, Ordering::Relaxed);
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
    if let PageSender::ZeroCopy(sender) = &channel {
        shared.stats.record_zero_copy(&sender.stats());
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
    for entry in &batch.entries {
        if entry.kind != PageKind::Raw {
            continue;
        }
        let ptr = region
            .page_ptr(u64::from(entry.page_index))
            .expect("the producer only batches pages of the region")
            .cast_const();
        // Adjacent pages go out as one piece.
        let has_page_segment = segments.len() > 1;
        match segments.last_mut() {
            Some(last) if has_page_segment && last.ptr.wrapping_add(last.len) == ptr => {
                last.len += PAGE_SIZE;
            }
            _ => segments.push(Segment {
                ptr,
                len: PAGE_SIZE,
            }),
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

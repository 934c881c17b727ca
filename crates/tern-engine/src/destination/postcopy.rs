//! The destination's half of postcopy (docs/postcopy.md): discard the
//! stale pages, register guest memory with the fault service, say ready,
//! resume on the commit, then turn faults into requests and place what the
//! source sends (urgent pages on the main channel, the background push on
//! every page channel) until every stale page is in.
//!
//! Three kinds of thread share one [`Delivery`]: the fault service's fault
//! thread (its [`PageSource`]) queues a request for a stale page and waits
//! until the page is placed; the main-channel thread sends the queued
//! requests and places the urgent pages; one push receiver per page
//! channel places the background push. Placement is `UFFDIO_COPY` through
//! the fault service, which never writes a page that is there: a page
//! delivered twice (urgent and pushed) is placed once, and a page the
//! guest has written since is never overwritten. Each page's hash for the
//! final digest is taken from the bytes placed, by whoever placed it
//! first, since the guest may change the page right after.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::ScopedJoinHandle;
use std::time::{Duration, Instant};

use tern_page::codec::CodecId;
use tern_wire::{
    Abort, FrameDecoder, FrameKind, MAX_REQUEST_PAGES, Message, PageKind, PageRequest, PageRun,
    PostcopyComplete, SessionSetup, UrgentPages,
};

use super::decode::Decompressors;
use super::handshake::peer_aborted;
use super::shared::ReceiverShared;
use super::stream::{FrameSource, read_event, read_message};
use crate::digest::{PageHashes, page_hash, zero_page_hash};
use crate::error::{ChannelError, MigrationError};
use crate::fault::{FaultConfig, FaultService, FaultStats, PageSource, PageSourceError};
use crate::guest::{MemoryRegion, PAGE_SIZE};
use crate::postcopy::{PageBits, PostcopyReport, StaleSet};
use crate::transport::Channel;

/// How long the main-channel thread and the waits sleep before looking at
/// their stop flags (a request or a delivery wakes them at once).
const POLL: Duration = Duration::from_millis(20);

/// The kinds a page channel carries during postcopy.
const PUSH_FRAMES: &[FrameKind] = &[FrameKind::Pages, FrameKind::Sync, FrameKind::Abort];

/// Requests remembered per connection to match their answers, at most: the
/// source refuses more than this many unanswered (its
/// `MAX_PENDING_REQUESTS`). An answer to a request not remembered matches
/// nothing and releases nothing; the remembered ones still match.
const MAX_OUTSTANDING: usize = 4096;

/// Zeros a zero page is placed from (a copy: see [`Delivery::place`]).
static ZERO_PAGE: [u8; PAGE_SIZE] = [0; PAGE_SIZE];

/// Discards the stale pages' memory, so that they fault once registered:
/// `MADV_REMOVE` for shared memory (a memfd), `MADV_DONTNEED` for private
/// anonymous memory, which refuses the first.
pub(super) fn discard(
    regions: &[MemoryRegion],
    runs: &[PageRun],
    setup: &SessionSetup,
) -> Result<(), MigrationError> {
    for run in runs {
        let Some(index) = setup.regions.iter().position(|r| r.id == run.region_id) else {
            continue;
        };
        let Some(start) = regions[index].page_ptr(u64::from(run.first_page)) else {
            continue;
        };
        let len = run.pages as usize * PAGE_SIZE;
        // SAFETY: the run lies inside the region (the stale set checked it
        // against the setup, whose regions match these); the guest is paused
        // and nothing else touches these pages; dropping them is what the
        // switch asks for.
        let removed = unsafe { libc::madvise(start.cast(), len, libc::MADV_REMOVE) };
        if removed != 0 {
            // SAFETY: as above.
            let dropped = unsafe { libc::madvise(start.cast(), len, libc::MADV_DONTNEED) };
            if dropped != 0 {
                return Err(MigrationError::Internal(format!(
                    "cannot discard stale pages {}+{} of region {}: {}",
                    run.first_page,
                    run.pages,
                    run.region_id,
                    std::io::Error::last_os_error()
                )));
            }
        }
    }
    Ok(())
}

/// What the three kinds of thread share.
pub(super) struct Delivery {
    stale: StaleSet,
    /// Per region: placed (by a push or an urgent delivery).
    delivered: Vec<PageBits>,
    delivered_count: AtomicU64,
    /// Per region: asked for already.
    requested: Vec<PageBits>,
    requests: Mutex<VecDeque<PageRun>>,
    /// Wakes the main-channel thread when a request is queued.
    wake: OwnedFd,
    arrived: (Mutex<()>, Condvar),
    failed: AtomicBool,
    /// A thread lost its channel this round (recovery may mend it).
    interrupted: AtomicBool,
    /// A fault waited past `request_timeout` this round: the source is
    /// silent, and the connection is given up for a new one.
    stalled: AtomicBool,
    /// Postcopy is paused: a fault waits without a deadline (the guest's
    /// memory never leaves userfaultfd while both processes live).
    paused: AtomicBool,
    /// Bumped at each recovery: a fault waiting since before it asks again
    /// (its request may have been lost with the old connection).
    generation: AtomicU64,
    request_timeout: Duration,
    region_ids: Vec<u32>,
    pub(super) requested_pages: AtomicU64,
    pub(super) pushed_pages: AtomicU64,
}

impl Delivery {
    pub(super) fn new(
        stale: StaleSet,
        setup: &SessionSetup,
        request_timeout: Duration,
    ) -> Result<Self, MigrationError> {
        // SAFETY: eventfd takes an initial value and flags only.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(MigrationError::Internal(format!(
                "cannot create an eventfd: {}",
                std::io::Error::last_os_error()
            )));
        }
        let bits = |stale: &StaleSet| {
            (0..stale.region_count())
                .map(|region| PageBits::new(stale.region_pages(region)))
                .collect::<Vec<_>>()
        };
        Ok(Self {
            delivered: bits(&stale),
            requested: bits(&stale),
            stale,
            delivered_count: AtomicU64::new(0),
            requests: Mutex::new(VecDeque::new()),
            // SAFETY: a new descriptor nothing else owns.
            wake: unsafe { OwnedFd::from_raw_fd(wake) },
            arrived: (Mutex::new(()), Condvar::new()),
            failed: AtomicBool::new(false),
            interrupted: AtomicBool::new(false),
            stalled: AtomicBool::new(false),
            paused: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            request_timeout,
            region_ids: setup.regions.iter().map(|region| region.id).collect(),
            requested_pages: AtomicU64::new(0),
            pushed_pages: AtomicU64::new(0),
        })
    }

    /// Whether every stale page is placed.
    pub(super) fn complete(&self) -> bool {
        self.delivered_count.load(Ordering::Acquire) >= self.stale.total()
    }

    /// Stops every wait: a faulting thread gets an error (the fault
    /// service then releases the memory and stops).
    pub(super) fn fail(&self) {
        self.failed.store(true, Ordering::Release);
        self.notify();
    }

    /// A thread lost its channel: the round ends, and the faults wait.
    fn interrupt(&self) {
        self.interrupted.store(true, Ordering::Release);
        self.notify();
    }

    /// Ends a round that lost its connection: faults wait without a
    /// deadline until [`Delivery::resume`] or [`Delivery::fail`].
    pub(super) fn pause(&self) {
        self.paused.store(true, Ordering::Release);
    }

    /// A new connection: a fault asks again, and has its deadline again.
    pub(super) fn resume(&self) {
        self.interrupted.store(false, Ordering::Release);
        self.stalled.store(false, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.paused.store(false, Ordering::Release);
        self.notify();
    }

    /// The stale pages not placed yet, as runs in the setup's order: what
    /// a reconnected source must send again.
    pub(super) fn missing_runs(&self) -> Vec<PageRun> {
        let mut runs = Vec::new();
        for (region, &region_id) in self.region_ids.iter().enumerate() {
            let pages = self.stale.region_pages(region);
            let mut page = 0;
            while page < pages {
                if !self.stale.contains(region, page) || self.delivered[region].get(page) {
                    page += 1;
                    continue;
                }
                let first = page;
                while page < pages
                    && page - first < u64::from(u32::MAX)
                    && self.stale.contains(region, page)
                    && !self.delivered[region].get(page)
                {
                    page += 1;
                }
                runs.push(PageRun {
                    region_id,
                    first_page: u32::try_from(first).unwrap_or(u32::MAX),
                    pages: u32::try_from(page - first).unwrap_or(u32::MAX),
                });
            }
        }
        runs
    }

    fn notify(&self) {
        let _guard = self.arrived.0.lock().unwrap_or_else(|e| e.into_inner());
        self.arrived.1.notify_all();
    }

    /// Places `bytes` (a page, or `None` for a zero page) as page `page` of
    /// region `region` unless it is there, and records its hash if this was
    /// its first delivery. Zero pages are placed by copying zeros: a
    /// private page the guest may write without a second fault. Returns
    /// whether this was the page's first delivery.
    fn place(
        &self,
        service: &FaultService,
        hashes: Option<&PageHashes>,
        region: usize,
        page: u64,
        bytes: Option<&[u8]>,
    ) -> Result<bool, MigrationError> {
        let data = bytes.unwrap_or(&ZERO_PAGE);
        service
            .place(region, page, data, &[false])
            .map_err(|error| MigrationError::Internal(format!("postcopy placement: {error}")))?;
        if self.delivered[region].set(page) {
            return Ok(false);
        }
        if let Some(hashes) = hashes {
            let hash = match bytes {
                // SAFETY: a page of readable bytes.
                Some(bytes) => unsafe { page_hash(bytes.as_ptr()) },
                None => zero_page_hash(),
            };
            hashes.record(region, page, hash);
        }
        let placed = self.delivered_count.fetch_add(1, Ordering::AcqRel) + 1;
        // Only a fault waits for one page, and only on a page asked for
        // (`wait_for` marks it before it waits, then looks once more); the
        // other waiters want the last page. Waking them for every pushed
        // page cost two threads ~12 500 wake-ups a second on a push of
        // ~27 000 pages a second, on CPUs the push receivers and the guest
        // need. The fence pairs with the one in `wait_for`: either this
        // placer sees the page asked for and wakes the fault, or the fault,
        // looking after it asked, sees the page placed.
        std::sync::atomic::fence(Ordering::SeqCst);
        if placed >= self.stale.total() || self.requested[region].get(page) {
            self.notify();
        }
        Ok(true)
    }

    /// Queues a request for the stale pages from `page` on that are neither
    /// placed nor asked for, at most [`MAX_REQUEST_PAGES`].
    fn request(&self, region: usize, page: u64) {
        let mut end = page;
        while end < page + u64::from(MAX_REQUEST_PAGES)
            && self.stale.contains(region, end)
            && !self.delivered[region].get(end)
            && (end == page || !self.requested[region].set(end))
        {
            end += 1;
        }
        if end == page {
            return;
        }
        self.queue_request(region, page, u32::try_from(end - page).unwrap_or(1));
    }

    /// Matches an urgent answer with the oldest request of the connection
    /// not answered yet (`outstanding`, in the order sent; the source
    /// answers in that order). An answer that covers less than its request
    /// left the rest out because the source's push has those pages on
    /// their way: they are no longer asked for, so that a fault on one asks
    /// again rather than wait for a push copy that may queue behind
    /// megabytes on a page channel. An answer that matches no request
    /// releases nothing.
    fn answered(&self, outstanding: &mut VecDeque<PageRun>, region: usize, urgent: &UrgentPages) {
        let Some(run) = outstanding.front().copied() else {
            return;
        };
        if (run.region_id, run.first_page) != (urgent.region_id, urgent.first_page) {
            return;
        }
        outstanding.pop_front();
        let answered = u32::from(urgent.pages);
        if answered < run.pages {
            let first = u64::from(run.first_page);
            self.release(
                region,
                first + u64::from(answered)..first + u64::from(run.pages),
            );
        }
    }

    /// Pages an answer left out (the source's push sends them): not asked
    /// for any more, and a fault waiting on one asks again.
    fn release(&self, region: usize, pages: std::ops::Range<u64>) {
        let Some(requested) = self.requested.get(region) else {
            return;
        };
        for page in pages {
            if !self.delivered[region].get(page) {
                requested.clear(page);
            }
        }
        self.notify();
    }

    /// Waits until page `page` of region `region` is placed. Past
    /// `request_timeout` the source counts as silent: the connection is
    /// given up for a new one (the round is marked stalled) and the wait
    /// goes on, as it does while postcopy is paused; after a recovery the
    /// page is asked for again. Only [`Delivery::fail`] ends the wait
    /// without the page.
    fn wait_for(&self, region: usize, page: u64) -> Result<(), PageSourceError> {
        let mut generation = self.generation.load(Ordering::Acquire);
        let mut deadline = Instant::now() + self.request_timeout;
        let mut guard = self.arrived.0.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.delivered[region].get(page) {
                return Ok(());
            }
            if self.failed.load(Ordering::Acquire) {
                return Err(PageSourceError::new("postcopy stopped"));
            }
            // Not asked for yet, or asked for as a neighbour and then left
            // out of the answer (the push has it on its way, but the guest
            // waits now).
            if !self.requested[region].set(page) {
                self.request(region, page);
            }
            let now = Instant::now();
            if self.generation.load(Ordering::Acquire) != generation {
                generation = self.generation.load(Ordering::Acquire);
                deadline = now + self.request_timeout;
                self.request_again(region, page);
            }
            if self.paused.load(Ordering::Acquire) {
                deadline = now + self.request_timeout;
            } else if now >= deadline && !self.stalled.swap(true, Ordering::AcqRel) {
                tracing::warn!(
                    page,
                    region,
                    timeout_s = self.request_timeout.as_secs_f64(),
                    "the source did not deliver a page within postcopy_request_timeout; \
                     reconnecting"
                );
                self.notify_locked();
            }
            // A placement wakes this wait only if it saw the page asked
            // for (`place`): the page is marked above, so look once more.
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.delivered[region].get(page) {
                return Ok(());
            }
            guard = self
                .arrived
                .1
                .wait_timeout(guard, POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Wakes the waiters while the caller holds the lock.
    fn notify_locked(&self) {
        self.arrived.1.notify_all();
    }

    /// Queues a request for one page whatever was asked before: the answer
    /// to the first may have been lost with a broken connection.
    fn request_again(&self, region: usize, page: u64) {
        self.queue_request(region, page, 1);
    }

    /// Queues a run of `pages` from `page` and wakes the main-channel
    /// thread (an eventfd) to send it.
    fn queue_request(&self, region: usize, page: u64, pages: u32) {
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(PageRun {
                region_id: self.region_ids[region],
                first_page: u32::try_from(page).unwrap_or(u32::MAX),
                pages,
            });
        let one = 1u64.to_ne_bytes();
        // SAFETY: eight readable bytes, what an eventfd write takes.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    fn take_requests(&self) -> Vec<PageRun> {
        let mut eight = [0u8; 8];
        // SAFETY: eight writable bytes; the descriptor does not block.
        unsafe { libc::read(self.wake.as_raw_fd(), eight.as_mut_ptr().cast(), 8) };
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect()
    }
}

/// The fault thread's page source: a stale page is requested and waited
/// for (it is placed by whoever delivers it, so the zeros handed back here
/// meet `EEXIST` and are dropped); any other missing page was a zero page
/// the destination never had to write, and is placed as zeros.
pub(super) struct RemotePages(pub(super) Arc<Delivery>);

impl PageSource for RemotePages {
    fn fetch(
        &self,
        region: usize,
        first: u64,
        buf: &mut [u8],
        zero: &mut [bool],
    ) -> Result<(), PageSourceError> {
        buf.fill(0);
        for (offset, is_zero) in zero.iter_mut().enumerate() {
            let page = first + offset as u64;
            *is_zero = false;
            if self.0.stale.contains(region, page) {
                self.0.wait_for(region, page)?;
            }
        }
        Ok(())
    }
}

/// Starts the fault service on `regions` for postcopy: single pages, no
/// loaders (the source pushes), memory released if it fails.
pub(super) fn start_faults(
    regions: &[MemoryRegion],
    delivery: &Arc<Delivery>,
) -> Result<FaultService, MigrationError> {
    FaultService::register_and_start(
        regions,
        Arc::new(RemotePages(delivery.clone())),
        FaultConfig {
            unit_pages: 1,
            loaders: 0,
            working_set: Vec::new(),
            release_on_failure: true,
        },
    )
    .map_err(|error| {
        MigrationError::Internal(format!(
            "postcopy needs guest memory under userfaultfd: {error}"
        ))
    })
}

/// Everything the postcopy phase's threads read.
pub(super) struct Phase<'a> {
    pub setup: &'a SessionSetup,
    pub delivery: &'a Delivery,
    pub service: &'a FaultService,
    pub hashes: Option<&'a PageHashes>,
    /// The iteration the push's packets and syncs carry.
    pub iteration: u32,
    pub io_timeout: Duration,
    pub stop: &'a AtomicBool,
    /// The receivers' state, for the push's decompressors (codecs and
    /// dictionaries as precopy left them).
    pub receiver: &'a ReceiverShared<'a>,
    /// The codecs the source announced.
    pub codecs: &'a [CodecId],
}

/// Runs the postcopy phase until every stale page is placed and every
/// page channel has ended its push, or the first failure. A lost
/// connection (see [`crate::postcopy::is_recoverable`]) leaves the faults
/// waiting for a recovery; any other failure releases them.
pub(super) fn deliver_all(
    phase: &Phase<'_>,
    main: &mut Channel,
    decoder: &mut FrameDecoder,
    mut channels: Vec<Channel>,
) -> Result<(), MigrationError> {
    let result = run_round(phase, main, decoder, &mut channels);
    if let Err(error) = &result {
        // A destination that gives up says so before any channel closes:
        // a source that saw a page channel close first would take it for
        // a broken link and wait, paused, for a recovery that never comes.
        if !crate::postcopy::is_recoverable(error)
            && !matches!(error, MigrationError::PeerAborted { .. })
        {
            tell_source_we_failed(main, error, phase.io_timeout);
        }
        // Whatever ended the round, the source hears of it now (each
        // handle may be a second one on its socket: shut it down).
        for channel in &channels {
            channel.shutdown();
        }
    }
    result
}

/// Sends the source an abort naming `error`, then waits up to `linger`
/// for it to close the main channel (bytes it sends meanwhile are read
/// and dropped): until then the page channels stay open, so that the
/// abort is what the source sees first. Best effort: a main channel that
/// is gone ends it at once.
fn tell_source_we_failed(main: &mut Channel, error: &MigrationError, linger: Duration) {
    let abort = Message::Abort(Abort {
        reason: error.abort_reason(),
        message: format!(
            "postcopy failed on the destination, which paused the guest without all of its \
             memory: {}",
            error.chain()
        ),
    });
    if main.send_message(&abort).is_err() {
        return;
    }
    let until = Instant::now() + linger;
    let mut byte = [0u8; 1];
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        match main.wait_readable(left.min(POLL)) {
            Ok(true) => {
                // One byte at a time: what follows the abort may be
                // anything, and a read never waits for more than is there.
                if main.read_exact(&mut byte).is_err() {
                    return;
                }
            }
            Ok(false) => {}
            Err(_) => return,
        }
    }
}

/// One round of postcopy on one connection: the push receivers and the
/// main channel's thread, until every page is in or the first failure.
fn run_round(
    phase: &Phase<'_>,
    main: &mut Channel,
    decoder: &mut FrameDecoder,
    channels: &mut [Channel],
) -> Result<(), MigrationError> {
    // The thread that failed first: its error is the cause, and those of
    // the others may be its consequences (a placement refused because
    // the failure released guest memory, a channel shut down for it).
    let first_failed = AtomicUsize::new(usize::MAX);
    let noted = |thread: usize, result: Result<(), MigrationError>| {
        if result.is_err() {
            let _ = first_failed.compare_exchange(
                usize::MAX,
                thread,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        result
    };
    std::thread::scope(|scope| {
        let pushers: Vec<ScopedJoinHandle<'_, Result<(), MigrationError>>> = channels
            .iter_mut()
            .enumerate()
            .map(|(index, channel)| {
                scope.spawn(move || noted(index, phase.receive_push(index + 1, channel)))
            })
            .collect();
        let main_thread = pushers.len();
        let urgent = scope.spawn(move || noted(main_thread, phase.serve_main(main, decoder)));
        let waited = phase.wait_until_delivered(&pushers, &urgent);
        phase.stop.store(true, Ordering::Release);
        if waited.is_err() {
            // Whoever waits on a page stays blocked until the round ends.
            phase.delivery.pause();
        }
        let mut errors: Vec<Option<MigrationError>> = pushers
            .into_iter()
            .chain(std::iter::once(urgent))
            .map(|handle| match handle.join() {
                Ok(result) => result.err(),
                Err(_) => Some(MigrationError::Internal(
                    "a postcopy thread panicked".into(),
                )),
            })
            .collect();
        let first = errors
            .get_mut(first_failed.load(Ordering::Acquire))
            .and_then(Option::take)
            .or_else(|| errors.into_iter().flatten().next());
        // A thread's own error says more than the wait's.
        let result = match (first, waited) {
            (Some(error), _) | (None, Err(error)) => Err(error),
            (None, Ok(())) => Ok(()),
        };
        let result = result.and_then(|()| service_intact(phase.service));
        if let Err(error) = &result
            && !crate::postcopy::is_recoverable(error)
        {
            phase.delivery.fail();
        }
        result
    })
}

/// Every page is in: that counts only if the fault service still holds
/// guest memory. Once it has released it (it failed), a page missing then
/// may have been read or written as zeros, and the digest of the bytes
/// delivered would no longer describe memory.
fn service_intact(service: &FaultService) -> Result<(), MigrationError> {
    if service.has_failed() || service.is_released() {
        let cause = service
            .take_failure()
            .map_or_else(|| "it released guest memory".to_owned(), |e| e.to_string());
        return Err(MigrationError::Internal(format!(
            "the fault service stopped before every page was placed: {cause}"
        )));
    }
    Ok(())
}

impl Phase<'_> {
    /// Waits on the threads: done when every page is in and every push
    /// ended; a thread's error ends the wait at once.
    fn wait_until_delivered(
        &self,
        pushers: &[ScopedJoinHandle<'_, Result<(), MigrationError>>],
        urgent: &ScopedJoinHandle<'_, Result<(), MigrationError>>,
    ) -> Result<(), MigrationError> {
        loop {
            if self.delivery.failed.load(Ordering::Acquire) {
                return Err(MigrationError::Internal("postcopy stopped".into()));
            }
            if self.delivery.interrupted.load(Ordering::Acquire) {
                return Err(MigrationError::channel(0)(ChannelError::Closed));
            }
            if self.delivery.stalled.load(Ordering::Acquire) {
                return Err(MigrationError::channel(0)(ChannelError::Timeout(
                    "a page the guest waits on (postcopy_request_timeout)",
                )));
            }
            if let Some(error) = self.service.take_failure() {
                return Err(MigrationError::Internal(format!(
                    "the fault service stopped: {error}"
                )));
            }
            if urgent.is_finished() {
                return Err(MigrationError::Internal(
                    "the main channel's postcopy thread ended early".into(),
                ));
            }
            let pushed = pushers.iter().all(ScopedJoinHandle::is_finished);
            if pushed && self.delivery.complete() {
                return Ok(());
            }
            if pushed && !self.delivery.complete() {
                // The push ended; what is missing now can only be urgent
                // pages on their way, or a source that pushed too little.
                self.delivery.wait_quietly(self.io_timeout)?;
                continue;
            }
            let guard = self
                .delivery
                .arrived
                .0
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            drop(
                self.delivery
                    .arrived
                    .1
                    .wait_timeout(guard, POLL)
                    .unwrap_or_else(|e| e.into_inner()),
            );
        }
    }

    /// The main channel: sends queued requests, places urgent pages.
    fn serve_main(
        &self,
        main: &mut Channel,
        decoder: &mut FrameDecoder,
    ) -> Result<(), MigrationError> {
        let result = self.serve_main_until_stopped(main, decoder);
        if let Err(error) = &result {
            self.lost(error);
        }
        result
    }

    fn serve_main_until_stopped(
        &self,
        main: &mut Channel,
        decoder: &mut FrameDecoder,
    ) -> Result<(), MigrationError> {
        let channel_error = |error| MigrationError::channel(0)(error);
        // The requests of this connection not answered yet, in order: the
        // source answers each, in order, on this channel.
        let mut outstanding: VecDeque<PageRun> = VecDeque::new();
        while !self.stop.load(Ordering::Acquire) {
            for run in self.delivery.take_requests() {
                main.send_message(&Message::PageRequest(PageRequest { run }))
                    .map_err(MigrationError::channel(0))?;
                self.delivery
                    .requested_pages
                    .fetch_add(u64::from(run.pages), Ordering::Relaxed);
                if outstanding.len() < MAX_OUTSTANDING {
                    outstanding.push_back(run);
                }
            }
            if !wait_two(main, &self.delivery.wake, POLL).map_err(channel_error)? {
                continue;
            }
            if !main.wait_readable(Duration::ZERO).map_err(channel_error)? {
                continue;
            }
            match read_message(main, decoder).map_err(MigrationError::channel(0))? {
                Message::UrgentPages(urgent) => {
                    self.place_urgent(&urgent)?;
                    self.release_unanswered(&mut outstanding, &urgent);
                }
                Message::Abort(abort) => return Err(peer_aborted(abort)),
                other => {
                    return Err(MigrationError::Protocol(format!(
                        "unexpected {:?} on the main channel during postcopy",
                        other.kind()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Places an urgent delivery: every page must be stale.
    fn place_urgent(&self, urgent: &UrgentPages) -> Result<(), MigrationError> {
        let region = self.region_index(urgent.region_id)?;
        for index in 0..usize::from(urgent.pages) {
            let page = u64::from(urgent.first_page) + index as u64;
            self.check_stale(region, page)?;
            self.delivery
                .place(self.service, self.hashes, region, page, urgent.page(index))?;
        }
        Ok(())
    }

    /// Matches an answer with its request (see [`Delivery::answered`]).
    fn release_unanswered(&self, outstanding: &mut VecDeque<PageRun>, urgent: &UrgentPages) {
        if let Ok(region) = self.region_index(urgent.region_id) {
            self.delivery.answered(outstanding, region, urgent);
        }
    }

    fn region_index(&self, id: u32) -> Result<usize, MigrationError> {
        self.setup
            .regions
            .iter()
            .position(|region| region.id == id)
            .ok_or_else(|| {
                MigrationError::Protocol(format!("postcopy page of unknown region {id}"))
            })
    }

    fn check_stale(&self, region: usize, page: u64) -> Result<(), MigrationError> {
        if self.delivery.stale.contains(region, page) {
            return Ok(());
        }
        Err(MigrationError::Protocol(format!(
            "the source sent page {page} of region {} in postcopy, which was not stale",
            self.setup.regions[region].id
        )))
    }

    /// One page channel's background push, until its last sync.
    /// The channel stays open: [`deliver_all`] closes it once the round
    /// has ended and the source was told why.
    fn receive_push(&self, index: usize, channel: &mut Channel) -> Result<(), MigrationError> {
        let result = self.receive_push_until_end(index, channel);
        if let Err(error) = &result {
            self.lost(error);
        }
        result
    }

    /// A thread's failure ends the round: a lost connection pauses
    /// postcopy, anything else fails it.
    fn lost(&self, error: &MigrationError) {
        if crate::postcopy::is_recoverable(error) {
            self.delivery.interrupt();
        } else {
            self.delivery.fail();
        }
    }

    fn receive_push_until_end(
        &self,
        index: usize,
        channel: &mut Channel,
    ) -> Result<(), MigrationError> {
        let error = |failure| MigrationError::channel(index)(failure);
        let mut decoder =
            FrameDecoder::with_setup(self.setup.clone()).only(PUSH_FRAMES, "postcopy pages");
        // The dictionaries precopy's last sync put in force (a refresh, or
        // one auto trained during the migration): the push's packets may
        // name them, as precopy's last ones could.
        decoder.allow_dictionaries(self.receiver.dictionaries.in_force());
        let mut payload = vec![0u8; tern_wire::MAX_PAGES_PER_PACKET * PAGE_SIZE];
        let mut decompressors = Decompressors::new(self.codecs, self.receiver)?;
        let mut page = Box::new([0u8; PAGE_SIZE]);
        let mut silent_since = Instant::now();
        loop {
            if self.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            if !channel.wait_readable(POLL).map_err(error)? {
                if silent_since.elapsed() > self.io_timeout {
                    return Err(error(ChannelError::Timeout("the source's background push")));
                }
                continue;
            }
            silent_since = Instant::now();
            match read_event(channel, &mut decoder).map_err(error)? {
                tern_wire::Event::Message(Message::Sync(sync)) => {
                    if sync.iteration != self.iteration || !sync.last {
                        return Err(MigrationError::Protocol(format!(
                            "channel {index}: postcopy ended with a sync of iteration {} (last: {}), \
                             expected the last of {}",
                            sync.iteration, sync.last, self.iteration
                        )));
                    }
                    return Ok(());
                }
                tern_wire::Event::Message(Message::Abort(abort)) => {
                    return Err(peer_aborted(abort));
                }
                tern_wire::Event::Message(other) => {
                    return Err(MigrationError::Protocol(format!(
                        "channel {index}: unexpected {:?} during postcopy",
                        other.kind()
                    )));
                }
                tern_wire::Event::Pages(packet) => {
                    let len = packet.payload_len;
                    let read = match payload.get_mut(..len) {
                        Some(buf) => channel.read_exact(buf),
                        None => Err(ChannelError::Protocol(tern_wire::WireError::Truncated(
                            "postcopy payload",
                        ))),
                    };
                    FrameSource::end_transfer(channel);
                    read.map_err(error)?;
                    decoder.consume_payload(len);
                    let pushed = Pushed {
                        packet: &packet,
                        entries: decoder.entries(),
                        payload: &payload[..len],
                    };
                    self.place_packet(index, &pushed, &mut decompressors, &mut page)?;
                }
            }
        }
    }

    /// Places a pushed packet's pages: zero, raw and compressed pages (a
    /// compressed page is decoded into `page` first, then placed whole,
    /// as a raw one is). Bad compressed input fails postcopy with a
    /// protocol error naming the page, which stays unplaced.
    fn place_packet(
        &self,
        index: usize,
        pushed: &Pushed<'_>,
        decompressors: &mut Decompressors,
        page_buf: &mut [u8; PAGE_SIZE],
    ) -> Result<(), MigrationError> {
        let Pushed {
            packet,
            entries,
            payload,
        } = *pushed;
        if packet.header.iteration != self.iteration {
            return Err(MigrationError::Protocol(format!(
                "channel {index}: postcopy packet of iteration {}, expected {}",
                packet.header.iteration, self.iteration
            )));
        }
        let region = packet.region_index;
        let mut pages = decompressors.packet(self.receiver, packet, entries)?;
        let mut rest = payload;
        for entry in entries {
            let page = u64::from(entry.page_index);
            self.check_stale(region, page)?;
            let len = entry.encoded_len as usize;
            let Some((input, after)) = rest.split_at_checked(len) else {
                return Err(MigrationError::Protocol(format!(
                    "channel {index}: a postcopy packet's table names more bytes than it carries"
                )));
            };
            rest = after;
            let bytes = match entry.kind {
                PageKind::Zero => None,
                PageKind::Raw => Some(input),
                PageKind::Compressed => {
                    pages.decode_next(input, page_buf).map_err(|error| {
                        MigrationError::Protocol(format!(
                            "channel {index}: page {page} of region {}: {error}",
                            packet.header.region_id
                        ))
                    })?;
                    Some(&page_buf[..])
                }
                other => {
                    return Err(MigrationError::Protocol(format!(
                        "channel {index}: a {other:?} page in the postcopy push \
                         (zero, raw and compressed only)"
                    )));
                }
            };
            if self
                .delivery
                .place(self.service, self.hashes, region, page, bytes)?
            {
                self.delivery.pushed_pages.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

/// A pushed packet as read: its header, table and payload.
#[derive(Clone, Copy)]
struct Pushed<'p> {
    packet: &'p tern_wire::PagePacket,
    entries: &'p [tern_wire::PageEntry],
    payload: &'p [u8],
}

impl Delivery {
    /// After the push ended: waits up to `timeout` for the last pages
    /// (urgent ones on their way); a push that left pages out is the
    /// source's error.
    fn wait_quietly(&self, timeout: Duration) -> Result<(), MigrationError> {
        let deadline = Instant::now() + timeout;
        let mut guard = self.arrived.0.lock().unwrap_or_else(|e| e.into_inner());
        while !self.complete() {
            if self.failed.load(Ordering::Acquire) {
                return Err(MigrationError::Internal("postcopy stopped".into()));
            }
            if self.interrupted.load(Ordering::Acquire) || self.stalled.load(Ordering::Acquire) {
                return Err(MigrationError::channel(0)(ChannelError::Closed));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(MigrationError::Protocol(format!(
                    "the source ended its push with {} of {} stale pages delivered",
                    self.delivered_count.load(Ordering::Acquire),
                    self.stale.total()
                )));
            }
            guard = self
                .arrived
                .1
                .wait_timeout(guard, (deadline - now).min(POLL))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }
}

/// Waits until the channel or the eventfd is readable, or `timeout`.
/// Returns whether the channel may be.
fn wait_two(main: &Channel, wake: &OwnedFd, timeout: Duration) -> Result<bool, ChannelError> {
    if main.wait_readable(Duration::ZERO)? {
        return Ok(true);
    }
    let mut fds = [
        libc::pollfd {
            fd: main.raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let millis = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: two valid pollfd structures.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, millis) };
    if ready < 0 {
        let error = std::io::Error::last_os_error();
        if error.kind() == std::io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(ChannelError::Io(error));
    }
    Ok(fds[0].revents != 0)
}

/// The destination's postcopy figures and its completion message.
pub(super) fn completion(
    delivery: &Delivery,
    faults: &FaultStats,
    digest: u128,
    delivered_after: Duration,
    latencies: &[u64],
) -> (PostcopyComplete, PostcopyReport) {
    let mut histogram = [0u64; tern_wire::LATENCY_BUCKETS];
    for (bucket, &count) in latencies.iter().enumerate() {
        histogram[bucket.min(tern_wire::LATENCY_BUCKETS - 1)] += count;
    }
    let complete = PostcopyComplete {
        digest,
        requested_pages: delivery.requested_pages.load(Ordering::Relaxed),
        pushed_pages: delivery.pushed_pages.load(Ordering::Relaxed),
        faults: faults.faults,
        blocktime_micros: crate::numeric::saturating_u64_from_f64(faults.blocktime_ms * 1000.0),
        delivered_micros: u64::try_from(delivered_after.as_micros()).unwrap_or(u64::MAX),
        latency_histogram: histogram.to_vec(),
    };
    let mut report = PostcopyReport {
        stale_pages: delivery.stale.total(),
        requested_pages: complete.requested_pages,
        pushed_pages: complete.pushed_pages,
        ..PostcopyReport::default()
    };
    report.add_destination(&complete);
    (complete, report)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use tern_wire::{PageRun, SessionSetup};

    use super::{Delivery, start_faults};
    use crate::destination::test_memory::AnonymousMemory;
    use crate::guest::PAGE_SIZE;
    use crate::postcopy::StaleSet;

    fn setup(pages: u64) -> SessionSetup {
        crate::destination::test_memory::one_region_setup(1, pages * PAGE_SIZE as u64)
    }

    /// Pages 0..4 of 8 stale, a delivery with `timeout` per fault.
    fn delivery(timeout: Duration) -> (Arc<Delivery>, SessionSetup) {
        let setup = setup(8);
        let runs = [PageRun {
            region_id: 1,
            first_page: 0,
            pages: 4,
        }];
        let stale = StaleSet::from_runs(&setup, &runs).unwrap();
        (
            Arc::new(Delivery::new(stale, &setup, timeout).unwrap()),
            setup,
        )
    }

    fn skip_without_userfaultfd(error: &crate::error::MigrationError) {
        tern_test_skip::skip(
            tern_test_skip::Need::Userfaultfd,
            format!("no userfaultfd for this process: {error}"),
        );
    }

    #[test]
    fn a_page_delivered_twice_is_placed_once() {
        let memory = AnonymousMemory::new(8);
        let regions = [memory.region(1)];
        let (delivery, _) = delivery(Duration::from_secs(5));
        let service = match start_faults(&regions, &delivery) {
            Ok(service) => service,
            Err(error) => return skip_without_userfaultfd(&error),
        };
        let first = vec![5u8; PAGE_SIZE];
        let second = vec![6u8; PAGE_SIZE];
        assert!(delivery.place(&service, None, 0, 1, Some(&first)).unwrap());
        assert!(!delivery.place(&service, None, 0, 1, Some(&second)).unwrap());
        assert!(delivery.place(&service, None, 0, 2, None).unwrap());
        drop(service.stop());
        assert!(memory.page(1).iter().all(|&byte| byte == 5));
        assert!(memory.page(2).iter().all(|&byte| byte == 0));
        assert!(!delivery.complete(), "pages 0 and 3 are still missing");
    }

    /// The defect docs/postcopy.md used to list: a fault that fails stops
    /// the fault service, which releases guest memory (the faulting thread
    /// then reads zeros); the page's later delivery met `ENOENT`, was
    /// taken for memory the guest unmapped, and was counted as delivered
    /// with the hash of bytes that never reached memory.
    #[test]
    fn a_page_arriving_after_a_failed_fault_released_memory_is_refused() {
        let memory = AnonymousMemory::new(8);
        let regions = [memory.region(1)];
        let (delivery, _) = delivery(Duration::from_secs(60));
        let service = match start_faults(&regions, &delivery) {
            Ok(service) => service,
            Err(error) => return skip_without_userfaultfd(&error),
        };
        let hashes = crate::digest::PageHashes::new(&regions, false);
        let base = memory.base as usize;
        let reader = std::thread::spawn(move || {
            // SAFETY: page 2 (stale) of the mapping, which outlives the
            // thread (joined below).
            unsafe { (base as *const u8).add(2 * PAGE_SIZE).read_volatile() }
        });
        tern_test_skip::wait::wait_until("a request is made", || {
            !delivery.take_requests().is_empty()
        });
        // The fault fails: the service stops and releases the memory, and
        // the faulting thread goes on with a page of zeros.
        delivery.fail();
        assert_eq!(
            tern_test_skip::wait::join_within(reader, "the faulting reader"),
            0
        );
        tern_test_skip::wait::wait_until("the service releases memory", || service.is_released());
        let page = vec![9u8; PAGE_SIZE];
        let error = delivery
            .place(&service, Some(&hashes), 0, 2, Some(&page))
            .expect_err("a page placed after the release must be refused")
            .to_string();
        assert!(
            error.contains("after the fault service had stopped"),
            "{error}"
        );
        // Nor does a page nobody faulted on count: memory left userfaultfd.
        assert!(delivery.place(&service, Some(&hashes), 0, 3, None).is_err());
        assert!(!delivery.delivered[0].get(2) && !delivery.delivered[0].get(3));
        assert_eq!(delivery.delivered_count.load(Ordering::Acquire), 0);
        assert!(memory.page(2).iter().all(|&byte| byte == 0));
        drop(service.stop());
    }

    /// The source answered a request for pages 1..4 with page 1 alone (its
    /// push had taken pages 2 and 3): a fault on page 2 asks again instead
    /// of waiting for the push copy, and an answer matching no request
    /// releases nothing.
    #[test]
    fn a_fault_on_a_page_left_out_of_an_answer_asks_again() {
        let memory = AnonymousMemory::new(8);
        let regions = [memory.region(1)];
        let (delivery, _) = delivery(Duration::from_secs(60));
        let service = match start_faults(&regions, &delivery) {
            Ok(service) => service,
            Err(error) => return skip_without_userfaultfd(&error),
        };
        let base = memory.base as usize;
        let read = move |page: usize| {
            std::thread::spawn(move || {
                // SAFETY: a stale page of the mapping, which outlives the
                // thread (joined below).
                unsafe { (base as *const u8).add(page * PAGE_SIZE).read_volatile() }
            })
        };
        let next_requests = || {
            let mut requests = Vec::new();
            tern_test_skip::wait::wait_until("a request", || {
                requests = delivery.take_requests();
                !requests.is_empty()
            });
            requests
        };
        let run = |first_page, pages| PageRun {
            region_id: 1,
            first_page,
            pages,
        };
        let first = read(1);
        let asked = next_requests();
        assert_eq!(asked, [run(1, 3)]);
        let mut outstanding = asked.into_iter().collect();
        let answer = |first_page, pages| tern_wire::UrgentPages {
            region_id: 1,
            first_page,
            pages,
            zero_mask: 0,
            data: vec![4u8; usize::from(pages) * PAGE_SIZE],
        };
        // An answer to nothing asked: ignored.
        delivery.answered(&mut outstanding, 0, &answer(3, 1));
        assert_eq!(outstanding.len(), 1);
        assert!(delivery.requested[0].get(2) && delivery.requested[0].get(3));
        let page = vec![4u8; PAGE_SIZE];
        assert!(delivery.place(&service, None, 0, 1, Some(&page)).unwrap());
        delivery.answered(&mut outstanding, 0, &answer(1, 1));
        assert!(outstanding.is_empty());
        assert_eq!(
            tern_test_skip::wait::join_within(first, "the first fault"),
            4
        );
        let second = read(2);
        assert_eq!(next_requests(), [run(2, 2)]);
        assert!(delivery.place(&service, None, 0, 2, Some(&page)).unwrap());
        assert_eq!(
            tern_test_skip::wait::join_within(second, "the second fault"),
            4
        );
        drop(service.stop());
    }

    #[test]
    fn a_fault_on_a_stale_page_asks_the_source_and_a_silent_source_pauses_it() {
        let memory = AnonymousMemory::new(8);
        let regions = [memory.region(1)];
        let (delivery, _) = delivery(Duration::from_millis(200));
        let service = match start_faults(&regions, &delivery) {
            Ok(service) => service,
            Err(error) => return skip_without_userfaultfd(&error),
        };
        let base = memory.base as usize;
        let reader = std::thread::spawn(move || {
            // SAFETY: page 6 (not stale) and page 2 (stale) of the mapping,
            // which outlives the thread (joined below).
            unsafe {
                let base = base as *const u8;
                (
                    base.add(6 * PAGE_SIZE).read_volatile(),
                    base.add(2 * PAGE_SIZE).read_volatile(),
                )
            }
        });
        // The page that was never stale is a zero page without asking;
        // the stale one is asked for, with its stale neighbours.
        let deadline = Instant::now() + Duration::from_secs(60);
        let requests = loop {
            let requests = delivery.take_requests();
            if !requests.is_empty() {
                break requests;
            }
            assert!(Instant::now() < deadline, "no request was made");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(
            requests,
            [PageRun {
                region_id: 1,
                first_page: 2,
                pages: 2
            }]
        );
        // Nobody answers: past the deadline the round is marked stalled
        // (the connection is given up for a new one), and the fault keeps
        // waiting: memory never leaves userfaultfd, nothing reads zeros.
        while !delivery.stalled.load(std::sync::atomic::Ordering::Acquire) {
            assert!(Instant::now() < deadline, "a silent source never stalled");
            std::thread::sleep(Duration::from_millis(1));
        }
        delivery.pause();
        assert!(service.take_failure().is_none());
        assert!(!reader.is_finished(), "the faulting thread waits");
        // A recovery: the fault asks again, and the page arrives.
        delivery.resume();
        let again = loop {
            let requests = delivery.take_requests();
            if !requests.is_empty() {
                break requests;
            }
            assert!(Instant::now() < deadline, "no request after the recovery");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(again[0].first_page, 2);
        let page = vec![9u8; PAGE_SIZE];
        assert!(delivery.place(&service, None, 0, 2, Some(&page)).unwrap());
        assert_eq!(
            tern_test_skip::wait::join_within(reader, "the faulting reader"),
            (0, 9)
        );
        assert_eq!(
            delivery.missing_runs(),
            [
                PageRun {
                    region_id: 1,
                    first_page: 0,
                    pages: 2
                },
                PageRun {
                    region_id: 1,
                    first_page: 3,
                    pages: 1
                }
            ]
        );
        drop(service.stop());
    }
}

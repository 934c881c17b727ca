//! The source's half of postcopy, after the point of no return: the guest
//! is paused here for good and its memory frozen; the main channel answers
//! the destination's page requests (the urgent path) while one thread per
//! page channel pushes every stale page (the background push).
//!
//! Why the main channel is the urgent path: once the switch is made it
//! carries nothing else, so an answer never waits behind a background
//! packet (QEMU's preempt channel, without a new connection and its
//! handshake). Each page channel carries one packet at a time of at most
//! 128 pages, so a request competes only with the page-channel packets
//! already in the kernel's buffers for the link, never in a queue of ours.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tern_page::zero::ZeroChecker;
use tern_wire::{MAX_PAGES_PER_PACKET, Message, PageRun, PostcopyComplete, Sync, UrgentPages};

use crate::error::{ChannelError, MigrationError};
use crate::guest::{MemoryRegion, PAGE_SIZE};
use crate::pipeline::{PushEncoder, PushedPacket};
use crate::postcopy::{PageBits, StaleSet};
use crate::stats::LiveStats;
use crate::transport::{Channel, Expected, ShutdownHandle};

/// Requests read but not answered yet, at most: a destination that sends
/// more without reading the answers is flooding, and the migration fails
/// with a clear error instead of queueing without end.
pub(crate) const MAX_PENDING_REQUESTS: usize = 4096;

/// How long the request loop waits for the main channel before it looks
/// at the push threads again.
const REQUEST_POLL: Duration = Duration::from_millis(20);

/// Chunks a request steers the push toward: the pushers continue from the
/// requested chunk, up to this many chunks on, before the plain order.
const STEER_SPAN: usize = 64;

/// Pages of one chunk: one packet at most.
const CHUNK_PAGES: u64 = MAX_PAGES_PER_PACKET as u64;

/// What the switch to postcopy takes from the source's setup.
pub(super) struct Handover<'a> {
    pub trigger: crate::postcopy::PostcopyTrigger,
    /// Second handles on the page channels, for the background push.
    pub channels: Vec<Channel>,
    pub setup: &'a tern_wire::SessionSetup,
    /// The guest's regions, in the setup's order.
    pub regions: &'a [MemoryRegion],
    /// How to connect again after a broken connection (recovery).
    pub connector: &'a dyn crate::transport::Connect,
    pub session_id: u64,
}

/// What the push and the answers read: the frozen memory and what is stale.
pub(super) struct Frozen<'a> {
    pub regions: &'a [MemoryRegion],
    pub stale: &'a StaleSet,
    /// The iteration number the push's packets and syncs carry.
    pub iteration: u32,
    /// How the push encodes its packets: precopy's codec at the switch.
    pub encoder: &'a PushEncoder,
}

/// The chunks that hold stale pages, handed to the pushers one at a time,
/// starting near the latest request when there is one.
struct ChunkCursor {
    /// (region index, first page), in memory order.
    chunks: Vec<(usize, u64)>,
    taken: PageBits,
    next: AtomicUsize,
    /// A chunk index to continue from, or `usize::MAX`.
    hint: AtomicUsize,
}

impl ChunkCursor {
    fn new(stale: &StaleSet) -> Self {
        let mut chunks = Vec::new();
        for region in 0..stale.region_count() {
            let pages = stale.region_pages(region);
            let mut first = 0;
            while first < pages {
                let end = (first + CHUNK_PAGES).min(pages);
                if (first..end).any(|page| stale.contains(region, page)) {
                    chunks.push((region, first));
                }
                first = end;
            }
        }
        Self {
            taken: PageBits::new(chunks.len() as u64),
            chunks,
            next: AtomicUsize::new(0),
            hint: AtomicUsize::new(usize::MAX),
        }
    }

    /// The next chunk nobody took: near the hint first, then in order.
    fn take(&self) -> Option<(usize, u64)> {
        let hint = self.hint.swap(usize::MAX, Ordering::AcqRel);
        if hint != usize::MAX {
            for index in hint..(hint + STEER_SPAN).min(self.chunks.len()) {
                if !self.taken.set(index as u64) {
                    self.hint.store(index + 1, Ordering::Release);
                    return Some(self.chunks[index]);
                }
            }
        }
        loop {
            let index = self.next.fetch_add(1, Ordering::AcqRel);
            let chunk = *self.chunks.get(index)?;
            if !self.taken.set(index as u64) {
                return Some(chunk);
            }
        }
    }

    /// Steers the push toward page `page` of region `region`.
    fn steer(&self, region: usize, page: u64) {
        let key = (region, page / CHUNK_PAGES * CHUNK_PAGES);
        let index = self.chunks.partition_point(|&chunk| chunk < key);
        if index < self.chunks.len() {
            self.hint.store(index, Ordering::Release);
        }
    }
}

/// One claim per page and round, shared by the push and the urgent
/// answers: whoever claims a page first sends it, and the other leaves it
/// out. The push claims a chunk's stale pages as it takes the chunk, an
/// answer the pages it is about to write; once claimed, a page is on its
/// way unless the connection breaks, and a broken connection ends the
/// round, after which the destination names again everything it has not
/// placed (`source/recover.rs`), and the next round starts with no claims.
/// The one page sent twice on purpose is a faulting page the push has
/// claimed already: its push copy may be queued behind megabytes on a
/// page channel, and the guest waits for it.
struct Claims {
    regions: Vec<PageBits>,
}

impl Claims {
    fn new(regions: &[MemoryRegion]) -> Self {
        Self {
            regions: regions
                .iter()
                .map(|region| PageBits::new(region.pages()))
                .collect(),
        }
    }

    /// Claims page `page` of region `region`: whether the caller got it
    /// (nobody had claimed it before). Out of range: false.
    fn claim(&self, region: usize, page: u64) -> bool {
        self.regions.get(region).is_some_and(|bits| !bits.set(page))
    }

    /// The answer to a request for `run`: its first page (the faulting
    /// one) whoever claimed it, then the pages after it as long as this
    /// call claims them; the first page the push claimed before ends it
    /// (the answer is one contiguous run, and the push sends the rest of
    /// that chunk). Returns the pages to send and whether the first page
    /// had been claimed before (it goes twice).
    fn claim_answer(&self, region: usize, run: &PageRun) -> (u32, bool) {
        let first = u64::from(run.first_page);
        let resent = !self.claim(region, first);
        let mut pages = 1;
        while pages < run.pages && self.claim(region, first + u64::from(pages)) {
            pages += 1;
        }
        (pages, resent)
    }
}

/// Counters of the source's postcopy.
#[derive(Default)]
pub(super) struct ServeCounters {
    pub requests: AtomicU64,
    pub requested_pages: AtomicU64,
    pub pushed_pages: AtomicU64,
    /// Stale pages the push left out because an urgent answer had claimed
    /// them.
    pub push_skipped_pages: AtomicU64,
    /// Requested pages an answer left out because the push had claimed
    /// them (on their way on a page channel).
    pub answer_skipped_pages: AtomicU64,
    /// Faulting pages answered although the push had claimed them: the
    /// pages the source sent twice.
    pub resent_pages: AtomicU64,
    pub bytes: AtomicU64,
    /// The push's packets: bytes on the wire, and pages sent compressed
    /// and as zero pages.
    pub push_bytes: AtomicU64,
    pub push_compressed_pages: AtomicU64,
    pub push_zero_pages: AtomicU64,
}

impl ServeCounters {
    fn add_push(&self, pushed: &PushedPacket) {
        self.push_bytes
            .fetch_add(pushed.wire_bytes, Ordering::Relaxed);
        self.push_compressed_pages
            .fetch_add(pushed.compressed_pages, Ordering::Relaxed);
        self.push_zero_pages
            .fetch_add(pushed.zero_pages, Ordering::Relaxed);
    }
}

/// Runs the postcopy phase to its end: the destination's completion, or
/// the first failure. Every wait is bounded by `io_timeout` of silence.
pub(super) fn serve(
    main: &mut Channel,
    page_channels: Vec<Channel>,
    frozen: &Frozen<'_>,
    io_timeout: Duration,
    stats: &LiveStats,
    counters: &ServeCounters,
) -> Result<PostcopyComplete, MigrationError> {
    let cursor = ChunkCursor::new(frozen.stale);
    let claims = Claims::new(frozen.regions);
    let checker = ZeroChecker::best();
    let stop = AtomicBool::new(false);
    let failure: Mutex<Option<MigrationError>> = Mutex::new(None);
    let handles: Vec<ShutdownHandle> = page_channels
        .iter()
        .enumerate()
        .map(|(index, channel)| {
            channel
                .shutdown_handle()
                .map_err(MigrationError::channel(index + 1))
        })
        .collect::<Result<_, _>>()?;
    let pushers_left = AtomicUsize::new(page_channels.len());
    std::thread::scope(|scope| {
        for (index, mut channel) in page_channels.into_iter().enumerate() {
            let (cursor, claims, stop, failure, pushers_left) =
                (&cursor, &claims, &stop, &failure, &pushers_left);
            let spawned = std::thread::Builder::new()
                .name(format!("tern-push-{index}"))
                .spawn_scoped(scope, move || {
                    let pusher = Pusher {
                        frozen,
                        cursor,
                        claims,
                        stats,
                        counters,
                    };
                    if let Err(error) = pusher.push(&mut channel, stop) {
                        let error = MigrationError::channel(index + 1)(error);
                        failure
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get_or_insert(error);
                    }
                    pushers_left.fetch_sub(1, Ordering::AcqRel);
                });
            if let Err(error) = spawned {
                failure
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(MigrationError::Thread(error));
                pushers_left.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let answers = Answers {
            frozen,
            cursor: &cursor,
            claims: &claims,
            checker: &checker,
            stats,
            counters,
        };
        let result = answers.run(main, io_timeout, &failure, &pushers_left);
        stop.store(true, Ordering::Release);
        if result.is_err() {
            for handle in &handles {
                handle.shutdown();
            }
        }
        result
    })
}

/// One page channel's background push.
struct Pusher<'a> {
    frozen: &'a Frozen<'a>,
    cursor: &'a ChunkCursor,
    claims: &'a Claims,
    stats: &'a LiveStats,
    counters: &'a ServeCounters,
}

impl Pusher<'_> {
    /// Sends chunks until none is left (or `stop`), then the last sync.
    /// Each chunk's stale pages go as one packet, encoded as precopy
    /// encoded its last pass (zero pages, the codec in force).
    fn push(&self, channel: &mut Channel, stop: &AtomicBool) -> Result<(), ChannelError> {
        let encoder = self.frozen.encoder;
        let mut packet = encoder.batch();
        let mut pages: Vec<u32> = Vec::with_capacity(MAX_PAGES_PER_PACKET);
        while let Some((region, first)) = self.cursor.take() {
            if stop.load(Ordering::Acquire) {
                return Ok(());
            }
            let memory = &self.frozen.regions[region];
            let end = (first + CHUNK_PAGES).min(memory.pages());
            let mut skipped = 0;
            pages.clear();
            for page in (first..end).filter(|&page| self.frozen.stale.contains(region, page)) {
                // Claimed before it is read: an answer that comes later
                // leaves it out, one that came earlier has sent it.
                if !self.claims.claim(region, page) {
                    skipped += 1;
                    continue;
                }
                // Region sizes fit the protocol's 32-bit page indices
                // (checked before the migration starts).
                if let Ok(page) = u32::try_from(page) {
                    pages.push(page);
                }
            }
            self.counters
                .push_skipped_pages
                .fetch_add(skipped, Ordering::Relaxed);
            if pages.is_empty() {
                continue;
            }
            let pushed = encoder.encode(
                &mut packet,
                region,
                self.frozen.iteration,
                pages.iter().copied(),
            );
            encoder.send(&mut packet, channel)?;
            self.stats.add_postcopy_sent(pushed.wire_bytes, true);
            self.counters
                .bytes
                .fetch_add(pushed.wire_bytes, Ordering::Relaxed);
            self.counters.add_push(&pushed);
            self.counters
                .pushed_pages
                .fetch_add(pushed.pages, Ordering::Relaxed);
        }
        let sync = Message::Sync(Sync {
            iteration: self.frozen.iteration,
            last: true,
            dictionaries: 0,
        });
        let sent = channel.send_message_counted(&sync)?;
        self.stats.add_postcopy_sent(sent as u64, true);
        self.counters
            .bytes
            .fetch_add(sent as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// The urgent path: requests in, pages out, on the main channel.
struct Answers<'a> {
    frozen: &'a Frozen<'a>,
    cursor: &'a ChunkCursor,
    claims: &'a Claims,
    checker: &'a ZeroChecker,
    stats: &'a LiveStats,
    counters: &'a ServeCounters,
}

impl Answers<'_> {
    /// Reads requests as they come (all that are ready, up to
    /// [`MAX_PENDING_REQUESTS`]) and answers them in order, until the
    /// destination's completion. Once every pusher has ended, the
    /// completion must come within `io_timeout`.
    fn run(
        &self,
        main: &mut Channel,
        io_timeout: Duration,
        failure: &Mutex<Option<MigrationError>>,
        pushers_left: &AtomicUsize,
    ) -> Result<PostcopyComplete, MigrationError> {
        let mut queue: VecDeque<PageRun> = VecDeque::new();
        let mut pushed_at: Option<Instant> = None;
        loop {
            // Everything that has arrived is read before the next answer:
            // a burst beyond the bound is refused, not left in the socket.
            let mut wait = if queue.is_empty() {
                REQUEST_POLL
            } else {
                Duration::ZERO
            };
            while main.wait_readable(wait).map_err(gone)? {
                let message = main.read_expected(Expected::POSTCOPY).map_err(gone)?;
                if let Some(complete) = self.take_message(message, &mut queue)? {
                    return Ok(complete);
                }
                wait = Duration::ZERO;
            }
            if let Some(run) = queue.pop_front() {
                self.answer(main, run)?;
                continue;
            }
            if let Some(error) = failure.lock().unwrap_or_else(|e| e.into_inner()).take() {
                return Err(error);
            }
            if pushers_left.load(Ordering::Acquire) == 0
                && pushed_at.get_or_insert_with(Instant::now).elapsed() > io_timeout
            {
                return Err(gone(ChannelError::Timeout(
                    "the destination's completion after every page was pushed",
                )));
            }
        }
    }

    /// Queues a request, or returns the completion.
    fn take_message(
        &self,
        message: Message,
        queue: &mut VecDeque<PageRun>,
    ) -> Result<Option<PostcopyComplete>, MigrationError> {
        match message {
            Message::PageRequest(request) => {
                self.check(&request.run)?;
                if queue.len() >= MAX_PENDING_REQUESTS {
                    return Err(MigrationError::Protocol(format!(
                        "the destination sent more than {MAX_PENDING_REQUESTS} page requests \
                         without reading the answers"
                    )));
                }
                self.counters.requests.fetch_add(1, Ordering::Relaxed);
                queue.push_back(request.run);
                Ok(None)
            }
            Message::PostcopyComplete(complete) => Ok(Some(complete)),
            Message::Heartbeat(_) | Message::PassApplied(_) => Ok(None),
            Message::Abort(abort) => Err(MigrationError::from_peer_abort(abort)),
            other => Err(MigrationError::Protocol(format!(
                "unexpected {:?} on the main channel during postcopy",
                other.kind()
            ))),
        }
    }

    /// A request must name guest memory.
    fn check(&self, run: &PageRun) -> Result<usize, MigrationError> {
        let index = self
            .frozen
            .regions
            .iter()
            .position(|region| region.id() == run.region_id)
            .ok_or_else(|| {
                MigrationError::Protocol(format!(
                    "the destination asked for a page of unknown region {}",
                    run.region_id
                ))
            })?;
        let pages = self.frozen.regions[index].pages();
        if run.end() > pages {
            return Err(MigrationError::Protocol(format!(
                "the destination asked for pages {}..{} of region {}, which has {pages}",
                run.first_page,
                run.end(),
                run.region_id
            )));
        }
        Ok(index)
    }

    /// Sends the requested pages from frozen memory: the faulting page
    /// always, its neighbours only while the push has not claimed them
    /// ([`Claims::claim_answer`]).
    fn answer(&self, main: &mut Channel, run: PageRun) -> Result<(), MigrationError> {
        let region = self.check(&run)?;
        let memory = &self.frozen.regions[region];
        let (pages, resent) = self.claims.claim_answer(region, &run);
        let mut zero_mask = 0u32;
        let mut data = Vec::with_capacity(pages as usize * PAGE_SIZE);
        let first = u64::from(run.first_page);
        for (index, page) in (first..first + u64::from(pages)).enumerate() {
            let Some(ptr) = memory.page_ptr(page) else {
                return Err(MigrationError::Internal("a checked page is missing".into()));
            };
            // SAFETY: `page_ptr` checked the page; the guest is paused for
            // good, so its memory is readable and unchanging.
            if unsafe { self.checker.is_zero_page(ptr) } {
                zero_mask |= 1 << index;
            } else {
                // SAFETY: as above; a page of readable memory.
                data.extend_from_slice(unsafe { std::slice::from_raw_parts(ptr, PAGE_SIZE) });
            }
        }
        let urgent = Message::UrgentPages(UrgentPages {
            region_id: run.region_id,
            first_page: run.first_page,
            pages: u16::try_from(pages).unwrap_or(u16::MAX),
            zero_mask,
            data,
        });
        let sent = main.send_message_counted(&urgent).map_err(gone)?;
        self.stats.add_postcopy_sent(sent as u64, false);
        self.counters
            .bytes
            .fetch_add(sent as u64, Ordering::Relaxed);
        self.counters
            .requested_pages
            .fetch_add(u64::from(pages), Ordering::Relaxed);
        self.counters
            .answer_skipped_pages
            .fetch_add(u64::from(run.pages - pages), Ordering::Relaxed);
        if resent {
            self.counters.resent_pages.fetch_add(1, Ordering::Relaxed);
        }
        self.cursor.steer(region, first);
        Ok(())
    }
}

/// A failure of the main channel during postcopy.
fn gone(error: ChannelError) -> MigrationError {
    MigrationError::channel(0)(error)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use tern_wire::{Message, PageRequest, PageRun, PostcopyComplete};

    use tern_page::codec::CodecId;

    use super::{ChunkCursor, Claims, Frozen, MAX_PENDING_REQUESTS, ServeCounters, serve};
    use crate::bitmap::DirtyBitmap;
    use crate::destination::test_memory::AnonymousMemory;
    use crate::error::MigrationError;
    use crate::guest::MemoryRegion;
    use crate::pipeline::PushEncoder;
    use crate::postcopy::StaleSet;
    use crate::stats::LiveStats;
    use crate::transport::Channel;
    use tern_test_skip::wait::{scope_within, wait_until};

    #[test]
    fn the_push_takes_every_chunk_once_and_follows_requests() {
        let mut bitmap = DirtyBitmap::new(1024);
        for page in [0, 130, 300, 600, 1023] {
            bitmap.set(page);
        }
        let cursor = ChunkCursor::new(&StaleSet::from_dirty(&[bitmap]));
        // Chunks of 128 pages holding stale ones: 0, 128, 256, 512, 896.
        assert_eq!(cursor.chunks.len(), 5);
        assert_eq!(cursor.take(), Some((0, 0)));
        // A request at page 600 steers the next chunk there, and the one
        // after follows on.
        cursor.steer(0, 600);
        assert_eq!(cursor.take(), Some((0, 512)));
        assert_eq!(cursor.take(), Some((0, 896)));
        let mut rest = Vec::new();
        while let Some(chunk) = cursor.take() {
            rest.push(chunk);
        }
        assert_eq!(rest, [(0, 128), (0, 256)]);
    }

    /// `pages` pages of sevens in one region, every one stale: the mapping
    /// (kept alive by the caller), its region and the stale set.
    fn every_page_stale(pages: usize) -> (AnonymousMemory, [MemoryRegion; 1], StaleSet) {
        let memory = AnonymousMemory::new(pages);
        // SAFETY: the mapping's pages, nothing else uses them.
        unsafe { memory.base.write_bytes(7, pages * crate::guest::PAGE_SIZE) };
        let regions = [memory.region(1)];
        let mut bitmap = DirtyBitmap::new(pages as u64);
        (0..pages as u64).for_each(|page| bitmap.set(page));
        (memory, regions, StaleSet::from_dirty(&[bitmap]))
    }

    /// Runs `serve` over 64 pages (16 stale) against `peer`, which plays
    /// the destination on the other end of the main channel; the one page
    /// channel's push is read and dropped.
    fn serve_against(
        peer: impl FnOnce(&mut Channel) + Send,
    ) -> (Result<PostcopyComplete, MigrationError>, ServeCounters) {
        let memory = AnonymousMemory::new(64);
        // SAFETY: the mapping's 64 pages, nothing else uses them.
        unsafe { memory.base.write_bytes(7, 8 * crate::guest::PAGE_SIZE) };
        let regions = [memory.region(1)];
        let mut bitmap = DirtyBitmap::new(64);
        (0..16).for_each(|page| bitmap.set(page * 4));
        let stale = StaleSet::from_dirty(&[bitmap]);
        let encoder = PushEncoder::for_tests(&regions, CodecId::None);
        let frozen = Frozen {
            regions: &regions,
            stale: &stale,
            iteration: 3,
            encoder: &encoder,
        };
        let (mut main, mut their_main) = Channel::pair();
        let (push, mut their_push) = Channel::pair();
        let stats = LiveStats::new();
        let counters = ServeCounters::default();
        let result = scope_within("serve ends", |scope| {
            scope.spawn(move || {
                let mut sink = vec![0u8; 1 << 20];
                while their_push.read_exact(&mut sink[..4096]).is_ok() {}
            });
            scope.spawn(move || peer(&mut their_main));
            serve(
                &mut main,
                vec![push],
                &frozen,
                Duration::from_secs(5),
                &stats,
                &counters,
            )
        });
        (result, counters)
    }

    fn request(first_page: u32, pages: u32) -> Message {
        Message::PageRequest(PageRequest {
            run: PageRun {
                region_id: 1,
                first_page,
                pages,
            },
        })
    }

    #[test]
    fn requests_are_answered_until_the_destination_completes() {
        let (result, counters) = serve_against(|peer| {
            peer.send_message(&request(0, 2)).unwrap();
            match peer.read_message().unwrap() {
                Message::UrgentPages(urgent) => {
                    assert_eq!(
                        (urgent.first_page, urgent.pages, urgent.zero_mask),
                        (0, 2, 0)
                    );
                    assert!(urgent.data.iter().all(|&byte| byte == 7));
                }
                other => panic!("{other:?}"),
            }
            peer.send_message(&complete(2, 16)).unwrap();
        });
        assert_eq!(result.unwrap().digest, 5);
        assert_eq!(
            counters.requests.load(std::sync::atomic::Ordering::Relaxed),
            1
        );
    }

    /// The destination's end of postcopy, digest 5, after one fault.
    fn complete(requested_pages: u64, pushed_pages: u64) -> Message {
        Message::PostcopyComplete(PostcopyComplete {
            digest: 5,
            requested_pages,
            pushed_pages,
            faults: 1,
            blocktime_micros: 10,
            delivered_micros: 100,
            latency_histogram: vec![0; tern_wire::LATENCY_BUCKETS],
        })
    }

    /// The push leaves out the pages an urgent answer sent before it took
    /// their chunk: 4096 stale pages of data, a push channel nobody reads
    /// until the answer to a request in chunk 20 has arrived (the pusher is
    /// stuck in its first chunk meanwhile), then read to its end.
    #[test]
    fn the_push_skips_pages_already_sent_as_urgent_answers() {
        const PAGES: usize = 4096;
        let (_memory, regions, stale) = every_page_stale(PAGES);
        let encoder = PushEncoder::for_tests(&regions, CodecId::None);
        let frozen = Frozen {
            regions: &regions,
            stale: &stale,
            iteration: 3,
            encoder: &encoder,
        };
        let (mut main, mut their_main) = Channel::pair();
        let (mut push, mut their_push) = Channel::pair();
        // The pusher waits in its first send until the answer has come.
        for channel in [&mut main, &mut their_main, &mut push, &mut their_push] {
            channel.set_timeouts(Duration::from_secs(60)).unwrap();
        }
        let stats = LiveStats::new();
        let counters = ServeCounters::default();
        let answered = AtomicBool::new(false);
        let result = scope_within("serve ends", |scope| {
            let (answered, counters) = (&answered, &counters);
            scope.spawn(move || {
                wait_until("the answer arrived", || answered.load(Ordering::Acquire));
                let mut sink = vec![0u8; 1 << 20];
                while their_push.read_exact(&mut sink[..4096]).is_ok() {}
            });
            scope.spawn(move || {
                let first = 20 * 128;
                their_main.send_message(&request(first, 8)).unwrap();
                match their_main.read_message().unwrap() {
                    Message::UrgentPages(urgent) => assert_eq!(urgent.first_page, first),
                    other => panic!("{other:?}"),
                }
                answered.store(true, Ordering::Release);
                wait_until("the push went through every stale page", || {
                    counters.pushed_pages.load(Ordering::Acquire)
                        + counters.push_skipped_pages.load(Ordering::Acquire)
                        >= PAGES as u64
                });
                their_main
                    .send_message(&complete(8, PAGES as u64 - 8))
                    .unwrap();
            });
            serve(
                &mut main,
                vec![push],
                &frozen,
                Duration::from_secs(60),
                &stats,
                counters,
            )
        });
        assert_eq!(result.unwrap().digest, 5);
        assert_eq!(counters.push_skipped_pages.load(Ordering::Relaxed), 8);
        assert_eq!(
            counters.pushed_pages.load(Ordering::Relaxed),
            PAGES as u64 - 8
        );
    }

    /// An answer sends the faulting page even when the push has taken it,
    /// and none of its neighbours that the push has taken: 4096 stale
    /// pages, a push stuck in its first chunk (pages 0..128, claimed) while
    /// the destination asks for 8 pages from page 5 (one goes: the
    /// faulting page) and for 8 pages of chunk 20 (all go, and the push
    /// leaves them out).
    #[test]
    fn an_answer_leaves_out_the_neighbours_the_push_has_taken() {
        const PAGES: usize = 4096;
        let (_memory, regions, stale) = every_page_stale(PAGES);
        let encoder = PushEncoder::for_tests(&regions, CodecId::None);
        let frozen = Frozen {
            regions: &regions,
            stale: &stale,
            iteration: 3,
            encoder: &encoder,
        };
        let (mut main, mut their_main) = Channel::pair();
        let (mut push, mut their_push) = Channel::pair();
        for channel in [&mut main, &mut their_main, &mut push, &mut their_push] {
            channel.set_timeouts(Duration::from_secs(60)).unwrap();
        }
        let stats = LiveStats::new();
        let counters = ServeCounters::default();
        let (pushing, answered) = (AtomicBool::new(false), AtomicBool::new(false));
        let result = scope_within("serve ends", |scope| {
            let (pushing, answered, counters) = (&pushing, &answered, &counters);
            scope.spawn(move || {
                let mut sink = vec![0u8; 1 << 20];
                // The first bytes of chunk 0: the push claimed it whole
                // before it wrote any, and now waits in that write.
                their_push.read_exact(&mut sink[..4096]).unwrap();
                pushing.store(true, Ordering::Release);
                wait_until("the answers arrived", || answered.load(Ordering::Acquire));
                while their_push.read_exact(&mut sink[..4096]).is_ok() {}
            });
            scope.spawn(move || {
                wait_until("the push took chunk 0", || pushing.load(Ordering::Acquire));
                for (first, expected) in [(5, 1), (20 * 128, 8)] {
                    their_main.send_message(&request(first, 8)).unwrap();
                    match their_main.read_message().unwrap() {
                        Message::UrgentPages(urgent) => {
                            assert_eq!((urgent.first_page, urgent.pages), (first, expected));
                            assert!(urgent.data.iter().all(|&byte| byte == 7));
                        }
                        other => panic!("{other:?}"),
                    }
                }
                answered.store(true, Ordering::Release);
                wait_until("the push went through every stale page", || {
                    counters.pushed_pages.load(Ordering::Acquire)
                        + counters.push_skipped_pages.load(Ordering::Acquire)
                        >= PAGES as u64
                });
                their_main
                    .send_message(&complete(9, PAGES as u64 - 8))
                    .unwrap();
            });
            serve(
                &mut main,
                vec![push],
                &frozen,
                Duration::from_secs(60),
                &stats,
                counters,
            )
        });
        assert_eq!(result.unwrap().digest, 5);
        let count = |counter: &std::sync::atomic::AtomicU64| counter.load(Ordering::Relaxed);
        assert_eq!(count(&counters.requested_pages), 9);
        assert_eq!(count(&counters.answer_skipped_pages), 7);
        assert_eq!(count(&counters.resent_pages), 1, "page 5 went twice");
        assert_eq!(count(&counters.push_skipped_pages), 8);
        assert_eq!(count(&counters.pushed_pages), PAGES as u64 - 8);
    }

    #[test]
    fn claims_go_to_whoever_comes_first_and_an_answer_keeps_its_first_page() {
        let memory = AnonymousMemory::new(64);
        let claims = Claims::new(&[memory.region(1)]);
        let run = |first_page, pages| PageRun {
            region_id: 1,
            first_page,
            pages,
        };
        // The push took pages 8..16.
        assert!((8..16).all(|page| claims.claim(0, page)));
        assert!(!claims.claim(0, 8) && !claims.claim(0, 70));
        // Nothing taken: the whole run.
        assert_eq!(claims.claim_answer(0, &run(0, 4)), (4, false));
        // Up to the first page the push took.
        assert_eq!(claims.claim_answer(0, &run(4, 8)), (4, false));
        // The faulting page itself taken: it goes anyway, alone.
        assert_eq!(claims.claim_answer(0, &run(10, 8)), (1, true));
        // A page taken by an answer is left out of the push, and the pages
        // the answer did not reach are still free.
        assert!(!claims.claim(0, 3));
        assert!(claims.claim(0, 16));
    }

    #[test]
    fn a_request_outside_guest_memory_fails_with_a_clear_error() {
        let (result, _) = serve_against(|peer| {
            peer.send_message(&request(60, 8)).unwrap();
        });
        let error = result.unwrap_err().to_string();
        assert!(
            error.contains("pages 60..68 of region 1, which has 64"),
            "{error}"
        );
    }

    #[test]
    fn a_request_flood_fails_instead_of_queueing_without_end() {
        let (result, _) = serve_against(|peer| {
            let mut burst = Vec::new();
            for _ in 0..MAX_PENDING_REQUESTS + 10 {
                request(0, 1).encode(&mut burst);
            }
            // Sent in one write and never read back: the source reads
            // them all before it could answer.
            let _ = peer.write_all(&burst);
        });
        let error = result.unwrap_err().to_string();
        assert!(error.contains("more than 4096 page requests"), "{error}");
    }

    #[test]
    fn a_destination_that_dies_ends_postcopy_with_a_channel_error() {
        let (result, _) = serve_against(|peer| {
            peer.send_message(&request(4, 1)).unwrap();
            peer.shutdown();
        });
        match result {
            Err(MigrationError::Channel { index: 0, .. }) => {}
            other => panic!("{other:?}"),
        }
    }
}

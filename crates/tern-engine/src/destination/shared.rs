//! What the destination's threads share during the live phase: the
//! session, per-page bookkeeping, the iteration barrier and the first
//! failure.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use tern_page::codec::{CodecDictionary, QplPath};
use tern_wire::{DigestAlgorithm, PassApplied, SessionSetup, Sync};

use super::dictionary::SessionDictionaries;
use super::handle::PassReporter;
use super::landing_pool::DecodePool;
use super::live_figures::lag_micros;
use super::stream::FrameSource;
use super::userfault::Userfault;
use super::{POLL_INTERVAL, ReceiveStats};
use crate::control::EventHub;
use crate::digest::PageHashes;
use crate::error::{ChannelError, MigrationError};
use crate::guest::MemoryRegion;
use crate::source::CancelToken;

pub(super) struct ReceiverShared<'a> {
    pub(super) setup: &'a SessionSetup,
    /// The guest's regions, in the setup's order.
    pub(super) regions: &'a [MemoryRegion],
    /// Pages that hold received data: a zero page must be written only over
    /// these (other pages are still fresh zero memory, and touching them
    /// would cost a page fault for nothing).
    pub(super) populated: Vec<AtomicBitmap>,
    /// The incremental digest: the hash of each page read back from guest
    /// memory right after each write, and audited against memory while
    /// pages arrive, so that the digest at the end costs no second pass over
    /// memory. `None` when the session does not verify.
    pub(super) page_hashes: Option<PageHashes>,
    /// The pages written in the current iteration, on any channel. A
    /// receiver claims every page of a packet here before any byte of the
    /// packet reaches guest memory, and the claims are released only at the
    /// iteration's barrier, when no receiver writes. So each page has at
    /// most one writer per iteration, which the `readv` into guest memory
    /// and the decompression into a page rely on; a page claimed twice is
    /// the peer's protocol error.
    claims: Vec<AtomicBitmap>,
    /// The decoder threads' rings and each receiver's packet buffers.
    pub(super) pool: DecodePool,
    /// Whether runs of fresh pages are populated before they are written
    /// (`populate.rs`); turned off for the session when the kernel refuses.
    pub(super) populate: AtomicBool,
    /// Fresh pages are placed whole with `UFFDIO_COPY` (`userfault.rs`)
    /// while this is set: from [`ReceiverShared::with_userfault`] until
    /// [`ReceiverShared::release_userfault`].
    pub(super) userfault: Option<Userfault>,
    /// The pages a duplicate read in the current iteration without having
    /// written them: no packet may write them until the barrier (see
    /// `reference`). Cleared with the claims.
    referenced: Vec<AtomicBitmap>,
    barrier: SyncBarrier,
    /// The iteration the source's `Complete` names as final, once the main
    /// channel has it; [`NO_FINAL_ITERATION`] before.
    final_iteration: AtomicU64,
    /// Every page channel has passed its last sync: only the main channel
    /// has more to say.
    pages_ended: AtomicBool,
    /// Passes every receiver has ended, their pages in memory (high 32
    /// bits), and the latest one's lag behind the link in microseconds
    /// (low 32): what the main channel tells the source (`PassApplied`),
    /// in one word so the two always belong together.
    last_pass_applied: AtomicU64,
    failed: AtomicBool,
    /// The first failure; later ones are its consequences. Taken once per
    /// failure, never on the per-page path.
    first_failure: Mutex<Option<MigrationError>>,
    pub(super) stats: &'a ReceiveStats,
    /// Where deflate pages are inflated: IAA through QPL or libdeflate
    /// (`ReceiveConfig::qpl_path`).
    pub(super) qpl_path: QplPath,
    /// The session's compression dictionaries (`dictionary.rs`).
    pub(super) dictionaries: SessionDictionaries,
    io_timeout: Duration,
    pub(super) cancel: &'a CancelToken,
    /// Tells the destination's watchers each iteration's figures
    /// (`MIGRATION_PASS`), when the session has watchers to tell.
    passes: Option<PassReporter<'a>>,
}

impl<'a> ReceiverShared<'a> {
    /// Shared state for `receivers` page channels of a session whose
    /// regions `check_layout` matched with the setup's.
    pub(super) fn new(
        setup: &'a SessionSetup,
        regions: &'a [MemoryRegion],
        receivers: usize,
        stats: &'a ReceiveStats,
        io_timeout: Duration,
        cancel: &'a CancelToken,
    ) -> Self {
        Self {
            setup,
            regions,
            populated: regions
                .iter()
                .map(|region| AtomicBitmap::new(region.pages()))
                .collect(),
            page_hashes: (setup.digest != DigestAlgorithm::None)
                .then(|| PageHashes::new(regions, false)),
            claims: regions
                .iter()
                .map(|region| AtomicBitmap::new(region.pages()))
                .collect(),
            pool: DecodePool::new(receivers, 0),
            populate: AtomicBool::new(true),
            userfault: None,
            referenced: regions
                .iter()
                .map(|region| AtomicBitmap::new(region.pages()))
                .collect(),
            barrier: SyncBarrier::new(receivers),
            final_iteration: AtomicU64::new(NO_FINAL_ITERATION),
            pages_ended: AtomicBool::new(false),
            last_pass_applied: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            first_failure: Mutex::new(None),
            stats,
            qpl_path: QplPath::Auto,
            dictionaries: SessionDictionaries::new(Vec::new()),
            io_timeout,
            cancel,
            passes: None,
        }
    }

    /// Publishes a `MIGRATION_PASS` event on `events` as each iteration's
    /// barrier releases, with what the iteration brought.
    pub(super) fn with_pass_events(mut self, events: &'a EventHub) -> Self {
        self.passes = Some(PassReporter::new(events, self.stats));
        self
    }

    /// Decodes packets that name one of `dictionaries`.
    pub(super) fn with_dictionaries(mut self, dictionaries: Vec<CodecDictionary>) -> Self {
        self.dictionaries = SessionDictionaries::new(dictionaries);
        self
    }

    /// Inflates deflate pages as `path` says (IAA when allowed and present).
    pub(super) fn with_qpl_path(mut self, path: QplPath) -> Self {
        self.qpl_path = path;
        self
    }

    /// Decodes with `threads` decoder threads (0, the default: each
    /// receiver decodes its own packets). A session that announced no
    /// codec has nothing to decompress, and gets none.
    pub(super) fn with_decode_threads(mut self, threads: usize) -> Self {
        let threads = if self.setup.codecs == 0 { 0 } else { threads };
        self.pool = DecodePool::new(self.barrier.parties, threads);
        self
    }

    /// Places fresh pages with `UFFDIO_COPY` when this process may register
    /// the guest's memory with a userfaultfd; faults them in otherwise.
    pub(super) fn with_userfault(mut self) -> Self {
        match Userfault::register(self.regions) {
            Ok(userfault) => self.userfault = Some(userfault),
            Err(error) => {
                tracing::info!(%error, "no userfaultfd: fresh pages fault in on first write");
            }
        }
        self
    }

    /// Ends the userfaultfd registration, if any: afterwards every page of
    /// guest memory may be touched as usual.
    pub(super) fn release_userfault(&self) {
        if let Some(userfault) = &self.userfault {
            userfault.release();
        }
    }

    /// Claims `page` of region `region` (an index into the setup's regions)
    /// for the caller's writes in the current iteration; false when another
    /// packet of this iteration, on any channel, has it already.
    ///
    /// A page a duplicate read in this iteration cannot be claimed: the
    /// claim is set before the reference bit is read, and `reference` sets
    /// its bit before reading the claim, both sequentially consistent, so of
    /// a racing write and read at least one sees the other.
    pub(super) fn claim(&self, region: usize, page: u64) -> bool {
        self.claims[region].claim(page) && !self.referenced[region].get_seq(page)
    }

    /// Marks `page` of region `region` as read by a duplicate in the
    /// current iteration; false when a packet of this iteration claimed it
    /// (the caller must then have written it itself, earlier).
    pub(super) fn reference(&self, region: usize, page: u64) -> bool {
        self.referenced[region].set_seq(page);
        !self.claims[region].get_seq(page)
    }

    /// Ends iteration `iteration` for the caller: waits until the main
    /// channel has delivered the dictionaries the sync counts, then until
    /// every receiver has ended the iteration; the last one releases the
    /// iteration's page claims and puts those dictionaries in force. Every
    /// receiver must agree on whether it was the last and on the count.
    pub(super) fn end_iteration(&self, iteration: u32, sync: Sync) -> Result<(), MigrationError> {
        self.dictionaries
            .wait_for(sync.dictionaries, Instant::now() + self.io_timeout, || {
                self.check_failed()
            })?;
        let vote = SyncVote {
            last: sync.last,
            dictionaries: sync.dictionaries,
        };
        self.barrier
            .wait(vote, |agreed| {
                for claims in self.claims.iter().chain(&self.referenced) {
                    claims.clear_all();
                }
                self.dictionaries.put_in_force(sync.dictionaries);
                // Every receiver is in the barrier: the counters hold this
                // iteration's pages and none of the next one's.
                if agreed {
                    let lag = self.stats.lag.take_pass_lag(Instant::now());
                    let applied = iteration.saturating_add(1);
                    let word = u64::from(applied) << 32 | u64::from(lag_micros(lag));
                    self.last_pass_applied.store(word, Ordering::Release);
                    if let Some(passes) = &self.passes {
                        passes.report(u64::from(iteration) + 1, self.stats);
                    }
                }
            })
            .map_err(|error| match error {
                BarrierError::Aborted => MigrationError::Internal("another channel failed".into()),
                BarrierError::Disagreement => MigrationError::Protocol(format!(
                    "the page channels disagree on whether iteration {iteration} is the last, \
                     or on the dictionaries in force after it"
                )),
            })?;
        if sync.last {
            self.pages_ended.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Passes every receiver has ended, their pages in guest memory, and
    /// the latest one's lag behind the link.
    pub(super) fn last_pass_applied(&self) -> PassApplied {
        let word = self.last_pass_applied.load(Ordering::Acquire);
        let half = |bits: u64| u32::try_from(bits & u64::from(u32::MAX)).unwrap_or(u32::MAX);
        PassApplied {
            passes: half(word >> 32),
            lag_micros: half(word),
        }
    }

    /// Whether every page channel has passed its last sync.
    pub(super) fn pages_ended(&self) -> bool {
        self.pages_ended.load(Ordering::Acquire)
    }

    /// The longest silence tolerated from the source on any channel.
    pub(super) fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// Records the final iteration the source's `Complete` names, so that
    /// the receivers refuse anything beyond it.
    pub(super) fn set_final_iteration(&self, iteration: u32) {
        self.final_iteration
            .store(u64::from(iteration), Ordering::Release);
    }

    /// The final iteration the source named, if its `Complete` came.
    pub(super) fn final_iteration(&self) -> Option<u32> {
        u32::try_from(self.final_iteration.load(Ordering::Acquire)).ok()
    }

    /// Records `error` if it is the first failure, and stops everyone.
    pub(super) fn fail(&self, error: MigrationError) {
        {
            let mut slot = self.first_failure.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_none() {
                *slot = Some(error);
            }
        }
        self.stop();
    }

    /// Runs a receive thread's `body` (a receiver, decoder, auditor or the
    /// fault server); a panic in it fails the migration with the panic's
    /// message, and `None` stands for the body's result. The main channel's
    /// wait has no deadline of its own while page channels are open (their
    /// receivers time out on a silent source), so a receiver that was gone
    /// without a word left it waiting for as long as the source kept the
    /// main channel alive.
    pub(super) fn failing_on_panic<T>(&self, thread: &str, body: impl FnOnce() -> T) -> Option<T> {
        crate::error::catching_panic(body)
            .map_err(|message| {
                self.fail(MigrationError::Internal(format!(
                    "the destination's {thread} thread panicked: {message}"
                )));
            })
            .ok()
    }

    /// Records `error` as the cause, replacing what was recorded.
    pub(super) fn fail_first(&self, error: MigrationError) {
        *self.first_failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
        self.stop();
    }

    fn stop(&self) {
        self.failed.store(true, Ordering::Release);
        self.barrier.abort();
    }

    pub(super) fn first_failure(&self) -> Option<MigrationError> {
        self.first_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Whether the first failure is the peer breaking the protocol, which
    /// this side found itself (so no abort from the peer will explain it).
    pub(super) fn failed_on_protocol(&self) -> bool {
        let failure = self.first_failure.lock().unwrap_or_else(|e| e.into_inner());
        matches!(
            *failure,
            Some(MigrationError::Protocol(_))
                | Some(MigrationError::Channel {
                    source: ChannelError::Protocol(_),
                    ..
                })
        )
    }

    pub(super) fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire) || self.cancel.is_cancelled()
    }

    /// An error when the migration has failed or was cancelled.
    pub(super) fn check_failed(&self) -> Result<(), MigrationError> {
        if !self.failed() {
            Ok(())
        } else if self.cancel.is_cancelled() {
            Err(MigrationError::Cancelled)
        } else {
            Err(MigrationError::Internal("another channel failed".into()))
        }
    }

    /// Waits for data, looking at the failure flag meanwhile.
    pub(super) fn wait_for_data(
        &self,
        channel: &impl FrameSource,
        index: usize,
    ) -> Result<(), MigrationError> {
        let started = Instant::now();
        loop {
            self.check_failed()?;
            if channel
                .wait_readable(POLL_INTERVAL)
                .map_err(MigrationError::channel(index))?
            {
                return Ok(());
            }
            if started.elapsed() > self.io_timeout {
                return Err(MigrationError::Channel {
                    index,
                    source: ChannelError::Timeout("data from the source"),
                });
            }
        }
    }
}

/// [`ReceiverShared::final_iteration`] before the source names it.
const NO_FINAL_ITERATION: u64 = u64::MAX;

/// A bitmap threads update concurrently without locks.
pub(super) struct AtomicBitmap {
    words: Vec<AtomicU64>,
}

impl AtomicBitmap {
    fn new(pages: u64) -> Self {
        Self {
            words: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub(super) fn set(&self, page: u64) {
        if let Some(word) = self.words.get((page / 64) as usize) {
            word.fetch_or(1 << (page % 64), Ordering::Relaxed);
        }
    }

    pub(super) fn clear(&self, page: u64) {
        if let Some(word) = self.words.get((page / 64) as usize) {
            word.fetch_and(!(1 << (page % 64)), Ordering::Relaxed);
        }
    }

    /// Sets `page`'s bit; true if it was clear, that is if this call
    /// claimed the page. One atomic read-modify-write, so of two threads
    /// claiming the same page exactly one wins; sequentially consistent, for
    /// the claim/reference handshake of `ReceiverShared::claim`.
    fn claim(&self, page: u64) -> bool {
        let bit = 1 << (page % 64);
        self.words
            .get((page / 64) as usize)
            .is_some_and(|word| word.fetch_or(bit, Ordering::SeqCst) & bit == 0)
    }

    fn set_seq(&self, page: u64) {
        if let Some(word) = self.words.get((page / 64) as usize) {
            word.fetch_or(1 << (page % 64), Ordering::SeqCst);
        }
    }

    fn get_seq(&self, page: u64) -> bool {
        self.words
            .get((page / 64) as usize)
            .is_some_and(|word| word.load(Ordering::SeqCst) & (1 << (page % 64)) != 0)
    }

    /// Clears every bit. Called only while no thread claims (inside the
    /// barrier, by its last arrival), so plain stores suffice; the barrier's
    /// mutex orders them before the next iteration's claims.
    fn clear_all(&self) {
        for word in &self.words {
            word.store(0, Ordering::Relaxed);
        }
    }

    pub(super) fn get(&self, page: u64) -> bool {
        self.words
            .get((page / 64) as usize)
            .is_some_and(|word| word.load(Ordering::Relaxed) & (1 << (page % 64)) != 0)
    }
}

/// The per-iteration barrier between receivers. It can be aborted, so a
/// failed channel never leaves the others waiting forever. It is crossed
/// once per iteration, not per page, so a mutex is fine here.
pub(super) struct SyncBarrier {
    parties: usize,
    state: Mutex<BarrierState>,
    condvar: Condvar,
    aborted: AtomicBool,
}

/// What each receiver's sync said; all must say the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SyncVote {
    pub(super) last: bool,
    pub(super) dictionaries: u8,
}

#[derive(Default)]
struct BarrierState {
    /// Parties waiting in the current generation.
    arrived: usize,
    /// The first party's vote in this generation.
    vote: Option<SyncVote>,
    /// Whether a later party voted otherwise.
    differs: bool,
    /// Generations completed.
    generation: u64,
    /// Whether the parties of the generation completed last agreed;
    /// stays valid until all of them have left, since the next
    /// generation cannot complete without each of them.
    agreed: bool,
}

/// Why [`SyncBarrier::wait`] did not pass.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum BarrierError {
    /// Another thread failed.
    Aborted,
    /// Some parties' syncs said otherwise than others'.
    Disagreement,
}

impl SyncBarrier {
    pub(super) fn new(parties: usize) -> Self {
        Self {
            parties,
            state: Mutex::new(BarrierState::default()),
            condvar: Condvar::new(),
            aborted: AtomicBool::new(false),
        }
    }

    pub(super) fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        self.condvar.notify_all();
    }

    /// Waits for every party. The last to arrive runs `release` before
    /// letting the others go, while all of them are inside the barrier.
    /// `release` is told whether every party voted alike.
    pub(super) fn wait(
        &self,
        vote: SyncVote,
        release: impl FnOnce(bool),
    ) -> Result<(), BarrierError> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = state.generation;
        state.arrived += 1;
        let first = *state.vote.get_or_insert(vote);
        state.differs |= first != vote;
        if state.arrived == self.parties {
            release(!state.differs);
            state.agreed = !state.differs;
            state.arrived = 0;
            state.vote = None;
            state.differs = false;
            state.generation += 1;
            self.condvar.notify_all();
        }
        while state.generation == generation {
            if self.aborted.load(Ordering::Acquire) {
                return Err(BarrierError::Aborted);
            }
            state = self
                .condvar
                .wait_timeout(state, POLL_INTERVAL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        if state.agreed {
            Ok(())
        } else {
            Err(BarrierError::Disagreement)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tern_test_skip::wait::scope_within;

    #[test]
    fn a_claimed_page_cannot_be_claimed_again_until_cleared() {
        let claims = AtomicBitmap::new(130);
        assert!(claims.claim(129));
        assert!(!claims.claim(129));
        assert!(claims.claim(0));
        claims.clear_all();
        assert!(claims.claim(129));
    }

    #[test]
    fn of_two_threads_claiming_the_same_pages_each_page_goes_to_one() {
        let claims = AtomicBitmap::new(4096);
        let won: Vec<u64> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| (0..4096).filter(|&page| claims.claim(page)).count() as u64)
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(won.iter().sum::<u64>(), 4096);
    }

    /// A zero page received over a populated page clears its bit alone:
    /// the other pages of its word, and those of the next word, keep
    /// theirs; a page past the bitmap's last word changes nothing.
    #[test]
    fn clearing_a_page_leaves_every_other_page_as_it_was() {
        let bitmap = AtomicBitmap::new(130);
        for page in [0, 1, 63, 64, 65, 129] {
            bitmap.set(page);
        }
        bitmap.clear(64);
        bitmap.clear(1);
        bitmap.set(192);
        bitmap.clear(200);
        let set: Vec<u64> = (0..256).filter(|&page| bitmap.get(page)).collect();
        assert_eq!(set, [0, 63, 65, 129]);
    }

    /// In one iteration a page is either written by a packet (claimed) or
    /// read by duplicates (referenced), never both: a duplicate of a page
    /// another channel is writing would copy half-written bytes, and a
    /// packet over a page a duplicate read would change what it copied.
    #[test]
    fn a_page_is_either_claimed_for_writing_or_read_by_duplicates_in_one_iteration() {
        let memory = crate::destination::test_memory::AnonymousMemory::new(4);
        let regions = [memory.region(1)];
        let setup = memory.setup(1);
        let stats = ReceiveStats::default();
        let cancel = CancelToken::new();
        let shared =
            ReceiverShared::new(&setup, &regions, 1, &stats, Duration::from_secs(1), &cancel);
        assert!(shared.claim(0, 0), "a fresh page is claimed");
        assert!(
            !shared.reference(0, 0),
            "a claimed page is read by a duplicate"
        );
        assert!(
            shared.reference(0, 1),
            "a fresh page is not read by a duplicate"
        );
        assert!(shared.reference(0, 1), "a page two duplicates read");
        assert!(!shared.claim(0, 1), "a page duplicates read is claimed");
        assert!(shared.claim(0, 2), "a page beside them is not claimed");
    }

    /// Runs `parties` threads through one barrier generation, each saying
    /// whether its sync was the last; returns each one's result and how
    /// often the release ran.
    fn cross(lasts: &[bool]) -> (Vec<Result<(), BarrierError>>, usize) {
        let votes: Vec<SyncVote> = lasts
            .iter()
            .map(|&last| SyncVote {
                last,
                dictionaries: 1,
            })
            .collect();
        cross_votes(&votes)
    }

    fn cross_votes(votes: &[SyncVote]) -> (Vec<Result<(), BarrierError>>, usize) {
        let barrier = SyncBarrier::new(votes.len());
        let released = AtomicU64::new(0);
        let results = scope_within("the barrier lets every party go", |scope| {
            let handles: Vec<_> = votes
                .iter()
                .map(|&last| {
                    let barrier = &barrier;
                    let released = &released;
                    scope.spawn(move || {
                        barrier.wait(last, |_| {
                            released.fetch_add(1, Ordering::Relaxed);
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        (
            results,
            usize::try_from(released.load(Ordering::Relaxed)).unwrap(),
        )
    }

    #[test]
    fn the_barrier_passes_when_all_agree_and_releases_once() {
        for lasts in [[false, false, false], [true, true, true]] {
            let (results, released) = cross(&lasts);
            assert!(results.iter().all(Result::is_ok), "{lasts:?}: {results:?}");
            assert_eq!(released, 1);
        }
    }

    #[test]
    fn the_barrier_refuses_parties_that_disagree_on_the_last() {
        let (results, _) = cross(&[true, false, false]);
        assert!(
            results
                .iter()
                .all(|result| *result == Err(BarrierError::Disagreement)),
            "{results:?}"
        );
    }

    #[test]
    fn the_barrier_refuses_parties_that_disagree_on_the_dictionaries() {
        let vote = |dictionaries| SyncVote {
            last: false,
            dictionaries,
        };
        let (results, _) = cross_votes(&[vote(2), vote(2), vote(3)]);
        assert!(
            results
                .iter()
                .all(|result| *result == Err(BarrierError::Disagreement)),
            "{results:?}"
        );
        let (results, _) = cross_votes(&[vote(3), vote(3)]);
        assert!(results.iter().all(Result::is_ok), "{results:?}");
    }
}

//! What the destination's threads share during the live phase: the
//! session, per-page bookkeeping, the iteration barrier and the first
//! failure.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use tern_wire::{DigestAlgorithm, SessionSetup};

use super::stream::FrameSource;
use super::{POLL_INTERVAL, ReceiveStats};
use crate::digest::zero_page_hash;
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
    /// The hash of each page as written, read back from guest memory right
    /// after each write, so that the digest at the end costs no second pass
    /// over memory. `None` when the session does not verify.
    pub(super) page_hashes: Option<Vec<Vec<AtomicU64>>>,
    pub(super) barrier: SyncBarrier,
    failed: AtomicBool,
    /// The first failure; later ones are its consequences. Taken once per
    /// failure, never on the per-page path.
    first_failure: Mutex<Option<MigrationError>>,
    pub(super) stats: &'a ReceiveStats,
    io_timeout: Duration,
    pub(super) cancel: &'a CancelToken,
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
            page_hashes: (setup.digest != DigestAlgorithm::None).then(|| {
                regions
                    .iter()
                    .map(|region| {
                        (0..region.pages())
                            .map(|_| AtomicU64::new(zero_page_hash()))
                            .collect()
                    })
                    .collect()
            }),
            barrier: SyncBarrier::new(receivers),
            failed: AtomicBool::new(false),
            first_failure: Mutex::new(None),
            stats,
            io_timeout,
            cancel,
        }
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

    pub(super) fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire) || self.cancel.is_cancelled()
    }

    /// Waits for data, looking at the failure flag meanwhile.
    pub(super) fn wait_for_data(
        &self,
        channel: &impl FrameSource,
        index: usize,
    ) -> Result<(), MigrationError> {
        let started = Instant::now();
        loop {
            if self.failed() {
                return Err(if self.cancel.is_cancelled() {
                    MigrationError::Cancelled
                } else {
                    MigrationError::Internal("another channel failed".into())
                });
            }
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
    state: Mutex<(usize, u64)>,
    condvar: Condvar,
    aborted: AtomicBool,
}

impl SyncBarrier {
    fn new(parties: usize) -> Self {
        Self {
            parties,
            state: Mutex::new((0, 0)),
            condvar: Condvar::new(),
            aborted: AtomicBool::new(false),
        }
    }

    fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        self.condvar.notify_all();
    }

    pub(super) fn wait(&self) -> Result<(), MigrationError> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = state.1;
        state.0 += 1;
        if state.0 == self.parties {
            state.0 = 0;
            state.1 += 1;
            self.condvar.notify_all();
            return Ok(());
        }
        while state.1 == generation {
            if self.aborted.load(Ordering::Acquire) {
                return Err(MigrationError::Internal("another channel failed".into()));
            }
            state = self
                .condvar
                .wait_timeout(state, POLL_INTERVAL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }
}

//! Shared memory state (mapping, atomic dirty bitmap) and the dirtier threads
//! that write guest memory the way a running guest would.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering, fence};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tern_engine::{DirtyBitmap, GuestError, GuestResult, PAGE_SIZE};

use crate::mapping::Mapping;
use crate::state::{CREDIT_PER_PAGE, DirtierConfig, ThreadState};

/// How often a dirtier thread wakes to write the pages that became due.
const SLICE: Duration = Duration::from_millis(1);
/// Longest gap credited at once: after a stall (an overloaded machine, a
/// stopped process) the dirtier resumes its rate instead of writing a burst.
const MAX_CATCH_UP: Duration = Duration::from_millis(20);
/// Bytes written per dirtying step: small, so a dirtied page stays mostly
/// what it was (as in a real guest) but still changes.
const WRITE_BYTES: u64 = 64;
/// The 64-bit words of one write.
const WRITE_WORDS: usize = 8;
const _: () = assert!(WRITE_WORDS as u64 * 8 == WRITE_BYTES);

/// Guest memory plus the dirty log, shared by the guest and its dirtiers.
#[derive(Debug)]
pub(crate) struct Memory {
    mapping: Mapping,
    /// First global page of each region, ascending, starting at 0.
    region_first_page: Vec<u64>,
    region_pages: Vec<u64>,
    bitmaps: Vec<Box<[AtomicU64]>>,
    logging: AtomicBool,
    dirtied: AtomicU64,
    throttle: AtomicU8,
}

impl Memory {
    pub(crate) fn new(mapping: Mapping, region_pages: Vec<u64>) -> Self {
        let mut first = 0;
        let region_first_page = region_pages
            .iter()
            .map(|pages| {
                let start = first;
                first += pages;
                start
            })
            .collect();
        let bitmaps = region_pages
            .iter()
            .map(|&pages| (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
            .collect();
        Self {
            mapping,
            region_first_page,
            region_pages,
            bitmaps,
            logging: AtomicBool::new(false),
            dirtied: AtomicU64::new(0),
            throttle: AtomicU8::new(0),
        }
    }

    pub(crate) fn mapping(&self) -> &Mapping {
        &self.mapping
    }

    pub(crate) fn total_pages(&self) -> u64 {
        (self.mapping.len() / PAGE_SIZE) as u64
    }

    pub(crate) fn dirtied(&self) -> u64 {
        self.dirtied.load(Ordering::Relaxed)
    }

    pub(crate) fn throttle(&self) -> u8 {
        self.throttle.load(Ordering::Relaxed)
    }

    pub(crate) fn set_throttle(&self, percent: u8) {
        self.throttle.store(percent, Ordering::Relaxed);
    }

    pub(crate) fn is_logging(&self) -> bool {
        self.logging.load(Ordering::SeqCst)
    }

    /// Enables marking, then clears. In this order a write racing with the
    /// call is either marked and possibly cleared (it completed before the
    /// clear, so the engine's first full pass, which starts after this call
    /// returns, reads it) or marked after the clear; see `dirty_one`.
    pub(crate) fn start_log(&self) {
        self.logging.store(true, Ordering::SeqCst);
        for word in self.bitmaps.iter().flat_map(|words| words.iter()) {
            word.swap(0, Ordering::Acquire);
        }
    }

    pub(crate) fn stop_log(&self) {
        self.logging.store(false, Ordering::SeqCst);
    }

    /// Moves the marked pages into `bitmaps`, one per region.
    pub(crate) fn sync_log(&self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
        if !self.is_logging() {
            return Err(GuestError::new("dirty log is not started"));
        }
        if bitmaps.len() != self.bitmaps.len() {
            return Err(GuestError::new(format!(
                "dirty log sync got {} bitmaps for {} regions",
                bitmaps.len(),
                self.bitmaps.len()
            )));
        }
        for (region, (bitmap, &pages)) in bitmaps.iter().zip(&self.region_pages).enumerate() {
            if bitmap.pages() != pages {
                return Err(GuestError::new(format!(
                    "dirty log sync: bitmap for region {region} covers {} pages, the region has {pages}",
                    bitmap.pages()
                )));
            }
        }
        for (atomics, bitmap) in self.bitmaps.iter().zip(bitmaps.iter_mut()) {
            for (atomic, word) in atomics.iter().zip(bitmap.words_mut()) {
                // Acquire pairs with the Release in `mark`: the page's new
                // content is visible to whoever reads it after this sync.
                *word |= atomic.swap(0, Ordering::Acquire);
            }
        }
        Ok(())
    }

    fn mark(&self, page: u64) {
        let region = self
            .region_first_page
            .partition_point(|&first| first <= page)
            - 1;
        let local = page - self.region_first_page[region];
        self.bitmaps[region][(local / 64) as usize].fetch_or(1 << (local % 64), Ordering::Release);
    }

    /// Changes `page` (below the total, checked by the caller): adds one
    /// to its first word, so its content always differs, then marks it as
    /// `dirty_one` does.
    pub(crate) fn change_page(&self, page: u64) {
        assert!(page < self.total_pages(), "page {page} out of range");
        // Inside the mapping (asserted above), whose length is a usize.
        #[expect(
            clippy::cast_possible_truncation,
            reason = "an offset into the mapping"
        )]
        let byte = (page * PAGE_SIZE as u64) as usize;
        // SAFETY: the page lies inside the mapping (asserted above), page
        // aligned, hence aligned for `u64`; volatile, as in `dirty_one`.
        unsafe {
            let word = self.mapping.ptr().add(byte).cast::<u64>();
            word.write_volatile(word.read_volatile().wrapping_add(1));
        }
        self.dirtied.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if self.logging.load(Ordering::SeqCst) {
            self.mark(page);
        }
    }

    /// One dirtying step: 64 pseudo-random bytes at a pseudo-random aligned
    /// offset of a pseudo-random working-set page, then the dirty bit.
    ///
    /// The bit is set only after the write, with Release ordering, so a sync
    /// that harvested the bit sees the new bytes; a write that lands after a
    /// harvest sets the bit again. The logging flag is read after the write
    /// (behind a full fence) so a write can only go unmarked if marking was
    /// still off when the write had already completed.
    pub(crate) fn dirty_one(&self, working_set_pages: u64, state: &mut ThreadState) {
        let page = state.rng.below(working_set_pages);
        let offset = state.rng.below(PAGE_SIZE as u64 / WRITE_BYTES) * WRITE_BYTES;
        // Inside the mapping (see below), whose length is a usize.
        #[expect(
            clippy::cast_possible_truncation,
            reason = "an offset into the mapping"
        )]
        let byte = (page * PAGE_SIZE as u64 + offset) as usize;
        debug_assert!(byte + WRITE_WORDS * 8 <= self.mapping.len());
        // SAFETY: `page < working_set_pages <= total pages` (validated when the
        // configuration was built or decoded) and `offset + 64 <= PAGE_SIZE`,
        // so the 64 bytes lie inside the mapping, which the `Arc<Memory>` held
        // by every caller keeps alive. The address is 64-byte aligned, hence
        // aligned for `u64`. Volatile writes through a raw pointer: the engine
        // reads the same bytes concurrently through raw pointers, and no Rust
        // reference to guest memory exists.
        unsafe {
            let dst = self.mapping.ptr().add(byte).cast::<u64>();
            for word in 0..WRITE_WORDS {
                dst.add(word).write_volatile(state.rng.next_u64());
            }
        }
        state.pages += 1;
        self.dirtied.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if self.logging.load(Ordering::SeqCst) {
            self.mark(page);
        }
    }
}

/// Pause/resume handshake state, behind the control mutex.
#[derive(Debug)]
struct ControlState {
    run: bool,
    exit: bool,
    /// Threads waiting in `park`; `pause` waits until all of them are.
    parked: usize,
    config: DirtierConfig,
    /// Authoritative while threads are parked or absent; each running thread
    /// works on a local copy and stores it back when it parks.
    states: Vec<ThreadState>,
}

#[derive(Debug)]
struct Control {
    state: Mutex<ControlState>,
    cond: Condvar,
    /// Mirror of `ControlState::run` that the threads poll without locking.
    run_flag: AtomicBool,
}

impl Control {
    fn lock(&self) -> MutexGuard<'_, ControlState> {
        // A poisoned lock only means a thread panicked while holding it; the
        // state itself is plain data and stays consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stores the thread's state, waits for resume (returning the possibly
    /// replaced state and configuration) or exit (`None`).
    fn park(&self, index: usize, local: ThreadState) -> Option<(ThreadState, DirtierConfig)> {
        let mut state = self.lock();
        state.states[index] = local;
        state.parked += 1;
        self.cond.notify_all();
        while !state.run && !state.exit {
            state = self
                .cond
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        state.parked -= 1;
        if state.exit {
            return None;
        }
        Some((state.states[index], state.config))
    }
}

/// The dirtier threads of one guest and their control.
#[derive(Debug)]
pub(crate) struct Dirtier {
    memory: Arc<Memory>,
    control: Arc<Control>,
    handles: Vec<JoinHandle<()>>,
}

impl Dirtier {
    /// A paused dirtier; threads are created on the first `resume`.
    pub(crate) fn new(memory: Arc<Memory>, config: DirtierConfig) -> Self {
        let states = config.initial_states();
        Self {
            memory,
            control: Arc::new(Control {
                state: Mutex::new(ControlState {
                    run: false,
                    exit: false,
                    parked: 0,
                    config,
                    states,
                }),
                cond: Condvar::new(),
                run_flag: AtomicBool::new(false),
            }),
            handles: Vec::new(),
        }
    }

    pub(crate) fn is_running(&self) -> bool {
        self.control.lock().run
    }

    pub(crate) fn snapshot(&self) -> (DirtierConfig, Vec<ThreadState>) {
        let state = self.control.lock();
        (state.config, state.states.clone())
    }

    pub(crate) fn resume(&mut self) -> std::io::Result<()> {
        let mut state = self.control.lock();
        if state.run {
            return Ok(());
        }
        if self.handles.is_empty() && state.config.rate > 0 {
            for index in 0..state.config.threads as usize {
                let memory = Arc::clone(&self.memory);
                let control = Arc::clone(&self.control);
                let spawned = std::thread::Builder::new()
                    .name(format!("tern-dirtier-{index}"))
                    .spawn(move || dirtier_main(&memory, &control, index));
                match spawned {
                    Ok(handle) => self.handles.push(handle),
                    Err(error) => {
                        drop(state);
                        self.stop_threads();
                        return Err(error);
                    }
                }
            }
        }
        state.run = true;
        self.control.run_flag.store(true, Ordering::Release);
        self.control.cond.notify_all();
        Ok(())
    }

    /// Stops the dirtiers and returns once every one of them is parked, so no
    /// write is in flight and their states are stored.
    pub(crate) fn pause(&mut self) -> GuestResult<()> {
        let mut state = self.control.lock();
        state.run = false;
        self.control.run_flag.store(false, Ordering::Release);
        self.control.cond.notify_all();
        for handle in &self.handles {
            handle.thread().unpark();
        }
        while state.parked < self.handles.len() {
            // A thread that died would never park: check instead of hanging.
            if self.handles.iter().any(JoinHandle::is_finished) {
                return Err(GuestError::new("a dirtier thread stopped unexpectedly"));
            }
            state = self
                .control
                .cond
                .wait_timeout(state, Duration::from_millis(50))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        Ok(())
    }

    /// Replaces configuration and thread states; the guest must be paused.
    /// Threads are recreated on the next resume since their count may change.
    pub(crate) fn replace(&mut self, config: DirtierConfig, states: Vec<ThreadState>) {
        self.stop_threads();
        let mut state = self.control.lock();
        state.config = config;
        state.states = states;
    }

    /// Runs `pages` dirtying steps on the calling thread, taking them from
    /// the threads' sequences in turn. The guest must be paused.
    pub(crate) fn step(&mut self, pages: u64) {
        let mut state = self.control.lock();
        let working_set = state.config.working_set_pages;
        let threads = state.states.len();
        for step in 0..pages {
            // `step % threads < threads`, a usize.
            #[expect(clippy::cast_possible_truncation, reason = "below the thread count")]
            let thread = (step % threads as u64) as usize;
            self.memory
                .dirty_one(working_set, &mut state.states[thread]);
        }
    }

    fn stop_threads(&mut self) {
        {
            let mut state = self.control.lock();
            state.exit = true;
            state.run = false;
            self.control.run_flag.store(false, Ordering::Release);
            self.control.cond.notify_all();
        }
        for handle in self.handles.drain(..) {
            // A panicked dirtier has nothing left to clean up.
            let _ = handle.join();
        }
        self.control.lock().exit = false;
    }
}

impl Drop for Dirtier {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

fn dirtier_main(memory: &Memory, control: &Control, index: usize) {
    let (mut local, mut config) = {
        let state = control.lock();
        (state.states[index], state.config)
    };
    let mut last = Instant::now();
    loop {
        if !control.run_flag.load(Ordering::Acquire) {
            match control.park(index, local) {
                Some((state, new_config)) => (local, config) = (state, new_config),
                None => return,
            }
            // Time spent paused earns no credit.
            last = Instant::now();
        }
        let slice_start = Instant::now();
        let elapsed = slice_start.duration_since(last).min(MAX_CATCH_UP);
        last = slice_start;
        let speed = 100 - u128::from(memory.throttle().min(99));
        let earned = u128::from(config.rate_share(index)) * speed * elapsed.as_nanos() / 100;
        let credit = u128::from(local.credit) + earned;
        let due = credit / u128::from(CREDIT_PER_PAGE);
        // Below CREDIT_PER_PAGE, a u64.
        #[expect(clippy::cast_possible_truncation, reason = "below CREDIT_PER_PAGE")]
        let left = (credit % u128::from(CREDIT_PER_PAGE)) as u64;
        local.credit = left;
        for _ in 0..due {
            if !control.run_flag.load(Ordering::Relaxed) {
                break;
            }
            memory.dirty_one(config.working_set_pages, &mut local);
        }
        if let Some(rest) = SLICE.checked_sub(slice_start.elapsed()) {
            // Parking rather than sleeping lets `pause` cut the slice short,
            // which keeps pause latency (part of migration downtime) low. An
            // early wake-up is harmless: credit is earned by elapsed time.
            std::thread::park_timeout(rest);
        }
    }
}

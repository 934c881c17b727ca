//! The service's threads: one answers faults, the loaders fill the rest.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::fault::uffd::{Event, Userfault, Wait};
use crate::fault::{FaultError, PageSource};
use crate::guest::PAGE_SIZE;

const PAGE: u64 = PAGE_SIZE as u64;

/// How long the fault thread sleeps in `poll` before looking at its stop
/// flag (a stop also wakes it at once).
const POLL_MS: i32 = 100;

/// How long a placement retries while the kernel answers `EAGAIN`.
const AGAIN_DEADLINE: Duration = Duration::from_secs(10);

/// Whether a placement failed only because the memory map was changing.
fn is_again(error: &FaultError) -> bool {
    matches!(error, FaultError::Place { source, .. } if source.raw_os_error() == Some(libc::EAGAIN))
}

/// Whether a placement failed because the memory is no longer there:
/// unmapped (`ENOENT`) or its process exited (`ESRCH`).
fn is_gone(error: &FaultError) -> bool {
    matches!(error, FaultError::Place { source, .. }
        if matches!(source.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)))
}

/// Fault latencies kept for the percentiles (a few MiB at most).
const MAX_LATENCY_SAMPLES: usize = 1 << 20;

/// One range of memory served: where it is in the faulting process's
/// address space and how long it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServedRegion {
    /// Address of the first byte, in the process that registered it.
    pub base: u64,
    /// Length in bytes, a multiple of the page size.
    pub len: u64,
}

impl ServedRegion {
    fn pages(&self) -> u64 {
        self.len / PAGE
    }
}

/// How the service runs.
#[derive(Clone, Debug)]
pub struct FaultConfig {
    /// Pages fetched and placed together (at least 1).
    pub unit_pages: u64,
    /// Background loader threads; 0 serves faults only.
    pub loaders: usize,
    /// Pages to load first, in order: (region index, page).
    pub working_set: Vec<(u32, u32)>,
    /// Unregister the memory when a fetch fails, so the threads waiting on
    /// it are released (they find zeros: the owner must then stop the
    /// guest, which no longer runs on trusted memory).
    pub release_on_failure: bool,
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self {
            unit_pages: 16,
            loaders: 2,
            working_set: Vec::new(),
            release_on_failure: true,
        }
    }
}

/// What the service did, in QMP's words where QMP has them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct FaultStats {
    /// Page faults answered.
    pub faults: u64,
    /// Pages placed because a fault asked for their unit.
    pub fault_pages: u64,
    /// Pages placed by the background loaders.
    pub prefetched_pages: u64,
    /// Of all pages placed, those mapped as zero pages.
    pub zero_pages: u64,
    /// `UFFD_EVENT_REMOVE` events handled.
    pub removes: u64,
    /// Median time from reading a fault to placing its page, µs.
    pub fault_latency_p50_us: f64,
    /// 99th percentile of the same, µs.
    pub fault_latency_p99_us: f64,
    /// Average of the same, µs.
    pub fault_latency_avg_us: f64,
    /// Time faulting threads waited, summed, ms (QEMU's blocktime).
    pub blocktime_ms: f64,
    /// Faults per latency bucket: entry `i` counts faults answered in
    /// `[2^i, 2^(i+1))` µs (the last entry also everything longer).
    pub fault_latency_histogram_us: Vec<u64>,
    /// Time from the start until every unit was present, if it happened.
    pub loaded_after_ms: Option<f64>,
}

/// The fault service: serves `regions` through `uffd` from a page source.
pub struct FaultService {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for FaultService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultService")
            .field("regions", &self.shared.regions)
            .finish_non_exhaustive()
    }
}

struct Shared {
    uffd: Userfault,
    regions: Vec<ServedRegion>,
    source: Arc<dyn PageSource>,
    unit_pages: u64,
    release_on_failure: bool,
    /// One bit per unit, per region: placed.
    present: Vec<Vec<AtomicU64>>,
    /// One bit per page, per region: removed (balloon), served as zeros.
    removed: Vec<Vec<AtomicU64>>,
    units_present: AtomicU64,
    total_units: u64,
    /// The loaders' order: working-set units, then every unit.
    order: Vec<(usize, u64)>,
    cursor: AtomicUsize,
    stop: AtomicBool,
    failed: Mutex<Option<FaultError>>,
    started: Instant,
    loaded_after: Mutex<Option<Duration>>,
    counters: Counters,
    latencies_ns: Mutex<Vec<u64>>,
    /// Pages whose fault loaded their unit, in order: the working set a
    /// later restore may prefetch.
    faulted: Mutex<Vec<(u32, u32)>>,
}

#[derive(Default)]
struct Counters {
    faults: AtomicU64,
    fault_pages: AtomicU64,
    prefetched_pages: AtomicU64,
    zero_pages: AtomicU64,
    removes: AtomicU64,
}

/// This process's `memory` as the ranges a service serves.
fn served_regions(memory: &[crate::guest::MemoryRegion]) -> Vec<ServedRegion> {
    memory
        .iter()
        .map(|region| ServedRegion {
            base: region.host_ptr() as u64,
            len: region.len(),
        })
        .collect()
}

fn bits(count: u64) -> Vec<AtomicU64> {
    (0..count.div_ceil(64)).map(|_| AtomicU64::new(0)).collect()
}

fn test_bit(words: &[AtomicU64], index: u64) -> bool {
    words
        .get((index / 64) as usize)
        .is_some_and(|word| word.load(Ordering::Acquire) & (1 << (index % 64)) != 0)
}

impl FaultService {
    /// Registers `memory` (this process's) with a new userfaultfd and
    /// starts serving it: the memory must be fresh (never touched), since
    /// a page already there is taken as placed.
    pub fn register_and_start(
        memory: &[crate::guest::MemoryRegion],
        source: Arc<dyn PageSource>,
        config: FaultConfig,
    ) -> Result<Self, FaultError> {
        let uffd = Userfault::register(memory).map_err(FaultError::Userfaultfd)?;
        Self::start(uffd, served_regions(memory), source, config)
    }

    /// Serves memory another process registered and handed over
    /// (Firecracker's protocol): `regions` are in that process's address
    /// space.
    pub fn adopt_and_start(
        fd: std::os::fd::OwnedFd,
        regions: Vec<ServedRegion>,
        source: Arc<dyn PageSource>,
        config: FaultConfig,
    ) -> Result<Self, FaultError> {
        let ranges = regions
            .iter()
            .map(|region| (region.base, region.len))
            .collect();
        let uffd = Userfault::adopt(fd, ranges).map_err(FaultError::Userfaultfd)?;
        Self::start(uffd, regions, source, config)
    }

    fn start(
        uffd: Userfault,
        regions: Vec<ServedRegion>,
        source: Arc<dyn PageSource>,
        config: FaultConfig,
    ) -> Result<Self, FaultError> {
        let unit_pages = config.unit_pages.max(1);
        let units: Vec<u64> = regions
            .iter()
            .map(|region| region.pages().div_ceil(unit_pages))
            .collect();
        let mut order: Vec<(usize, u64)> = config
            .working_set
            .iter()
            .filter(|&&(region, page)| {
                regions
                    .get(region as usize)
                    .is_some_and(|r| u64::from(page) < r.pages())
            })
            .map(|&(region, page)| (region as usize, u64::from(page) / unit_pages))
            .collect();
        order.dedup();
        for (region, &count) in units.iter().enumerate() {
            order.extend((0..count).map(|unit| (region, unit)));
        }
        let shared = Arc::new(Shared {
            present: units.iter().map(|&count| bits(count)).collect(),
            removed: regions.iter().map(|region| bits(region.pages())).collect(),
            total_units: units.iter().sum(),
            uffd,
            regions,
            source,
            unit_pages,
            release_on_failure: config.release_on_failure,
            units_present: AtomicU64::new(0),
            order,
            cursor: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
            started: Instant::now(),
            loaded_after: Mutex::new(None),
            counters: Counters::default(),
            latencies_ns: Mutex::new(Vec::new()),
            faulted: Mutex::new(Vec::new()),
        });
        let mut service = Self {
            shared,
            threads: Vec::new(),
        };
        service.spawn("tern-faults", |shared| shared.serve_faults())?;
        service.add_loaders(config.loaders)?;
        Ok(service)
    }

    /// Starts `count` more background loaders: a service started with
    /// none (faults only) begins loading everything else now. Loaders
    /// share one cursor, so pages are never loaded twice by them.
    pub fn add_loaders(&mut self, count: usize) -> Result<(), FaultError> {
        for _ in 0..count {
            self.spawn("tern-loader", |shared| shared.load_all())?;
        }
        Ok(())
    }

    fn spawn(&mut self, name: &str, run: fn(&Shared)) -> Result<(), FaultError> {
        let shared = Arc::clone(&self.shared);
        match std::thread::Builder::new()
            .name(name.into())
            .spawn(move || run(&shared))
        {
            Ok(thread) => {
                self.threads.push(thread);
                Ok(())
            }
            Err(error) => {
                self.shared.fail(FaultError::Spawn(error));
                Err(self.take_failure().unwrap_or(FaultError::PeerGone))
            }
        }
    }

    /// Whether every unit has been placed.
    pub fn is_loaded(&self) -> bool {
        self.shared.units_present.load(Ordering::Acquire) >= self.shared.total_units
    }

    /// Takes the error that stopped the service, if one did.
    pub fn take_failure(&self) -> Option<FaultError> {
        self.shared.failed.lock().ok()?.take()
    }

    /// Whether guest memory has left userfaultfd (the service failed or
    /// was stopped): from then on nothing can be placed.
    pub(crate) fn is_released(&self) -> bool {
        self.shared.uffd.is_released()
    }

    /// Whether the service has failed (without taking the error).
    pub fn has_failed(&self) -> bool {
        self.shared
            .failed
            .lock()
            .is_ok_and(|failed| failed.is_some())
    }

    /// Waits until every unit is placed or the service fails, polling
    /// every millisecond, up to `deadline`.
    pub fn wait_loaded(&self, deadline: Duration) -> Result<(), FaultError> {
        let until = Instant::now() + deadline;
        loop {
            if let Some(error) = self.take_failure() {
                return Err(error);
            }
            if self.is_loaded() {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(FaultError::Timeout(deadline));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits until the faulting process closes its userfaultfd (the page
    /// server's lifetime), or the service fails, or `stop` is set.
    pub fn wait_peer_gone(&self, stop: &AtomicBool) -> Result<(), FaultError> {
        while !stop.load(Ordering::Relaxed) {
            if let Some(error) = self.take_failure() {
                return match error {
                    FaultError::PeerGone => Ok(()),
                    other => Err(other),
                };
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Places pages `first..first + zero.len()` of region `region` that a
    /// page source delivered without a fault asking (postcopy's urgent and
    /// background pages): each missing page is placed from `buf` (or as
    /// zeros where `zero` is set), a page there already is left alone, and
    /// threads waiting on the pages wake. Returns how many this call placed.
    /// With units of one page, the pages count as present for the faults.
    ///
    /// Once the service has released the memory (it failed, or was
    /// stopped), every placement fails with [`FaultError::Released`],
    /// whatever the kernel said: a page missing at the release may have
    /// been faulted in as zeros, so `ENOENT` (no longer registered) and
    /// even `EEXIST` no longer mean what they mean while the service runs.
    /// `ENOENT` while the service runs is memory the guest unmapped, and
    /// places nothing.
    pub(crate) fn place(
        &self,
        region: usize,
        first: u64,
        buf: &[u8],
        zero: &[bool],
    ) -> Result<usize, FaultError> {
        let served = self
            .shared
            .regions
            .get(region)
            .ok_or_else(|| FaultError::Place {
                region,
                page: first,
                source: std::io::Error::from_raw_os_error(libc::EINVAL),
            })?;
        if first + zero.len() as u64 > served.pages() || buf.len() < zero.len() * PAGE_SIZE {
            return Err(FaultError::Place {
                region,
                page: first,
                source: std::io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        let deadline = Instant::now() + AGAIN_DEADLINE;
        let placed = loop {
            match self.shared.place_runs(region, first, buf, zero) {
                Err(error) if is_again(&error) && Instant::now() < deadline => {
                    std::thread::yield_now();
                }
                Err(error) if is_gone(&error) => break Ok(0),
                other => break other,
            }
        };
        // Looked at after the placement: the flag is raised before the
        // memory is unregistered, so a placement refused or skipped
        // because of the release always sees it.
        if self.shared.uffd.is_released() {
            return Err(FaultError::Released {
                region,
                page: first,
            });
        }
        let placed = placed?;
        if self.shared.unit_pages == 1 {
            for page in first..first + zero.len() as u64 {
                self.shared.mark_present(region, page);
            }
        }
        Ok(placed)
    }

    /// The statistics so far.
    pub fn stats(&self) -> FaultStats {
        self.shared.stats()
    }

    /// Pages whose fault loaded their unit, in fault order.
    pub fn faulted_pages(&self) -> Vec<(u32, u32)> {
        self.shared
            .faulted
            .lock()
            .map(|faulted| faulted.clone())
            .unwrap_or_default()
    }

    /// Stops the threads and, for memory this process registered, ends the
    /// registration (a page still missing then faults in as zeros).
    /// Returns the statistics.
    pub fn stop(mut self) -> FaultStats {
        self.halt();
        self.shared.stats()
    }

    fn halt(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.uffd.stop_waiting();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        self.shared.uffd.release();
    }
}

impl Drop for FaultService {
    fn drop(&mut self) {
        self.halt();
    }
}

impl Shared {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn fail(&self, error: FaultError) {
        tracing::warn!(%error, "the fault service stops");
        if let Ok(mut failed) = self.failed.lock()
            && failed.is_none()
        {
            *failed = Some(error);
        }
        self.stop.store(true, Ordering::Release);
        if self.release_on_failure {
            self.uffd.release();
        }
        self.uffd.stop_waiting();
    }

    /// The fault thread: reads events until stopped.
    fn serve_faults(&self) {
        let mut pending = VecDeque::new();
        while !self.stopping() {
            match self.uffd.wait(POLL_MS) {
                Wait::Stopped => return,
                Wait::Timeout => {}
                Wait::Closed => return self.fail(FaultError::PeerGone),
                Wait::Ready => {
                    while let Some(event) = self.uffd.next_event() {
                        pending.push_back(event);
                    }
                    while let Some(event) = pending.pop_front() {
                        if let Err(error) = self.handle_retrying(event, &mut pending) {
                            return self.fail(error);
                        }
                    }
                }
            }
        }
    }

    /// Handles `event`; while a placement meets `EAGAIN` (the memory map
    /// is changing: a remove event is queued), reads the queued events,
    /// handles the removes at once, keeps the faults for later, and tries
    /// again, for up to [`AGAIN_DEADLINE`].
    fn handle_retrying(
        &self,
        event: Event,
        pending: &mut VecDeque<Event>,
    ) -> Result<(), FaultError> {
        let deadline = Instant::now() + AGAIN_DEADLINE;
        loop {
            match self.handle(event) {
                Err(error) if is_again(&error) && Instant::now() < deadline => {
                    while let Some(queued) = self.uffd.next_event() {
                        match queued {
                            Event::Remove { .. } => self.handle(queued)?,
                            other => pending.push_back(other),
                        }
                    }
                }
                // The range was unmapped (or the process ended) since the
                // fault was queued: no page of ours goes there any more. A
                // thread still waiting is woken to fault on what is mapped
                // there now (or to find its process gone).
                Err(error) if is_gone(&error) => {
                    if let Event::PageFault(address) = event {
                        self.uffd.wake_range(address, PAGE);
                    }
                    return Ok(());
                }
                other => return other,
            }
        }
    }

    fn handle(&self, event: Event) -> Result<(), FaultError> {
        match event {
            Event::PageFault(address) => {
                let began = Instant::now();
                self.counters.faults.fetch_add(1, Ordering::Relaxed);
                if let Some((region, page)) = self.locate(address) {
                    if self.load_unit(region, page / self.unit_pages, true)? {
                        if let Ok(mut faulted) = self.faulted.lock() {
                            faulted.push((
                                crate::numeric::saturating_u32(region),
                                crate::numeric::saturating_u32(page),
                            ));
                        }
                    } else {
                        // Its unit was placed, yet the page is missing:
                        // it was dropped (`MADV_DONTNEED`) on a descriptor
                        // that reports no removes, as ours do not. Freshly
                        // released memory reads as zeros; left missing, the
                        // page would fault again for ever. A page placed
                        // meanwhile stays (the kernel refuses to replace it).
                        self.place_runs(region, page, &[], &[true])?;
                    }
                }
                // Whoever placed the page, its waiters wake now.
                self.uffd.wake_range(address, PAGE);
                if let Ok(mut latencies) = self.latencies_ns.lock()
                    && latencies.len() < MAX_LATENCY_SAMPLES
                {
                    latencies.push(crate::numeric::saturating_u64(began.elapsed().as_nanos()));
                }
            }
            Event::Remove { start, end } => {
                self.remove(start, end);
                // Counted once handled: the counter says the bitmaps know.
                self.counters.removes.fetch_add(1, Ordering::Release);
            }
            Event::Other(_) => {}
        }
        Ok(())
    }

    /// The region index and page of a faulting address.
    fn locate(&self, address: u64) -> Option<(usize, u64)> {
        self.regions.iter().enumerate().find_map(|(index, region)| {
            let offset = address.checked_sub(region.base)?;
            (offset < region.len).then_some((index, offset / PAGE))
        })
    }

    /// Pages `start..end` were dropped: their units are missing again, and
    /// the pages are served as zeros from now on (what the guest would
    /// find in freshly released memory).
    fn remove(&self, start: u64, end: u64) {
        let mut address = start & !(PAGE - 1);
        while address < end {
            if let Some((region, page)) = self.locate(address) {
                self.removed[region][(page / 64) as usize]
                    .fetch_or(1 << (page % 64), Ordering::AcqRel);
                let unit = page / self.unit_pages;
                let word = &self.present[region][(unit / 64) as usize];
                if word.fetch_and(!(1 << (unit % 64)), Ordering::AcqRel) & (1 << (unit % 64)) != 0 {
                    self.units_present.fetch_sub(1, Ordering::AcqRel);
                }
            }
            address += PAGE;
        }
    }

    /// A loader: takes units from the shared order until none is left.
    fn load_all(&self) {
        while !self.stopping() {
            let index = self.cursor.fetch_add(1, Ordering::Relaxed);
            let Some(&(region, unit)) = self.order.get(index) else {
                return;
            };
            let deadline = Instant::now() + AGAIN_DEADLINE;
            loop {
                match self.load_unit(region, unit, false) {
                    Ok(_) => break,
                    // The fault thread reads the event that unblocks it.
                    Err(error) if is_again(&error) && Instant::now() < deadline => {
                        std::thread::yield_now();
                    }
                    // Memory unmapped, or its process gone: nothing to load.
                    Err(error) if is_gone(&error) => return,
                    Err(error) => return self.fail(error),
                }
            }
        }
    }

    /// Fetches and places one unit unless it is present. Returns whether
    /// this call loaded it.
    fn load_unit(&self, region: usize, unit: u64, by_fault: bool) -> Result<bool, FaultError> {
        if test_bit(&self.present[region], unit) {
            return Ok(false);
        }
        let served = self.regions[region];
        let first = unit * self.unit_pages;
        let count = crate::numeric::saturating_usize(self.unit_pages.min(served.pages() - first));
        let mut buf = vec![0u8; count * PAGE_SIZE];
        let mut zero = vec![false; count];
        self.source
            .fetch(region, first, &mut buf, &mut zero)
            .map_err(|source| FaultError::Source {
                region,
                page: first,
                source,
            })?;
        for (offset, is_zero) in zero.iter_mut().enumerate() {
            *is_zero |= test_bit(&self.removed[region], first + offset as u64);
        }
        let placed = self.place_runs(region, first, &buf, &zero)?;
        self.mark_present(region, unit);
        let counter = if by_fault {
            &self.counters.fault_pages
        } else {
            &self.counters.prefetched_pages
        };
        counter.fetch_add(placed as u64, Ordering::Relaxed);
        Ok(true)
    }

    /// Marks unit `unit` of region `region` present.
    fn mark_present(&self, region: usize, unit: u64) {
        let word = &self.present[region][(unit / 64) as usize];
        if word.fetch_or(1 << (unit % 64), Ordering::AcqRel) & (1 << (unit % 64)) == 0 {
            self.units_present.fetch_add(1, Ordering::AcqRel);
            if self.units_present.load(Ordering::Acquire) >= self.total_units
                && let Ok(mut loaded) = self.loaded_after.lock()
            {
                loaded.get_or_insert(self.started.elapsed());
            }
        }
    }

    /// Places a fetched unit: each run of data pages with one copy, each
    /// run of zero pages with one zero-page call. Returns pages placed.
    fn place_runs(
        &self,
        region: usize,
        first: u64,
        buf: &[u8],
        zero: &[bool],
    ) -> Result<usize, FaultError> {
        let base = self.regions[region].base + first * PAGE;
        let mut placed = 0;
        let mut start = 0;
        while start < zero.len() {
            let kind = zero[start];
            let end = zero[start..]
                .iter()
                .position(|&other| other != kind)
                .map_or(zero.len(), |run| start + run);
            let address = base + (start * PAGE_SIZE) as u64;
            let result = if kind {
                // SAFETY: pages `start..end` of a served region, which the
                // kernel checks against the registration.
                unsafe { self.uffd.zero_missing(address, end - start) }.inspect(|&count| {
                    self.counters
                        .zero_pages
                        .fetch_add(count as u64, Ordering::Relaxed);
                })
            } else {
                // SAFETY: as above; `buf` holds the run's pages.
                unsafe {
                    self.uffd
                        .copy_missing(address, buf[start * PAGE_SIZE..].as_ptr(), end - start)
                }
            };
            placed += result.map_err(|source| FaultError::Place {
                region,
                page: first + start as u64,
                source,
            })?;
            start = end;
        }
        Ok(placed)
    }

    fn stats(&self) -> FaultStats {
        let mut latencies = self
            .latencies_ns
            .lock()
            .map(|l| l.clone())
            .unwrap_or_default();
        latencies.sort_unstable();
        let percentile = |p: f64| {
            if latencies.is_empty() {
                return 0.0;
            }
            let index = crate::numeric::saturating_usize(crate::numeric::saturating_u64_from_f64(
                ((latencies.len() - 1) as f64 * p).round(),
            ));
            latencies[index] as f64 / 1000.0
        };
        let total_ns: u64 = latencies.iter().sum();
        let mut histogram = vec![0u64; tern_wire::LATENCY_BUCKETS];
        for &latency in &latencies {
            histogram[crate::postcopy::latency_bucket(latency)] += 1;
        }
        FaultStats {
            fault_latency_avg_us: if latencies.is_empty() {
                0.0
            } else {
                total_ns as f64 / latencies.len() as f64 / 1000.0
            },
            blocktime_ms: total_ns as f64 / 1e6,
            fault_latency_histogram_us: crate::postcopy::trimmed(&histogram),
            faults: self.counters.faults.load(Ordering::Relaxed),
            fault_pages: self.counters.fault_pages.load(Ordering::Relaxed),
            prefetched_pages: self.counters.prefetched_pages.load(Ordering::Relaxed),
            zero_pages: self.counters.zero_pages.load(Ordering::Relaxed),
            removes: self.counters.removes.load(Ordering::Acquire),
            fault_latency_p50_us: percentile(0.5),
            fault_latency_p99_us: percentile(0.99),
            loaded_after_ms: self
                .loaded_after
                .lock()
                .ok()
                .and_then(|loaded| *loaded)
                .map(|elapsed| elapsed.as_secs_f64() * 1000.0),
        }
    }
}

#[cfg(test)]
mod tests;

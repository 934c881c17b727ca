//! The service on real userfaultfd-registered memory: what a touched page
//! brings, what the loaders fetch and in which order, removes, placements
//! from outside, a failing source and the release at the end.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tern_test_skip::wait::exit_after_deadline;

use super::{FaultConfig, FaultService, PAGE_SIZE};
use crate::destination::test_memory::AnonymousMemory;
use crate::fault::uffd::Userfault;
use crate::fault::{FaultError, PageSource, PageSourceError};
use crate::guest::MemoryRegion;

/// Pages of the two served regions: 10 (units of 4: three, the last of
/// two pages) and 7 (two units, the last of three).
const PAGES: [usize; 2] = [10, 7];
const UNIT: u64 = 4;

/// Every third page (2, 5, 8) is zero; every other page is filled with a
/// byte naming its region and page.
fn expected(region: usize, page: u64) -> u8 {
    if page % 3 == 2 {
        0
    } else {
        u8::try_from(region as u64 * 50 + page + 1).unwrap()
    }
}

/// The pages of [`expected`]; records each fetch (region, first page,
/// pages) in order, refuses the unit beginning at `failing`, and holds
/// the fetch of the unit beginning at `held` until the test lets it go.
#[derive(Default)]
struct PatternSource {
    fetched: Mutex<Vec<(usize, u64, usize)>>,
    failing: Option<(usize, u64)>,
    held: Option<HeldUnit>,
}

/// A unit whose fetch waits for a word on the channel.
type HeldUnit = ((usize, u64), Mutex<std::sync::mpsc::Receiver<()>>);

impl PatternSource {
    fn fetched(&self) -> Vec<(usize, u64, usize)> {
        self.fetched.lock().unwrap().clone()
    }
}

impl PageSource for PatternSource {
    fn fetch(
        &self,
        region: usize,
        first: u64,
        buf: &mut [u8],
        zero: &mut [bool],
    ) -> Result<(), PageSourceError> {
        self.fetched
            .lock()
            .unwrap()
            .push((region, first, zero.len()));
        if let Some((unit, release)) = &self.held
            && *unit == (region, first)
        {
            let _ = release.lock().unwrap().recv();
        }
        if self.failing == Some((region, first)) {
            return Err(PageSourceError::new("this unit cannot be read"));
        }
        for (index, page) in buf.chunks_mut(PAGE_SIZE).enumerate() {
            let byte = expected(region, first + index as u64);
            zero[index] = byte == 0;
            // A zero page's bytes are not looked at: fill them with
            // something else, so a zero page placed from them shows.
            page.fill(if byte == 0 { 0xEE } else { byte });
        }
        Ok(())
    }
}

/// The two regions' memory and the service serving it, or `None` after a
/// visible skip where this process has no userfaultfd.
fn served(
    source: &Arc<PatternSource>,
    config: FaultConfig,
) -> Option<([AnonymousMemory; 2], FaultService)> {
    served_through(source, config, Userfault::register)
}

/// [`served`] through a descriptor `register` made for the regions.
fn served_through(
    source: &Arc<PatternSource>,
    config: FaultConfig,
    register: fn(&[MemoryRegion]) -> std::io::Result<Userfault>,
) -> Option<([AnonymousMemory; 2], FaultService)> {
    let memory = PAGES.map(AnonymousMemory::new);
    let regions = [memory[0].region(0), memory[1].region(1)];
    let service = started(&regions, source, config, register)?;
    Some((memory, service))
}

/// A service of `regions` through a descriptor `register` made for them,
/// or `None` after a visible skip where this process has no userfaultfd.
fn started(
    regions: &[MemoryRegion],
    source: &Arc<PatternSource>,
    config: FaultConfig,
    register: fn(&[MemoryRegion]) -> std::io::Result<Userfault>,
) -> Option<FaultService> {
    let uffd = match register(regions) {
        Ok(uffd) => uffd,
        Err(error) => {
            tern_test_skip::skip(
                tern_test_skip::Need::Userfaultfd,
                format!("no userfaultfd for this process: {error}"),
            );
            return None;
        }
    };
    let source = Arc::clone(source) as Arc<dyn PageSource>;
    Some(FaultService::start(uffd, super::served_regions(regions), source, config).unwrap())
}

fn config(loaders: usize) -> FaultConfig {
    FaultConfig {
        unit_pages: UNIT,
        loaders,
        ..FaultConfig::default()
    }
}

/// The first byte of each page `pages` of `memory`, each page checked to
/// be that byte throughout; a read the service never answers fails the
/// test process at the deadline.
fn read(memory: &AnonymousMemory, pages: impl IntoIterator<Item = usize>) -> Vec<u8> {
    exit_after_deadline("the service answers the reads", || {
        pages
            .into_iter()
            .map(|page| {
                let bytes = memory.page(page);
                assert!(
                    bytes.iter().all(|&byte| byte == bytes[0]),
                    "page {page} is one byte throughout"
                );
                bytes[0]
            })
            .collect()
    })
}

fn expected_pages(region: usize, pages: impl IntoIterator<Item = u64>) -> Vec<u8> {
    pages
        .into_iter()
        .map(|page| expected(region, page))
        .collect()
}

#[test]
fn a_touched_page_brings_its_unit_and_the_loaders_bring_the_rest_once() {
    let source = Arc::new(PatternSource::default());
    let Some((memory, mut service)) = served(&source, config(0)) else {
        return;
    };
    // Page 5 of region 0 (zero) brings its unit, pages 4-7, in one fetch;
    // its neighbours then read without a fault.
    assert_eq!(read(&memory[0], [5]), [0]);
    assert_eq!(read(&memory[0], 4..8), expected_pages(0, 4..8));
    assert!(!service.is_released() && !service.has_failed());
    assert_eq!(read(&memory[1], [6]), expected_pages(1, [6]));
    // A waiting thread wakes as its page is placed, before the service
    // has counted it: the counts settle soon after.
    let stats = settled(&service, |stats| {
        stats.fault_pages == 4 + 3 && stats.zero_pages == 2
    });
    assert_eq!(stats.faults, 2);
    assert_eq!(stats.prefetched_pages, 0);
    // Page 5 of both units; region 1's last unit is pages 4-6.
    assert_eq!(stats.zero_pages, 2);
    tern_test_skip::wait::wait_until("both faults are recorded", || {
        service.faulted_pages().len() == 2
    });
    assert_eq!(service.faulted_pages(), [(0, 5), (1, 6)]);
    assert_eq!(source.fetched(), [(0, 4, 4), (1, 4, 3)]);
    assert_eq!(stats.fault_latency_histogram_us.iter().sum::<u64>(), 2);
    assert!(stats.fault_latency_p50_us <= stats.fault_latency_p99_us);
    assert!(!service.is_loaded());
    assert!(stats.loaded_after_ms.is_none());
    assert!(matches!(
        service.wait_loaded(Duration::from_millis(20)),
        Err(FaultError::Timeout(_))
    ));

    service.add_loaders(2).unwrap();
    service.wait_loaded(tern_test_skip::wait::DEADLINE).unwrap();
    assert!(service.is_loaded());
    for region in 0..2 {
        assert_eq!(
            read(&memory[region], 0..PAGES[region]),
            expected_pages(region, 0..PAGES[region] as u64),
            "region {region}"
        );
    }
    let stats = service.stop();
    assert_eq!(stats.faults, 2, "the loaded pages read without a fault");
    assert_eq!(stats.prefetched_pages, 17 - 7);
    // Pages 2, 5, 8 of region 0 and 2, 5 of region 1.
    assert_eq!(stats.zero_pages, 5);
    assert!(stats.loaded_after_ms.is_some());
    let mut fetched = source.fetched();
    fetched.sort_unstable();
    assert_eq!(
        fetched,
        [(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 4), (1, 4, 3)],
        "every unit fetched once"
    );
}

#[test]
fn a_loader_takes_the_working_set_first_in_its_order() {
    let source = Arc::new(PatternSource::default());
    // (0, 10) is one page past region 0's end, in a unit that exists.
    let working_set = vec![(0, 10), (1, 5), (1, 4), (0, 9), (7, 0), (1, 1)];
    let with_working_set = FaultConfig {
        working_set,
        ..config(1)
    };
    let Some((memory, service)) = served(&source, with_working_set) else {
        return;
    };
    service.wait_loaded(tern_test_skip::wait::DEADLINE).unwrap();
    // The working set's units in its order (a region or page that does
    // not exist left out), then every unit not yet there.
    assert_eq!(
        source.fetched(),
        [(1, 4, 3), (0, 8, 2), (1, 0, 4), (0, 0, 4), (0, 4, 4)]
    );
    assert_eq!(read(&memory[1], 0..7), expected_pages(1, 0..7));
    let stats = service.stop();
    assert_eq!((stats.faults, stats.fault_pages), (0, 0));
    assert_eq!(stats.prefetched_pages, 17);
}

/// The service's statistics once `done` holds of them (its counts trail
/// the wake-up of the thread that faulted).
fn settled(service: &FaultService, done: impl Fn(&super::FaultStats) -> bool) -> super::FaultStats {
    tern_test_skip::wait::wait_for("the service's counts settle", || {
        let stats = service.stats();
        done(&stats).then_some(stats)
    })
}

/// Waits until every unit is present (placed before its thread woke, and
/// marked just after).
fn loaded(service: &FaultService) {
    tern_test_skip::wait::wait_until("every unit is marked present", || service.is_loaded());
}

/// Drops pages `first..first + count` of `memory` (`MADV_DONTNEED`, which
/// waits until the service has read the remove event), then waits until
/// the service has handled `removes` removes in all.
fn drop_handled(
    service: &FaultService,
    memory: &AnonymousMemory,
    first: usize,
    count: usize,
    removes: u64,
) {
    drop_pages(memory, first, count);
    settled(service, |stats| stats.removes == removes);
}

/// Drops pages `first..first + count` of `memory` (`MADV_DONTNEED`, which
/// waits until the service has read the remove event).
fn drop_pages(memory: &AnonymousMemory, first: usize, count: usize) {
    exit_after_deadline("the service reads the remove event", || {
        // SAFETY: whole pages inside the mapping; their contents may go.
        let result = unsafe {
            libc::madvise(
                memory.base.add(first * PAGE_SIZE).cast(),
                count * PAGE_SIZE,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(result, 0, "{}", std::io::Error::last_os_error());
    });
}

#[test]
fn dropped_pages_read_as_zeros_and_their_units_are_missing_again() {
    let source = Arc::new(PatternSource::default());
    let Some((memory, service)) =
        served_through(&source, config(0), Userfault::register_reporting_removes)
    else {
        return;
    };
    // Every unit by a fault.
    read(&memory[0], [0, 4, 8]);
    read(&memory[1], [0, 4]);
    loaded(&service);
    // Pages 3 and 4: the last of unit 0, the first of unit 1.
    drop_handled(&service, &memory[0], 3, 2, 1);
    assert!(!service.is_loaded(), "units 0 and 1 are missing again");
    assert_eq!(read(&memory[0], [3]), [0], "a dropped page reads as zeros");
    assert!(!service.is_loaded(), "unit 1 is still missing");
    assert_eq!(read(&memory[0], [4]), [0]);
    loaded(&service);
    // The pages of those units that were not dropped kept their bytes.
    assert_eq!(read(&memory[0], 0..3), expected_pages(0, 0..3));
    assert_eq!(read(&memory[0], 5..8), expected_pages(0, 5..8));
    assert_eq!(read(&memory[1], 0..7), expected_pages(1, 0..7));
    let stats = service.stop();
    assert_eq!(stats.faults, 5 + 2);
    assert_eq!(source.fetched().len(), 5 + 2, "the two units fetched again");
}

#[test]
fn a_page_dropped_without_a_remove_event_reads_as_zeros() {
    let source = Arc::new(PatternSource::default());
    let Some((memory, service)) = served(&source, config(0)) else {
        return;
    };
    read(&memory[0], [0, 4, 8]);
    // Our own descriptors report no removes: the service learns of these
    // only when the pages fault.
    drop_pages(&memory[0], 3, 2);
    assert_eq!(read(&memory[0], [3, 4]), [0, 0]);
    assert_eq!(read(&memory[0], 0..3), expected_pages(0, 0..3));
    assert_eq!(read(&memory[0], 5..8), expected_pages(0, 5..8));
    let stats = service.stop();
    assert_eq!(stats.removes, 0);
    // Pages 2, 5 and 8 of the units, then the two dropped.
    assert_eq!(stats.zero_pages, 3 + 2);
    assert_eq!(source.fetched().len(), 3, "nothing fetched again");
}

#[test]
fn pages_placed_from_outside_are_left_alone_and_answer_faults() {
    let source = Arc::new(PatternSource::default());
    let Some((memory, service)) = served(&source, config(0)) else {
        return;
    };
    // Unit 1 of region 0 placed from outside, page 5 as zeros.
    let outside: Vec<u8> = [9u8, 0xEE, 9, 9]
        .iter()
        .flat_map(|&byte| [byte; PAGE_SIZE])
        .collect();
    let zero = [false, true, false, false];
    assert_eq!(service.place(0, 4, &outside, &zero).unwrap(), 4);
    assert_eq!(
        service.place(0, 4, &outside, &zero).unwrap(),
        0,
        "all there"
    );
    assert_eq!(read(&memory[0], 4..8), [9, 0, 9, 9]);
    assert_eq!(service.stats().faults, 0);
    // Units of four: a page placed does not make its unit present, so a
    // fault on page 8 still fetches unit 2.
    assert_eq!(read(&memory[0], [8, 9]), expected_pages(0, [8, 9]));
    assert_eq!(source.fetched(), [(0, 8, 2)]);
    assert!(
        !service.is_loaded(),
        "units 0 and 1 and region 1 are missing"
    );
    // Outside the region, or fewer bytes than pages: refused.
    for (region, first, pages) in [(0, 8, 3), (2, 0, 1)] {
        let refused = service.place(region, first, &outside, &zero[..pages]);
        assert!(
            matches!(refused, Err(FaultError::Place { source, .. })
                if source.raw_os_error() == Some(libc::EINVAL)),
            "region {region}, pages {first}+{pages}"
        );
    }
    assert!(service.place(1, 0, &outside[..PAGE_SIZE], &zero).is_err());
    drop(service);
    // Stopped: the registration ended, so a page never placed faults in
    // as zeros (nothing serves it any more).
    assert_eq!(read(&memory[0], [0, 1]), [0, 0]);
}

#[test]
fn with_units_of_one_page_placed_pages_count_as_present() {
    let source = Arc::new(PatternSource::default());
    let one_page_units = FaultConfig {
        unit_pages: 1,
        ..config(0)
    };
    let Some((memory, service)) = served(&source, one_page_units) else {
        return;
    };
    let outside = vec![3u8; 10 * PAGE_SIZE];
    assert_eq!(service.place(0, 0, &outside, &[false; 10]).unwrap(), 10);
    assert_eq!(service.place(1, 0, &outside, &[true; 7]).unwrap(), 7);
    assert!(service.is_loaded());
    assert_eq!(read(&memory[0], 0..10), [3; 10]);
    assert!(source.fetched().is_empty());
    assert_eq!(service.stop().zero_pages, 7);
}

#[test]
fn a_unit_the_source_cannot_read_stops_the_service_and_releases_the_memory() {
    let source = Arc::new(PatternSource {
        failing: Some((0, 4)),
        ..PatternSource::default()
    });
    let Some((memory, service)) = served(&source, config(0)) else {
        return;
    };
    // The thread reading page 5 is released: it finds zeros where the
    // unit's pages would have been.
    assert_eq!(read(&memory[0], [5, 6]), [0, 0]);
    assert!(service.has_failed());
    assert!(service.is_released());
    let page = [1u8; PAGE_SIZE];
    assert!(matches!(
        service.place(0, 0, &page, &[false]),
        Err(FaultError::Released { region: 0, page: 0 })
    ));
    let failure = service.wait_peer_gone(&AtomicBool::new(false));
    assert!(
        matches!(
            failure,
            Err(FaultError::Source {
                region: 0,
                page: 4,
                ..
            })
        ),
        "{failure:?}"
    );
    assert!(!service.has_failed(), "the failure was taken");
    assert!(service.take_failure().is_none());
}

#[test]
fn waiting_for_the_peer_ends_when_asked_to() {
    let source = Arc::new(PatternSource::default());
    let Some((_memory, service)) = served(&source, config(0)) else {
        return;
    };
    assert!(service.wait_peer_gone(&AtomicBool::new(true)).is_ok());
    assert!(!service.has_failed());
}

#[test]
fn a_region_of_more_than_64_units_is_tracked_unit_by_unit() {
    // 130 units of one page: three words of the bitmaps.
    let memory = AnonymousMemory::new(130);
    let source = Arc::new(PatternSource::default());
    let config = FaultConfig {
        unit_pages: 1,
        ..config(0)
    };
    let Some(service) = started(&[memory.region(0)], &source, config, Userfault::register) else {
        return;
    };
    let outside = vec![4u8; 129 * PAGE_SIZE];
    assert_eq!(service.place(0, 0, &outside, &[false; 129]).unwrap(), 129);
    assert!(!service.is_loaded());
    assert_eq!(read(&memory, [129]), expected_pages(0, [129]));
    loaded(&service);
    assert_eq!(read(&memory, [0, 64, 128]), [4; 3]);
    assert_eq!(source.fetched(), [(0, 129, 1)]);
}

/// Replaces pages `first..first + count` of `memory` with a fresh mapping,
/// which no userfaultfd serves: to the service, memory unmapped since.
fn map_afresh(memory: &AnonymousMemory, first: usize, count: usize) {
    // SAFETY: whole pages inside the mapping, replaced in place (the
    // mapping stays ours, to be unmapped whole when `memory` drops).
    let mapped = unsafe {
        libc::mmap(
            memory.base.add(first * PAGE_SIZE).cast(),
            count * PAGE_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    assert_ne!(
        mapped,
        libc::MAP_FAILED,
        "{}",
        std::io::Error::last_os_error()
    );
}

#[test]
fn a_placement_into_memory_unmapped_since_places_nothing_and_fails_nothing() {
    let source = Arc::new(PatternSource::default());
    let Some((memory, service)) = served(&source, config(0)) else {
        return;
    };
    map_afresh(&memory[1], 0, 7);
    let outside = vec![6u8; 4 * PAGE_SIZE];
    assert_eq!(service.place(1, 0, &outside, &[false; 4]).unwrap(), 0);
    assert!(!service.has_failed());
    assert_eq!(read(&memory[0], 0..10), expected_pages(0, 0..10));
}

#[test]
fn a_fault_on_memory_unmapped_while_its_unit_was_fetched_wakes_and_fails_nothing() {
    let (release, held) = std::sync::mpsc::channel();
    let source = Arc::new(PatternSource {
        held: Some(((0, 4), Mutex::new(held))),
        ..PatternSource::default()
    });
    let Some((memory, service)) = served(&source, config(0)) else {
        return;
    };
    tern_test_skip::wait::scope_within("the faulting thread is woken", |scope| {
        let page = memory[0].page(5).as_ptr() as usize;
        // SAFETY: a byte of the mapping, which outlives the scope.
        let reader = scope.spawn(move || unsafe { (page as *const u8).read_volatile() });
        tern_test_skip::wait::wait_until("the fault's unit is being fetched", || {
            source.fetched().contains(&(0, 4, 4))
        });
        // The guest's memory there is replaced while the service fetches:
        // its placement finds nothing of its own (ENOENT).
        map_afresh(&memory[0], 4, 4);
        release.send(()).unwrap();
        assert_eq!(reader.join().unwrap(), 0, "the fresh mapping's zeros");
    });
    assert!(!service.has_failed());
    assert_eq!(
        read(&memory[0], [0]),
        expected_pages(0, [0]),
        "still serving"
    );
}

#[test]
fn adjacent_regions_are_told_apart_at_their_border() {
    // Both regions in one mapping: region 1 begins where region 0 ends.
    let memory = AnonymousMemory::new(17);
    let split = 10 * PAGE_SIZE;
    // SAFETY: two disjoint ranges of the mapping, which outlives them.
    let regions = unsafe {
        let base = std::ptr::NonNull::new(memory.base).unwrap();
        [
            MemoryRegion::new(0, 0, base, split as u64),
            MemoryRegion::new(1, split as u64, base.add(split), 7 * PAGE_SIZE as u64),
        ]
    };
    let source = Arc::new(PatternSource::default());
    let Some(service) = started(&regions, &source, config(0), Userfault::register) else {
        return;
    };
    // Three pages from region 0's page 8 would run into region 1, which
    // the kernel cannot see (one mapping): the service refuses them.
    let outside = vec![9u8; 3 * PAGE_SIZE];
    let refused = service.place(0, 8, &outside, &[false; 3]);
    assert!(
        matches!(refused, Err(FaultError::Place { ref source, .. })
            if source.raw_os_error() == Some(libc::EINVAL)),
        "{refused:?}"
    );
    assert_eq!(read(&memory, [10]), expected_pages(1, [0]));
    assert_eq!(read(&memory, [9]), expected_pages(0, [9]));
    assert_eq!(source.fetched(), [(1, 0, 4), (0, 8, 2)]);
    drop(service);
}

fn one_page_units(loaders: usize) -> FaultConfig {
    FaultConfig {
        unit_pages: 1,
        ..config(loaders)
    }
}

#[test]
fn a_dropped_page_makes_its_own_unit_missing_and_no_other() {
    let source = Arc::new(PatternSource::default());
    let Some((memory, service)) = served_through(
        &source,
        one_page_units(0),
        Userfault::register_reporting_removes,
    ) else {
        return;
    };
    read(&memory[0], 0..10);
    read(&memory[1], 0..7);
    loaded(&service);
    // Pages of both address parities, so that a mask that cleared the
    // wrong bit would take in a neighbour for one of them.
    for (removes, page) in [(1, 3), (2, 4)] {
        drop_handled(&service, &memory[0], page, 1, removes);
        assert!(!service.is_loaded(), "page {page} is missing again");
        assert_eq!(read(&memory[0], [page]), [0]);
        loaded(&service);
    }
    assert_eq!(read(&memory[0], [2, 5]), expected_pages(0, [2, 5]));
}

#[test]
fn a_page_dropped_before_its_unit_was_placed_takes_no_unit_away() {
    let source = Arc::new(PatternSource::default());
    let Some((memory, mut service)) =
        served_through(&source, config(0), Userfault::register_reporting_removes)
    else {
        return;
    };
    drop_handled(&service, &memory[0], 1, 1, 1);
    assert!(!service.is_loaded(), "nothing was ever loaded");
    service.add_loaders(1).unwrap();
    service.wait_loaded(tern_test_skip::wait::DEADLINE).unwrap();
    assert_eq!(read(&memory[0], 0..4), [1, 0, 0, 4], "page 1 as zeros");
    assert_eq!(source.fetched().len(), 5, "every unit once");
}

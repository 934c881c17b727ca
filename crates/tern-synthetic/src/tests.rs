//! Guest-level tests: small memories so the suite stays fast.

use std::thread::sleep;
use std::time::{Duration, Instant};

use super::*;

const MIB: u64 = 1 << 20;

/// How long a test waits for a running dirtier before it fails: far beyond
/// any scheduling delay on a loaded machine, so only a hang reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

/// Polls `condition` until it holds, panicking with `what` after [`DEADLINE`].
fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition() {
        assert!(
            Instant::now() < deadline,
            "timed out after {DEADLINE:?} waiting until {what}"
        );
        sleep(Duration::from_millis(1));
    }
}

/// Waits until the running dirtier has written at least `pages` more pages.
fn wait_for_dirtied(guest: &SyntheticGuest, pages: u64) {
    let target = guest.dirtied_pages() + pages;
    wait_until(&format!("the dirtier wrote {pages} pages"), || {
        guest.dirtied_pages() >= target
    });
}

/// Most pages `threads` dirtiers at `rate` bytes/s slowed by `throttle`
/// percent can write in `elapsed`: credit is earned by elapsed time only,
/// and each thread may carry less than one page of credit from before.
fn rate_bound(rate: u64, throttle: u8, threads: u64, elapsed: Duration) -> u64 {
    let bytes = rate as f64 * f64::from(100 - throttle) / 100.0 * elapsed.as_secs_f64();
    (bytes / PAGE_SIZE as f64).ceil() as u64 + threads
}

fn config(memory_bytes: u64) -> SyntheticConfig {
    SyntheticConfig {
        memory_bytes,
        seed: 1,
        ..SyntheticConfig::default()
    }
}

/// All memory as one vector of bytes (regions are contiguous).
fn snapshot(guest: &SyntheticGuest) -> Vec<u8> {
    (0..guest.regions().len())
        .flat_map(|region| guest.region_bytes(region).unwrap())
        .collect()
}

fn changed_pages(before: &[u8], after: &[u8]) -> Vec<u64> {
    before
        .chunks(PAGE_SIZE)
        .zip(after.chunks(PAGE_SIZE))
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(page, _)| page as u64)
        .collect()
}

fn bitmaps_for(guest: &SyntheticGuest) -> Vec<DirtyBitmap> {
    guest
        .regions()
        .iter()
        .map(|region| DirtyBitmap::new(region.pages()))
        .collect()
}

/// Global page numbers set in per-region bitmaps.
fn dirty_pages(guest: &SyntheticGuest, bitmaps: &[DirtyBitmap]) -> Vec<u64> {
    guest
        .regions()
        .iter()
        .zip(bitmaps)
        .flat_map(|(region, bitmap)| {
            let first = region.guest_addr() / PAGE;
            bitmap.iter_dirty().map(move |page| first + page)
        })
        .collect()
}

#[test]
fn parses_mixes() {
    assert_eq!(
        "50:25:25".parse::<ContentMix>().unwrap(),
        ContentMix::default()
    );
    assert_eq!(
        " 10 : 0 :90".parse::<ContentMix>().unwrap(),
        ContentMix {
            zero: 10,
            random: 0,
            text: 90
        }
    );
    assert_eq!(
        "100:0:0".parse::<ContentMix>().unwrap().to_string(),
        "100:0:0"
    );
    for bad in [
        "",
        "50:50",
        "50:25:25:0",
        "a:b:c",
        "-1:50:51",
        "200:0:0",
        "50:25:",
    ] {
        let error = bad.parse::<ContentMix>().unwrap_err();
        assert!(
            matches!(error, SyntheticError::MixSyntax { .. }),
            "{bad}: {error}"
        );
        assert!(error.to_string().contains("50:25:25"), "{error}");
    }
    let error = "50:25:26".parse::<ContentMix>().unwrap_err();
    assert!(error.to_string().contains("sums to 101"), "{error}");
}

#[test]
fn rejects_bad_configs() {
    let check = |config: SyntheticConfig, expect: &str| {
        let error = SyntheticGuest::new(&config).unwrap_err().to_string();
        assert!(error.contains(expect), "{error:?} lacks {expect:?}");
    };
    check(config(0), "greater than zero");
    check(config(MIB + 1), "not a multiple");
    check(
        SyntheticConfig {
            regions: 0,
            ..config(MIB)
        },
        "at least 1",
    );
    check(
        SyntheticConfig {
            regions: 257,
            ..config(MIB)
        },
        "257 regions",
    );
    check(
        SyntheticConfig {
            mix: ContentMix {
                zero: 90,
                random: 90,
                text: 0,
            },
            ..config(MIB)
        },
        "sums to 180",
    );
    for threads in [0, 65] {
        check(
            SyntheticConfig {
                dirtier_threads: threads,
                ..config(MIB)
            },
            "thread count",
        );
    }
    assert!(SyntheticGuest::empty(&[]).is_err());
    assert!(SyntheticGuest::empty(&[MIB, 100]).is_err());
    assert!(SyntheticGuest::empty(&[MIB, 0]).is_err());
}

#[test]
fn regions_split_memory() {
    let guest = SyntheticGuest::new(&SyntheticConfig {
        regions: 3,
        ..config(MIB + 2 * PAGE)
    })
    .unwrap();
    let regions = guest.regions();
    let layout: Vec<(u32, u64, u64)> = regions
        .iter()
        .map(|r| (r.id(), r.guest_addr(), r.len()))
        .collect();
    assert_eq!(
        layout,
        vec![
            (0, 0, 86 * PAGE),
            (1, 86 * PAGE, 86 * PAGE),
            (2, 172 * PAGE, 86 * PAGE)
        ]
    );
    assert!(!guest.is_running());
    // Contiguous host memory too, which `snapshot` relies on.
    assert_eq!(
        regions[1].host_ptr() as usize - regions[0].host_ptr() as usize,
        86 * PAGE_SIZE
    );
}

#[test]
fn fill_follows_the_mix() {
    let guest = SyntheticGuest::new(&SyntheticConfig {
        mix: "40:35:25".parse().unwrap(),
        regions: 2,
        ..config(64 * MIB)
    })
    .unwrap();
    let mut counts = [0usize; 3];
    let memory = snapshot(&guest);
    for page in memory.chunks(PAGE_SIZE) {
        let kind = if page.iter().all(|&b| b == 0) {
            0
        } else if page
            .iter()
            .all(|&b| b == b' ' || b == b'\n' || b.is_ascii_graphic())
        {
            2
        } else {
            1
        };
        counts[kind] += 1;
    }
    let pages = memory.len() / PAGE_SIZE;
    let percent = counts.map(|count| count * 100 / pages);
    // The untouched zero pages come out at their share, so the fill really
    // skipped them; the other kinds likewise.
    assert!((39..=41).contains(&percent[0]), "{counts:?}");
    assert!((34..=36).contains(&percent[1]), "{counts:?}");
    assert!((24..=26).contains(&percent[2]), "{counts:?}");
}

#[test]
fn fill_is_deterministic() {
    let a = SyntheticGuest::new(&config(8 * MIB)).unwrap().digest();
    let b = SyntheticGuest::new(&config(8 * MIB)).unwrap().digest();
    let c = SyntheticGuest::new(&SyntheticConfig {
        seed: 2,
        ..config(8 * MIB)
    })
    .unwrap()
    .digest();
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_ne!(a, SyntheticGuest::empty(&[8 * MIB]).unwrap().digest());
}

#[test]
fn dirty_log_covers_every_change() {
    let mut guest = SyntheticGuest::new(&SyntheticConfig {
        regions: 2,
        dirty_rate_bytes_per_sec: 40 * MIB,
        working_set_bytes: 12 * MIB,
        dirtier_threads: 2,
        ..config(16 * MIB)
    })
    .unwrap();
    assert!(guest.is_running());
    assert_eq!(guest.working_set_pages(), 3072);
    let mut bitmaps = bitmaps_for(&guest);
    assert!(
        guest.sync_dirty_log(&mut bitmaps).is_err(),
        "log not started"
    );

    guest.pause().unwrap();
    let before = snapshot(&guest);
    guest.start_dirty_log().unwrap();
    guest.resume().unwrap();
    // A third of the working set lies in the second region; 300 random pages
    // miss it with a probability of (2/3)^300.
    wait_for_dirtied(&guest, 300);
    guest.pause().unwrap();
    guest.sync_dirty_log(&mut bitmaps).unwrap();
    let after = snapshot(&guest);

    let dirty = dirty_pages(&guest, &bitmaps);
    let changed = changed_pages(&before, &after);
    assert!(!changed.is_empty());
    assert!(changed.iter().all(|page| dirty.binary_search(page).is_ok()));
    assert!(dirty.iter().all(|&page| page < 3072));
    // Pages in the second region were dirtied too.
    assert!(bitmaps[1].count() > 0, "{}", bitmaps[1].count());

    let mut again = bitmaps_for(&guest);
    guest.sync_dirty_log(&mut again).unwrap();
    assert_eq!(again.iter().map(DirtyBitmap::count).sum::<u64>(), 0);

    // Bad bitmap shapes are errors.
    assert!(guest.sync_dirty_log(&mut again[..1]).is_err());
    let mut wrong = vec![DirtyBitmap::new(2048), DirtyBitmap::new(2047)];
    assert!(guest.sync_dirty_log(&mut wrong).is_err());

    // Once stopped, writes are no longer marked.
    guest.stop_dirty_log().unwrap();
    guest.step_dirtier(100).unwrap();
    guest.start_dirty_log().unwrap();
    guest.sync_dirty_log(&mut again).unwrap();
    assert_eq!(again.iter().map(DirtyBitmap::count).sum::<u64>(), 0);
}

#[test]
fn pause_resume_and_throttle() {
    const RATE: u64 = 64 * MIB;
    let mut guest = SyntheticGuest::new(&SyntheticConfig {
        dirty_rate_bytes_per_sec: RATE,
        ..config(8 * MIB)
    })
    .unwrap();
    wait_for_dirtied(&guest, 1);
    guest.pause().unwrap();
    assert!(!guest.is_running());
    let (digest, count) = (guest.digest(), guest.dirtied_pages());
    // Not waiting for an event: a dirtier that failed to park would write
    // during this pause, and nothing should happen.
    sleep(Duration::from_millis(50));
    assert_eq!(guest.digest(), digest);
    assert_eq!(guest.dirtied_pages(), count);

    // Unthrottled, the dirtier makes progress and never exceeds its rate.
    let started = Instant::now();
    guest.resume().unwrap();
    wait_for_dirtied(&guest, 400);
    guest.pause().unwrap();
    let full_speed = guest.dirtied_pages() - count;
    let bound = rate_bound(RATE, 0, 1, started.elapsed());
    assert!(full_speed <= bound, "{full_speed} pages, at most {bound}");
    assert_ne!(guest.digest(), digest);

    // Throttled by 99%, it still progresses but at most at 1% of its rate.
    // The bound is on pages per elapsed time, so a loaded machine, which
    // only slows the dirtier, cannot break it.
    assert!(guest.set_throttle(100).is_err());
    guest.set_throttle(99).unwrap();
    let count = guest.dirtied_pages();
    let started = Instant::now();
    guest.resume().unwrap();
    wait_for_dirtied(&guest, 1);
    wait_until("100 ms passed", || {
        started.elapsed() >= Duration::from_millis(100)
    });
    guest.pause().unwrap();
    let elapsed = started.elapsed();
    let throttled = guest.dirtied_pages() - count;
    let bound = rate_bound(RATE, 99, 1, elapsed);
    assert!(
        throttled <= bound,
        "99% throttle: {throttled} pages in {elapsed:?}, at most {bound}"
    );
    // The same time unthrottled would allow 100 times as many pages.
    assert!(bound * 50 < rate_bound(RATE, 0, 1, elapsed));
}

#[test]
fn state_moves_the_dirtier() {
    let mut source = SyntheticGuest::new(&SyntheticConfig {
        regions: 2,
        dirty_rate_bytes_per_sec: 32 * MIB,
        working_set_bytes: 3 * MIB,
        dirtier_threads: 3,
        ..config(8 * MIB)
    })
    .unwrap();
    source.set_throttle(20).unwrap();
    wait_for_dirtied(&source, 1);
    assert!(source.save_state().is_err(), "running");
    source.pause().unwrap();
    let sections = source.save_state().unwrap();
    assert_eq!(sections.len(), 1);
    assert_eq!(sections[0].name, SECTION_NAME);
    assert_eq!(sections[0].version, SECTION_VERSION);

    let lens: Vec<u64> = source.regions().iter().map(MemoryRegion::len).collect();
    assert_eq!(lens, [4 * MIB, 4 * MIB]);
    let mut destination = SyntheticGuest::empty(&lens).unwrap();
    assert!(!destination.is_running());
    destination.restore_state(&sections).unwrap();
    assert_eq!(destination.save_state().unwrap(), sections);
    assert_eq!(destination.throttle(), 20);
    assert_eq!(destination.working_set_pages(), 768);

    // The migration would copy memory; a raw copy stands in for it here.
    for (from, to) in source.regions().iter().zip(destination.regions()) {
        assert_eq!(from.len(), to.len());
        // SAFETY: both regions are live mappings of the same length, in
        // different guests, and neither guest is running.
        unsafe {
            std::ptr::copy_nonoverlapping(from.host_ptr(), to.host_ptr(), from.len() as usize);
        }
    }
    assert_eq!(source.digest(), destination.digest());

    // Both sides continue the same dirtying sequence.
    source.step_dirtier(5000).unwrap();
    destination.step_dirtier(5000).unwrap();
    assert_eq!(source.digest(), destination.digest());
    assert_eq!(
        source.save_state().unwrap(),
        destination.save_state().unwrap()
    );

    // Running threads on the destination dirty only the working set.
    let before = snapshot(&destination);
    destination.set_throttle(0).unwrap();
    destination.resume().unwrap();
    assert!(destination.step_dirtier(1).is_err(), "running");
    wait_for_dirtied(&destination, 100);
    destination.pause().unwrap();
    let changed = changed_pages(&before, &snapshot(&destination));
    assert!(!changed.is_empty());
    assert!(changed.iter().all(|&page| page < 768));
}

#[test]
fn restore_rejects_bad_sections() {
    let mut source = SyntheticGuest::new(&config(4 * MIB)).unwrap();
    let sections = source.save_state().unwrap();
    let mut destination = SyntheticGuest::empty(&[4 * MIB]).unwrap();

    let error = |guest: &mut SyntheticGuest, sections: &[StateSection]| {
        guest.restore_state(sections).unwrap_err().to_string()
    };
    assert!(error(&mut destination, &[]).contains("missing"));
    let mut extra = sections.clone();
    extra.push(StateSection {
        name: "serial".into(),
        version: 1,
        data: vec![],
    });
    assert!(error(&mut destination, &extra).contains("\"serial\""));
    let twice = [sections[0].clone(), sections[0].clone()];
    assert!(error(&mut destination, &twice).contains("more than once"));

    let mut smaller = SyntheticGuest::empty(&[2 * MIB]).unwrap();
    assert!(error(&mut smaller, &sections).contains("1024 pages"));

    let mut rng = rng::WyRand(5);
    for _ in 0..2000 {
        let len = rng.below(120) as usize;
        let mut section = sections[0].clone();
        section.data = (0..len).map(|_| rng.next_u64() as u8).collect();
        assert!(destination.restore_state(&[section]).is_err());
    }
    destination.restore_state(&sections).unwrap();
}

#[test]
fn rapid_pause_resume_and_restore() {
    let mut guest = SyntheticGuest::new(&SyntheticConfig {
        dirty_rate_bytes_per_sec: 400 * MIB,
        dirtier_threads: 4,
        ..config(MIB / 4)
    })
    .unwrap();
    let start = Instant::now();
    for round in 0..200 {
        guest.pause().unwrap();
        let count = guest.dirtied_pages();
        std::thread::yield_now();
        assert_eq!(guest.dirtied_pages(), count, "round {round}");
        if round % 50 == 0 {
            // Restoring the guest's own state recreates its threads.
            let sections = guest.save_state().unwrap();
            guest.restore_state(&sections).unwrap();
        }
        guest.resume().unwrap();
    }
    // A pause that waited for a dirtier that never parks would hang; this
    // bound is only there to turn such a hang into a failure.
    assert!(
        start.elapsed() < DEADLINE,
        "200 pause/resume rounds took {:?}",
        start.elapsed()
    );
    // Dropping a running guest stops its threads before unmapping.
    drop(guest);
}

/// Kilobytes of private anonymous memory backing the mapping that starts at
/// `ptr`, from /proc/self/smaps: pages never touched, or only read (mapped
/// to the kernel's shared zero page), do not count.
fn anonymous_kib(ptr: *const u8) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let head = format!("{:x}-", ptr as usize);
    let mut lines = smaps.lines().skip_while(|line| !line.starts_with(&head));
    assert!(lines.next().is_some(), "no mapping at {ptr:?}");
    lines
        .find_map(|line| line.strip_prefix("Anonymous:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn touching_zero_pages_gives_each_its_own_memory_and_changes_nothing() {
    let guest = SyntheticGuest::new(&SyntheticConfig {
        memory_bytes: 8 << 20,
        mix: ContentMix::new(50, 25, 25).unwrap(),
        ..SyntheticConfig::default()
    })
    .unwrap();
    let region = &tern_engine::GuestMemory::regions(&guest)[0];
    let (ptr, len) = (region.host_ptr().cast_const(), region.len());
    let before = guest.digest();
    let private_before = anonymous_kib(ptr);
    assert!(
        private_before < len / 1024,
        "the fill leaves zero pages without memory"
    );
    assert_eq!(guest.touch_zero_pages(), len / PAGE_SIZE as u64);
    // At least the whole guest: the kernel may merge a neighbouring
    // anonymous mapping into the same entry of smaps.
    let private_after = anonymous_kib(ptr);
    assert!(
        private_after >= len / 1024,
        "every page has its own memory: {private_after} KiB of {} KiB",
        len / 1024
    );
    assert_eq!(guest.digest(), before);
}

//! Diff snapshots of the synthetic guest: a diff holds only the chunks
//! that changed since its base, restores eagerly and lazily on its base
//! (and on a diff of a diff), every restore proved by the digest; a diff
//! alone, on the wrong base or on a corrupted base is refused with one
//! line, and no guest resumes.

// Test data: sizes and counters of small guests.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use crate::common;

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::MIB;
use common::snapshot::{empty, lazy_or_skip, on, one_line};
use tern_engine::snapshot::{SaveConfig, SaveStats, SnapshotFile, merge};
use tern_engine::{GuestControl, PAGE_SIZE};
use tern_synthetic::{ContentMix, SyntheticConfig, SyntheticGuest};

const LOADED_WITHIN: Duration = Duration::from_secs(60);
const MEMORY: u64 = 16 * MIB;
const PAGES: u64 = MEMORY / PAGE_SIZE as u64;

/// A guest of two regions whose dirtier writes its first quarter.
fn source(dirty_rate: u64) -> SyntheticGuest {
    common::guest_with(SyntheticConfig {
        memory_bytes: MEMORY,
        regions: 2,
        mix: ContentMix::default(),
        seed: 2525,
        dirty_rate_bytes_per_sec: dirty_rate,
        working_set_bytes: MEMORY / 4,
        dirtier_threads: 1,
    })
}

/// Saves `guest` (paused, left paused) to `path`, a diff on `base` if
/// given. Returns the statistics and the guest's memory hash.
fn save(guest: &mut SyntheticGuest, path: &Path, base: Option<&Path>) -> (SaveStats, u128) {
    let mut config = SaveConfig::default();
    config.resume = false;
    config.diff_base = base.map(Path::to_owned);
    let stats = tern_engine::save(guest, path, &config).expect("save");
    (stats, guest.digest())
}

/// Disk the file takes (holes take none).
fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// A base saved, then a diff after the guest dirtied `steps` pages.
struct Pair {
    _dir: tempfile::TempDir,
    base: PathBuf,
    diff: PathBuf,
    stats: SaveStats,
    memory: u128,
}

fn base_and_diff(steps: u64) -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.tern");
    let diff = dir.path().join("diff.tern");
    let mut guest = source(0);
    let (_, base_memory) = save(&mut guest, &base, None);
    guest.step_dirtier(steps).unwrap();
    let (stats, memory) = save(&mut guest, &diff, Some(&base));
    assert_ne!(memory, base_memory, "the dirtier changed nothing");
    Pair {
        _dir: dir,
        base,
        diff,
        stats,
        memory,
    }
}

#[test]
fn a_diff_holds_only_changed_chunks_and_restores_eagerly_on_its_base() {
    let pair = base_and_diff(200);
    let stats = &pair.stats;
    // The dirtier writes only its working set, the first quarter of
    // memory: the diff holds chunks of it and nothing else.
    let working_set = PAGES / 4;
    assert!(stats.normal + stats.duplicate <= working_set, "{stats:?}");
    assert!(stats.unchanged_pages >= PAGES - working_set, "{stats:?}");
    assert_eq!(
        stats.normal + stats.duplicate + stats.unchanged_pages,
        PAGES
    );
    assert!(stats.base_digest.is_some(), "{stats:?}");
    assert!(
        allocated(&pair.diff) * 2 < allocated(&pair.base),
        "diff {} bytes on disk, base {}",
        allocated(&pair.diff),
        allocated(&pair.base)
    );
    let restored = tern_engine::restore(&pair.diff, &on(&[&pair.base]), empty).unwrap();
    assert_eq!(restored.guest.digest(), pair.memory);
    assert_eq!(restored.stats.digest, stats.digest);
}

#[test]
fn a_diff_restores_lazily_on_its_base() {
    let pair = base_and_diff(300);
    let Some(lazy) = lazy_or_skip(&pair.diff, &on(&[&pair.base])) else {
        return;
    };
    let (mut guest, stats) = lazy.wait_loaded(LOADED_WITHIN).unwrap();
    // The digest of the pages the loaders and faults verified.
    assert_eq!(stats.digest, pair.stats.digest);
    guest.pause().unwrap();
    assert_eq!(guest.digest(), pair.memory);
}

#[test]
fn a_diff_of_a_diff_restores_on_both_bases_eagerly_and_lazily() {
    let dir = tempfile::tempdir().unwrap();
    let [base, first, second] = ["base", "first", "second"].map(|name| dir.path().join(name));
    let mut guest = source(0);
    save(&mut guest, &base, None);
    guest.step_dirtier(150).unwrap();
    save(&mut guest, &first, Some(&base));
    guest.step_dirtier(150).unwrap();
    let (stats, memory) = save(&mut guest, &second, Some(&first));
    let restored = tern_engine::restore(&second, &on(&[&base, &first]), empty).unwrap();
    assert_eq!(restored.guest.digest(), memory);
    let Some(lazy) = lazy_or_skip(&second, &on(&[&base, &first])) else {
        return;
    };
    let (_, lazy_stats) = lazy.wait_loaded(LOADED_WITHIN).unwrap();
    assert_eq!(lazy_stats.digest, stats.digest);
    // Only the base below the first diff is refused.
    let line = one_line(&tern_engine::restore(&second, &on(&[&base]), empty).unwrap_err());
    assert!(line.contains("not its base"), "{line}");
}

/// base, first diff, second diff merged into one full snapshot: it
/// restores alone to the second diff's memory, and a diff taken on the
/// second diff restores on the merge (a base is named by its memory).
#[test]
fn a_merge_of_a_diff_and_its_bases_is_a_full_snapshot_of_the_same_memory() {
    let dir = tempfile::tempdir().unwrap();
    let [base, first, second, third, merged] =
        ["base", "first", "second", "third", "merged"].map(|name| dir.path().join(name));
    let mut guest = source(0);
    save(&mut guest, &base, None);
    guest.step_dirtier(150).unwrap();
    save(&mut guest, &first, Some(&base));
    guest.step_dirtier(150).unwrap();
    let (second_stats, memory) = save(&mut guest, &second, Some(&first));
    let stats = merge(&[base.clone(), first.clone()], &second, &merged).unwrap();
    assert_eq!(stats.digest, second_stats.digest);
    assert_eq!(stats.layers, 3);
    assert_eq!(stats.pages_written + stats.zero_pages, PAGES);
    assert!(!SnapshotFile::open(&merged).unwrap().metadata().is_diff());
    let restored = tern_engine::restore(&merged, &on(&[]), empty).unwrap();
    assert_eq!(restored.guest.digest(), memory);
    guest.step_dirtier(150).unwrap();
    let (_, later) = save(&mut guest, &third, Some(&second));
    let restored = tern_engine::restore(&third, &on(&[&merged]), empty).unwrap();
    assert_eq!(restored.guest.digest(), later);
    // The output may not be an input, and a diff alone is no snapshot.
    let line = one_line(&merge(std::slice::from_ref(&base), &first, &base).unwrap_err());
    assert!(line.contains("would replace its input"), "{line}");
    let line = one_line(&merge(&[], &second, &merged).unwrap_err());
    assert!(line.contains("is a diff snapshot"), "{line}");
}

#[test]
fn a_live_diff_of_a_dirtying_guest_restores_to_its_memory_at_the_pause() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.tern");
    let diff = dir.path().join("live.tern");
    let mut guest = source(64 * MIB);
    save(&mut guest, &base, None);
    // The save starts as the guest resumes: its first pass finds most
    // chunks still the base's, and the guest dirties some of them after
    // the pass compared them, which the later passes must add to the diff.
    guest.resume().unwrap();
    let mut config = SaveConfig::default();
    config.live = true;
    config.resume = false;
    config.final_pass_pages = 16;
    config.max_passes = 4;
    config.diff_base = Some(base.clone());
    let stats = tern_engine::save(&mut guest, &diff, &config).unwrap();
    assert!(stats.unchanged_pages > 0 && stats.passes >= 2, "{stats:?}");
    let memory = guest.digest();
    let restored = tern_engine::restore(&diff, &on(&[&base]), empty).unwrap();
    assert_eq!(restored.guest.digest(), memory);
}

#[test]
fn a_diff_alone_or_on_the_wrong_base_is_refused_with_one_line() {
    let pair = base_and_diff(100);
    let alone = one_line(&tern_engine::restore(&pair.diff, &on(&[]), empty).unwrap_err());
    assert!(alone.contains("is a diff snapshot"), "{alone}");
    assert!(alone.contains("name its base first"), "{alone}");
    // Another full snapshot of the same shape, other memory.
    let other = pair.diff.with_file_name("other.tern");
    let mut guest = source(0);
    guest.pause().unwrap();
    guest.step_dirtier(10).unwrap();
    save(&mut guest, &other, None);
    let wrong = one_line(&tern_engine::restore(&pair.diff, &on(&[&other]), empty).unwrap_err());
    assert!(wrong.contains("not its base"), "{wrong}");
    let lazy = tern_engine::restore_lazy(&pair.diff, &on(&[&other]), empty).unwrap_err();
    assert!(one_line(&lazy).contains("not its base"));
    // A full snapshot named above another.
    let full = one_line(&tern_engine::restore(&other, &on(&[&pair.base]), empty).unwrap_err());
    assert!(full.contains("is a full snapshot"), "{full}");
    // Opening the diff alone (as `tern serve-pages` does) is refused too.
    let line = one_line(&SnapshotFile::open(&pair.diff).unwrap_err());
    assert!(line.contains("is a diff snapshot"), "{line}");
}

/// A base page the diff leaves to its base is corrupted: the chunk read
/// from the base no longer matches the diff's hash for it.
#[test]
fn a_corrupted_base_under_a_diff_is_refused_by_its_chunk() {
    let pair = base_and_diff(100);
    let base = SnapshotFile::open(&pair.base).unwrap();
    let diff = SnapshotFile::open_layers(std::slice::from_ref(&pair.base), &pair.diff).unwrap();
    let region = base.metadata().regions.len() - 1;
    let page = (0..base.metadata().regions[region].pages())
        .rev()
        .find(|&page| {
            base.metadata().is_present(region, page) && !diff.metadata().is_changed(region, page)
        })
        .expect("a present page the diff leaves to the base");
    let offset = base.metadata().regions[region].slot_offset(page).unwrap() + 7;
    let file = OpenOptions::new().write(true).open(&pair.base).unwrap();
    file.write_all_at(&[0xee], offset).unwrap();
    let line = one_line(&tern_engine::restore(&pair.diff, &on(&[&pair.base]), empty).unwrap_err());
    assert!(
        line.contains(&format!(
            "(on its base): chunk {} of region {region}",
            page / 16
        )),
        "{line}"
    );
}

#[test]
fn a_diff_on_a_base_of_another_shape_is_refused_and_the_guest_runs_on() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("small.tern");
    let mut small = common::guest(4 * MIB, 0);
    let mut config = SaveConfig::default();
    config.resume = false;
    tern_engine::save(&mut small, &base, &config).unwrap();
    let mut guest = source(16 * MIB);
    let mut config = SaveConfig::default();
    config.diff_base = Some(base.clone());
    let error = tern_engine::save(&mut guest, &dir.path().join("d"), &config).unwrap_err();
    let line = one_line(&error);
    assert!(line.contains("the base"), "{line}");
    assert!(line.contains("does not fit this guest"), "{line}");
    assert!(guest.is_running());
    // A diff may not replace its own base.
    config.diff_base = Some(base.clone());
    let error = tern_engine::save(&mut small, &base, &config).unwrap_err();
    assert!(
        one_line(&error).contains("its own base"),
        "{}",
        one_line(&error)
    );
}

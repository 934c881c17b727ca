//! Tracked diff snapshots of the synthetic guest (Firecracker's
//! `track_dirty_pages` + `snapshot_type: Diff`): the dirty log runs from
//! one save to the next, and the diff holds exactly the pages written
//! since its base, no whole chunks; it restores eagerly and lazily on its
//! base to the exact digest, a diff of a diff merges into a full
//! snapshot, and a tracked diff on any other snapshot is refused in one
//! line with the guest running on.

// Test data: sizes and counters of small guests.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::MIB;
use common::snapshot::{empty, lazy_or_skip, on, one_line};
use tern_engine::snapshot::{SaveConfig, SaveStats, SnapshotFile, merge};
use tern_engine::{DirtyTracker, GuestControl, PAGE_SIZE};
use tern_synthetic::{ContentMix, SyntheticConfig, SyntheticGuest};

const LOADED_WITHIN: Duration = Duration::from_secs(60);
const MEMORY: u64 = 16 * MIB;
const PAGES: u64 = MEMORY / PAGE_SIZE as u64;

/// A guest of two regions; its dirtier (when it runs) writes the first
/// quarter of memory.
fn source(dirty_rate: u64) -> SyntheticGuest {
    common::guest_with(SyntheticConfig {
        memory_bytes: MEMORY,
        regions: 2,
        mix: ContentMix::default(),
        seed: 2526,
        dirty_rate_bytes_per_sec: dirty_rate,
        working_set_bytes: MEMORY / 4,
        dirtier_threads: 1,
    })
}

fn config(base: Option<&Path>) -> SaveConfig {
    let mut config = SaveConfig::default();
    config.resume = false;
    config.diff_base = base.map(Path::to_owned);
    config
}

/// A tracked save (paused, left paused), a diff on `base` if given.
fn save_tracked(
    guest: &mut SyntheticGuest,
    tracker: &mut DirtyTracker,
    path: &Path,
    base: Option<&Path>,
) -> SaveStats {
    tern_engine::save_tracked(guest, path, &config(base), tracker).expect("tracked save")
}

/// One page in every `stride`, from `first`: a spread across all memory
/// (both regions), no two in one 16-page chunk when `stride >= 16`.
fn spread(first: u64, stride: u64) -> Vec<u64> {
    (first..PAGES).step_by(stride as usize).collect()
}

/// Pages a snapshot file marks changed and present, over all regions.
fn changed_and_present(diff: &Path, base: &Path) -> (u64, u64) {
    let file = SnapshotFile::open_layers(&[base.to_owned()], diff).unwrap();
    let metadata = file.metadata();
    let count = |bitmaps: &[Vec<u64>]| -> u64 {
        bitmaps
            .iter()
            .flatten()
            .map(|word| u64::from(word.count_ones()))
            .sum()
    };
    (count(&metadata.changed), count(&metadata.present))
}

struct Tracked {
    dir: tempfile::TempDir,
    base: PathBuf,
    diff: PathBuf,
    stats: SaveStats,
    dirtied: Vec<u64>,
    memory: u128,
}

/// A tracked base, then a tracked diff after 1 % of pages, spread across
/// memory, were written.
fn tracked_base_and_diff() -> Tracked {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.tern");
    let diff = dir.path().join("diff.tern");
    let mut guest = source(0);
    let mut tracker = DirtyTracker::new();
    let base_stats = save_tracked(&mut guest, &mut tracker, &base, None);
    assert!(
        base_stats.tracked && tracker.is_tracking(),
        "{base_stats:?}"
    );
    let dirtied = spread(7, 100);
    guest.dirty_pages(&dirtied).unwrap();
    let stats = save_tracked(&mut guest, &mut tracker, &diff, Some(&base));
    Tracked {
        dir,
        base,
        diff,
        stats,
        dirtied,
        memory: guest.digest(),
    }
}

#[test]
fn a_tracked_diff_holds_exactly_the_dirtied_pages_and_restores_eagerly() {
    let tracked = tracked_base_and_diff();
    let stats = &tracked.stats;
    let dirtied = tracked.dirtied.len() as u64;
    // Every dirtied page was made non-zero: each is one page written.
    assert_eq!(stats.normal, dirtied, "{stats:?}");
    assert_eq!(stats.duplicate, 0, "{stats:?}");
    assert_eq!(stats.unchanged_pages, PAGES - dirtied, "{stats:?}");
    assert_eq!(
        changed_and_present(&tracked.diff, &tracked.base),
        (dirtied, dirtied)
    );
    let restored = tern_engine::restore(&tracked.diff, &on(&[&tracked.base]), empty).unwrap();
    assert_eq!(restored.guest.digest(), tracked.memory);
    assert_eq!(restored.stats.digest, stats.digest);
}

/// The same change, diffed by content: whole chunks, 16 times the pages.
#[test]
fn a_diff_by_content_of_the_same_pages_writes_whole_chunks() {
    let tracked = tracked_base_and_diff();
    let by_content = tracked.dir.path().join("by-content.tern");
    let mut guest = source(0);
    guest.dirty_pages(&tracked.dirtied).unwrap();
    assert_eq!(guest.digest(), tracked.memory);
    let stats = tern_engine::save(&mut guest, &by_content, &config(Some(&tracked.base))).unwrap();
    assert_eq!(stats.digest, tracked.stats.digest);
    let (changed, _) = changed_and_present(&by_content, &tracked.base);
    assert!(
        changed >= 15 * tracked.dirtied.len() as u64,
        "{changed} pages by content, {} dirtied",
        tracked.dirtied.len()
    );
}

#[test]
fn a_tracked_diff_restores_lazily_on_its_base() {
    let tracked = tracked_base_and_diff();
    let Some(lazy) = lazy_or_skip(&tracked.diff, &on(&[&tracked.base])) else {
        return;
    };
    let (mut guest, stats) = lazy.wait_loaded(LOADED_WITHIN).unwrap();
    assert_eq!(stats.digest, tracked.stats.digest);
    guest.pause().unwrap();
    assert_eq!(guest.digest(), tracked.memory);
}

/// base, a tracked diff, a tracked diff of it: restores on both, merges
/// into a full snapshot of the same memory.
#[test]
fn a_tracked_diff_of_a_tracked_diff_restores_and_merges() {
    let dir = tempfile::tempdir().unwrap();
    let [base, first, second, merged] =
        ["base", "first", "second", "merged"].map(|name| dir.path().join(name));
    let mut guest = source(0);
    let mut tracker = DirtyTracker::new();
    save_tracked(&mut guest, &mut tracker, &base, None);
    guest.dirty_pages(&spread(3, 64)).unwrap();
    save_tracked(&mut guest, &mut tracker, &first, Some(&base));
    let second_pages = spread(5, 128);
    guest.dirty_pages(&second_pages).unwrap();
    let stats = save_tracked(&mut guest, &mut tracker, &second, Some(&first));
    assert_eq!(stats.normal, second_pages.len() as u64, "{stats:?}");
    let memory = guest.digest();
    let restored = tern_engine::restore(&second, &on(&[&base, &first]), empty).unwrap();
    assert_eq!(restored.guest.digest(), memory);
    let merge_stats = merge(&[base.clone(), first.clone()], &second, &merged).unwrap();
    assert_eq!(merge_stats.digest, stats.digest);
    let restored = tern_engine::restore(&merged, &on(&[]), empty).unwrap();
    assert_eq!(restored.guest.digest(), memory);
}

/// A live tracked diff of a guest dirtying memory: what the log reported
/// since the base, then precopy passes, restores to the memory at the
/// pause.
#[test]
fn a_live_tracked_diff_of_a_dirtying_guest_restores_to_its_memory_at_the_pause() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.tern");
    let diff = dir.path().join("live.tern");
    let mut guest = source(64 * MIB);
    let mut tracker = DirtyTracker::new();
    save_tracked(&mut guest, &mut tracker, &base, None);
    guest.resume().unwrap();
    let mut live = config(Some(&base));
    live.live = true;
    live.final_pass_pages = 16;
    live.max_passes = 4;
    let stats = tern_engine::save_tracked(&mut guest, &diff, &live, &mut tracker).unwrap();
    // The dirtier writes only the first quarter of memory.
    assert!(stats.unchanged_pages >= PAGES - PAGES / 4, "{stats:?}");
    let memory = guest.digest();
    let restored = tern_engine::restore(&diff, &on(&[&base]), empty).unwrap();
    assert_eq!(restored.guest.digest(), memory);
}

#[test]
fn a_tracked_diff_on_another_snapshot_is_refused_with_one_line_and_the_guest_runs_on() {
    let dir = tempfile::tempdir().unwrap();
    let [base, other, diff] = ["base", "other", "diff"].map(|name| dir.path().join(name));
    let mut guest = source(0);
    let mut tracker = DirtyTracker::new();
    // No log runs yet: a tracked diff has nothing to go on.
    tern_engine::save(&mut guest, &other, &config(None)).unwrap();
    guest.dirty_pages(&[1]).unwrap();
    let line = one_line(
        &tern_engine::save_tracked(&mut guest, &diff, &config(Some(&other)), &mut tracker)
            .unwrap_err(),
    );
    assert!(line.contains("no dirty log runs since"), "{line}");
    save_tracked(&mut guest, &mut tracker, &base, None);
    guest.dirty_pages(&[2, 300]).unwrap();
    guest.resume().unwrap();
    let line = one_line(
        &tern_engine::save_tracked(&mut guest, &diff, &config(Some(&other)), &mut tracker)
            .unwrap_err(),
    );
    assert!(line.contains("not the base of a tracked diff"), "{line}");
    assert!(guest.is_running(), "the refused save left the guest paused");
    // The tracker still tracks from its base: the next diff on it holds
    // the pages written since, and restores.
    guest.pause().unwrap();
    let stats = save_tracked(&mut guest, &mut tracker, &diff, Some(&base));
    assert_eq!(stats.normal, 2, "{stats:?}");
    let restored = tern_engine::restore(&diff, &on(&[&base]), empty).unwrap();
    assert_eq!(restored.guest.digest(), guest.digest());
}

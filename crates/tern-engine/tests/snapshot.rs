//! Snapshots of the synthetic guest: saved paused and live, restored
//! eagerly and lazily, every restore proved by the guest's digest; and
//! every kind of bad file refused with one line, no guest resumed on it.

use crate::common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use common::MIB;
use tern_engine::snapshot::{SaveConfig, SnapshotFile};
use tern_engine::{GuestControl, GuestMemory, PAGE_SIZE, RestoreConfig, SnapshotError};
use tern_synthetic::{ContentMix, SyntheticConfig, SyntheticGuest};

use common::snapshot::{empty, lazy_or_skip, one_line};

const LOADED_WITHIN: Duration = Duration::from_secs(60);

fn source(memory: u64, dirty_rate: u64, regions: u32) -> SyntheticGuest {
    common::guest_with(SyntheticConfig {
        memory_bytes: memory,
        regions,
        mix: ContentMix::default(),
        seed: 25,
        dirty_rate_bytes_per_sec: dirty_rate,
        working_set_bytes: memory / 4,
        dirtier_threads: 1,
    })
}

fn paused_save(guest: &mut SyntheticGuest, path: &Path) -> u128 {
    let config = {
        let mut config = SaveConfig::default();
        config.resume = false;
        config
    };
    tern_engine::save(guest, path, &config).expect("save");
    guest.digest()
}

#[test]
fn a_paused_save_restores_eagerly_to_the_same_memory_and_runs_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("guest.tern");
    let mut guest = source(16 * MIB, 32 * MIB, 2);
    let digest = paused_save(&mut guest, &path);
    let file_len = std::fs::metadata(&path).unwrap().len();
    // Fixed slots: memory plus metadata, never more.
    assert!(file_len <= 16 * MIB + 3 * MIB, "{file_len}");
    let mut restored = tern_engine::restore(&path, &held(), empty).unwrap();
    assert_eq!(restored.guest.digest(), digest);
    assert!(restored.stats.zero_pages > 0, "zero pages are holes");
    runs_on(&mut restored.guest);
}

/// Restores without resuming, so the digest can be compared first.
fn held() -> RestoreConfig {
    {
        let mut config = RestoreConfig::default();
        config.resume = false;
        config
    }
}

/// Resumes the guest and proves it dirties memory again (its dirtier
/// carried on from the saved state).
fn runs_on(guest: &mut SyntheticGuest) {
    guest.resume().unwrap();
    let before = guest.dirtied_pages();
    common::wait_until("the restored guest dirties memory", || {
        guest.dirtied_pages() > before
    });
}

#[test]
fn a_live_save_of_a_dirtying_guest_restores_to_its_memory_at_the_pause() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("live.tern");
    let mut guest = source(32 * MIB, 256 * MIB, 1);
    let config = {
        let mut config = SaveConfig::default();
        config.live = true;
        config.resume = false;
        config.final_pass_pages = 64;
        config.max_passes = 5;
        config
    };
    let stats = tern_engine::save(&mut guest, &path, &config).unwrap();
    assert!(stats.passes >= 2, "{stats:?}");
    let digest = guest.digest();
    assert!(std::fs::metadata(&path).unwrap().len() <= 32 * MIB + 2 * MIB);
    let mut restored = tern_engine::restore(&path, &held(), empty).unwrap();
    assert_eq!(restored.guest.digest(), digest);
    runs_on(&mut restored.guest);
}

/// A live save that resumes the guest lets it run before the file is
/// finished: the guest runs on, and the file restores, whole, to the
/// digest the save reported.
#[test]
fn a_live_save_that_resumes_the_guest_restores_to_the_memory_of_its_pause() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("resumed.tern");
    let mut guest = source(32 * MIB, 256 * MIB, 2);
    let config = {
        let mut config = SaveConfig::default();
        config.live = true;
        config.final_pass_pages = 64;
        config.max_passes = 4;
        config
    };
    let stats = tern_engine::save(&mut guest, &path, &config).unwrap();
    assert!(guest.is_running(), "the guest runs on after the save");
    let restored = tern_engine::restore(&path, &held(), empty).unwrap();
    // The restore checked every chunk and the memory it loaded against
    // the file's digest: the file is whole and is what the save reported.
    assert_eq!(restored.stats.digest, stats.digest);
}

/// Without waiting for the disk the file is still complete and restores
/// (the kernel writes it back later).
#[test]
fn a_save_that_does_not_wait_for_the_disk_restores_to_the_same_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nosync.tern");
    let mut guest = source(8 * MIB, 0, 1);
    let config = {
        let mut config = SaveConfig::default();
        config.sync = false;
        config.resume = false;
        config
    };
    tern_engine::save(&mut guest, &path, &config).unwrap();
    let restored = tern_engine::restore(&path, &held(), empty).unwrap();
    assert_eq!(restored.guest.digest(), guest.digest());
}

#[test]
fn a_lazy_restore_runs_at_once_and_ends_with_the_saved_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lazy.tern");
    // No dirtier: the restored guest's memory stays what was saved, so
    // the digest compares while the guest runs.
    let mut guest = source(16 * MIB, 0, 1);
    let digest = paused_save(&mut guest, &path);
    let Some(lazy) = lazy_or_skip(&path, &RestoreConfig::default()) else {
        return;
    };
    assert!(lazy.guest().is_running());
    let (mut restored, stats) = lazy.wait_loaded(LOADED_WITHIN).unwrap();
    assert!(stats.faults.fault_pages + stats.faults.prefetched_pages > 0);
    restored.pause().unwrap();
    assert_eq!(restored.digest(), digest);
}

#[test]
fn a_lazily_restored_guest_dirties_memory_while_it_loads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("busy.tern");
    let mut guest = source(16 * MIB, 64 * MIB, 1);
    paused_save(&mut guest, &path);
    let config = {
        let mut config = RestoreConfig::default();
        config.background = false;
        config
    };
    let Some(lazy) = lazy_or_skip(&path, &config) else {
        return;
    };
    // Nothing loads but what the guest touches, and it makes progress.
    common::wait_until("the lazily restored guest dirties memory", || {
        lazy.guest().dirtied_pages() > 0
    });
    assert!(lazy.fault_stats().faults > 0);
    assert!(!lazy.has_failed());
}

#[test]
fn a_lazy_restore_without_loaders_serves_every_page_by_fault() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("faults.tern");
    let mut guest = source(4 * MIB, 0, 1);
    let digest = paused_save(&mut guest, &path);
    let config = {
        let mut config = RestoreConfig::default();
        config.background = false;
        config
    };
    let Some(lazy) = lazy_or_skip(&path, &config) else {
        return;
    };
    // Reading all memory faults every chunk in.
    assert_eq!(lazy.guest().digest(), digest);
    let stats = lazy.fault_stats();
    assert!(stats.faults >= 4 * MIB / 4096 / 16, "{stats:?}");
    assert_eq!(stats.prefetched_pages, 0);
    let (_, stats) = lazy.wait_loaded(LOADED_WITHIN).unwrap();
    assert_eq!(stats.faulted_pages.len() as u64, 4 * MIB / 4096 / 16);
    assert_eq!(stats.faults.prefetched_pages, 0);
}

/// Reads one byte of `page` of `region` as the guest would. A volatile
/// read: a copy whose result is dropped (`let _ = guest.region_bytes(..)`)
/// is removed by the optimiser, and then nothing faults at all.
fn touch(guest: &SyntheticGuest, region: usize, page: u64) -> u8 {
    let region = &guest.regions()[region];
    let offset = page * PAGE_SIZE as u64;
    assert!(offset < region.len(), "page {page} is outside the region");
    // SAFETY: `offset` is inside the region, which the guest maps for as
    // long as it lives; a missing page waits for the fault service.
    unsafe {
        region
            .host_ptr()
            .add(usize::try_from(offset).unwrap())
            .read_volatile()
    }
}

/// The first page of region 0 the snapshot holds data for.
fn first_present_page(path: &Path) -> (u64, u64) {
    let metadata = SnapshotFile::open(path).unwrap().metadata().clone();
    let page = (0..metadata.regions[0].pages())
        .find(|&page| metadata.is_present(0, page))
        .unwrap();
    (page, metadata.regions[0].slot_offset(page).unwrap())
}

fn change_slot(path: &Path, offset: u64) {
    let file = OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(b"changed", offset).unwrap();
}

#[test]
fn a_file_changed_under_a_lazy_restore_stops_it_with_the_chunk_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("changed.tern");
    let mut guest = source(4 * MIB, 0, 1);
    paused_save(&mut guest, &path);
    let (page, offset) = first_present_page(&path);
    // No loaders: only the guest's touch below reads the chunk, after the
    // change.
    let mut config = RestoreConfig::default();
    config.background = false;
    let Some(lazy) = lazy_or_skip(&path, &config) else {
        return;
    };
    change_slot(&path, offset);
    // The guest touches the page: the chunk no longer matches its hash.
    touch(lazy.guest(), 0, page);
    let error = lazy.wait_loaded(LOADED_WITHIN).unwrap_err();
    let line = one_line(&error);
    assert!(
        line.contains(&format!("chunk {} of region 0", page / 16)),
        "{line}"
    );
}

#[test]
fn a_changed_chunk_found_by_the_background_loader_stops_the_restore() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("changed.tern");
    let mut guest = source(4 * MIB, 0, 1);
    paused_save(&mut guest, &path);
    let (page, offset) = first_present_page(&path);
    // Changed before the restore: opening checks only the metadata, so the
    // loaders are the first to read the chunk. The guest touches nothing.
    change_slot(&path, offset);
    let Some(lazy) = lazy_or_skip(&path, &RestoreConfig::default()) else {
        return;
    };
    let error = lazy.wait_loaded(LOADED_WITHIN).unwrap_err();
    let line = one_line(&error);
    assert!(
        line.contains(&format!("chunk {} of region 0", page / 16)),
        "{line}"
    );
}

/// The part of a guest built alongside the opening of the file
/// (`restore_lazy_prepared`): counts its live copies.
struct Prepared {
    _alive: std::sync::Arc<()>,
}

#[test]
fn a_lazy_restore_builds_its_prepared_part_alongside_and_ends_with_the_saved_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prepared.tern");
    let mut guest = source(16 * MIB, 0, 2);
    let digest = paused_save(&mut guest, &path);
    let alive = std::sync::Arc::new(());
    let prepared = Prepared {
        _alive: std::sync::Arc::clone(&alive),
    };
    let restored = tern_engine::restore_lazy_prepared(
        &path,
        &RestoreConfig::default(),
        move || Ok(prepared),
        |prepared: Prepared, lens: &[u64]| {
            drop(prepared);
            empty(lens)
        },
    );
    let lazy = match restored {
        Err(SnapshotError::Fault(error)) => {
            tern_test_skip::skip(tern_test_skip::Need::Userfaultfd, error.to_string());
            return;
        }
        other => other.unwrap(),
    };
    assert_eq!(std::sync::Arc::strong_count(&alive), 1);
    let (mut restored, stats) = lazy.wait_loaded(LOADED_WITHIN).unwrap();
    assert!(stats.resumed_after_ms >= stats.startup.open_ms, "{stats:?}");
    restored.pause().unwrap();
    assert_eq!(restored.digest(), digest);
}

/// A bad file is refused before the guest is built, and what was built
/// alongside the opening is dropped, never used.
#[test]
fn a_lazy_restore_refuses_a_bad_file_before_building_the_guest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("foreign");
    std::fs::write(&path, vec![0x5a; 1 << 16]).unwrap();
    let alive = std::sync::Arc::new(());
    let prepared = Prepared {
        _alive: std::sync::Arc::clone(&alive),
    };
    let error = tern_engine::restore_lazy_prepared(
        &path,
        &RestoreConfig::default(),
        move || Ok(prepared),
        |_: Prepared, _: &[u64]| -> Result<SyntheticGuest, tern_engine::GuestError> {
            panic!("a guest built for a file that failed its checks")
        },
    )
    .unwrap_err();
    assert!(one_line(&error).contains("not a tern snapshot"), "{error}");
    assert_eq!(std::sync::Arc::strong_count(&alive), 1);
}

fn saved_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("bad.tern");
    let mut guest = source(4 * MIB, 0, 1);
    paused_save(&mut guest, &path);
    path
}

fn refused(path: &Path) -> String {
    let error = tern_engine::restore(path, &RestoreConfig::default(), empty).unwrap_err();
    one_line(&error)
}

#[test]
fn a_truncated_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved_file(dir.path());
    let len = std::fs::metadata(&path).unwrap().len();
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    assert!(refused(&path).contains("truncated"), "{}", refused(&path));
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(100)
        .unwrap();
    assert!(
        refused(&path).contains("Truncated snapshot header"),
        "{}",
        refused(&path)
    );
}

#[test]
fn a_corrupted_page_is_refused_before_the_guest_runs() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved_file(dir.path());
    let metadata = SnapshotFile::open(&path).unwrap().metadata().clone();
    let page = (0..metadata.regions[0].pages())
        .rev()
        .find(|&page| metadata.is_present(0, page))
        .unwrap();
    let offset = metadata.regions[0].slot_offset(page).unwrap() + 100;
    let file = OpenOptions::new().write(true).open(&path).unwrap();
    file.write_all_at(&[0xee], offset).unwrap();
    let line = refused(&path);
    assert!(line.contains("does not match its hash"), "{line}");
}

#[test]
fn corrupted_metadata_and_device_state_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved_file(dir.path());
    let file = OpenOptions::new().write(true).open(&path).unwrap();
    file.write_all_at(&[0xff], 200).unwrap();
    assert!(
        refused(&path).contains("metadata is corrupted"),
        "{}",
        refused(&path)
    );
    let path = saved_file(dir.path());
    let header = SnapshotFile::open(&path).unwrap().metadata().header;
    let file = OpenOptions::new().write(true).open(&path).unwrap();
    file.write_all_at(&[0xff], header.data_end + 20).unwrap();
    assert!(
        refused(&path).contains("device state is corrupted"),
        "{}",
        refused(&path)
    );
}

#[test]
fn a_foreign_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("foreign");
    std::fs::write(&path, vec![0x5a; 1 << 16]).unwrap();
    assert!(
        refused(&path).contains("not a tern snapshot"),
        "{}",
        refused(&path)
    );
    std::fs::write(&path, b"").unwrap();
    assert!(refused(&path).contains("Truncated"), "{}", refused(&path));
}

#[test]
fn a_header_claiming_more_memory_than_the_file_holds_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved_file(dir.path());
    // Cut the file inside the page slots: the header still claims them.
    let header = SnapshotFile::open(&path).unwrap().metadata().header;
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(header.data_end / 2)
        .unwrap();
    let line = refused(&path);
    assert!(line.contains("truncated: the header needs"), "{line}");
}

#[test]
fn a_snapshot_of_another_shape_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved_file(dir.path());
    let error = tern_engine::restore(&path, &RestoreConfig::default(), |_: &[u64]| {
        empty(&[8 * MIB])
    })
    .unwrap_err();
    assert!(one_line(&error).contains("does not fit this guest"));
}

/// A save that fails midway (here: a writer count of zero is refused up
/// front; the full-disk case is in `a_full_disk_*`) leaves the guest as it
/// was.
#[test]
fn an_impossible_configuration_is_refused_and_the_guest_runs_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut guest = source(4 * MIB, 16 * MIB, 1);
    let config = {
        let mut config = SaveConfig::default();
        config.writers = 0;
        config
    };
    let error = tern_engine::save(&mut guest, &dir.path().join("x"), &config).unwrap_err();
    assert!(one_line(&error).contains("writers"));
    assert!(guest.is_running());
}

/// A filesystem of 2 MiB (tmpfs, mounted here as root) fills up during
/// the save: the error says so, the guest keeps running, and the partial
/// file is refused as incomplete.
#[test]
fn a_full_disk_fails_the_save_leaves_the_guest_running_and_the_file_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mount = dir.path().join("small");
    std::fs::create_dir(&mount).unwrap();
    let target = std::ffi::CString::new(mount.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: NUL-terminated strings; the mount is undone below.
    let mounted = unsafe {
        libc::mount(
            c"tern-test".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            0,
            c"size=2m".as_ptr().cast(),
        )
    };
    if mounted != 0 {
        tern_test_skip::skip(
            tern_test_skip::Need::Host,
            format!(
                "cannot mount a small tmpfs here: {}",
                std::io::Error::last_os_error()
            ),
        );
        return;
    }
    struct Unmount(std::ffi::CString);
    impl Drop for Unmount {
        fn drop(&mut self) {
            // SAFETY: the mount point mounted above.
            unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
        }
    }
    let _unmount = Unmount(target);
    let path = mount.join("full.tern");
    let mut guest = source(16 * MIB, 16 * MIB, 1);
    let error = tern_engine::save(&mut guest, &path, &SaveConfig::default()).unwrap_err();
    let line = one_line(&error);
    assert!(line.contains("No space left on device"), "{line}");
    assert!(line.contains("incomplete"), "{line}");
    assert!(guest.is_running(), "the source guest runs on");
    let line = refused(&path);
    assert!(line.contains("incomplete"), "{line}");
}

#[test]
fn an_o_direct_save_restores_to_the_same_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("direct.tern");
    let mut guest = source(8 * MIB, 0, 1);
    let config = {
        let mut config = SaveConfig::default();
        config.direct = true;
        config.resume = false;
        config
    };
    match tern_engine::save(&mut guest, &path, &config) {
        Err(SnapshotError::Open { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
            tern_test_skip::skip(
                tern_test_skip::Need::Host,
                "this filesystem refuses O_DIRECT",
            );
            return;
        }
        other => {
            other.unwrap();
        }
    }
    let digest = guest.digest();
    let restored = tern_engine::restore(&path, &held(), empty).unwrap();
    assert_eq!(restored.guest.digest(), digest);
}

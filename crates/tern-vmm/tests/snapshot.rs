//! The KVM test guest saved to a file and restored, eagerly and lazily:
//! its memory equal to what was saved, its vCPU state back, and its pass
//! counter advancing again. Skips where /dev/kvm is missing.

// Test data: offsets into a small guest and a counter's low byte.
#![allow(clippy::cast_possible_truncation)]

use std::time::Duration;

use tern_engine::snapshot::SaveConfig;
use tern_engine::{GuestControl, GuestError, GuestMemory, RestoreConfig, SnapshotError};
use tern_vmm::{KvmGuest, VmConfig, kvm_available};

const MIB: u64 = 1 << 20;
const WITHIN: Duration = Duration::from_secs(30);

macro_rules! require_kvm {
    () => {
        if !kvm_available() {
            tern_test_skip::skip(tern_test_skip::Need::Kvm, "/dev/kvm not available");
            return;
        }
    };
}

fn running_source() -> KvmGuest {
    let guest = KvmGuest::new(&VmConfig {
        memory_bytes: 32 * MIB,
        working_set_pages: 256,
        workload: Default::default(),
        image: None,
        memfd: false,
    })
    .expect("create the source VM");
    assert!(guest.wait_for_pass_count_above(2, WITHIN), "the guest runs");
    guest
}

fn destination(lens: &[u64]) -> Result<KvmGuest, GuestError> {
    KvmGuest::for_destination(lens).map_err(GuestError::from)
}

/// XXH3-128 of all guest memory (the guest paused).
fn memory_hash(guest: &KvmGuest) -> u128 {
    let mut bytes = vec![0u8; guest.memory_bytes() as usize];
    guest.read_memory(0, &mut bytes);
    xxhash(&bytes)
}

fn xxhash(bytes: &[u8]) -> u128 {
    // The engine's page digest is internal; any strong hash compares here.
    let mut hash = 0u128;
    for (index, chunk) in bytes.chunks(4096).enumerate() {
        let mut page = 0xcbf2_9ce4_8422_2325u64;
        for &byte in chunk {
            page = (page ^ u64::from(byte)).wrapping_mul(0x1000_0000_01b3);
        }
        hash = hash.rotate_left(7) ^ u128::from(page) ^ index as u128;
    }
    hash
}

fn save_paused(guest: &mut KvmGuest, path: &std::path::Path, live: bool) -> (u128, u64) {
    let (hash, passes, _) = save_paused_with_digest(guest, path, live);
    (hash, passes)
}

/// As `save_paused`, also returning the memory digest the save recorded.
fn save_paused_with_digest(
    guest: &mut KvmGuest,
    path: &std::path::Path,
    live: bool,
) -> (u128, u64, String) {
    let config = {
        let mut config = SaveConfig::default();
        config.live = live;
        config.resume = false;
        config.final_pass_pages = 16;
        config
    };
    let stats = tern_engine::save(guest, path, &config).expect("save");
    (memory_hash(guest), guest.pass_count(), stats.digest)
}

#[test]
fn a_saved_kvm_guest_restores_eagerly_with_its_memory_and_counts_on() {
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.tern");
    let mut source = running_source();
    let (hash, passes) = save_paused(&mut source, &path, true);
    drop(source);
    let config = {
        let mut config = RestoreConfig::default();
        config.resume = false;
        config
    };
    let mut restored = tern_engine::restore(&path, &config, destination)
        .unwrap()
        .guest;
    assert_eq!(memory_hash(&restored), hash);
    assert_eq!(restored.pass_count(), passes);
    restored.resume().unwrap();
    assert!(
        restored.wait_for_pass_count_above(passes + 2, WITHIN),
        "the restored guest counts on (status {:?})",
        restored.vcpu_status()
    );
    restored.pause().unwrap();
    let report = restored.consistency_check().unwrap();
    assert!(report.passed, "{report:?}");
}

#[test]
fn a_lazily_restored_kvm_guest_counts_on_while_its_memory_loads() {
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lazy.tern");
    let mut source = running_source();
    let (_, passes, digest) = save_paused_with_digest(&mut source, &path, false);
    drop(source);
    let config = {
        let mut config = RestoreConfig::default();
        config.background = false;
        config
    };
    let lazy = match tern_engine::restore_lazy(&path, &config, destination) {
        Err(SnapshotError::Fault(error)) => {
            tern_test_skip::skip(
                tern_test_skip::Need::Userfaultfd,
                format!("no userfaultfd for this process: {error}"),
            );
            return;
        }
        other => other.unwrap(),
    };
    // Faults only: the vCPU runs on the pages it touches.
    assert!(
        lazy.guest().wait_for_pass_count_above(passes + 2, WITHIN),
        "the guest counts on by faults alone (status {:?})",
        lazy.guest().vcpu_status()
    );
    let stats = lazy.fault_stats();
    assert!(stats.faults > 0 && stats.prefetched_pages == 0, "{stats:?}");
    let pages = lazy.guest().regions()[0].pages();
    assert!(stats.fault_pages < pages, "not everything was needed");
    // The VMM reading all memory faults the rest in; then nothing is
    // missing and the registration ends.
    memory_hash(lazy.guest());
    let (mut restored, stats) = lazy.wait_loaded(WITHIN).unwrap();
    assert!(stats.faults.faults > 0);
    // Every page came from the file with its chunk's hash checked, and
    // the digest of what was loaded is the one the save recorded.
    assert_eq!(stats.digest, digest);
    restored.pause().unwrap();
    let report = restored.consistency_check().unwrap();
    assert!(report.passed, "{report:?}");
}

/// A tracked diff of the KVM guest (Firecracker's `track_dirty_pages` +
/// `snapshot_type: Diff`): the dirty log runs from the base save on, the
/// guest counts on meanwhile, and the diff holds only the pages the log
/// reported; base + diff restore to the exact memory.
#[test]
fn a_tracked_diff_of_the_kvm_guest_restores_on_its_base() {
    if !kvm_available() {
        tern_test_skip::skip(tern_test_skip::Need::Kvm, "/dev/kvm not available");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.tern");
    let diff = dir.path().join("diff.tern");
    let mut source = running_source();
    let mut tracker = tern_engine::DirtyTracker::new();
    let mut config = SaveConfig::default();
    tern_engine::save_tracked(&mut source, &base, &config, &mut tracker).expect("base");
    let passes = source.pass_count();
    assert!(
        source.wait_for_pass_count_above(passes + 2, WITHIN),
        "the guest counts on after the base"
    );
    config.resume = false;
    config.diff_base = Some(base.clone());
    let stats = tern_engine::save_tracked(&mut source, &diff, &config, &mut tracker).expect("diff");
    let memory_pages = source.memory_bytes() / 4096;
    // The guest writes its 256-page working set (and its stack), not all
    // of its 32 MiB.
    assert!(
        stats.normal + stats.duplicate < memory_pages / 4,
        "{stats:?}"
    );
    assert_eq!(
        stats.normal + stats.duplicate + stats.unchanged_pages,
        memory_pages
    );
    let hash = memory_hash(&source);
    let passes = source.pass_count();
    drop(source);
    let mut restore = RestoreConfig::default();
    restore.resume = false;
    restore.bases = vec![base];
    let restored = tern_engine::restore(&diff, &restore, destination).unwrap();
    assert_eq!(restored.stats.digest, stats.digest);
    let mut restored = restored.guest;
    assert_eq!(memory_hash(&restored), hash);
    assert_eq!(restored.pass_count(), passes);
    restored.resume().unwrap();
    assert!(
        restored.wait_for_pass_count_above(passes + 2, WITHIN),
        "the guest restored from base + diff counts on (status {:?})",
        restored.vcpu_status()
    );
}

/// Base + tracked diff of the KVM guest restored lazily: the guest runs
/// at once on pages faulted in from whichever layer defines them, counts
/// on, and once everything is loaded the digest is the diff's.
#[test]
fn a_tracked_diff_of_the_kvm_guest_restores_lazily_on_its_base_and_counts_on() {
    require_kvm!();
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.tern");
    let diff = dir.path().join("diff.tern");
    let mut source = running_source();
    let mut tracker = tern_engine::DirtyTracker::new();
    let mut config = SaveConfig::default();
    tern_engine::save_tracked(&mut source, &base, &config, &mut tracker).expect("base");
    let passes = source.pass_count();
    assert!(
        source.wait_for_pass_count_above(passes + 2, WITHIN),
        "the guest counts on after the base"
    );
    config.resume = false;
    config.diff_base = Some(base.clone());
    let saved = tern_engine::save_tracked(&mut source, &diff, &config, &mut tracker).expect("diff");
    let passes = source.pass_count();
    drop(source);
    let mut restore = RestoreConfig::default();
    restore.bases = vec![base];
    let lazy = match tern_engine::restore_lazy(&diff, &restore, destination) {
        Err(SnapshotError::Fault(error)) => {
            tern_test_skip::skip(
                tern_test_skip::Need::Userfaultfd,
                format!("no userfaultfd for this process: {error}"),
            );
            return;
        }
        other => other.unwrap(),
    };
    assert!(
        lazy.guest().wait_for_pass_count_above(passes + 2, WITHIN),
        "the lazily restored guest counts on (status {:?})",
        lazy.guest().vcpu_status()
    );
    let (mut restored, stats) = lazy.wait_loaded(WITHIN).unwrap();
    assert_eq!(stats.digest, saved.digest);
    restored.pause().unwrap();
    let report = restored.consistency_check().unwrap();
    assert!(report.passed, "{report:?}");
}

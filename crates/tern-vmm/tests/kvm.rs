//! Integration tests against the host's KVM. Each test prints a skip
//! message and returns where /dev/kvm is missing; where it exists they run
//! for real.

use std::time::{Duration, Instant};

use tern_engine::{
    Address, Destination, DirtyBitmap, DirtyLog, GuestControl, GuestMemory, Listener,
    MigrationConfig, MigrationStatus, ReceiveConfig, Source,
};
use tern_vmm::{KvmGuest, VmConfig, kvm_available};

const MIB: u64 = 1 << 20;

macro_rules! require_kvm {
    () => {
        if !kvm_available() {
            eprintln!("skipped: /dev/kvm not available");
            return;
        }
    };
}

fn config(pages: u32) -> VmConfig {
    VmConfig {
        memory_bytes: 64 * MIB,
        working_set_pages: pages,
        image: None,
    }
}

fn source(pages: u32) -> KvmGuest {
    let guest = KvmGuest::new(&config(pages)).expect("create the source VM");
    assert!(
        guest.wait_for_pass_count_above(2, Duration::from_secs(20)),
        "the guest makes passes (status {:?})",
        guest.vcpu_status()
    );
    guest
}

#[test]
fn guest_counts_passes_and_reports_them_on_serial() {
    require_kvm!();
    let mut guest = source(256);
    let before = guest.pass_count();
    assert!(guest.wait_for_pass_count_above(before + 5, Duration::from_secs(20)));
    guest.pause().unwrap();
    let passes = guest.pass_count();
    assert_eq!(
        guest.serial_transmitted(),
        passes,
        "one serial byte per pass"
    );
    assert_eq!(guest.serial_tail().last(), Some(&(passes as u8)));
    let report = guest.consistency_check().unwrap();
    assert!(report.passed, "{report:?}");
    // Paused means paused.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(guest.pass_count(), passes);
    guest.resume().unwrap();
    assert!(guest.wait_for_pass_count_above(passes, Duration::from_secs(20)));
}

//! Postcopy with the reference KVM VMM: the vCPU runs on the destination
//! while its working set, stale at the switch, is still missing, so its
//! first touch of each stale page faults through KVM into userfaultfd
//! (docs/postcopy.md). Skipped visibly without /dev/kvm.

use std::time::Duration;

use tern_engine::{
    Address, Destination, GuestControl, Listener, MigrationConfig, MigrationStatus, PostcopyMode,
    ReceiveConfig, Source,
};
use tern_vmm::{KvmGuest, VmConfig, kvm_available};

const MIB: u64 = 1 << 20;

// Config structs become non_exhaustive (issue 29): outside tern-engine they
// are built from their default and then set, never as literals.
#[allow(clippy::field_reassign_with_default)]
#[test]
fn a_kvm_guest_runs_on_through_postcopy() {
    if !kvm_available() {
        tern_test_skip::skip(tern_test_skip::Need::Kvm, "/dev/kvm not available");
        return;
    }
    let mut guest = KvmGuest::new(&VmConfig {
        memory_bytes: 64 * MIB,
        working_set_pages: 2048,
        workload: Default::default(),
        image: None,
        memfd: false,
    })
    .expect("create the source VM");
    assert!(guest.wait_for_pass_count_above(2, Duration::from_secs(20)));
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap();
    let address = listener.local_address().unwrap();
    let destination = std::thread::spawn(move || {
        let mut config = ReceiveConfig::default();
        config.io_timeout = Duration::from_secs(20);
        Destination::new(config).receive(&listener, |setup| {
            let lens: Vec<u64> = setup.regions.iter().map(|region| region.len).collect();
            Ok(KvmGuest::for_destination(&lens)?)
        })
    });
    let mut config = MigrationConfig::default();
    config.channels = 2;
    config.io_timeout = Duration::from_secs(20);
    config.postcopy = PostcopyMode::AfterFirstPass;
    // The working set must not fit the downtime: precopy would converge.
    config.max_bandwidth = Some(32 * MIB);
    config.downtime_limit = Duration::from_millis(5);
    let stats = Source::new(config)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect("the migration completes");
    let received = destination
        .join()
        .unwrap()
        .expect("the destination completes");
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(stats.digest_verified, "{:?}", stats.digest_comparison);
    let postcopy = stats.postcopy.expect("postcopy report");
    eprintln!("KVM postcopy: {postcopy:?}");
    assert!(postcopy.stale_pages > 0, "{postcopy:?}");
    let mut moved = received.guest;
    let final_count = guest.pass_count();
    assert!(
        moved.wait_for_pass_count_above(final_count + 3, Duration::from_secs(20)),
        "the guest counts on at the destination (status {:?})",
        moved.vcpu_status()
    );
    moved.pause().unwrap();
    let report = moved.consistency_check().unwrap();
    assert!(report.passed, "{report:?}");
}

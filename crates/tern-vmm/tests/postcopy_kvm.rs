//! Postcopy with the reference KVM VMM: the vCPU runs on the destination
//! while its working set, stale at the switch, is still missing, so its
//! first touch of each stale page faults through KVM into userfaultfd
//! (docs/postcopy.md). Skipped visibly without /dev/kvm.

use std::thread::JoinHandle;
use std::time::Duration;

use tern_engine::{
    Address, Destination, GuestControl, Listener, MigrationConfig, MigrationError, MigrationStats,
    MigrationStatus, PostcopyMode, ReceiveConfig, ReceiveHandle, Received, Source,
};
use tern_test_skip::proxy::Proxy;
use tern_test_skip::wait::{join_within, wait_until};
use tern_vmm::{KvmGuest, VmConfig, kvm_available};

const MIB: u64 = 1 << 20;

fn kvm_or_skip() -> bool {
    if kvm_available() {
        return true;
    }
    tern_test_skip::skip(tern_test_skip::Need::Kvm, "/dev/kvm not available");
    false
}

/// A running source VM whose 8 MiB working set is rewritten constantly.
fn source_guest() -> KvmGuest {
    let guest = KvmGuest::new(&VmConfig {
        memory_bytes: 64 * MIB,
        working_set_pages: 2048,
        workload: Default::default(),
        image: None,
        memfd: false,
    })
    .expect("create the source VM");
    assert!(guest.wait_for_pass_count_above(2, Duration::from_secs(20)));
    guest
}

type DestinationThread = JoinHandle<Result<Received<KvmGuest>, MigrationError>>;

/// A destination on a loopback port, receiving on a thread: its address,
/// handle and thread.
// Config structs become non_exhaustive (issue 29): outside tern-engine they
// are built from their default and then set, never as literals.
#[allow(clippy::field_reassign_with_default)]
fn spawn_destination(recover_timeout: Duration) -> (Address, ReceiveHandle, DestinationThread) {
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap();
    let address = listener.local_address().unwrap();
    let mut config = ReceiveConfig::default();
    config.io_timeout = Duration::from_secs(2);
    config.postcopy_request_timeout = Duration::from_secs(1);
    config.postcopy_recover_timeout = recover_timeout;
    let destination = Destination::new(config);
    let handle = destination.handle();
    let thread = std::thread::spawn(move || {
        destination.receive(&listener, |setup| {
            let lens: Vec<u64> = setup.regions.iter().map(|region| region.len).collect();
            Ok(KvmGuest::for_destination(&lens)?)
        })
    });
    (address, handle, thread)
}

/// Postcopy after the first pass: the working set cannot fit the downtime
/// limit, so precopy would never converge.
#[allow(clippy::field_reassign_with_default)]
fn source_config(recover_timeout: Duration) -> MigrationConfig {
    let mut config = MigrationConfig::default();
    config.channels = 2;
    config.io_timeout = Duration::from_secs(2);
    config.postcopy = PostcopyMode::AfterFirstPass;
    config.max_bandwidth = Some(32 * MIB);
    config.downtime_limit = Duration::from_millis(5);
    config.postcopy_recover_timeout = recover_timeout;
    config
}

/// The migration completed with its digests equal, postcopy moved stale
/// pages, and the guest counts on at the destination with its working set
/// consistent.
fn check_moved(stats: &MigrationStats, received: Received<KvmGuest>, source: &KvmGuest) {
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(stats.digest_verified, "{:?}", stats.digest_comparison);
    assert!(
        received
            .digest_comparison
            .as_ref()
            .is_some_and(|comparison| comparison.matched()),
        "{:?}",
        received.digest_comparison
    );
    let postcopy = stats.postcopy.as_ref().expect("postcopy report");
    eprintln!("KVM postcopy: {postcopy:?}");
    assert!(postcopy.stale_pages > 0, "{postcopy:?}");
    let mut moved = received.guest;
    let final_count = source.pass_count();
    assert!(
        moved.wait_for_pass_count_above(final_count + 3, Duration::from_secs(20)),
        "the guest counts on at the destination (status {:?})",
        moved.vcpu_status()
    );
    moved.pause().unwrap();
    let report = moved.consistency_check().unwrap();
    assert!(report.passed, "{report:?}");
}

#[test]
fn a_kvm_guest_runs_on_through_postcopy() {
    if !kvm_or_skip() {
        return;
    }
    let mut guest = source_guest();
    let (address, _, destination) = spawn_destination(Duration::from_secs(60));
    let stats = Source::new(source_config(Duration::from_secs(60)))
        .unwrap()
        .migrate(&mut guest, &address)
        .expect("the migration completes");
    let received = join_within(destination, "the destination").expect("the destination completes");
    check_moved(&stats, received, &guest);
}

/// A severed network during postcopy with the KVM guest: its vCPU runs on
/// at the destination, faults on missing pages wait through the pause,
/// the source reconnects when the network is back, and the migration
/// completes with the digests equal (docs/postcopy.md, "Recovery").
#[test]
fn a_kvm_guest_survives_a_severed_link_during_postcopy() {
    if !kvm_or_skip() {
        return;
    }
    let mut guest = source_guest();
    let (target, receive, destination) = spawn_destination(Duration::from_secs(60));
    let Address::Tcp(target) = &target else {
        panic!("a TCP destination");
    };
    // 8 MiB/s: the 8 MiB working set, stale at the switch, takes about a
    // second to arrive, long enough to be cut.
    let proxy = Proxy::start(target, 8 * MIB);
    let through = Address::Tcp(proxy.address().to_string());
    let source = Source::new(source_config(Duration::from_secs(60))).unwrap();
    let handle = source.handle();
    let saboteur = {
        let handle = handle.clone();
        std::thread::spawn(move || {
            wait_until("postcopy starts", || {
                handle.query().status == MigrationStatus::PostcopyActive
            });
            proxy.cut();
            wait_until("the source pauses postcopy", || {
                handle.query().status == MigrationStatus::PostcopyPaused
            });
            wait_until("the destination pauses postcopy", || {
                receive.query().status == MigrationStatus::PostcopyPaused
            });
            proxy.pass();
            proxy
        })
    };
    let result = source.migrate(&mut guest, &through);
    let stats = result.expect("the migration completes after recovering");
    let _proxy = join_within(saboteur, "the saboteur");
    let postcopy = stats.postcopy.as_ref().expect("postcopy report");
    assert!(postcopy.postcopy_recoveries >= 1, "{postcopy:?}");
    let received = join_within(destination, "the destination").expect("the destination completes");
    check_moved(&stats, received, &guest);
}

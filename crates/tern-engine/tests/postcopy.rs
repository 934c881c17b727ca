//! Postcopy end to end (docs/postcopy.md): real sockets, real userfaultfd,
//! the synthetic guest's dirtier running on the destination while its
//! missing pages arrive. Skipped visibly without userfaultfd.

use crate::common;

use std::time::Duration;

use common::*;
use tern_engine::{
    Destination, GuestControl, MigrationConfig, MigrationStatus, PostcopyMode, PostcopyTrigger,
    ReceiveConfig, Source,
};
use tern_synthetic::{ContentMix, SyntheticConfig, SyntheticGuest};

/// Whether this process may use userfaultfd; a skip says why not.
fn userfaultfd_works() -> bool {
    // SAFETY: the system call takes flags only; the descriptor is closed
    // right away.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
    if fd >= 0 {
        // SAFETY: our own descriptor.
        unsafe { libc::close(libc::c_int::try_from(fd).unwrap()) };
        return true;
    }
    let device = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd");
    if device.is_ok() {
        return true;
    }
    tern_test_skip::skip(
        tern_test_skip::Need::Userfaultfd,
        "no userfaultfd for this process",
    );
    false
}

/// A guest whose dirtier outruns a 16 MiB/s link: precopy cannot converge.
fn busy_guest() -> SyntheticGuest {
    guest_with(SyntheticConfig {
        memory_bytes: 48 * MIB,
        regions: 2,
        mix: ContentMix::new(20, 60, 20).unwrap(),
        seed: 3,
        dirty_rate_bytes_per_sec: 64 * MIB,
        working_set_bytes: 24 * MIB,
        dirtier_threads: 2,
    })
}

fn postcopy_config(mode: PostcopyMode) -> MigrationConfig {
    let mut config = migration_config(3);
    config.max_bandwidth = Some(16 * MIB);
    config.downtime_limit = Duration::from_millis(20);
    config.postcopy = mode;
    config
}

fn spawn_destination_with(
    listener: tern_engine::Listener,
    config: ReceiveConfig,
) -> std::thread::JoinHandle<DestinationResult> {
    std::thread::spawn(move || Destination::new(config).receive(&listener, make_destination_guest))
}

#[test]
fn a_guest_that_cannot_converge_migrates_with_postcopy_auto() {
    if !userfaultfd_works() {
        return;
    }
    let mut guest = busy_guest();
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let source = Source::new(postcopy_config(PostcopyMode::Auto)).unwrap();
    let stats = source.migrate(&mut guest, &address).expect("migration");
    let mut received = join_within(destination, "the destination").expect("destination");
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(stats.digest_verified, "{:?}", stats.digest_comparison);
    assert!(!guest.is_running(), "the source stays paused");
    assert_eq!(
        stats.cpu_throttle_percentage, 0,
        "postcopy instead of throttling"
    );
    let postcopy = stats.postcopy.expect("postcopy report");
    assert_eq!(postcopy.trigger, Some(PostcopyTrigger::Throttle));
    assert!(postcopy.stale_pages > 0);
    assert!(
        postcopy.pushed_pages + postcopy.requested_pages >= postcopy.stale_pages,
        "{postcopy:?}"
    );
    // Without a recovery the push sends each stale page once, unless an
    // urgent answer sent it first.
    assert_eq!(
        postcopy.pushed_pages + postcopy.push_skipped_pages,
        postcopy.stale_pages,
        "{postcopy:?}"
    );
    eprintln!("source: {postcopy:?}");
    let here = received.stats.postcopy.clone().expect("destination report");
    eprintln!("destination: {here:?}");
    assert_eq!(here.stale_pages, postcopy.stale_pages);
    assert!(received.digest_comparison.unwrap().matched());
    // The guest carries on on the destination.
    let before = received.guest.dirtied_pages();
    wait_until("the destination guest dirties memory", || {
        received.guest.dirtied_pages() > before
    });
    received.guest.pause().unwrap();
}

#[test]
fn memory_held_paused_after_postcopy_equals_the_source() {
    if !userfaultfd_works() {
        return;
    }
    let mut guest = busy_guest();
    let (listener, address) = tcp_listener();
    let mut receive = receive_config();
    receive.keep_paused = true;
    let destination = spawn_destination_with(listener, receive);
    let source = Source::new(postcopy_config(PostcopyMode::AfterFirstPass)).unwrap();
    let stats = source.migrate(&mut guest, &address).expect("migration");
    let received = join_within(destination, "the destination").expect("destination");
    assert!(stats.digest_verified);
    assert_eq!(
        stats.postcopy.as_ref().and_then(|p| p.trigger),
        Some(PostcopyTrigger::FirstPass)
    );
    assert!(!received.resumed);
    // Nothing ran on the destination: its memory is the source's, byte
    // for byte, the stale pages included.
    assert_eq!(received.guest.digest(), guest.digest());
}

#[test]
fn migrate_start_postcopy_hands_over_on_request() {
    if !userfaultfd_works() {
        return;
    }
    let mut guest = busy_guest();
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut config = postcopy_config(PostcopyMode::OnRequest);
    // Precopy alone would throttle on: only the request ends it.
    config.auto_converge = false;
    let source = Source::new(config).unwrap();
    let handle = source.handle();
    let requester = std::thread::spawn(move || {
        wait_until("the migration is active", || {
            handle.query().status == MigrationStatus::Active
        });
        handle.start_postcopy()
    });
    let stats = source.migrate(&mut guest, &address).expect("migration");
    join_within(requester, "the postcopy requester").expect("start_postcopy");
    let mut received = join_within(destination, "the destination").expect("destination");
    assert!(stats.digest_verified);
    assert_eq!(
        stats.postcopy.as_ref().and_then(|p| p.trigger),
        Some(PostcopyTrigger::Requested)
    );
    received.guest.pause().unwrap();
}

#[test]
fn migrate_start_postcopy_is_refused_when_postcopy_is_off() {
    let source = Source::new(migration_config(1)).unwrap();
    let error = source.handle().start_postcopy().unwrap_err().to_string();
    assert!(error.contains("Postcopy is off"), "{error}");
}

/// The background push compresses with precopy's codec (per page, and in
/// zstd packet frames) and the destination decodes what it places: the
/// memory held paused on the destination is the source's byte for byte,
/// the digests agree, and the push's bytes are fewer than its data pages
/// raw.
#[test]
fn a_compressed_postcopy_push_verifies_and_sends_fewer_bytes_than_raw() {
    if !userfaultfd_works() {
        return;
    }
    for (choice, packet_frames, name) in [
        (tern_page::codec::CodecChoice::Zstd, false, "zstd"),
        (tern_page::codec::CodecChoice::Zstd, true, "zstd-packet"),
        (tern_page::codec::CodecChoice::Lz4, false, "lz4"),
        // Whatever auto chose, with the dictionary it may have trained
        // during the migration (in force from a sync on, not in the hello).
        (tern_page::codec::CodecChoice::Auto, false, "auto"),
    ] {
        let mut guest = busy_guest();
        let (listener, address) = tcp_listener();
        let mut receive = receive_config();
        receive.keep_paused = true;
        let destination = spawn_destination_with(listener, receive);
        let mut config = postcopy_config(PostcopyMode::AfterFirstPass);
        config.compression = choice;
        config.packet_frames = packet_frames;
        let stats = Source::new(config)
            .unwrap()
            .migrate(&mut guest, &address)
            .expect("migration");
        let received = join_within(destination, "the destination").expect("destination");
        assert!(
            stats.digest_verified,
            "{name}: {:?}",
            stats.digest_comparison
        );
        assert_eq!(received.guest.digest(), guest.digest(), "{name}");
        let postcopy = stats.postcopy.expect("postcopy report");
        eprintln!("{name}: {postcopy:?}");
        if name != "auto" {
            assert_eq!(postcopy.push_codec.as_deref(), Some(name), "{postcopy:?}");
        }
        eprintln!("{name}: compression {:?}", stats.compression);
        assert!(postcopy.push_compressed_pages > 0, "{name}: {postcopy:?}");
        let raw_data = (postcopy.pushed_pages - postcopy.push_zero_pages) * 4096;
        assert!(
            postcopy.push_bytes < raw_data,
            "{name}: the push sent {} bytes for {raw_data} bytes of data pages: {postcopy:?}",
            postcopy.push_bytes
        );
        assert!(
            postcopy.postcopy_bytes >= postcopy.push_bytes,
            "{postcopy:?}"
        );
    }
}

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

use tern_test_skip::userfaultfd_works;

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

/// The first page at which `destination`'s memory differs from
/// `source`'s, region by region; `None` when they are equal byte for byte.
fn first_different_page(
    source: &[tern_engine::MemoryRegion],
    destination: &[tern_engine::MemoryRegion],
) -> Option<(usize, u64)> {
    assert_eq!(source.len(), destination.len(), "region count");
    for (index, (here, there)) in source.iter().zip(destination).enumerate() {
        assert_eq!(here.len(), there.len(), "region {index}'s size");
        for page in 0..here.pages() {
            let (a, b) = (here.page_ptr(page).unwrap(), there.page_ptr(page).unwrap());
            // SAFETY: whole pages inside each region's mapping; both guests
            // are paused, nothing writes them meanwhile.
            let equal = unsafe {
                std::slice::from_raw_parts(a, 4096) == std::slice::from_raw_parts(b, 4096)
            };
            if !equal {
                return Some((index, page));
            }
        }
    }
    None
}

/// A dictionary put in force at a sync during precopy (a refresh: id 2,
/// not in the hello) is still in force at the postcopy switch, and the
/// push's packets name it: the destination's push decoders must know it.
/// The guest's pages change character at every sync (`dictionary.rs`'s
/// [`ChangingGuest`]), so the setup's dictionary stops helping after
/// iteration 0 and a refresh is in force from iteration 2 on
/// (`DictionaryRefresh::AtBoundary`: at a known boundary); postcopy is
/// requested only after the third sync, once it is. The memory held
/// paused on the destination is the source's, by digest and byte for
/// byte, and the push sent compressed pages.
#[test]
fn a_postcopy_push_names_a_dictionary_refreshed_during_precopy() {
    use crate::dictionary::ChangingGuest;
    use tern_engine::GuestMemory as _;

    if !userfaultfd_works() {
        return;
    }
    // 2048 pages of one passage; 512 of them rewritten with another at
    // every sync.
    let mut guest = ChangingGuest::new(8 * MIB, 512);
    let (listener, address) = tcp_listener();
    let mut receive = receive_config();
    receive.keep_paused = true;
    let destination = spawn_destination_with(listener, receive);
    let mut config = migration_config(2);
    config.compression = tern_page::codec::CodecChoice::Zstd;
    config.compression_dictionary = Some(32 << 10);
    config.dictionary_refresh = tern_engine::DictionaryRefresh::AtBoundary;
    // Precopy never converges by itself: only the request ends it.
    config.downtime_limit = Duration::from_nanos(1);
    config.auto_converge = false;
    config.postcopy = PostcopyMode::OnRequest;
    let source = Source::new(config).unwrap();
    let handle = source.handle();
    let requester = std::thread::spawn(move || {
        wait_until("three dirty-log syncs", || {
            handle.query().ram.dirty_sync_count >= 3
        });
        handle.start_postcopy()
    });
    let stats = source.migrate(&mut guest, &address).expect("migration");
    join_within(requester, "the requester").expect("start_postcopy");
    let received = join_within(destination, "the destination").expect("destination");
    assert!(stats.digest_verified, "{:?}", stats.digest_comparison);
    let postcopy = stats.postcopy.clone().expect("postcopy report");
    eprintln!("{postcopy:?}");
    assert_eq!(postcopy.trigger, Some(PostcopyTrigger::Requested));
    let dictionary = stats
        .compression
        .as_ref()
        .and_then(|report| report.dictionary.clone())
        .expect("a dictionary was trained");
    assert!(dictionary.refreshes >= 1, "{dictionary:?}");
    assert_eq!(postcopy.push_codec.as_deref(), Some("zstd"), "{postcopy:?}");
    assert!(postcopy.push_compressed_pages > 0, "{postcopy:?}");
    // Against the refreshed dictionary a page of the second passage costs
    // a few dozen bytes, against the setup's ~2.5 KiB (`dictionary.rs`):
    // the push named the refreshed one.
    assert!(
        postcopy.push_bytes < postcopy.pushed_pages * 512,
        "{postcopy:?}"
    );
    assert!(!received.resumed);
    assert_eq!(received.guest.digest(), guest.inner.digest());
    let different = first_different_page(guest.inner.regions(), received.guest.regions());
    assert_eq!(different, None, "(region, page) differing");
}

//! The live counters progress displays read: the source's remaining bytes
//! within an iteration, the destination's counters, and the byte counters
//! of the final statistics.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use tern_engine::{Destination, MigrationStatus, ReceivePhase, Source};
use tern_synthetic::{ContentMix, SyntheticConfig};

/// Generous: the machine may be loaded.
const DEADLINE: Duration = Duration::from_secs(60);

#[test]
fn remaining_falls_while_the_first_iteration_is_sent() {
    // Data pages only, no dirtying, through a slow link: the first
    // iteration takes seconds, so the poller below sees it in progress.
    let memory = 24 * MIB;
    let mut guest = guest_with(SyntheticConfig {
        memory_bytes: memory,
        regions: 1,
        mix: ContentMix::new(0, 100, 0).unwrap(),
        seed: 21,
        dirty_rate_bytes_per_sec: 0,
        working_set_bytes: 0,
        dirtier_threads: 1,
    });
    let (listener, address) = tcp_listener();
    let destination = Destination::new(receive_config());
    let received = destination.stats();
    assert_eq!(received.phase(), ReceivePhase::Waiting);
    let destination =
        std::thread::spawn(move || destination.receive(&listener, make_destination_guest));
    let mut config = migration_config(2);
    config.max_bandwidth = Some(6 * MIB);
    let source = Source::new(config).unwrap();
    let stats = source.stats();
    let migration = std::thread::spawn(move || {
        let result = source.migrate(&mut guest, &address);
        (result, guest)
    });

    // Samples of the first iteration in progress, source and destination.
    let mut remaining_seen = Vec::new();
    let mut destination_pages_seen = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    while !migration.is_finished() {
        assert!(Instant::now() < deadline, "the migration did not end");
        if stats.status() == MigrationStatus::Active && stats.iteration() == 0 {
            let (sent, size) = stats.iteration_progress();
            let remaining = size - sent;
            if size == memory
                && sent > 0
                && remaining > 0
                && remaining_seen.last() != Some(&remaining)
            {
                remaining_seen.push(remaining);
            }
        }
        if received.phase() == ReceivePhase::Receiving && received.iterations_done() == 0 {
            assert_eq!(received.total_bytes(), memory);
            let pages = received.pages();
            if pages > 0 && pages < received.total_pages() {
                destination_pages_seen.push(pages);
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let (result, _guest) = join_within(migration, "the migration");
    let final_stats = result.expect("migration");
    join_within(destination, "the destination").expect("destination");
    assert_eq!(received.phase(), ReceivePhase::Resumed);

    assert!(
        remaining_seen.len() >= 2,
        "remaining bytes moved within the first iteration: {remaining_seen:?}"
    );
    assert!(
        remaining_seen.windows(2).all(|pair| pair[1] < pair[0]),
        "remaining only falls within an iteration: {remaining_seen:?}"
    );
    assert!(
        !destination_pages_seen.is_empty(),
        "the destination's counters moved before the end"
    );
    assert_eq!(final_stats.ram.remaining, 0);
}

#[test]
fn byte_counters_add_up() {
    let mut guest = guest(32 * MIB, 16 * MIB);
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let source = Source::new(migration_config(3)).unwrap();
    let stats = source.migrate(&mut guest, &address).expect("migration");
    let received = join_within(destination, "the destination").expect("destination");
    let ram = &stats.ram;
    assert_eq!(ram.page_size, 4096);
    assert_eq!(
        ram.precopy_bytes + ram.downtime_bytes,
        ram.transferred,
        "{ram:?}"
    );
    assert!(ram.precopy_bytes > 0, "{ram:?}");
    // The switch-over sends at least the syncs, the state and the
    // completion while the guest is paused.
    assert!(ram.downtime_bytes > 0, "{ram:?}");
    // The main channel carried the state and the completion; the rest went
    // over the page channels, and the destination read exactly that.
    assert!(ram.multifd_bytes < ram.transferred, "{ram:?}");
    assert_eq!(ram.multifd_bytes, received.stats.received);
    assert!(stats.ram.dirty_sync_count >= 2);
}

#[test]
fn zero_copy_counters_are_live_at_each_sync() {
    // A guest that keeps dirtying and a switch-over forced after a few
    // iterations: several syncs happen while the guest still runs.
    let mut guest = guest(16 * MIB, 64 * MIB);
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut config = migration_config(2);
    config.zero_copy = true;
    config.zero_copy_window = 1 << 20;
    config.downtime_limit = Duration::from_micros(1);
    config.max_iterations = Some(4);
    // Slow enough for the poller below to see the iterations.
    config.max_bandwidth = Some(32 * MIB);
    config.limit_policy = tern_engine::LimitPolicy::SwitchOver;
    let source = Source::new(config).unwrap();
    let stats = source.stats();
    let migration = std::thread::spawn(move || source.migrate(&mut guest, &address));

    let mut live = None;
    let deadline = Instant::now() + DEADLINE;
    while !migration.is_finished() {
        assert!(Instant::now() < deadline, "the migration did not end");
        if stats.status() == MigrationStatus::Active
            && let Some(zero_copy) = stats.snapshot().zero_copy
        {
            live = Some(zero_copy);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let final_stats = join_within(migration, "the migration").expect("migration");
    join_within(destination, "the destination").expect("destination");
    assert!(final_stats.digest_verified);

    let live = live.expect("zero-copy counters were published while the guest ran");
    assert!(live.syncs >= 1, "{live:?}");
    assert!(live.last_sync_sends_completed > 0, "{live:?}");
    // Loopback copies every send, and says so per notification range.
    assert_eq!(live.last_sync_sends_copied, live.last_sync_sends_completed);
    assert_eq!(live.last_sync_copied_bytes, live.last_sync_zero_copy_bytes);
    let at_end = final_stats.zero_copy.expect("zero-copy statistics");
    assert!(at_end.syncs > live.syncs, "{live:?} then {at_end:?}");
    assert_eq!(at_end.sends_copied, at_end.sends_queued);
    assert_eq!(at_end.sends_completed, at_end.sends_queued);
}

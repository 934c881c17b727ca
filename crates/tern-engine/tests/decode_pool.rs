//! Compressed migrations whose destination decompresses on a pool of
//! decoder threads (`ReceiveConfig::decode_threads`), over real sockets,
//! checked by digest: with one channel (the pool gives it more than one
//! core) and with several (any decoder takes any channel's packets), with
//! a dirtying guest, so that pages are resent across iterations and each
//! sync must mean that everything before it has landed.

use crate::common;

use common::*;
use tern_engine::{Destination, MigrationStatus, Source};
use tern_page::codec::CodecChoice;

/// Migrates a guest of `memory` bytes dirtied at `dirty_rate` over
/// `channels` channels with zstd, to a destination with `decode_threads`
/// decoders; returns the source's statistics.
fn migrate_compressed(
    channels: u16,
    decode_threads: usize,
    memory: u64,
    dirty_rate: u64,
) -> tern_engine::MigrationStats {
    let mut guest = guest(memory, dirty_rate);
    let (listener, address) = tcp_listener();
    let destination = std::thread::spawn(move || {
        Destination::new({
            let mut config = receive_config();
            config.decode_threads = Some(decode_threads);
            config
        })
        .receive(&listener, make_destination_guest)
    });
    let mut config = migration_config(channels);
    config.compression = CodecChoice::Zstd;
    let stats = Source::new(config)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect("migration");
    let mut received = join_within(destination, "the destination").expect("destination");
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(
        stats.digest_verified,
        "{channels} channels, {decode_threads} decoders"
    );
    if dirty_rate == 0 {
        use tern_engine::GuestControl;
        received.guest.pause().unwrap();
        assert_eq!(received.guest.digest(), guest.digest());
    }
    let report = stats.compression.as_ref().expect("compression report");
    assert!(report.codecs["zstd"].compressed > 0, "{report:?}");
    stats
}

#[test]
fn a_paused_guest_arrives_identical_through_the_decoder_pool() {
    for channels in [1, 3] {
        migrate_compressed(channels, 2, 32 * MIB, 0);
    }
}

#[test]
fn a_dirtying_guest_verifies_through_the_decoder_pool() {
    for (channels, decoders) in [(1, 2), (2, 3), (3, 1)] {
        let stats = migrate_compressed(channels, decoders, 32 * MIB, 8 * MIB);
        // At least the first copy and the final pass, each ending in a sync.
        assert!(stats.ram.dirty_sync_count >= 2, "{:?}", stats.ram);
    }
}

#[test]
fn without_decoder_threads_each_receiver_decodes_its_own_packets() {
    migrate_compressed(2, 0, 32 * MIB, 8 * MIB);
}

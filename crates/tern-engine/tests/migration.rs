//! End-to-end migrations between a source and a destination in this
//! process, over real sockets, checked by digest.

use crate::common;

use std::time::Duration;

use common::*;
use tern_engine::{
    Address, Destination, GuestControl, LimitPolicy, Listener, MigrationError, MigrationStatus,
    Source, ZeroPageDetection,
};
use tern_synthetic::{ContentMix, SyntheticConfig};

fn migrate_and_check(
    guest: &mut tern_synthetic::SyntheticGuest,
    config: tern_engine::MigrationConfig,
    listener: Listener,
    address: Address,
) -> (tern_engine::MigrationStats, tern_synthetic::SyntheticGuest) {
    let destination = spawn_destination(listener);
    let source = Source::new(config).unwrap();
    let stats = source.migrate(guest, &address).expect("migration");
    let received = join_within(destination, "the destination").expect("destination");
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(stats.digest_verified);
    (stats, received.guest)
}

#[test]
fn paused_guest_arrives_identical_over_tcp() {
    let mut guest = guest(64 * MIB, 0);
    let (listener, address) = tcp_listener();
    let (stats, mut destination) =
        migrate_and_check(&mut guest, migration_config(2), listener, address);
    destination.pause().unwrap();
    assert_eq!(destination.digest(), guest.digest());
    let pages = 64 * MIB / 4096;
    assert_eq!(stats.ram.normal + stats.ram.duplicate, pages);
    // Half the pages are zero pages in the default mix.
    assert!(stats.ram.duplicate > pages / 3, "{:?}", stats.ram);
    assert_eq!(stats.ram.iterations, 1);
    let destination_stats = stats.destination.expect("destination stats");
    assert_eq!(destination_stats.normal_pages, stats.ram.normal);
}

#[test]
fn dirtying_guest_converges_and_resumes_on_destination() {
    let mut guest = guest(64 * MIB, 32 * MIB);
    let (listener, address) = tcp_listener();
    let (stats, mut destination) =
        migrate_and_check(&mut guest, migration_config(3), listener, address);
    assert!(!guest.is_running(), "the source stays paused after success");
    assert!(stats.ram.dirty_sync_count >= 2);
    // The guest carries on dirtying memory on the destination.
    let before = destination.dirtied_pages();
    wait_until("the destination guest dirties memory", || {
        destination.dirtied_pages() > before
    });
    destination.pause().unwrap();
}

#[test]
fn unix_socket_and_several_regions() {
    let mut guest = guest_with(SyntheticConfig {
        memory_bytes: 48 * MIB,
        regions: 3,
        mix: "20:40:40".parse().unwrap(),
        seed: 5,
        dirty_rate_bytes_per_sec: 16 * MIB,
        working_set_bytes: 48 * MIB,
        dirtier_threads: 2,
    });
    let dir = tempfile::tempdir().unwrap();
    let address = Address::Unix(dir.path().join("m.sock"));
    let listener = Listener::bind(&address).unwrap();
    let (_, mut destination) =
        migrate_and_check(&mut guest, migration_config(4), listener, address);
    destination.pause().unwrap();
}

#[test]
fn every_zero_page_detection_mode_verifies() {
    for mode in [
        ZeroPageDetection::None,
        ZeroPageDetection::Source,
        ZeroPageDetection::Workers,
    ] {
        let mut guest = guest(32 * MIB, 0);
        let (listener, address) = tcp_listener();
        let mut config = migration_config(2);
        config.zero_page_detection = mode;
        let (stats, _destination) = migrate_and_check(&mut guest, config, listener, address);
        if mode == ZeroPageDetection::None {
            assert_eq!(stats.ram.duplicate, 0);
        } else {
            assert!(stats.ram.duplicate > 0);
        }
    }
}

#[test]
fn bandwidth_cap_is_respected_on_average() {
    let mut guest = guest_with(SyntheticConfig {
        memory_bytes: 32 * MIB,
        regions: 1,
        mix: ContentMix::new(0, 100, 0).unwrap(),
        seed: 1,
        dirty_rate_bytes_per_sec: 0,
        working_set_bytes: 0,
        dirtier_threads: 1,
    });
    let (listener, address) = tcp_listener();
    let mut config = migration_config(2);
    config.max_bandwidth = Some(64 * MIB);
    let (stats, _) = migrate_and_check(&mut guest, config, listener, address);
    // 32 MiB at 64 MiB/s cannot take less than half a second; the cap is a
    // lower bound on time, which holds on any machine however slow.
    assert!(stats.total_time >= 450, "{} ms", stats.total_time);
}

#[test]
fn iteration_limit_with_cancel_policy_leaves_source_running() {
    // A guest dirtying far faster than a throttled link can carry.
    let mut guest = guest_with(SyntheticConfig {
        memory_bytes: 32 * MIB,
        regions: 1,
        mix: ContentMix::new(0, 100, 0).unwrap(),
        seed: 3,
        dirty_rate_bytes_per_sec: 512 * MIB,
        working_set_bytes: 32 * MIB,
        dirtier_threads: 1,
    });
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut config = migration_config(2);
    config.max_bandwidth = Some(32 * MIB);
    config.max_iterations = Some(2);
    config.auto_converge = false;
    config.downtime_limit = Duration::from_millis(1);
    let failure = Source::new(config)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect_err("cannot converge");
    assert!(matches!(failure.error, MigrationError::LimitReached(_)));
    assert_eq!(failure.stats.status, MigrationStatus::Failed);
    assert!(guest.is_running(), "the source guest must keep running");
    let error = join_within(destination, "the destination").expect_err("destination must fail");
    assert!(
        matches!(error, MigrationError::PeerAborted { .. }),
        "{error}"
    );
    guest.pause().unwrap();
}

#[test]
fn iteration_limit_with_switch_over_policy_completes() {
    let mut guest = guest(32 * MIB, 64 * MIB);
    let (listener, address) = tcp_listener();
    let mut config = migration_config(2);
    // A slow link and a 1 ms limit: the dirty working set can never fit.
    config.max_bandwidth = Some(64 * MIB);
    config.max_iterations = Some(2);
    config.auto_converge = false;
    config.downtime_limit = Duration::from_millis(1);
    config.limit_policy = LimitPolicy::SwitchOver;
    let (stats, mut destination) = migrate_and_check(&mut guest, config, listener, address);
    assert!(stats.forced_switch_over);
    destination.pause().unwrap();
}

#[test]
fn auto_converge_throttles_a_fast_dirtier() {
    let mut guest = guest_with(SyntheticConfig {
        memory_bytes: 32 * MIB,
        regions: 1,
        mix: ContentMix::new(0, 100, 0).unwrap(),
        seed: 9,
        dirty_rate_bytes_per_sec: 256 * MIB,
        working_set_bytes: 32 * MIB,
        dirtier_threads: 1,
    });
    let (listener, address) = tcp_listener();
    let mut config = migration_config(1);
    config.max_bandwidth = Some(48 * MIB);
    config.downtime_limit = Duration::from_millis(20);
    let (stats, mut destination) = migrate_and_check(&mut guest, config, listener, address);
    assert!(stats.cpu_throttle_percentage >= 20, "{stats:?}");
    destination.pause().unwrap();
}

#[test]
fn cancellation_leaves_source_running_and_intact() {
    let mut guest = guest(64 * MIB, 0);
    let digest_before = guest.digest();
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut config = migration_config(2);
    config.max_bandwidth = Some(16 * MIB);
    let source = Source::new(config).unwrap();
    let cancel = source.cancel_token();
    let stats = source.stats();
    // Cancelled while pages move, however long the connection takes; the
    // slow link keeps the transfer running for seconds after that.
    let canceller = std::thread::spawn(move || {
        wait_until("the migration is active", || {
            stats.status() == MigrationStatus::Active
        });
        cancel.cancel();
    });
    let failure = source.migrate(&mut guest, &address).expect_err("cancelled");
    join_within(canceller, "the canceller");
    assert!(matches!(failure.error, MigrationError::Cancelled));
    assert_eq!(failure.stats.status, MigrationStatus::Cancelled);
    assert_eq!(guest.digest(), digest_before);
    let error = join_within(destination, "the destination").expect_err("destination must fail");
    assert!(error.to_string().contains("cancelled"), "{error}");
}

#[test]
fn mismatched_destination_layout_is_refused() {
    let mut guest = guest(8 * MIB, 0);
    let (listener, address) = tcp_listener();
    let destination = std::thread::spawn(move || {
        tern_engine::Destination::new(receive_config()).receive(&listener, |_| {
            tern_synthetic::SyntheticGuest::empty(&[4 * MIB])
                .map_err(|e| tern_engine::GuestError::with_source("destination", e))
        })
    });
    let failure = Source::new(migration_config(1))
        .unwrap()
        .migrate(&mut guest, &address)
        .expect_err("layout differs");
    assert!(
        failure.error.to_string().contains("incompatible setup"),
        "{}",
        failure.error
    );
    assert!(matches!(
        join_within(destination, "the destination"),
        Err(MigrationError::Incompatible(_))
    ));
}

/// A guest whose dirty log forgets every write: the destination ends up
/// with stale pages, and only the digest can tell.
struct ForgetfulDirtyLog(tern_synthetic::SyntheticGuest);

impl tern_engine::GuestMemory for ForgetfulDirtyLog {
    fn regions(&self) -> &[tern_engine::MemoryRegion] {
        self.0.regions()
    }
}

impl tern_engine::DirtyLog for ForgetfulDirtyLog {
    fn start_dirty_log(&mut self) -> tern_engine::GuestResult<()> {
        self.0.start_dirty_log()
    }

    fn sync_dirty_log(
        &mut self,
        bitmaps: &mut [tern_engine::DirtyBitmap],
    ) -> tern_engine::GuestResult<()> {
        let mut discarded: Vec<tern_engine::DirtyBitmap> = bitmaps
            .iter()
            .map(|bitmap| tern_engine::DirtyBitmap::new(bitmap.pages()))
            .collect();
        self.0.sync_dirty_log(&mut discarded)
    }

    fn stop_dirty_log(&mut self) -> tern_engine::GuestResult<()> {
        self.0.stop_dirty_log()
    }
}

impl GuestControl for ForgetfulDirtyLog {
    fn pause(&mut self) -> tern_engine::GuestResult<()> {
        self.0.pause()
    }

    fn resume(&mut self) -> tern_engine::GuestResult<()> {
        self.0.resume()
    }

    fn set_throttle(&mut self, percent: u8) -> tern_engine::GuestResult<()> {
        self.0.set_throttle(percent)
    }
}

impl tern_engine::DeviceState for ForgetfulDirtyLog {
    fn save_state(&mut self) -> tern_engine::GuestResult<Vec<tern_engine::StateSection>> {
        self.0.save_state()
    }

    fn restore_state(
        &mut self,
        sections: &[tern_engine::StateSection],
    ) -> tern_engine::GuestResult<()> {
        self.0.restore_state(sections)
    }
}

#[test]
fn a_lying_dirty_log_is_caught_by_the_digest_and_the_source_runs_on() {
    let mut guest = ForgetfulDirtyLog(guest(32 * MIB, 64 * MIB));
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    // A slow link gives the dirtier time to change pages already sent.
    let mut config = migration_config(2);
    config.max_bandwidth = Some(64 * MIB);
    let failure = Source::new(config)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect_err("stale pages must be detected");
    assert!(
        matches!(failure.error, MigrationError::DigestMismatch { .. }),
        "{}",
        failure.error.chain()
    );
    assert_eq!(failure.stats.status, MigrationStatus::Failed);
    assert!(!failure.stats.digest_verified);
    assert!(guest.0.is_running(), "the source guest must run on");
    let error = join_within(destination, "the destination").expect_err("destination must refuse");
    assert!(
        matches!(error, MigrationError::DigestMismatch { .. }),
        "{error}"
    );
    guest.0.pause().unwrap();
}

#[test]
fn verify_none_skips_the_digest() {
    let mut guest = guest(16 * MIB, 0);
    let (listener, address) = tcp_listener();
    let mut config = migration_config(1);
    config.verify = tern_engine::Verify::None;
    // Skipping the digest is the destination's choice too.
    let destination = std::thread::spawn(move || {
        let config = {
            let mut config = receive_config();
            config.allow_unverified = true;
            config
        };
        Destination::new(config).receive(&listener, make_destination_guest)
    });
    let stats = Source::new(config)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect("migration");
    let received = join_within(destination, "the destination").expect("destination");
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(!stats.digest_verified);
    let mut destination_guest = received.guest;
    destination_guest.pause().unwrap();
    assert_eq!(destination_guest.digest(), guest.digest());
}

#[test]
fn zero_copy_over_loopback_is_accounted_as_copied_and_verifies() {
    let mut guest = guest(32 * MIB, 8 * MIB);
    let (listener, address) = tcp_listener();
    let mut config = migration_config(2);
    config.zero_copy = true;
    config.zero_copy_window = 1 << 20;
    let (stats, mut destination) = migrate_and_check(&mut guest, config, listener, address);
    let zero_copy = stats.zero_copy.expect("zero-copy statistics");
    assert!(zero_copy.sends_queued > 0);
    assert_eq!(zero_copy.sends_completed, zero_copy.sends_queued);
    // Loopback never transmits from user pages: the kernel copies them and
    // says so in every notification.
    assert_eq!(zero_copy.sends_copied, zero_copy.sends_queued);
    assert!(zero_copy.max_outstanding_bytes <= 1 << 20);
    destination.pause().unwrap();
}

#[test]
fn io_uring_zero_copy_over_loopback_is_accounted_and_verifies() {
    let mut guest = guest(32 * MIB, 8 * MIB);
    let (listener, address) = tcp_listener();
    let mut config = migration_config(2);
    config.zero_copy = true;
    config.zero_copy_backend = tern_engine::ZeroCopyBackend::Uring;
    config.zero_copy_window = 1 << 20;
    let destination = spawn_destination(listener);
    match Source::new(config).unwrap().migrate(&mut guest, &address) {
        Ok(stats) => {
            join_within(destination, "the destination").expect("destination");
            assert!(stats.digest_verified);
            let zero_copy = stats.zero_copy.expect("zero-copy statistics");
            assert!(zero_copy.sends_queued > 0);
            assert_eq!(zero_copy.sends_completed, zero_copy.sends_queued);
            assert_eq!(zero_copy.sends_copied, zero_copy.sends_queued);
        }
        Err(failure)
            if failure
                .error
                .chain()
                .contains("io_uring SENDMSG_ZC is not available") =>
        {
            tern_test_skip::skip(tern_test_skip::Need::IoUring, failure.error.chain());
            let _ = join_within(destination, "the destination");
        }
        Err(failure) => panic!("{}", failure.error.chain()),
    }
}

#[test]
fn zero_copy_over_a_unix_socket_is_refused_before_connecting() {
    let mut guest = guest(4 * MIB, 0);
    let dir = tempfile::tempdir().unwrap();
    let address = Address::Unix(dir.path().join("z.sock"));
    let listener = Listener::bind(&address).unwrap();
    let destination = Destination::new(receive_config());
    let cancel = destination.cancel_token();
    let destination =
        std::thread::spawn(move || destination.receive(&listener, make_destination_guest));
    let mut config = migration_config(1);
    config.zero_copy = true;
    let failure = Source::new(config)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect_err("unix sockets have no MSG_ZEROCOPY");
    let chain = failure.error.chain();
    // The engine names its config field; the command line maps it to a flag.
    assert!(
        chain.contains("zero_copy") && chain.contains("unix"),
        "{chain}"
    );
    // Refused before connecting: the destination is still waiting for a
    // source, and stops only when cancelled.
    assert!(!destination.is_finished());
    cancel.cancel();
    assert!(join_within(destination, "the destination").is_err());
}

#[test]
fn every_codec_verifies_and_reports() {
    use tern_page::codec::CodecChoice;
    for choice in [CodecChoice::Zstd, CodecChoice::Deflate, CodecChoice::Lz4] {
        let mut guest = guest(32 * MIB, 8 * MIB);
        let (listener, address) = tcp_listener();
        let mut config = migration_config(2);
        config.compression = choice;
        let (stats, mut destination) = migrate_and_check(&mut guest, config, listener, address);
        let report = stats.compression.expect("compression report");
        let codec = &report.codecs[choice.name()];
        assert!(codec.compressed > 0, "{choice}: {report:?}");
        // Random pages are recognised by sampling and sent raw.
        assert!(codec.skipped_by_sampling > 0, "{choice}: {report:?}");
        assert!(codec.ratio > 1.0);
        // Compressed text pages make the wire carry less than the data.
        assert!(stats.ram.transferred < stats.ram.normal_bytes);
        destination.pause().unwrap();
    }
}

#[test]
fn adaptive_compression_on_a_slow_link_compresses_and_verifies() {
    let mut guest = guest(32 * MIB, 0);
    let (listener, address) = tcp_listener();
    let mut config = migration_config(2);
    config.compression = tern_page::codec::CodecChoice::Auto;
    config.max_bandwidth = Some(16 * MIB);
    let (stats, _destination) = migrate_and_check(&mut guest, config, listener, address);
    let report = stats.compression.expect("compression report");
    assert_eq!(report.choice, "auto");
    // On a link this slow any codec beats sending raw, and auto starts
    // with one (calibration's best ratio): every data page goes through a
    // codec, none raw for want of a first decision.
    assert!(report.codecs.values().any(|codec| codec.compressed > 0));
    let through_codecs: u64 = report.codecs.values().map(|codec| codec.pages).sum();
    assert_eq!(through_codecs, stats.ram.normal, "{report:?}");
}

#[test]
fn zero_copy_and_compression_together_are_refused_up_front() {
    let mut config = migration_config(1);
    config.zero_copy = true;
    config.compression = tern_page::codec::CodecChoice::Zstd;
    let error = Source::new(config).expect_err("incompatible options");
    let text = error.to_string();
    assert!(
        matches!(
            error,
            MigrationError::InvalidConfig {
                field: "zero_copy",
                ..
            }
        ),
        "{text}"
    );
    assert!(text.contains("compression (zstd)"), "{text}");
}

#[test]
fn missing_accelerators_are_clear_errors_at_start_up() {
    let mut config = migration_config(1);
    config.compression = tern_page::codec::CodecChoice::Qpl;
    if tern_page::codec::qpl_available().is_ok() {
        tern_test_skip::skip(
            tern_test_skip::Need::NoQpl,
            "libqpl is installed here, so QPL cannot be missing",
        );
    } else {
        let error = Source::new(config).expect_err("no libqpl");
        assert!(error.to_string().contains("libqpl"), "{error}");
    }
    let mut config = migration_config(1);
    config.zero_page_detection = ZeroPageDetection::Dsa;
    if std::path::Path::new("/dev/dsa").exists() {
        tern_test_skip::skip(
            tern_test_skip::Need::NoAccelerator,
            "this machine has DSA devices",
        );
    } else {
        let error = Source::new(config).expect_err("no DSA");
        assert!(error.to_string().contains("no DSA work queue"), "{error}");
    }
}

#[test]
fn dsa_offload_on_the_software_device_with_faults_and_errors_verifies() {
    use std::sync::Arc;
    use tern_dsa::{SoftwareDsaConfig, software_dsa};
    let mut guest = guest(32 * MIB, 8 * MIB);
    let (listener, address) = tcp_listener();
    let mut config = migration_config(2);
    config.zero_page_detection = ZeroPageDetection::Dsa;
    // Every 7th page faults part-way; every 101st comes back with a device
    // error: the CPU must finish both, and the memory must still match.
    config.zero_page_offload = Some(software_dsa(SoftwareDsaConfig {
        fault_if: Some(Arc::new(|index, _| index % 7 == 0)),
        error_if: Some(Arc::new(|index, _| index % 101 == 0)),
        ..SoftwareDsaConfig::default()
    }));
    let (stats, mut destination) = migrate_and_check(&mut guest, config, listener, address);
    let detection = stats.zero_page_detection.expect("detection report");
    assert_eq!(detection.mode, "dsa");
    let offload = detection.offload.expect("offload counters");
    assert!(offload.pages_device > 0, "{offload:?}");
    assert!(offload.page_faults > 0, "{offload:?}");
    assert!(offload.cpu_fallbacks > 0, "{offload:?}");
    assert!(stats.ram.duplicate > 0);
    destination.pause().unwrap();
}

#[test]
fn zero_pages_sent_as_normal_on_request() {
    let mut guest = guest_with(SyntheticConfig {
        memory_bytes: 16 * MIB,
        regions: 1,
        mix: ContentMix::new(100, 0, 0).unwrap(),
        seed: 2,
        dirty_rate_bytes_per_sec: 0,
        working_set_bytes: 0,
        dirtier_threads: 1,
    });
    let (listener, address) = tcp_listener();
    let mut config = migration_config(1);
    config.zero_page_as_normal = 0.25;
    let (stats, _) = migrate_and_check(&mut guest, config, listener, address);
    let pages = 16 * MIB / 4096;
    assert_eq!(stats.ram.normal + stats.ram.duplicate, pages);
    assert_eq!(stats.ram.normal, pages / 4);
}

#[test]
fn zero_copy_to_a_unix_socket_is_refused_before_connecting() {
    let dir = tempfile::tempdir().unwrap();
    let address = Address::Unix(dir.path().join("tern.sock"));
    let listener = Listener::bind(&address).unwrap();
    let source = Source::new({
        let mut config = migration_config(2);
        config.zero_copy = true;
        config
    })
    .unwrap();
    let mut guest = guest(4 * MIB, 0);
    let failure = source.migrate(&mut guest, &address).unwrap_err();
    assert!(
        matches!(
            failure.error,
            MigrationError::UnsupportedTransport {
                field: "zero_copy",
                ..
            }
        ),
        "{:?}",
        failure.error
    );
    assert_eq!(failure.stats.ram.transferred, 0);
    // A connection would wait in the listener's backlog; there is none.
    assert!(
        matches!(
            listener.accept_timeout(Duration::from_millis(1)),
            Err(tern_engine::ChannelError::Timeout(_))
        ),
        "the source connected before refusing"
    );
}

/// A destination with its own QPL path for inflating deflate pages.
fn spawn_destination_inflating_with(
    listener: Listener,
    qpl_path: tern_engine::QplPath,
) -> std::thread::JoinHandle<DestinationResult> {
    std::thread::spawn(move || {
        Destination::new({
            let mut config = receive_config();
            config.qpl_path = qpl_path;
            config
        })
        .receive(&listener, make_destination_guest)
    })
}

#[test]
fn deflate_pages_verify_whichever_inflate_the_destination_picks() {
    use tern_engine::QplPath;
    // Without IAA (every machine here) `auto` and `software` inflate with
    // libdeflate; with IAA `auto` would use it, and the digest must agree.
    for qpl_path in [QplPath::Auto, QplPath::Software] {
        let mut guest = guest(16 * MIB, 4 * MIB);
        let (listener, address) = tcp_listener();
        let destination = spawn_destination_inflating_with(listener, qpl_path);
        let mut config = migration_config(2);
        config.compression = tern_page::codec::CodecChoice::Deflate;
        let stats = Source::new(config)
            .unwrap()
            .migrate(&mut guest, &address)
            .expect("migration");
        join_within(destination, "the destination").expect("destination");
        assert!(stats.digest_verified, "{qpl_path}");
        assert!(stats.compression.expect("compression").codecs["deflate"].compressed > 0);
    }
}

#[test]
fn a_destination_that_requires_iaa_without_it_fails_naming_libqpl() {
    use tern_engine::QplPath;
    if tern_page::codec::qpl_available().is_ok() {
        tern_test_skip::skip(
            tern_test_skip::Need::NoQpl,
            "libqpl loads here; this checks a destination without it",
        );
        return;
    }
    let mut guest = guest(8 * MIB, 0);
    let (listener, address) = tcp_listener();
    let destination = spawn_destination_inflating_with(listener, QplPath::Hardware);
    let mut config = migration_config(1);
    config.compression = tern_page::codec::CodecChoice::Deflate;
    let failure = Source::new(config)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect_err("the destination cannot inflate as required");
    let error = join_within(destination, "the destination").expect_err("no IAA, no libqpl");
    let message = format!("{error:#}") + &format!(" {:?}", error);
    assert!(message.contains("libqpl"), "{message}");
    assert_ne!(failure.stats.status, MigrationStatus::Completed);
}

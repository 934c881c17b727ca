//! The control handles in the library: events in order on both sides, the
//! live and final query, parameters refused after the end, the paused
//! hand-over (the cross-process tests are in crates/tern/tests/control.rs).

use crate::common;

use common::*;
use tern_engine::control::GuestState;
use tern_engine::{
    ControlError, Destination, EventBody, GuestControl, MigrationParameters, MigrationStatus,
    Source,
};

fn names(events: impl Iterator<Item = tern_engine::Event>) -> Vec<String> {
    events
        .map(|event| match event.body {
            EventBody::Migration(change) => format!("MIGRATION:{}", change.status.as_str()),
            EventBody::MigrationPass(pass) => format!("PASS:{}", pass.pass()),
            EventBody::MigrationThrottle(_) => "THROTTLE".into(),
            EventBody::MigrationParameters(_) => "PARAMETERS".into(),
            EventBody::Resume(_) => "RESUME".into(),
            other => format!("{other:?}"),
        })
        .collect()
}

#[test]
fn both_sides_report_events_in_order_and_keep_the_final_report() {
    let (listener, address) = tcp_listener();
    let destination = Destination::new({
        let mut config = receive_config();
        config.keep_paused = true;
        config
    });
    let receive_handle = destination.handle();
    let destination_events = receive_handle.subscribe();
    let receiving =
        std::thread::spawn(move || destination.receive(&listener, make_destination_guest));
    let source = Source::new(migration_config(2)).unwrap();
    let handle = source.handle();
    let source_events = handle.subscribe();
    let mut guest = guest(16 * MIB, 0);
    let stats = source.migrate(&mut guest, &address).unwrap();
    let mut received = join_within(receiving, "the destination").unwrap();

    let source_names = names(source_events);
    assert_eq!(source_names[..2], ["MIGRATION:setup", "MIGRATION:active"]);
    assert_eq!(source_names[2], "PASS:1", "{source_names:?}");
    assert_eq!(
        source_names[source_names.len() - 2..],
        ["MIGRATION:device", "MIGRATION:completed"]
    );
    // The destination's passes come between active and device, one per
    // iteration every page channel finished, numbered from 1.
    let destination_names = names(destination_events);
    let passes = &destination_names[2..destination_names.len() - 2];
    assert!(!passes.is_empty(), "{destination_names:?}");
    assert_eq!(
        passes,
        (1..=passes.len())
            .map(|pass| format!("PASS:{pass}"))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        [
            &destination_names[..2],
            &destination_names[destination_names.len() - 2..]
        ]
        .concat(),
        [
            "MIGRATION:setup",
            "MIGRATION:active",
            "MIGRATION:device",
            "MIGRATION:completed"
        ]
    );
    // The final report, the destination's figures included, stays queryable.
    assert_eq!(handle.query(), stats);
    assert!(handle.query().destination.is_some());
    assert_eq!(handle.query().version, tern_engine::CONTRACT_VERSION);
    let late = handle.subscribe().collect::<Vec<_>>();
    assert_eq!(names(late.into_iter()), ["MIGRATION:completed"]);
    assert_eq!(
        handle.set_parameters(&{
            let mut config = MigrationParameters::default();
            config.downtime_limit = Some(10);
            config
        }),
        Err(ControlError::Ended("completed"))
    );
    // Kept paused: handed over, not resumed.
    assert!(!received.resumed);
    let report = receive_handle.query();
    assert_eq!(report.status, MigrationStatus::Completed);
    assert_eq!(report.guest, Some(GuestState::Paused));
    assert!(report.digest_verified);
    assert_eq!(
        receive_handle.query().iterations,
        passes.len() as u64,
        "one pass per iteration"
    );
    received.guest.resume().unwrap();
    receive_handle.note_resumed();
    assert_eq!(receive_handle.query().guest, Some(GuestState::Running));
    // A watcher that comes after the end gets the whole history, the
    // RESUME included, numbered without gaps.
    let history = receive_handle.history();
    assert_eq!(history.dropped, 0);
    let seqs: Vec<u64> = history.events.iter().map(|event| event.seq).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    assert_eq!(
        names(receive_handle.subscribe_with_history()),
        [destination_names, vec!["RESUME".to_string()]].concat()
    );
    assert_eq!(
        names(handle.subscribe_with_history()),
        source_names,
        "the source's history is every event it sent"
    );
}

#[test]
fn a_failed_reception_is_reported_with_its_cause() {
    let (listener, address) = tcp_listener();
    let destination = Destination::new(receive_config());
    let handle = destination.handle();
    let receiving =
        std::thread::spawn(move || destination.receive(&listener, make_destination_guest));
    let mut config = migration_config(1);
    config.max_bandwidth = Some(2 * MIB);
    let source = Source::new(config).unwrap();
    let source_handle = source.handle();
    let mut guest = guest(32 * MIB, 0);
    let migrating = std::thread::spawn(move || source.migrate(&mut guest, &address));
    wait_until("the destination receives", || {
        handle.query().stats.received > 0
    });
    assert_eq!(handle.query().status, MigrationStatus::Active);
    source_handle.cancel();
    let failure = join_within(migrating, "the migration").unwrap_err();
    assert_eq!(failure.stats.status, MigrationStatus::Cancelled);
    assert_eq!(failure.stats.failed_in, Some(MigrationStatus::Active));
    assert!(join_within(receiving, "the destination").is_err());
    let report = handle.query();
    assert_eq!(report.status, MigrationStatus::Failed);
    assert_eq!(report.failed_in, Some(MigrationStatus::Active));
    assert!(report.error_desc.unwrap().contains("cancel"));
}

/// The VMM's configuration reaches the setup callback before the guest is
/// built; one longer than the destination accepts is refused at the hello
/// that announces it; a frame longer than announced is refused at its
/// header, before its body is read.
#[test]
fn the_vmm_configuration_reaches_the_setup_callback_and_is_bounded() {
    let blob: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    // Delivered.
    let (listener, address) = tcp_listener();
    let (given, delivered) = std::sync::mpsc::channel();
    let receiving = std::thread::spawn(move || {
        Destination::new(receive_config()).receive_with_vmm_config(&listener, |setup, config| {
            given.send(config.to_vec()).unwrap();
            make_destination_guest(setup)
        })
    });
    let source = Source::new({
        let mut config = migration_config(1);
        config.vmm_config = blob.clone();
        config
    })
    .unwrap();
    source.migrate(&mut guest(4 * MIB, 0), &address).unwrap();
    join_within(receiving, "the destination").unwrap();
    assert_eq!(delivered.try_recv().unwrap(), blob);

    // Too large for this destination: refused at the hello, nothing sent.
    let (listener, address) = tcp_listener();
    let receiving = std::thread::spawn(move || {
        Destination::new({
            let mut config = receive_config();
            config.max_vmm_config = 1024;
            config
        })
        .receive(&listener, make_destination_guest)
    });
    let source = Source::new({
        let mut config = migration_config(1);
        config.vmm_config = blob;
        config
    })
    .unwrap();
    let failure = source
        .migrate(&mut guest(4 * MIB, 0), &address)
        .unwrap_err();
    assert_eq!(failure.stats.failed_in, Some(MigrationStatus::Setup));
    assert!(
        failure.error.chain().contains("at most 1024"),
        "{}",
        failure.error.chain()
    );
    assert!(join_within(receiving, "the destination").is_err());
}

#[test]
fn a_vmm_configuration_frame_longer_than_announced_is_refused_at_its_header() {
    use tern_wire::{
        DigestAlgorithm, FrameHeader, FrameKind, Handshake, Hello, Message, RegionInfo,
        SessionSetup,
    };
    let (listener, address) = tcp_listener();
    let receiving = spawn_destination(listener);
    let mut main =
        tern_engine::Channel::connect(&address, std::time::Duration::from_secs(10)).unwrap();
    main.set_timeouts(DEADLINE).unwrap();
    main.send_message(&Message::Hello(Hello {
        handshake: Handshake {
            session_id: 7,
            channel_index: 0,
        },
        setup: SessionSetup {
            page_size: 4096,
            channel_count: 1,
            codecs: 0,
            digest: DigestAlgorithm::Xxh3Pages,
            regions: vec![RegionInfo {
                id: 0,
                guest_addr: 0,
                len: MIB,
            }],
            guest_kind: "synthetic".into(),
            dictionaries: 0,
            vmm_config_len: 16,
        },
    }))
    .unwrap();
    // A header claiming a megabyte, and no body: the destination must
    // refuse it from the header alone.
    let header = FrameHeader {
        kind: FrameKind::VmmConfig,
        body_len: 1 << 20,
    };
    main.write_all(&header.encode()).unwrap();
    let error = join_within(receiving, "the destination").unwrap_err();
    assert!(error.chain().contains("exceeds"), "{}", error.chain());
}

//! The control handles in the library: events in order on both sides, the
//! live and final query, parameters refused after the end, the paused
//! hand-over (the cross-process tests are in crates/tern/tests/control.rs).

mod common;

use common::*;
use tern_engine::control::GuestState;
use tern_engine::{
    ControlError, Destination, EventBody, GuestControl, MigrationParameters, MigrationStatus,
    ReceiveConfig, Source,
};

fn names(events: impl Iterator<Item = tern_engine::Event>) -> Vec<String> {
    events
        .map(|event| match event.body {
            EventBody::Migration(change) => format!("MIGRATION:{}", change.status.as_str()),
            EventBody::MigrationPass(pass) => format!("PASS:{}", pass.pass),
            EventBody::MigrationThrottle(_) => "THROTTLE".into(),
            EventBody::MigrationParameters(_) => "PARAMETERS".into(),
            EventBody::Resume(_) => "RESUME".into(),
        })
        .collect()
}

#[test]
fn both_sides_report_events_in_order_and_keep_the_final_report() {
    let (listener, address) = tcp_listener();
    let destination = Destination::new(ReceiveConfig {
        keep_paused: true,
        ..receive_config()
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
    let mut received = receiving.join().unwrap().unwrap();

    let source_names = names(source_events);
    assert_eq!(source_names[..2], ["MIGRATION:setup", "MIGRATION:active"]);
    assert_eq!(source_names[2], "PASS:1", "{source_names:?}");
    assert_eq!(
        source_names[source_names.len() - 2..],
        ["MIGRATION:device", "MIGRATION:completed"]
    );
    assert_eq!(
        names(destination_events),
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
        handle.set_parameters(&MigrationParameters {
            downtime_limit: Some(10),
            ..MigrationParameters::default()
        }),
        Err(ControlError::Ended("completed"))
    );
    // Kept paused: handed over, not resumed.
    assert!(!received.resumed);
    let report = receive_handle.query();
    assert_eq!(report.status, MigrationStatus::Completed);
    assert_eq!(report.guest, Some(GuestState::Paused));
    assert!(report.digest_verified);
    received.guest.resume().unwrap();
    receive_handle.note_resumed();
    assert_eq!(receive_handle.query().guest, Some(GuestState::Running));
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
    let failure = migrating.join().unwrap().unwrap_err();
    assert_eq!(failure.stats.status, MigrationStatus::Cancelled);
    assert_eq!(failure.stats.failed_in, Some(MigrationStatus::Active));
    assert!(receiving.join().unwrap().is_err());
    let report = handle.query();
    assert_eq!(report.status, MigrationStatus::Failed);
    assert_eq!(report.failed_in, Some(MigrationStatus::Active));
    assert!(report.error_desc.unwrap().contains("cancel"));
}

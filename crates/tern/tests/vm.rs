//! `tern vm` as separate processes, against the host's KVM. Where
//! /dev/kvm is missing each test skips visibly (`tern_test_skip::skip`:
//! `SKIPPED` on the runner's output, counted apart by `.ci/run`) and
//! returns.

use crate::process;

use process::{
    Reaped, Receiver, TlsDirs, assert_reports_tls, event_and_rest, json, tern, wait_until_read,
};
use std::process::Stdio;

/// Whether /dev/kvm exists; where it does not, records the running test's
/// skip (the caller returns at once).
fn kvm_or_skip() -> bool {
    if std::path::Path::new("/dev/kvm").exists() {
        return true;
    }
    tern_test_skip::skip(tern_test_skip::Need::Kvm, "/dev/kvm not available");
    false
}

#[test]
fn vm_demo_json_proves_memory_and_execution() {
    if !kvm_or_skip() {
        return;
    }
    let output = tern()
        .args([
            "vm",
            "demo",
            "--json",
            "--memory",
            "64MiB",
            "--working-set",
            "2MiB",
            "--warmup",
            "200",
            "--run-after",
            "300",
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let report = json(&output);
    assert_eq!(report["status"], "completed");
    assert_eq!(report["digest-verified"], true);
    assert_eq!(report["consistency-check"]["passed"], true, "{report}");
    assert_eq!(report["consistency-check"]["serial-matches"], true);
    assert_eq!(report["guest-runs-on-destination"], true);
    let before = report["pass-count-before"].as_u64().unwrap();
    let after = report["pass-count-after"].as_u64().unwrap();
    assert!(after > before, "{before} -> {after}");
    assert!(report["first-pass-after-ms"].is_u64(), "{report}");
    assert_eq!(report["ram"]["total"], 64 << 20);
    assert_eq!(report["working-set-pages"], 512);
}

#[test]
fn vm_run_reports_the_dirty_rate() {
    if !kvm_or_skip() {
        return;
    }
    let output = tern()
        .args([
            "vm",
            "run",
            "--json",
            "--seconds",
            "0.5",
            "--memory",
            "32MiB",
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let report = json(&output);
    assert!(report["pass-count"].as_u64().unwrap() > 0);
    // The pause may land between a pass's count and its serial byte.
    let owed = report["consistency-check"]["unreported-passes"]
        .as_u64()
        .unwrap();
    assert_eq!(
        report["serial-bytes"].as_u64().unwrap() + owed,
        report["pass-count"].as_u64().unwrap(),
        "{report}"
    );
    assert!(report["page-writes-per-second"].as_f64().unwrap() > 0.0);
    assert_eq!(report["consistency-check"]["passed"], true);
}

/// Starts `tern vm receive` and waits until it listens.
fn receiver(extra: &[&str]) -> Receiver {
    Receiver::spawn(
        &["vm", "receive"],
        &[&["--accept-timeout", "30"], extra].concat(),
    )
}

#[test]
fn vm_migrate_to_vm_receive_between_processes() {
    if !kvm_or_skip() {
        return;
    }
    let destination = receiver(&["--json", "--run-after", "300"]);
    let source = tern()
        .args([
            "vm",
            "migrate",
            "--json",
            "--to",
            &destination.address,
            "--memory",
            "64MiB",
            "--warmup",
            "200",
        ])
        .output()
        .unwrap();
    assert!(source.status.success(), "{source:?}");
    let received = destination.report();
    let source = json(&source);
    assert_eq!(source["status"], "completed");
    assert_eq!(source["digest-verified"], true);
    assert!(
        source["guest-before-migration"]["page-writes-per-second"]
            .as_f64()
            .unwrap()
            > 0.0,
        "{source}"
    );
    assert_eq!(received["consistency-check"]["passed"], true);
    assert_eq!(received["guest-runs-on-destination"], true);
    // The destination resumes the guest before it pauses it again for the
    // check, so a few passes may already have run there; what must hold is
    // that the count carried on from the source's, not from zero.
    let source_count = source["source-pass-count"].as_u64().unwrap();
    let destination_count = received["pass-count-before"].as_u64().unwrap();
    assert!(
        destination_count >= source_count && source_count > 0,
        "the destination carries on from the source's count: source {source_count}, destination {destination_count}"
    );
    // The count as the migration started: after the warm-up's passes, at
    // most where the source stopped (the bench's guest work is measured
    // from it).
    let start_count = source["source-pass-count-at-start"].as_u64().unwrap();
    assert!(
        start_count > 0 && start_count <= source_count,
        "the count at the start: {start_count}, at the end: {source_count}"
    );
}

/// `tern vm migrate` to `tern vm receive` with the given security options
/// on each side: both must complete, the guest run on, and both reports
/// are returned.
fn secured_vm_migration(
    receive: &[&str],
    migrate: &[&str],
) -> (serde_json::Value, serde_json::Value) {
    let destination = receiver(&[&["--json", "--run-after", "200"], receive].concat());
    let source = tern()
        .args(["vm", "migrate", "--json", "--to", &destination.address])
        .args(["--memory", "32MiB", "--warmup", "100"])
        .args(migrate)
        .output()
        .unwrap();
    assert!(source.status.success(), "{source:?}");
    let received = destination.report();
    let source = json(&source);
    assert_eq!(source["status"], "completed");
    assert_eq!(source["digest-verified"], true);
    assert_eq!(received["consistency-check"]["passed"], true);
    assert_eq!(received["guest-runs-on-destination"], true);
    (source, received)
}

#[test]
fn vm_migrate_and_receive_over_tls() {
    if !kvm_or_skip() {
        return;
    }
    let pki = TlsDirs::new();
    let destination = pki.host("destination", &["127.0.0.1"]);
    let source = pki.host("source", &["source.test"]);
    let (source, received) =
        secured_vm_migration(&["--tls-dir", &destination], &["--tls-dir", &source]);
    assert_reports_tls(&source);
    assert_reports_tls(&received);
}

#[test]
fn vm_migrate_and_receive_with_an_auth_key() {
    if !kvm_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "a key shared by both VMMs\n").unwrap();
    let key = key.to_str().unwrap();
    let (source, received) = secured_vm_migration(&["--auth-key", key], &["--auth-key", key]);
    for report in [&source, &received] {
        assert_eq!(report["authenticated"], true, "{report}");
        assert_eq!(report["transport"], "tcp", "{report}");
        assert!(report.get("tls").is_none(), "{report}");
    }
}

#[test]
fn vm_migrate_events_announce_the_start_before_the_report() {
    if !kvm_or_skip() {
        return;
    }
    let destination = receiver(&["--json", "--run-after", "100"]);
    let source = tern()
        .args(["vm", "migrate", "--events", "--json", "--paused"])
        .args(["--to", &destination.address])
        .args(["--memory", "32MiB", "--warmup", "100"])
        .output()
        .unwrap();
    assert!(source.status.success(), "{source:?}");
    let (event, rest) = event_and_rest(&source);
    assert_eq!(event["event"], "migrating", "{event}");
    assert_eq!(event["address"], destination.address.as_str());
    assert_eq!(event["transport"], "tcp");
    let report: serde_json::Value = serde_json::from_slice(rest).unwrap();
    assert_eq!(report["status"], "completed");
    assert_eq!(destination.report()["status"], "completed");
}

#[test]
fn vm_migrate_survives_a_killed_receiver() {
    if !kvm_or_skip() {
        return;
    }
    let Receiver {
        child: mut destination,
        address,
        ..
    } = receiver(&[]);
    let source = tern()
        .args([
            "vm",
            "migrate",
            "--json",
            "--to",
            &address,
            "--memory",
            "64MiB",
            "--warmup",
            "100",
            // Slow enough that the kill lands mid-transfer; uncompressed
            // and without duplicate references, since the test guest's
            // written pages are copies of one another: with dedup (on by
            // default) its 8 MiB of data pages cost about 260 KiB, no more
            // than the bytes waited for below, and the kill landed after
            // the commit (outcome unknown, not failed).
            "--max-bandwidth",
            "4MiB",
            "--compression",
            "none",
            "--dedup",
            "off",
            "--io-timeout",
            "5",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(Reaped::new)
        .unwrap();
    // Some pages have arrived: the kill lands after the handshake, during
    // the transfer, whatever setup costs on a loaded machine.
    wait_until_read(&destination, 256 << 10);
    destination.kill().unwrap();
    destination.wait().unwrap();
    let source = source.wait_with_output().unwrap();
    assert_eq!(source.status.code(), Some(1), "{source:?}");
    let report = json(&source);
    assert_eq!(report["status"], "failed");
    assert_eq!(report["source-guest-runs"], true, "{report}");
}

#[test]
fn vm_migrate_to_a_synthetic_receiver_is_refused_before_any_page_moves() {
    if !kvm_or_skip() {
        return;
    }
    let destination = Receiver::spawn(
        &["receive"],
        &["--accept-timeout", "30", "--progress", "none"],
    );
    let source = tern()
        .args([
            "vm",
            "migrate",
            "--json",
            "--to",
            &destination.address,
            "--memory",
            "64MiB",
            "--warmup",
            "100",
        ])
        .output()
        .unwrap();
    let (status, _, destination_said) = destination.finish();
    let expected = "the destination expects a synthetic guest, the source sends a kvm test guest";
    assert!(!status.success(), "{destination_said}");
    assert!(
        destination_said.to_lowercase().contains(expected),
        "{destination_said}"
    );
    assert!(!source.status.success(), "{source:?}");
    let report = json(&source);
    assert!(
        report.to_string().to_lowercase().contains(expected),
        "{report}"
    );
    assert_eq!(report["ram"]["transferred"], 0, "{report}");
    assert_eq!(report["source-guest-runs"], true, "{report}");
}

/// `tern vm migrate --local` to `tern vm receive --local`: the KVM guest's
/// RAM is a memfd, handed over; the destination VM maps it and the guest
/// carries on there, consistent.
#[test]
fn vm_migrate_local_hands_the_kvm_guest_memory_over() {
    if !kvm_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("unix:{}", dir.path().join("vm-local.sock").display());
    let destination = Receiver::spawn_at(
        &["vm", "receive"],
        &listen,
        &["--local", "--json", "--run-after", "300"],
    );
    let source = tern()
        .args(["vm", "migrate", "--local", "--json"])
        .args(["--to", &destination.address])
        .args(["--memory", "64MiB", "--warmup", "200"])
        .output()
        .unwrap();
    assert!(source.status.success(), "{source:?}");
    let received = destination.report();
    let source = json(&source);
    assert_eq!(source["status"], "completed");
    assert_eq!(source["digest-verified"], true);
    assert_eq!(source["ram"]["normal"], 0, "no page is copied: {source}");
    assert!(
        source.get("source-pass-count").is_none(),
        "the source's memory is revoked: {source}"
    );
    assert_eq!(received["consistency-check"]["passed"], true, "{received}");
    assert_eq!(received["guest-runs-on-destination"], true);
    assert!(received["pass-count-before"].as_u64().unwrap() > 0);
}

#[test]
fn vm_save_reports_the_guest_running_on_after_a_live_save() {
    if !kvm_or_skip() {
        return;
    }
    let directory = tempfile::tempdir().unwrap();
    let file = directory.path().join("guest.tern");
    let output = tern()
        .args(["vm", "save", "--json", "--live", "--memory", "32MiB"])
        .args(["--warmup", "50", "--output", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let report = json(&output);
    // Resumed after the save: its own pass counter moved on.
    assert_eq!(report["guest-runs"], true, "{report}");
    assert!(report["pass-count"].as_u64().unwrap() > 0, "{report}");

    let stopped = directory.path().join("stopped.tern");
    let output = tern()
        .args(["vm", "save", "--json", "--stop", "--memory", "32MiB"])
        .args(["--warmup", "50", "--output", stopped.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert_eq!(json(&output)["guest-runs"], false);
}

/// `tern vm restore` of `file` (on `bases`), eager or lazy, as a user runs it.
fn vm_restore(file: &std::path::Path, bases: &[&std::path::Path], lazy: bool) -> serde_json::Value {
    let mut command = tern();
    command.args(["vm", "restore", "--json", "--run-after", "300"]);
    command.arg("--snapshot").arg(file);
    for base in bases {
        command.arg("--base").arg(base);
    }
    if lazy {
        command.arg("--lazy");
    }
    let output = command.output().unwrap();
    assert!(output.status.success(), "{output:?}");
    json(&output)
}

/// The whole path through the binary for the KVM guest: `tern vm save`
/// (a full snapshot and a tracked diff on it, the guest stopped at the
/// end), then `tern vm restore` eager and `--lazy` of each in new
/// processes: the digest the restore verified is the one the save
/// recorded, and the restored guest's pass counter moves on from where it
/// was saved.
#[test]
fn vm_save_and_restore_eager_lazy_and_diff_between_processes() {
    if !kvm_or_skip() {
        return;
    }
    let directory = tempfile::tempdir().unwrap();
    let full = directory.path().join("full.tern");
    let diff = directory.path().join("diff.tern");
    let output = tern()
        .args([
            "vm",
            "save",
            "--json",
            "--stop",
            "--track-dirty-pages",
            "--memory",
            "32MiB",
        ])
        .args(["--warmup", "50", "--diff-after", "200", "--output"])
        .arg(&full)
        .arg("--diff-output")
        .arg(&diff)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let saved = json(&output);
    let saved_diff = &saved["diffs"][0];
    assert!(saved_diff["digest"].is_string(), "{saved}");
    for (file, bases, digest) in [
        (&full, vec![], &saved["digest"]),
        (&diff, vec![full.as_path()], &saved_diff["digest"]),
    ] {
        for lazy in [false, true] {
            let restored = vm_restore(file, &bases, lazy);
            let context = format!("{} lazy={lazy}: {restored}", file.display());
            assert_eq!(&restored["digest"], digest, "{context}");
            assert_eq!(restored["guest-runs"], true, "{context}");
            let before = restored["pass-count-before"].as_u64().unwrap();
            let after = restored["pass-count-after"].as_u64().unwrap();
            assert!(after > before, "the guest counts on: {context}");
        }
    }
    // The full snapshot was taken with the guest running on afterwards
    // (only the last save stops it), so the diff's guest is further on.
    assert!(saved["pass-count"].as_u64().unwrap() > 0, "{saved}");
}

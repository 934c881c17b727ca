//! The `tern` command line, run as separate processes.

mod process;

use process::{Receiver, json, tern, wait_until_read};
use std::process::Stdio;
use std::time::{Duration, Instant};

#[test]
fn demo_json_completes_and_verifies() {
    let output = tern()
        .args([
            "demo",
            "--json",
            "--memory",
            "64MiB",
            "--working-set",
            "16MiB",
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let report = json(&output);
    assert_eq!(report["status"], "completed");
    assert_eq!(report["digest-verified"], true);
    assert_eq!(report["resumed-on-destination"], true);
    assert_eq!(report["ram"]["total"], 64 << 20);
    assert!(report["destination"]["cpu-seconds"].is_object());
}

#[test]
fn demo_over_a_unix_socket_prints_a_summary() {
    let output = tern()
        .args(["demo", "--unix", "--memory", "32MiB", "--channels", "3"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("completed"), "{text}");
    assert!(text.contains("digest verified  true"), "{text}");
}

#[test]
fn migrate_to_a_separate_receive_process() {
    let receiver = Receiver::spawn(&["receive"], &["--json"]);
    let output = tern()
        .args([
            "migrate",
            "--json",
            "--to",
            &receiver.address,
            "--memory",
            "48MiB",
            "--mix",
            "30:30:40",
            "--dirty-rate",
            "16MiB",
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let source = json(&output);
    assert_eq!(source["status"], "completed");
    // QEMU's query-migrate names, and tern's split of the bytes.
    let ram = &source["ram"];
    assert_eq!(ram["page-size"], 4096);
    assert_eq!(
        ram["precopy-bytes"].as_u64().unwrap() + ram["downtime-bytes"].as_u64().unwrap(),
        ram["transferred"].as_u64().unwrap(),
        "{ram}"
    );
    assert!(ram["multifd-bytes"].as_u64().unwrap() < ram["transferred"].as_u64().unwrap());
    assert!(source["cpu-throttle-percentage"].is_u64(), "{source}");
    let report = receiver.report();
    assert_eq!(report["digest-verified"], true);
    assert_eq!(report["resumed-guest-dirtying"], true);
}

#[test]
fn killed_receiver_fails_the_migration_cleanly() {
    let Receiver {
        child: mut receiver,
        address,
        ..
    } = Receiver::spawn(&["receive"], &["--progress", "none"]);
    // A slow link keeps the migration running long enough to kill the
    // destination in the middle of it.
    let migrate = tern()
        .args([
            "migrate",
            "--json",
            "--to",
            &address,
            "--memory",
            "64MiB",
            "--mix",
            "0:100:0",
            "--max-bandwidth",
            "16MiB",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // 1 MiB of the 64 MiB of random pages: the transfer is under way and
    // still has seconds to go at 16 MiB/s.
    wait_until_read(&receiver, 1 << 20);
    receiver.kill().unwrap();
    receiver.wait().unwrap();
    let started = Instant::now();
    let output = migrate.wait_with_output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let report = json(&output);
    assert_eq!(report["status"], "failed");
    assert!(
        report["error-desc"].as_str().unwrap().contains("Channel"),
        "{report}"
    );
}

#[test]
fn bad_options_are_clear_errors() {
    let output = tern().args(["demo", "--memory", "lots"]).output().unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("not a size"));
    let output = tern()
        .args(["demo", "--channels", "0", "--memory", "4MiB"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--channels 0"));
    let output = tern()
        .args([
            "migrate",
            "--to",
            "unix:/nonexistent/dir/sock",
            "--memory",
            "4MiB",
            "--json",
            "--connect-timeout",
            "1",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(
        json(&output)["error-desc"]
            .as_str()
            .unwrap()
            .contains("Cannot connect")
    );
}

#[test]
fn receive_reports_an_unverified_migration_as_such() {
    let receiver = Receiver::spawn(&["receive"], &["--json"]);
    let output = tern()
        .args(["migrate", "--json", "--to", &receiver.address])
        .args(["--memory", "16MiB"])
        .args(["--dirty-rate", "0", "--verify", "none"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert_eq!(json(&output)["digest-verified"], false);
    assert_eq!(receiver.report()["digest-verified"], false);
}

#[test]
fn receive_json_announces_its_address_on_the_first_line() {
    // As a script would: start the receiver on a port the system picks,
    // read one line, take the address from it, migrate there, then read
    // the report that follows.
    let receiver = Receiver::spawn(&["receive"], &["--json", "--progress", "none"]);
    let (host, port) = receiver.address.rsplit_once(':').unwrap();
    assert_eq!(host, "127.0.0.1");
    assert_ne!(port.parse::<u16>().unwrap(), 0, "the bound port, not 0");
    let output = tern()
        .args(["migrate", "--json", "--progress", "none"])
        .args(["--to", &receiver.address, "--memory", "8MiB"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let (status, rest, stderr) = receiver.finish();
    assert!(status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&rest).unwrap();
    assert_eq!(report["status"], "completed");
    assert_eq!(report["memory"], 8 << 20);
    assert!(
        !stderr.contains("listening on"),
        "the event replaces the old text line: {stderr}"
    );
}

#[test]
fn plain_progress_writes_lines_on_stderr() {
    // A slow link keeps the migration going for a few plain intervals.
    let receiver = Receiver::spawn(&["receive"], &["--progress", "plain"]);
    let output = tern()
        .args(["migrate", "--json", "--progress", "plain"])
        .args(["--to", &receiver.address, "--memory", "32MiB"])
        .args(["--mix", "0:100:0", "--dirty-rate", "0"])
        .args(["--max-bandwidth", "6MiB"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let (status, _, receiver_stderr) = receiver.finish();
    assert!(status.success(), "{receiver_stderr}");
    let source_stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        source_stderr
            .lines()
            .any(|line| line.starts_with("tern: active") && line.contains("iteration 0")),
        "{source_stderr}"
    );
    assert!(
        receiver_stderr
            .lines()
            .any(|line| line.starts_with("tern: receiving")),
        "{receiver_stderr}"
    );
    // No bar escape codes off a terminal.
    assert!(!source_stderr.contains('\u{1b}'), "{source_stderr}");
}

//! The `tern` command line, run as separate processes.

mod process;

use process::{free_port, json, tern};
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
    let address = format!("127.0.0.1:{}", free_port());
    let receiver = tern()
        .args(["receive", "--json", "--listen", &address])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let output = tern()
        .args([
            "migrate",
            "--json",
            "--to",
            &address,
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
    assert_eq!(json(&output)["status"], "completed");
    let received = receiver.wait_with_output().unwrap();
    assert!(received.status.success(), "{received:?}");
    let report = json(&received);
    assert_eq!(report["digest-verified"], true);
    assert_eq!(report["resumed-guest-dirtying"], true);
}

#[test]
fn killed_receiver_fails_the_migration_cleanly() {
    let address = format!("127.0.0.1:{}", free_port());
    let mut receiver = tern()
        .args(["receive", "--listen", &address])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
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
    std::thread::sleep(Duration::from_millis(1500));
    receiver.kill().unwrap();
    receiver.wait().unwrap();
    let started = Instant::now();
    let output = migrate.wait_with_output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let report = json(&output);
    assert_eq!(report["status"], "failed");
    assert!(
        report["error"].as_str().unwrap().contains("Channel"),
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
        json(&output)["error"]
            .as_str()
            .unwrap()
            .contains("Cannot connect")
    );
}

#[test]
fn receive_reports_an_unverified_migration_as_such() {
    let address = format!("127.0.0.1:{}", free_port());
    let receiver = tern()
        .args(["receive", "--json", "--listen", &address])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let output = tern()
        .args(["migrate", "--json", "--to", &address, "--memory", "16MiB"])
        .args(["--dirty-rate", "0", "--verify", "none"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert_eq!(json(&output)["digest-verified"], false);
    let received = receiver.wait_with_output().unwrap();
    assert!(received.status.success(), "{received:?}");
    assert_eq!(json(&received)["digest-verified"], false);
}

#[test]
fn zero_copy_to_a_unix_socket_is_refused_before_connecting() {
    // Nothing listens there: a source that tried to connect first would
    // report that it cannot connect.
    let output = tern()
        .args([
            "migrate",
            "--zero-copy",
            "--to",
            "unix:/nonexistent/dir/sock",
            "--memory",
            "4MiB",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--zero-copy cannot be used with unix:/nonexistent/dir/sock"),
        "{stderr}"
    );
    assert!(!stderr.contains("Cannot connect"), "{stderr}");
}

#[test]
fn bench_zero_compares_each_backend_with_the_read_loop() {
    let output = tern()
        .args([
            "bench", "zero", "--json", "--buffer", "1MiB", "--rounds", "1",
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let report = json(&output);
    let baseline = report["read-loop-gib-per-s"].as_f64().unwrap();
    assert!(baseline > 0.0, "{report}");
    assert!(report["default-backend"].is_string(), "{report}");
    for row in report["rows"].as_array().unwrap() {
        let rate = row["gib-per-s"].as_f64().unwrap();
        let times = row["times-read-loop"].as_f64().unwrap();
        assert!(
            (times * baseline - rate).abs() <= 1e-6 * rate.max(1.0),
            "{row}"
        );
    }
    let text = tern()
        .args(["bench", "zero", "--buffer", "1MiB", "--rounds", "1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("plain loop reading every byte"), "{text}");
    assert!(!text.contains('%'), "{text}");
}

#[test]
fn bench_codec_reports_no_decompression_rate_for_raw_pages() {
    let output = tern()
        .args(["bench", "codec", "--json", "--pages", "6"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let report = json(&output);
    for row in report["rows"].as_array().unwrap() {
        let all_raw = row["raw-pages"] == row["pages"];
        assert_eq!(row["decompress-mb-s"].is_null(), all_raw, "{row}");
        if !all_raw {
            assert!(row["decompress-mb-s"].as_f64().unwrap() > 0.0, "{row}");
        }
    }
    let text = tern()
        .args(["bench", "codec", "--pages", "6"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("| - (all raw) |"), "{text}");
    assert!(!text.contains("| 0 |"), "{text}");
}

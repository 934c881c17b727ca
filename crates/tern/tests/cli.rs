//! The `tern` command line, run as separate processes.

use crate::process;

use process::{
    Reaped, Receiver, TlsDirs, assert_reports_tls, event_and_rest, json, read_event, tern,
    wait_until_read,
};
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
fn doctor_reports_every_topic_as_json() {
    let output = tern().args(["doctor", "--json"]).output().unwrap();
    assert!(output.status.success(), "{output:?}");
    let report = json(&output);
    let findings = report["findings"].as_array().expect("a findings array");
    let topics: Vec<&str> = findings
        .iter()
        .map(|finding| finding["topic"].as_str().unwrap())
        .collect();
    for topic in [
        "kvm", "cpu", "dsa", "iaa", "qpl", "ktls", "io-uring", "memlock", "thp", "numa",
    ] {
        assert!(topics.contains(&topic), "{topic} missing from {topics:?}");
    }
    for finding in findings {
        let status = finding["status"].as_str().unwrap();
        assert!(["ok", "limited", "missing"].contains(&status), "{finding}");
    }
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
        .map(Reaped::new)
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
    assert!(String::from_utf8_lossy(&output.stderr).contains("out of range (1..=64)"));
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
    assert_eq!(output.status.code(), Some(4), "nothing was sent");
    assert!(
        json(&output)["error-desc"]
            .as_str()
            .unwrap()
            .contains("Cannot connect")
    );
}

/// stderr's lines, for tests that count them.
fn stderr_lines(output: &std::process::Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn setup_errors_exit_2_with_one_line() {
    for args in [
        &["demo", "--memory", "64MiB", "--working-set", "4GiB"][..],
        &["demo", "--memory", "1000TiB"],
        &["migrate", "--to", "tcp::1", "--memory", "1000TiB"],
    ] {
        let output = tern().args(args).output().unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}: {output:?}");
        let lines = stderr_lines(&output);
        assert_eq!(lines.len(), 1, "{args:?}: {lines:?}");
        assert!(lines[0].starts_with("tern: error: "), "{lines:?}");
        assert!(output.stdout.is_empty(), "{args:?}: {output:?}");
    }
    let output = tern()
        .args(["demo", "--memory", "1000TiB"])
        .output()
        .unwrap();
    let line = &stderr_lines(&output)[0];
    assert!(
        line.contains("both ends") && line.contains("available"),
        "{line}"
    );
}

#[test]
fn a_migration_that_sent_nothing_is_one_line_and_exit_4() {
    let args = [
        "migrate",
        "--to",
        "unix:/nonexistent/dir/sock",
        "--memory",
        "4MiB",
        "--connect-timeout",
        "1",
    ];
    let output = tern().args(args).output().unwrap();
    assert_eq!(output.status.code(), Some(4), "{output:?}");
    assert!(output.stdout.is_empty(), "no table on failure: {output:?}");
    let lines = stderr_lines(&output);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("tern: error: nothing was sent; the source guest runs on: ")
            && lines[0].contains("Cannot connect"),
        "{lines:?}"
    );
    assert!(!lines[0].contains('\x1b'), "colour on a pipe: {lines:?}");
    let verbose = tern().args(args).arg("-v").output().unwrap();
    assert_eq!(verbose.status.code(), Some(4));
    assert!(
        String::from_utf8_lossy(&verbose.stdout).contains("status  failed"),
        "-v prints the table: {verbose:?}"
    );
}

#[test]
fn colour_only_when_asked_off_a_terminal() {
    let run = |extra: &[&str]| {
        tern()
            .args(["-v", "demo", "--memory", "4MiB", "--dirty-rate", "0"])
            .args(extra)
            .env_remove("RUST_LOG")
            .output()
            .unwrap()
    };
    let plain = run(&[]);
    assert!(plain.status.success(), "{plain:?}");
    assert!(!plain.stderr.is_empty(), "-v logs nothing: {plain:?}");
    assert!(!plain.stderr.contains(&0x1b), "{plain:?}");
    let coloured = run(&["--color", "always"]);
    assert!(coloured.stderr.contains(&0x1b), "{coloured:?}");
}

#[test]
fn qemu_spellings_migrate() {
    // Every interface, unauthenticated: allowed only with --insecure.
    let receiver = Receiver::spawn_at(
        &["receive"],
        "tcp::0",
        &["--json", "--progress", "none", "--insecure"],
    );
    let port = receiver.port();
    let output = tern()
        .args(["migrate", "--json", "--to", &format!("tcp::{port}")])
        .args(["--connect-timeout", "60"])
        .args(["--memory", "16MiB", "--dirty-rate", "0"])
        .args([
            "--zero-page-detection",
            "multifd",
            "--max-bandwidth",
            "10Gbps",
        ])
        .args(["--compression", "zstd", "--compression-level", "99"])
        .args(["--auto-converge", "off", "--cpu-throttle-initial", "30"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let report = json(&output);
    assert_eq!(report["status"], "completed");
    assert_eq!(report["compression"]["level"], 22, "the level in force");
    let warning = String::from_utf8_lossy(&output.stderr);
    assert!(warning.contains("so 22"), "{warning}");
    let (status, _, stderr) = receiver.finish();
    assert!(status.success(), "{status}: {stderr}");
}

#[test]
fn sigint_cancels_and_exits_130() {
    let Receiver {
        child: mut receiver,
        address,
        ..
    } = Receiver::spawn(&["receive"], &["--progress", "none"]);
    // A slow link keeps the migration running until the signal comes.
    let migrate = tern()
        .args(["migrate", "--json", "--to", &address])
        .args([
            "--memory",
            "64MiB",
            "--mix",
            "0:100:0",
            "--max-bandwidth",
            "1MiB",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(Reaped::new)
        .unwrap();
    wait_for_open_connection(&address, migrate.id());
    send_signal(&migrate, libc::SIGINT);
    let output = migrate.wait_with_output().unwrap();
    assert_eq!(output.status.code(), Some(130), "{output:?}");
    assert_eq!(json(&output)["status"], "cancelled");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr.matches("tern: error:").count(),
        1,
        "one error line: {stderr}"
    );
    let received = receiver.wait().unwrap();
    assert_eq!(received.code(), Some(1), "the receiver saw the cancel");
    let _ = receiver.kill();
}

/// Waits until process `pid` holds an established TCP connection to
/// `address`: the migration is under way.
fn wait_for_open_connection(address: &str, pid: u32) {
    let port = address.rsplit_once(':').unwrap().1.parse::<u16>().unwrap();
    let remote = format!(":{port:04X} ");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let sockets = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
        // Column 3 is the remote address, column 4 the state (01:
        // established).
        let connected = sockets.lines().skip(1).any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() > 3 && format!("{} ", fields[2]).ends_with(&remote) && fields[3] == "01"
        });
        if connected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "tern migrate did not connect to {address} within 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn completions_are_printed_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let output = tern().args(["completions", shell]).output().unwrap();
        assert!(output.status.success(), "{output:?}");
        let script = String::from_utf8_lossy(&output.stdout);
        assert!(script.contains("zero-page-detection"), "{shell}: {script}");
    }
}

#[test]
fn receive_reports_an_unverified_migration_as_such() {
    let receiver = Receiver::spawn(&["receive"], &["--json", "--allow-unverified"]);
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
fn migrate_events_announce_the_start_before_the_report() {
    let receiver = Receiver::spawn(&["receive"], &["--json", "--progress", "none"]);
    let output = tern()
        .args(["migrate", "--events", "--json", "--progress", "none"])
        .args(["--to", &receiver.address, "--memory", "8MiB"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let (event, rest) = event_and_rest(&output);
    assert_eq!(event["event"], "migrating", "{event}");
    assert_eq!(event["address"], receiver.address.as_str());
    assert_eq!(event["transport"], "tcp");
    assert_eq!(event["port"], receiver.port());
    let report: serde_json::Value = serde_json::from_slice(rest).unwrap_or_else(|error| {
        panic!(
            "the report after the event is not JSON ({error}): {}",
            String::from_utf8_lossy(rest)
        )
    });
    assert_eq!(report["status"], "completed");
    assert_eq!(receiver.report()["status"], "completed");
}

#[test]
fn migrating_event_comes_while_the_migration_runs() {
    // As a harness would: read the event, then act on the running source
    // (here: cancel it). A slow link keeps it running until the signal.
    let Receiver {
        child: receiver,
        address,
        ..
    } = Receiver::spawn(&["receive"], &["--progress", "none"]);
    let mut migrate = tern()
        .args([
            "migrate",
            "--events",
            "--progress",
            "none",
            "--to",
            &address,
        ])
        .args(["--memory", "64MiB", "--mix", "0:100:0"])
        .args(["--max-bandwidth", "1MiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(Reaped::new)
        .unwrap();
    let mut stdout = std::io::BufReader::new(migrate.stdout.take().unwrap());
    let event = read_event(migrate.id(), &mut stdout);
    assert_eq!(event["event"], "migrating", "{event}");
    assert_eq!(event["address"], address.as_str());
    send_signal(&migrate, libc::SIGINT);
    let status = migrate.wait().unwrap();
    assert_eq!(status.code(), Some(130), "the handler is installed first");
    // The receiver's end depends on when the signal came: a source
    // cancelled while still dialling never reaches it (nothing to tell),
    // one cancelled later tells it (exit 1). Dropping it kills it.
    drop(receiver);
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

#[test]
fn sigterm_cancels_a_waiting_receiver_with_143() {
    // The ready event comes after the signal handler is installed.
    let receiver = Receiver::spawn(&["receive"], &["--progress", "none"]);
    send_signal(&receiver.child, libc::SIGTERM);
    let (status, _, stderr) = receiver.finish();
    assert_eq!(status.code(), Some(143), "{status:?}: {stderr}");
    assert_eq!(
        stderr
            .lines()
            .filter(|line| line.starts_with("tern: error:"))
            .count(),
        1,
        "{stderr}"
    );
}

/// Sends `signal` to a running child.
fn send_signal(child: &std::process::Child, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill(2) on a child we spawned and have not reaped, so the pid
    // is still ours.
    let sent = unsafe { libc::kill(pid, signal) };
    assert_eq!(sent, 0, "kill: {}", std::io::Error::last_os_error());
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

#[test]
fn qpl_path_hardware_without_iaa_is_refused_before_anything_moves() {
    if tern_page::codec::qpl_available().is_ok() {
        tern_test_skip::skip(
            tern_test_skip::Need::NoQpl,
            "libqpl loads here; this checks a machine without it",
        );
        return;
    }
    for args in [
        &[
            "receive",
            "--listen",
            "tcp:127.0.0.1:0",
            "--qpl-path",
            "hardware",
        ][..],
        &[
            "demo",
            "--memory",
            "16MiB",
            "--compression",
            "qpl",
            "--qpl-path",
            "hardware",
        ],
    ] {
        let output = tern().args(args).output().unwrap();
        assert!(!output.status.success(), "{args:?}: {output:?}");
        let lines = stderr_lines(&output);
        assert_eq!(lines.len(), 1, "{args:?}: {lines:?}");
        assert!(lines[0].contains("libqpl"), "{args:?}: {lines:?}");
    }
    let output = tern()
        .args(["demo", "--memory", "16MiB", "--qpl-path", "gpu"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("hardware"), "{stderr}");
}

#[test]
fn receive_refuses_to_listen_unauthenticated_where_others_reach_it() {
    let output = tern()
        .args(["receive", "--listen", "tcp::0", "--accept-timeout", "1"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("refusing to receive unauthenticated migrations")
            && stderr.contains("--insecure"),
        "{stderr}"
    );
    assert!(output.stdout.is_empty(), "no listening event: {output:?}");
    // The policy is checked before the port is bound: on a port another
    // socket holds, the refusal is still the policy's, not "in use".
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let output = tern()
        .args(["receive", "--listen", &format!("tcp::{port}")])
        .args(["--accept-timeout", "1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("refusing to receive unauthenticated migrations"),
        "the port was bound before the policy was checked: {stderr}"
    );
}

#[test]
fn migrate_and_receive_with_an_auth_key() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "a key shared by both processes\n").unwrap();
    let key = key.to_str().unwrap();
    let receiver = Receiver::spawn(&["receive"], &["--json", "--auth-key", key]);
    let output = tern()
        .args(["migrate", "--json", "--to", &receiver.address])
        .args(["--memory", "16MiB", "--dirty-rate", "0", "--auth-key", key])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let report = json(&output);
    assert_eq!(report["authenticated"], true);
    assert_eq!(report["transport"], "tcp");
    assert_eq!(report["digest-verified"], true);
    assert!(report.get("tls").is_none(), "no TLS: {report}");
    let received = receiver.report();
    assert_eq!(received["digest-verified"], true);
    assert_eq!(received["authenticated"], true);
    assert_eq!(received["transport"], "tcp");
    assert!(received.get("tls").is_none(), "no TLS: {received}");
}

#[test]
fn migrate_and_receive_over_tls_report_it_on_both_sides() {
    let pki = TlsDirs::new();
    let destination = pki.host("destination", &["127.0.0.1"]);
    let source = pki.host("source", &["source.test"]);
    let receiver = Receiver::spawn(&["receive"], &["--json", "--tls-dir", &destination]);
    let output = tern()
        .args(["migrate", "--json", "--to", &receiver.address])
        .args([
            "--memory",
            "16MiB",
            "--dirty-rate",
            "0",
            "--tls-dir",
            &source,
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let report = json(&output);
    assert_eq!(report["digest-verified"], true);
    assert_reports_tls(&report);
    let received = receiver.report();
    assert_eq!(received["digest-verified"], true);
    assert_reports_tls(&received);
    assert_eq!(received["tls"], report["tls"], "both sides agree");
}

/// A failed TLS handshake is one line on each side: the source's error
/// (exit 4: nothing was sent), the receiver's log line; the receiver keeps
/// waiting.
#[test]
fn an_expired_certificate_is_one_line_on_both_sides() {
    let pki = TlsDirs::new();
    let destination = pki.host("destination", &["127.0.0.1"]);
    let source = pki.expired_host("source", &["source.test"]);
    let mut receiver = Receiver::spawn(&["receive"], &["--tls-dir", &destination]);
    let output = tern()
        .args(["migrate", "--to", &receiver.address, "--tls-dir", &source])
        .args(["--memory", "16MiB", "--dirty-rate", "0"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(4), "{output:?}");
    let lines = stderr_lines(&output);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("certificate has expired"), "{lines:?}");
    let logged = receiver.stderr_line_with("failed its handshake");
    assert!(logged.contains("certificate expired"), "{logged}");
    assert_eq!(receiver.child.try_wait().unwrap(), None, "still waiting");
    send_signal(&receiver.child, libc::SIGTERM);
    receiver.child.wait().unwrap();
}

#[test]
fn demo_over_tls_reports_it() {
    let output = tern()
        .args([
            "demo",
            "--tls",
            "--json",
            "--memory",
            "16MiB",
            "--dirty-rate",
            "0",
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let report = json(&output);
    assert_eq!(report["tls"]["version"], "TLSv1_3");
    assert_eq!(report["authenticated"], true);
    assert_eq!(report["digest-verified"], true);
}

#[test]
fn receive_decodes_on_the_threads_it_is_given() {
    let receiver = Receiver::spawn(&["receive"], &["--json", "--decode-threads", "2"]);
    let output = tern()
        .args(["migrate", "--json", "--to", &receiver.address])
        .args([
            "--memory",
            "16MiB",
            "--dirty-rate",
            "0",
            "--compression",
            "zstd",
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert_eq!(json(&output)["digest-verified"], true);
    let received = receiver.report();
    assert_eq!(received["digest-verified"], true);
    assert!(
        received["cpu-seconds"].get("decoders").is_some(),
        "the decoder threads ran: {received}"
    );
    let too_many = tern()
        .args([
            "receive",
            "--listen",
            "127.0.0.1:0",
            "--decode-threads",
            "5000",
        ])
        .output()
        .unwrap();
    assert_eq!(too_many.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&too_many.stderr).contains("5000"));
}

/// `tern migrate --local` to `tern receive --local`: the memory is handed
/// over as a memfd, no page moves, and the digest and the resumed guest
/// check it.
#[test]
fn migrate_local_hands_memory_over_to_receive_local() {
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("unix:{}", dir.path().join("local.sock").display());
    let destination = Receiver::spawn_at(&["receive"], &listen, &["--local", "--json"]);
    let source = tern()
        .args(["migrate", "--local", "--json", "--to", &destination.address])
        .args(["--memory", "64MiB", "--dirty-rate", "20MiB"])
        .output()
        .unwrap();
    assert!(source.status.success(), "{source:?}");
    let source = json(&source);
    let received = destination.report();
    assert_eq!(source["status"], "completed");
    assert_eq!(source["digest-verified"], true);
    assert_eq!(source["ram"]["normal"], 0, "no page is copied: {source}");
    assert_eq!(source["ram"]["precopy-bytes"], 0, "{source}");
    assert_eq!(received["digest-verified"], true);
    assert_eq!(received["normal-pages"], 0, "{received}");
    assert_eq!(received["memory"], 64 << 20);
    assert_eq!(received["resumed-guest-dirtying"], true);
}

/// `--local` on a destination that cannot carry descriptors is refused
/// before it listens, and a copying destination refuses a hand-over.
#[test]
fn local_needs_a_unix_socket_on_both_sides() {
    let output = tern()
        .args(["receive", "--local", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--local needs a unix: address"), "{stderr}");
    let output = tern()
        .args([
            "migrate",
            "--local",
            "--to",
            "127.0.0.1:9",
            "--memory",
            "8MiB",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--local cannot be used with tcp:"),
        "{stderr}"
    );
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("unix:{}", dir.path().join("copy.sock").display());
    let destination = Receiver::spawn_at(&["receive"], &listen, &[]);
    let source = tern()
        .args(["migrate", "--local", "--to", &destination.address])
        .args(["--memory", "8MiB"])
        .output()
        .unwrap();
    assert!(!source.status.success());
    let stderr = String::from_utf8_lossy(&source.stderr);
    assert!(stderr.contains("hands its memory over"), "{stderr}");
    assert!(!destination.finish().0.success());
}

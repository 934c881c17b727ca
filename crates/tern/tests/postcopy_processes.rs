//! Postcopy across processes (docs/postcopy.md, "Failures after the point
//! of no return" and "Recovery"): `tern migrate` and `tern receive` as
//! real processes, through the test proxy, one of them stopped (SIGSTOP)
//! or killed (SIGKILL) after the point of no return, and the operator's
//! commands through `tern ctl`. Skipped visibly without userfaultfd.

use crate::process;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::mpsc;

use process::{Reaped, Receiver, json, tern};
use tern_test_skip::proxy::Proxy;
use tern_test_skip::wait::{DEADLINE, wait_until};

const MIB: u64 = 1 << 20;

use tern_test_skip::userfaultfd_works;

/// `tern ctl SOCKET ARGS...`: whether it succeeded, and its stdout as JSON
/// (null when it failed).
fn ctl(socket: &Path, args: &[&str]) -> (bool, serde_json::Value) {
    let output = tern().arg("ctl").arg(socket).args(args).output().unwrap();
    if output.status.success() {
        (true, json(&output))
    } else {
        (false, serde_json::Value::Null)
    }
}

/// Waits until `query-migrate` on `socket` says `status`.
fn wait_status(socket: &Path, side: &str, status: &str) {
    wait_until(&format!("the {side} is {status}"), || {
        let (answered, report) = ctl(socket, &["query-migrate"]);
        answered && report["status"] == status
    });
}

/// Sends `signal` to process `pid`.
fn signal(pid: u32, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).unwrap();
    // SAFETY: a signal to the test's own child, not reaped yet.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
}

/// The lines a child writes on stderr, read on a thread of their own.
fn stderr_lines(child: &mut Reaped) -> mpsc::Receiver<String> {
    let pipe = child.stderr.take().expect("stderr not taken yet");
    let (sender, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(pipe).lines() {
            let Ok(line) = line else { return };
            if sender.send(line).is_err() {
                return;
            }
        }
    });
    lines
}

/// The first of `lines` that contains `needle`, within [`DEADLINE`].
fn line_with(lines: &mpsc::Receiver<String>, needle: &str) -> String {
    let deadline = std::time::Instant::now() + DEADLINE;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if line.contains(needle) => return line,
            Ok(line) => seen.push(line),
            Err(_) => panic!("no stderr line with '{needle}'; saw {seen:?}"),
        }
    }
}

/// A postcopy migration between two processes through a proxy: 16 MiB
/// of which the guest rewrites 12 much faster than the 4 MiB/s link
/// moves them, so most of it is stale at the switch and postcopy lasts
/// a few seconds.
struct Running {
    proxy: Proxy,
    receiver: Receiver,
    migrate: Reaped,
    source_socket: PathBuf,
    destination_socket: PathBuf,
    _dir: tempfile::TempDir,
}

/// Starts it, each side reconnecting (or accepting) for `recover_timeout`
/// seconds after a break.
fn start(recover_timeout: &str) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let (source_socket, destination_socket) =
        (dir.path().join("source"), dir.path().join("destination"));
    let receiver = Receiver::spawn(
        &["receive"],
        &[
            "--json",
            "--io-timeout",
            "2",
            "--postcopy-recover-timeout",
            recover_timeout,
            "--control-socket",
            destination_socket.to_str().unwrap(),
        ],
    );
    let proxy = Proxy::start(&format!("127.0.0.1:{}", receiver.port()), 4 * MIB);
    let migrate = tern()
        .args(["migrate", "--json", "--progress", "none", "--to"])
        .arg(proxy.address())
        .arg("--control-socket")
        .arg(&source_socket)
        .args(["--postcopy", "after-first-pass"])
        .args(["--postcopy-recover-timeout", recover_timeout])
        .args(["--io-timeout", "2"])
        .args(["--memory", "16MiB", "--working-set", "12MiB"])
        .args(["--dirty-rate", "64MiB", "--dirtier-threads", "2"])
        .args(["--mix", "20:60:20"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(Reaped::new)
        .unwrap();
    Running {
        proxy,
        receiver,
        migrate,
        source_socket,
        destination_socket,
        _dir: dir,
    }
}

impl Running {
    /// The source is `postcopy-active` once the destination acknowledged
    /// the commit: the guest runs there, and the destination says
    /// `postcopy-active` too (QEMU's status on both sides), as it did
    /// before it acknowledged.
    fn wait_postcopy_active(&self) {
        wait_status(&self.source_socket, "source", "postcopy-active");
        let (answered, report) = ctl(&self.destination_socket, &["query-migrate"]);
        assert!(answered);
        assert_eq!(report["status"], "postcopy-active", "{report}");
    }

    /// Both processes exit 0, the digests compared and equal, after at
    /// least one recovery on each side.
    fn finish_recovered(self) {
        let output = self.migrate.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{}: {stderr}", output.status);
        let report = json(&output);
        assert_eq!(report["status"], "completed", "{report}");
        assert_eq!(report["digest-verified"], true, "{report}");
        let recoveries = &report["postcopy"]["postcopy-recoveries"];
        assert!(recoveries.as_u64() >= Some(1), "{report}");
        let received = self.receiver.report();
        assert_eq!(received["digest-verified"], true, "{received}");
    }
}

/// A source stopped with SIGSTOP after the point of no return: the
/// destination's push waits past its I/O timeout, pauses postcopy and
/// closes its channels; once the source runs again it finds them closed,
/// pauses too, reconnects, and the migration completes with the memory
/// verified on both sides.
#[test]
fn a_sigstopped_source_mid_postcopy_is_recovered_with_its_memory_verified() {
    if !userfaultfd_works() {
        return;
    }
    let running = start("60");
    running.wait_postcopy_active();
    signal(running.migrate.id(), libc::SIGSTOP);
    wait_status(
        &running.destination_socket,
        "destination",
        "postcopy-paused",
    );
    signal(running.migrate.id(), libc::SIGCONT);
    running.finish_recovered();
}

/// The destination stopped with SIGSTOP after the point of no return,
/// past the source's I/O timeout: the source pauses on its own deadline
/// (not a hang, not a failure) and tries to reconnect while the
/// destination cannot answer. Once the destination runs again it finds
/// the source's channels closed, pauses too, takes the reconnection,
/// and the migration completes with the memory verified on both sides.
#[test]
fn a_sigstopped_destination_mid_postcopy_pauses_the_source_and_is_recovered_with_its_memory_verified()
 {
    if !userfaultfd_works() {
        return;
    }
    let running = start("60");
    running.wait_postcopy_active();
    let destination = running.receiver.child.id();
    signal(destination, libc::SIGSTOP);
    wait_status(&running.source_socket, "source", "postcopy-paused");
    signal(destination, libc::SIGCONT);
    running.finish_recovered();
}

/// The operator's reconnection through `tern ctl`: the network cut past
/// both sides' recovery windows leaves them paused, saying so; with the
/// network back, `migrate-recover` on the destination and
/// `migrate-resume` on the source mend it, and the migration completes
/// with the memory verified.
#[test]
fn past_the_recovery_window_tern_ctl_migrate_recover_and_resume_mend_postcopy() {
    if !userfaultfd_works() {
        return;
    }
    let mut running = start("1");
    let source_lines = stderr_lines(&mut running.migrate);
    running.wait_postcopy_active();
    running.proxy.cut();
    line_with(&source_lines, "postcopy recovery timed out");
    running
        .receiver
        .stderr_line_with("postcopy recovery timed out");
    running.proxy.pass();
    wait_status(&running.source_socket, "source", "postcopy-paused");
    wait_status(
        &running.destination_socket,
        "destination",
        "postcopy-paused",
    );
    assert!(ctl(&running.destination_socket, &["migrate-recover"]).0);
    assert!(ctl(&running.source_socket, &["migrate-resume"]).0);
    // The report is JSON on stdout; stderr was taken for the lines above.
    let output = running.migrate.wait_with_output().unwrap();
    assert!(output.status.success(), "{}", output.status);
    let report = json(&output);
    assert_eq!(report["digest-verified"], true, "{report}");
    assert!(report["postcopy"]["postcopy-recoveries"].as_u64() >= Some(1));
    let (status, rest, _) = running.receiver.finish();
    assert!(status.success(), "{status}");
    let received: serde_json::Value = serde_json::from_slice(&rest).unwrap();
    assert_eq!(received["digest-verified"], true, "{received}");
}

/// The source process killed after the point of no return: the guest is
/// lost. The destination pauses (it cannot tell a dead source from a cut
/// link) until the operator cancels, then says so in one line and exits
/// with status 6, its guest paused.
#[test]
fn a_source_killed_mid_postcopy_leaves_the_destination_paused_until_cancelled_then_exit_6() {
    if !userfaultfd_works() {
        return;
    }
    let mut running = start("60");
    running.wait_postcopy_active();
    running.migrate.kill().unwrap();
    running.migrate.wait().unwrap();
    wait_status(
        &running.destination_socket,
        "destination",
        "postcopy-paused",
    );
    assert!(ctl(&running.destination_socket, &["migrate_cancel"]).0);
    let (status, _, stderr) = running.receiver.finish();
    assert_eq!(status.code(), Some(6), "{stderr}");
    assert!(
        stderr.contains("the guest is paused on the destination without all of its memory"),
        "{stderr}"
    );
}

/// The destination process killed after the point of no return, and
/// nothing listening where the source reconnects: the source pauses,
/// tries for its recovery window, says that every attempt was refused,
/// and stays paused for the operator (a refusal is no proof that the
/// destination is gone); cancelled, it exits with status 6 and says the
/// guest cannot continue without it.
#[test]
fn a_destination_killed_mid_postcopy_is_reported_and_cancelling_the_source_exits_6() {
    if !userfaultfd_works() {
        return;
    }
    let mut running = start("1");
    let source_lines = stderr_lines(&mut running.migrate);
    running.wait_postcopy_active();
    // The path first, so that no reconnection reaches a proxy whose
    // target is gone: every attempt meets a closed port.
    drop(running.proxy);
    running.receiver.child.kill().unwrap();
    running.receiver.child.wait().unwrap();
    let line = line_with(&source_lines, "postcopy recovery timed out");
    assert!(line.contains("every attempt was refused"), "{line}");
    let (answered, report) = ctl(&running.source_socket, &["query-migrate"]);
    assert!(answered);
    assert_eq!(report["status"], "postcopy-paused", "{report}");
    assert!(ctl(&running.source_socket, &["migrate_cancel"]).0);
    let status = running.migrate.wait().unwrap();
    assert_eq!(status.code(), Some(6));
    let fate = line_with(
        &source_lines,
        "Postcopy failed after the point of no return",
    );
    assert!(
        fate.contains("cannot continue without this source"),
        "{fate}"
    );
}

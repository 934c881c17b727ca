//! Helpers for tests that run the `tern` binary as separate processes.
#![allow(dead_code)]

use std::process::{Command, Output};

/// The `tern` binary built for these tests.
pub fn tern() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tern"))
}

/// A command's stdout as JSON, with both streams in the panic message when
/// it is not.
pub fn json(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "stdout is not JSON ({error}):\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// The stdout of a command run with `--events`: its first line, a JSON
/// event (docs/cli.md, "Events"), and the bytes after it (the report).
pub fn event_and_rest(output: &Output) -> (serde_json::Value, &[u8]) {
    let stdout = &output.stdout;
    let end = stdout
        .iter()
        .position(|&byte| byte == b'\n')
        .unwrap_or_else(|| panic!("no event line on stdout: {output:?}"));
    let event = serde_json::from_slice(&stdout[..end]).unwrap_or_else(|error| {
        panic!(
            "the first line is not an event ({error}): {:?}",
            String::from_utf8_lossy(&stdout[..end])
        )
    });
    (event, &stdout[end + 1..])
}

/// Reads one line from a child's stdout (blocking until it comes, or an
/// empty string if the child exits first) and parses it as an event.
pub fn read_event(stdout: &mut impl std::io::BufRead) -> serde_json::Value {
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    serde_json::from_str(&line)
        .unwrap_or_else(|error| panic!("the line is not an event ({error}): {line:?}"))
}

/// A TCP port of 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `tern receive` or `tern vm receive` started on a port the system
/// picked, known from its ready event (docs/cli.md, "Events").
pub struct Receiver {
    pub child: std::process::Child,
    /// The event's `address`: what `--to` takes.
    pub address: String,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Receiver {
    /// Runs `tern <command…> --listen 127.0.0.1:0 <extra…>` and waits for its
    /// ready event, the first line of its stdout.
    pub fn spawn(command: &[&str], extra: &[&str]) -> Self {
        Self::spawn_at(command, "127.0.0.1:0", extra)
    }

    /// [`Receiver::spawn`] listening on `listen`.
    pub fn spawn_at(command: &[&str], listen: &str, extra: &[&str]) -> Self {
        use std::io::BufRead;
        let mut child = tern()
            .args(command)
            .args(["--listen", listen])
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        // Blocks until the line arrives: the receiver prints it as soon as
        // it listens, or exits (an empty read) if it cannot.
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let event: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|error| panic!("the first line is not an event ({error}): {line:?}"));
        assert_eq!(event["event"], "listening", "{line}");
        let address = event["address"].as_str().unwrap().to_string();
        Self {
            child,
            address,
            stdout,
        }
    }

    /// The bound TCP port, from the event's address.
    pub fn port(&self) -> u16 {
        let (_, port) = self.address.rsplit_once(':').expect("a TCP address");
        port.parse().expect("a port number")
    }

    /// Waits for the receiver to exit: its status, the rest of its stdout,
    /// its stderr.
    pub fn finish(mut self) -> (std::process::ExitStatus, Vec<u8>, String) {
        use std::io::Read;
        let mut rest = Vec::new();
        self.stdout.read_to_end(&mut rest).unwrap();
        let mut stderr = String::new();
        if let Some(mut pipe) = self.child.stderr.take() {
            pipe.read_to_string(&mut stderr).unwrap();
        }
        let status = self.child.wait().unwrap();
        (status, rest, stderr)
    }

    /// [`Receiver::finish`] for a `--json` receiver that must succeed: its
    /// report.
    pub fn report(self) -> serde_json::Value {
        let (status, rest, stderr) = self.finish();
        assert!(status.success(), "{status}: {stderr}");
        serde_json::from_slice(&rest).unwrap_or_else(|error| {
            panic!(
                "the report is not JSON ({error}):\n{}\nstderr:\n{stderr}",
                String::from_utf8_lossy(&rest)
            )
        })
    }
}

/// Waits until process `child` has read `bytes` bytes through `read`-like
/// calls (`rchar` in `/proc/PID/io`): for a receiver, proof that pages are
/// arriving, so a test can kill it in the middle of a migration without
/// guessing how long setup takes on a loaded machine.
pub fn wait_until_read(child: &std::process::Child, bytes: u64) {
    let path = format!("/proc/{}/io", child.id());
    let read = || -> u64 {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        text.lines()
            .find_map(|line| line.strip_prefix("rchar: "))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while read() < bytes {
        assert!(
            std::time::Instant::now() < deadline,
            "process {} read only {} of {bytes} bytes in 60 s",
            child.id(),
            read()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

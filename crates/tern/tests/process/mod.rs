//! Helpers for tests that run the `tern` binary as separate processes.

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

/// A TCP port of 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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

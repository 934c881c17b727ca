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

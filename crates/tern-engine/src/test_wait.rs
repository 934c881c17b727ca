//! Polling with a deadline for the unit tests: a test waits for a
//! condition, never for a time, and fails naming what did not happen.

use std::time::{Duration, Instant};

/// Polls `condition` every millisecond until it holds; panics naming
/// `what` after a minute, far beyond any scheduling delay on a loaded
/// machine.
pub(crate) fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

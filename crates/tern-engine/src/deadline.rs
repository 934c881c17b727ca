//! Waits with a deadline, taken in short slices so that a cancel or a
//! message on another channel is noticed while the deadline runs.

use std::time::{Duration, Instant};

use crate::error::{ChannelError, MigrationError};
use crate::source::CancelToken;

/// The end of one wait, and what the wait is for (named in the timeout
/// error).
pub(crate) struct Deadline {
    at: Instant,
    waiting_for: &'static str,
}

impl Deadline {
    /// A deadline `timeout` from now.
    pub(crate) fn after(timeout: Duration, waiting_for: &'static str) -> Self {
        Self {
            at: Instant::now() + timeout,
            waiting_for,
        }
    }

    /// When the wait ends: a message read within it is cut off there too,
    /// however its bytes trickle in.
    pub(crate) fn at(&self) -> Instant {
        self.at
    }

    /// Whether the deadline has passed.
    pub(crate) fn passed(&self) -> bool {
        Instant::now() >= self.at
    }

    /// How long the next slice of the wait may last: at most `slice`, and
    /// never past the deadline. Fails once the deadline has passed, naming
    /// what was awaited.
    pub(crate) fn next_slice(&self, slice: Duration) -> Result<Duration, ChannelError> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ChannelError::Timeout(self.waiting_for));
        }
        Ok(left.min(slice))
    }

    /// [`Self::next_slice`] for a wait that a cancel also ends; a timeout
    /// is blamed on channel `index`.
    pub(crate) fn next_slice_unless(
        &self,
        cancel: &CancelToken,
        index: usize,
        slice: Duration,
    ) -> Result<Duration, MigrationError> {
        if cancel.is_cancelled() {
            return Err(MigrationError::Cancelled);
        }
        self.next_slice(slice)
            .map_err(MigrationError::channel(index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_never_reaches_past_the_deadline() {
        let deadline = Deadline::after(Duration::from_secs(3600), "a test");
        let slice = deadline.next_slice(Duration::from_millis(100)).unwrap();
        assert_eq!(slice, Duration::from_millis(100));
        let near = Deadline::after(Duration::from_millis(50), "a test");
        assert!(near.next_slice(Duration::from_secs(10)).unwrap() <= Duration::from_millis(50));
    }

    #[test]
    fn a_passed_deadline_names_what_was_awaited() {
        let deadline = Deadline::after(Duration::ZERO, "the peer's answer");
        let error = deadline.next_slice(Duration::from_millis(100)).unwrap_err();
        assert!(matches!(error, ChannelError::Timeout("the peer's answer")));
    }

    #[test]
    fn a_cancel_ends_the_wait_before_the_deadline() {
        let cancel = CancelToken::new();
        cancel.cancel();
        let deadline = Deadline::after(Duration::from_secs(3600), "a test");
        let error = deadline
            .next_slice_unless(&cancel, 0, Duration::from_millis(100))
            .unwrap_err();
        assert!(matches!(error, MigrationError::Cancelled));
    }
}

//! The io_uring backend when tern-engine is built without the `io-uring`
//! feature: the same names, and a clear error when it is chosen.

use super::{ZeroCopyError, ZeroCopyStats};
use crate::transport::{Channel, Segment};

fn not_built() -> ZeroCopyError {
    ZeroCopyError::UringUnavailable {
        reason: "this build of tern-engine has no io_uring support (cargo feature `io-uring` \
                 is off); rebuild with it or use zero_copy_backend = msg"
            .to_string(),
    }
}

/// Always fails: io_uring support is not built.
pub fn check_available() -> Result<(), ZeroCopyError> {
    Err(not_built())
}

/// Cannot exist: [`UringZeroCopySender::enable`] always fails.
#[derive(Debug)]
pub enum UringZeroCopySender {}

impl UringZeroCopySender {
    /// Always fails: io_uring support is not built.
    pub fn enable(
        _channel: Channel,
        _index: usize,
        _window_bytes: usize,
    ) -> Result<Self, ZeroCopyError> {
        Err(not_built())
    }

    /// Unreachable: no value of this type exists.
    ///
    /// # Safety
    /// As for [`super::ZeroCopySender::send`].
    pub unsafe fn send(&mut self, _header: &[u8], _pages: &[Segment]) -> Result<(), ZeroCopyError> {
        match *self {}
    }

    /// Unreachable: no value of this type exists.
    pub fn flush(&mut self) -> Result<(), ZeroCopyError> {
        match *self {}
    }

    /// Unreachable: no value of this type exists.
    pub fn stats(&self) -> ZeroCopyStats {
        match *self {}
    }

    /// Unreachable: no value of this type exists.
    pub fn channel(&self) -> &Channel {
        match *self {}
    }

    /// Unreachable: no value of this type exists.
    pub fn channel_mut(&mut self) -> &mut Channel {
        match *self {}
    }

    /// Unreachable: no value of this type exists.
    pub fn outstanding_sends(&self) -> usize {
        match *self {}
    }

    /// Unreachable: no value of this type exists.
    pub fn outstanding_charge(&self) -> usize {
        match *self {}
    }
}

super::impl_zero_copy_transport!(UringZeroCopySender);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choosing_io_uring_names_the_missing_feature() {
        let message = check_available().unwrap_err().to_string();
        assert!(message.contains("io-uring") && message.contains("zero_copy_backend = msg"));
    }
}

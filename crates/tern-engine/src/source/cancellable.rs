//! Dialling that a cancel stops. A source started before its destination
//! listens dials again for as long as the connect timeout allows (a minute
//! is common when an orchestrator starts both sides at once); a cancel
//! (Ctrl-C, `migrate_cancel`, [`crate::CancelToken`]) must end that wait
//! at once, not when the timeout runs out. The source's connecting code
//! takes any [`Connect`]; this one hands the token to every dial.

use std::fmt;
use std::io;
use std::time::Duration;

use crate::cancel::CancelToken;
use crate::error::ChannelError;
use crate::transport::{Address, Channel, Connect};

/// A [`Connect`] whose every dial watches `cancel`, and that dials no more
/// once it is cancelled.
pub(super) struct CancellableConnect<'a> {
    inner: &'a dyn Connect,
    cancel: &'a CancelToken,
}

impl<'a> CancellableConnect<'a> {
    pub(super) fn new(inner: &'a dyn Connect, cancel: &'a CancelToken) -> Self {
        Self { inner, cancel }
    }
}

impl fmt::Debug for CancellableConnect<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CancellableConnect")
            .field("inner", &self.inner)
            .field("cancelled", &self.cancel.is_cancelled())
            .finish()
    }
}

impl Connect for CancellableConnect<'_> {
    fn connect(&self, index: u16, timeout: Duration) -> Result<Channel, ChannelError> {
        if self.cancel.is_cancelled() {
            return Err(ChannelError::Connect(
                self.inner.address().to_string(),
                io::Error::new(io::ErrorKind::Interrupted, "the migration was cancelled"),
            ));
        }
        self.inner.connect_cancellable(index, timeout, self.cancel)
    }

    fn address(&self) -> Address {
        self.inner.address()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Connector;

    fn is_cancel(error: &ChannelError) -> bool {
        matches!(error, ChannelError::Connect(_, source) if source.kind() == io::ErrorKind::Interrupted)
    }

    /// Nothing listens on the path, so the connector dials again and again
    /// for the hour it is given; the cancel must end that.
    #[test]
    fn a_cancel_ends_the_wait_for_a_destination_that_does_not_listen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nobody");
        let address: Address = format!("unix:{}", path.display()).parse().unwrap();
        let connector = Connector::for_address(&address).unwrap();
        let cancel = CancelToken::new();
        let connect = CancellableConnect::new(&connector, &cancel);
        // Only the cancel ends the hour's dial.
        let error = tern_test_skip::wait::scope_within("the cancel ends the dial", |scope| {
            let dialling = scope.spawn(|| connect.connect(0, Duration::from_secs(3600)));
            cancel.cancel();
            dialling.join().unwrap().expect_err("nobody listens")
        });
        assert!(is_cancel(&error), "{error:?}");
        // Cancelled already: the next channel is not even dialled.
        let again = connect
            .connect(1, Duration::from_secs(3600))
            .expect_err("cancelled");
        assert!(is_cancel(&again), "{again:?}");
    }

    /// The dial itself stops on the token, whenever the cancel comes:
    /// before the first attempt or between two.
    #[test]
    fn a_dial_stops_on_its_token() {
        let dir = tempfile::tempdir().unwrap();
        let address: Address = format!("unix:{}", dir.path().join("nobody").display())
            .parse()
            .unwrap();
        let cancel = CancelToken::new();
        // Only the cancel ends the hour's dial.
        let error = tern_test_skip::wait::scope_within("the cancel ends the dial", |scope| {
            let dialling = scope.spawn(|| {
                Channel::connect_cancellable(&address, Duration::from_secs(3600), &cancel)
            });
            cancel.cancel();
            dialling.join().unwrap().expect_err("nobody listens")
        });
        assert!(is_cancel(&error), "{error:?}");
    }
}

//! What the destination says, or is told, on the main channel outside the
//! normal flow: aborts in both directions.

use std::time::Duration;

use tern_wire::Message;

use crate::error::{ChannelError, MigrationError};
use crate::transport::Channel;

/// Fails if the destination has sent something on the main channel (it only
/// speaks there before the end to abort).
pub(super) fn check_peer(main: &mut Channel) -> Result<(), MigrationError> {
    match main.wait_readable(Duration::ZERO) {
        Ok(false) => Ok(()),
        Ok(true) => Err(peer_reason(main).unwrap_or(MigrationError::Channel {
            index: 0,
            source: ChannelError::Closed,
        })),
        Err(error) => Err(MigrationError::channel(0)(error)),
    }
}

/// Tells the destination why the migration stops (unless it told us).
pub(super) fn send_abort(main: &mut Channel, error: &MigrationError) {
    if !matches!(error, MigrationError::PeerAborted { .. }) {
        let _ = main.send_message(&Message::Abort(tern_wire::Abort {
            reason: error.abort_reason(),
            message: error.chain(),
        }));
    }
}

/// Reads an abort message the destination may have sent, waiting briefly.
pub(super) fn peer_reason(main: &mut Channel) -> Option<MigrationError> {
    if !main.wait_readable(Duration::from_millis(500)).ok()? {
        return None;
    }
    match main.read_message() {
        Ok(Message::Abort(abort)) => Some(MigrationError::PeerAborted {
            reason: abort.reason,
            message: abort.message,
        }),
        _ => None,
    }
}

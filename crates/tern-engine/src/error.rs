//! Engine errors.

use std::io;

use tern_wire::{AbortReason, WireError};

use crate::guest::GuestError;

/// A failure on one channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    /// Connecting failed.
    #[error("Cannot connect to {0}")]
    Connect(String, #[source] io::Error),
    /// The peer closed the channel.
    #[error("Channel closed by the peer mid-stream")]
    Closed,
    /// Nothing arrived in time.
    #[error("Timed out waiting for {0}")]
    Timeout(&'static str),
    /// The peer sent something invalid.
    #[error("Protocol error")]
    Protocol(#[from] WireError),
    /// Any other I/O error.
    #[error("I/O error")]
    Io(#[source] io::Error),
    /// The TLS handshake or a TLS record failed (wrong CA, host name,
    /// missing or different certificate, a peer that does not speak TLS).
    #[error("TLS")]
    Tls(#[source] io::Error),
    /// The peer did not authenticate as this side requires, or refused this
    /// side's authentication.
    #[error("Authentication failed: {0}")]
    Auth(String),
}

/// Runs a migration thread's `body`; a panic in it becomes `Err` with the
/// panic's message, for the caller to fail the migration with. The other
/// threads wait on a failure flag, never on a thread that is gone, so a
/// panic must set that flag or they wait for the thread until a deadline
/// (or, where the peer keeps its channel alive, for good).
pub(crate) fn catching_panic<T>(body: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).map_err(|panic| {
        panic
            .downcast_ref::<&str>()
            .map(|text| (*text).to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".to_string())
    })
}

/// `error` and each of its causes, joined by ": ".
fn cause_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

impl ChannelError {
    /// The full cause chain as one line, for logs (a TLS failure's reason
    /// is in its cause).
    pub fn chain(&self) -> String {
        cause_chain(self)
    }
}

/// Why a migration (either side) did not complete.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrationError {
    /// A [`crate::MigrationConfig`] field has an unusable value. The field is
    /// named as in the config so that a front end can name its own option.
    #[error("Invalid configuration: {field}: {reason}")]
    InvalidConfig {
        /// The config field, such as `"channels"`.
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// A fault inside this side of the migration (a thread that panicked, a
    /// missing internal part), not something the peer did; the peer hears
    /// only that this side failed, never a protocol error.
    #[error("Internal error: {0}")]
    Internal(String),
    /// A channel failed.
    #[error("Channel {index} failed")]
    Channel {
        /// 0 = main channel, 1.. = page channels.
        index: usize,
        /// The cause.
        #[source]
        source: ChannelError,
    },
    /// The VMM's guest implementation failed.
    #[error("Guest operation '{operation}' failed")]
    Guest {
        /// What was being done.
        operation: &'static str,
        /// The VMM's error.
        #[source]
        source: GuestError,
    },
    /// The peer aborted.
    #[error("The peer aborted the migration ({}): {message}", reason.as_str())]
    PeerAborted {
        /// Reason class.
        reason: AbortReason,
        /// Peer's explanation.
        message: String,
    },
    /// The session setup is not acceptable.
    #[error("Incompatible setup: {0}")]
    Incompatible(String),
    /// The source sends a kind of guest the destination cannot restore.
    #[error("The destination expects a {expected} guest, the source sends a {offered} guest")]
    GuestKindMismatch {
        /// The destination's [`crate::DeviceState::guest_kind`].
        expected: String,
        /// The kind the source announced.
        offered: String,
    },
    /// A [`crate::MigrationConfig`] field cannot work over the destination's
    /// transport. Found before connecting; the field is named as in the
    /// config so that a front end can name its own option for it.
    #[error("Config field {field} cannot be used with {address}: {reason}")]
    UnsupportedTransport {
        /// The `MigrationConfig` field, such as `"zero_copy"`.
        field: &'static str,
        /// The destination address.
        address: String,
        /// Why not.
        reason: &'static str,
    },
    /// The peer broke the protocol's sequence.
    #[error("Protocol violation: {0}")]
    Protocol(String),
    /// The destination's memory differs from the source's.
    #[error("Memory digest mismatch: source {source_digest:032x}, destination {destination:032x}")]
    DigestMismatch {
        /// Source digest.
        source_digest: u128,
        /// Destination digest.
        destination: u128,
    },
    /// The migration was cancelled.
    #[error("Migration cancelled")]
    Cancelled,
    /// The source's peer answered its handshake as no tern destination
    /// does, or not at all within the handshake timeout: something else
    /// listens there.
    #[error("{address} is not a tern destination: {detail}")]
    NotTern {
        /// The destination address.
        address: String,
        /// What it did instead.
        detail: String,
    },
    /// The source committed the switch-over and the destination did not
    /// confirm that it resumed the guest: it may run there, or nowhere. The
    /// source keeps its guest paused, so it never runs twice; an operator
    /// (or the embedding VMM) decides, as with QEMU's `postmigrate` state.
    #[error(
        "Switch-over outcome unknown: the source committed and keeps its guest paused; \
         check the destination before resuming either"
    )]
    OutcomeUnknown(#[source] Box<MigrationError>),
    /// Postcopy failed after the point of no return: the guest no longer
    /// runs on the source, which never resumes it; `fate` says where it is.
    #[error("Postcopy failed after the point of no return ({fate})")]
    PostcopyFailed {
        /// Where the guest is now, in one line.
        fate: &'static str,
        /// What failed.
        #[source]
        cause: Box<MigrationError>,
    },
    /// Every page reached the destination during postcopy, but its memory
    /// as delivered does not match the source's: the guest already runs
    /// there, so this cannot be undone.
    #[error(
        "Memory digest mismatch after postcopy (source {source_digest:032x}, destination \
         {destination:032x}): the guest already runs on the destination; suspect pages: {pages}"
    )]
    PostcopyDigestMismatch {
        /// Source digest.
        source_digest: u128,
        /// Destination digest.
        destination: u128,
        /// The pages delivered after the switch (the only ones the digest
        /// did not cover before), as runs `region:first+count`.
        pages: String,
    },
    /// The iteration or time limit was reached under the cancel policy.
    #[error("Migration did not converge: {0}")]
    LimitReached(String),
    /// Zero-copy sending cannot be set up or failed.
    #[error("Zero-copy send")]
    ZeroCopy(#[source] crate::zerocopy::ZeroCopyError),
    /// A thread could not be started.
    #[error("Cannot start thread")]
    Thread(#[source] io::Error),
}

impl MigrationError {
    /// The reason to put in an abort message to the peer.
    pub fn abort_reason(&self) -> AbortReason {
        match self {
            Self::Cancelled => AbortReason::Cancelled,
            Self::Channel {
                source: ChannelError::Protocol(_),
                ..
            }
            | Self::Protocol(_)
            | Self::NotTern { .. } => AbortReason::ProtocolError,
            Self::Incompatible(_)
            | Self::GuestKindMismatch { .. }
            | Self::InvalidConfig { .. }
            | Self::UnsupportedTransport { .. } => AbortReason::IncompatibleSetup,
            Self::Guest { .. } => AbortReason::GuestError,
            Self::Channel { .. } | Self::ZeroCopy(_) => AbortReason::ChannelFailed,
            Self::DigestMismatch { .. } | Self::PostcopyDigestMismatch { .. } => {
                AbortReason::DigestMismatch
            }
            Self::LimitReached(_) => AbortReason::LimitReached,
            Self::PeerAborted { .. }
            | Self::Thread(_)
            | Self::Internal(_)
            | Self::OutcomeUnknown(_)
            | Self::PostcopyFailed { .. } => AbortReason::Other,
        }
    }

    /// The full cause chain as one line, for abort messages and reports.
    pub fn chain(&self) -> String {
        cause_chain(self)
    }

    pub(crate) fn guest(operation: &'static str) -> impl FnOnce(GuestError) -> Self {
        move |source| Self::Guest { operation, source }
    }

    /// What the peer's abort message says, as this side's error.
    pub(crate) fn from_peer_abort(abort: tern_wire::Abort) -> Self {
        Self::PeerAborted {
            reason: abort.reason,
            message: abort.message,
        }
    }

    pub(crate) fn channel(index: usize) -> impl FnOnce(ChannelError) -> Self {
        move |source| Self::Channel { index, source }
    }
}

//! The crate's errors.

use std::path::PathBuf;

/// What went wrong with the agent or with joining it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FleetError {
    /// The agent's socket could not be created or reached.
    #[error("Agent socket {path}: {source}")]
    Socket {
        /// The socket's path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Another process already serves the socket.
    #[error("Agent socket {0}: another process listens on it")]
    InUse(PathBuf),
    /// The agent answered something this version does not understand.
    #[error("The agent broke the protocol: {0}")]
    Protocol(String),
    /// The agent refused a request.
    #[error("The agent refused it: {0}")]
    Refused(String),
    /// No slot within the queue timeout.
    #[error("No slot within {0} s (the agent's queue); nothing was started")]
    QueueTimeout(u64),
    /// A request named a migration the agent does not know.
    #[error("No migration {0} on this host")]
    UnknownMigration(String),
    /// A setting out of its range.
    #[error("Setting '{name}' {reason}")]
    InvalidSetting {
        /// The setting's name as in the protocol.
        name: &'static str,
        /// What is wrong.
        reason: String,
    },
}

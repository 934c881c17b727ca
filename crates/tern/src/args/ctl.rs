//! `tern ctl`'s syntax.

use std::path::PathBuf;

use clap::Args;

#[derive(Debug, Args)]
pub(crate) struct CtlArgs {
    /// The control socket (`--control-socket` of migrate, receive or vm).
    pub socket: PathBuf,
    /// A command (query-migrate, migrate-set-parameters, migrate_cancel,
    /// migrate-switch-over, query-events, cont, ...; docs/control.md), or
    /// `events` to print the events kept so far, then each as it comes,
    /// until the migration ends.
    pub command: String,
    /// The command's arguments as NAME=VALUE, VALUE as JSON when it parses
    /// as JSON, else as a string: `max-bandwidth=8388608`.
    pub arguments: Vec<String>,
    /// How long to wait for the answer (or, for `events`, for the end), in
    /// seconds.
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// For `events`: only the events from now on, not first those the
    /// command kept from before (`query-events`).
    #[arg(long)]
    pub no_history: bool,
}

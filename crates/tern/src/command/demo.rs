//! `tern demo`, and the one implementation of a localhost demo that `tern
//! vm demo` shares: both ends in this process, the destination in a thread,
//! the source migrating to it, then a proof on the destination. What
//! differs between a synthetic guest and a KVM guest is a [`Rehearsal`].

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tern_engine::{
    Address, DestinationGuest, GuestError, Listener, MigrationConfig, MigrationFailure,
    MigrationStats, ReceiveConfig, Received, Source, SourceGuest,
};
use tern_synthetic::SyntheticGuest;
use tern_wire::SessionSetup;

use crate::args::{DemoArgs, TransferArgs};
use crate::report::{Progress, print_json, print_summary};
use crate::session::{self, Incomplete};

/// What `tern demo` and `tern vm demo` differ in: the guests at both ends,
/// and what proves the migration on the destination.
pub(crate) trait Rehearsal {
    /// The guest migrated.
    type Source: SourceGuest;
    /// The guest received, in the destination's thread.
    type Destination: DestinationGuest + Send + 'static;

    /// Refuses, before anything is built, what this machine cannot run.
    fn check(&self) -> anyhow::Result<()>;

    /// Binds the destination's listener; a directory it needs (a Unix
    /// socket's) lives as long as the value beside it.
    fn listen(&self) -> anyhow::Result<(Listener, Option<tempfile::TempDir>)>;

    /// Builds and starts the source guest, which will migrate to
    /// `address`.
    fn start_source(&mut self, address: &Address) -> anyhow::Result<Self::Source>;

    /// The step that builds the destination's guest for the layout the
    /// source announces.
    fn destination_guest(
        &self,
    ) -> anyhow::Result<
        impl FnOnce(&SessionSetup) -> Result<Self::Destination, GuestError> + Send + 'static,
    >;

    /// Says the migration starts, once the destination waits.
    fn announce(&self, address: &Address, config: &MigrationConfig);

    /// Proves the migration on the destination and prints the report; the
    /// exit status.
    fn succeeded(
        &self,
        source: &Self::Source,
        stats: MigrationStats,
        received: Received<Self::Destination>,
        config: &MigrationConfig,
    ) -> anyhow::Result<ExitCode>;

    /// Reports a failed migration; the error, with what became of the
    /// source guest.
    fn failed(
        &self,
        source: &Self::Source,
        failure: MigrationFailure,
        verbose: bool,
    ) -> anyhow::Error;
}

/// `tern demo`.
pub(crate) fn run(args: &DemoArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    rehearse(
        &mut SyntheticRehearsal { args },
        &args.transfer,
        args.tls,
        verbose,
    )
}

/// Runs a demo: the source's settings from `transfer` (with a throwaway CA
/// when `tls`), a destination in a thread, the migration, the proof.
pub(crate) fn rehearse<R: Rehearsal>(
    rehearsal: &mut R,
    transfer: &TransferArgs,
    tls: bool,
    verbose: bool,
) -> anyhow::Result<ExitCode> {
    let mut config = session::migration_config(transfer)?;
    let (source_security, destination_security) = if tls {
        crate::secure::throwaway_tls()?
    } else {
        Default::default()
    };
    config.security = source_security;
    rehearsal.check()?;
    let source = Source::new(config.clone())?;
    let (listener, _socket_dir) = rehearsal.listen()?;
    let address = listener.local_address()?;
    session::check_config(&config, &address)?;
    let mut guest = rehearsal.start_source(&address)?;
    let mut receive_config = ReceiveConfig::default();
    receive_config.io_timeout = config.io_timeout;
    receive_config.security = destination_security;
    // The demo's own source: its --verify choice stands.
    receive_config.allow_unverified = true;
    let destination =
        session::spawn_local_destination(listener, receive_config, rehearsal.destination_guest()?);
    rehearsal.announce(&address, &config);
    let cancel = source.cancel_token();
    session::install_interrupt_handler(move || cancel.cancel());
    let progress = Progress::start(source.stats());
    let result = source.migrate(&mut guest, &address);
    progress.finish();
    let received = destination.finish(result.is_ok());
    match (result, received) {
        (Ok(stats), Ok(received)) => rehearsal.succeeded(&guest, stats, received, &config),
        (Err(failure), destination) => {
            // The source's error names the cause; the destination's is
            // mostly the same failure seen from the other end.
            if let Err(error) = destination {
                tracing::debug!("destination: {error:#}");
            }
            Err(rehearsal.failed(&guest, failure, verbose))
        }
        (Ok(_), Err(error)) => Err(Incomplete::error(
            error,
            "the source finished but the destination did not",
        )),
    }
}

/// The demo's JSON document: the source's statistics (with the
/// destination's inside) plus what the demo checked on the destination.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct DemoReport {
    #[serde(flatten)]
    stats: MigrationStats,
    channels: u16,
    zero_page_detection: &'static str,
    /// The destination guest kept dirtying memory after it resumed.
    resumed_on_destination: bool,
}

/// `tern demo`'s guests: synthetic at both ends, the destination's shown to
/// go on dirtying memory.
struct SyntheticRehearsal<'a> {
    args: &'a DemoArgs,
}

impl Rehearsal for SyntheticRehearsal<'_> {
    type Source = SyntheticGuest;
    type Destination = SyntheticGuest;

    fn check(&self) -> anyhow::Result<()> {
        self.args.guest.check()?;
        session::check_memory_fits(
            2 * self.args.guest.resident_estimate(),
            &format!(
                "--memory {} with both ends of the demo in this process",
                crate::units::human_bytes(self.args.guest.memory)
            ),
        )
    }

    fn listen(&self) -> anyhow::Result<(Listener, Option<tempfile::TempDir>)> {
        let mut temp_dir = None;
        let listen = if self.args.unix {
            let dir = tempfile::tempdir().context("cannot create a directory for the socket")?;
            let path = dir.path().join("tern.sock");
            temp_dir = Some(dir);
            Address::Unix(path)
        } else {
            Address::Tcp("127.0.0.1:0".into())
        };
        let listener =
            Listener::bind(&listen).with_context(|| format!("cannot listen on {listen}"))?;
        Ok((listener, temp_dir))
    }

    fn start_source(&mut self, _address: &Address) -> anyhow::Result<SyntheticGuest> {
        let guest = &self.args.guest;
        if !self.args.json {
            eprintln!(
                "tern demo: filling a {} guest ({}% zero, {}% random, {}% text pages)...",
                crate::units::human_bytes(guest.memory),
                guest.mix.zero,
                guest.mix.random,
                guest.mix.text
            );
        }
        session::fill_guest(guest, false)
    }

    fn destination_guest(
        &self,
    ) -> anyhow::Result<
        impl FnOnce(&SessionSetup) -> Result<SyntheticGuest, GuestError> + Send + 'static,
    > {
        Ok(session::destination_guest)
    }

    fn announce(&self, address: &Address, config: &MigrationConfig) {
        if !self.args.json {
            eprintln!(
                "tern demo: migrating to {address} over {} channels...",
                config.channels
            );
        }
    }

    fn succeeded(
        &self,
        _source: &SyntheticGuest,
        stats: MigrationStats,
        received: Received<SyntheticGuest>,
        config: &MigrationConfig,
    ) -> anyhow::Result<ExitCode> {
        let running = session::guest_keeps_running(&received.guest, Duration::from_secs(2))
            || self.args.guest.dirty_rate == 0;
        let report = DemoReport {
            stats,
            channels: config.channels,
            zero_page_detection: config.zero_page_detection.as_str(),
            resumed_on_destination: running,
        };
        if self.args.json {
            print_json(&report)?;
        } else {
            print_summary(
                &report.stats,
                &[
                    ("channels", report.channels.to_string()),
                    (
                        "zero-page detection",
                        report.zero_page_detection.to_string(),
                    ),
                    (
                        "guest runs on destination",
                        report.resumed_on_destination.to_string(),
                    ),
                ],
            );
        }
        Ok(ExitCode::SUCCESS)
    }

    fn failed(
        &self,
        _source: &SyntheticGuest,
        failure: MigrationFailure,
        verbose: bool,
    ) -> anyhow::Error {
        if let Err(error) = session::report_failure(&failure.stats, self.args.json, verbose) {
            return error;
        }
        let what = session::source_guest_after(&failure.error);
        Incomplete::error(failure.error, what)
    }
}

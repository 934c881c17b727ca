//! `tern migrate`, and the one implementation of a source that `tern vm
//! migrate` shares: the settings, the steering and the agent, the signals,
//! the events and the migration itself. What differs between a synthetic
//! guest and a KVM guest is a [`Departure`].

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use tern_engine::{Address, MigrationFailure, MigrationStats, Source, SourceGuest};
use tern_synthetic::SyntheticGuest;

use crate::args::security::SourceSecurityArgs;
use crate::args::steering::SteeringArgs;
use crate::args::{MigrateArgs, TransferArgs};
use crate::control_socket::Target;
use crate::report::{Progress, print_json, print_summary};
use crate::session::{self, Incomplete};

/// What `tern migrate` and `tern vm migrate` differ in: the guest, and
/// what is reported with the engine's statistics.
pub(crate) trait Departure {
    /// The guest migrated.
    type Guest: SourceGuest;

    /// Refuses, before anything is built, what this machine cannot run.
    fn check(&self) -> anyhow::Result<()>;

    /// Builds and starts the guest, once the source and its steering are
    /// up.
    fn start(&mut self) -> anyhow::Result<Self::Guest>;

    /// Reports the migration's outcome; the exit status, or the error
    /// with what became of the guest.
    fn finish(
        &self,
        guest: &Self::Guest,
        result: Result<MigrationStats, MigrationFailure>,
        verbose: bool,
    ) -> anyhow::Result<ExitCode>;
}

/// The options every migrating command has.
pub(crate) struct Departing<'a> {
    /// `--to`.
    pub to: &'a Address,
    /// `--auth-key`, `--tls-dir`, `--tls-hostname`.
    pub security: &'a SourceSecurityArgs,
    /// How pages go.
    pub transfer: &'a TransferArgs,
    /// `--control-socket`, `--metrics-listen`, `--agent`.
    pub steering: &'a SteeringArgs,
    /// `--events`.
    pub events: bool,
    /// `--vmm-config`.
    pub vmm_config: Option<&'a Path>,
    /// `--local`: memory handed over, not copied.
    pub local: bool,
}

/// `tern migrate`.
pub(crate) fn run(args: &MigrateArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let departing = Departing {
        to: &args.to,
        security: &args.security,
        transfer: &args.transfer,
        steering: &args.steering,
        events: args.events,
        vmm_config: args.vmm_config.as_deref(),
        local: args.local,
    };
    depart(&departing, &mut SyntheticDeparture { args }, verbose)
}

/// Migrates the guest `departure` starts to `departing.to`.
pub(crate) fn depart<D: Departure>(
    departing: &Departing<'_>,
    departure: &mut D,
    verbose: bool,
) -> anyhow::Result<ExitCode> {
    let mut config = session::migration_config(departing.transfer)?;
    config.security = departing.security.security()?;
    if let Some(path) = departing.vmm_config {
        config.vmm_config =
            std::fs::read(path).with_context(|| format!("--vmm-config {}", path.display()))?;
    }
    config.memory_handover = departing.local;
    session::check_config(&config, departing.to)?;
    departure.check()?;
    let source = Source::new(config)?;
    let steering = crate::steering::Steering::start(departing.steering)?;
    steering.steer(&Target::Source(source.handle()));
    let mut guest = departure.start()?;
    let cancel = source.cancel_token();
    session::install_interrupt_handler(move || cancel.cancel());
    // --agent: waits here for a slot (docs/fleet.md).
    steering.join_agent(&Target::Source(source.handle()), &source.cancel_token())?;
    // After the handler, as for the ready event: a script may signal from
    // the moment it reads the line.
    if departing.events {
        crate::report::print_migrating(departing.to)?;
    }
    let progress = Progress::start(source.stats());
    let result = source.migrate(&mut guest, departing.to);
    progress.finish();
    departure.finish(&guest, result, verbose)
}

/// `tern migrate`'s guest: synthetic, filled as the options say.
struct SyntheticDeparture<'a> {
    args: &'a MigrateArgs,
}

impl Departure for SyntheticDeparture<'_> {
    type Guest = SyntheticGuest;

    fn check(&self) -> anyhow::Result<()> {
        self.args.guest.check()?;
        session::check_memory_fits(
            self.args.guest.resident_estimate(),
            &format!(
                "--memory {}",
                crate::units::human_bytes(self.args.guest.memory)
            ),
        )
    }

    fn start(&mut self) -> anyhow::Result<SyntheticGuest> {
        session::fill_guest(&self.args.guest, self.args.local)
    }

    fn finish(
        &self,
        _guest: &SyntheticGuest,
        result: Result<MigrationStats, MigrationFailure>,
        verbose: bool,
    ) -> anyhow::Result<ExitCode> {
        match result {
            Ok(stats) => {
                if self.args.json {
                    print_json(&stats)?;
                } else {
                    print_summary(&stats, &[]);
                }
                Ok(ExitCode::SUCCESS)
            }
            Err(failure) => {
                session::report_failure(&failure.stats, self.args.json, verbose)?;
                let what = session::source_guest_after(&failure.error);
                Err(Incomplete::source(failure, what))
            }
        }
    }
}

//! `tern migrate`: a synthetic guest migrated to a `tern receive`.

use std::process::ExitCode;

use anyhow::Context;
use tern_engine::Source;

use crate::args::MigrateArgs;
use crate::control_socket::Target;
use crate::report::{Progress, print_json, print_summary};
use crate::session::{self, Incomplete};

/// `tern migrate`.
pub fn run(args: &MigrateArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let mut config = session::migration_config(&args.transfer)?;
    config.security = args.security.security()?;
    if let Some(path) = &args.vmm_config {
        config.vmm_config =
            std::fs::read(path).with_context(|| format!("--vmm-config {}", path.display()))?;
    }
    session::check_config(&config, &args.to)?;
    args.guest.check()?;
    session::check_memory_fits(
        args.guest.resident_estimate(),
        &format!("--memory {}", crate::units::human_bytes(args.guest.memory)),
    )?;
    let source = Source::new(config)?;
    let steering = crate::steering::Steering::start(&args.steering)?;
    steering.steer(&Target::Source(source.handle()));
    let mut guest = session::fill_guest(&args.guest)?;
    let cancel = source.cancel_token();
    session::install_interrupt_handler(move || cancel.cancel());
    // --agent: waits here for a slot (docs/fleet.md).
    steering.join_agent(&Target::Source(source.handle()), &source.cancel_token())?;
    // After the handler, as for the ready event: a script may signal from
    // the moment it reads the line.
    if args.events {
        crate::report::print_migrating(&args.to)?;
    }
    let progress = Progress::start(source.stats());
    let result = source.migrate(&mut guest, &args.to);
    progress.finish();
    match result {
        Ok(stats) => {
            if args.json {
                print_json(&stats)?;
            } else {
                print_summary(&stats, &[]);
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(failure) => {
            session::report_failure(&failure.stats, args.json, verbose)?;
            let what = session::source_guest_after(&failure.error);
            Err(Incomplete::source(failure, what))
        }
    }
}

//! `tern vm migrate`: the test guest run, then migrated live to a `tern vm
//! receive`.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use tern_engine::{GuestControl, Source};

use super::guest::{SourceReport, guest_write_rate_row, measure, source_guest_after_failure};
use crate::args::vm::MigrateArgs;
use crate::control_socket::Target;
use crate::report::{Progress, print_json, print_summary};
use crate::session::{self, Incomplete};

/// `tern vm migrate`.
pub(super) fn run(args: &MigrateArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let mut config = session::migration_config(&args.transfer)?;
    config.security = args.security.security()?;
    session::check_config(&config, &args.to)?;
    let source = Source::new(config)?;
    let steering = crate::steering::Steering::start(&args.steering)?;
    steering.steer(&Target::Source(source.handle()));
    let mut guest = session::start_kvm_guest(&args.vm, 1)?;
    let rate = measure(&guest, Duration::from_millis(args.warmup));
    if args.paused {
        guest.pause().context("cannot pause the guest")?;
    }
    eprintln!(
        "tern vm migrate: guest write rate (test guest's own counter) {:.0} pages/s; migrating to {}...",
        rate.page_writes_per_second, args.to
    );
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
    let (stats, runs, error) = match result {
        Ok(stats) => (stats, None, None),
        Err(failure) => {
            let before = guest.pass_count();
            let runs =
                !args.paused && guest.wait_for_pass_count_above(before, Duration::from_secs(5));
            (*failure.stats, Some(runs), Some(failure.error))
        }
    };
    let report = SourceReport {
        stats,
        guest_before_migration: rate,
        source_pass_count: guest.pass_count(),
        source_guest_runs: runs,
    };
    if args.json {
        print_json(&report)?;
    } else if error.is_none() || verbose {
        let mut rows = vec![
            ("source pass count", report.source_pass_count.to_string()),
            guest_write_rate_row(&report.guest_before_migration),
        ];
        if let Some(runs) = runs {
            rows.push(("source guest runs on", runs.to_string()));
        }
        print_summary(&report.stats, &rows);
    }
    match error {
        None => Ok(ExitCode::SUCCESS),
        Some(error) => {
            let what = match error {
                tern_engine::MigrationError::OutcomeUnknown(_) => {
                    session::source_guest_after(&error)
                }
                _ => source_guest_after_failure(runs == Some(true), args.paused),
            };
            Err(Incomplete::source_error(error, what, &report.stats))
        }
    }
}

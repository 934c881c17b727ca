//! `tern vm migrate`: `tern migrate`'s implementation with the test guest
//! run under KVM, then migrated live to a `tern vm receive`.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use tern_engine::{GuestControl, MigrationError, MigrationFailure, MigrationStats};
use tern_vmm::KvmGuest;

use super::guest::{
    GuestRate, SourceReport, guest_write_rate_row, measure, source_guest_after_failure,
};
use crate::args::vm::MigrateArgs;
use crate::command::migrate::{Departing, Departure, depart};
use crate::report::{print_json, print_summary};
use crate::session::{self, Incomplete};

/// `tern vm migrate`.
pub(super) fn run(args: &MigrateArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let departing = Departing {
        to: &args.to,
        security: &args.security,
        transfer: &args.transfer,
        steering: &args.steering,
        events: args.events,
        vmm_config: None,
        local: args.local,
    };
    let mut departure = KvmDeparture {
        args,
        rate: GuestRate::default(),
        start_pass_count: None,
    };
    depart(&departing, &mut departure, verbose)
}

/// The KVM test guest; `rate` is its own, measured during the warm-up (as
/// the guest starts).
struct KvmDeparture<'a> {
    args: &'a MigrateArgs,
    rate: GuestRate,
    /// The guest's pass counter as the migration starts.
    start_pass_count: Option<u64>,
}

impl Departure for KvmDeparture<'_> {
    type Guest = KvmGuest;

    fn check(&self) -> anyhow::Result<()> {
        // The guest's shape and memory are checked as it starts.
        Ok(())
    }

    fn start(&mut self) -> anyhow::Result<KvmGuest> {
        let mut guest = if self.args.local {
            session::start_memfd_kvm_guest(&self.args.vm)?
        } else {
            session::start_kvm_guest(&self.args.vm, 1)?
        };
        self.rate = measure(&guest, Duration::from_millis(self.args.warmup));
        self.start_pass_count = Some(guest.pass_count());
        if self.args.paused {
            guest.pause().context("cannot pause the guest")?;
        }
        eprintln!(
            "tern vm migrate: guest write rate (test guest's own counter) {:.0} pages/s; migrating to {}...",
            self.rate.page_writes_per_second, self.args.to
        );
        Ok(guest)
    }

    fn finish(
        &self,
        guest: &KvmGuest,
        result: Result<MigrationStats, MigrationFailure>,
        verbose: bool,
    ) -> anyhow::Result<ExitCode> {
        let (stats, runs, error) = match result {
            Ok(stats) => (stats, None, None),
            Err(failure) => {
                let before = guest.pass_count();
                let runs = !self.args.paused
                    && guest.wait_for_pass_count_above(before, Duration::from_secs(5));
                (*failure.stats, Some(runs), Some(failure.error))
            }
        };
        // After a hand-over the source's mapping of the memory is revoked
        // (the guest runs on at the destination, on the same pages):
        // nothing of it may be read here.
        let handed_over = self.args.local && error.is_none();
        let report = SourceReport {
            stats,
            guest_before_migration: self.rate,
            source_pass_count_at_start: self.start_pass_count,
            source_pass_count: (!handed_over).then(|| guest.pass_count()),
            source_guest_runs: runs,
        };
        if self.args.json {
            print_json(&report)?;
        } else if error.is_none() || verbose {
            let mut rows = vec![
                (
                    "source pass count",
                    report.source_pass_count.map_or_else(
                        || "- (memory handed over)".into(),
                        |count| count.to_string(),
                    ),
                ),
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
                    MigrationError::OutcomeUnknown(_) => session::source_guest_after(&error),
                    _ => source_guest_after_failure(runs == Some(true), self.args.paused),
                };
                Err(Incomplete::source_error(error, what, &report.stats))
            }
        }
    }
}

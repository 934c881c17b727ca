//! `tern vm demo`: `tern demo`'s implementation with a running KVM guest,
//! its memory and execution proved on the destination.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tern_engine::{
    Address, GuestError, Listener, MigrationConfig, MigrationFailure, MigrationStats, Received,
};
use tern_vmm::KvmGuest;
use tern_wire::SessionSetup;

use super::guest::{
    DestinationProof, GuestRate, SourceReport, guest_write_rate_row, measure, prepare_destination,
    prove_on_destination, source_guest_after_failure,
};
use crate::args::vm::DemoArgs;
use crate::command::demo::{Rehearsal, rehearse};
use crate::report::{print_json, print_summary};
use crate::session::{self, Incomplete};
use crate::units::human_bytes;

/// `tern vm demo`.
pub(super) fn run(args: &DemoArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let mut rehearsal = KvmRehearsal {
        args,
        rate: GuestRate::default(),
    };
    rehearse(&mut rehearsal, &args.transfer, false, verbose)
}

/// The demo's JSON document.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct DemoReport {
    #[serde(flatten)]
    stats: MigrationStats,
    #[serde(flatten)]
    proof: DestinationProof,
    guest_before_migration: GuestRate,
    memory: u64,
    working_set_pages: u32,
    dirty_log: &'static str,
    channels: u16,
}

/// A KVM guest at both ends; `rate` is the source guest's own, measured
/// during the warm-up (as the guest starts).
struct KvmRehearsal<'a> {
    args: &'a DemoArgs,
    rate: GuestRate,
}

impl Rehearsal for KvmRehearsal<'_> {
    type Source = KvmGuest;
    type Destination = KvmGuest;

    fn check(&self) -> anyhow::Result<()> {
        // The guest's shape and memory are checked as it starts.
        Ok(())
    }

    fn listen(&self) -> anyhow::Result<(Listener, Option<tempfile::TempDir>)> {
        let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into()))
            .context("cannot listen on 127.0.0.1")?;
        Ok((listener, None))
    }

    fn start_source(&mut self, address: &Address) -> anyhow::Result<KvmGuest> {
        let guest = session::start_kvm_guest(&self.args.vm, 2)?;
        let rate = measure(&guest, Duration::from_millis(self.args.warmup));
        self.rate = rate;
        if !self.args.json {
            eprintln!(
                "tern vm demo: a {} KVM guest writing {} pages per pass, guest write rate (test guest's own counter) {:.0} pages/s; migrating to {address}...",
                human_bytes(guest.memory_bytes()),
                guest.working_set_pages(),
                rate.page_writes_per_second
            );
        }
        Ok(guest)
    }

    fn destination_guest(
        &self,
    ) -> anyhow::Result<impl FnOnce(&SessionSetup) -> Result<KvmGuest, GuestError> + Send + 'static>
    {
        prepare_destination()
    }

    fn announce(&self, _address: &Address, _config: &MigrationConfig) {
        // Said as the guest started, with its rate.
    }

    fn succeeded(
        &self,
        source: &KvmGuest,
        stats: MigrationStats,
        mut received: Received<KvmGuest>,
        config: &MigrationConfig,
    ) -> anyhow::Result<ExitCode> {
        let proof = prove_on_destination(
            &mut received.guest,
            Duration::from_millis(self.args.run_after),
        )?;
        let passed = proof.passed() && stats.digest_verified;
        let report = DemoReport {
            stats,
            proof,
            guest_before_migration: self.rate,
            memory: source.memory_bytes(),
            working_set_pages: source.working_set_pages(),
            dirty_log: source.dirty_log_mode().as_str(),
            channels: config.channels,
        };
        if self.args.json {
            print_json(&report)?;
        } else {
            let mut rows = report.proof.rows();
            rows.push(guest_write_rate_row(&report.guest_before_migration));
            rows.push(("dirty log", report.dirty_log.to_string()));
            print_summary(&report.stats, &rows);
        }
        Ok(if passed {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        })
    }

    fn failed(&self, source: &KvmGuest, failure: MigrationFailure, verbose: bool) -> anyhow::Error {
        let before = source.pass_count();
        let runs = source.wait_for_pass_count_above(before, Duration::from_secs(5));
        let report = SourceReport {
            stats: *failure.stats,
            guest_before_migration: self.rate,
            source_pass_count_at_start: None,
            source_pass_count: Some(source.pass_count()),
            source_guest_runs: Some(runs),
        };
        if self.args.json {
            if let Err(error) = print_json(&report) {
                return error;
            }
        } else if verbose {
            print_summary(&report.stats, &[]);
        }
        Incomplete::error(failure.error, source_guest_after_failure(runs, false))
    }
}

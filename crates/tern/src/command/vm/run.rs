//! `tern vm run`: the test guest under KVM, and how fast it dirties memory.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use tern_engine::GuestControl;
use tern_vmm::KvmGuest;

use super::guest::{ConsistencyJson, GuestRate, measure};
use crate::args::vm::RunArgs;
use crate::report::print_json;
use crate::session;
use crate::units::{human_bytes, whole_u64};

/// `tern vm run --json`'s document.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct RunReport {
    memory: u64,
    working_set_pages: u32,
    seconds: f64,
    pass_count: u64,
    #[serde(flatten)]
    rate: GuestRate,
    serial_bytes: u64,
    vm_exits: u64,
    dirty_log: &'static str,
    consistency_check: ConsistencyJson,
}

/// `tern vm run`.
pub(super) fn run(args: &RunArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.seconds.is_finite() && args.seconds > 0.0,
        "--seconds must be a positive number"
    );
    let mut guest = session::start_kvm_guest(&args.vm, 1)?;
    let pages = guest.working_set_pages();
    if !args.json {
        eprintln!(
            "tern vm run: {} of RAM, the guest dirties {} pages ({}) per pass; dirty log: {}",
            human_bytes(guest.memory_bytes()),
            pages,
            human_bytes(u64::from(pages) * tern_engine::PAGE_SIZE as u64),
            guest.dirty_log_mode().as_str()
        );
    }
    let started = Instant::now();
    run_for(
        &guest,
        started,
        Duration::from_secs_f64(args.seconds),
        args.json,
    );
    let check = {
        guest.pause().context("cannot pause the guest")?;
        let report = guest
            .consistency_check()
            .map_err(|reason| anyhow::anyhow!("consistency check: {reason}"))?;
        let unreported = guest
            .unreported_passes()
            .context("cannot read the paused vCPU")?;
        ConsistencyJson::new(report, guest.serial_transmitted(), unreported)
    };
    let elapsed = started.elapsed().as_secs_f64();
    let passes = guest.pass_count();
    let report = RunReport {
        memory: guest.memory_bytes(),
        working_set_pages: pages,
        seconds: elapsed,
        pass_count: passes,
        rate: GuestRate {
            passes_per_second: passes as f64 / elapsed,
            page_writes_per_second: passes as f64 * f64::from(pages) / elapsed,
        },
        serial_bytes: guest.serial_transmitted(),
        vm_exits: guest.exits(),
        dirty_log: guest.dirty_log_mode().as_str(),
        consistency_check: check,
    };
    let passed = report.consistency_check.passed;
    if args.json {
        print_json(&report)?;
    } else {
        println!(
            "{} passes in {:.1} s; consistency check {}",
            report.pass_count,
            elapsed,
            if passed { "passed" } else { "FAILED" }
        );
    }
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Lets the guest run until `total` after `started`, measuring its rate
/// each second and, unless `json`, printing a line for each.
fn run_for(guest: &KvmGuest, started: Instant, total: Duration, json: bool) {
    while started.elapsed() < total {
        let slice = (total - started.elapsed()).min(Duration::from_secs(1));
        let rate = measure(guest, slice);
        if !json {
            println!(
                "{:>6.1} s  passes {:>9}  {:>9.0} passes/s  {:>10.0} page writes/s ({}/s)  serial {} bytes",
                started.elapsed().as_secs_f64(),
                guest.pass_count(),
                rate.passes_per_second,
                rate.page_writes_per_second,
                human_bytes(
                    whole_u64(rate.page_writes_per_second)
                        .saturating_mul(tern_engine::PAGE_SIZE as u64)
                ),
                guest.serial_transmitted()
            );
        }
    }
}

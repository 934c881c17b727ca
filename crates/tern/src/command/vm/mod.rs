//! `tern vm`: run, migrate and receive a real KVM guest (the reference VMM
//! of `tern-vmm` with its test guest), and a localhost demo proving the
//! guest's memory and execution on the destination. Migrating, receiving
//! and the demo are `tern migrate`'s, `tern receive`'s and `tern demo`'s
//! implementations with a KVM guest (`Departure`, `Arrival`, `Rehearsal`);
//! saving and restoring are `tern save`'s and `tern restore`'s.

mod demo;
mod guest;
mod migrate;
mod receive;
mod run;

use std::process::ExitCode;

use anyhow::Context;

use crate::args::vm::{ExportGuestArgs, VmCommand};

/// `tern vm ...`.
pub(crate) fn run(command: VmCommand, verbose: bool) -> anyhow::Result<ExitCode> {
    match command {
        VmCommand::Run(args) => run::run(&args),
        VmCommand::Migrate(args) => migrate::run(&args, verbose),
        VmCommand::Receive(args) => receive::run(&args),
        VmCommand::Demo(args) => demo::run(&args, verbose),
        VmCommand::ExportGuest(args) => export_guest(&args),
        VmCommand::Save(args) => super::save::vm_save(&args),
        VmCommand::Restore(args) => super::restore::vm_restore(&args),
    }
}

/// `tern vm export-guest`.
fn export_guest(args: &ExportGuestArgs) -> anyhow::Result<ExitCode> {
    let pages = u32::try_from(args.working_set / tern_engine::PAGE_SIZE as u64)
        .context("--working-set is too large")?;
    anyhow::ensure!(pages > 0, "--working-set must be at least one page");
    let image = tern_vmm::guest_code::multiboot_image_for(pages, args.workload);
    std::fs::write(&args.multiboot, &image)
        .with_context(|| format!("cannot write {}", args.multiboot.display()))?;
    eprintln!(
        "tern vm export-guest: {} bytes, {pages} working-set pages, to {}",
        image.len(),
        args.multiboot.display()
    );
    Ok(ExitCode::SUCCESS)
}

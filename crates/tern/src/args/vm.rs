//! `tern vm`'s syntax: the KVM test guest's commands and its shape.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use tern_engine::Address;
use tern_vmm::VmConfig;
use tern_vmm::guest_code::Workload;

use super::TransferArgs;
use super::values::workload_values;
use crate::units::{human_bytes, parse_size};

/// KVM guest commands.
#[derive(Debug, Subcommand)]
pub(crate) enum VmCommand {
    /// Run the test guest under KVM and report how fast it dirties memory.
    Run(RunArgs),
    /// Run the test guest and migrate it, live, to a `tern vm receive`.
    Migrate(Box<MigrateArgs>),
    /// Receive a KVM guest, check it and let it run on here.
    Receive(ReceiveArgs),
    /// Migrate a running KVM guest between two VMs of this process over
    /// localhost and prove its memory and execution on the destination.
    Demo(DemoArgs),
    /// Write the test guest as a multiboot image (for QEMU's `-kernel`).
    ExportGuest(ExportGuestArgs),
    /// Run the test guest and save it to a snapshot file.
    Save(super::snapshot::VmSaveArgs),
    /// Restore the test guest from a snapshot file and let it run.
    Restore(super::snapshot::RestoreArgs),
}

#[derive(Debug, Args)]
pub(crate) struct ExportGuestArgs {
    /// Memory the guest dirties each pass, from 1 MiB up (baked into the
    /// code).
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    pub working_set: u64,
    /// What the guest does to each working-set page every pass.
    #[arg(long, default_value = "increment", value_parser = workload_values())]
    pub workload: Workload,
    /// Where to write the flat multiboot image.
    #[arg(long)]
    pub multiboot: PathBuf,
}

/// The guest VM's shape.
#[derive(Debug, Args, Clone)]
pub(crate) struct VmArgs {
    /// Guest RAM (binary units: 128M, 1GiB; at most 3 GiB).
    #[arg(long, default_value = "128MiB", value_parser = parse_size)]
    pub memory: u64,
    /// Memory the guest dirties each pass, from 1 MiB up.
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    pub working_set: u64,
    /// What the guest does to each working-set page every pass.
    #[arg(long, default_value = "increment", value_parser = workload_values())]
    pub workload: Workload,
    /// Start RAM from this file's contents (mapped privately, never
    /// written).
    #[arg(long)]
    pub image: Option<PathBuf>,
}

impl VmArgs {
    /// The VMM's configuration for this shape.
    pub(crate) fn config(&self) -> anyhow::Result<VmConfig> {
        let pages = u32::try_from(self.working_set / tern_engine::PAGE_SIZE as u64)
            .context("--working-set is too large")?;
        anyhow::ensure!(pages > 0, "--working-set must be at least one page");
        anyhow::ensure!(
            self.working_set <= self.memory,
            "--working-set {} is larger than --memory {}",
            human_bytes(self.working_set),
            human_bytes(self.memory)
        );
        Ok(VmConfig {
            memory_bytes: self.memory,
            working_set_pages: pages,
            workload: self.workload,
            image: self.image.clone(),
            memfd: false,
        })
    }
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub vm: VmArgs,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Print one JSON document instead of a line per second.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct MigrateArgs {
    /// Destination: HOST:PORT, tcp:HOST:PORT, tcp::PORT (this machine) or
    /// unix:PATH.
    #[arg(long, value_parser = super::values::parse_address)]
    pub to: Address,
    #[command(flatten)]
    pub security: super::security::SourceSecurityArgs,
    #[command(flatten)]
    pub vm: VmArgs,
    /// How long the guest runs before the migration starts, in
    /// milliseconds.
    #[arg(long, default_value_t = 500)]
    pub warmup: u64,
    /// Pause the guest after the warm-up and migrate it paused (it resumes
    /// on the destination).
    #[arg(long)]
    pub paused: bool,
    #[command(flatten)]
    pub transfer: TransferArgs,
    /// Print one JSON document instead of the summary table.
    #[arg(long)]
    pub json: bool,
    /// Print a `migrating` event, one JSON line on stdout, as the migration
    /// starts, before the report (docs/cli.md, "Events").
    #[arg(long)]
    pub events: bool,
    #[command(flatten)]
    pub steering: super::steering::SteeringArgs,
    /// Same-host migration: hand the guest's memory (then a memfd) over as
    /// file descriptors over the unix: socket instead of copying it; the
    /// destination runs `tern vm receive --local`.
    #[arg(long)]
    pub local: bool,
}

#[derive(Debug, Args)]
pub(crate) struct ReceiveArgs {
    #[command(flatten)]
    pub listen: super::ListenArgs,
    /// How long to let the guest run on here before reporting and exiting,
    /// in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub run_after: u64,
    /// Print one JSON document instead of a summary.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    #[command(flatten)]
    pub vm: VmArgs,
    /// How long the guest runs before the migration starts, in
    /// milliseconds.
    #[arg(long, default_value_t = 500)]
    pub warmup: u64,
    /// How long the guest runs on the destination before the final count,
    /// in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub run_after: u64,
    #[command(flatten)]
    pub transfer: TransferArgs,
    /// Print one JSON document instead of the summary table.
    #[arg(long)]
    pub json: bool,
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::args::{Cli, Command};

    #[test]
    fn parses_vm_commands() {
        let cli = Cli::try_parse_from([
            "tern",
            "vm",
            "migrate",
            "--to",
            "127.0.0.1:7000",
            "--memory",
            "64M",
            "--working-set",
            "2M",
            "--channels",
            "3",
        ])
        .unwrap();
        let Command::Vm(super::VmCommand::Migrate(args)) = cli.command else {
            panic!("not vm migrate")
        };
        assert_eq!(args.vm.config().unwrap().working_set_pages, 512);
        assert_eq!(args.transfer.channels, 3);
        assert!(Cli::try_parse_from(["tern", "vm", "demo", "--json"]).is_ok());
        assert!(Cli::try_parse_from(["tern", "vm", "receive"]).is_err());
        let cli = Cli::try_parse_from([
            "tern",
            "vm",
            "migrate",
            "--to",
            "127.0.0.1:7000",
            "--paused",
        ])
        .unwrap();
        let Command::Vm(super::VmCommand::Migrate(args)) = cli.command else {
            panic!("not vm migrate")
        };
        assert!(args.paused);
        let cli =
            Cli::try_parse_from(["tern", "vm", "export-guest", "--multiboot", "guest.mb"]).unwrap();
        let Command::Vm(super::VmCommand::ExportGuest(args)) = cli.command else {
            panic!("not vm export-guest")
        };
        assert_eq!(args.working_set, 4 << 20);
    }
}

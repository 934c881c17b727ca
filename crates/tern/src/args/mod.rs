//! The command line's syntax: every clap type, one module per command
//! family, and the value parsers they share. Nothing here does I/O or
//! imports a command; the commands (`crate::command`) read these.

pub(crate) mod agent;
pub(crate) mod bench;
pub(crate) mod ctl;
pub(crate) mod progress;
pub(crate) mod security;
pub(crate) mod snapshot;
pub(crate) mod steering;
pub(crate) mod transfer;
pub(crate) mod values;
pub(crate) mod vm;

use std::time::Duration;

use clap::{Args, ColorChoice, Parser, Subcommand};
use tern_engine::Address;
use tern_page::codec::QplPath;
use tern_synthetic::{ContentMix, SyntheticConfig};

pub(crate) use transfer::TransferArgs;
use values::{parse_address, qpl_path_values};

use crate::units::{parse_rate, parse_size};

/// Live migration of virtual-machine memory over parallel channels.
#[derive(Debug, Parser)]
#[command(name = "tern", version)]
pub(crate) struct Cli {
    /// Log what happens (or set RUST_LOG), and print the statistics table
    /// after a failed migration too.
    #[arg(short, long, global = true)]
    pub verbose: bool,
    #[command(flatten)]
    pub progress: progress::ProgressArgs,
    /// Colour in log lines: auto (only on a terminal, and not when NO_COLOR
    /// is set), always or never.
    #[arg(long, global = true, value_enum, default_value_t = ColorChoice::Auto)]
    pub color: ColorChoice,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// Whether log lines on stderr carry colour.
    pub(crate) fn log_colour(&self) -> bool {
        use std::io::IsTerminal;
        match self.color {
            ColorChoice::Always => true,
            ColorChoice::Never => false,
            ColorChoice::Auto => {
                std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty())
                    && std::io::stderr().is_terminal()
            }
        }
    }
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Migrate a built-in synthetic guest to a destination on this machine,
    /// both ends in one process, with progress and a summary.
    Demo(DemoArgs),
    /// Migrate a synthetic guest to a `tern receive` destination.
    Migrate(Box<MigrateArgs>),
    /// Receive one migration and verify it.
    Receive(ReceiveArgs),
    /// Save a synthetic guest to a snapshot file (paused or live).
    Save(snapshot::SaveArgs),
    /// Restore a synthetic guest from a snapshot file, eagerly or lazily.
    Restore(snapshot::RestoreArgs),
    /// Merge a diff snapshot and its bases into one full snapshot.
    MergeSnapshot(snapshot::MergeSnapshotArgs),
    /// Serve a snapshot's pages to a VMM over Firecracker's userfaultfd
    /// page-fault handler protocol.
    ServePages(snapshot::ServePagesArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// A real KVM guest: run, migrate, receive, demo.
    #[command(subcommand)]
    Vm(vm::VmCommand),
    /// Print a shell completion script: `tern completions bash >
    /// /etc/bash_completion.d/tern`.
    Completions(CompletionsArgs),
    /// Send one command to the control socket of a running migrate, receive
    /// or vm command, or print its events (docs/control.md).
    Ctl(ctl::CtlArgs),
    /// Report what this machine offers tern (KVM, DSA, IAA, QPL, kernel TLS,
    /// io_uring, memlock limit, huge pages, NUMA) and how to fix what is
    /// missing.
    Doctor(DoctorArgs),
    /// The host coordinator: slots and a shared bandwidth budget for every
    /// migration on this host that joins with --agent (docs/fleet.md).
    Agent(agent::AgentArgs),
}

#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    #[command(flatten)]
    pub guest: GuestArgs,
    #[command(flatten)]
    pub transfer: TransferArgs,
    /// Use a Unix socket instead of TCP on 127.0.0.1.
    #[arg(long)]
    pub unix: bool,
    /// Run TLS 1.3 on every channel, with certificates from a CA made for
    /// this run only.
    #[arg(long)]
    pub tls: bool,
    /// Print one JSON document instead of the summary table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct MigrateArgs {
    /// Destination: HOST:PORT, tcp:HOST:PORT, tcp::PORT (this machine),
    /// unix:PATH, vsock:CID:PORT or fd:N,M,... (inherited connected
    /// sockets, one per channel, main first).
    #[arg(long, value_parser = parse_address)]
    pub to: Address,
    #[command(flatten)]
    pub security: security::SourceSecurityArgs,
    #[command(flatten)]
    pub guest: GuestArgs,
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
    pub steering: steering::SteeringArgs,
    /// A file whose bytes go to the destination before any memory, as the
    /// VMM's configuration (opaque to tern, at most 1 MiB): `tern receive
    /// --save-vmm-config` writes them out.
    #[arg(long, value_name = "FILE")]
    pub vmm_config: Option<std::path::PathBuf>,
    /// Same-host migration: hand guest memory over as file descriptors
    /// over the unix: socket instead of copying it (the synthetic guest is
    /// then memfd-backed); the destination runs `tern receive --local`.
    #[arg(long)]
    pub local: bool,
}

/// Where and how a destination waits (`tern receive`, `tern vm receive`).
#[derive(Debug, Args)]
pub(crate) struct ListenArgs {
    /// Where to listen: HOST:PORT, tcp:HOST:PORT, tcp::PORT (every
    /// interface), unix:PATH, vsock:CID:PORT or fd:N (an inherited
    /// listening socket, or connected ones).
    #[arg(long, value_parser = parse_address)]
    pub listen: Address,
    #[command(flatten)]
    pub security: security::DestinationSecurityArgs,
    /// How long to wait for the source, in seconds.
    #[arg(long, default_value_t = 300)]
    pub accept_timeout: u64,
    /// Longest silence tolerated from the source once it is connected, in
    /// seconds.
    #[arg(long, default_value_t = 30)]
    pub io_timeout: u64,
    /// How long each new connection has to send its whole first message, in
    /// seconds; a connection that does not is closed, and the wait goes on.
    #[arg(long, default_value_t = 5)]
    pub handshake_timeout: u64,
    /// The largest guest accepted (e.g. 16G); a bigger one is refused at the
    /// handshake, before anything is allocated. Default: the memory this
    /// machine has available now (MemAvailable + SwapFree).
    #[arg(long, value_parser = crate::units::parse_size)]
    pub max_memory: Option<u64>,
    /// Serve migrations one after another instead of exiting after the
    /// first; a failed one is reported and the next awaited. Stop with
    /// SIGINT or SIGTERM.
    #[arg(long)]
    pub keep_listening: bool,
    /// Where deflate pages are inflated: IAA through QPL when present
    /// (auto), IAA or fail (hardware), or libdeflate (software). The wire
    /// format is the same either way.
    #[arg(long, default_value = "auto", value_parser = qpl_path_values())]
    pub qpl_path: QplPath,
    /// Threads that decompress pages for every channel (default: one per
    /// core); 0 leaves each channel's receiver to decompress its own
    /// packets. QEMU: no parameter.
    #[arg(long, value_parser = clap::value_parser!(u16).range(0..=256))]
    pub decode_threads: Option<u16>,
    /// How long, after saying it is ready, to wait for the source's commit,
    /// in seconds; without it the guest is not resumed here.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub switch_over_timeout: u64,
    #[command(flatten)]
    pub steering: steering::SteeringArgs,
    /// Keep the guest paused after a verified switch-over and hand it over:
    /// `cont` on the control socket resumes it (needs --control-socket).
    #[arg(long, requires = "control_socket")]
    pub keep_paused: bool,
    /// With --keep-paused: how long to wait for `cont`, in seconds; then
    /// the guest is resumed anyway, never left paused.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub paused_timeout: u64,
    /// The largest VMM configuration accepted from the source (at most
    /// 1MiB); a larger one is refused before it is read.
    #[arg(long, default_value = "64KiB", value_parser = crate::units::parse_size)]
    pub max_vmm_config: u64,
    /// Same-host migration: take guest memory over from the source's file
    /// descriptors (its `--local`) instead of receiving a copy; needs a
    /// unix: address.
    #[arg(long)]
    pub local: bool,
    /// After postcopy's point of no return, how long to accept the
    /// source's reconnection once the connection broke, in seconds; then
    /// the migration stays postcopy-paused until `tern ctl ...
    /// migrate-recover` (QEMU's migrate-recover). Never a failure.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub postcopy_recover_timeout: u64,
}

impl ListenArgs {
    /// The destination's settings these options ask for, before the
    /// listener and its security (`crate::session::bind`).
    pub(crate) fn receive_settings(&self) -> tern_engine::ReceiveConfig {
        let mut config = tern_engine::ReceiveConfig::default();
        config.accept_timeout = Duration::from_secs(self.accept_timeout);
        config.io_timeout = Duration::from_secs(self.io_timeout);
        config.handshake_timeout = Duration::from_secs(self.handshake_timeout);
        config.max_memory = self.max_memory;
        config.qpl_path = self.qpl_path;
        config.switch_over_timeout = Duration::from_secs(self.switch_over_timeout);
        config.decode_threads = self.decode_threads.map(usize::from);
        config.keep_paused = self.keep_paused;
        config.max_vmm_config = usize::try_from(self.max_vmm_config).unwrap_or(usize::MAX);
        config.postcopy_recover_timeout = Duration::from_secs(self.postcopy_recover_timeout);
        config
    }
}

#[derive(Debug, Args)]
pub(crate) struct ReceiveArgs {
    #[command(flatten)]
    pub listen: ListenArgs,
    /// How long to let the resumed guest run before exiting, in
    /// milliseconds (shows it carries on dirtying memory here).
    #[arg(long, default_value_t = 200)]
    pub run_after: u64,
    /// Write the VMM configuration the source sent (`tern migrate
    /// --vmm-config`) to this file.
    #[arg(long, value_name = "FILE")]
    pub save_vmm_config: Option<std::path::PathBuf>,
    /// Print one JSON document instead of the summary table.
    #[arg(long)]
    pub json: bool,
}

/// The synthetic guest's working set unless `--working-set` says otherwise.
const DEFAULT_WORKING_SET: u64 = 256 << 20;

/// The synthetic guest's options.
#[derive(Debug, Args, Clone)]
pub(crate) struct GuestArgs {
    /// Guest memory size (binary units: 512M, 4GiB).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub memory: u64,
    /// Content mix: percent of zero, random and text-like pages.
    #[arg(long, default_value = "50:25:25")]
    pub mix: ContentMix,
    /// Bytes of pages the guest dirties per second (0: none).
    #[arg(long, default_value = "64MiB", value_parser = parse_rate)]
    pub dirty_rate: u64,
    /// The part of memory the guest dirties, from its start, at most
    /// --memory [default: 256MiB, or --memory if smaller].
    #[arg(long, value_parser = parse_size)]
    pub working_set: Option<u64>,
    /// Dirtier threads.
    #[arg(long, default_value_t = 1)]
    pub dirtier_threads: u32,
    /// Memory regions the guest is split into.
    #[arg(long, default_value_t = 1)]
    pub regions: u32,
    /// Seed of the content and of the dirtier.
    #[arg(long, default_value_t = 0x7e57)]
    pub seed: u64,
    /// Write every zero page once (without changing it) after the fill, so
    /// each has its own memory: DSA then finds real page-table entries
    /// instead of faulting, and the CPU reads real memory instead of one
    /// cached shared zero page (docs/hardware.md).
    #[arg(long)]
    pub touch_zero_pages: bool,
}

impl GuestArgs {
    /// Rejects combinations the guest would otherwise quietly reinterpret.
    pub(crate) fn check(&self) -> anyhow::Result<()> {
        use crate::units::human_bytes;
        if let Some(working_set) = self.working_set {
            anyhow::ensure!(
                working_set <= self.memory,
                "--working-set {} is larger than --memory {}",
                human_bytes(working_set),
                human_bytes(self.memory)
            );
        }
        Ok(())
    }

    /// The working set in force.
    pub(crate) fn working_set(&self) -> u64 {
        self.working_set
            .unwrap_or(DEFAULT_WORKING_SET)
            .min(self.memory)
    }

    /// Bytes of memory one end will have touched: the pages with data, and
    /// the zero pages the dirtier writes to (untouched zero pages cost
    /// nothing).
    pub(crate) fn resident_estimate(&self) -> u64 {
        let share = |bytes: u64, percent: u8| {
            u64::try_from(u128::from(bytes) * u128::from(percent) / 100).unwrap_or(u64::MAX)
        };
        if self.touch_zero_pages {
            return self.memory;
        }
        share(self.memory, 100 - self.mix.zero)
            .saturating_add(share(self.working_set(), self.mix.zero))
    }

    pub(crate) fn synthetic_config(&self) -> SyntheticConfig {
        SyntheticConfig {
            memory_bytes: self.memory,
            regions: self.regions,
            mix: self.mix,
            seed: self.seed,
            dirty_rate_bytes_per_sec: self.dirty_rate,
            working_set_bytes: self.working_set(),
            dirtier_threads: self.dirtier_threads,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tern_engine::{MigrationConfig, ZeroPageDetection};

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_a_migrate_command() {
        let cli = Cli::try_parse_from([
            "tern",
            "migrate",
            "--to",
            "127.0.0.1:7000",
            "--memory",
            "64M",
            "--mix",
            "10:80:10",
            "--channels",
            "4",
            "--max-bandwidth",
            "1Gbit",
        ])
        .unwrap();
        let Command::Migrate(args) = cli.command else {
            panic!("not migrate")
        };
        assert_eq!(args.guest.memory, 64 << 20);
        assert_eq!(args.transfer.channels, 4);
        assert_eq!(args.transfer.max_bandwidth, Some(125_000_000));
        assert!(Cli::try_parse_from(["tern", "migrate", "--to", "nowhere"]).is_err());
        assert!(Cli::try_parse_from(["tern", "demo", "--zero-page-detection", "magic"]).is_err());
    }

    fn demo(options: &[&str]) -> Result<DemoArgs, clap::Error> {
        let cli = Cli::try_parse_from(["tern", "demo"].iter().chain(options))?;
        let Command::Demo(args) = cli.command else {
            panic!("not demo")
        };
        Ok(args)
    }

    #[test]
    fn converting_the_options_opens_no_device() {
        // Hardware DSA for both offloads: on a machine without DSA, opening
        // it would fail; the conversion must not try (the session opens it).
        let args = demo(&[
            "--zero-page-detection",
            "dsa",
            "--dsa-device",
            "dsa9/wq9.9",
            "--delta-offload",
            "hw",
        ])
        .unwrap();
        let config = args.transfer.migration_settings().unwrap();
        assert_eq!(config.zero_page_detection, ZeroPageDetection::Dsa);
        assert!(config.zero_page_offload.is_none());
        assert!(config.delta_offload.is_none());
        assert!(args.transfer.zero_pages_on_hardware_dsa());
    }

    #[test]
    fn dedup_auto_follows_verification() {
        let dedup = |options: &[&str]| {
            demo(options)
                .unwrap()
                .transfer
                .migration_settings()
                .unwrap()
                .dedup
        };
        assert!(dedup(&[]));
        assert!(!dedup(&["--verify", "none"]));
        assert!(dedup(&["--verify", "none", "--dedup", "on"]));
        assert!(!dedup(&["--dedup", "off"]));
        assert!(demo(&["--dedup", "sometimes"]).is_err());
    }

    #[test]
    fn accepts_qemu_spellings() {
        let cli = Cli::try_parse_from(["tern", "migrate", "--to", "tcp::4444"]).unwrap();
        let Command::Migrate(args) = cli.command else {
            panic!("not migrate")
        };
        assert_eq!(args.to, Address::Tcp(":4444".into()));
        let args = demo(&[
            "--zero-page-detection",
            "legacy",
            "--max-bandwidth",
            "1Gbps",
            "--auto-converge",
            "off",
            "--cpu-throttle-initial",
            "35",
            "--cpu-throttle-increment",
            "5",
        ])
        .unwrap();
        let config = args.transfer.migration_settings().unwrap();
        assert_eq!(config.zero_page_detection, ZeroPageDetection::Source);
        assert_eq!(config.max_bandwidth, Some(125_000_000));
        assert!(!config.auto_converge);
        assert_eq!(
            (config.throttle_initial, config.throttle_increment),
            (35, 5)
        );
        let config = demo(&["--zero-page-detection", "multifd"])
            .unwrap()
            .transfer
            .migration_settings()
            .unwrap();
        assert_eq!(config.zero_page_detection, ZeroPageDetection::Workers);
        assert!(config.auto_converge);
        let hidden_alias = demo(&["--no-auto-converge"]).unwrap();
        assert!(
            !hidden_alias
                .transfer
                .migration_settings()
                .unwrap()
                .auto_converge
        );
        assert!(demo(&["--cpu-throttle-initial", "100"]).is_err());
        assert!(demo(&["--auto-converge", "maybe"]).is_err());
    }

    #[test]
    fn zlib_points_to_deflate() {
        let error = demo(&["--compression", "zlib"]).unwrap_err().to_string();
        assert!(error.contains("use deflate"), "{error}");
    }

    #[test]
    fn one_channel_range_everywhere() {
        for count in ["0", "65", "100000", "-1"] {
            let error = demo(&[&format!("--channels={count}")])
                .unwrap_err()
                .to_string();
            assert!(error.contains("out of range (1..=64)"), "{error}");
        }
        assert_eq!(demo(&["--channels", "64"]).unwrap().transfer.channels, 64);
        let engine = {
            let mut config = MigrationConfig::default();
            config.channels = 65;
            config
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(engine.contains("out of range (1..=64)"), "{engine}");
        let bench = Cli::try_parse_from(["tern", "bench", "migrate", "--channels", "1,0"]);
        assert!(
            bench
                .unwrap_err()
                .to_string()
                .contains("out of range (1..=64)")
        );
    }

    #[test]
    fn dsa_device_takes_hw_software_or_a_list() {
        use tern_dsa::DsaDevice;
        assert_eq!(demo(&[]).unwrap().transfer.dsa_device, DsaDevice::Hardware);
        let args = demo(&["--dsa-device", "software"]).unwrap();
        assert_eq!(args.transfer.dsa_device, DsaDevice::Software);
        let args = demo(&["--dsa-device", "dsa0,dsa2/wq2.1"]).unwrap();
        assert_eq!(args.transfer.dsa_device.to_string(), "dsa0,dsa2/wq2.1");
        let error = demo(&["--dsa-device", "gpu0"]).unwrap_err().to_string();
        assert!(
            error.contains("gpu0") && error.contains("dsa2/wq2.1"),
            "{error}"
        );
    }

    #[test]
    fn every_choice_option_lists_its_values() {
        use clap::CommandFactory;
        let mut command = Cli::command();
        command.build();
        let demo = command.find_subcommand("demo").unwrap();
        for name in [
            "on_limit",
            "zero_page_detection",
            "dsa_device",
            "compression",
            "verify",
            "zero_copy_backend",
            "auto_converge",
            "color",
        ] {
            let arg = demo
                .get_arguments()
                .find(|arg| arg.get_id() == name)
                .unwrap_or_else(|| panic!("no option {name}"));
            assert!(
                arg.get_possible_values().len() >= 2,
                "--{name} lists no values"
            );
        }
    }

    #[test]
    fn top_level_help_lists_every_command() {
        use clap::CommandFactory;
        let mut command = Cli::command();
        let help = command.render_help().to_string();
        for subcommand in command.get_subcommands() {
            assert!(
                help.contains(&format!("  {}", subcommand.get_name())),
                "{} is missing from:\n{help}",
                subcommand.get_name()
            );
        }
        assert!(help.contains("  vm "), "{help}");
    }

    #[test]
    fn working_set_must_fit_in_memory() {
        let error = demo(&["--memory", "64MiB", "--working-set", "4GiB"])
            .unwrap()
            .guest
            .check()
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            "--working-set 4.00 GiB is larger than --memory 64.00 MiB"
        );
        let small = demo(&["--memory", "32MiB"]).unwrap().guest;
        small.check().unwrap();
        assert_eq!(small.working_set(), 32 << 20);
        assert_eq!(demo(&[]).unwrap().guest.working_set(), 256 << 20);
    }

    #[test]
    fn resident_estimate_skips_untouched_zero_pages() {
        let guest = demo(&[
            "--memory",
            "1GiB",
            "--mix",
            "50:25:25",
            "--working-set",
            "0",
        ])
        .unwrap()
        .guest;
        assert_eq!(guest.resident_estimate(), 512 << 20);
        let guest = demo(&["--memory", "1GiB", "--mix", "0:100:0"])
            .unwrap()
            .guest;
        assert_eq!(guest.resident_estimate(), 1 << 30);
    }

    #[test]
    fn out_of_range_levels_are_named() {
        let note = |options: &[&str]| demo(options).unwrap().transfer.compression_level_note();
        let zstd = note(&["--compression", "zstd", "--compression-level", "99"]).unwrap();
        assert!(zstd.ends_with("so 22"), "{zstd}");
        let deflate = note(&["--compression", "deflate", "--compression-level", "0"]).unwrap();
        assert!(deflate.ends_with("so 1"), "{deflate}");
        let qpl = note(&["--compression", "qpl", "--compression-level", "9"]).unwrap();
        assert!(qpl.ends_with("so 3"), "{qpl}");
        assert!(
            note(&["--compression", "none", "--compression-level", "3"])
                .unwrap()
                .contains("no effect")
        );
        // The default is auto, which clamps per codec.
        assert_eq!(note(&["--compression-level", "3"]), None);
        assert_eq!(
            note(&["--compression", "zstd", "--compression-level", "-5"]),
            None
        );
        assert_eq!(note(&["--compression", "zstd"]), None);
    }

    #[test]
    fn colour_follows_the_option() {
        let cli = Cli::try_parse_from(["tern", "--color", "never", "bench", "codec"]).unwrap();
        assert!(!cli.log_colour());
        let cli = Cli::try_parse_from(["tern", "bench", "codec", "--color", "always"]).unwrap();
        assert!(cli.log_colour());
    }
}

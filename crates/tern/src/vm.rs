//! `tern vm`: run, migrate and receive a real KVM guest (the reference VMM
//! of `tern-vmm` with its test guest), and a localhost demo proving the
//! guest's memory and execution on the destination.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand};
use serde::Serialize;
use tern_engine::{
    Address, Destination, GuestControl, GuestError, Listener, MigrationStats, ReceiveConfig,
    Received, Source,
};
use tern_vmm::{ConsistencyReport, DestinationVm, KvmGuest, VmConfig};

use tern_vmm::guest_code::Workload;

use crate::cli::{TransferArgs, workload_values};
use crate::report::{Progress, print_json, print_summary};
use crate::units::{human_bytes, parse_size};

/// KVM guest commands.
#[derive(Debug, Subcommand)]
pub enum VmCommand {
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
    Save(crate::save::VmSaveArgs),
    /// Restore the test guest from a snapshot file and let it run.
    Restore(crate::restore::RestoreArgs),
}

#[derive(Debug, Args)]
pub struct ExportGuestArgs {
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
pub struct VmArgs {
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
    fn config(&self) -> anyhow::Result<VmConfig> {
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
        })
    }

    /// Starts the guest; `ends` is how many copies of its memory this
    /// process will hold (2 when the destination runs here too).
    pub(crate) fn start(&self, ends: u64) -> anyhow::Result<KvmGuest> {
        let config = self.config()?;
        let what = if ends > 1 {
            format!(
                "--memory {} with both ends in this process",
                human_bytes(self.memory)
            )
        } else {
            format!("--memory {}", human_bytes(self.memory))
        };
        crate::run::check_memory_fits(ends * self.memory, &what)?;
        KvmGuest::new(&config).context("cannot start the KVM guest")
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
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
pub struct MigrateArgs {
    /// Destination: HOST:PORT, tcp:HOST:PORT, tcp::PORT (this machine) or
    /// unix:PATH.
    #[arg(long, value_parser = crate::cli::parse_address)]
    pub to: Address,
    #[command(flatten)]
    pub security: crate::secure::SourceSecurityArgs,
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
    pub steering: crate::steering::SteeringArgs,
}

#[derive(Debug, Args)]
pub struct ReceiveArgs {
    #[command(flatten)]
    pub listen: crate::cli::ListenArgs,
    /// How long to let the guest run on here before reporting and exiting,
    /// in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub run_after: u64,
    /// Print one JSON document instead of a summary.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
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

pub fn run(command: VmCommand, verbose: bool) -> anyhow::Result<ExitCode> {
    match command {
        VmCommand::Run(args) => run_guest(&args),
        VmCommand::Migrate(args) => migrate(&args, verbose),
        VmCommand::Receive(args) => receive(&args),
        VmCommand::Demo(args) => demo(&args, verbose),
        VmCommand::ExportGuest(args) => export_guest(&args),
        VmCommand::Save(args) => crate::save::vm_save(&args),
        VmCommand::Restore(args) => crate::restore::vm_restore(&args),
    }
}

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

/// The consistency check, as JSON.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct ConsistencyJson {
    passed: bool,
    pages: u32,
    edges: u32,
    first_byte: u8,
    last_byte: u8,
    pass_count: u64,
    counter_matches: bool,
    /// Serial bytes received equal the pass counter: no `out` was lost or
    /// repeated across the migration.
    serial_matches: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    failure: Option<String>,
}

impl ConsistencyJson {
    fn new(report: ConsistencyReport, serial_bytes: u64) -> Self {
        let serial_matches = serial_bytes == report.pass_count;
        Self {
            passed: report.passed && serial_matches,
            pages: report.pages,
            edges: report.edges,
            first_byte: report.first_byte,
            last_byte: report.last_byte,
            pass_count: report.pass_count,
            counter_matches: report.counter_matches,
            serial_matches,
            failure: report.failure.or_else(|| {
                (!serial_matches).then(|| {
                    format!(
                        "{serial_bytes} serial bytes for {} passes",
                        report.pass_count
                    )
                })
            }),
        }
    }
}

/// The test guest's own speed, from its pass counter: passes per second,
/// and page writes per second (each pass writes every working-set page
/// once). Not the engine's dirty rate (`ram.dirty-pages-rate`), which counts
/// distinct pages found dirty per second between dirty-log syncs: a page
/// written many times between two syncs counts once there, and dirty
/// logging itself slows the guest.
#[derive(Clone, Copy, Serialize)]
#[serde(rename_all = "kebab-case")]
struct GuestRate {
    passes_per_second: f64,
    page_writes_per_second: f64,
}

/// The summary row of the guest's own rate, labelled apart from the
/// engine's "dirty rate (engine)".
fn guest_write_rate_row(rate: &GuestRate) -> (&'static str, String) {
    (
        "guest write rate",
        format!(
            "{:.0} pages/s (test guest's own counter, before the migration)",
            rate.page_writes_per_second
        ),
    )
}

fn measure(guest: &KvmGuest, during: Duration) -> GuestRate {
    let (start, passes) = (Instant::now(), guest.pass_count());
    std::thread::sleep(during);
    let passes_per_second =
        (guest.pass_count() - passes) as f64 / start.elapsed().as_secs_f64().max(1e-9);
    GuestRate {
        passes_per_second,
        page_writes_per_second: passes_per_second * f64::from(guest.working_set_pages()),
    }
}

/// Pauses a guest, checks it, and lets it run again.
fn check_paused(guest: &mut KvmGuest) -> anyhow::Result<ConsistencyJson> {
    guest.pause().context("cannot pause the guest")?;
    let report = guest
        .consistency_check()
        .map_err(|reason| anyhow::anyhow!("consistency check: {reason}"))?;
    let serial = guest.serial_transmitted();
    guest.resume().context("cannot resume the guest")?;
    Ok(ConsistencyJson::new(report, serial))
}

/// What the destination shows after the switch-over: a consistent working
/// set, and a pass counter that advances.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct DestinationProof {
    consistency_check: ConsistencyJson,
    pass_count_before: u64,
    pass_count_after: u64,
    guest_runs_on_destination: bool,
    serial_bytes: u64,
}

fn prove_on_destination(
    guest: &mut KvmGuest,
    run_after: Duration,
) -> anyhow::Result<DestinationProof> {
    let consistency_check = check_paused(guest)?;
    let pass_count_before = consistency_check.pass_count;
    guest.wait_for_pass_count_above(pass_count_before, run_after);
    std::thread::sleep(run_after.saturating_sub(Duration::from_millis(1)));
    let pass_count_after = guest.pass_count();
    Ok(DestinationProof {
        consistency_check,
        pass_count_before,
        pass_count_after,
        guest_runs_on_destination: pass_count_after > pass_count_before && guest.is_running(),
        serial_bytes: guest.serial_transmitted(),
    })
}

impl DestinationProof {
    fn passed(&self) -> bool {
        self.consistency_check.passed && self.guest_runs_on_destination
    }

    fn rows(&self) -> Vec<(&'static str, String)> {
        let check = &self.consistency_check;
        vec![
            (
                "consistency check",
                if check.passed {
                    format!(
                        "passed ({} pages, {} edge, serial = counter)",
                        check.pages, check.edges
                    )
                } else {
                    format!("FAILED: {}", check.failure.as_deref().unwrap_or("unknown"))
                },
            ),
            ("pass count before", self.pass_count_before.to_string()),
            ("pass count after", self.pass_count_after.to_string()),
            (
                "guest runs on destination",
                self.guest_runs_on_destination.to_string(),
            ),
        ]
    }
}

/// Builds the destination VM now, before the source connects (VM creation
/// can take a long time on a loaded host, docs/vmm.md), and returns the
/// `make_guest` step that checks the announced size and only adds the
/// memory the source announces.
fn prepare_destination()
-> anyhow::Result<impl FnOnce(&tern_wire::SessionSetup) -> Result<KvmGuest, GuestError>> {
    let vm = DestinationVm::new().context("cannot create the destination VM")?;
    Ok(move |setup: &tern_wire::SessionSetup| {
        crate::run::check_memory_fits(
            setup.total_bytes(),
            &format!("a {} guest", human_bytes(setup.total_bytes())),
        )
        .map_err(|error| GuestError::new(error.to_string()))?;
        let lens: Vec<u64> = setup.regions.iter().map(|region| region.len).collect();
        vm.with_memory(&lens)
            .map_err(|error| GuestError::with_source("cannot create the destination VM", error))
    })
}

fn run_guest(args: &RunArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.seconds.is_finite() && args.seconds > 0.0,
        "--seconds must be a positive number"
    );
    let mut guest = args.vm.start(1)?;
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
    let total = Duration::from_secs_f64(args.seconds);
    let mut rates = Vec::new();
    while started.elapsed() < total {
        let slice = (total - started.elapsed()).min(Duration::from_secs(1));
        let rate = measure(&guest, slice);
        if !args.json {
            println!(
                "{:>6.1} s  passes {:>9}  {:>9.0} passes/s  {:>10.0} page writes/s ({}/s)  serial {} bytes",
                started.elapsed().as_secs_f64(),
                guest.pass_count(),
                rate.passes_per_second,
                rate.page_writes_per_second,
                human_bytes(rate.page_writes_per_second as u64 * tern_engine::PAGE_SIZE as u64),
                guest.serial_transmitted()
            );
        }
        rates.push(rate);
    }
    let check = {
        guest.pause().context("cannot pause the guest")?;
        let report = guest
            .consistency_check()
            .map_err(|reason| anyhow::anyhow!("consistency check: {reason}"))?;
        ConsistencyJson::new(report, guest.serial_transmitted())
    };
    let elapsed = started.elapsed().as_secs_f64();
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

/// The source side's report.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct SourceReport {
    #[serde(flatten)]
    stats: MigrationStats,
    guest_before_migration: GuestRate,
    /// The pass count where the source stopped (it runs on the destination
    /// from there), or where it ran on after a failure.
    source_pass_count: u64,
    /// After a failed migration: whether the source guest still runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    source_guest_runs: Option<bool>,
}

/// What became of the source guest after a failed migration, for the one
/// error line.
fn source_guest_after_failure(runs: bool, paused: bool) -> &'static str {
    match (runs, paused) {
        (true, _) => "the migration did not complete; the source guest runs on",
        (false, true) => "the migration did not complete; the source guest stays paused",
        (false, false) => "the migration did not complete; the source guest does not run",
    }
}

fn migrate(args: &MigrateArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let mut config = args.transfer.migration_config()?;
    config.security = args.security.security()?;
    crate::run::check_config(&config, &args.to)?;
    let source = Source::new(config)?;
    let steering = crate::steering::Steering::start(&args.steering)?;
    steering.steer(&crate::control_socket::Target::Source(source.handle()));
    let mut guest = args.vm.start(1)?;
    let rate = measure(&guest, Duration::from_millis(args.warmup));
    if args.paused {
        guest.pause().context("cannot pause the guest")?;
    }
    eprintln!(
        "tern vm migrate: guest write rate (test guest's own counter) {:.0} pages/s; migrating to {}...",
        rate.page_writes_per_second, args.to
    );
    let cancel = source.cancel_token();
    crate::run::install_interrupt_handler(move || cancel.cancel());
    // --agent: waits here for a slot (docs/fleet.md).
    steering.join_agent(
        &crate::control_socket::Target::Source(source.handle()),
        &source.cancel_token(),
    )?;
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
                    crate::run::source_guest_after(&error)
                }
                _ => source_guest_after_failure(runs == Some(true), args.paused),
            };
            Err(crate::run::Incomplete::source_error(
                error,
                what,
                &report.stats,
            ))
        }
    }
}

fn receive(args: &ReceiveArgs) -> anyhow::Result<ExitCode> {
    let steering = crate::steering::Steering::start(&args.listen.steering)?;
    crate::run::serve_sessions(&args.listen, |destination, listener| {
        steering.steer(&crate::control_socket::Target::Destination(
            destination.handle(),
        ));
        steering.join_agent(
            &crate::control_socket::Target::Destination(destination.handle()),
            &destination.cancel_token(),
        )?;
        receive_one(args, destination, listener, &steering)
    })
}

/// `tern vm receive --json`'s document: the destination's report and what
/// the guest did on here.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct ReceiveJson<'a> {
    #[serde(flatten)]
    report: tern_engine::ReceiveReport,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    proof: Option<&'a DestinationProof>,
}

fn receive_one(
    args: &ReceiveArgs,
    destination: &Destination,
    listener: &tern_engine::Listener,
    steering: &crate::steering::Steering,
) -> anyhow::Result<ExitCode> {
    let make_destination = prepare_destination()?;
    let progress = Progress::receiving(destination.stats());
    let received = destination.receive(listener, make_destination);
    progress.finish();
    let Received {
        mut guest,
        stats,
        security,
        resumed,
        ..
    } = match received {
        Ok(received) => received,
        Err(error) => {
            if args.json {
                print_json(&ReceiveJson {
                    report: destination.handle().query(),
                    proof: None,
                })?;
            }
            return Err(crate::run::Incomplete::error(
                error,
                "the incoming migration did not complete",
            ));
        }
    };
    if !resumed {
        crate::steering::hand_over_paused(
            &mut guest,
            steering,
            &destination.handle(),
            Duration::from_secs(args.listen.paused_timeout),
        )?;
    }
    let proof = prove_on_destination(&mut guest, Duration::from_millis(args.run_after))?;
    let report = destination.handle().query();
    if args.json {
        print_json(&ReceiveJson {
            report,
            proof: Some(&proof),
        })?;
    } else {
        println!(
            "received {} ({} pages with data, {} zero)",
            human_bytes(report.memory),
            stats.normal_pages,
            stats.zero_pages
        );
        println!(
            "{:>26}  {}",
            "security",
            crate::report::security_line(&security)
        );
        for (name, value) in proof.rows() {
            println!("{name:>26}  {value}");
        }
    }
    Ok(if proof.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
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

fn demo(args: &DemoArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let config = args.transfer.migration_config()?;
    let source = Source::new(config.clone())?;
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into()))
        .context("cannot listen on 127.0.0.1")?;
    let address = listener.local_address()?;
    let mut guest = args.vm.start(2)?;
    let rate = measure(&guest, Duration::from_millis(args.warmup));
    if !args.json {
        eprintln!(
            "tern vm demo: a {} KVM guest writing {} pages per pass, guest write rate (test guest's own counter) {:.0} pages/s; migrating to {address}...",
            human_bytes(guest.memory_bytes()),
            guest.working_set_pages(),
            rate.page_writes_per_second
        );
    }
    let io_timeout = config.io_timeout;
    let make_destination = prepare_destination()?;
    let destination = std::thread::spawn(move || {
        Destination::new({
            let mut config = ReceiveConfig::default();
            config.io_timeout = io_timeout;
            // The demo's own source: its --verify choice stands.
            config.allow_unverified = true;
            config
        })
        .receive(&listener, make_destination)
        .context("the destination failed")
    });
    let cancel = source.cancel_token();
    crate::run::install_interrupt_handler(move || cancel.cancel());
    let progress = Progress::start(source.stats());
    let result = source.migrate(&mut guest, &address);
    progress.finish();
    let received = destination
        .join()
        .map_err(|_| anyhow::anyhow!("the destination thread panicked"))?;
    match (result, received) {
        (Ok(stats), Ok(mut received)) => {
            let proof =
                prove_on_destination(&mut received.guest, Duration::from_millis(args.run_after))?;
            let passed = proof.passed() && stats.digest_verified;
            let report = DemoReport {
                stats,
                proof,
                guest_before_migration: rate,
                memory: guest.memory_bytes(),
                working_set_pages: guest.working_set_pages(),
                dirty_log: guest.dirty_log_mode().as_str(),
                channels: config.channels,
            };
            if args.json {
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
        (Err(failure), destination) => {
            // The source's error names the cause; the destination's is
            // mostly the same failure seen from the other end.
            if let Err(error) = destination {
                tracing::debug!("destination: {error:#}");
            }
            let before = guest.pass_count();
            let runs = guest.wait_for_pass_count_above(before, Duration::from_secs(5));
            let report = SourceReport {
                stats: *failure.stats,
                guest_before_migration: rate,
                source_pass_count: guest.pass_count(),
                source_guest_runs: Some(runs),
            };
            if args.json {
                print_json(&report)?;
            } else if verbose {
                print_summary(&report.stats, &[]);
            }
            Err(crate::run::Incomplete::error(
                failure.error,
                source_guest_after_failure(runs, false),
            ))
        }
        (Ok(_), Err(error)) => Err(crate::run::Incomplete::error(
            error,
            "the source finished but the destination did not",
        )),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::cli::{Cli, Command};

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

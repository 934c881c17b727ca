//! What the commands share around one migration: the engine's settings
//! from the options (and the offload devices they name), memory checks, the
//! guests of the synthetic commands, a destination in a thread of this
//! process, a listener serving one migration after another, signals, and
//! how a command ends (`outcome`).

mod interrupt;
mod outcome;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tern_engine::{
    Address, CancelToken, Destination, DestinationGuest, GuestError, Listener, MigrationConfig,
    MigrationError, MigrationStats, ReceiveConfig, Received, ZeroPageDetection,
};
use tern_page::codec::QplPath;
use tern_synthetic::SyntheticGuest;
use tern_vmm::KvmGuest;
use tern_wire::SessionSetup;

pub(crate) use interrupt::{install_interrupt_handler, interrupted_by};
pub(crate) use outcome::{Incomplete, exit_code, signal_exit_code, source_guest_after};

use crate::args::transfer::DeltaOffloadChoice;
use crate::args::vm::VmArgs;
use crate::args::{GuestArgs, ListenArgs, TransferArgs};
use crate::report::{print_json, print_summary};
use crate::units::human_bytes;

/// The engine's settings `--...` ask for, with the offload devices they
/// name opened: the conversion itself is pure
/// ([`TransferArgs::migration_settings`]); only this opens devices.
pub(crate) fn migration_config(transfer: &TransferArgs) -> anyhow::Result<MigrationConfig> {
    let mut config = transfer.migration_settings()?;
    attach_offloads(transfer, &mut config)?;
    Ok(config)
}

/// Opens the zero-page and delta offloads `--zero-page-detection dsa`,
/// `--dsa-device` and `--delta-offload` ask for, into `config`. One engine
/// over the hardware queues serves both (a dedicated queue takes a single
/// opener).
fn attach_offloads(transfer: &TransferArgs, config: &mut MigrationConfig) -> anyhow::Result<()> {
    let hardware_delta = transfer.delta_offload == DeltaOffloadChoice::Hardware;
    let engine = if transfer.zero_pages_on_hardware_dsa() || hardware_delta {
        Some(
            tern_dsa::open_dsa_engine(&transfer.dsa_config())
                .with_context(|| format!("--dsa-device {}", transfer.dsa_device))?,
        )
    } else {
        None
    };
    config.zero_page_offload = match (transfer.zero_page_detection, &engine) {
        (ZeroPageDetection::Dsa, _) if transfer.dsa_device == tern_dsa::DsaDevice::Software => {
            Some(tern_dsa::software_dsa(
                tern_dsa::SoftwareDsaConfig::default(),
            ))
        }
        (ZeroPageDetection::Dsa, Some(engine)) => {
            Some(engine.clone() as Arc<dyn tern_page::ZeroPageOffload>)
        }
        _ => None,
    };
    config.delta_offload = match transfer.delta_offload {
        DeltaOffloadChoice::Cpu => None,
        DeltaOffloadChoice::Software => Some(tern_dsa::software_delta_offload(
            tern_dsa::SoftwareDsaConfig::default(),
        )),
        DeltaOffloadChoice::Hardware => Some(match &engine {
            Some(engine) => Arc::new(tern_dsa::DsaDeltaOffload::sharing(
                engine.clone(),
                tern_dsa::DELTA_DEADLINE,
            )),
            None => tern_dsa::open_delta_offload(&transfer.dsa_config())
                .context("--delta-offload hw")?,
        }),
    };
    Ok(())
}

/// Binds the listener `--listen` names and builds the destination's
/// settings, its security included.
pub(crate) fn bind(listen: &ListenArgs) -> anyhow::Result<(Listener, ReceiveConfig)> {
    // Refused before binding: a refusal must not have held the port.
    listen.security.check_before_bind(&listen.listen)?;
    anyhow::ensure!(
        !listen.local || matches!(listen.listen, Address::Unix(_) | Address::Fd(_)),
        "--local needs a unix: address: memory is handed over as file descriptors, which only \
         a Unix socket carries"
    );
    let listener = Listener::bind(&listen.listen)
        .with_context(|| format!("cannot listen on {}", listen.listen))?;
    let mut config = listen.receive_settings();
    if listen.qpl_path == QplPath::Hardware {
        // Asked for IAA: say now, not when a source connects, if it
        // cannot be had.
        tern_page::codec::PageDecompressor::for_destination(
            tern_page::codec::CodecId::Deflate,
            QplPath::Hardware,
        )
        .context("--qpl-path hardware")?;
    }
    listen.security.apply(&listener, &mut config)?;
    Ok((listener, config))
}

/// Starts the KVM test guest; `ends` is how many copies of its memory this
/// process will hold (2 when the destination runs here too).
pub(crate) fn start_kvm_guest(vm: &VmArgs, ends: u64) -> anyhow::Result<KvmGuest> {
    start_kvm_guest_with(vm.config()?, vm, ends)
}

/// [`start_kvm_guest`] with its RAM in a memfd, for `--local`.
pub(crate) fn start_memfd_kvm_guest(vm: &VmArgs) -> anyhow::Result<KvmGuest> {
    let mut config = vm.config()?;
    config.memfd = true;
    start_kvm_guest_with(config, vm, 1)
}

fn start_kvm_guest_with(
    config: tern_vmm::VmConfig,
    vm: &VmArgs,
    ends: u64,
) -> anyhow::Result<KvmGuest> {
    let what = if ends > 1 {
        format!(
            "--memory {} with both ends in this process",
            human_bytes(vm.memory)
        )
    } else {
        format!("--memory {}", human_bytes(vm.memory))
    };
    check_memory_fits(ends * vm.memory, &what)?;
    KvmGuest::new(&config).context("cannot start the KVM guest")
}

/// Refuses a guest that this machine cannot hold: better a clear error now
/// than the OOM killer minutes later. `need` is the memory the command
/// will touch; `what` says why, for the message.
pub(crate) fn check_memory_fits(need: u64, what: &str) -> anyhow::Result<()> {
    let Some(available) = memory_available() else {
        return Ok(());
    };
    anyhow::ensure!(
        need <= available,
        "{what} needs about {} of RAM, but this machine has {} available (MemAvailable in \
         /proc/meminfo)",
        human_bytes(need),
        human_bytes(available)
    );
    Ok(())
}

/// MemAvailable from /proc/meminfo, in bytes.
fn memory_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo
        .lines()
        .find(|line| line.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Builds a destination guest of the layout the source announces.
pub(crate) fn destination_guest(setup: &SessionSetup) -> Result<SyntheticGuest, GuestError> {
    check_memory_fits(
        setup.total_bytes(),
        &format!("a {} guest", human_bytes(setup.total_bytes())),
    )
    .map_err(|error| GuestError::new(error.to_string()))?;
    let lens: Vec<u64> = setup.regions.iter().map(|region| region.len).collect();
    SyntheticGuest::empty(&lens)
        .map_err(|error| GuestError::with_source("cannot create the destination guest", error))
}

/// A destination running in a thread of this process.
pub(crate) struct LocalDestination<G> {
    thread: std::thread::JoinHandle<anyhow::Result<Received<G>>>,
    cancel: CancelToken,
}

impl<G> LocalDestination<G> {
    /// Waits for the destination; when the source failed (`source_ok`
    /// false) it is cancelled first, so it does not wait for a source that
    /// will never come.
    pub(crate) fn finish(self, source_ok: bool) -> anyhow::Result<Received<G>> {
        if !source_ok {
            self.cancel.cancel();
        }
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the destination thread panicked"))?
    }
}

/// Runs a destination in a thread of this process; `make_guest` builds
/// its guest for the layout the source announces.
pub(crate) fn spawn_local_destination<G, F>(
    listener: Listener,
    config: ReceiveConfig,
    make_guest: F,
) -> LocalDestination<G>
where
    G: DestinationGuest + Send + 'static,
    F: FnOnce(&SessionSetup) -> Result<G, GuestError> + Send + 'static,
{
    let destination = Destination::new(config);
    let cancel = destination.cancel_token();
    let thread = std::thread::spawn(move || {
        destination
            .receive(&listener, make_guest)
            .context("the destination failed")
    });
    LocalDestination { thread, cancel }
}

/// Waits until the resumed guest has dirtied memory, or gives up.
pub(crate) fn guest_keeps_running(guest: &SyntheticGuest, within: Duration) -> bool {
    let before = guest.dirtied_pages();
    let deadline = std::time::Instant::now() + within;
    while std::time::Instant::now() < deadline {
        if guest.dirtied_pages() > before {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// The statistics of a failed migration: the JSON document with `--json`
/// (scripts read `status` and `error`), the table only with `-v`; the cause
/// itself is the one `tern: error:` line.
pub(crate) fn report_failure(
    stats: &MigrationStats,
    json: bool,
    verbose: bool,
) -> anyhow::Result<()> {
    if json {
        print_json(stats)?;
    } else if verbose {
        print_summary(stats, &[]);
    }
    Ok(())
}

/// Checks the options, and the options against the destination's
/// transport, before anything is built or connected; the engine names its
/// config fields, this names the command-line options for them.
pub(crate) fn check_config(config: &MigrationConfig, to: &Address) -> anyhow::Result<()> {
    config
        .validate()
        .and_then(|()| config.check_address(to))
        .map_err(|error| match error {
            MigrationError::InvalidConfig { field, reason } => {
                anyhow::anyhow!("{}: {reason}", option_for(field))
            }
            MigrationError::UnsupportedTransport {
                field,
                address,
                reason,
            } => anyhow::anyhow!(
                "{} cannot be used with {address}: {reason}",
                option_for(field)
            ),
            other => other.into(),
        })
}

/// The command-line option that sets a `MigrationConfig` field.
fn option_for(field: &str) -> String {
    match field {
        "throttle_initial" => "--cpu-throttle-initial".into(),
        "throttle_increment" => "--cpu-throttle-increment".into(),
        "zero_page_offload" => "--dsa-device".into(),
        "memory_handover" => "--local".into(),
        other => format!("--{}", other.replace('_', "-")),
    }
}

/// Creates the synthetic guest, showing the fill's progress; in a memfd
/// when its memory will be handed over (`--local`).
pub(crate) fn fill_guest(args: &GuestArgs, memfd: bool) -> anyhow::Result<SyntheticGuest> {
    let config = args.synthetic_config();
    let guest = crate::report::with_fill_progress(config.memory_bytes, |filled| {
        if memfd {
            SyntheticGuest::new_memfd_with_fill_progress(&config, filled)
        } else {
            SyntheticGuest::new_with_fill_progress(&config, filled)
        }
    })
    .context("cannot create the synthetic guest")?;
    if args.touch_zero_pages {
        guest.touch_zero_pages();
    }
    Ok(guest)
}

/// Serves incoming migrations on the listener `listen` binds: one, or with
/// `--keep-listening` one after another until SIGINT or SIGTERM, reporting
/// each failed one on stderr and waiting for the next. `session` receives one
/// migration with the destination it is given.
pub(crate) fn serve_sessions(
    listen: &ListenArgs,
    mut session: impl FnMut(&Destination, &Listener) -> anyhow::Result<ExitCode>,
) -> anyhow::Result<ExitCode> {
    let (listener, config) = bind(listen)?;
    let current = std::sync::Arc::new(std::sync::Mutex::new(None::<CancelToken>));
    let on_interrupt = current.clone();
    // The handler before the ready event: a script may signal it from then on.
    install_interrupt_handler(move || {
        if let Some(cancel) = on_interrupt
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            cancel.cancel();
        }
    });
    crate::report::print_listening(&listener.local_address()?)?;
    loop {
        let destination = Destination::new(config.clone());
        *current.lock().unwrap_or_else(|e| e.into_inner()) = Some(destination.cancel_token());
        if interrupted_by().is_some() {
            destination.cancel_token().cancel();
        }
        let result = session(&destination, &listener);
        if !listen.keep_listening || interrupted_by().is_some() {
            return result;
        }
        if let Err(error) = result {
            eprintln!("tern: {error:#}; waiting for the next migration");
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::args::{Cli, Command};

    fn transfer(options: &[&str]) -> crate::args::TransferArgs {
        let cli = Cli::try_parse_from(["tern", "demo"].iter().chain(options)).unwrap();
        let Command::Demo(args) = cli.command else {
            panic!("not demo")
        };
        args.transfer
    }

    #[test]
    fn the_software_device_is_attached_without_hardware() {
        let config = super::migration_config(&transfer(&[
            "--zero-page-detection",
            "dsa",
            "--dsa-device",
            "software",
            "--delta-offload",
            "software",
        ]))
        .unwrap();
        assert!(config.zero_page_offload.is_some());
        assert!(config.delta_offload.is_some());
        let config = super::migration_config(&transfer(&[])).unwrap();
        assert!(config.zero_page_offload.is_none());
        assert!(config.delta_offload.is_none());
    }
}

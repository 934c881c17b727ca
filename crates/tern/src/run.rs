//! The commands.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tern_engine::{
    Address, CancelToken, Destination, GuestError, Listener, MigrationError, MigrationStats,
    ReceiveConfig, Received, Source,
};
use tern_synthetic::SyntheticGuest;

use crate::cli::{Command, DemoArgs, MigrateArgs, ReceiveArgs};
use crate::report::{Progress, print_json, print_summary, security_line};

pub fn dispatch(command: Command, verbose: bool) -> anyhow::Result<ExitCode> {
    match command {
        Command::Demo(args) => demo(&args, verbose),
        Command::Migrate(args) => migrate(&args, verbose),
        Command::Receive(args) => receive(&args),
        Command::Save(args) => crate::save::save(&args),
        Command::Restore(args) => crate::restore::restore(&args),
        Command::ServePages(args) => crate::serve_pages::serve(&args),
        Command::Bench(command) => crate::bench::run(command),
        Command::Vm(command) => crate::vm::run(command, verbose),
        Command::Ctl(args) => crate::ctl::run(&args),
        Command::Agent(args) => crate::agent::run(&args),
        Command::Doctor(args) => {
            crate::doctor::print(&crate::doctor::examine(), args.json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Completions(args) => {
            use clap::CommandFactory;
            clap_complete::generate(
                args.shell,
                &mut crate::cli::Cli::command(),
                "tern",
                &mut std::io::stdout(),
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A migration that started and did not complete, with what became of the
/// guest. `tern` exits with [`exit::FAILED`] for it, [`exit::NOTHING_SENT`]
/// when it never got past the handshake, [`exit::OUTCOME_UNKNOWN`] when the
/// switch-over's outcome is unknown, [`exit::CANCELLED`] when a control
/// command cancelled it, or 128 + the signal that cancelled it; any other
/// error is a usage or setup error ([`exit::USAGE`]).
#[derive(Debug)]
pub struct Incomplete(pub String);

impl std::fmt::Display for Incomplete {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Incomplete {
    /// A failed or cancelled migration whose cause is `error`.
    pub fn error(error: impl Into<anyhow::Error>, what: impl Into<String>) -> anyhow::Error {
        error.into().context(Self(what.into()))
    }

    /// A failed source migration, with the exit status its report implies.
    pub fn source(failure: tern_engine::MigrationFailure, what: &str) -> anyhow::Error {
        Self::source_error(failure.error, what, &failure.stats)
    }

    /// A source's `error`, with `stats` its report: a [`NothingSent`] when
    /// it failed before anything was sent.
    pub fn source_error(
        error: MigrationError,
        what: &str,
        stats: &MigrationStats,
    ) -> anyhow::Error {
        let nothing_sent = stats.failed_in == Some(tern_engine::MigrationStatus::Setup)
            && !matches!(
                error,
                MigrationError::Cancelled | MigrationError::OutcomeUnknown(_)
            );
        if nothing_sent {
            anyhow::Error::from(error).context(NothingSent)
        } else {
            Self::error(error, what)
        }
    }
}

/// A migration that failed before anything was sent: the destination could
/// not be reached, or the handshake with it failed. The source guest runs
/// on.
#[derive(Debug)]
pub struct NothingSent;

impl std::fmt::Display for NothingSent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("nothing was sent; the source guest runs on")
    }
}

/// tern's exit statuses (docs/cli.md, "Exit status").
pub mod exit {
    /// It failed mid-migration; the source guest runs on.
    pub const FAILED: u8 = 1;
    /// A usage or setup error: nothing was started.
    pub const USAGE: u8 = 2;
    /// The source committed and the destination did not confirm: the source
    /// guest stays paused, the outcome is unknown.
    pub const OUTCOME_UNKNOWN: u8 = 3;
    /// Nothing was sent: the destination could not be reached, or it did
    /// not complete the handshake (not a tern destination, refused, timed
    /// out). The source guest runs on.
    pub const NOTHING_SENT: u8 = 4;
    /// Cancelled by a control command (`migrate_cancel`); the source guest
    /// runs on.
    pub const CANCELLED: u8 = 5;
    /// Postcopy failed after the point of no return (or its digests
    /// differed): the guest no longer runs on the source, which stays
    /// paused; see the error line for where the guest is.
    pub const POSTCOPY_FAILED: u8 = 6;
}

/// The exit status for an error: see [`Incomplete`] and docs/cli.md.
pub fn exit_code(error: &anyhow::Error) -> u8 {
    let cause_is = |test: fn(&MigrationError) -> bool| {
        error
            .chain()
            .any(|cause| cause.downcast_ref::<MigrationError>().is_some_and(test))
    };
    if error.downcast_ref::<NothingSent>().is_some() {
        match interrupted_by() {
            Some(signal) => 128 + signal as u8,
            None => exit::NOTHING_SENT,
        }
    } else if error.downcast_ref::<Incomplete>().is_none() {
        exit::USAGE
    } else if cause_is(|error| matches!(error, MigrationError::OutcomeUnknown(_))) {
        exit::OUTCOME_UNKNOWN
    } else if cause_is(|error| {
        matches!(
            error,
            MigrationError::PostcopyFailed { .. } | MigrationError::PostcopyDigestMismatch { .. }
        )
    }) {
        exit::POSTCOPY_FAILED
    } else if let Some(signal) = interrupted_by() {
        128 + signal as u8
    } else if cause_is(|error| matches!(error, MigrationError::Cancelled)) {
        exit::CANCELLED
    } else {
        exit::FAILED
    }
}

/// What became of the source guest after `error`, for the one error line.
pub fn source_guest_after(error: &MigrationError) -> &'static str {
    if matches!(error, MigrationError::OutcomeUnknown(_)) {
        "the switch-over's outcome is unknown; the source guest stays paused"
    } else if matches!(error, MigrationError::PostcopyFailed { .. }) {
        "postcopy failed after the point of no return; the source guest stays paused and the guest is lost unless the destination still runs it whole"
    } else if matches!(error, MigrationError::PostcopyDigestMismatch { .. }) {
        "the guest runs on the destination, whose memory differs from the source's; the source guest stays paused"
    } else {
        "the migration did not complete; the source guest runs on"
    }
}

/// Refuses a guest that this machine cannot hold: better a clear error now
/// than the OOM killer minutes later. `need` is the memory the command
/// will touch; `what` says why, for the message.
pub fn check_memory_fits(need: u64, what: &str) -> anyhow::Result<()> {
    let Some(available) = memory_available() else {
        return Ok(());
    };
    anyhow::ensure!(
        need <= available,
        "{what} needs about {} of RAM, but this machine has {} available (MemAvailable in \
         /proc/meminfo)",
        crate::units::human_bytes(need),
        crate::units::human_bytes(available)
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

/// The demo's JSON document: the source's statistics (with the
/// destination's inside) plus what the demo checked on the destination.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct DemoReport {
    #[serde(flatten)]
    stats: MigrationStats,
    channels: u16,
    zero_page_detection: &'static str,
    /// The destination guest kept dirtying memory after it resumed.
    resumed_on_destination: bool,
}

/// Builds a destination guest of the layout the source announces.
pub fn destination_guest(setup: &tern_wire::SessionSetup) -> Result<SyntheticGuest, GuestError> {
    check_memory_fits(
        setup.total_bytes(),
        &format!("a {} guest", crate::units::human_bytes(setup.total_bytes())),
    )
    .map_err(|error| GuestError::new(error.to_string()))?;
    let lens: Vec<u64> = setup.regions.iter().map(|region| region.len).collect();
    SyntheticGuest::empty(&lens)
        .map_err(|error| GuestError::with_source("cannot create the destination guest", error))
}

/// A destination running in a thread of this process.
pub struct LocalDestination {
    thread: std::thread::JoinHandle<anyhow::Result<Received<SyntheticGuest>>>,
    cancel: tern_engine::CancelToken,
}

impl LocalDestination {
    /// Waits for the destination; when the source failed (`source_ok`
    /// false) it is cancelled first, so it does not wait for a source that
    /// will never come.
    pub fn finish(self, source_ok: bool) -> anyhow::Result<Received<SyntheticGuest>> {
        if !source_ok {
            self.cancel.cancel();
        }
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the destination thread panicked"))?
    }
}

/// Runs a destination in a thread of this process.
pub fn spawn_local_destination(listener: Listener, config: ReceiveConfig) -> LocalDestination {
    let destination = Destination::new(config);
    let cancel = destination.cancel_token();
    let thread = std::thread::spawn(move || {
        destination
            .receive(&listener, destination_guest)
            .context("the destination failed")
    });
    LocalDestination { thread, cancel }
}

/// Waits until the resumed guest has dirtied memory, or gives up.
pub fn guest_keeps_running(guest: &SyntheticGuest, within: Duration) -> bool {
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

fn demo(args: &DemoArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let mut config = args.transfer.migration_config()?;
    let (source_security, destination_security) = if args.tls {
        crate::secure::throwaway_tls()?
    } else {
        Default::default()
    };
    config.security = source_security;
    args.guest.check()?;
    check_memory_fits(
        2 * args.guest.resident_estimate(),
        &format!(
            "--memory {} with both ends of the demo in this process",
            crate::units::human_bytes(args.guest.memory)
        ),
    )?;
    let source = Source::new(config.clone())?;
    let temp_dir;
    let listen = if args.unix {
        temp_dir = tempfile::tempdir().context("cannot create a directory for the socket")?;
        Address::Unix(temp_dir.path().join("tern.sock"))
    } else {
        Address::Tcp("127.0.0.1:0".into())
    };
    let listener = Listener::bind(&listen).with_context(|| format!("cannot listen on {listen}"))?;
    let address = listener.local_address()?;
    check_config(&config, &address)?;
    if !args.json {
        eprintln!(
            "tern demo: filling a {} guest ({}% zero, {}% random, {}% text pages)...",
            crate::units::human_bytes(args.guest.memory),
            args.guest.mix.zero,
            args.guest.mix.random,
            args.guest.mix.text
        );
    }
    let mut guest = fill_guest(&args.guest, false)?;
    let destination = spawn_local_destination(listener, {
        let mut engine_config = ReceiveConfig::default();
        engine_config.io_timeout = config.io_timeout;
        engine_config.security = destination_security;
        // The demo's own source: its --verify choice stands.
        engine_config.allow_unverified = true;
        engine_config
    });
    if !args.json {
        eprintln!(
            "tern demo: migrating to {address} over {} channels...",
            config.channels
        );
    }
    let cancel = source.cancel_token();
    install_interrupt_handler(move || cancel.cancel());
    let progress = Progress::start(source.stats());
    let result = source.migrate(&mut guest, &address);
    progress.finish();
    let received = destination.finish(result.is_ok());
    match (result, received) {
        (Ok(stats), Ok(received)) => {
            let running = guest_keeps_running(&received.guest, Duration::from_secs(2))
                || args.guest.dirty_rate == 0;
            let report = DemoReport {
                stats,
                channels: config.channels,
                zero_page_detection: config.zero_page_detection.as_str(),
                resumed_on_destination: running,
            };
            if args.json {
                print_json(&report)?;
            } else {
                print_summary(
                    &report.stats,
                    &[
                        ("channels", report.channels.to_string()),
                        (
                            "zero-page detection",
                            report.zero_page_detection.to_string(),
                        ),
                        (
                            "guest runs on destination",
                            report.resumed_on_destination.to_string(),
                        ),
                    ],
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        (Err(failure), destination) => {
            // The source's error names the cause; the destination's is
            // mostly the same failure seen from the other end.
            if let Err(error) = destination {
                tracing::debug!("destination: {error:#}");
            }
            report_failure(&failure.stats, args.json, verbose)?;
            let what = source_guest_after(&failure.error);
            Err(Incomplete::error(failure.error, what))
        }
        (Ok(_), Err(error)) => Err(Incomplete::error(
            error,
            "the source finished but the destination did not",
        )),
    }
}

/// The statistics of a failed migration: the JSON document with `--json`
/// (scripts read `status` and `error`), the table only with `-v`; the cause
/// itself is the one `tern: error:` line.
pub fn report_failure(stats: &MigrationStats, json: bool, verbose: bool) -> anyhow::Result<()> {
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
pub fn check_config(config: &tern_engine::MigrationConfig, to: &Address) -> anyhow::Result<()> {
    config
        .validate()
        .and_then(|()| config.check_address(to))
        .map_err(|error| match error {
            tern_engine::MigrationError::InvalidConfig { field, reason } => {
                anyhow::anyhow!("{}: {reason}", option_for(field))
            }
            tern_engine::MigrationError::UnsupportedTransport {
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

fn migrate(args: &MigrateArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let mut config = args.transfer.migration_config()?;
    config.security = args.security.security()?;
    if let Some(path) = &args.vmm_config {
        config.vmm_config =
            std::fs::read(path).with_context(|| format!("--vmm-config {}", path.display()))?;
    }
    config.memory_handover = args.local;
    check_config(&config, &args.to)?;
    args.guest.check()?;
    check_memory_fits(
        args.guest.resident_estimate(),
        &format!("--memory {}", crate::units::human_bytes(args.guest.memory)),
    )?;
    let source = Source::new(config)?;
    let steering = crate::steering::Steering::start(&args.steering)?;
    steering.steer(&crate::control_socket::Target::Source(source.handle()));
    let mut guest = fill_guest(&args.guest, args.local)?;
    let cancel = source.cancel_token();
    install_interrupt_handler(move || cancel.cancel());
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
            report_failure(&failure.stats, args.json, verbose)?;
            let what = source_guest_after(&failure.error);
            Err(Incomplete::source(failure, what))
        }
    }
}

/// Creates the synthetic guest, showing the fill's progress; in a memfd
/// when its memory will be handed over (`--local`).
fn fill_guest(args: &crate::cli::GuestArgs, memfd: bool) -> anyhow::Result<SyntheticGuest> {
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
pub fn serve_sessions(
    listen: &crate::cli::ListenArgs,
    mut session: impl FnMut(&Destination, &Listener) -> anyhow::Result<ExitCode>,
) -> anyhow::Result<ExitCode> {
    let (listener, config) = listen.bind()?;
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

fn receive(args: &ReceiveArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        !args.local || matches!(args.listen.listen, Address::Unix(_) | Address::Fd(_)),
        "--local needs a unix: address: memory is handed over as file descriptors, which only \
         a Unix socket carries"
    );
    let steering = crate::steering::Steering::start(&args.listen.steering)?;
    serve_sessions(&args.listen, |destination, listener| {
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

/// `tern receive --json`'s document: the destination's report and whether
/// the resumed guest went on writing memory.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub(crate) struct ReceiveJson {
    #[serde(flatten)]
    report: tern_engine::ReceiveReport,
    /// Whether the guest, resumed here, went on writing memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    resumed_guest_dirtying: Option<bool>,
    /// Bytes of the VMM configuration the source sent, when it sent one.
    #[serde(skip_serializing_if = "Option::is_none")]
    vmm_config_bytes: Option<u64>,
}

fn receive_one(
    args: &ReceiveArgs,
    destination: &Destination,
    listener: &tern_engine::Listener,
    steering: &crate::steering::Steering,
) -> anyhow::Result<ExitCode> {
    let progress = Progress::receiving(destination.stats());
    let mut vmm_config = Vec::new();
    let received = receive_guest(args.local, destination, listener, &mut vmm_config);
    progress.finish();
    if let Some(path) = &args.save_vmm_config
        && received.is_ok()
    {
        std::fs::write(path, &vmm_config)
            .with_context(|| format!("--save-vmm-config {}", path.display()))?;
    }
    let mut received = match received {
        Ok(received) => received,
        Err(error) => {
            if args.json {
                print_json(&ReceiveJson {
                    report: destination.handle().query(),
                    resumed_guest_dirtying: None,
                    vmm_config_bytes: None,
                })?;
            }
            return Err(Incomplete::error(
                error,
                "the incoming migration did not complete",
            ));
        }
    };
    if !received.resumed {
        crate::steering::hand_over_paused(
            &mut received.guest,
            steering,
            &destination.handle(),
            Duration::from_secs(args.listen.paused_timeout),
        )?;
    }
    let running = guest_keeps_running(&received.guest, Duration::from_millis(args.run_after));
    let report = destination.handle().query();
    if args.json {
        print_json(&ReceiveJson {
            report,
            resumed_guest_dirtying: Some(running),
            vmm_config_bytes: (!vmm_config.is_empty()).then_some(vmm_config.len() as u64),
        })?;
    } else {
        let how = if args.local {
            "by hand-over, no page copied".to_string()
        } else {
            format!(
                "in {} pages with data and {} zero pages",
                received.stats.normal_pages, received.stats.zero_pages
            )
        };
        println!(
            "received {} {how}; digest {}; guest resumed{}",
            crate::units::human_bytes(report.memory),
            if report.digest_verified {
                "verified"
            } else {
                "not checked (--verify none)"
            },
            if running { " and dirtying memory" } else { "" }
        );
        println!("channels: {}", security_line(&received.security));
    }
    Ok(ExitCode::SUCCESS)
}

/// Receives the guest: a copy, or with `--local` the source's memory by
/// hand-over, mapped from the files it passed.
fn receive_guest(
    local: bool,
    destination: &Destination,
    listener: &Listener,
    vmm_config: &mut Vec<u8>,
) -> Result<Received<SyntheticGuest>, MigrationError> {
    if local {
        return destination.receive_handover(listener, |_, config, files| {
            *vmm_config = config.to_vec();
            SyntheticGuest::from_handed_files(files).map_err(|error| {
                GuestError::with_source("cannot map the handed-over memory", error)
            })
        });
    }
    destination.receive_with_vmm_config(listener, |setup, config| {
        *vmm_config = config.to_vec();
        destination_guest(setup)
    })
}

/// The first SIGINT or SIGTERM received, once a handler is installed.
static INTERRUPTED_BY: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The signal that interrupted the command, if one did.
pub fn interrupted_by() -> Option<i32> {
    match INTERRUPTED_BY.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        signal => Some(signal),
    }
}

/// Runs `on_interrupt` once on SIGINT or SIGTERM, from a thread of its own
/// (the handler itself only records the signal and writes to a pipe).
pub fn install_interrupt_handler(on_interrupt: impl FnOnce() + Send + 'static) {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    static WRITE_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
    extern "C" fn handler(signal: libc::c_int) {
        // Lock-free atomics are async-signal-safe.
        let _ = INTERRUPTED_BY.compare_exchange(
            0,
            signal,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
        let fd = WRITE_FD.load(std::sync::atomic::Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: write(2) is async-signal-safe; the buffer is a static byte.
            unsafe {
                libc::write(fd, b"x".as_ptr().cast(), 1);
            }
        }
    }
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe(2) writes.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return;
    }
    WRITE_FD.store(fds[1], std::sync::atomic::Ordering::Relaxed);
    // SAFETY: the read end was just created by pipe(2) and is owned by
    // nothing else.
    let mut reader = unsafe { std::fs::File::from_raw_fd(fds[0]) };
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only performs an async-signal-safe write.
        unsafe {
            libc::signal(signal, handler as *const () as libc::sighandler_t);
        }
    }
    let _ = std::thread::Builder::new()
        .name("tern-signals".into())
        .spawn(move || {
            let mut byte = [0u8; 1];
            if reader.read_exact(&mut byte).is_ok() {
                // Not eprintln!: with stderr's reader gone it would panic
                // this thread before the cancel, and the signal would be lost.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "tern: interrupted, cancelling...");
                on_interrupt();
            }
        });
}

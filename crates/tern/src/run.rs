//! The commands.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tern_engine::{
    Address, Destination, GuestError, Listener, MigrationStats, ReceiveConfig, Received, Source,
};
use tern_synthetic::SyntheticGuest;

use crate::cli::{Command, DemoArgs, MigrateArgs, ReceiveArgs};
use crate::report::{Progress, print_json, print_summary};

pub fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Demo(args) => demo(&args),
        Command::Migrate(args) => migrate(&args),
        Command::Receive(args) => receive(&args),
        Command::Bench(command) => crate::bench::run(command),
        Command::Vm(command) => crate::vm::run(command),
    }
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

fn demo(args: &DemoArgs) -> anyhow::Result<ExitCode> {
    let config = args.transfer.migration_config()?;
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
    check_destination(&config, &address)?;
    if !args.json {
        eprintln!(
            "tern demo: filling a {} guest ({}% zero, {}% random, {}% text pages)...",
            crate::units::human_bytes(args.guest.memory),
            args.guest.mix.zero,
            args.guest.mix.random,
            args.guest.mix.text
        );
    }
    let mut guest = SyntheticGuest::new(&args.guest.synthetic_config())
        .context("cannot create the synthetic guest")?;
    let destination = spawn_local_destination(
        listener,
        ReceiveConfig {
            io_timeout: config.io_timeout,
            ..ReceiveConfig::default()
        },
    );
    if !args.json {
        eprintln!(
            "tern demo: migrating to {address} over {} channels...",
            config.channels
        );
    }
    let progress = Progress::start(source.stats());
    let result = source.migrate(&mut guest, &address);
    progress.finish();
    let received = destination.finish(result.is_ok());
    let stats = match (result, received) {
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
            return Ok(ExitCode::SUCCESS);
        }
        (Err(failure), destination) => {
            if let Err(error) = destination {
                eprintln!("tern: destination: {error:#}");
            }
            *failure.stats
        }
        (Ok(_), Err(error)) => return Err(error),
    };
    report_failure(&stats, args.json)
}

fn report_failure(stats: &MigrationStats, json: bool) -> anyhow::Result<ExitCode> {
    if json {
        print_json(stats)?;
    } else {
        print_summary(stats, &[]);
        eprintln!("tern: the migration did not complete; the source guest runs on");
    }
    Ok(ExitCode::from(1))
}

/// Checks the options against the destination's transport before anything
/// is built or connected, naming the command-line option for the engine's
/// config field.
pub fn check_destination(
    config: &tern_engine::MigrationConfig,
    to: &Address,
) -> anyhow::Result<()> {
    config.check_address(to).map_err(|error| match error {
        tern_engine::MigrationError::UnsupportedTransport {
            field,
            address,
            reason,
        } => anyhow::anyhow!(
            "--{} cannot be used with {address}: {reason}",
            field.replace('_', "-")
        ),
        other => other.into(),
    })
}

fn migrate(args: &MigrateArgs) -> anyhow::Result<ExitCode> {
    let config = args.transfer.migration_config()?;
    check_destination(&config, &args.to)?;
    let source = Source::new(config)?;
    let mut guest = SyntheticGuest::new(&args.guest.synthetic_config())
        .context("cannot create the synthetic guest")?;
    let cancel = source.cancel_token();
    install_interrupt_handler(move || cancel.cancel());
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
        Err(failure) => report_failure(&failure.stats, args.json),
    }
}

fn receive(args: &ReceiveArgs) -> anyhow::Result<ExitCode> {
    let (listener, config) = args.listen.bind()?;
    if !args.json {
        eprintln!("tern receive: listening on {}", listener.local_address()?);
    }
    let destination = Destination::new(config);
    let cancel = destination.cancel_token();
    install_interrupt_handler(move || cancel.cancel());
    let received = destination
        .receive(&listener, destination_guest)
        .context("the incoming migration failed")?;
    let running = guest_keeps_running(&received.guest, Duration::from_millis(args.run_after));
    #[derive(Serialize)]
    #[serde(rename_all = "kebab-case")]
    struct ReceiveReport<'a> {
        status: &'static str,
        digest_verified: bool,
        memory: u64,
        resumed_guest_dirtying: bool,
        #[serde(flatten)]
        stats: &'a tern_engine::DestinationStats,
    }
    let report = ReceiveReport {
        status: "completed",
        // The destination compared digests unless the source asked for none.
        digest_verified: received.setup.digest != tern_wire::DigestAlgorithm::None,
        memory: received.setup.total_bytes(),
        resumed_guest_dirtying: running,
        stats: &received.stats,
    };
    if args.json {
        print_json(&report)?;
    } else {
        println!(
            "received {} in {} pages with data and {} zero pages; digest {}; guest resumed{}",
            crate::units::human_bytes(report.memory),
            received.stats.normal_pages,
            received.stats.zero_pages,
            if report.digest_verified {
                "verified"
            } else {
                "not checked (--verify none)"
            },
            if running { " and dirtying memory" } else { "" }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `on_interrupt` once on SIGINT or SIGTERM, from a thread of its own
/// (the handler itself only writes to a pipe).
pub fn install_interrupt_handler(on_interrupt: impl FnOnce() + Send + 'static) {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    static WRITE_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
    extern "C" fn handler(_: libc::c_int) {
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
                eprintln!("tern: interrupted, cancelling...");
                on_interrupt();
            }
        });
}

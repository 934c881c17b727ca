//! `tern agent`: the host coordinator's daemon (crates/tern-fleet,
//! docs/fleet.md): a Unix socket every migration on the host joins with
//! `--agent PATH`, and an aggregate metrics endpoint.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, ValueEnum};
use tern_fleet::{Agent, Division, Settings};

use crate::units::parse_rate;

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// The agent's Unix socket (created mode 0600; other users refused).
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// The host's bandwidth budget shared by outbound migrations (e.g.
    /// 1Gbit, 100MiB); none by default (each migration keeps its own cap).
    #[arg(long, value_parser = parse_rate)]
    pub bandwidth: Option<u64>,
    /// Migrations leaving at once (KubeVirt's
    /// parallelOutboundMigrationsPerNode, Nova's
    /// max_concurrent_live_migrations).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub outbound_slots: u32,
    /// Migrations arriving at once.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub inbound_slots: u32,
    /// How the budget is divided (docs/fleet.md, "The division").
    #[arg(long, value_enum, default_value_t = DivisionArg::ConvergeFirst)]
    pub division: DivisionArg,
    /// Serve every migration's figures and the agent's own in the
    /// Prometheus text format on HOST:PORT (`GET /metrics`).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DivisionArg {
    /// Floors against each dirty rate, the rest to the migration that
    /// finishes soonest for what its delay costs.
    ConvergeFirst,
    /// Equal shares.
    Equal,
}

impl From<DivisionArg> for Division {
    fn from(division: DivisionArg) -> Self {
        match division {
            DivisionArg::ConvergeFirst => Division::ConvergeFirst,
            DivisionArg::Equal => Division::Equal,
        }
    }
}

/// Runs the agent until SIGINT or SIGTERM. Migrations that joined go on at
/// their last share when it stops, and rejoin the next agent on the path.
pub fn run(args: &AgentArgs) -> anyhow::Result<ExitCode> {
    // Before any thread starts, so that every thread inherits the mask and
    // the signals wait for `sigwait` below.
    let signals = block_stop_signals()?;
    let settings = Settings {
        bandwidth: args.bandwidth.unwrap_or(0),
        outbound_slots: args.outbound_slots,
        inbound_slots: args.inbound_slots,
        division: args.division.into(),
        ..Settings::default()
    };
    let agent = std::sync::Arc::new(
        Agent::start(&args.socket, settings).with_context(|| "cannot start the agent")?,
    );
    let _metrics = args
        .metrics_listen
        .as_deref()
        .map(|address| {
            crate::agent_metrics::AgentMetrics::start(address, std::sync::Arc::downgrade(&agent))
        })
        .transpose()?;
    crate::report::print_listening(&tern_engine::Address::Unix(args.socket.clone()))?;
    let mut signal: libc::c_int = 0;
    // SAFETY: `signals` is an initialised set; `signal` receives one value.
    let waited = unsafe { libc::sigwait(&signals, &mut signal) };
    anyhow::ensure!(waited == 0, "sigwait failed: {waited}");
    tracing::info!("signal {signal}: the agent stops; its migrations go on at their shares");
    Ok(ExitCode::from(128 + signal as u8))
}

/// Blocks SIGINT and SIGTERM in this thread (and the threads it starts);
/// the set, for `sigwait`.
fn block_stop_signals() -> anyhow::Result<libc::sigset_t> {
    // SAFETY: sigemptyset initialises the set before sigaddset and
    // pthread_sigmask read it; a null old set is allowed.
    unsafe {
        let mut signals: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut signals);
        libc::sigaddset(&mut signals, libc::SIGINT);
        libc::sigaddset(&mut signals, libc::SIGTERM);
        let blocked = libc::pthread_sigmask(libc::SIG_BLOCK, &signals, std::ptr::null_mut());
        anyhow::ensure!(blocked == 0, "cannot block SIGINT and SIGTERM: {blocked}");
        Ok(signals)
    }
}

//! `tern agent`: the host coordinator's daemon (crates/tern-fleet,
//! docs/fleet.md): a Unix socket every migration on the host joins with
//! `--agent PATH`, and an aggregate metrics endpoint.

use std::process::ExitCode;

use anyhow::Context;
use tern_fleet::{Agent, Settings};

use crate::args::agent::AgentArgs;

/// Runs the agent until SIGINT or SIGTERM. Migrations that joined go on at
/// their last share when it stops, and rejoin the next agent on the path.
pub(crate) fn run(args: &AgentArgs) -> anyhow::Result<ExitCode> {
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
    Ok(ExitCode::from(crate::session::signal_exit_code(signal)))
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

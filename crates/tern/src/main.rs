//! `tern`: live migration of VM memory, from the command line.
//!
//! The arrows point one way: `main` → `command` (one file per command) →
//! `session` (what the commands share around a migration), `args` (the
//! syntax), `report` (the output), and the control plane (`steering`,
//! `control_socket`, `metrics`, `secure`); nothing below imports a command.

mod agent_metrics;
mod args;
mod command;
mod control_socket;
mod metrics;
#[cfg(test)]
mod reference;
mod report;
#[cfg(test)]
mod schema;
mod secure;
mod session;
mod steering;
mod units;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = args::Cli::parse();
    report::set_progress_mode(cli.progress.progress);
    let filter = if cli.verbose { "debug" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(cli.log_colour())
        .init();
    match command::dispatch(cli.command, cli.verbose) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("tern: error: {error:#}");
            std::process::ExitCode::from(session::exit_code(&error))
        }
    }
}

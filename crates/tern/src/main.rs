//! `tern`: live migration of VM memory, from the command line.

mod agent;
mod agent_metrics;
mod bench;
mod cli;
mod control_socket;
mod ctl;
mod doctor;
mod metrics;
#[cfg(test)]
mod reference;
mod report;
mod restore;
mod run;
mod save;
#[cfg(test)]
mod schema;
mod secure;
mod serve_pages;
mod steering;
mod units;
mod vm;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
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
    match run::dispatch(cli.command, cli.verbose) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("tern: error: {error:#}");
            std::process::ExitCode::from(run::exit_code(&error))
        }
    }
}

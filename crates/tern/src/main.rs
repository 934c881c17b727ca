//! `tern`: live migration of VM memory, from the command line.

mod bench;
mod cli;
mod report;
mod run;
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
        .init();
    match run::dispatch(cli.command) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("tern: error: {error:#}");
            std::process::ExitCode::from(2)
        }
    }
}

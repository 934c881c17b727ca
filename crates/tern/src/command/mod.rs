//! The commands, one file each (`tern vm`'s in `vm/`). Each reads its
//! options from `crate::args` and builds on `crate::session` and
//! `crate::report`; nothing below imports a command. `tern vm receive` and
//! `tern vm demo` are `receive`'s and `demo`'s implementations with a KVM
//! guest.

pub mod agent;
pub mod bench;
pub mod ctl;
pub mod demo;
pub mod doctor;
pub mod migrate;
pub mod receive;
pub mod restore;
pub mod save;
pub mod serve_pages;
pub mod vm;

use std::process::ExitCode;

use crate::args::Command;

/// Runs `command`.
pub fn dispatch(command: Command, verbose: bool) -> anyhow::Result<ExitCode> {
    match command {
        Command::Demo(args) => demo::run(&args, verbose),
        Command::Migrate(args) => migrate::run(&args, verbose),
        Command::Receive(args) => receive::run(&args),
        Command::Save(args) => save::save(&args),
        Command::Restore(args) => restore::restore(&args),
        Command::MergeSnapshot(args) => restore::merge(&args),
        Command::ServePages(args) => serve_pages::serve(&args),
        Command::Bench(command) => bench::run(command),
        Command::Vm(command) => vm::run(command, verbose),
        Command::Ctl(args) => ctl::run(&args),
        Command::Agent(args) => agent::run(&args),
        Command::Doctor(args) => {
            doctor::print(&doctor::examine(), args.json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Completions(args) => {
            use clap::CommandFactory;
            clap_complete::generate(
                args.shell,
                &mut crate::args::Cli::command(),
                "tern",
                &mut std::io::stdout(),
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

//! The commands, one file each (`tern vm`'s in `vm/`). Each reads its
//! options from `crate::args` and builds on `crate::session` and
//! `crate::report`; nothing below imports a command. `tern vm receive` and
//! `tern vm demo` are `receive`'s and `demo`'s implementations with a KVM
//! guest.

pub(crate) mod agent;
pub(crate) mod bench;
pub(crate) mod ctl;
pub(crate) mod demo;
pub(crate) mod doctor;
pub(crate) mod migrate;
pub(crate) mod receive;
pub(crate) mod restore;
pub(crate) mod save;
pub(crate) mod serve_pages;
pub(crate) mod vm;

use std::process::ExitCode;

use crate::args::Command;

/// Runs `command`.
pub(crate) fn dispatch(command: Command, verbose: bool) -> anyhow::Result<ExitCode> {
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

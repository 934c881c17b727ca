//! `--progress`, global to every command (applied by `crate::report`).

/// How progress is shown (`--progress`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ProgressMode {
    /// A bar when stderr is a terminal, `plain` otherwise.
    #[default]
    Auto,
    /// A live bar on stderr (drawn only on a terminal).
    Bar,
    /// One line on stderr every two seconds, for logs and CI.
    Plain,
    /// Nothing, for scripts.
    None,
}

/// The `--progress` option, in a struct of its own so the commands' option
/// lists stay apart from it.
#[derive(Clone, Copy, Debug, clap::Args)]
pub(crate) struct ProgressArgs {
    /// Progress on stderr: auto (a bar on a terminal, plain otherwise), bar,
    /// plain (a line every 2 s) or none.
    #[arg(long, global = true, value_enum, default_value_t = ProgressMode::Auto)]
    pub progress: ProgressMode,
}

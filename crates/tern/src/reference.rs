//! The option reference in docs/cli.md, rendered from the clap definitions
//! so that it cannot drift from them. `TERN_BLESS=1 cargo test -p tern
//! reference` rewrites it.

use std::fmt::Write;

use clap::CommandFactory;

const BEGIN: &str = "<!-- BEGIN GENERATED REFERENCE: TERN_BLESS=1 cargo test -p tern reference -->";
const END: &str = "<!-- END GENERATED REFERENCE -->";

/// Every command, its options, their defaults and possible values, as
/// Markdown.
fn render() -> String {
    let mut command = crate::args::Cli::command();
    command.build();
    let mut out = String::new();
    render_command(&mut out, &command, "tern");
    out
}

fn render_command(out: &mut String, command: &clap::Command, path: &str) {
    if command.is_hide_set() || command.get_name() == "help" {
        return;
    }
    let _ = writeln!(out, "\n### `{path}`\n");
    if let Some(about) = command.get_long_about().or(command.get_about()) {
        let _ = writeln!(out, "{}\n", one_paragraph(&about.to_string()));
    }
    let args: Vec<&clap::Arg> = command
        .get_arguments()
        .filter(|arg| !arg.is_hide_set())
        // Global options are listed once, at the top.
        .filter(|arg| path == "tern" || !arg.is_global_set())
        .filter(|arg| !matches!(arg.get_id().as_str(), "help" | "version"))
        .collect();
    if !args.is_empty() {
        let _ = writeln!(out, "| option | default | meaning |\n|---|---|---|");
        for arg in args {
            let _ = writeln!(
                out,
                "| {} | {} | {} |",
                arg_name(arg),
                arg.get_default_values()
                    .iter()
                    // A flag's default (`false`) says nothing.
                    .filter(|_| arg.get_num_args().is_some_and(|range| range.takes_values()))
                    .map(|value| format!("`{}`", value.to_string_lossy()))
                    .collect::<Vec<_>>()
                    .join(","),
                arg_help(arg).replace('|', "\\|")
            );
        }
    }
    for subcommand in command.get_subcommands() {
        render_command(
            out,
            subcommand,
            &format!("{path} {}", subcommand.get_name()),
        );
    }
}

fn arg_name(arg: &clap::Arg) -> String {
    let value = arg
        .get_value_names()
        .map(|names| {
            names
                .iter()
                .map(|name| format!("<{name}>"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    let takes_value = arg.get_num_args().is_some_and(|range| range.takes_values());
    match (arg.get_long(), arg.get_short()) {
        (Some(long), Some(short)) if !takes_value => format!("`-{short}`, `--{long}`"),
        (Some(long), _) if !takes_value => format!("`--{long}`"),
        (Some(long), _) => format!("`--{long} {value}`"),
        (None, _) => format!("`{value}`"),
    }
}

fn arg_help(arg: &clap::Arg) -> String {
    let mut help = arg
        .get_long_help()
        .or(arg.get_help())
        .map(|help| one_paragraph(&help.to_string()))
        .unwrap_or_default();
    if !help.is_empty() && !help.ends_with('.') {
        help.push('.');
    }
    let values: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|value| !value.is_hide_set())
        .map(|value| match value.get_help() {
            Some(meaning) => format!("`{}` ({meaning})", value.get_name()),
            None => format!("`{}`", value.get_name()),
        })
        .collect();
    if !values.is_empty() {
        let _ = write!(help, " Values: {}.", values.join(", "));
    }
    help
}

fn one_paragraph(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn docs_cli_md_has_the_current_reference() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/cli.md");
    let document = std::fs::read_to_string(path).expect("docs/cli.md");
    let (before, rest) = document
        .split_once(BEGIN)
        .expect("docs/cli.md lacks the generated-reference marker");
    let (current, after) = rest
        .split_once(END)
        .expect("docs/cli.md lacks the end marker");
    let rendered = render();
    if current == rendered {
        return;
    }
    if std::env::var_os("TERN_BLESS").is_some() {
        std::fs::write(path, format!("{before}{BEGIN}{rendered}{END}{after}")).unwrap();
        return;
    }
    panic!(
        "docs/cli.md's option reference is out of date with the clap definitions; \
         run `TERN_BLESS=1 cargo test -p tern reference` and commit docs/cli.md"
    );
}

//! Value parsers shared by the commands' options.

use std::ffi::OsStr;
use std::str::FromStr;

use clap::builder::{PossibleValue, TypedValueParser};
use tern_engine::{Address, Verify};
use tern_page::codec::{CodecChoice, QplPath};

/// The `--qpl-path` values.
pub(super) fn qpl_path_values() -> Choices<QplPath> {
    Choices::new(&[
        ("auto", "IAA when present, else QPL's software path"),
        ("hardware", "IAA only; fail without a usable IAA work queue"),
        (
            "software",
            "QPL's software path (libdeflate on a destination)",
        ),
    ])
}

pub(crate) fn parse_address(text: &str) -> Result<Address, String> {
    text.parse()
}

/// The engine's range, checked while parsing so that every command says
/// the same.
pub(super) fn parse_channels(text: &str) -> Result<u16, String> {
    let max = tern_wire::MAX_CHANNELS;
    match text.trim().parse::<u64>().map(u16::try_from) {
        Ok(Ok(channels)) if (1..=max).contains(&channels) => Ok(channels),
        _ => Err(format!("--channels {text} is out of range (1..={max})")),
    }
}
/// The `--workload` values of the test guest.
pub(super) fn workload_values() -> Choices<tern_vmm::guest_code::Workload> {
    Choices::new(&[
        (
            "increment",
            "add one to each page's first byte (a one-byte change)",
        ),
        (
            "rewrite",
            "also rewrite the rest of each page with new random words",
        ),
    ])
}

pub(super) fn compression_values() -> Choices<CodecChoice> {
    Choices::new(&[
        ("none", "pages go as they are"),
        ("zstd", "zstd, level 1 unless --compression-level"),
        ("deflate", "raw deflate, 4 KiB window (IAA-compatible)"),
        ("lz4", "lz4 block format"),
        ("qpl", "deflate through Intel QPL (IAA when present)"),
        ("auto", "picked from the measured link and codec speeds"),
    ])
}

pub(super) fn postcopy_values() -> Choices<tern_engine::PostcopyMode> {
    Choices::new(&[
        ("off", "precopy only: throttle, or give up at a limit"),
        (
            "on-request",
            "precopy until migrate-start-postcopy (tern ctl) or --postcopy-after, then postcopy",
        ),
        (
            "auto",
            "postcopy instead of throttling past --postcopy-max-throttle or giving up at a limit",
        ),
        ("after-first-pass", "one full precopy pass, then postcopy"),
    ])
}

pub(super) fn verify_values() -> Choices<Verify> {
    Choices::new(&[
        ("full", "compare digests of all memory before resuming"),
        (
            "strict",
            "full, and the source hashes all memory again while paused: a write its dirty log forgot is always found, at a longer downtime",
        ),
        ("none", "shortest downtime; trusts the dirty log"),
    ])
}

/// A value parser that lists its possible values (for help, completions
/// and docs/cli.md) but parses with the type's own `FromStr`, so that
/// aliases and helpful errors (`zlib`, `legacy`) stay in one place.
#[derive(Clone, Debug)]
pub(crate) struct Choices<T> {
    values: &'static [(&'static str, &'static str)],
    parsed: std::marker::PhantomData<fn() -> T>,
}

impl<T> Choices<T> {
    pub(super) fn new(values: &'static [(&'static str, &'static str)]) -> Self {
        Self {
            values,
            parsed: std::marker::PhantomData,
        }
    }
}

impl<T, E> TypedValueParser for Choices<T>
where
    T: FromStr<Err = E> + Clone + Send + Sync + 'static,
    E: std::fmt::Display,
{
    type Value = T;

    fn parse_ref(
        &self,
        command: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<T, clap::Error> {
        let names: Vec<&str> = self.values.iter().map(|(name, _)| *name).collect();
        let names = names.join(", ");
        let parse = move |text: &str| {
            text.parse::<T>()
                .map_err(|error| format!("{error} (possible values: {names})"))
        };
        parse.parse_ref(command, arg, value)
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(
            self.values
                .iter()
                .map(|(name, help)| PossibleValue::new(*name).help(*help)),
        ))
    }
}

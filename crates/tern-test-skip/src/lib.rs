//! Visible skips for tern's tests, the check that keeps each crate's
//! integration tests in one binary without leaving a file out
//! ([`assert_every_test_file_is_compiled`]), bounded waits that fail a
//! test naming what did not happen instead of hanging it ([`wait`]), and
//! a TCP proxy that cuts, holds and paces connections ([`proxy::Proxy`])
//! for the tests of broken networks.
//!
//! libtest has no run-time skip: a test that cannot run on this machine
//! (no `/dev/kvm`, no userfaultfd, no libqpl) can only return early, and
//! then counts as passed with its message captured and hidden. [`skip`]
//! makes the skip visible twice:
//!
//! * on the runner's own output: a `SKIPPED <test>: <reason>` line written
//!   straight to the process's standard error, which libtest does not
//!   capture (it captures only the `print!` family);
//! * in the file named by `TERN_SKIP_LOG`, when set: one line per skip,
//!   `<test>\t<need>\t<reason>`, which `.ci/run` reads to count skips apart
//!   from passes and to say which optional paths the run exercised
//!   (docs/testing.md, "Skips").
//!
//! A test calls it and returns at once:
//!
//! ```
//! # fn kvm_available() -> bool { false }
//! # fn a_kvm_test() {
//! if !kvm_available() {
//!     return tern_test_skip::skip(tern_test_skip::Need::Kvm, "/dev/kvm not available");
//! }
//! # }
//! ```

use std::fmt;
use std::io::Write;

mod layout;
pub mod proxy;
pub mod wait;
pub use layout::{assert_every_test_file_is_compiled, undeclared_test_files};

/// The environment variable naming the skip log.
pub const LOG_ENV: &str = "TERN_SKIP_LOG";

/// The environment variable naming needs this run must not skip for,
/// comma-separated by [`Need::name`] (`TERN_REQUIRE=kvm,userfaultfd`): a
/// skip for one of them fails its test instead. For a machine known to
/// have them, where a skip means the environment or the code broke (a
/// mutation that makes userfaultfd unusable would otherwise turn every
/// test of it into a pass).
pub const REQUIRE_ENV: &str = "TERN_REQUIRE";

/// What a skipped test needed and this machine lacks (or, for the tests of
/// a fallback, has): the optional paths CI reports as exercised or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Need {
    /// `/dev/kvm`.
    Kvm,
    /// A machine without `/dev/kvm` (the tests of the error path).
    NoKvm,
    /// userfaultfd for this process (root, or `vm.unprivileged_userfaultfd`).
    Userfaultfd,
    /// io_uring with zero-copy send.
    IoUring,
    /// libqpl loadable (`TERN_QPL_LIB`).
    Qpl,
    /// A machine without libqpl (the tests of its absence).
    NoQpl,
    /// No DSA or IAA device (the tests of the software fallback's errors).
    NoAccelerator,
    /// A CPU feature or other host property named in the reason.
    Host,
}

impl Need {
    /// The short name CI prints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kvm => "kvm",
            Self::NoKvm => "no-kvm",
            Self::Userfaultfd => "userfaultfd",
            Self::IoUring => "io-uring",
            Self::Qpl => "qpl",
            Self::NoQpl => "no-qpl",
            Self::NoAccelerator => "no-accelerator",
            Self::Host => "host",
        }
    }
}

impl fmt::Display for Need {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

/// Records that the running test skips because this machine lacks `need`,
/// saying `reason`. The caller returns right after.
pub fn skip(need: Need, reason: impl fmt::Display) {
    let test = current_test();
    let reason = reason.to_string().replace(['\n', '\t'], " ");
    // Straight to the file descriptor: libtest's capture covers only the
    // `print!` family, so this line shows between the runner's own.
    let _ = std::io::stderr().write_all(format!("SKIPPED {test} ({need}): {reason}\n").as_bytes());
    if let Some(path) = std::env::var_os(LOG_ENV) {
        append(&path, &format!("{test}\t{need}\t{reason}\n"));
    }
    let required = std::env::var(REQUIRE_ENV).unwrap_or_default();
    assert!(
        !is_required(need, &required),
        "{test} would skip, but {REQUIRE_ENV}={required} requires {need}: {reason}"
    );
}

/// Whether `need` is among the comma-separated names in `required`.
fn is_required(need: Need, required: &str) -> bool {
    required.split(',').any(|name| name.trim() == need.name())
}

/// The running test's name: libtest runs each test on a thread named
/// after it.
fn current_test() -> String {
    std::thread::current()
        .name()
        .filter(|name| *name != "main")
        .map_or_else(|| "(unnamed test)".to_string(), ToString::to_string)
}

/// Appends `line` in one write, so lines from test processes running at
/// once do not interleave.
fn append(path: &std::ffi::OsStr, line: &str) {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path);
    match file {
        Ok(mut file) => {
            if let Err(error) = file.write_all(line.as_bytes()) {
                let _ = writeln!(std::io::stderr(), "cannot append to {LOG_ENV}: {error}");
            }
        }
        Err(error) => {
            let _ = writeln!(std::io::stderr(), "cannot open {LOG_ENV}: {error}");
        }
    }
}

/// Whether this process may create a userfaultfd (the system call, or
/// `/dev/userfaultfd` where the call is refused to unprivileged users);
/// where it may not, records the skip, and the caller returns.
pub fn userfaultfd_works() -> bool {
    // SAFETY: the system call takes flags only; the descriptor is closed
    // right away.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
    if let Ok(fd) = libc::c_int::try_from(fd)
        && fd >= 0
    {
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(fd) };
        return true;
    }
    let device = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd");
    if device.is_ok() {
        return true;
    }
    skip(Need::Userfaultfd, "no userfaultfd for this process");
    false
}

#[cfg(test)]
mod tests {
    use super::{LOG_ENV, Need, is_required, skip};

    #[test]
    fn a_skip_is_logged_with_the_test_name_and_reason() {
        let directory = std::env::temp_dir().join(format!("tern-skip-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let log = directory.join("skips");
        // SAFETY: no other test of this crate reads or writes the
        // environment.
        unsafe { std::env::set_var(LOG_ENV, &log) };
        skip(Need::Kvm, "no\tkvm\nhere");
        let text = std::fs::read_to_string(&log).unwrap();
        std::fs::remove_dir_all(&directory).unwrap();
        assert_eq!(
            text,
            "tests::a_skip_is_logged_with_the_test_name_and_reason\tkvm\tno kvm here\n"
        );
    }

    #[test]
    fn a_need_is_required_only_when_named_whole() {
        assert!(is_required(Need::Kvm, "kvm"));
        assert!(is_required(Need::Userfaultfd, "kvm, userfaultfd"));
        assert!(!is_required(Need::Kvm, ""));
        assert!(!is_required(Need::Kvm, "no-kvm"));
        assert!(!is_required(Need::Qpl, "kvm,userfaultfd"));
    }
}

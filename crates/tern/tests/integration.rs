//! tern's integration tests, as one test binary: each file of this
//! directory is a module here (docs/testing.md, "One test binary");
//! a file added here must be named below, which
//! [`every_test_file_is_compiled`] checks.

mod agent;
mod attacks_accept;
mod attacks_trust;
mod cli;
mod control;
mod postcopy_processes;
mod process;
mod serve_pages;
mod snapshot_diff;
mod snapshot_lazy;
mod snapshot_tracked;
mod vm;

/// Every `.rs` file beside this one is a module above, so no test file is
/// silently left out of the build (Cargo no longer finds them itself:
/// `autotests = false`).
#[test]
fn every_test_file_is_compiled() {
    tern_test_skip::assert_every_test_file_is_compiled(env!("CARGO_MANIFEST_DIR"));
}

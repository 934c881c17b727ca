//! tern-engine's integration tests, as one test binary.
//!
//! Each file in this directory is a module here rather than a test binary
//! of its own: every binary compiled and optimised the engine's generic
//! pipeline again for its guest types, so 21 binaries cost CI most of its
//! build (docs/testing.md, "One test binary"). `cargo nextest` still runs
//! every test in its own process; a test's name is its file's module and
//! its function, e.g. `migration::a_paused_guest_migrates`.
//!
//! A file added to this directory must be named below:
//! [`every_test_file_is_compiled`] fails otherwise, since Cargo no longer
//! finds test files by itself (`autotests = false`).

mod common;

mod attacks_invariants;
mod auto;
mod catch_up;
mod control;
mod decode_pool;
mod dictionary;
mod faults;
mod fuzz_corpus;
mod handover;
#[cfg(feature = "tls")]
mod identity_checks;
mod migration;
mod postcopy;
mod postcopy_recovery;
mod progress;
mod reuse;
#[cfg(feature = "tls")]
mod secure;
mod snapshot;
mod snapshot_diff;
mod snapshot_tracked;
mod streams;
mod switch_over_commit;
mod verification;
#[cfg(feature = "vm-memory")]
mod vm_memory;

/// Every `.rs` file beside this one is a module above, so no test file is
/// silently left out of the build.
#[test]
fn every_test_file_is_compiled() {
    tern_test_skip::assert_every_test_file_is_compiled(env!("CARGO_MANIFEST_DIR"));
}

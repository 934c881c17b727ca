//! tern-vmm's integration tests, as one test binary: each file of this
//! directory is a module here (docs/testing.md, "One test binary");
//! a file added here must be named below, which
//! [`every_test_file_is_compiled`] checks.

mod kvm;
mod postcopy_kvm;
mod snapshot;

/// Every `.rs` file beside this one is a module above, so no test file is
/// silently left out of the build (Cargo no longer finds them itself:
/// `autotests = false`).
#[test]
fn every_test_file_is_compiled() {
    tern_test_skip::assert_every_test_file_is_compiled(env!("CARGO_MANIFEST_DIR"));
}

//! Helpers shared by the snapshot tests.

use std::path::Path;

use tern_engine::{GuestError, LazyRestore, RestoreConfig, SnapshotError};
use tern_synthetic::SyntheticGuest;

/// An empty guest of regions of `lens` bytes: what a restore fills.
pub(crate) fn empty(lens: &[u64]) -> Result<SyntheticGuest, GuestError> {
    SyntheticGuest::empty(lens).map_err(|error| GuestError::with_source("empty guest", error))
}

/// A restore on `bases` that leaves the guest paused.
pub(crate) fn on(bases: &[&Path]) -> RestoreConfig {
    let mut config = RestoreConfig::default();
    config.resume = false;
    config.bases = bases.iter().map(|path| path.to_path_buf()).collect();
    config
}

/// The error as the CLI prints it: the whole chain on one line.
pub(crate) fn one_line(error: &SnapshotError) -> String {
    let mut line = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        line.push_str(": ");
        line.push_str(&cause.to_string());
        source = cause.source();
    }
    assert!(!line.contains('\n'), "{line}");
    line
}

/// A lazy restore of `path` with `config` into an empty guest, or `None`
/// after a visible skip where this process has no userfaultfd.
pub(crate) fn lazy_or_skip(
    path: &Path,
    config: &RestoreConfig,
) -> Option<LazyRestore<SyntheticGuest>> {
    match tern_engine::restore_lazy(path, config, empty) {
        Err(SnapshotError::Fault(error)) => {
            tern_test_skip::skip(
                tern_test_skip::Need::Userfaultfd,
                format!("no userfaultfd for this process: {error}"),
            );
            None
        }
        other => Some(other.unwrap()),
    }
}

//! The cancel token: a leaf module, so that the transport, the deadlines
//! and both sides can stop on it without importing the control plane.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Cancels a running migration from another thread (a signal handler's
/// helper, a UI, a test).
#[derive(Clone, Debug, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A token not yet cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the migration to stop; it ends with status `cancelled` and the
    /// source guest running.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether cancellation was asked for.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    pub(crate) fn flag(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

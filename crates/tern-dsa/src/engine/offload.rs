//! [`DsaOffload`]: the engine as a [`ZeroPageOffload`], owning the
//! completion thread.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use tern_page::{OffloadError, Ticket, ZeroOffloadStats, ZeroPageOffload};

use super::completion::completion_thread;
use super::config::OffloadConfig;
use super::inner::Inner;
use super::slot::DONE;
use crate::DsaError;
use crate::queue::DsaQueue;

/// The DSA engine: queues, slots and the completion thread.
#[derive(Debug)]
pub struct DsaOffload {
    pub(super) inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl DsaOffload {
    /// Starts the engine over `queues` (hardware or software), used
    /// round-robin.
    ///
    /// # Errors
    ///
    /// [`DsaError::NoneOpened`] if `queues` is empty.
    pub fn new(queues: Vec<Arc<dyn DsaQueue>>, config: OffloadConfig) -> Result<Self, DsaError> {
        Self::with_bound(queues, config, true)
    }

    /// [`new`](Self::new), with the per-queue in-flight bound lifted when
    /// `bounded` is false (tests only: shows the overfill it prevents).
    pub(super) fn with_bound(
        queues: Vec<Arc<dyn DsaQueue>>,
        config: OffloadConfig,
        bounded: bool,
    ) -> Result<Self, DsaError> {
        if queues.is_empty() {
            return Err(DsaError::NoneOpened("no queue given".into()));
        }
        let inner = Inner::new(queues, config, bounded);
        let poller_inner = inner.clone();
        let thread = std::thread::Builder::new()
            .name("tern-dsa-completion".into())
            .spawn(move || completion_thread(&poller_inner))
            .map_err(|error| {
                DsaError::NoneOpened(format!("cannot start the completion thread: {error}"))
            })?;
        let _ = inner.poller.set(thread.thread().clone());
        Ok(DsaOffload {
            inner,
            thread: Some(thread),
        })
    }

    /// Reserves room for one descriptor on the next enabled queue with room
    /// (the zero-page submissions' round-robin, in-flight bound and
    /// back-off), for another user of the same queues such as the delta
    /// offload; `None` when every queue is full, backing off or retired.
    /// The reservation is given back with [`release_one`](Self::release_one)
    /// once the descriptor's record is written, and kept for good if it
    /// never is.
    pub(crate) fn reserve_one(&self) -> Option<(usize, Arc<dyn DsaQueue>)> {
        let node = if self.inner.queues.numa_matters {
            crate::select::current_numa_node()
        } else {
            None
        };
        let r = self.inner.queues.pick(1, node).ok()?;
        Some((r.queue, self.inner.queues.entries[r.queue].queue.clone()))
    }

    /// Gives back a reservation of [`reserve_one`](Self::reserve_one); a
    /// refused submission is counted and may back the queue off or retire it.
    pub(crate) fn release_one(&self, queue: usize, refused: Option<&crate::SubmitError>) {
        let entry = &self.inner.queues.entries[queue];
        entry.in_flight.fetch_sub(1, Ordering::AcqRel);
        match refused {
            Some(error) => self.inner.note_refusal(entry, error),
            None => entry.accepted(),
        }
    }

    /// Names and methods of the queues, e.g. `["dsa0/wq0.0 (movdir64b)"]`.
    pub fn queue_names(&self) -> Vec<String> {
        self.inner
            .queues
            .entries
            .iter()
            .map(|q| format!("{} ({})", q.queue.name(), q.queue.method()))
            .collect()
    }
}

impl Drop for DsaOffload {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl ZeroPageOffload for DsaOffload {
    unsafe fn submit(&self, pages: &[*const u8]) -> Result<Ticket, OffloadError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.submit(pages) }
    }

    fn wait(&self, ticket: Ticket, out: &mut Vec<bool>) -> Result<(), OffloadError> {
        self.inner.wait(ticket, out)
    }

    fn is_done(&self, ticket: &Ticket) -> bool {
        match self.inner.slot_of(ticket) {
            Ok(Some(slot)) => slot.state.load(Ordering::Acquire) == DONE,
            _ => true,
        }
    }

    fn stats(&self) -> ZeroOffloadStats {
        let mut s = self.inner.counters.snapshot();
        s.submit_retries = self
            .inner
            .queues
            .entries
            .iter()
            .map(|q| q.queue.retries())
            .sum();
        s
    }

    fn describe(&self) -> String {
        format!("dsa [{}]", self.queue_names().join(", "))
    }
}

//! The DSA engine behind [`ZeroPageOffload`](tern_page::ZeroPageOffload).
//!
//! # How a worker uses it
//!
//! ```text
//! let offload: Arc<dyn ZeroPageOffload> = open_dsa(&cfg)?;   // or tern_page::cpu_offload(..)
//! // per batch of up to 128 pages:
//! let ticket = unsafe { offload.submit(&page_ptrs) }?;       // returns at once
//! ...                                                         // other work
//! offload.wait(ticket, &mut is_zero)?;                        // one bool per page
//! ```
//!
//! `submit` never fails for device reasons: a device that is missing,
//! disabled, full or out of batch slots makes it answer on the CPU instead
//! (counted in [`ZeroOffloadStats`](tern_page::ZeroOffloadStats)). `wait` finishes on the CPU whatever the
//! device could not (page faults from `bytes_completed`, error statuses).
//!
//! # DSA engine
//!
//! A fixed pool of *slots*, each owning the memory of one submission (128
//! COMPVAL descriptors, their records, and the batch descriptors/records),
//! 64-byte aligned. A submitter takes a free slot from a lock-free queue, so
//! the per-batch path takes no lock, fills it, submits one BATCH per chunk of
//! at most `max_batch_size` pages (a lone page goes as a plain COMPVAL), and
//! hands the slot to the completion thread. The completion thread polls the
//! status byte of each chunk's record (spinning with `spin_loop` for a few
//! rounds, then, when nothing progresses, UMONITOR/UMWAIT on the oldest
//! pending record where the CPU has WAITPKG, else `yield_now`; it parks when
//! nothing is outstanding), marks the slot done and unparks the waiting
//! worker. The worker decodes the records and returns the slot.
//!
//! Queues are taken round-robin per submit, those on the submitting CPU's
//! NUMA node first ([`NumaPolicy`](crate::NumaPolicy)). Each queue carries at most its
//! [`capacity`](crate::DsaQueue::capacity) descriptors in flight whatever the
//! submission path; pages of a batch that do not fit are checked on the CPU
//! by the submitter while the device works on the rest.
//!
//! A submission not complete [`completion_timeout`](OffloadConfig) after it
//! was made (measured on the monotonic clock at every polling round) is
//! answered on the CPU; since the device may still write its records some
//! day, its slot memory is never reused (leaked) and its queue is retired
//! with its reservation kept, so nothing is ever handed to that queue again.
//!
//! # Files
//!
//! Slot memory and states in `slot.rs`, the queues and their
//! round-robin pick in `queues.rs`, the shared state in `inner.rs`, the
//! submission path in `submit.rs`, decoding in `finish.rs`, the completion
//! thread in `completion.rs`, [`DsaOffload`] in `offload.rs`, and the ways
//! to build one in `open.rs`.

mod completion;
mod config;
mod finish;
mod inner;
mod offload;
mod open;
mod queues;
mod slot;
mod submit;
#[cfg(test)]
mod tests;

pub use config::{DsaConfig, OffloadConfig};
pub use offload::DsaOffload;
pub use open::{open_dsa, open_dsa_engine, software_dsa};

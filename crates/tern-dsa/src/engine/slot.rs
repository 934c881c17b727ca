//! Batch slots: the memory of one submission (descriptors and completion
//! records the device reads and writes) and its book-keeping.
//!
//! A slot goes FREE → IN_FLIGHT (the submitter filled and published it) →
//! DONE (the completion thread saw its records written, or its deadline
//! pass) → FREE again (the waiter decoded it). A slot that timed out is
//! never FREE again: the device may still write its memory.

use std::cell::UnsafeCell;
use std::ptr::addr_of_mut;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32};
use std::thread::Thread;
use std::time::Instant;

use tern_page::MAX_BATCH_PAGES;

use crate::desc::{CompletionRecord, Descriptor};

/// Batch descriptors per slot: chunks have at least 2 pages when batching.
pub(super) const MAX_CHUNKS: usize = MAX_BATCH_PAGES / 2;

/// Slot states.
pub(super) const FREE: u8 = 0;
pub(super) const IN_FLIGHT: u8 = 1;
pub(super) const DONE: u8 = 2;

/// Memory of one submission. Everything the device reads or writes lives
/// here, 64-byte aligned (descriptor lists must be; records need 32).
#[repr(C, align(64))]
pub(super) struct SlotMem {
    descs: [Descriptor; MAX_BATCH_PAGES],
    batch_descs: [Descriptor; MAX_CHUNKS],
    recs: [CompletionRecord; MAX_BATCH_PAGES],
    batch_recs: [CompletionRecord; MAX_CHUNKS],
}

/// A record whose status says a chunk is finished.
#[derive(Clone, Copy, Debug)]
pub(super) enum Watch {
    /// A lone COMPVAL: its own record (the page's index).
    Single(usize),
    /// A BATCH: its batch record (written after all its descriptors'), by
    /// chunk index.
    Batch(usize),
}

/// Book-keeping of one submission, written by the submitter before the slot
/// is published and read-only afterwards.
pub(super) struct SlotMeta {
    pub(super) pages: [usize; MAX_BATCH_PAGES],
    pub(super) len: usize,
    /// Pages `..device_len` went to the device; the rest did not fit in the
    /// queue and were checked on the CPU at submission, into `cpu_zero`.
    pub(super) device_len: usize,
    /// Bit i set = page i (>= `device_len`) is zero.
    pub(super) cpu_zero: u128,
    pub(super) watch: Vec<Watch>,
    pub(super) queue: usize,
    pub(super) reserved: u32,
    pub(super) submitted_at: Instant,
}

/// One slot: its device memory, its book-keeping and its state.
pub(super) struct Slot {
    /// Its position in the engine's slot array, the index tickets carry.
    pub(super) index: u32,
    pub(super) mem: *mut SlotMem,
    pub(super) meta: UnsafeCell<SlotMeta>,
    pub(super) state: AtomicU8,
    pub(super) generation: AtomicU32,
    pub(super) timed_out: AtomicBool,
    pub(super) waiter: Mutex<Option<Thread>>,
}

/// Raw pointers to the four arrays of a slot's memory.
pub(super) struct SlotArrays {
    pub(super) descs: *mut Descriptor,
    pub(super) batch_descs: *mut Descriptor,
    pub(super) recs: *mut CompletionRecord,
    pub(super) batch_recs: *mut CompletionRecord,
}

impl Slot {
    pub(super) fn new(index: u32) -> Self {
        let mem = Box::new(SlotMem {
            descs: [Descriptor::default(); MAX_BATCH_PAGES],
            batch_descs: [Descriptor::default(); MAX_CHUNKS],
            recs: [CompletionRecord::default(); MAX_BATCH_PAGES],
            batch_recs: [CompletionRecord::default(); MAX_CHUNKS],
        });
        Slot {
            index,
            mem: Box::into_raw(mem),
            meta: UnsafeCell::new(SlotMeta {
                pages: [0; MAX_BATCH_PAGES],
                len: 0,
                device_len: 0,
                cpu_zero: 0,
                watch: Vec::with_capacity(MAX_BATCH_PAGES),
                queue: 0,
                reserved: 0,
                submitted_at: Instant::now(),
            }),
            state: AtomicU8::new(FREE),
            generation: AtomicU32::new(0),
            timed_out: AtomicBool::new(false),
            waiter: Mutex::new(None),
        }
    }

    /// Pointers to the slot's arrays. Raw pointers only: once a chunk is
    /// submitted the device reads descriptors and writes records
    /// concurrently, so a `&mut SlotMem` would be aliased.
    pub(super) fn arrays(&self) -> SlotArrays {
        let mem = self.mem;
        // SAFETY: `mem` is the slot's live allocation; addr_of_mut! projects
        // fields without creating references.
        unsafe {
            SlotArrays {
                descs: addr_of_mut!((*mem).descs).cast::<Descriptor>(),
                batch_descs: addr_of_mut!((*mem).batch_descs).cast::<Descriptor>(),
                recs: addr_of_mut!((*mem).recs).cast::<CompletionRecord>(),
                batch_recs: addr_of_mut!((*mem).batch_recs).cast::<CompletionRecord>(),
            }
        }
    }

    pub(super) fn rec(&self, i: usize) -> *const CompletionRecord {
        // SAFETY: in-bounds projection of the slot's live allocation; no
        // reference is created, so concurrent device writes are not aliased.
        unsafe {
            addr_of_mut!((*self.mem).recs)
                .cast::<CompletionRecord>()
                .add(i)
        }
    }

    fn batch_rec(&self, c: usize) -> *const CompletionRecord {
        // SAFETY: as in `rec`.
        unsafe {
            addr_of_mut!((*self.mem).batch_recs)
                .cast::<CompletionRecord>()
                .add(c)
        }
    }

    pub(super) fn watch_rec(&self, w: Watch) -> *const CompletionRecord {
        match w {
            Watch::Single(i) => self.rec(i),
            Watch::Batch(c) => self.batch_rec(c),
        }
    }
}

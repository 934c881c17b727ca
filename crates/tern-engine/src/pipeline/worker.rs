//! The worker threads: classify and encode a batch, hand it to the
//! least-loaded sender (a channel stream's batch: to a channel whose stream
//! is free, compressed with it).

use std::sync::{MutexGuard, PoisonError, TryLockError};
use std::thread;

use tern_page::PageCompressor;
use tern_page::cpu_time::thread_cpu_ns;
use tern_wire::{MAX_PAGES_PER_PACKET, PageKind};

use super::Shared;
use super::batch::{Batch, SendItem};
use super::dedup::IndexedPage;
use super::encode::{build_table, compress_in_stream, encode};
use super::reuse::publish;
use super::scratch::Scratch;
use crate::stats::thread_cpu_seconds;

pub(super) fn run_worker(shared: &Shared, index: usize) {
    let cpu_start = thread_cpu_seconds();
    let mut scratch = Scratch::default();
    let mut published = Vec::with_capacity(MAX_PAGES_PER_PACKET);
    let bell = shared.worker_bells[index].wait();
    let ring = &shared.worker_rings[index];
    loop {
        let mut item = None;
        bell.wait_until(|| {
            item = ring.pop();
            item.is_some() || shared.is_stopping()
        });
        let Some(mut batch) = item else { break };
        shared.producer_bell.ring();
        let encode_started = thread_cpu_ns();
        encode(shared, &mut batch, &mut scratch);
        // A stream's packets must reach its channel in the order they
        // were compressed: its stream is held from compressing to queueing.
        let (target, stream) = if batch.codec.is_stream() {
            let (target, mut stream) = lock_stream(shared, batch.reuse.route, index);
            compress_in_stream(shared, &mut batch, &mut scratch.pointers, &mut stream);
            build_table(shared, &mut batch);
            (target, Some(stream))
        } else {
            let route = batch.reuse.route;
            (
                route.unwrap_or_else(|| least_loaded_sender(shared, index)),
                None,
            )
        };
        batch.encode_cpu_ns = thread_cpu_ns().saturating_sub(encode_started);
        let queued = queue(shared, batch, target, &mut published);
        drop(stream);
        if !queued {
            return;
        }
    }
    shared
        .stats
        .record_cpu(&format!("worker-{index}"), thread_cpu_seconds() - cpu_start);
}

/// Puts `batch` on channel `target`'s ring and wakes its sender; `false`
/// when the pipeline stops first.
fn queue(
    shared: &Shared,
    batch: Box<Batch>,
    target: usize,
    published: &mut Vec<(u64, IndexedPage)>,
) -> bool {
    indexable_pages(shared, &batch, target, published);
    let mut item = SendItem::Batch(batch);
    loop {
        match shared.sender_rings[target].push(item) {
            Ok(()) => break,
            Err(back) => {
                // Cannot happen while rings hold the whole pool; stay
                // correct anyway.
                if shared.is_stopping() {
                    return false;
                }
                item = back;
                thread::yield_now();
            }
        }
    }
    // Only now that the batch is queued on its channel may a later
    // batch reference its pages (routed to the same channel).
    publish(shared, published);
    if let Some(bell) = shared.sender_bells[target].get() {
        bell.ring();
    }
    true
}

/// The channel a stream batch goes on and its stream, locked: the route
/// its duplicates need, else the least-loaded channel whose stream no
/// other worker holds (waiting for the least-loaded one when all are held).
fn lock_stream(
    shared: &Shared,
    route: Option<usize>,
    worker: usize,
) -> (usize, MutexGuard<'_, Option<PageCompressor>>) {
    let lock = |channel: usize| {
        shared.streams[channel]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    };
    if let Some(channel) = route {
        return (channel, lock(channel));
    }
    let first = least_loaded_sender(shared, worker);
    let channels = shared.streams.len();
    for offset in 0..channels {
        let channel = (first + offset) % channels;
        match shared.streams[channel].try_lock() {
            Ok(stream) => return (channel, stream),
            Err(TryLockError::Poisoned(poisoned)) => return (channel, poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => {}
        }
    }
    (first, lock(first))
}

pub(super) fn least_loaded_sender(shared: &Shared, worker: usize) -> usize {
    let senders = shared.sender_rings.len();
    let mut best = worker % senders;
    let mut best_len = shared.sender_rings[best].len();
    for offset in 1..senders {
        let candidate = (worker + offset) % senders;
        let len = shared.sender_rings[candidate].len();
        if len < best_len {
            best = candidate;
            best_len = len;
        }
    }
    best
}

/// The batch's pages a later batch may reference, with their hashes: those
/// the destination gets the bytes of (not zero pages, not duplicates).
fn indexable_pages(
    shared: &Shared,
    batch: &Batch,
    channel: usize,
    pages: &mut Vec<(u64, IndexedPage)>,
) {
    pages.clear();
    if shared.dedup.is_none() {
        return;
    }
    for (position, entry) in batch.entries.iter().enumerate() {
        if matches!(entry.kind, PageKind::Zero | PageKind::Duplicate) {
            continue;
        }
        pages.push((
            batch.reuse.hashes[position],
            IndexedPage {
                region: batch.region,
                page: entry.page_index,
                channel,
                iteration: batch.iteration,
            },
        ));
    }
}

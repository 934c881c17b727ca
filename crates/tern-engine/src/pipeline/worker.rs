//! The worker threads: classify and encode a batch, hand it to the
//! least-loaded sender.

use std::thread;

use tern_page::cpu_time::thread_cpu_ns;
use tern_wire::{MAX_PAGES_PER_PACKET, PageKind};

use super::Shared;
use super::batch::{Batch, SendItem};
use super::dedup::IndexedPage;
use super::encode::encode;
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
        batch.encode_cpu_ns = thread_cpu_ns().saturating_sub(encode_started);
        let target = batch
            .reuse
            .route
            .unwrap_or_else(|| least_loaded_sender(shared, index));
        indexable_pages(shared, &batch, target, &mut published);
        let mut item = SendItem::Batch(batch);
        loop {
            match shared.sender_rings[target].push(item) {
                Ok(()) => break,
                Err(back) => {
                    // Cannot happen while rings hold the whole pool; stay
                    // correct anyway.
                    if shared.is_stopping() {
                        return;
                    }
                    item = back;
                    thread::yield_now();
                }
            }
        }
        // Only now that the batch is queued on its channel may a later
        // batch reference its pages (routed to the same channel).
        publish(shared, &published);
        if let Some(bell) = shared.sender_bells[target].get() {
            bell.ring();
        }
    }
    shared
        .stats
        .record_cpu(&format!("worker-{index}"), thread_cpu_seconds() - cpu_start);
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

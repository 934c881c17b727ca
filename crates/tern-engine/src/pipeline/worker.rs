//! The worker loop: takes batches from its ring, encodes them and hands
//! them to the least-loaded sender.

use std::thread;

use super::encode::{Scratch, encode};
use super::{SendItem, Shared};
use crate::stats::thread_cpu_seconds;

pub(super) fn run_worker(shared: &Shared, index: usize) {
    let cpu_start = thread_cpu_seconds();
    let mut scratch = Scratch::default();
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
        encode(shared, &mut batch, &mut scratch);
        let target = least_loaded_sender(shared, index);
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
        if let Some(bell) = shared.sender_bells[target].get() {
            bell.ring();
        }
    }
    shared
        .stats
        .record_cpu(&format!("worker-{index}"), thread_cpu_seconds() - cpu_start);
}

fn least_loaded_sender(shared: &Shared, worker: usize) -> usize {
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

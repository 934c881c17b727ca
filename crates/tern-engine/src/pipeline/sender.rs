//! The channel senders: one thread per page channel writes each batch
//! (header, table and pages straight from guest memory) and the syncs.

use std::sync::atomic::Ordering;
use std::time::Instant;

use tern_wire::{MAX_PAGES_PER_PACKET, Message, PageKind};

use super::Shared;
use super::batch::{Batch, Completion, SendItem, page_ptr};
use crate::error::{ChannelError, MigrationError};
use crate::guest::PAGE_SIZE;
use crate::stats::thread_cpu_seconds;
use crate::transport::{Channel, Segment};
use crate::zerocopy::{ZeroCopyError, ZeroCopyStats, ZeroCopyTransport};

/// How a sender writes its channel.
pub(crate) enum PageSender {
    /// `sendmsg` copying from guest memory.
    Plain(Channel),
    /// Zero-copy sends from guest memory (`MSG_ZEROCOPY` or io_uring).
    ZeroCopy(Box<dyn ZeroCopyTransport>),
}

impl PageSender {
    pub(crate) fn channel(&self) -> &Channel {
        match self {
            Self::Plain(channel) => channel,
            Self::ZeroCopy(sender) => sender.channel(),
        }
    }

    /// Zero-copy accounting, for the zero-copy variants.
    pub(super) fn zero_copy_stats(&self) -> Option<ZeroCopyStats> {
        match self {
            Self::Plain(_) => None,
            Self::ZeroCopy(sender) => Some(sender.stats()),
        }
    }

    pub(super) fn write_control(&mut self, bytes: &[u8]) -> Result<(), ChannelError> {
        match self {
            Self::Plain(channel) => channel.write_all(bytes),
            Self::ZeroCopy(sender) => {
                // Everything sent before a sync completes before it: at each
                // iteration's end and before switch-over nothing is pending.
                sender.flush().map_err(ZeroCopyError::into_channel_error)?;
                sender.channel_mut().write_all(bytes)
            }
        }
    }
}

pub(super) fn run_sender(shared: &Shared, index: usize, mut channel: PageSender) {
    let cpu_start = thread_cpu_seconds();
    let bell = shared.sender_bells[index].wait();
    let ring = &shared.sender_rings[index];
    let mut segments: Vec<Segment> = Vec::with_capacity(MAX_PAGES_PER_PACKET + 1);
    // Zero-copy counters as published at the last sync.
    let mut at_last_sync = ZeroCopyStats::default();
    loop {
        let mut item = None;
        bell.wait_until(|| {
            item = ring.pop();
            item.is_some() || shared.is_stopping()
        });
        let Some(item) = item else { break };
        let result = match item {
            SendItem::Batch(batch) => {
                let started = Instant::now();
                if let Some(queue) = &shared.link_queue {
                    queue.sample(index, channel.channel().raw_fd());
                }
                shared.limiter.acquire(batch.wire_bytes);
                let result = send_batch(shared, &mut channel, &batch, &mut segments);
                shared.sender_busy_ns.fetch_add(
                    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
                    Ordering::Relaxed,
                );
                if result.is_ok() {
                    shared.stats.add_sent(batch.wire_bytes, batch.paused, true);
                    let _ = shared.completions.push(Completion::Batch(batch));
                }
                result
            }
            SendItem::Sync(sync) => {
                let bytes = Message::Sync(sync).to_bytes();
                let result = channel.write_control(&bytes);
                if result.is_ok() {
                    shared.stats.add_sent(bytes.len() as u64, sync.last, true);
                    publish_zero_copy_at_sync(shared, index, &channel, &mut at_last_sync);
                    let _ = shared.completions.push(Completion::Synced);
                }
                result
            }
        };
        if let Err(error) = result {
            shared.fail(MigrationError::channel(index + 1)(error));
            break;
        }
        shared.producer_bell.ring();
    }
    if let Some(zero_copy) = channel.zero_copy_stats() {
        let at_end = zero_copy.with_sync_fields_of(&at_last_sync);
        shared.stats.publish_zero_copy(index, &at_end);
    }
    shared
        .stats
        .record_cpu(&format!("sender-{index}"), thread_cpu_seconds() - cpu_start);
}

/// After a sync on a zero-copy channel (every send before it completed:
/// the sync's write flushed them), publishes the channel's counters with
/// what the iteration just ended added up to, copied sends included.
fn publish_zero_copy_at_sync(
    shared: &Shared,
    index: usize,
    channel: &PageSender,
    at_last_sync: &mut ZeroCopyStats,
) {
    if let Some(now) = channel.zero_copy_stats() {
        *at_last_sync = now.at_sync(at_last_sync);
        shared.stats.publish_zero_copy(index, at_last_sync);
    }
}

pub(super) fn send_batch(
    shared: &Shared,
    channel: &mut PageSender,
    batch: &Batch,
    segments: &mut Vec<Segment>,
) -> Result<(), ChannelError> {
    batch_segments(shared, batch, segments);
    match channel {
        // SAFETY: the prefix and the other buffers live in the batch, which
        // outlives the call; page pointers come from `page_ptr`, inside the
        // region's mapping, which outlives the migration. Concurrent guest
        // writes are acceptable (see `send_vectored`).
        PageSender::Plain(channel) => unsafe { channel.send_vectored(segments) },
        // SAFETY: as above; the data segments point into guest memory,
        // which stays mapped until the sender flushes at the next sync.
        PageSender::ZeroCopy(sender) => unsafe {
            sender
                .send(&batch.prefix, &segments[1..])
                .map_err(ZeroCopyError::into_channel_error)
        },
    }
}

/// The batch's packet as pieces to write in order: its prefix (header and
/// table), then each page's payload (guest memory for a raw page, the
/// batch's buffers for the others), adjacent pieces joined.
pub(super) fn batch_segments(shared: &Shared, batch: &Batch, segments: &mut Vec<Segment>) {
    let region = &shared.regions[batch.region];
    segments.clear();
    segments.push(Segment {
        ptr: batch.prefix.as_ptr(),
        len: batch.prefix.len(),
    });
    let mut compressed_offset = 0;
    let mut duplicates_offset = 0;
    let mut deltas_offset = 0;
    let from_buffer = |buffer: &[u8], offset: &mut usize, len: usize| {
        let bytes = &buffer[*offset..*offset + len];
        *offset += len;
        (bytes.as_ptr(), len)
    };
    for (position, entry) in batch.entries.iter().enumerate() {
        let len = entry.encoded_len as usize;
        let (ptr, len) = match entry.kind {
            PageKind::Zero => continue,
            // With the delta cache the copy is what was cached, so it is
            // what must go.
            PageKind::Raw => match batch.reuse.copy(position) {
                Some(copy) => (copy.as_ptr(), PAGE_SIZE),
                None => (page_ptr(region, entry.page_index), PAGE_SIZE),
            },
            PageKind::Compressed => {
                from_buffer(&batch.compressed.data, &mut compressed_offset, len)
            }
            PageKind::Duplicate => {
                from_buffer(&batch.reuse.duplicates, &mut duplicates_offset, len)
            }
            PageKind::Delta => from_buffer(&batch.reuse.deltas, &mut deltas_offset, len),
        };
        // Adjacent pieces (neighbouring guest pages, or compressed pages
        // packed back to back) go out as one iovec.
        let has_payload_segment = segments.len() > 1;
        match segments.last_mut() {
            Some(last) if has_payload_segment && last.ptr.wrapping_add(last.len) == ptr => {
                last.len += len;
            }
            _ => segments.push(Segment { ptr, len }),
        }
    }
}

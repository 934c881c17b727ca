//! The pool's state, below both the decode step (`decode.rs`) and the
//! state receivers share (`shared.rs`, which owns the pool): the landings a
//! packet reads into and the rings and counters that move them between
//! receivers and decoder threads. What runs on them is in `decode.rs`.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use tern_wire::{MAX_PAGES_PER_PACKET, PageEntry, PageKind, codec_id};

use crate::guest::PAGE_SIZE;
use crate::ring::{Doorbell, Ring};
use crate::transport::Segment;

/// Landings each receiver owns when a pool decodes: enough to keep every
/// decoder busy while the receiver reads the next packet, few enough that
/// a channel holds at most this many packets' compressed bytes (512 KiB
/// each) in memory.
const LANDINGS_PER_RECEIVER: usize = 4;

/// One packet on its way into guest memory: where each page goes and the
/// compressed bytes still to decode.
pub(super) struct Landing {
    /// The receiver that owns this landing (its buffers and its place in
    /// the iteration barrier).
    pub(super) owner: usize,
    /// The channel the packet came on, for error messages.
    pub(super) channel: usize,
    pub(super) region_index: usize,
    pub(super) region_id: u32,
    pub(super) codec: u8,
    /// The packet header's dictionary byte: the dictionary the packet
    /// names (0: none), or a channel stream's restart flag.
    pub(super) dictionary: u8,
    /// The packet's table.
    pub(super) entries: Vec<PageEntry>,
    /// Each entry's page in guest memory.
    pub(super) pages: Vec<*mut u8>,
    /// The `readv` segments: raw pages, then slices of `compressed`.
    pub(super) segments: Vec<Segment>,
    /// Compressed payloads land here, then decode straight into their page.
    pub(super) compressed: Vec<u8>,
    /// With a userfaultfd: raw pages no packet has written yet land here
    /// (the bounce buffer, allocated on first use), to be placed whole
    /// with `UFFDIO_COPY` (`userfault.rs`).
    pub(super) staging: Vec<u8>,
    /// Each staged page's place in guest memory, in staging order.
    pub(super) staged: Vec<*mut u8>,
}

// SAFETY: the pointers are whole guest pages this landing's packet claimed
// for the current iteration and slices of its own buffer. A landing is
// used by one thread at a time: it moves between threads through the
// pool's rings, whose push and pop order every access before the hand-off
// before every access after it.
unsafe impl Send for Landing {}

impl Landing {
    pub(super) fn new(owner: usize) -> Self {
        Self {
            owner,
            channel: owner + 1,
            region_index: 0,
            region_id: 0,
            codec: 0,
            dictionary: 0,
            entries: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            pages: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            segments: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            compressed: vec![0; MAX_PAGES_PER_PACKET * PAGE_SIZE],
            staging: Vec::new(),
            staged: Vec::with_capacity(MAX_PAGES_PER_PACKET),
        }
    }

    /// Where the payload goes, in the order of the stream.
    pub(super) fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Whether landing this packet costs more than hashing its raw pages:
    /// then it is worth handing to the pool.
    pub(super) fn needs_decoding(&self) -> bool {
        self.entries
            .iter()
            .any(|entry| entry.kind == PageKind::Compressed)
    }

    /// The dictionary the packet names (0: none, or a codec that takes
    /// none).
    pub(super) fn named_dictionary(&self) -> u8 {
        codec_id::named_dictionary(self.codec, self.dictionary)
    }

    /// Whether this packet's compressed pages, if it has any, continue its
    /// channel's stream ([`codec_id::ZSTD_STREAM`]): then only the
    /// channel's own decoder, fed its packets in order, can decode them, so
    /// the packet lands on its receiver, never in the pool.
    pub(super) fn continues_a_stream(&self) -> bool {
        self.codec == codec_id::ZSTD_STREAM
    }

    /// Whether a page of this packet copies another page (a duplicate):
    /// the page it copies may be in an earlier packet of this receiver, so
    /// this one lands only after all of those have.
    pub(super) fn copies_pages(&self) -> bool {
        self.entries
            .iter()
            .any(|entry| entry.kind == PageKind::Duplicate)
    }
}

/// The decoder threads' shared state: the ring of packets waiting to be
/// decoded and each receiver's landings.
pub(super) struct DecodePool {
    /// Decoder threads; 0: every receiver lands its own packets.
    pub(super) threads: usize,
    /// Read packets waiting for their decode step, from every receiver.
    pub(super) queued: Ring<Box<Landing>>,
    /// Each receiver's landings not in use.
    pub(super) free: Vec<Ring<Box<Landing>>>,
    /// Each receiver's landings queued or being decoded.
    pub(super) in_flight: Vec<AtomicUsize>,
    pub(super) decoder_bells: Vec<OnceLock<Doorbell>>,
    pub(super) receiver_bells: Vec<OnceLock<Doorbell>>,
    /// Set once every receiver has ended: the decoders finish.
    pub(super) closed: AtomicBool,
    /// CPU nanoseconds of the decoder threads, added as each ends.
    pub(super) cpu_nanos: AtomicU64,
}

impl DecodePool {
    /// A pool of `threads` decoders for `receivers` receivers.
    pub(super) fn new(receivers: usize, threads: usize) -> Self {
        let landings = if threads == 0 {
            1
        } else {
            LANDINGS_PER_RECEIVER
        };
        let free = (0..receivers)
            .map(|owner| {
                let ring = Ring::new(landings);
                for _ in 0..landings {
                    // A fresh ring of this capacity has room for each.
                    let _ = ring.push(Box::new(Landing::new(owner)));
                }
                ring
            })
            .collect();
        Self {
            threads,
            queued: Ring::new(receivers * landings),
            free,
            in_flight: (0..receivers).map(|_| AtomicUsize::new(0)).collect(),
            decoder_bells: (0..threads).map(|_| OnceLock::new()).collect(),
            receiver_bells: (0..receivers).map(|_| OnceLock::new()).collect(),
            closed: AtomicBool::new(false),
            cpu_nanos: AtomicU64::new(0),
        }
    }

    /// The number of decoder threads to start.
    pub(super) fn threads(&self) -> usize {
        self.threads
    }

    /// CPU seconds the decoder threads used.
    pub(super) fn cpu_seconds(&self) -> f64 {
        self.cpu_nanos.load(Ordering::Relaxed) as f64 / 1e9
    }

    /// Tells the decoders that no more packets come, and wakes them.
    pub(super) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for bell in self.decoder_bells.iter().filter_map(OnceLock::get) {
            bell.ring();
        }
    }
}

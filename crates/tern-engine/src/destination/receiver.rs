//! One page channel's receiver: read a packet (I/O and decoding), then
//! apply its entries to guest memory (no I/O).
//!
//! The protocol decoder has validated a packet before any of its bytes
//! reach memory: its region exists (and the destination's region of that
//! index has the setup's size, see `check_layout`), every page index is
//! inside the region, every length matches its kind, the codec was
//! announced (so it has a decompressor), and the lengths add up to the
//! payload. What remains to check here is what the decoder cannot know:
//! the order of packets and syncs (the page channel's state machine, see
//! `order.rs`), that no page of the packet was written in this iteration
//! already, on this channel or another (the shared page claims), and
//! whether a compressed page decodes.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tern_page::codec::CodecId;
use tern_wire::{Event, FrameDecoder, FrameKind, Message, PageEntry, PageKind, PagePacket, Sync};

use super::decode::{Decompressors, ReceiverLanding};
use super::handshake::peer_aborted;
use super::order::{PageChannelEvent, PageChannelState};
use super::reuse::WrittenHere;
use super::shared::ReceiverShared;
use super::stream::{FrameSource, read_event};
use crate::error::{ChannelError, MigrationError};
use crate::switch_over_timeline::StepMark;

/// What a page channel carries.
const PAGE_CHANNEL_FRAMES: &[FrameKind] = &[FrameKind::Pages, FrameKind::Sync, FrameKind::Abort];

/// Receives page channel `index + 1` until its last sync; returns the final
/// iteration.
pub(super) fn receive_pages(
    shared: &ReceiverShared<'_>,
    index: usize,
    mut source: impl FrameSource,
    codecs: &[CodecId],
) -> Result<u32, MigrationError> {
    let mut receiver = PageReceiver::new(shared, index, codecs)?;
    loop {
        shared.wait_for_data(&source, receiver.channel)?;
        match receiver.read_packet(&mut source)? {
            Packet::Pages(packet) => {
                let unread = source.unread_bytes();
                let rest = u64::try_from(packet.payload_len).unwrap_or(u64::MAX);
                shared.stats.lag.record(index, unread, rest, Instant::now());
                if receiver.iteration_began.is_none() {
                    receiver.iteration_began = Some(StepMark::now().with_queued(unread));
                }
                receiver.receive_packet(&mut source, &packet)?;
            }
            Packet::Sync(sync) => {
                let unread = source.unread_bytes();
                shared.stats.lag.record_sync(index, unread, Instant::now());
                let read = StepMark::now().with_queued(unread);
                receiver.end_iteration(sync, read)?;
            }
        }
        if let PageChannelState::Ended(last) = receiver.state {
            refuse_trailing_bytes(&mut source, receiver.channel)?;
            receiver.log_offload();
            return Ok(last);
        }
    }
}

/// A page channel's decoder: pages, syncs and aborts only, and packets
/// that may name any dictionary a session can have (protocol 13: one the
/// main channel delivers during the pass; the receiver waits for it, see
/// `SessionDictionaries::put_named_in_force`).
fn page_channel_decoder(shared: &ReceiverShared<'_>) -> FrameDecoder {
    let mut decoder = FrameDecoder::with_setup(shared.setup.clone())
        .only(PAGE_CHANNEL_FRAMES, "pages or a sync on a page channel");
    decoder.allow_dictionaries(tern_wire::MAX_DICTIONARIES);
    decoder
}

/// Nothing may follow a page channel's last sync. What has arrived by then
/// is checked (a correct source sends nothing more, so this never refuses
/// one); what comes later is never read.
fn refuse_trailing_bytes(
    source: &mut impl FrameSource,
    channel: usize,
) -> Result<(), MigrationError> {
    if source.wait_readable(Duration::ZERO).unwrap_or(false) {
        let mut byte = [0u8; 1];
        // The end of the stream, or an error, is what a closing source
        // gives; a byte is a message after the last sync.
        if source.read_exact(&mut byte).is_ok() {
            return Err(MigrationError::Protocol(format!(
                "channel {channel}: data after the last sync"
            )));
        }
    }
    Ok(())
}

/// What a page channel delivers, once decoded.
enum Packet {
    /// Pages of the current iteration; the payload is still to be read.
    Pages(PagePacket),
    /// The end of an iteration.
    Sync(Sync),
}

struct PageReceiver<'s, 'a> {
    shared: &'s ReceiverShared<'a>,
    /// Receiver number, from 0.
    index: usize,
    /// The channel's index in the protocol: `index + 1`.
    channel: usize,
    state: PageChannelState,
    decoder: FrameDecoder,
    /// This receiver's packet buffers and its side of the decoder pool.
    landing: ReceiverLanding,
    /// The pages this receiver's packets wrote in the current iteration,
    /// which its later duplicates may copy.
    written: WrittenHere,
    /// When the current iteration's first packet came, for the
    /// switch-over's timeline should the iteration be the last.
    iteration_began: Option<StepMark>,
    /// When the previous iteration's sync was read, and the one before.
    previous_sync_read: Option<StepMark>,
    second_last_sync_read: Option<StepMark>,
}

impl PageReceiver<'_, '_> {
    fn log_offload(&self) {
        self.landing.log_offload();
    }
}

impl<'s, 'a> PageReceiver<'s, 'a> {
    fn new(
        shared: &'s ReceiverShared<'a>,
        index: usize,
        codecs: &[CodecId],
    ) -> Result<Self, MigrationError> {
        let decompressors = Decompressors::new(codecs, shared)?;
        Ok(Self {
            shared,
            index,
            channel: index + 1,
            state: PageChannelState::Iteration(0),
            decoder: page_channel_decoder(shared),
            landing: ReceiverLanding::new(shared, index, decompressors),
            written: WrittenHere::new(shared),
            iteration_began: None,
            previous_sync_read: None,
            second_last_sync_read: None,
        })
    }

    /// Reads and decodes the next frame, up to a packet's page table.
    fn read_packet(&mut self, source: &mut impl FrameSource) -> Result<Packet, MigrationError> {
        let channel = self.channel;
        let event =
            read_event(source, &mut self.decoder).map_err(MigrationError::channel(channel))?;
        let packet = match event {
            Event::Pages(packet) => {
                self.advance(PageChannelEvent::Pages {
                    iteration: packet.header.iteration,
                })?;
                let shared = self.shared;
                shared.dictionaries.put_named_in_force(
                    packet.header.named_dictionary(),
                    shared.io_timeout(),
                    || shared.check_failed(),
                )?;
                Packet::Pages(packet)
            }
            Event::Message(Message::Sync(sync)) => Packet::Sync(sync),
            Event::Message(Message::Abort(abort)) => return Err(peer_aborted(abort)),
            // The decoder refuses every other kind at its header.
            Event::Message(other) => {
                return Err(MigrationError::channel(channel)(ChannelError::Protocol(
                    tern_wire::WireError::Unexpected {
                        got: other.kind(),
                        expected: "pages or a sync on a page channel",
                    },
                )));
            }
        };
        self.shared
            .stats
            .received
            .fetch_add(self.decoder.frame_len() as u64, Ordering::Relaxed);
        Ok(packet)
    }

    /// Moves the channel's state machine on, or refuses `event`.
    fn advance(&mut self, event: PageChannelEvent) -> Result<(), MigrationError> {
        self.state = self
            .state
            .next(event, self.shared.final_iteration())
            .map_err(|refusal| {
                MigrationError::Protocol(format!("channel {}: {refusal}", self.channel))
            })?;
        Ok(())
    }

    /// The iteration the channel is in.
    fn iteration(&self) -> u32 {
        match self.state {
            PageChannelState::Iteration(iteration) | PageChannelState::Ended(iteration) => {
                iteration
            }
        }
    }

    /// Reads a packet's payload into place and hands it to the decode
    /// step (here or on the decoder pool).
    fn receive_packet(
        &mut self,
        source: &mut impl FrameSource,
        packet: &PagePacket,
    ) -> Result<(), MigrationError> {
        let started = Instant::now();
        let mut landing = self.landing.take(self.shared)?;
        let entries = self.decoder.entries();
        let page_count = entries.len() as u64;
        landing.place(self.shared, packet, entries)?;
        claim_pages(self.shared, self.channel, packet, entries, self.iteration())?;
        landing.populate_raw_pages(self.shared);
        let before_read = Instant::now();
        // SAFETY: `place` made every segment either a whole page inside the
        // region (bounds-checked by `page_ptr`) or a slice of one of the
        // landing's own buffers, which this receiver holds. Each of those
        // pages was claimed by this receiver just above, and claims are
        // released only at the iteration's barrier, which this receiver has
        // not reached: so no other thread writes the page during the read.
        // (The guest is not running on the destination, so it does not
        // touch it either.) Fresh pages are read into the bounce buffer and
        // placed right after (`place_staged`), so the read touches none.
        unsafe { source.read_scattered(landing.segments()) }
            .map_err(MigrationError::channel(self.channel))?;
        // The packet, header to payload, was one transfer.
        source.end_transfer();
        // The wait for the bytes is the link's, which the source measures.
        let read = before_read.elapsed();
        landing.place_staged(self.shared)?;
        // Marked now, read only by a later packet's duplicates, which land
        // after every packet before them (`hand_off`).
        for entry in entries.iter().filter(|entry| entry.kind != PageKind::Zero) {
            self.written
                .set(packet.region_index, u64::from(entry.page_index));
        }
        self.decoder.consume_payload(packet.payload_len);
        let handed = self.landing.hand_off(self.shared, landing, &self.written);
        self.shared
            .stats
            .placing
            .record(started.elapsed().saturating_sub(read), page_count);
        handed
    }

    /// Ends the current iteration: every receiver waits for the others, so
    /// no page of the next iteration lands before all of this one, and all
    /// must agree on whether it was the last.
    fn end_iteration(&mut self, sync: Sync, sync_read: StepMark) -> Result<(), MigrationError> {
        let iteration = self.iteration();
        let last = sync.last;
        // What a sync promises: every page before it is in memory. The
        // wait is the decoders' lag behind this receiver: placing time.
        let waited = Instant::now();
        self.landing.wait_landed(self.shared)?;
        self.shared.stats.placing.record(waited.elapsed(), 0);
        let landed = last.then(StepMark::now);
        self.advance(PageChannelEvent::Sync {
            iteration: sync.iteration,
            last: sync.last,
        })?;
        self.shared.end_iteration(iteration, sync)?;
        let began = self.iteration_began.take();
        let previous = self.previous_sync_read.replace(sync_read.clone());
        let second_last = std::mem::replace(&mut self.second_last_sync_read, previous.clone());
        if let Some(landed) = landed {
            let timeline = &self.shared.stats.timeline;
            let index = self.index;
            if let Some(second_last) = second_last {
                timeline.record(
                    format!("receiver-{index}-second-last-sync-read"),
                    second_last,
                );
            }
            if let Some(previous) = previous {
                timeline.record(format!("receiver-{index}-previous-sync-read"), previous);
            }
            if let Some(began) = began {
                timeline.record(format!("receiver-{index}-last-iteration-began"), began);
            }
            timeline.record(format!("receiver-{index}-last-sync-read"), sync_read);
            timeline.record(format!("receiver-{index}-landed"), landed);
            timeline.mark(format!("receiver-{index}-past-barrier"));
        }
        self.written.clear();
        if self.index == 0 {
            self.shared
                .stats
                .iteration
                .store(u64::from(iteration) + 1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Claims every page of `packet` for this receiver in the current
/// iteration, before any of its bytes is read: a page some packet of this
/// iteration carried already, on any channel (this one included), is the
/// peer's protocol error, and then nothing of the packet is written.
fn claim_pages(
    shared: &ReceiverShared<'_>,
    channel: usize,
    packet: &PagePacket,
    entries: &[PageEntry],
    iteration: u32,
) -> Result<(), MigrationError> {
    for entry in entries {
        if !shared.claim(packet.region_index, u64::from(entry.page_index)) {
            return Err(MigrationError::Protocol(format!(
                "channel {channel}: page {} of region {} arrived twice in iteration \
                 {iteration}, or after a duplicate read it",
                entry.page_index, packet.header.region_id
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! A receiver driven from a buffer instead of a socket: the whole page
    //! channel path (decoding, placement, apply) without I/O.

    use std::ptr::NonNull;
    use std::time::Duration;

    use tern_page::codec::PageCompressor;
    use tern_wire::{DigestAlgorithm, RegionInfo, SessionSetup, Sync, encode_pages_prefix};

    use super::*;
    use crate::destination::ReceiveStats;
    use crate::destination::test_memory::AnonymousMemory;
    use crate::guest::{MemoryRegion, PAGE_SIZE};
    use crate::source::CancelToken;
    use crate::transport::Segment;
    use tern_wire::{PageEntry, PageKind};

    /// A page channel's bytes held in memory.
    struct Buffer {
        bytes: Vec<u8>,
        read: usize,
    }

    impl Buffer {
        fn take(&mut self, len: usize) -> Result<&[u8], ChannelError> {
            let bytes = self
                .bytes
                .get(self.read..self.read + len)
                .ok_or(ChannelError::Closed)?;
            self.read += len;
            Ok(bytes)
        }
    }

    impl FrameSource for Buffer {
        fn wait_readable(&self, _: Duration) -> Result<bool, ChannelError> {
            Ok(true)
        }

        fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ChannelError> {
            buf.copy_from_slice(self.take(buf.len())?);
            Ok(())
        }

        unsafe fn read_scattered(&mut self, segments: &[Segment]) -> Result<(), ChannelError> {
            for segment in segments {
                let bytes = self.take(segment.len)?;
                // SAFETY: the caller's contract: `len` writable bytes that
                // nothing else accesses; `bytes` is our own buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        segment.ptr.cast_mut(),
                        bytes.len(),
                    )
                };
            }
            Ok(())
        }
    }

    const PAGES: usize = 8;

    fn setup() -> SessionSetup {
        SessionSetup {
            page_size: tern_wire::PAGE_SIZE,
            channel_count: 1,
            codecs: 1 << tern_wire::codec_id::ZSTD,
            digest: DigestAlgorithm::Xxh3Pages,
            regions: vec![RegionInfo {
                id: 5,
                guest_addr: 0,
                len: (PAGES * PAGE_SIZE) as u64,
            }],
            guest_kind: String::new(),
            dictionaries: 0,
            vmm_config_len: 0,
        }
    }

    fn sync(iteration: u32, last: bool) -> Vec<u8> {
        Message::Sync(Sync {
            iteration,
            last,
            dictionaries: 0,
        })
        .to_bytes()
    }

    /// Receives `stream` into a fresh guest of [`PAGES`] pages, each
    /// receiver decoding its own packets.
    fn receive(stream: Vec<u8>) -> (Result<u32, MigrationError>, Vec<u8>, ReceiveStats) {
        receive_with_decoders(stream, 0)
    }

    /// Receives `stream` with `decoders` decoder threads running beside
    /// the receiver, as `live.rs` starts them.
    fn receive_with_decoders(
        stream: Vec<u8>,
        decoders: usize,
    ) -> (Result<u32, MigrationError>, Vec<u8>, ReceiveStats) {
        let setup = setup();
        let mut memory = vec![0u8; PAGES * PAGE_SIZE];
        // SAFETY: `memory` is a writable allocation of that length that
        // outlives every use of the region below.
        let region = unsafe {
            MemoryRegion::new(
                5,
                0,
                NonNull::new(memory.as_mut_ptr()).unwrap(),
                memory.len() as u64,
            )
        };
        let regions = [region];
        let stats = ReceiveStats::default();
        let cancel = CancelToken::new();
        let result = {
            let shared = ReceiverShared::new(
                &setup,
                &regions,
                1,
                &stats,
                Duration::from_secs(30),
                &cancel,
            )
            .with_decode_threads(decoders);
            let source = Buffer {
                bytes: stream,
                read: 0,
            };
            let codecs = [CodecId::Zstd];
            std::thread::scope(|scope| {
                for index in 0..decoders {
                    let (shared, codecs) = (&shared, &codecs);
                    scope.spawn(move || shared.pool.run_decoder(index, shared, codecs));
                }
                let result = receive_pages(&shared, 0, source, &codecs);
                shared.pool.close();
                // A decoder records its failure, which the receiver then
                // sees as "another channel failed".
                result.map_err(|error| shared.first_failure().unwrap_or(error))
            })
        };
        (result, memory, stats)
    }

    /// Receives `stream` into a fresh anonymous mapping of [`PAGES`] pages
    /// registered with a userfaultfd, as a real session's guest memory is;
    /// `prepare` writes into it before the registration. `None` when this
    /// process has no userfaultfd.
    fn receive_registered(
        stream: Vec<u8>,
        decoders: usize,
        prepare: impl FnOnce(&mut [u8]),
    ) -> Option<(Result<u32, MigrationError>, Vec<u8>)> {
        let mut memory = AnonymousMemory::new(PAGES);
        prepare(memory.bytes_mut());
        let regions = [memory.region(5)];
        let (setup, stats, cancel) = (setup(), ReceiveStats::default(), CancelToken::new());
        let shared = ReceiverShared::new(
            &setup,
            &regions,
            1,
            &stats,
            Duration::from_secs(30),
            &cancel,
        )
        .with_decode_threads(decoders)
        .with_userfault();
        if shared.userfault.is_none() {
            println!("SKIPPED: no userfaultfd for this process");
            return None;
        }
        let codecs = [CodecId::Zstd];
        let result = std::thread::scope(|scope| {
            for index in 0..decoders {
                let (shared, codecs) = (&shared, &codecs);
                scope.spawn(move || shared.pool.run_decoder(index, shared, codecs));
            }
            let source = Buffer {
                bytes: stream,
                read: 0,
            };
            let result = receive_pages(&shared, 0, source, &codecs);
            shared.pool.close();
            result.map_err(|error| shared.first_failure().unwrap_or(error))
        });
        shared.release_userfault();
        drop(shared);
        Some((result, memory.bytes_mut().to_vec()))
    }

    #[test]
    fn fresh_pages_are_placed_through_a_userfaultfd_and_others_written_in_place() {
        for decoders in [0, 2] {
            let (text, compressed) = compressed_page("placed ");
            let mut stream = Vec::new();
            // Pages 1-2 raw and fresh (one run), 3 zero, 4 compressed and
            // fresh, 6 raw but written before the session, 7 raw and fresh.
            let entries = [
                (1, PageKind::Raw, PAGE_SIZE),
                (2, PageKind::Raw, PAGE_SIZE),
                (3, PageKind::Zero, 0),
                (4, PageKind::Compressed, compressed.len()),
                (6, PageKind::Raw, PAGE_SIZE),
                (7, PageKind::Raw, PAGE_SIZE),
            ]
            .map(|(page_index, kind, len)| PageEntry {
                page_index,
                kind,
                encoded_len: u32::try_from(len).unwrap(),
            });
            encode_pages_prefix(&mut stream, 5, 0, CodecId::Zstd.to_wire(), &entries);
            stream.extend_from_slice(&[0x11; PAGE_SIZE]);
            stream.extend_from_slice(&[0x22; PAGE_SIZE]);
            stream.extend_from_slice(&compressed);
            stream.extend_from_slice(&[0x66; PAGE_SIZE]);
            stream.extend_from_slice(&[0x77; PAGE_SIZE]);
            // Page 5, fresh, duplicates page 2.
            let duplicate = [PageEntry {
                page_index: 5,
                kind: PageKind::Duplicate,
                encoded_len: u32::try_from(tern_wire::PageRef::ENCODED_LEN).unwrap(),
            }];
            encode_pages_prefix(&mut stream, 5, 0, 0, &duplicate);
            let reference = tern_wire::PageRef {
                region_id: 5,
                page_index: 2,
            };
            stream.extend_from_slice(&reference.encode());
            stream.extend(sync(0, false));
            // Iteration 1: page 1 again (now present, read in place).
            let again = [PageEntry {
                page_index: 1,
                kind: PageKind::Raw,
                encoded_len: tern_wire::PAGE_SIZE,
            }];
            encode_pages_prefix(&mut stream, 5, 1, 0, &again);
            stream.extend_from_slice(&[0x99; PAGE_SIZE]);
            stream.extend(sync(1, true));

            let Some((result, memory)) = receive_registered(stream, decoders, |memory| {
                memory[6 * PAGE_SIZE..7 * PAGE_SIZE].fill(0xee)
            }) else {
                return;
            };
            assert_eq!(result.unwrap(), 1, "{decoders} decoders");
            let filled = |index: usize, byte: u8| page(&memory, index).iter().all(|&b| b == byte);
            assert!(
                filled(0, 0) && filled(3, 0),
                "untouched pages read as zeros"
            );
            assert!(filled(1, 0x99) && filled(2, 0x22) && filled(5, 0x22));
            assert!(filled(6, 0x66) && filled(7, 0x77));
            assert_eq!(page(&memory, 4), text.as_slice());
        }
    }

    /// `text` repeated to fill a page, and its zstd encoding.
    fn compressed_page(text: &str) -> (Vec<u8>, Vec<u8>) {
        let page: Vec<u8> = text.bytes().cycle().take(PAGE_SIZE).collect();
        let mut compressed = [0u8; tern_page::codec::MAX_COMPRESSED];
        let len = PageCompressor::new(CodecId::Zstd, 1)
            .unwrap()
            .compress(page.as_slice().try_into().unwrap(), &mut compressed)
            .expect("repeated text compresses");
        (page, compressed[..len].to_vec())
    }

    /// A packet of iteration `iteration` carrying `pages`, each compressed.
    fn compressed_packet(stream: &mut Vec<u8>, iteration: u32, pages: &[(u32, &[u8])]) {
        let entries: Vec<PageEntry> = pages
            .iter()
            .map(|&(page_index, bytes)| PageEntry {
                page_index,
                kind: PageKind::Compressed,
                encoded_len: u32::try_from(bytes.len()).unwrap(),
            })
            .collect();
        encode_pages_prefix(stream, 5, iteration, CodecId::Zstd.to_wire(), &entries);
        for (_, bytes) in pages {
            stream.extend_from_slice(bytes);
        }
    }

    fn page(memory: &[u8], index: usize) -> &[u8] {
        &memory[index * PAGE_SIZE..(index + 1) * PAGE_SIZE]
    }

    #[test]
    fn a_session_received_from_a_buffer() {
        for decoders in [0, 1, 2] {
            received_from_a_buffer_with(decoders);
        }
    }

    fn received_from_a_buffer_with(decoders: usize) {
        let text: Vec<u8> = b"tern ".iter().copied().cycle().take(PAGE_SIZE).collect();
        let mut compressed = [0u8; tern_page::codec::MAX_COMPRESSED];
        let len = PageCompressor::new(CodecId::Zstd, 1)
            .unwrap()
            .compress(text.as_slice().try_into().unwrap(), &mut compressed)
            .expect("repeated text compresses");
        let entries = [
            PageEntry {
                page_index: 1,
                kind: PageKind::Raw,
                encoded_len: tern_wire::PAGE_SIZE,
            },
            PageEntry {
                page_index: 2,
                kind: PageKind::Zero,
                encoded_len: 0,
            },
            PageEntry {
                page_index: 3,
                kind: PageKind::Compressed,
                encoded_len: u32::try_from(len).unwrap(),
            },
        ];
        let mut stream = Vec::new();
        encode_pages_prefix(&mut stream, 5, 0, CodecId::Zstd.to_wire(), &entries);
        stream.extend_from_slice(&[0xab; PAGE_SIZE]);
        stream.extend_from_slice(&compressed[..len]);
        stream.extend(sync(0, false));
        // Iteration 1: page 1 became zero, so it is cleared.
        let zero = [PageEntry {
            page_index: 1,
            kind: PageKind::Zero,
            encoded_len: 0,
        }];
        encode_pages_prefix(&mut stream, 5, 1, 0, &zero);
        stream.extend(sync(1, true));
        let stream_len = stream.len() as u64;

        let (result, memory, stats) = receive_with_decoders(stream, decoders);
        assert_eq!(result.unwrap(), 1);
        assert!(page(&memory, 1).iter().all(|&b| b == 0));
        assert_eq!(page(&memory, 3), text.as_slice());
        assert_eq!(stats.received_bytes(), stream_len);
        assert_eq!(stats.zero_pages.load(Ordering::Relaxed), 2);
        assert_eq!(stats.zero_pages_cleared.load(Ordering::Relaxed), 1);
        assert_eq!(stats.normal_pages.load(Ordering::Relaxed), 2);
        assert_eq!(stats.iterations_done(), 2);
    }

    #[test]
    fn the_decoder_pool_lands_every_iteration_before_its_sync() {
        // Every iteration rewrites every page with new content, one packet
        // per page, so two decoders hold pages of one iteration at once;
        // had a page of iteration i landed after the sync of i, it would
        // overwrite the newer copy of i + 1 (the claims are released at
        // the sync), and the last iteration's content would not all be
        // there at the end.
        const ITERATIONS: u32 = 40;
        let mut stream = Vec::new();
        let mut expected = Vec::new();
        for iteration in 0..ITERATIONS {
            expected.clear();
            for page in 0..u32::try_from(PAGES).unwrap() {
                let (plain, compressed) =
                    compressed_page(&format!("iteration {iteration} page {page} "));
                compressed_packet(&mut stream, iteration, &[(page, &compressed)]);
                expected.push(plain);
            }
            stream.extend(sync(iteration, iteration == ITERATIONS - 1));
        }
        let (result, memory, stats) = receive_with_decoders(stream, 2);
        assert_eq!(result.unwrap(), ITERATIONS - 1);
        for (index, plain) in expected.iter().enumerate() {
            assert_eq!(page(&memory, index), plain.as_slice(), "page {index}");
        }
        assert_eq!(
            stats.normal_pages.load(Ordering::Relaxed),
            u64::from(ITERATIONS) * PAGES as u64
        );
        assert_eq!(stats.iterations_done(), u64::from(ITERATIONS));
    }

    #[test]
    fn bad_compressed_input_on_a_decoder_is_a_clear_error_confined_to_its_page() {
        for decoders in [0, 2] {
            let (_, good) = compressed_page("tern ");
            let mut bad = good.clone();
            // Keep zstd's frame header, break the block that follows.
            for byte in &mut bad[6..] {
                *byte = 0xff;
            }
            let mut stream = Vec::new();
            compressed_packet(&mut stream, 0, &[(2, &good), (3, &bad), (4, &good)]);
            stream.extend(sync(0, true));
            let (result, memory, _) = receive_with_decoders(stream, decoders);
            let error = result.unwrap_err();
            assert!(matches!(error, MigrationError::Protocol(_)), "{error:?}");
            assert!(
                error.to_string().contains("channel 1: page 3 of region 5"),
                "{decoders} decoders: {error}"
            );
            // Nothing outside the pages of the packet was written, and
            // page 4, after the bad one, was not.
            for index in [0, 1, 4, 5, 6, 7] {
                assert!(page(&memory, index).iter().all(|&b| b == 0), "page {index}");
            }
        }
    }

    #[test]
    fn data_after_the_last_sync_is_refused() {
        let mut stream = sync(0, true);
        stream.extend(sync(1, true));
        let (result, _, _) = receive(stream);
        let error = result.unwrap_err().to_string();
        assert!(
            error.contains("channel 1: data after the last sync"),
            "{error}"
        );
    }

    #[test]
    fn a_packet_of_another_iteration_is_refused() {
        let mut stream = Vec::new();
        let entry = [PageEntry {
            page_index: 0,
            kind: PageKind::Zero,
            encoded_len: 0,
        }];
        encode_pages_prefix(&mut stream, 5, 4, 0, &entry);
        let (result, _, _) = receive(stream);
        let error = result.unwrap_err().to_string();
        assert!(
            error.contains("packet of iteration 4 during iteration 0"),
            "{error}"
        );
    }

    #[test]
    fn a_stream_ending_inside_a_payload_is_a_closed_channel() {
        let mut stream = Vec::new();
        let entry = [PageEntry {
            page_index: 0,
            kind: PageKind::Raw,
            encoded_len: tern_wire::PAGE_SIZE,
        }];
        encode_pages_prefix(&mut stream, 5, 0, 0, &entry);
        stream.extend_from_slice(&[1; 100]);
        let (result, _, _) = receive(stream);
        assert!(matches!(
            result,
            Err(MigrationError::Channel {
                index: 1,
                source: ChannelError::Closed
            })
        ));
    }

    #[test]
    fn a_state_section_on_a_page_channel_is_refused_at_its_header() {
        let stream = Message::StateSection(tern_wire::StateSectionMsg {
            name: "cpu".into(),
            version: 1,
            data: vec![0; 1000],
        })
        .to_bytes();
        let (result, _, _) = receive(stream[..tern_wire::FRAME_HEADER_LEN].to_vec());
        let error = result.unwrap_err();
        assert!(
            error.chain().contains("pages or a sync on a page channel"),
            "{}",
            error.chain()
        );
    }
}

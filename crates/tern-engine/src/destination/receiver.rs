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
use std::time::Duration;

use tern_page::codec::{CodecError, CodecId, PageDecompressor};
use tern_wire::{
    Event, FrameDecoder, FrameKind, MAX_PAGES_PER_PACKET, Message, PageEntry, PageKind, PagePacket,
    Sync, codec_id,
};

use super::handshake::peer_aborted;
use super::order::{PageChannelEvent, PageChannelState};
use super::shared::ReceiverShared;
use super::stream::{FrameSource, read_event};
use crate::digest::{page_hash, zero_page_hash};
use crate::error::{ChannelError, MigrationError};
use crate::guest::{MemoryRegion, PAGE_SIZE};
use crate::transport::Segment;

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
            Packet::Pages(packet) => receiver.receive_packet(&mut source, &packet)?,
            Packet::Sync(sync) => receiver.end_iteration(sync)?,
        }
        if let PageChannelState::Ended(last) = receiver.state {
            refuse_trailing_bytes(&mut source, receiver.channel)?;
            receiver.log_offload();
            return Ok(last);
        }
    }
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

/// Per-page counts of one packet, added to the live statistics.
#[derive(Default)]
struct PageCounts {
    zero: u64,
    cleared: u64,
    normal: u64,
}

struct PageReceiver<'s, 'a> {
    shared: &'s ReceiverShared<'a>,
    /// Receiver number, from 0.
    index: usize,
    /// The channel's index in the protocol: `index + 1`.
    channel: usize,
    state: PageChannelState,
    decoder: FrameDecoder,
    /// One per codec id the session announced.
    decompressors: [Option<PageDecompressor>; 8],
    /// Where the packet's payload goes.
    placement: Placement,
}

/// Where one packet's payload lands, in table order.
struct Placement {
    /// Each entry's page in guest memory.
    pages: Vec<*mut u8>,
    /// The `readv` segments: raw pages, then slices of `compressed`.
    segments: Vec<Segment>,
    /// Compressed payloads land here, then decode straight into their page.
    compressed: Vec<u8>,
}

impl PageReceiver<'_, '_> {
    /// Says which inflate ran and how often the offload left a page to
    /// libdeflate (not in the statistics, whose wire message lacks a field).
    fn log_offload(&self) {
        for decompressor in self.decompressors.iter().flatten() {
            if decompressor.implementation() == tern_page::codec::CodecImpl::Qpl {
                tracing::info!(
                    channel = self.channel,
                    fallbacks = decompressor.offload_fallbacks(),
                    "deflate pages inflated on IAA through QPL"
                );
            }
        }
    }
}

impl<'s, 'a> PageReceiver<'s, 'a> {
    fn new(
        shared: &'s ReceiverShared<'a>,
        index: usize,
        codecs: &[CodecId],
    ) -> Result<Self, MigrationError> {
        let mut decompressors: [Option<PageDecompressor>; 8] = Default::default();
        for &codec in codecs {
            decompressors[codec as usize] = Some(
                PageDecompressor::for_destination(codec, shared.qpl_path)
                    .and_then(|decoder| decoder.with_dictionaries(&shared.dictionaries))
                    .map_err(|error| {
                        MigrationError::Incompatible(format!(
                            "cannot decode {}: {error}",
                            codec.name()
                        ))
                    })?,
            );
        }
        Ok(Self {
            shared,
            index,
            channel: index + 1,
            state: PageChannelState::Iteration(0),
            decoder: FrameDecoder::with_setup(shared.setup.clone())
                .only(PAGE_CHANNEL_FRAMES, "pages or a sync on a page channel"),
            decompressors,
            placement: Placement {
                pages: Vec::with_capacity(MAX_PAGES_PER_PACKET),
                segments: Vec::with_capacity(MAX_PAGES_PER_PACKET),
                compressed: vec![0; MAX_PAGES_PER_PACKET * PAGE_SIZE],
            },
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

    /// Reads a packet's payload into place and applies its entries.
    fn receive_packet(
        &mut self,
        source: &mut impl FrameSource,
        packet: &PagePacket,
    ) -> Result<(), MigrationError> {
        let region = &self.shared.regions[packet.region_index];
        let entries = self.decoder.entries();
        self.placement.place(region, entries)?;
        claim_pages(self.shared, self.channel, packet, entries, self.iteration())?;
        // SAFETY: `place` made every segment either a whole page inside the
        // region (bounds-checked by `page_ptr`) or a slice of this
        // receiver's own buffer. Each of those pages was claimed by this
        // receiver just above, and claims are released only at the
        // iteration's barrier, which this receiver has not reached: so no
        // other thread writes the page during the read. (The guest is not
        // running on the destination, so it does not touch it either.)
        unsafe { source.read_scattered(&self.placement.segments) }
            .map_err(MigrationError::channel(self.channel))?;
        self.decoder.consume_payload(packet.payload_len);
        let counts = self.apply_entries(packet)?;
        let stats = self.shared.stats;
        stats.zero_pages.fetch_add(counts.zero, Ordering::Relaxed);
        stats
            .zero_pages_cleared
            .fetch_add(counts.cleared, Ordering::Relaxed);
        stats
            .normal_pages
            .fetch_add(counts.normal, Ordering::Relaxed);
        Ok(())
    }

    /// Writes what the payload alone does not: decompresses compressed
    /// pages into their page, clears zero pages that hold data, and records
    /// each page's hash and whether it holds data.
    fn apply_entries(&mut self, packet: &PagePacket) -> Result<PageCounts, MigrationError> {
        let populated = &self.shared.populated[packet.region_index];
        let hashes = self.shared.page_hashes.as_ref();
        let entries = self.decoder.entries();
        let mut compressed = CompressedInput::new(
            self.decompressors[usize::from(packet.header.codec)].as_mut(),
            packet,
            entries,
            &self.placement.compressed,
        )
        .map_err(|error| packet_error(self.channel, packet, error))?;
        let mut counts = PageCounts::default();
        for (entry, &ptr) in entries.iter().zip(&self.placement.pages) {
            let page = u64::from(entry.page_index);
            if entry.kind == PageKind::Zero {
                counts.zero += 1;
                if let Some(hashes) = hashes {
                    hashes.record(packet.region_index, page, zero_page_hash());
                }
                if populated.get(page) {
                    // SAFETY: a whole page inside the region (from
                    // `page_ptr`), claimed by this receiver for this
                    // iteration.
                    unsafe { std::ptr::write_bytes(ptr, 0, PAGE_SIZE) };
                    populated.clear(page);
                    counts.cleared += 1;
                }
                continue;
            }
            if entry.kind == PageKind::Compressed {
                // SAFETY: `ptr` is a whole page inside the region (from
                // `page_ptr`), claimed by this receiver for this iteration.
                unsafe { compressed.decode_next(entry, ptr) }.map_err(|error| {
                    MigrationError::Protocol(format!(
                        "channel {}: page {page} of region {}: {error}",
                        self.channel, packet.header.region_id
                    ))
                })?;
            }
            populated.set(page);
            counts.normal += 1;
            if let Some(hashes) = hashes {
                // SAFETY: a whole page inside the region, written by this
                // receiver just now and claimed by it for this iteration.
                let hash = unsafe { page_hash(ptr) };
                hashes.record(packet.region_index, page, hash);
            }
        }
        Ok(counts)
    }

    /// Ends the current iteration: every receiver waits for the others, so
    /// no page of the next iteration lands before all of this one, and all
    /// must agree on whether it was the last.
    fn end_iteration(&mut self, sync: Sync) -> Result<(), MigrationError> {
        let iteration = self.iteration();
        self.advance(PageChannelEvent::Sync {
            iteration: sync.iteration,
            last: sync.last,
        })?;
        self.shared.end_iteration(iteration, sync.last)?;
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
                "channel {channel}: page {} of region {} arrived twice in iteration {iteration}",
                entry.page_index, packet.header.region_id
            )));
        }
    }
    Ok(())
}

fn packet_error(channel: usize, packet: &PagePacket, error: CodecError) -> MigrationError {
    MigrationError::Protocol(format!(
        "channel {channel}: packet of region {}: {error}",
        packet.header.region_id
    ))
}

/// Where a packet's compressed pages come from: each page's own bytes
/// decoded alone (against the packet's dictionary, if it names one), or
/// the pages of the packet's one frame, decoded up front.
enum CompressedInput<'d> {
    PerPage {
        decompressor: Option<&'d mut PageDecompressor>,
        payload: &'d [u8],
        dictionary: u8,
    },
    Frame(&'d [u8]),
}

impl<'d> CompressedInput<'d> {
    /// For a packet frame, decodes the frame (exactly the packet's
    /// compressed pages × `PAGE_SIZE` bytes, or an error).
    fn new(
        decompressor: Option<&'d mut PageDecompressor>,
        packet: &PagePacket,
        entries: &[PageEntry],
        payload: &'d [u8],
    ) -> Result<Self, CodecError> {
        let dictionary = packet.header.dictionary;
        if packet.header.codec != codec_id::ZSTD_PACKET {
            return Ok(Self::PerPage {
                decompressor,
                payload,
                dictionary,
            });
        }
        let compressed = entries
            .iter()
            .filter(|entry| entry.kind == PageKind::Compressed);
        let pages = compressed.clone().count();
        let frame_len: usize = compressed.map(|entry| entry.encoded_len as usize).sum();
        if pages == 0 {
            return Ok(Self::Frame(&[]));
        }
        // The decoder admits only announced codecs, and each has one.
        let decompressor = decompressor.ok_or(CodecError::NoCodec)?;
        let frame = payload.get(..frame_len).ok_or(CodecError::BadInputLength {
            codec: "zstd packet",
            len: frame_len,
        })?;
        Ok(Self::Frame(
            decompressor.decompress_packet(frame, dictionary, pages)?,
        ))
    }

    /// Writes the next compressed page into `page_out`.
    ///
    /// # Safety
    /// `page_out` points to `PAGE_SIZE` writable bytes nothing else
    /// accesses during the call.
    unsafe fn decode_next(
        &mut self,
        entry: &PageEntry,
        page_out: *mut u8,
    ) -> Result<(), CodecError> {
        match self {
            Self::PerPage {
                decompressor,
                payload,
                dictionary,
            } => {
                let (input, rest) = payload.split_at(entry.encoded_len as usize);
                *payload = rest;
                let decompressor = decompressor.as_deref_mut().ok_or(CodecError::NoCodec)?;
                // SAFETY: forwarded caller contract; the decoder writes
                // exactly one page or fails.
                unsafe { decompressor.decompress_page_with(input, *dictionary, page_out) }
            }
            Self::Frame(pages) => {
                let (page, rest) = pages
                    .split_first_chunk::<PAGE_SIZE>()
                    .ok_or(CodecError::NoCodec)?;
                *pages = rest;
                // SAFETY: forwarded caller contract; `page` is this
                // receiver's own buffer, which cannot overlap guest memory.
                unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), page_out, PAGE_SIZE) };
                Ok(())
            }
        }
    }
}

impl Placement {
    /// Finds each entry's page and the segment its payload goes to. The
    /// region's `page_ptr` is the one bounds check between a page index and
    /// guest memory.
    fn place(
        &mut self,
        region: &MemoryRegion,
        entries: &[PageEntry],
    ) -> Result<(), MigrationError> {
        self.pages.clear();
        self.segments.clear();
        let mut compressed = &mut self.compressed[..];
        for entry in entries {
            let ptr = region
                .page_ptr(u64::from(entry.page_index))
                .ok_or_else(|| MigrationError::Protocol("page outside its region".into()))?;
            self.pages.push(ptr);
            match entry.kind {
                PageKind::Raw => self.segments.push(Segment {
                    ptr,
                    len: PAGE_SIZE,
                }),
                PageKind::Compressed if entry.encoded_len == 0 => {}
                PageKind::Compressed => {
                    // Each compressed page is shorter than a page and there
                    // are at most MAX_PAGES_PER_PACKET, so they fit.
                    let (slot, rest) =
                        std::mem::take(&mut compressed).split_at_mut(entry.encoded_len as usize);
                    compressed = rest;
                    self.segments.push(Segment {
                        ptr: slot.as_mut_ptr(),
                        len: slot.len(),
                    });
                }
                PageKind::Zero => {}
            }
        }
        Ok(())
    }
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
    use crate::source::CancelToken;

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
        }
    }

    fn sync(iteration: u32, last: bool) -> Vec<u8> {
        Message::Sync(Sync { iteration, last }).to_bytes()
    }

    /// Receives `stream` into a fresh guest of [`PAGES`] pages.
    fn receive(stream: Vec<u8>) -> (Result<u32, MigrationError>, Vec<u8>, ReceiveStats) {
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
            );
            let source = Buffer {
                bytes: stream,
                read: 0,
            };
            receive_pages(&shared, 0, source, &[CodecId::Zstd])
        };
        (result, memory, stats)
    }

    fn page(memory: &[u8], index: usize) -> &[u8] {
        &memory[index * PAGE_SIZE..(index + 1) * PAGE_SIZE]
    }

    #[test]
    fn a_session_received_from_a_buffer() {
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
                encoded_len: PAGE_SIZE as u32,
            },
            PageEntry {
                page_index: 2,
                kind: PageKind::Zero,
                encoded_len: 0,
            },
            PageEntry {
                page_index: 3,
                kind: PageKind::Compressed,
                encoded_len: len as u32,
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

        let (result, memory, stats) = receive(stream);
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
            encoded_len: PAGE_SIZE as u32,
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

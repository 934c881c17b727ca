//! Structure-aware whole sessions: a fuzz input is read as the choices of a
//! valid session (page channels, regions, codecs, dictionaries and a
//! refresh, iterations of pages of every kind: zero, raw, compressed,
//! duplicate, delta; state sections, the completion with its digest, the
//! commit), which is built and then corrupted as the input's last choices
//! say; the very last may slip in a frame only a destination sends
//! (`PassApplied`, protocol 12), which must be refused. Byte-level
//! mutations of such inputs change the session's shape, not its framing,
//! so the fuzzer spends its time past the handshake: in the receivers,
//! the claims, the dictionaries, the switch-over.
//!
//! An input that runs out of bytes takes the first choice everywhere
//! (`arbitrary` yields zeros), so the empty input is a valid, verified
//! session of one channel, one page and no corruption.

use arbitrary::Unstructured;
use tern_page::codec::{CodecDictionary, CodecId, CompressedBatch, PageCompressor, PageOutcome};
use tern_wire::{
    ChannelHello, Complete, DigestAlgorithm, Handshake, Hello, Message, PageEntry, PageKind,
    PageRef, PagesHeader, PassApplied, RegionInfo, SessionSetup, StateSectionMsg, Sync,
    encode_packet_prefix,
};
use xxhash_rust::xxh3::Xxh3;

use crate::digest::{add_region, page_hash};
use crate::guest::PAGE_SIZE;

/// The session id of every structured session.
pub const STRUCTURED_SESSION: u64 = 0x5e55_1011;

const MAX_PAGE_CHANNELS: u16 = 4;
const MAX_REGIONS: usize = 2;
const MAX_REGION_PAGES: usize = 16;
const MAX_ITERATIONS: u32 = 3;
const MAX_PACKETS_PER_CHANNEL: usize = 3;
const MAX_PAGES_PER_PACKET: usize = 4;
const MAX_CORRUPTIONS: usize = 3;

/// The codecs a session may announce, in the order of their choice bits.
const CODECS: [CodecId; 5] = [
    CodecId::Zstd,
    CodecId::Deflate,
    CodecId::Lz4,
    CodecId::ZstdPacket,
    CodecId::ZstdStream,
];

/// Builds the session `data` describes and corrupts it; its streams as
/// (main channel, page channels), for [`super::run_session`].
pub fn structured_session(data: &[u8]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut choices = Unstructured::new(data);
    let mut session = Session::choose(&mut choices);
    let iterations = choices.int_in_range(1..=MAX_ITERATIONS).unwrap_or(1);
    for iteration in 0..iterations {
        session.iteration(&mut choices, iteration, iteration + 1 == iterations);
    }
    // The live phase's end on the main channel: a frame boundary.
    let live_end = session.main.len();
    let (mut main, mut pages) = session.finish(&mut choices, iterations - 1);
    corrupt(&mut choices, &mut main, &mut pages);
    // Chosen last, so that the seeds chosen before it keep their sessions.
    if choices.int_in_range(0..=7u8).unwrap_or(0) == 7 {
        insert_pass_applied(&mut main, live_end, &mut choices);
    }
    (main, pages)
}

/// A `PassApplied` (protocol 12; its lag since 13), which only a destination sends, put on
/// the main channel at `at` (the live phase's end, unless a corruption
/// moved it) as though the source sent it: the destination must refuse it.
fn insert_pass_applied(main: &mut Vec<u8>, at: usize, choices: &mut Unstructured<'_>) {
    let mut frame = Vec::new();
    Message::PassApplied(PassApplied {
        passes: choices.arbitrary().unwrap_or(0),
        lag_micros: choices.arbitrary().unwrap_or(0),
    })
    .encode(&mut frame);
    let at = at.min(main.len());
    main.splice(at..at, frame);
}

/// What an entry of a packet carries, before encoding.
enum Planned {
    Zero,
    /// Bytes the packet's codec may compress.
    Data(Vec<u8>),
    Duplicate(PageRef),
    Delta(Vec<u8>),
}

/// The session being built: the source's memory as the destination will
/// hold it, and the streams so far.
struct Session {
    setup: SessionSetup,
    /// Each region's pages, as sent.
    memory: Vec<Vec<[u8; PAGE_SIZE]>>,
    /// Pages that hold data the destination received in an earlier
    /// iteration (what a duplicate may name or a delta apply to).
    held: Vec<Vec<bool>>,
    dictionaries: Vec<CodecDictionary>,
    /// Dictionaries in force in the current iteration.
    in_force: u8,
    /// Whether a refreshed dictionary comes into force after iteration 0.
    refresh: bool,
    main: Vec<u8>,
    channels: Vec<Vec<u8>>,
    /// Each page channel's zstd stream (codec 5), made at its first packet.
    streams: Vec<Option<PageCompressor>>,
}

impl Session {
    fn choose(choices: &mut Unstructured<'_>) -> Self {
        let channel_count = choices.int_in_range(1..=MAX_PAGE_CHANNELS).unwrap_or(1);
        let region_count = choices.int_in_range(1..=MAX_REGIONS).unwrap_or(1);
        let regions: Vec<RegionInfo> = (0..region_count)
            .map(|index| {
                let pages = choices.int_in_range(1..=MAX_REGION_PAGES).unwrap_or(1);
                RegionInfo {
                    id: crate::numeric::saturating_u32(index) * 2 + u32::from(flag(choices)),
                    guest_addr: (index as u64) << 30,
                    len: (pages * PAGE_SIZE) as u64,
                }
            })
            .collect();
        let mut codecs = 0u8;
        for codec in CODECS {
            if codec.is_built() && flag(choices) {
                codecs |= 1 << codec.to_wire();
            }
        }
        let zstd = CODECS
            .iter()
            .any(|codec| codec.is_zstd() && codecs & (1 << codec.to_wire()) != 0);
        let initial = if zstd {
            choices.int_in_range(0..=2u8).unwrap_or(0)
        } else {
            0
        };
        let refresh = zstd && flag(choices);
        let total = initial + u8::from(refresh);
        let dictionaries: Vec<CodecDictionary> = (1..=total).map(dictionary).collect();
        let digest = if flag(choices) {
            DigestAlgorithm::None
        } else {
            DigestAlgorithm::Xxh3Pages
        };
        let memory = regions
            .iter()
            .map(|region| {
                vec![[0u8; PAGE_SIZE]; crate::numeric::saturating_usize(region.len) / PAGE_SIZE]
            })
            .collect::<Vec<_>>();
        let held = memory
            .iter()
            .map(|pages| vec![false; pages.len()])
            .collect();
        let setup = SessionSetup {
            page_size: tern_wire::PAGE_SIZE,
            channel_count,
            codecs,
            digest,
            regions,
            guest_kind: String::new(),
            dictionaries: initial,
            vmm_config_len: 0,
        };
        let main = main_start(&setup, &dictionaries);
        let streams = (0..channel_count).map(|_| None).collect();
        let channels = (1..=channel_count)
            .map(|index| {
                Message::ChannelHello(ChannelHello {
                    handshake: handshake(index),
                })
                .to_bytes()
            })
            .collect();
        Self {
            setup,
            memory,
            held,
            dictionaries,
            in_force: initial,
            refresh,
            main,
            channels,
            streams,
        }
    }

    /// One iteration: packets on every channel, each page at most once,
    /// then every channel's sync.
    fn iteration(&mut self, choices: &mut Unstructured<'_>, iteration: u32, last: bool) {
        let mut iteration_state = IterationState::new(&self.memory);
        for channel in 0..self.channels.len() {
            let packets = choices
                .int_in_range(0..=MAX_PACKETS_PER_CHANNEL)
                .unwrap_or(1);
            // At least one packet in the first iteration, so the empty
            // input moves a page.
            let packets = if iteration == 0 && channel == 0 {
                packets.max(1)
            } else {
                packets
            };
            for _ in 0..packets {
                self.packet(choices, &mut iteration_state, channel, iteration);
            }
        }
        for (region, sent) in iteration_state.sent.iter().enumerate() {
            for (page, kind) in sent.iter().enumerate() {
                if let Some(holds_data) = kind {
                    self.held[region][page] = *holds_data;
                }
            }
        }
        if iteration == 0 && self.refresh {
            self.in_force += 1;
        }
        for channel in &mut self.channels {
            Message::Sync(Sync {
                iteration,
                last,
                dictionaries: self.in_force,
            })
            .encode(channel);
        }
    }

    /// One packet on `channel`: a region, a codec (and dictionary), and up
    /// to four pages not sent yet in this iteration, each of a chosen kind.
    fn packet(
        &mut self,
        choices: &mut Unstructured<'_>,
        state: &mut IterationState,
        channel: usize,
        iteration: u32,
    ) {
        let region = choices.choose_index(self.memory.len()).unwrap_or(0);
        let codec = self.choose_codec(choices);
        let dictionary = if codec.is_zstd() && self.in_force > 0 {
            choices.int_in_range(0..=self.in_force).unwrap_or(0)
        } else {
            0
        };
        let count = choices.int_in_range(1..=MAX_PAGES_PER_PACKET).unwrap_or(1);
        let mut planned: Vec<(u32, Planned)> = Vec::new();
        for _ in 0..count {
            let Some(page) = state.free_page(choices, region) else {
                break;
            };
            let entry = self.plan_page(choices, state, channel, region, page, codec);
            let holds_data = !matches!(entry, Planned::Zero);
            state.sent[region][page] = Some(holds_data);
            if holds_data {
                state.written_on[region][page] = Some(channel);
            }
            planned.push((crate::numeric::saturating_u32(page), entry));
        }
        if planned.is_empty() {
            return;
        }
        let dictionary = (dictionary > 0).then(|| &self.dictionaries[usize::from(dictionary) - 1]);
        let mut header = PagesHeader {
            region_id: self.setup.regions[region].id,
            iteration,
            page_count: 0,
            codec: if codec == CodecId::None {
                0
            } else {
                codec.to_wire()
            },
            dictionary: dictionary.map_or(0, CodecDictionary::id),
        };
        // A stream's packets continue their channel's stream, in order.
        let mut made_here = None;
        let compressor = if codec.is_stream() {
            &mut self.streams[channel]
        } else {
            &mut made_here
        };
        if codec != CodecId::None && compressor.is_none() {
            *compressor =
                PageCompressor::with_dictionary(codec, codec.default_level(), dictionary).ok();
        }
        encode_packet(
            &mut self.channels[channel],
            &mut header,
            compressor.as_mut(),
            &planned,
        );
    }

    /// A codec the session announced, or none.
    fn choose_codec(&self, choices: &mut Unstructured<'_>) -> CodecId {
        let announced: Vec<CodecId> = CODECS
            .into_iter()
            .filter(|codec| self.setup.codecs & (1 << codec.to_wire()) != 0)
            .collect();
        match choices.choose_index(announced.len() + 1) {
            Ok(index) if index > 0 => announced[index - 1],
            _ => CodecId::None,
        }
    }

    /// What page `page` of `region` becomes and how it goes: a zero page,
    /// new data, a duplicate of a page the destination will hold, or a
    /// delta against the version it holds. Updates the memory model.
    fn plan_page(
        &mut self,
        choices: &mut Unstructured<'_>,
        state: &mut IterationState,
        channel: usize,
        region: usize,
        page: usize,
        codec: CodecId,
    ) -> Planned {
        // A packet codec frames all its pages together: only zero pages
        // and data beside it.
        let kinds = if matches!(codec, CodecId::ZstdPacket | CodecId::ZstdStream) {
            2
        } else {
            4
        };
        let kind = choices.choose_index(kinds).unwrap_or(1);
        let seed = choices.arbitrary::<u8>().unwrap_or(0);
        match kind {
            0 => {
                self.memory[region][page] = [0; PAGE_SIZE];
                Planned::Zero
            }
            2 => match state.duplicate_target(choices, &self.held, channel, (region, page)) {
                Some((target_region, target_page)) => {
                    self.memory[region][page] = self.memory[target_region][target_page];
                    state.named[target_region][target_page] = true;
                    Planned::Duplicate(PageRef {
                        region_id: self.setup.regions[target_region].id,
                        page_index: crate::numeric::saturating_u32(target_page),
                    })
                }
                None => self.new_data(region, page, seed),
            },
            3 if self.held[region][page] => {
                let old = self.memory[region][page];
                let mut new = old;
                tweak(&mut new, seed);
                let mut record = vec![0u8; PAGE_SIZE];
                match tern_page::delta::create_delta(&old, &new, &mut record) {
                    Some(len) => {
                        record.truncate(len);
                        self.memory[region][page] = new;
                        Planned::Delta(record)
                    }
                    None => self.new_data(region, page, seed),
                }
            }
            _ => self.new_data(region, page, seed),
        }
    }

    fn new_data(&mut self, region: usize, page: usize, seed: u8) -> Planned {
        let content = page_content(seed, &self.memory[region][page]);
        self.memory[region][page] = content;
        Planned::Data(content.to_vec())
    }

    /// The state sections, the completion (its digest right, or wrong
    /// when the input says so) and the commit, or an abort, or nothing.
    fn finish(
        mut self,
        choices: &mut Unstructured<'_>,
        final_iteration: u32,
    ) -> (Vec<u8>, Vec<Vec<u8>>) {
        let sections = choices.int_in_range(0..=2u32).unwrap_or(0);
        for index in 0..sections {
            Message::StateSection(StateSectionMsg {
                name: format!("device {index}"),
                version: 1,
                data: vec![
                    crate::numeric::low_byte(index.into());
                    usize::from(choices.arbitrary::<u8>().unwrap_or(0))
                ],
            })
            .encode(&mut self.main);
        }
        let mut digest = if self.setup.digest == DigestAlgorithm::None {
            0
        } else {
            self.digest()
        };
        if flag(choices) {
            digest ^= 1;
        }
        Message::Complete(Complete {
            final_iteration,
            sections,
            digest,
        })
        .encode(&mut self.main);
        match choices.choose_index(3).unwrap_or(0) {
            0 => Message::Commit.encode(&mut self.main),
            1 => Message::Abort(tern_wire::Abort {
                reason: tern_wire::AbortReason::Other,
                message: "the structured source gives up".into(),
            })
            .encode(&mut self.main),
            _ => {}
        }
        (self.main, self.channels)
    }

    /// The protocol's digest of the memory as built.
    fn digest(&self) -> u128 {
        let mut hasher = Xxh3::new();
        for (region, pages) in self.setup.regions.iter().zip(&self.memory) {
            add_region(
                &mut hasher,
                region.id,
                pages.iter().map(|page| {
                    // SAFETY: a whole page of this session's own memory.
                    unsafe { page_hash(page.as_ptr()) }
                }),
            );
        }
        hasher.digest128()
    }
}

/// Which pages an iteration has sent, and how.
struct IterationState {
    /// Per page: `None` not sent in this iteration; `Some(holds data)`.
    sent: Vec<Vec<Option<bool>>>,
    /// The channel that wrote data to a page in this iteration.
    written_on: Vec<Vec<Option<usize>>>,
    /// Pages a duplicate of this iteration names: not sent again in it.
    named: Vec<Vec<bool>>,
}

impl IterationState {
    fn new(memory: &[Vec<[u8; PAGE_SIZE]>]) -> Self {
        Self {
            sent: memory.iter().map(|pages| vec![None; pages.len()]).collect(),
            written_on: memory.iter().map(|pages| vec![None; pages.len()]).collect(),
            named: memory
                .iter()
                .map(|pages| vec![false; pages.len()])
                .collect(),
        }
    }

    /// A page of `region` this iteration may still send.
    fn free_page(&self, choices: &mut Unstructured<'_>, region: usize) -> Option<usize> {
        let free: Vec<usize> = (0..self.sent[region].len())
            .filter(|&page| self.sent[region][page].is_none() && !self.named[region][page])
            .collect();
        let index = choices.choose_index(free.len()).ok()?;
        Some(free[index])
    }

    /// A page a duplicate sent on `channel` may name (docs/protocol.md,
    /// "Duplicate pages"): one this channel wrote earlier in this
    /// iteration, or one that holds data from an earlier iteration and that
    /// no channel sent in this one; never the page itself.
    fn duplicate_target(
        &self,
        choices: &mut Unstructured<'_>,
        held: &[Vec<bool>],
        channel: usize,
        this: (usize, usize),
    ) -> Option<(usize, usize)> {
        let mut candidates = Vec::new();
        for (region, pages) in self.sent.iter().enumerate() {
            for (page, sent) in pages.iter().enumerate() {
                let this_channel = self.written_on[region][page] == Some(channel);
                let earlier = held[region][page] && sent.is_none();
                if (region, page) != this && (this_channel || earlier) {
                    candidates.push((region, page));
                }
            }
        }
        let index = choices.choose_index(candidates.len()).ok()?;
        Some(candidates[index])
    }
}

/// The main channel's hello, then the setup's dictionaries and the
/// refresh, which a source sends during iteration 0 and which the syncs of
/// iteration 0 count.
fn main_start(setup: &SessionSetup, dictionaries: &[CodecDictionary]) -> Vec<u8> {
    let mut main = Message::Hello(Hello {
        handshake: handshake(0),
        setup: setup.clone(),
    })
    .to_bytes();
    for dictionary in dictionaries {
        Message::Dictionary(tern_wire::Dictionary {
            id: dictionary.id(),
            codec: tern_wire::codec_id::ZSTD,
            data: dictionary.bytes().to_vec(),
        })
        .encode(&mut main);
    }
    main
}

/// A choice between two ways; the first when the input has run out.
fn flag(choices: &mut Unstructured<'_>) -> bool {
    choices.arbitrary::<bool>().unwrap_or(false)
}

fn handshake(channel_index: u16) -> Handshake {
    Handshake {
        session_id: STRUCTURED_SESSION,
        channel_index,
    }
}

/// Dictionary `id`: raw content, as zstd takes any bytes.
fn dictionary(id: u8) -> CodecDictionary {
    let text = format!("structured session page, dictionary {id}; ").repeat(48);
    CodecDictionary::new(id, CodecId::Zstd, text.into_bytes()).expect("within the limits")
}

/// New contents for a page: text that compresses, noise that does not, or
/// the old contents with a few words changed (what a delta is made for).
fn page_content(seed: u8, old: &[u8; PAGE_SIZE]) -> [u8; PAGE_SIZE] {
    let mut page = [0u8; PAGE_SIZE];
    match seed % 3 {
        0 => {
            let text = format!("structured session page {seed}, ");
            for (byte, source) in page.iter_mut().zip(text.bytes().cycle()) {
                *byte = source;
            }
        }
        1 => {
            let mut state = u64::from(seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            for byte in &mut page {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *byte = crate::numeric::low_byte(state);
            }
        }
        _ => {
            page = *old;
            tweak(&mut page, seed);
        }
    }
    page
}

/// Changes a few 8-byte words of `page`.
fn tweak(page: &mut [u8; PAGE_SIZE], seed: u8) {
    for step in 0..=usize::from(seed % 8) {
        let at = (usize::from(seed) * 37 + step * 521) % (PAGE_SIZE / 8) * 8;
        page[at] = page[at].wrapping_add(seed | 1);
    }
}

/// Appends the packet of `planned` entries: data pages compressed with
/// `compressor` (the packet's codec) where they shrink (one frame for a
/// packet codec, the channel stream's next bytes for a stream, whose
/// restart the header then says), the others raw; duplicates and deltas
/// with their payloads.
fn encode_packet(
    stream: &mut Vec<u8>,
    header: &mut PagesHeader,
    compressor: Option<&mut PageCompressor>,
    planned: &[(u32, Planned)],
) {
    let data: Vec<&[u8]> = planned
        .iter()
        .filter_map(|(_, entry)| match entry {
            Planned::Data(bytes) => Some(bytes.as_slice()),
            _ => None,
        })
        .collect();
    let pointers: Vec<*const u8> = data.iter().map(|page| page.as_ptr()).collect();
    let mut batch = CompressedBatch::new();
    if let Some(compressor) = compressor {
        // SAFETY: every pointer is a whole page of `planned`, alive and
        // unchanged during the call.
        unsafe { compressor.compress_batch(&pointers, &mut batch) };
        if batch.stream_restart {
            header.dictionary = tern_wire::codec_id::STREAM_RESTART;
        }
    }
    let mut entries = Vec::new();
    let mut payload = Vec::new();
    let mut outcomes = batch.outcomes.iter();
    for (page_index, entry) in planned {
        let (kind, bytes): (PageKind, &[u8]) = match entry {
            Planned::Zero => (PageKind::Zero, &[]),
            Planned::Data(content) => match outcomes.next() {
                Some(PageOutcome::Compressed { offset, len }) => {
                    (PageKind::Compressed, &batch.data[*offset..*offset + *len])
                }
                _ => (PageKind::Raw, content),
            },
            Planned::Duplicate(reference) => {
                payload.extend_from_slice(&reference.encode());
                entries.push(PageEntry {
                    page_index: *page_index,
                    kind: PageKind::Duplicate,
                    encoded_len: crate::numeric::saturating_u32(PageRef::ENCODED_LEN),
                });
                continue;
            }
            Planned::Delta(record) => (PageKind::Delta, record),
        };
        entries.push(PageEntry {
            page_index: *page_index,
            kind,
            encoded_len: crate::numeric::saturating_u32(bytes.len()),
        });
        payload.extend_from_slice(bytes);
    }
    encode_packet_prefix(stream, header, &entries);
    stream.extend_from_slice(&payload);
}

/// Up to three corruptions of the built streams: a byte flipped, a stream
/// cut short, a range dropped, bytes inserted, a range repeated.
fn corrupt(choices: &mut Unstructured<'_>, main: &mut Vec<u8>, pages: &mut [Vec<u8>]) {
    let count = choices.int_in_range(0..=MAX_CORRUPTIONS).unwrap_or(0);
    for _ in 0..count {
        let index = choices.choose_index(pages.len() + 1).unwrap_or(0);
        let stream = if index == 0 {
            &mut *main
        } else {
            &mut pages[index - 1]
        };
        if stream.is_empty() {
            continue;
        }
        let at = choices.choose_index(stream.len()).unwrap_or(0);
        let len = usize::from(choices.arbitrary::<u8>().unwrap_or(0)).min(stream.len() - at);
        match choices.choose_index(5).unwrap_or(0) {
            0 => stream[at] ^= choices.arbitrary::<u8>().unwrap_or(0) | 1,
            1 => stream.truncate(at),
            2 => {
                stream.drain(at..at + len);
            }
            3 => {
                let bytes = choices.bytes(len).unwrap_or(&[]).to_vec();
                stream.splice(at..at, bytes);
            }
            _ => {
                let repeated = stream[at..at + len].to_vec();
                stream.splice(at..at, repeated);
            }
        }
    }
}

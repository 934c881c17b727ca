//! What the fuzz targets in `fuzz/` and the tests that replay their corpus
//! share: a whole destination session run from one byte string, a small
//! guest in plain memory to receive it, and a valid session to start from.
//! Not a stable API.

use std::ptr::NonNull;

use tern_page::codec::{CodecDictionary, CodecId, CompressedBatch, PageCompressor, PageOutcome};
use tern_wire::{
    ChannelHello, Complete, DigestAlgorithm, Handshake, Hello, Message, PageEntry, PageKind,
    PagesHeader, RegionInfo, SessionSetup, StateSectionMsg, Sync, codec_id, encode_packet_prefix,
};
use xxhash_rust::xxh3::Xxh3;

pub mod structured;

use crate::config::ReceiveConfig;
use crate::destination::Destination;
use crate::digest::{add_region, page_hash};
use crate::error::MigrationError;
use crate::guest::{
    DeviceState, GuestControl, GuestError, GuestMemory, GuestResult, MemoryRegion, PAGE_SIZE,
    StateSection,
};

/// The largest guest a fuzzed session may declare: anything larger is
/// refused by the guest factory, so an input cannot make a run slow by
/// asking for much memory.
pub const MAX_GUEST_BYTES: u64 = 1 << 20;

/// The most page channels an input can have.
const MAX_CHANNELS: usize = 4;

/// Splits a fuzz input into the streams the source sent: the first byte
/// gives the number of page channels (1 to 4); then come chunks of
/// `stream u8, length u16 (little-endian), bytes`, each appended to stream
/// `stream % (channels + 1)`, 0 being the main channel. A chunk cut short
/// takes what is left.
pub fn split_session_input(data: &[u8]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let Some((&first, mut rest)) = data.split_first() else {
        return (Vec::new(), vec![Vec::new()]);
    };
    let channels = usize::from(first) % MAX_CHANNELS + 1;
    let mut streams = vec![Vec::new(); channels + 1];
    while let [stream, low, high, tail @ ..] = rest {
        let len = usize::from(u16::from_le_bytes([*low, *high])).min(tail.len());
        streams[usize::from(*stream) % (channels + 1)].extend_from_slice(&tail[..len]);
        rest = &tail[len..];
    }
    let main = streams.remove(0);
    (main, streams)
}

/// The inverse of [`split_session_input`], for writing seeds.
pub fn join_session_input(main: &[u8], page_channels: &[Vec<u8>]) -> Vec<u8> {
    assert!((1..=MAX_CHANNELS).contains(&page_channels.len()));
    let mut data = vec![u8::try_from(page_channels.len() - 1).unwrap_or(u8::MAX)];
    let streams = std::iter::once(main).chain(page_channels.iter().map(Vec::as_slice));
    for (index, stream) in streams.enumerate() {
        for chunk in stream.chunks(usize::from(u16::MAX)) {
            data.push(u8::try_from(index).unwrap_or(u8::MAX));
            data.extend_from_slice(&u16::try_from(chunk.len()).unwrap_or(u16::MAX).to_le_bytes());
            data.extend_from_slice(chunk);
        }
    }
    data
}

/// The key the auth handshake target's destination holds.
pub const FUZZ_AUTH_KEY: &[u8] = b"the fuzzing destination's key";

/// The most bytes of one auth handshake input: more fits in no socket
/// buffer without a reader, and the handshake reads far less.
const MAX_AUTH_INPUT: usize = 16 << 10;

/// Runs the destination's side of a new connection with an auth key (the
/// shared-key handshake, then the hello it must name the same session and
/// channel) on `data` as the bytes the peer sent, over a real socket pair.
/// Whatever the input, it must end in a clear error or a message, never a
/// panic or a hang; without the key no input can pass, since the
/// destination's nonce is fresh.
pub fn destination_auth(data: &[u8]) -> Result<tern_wire::Message, crate::error::ChannelError> {
    use std::io::Write;
    use std::sync::Arc;
    let (ours, mut theirs) =
        std::os::unix::net::UnixStream::pair().map_err(crate::error::ChannelError::Io)?;
    theirs
        .write_all(&data[..data.len().min(MAX_AUTH_INPUT)])
        .map_err(crate::error::ChannelError::Io)?;
    // The end of the input is the end of the stream.
    theirs
        .shutdown(std::net::Shutdown::Write)
        .map_err(crate::error::ChannelError::Io)?;
    let mut channel = crate::transport::Channel::from_socket(ours.into())?;
    channel.set_timeouts(std::time::Duration::from_secs(5))?;
    let key = crate::transport::auth::AuthKey::from_bytes(FUZZ_AUTH_KEY)
        .map_err(|error| crate::error::ChannelError::Auth(error.to_string()))?;
    let security = crate::transport::security::Security {
        tls: None,
        auth_key: Some(Arc::new(key)),
    };
    // `theirs` stays open until here, so the destination's replies land in
    // its buffer instead of failing.
    let arrived = crate::destination::handshake::open(channel, &security);
    drop(theirs);
    arrived.map(|arrived| arrived.message)
}

/// A valid start of an auth handshake (an auth hello for session 1,
/// channel 0, then a proof that cannot match), for seeds.
pub fn sample_auth_input() -> Vec<u8> {
    let mut bytes = Message::AuthHello(tern_wire::AuthHello {
        handshake: Handshake {
            session_id: 1,
            channel_index: 0,
        },
        nonce: [7; tern_wire::AUTH_NONCE_LEN],
    })
    .to_bytes();
    Message::AuthProof(tern_wire::AuthProof {
        proof: [9; tern_wire::AUTH_PROOF_LEN],
    })
    .encode(&mut bytes);
    bytes
}

/// Runs a whole destination session from a fuzz input (see
/// [`split_session_input`]) into a [`MemoryGuest`]. Whatever the input, it
/// must end in `Ok` or a clear error, never a panic or a hang, and what the
/// destination sent back must be valid protocol.
pub fn destination_session(data: &[u8]) -> Result<(), MigrationError> {
    let (main, pages) = split_session_input(data);
    run_session(&main, &pages).map(|_| ())
}

/// Runs a whole destination session built from a fuzz input read as
/// choices (see [`structured::structured_session`]): a valid session of
/// every page kind, codec and dictionary way, corrupted as the input says.
/// The same checks as [`destination_session`].
pub fn structured_destination_session(data: &[u8]) -> Result<SessionEnd, MigrationError> {
    let (main, pages) = structured::structured_session(data);
    run_session(&main, &pages)
}

/// How far a session that ended well went: whether the guest resumed, and
/// the digests the destination compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionEnd {
    /// The digests compared at the switch-over, when the session verified.
    pub digest_comparison: Option<crate::stats::DigestComparison>,
}

/// Runs one session from its streams (main channel, page channels) into a
/// [`MemoryGuest`], checking that the destination's replies are valid
/// protocol and end as the result says.
pub fn run_session(main: &[u8], pages: &[Vec<u8>]) -> Result<SessionEnd, MigrationError> {
    let pages: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
    // Streams that skip the digest reach the receiver too. In memory, a
    // source that falls silent (its stream ends, or holds back a commit the
    // destination has not asked for yet) costs a timeout: a short one keeps
    // such inputs fast.
    let destination = Destination::new(ReceiveConfig {
        allow_unverified: true,
        io_timeout: std::time::Duration::from_millis(100),
        ..ReceiveConfig::default()
    });
    let (result, sent) = destination.receive_from_memory(main, &pages, MemoryGuest::for_setup);
    let replies = tern_wire::decode_stream(&sent, None)
        .unwrap_or_else(|error| panic!("the destination sent invalid bytes: {error}"));
    let verdict = replies.last().map(|frame| match frame {
        tern_wire::Frame::Message(message) => message.kind(),
        tern_wire::Frame::Pages(..) => tern_wire::FrameKind::Pages,
    });
    match &result {
        Ok(received) => {
            assert!(
                received.guest.resumed,
                "a completed session resumes the guest"
            );
            assert_eq!(verdict, Some(tern_wire::FrameKind::Outcome));
        }
        // The source gave up: nothing more is owed to it.
        Err(MigrationError::PeerAborted { .. }) => {}
        Err(error) => assert!(
            matches!(
                verdict,
                None | Some(tern_wire::FrameKind::Abort | tern_wire::FrameKind::Outcome)
            ),
            "a failed session ends with an abort or a refusal, not {verdict:?}: {}",
            error.chain()
        ),
    }
    result.map(|received| SessionEnd {
        digest_comparison: received.digest_comparison,
    })
}

/// A destination guest in anonymous memory of its own (`mmap`, as a VMM's
/// guest RAM is, so the destination may register it with a userfaultfd and
/// place pages as it does in production), as small as the fuzz target
/// allows.
#[derive(Debug)]
pub struct MemoryGuest {
    /// The regions' mappings, unmapped on drop.
    mappings: Vec<Mapping>,
    regions: Vec<MemoryRegion>,
    /// The sections restored.
    pub sections: Vec<StateSection>,
    /// Whether the session resumed the guest.
    pub resumed: bool,
}

/// One anonymous private mapping.
#[derive(Debug)]
struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by its guest; the engine's
// threads reach it through the guest's regions, as they do any guest's.
unsafe impl Send for Mapping {}
// SAFETY: as above; `Mapping` itself is never written through `&self`.
unsafe impl std::marker::Sync for Mapping {}

impl Mapping {
    fn new(len: usize) -> Result<Self, GuestError> {
        if len == 0 {
            // An empty region: nothing to map (mmap refuses a length of 0).
            return Ok(Self {
                base: NonNull::dangling(),
                len,
            });
        }
        // SAFETY: a new anonymous private mapping; no existing memory is
        // affected.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(GuestError::new(format!(
                "mmap of {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        let base = NonNull::new(base.cast()).ok_or_else(|| GuestError::new("mmap gave null"))?;
        Ok(Self { base, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: the mapping this value made; nothing uses it any more
        // (the guest, which lends it out, is being dropped).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

impl MemoryGuest {
    /// A zeroed guest with the setup's regions, or an error when they add
    /// up to more than [`MAX_GUEST_BYTES`].
    pub fn for_setup(setup: &SessionSetup) -> Result<Self, GuestError> {
        let total = setup
            .regions
            .iter()
            .try_fold(0u64, |sum, region| sum.checked_add(region.len));
        if total.is_none_or(|total| total > MAX_GUEST_BYTES) {
            return Err(GuestError::new("the fuzzing guest is at most 1 MiB"));
        }
        let mut mappings = Vec::new();
        let mut regions = Vec::new();
        for info in &setup.regions {
            let mapping = Mapping::new(
                usize::try_from(info.len)
                    .map_err(|_| GuestError::new("a region past the address space"))?,
            )?;
            // SAFETY: `mapping` is a writable mapping of `info.len` bytes (a
            // multiple of the page size, as the decoder checked) that this
            // guest owns and unmaps only when dropped.
            regions.push(unsafe {
                MemoryRegion::new(info.id, info.guest_addr, mapping.base, info.len)
            });
            mappings.push(mapping);
        }
        Ok(Self {
            mappings,
            regions,
            sections: Vec::new(),
            resumed: false,
        })
    }

    /// The bytes of region `index`.
    pub fn region_bytes(&self, index: usize) -> &[u8] {
        let mapping = &self.mappings[index];
        // SAFETY: the whole mapping, alive as long as `self`; the session
        // that wrote it has ended.
        unsafe { std::slice::from_raw_parts(mapping.base.as_ptr(), mapping.len) }
    }
}

impl GuestMemory for MemoryGuest {
    fn regions(&self) -> &[MemoryRegion] {
        &self.regions
    }
}

impl GuestControl for MemoryGuest {
    fn pause(&mut self) -> GuestResult<()> {
        self.resumed = false;
        Ok(())
    }

    fn resume(&mut self) -> GuestResult<()> {
        self.resumed = true;
        Ok(())
    }

    fn set_throttle(&mut self, _percent: u8) -> GuestResult<()> {
        Ok(())
    }
}

impl DeviceState for MemoryGuest {
    fn save_state(&mut self) -> GuestResult<Vec<StateSection>> {
        Ok(self.sections.clone())
    }

    fn restore_state(&mut self, sections: &[StateSection]) -> GuestResult<()> {
        self.sections = sections.to_vec();
        Ok(())
    }
}

/// Dictionary `id` of [`sample_session`]: raw content (zstd takes any
/// bytes without its dictionary magic as a prefix to match against).
/// Dictionary 1 is the setup's, dictionary 2 a refresh.
fn sample_dictionary(id: u8) -> CodecDictionary {
    let text = format!("page of the sample session; dictionary {id} ").repeat(64);
    CodecDictionary::new(id, CodecId::Zstd, text.into_bytes()).expect("within the limits")
}

/// Appends one packet of `pages` (index, content or `None` for a zero
/// page) to `stream`: compressed with `codec` (against `dictionary`)
/// where a page shrinks, in one frame for a packet codec.
fn encode_sample_packet(
    stream: &mut Vec<u8>,
    iteration: u32,
    codec: CodecId,
    dictionary: Option<&CodecDictionary>,
    pages: &[(u32, Option<Vec<u8>>)],
) {
    let data: Vec<&[u8]> = pages
        .iter()
        .filter_map(|(_, content)| content.as_deref())
        .collect();
    let pointers: Vec<*const u8> = data.iter().map(|page| page.as_ptr()).collect();
    let mut batch = CompressedBatch::new();
    if let Ok(mut compressor) =
        PageCompressor::with_dictionary(codec, codec.default_level(), dictionary)
    {
        // SAFETY: every pointer is a whole page of `pages`, alive and
        // unchanged during the call.
        unsafe { compressor.compress_batch(&pointers, &mut batch) };
    }
    let mut entries = Vec::new();
    let mut payload = Vec::new();
    let mut outcome = 0;
    for (page, content) in pages {
        let Some(content) = content else {
            entries.push(PageEntry {
                page_index: *page,
                kind: PageKind::Zero,
                encoded_len: 0,
            });
            continue;
        };
        let (kind, bytes) = match batch.outcomes.get(outcome) {
            Some(PageOutcome::Compressed { offset, len }) => {
                (PageKind::Compressed, &batch.data[*offset..*offset + *len])
            }
            _ => (PageKind::Raw, &content[..]),
        };
        outcome += 1;
        entries.push(PageEntry {
            page_index: *page,
            kind,
            encoded_len: crate::numeric::saturating_u32(bytes.len()),
        });
        payload.extend_from_slice(bytes);
    }
    let header = PagesHeader {
        region_id: 3,
        iteration,
        page_count: 0,
        codec: codec.to_wire(),
        dictionary: dictionary.map_or(0, CodecDictionary::id),
    };
    encode_packet_prefix(stream, &header, &entries);
    stream.extend_from_slice(&payload);
}

/// The session of [`sample_session`].
pub const SAMPLE_SESSION: u64 = 0x7e57_5e55;

/// A valid session of two page channels into one region of 16 pages, which
/// uses every page kind and every codec, two iterations (a page sent again,
/// one turned to zero) and one state section; its streams as
/// (main, page channels). The fuzz targets start from it.
// long: one table of what the sample session sends, and its encoding
pub fn sample_session() -> (Vec<u8>, Vec<Vec<u8>>) {
    const PAGES: usize = 16;
    let setup = SessionSetup {
        page_size: tern_wire::PAGE_SIZE,
        channel_count: 2,
        codecs: 1 << codec_id::ZSTD
            | 1 << codec_id::DEFLATE
            | 1 << codec_id::LZ4
            | 1 << codec_id::ZSTD_PACKET,
        digest: DigestAlgorithm::Xxh3Pages,
        regions: vec![RegionInfo {
            id: 3,
            guest_addr: 1 << 20,
            len: (PAGES * PAGE_SIZE) as u64,
        }],
        guest_kind: String::new(),
        dictionaries: 1,
        vmm_config_len: 0,
    };
    let mut memory = vec![0u8; PAGES * PAGE_SIZE];
    let text = |seed: u8| -> Vec<u8> {
        format!("page {seed} of the sample session; ")
            .into_bytes()
            .into_iter()
            .cycle()
            .take(PAGE_SIZE)
            .collect()
    };
    let noise = |seed: u8| -> Vec<u8> {
        let mut state = u64::from(seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..PAGE_SIZE)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                crate::numeric::low_byte(state)
            })
            .collect()
    };
    let mut channels = vec![Vec::new(), Vec::new()];
    for (index, channel) in channels.iter_mut().enumerate() {
        channel.extend(
            Message::ChannelHello(ChannelHello {
                handshake: Handshake {
                    session_id: SAMPLE_SESSION,
                    channel_index: u16::try_from(index + 1).unwrap_or(u16::MAX),
                },
            })
            .to_bytes(),
        );
    }
    // (iteration, channel, codec, pages as (index, content or None for a
    // zero page)); compressed when the codec is one and the page shrinks.
    type Send = (u32, usize, CodecId, Vec<(u32, Option<Vec<u8>>)>);
    let plan: Vec<Send> = vec![
        (
            0,
            0,
            CodecId::None,
            vec![(0, Some(noise(0))), (1, None), (2, Some(text(2)))],
        ),
        (
            0,
            1,
            CodecId::Zstd,
            vec![(3, Some(text(3))), (4, Some(noise(4))), (5, None)],
        ),
        (0, 0, CodecId::Deflate, vec![(6, Some(text(6)))]),
        (
            0,
            1,
            CodecId::Lz4,
            vec![(7, Some(text(7))), (8, Some(text(8)))],
        ),
        (1, 1, CodecId::None, vec![(0, Some(text(10)))]),
        (1, 0, CodecId::Zstd, vec![(3, None), (9, Some(text(9)))]),
        (
            1,
            1,
            CodecId::ZstdPacket,
            vec![
                (11, Some(text(11))),
                (12, Some(noise(12))),
                (13, Some(text(13))),
            ],
        ),
        (
            0,
            0,
            CodecId::ZstdPacket,
            vec![(14, Some(text(14))), (15, None)],
        ),
    ];
    let dictionaries = [sample_dictionary(1), sample_dictionary(2)];
    for iteration in 0..2u32 {
        for (_, channel, codec, pages) in plan.iter().filter(|send| send.0 == iteration) {
            for (page, content) in pages {
                let start = *page as usize * PAGE_SIZE;
                match content {
                    Some(content) => memory[start..start + PAGE_SIZE].copy_from_slice(content),
                    None => memory[start..start + PAGE_SIZE].fill(0),
                }
            }
            // zstd packets use the setup's dictionary in iteration 0; in
            // iteration 1 per-page zstd uses the refreshed one and the
            // packet frame none, so every way is in the sample.
            let dictionary = codec
                .is_zstd()
                .then_some(&dictionaries[iteration as usize])
                .filter(|_| iteration == 0 || *codec == CodecId::Zstd);
            encode_sample_packet(
                &mut channels[*channel],
                iteration,
                *codec,
                dictionary,
                pages,
            );
        }
        for channel in &mut channels {
            channel.extend(
                Message::Sync(Sync {
                    iteration,
                    last: iteration == 1,
                    // The refresh, sent on the main channel during
                    // iteration 0, is in force from iteration 1.
                    dictionaries: 2,
                })
                .to_bytes(),
            );
        }
    }
    let mut hasher = Xxh3::new();
    add_region(
        &mut hasher,
        3,
        memory.chunks_exact(PAGE_SIZE).map(|page| {
            // SAFETY: a whole page of `memory`, which nothing else uses.
            unsafe { page_hash(page.as_ptr()) }
        }),
    );
    let mut main = Message::Hello(Hello {
        handshake: Handshake {
            session_id: SAMPLE_SESSION,
            channel_index: 0,
        },
        setup,
    })
    .to_bytes();
    for dictionary in &dictionaries {
        main.extend(
            Message::Dictionary(tern_wire::Dictionary {
                id: dictionary.id(),
                codec: codec_id::ZSTD,
                data: dictionary.bytes().to_vec(),
            })
            .to_bytes(),
        );
    }
    main.extend(
        Message::StateSection(StateSectionMsg {
            name: "sample".into(),
            version: 1,
            data: b"state of the sample guest".to_vec(),
        })
        .to_bytes(),
    );
    main.extend(
        Message::Complete(Complete {
            final_iteration: 1,
            sections: 1,
            digest: hasher.digest128(),
        })
        .to_bytes(),
    );
    // The answer to the destination's ready.
    main.extend(Message::Commit.to_bytes());
    (main, channels)
}

//! zstd dictionaries and packet frames end to end: real migrations over
//! TCP checked by digest, and a hand-driven source sending what a correct
//! one never does (an oversized, unexpected or misnumbered dictionary, a
//! packet naming a dictionary the main channel never delivers, a packet frame of the
//! wrong size or cut short). Each must end in a clear error within a
//! bounded time.

use crate::common;

use std::time::Duration;

use common::*;
use tern_engine::{Address, Channel, GuestMemory, MigrationStatus, Source};
use tern_page::codec::{CodecChoice, CodecId, CompressedBatch, PageCompressor};
use tern_wire::{
    ChannelHello, DigestAlgorithm, FRAME_HEADER_LEN, FrameHeader, FrameKind, Handshake, Hello,
    Message, PageEntry, PageKind, PagesHeader, RegionInfo, SessionSetup, codec_id,
};

const SESSION: u64 = 0xd1c7;
const REGION_BYTES: u64 = 4 << 20;

/// Migrates a dirtying guest with `configure` applied; the destination's
/// memory must equal the source's by digest (compared by the destination
/// before it resumes: once resumed, its guest writes again).
fn migrate(
    configure: impl FnOnce(&mut tern_engine::MigrationConfig),
) -> tern_engine::MigrationStats {
    migrate_guest(&mut guest(32 * MIB, 8 * MIB), configure, Address::clone)
}

/// Migrates `guest` with `configure` applied, to a destination reached
/// through `link` (given the destination's address, the one the source
/// connects to); the destination must verify by digest.
pub(crate) fn migrate_guest(
    guest: &mut tern_synthetic::SyntheticGuest,
    configure: impl FnOnce(&mut tern_engine::MigrationConfig),
    link: impl FnOnce(&Address) -> Address,
) -> tern_engine::MigrationStats {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut config = migration_config(2);
    configure(&mut config);
    let stats = Source::new(config)
        .unwrap()
        .migrate(guest, &link(&address))
        .expect("migration");
    join_within(destination, "the destination").expect("destination");
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(stats.digest_verified);
    stats
}

#[test]
fn zstd_against_a_trained_dictionary_verifies() {
    let stats = migrate(|config| {
        config.compression = CodecChoice::Zstd;
        config.compression_dictionary = Some(16 << 10);
    });
    let report = stats.compression.expect("compression report");
    let dictionary = report.dictionary.expect("a dictionary was trained");
    assert!(dictionary.bytes > 0 && dictionary.bytes <= 16 << 10);
    assert!(dictionary.sample_pages > 0);
    assert!(report.codecs["zstd"].compressed > 0, "{:?}", report.codecs);
}

#[test]
fn packet_frames_verify_with_and_without_a_dictionary() {
    for dictionary in [None, Some(32 << 10)] {
        let stats = migrate(|config| {
            config.compression = CodecChoice::Zstd;
            config.packet_frames = true;
            config.compression_dictionary = dictionary;
        });
        let report = stats.compression.expect("compression report");
        assert_eq!(report.dictionary.is_some(), dictionary.is_some());
        let packet = &report.codecs["zstd-packet"];
        assert!(packet.compressed > 0, "{:?}", report.codecs);
        assert!(packet.ratio > 1.0);
        assert!(stats.ram.transferred < stats.ram.normal_bytes);
    }
}

#[test]
fn packet_frames_of_a_guest_with_nothing_to_compress_verify() {
    // Every data page random: packets of the packet codec with no frame.
    let mut guest = guest_with(tern_synthetic::SyntheticConfig {
        memory_bytes: 16 * MIB,
        regions: 1,
        mix: tern_synthetic::ContentMix::new(20, 80, 0).unwrap(),
        seed: 5,
        dirty_rate_bytes_per_sec: 0,
        working_set_bytes: 4 * MIB,
        dirtier_threads: 1,
    });
    let stats = migrate_guest(
        &mut guest,
        |config| {
            config.compression = CodecChoice::Zstd;
            config.packet_frames = true;
            config.compression_dictionary = Some(16 << 10);
        },
        Address::clone,
    );
    let report = stats.compression.expect("compression report");
    // Nothing to learn from random pages: no dictionary, and no frame.
    assert!(report.dictionary.is_none());
    assert_eq!(report.codecs["zstd-packet"].compressed, 0);
}

#[test]
fn auto_with_a_dictionary_verifies() {
    let stats = migrate(|config| {
        config.compression = CodecChoice::Auto;
        config.compression_dictionary = Some(16 << 10);
        config.max_bandwidth = Some(16 * MIB);
    });
    let report = stats.compression.expect("compression report");
    assert!(report.dictionary.is_some());
    assert!(report.codecs.values().any(|codec| codec.compressed > 0));
}

/// A guest whose data pages are 4 KiB windows of one 12 KiB passage of
/// letters: a dictionary trained on them holds the passage, and a page
/// then costs a few bytes, while without it every page costs about 60 %
/// of its size. At every dirty-log sync (the first ends iteration 0) it
/// rewrites its working set with windows of another passage, so the
/// setup's dictionary stops helping: a refresh pays.
pub(crate) struct ChangingGuest {
    pub(crate) inner: tern_synthetic::SyntheticGuest,
    working_set_pages: u64,
}

const PASSAGE_LEN: usize = 12 << 10;

fn passage(seed: u64) -> Vec<u8> {
    let mut state = seed;
    (0..PASSAGE_LEN)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            b"abcdefghijklmnopqrstuvwxyz "[((state >> 33) % 27) as usize]
        })
        .collect()
}

/// A one-region guest of `memory` bytes filled with `mix` from `seed`,
/// which writes nothing by itself.
fn still_guest(
    memory: u64,
    mix: tern_synthetic::ContentMix,
    seed: u64,
) -> tern_synthetic::SyntheticGuest {
    guest_with(tern_synthetic::SyntheticConfig {
        memory_bytes: memory,
        regions: 1,
        mix,
        seed,
        dirty_rate_bytes_per_sec: 0,
        working_set_bytes: 0,
        dirtier_threads: 1,
    })
}

impl ChangingGuest {
    pub(crate) fn new(memory: u64, working_set_pages: u64) -> Self {
        let inner = still_guest(
            memory,
            tern_synthetic::ContentMix::new(100, 0, 0).unwrap(),
            3,
        );
        let mut guest = Self {
            inner,
            working_set_pages,
        };
        let pages = guest.inner.regions()[0].pages();
        guest.write(pages, 1);
        guest
    }

    /// Fills the first `pages` pages with windows of passage `seed`, each
    /// page's window at another offset.
    fn write(&mut self, pages: u64, seed: u64) {
        let text = passage(seed);
        let region = &self.inner.regions()[0];
        for page in 0..pages {
            let offset = (usize::try_from(page).unwrap() * 1031
                + usize::try_from(seed).unwrap() * 17)
                % (PASSAGE_LEN - 4096);
            let ptr = region.page_ptr(page).expect("inside the region");
            // SAFETY: a whole page of the guest's own mapping; the source
            // reads pages only while an iteration is sent, never during
            // the dirty-log sync that calls this.
            unsafe { std::ptr::copy_nonoverlapping(text[offset..].as_ptr(), ptr, 4096) };
        }
    }
}

impl tern_engine::GuestMemory for ChangingGuest {
    fn regions(&self) -> &[tern_engine::MemoryRegion] {
        self.inner.regions()
    }
}

impl tern_engine::DirtyLog for ChangingGuest {
    fn start_dirty_log(&mut self) -> tern_engine::GuestResult<()> {
        self.inner.start_dirty_log()
    }

    fn sync_dirty_log(
        &mut self,
        bitmaps: &mut [tern_engine::DirtyBitmap],
    ) -> tern_engine::GuestResult<()> {
        self.inner.sync_dirty_log(bitmaps)?;
        self.write(self.working_set_pages, 2);
        for page in 0..self.working_set_pages {
            bitmaps[0].set(page);
        }
        Ok(())
    }

    fn stop_dirty_log(&mut self) -> tern_engine::GuestResult<()> {
        self.inner.stop_dirty_log()
    }
}

impl tern_engine::GuestControl for ChangingGuest {
    fn pause(&mut self) -> tern_engine::GuestResult<()> {
        self.inner.pause()
    }

    fn resume(&mut self) -> tern_engine::GuestResult<()> {
        self.inner.resume()
    }

    fn set_throttle(&mut self, percent: u8) -> tern_engine::GuestResult<()> {
        self.inner.set_throttle(percent)
    }
}

impl tern_engine::DeviceState for ChangingGuest {
    fn save_state(&mut self) -> tern_engine::GuestResult<Vec<tern_engine::StateSection>> {
        self.inner.save_state()
    }

    fn restore_state(
        &mut self,
        sections: &[tern_engine::StateSection],
    ) -> tern_engine::GuestResult<()> {
        self.inner.restore_state(sections)
    }

    fn state_size_hint(&self) -> u64 {
        self.inner.state_size_hint()
    }

    fn guest_kind(&self) -> &str {
        self.inner.guest_kind()
    }
}

/// Migrates a [`ChangingGuest`] through iterations 0 to 3 and a forced
/// switch-over, checked by digest.
fn migrate_changing_guest(
    packet_frames: bool,
    refresh: tern_engine::DictionaryRefresh,
) -> tern_engine::MigrationStats {
    // 2048 pages of the first passage; from iteration 1 on, 512 of them
    // hold the second, written again at every sync.
    let mut guest = ChangingGuest::new(8 * MIB, 512);
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut config = migration_config(2);
    config.compression = CodecChoice::Zstd;
    config.packet_frames = packet_frames;
    config.compression_dictionary = Some(32 << 10);
    config.dictionary_refresh = refresh;
    // Never converges by itself: iterations 0 to 3 run, then the
    // switch-over is forced.
    config.downtime_limit = Duration::from_nanos(1);
    config.max_iterations = Some(4);
    config.limit_policy = tern_engine::LimitPolicy::SwitchOver;
    let stats = Source::new(config)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect("migration");
    join_within(destination, "the destination").expect("destination");
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(stats.digest_verified);
    stats
}

#[test]
fn a_guest_whose_pages_change_character_gets_a_refreshed_dictionary() {
    use tern_engine::DictionaryRefresh;
    for packet_frames in [false, true] {
        let stats = migrate_changing_guest(packet_frames, DictionaryRefresh::AtBoundary);
        let report = stats.compression.expect("compression report");
        let dictionary = report.dictionary.expect("a dictionary was trained");
        // Iteration 1 sends the second passage against the first's
        // dictionary: its ratio collapses, and a dictionary trained on it
        // is in force from iteration 2; that one keeps its ratio.
        assert_eq!(dictionary.refreshes, 1, "{dictionary:?}");
        assert_eq!(dictionary.trained, 2);
        assert!(dictionary.refresh_training_ms > 0.0);
        // It pays: iterations 2, 3 and the switch-over send 3 × 512 pages
        // of the second passage. Per page, against the old dictionary,
        // each costs ~2.5 KiB, against the new one a few bytes (measured:
        // 1.4 MB in all against 5.2 MB); a packet frame finds much of the
        // passage inside itself, so there it saves less (114 KB, 198 KB).
        let without = migrate_changing_guest(packet_frames, DictionaryRefresh::Off);
        let without_report = without.compression.expect("compression report");
        assert_eq!(without_report.dictionary.expect("setup's").refreshes, 0);
        let saved = if packet_frames { 16 << 10 } else { 2 * MIB };
        assert!(
            stats.ram.transferred + saved < without.ram.transferred,
            "{} bytes with the refresh, {} without",
            stats.ram.transferred,
            without.ram.transferred
        );
    }
}

#[test]
fn dictionary_options_outside_zstd_are_refused_up_front() {
    let mut config = migration_config(2);
    config.compression = CodecChoice::Lz4;
    config.packet_frames = true;
    let error = Source::new(config).unwrap_err().to_string();
    assert!(
        error.contains("packet frames are a zstd framing"),
        "{error}"
    );
    let mut config = migration_config(2);
    config.compression = CodecChoice::Deflate;
    config.compression_dictionary = Some(4096);
    let error = Source::new(config).unwrap_err().to_string();
    assert!(error.contains("dictionaries are zstd's"), "{error}");
    let mut config = migration_config(2);
    config.compression = CodecChoice::Zstd;
    config.compression_dictionary = Some(1 << 20);
    let error = Source::new(config).unwrap_err().to_string();
    assert!(error.contains("must be 256 to"), "{error}");
}

/// A destination on its own thread and a source driven by hand.
pub(crate) struct Attack {
    destination: std::thread::JoinHandle<DestinationResult>,
    address: Address,
    main: Channel,
}

fn connect(address: &Address) -> Channel {
    let mut channel = Channel::connect(address, Duration::from_secs(10)).expect("connect");
    channel.set_timeouts(DEADLINE).expect("timeouts");
    channel
}

/// Sends a hello announcing `codecs` and `dictionaries`, one page channel,
/// and reads the welcome.
pub(crate) fn hello(codecs: u8, dictionaries: u8) -> Attack {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut main = connect(&address);
    main.send_message(&Message::Hello(Hello {
        handshake: Handshake {
            session_id: SESSION,
            channel_index: 0,
        },
        setup: SessionSetup {
            page_size: 4096,
            channel_count: 1,
            codecs,
            digest: DigestAlgorithm::Xxh3Pages,
            regions: vec![RegionInfo {
                id: 0,
                guest_addr: 0,
                len: REGION_BYTES,
            }],
            guest_kind: "synthetic".into(),
            dictionaries,
            vmm_config_len: 0,
        },
    }))
    .expect("hello");
    assert!(matches!(main.read_message(), Ok(Message::Welcome(_))));
    Attack {
        destination,
        address,
        main,
    }
}

impl Attack {
    pub(crate) fn page_channel(&self) -> Channel {
        let mut channel = connect(&self.address);
        channel
            .send_message(&Message::ChannelHello(ChannelHello {
                handshake: Handshake {
                    session_id: SESSION,
                    channel_index: 1,
                },
            }))
            .expect("channel hello");
        assert!(matches!(channel.read_message(), Ok(Message::Welcome(_))));
        channel
    }

    /// The destination's error, which must come within [`DEADLINE`] (the
    /// join is bounded by its own timeouts) and mention `needle`.
    pub(crate) fn expect_error(self, needle: &str) {
        let error = join_within(self.destination, "the destination")
            .expect_err("the destination must refuse the session");
        assert!(
            error.chain().contains(needle),
            "{needle:?} not in: {}",
            error.chain()
        );
    }
}

fn dictionary_message(id: u8, len: usize) -> Message {
    Message::Dictionary(tern_wire::Dictionary {
        id,
        codec: codec_id::ZSTD,
        data: (0..len).map(|i| u8::try_from(i % 251).unwrap()).collect(),
    })
}

#[test]
fn an_oversized_dictionary_is_refused_at_its_header() {
    let mut attack = hello(1 << codec_id::ZSTD, 1);
    // Only the header: the destination must not wait for the body.
    let header = FrameHeader {
        kind: FrameKind::Dictionary,
        body_len: u32::try_from(FrameKind::Dictionary.max_body() + 1).unwrap(),
    };
    attack.main.write_all(&header.encode()).expect("header");
    attack.expect_error("exceeds the limit");
}

#[test]
fn a_dictionary_the_hello_did_not_announce_is_refused() {
    let mut attack = hello(1 << codec_id::ZSTD, 0);
    attack
        .main
        .send_message(&dictionary_message(1, 1024))
        .expect("dictionary");
    attack.expect_error("got Dictionary");
}

#[test]
fn a_dictionary_of_another_id_than_expected_is_refused() {
    let mut attack = hello(1 << codec_id::ZSTD, 1);
    attack
        .main
        .send_message(&dictionary_message(2, 1024))
        .expect("dictionary");
    attack.expect_error("expected dictionary 1 of 1, got dictionary 2");
}

/// One packet of region 0, iteration 0, with `entries` and `payload`.
pub(crate) fn packet(codec: u8, dictionary: u8, entries: &[PageEntry], payload: &[u8]) -> Vec<u8> {
    let header = PagesHeader {
        region_id: 0,
        iteration: 0,
        page_count: 0,
        codec,
        dictionary,
    };
    let mut bytes = Vec::new();
    tern_wire::encode_packet_prefix(&mut bytes, &header, entries);
    bytes.extend_from_slice(payload);
    assert_eq!(
        bytes.len(),
        FRAME_HEADER_LEN
            + PagesHeader::ENCODED_LEN
            + entries.len() * PageEntry::ENCODED_LEN
            + payload.len()
    );
    bytes
}

pub(crate) fn compressed(page_index: u32, encoded_len: usize) -> PageEntry {
    PageEntry {
        page_index,
        kind: PageKind::Compressed,
        encoded_len: u32::try_from(encoded_len).unwrap(),
    }
}

/// A zstd packet frame of `pages` text-like pages.
fn packet_frame(pages: usize) -> Vec<u8> {
    let pages: Vec<[u8; 4096]> = (0..pages)
        .map(|i| tern_page::codec::corpus_page("text", i as u64 + 1))
        .collect();
    let pointers: Vec<*const u8> = pages.iter().map(|page| page.as_ptr()).collect();
    let mut batch = CompressedBatch::new();
    let mut compressor = PageCompressor::new(CodecId::ZstdPacket, 1).unwrap();
    // SAFETY: whole pages of `pages`, alive during the call.
    unsafe { compressor.compress_batch(&pointers, &mut batch) };
    batch.data
}

#[test]
fn a_packet_naming_a_dictionary_the_session_lacks_is_refused() {
    let attack = hello(1 << codec_id::ZSTD, 0);
    let mut channel = attack.page_channel();
    let bytes = packet(codec_id::ZSTD, 1, &[compressed(0, 10)], &[0; 10]);
    let _ = channel.write_all(&bytes);
    attack.expect_error("dictionary 1");
}

#[test]
fn a_packet_frame_decoding_to_the_wrong_size_is_refused() {
    let attack = hello(1 << codec_id::ZSTD_PACKET, 0);
    let mut channel = attack.page_channel();
    // A frame of one page for a packet that says two.
    let frame = packet_frame(1);
    let bytes = packet(
        codec_id::ZSTD_PACKET,
        0,
        &[compressed(0, frame.len()), compressed(1, 0)],
        &frame,
    );
    let _ = channel.write_all(&bytes);
    attack.expect_error("packet frame decodes to 4096 bytes, expected 8192");
}

#[test]
fn a_truncated_packet_frame_is_refused() {
    let attack = hello(1 << codec_id::ZSTD_PACKET, 0);
    let mut channel = attack.page_channel();
    let frame = packet_frame(4);
    let cut = &frame[..frame.len() / 2];
    let entries: Vec<PageEntry> = (0..4)
        .map(|page| compressed(page, if page == 0 { cut.len() } else { 0 }))
        .collect();
    let _ = channel.write_all(&packet(codec_id::ZSTD_PACKET, 0, &entries, cut));
    attack.expect_error("zstd page malformed");
}

/// A session with the setup's dictionary 1 and one page channel.
fn session_with_one_dictionary() -> (Attack, Channel) {
    let mut attack = hello(1 << codec_id::ZSTD, 1);
    attack
        .main
        .send_message(&dictionary_message(1, 1024))
        .expect("dictionary");
    let channel = attack.page_channel();
    (attack, channel)
}

fn sync(iteration: u32, dictionaries: u8) -> Message {
    Message::Sync(tern_wire::Sync {
        iteration,
        last: false,
        dictionaries,
    })
}

/// Protocol 13: a packet may name a dictionary the main channel delivered
/// during the pass, before any sync counted it (auto's first, trained
/// mid-pass). This one passes the naming and reaches the decoder, which
/// finds its garbage page against dictionary 2.
#[test]
fn a_packet_may_name_a_dictionary_delivered_before_its_barrier() {
    let (mut attack, mut channel) = session_with_one_dictionary();
    attack
        .main
        .send_message(&dictionary_message(2, 1024))
        .expect("dictionary");
    let bytes = packet(codec_id::ZSTD, 2, &[compressed(0, 10)], &[0; 10]);
    let _ = channel.write_all(&bytes);
    attack.expect_error("zstd page malformed");
}

/// The main channel's copy may come after the packet naming it (two
/// connections race), so the receiver waits for it, but only as long as
/// the I/O timeout.
#[test]
fn a_packet_naming_a_dictionary_never_delivered_fails_within_the_timeout() {
    let (attack, mut channel) = session_with_one_dictionary();
    let bytes = packet(codec_id::ZSTD, 2, &[compressed(0, 10)], &[0; 10]);
    let _ = channel.write_all(&bytes);
    attack.expect_error("a packet names dictionary 2, the main channel delivered 1");
}

#[test]
fn a_refreshed_dictionary_out_of_turn_is_refused() {
    let (mut attack, _channel) = session_with_one_dictionary();
    attack
        .main
        .send_message(&dictionary_message(3, 1024))
        .expect("dictionary");
    attack.expect_error("dictionary 3 sent where dictionary 2 was due");
}

#[test]
fn a_sync_counting_fewer_dictionaries_than_in_force_is_refused() {
    let (attack, mut channel) = session_with_one_dictionary();
    channel.send_message(&sync(0, 0)).expect("sync");
    attack.expect_error("a sync counts 0 dictionaries, 1 are already in force");
}

#[test]
fn a_sync_counting_a_dictionary_that_never_comes_fails_within_the_timeout() {
    let (attack, mut channel) = session_with_one_dictionary();
    channel.send_message(&sync(0, 2)).expect("sync");
    // The destination's I/O timeout bounds the wait.
    attack.expect_error("a sync counts 2 dictionaries, the main channel delivered 1");
}

/// Issue 23: a dictionary libzstd refuses (the dictionary magic, then
/// bytes that are no entropy tables) is named as the source's malformed
/// dictionary, not as libzstd's "not enough memory".
#[test]
fn a_malformed_dictionary_is_named_as_the_source_s() {
    let mut attack = hello(1 << codec_id::ZSTD, 1);
    let mut data = 0xec30_a437_u32.to_le_bytes().to_vec();
    data.extend((0..1020).map(|i| u8::try_from(i % 251).unwrap()));
    attack
        .main
        .send_message(&Message::Dictionary(tern_wire::Dictionary {
            id: 1,
            codec: codec_id::ZSTD,
            data,
        }))
        .expect("dictionary");
    attack.expect_error("the source's dictionary 1 (1024 bytes) is not a zstd dictionary");
}

/// A guest like the benchmarks' `mixed` image: per page zero (half),
/// random (a quarter) or a 4 KiB slice of one 64 KiB passage of letters at
/// a seeded offset (a quarter). A packet frame holds a few dozen slices of
/// the passage, a 64 KiB dictionary all of it: the dictionary pays even in
/// packet frames, as it does on that image.
pub(crate) fn sliced_text_guest(memory: u64) -> tern_synthetic::SyntheticGuest {
    let guest = still_guest(
        memory,
        tern_synthetic::ContentMix::new(75, 25, 0).unwrap(),
        9,
    );
    const LONG_PASSAGE: usize = 64 << 10;
    let text: Vec<u8> = (0..LONG_PASSAGE / PASSAGE_LEN + 1)
        .flat_map(|seed| passage(seed as u64 + 100))
        .take(LONG_PASSAGE)
        .collect();
    let region = &guest.regions()[0];
    // A quarter of the pages, scattered (a stride would dodge samplers
    // that also stride).
    let sliced = |page: u64| (page.wrapping_mul(2_654_435_761) >> 11) % 4 == 1;
    for page in (0..region.pages()).filter(|&page| sliced(page)) {
        let offset = usize::try_from(page.wrapping_mul(7919)).unwrap() % (LONG_PASSAGE - 4096);
        let ptr = region.page_ptr(page).expect("inside the region");
        // SAFETY: a whole page of the guest's own mapping, before any
        // migration reads it.
        unsafe { std::ptr::copy_nonoverlapping(text[offset..].as_ptr(), ptr, 4096) };
    }
    guest
}

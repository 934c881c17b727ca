//! What the incremental digest must catch (docs/verification.md): a page
//! changed on the destination after it landed, a page that never arrived,
//! and a stale copy of a page delivered after the fresh one. (The lying
//! dirty log is `migration::a_lying_dirty_log_is_caught_by_the_digest_and_the_source_runs_on`.)
//! Each case ends with the digests differing and the guest not resumed;
//! a control case shows the same fake source verifies when it is honest.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use tern_engine::{
    Channel, Destination, DeviceState, DirtyBitmap, GuestControl, GuestMemory, GuestResult,
    MemoryRegion, MigrationError, Source,
};
use tern_wire::{
    ChannelHello, Complete, DigestAlgorithm, Handshake, Hello, Message, RegionInfo, SessionSetup,
    StateSectionMsg, Sync,
};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

const SESSION: u64 = 0x00d1_6e57;
const PAGE: usize = 4096;
const REGION_PAGES: usize = 256;
/// Pages the fake source fills with data; the rest stay zero.
const DATA_PAGES: usize = 24;

/// The fake source's memory: distinct data in the first pages.
fn source_memory() -> Vec<u8> {
    let mut memory = vec![0u8; REGION_PAGES * PAGE];
    for page in 0..DATA_PAGES {
        page_bytes(&mut memory, page).fill(u8::try_from(page).unwrap() + 1);
        page_bytes(&mut memory, page)[17] = 0xC3;
    }
    memory
}

fn page_bytes(memory: &mut [u8], page: usize) -> &mut [u8] {
    &mut memory[page * PAGE..(page + 1) * PAGE]
}

/// The digest the protocol defines (docs/protocol.md): XXH3-128 over the
/// region's id and the XXH3-64 of each page, computed here independently
/// of the engine.
fn protocol_digest(memory: &[u8]) -> u128 {
    let mut hasher = Xxh3::new();
    hasher.update(&0u32.to_le_bytes());
    for page in memory.chunks(PAGE) {
        hasher.update(&xxh3_64(page).to_le_bytes());
    }
    hasher.digest128()
}

struct FakeSource {
    main: Channel,
    pages: Channel,
}

impl FakeSource {
    fn connect(address: &tern_engine::Address) -> Self {
        let setup = SessionSetup {
            page_size: u32::try_from(PAGE).unwrap(),
            channel_count: 1,
            codecs: 0,
            digest: DigestAlgorithm::Xxh3Pages,
            regions: vec![RegionInfo {
                id: 0,
                guest_addr: 0,
                len: (REGION_PAGES * PAGE) as u64,
            }],
            guest_kind: "synthetic".into(),
            dictionaries: 0,
            vmm_config_len: 0,
        };
        let handshake = |channel_index| Handshake {
            session_id: SESSION,
            channel_index,
        };
        let mut main = Channel::connect(address, Duration::from_secs(5)).expect("connect");
        main.set_timeouts(DEADLINE).expect("timeouts");
        main.send_message(&Message::Hello(Hello {
            handshake: handshake(0),
            setup,
        }))
        .unwrap();
        assert!(matches!(main.read_message().unwrap(), Message::Welcome(_)));
        let mut pages = Channel::connect(address, Duration::from_secs(5)).expect("connect");
        pages.set_timeouts(DEADLINE).expect("timeouts");
        pages
            .send_message(&Message::ChannelHello(ChannelHello {
                handshake: handshake(1),
            }))
            .unwrap();
        assert!(matches!(pages.read_message().unwrap(), Message::Welcome(_)));
        Self { main, pages }
    }

    /// Sends `pages` of `memory` raw in one packet of `iteration`.
    fn send_pages(&mut self, iteration: u32, memory: &[u8], pages: &[usize]) {
        let indices: Vec<u32> = pages
            .iter()
            .map(|&page| u32::try_from(page).unwrap())
            .collect();
        let mut bytes = raw_pages_prefix(iteration, &indices);
        for &page in pages {
            bytes.extend_from_slice(&memory[page * PAGE..(page + 1) * PAGE]);
        }
        self.pages.write_all(&bytes).unwrap();
    }

    fn sync(&mut self, iteration: u32, last: bool) {
        self.pages
            .send_message(&Message::Sync(Sync {
                iteration,
                last,
                dictionaries: 0,
            }))
            .unwrap();
    }

    /// Ends at `final_iteration` claiming `digest`; returns the
    /// destination's explanation when it did not verify.
    fn complete(&mut self, final_iteration: u32, digest: u128) -> Result<(), String> {
        // The state a synthetic guest needs to resume.
        let sections = tern_synthetic::SyntheticGuest::empty(&[(REGION_PAGES * PAGE) as u64])
            .unwrap()
            .save_state()
            .unwrap();
        for section in &sections {
            self.main
                .send_message(&Message::StateSection(StateSectionMsg {
                    name: section.name.clone(),
                    version: section.version,
                    data: section.data.clone(),
                }))
                .unwrap();
        }
        self.main
            .send_message(&Message::Complete(Complete {
                final_iteration,
                sections: u32::try_from(sections.len()).unwrap(),
                digest,
            }))
            .unwrap();
        loop {
            match self.main.read_message() {
                Ok(Message::Heartbeat(_) | Message::PassApplied(_)) => {}
                // The digests matched: commit, as a source does.
                Ok(Message::Ready(_)) => self.main.send_message(&Message::Commit).unwrap(),
                Ok(Message::Outcome(outcome)) if outcome.verified => return Ok(()),
                Ok(Message::Outcome(outcome)) => return Err(outcome.detail),
                other => panic!("expected the destination's verdict, got {other:?}"),
            }
        }
    }
}

fn all_data_pages() -> Vec<usize> {
    (0..DATA_PAGES).collect()
}

fn assert_mismatch(outcome: Result<(), String>) {
    let detail = outcome.expect_err("the destination must not verify");
    assert!(detail.contains("digest"), "{detail}");
}

fn expect_mismatch(destination: std::thread::JoinHandle<DestinationResult>) {
    let error = join_within(destination, "the destination").expect_err("destination must refuse");
    assert!(
        matches!(error, MigrationError::DigestMismatch { .. }),
        "{}",
        error.chain()
    );
}

#[test]
fn an_honest_fake_source_verifies() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let memory = source_memory();
    let mut source = FakeSource::connect(&address);
    source.send_pages(0, &memory, &all_data_pages());
    source.sync(0, true);
    source.complete(0, protocol_digest(&memory)).unwrap();
    let received = join_within(destination, "the destination").expect("destination verifies");
    assert_eq!(received.guest.region_bytes(0).unwrap(), memory);
    let comparison = received
        .digest_comparison
        .expect("the destination reports the digests it compared");
    assert_eq!(comparison.source, protocol_digest(&memory));
    assert_eq!(comparison.destination, protocol_digest(&memory));
}

/// The bytes a faulty copy or decoder would have left: the destination's
/// digest is read back from what its memory holds, so it is the digest of
/// the wrong page, computed here independently, and differs from the
/// source's.
#[test]
fn a_page_copied_or_decompressed_wrongly_is_caught() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let memory = source_memory();
    let mut landed = memory.clone();
    page_bytes(&mut landed, 5)[100] ^= 0x40;
    let mut source = FakeSource::connect(&address);
    source.send_pages(0, &landed, &all_data_pages());
    source.sync(0, true);
    assert_mismatch(source.complete(0, protocol_digest(&memory)));
    let error = join_within(destination, "the destination").expect_err("destination must refuse");
    let MigrationError::DigestMismatch {
        source_digest,
        destination,
    } = error
    else {
        panic!("expected a digest mismatch: {}", error.chain());
    };
    assert_eq!(source_digest, protocol_digest(&memory));
    assert_eq!(
        destination,
        protocol_digest(&landed),
        "the destination's digest is that of the memory it holds"
    );
}

#[test]
fn a_dropped_page_is_caught() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let memory = source_memory();
    let mut source = FakeSource::connect(&address);
    let mut pages = all_data_pages();
    pages.retain(|&page| page != 7);
    source.send_pages(0, &memory, &pages);
    source.sync(0, true);
    assert_mismatch(source.complete(0, protocol_digest(&memory)));
    expect_mismatch(destination);
}

#[test]
fn a_stale_page_resent_after_the_fresh_one_is_caught() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let stale = source_memory();
    let mut fresh = stale.clone();
    page_bytes(&mut fresh, 3)[100] ^= 0x5A;
    let mut source = FakeSource::connect(&address);
    // Iteration 0 carries the fresh page 3; the stale copy comes late, in
    // iteration 1, as if an old buffer had been sent again.
    source.send_pages(0, &fresh, &all_data_pages());
    source.sync(0, false);
    source.send_pages(1, &stale, &[3]);
    source.sync(1, true);
    assert_mismatch(source.complete(1, protocol_digest(&fresh)));
    expect_mismatch(destination);
}

/// A source guest that, once paused (so no page is sent again), changes a
/// page of the destination's memory that has landed there, then waits
/// until the destination's audit has made a complete pass since.
struct CorruptsTheDestination {
    guest: tern_synthetic::SyntheticGuest,
    destination_memory: Arc<Mutex<Option<MemoryRegion>>>,
    destination_stats: Arc<tern_engine::ReceiveStats>,
    paused: bool,
    corrupted: bool,
}

impl CorruptsTheDestination {
    fn corrupt(&mut self) {
        let region = self
            .destination_memory
            .lock()
            .unwrap()
            .expect("the destination made its guest");
        // A page that landed with data: the destination's memory holds a
        // non-zero byte in it.
        let page = (0..region.pages())
            .find(|&page| {
                let ptr = region.page_ptr(page).unwrap();
                // SAFETY: a whole page of the destination's live mapping;
                // its receivers wrote it in an earlier iteration.
                let bytes = unsafe { std::slice::from_raw_parts(ptr, PAGE) };
                bytes.iter().any(|&byte| byte != 0)
            })
            .expect("some page landed with data");
        let passes_before = self.destination_stats.audit_passes();
        // SAFETY: as above; no receiver writes this page any more (the
        // source guest is paused and the page is not dirty).
        unsafe { *region.page_ptr(page).unwrap().add(99) ^= 0xFF };
        // The pass under way may have read the page before the change; the
        // one after it starts after the change.
        wait_until("the destination's audit passed twice more", || {
            self.destination_stats.audit_passes() >= passes_before + 2
        });
    }
}

impl GuestMemory for CorruptsTheDestination {
    fn regions(&self) -> &[MemoryRegion] {
        self.guest.regions()
    }
}

impl tern_engine::DirtyLog for CorruptsTheDestination {
    fn start_dirty_log(&mut self) -> GuestResult<()> {
        self.guest.start_dirty_log()
    }

    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
        self.guest.sync_dirty_log(bitmaps)?;
        if self.paused && !self.corrupted {
            self.corrupted = true;
            self.corrupt();
        }
        Ok(())
    }

    fn stop_dirty_log(&mut self) -> GuestResult<()> {
        self.guest.stop_dirty_log()
    }
}

impl GuestControl for CorruptsTheDestination {
    fn pause(&mut self) -> GuestResult<()> {
        self.paused = true;
        self.guest.pause()
    }

    fn resume(&mut self) -> GuestResult<()> {
        self.paused = false;
        self.guest.resume()
    }

    fn set_throttle(&mut self, percent: u8) -> GuestResult<()> {
        self.guest.set_throttle(percent)
    }
}

impl DeviceState for CorruptsTheDestination {
    fn save_state(&mut self) -> GuestResult<Vec<tern_engine::StateSection>> {
        self.guest.save_state()
    }

    fn restore_state(&mut self, sections: &[tern_engine::StateSection]) -> GuestResult<()> {
        self.guest.restore_state(sections)
    }
}

#[test]
fn a_page_changed_on_the_destination_after_it_landed_is_caught() {
    let (listener, address) = tcp_listener();
    let memory_slot: Arc<Mutex<Option<MemoryRegion>>> = Arc::default();
    let receiver = Destination::new(receive_config());
    let destination_stats = receiver.stats();
    let slot = memory_slot.clone();
    let destination = std::thread::spawn(move || {
        receiver.receive(&listener, |setup| {
            let guest = make_destination_guest(setup)?;
            *slot.lock().unwrap() = Some(guest.regions()[0]);
            Ok(guest)
        })
    });
    let mut guest = CorruptsTheDestination {
        guest: guest(16 * MIB, 0),
        destination_memory: memory_slot,
        destination_stats,
        paused: false,
        corrupted: false,
    };
    let failure = Source::new(migration_config(2))
        .unwrap()
        .migrate(&mut guest, &address)
        .expect_err("the changed page must be detected");
    assert!(guest.corrupted, "the test changed no page");
    assert!(
        matches!(failure.error, MigrationError::DigestMismatch { .. }),
        "{}",
        failure.error.chain()
    );
    assert!(guest.guest.is_running(), "the source guest must run on");
    expect_mismatch(destination);
    guest.guest.pause().unwrap();
}

/// A source guest whose dirty log forgets one write: after the first
/// iteration has sent every page, it changes a page with data, reports
/// nothing, and lets the migration go on once the source's audit has made a
/// complete pass since. Unlike the always-forgetful log of the migration
/// tests, nothing here races with the sending of the page, so only the
/// audit can find the change.
struct ForgetsOneWrite {
    guest: tern_synthetic::SyntheticGuest,
    source_stats: Option<Arc<tern_engine::LiveStats>>,
    syncs: u32,
    /// Let the source's audit pass twice over the write (`--verify full`);
    /// `strict` runs no audit and needs none.
    wait_for_audit: bool,
}

impl ForgetsOneWrite {
    fn write_and_forget(&mut self) {
        let region = self.guest.regions()[0];
        let page = (0..region.pages())
            .find(|&page| {
                // SAFETY: a whole page of the live mapping; the dirtier is
                // off (rate 0), so nothing writes it meanwhile.
                let bytes =
                    unsafe { std::slice::from_raw_parts(region.page_ptr(page).unwrap(), PAGE) };
                bytes.iter().any(|&byte| byte != 0)
            })
            .expect("a page with data");
        let stats = self.source_stats.as_ref().expect("the test set the stats");
        let passes_before = stats.audit_passes();
        // SAFETY: as above.
        unsafe { *region.page_ptr(page).unwrap().add(1234) ^= 0x81 };
        if !self.wait_for_audit {
            return;
        }
        wait_until("the source's audit passed twice more", || {
            stats.audit_passes() >= passes_before + 2
        });
    }
}

impl GuestMemory for ForgetsOneWrite {
    fn regions(&self) -> &[MemoryRegion] {
        self.guest.regions()
    }
}

impl tern_engine::DirtyLog for ForgetsOneWrite {
    fn start_dirty_log(&mut self) -> GuestResult<()> {
        self.guest.start_dirty_log()
    }

    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
        self.guest.sync_dirty_log(bitmaps)?;
        self.syncs += 1;
        if self.syncs == 1 {
            self.write_and_forget();
        }
        Ok(())
    }

    fn stop_dirty_log(&mut self) -> GuestResult<()> {
        self.guest.stop_dirty_log()
    }
}

impl GuestControl for ForgetsOneWrite {
    fn pause(&mut self) -> GuestResult<()> {
        self.guest.pause()
    }

    fn resume(&mut self) -> GuestResult<()> {
        self.guest.resume()
    }

    fn set_throttle(&mut self, percent: u8) -> GuestResult<()> {
        self.guest.set_throttle(percent)
    }
}

impl DeviceState for ForgetsOneWrite {
    fn save_state(&mut self) -> GuestResult<Vec<tern_engine::StateSection>> {
        self.guest.save_state()
    }

    fn restore_state(&mut self, sections: &[tern_engine::StateSection]) -> GuestResult<()> {
        self.guest.restore_state(sections)
    }
}

#[test]
fn a_write_the_dirty_log_forgot_is_found_by_the_audit() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut guest = ForgetsOneWrite {
        guest: guest(16 * MIB, 0),
        source_stats: None,
        syncs: 0,
        wait_for_audit: true,
    };
    let source = Source::new(migration_config(2)).unwrap();
    guest.source_stats = Some(source.stats());
    let failure = source
        .migrate(&mut guest, &address)
        .expect_err("the forgotten write must be detected");
    assert!(guest.syncs >= 2, "the migration never synced twice");
    assert!(
        matches!(failure.error, MigrationError::DigestMismatch { .. }),
        "{}",
        failure.error.chain()
    );
    assert!(guest.guest.is_running(), "the source guest must run on");
    expect_mismatch(destination);
    guest.guest.pause().unwrap();
}

#[test]
fn with_strict_a_forgotten_write_is_found_without_an_audit() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut guest = ForgetsOneWrite {
        guest: guest(16 * MIB, 0),
        source_stats: None,
        syncs: 0,
        wait_for_audit: false,
    };
    let source = Source::new({
        let mut config = migration_config(2);
        config.verify = tern_engine::Verify::Strict;
        config
    })
    .unwrap();
    guest.source_stats = Some(source.stats());
    let failure = source
        .migrate(&mut guest, &address)
        .expect_err("the forgotten write must be detected");
    assert_eq!(
        guest.source_stats.as_ref().unwrap().audit_passes(),
        0,
        "strict runs no audit"
    );
    assert!(
        matches!(failure.error, MigrationError::DigestMismatch { .. }),
        "{}",
        failure.error.chain()
    );
    assert!(guest.guest.is_running(), "the source guest must run on");
    expect_mismatch(destination);
    guest.guest.pause().unwrap();
}

/// A guest whose device takes long to save its state.
struct SlowState(tern_synthetic::SyntheticGuest);

const SLOW_STATE: Duration = Duration::from_millis(200);

impl GuestMemory for SlowState {
    fn regions(&self) -> &[MemoryRegion] {
        self.0.regions()
    }
}

impl tern_engine::DirtyLog for SlowState {
    fn start_dirty_log(&mut self) -> GuestResult<()> {
        self.0.start_dirty_log()
    }

    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
        self.0.sync_dirty_log(bitmaps)
    }

    fn stop_dirty_log(&mut self) -> GuestResult<()> {
        self.0.stop_dirty_log()
    }
}

impl GuestControl for SlowState {
    fn pause(&mut self) -> GuestResult<()> {
        self.0.pause()
    }

    fn resume(&mut self) -> GuestResult<()> {
        self.0.resume()
    }

    fn set_throttle(&mut self, percent: u8) -> GuestResult<()> {
        self.0.set_throttle(percent)
    }
}

impl DeviceState for SlowState {
    fn save_state(&mut self) -> GuestResult<Vec<tern_engine::StateSection>> {
        // A slow device, not a wait for something: the downtime must hold
        // this much, whatever else happens.
        std::thread::sleep(SLOW_STATE);
        self.0.save_state()
    }

    fn restore_state(&mut self, sections: &[tern_engine::StateSection]) -> GuestResult<()> {
        self.0.restore_state(sections)
    }
}

#[test]
fn a_broken_downtime_limit_is_reported_with_its_cause() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut guest = SlowState(guest(8 * MIB, 0));
    let mut config = migration_config(1);
    config.downtime_limit = Duration::from_millis(100);
    let stats = Source::new(config)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect("the migration completes, late");
    join_within(destination, "the destination").expect("destination verifies");
    assert_eq!(stats.downtime_limit, 100);
    assert!(stats.downtime >= u64::try_from(SLOW_STATE.as_millis()).unwrap());
    assert!(stats.downtime_exceeded);
    let parts = stats.downtime_parts.expect("the downtime's parts");
    assert!(
        parts.state >= u64::try_from(SLOW_STATE.as_millis()).unwrap(),
        "{parts:?}"
    );
    assert_eq!(stats.downtime_exceeded_cause, Some(parts.largest()));
    let json = serde_json::to_value(&stats).unwrap();
    assert_eq!(json["downtime-exceeded"], true);
    assert_eq!(json["downtime-limit"], 100);
    assert!(json["downtime-exceeded-cause"].is_string());
    assert!(json["downtime-parts"]["final-rehash"].is_u64());
    // The slow state is the source's, which its part of the estimate did
    // not hold: the report says which side overran.
    assert_eq!(
        stats.downtime_overrun,
        Some(tern_engine::DowntimeSide::Source),
        "{:?}",
        stats.expected_downtime_parts
    );
    assert_eq!(json["downtime-overrun"], "source");
    assert!(json["expected-downtime-parts"]["destination"].is_u64());
}

#[test]
fn a_kept_downtime_limit_is_not_reported_as_broken() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut guest = guest(8 * MIB, 0);
    let mut config = migration_config(1);
    // Far beyond any stall of a loaded machine.
    config.downtime_limit = Duration::from_secs(60);
    let stats = Source::new(config)
        .unwrap()
        .migrate(&mut guest, &address)
        .expect("the migration completes");
    join_within(destination, "the destination").expect("destination verifies");
    assert!(!stats.downtime_exceeded);
    assert_eq!(stats.downtime_exceeded_cause, None);
    let json = serde_json::to_value(&stats).unwrap();
    assert_eq!(json["downtime-exceeded"], false);
    assert!(json.get("downtime-exceeded-cause").is_none());
}

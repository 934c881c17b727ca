//! Bad input and faults: every case ends in a clear error, never a panic,
//! a hang, or a write outside guest memory, and the source guest survives.

use crate::common;

use std::time::Duration;

use common::*;
use tern_engine::{Channel, ChannelError, MigrationError, MigrationStatus, Source};
use tern_wire::{
    ChannelHello, DigestAlgorithm, FrameHeader, FrameKind, Handshake, Hello, Message, PageEntry,
    PageKind, RegionInfo, SessionSetup, Sync, encode_pages_prefix,
};

const SESSION: u64 = 0x5e55_1011;
const REGION_BYTES: u64 = 4 * MIB;

fn setup_with_codecs(channels: u16, codecs: u8) -> SessionSetup {
    SessionSetup {
        page_size: 4096,
        channel_count: channels,
        codecs,
        digest: DigestAlgorithm::Xxh3Pages,
        regions: vec![RegionInfo {
            id: 0,
            guest_addr: 0,
            len: REGION_BYTES,
        }],
        guest_kind: "synthetic".into(),
        dictionaries: 0,
        vmm_config_len: 0,
    }
}

fn hello(channels: u16) -> Message {
    hello_with_codecs(channels, 0)
}

fn hello_with_codecs(channels: u16, codecs: u8) -> Message {
    Message::Hello(Hello {
        handshake: Handshake {
            session_id: SESSION,
            channel_index: 0,
        },
        setup: setup_with_codecs(channels, codecs),
    })
}

fn channel_hello(session_id: u64, channel_index: u16) -> Message {
    Message::ChannelHello(ChannelHello {
        handshake: Handshake {
            session_id,
            channel_index,
        },
    })
}

/// A one-page packet of iteration 0; the payload length is the kind's.
fn packet(region_id: u32, page_index: u32, kind: PageKind, payload: &[u8]) -> Vec<u8> {
    packet_with_codec(region_id, 0, page_index, kind, payload)
}

fn packet_with_codec(
    region_id: u32,
    codec: u8,
    page_index: u32,
    kind: PageKind,
    payload: &[u8],
) -> Vec<u8> {
    let encoded_len = match kind {
        PageKind::Zero => 0,
        PageKind::Raw => 4096,
        PageKind::Compressed | PageKind::Duplicate | PageKind::Delta => {
            u32::try_from(payload.len()).unwrap()
        }
    };
    let mut bytes = Vec::new();
    encode_pages_prefix(
        &mut bytes,
        region_id,
        0,
        codec,
        &[PageEntry {
            page_index,
            kind,
            encoded_len,
        }],
    );
    bytes.extend_from_slice(payload);
    bytes
}

/// A hello damaged at `offset` must be refused with `needle` in the error,
/// both in the abort the peer receives and in the destination's result.
fn corrupted_hello_is_refused(offset: usize, patch: &[u8], needle: &str) {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut bytes = hello(1).to_bytes();
    bytes[offset..offset + patch.len()].copy_from_slice(patch);
    let mut main = connect(&address);
    main.write_all(&bytes).unwrap();
    expect_abort(&mut main, needle);
    expect_still_listening(destination, &address);
}

/// A connection that fails its handshake costs nothing else: the
/// destination goes on waiting, and serves the next source.
fn expect_still_listening(
    destination: std::thread::JoinHandle<DestinationResult>,
    address: &tern_engine::Address,
) {
    let mut fake = handshake(address, 1);
    fake.main
        .send_message(&Message::Abort(tern_wire::Abort {
            reason: tern_wire::AbortReason::Cancelled,
            message: "the next source gave up".into(),
        }))
        .unwrap();
    expect_destination_error(destination, "the next source gave up");
}

/// A hand-driven source that speaks the protocol, or breaks it on purpose.
struct FakeSource {
    main: Channel,
    pages: Vec<Channel>,
}

/// A channel to the destination whose every read and write waits at most
/// [`DEADLINE`]: a destination that stops answering fails the test.
fn connect(address: &tern_engine::Address) -> Channel {
    let mut channel = Channel::connect(address, Duration::from_secs(5)).expect("connect");
    channel.set_timeouts(DEADLINE).expect("timeouts");
    channel
}

fn handshake(address: &tern_engine::Address, channels: u16) -> FakeSource {
    handshake_with_codecs(address, channels, 0)
}

fn handshake_with_codecs(address: &tern_engine::Address, channels: u16, codecs: u8) -> FakeSource {
    let mut main = connect(address);
    main.send_message(&hello_with_codecs(channels, codecs))
        .unwrap();
    assert!(matches!(main.read_message().unwrap(), Message::Welcome(_)));
    let pages = (1..=channels)
        .map(|index| welcomed_page_channel(address, index))
        .collect();
    FakeSource { main, pages }
}

/// Page channel `index` of the session, connected and welcomed.
fn welcomed_page_channel(address: &tern_engine::Address, index: u16) -> Channel {
    let mut channel = connect(address);
    channel
        .send_message(&channel_hello(SESSION, index))
        .unwrap();
    assert!(matches!(
        channel.read_message().unwrap(),
        Message::Welcome(_)
    ));
    channel
}

fn expect_destination_error(
    destination: std::thread::JoinHandle<DestinationResult>,
    needle: &str,
) -> MigrationError {
    let error = join_within(destination, "the destination").expect_err("destination must fail");
    let chain = error.chain();
    assert!(
        chain.to_lowercase().contains(&needle.to_lowercase()),
        "expected '{needle}' in: {chain}"
    );
    error
}

fn expect_abort(channel: &mut Channel, needle: &str) {
    // A destination past the handshake sends heartbeats (and passes
    // applied), which may come first on a slow machine.
    let answer = loop {
        match channel.read_message() {
            Ok(Message::Heartbeat(_) | Message::PassApplied(_)) => {}
            other => break other,
        }
    };
    match answer {
        Ok(Message::Abort(abort)) => assert!(
            abort
                .message
                .to_lowercase()
                .contains(&needle.to_lowercase()),
            "abort message '{}' lacks '{needle}'",
            abort.message
        ),
        other => panic!("expected an abort mentioning '{needle}', got {other:?}"),
    }
}

#[test]
fn garbage_on_the_main_channel() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut main = connect(&address);
    main.write_all(b"GET / HTTP/1.1\r\nHost: tern\r\n\r\n")
        .unwrap();
    expect_abort(&mut main, "unknown frame kind");
    expect_still_listening(destination, &address);
}

#[test]
fn wrong_magic() {
    corrupted_hello_is_refused(8, b"NOTTERN!", "magic");
}

#[test]
fn wrong_version() {
    corrupted_hello_is_refused(16, &99u16.to_le_bytes(), "version 99");
}

#[test]
fn wrong_session_on_a_page_channel_is_turned_away() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut main = connect(&address);
    main.send_message(&hello(1)).unwrap();
    assert!(matches!(main.read_message().unwrap(), Message::Welcome(_)));
    let mut stray = connect(&address);
    stray.send_message(&channel_hello(SESSION + 1, 1)).unwrap();
    expect_abort(&mut stray, "session");
    // The stray connection did not end the migration: the right one is
    // still welcome.
    let mut right = connect(&address);
    right.send_message(&channel_hello(SESSION, 1)).unwrap();
    assert!(matches!(right.read_message().unwrap(), Message::Welcome(_)));
    drop(right);
    drop(main);
    expect_destination_error(destination, "closed");
}

#[test]
fn a_page_channel_index_outside_the_session_is_turned_away() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut main = connect(&address);
    main.send_message(&hello(2)).unwrap();
    assert!(matches!(main.read_message().unwrap(), Message::Welcome(_)));
    // Index 0 is the main channel's (the frame decoder refuses it) and 3
    // is past the two announced (the session's check refuses it): each is
    // turned away without ending the migration; accepted, either would
    // index a channel slot that does not exist.
    for (outside, refusal) in [
        (0, "channel index 0"),
        (3, "channel index 3 is outside 1..=2"),
    ] {
        let mut stray = connect(&address);
        stray
            .send_message(&channel_hello(SESSION, outside))
            .unwrap();
        expect_abort(&mut stray, refusal);
    }
    let right: Vec<Channel> = [2, 1]
        .into_iter()
        .map(|index| welcomed_page_channel(&address, index))
        .collect();
    drop(right);
    drop(main);
    expect_destination_error(destination, "closed");
}

#[test]
fn a_page_channel_that_never_comes_is_named_when_the_wait_ends() {
    let (listener, address) = tcp_listener();
    let destination = std::thread::spawn(move || {
        let mut config = receive_config();
        config.accept_timeout = Duration::from_secs(1);
        tern_engine::Destination::new(config).receive(&listener, make_destination_guest)
    });
    let mut main = connect(&address);
    main.send_message(&hello(2)).unwrap();
    assert!(matches!(main.read_message().unwrap(), Message::Welcome(_)));
    let mut first = connect(&address);
    first.send_message(&channel_hello(SESSION, 1)).unwrap();
    assert!(matches!(first.read_message().unwrap(), Message::Welcome(_)));
    // Channel 2 never connects: the accept deadline ends the wait and the
    // error names the channel still awaited, not the main channel or the
    // one that came.
    let error = expect_destination_error(destination, "page channels");
    assert!(
        matches!(error, MigrationError::Channel { index: 2, .. }),
        "{error:?}"
    );
}

#[test]
fn page_outside_the_region_is_refused() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut fake = handshake(&address, 1);
    let outside = u32::try_from(REGION_BYTES / 4096).unwrap();
    fake.pages[0]
        .write_all(&packet(0, outside, PageKind::Raw, &[0xee; 4096]))
        .unwrap();
    expect_destination_error(destination, "outside region");
    expect_abort(&mut fake.main, "outside region");
}

#[test]
fn unknown_region_is_refused() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut fake = handshake(&address, 1);
    fake.pages[0]
        .write_all(&packet(9, 0, PageKind::Zero, &[]))
        .unwrap();
    expect_destination_error(destination, "unknown region 9");
}

#[test]
fn oversized_packet_is_refused_before_reading_it() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut fake = handshake(&address, 1);
    let header = FrameHeader {
        kind: FrameKind::Pages,
        body_len: u32::MAX,
    };
    fake.pages[0].write_all(&header.encode()).unwrap();
    expect_destination_error(destination, "exceeds the limit");
}

#[test]
fn truncated_packet_then_close() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut fake = handshake(&address, 2);
    // 3096 bytes short of the page the table announces.
    fake.pages[1]
        .write_all(&packet(0, 3, PageKind::Raw, &[1; 1000]))
        .unwrap();
    drop(fake.pages);
    expect_destination_error(destination, "closed by the peer mid-stream");
}

#[test]
fn garbage_on_a_page_channel() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut fake = handshake(&address, 1);
    fake.pages[0].write_all(&[0xff; 64]).unwrap();
    expect_destination_error(destination, "unknown frame kind 255");
}

#[test]
fn payload_length_lies_are_refused() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut fake = handshake(&address, 1);
    // Claim a body 4 KiB longer than the table describes.
    let mut bytes = packet(0, 1, PageKind::Raw, &[7; 8192]);
    let body = u32::from_le_bytes(bytes[4..8].try_into().unwrap()) + 4096;
    bytes[4..8].copy_from_slice(&body.to_le_bytes());
    fake.pages[0].write_all(&bytes).unwrap();
    expect_destination_error(destination, "page table describes");
}

#[test]
fn sync_out_of_order_is_refused() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut fake = handshake(&address, 1);
    fake.pages[0]
        .send_message(&Message::Sync(Sync {
            iteration: 5,
            last: false,
            dictionaries: 0,
        }))
        .unwrap();
    expect_destination_error(destination, "iteration 5");
}

#[test]
fn source_abort_is_reported_by_the_destination() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut fake = handshake(&address, 2);
    fake.main
        .send_message(&Message::Abort(tern_wire::Abort {
            reason: tern_wire::AbortReason::Cancelled,
            message: "operator cancelled".into(),
        }))
        .unwrap();
    expect_destination_error(destination, "operator cancelled");
}

/// A destination that handshakes correctly and then dies mid-stream.
fn dying_destination(
    listener: tern_engine::Listener,
    channels: u16,
    read_bytes: usize,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut main = listener.accept_timeout(Duration::from_secs(10)).unwrap();
        let Message::Hello(hello) = main.read_message().unwrap() else {
            panic!("no hello")
        };
        let session_id = hello.handshake.session_id;
        main.send_message(&Message::Welcome(tern_wire::Welcome {
            session_id,
            channel_index: 0,
        }))
        .unwrap();
        let mut pages = Vec::new();
        for _ in 0..channels {
            let mut channel = listener.accept_timeout(Duration::from_secs(10)).unwrap();
            let Message::ChannelHello(hello) = channel.read_message().unwrap() else {
                panic!("no channel hello")
            };
            channel
                .send_message(&Message::Welcome(tern_wire::Welcome {
                    session_id,
                    channel_index: hello.handshake.channel_index,
                }))
                .unwrap();
            pages.push(channel);
        }
        let mut sink = vec![0u8; read_bytes];
        let _ = pages[0].read_exact(&mut sink);
        // Dropping every socket is what the kernel does when the process dies.
    })
}

#[test]
fn destination_dying_mid_migration_leaves_source_running_and_intact() {
    use tern_engine::GuestControl;
    let memory = 64 * MIB;
    let mut guest = guest(memory, 8 * MIB);
    // The dirtier writes only the first quarter (the working set); the rest
    // must come out of the failed migration byte for byte as it went in.
    let untouched_from = (memory / 4) as usize;
    guest.pause().unwrap();
    let before = guest.region_bytes(0).unwrap()[untouched_from..].to_vec();
    guest.resume().unwrap();
    let (listener, address) = tcp_listener();
    let dying = dying_destination(listener, 2, 1 << 20);
    let failure = exit_after_deadline("the source's migration to a dying destination", || {
        Source::new(migration_config(2))
            .unwrap()
            .migrate(&mut guest, &address)
    })
    .expect_err("the destination died");
    join_within(dying, "the dying peer");
    assert_eq!(failure.stats.status, MigrationStatus::Failed);
    assert!(
        matches!(
            failure.error,
            MigrationError::Channel { .. }
                | MigrationError::Protocol(_)
                | MigrationError::Internal(_)
        ),
        "{}",
        failure.error.chain()
    );
    assert!(guest.is_running(), "the source guest must run on");
    let dirtied = guest.dirtied_pages();
    wait_until("the source guest dirties memory again", || {
        guest.dirtied_pages() > dirtied
    });
    guest.pause().unwrap();
    let after = guest.region_bytes(0).unwrap()[untouched_from..].to_vec();
    assert!(before == after, "memory outside the working set changed");
}

#[test]
fn paused_source_memory_is_untouched_by_a_failed_migration() {
    let mut guest = guest(32 * MIB, 0);
    let digest_before = guest.digest();
    let (listener, address) = tcp_listener();
    let dying = dying_destination(listener, 1, 256 << 10);
    let failure = exit_after_deadline("the source's migration to a dying destination", || {
        Source::new(migration_config(1))
            .unwrap()
            .migrate(&mut guest, &address)
    })
    .expect_err("the destination died");
    join_within(dying, "the dying peer");
    assert!(
        matches!(
            failure.error,
            MigrationError::Channel {
                source: ChannelError::Io(_) | ChannelError::Closed,
                ..
            } | MigrationError::Protocol(_)
                | MigrationError::Internal(_)
        ),
        "{}",
        failure.error.chain()
    );
    assert_eq!(guest.digest(), digest_before);
}

#[test]
fn nobody_listening_is_a_clear_error() {
    let (listener, address) = tcp_listener();
    drop(listener);
    let mut guest = guest(4 * MIB, 0);
    let mut config = migration_config(1);
    config.connect_timeout = Duration::from_millis(200);
    let failure = exit_after_deadline("the source's connect to nobody", || {
        Source::new(config).unwrap().migrate(&mut guest, &address)
    })
    .expect_err("nobody listens");
    assert!(
        failure.error.chain().contains("Cannot connect"),
        "{}",
        failure.error.chain()
    );
}

#[test]
fn garbage_compressed_page_is_a_clear_error() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let zstd = tern_page::CodecId::Zstd.to_wire();
    let mut fake = handshake_with_codecs(&address, 1, 1 << zstd);
    fake.pages[0]
        .write_all(&packet_with_codec(
            0,
            zstd,
            3,
            PageKind::Compressed,
            &[0x5a; 100],
        ))
        .unwrap();
    expect_destination_error(destination, "page 3 of region 0");
}

#[test]
fn unannounced_codec_is_refused() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut fake = handshake(&address, 1);
    fake.pages[0]
        .write_all(&packet_with_codec(
            0,
            1,
            3,
            PageKind::Compressed,
            &[0x5a; 100],
        ))
        .unwrap();
    expect_destination_error(destination, "was not announced");
}

#[test]
fn unknown_codec_in_the_hello_is_refused() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut main = connect(&address);
    main.send_message(&hello_with_codecs(1, 1 << 6)).unwrap();
    expect_abort(&mut main, "codec 6");
    expect_destination_error(destination, "cannot decode");
}

#[test]
fn a_guest_of_another_kind_is_refused_at_the_handshake() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let Message::Hello(mut kvm) = hello(1) else {
        unreachable!()
    };
    // tern-vmm's kind, spelled out: the engine's tests do not depend on
    // the reference VMM.
    kvm.setup.guest_kind = "KVM test".into();
    let mut main = connect(&address);
    main.send_message(&Message::Hello(kvm)).unwrap();
    let expected = "the destination expects a synthetic guest, the source sends a KVM test guest";
    // Refused instead of welcomed: no page channel is ever accepted.
    expect_abort(&mut main, expected);
    let error = expect_destination_error(destination, expected);
    assert!(
        matches!(error, MigrationError::GuestKindMismatch { .. }),
        "{error:?}"
    );
}

#[test]
fn a_source_that_does_not_name_its_guest_kind_is_accepted() {
    let (listener, address) = tcp_listener();
    let _destination = spawn_destination(listener);
    let Message::Hello(mut unnamed) = hello(1) else {
        unreachable!()
    };
    unnamed.setup.guest_kind.clear();
    let mut main = connect(&address);
    main.send_message(&Message::Hello(unnamed)).unwrap();
    assert!(matches!(main.read_message().unwrap(), Message::Welcome(_)));
}

#[test]
fn a_source_giving_up_while_page_channels_connect_is_heard_at_once() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut main = connect(&address);
    main.send_message(&hello(2)).unwrap();
    assert!(matches!(main.read_message().unwrap(), Message::Welcome(_)));
    let mut first = connect(&address);
    first.send_message(&channel_hello(SESSION, 1)).unwrap();
    assert!(matches!(first.read_message().unwrap(), Message::Welcome(_)));
    // Channel 2 never comes: the source could not set it up and says why
    // on the main channel. The destination must report that, not wait for
    // its accept timeout.
    main.send_message(&Message::Abort(tern_wire::Abort {
        reason: tern_wire::AbortReason::ChannelFailed,
        message: "channel 2 cannot send zero-copy".into(),
    }))
    .unwrap();
    let error = expect_destination_error(destination, "channel 2 cannot send zero-copy");
    assert!(
        matches!(error, MigrationError::PeerAborted { .. }),
        "{error:?}"
    );
}

#[test]
fn a_source_failing_after_connecting_tells_the_destination_why() {
    // A fake destination that welcomes the main channel and then answers
    // the first page channel with someone else's session.
    let (listener, address) = tcp_listener();
    let fake = std::thread::spawn(move || {
        let accept = || listener.accept_timeout(Duration::from_secs(30)).unwrap();
        let mut main = accept();
        let Message::Hello(hello) = main.read_message().unwrap() else {
            panic!("expected a hello");
        };
        let session_id = hello.handshake.session_id;
        main.send_message(&Message::Welcome(tern_wire::Welcome {
            session_id,
            channel_index: 0,
        }))
        .unwrap();
        let mut page = accept();
        assert!(matches!(
            page.read_message().unwrap(),
            Message::ChannelHello(_)
        ));
        page.send_message(&Message::Welcome(tern_wire::Welcome {
            session_id: session_id ^ 1,
            channel_index: 1,
        }))
        .unwrap();
        main.read_message()
    });
    let source = Source::new(migration_config(2)).unwrap();
    let mut guest = guest(4 * MIB, 0);
    let failure = exit_after_deadline("the source's migration to a fake destination", || {
        source.migrate(&mut guest, &address)
    })
    .unwrap_err();
    assert!(
        failure.error.chain().contains("welcome on channel 1"),
        "{}",
        failure.error.chain()
    );
    match join_within(fake, "the fake peer") {
        Ok(Message::Abort(abort)) => assert!(
            abort.message.contains("welcome on channel 1"),
            "{}",
            abort.message
        ),
        other => panic!("the source closed without saying why: {other:?}"),
    }
}

/// A duplicate naming `source` of region `region_id` for page 1.
fn duplicate_of(region_id: u32, source: u32) -> Vec<u8> {
    let reference = tern_wire::PageRef {
        region_id,
        page_index: source,
    };
    packet(0, 1, PageKind::Duplicate, &reference.encode())
}

#[test]
fn duplicates_of_pages_the_destination_does_not_hold_are_refused() {
    let outside = u32::try_from(REGION_BYTES / 4096).unwrap();
    for (reference, needle) in [
        (duplicate_of(0, 5), "holds no data"),
        (duplicate_of(0, outside), "outside region"),
        (duplicate_of(9, 0), "unknown region 9"),
        (duplicate_of(0, 1), "a duplicate of itself"),
    ] {
        let (listener, address) = tcp_listener();
        let destination = spawn_destination(listener);
        let mut fake = handshake(&address, 1);
        fake.pages[0].write_all(&reference).unwrap();
        expect_destination_error(destination, needle);
        expect_abort(&mut fake.main, needle);
    }
}

/// One page packet of `iteration`.
fn page_packet(iteration: u32, page_index: u32, kind: PageKind, payload: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    let entry = PageEntry {
        page_index,
        kind,
        encoded_len: u32::try_from(payload.len()).unwrap(),
    };
    encode_pages_prefix(&mut bytes, 0, iteration, 0, &[entry]);
    bytes.extend_from_slice(payload);
    bytes
}

fn sync(iteration: u32) -> Vec<u8> {
    Message::Sync(Sync {
        iteration,
        last: false,
        dictionaries: 0,
    })
    .to_bytes()
}

#[test]
fn a_duplicate_of_a_page_another_channel_writes_in_the_iteration_is_refused() {
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut fake = handshake(&address, 2);
    // Iteration 0 gives page 5 data on channel 1. In iteration 1 channel 2
    // writes page 5 again while channel 1 copies it into page 1: whichever
    // arrives second is refused, both naming the duplicate.
    let reference = tern_wire::PageRef {
        region_id: 0,
        page_index: 5,
    };
    let mut first = page_packet(0, 5, PageKind::Raw, &[3; 4096]);
    first.extend(sync(0));
    first.extend(page_packet(1, 1, PageKind::Duplicate, &reference.encode()));
    let mut second = sync(0);
    second.extend(page_packet(1, 5, PageKind::Raw, &[4; 4096]));
    fake.pages[0].write_all(&first).unwrap();
    fake.pages[1].write_all(&second).unwrap();
    expect_destination_error(destination, "duplicate");
}

#[test]
fn bad_deltas_are_refused() {
    let mut out_of_page = 512u16.to_le_bytes().to_vec();
    out_of_page.extend_from_slice(&[1; 8]);
    for (record, needle) in [
        // No page data yet: nothing to apply a delta to.
        (vec![0u8; 10], "holds no data"),
        (out_of_page, "outside the page"),
    ] {
        let (listener, address) = tcp_listener();
        let destination = spawn_destination(listener);
        let mut fake = handshake(&address, 1);
        let mut bytes = Vec::new();
        if needle != "holds no data" {
            bytes.extend(page_packet(0, 1, PageKind::Raw, &[9; 4096]));
            bytes.extend(sync(0));
            bytes.extend(page_packet(1, 1, PageKind::Delta, &record));
        } else {
            bytes.extend(page_packet(0, 1, PageKind::Delta, &record));
        }
        fake.pages[0].write_all(&bytes).unwrap();
        expect_destination_error(destination, needle);
        expect_abort(&mut fake.main, needle);
    }
}

/// A zero-page offload that panics on the workers' first batch: a bug on a
/// pipeline thread, not input.
#[derive(Debug)]
struct PanickingOffload;

impl tern_page::ZeroPageOffload for PanickingOffload {
    unsafe fn submit(
        &self,
        _: &[*const u8],
    ) -> Result<tern_page::offload::Ticket, tern_page::offload::OffloadError> {
        panic!("the offload broke")
    }

    fn wait(
        &self,
        _: tern_page::offload::Ticket,
        _: &mut Vec<bool>,
    ) -> Result<(), tern_page::offload::OffloadError> {
        panic!("no ticket was ever given")
    }

    fn is_done(&self, _: &tern_page::offload::Ticket) -> bool {
        true
    }

    fn stats(&self) -> tern_page::offload::ZeroOffloadStats {
        tern_page::offload::ZeroOffloadStats::default()
    }

    fn describe(&self) -> String {
        "an offload that panics".into()
    }
}

/// A pipeline thread that panics fails the migration with an error that
/// names it, well within the caller's deadline, instead of leaving the
/// producer waiting for batches that never come back; the source guest
/// runs on.
#[test]
fn a_pipeline_thread_that_panics_fails_the_migration_and_the_source_runs_on() {
    let mut guest = guest(16 * MIB, 8 * MIB);
    let (listener, address) = tcp_listener();
    let destination = spawn_destination(listener);
    let mut config = migration_config(2);
    config.zero_page_detection = tern_engine::ZeroPageDetection::Dsa;
    config.zero_page_offload = Some(std::sync::Arc::new(PanickingOffload));
    let failure = exit_after_deadline("a migration whose worker panics", || {
        Source::new(config).unwrap().migrate(&mut guest, &address)
    })
    .expect_err("a worker panicked");
    assert_eq!(failure.stats.status, MigrationStatus::Failed);
    assert!(
        matches!(&failure.error, MigrationError::Internal(text)
            if text.contains("worker-") && text.contains("panicked: the offload broke")),
        "{}",
        failure.error.chain()
    );
    assert!(guest.is_running(), "the source guest must run on");
    let _ = join_within(destination, "the destination");
}

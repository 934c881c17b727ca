//! Attacks on `tern receive` before a session starts: stray, idle, slow and
//! lying connections. Each one is closed and logged, costs bounded time and
//! memory, and a real migration still completes after it. docs/security.md
//! has the table these tests measure.

use crate::process;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use process::{Receiver, tern};
use tern_wire::{
    AbortReason, DigestAlgorithm, FrameDecoder, Handshake, Hello, Message, RegionInfo, SessionSetup,
};

const GUEST: &str = "32MiB";
const GUEST_BYTES: u64 = 32 << 20;
const GIB: u64 = 1 << 30;

/// Migrates a small synthetic guest to `address`; panics unless it completes.
fn real_migration(address: &str) {
    let output = tern()
        .args(["migrate", "--json", "--progress", "none", "--to", address])
        .args(["--memory", GUEST, "--channels", "4", "--dirty-rate", "0"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "the real migration failed after the attack: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Peak resident memory of a running process (`VmHWM`), in bytes.
fn peak_rss(child: &std::process::Child) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kib * 1024
}

fn assert_rss_bounded(receiver: &Receiver, what: &str) {
    let peak = peak_rss(&receiver.child);
    eprintln!("{what}: receiver peak RSS {} KiB", peak / 1024);
    assert!(
        peak < GUEST_BYTES + (64 << 20),
        "{what}: receiver peak RSS {peak} bytes, more than the guest + 64 MiB"
    );
}

fn connect(receiver: &Receiver) -> TcpStream {
    TcpStream::connect(("127.0.0.1", receiver.port())).unwrap()
}

/// Reads until the receiver closes `stream`, with a generous deadline;
/// returns what it sent.
fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut reply = Vec::new();
    match stream.read_to_end(&mut reply) {
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(error) => panic!("the receiver did not close the connection: {error}"),
    }
    reply
}

fn hello(regions: Vec<RegionInfo>) -> Vec<u8> {
    Message::Hello(Hello {
        handshake: Handshake {
            session_id: 0x00a7_7ac4,
            channel_index: 0,
        },
        setup: SessionSetup {
            page_size: 4096,
            channel_count: 1,
            codecs: 0,
            digest: DigestAlgorithm::Xxh3Pages,
            regions,
            guest_kind: "synthetic".into(),
            dictionaries: 0,
            vmm_config_len: 0,
        },
    })
    .to_bytes()
}

fn regions(count: u32, len: u64) -> Vec<RegionInfo> {
    (0..count)
        .map(|id| RegionInfo {
            id,
            guest_addr: u64::from(id) * len,
            len,
        })
        .collect()
}

/// Reads one message from `stream`.
fn read_message(stream: &mut TcpStream) -> Message {
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut decoder = FrameDecoder::new();
    loop {
        let buf = decoder.buffer();
        let len = buf.len();
        stream.read_exact(buf).unwrap();
        match decoder.filled(len).unwrap() {
            Some(tern_wire::Event::Message(message)) => return message,
            Some(other) => panic!("expected a message, got {other:?}"),
            None => {}
        }
    }
}

/// The abort a receiver answered with.
fn abort_in(reply: &[u8]) -> tern_wire::Abort {
    let mut decoder = FrameDecoder::new();
    let mut offset = 0;
    loop {
        let buf = decoder.buffer();
        let len = buf.len();
        assert!(offset + len <= reply.len(), "no whole abort in {reply:?}");
        buf.copy_from_slice(&reply[offset..offset + len]);
        offset += len;
        match decoder.filled(len).unwrap() {
            Some(tern_wire::Event::Message(Message::Abort(abort))) => return abort,
            Some(other) => panic!("expected an abort, got {other:?}"),
            None => {}
        }
    }
}

#[test]
fn stray_connections_before_the_source_do_not_end_the_receiver() {
    let receiver = Receiver::spawn(&["receive"], &["--json", "--progress", "none"]);
    let mut connect_and_close = connect(&receiver);
    connect_and_close
        .shutdown(std::net::Shutdown::Write)
        .unwrap();
    read_until_closed(&mut connect_and_close);
    let mut garbage = connect(&receiver);
    garbage.write_all(&[0xde; 64]).unwrap();
    read_until_closed(&mut garbage);
    let mut wrong_magic = connect(&receiver);
    let mut frame = hello(regions(1, 1 << 20));
    // The body opens with the handshake's magic.
    frame[8] ^= 0xff;
    wrong_magic.write_all(&frame).unwrap();
    read_until_closed(&mut wrong_magic);
    real_migration(&receiver.address);
    let (status, _, stderr) = receiver.finish();
    assert!(status.success(), "{status}: {stderr}");
    assert!(
        stderr.matches("failed its handshake").count() >= 3,
        "each stray connection is logged: {stderr}"
    );
}

#[test]
fn idle_connections_delay_no_one() {
    // Handshake deadline longer than any test: the idle connections are
    // still pending while the source connects its page channels.
    let receiver = Receiver::spawn(
        &["receive"],
        &["--keep-listening", "--handshake-timeout", "300"],
    );
    let idle: Vec<TcpStream> = (0..10).map(|_| connect(&receiver)).collect();
    real_migration(&receiver.address);
    assert_rss_bounded(&receiver, "10 idle connections");
    drop(idle);
    let mut receiver = receiver;
    receiver.child.kill().unwrap();
    receiver.child.wait().unwrap();
}

#[test]
fn slowloris_fails_at_the_handshake_deadline() {
    let receiver = Receiver::spawn(
        &["receive"],
        &["--keep-listening", "--handshake-timeout", "2"],
    );
    let mut slow = connect(&receiver);
    let frame = hello(regions(1, 1 << 20));
    let started = Instant::now();
    // One byte every 200 ms (the attacker's pace): a per-read timeout would
    // never fire; the per-connection deadline must.
    let mut closed = false;
    for byte in frame.iter().cycle() {
        if slow.write_all(&[*byte]).is_err() {
            closed = true;
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("slowloris closed after {:?}", started.elapsed());
    assert!(closed, "a one-byte-at-a-time handshake was kept alive 60 s");
    real_migration(&receiver.address);
    assert_rss_bounded(&receiver, "slowloris");
    let mut receiver = receiver;
    receiver.child.kill().unwrap();
    let (_, _, stderr) = receiver.finish();
    assert!(stderr.contains("did not finish its handshake"), "{stderr}");
}

#[test]
fn oversized_hellos_are_refused_before_allocating() {
    let receiver = Receiver::spawn(&["receive"], &["--keep-listening"]);
    for (what, layout) in [
        ("1 TiB", regions(1, 1024 * GIB)),
        ("16 TiB", regions(1, 16 * 1024 * GIB)),
        ("1024 regions x 16 GiB", regions(1024, 16 * GIB)),
    ] {
        let started = Instant::now();
        let mut liar = connect(&receiver);
        liar.write_all(&hello(layout)).unwrap();
        let abort = abort_in(&read_until_closed(&mut liar));
        eprintln!("{what}: refused in {:?}", started.elapsed());
        assert_eq!(abort.reason, AbortReason::IncompatibleSetup, "{what}");
        assert!(
            abort.message.contains("more than this destination accepts"),
            "{what}: {}",
            abort.message
        );
        assert_rss_bounded(&receiver, what);
    }
    real_migration(&receiver.address);
    assert_rss_bounded(&receiver, "oversized hellos, then a migration");
    let mut receiver = receiver;
    receiver.child.kill().unwrap();
    receiver.child.wait().unwrap();
}

#[test]
fn the_source_reports_a_refused_size() {
    let receiver = Receiver::spawn(&["receive"], &["--max-memory", "16MiB"]);
    let output = tern()
        .args(["migrate", "--progress", "none", "--to", &receiver.address])
        .args(["--memory", GUEST, "--dirty-rate", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("more than this destination accepts"),
        "{stderr}"
    );
    let mut receiver = receiver;
    receiver.child.kill().unwrap();
    receiver.child.wait().unwrap();
}

#[test]
fn abort_text_from_a_stranger_is_sanitised() {
    let receiver = Receiver::spawn(&["receive"], &["--json", "--progress", "none"]);
    let mut stranger = connect(&receiver);
    let abort = Message::Abort(tern_wire::Abort {
        reason: AbortReason::Other,
        message: "\x1b[2J\x1b]0;owned\x07evil\nforged log line\u{202e}".into(),
    });
    stranger.write_all(&abort.to_bytes()).unwrap();
    read_until_closed(&mut stranger);
    real_migration(&receiver.address);
    let (status, _, stderr) = receiver.finish();
    assert!(status.success(), "{status}: {stderr}");
    assert!(stderr.contains("evil"), "the abort is logged: {stderr}");
    assert!(
        !stderr.contains('\x1b') && !stderr.contains('\x07') && !stderr.contains('\u{202e}'),
        "raw escape codes reached the log: {stderr:?}"
    );
    assert!(!stderr.contains("\nforged"), "{stderr:?}");
}

#[test]
fn a_flood_of_state_sections_stays_within_the_bound() {
    let receiver = Receiver::spawn(&["receive"], &["--keep-listening"]);
    let mut main = connect(&receiver);
    main.write_all(&hello(regions(1, GUEST_BYTES))).unwrap();
    let answer = read_message(&mut main);
    assert!(matches!(answer, Message::Welcome(_)), "{answer:?}");
    let mut page = connect(&receiver);
    page.write_all(
        &Message::ChannelHello(tern_wire::ChannelHello {
            handshake: Handshake {
                session_id: 0x00a7_7ac4,
                channel_index: 1,
            },
        })
        .to_bytes(),
    )
    .unwrap();
    // The live phase starts once the page channel is welcomed too.
    let answer = read_message(&mut page);
    assert!(matches!(answer, Message::Welcome(_)), "{answer:?}");
    let started = Instant::now();
    for index in 0..80 {
        let section = Message::StateSection(tern_wire::StateSectionMsg {
            name: format!("flood-{index}"),
            version: 1,
            data: vec![7; 1 << 20],
        });
        // The receiver closes the channel once the bound is crossed.
        if main.write_all(&section.to_bytes()).is_err() {
            break;
        }
    }
    let reply = read_until_closed(&mut main);
    eprintln!("state-section flood: refused in {:?}", started.elapsed());
    let frames = tern_wire::decode_stream(&reply, None).expect("valid replies");
    let abort = frames.iter().find_map(|frame| match frame {
        tern_wire::Frame::Message(Message::Abort(abort)) => Some(abort),
        _ => None,
    });
    let abort = abort.unwrap_or_else(|| panic!("no abort in {frames:?}"));
    assert!(
        abort
            .message
            .contains("more state than a destination accepts"),
        "{}",
        abort.message
    );
    assert_rss_bounded(&receiver, "a flood of 1 MiB state sections");
    drop(page);
    real_migration(&receiver.address);
    let mut receiver = receiver;
    receiver.child.kill().unwrap();
    receiver.child.wait().unwrap();
}

//! The trust holes of issue 23, each as an attack on a real `tern receive`
//! process: what an unauthenticated connection may make it hold, a flood
//! of idle connections against an authenticated source, and the memory of
//! a 64-channel session against the bound docs/security.md states. Each
//! prints what it measured (`--nocapture`), the figures of the threat table
//! in docs/security.md.

use crate::process;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use process::{Reaped, Receiver, TlsDirs, tern, wait_until_read};
use tern_test_skip::wait::{exit_within, join_within, wait_for, wait_until};
use tern_wire::{
    Abort, AbortReason, AuthHello, DigestAlgorithm, FRAME_HEADER_LEN, FrameHeader, FrameKind,
    Handshake, Hello, Message, Ready, RegionInfo, SessionSetup, Welcome,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Connections an attacker holds: the receiver's default handshake limit.
const HOSTILE: usize = 64;

/// A `/proc/PID/status` field in bytes (`VmRSS`, `VmHWM`).
fn status_bytes(child: &std::process::Child, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/PID/status"));
    kib * KIB
}

/// Bytes the process read so far (`rchar`).
fn read_bytes(child: &std::process::Child) -> u64 {
    std::fs::read_to_string(format!("/proc/{}/io", child.id()))
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix("rchar: "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0)
}

/// The machine's load, for the record next to each figure.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn key_file() -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(b"0123456789abcdef0123456789abcdef\n")
        .unwrap();
    file
}

fn connect(port: u16) -> TcpStream {
    TcpStream::connect(("127.0.0.1", port)).unwrap()
}

/// The largest legal hello: 1024 regions and the longest guest kind.
fn largest_hello() -> Vec<u8> {
    Message::Hello(Hello {
        handshake: Handshake {
            session_id: 0x5107_1015,
            channel_index: 0,
        },
        setup: SessionSetup {
            page_size: 4096,
            channel_count: 1,
            codecs: 0,
            digest: DigestAlgorithm::Xxh3Pages,
            regions: (0..1024)
                .map(|id| RegionInfo {
                    id,
                    guest_addr: u64::from(id) << 30,
                    len: 1 << 20,
                })
                .collect(),
            guest_kind: "k".repeat(64),
            dictionaries: 0,
            vmm_config_len: 0,
        },
    })
    .to_bytes()
}

/// The v6 attack: a state section's header announcing 64 MiB, then 1 MiB
/// of its body (the receiver read all of it before authenticating).
fn oversized_first_frame(stream: &mut TcpStream) {
    let header = FrameHeader {
        kind: FrameKind::StateSection,
        body_len: 64 << 20,
    }
    .encode();
    // Refused at its header now: the writes may meet a closed socket.
    let _ = stream.write_all(&header);
    let _ = stream.write_all(&vec![0x5a; usize::try_from(MIB).unwrap()]);
}

/// Reads one frame (header and body) from a plaintext stream.
fn read_frame(stream: &mut TcpStream) -> Message {
    let mut head = [0u8; FRAME_HEADER_LEN];
    stream.read_exact(&mut head).unwrap();
    let header = FrameHeader::decode(&head).unwrap();
    let mut body = vec![0u8; header.body_len as usize];
    stream.read_exact(&mut body).unwrap();
    Message::decode(header.kind, &body).unwrap()
}

/// Opens `HOSTILE` connections that each send `attack`, waits until the
/// receiver has read what they sent, and returns its peak RSS above what
/// it held before, with the connections still held.
fn hostile_peak(
    receiver: &Receiver,
    attack: impl Fn(&mut TcpStream) -> u64,
) -> (u64, Vec<TcpStream>) {
    let idle = status_bytes(&receiver.child, "VmRSS:");
    let before = read_bytes(&receiver.child);
    let mut sent = 0;
    let held: Vec<TcpStream> = (0..HOSTILE)
        .map(|_| {
            let mut stream = connect(receiver.port());
            sent += attack(&mut stream);
            stream
        })
        .collect();
    wait_until_read(&receiver.child, before + sent);
    let peak = status_bytes(&receiver.child, "VmHWM:");
    (peak.saturating_sub(idle), held)
}

/// What an unauthenticated connection can make the receiver hold: at most
/// 64 KiB each, whatever it sends first (docs/security.md, "Before
/// authentication").
#[test]
fn unauthenticated_input_costs_at_most_64_kib_per_connection() {
    let key = key_file();
    let key_path = key.path().to_str().unwrap();
    let bound = HOSTILE as u64 * 64 * KIB;
    // With a key: the v6 attack (refused at its header now), then the
    // worst that still passes: an auth hello, then all but the last byte
    // of the longest frame allowed in place of the proof.
    let receiver = Receiver::spawn(
        &["receive"],
        &[
            "--keep-listening",
            "--auth-key",
            key_path,
            "--handshake-timeout",
            "60",
        ],
    );
    let (oversized, held) = hostile_peak(&receiver, |stream| {
        oversized_first_frame(stream);
        // Only the refused header's 8 bytes are read.
        FRAME_HEADER_LEN as u64
    });
    drop(held);
    let (proof_frame, held) = hostile_peak(&receiver, |stream| {
        let hello = Message::AuthHello(AuthHello {
            handshake: Handshake {
                session_id: 1,
                channel_index: 0,
            },
            nonce: [3; 32],
        })
        .to_bytes();
        stream.write_all(&hello).unwrap();
        assert!(matches!(read_frame(stream), Message::AuthChallenge(_)));
        let abort = Message::Abort(Abort {
            reason: AbortReason::Other,
            message: "x".repeat(4096),
        })
        .to_bytes();
        stream.write_all(&abort[..abort.len() - 1]).unwrap();
        (hello.len() + abort.len() - 1) as u64
    });
    drop(held);
    let mut receiver = receiver;
    receiver.child.kill().unwrap();
    receiver.child.wait().unwrap();
    // Without a key (loopback): all but the last byte of the largest
    // legal hello.
    let receiver = Receiver::spawn(
        &["receive"],
        &["--keep-listening", "--handshake-timeout", "60"],
    );
    let hello = largest_hello();
    let (largest_hello_cost, held) = hostile_peak(&receiver, |stream| {
        stream.write_all(&hello[..hello.len() - 1]).unwrap();
        (hello.len() - 1) as u64
    });
    drop(held);
    let mut receiver = receiver;
    receiver.child.kill().unwrap();
    receiver.child.wait().unwrap();
    for (what, cost) in [
        ("64 MiB state-section header first (auth key)", oversized),
        (
            "auth hello, then 4 KiB - 1 of an abort (auth key)",
            proof_frame,
        ),
        ("largest hello - 1 byte (no key)", largest_hello_cost),
    ] {
        eprintln!(
            "{HOSTILE} connections, {what}: receiver peak RSS +{} KiB above idle (load {})",
            cost / KIB,
            load()
        );
        assert!(
            cost <= bound,
            "{what}: {cost} bytes above idle for {HOSTILE} connections, more than {bound}"
        );
    }
}

/// A TCP connection to `port` on 127.0.0.1 from `source` (another
/// loopback address): the receiver limits pending handshakes per address.
fn connect_from(source: std::net::Ipv4Addr, port: u16) -> TcpStream {
    use std::os::fd::FromRawFd;
    let address = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::sa_family_t::try_from(libc::AF_INET).unwrap(),
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_in>()).unwrap();
    // SAFETY: a new socket; the addresses are valid `sockaddr_in`s of
    // `len` bytes; the descriptor is handed to the `TcpStream`, which owns
    // it from then on (or closed here on failure).
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let local = address(source, 0);
        let remote = address(std::net::Ipv4Addr::LOCALHOST, port);
        let bound = libc::bind(fd, (&raw const local).cast(), len) == 0
            && libc::connect(fd, (&raw const remote).cast(), len) == 0;
        if !bound {
            let error = std::io::Error::last_os_error();
            libc::close(fd);
            panic!("connect from {source}: {error}");
        }
        TcpStream::from_raw_fd(fd)
    }
}

/// The bytes waiting unread in the receive queues of the receiver's
/// established connections on `port` (`/proc/net/tcp`), and how many
/// there are.
fn unread_on(port: u16) -> (usize, u64) {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let local = format!(":{port:04X}");
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // Local address, state 01 (established), then tx:rx queues.
            (fields.get(1)?.ends_with(&local) && *fields.get(3)? == "01").then(|| {
                let rx = fields.get(4)?.split_once(':')?.1;
                u64::from_str_radix(rx, 16).ok()
            })?
        })
        .fold((0, 0), |(count, bytes), rx| (count + 1, bytes + rx))
}

/// What the receiver reads of a TLS handshake before it has completed:
/// 24 KiB (`HANDSHAKE_READ_BUDGET` in `transport/tls.rs`), where rustls
/// alone would join up to 64 KiB.
const TLS_HANDSHAKE_BUDGET: usize = 24 << 10;

/// The first `wire_len` bytes of a `ClientHello` announcing the largest
/// handshake message rustls joins (64 KiB), in records of 16 KiB.
fn client_hello_prefix(stream: &mut TcpStream, wire_len: usize) {
    const MESSAGE: usize = 0xffff - 4 - 5 * 5 - 64;
    let [high, low] = u16::try_from(MESSAGE).unwrap().to_be_bytes();
    let mut message = vec![0x01, 0x00, high, low];
    // A plausible start (the legacy version), then filler.
    message.extend_from_slice(&[0x03, 0x03]);
    message.resize(4 + MESSAGE, 0x41);
    let mut wire = Vec::new();
    for record in message.chunks(16 * 1024) {
        wire.extend_from_slice(&[0x16, 0x03, 0x01]);
        wire.extend_from_slice(&u16::try_from(record.len()).unwrap().to_be_bytes());
        wire.extend_from_slice(record);
    }
    // Refused early: the write may meet a closed socket.
    let _ = stream.write_all(&wire[..wire_len.min(wire.len())]);
}

/// What unauthenticated TLS connections can make the receiver hold
/// before the handshake proves anything: 64 connections (32 from each of
/// two addresses, the per-address limit), each all but one byte of what
/// the receiver reads of a handshake, held; one byte more and the
/// connection is closed.
#[test]
fn unauthenticated_tls_input_costs_at_most_the_handshake_buffer_per_connection() {
    let pki = TlsDirs::new();
    let destination = pki.host("destination", &["127.0.0.1"]);
    let receiver = Receiver::spawn(
        &["receive"],
        &[
            "--keep-listening",
            "--tls-dir",
            &destination,
            "--handshake-timeout",
            "60",
        ],
    );
    let port = receiver.port();
    let idle = status_bytes(&receiver.child, "VmRSS:");
    let held: Vec<TcpStream> = (0..HOSTILE)
        .map(|index| {
            let source = std::net::Ipv4Addr::new(127, 0, 0, 1 + u8::try_from(index % 2).unwrap());
            let mut stream = connect_from(source, port);
            client_hello_prefix(&mut stream, TLS_HANDSHAKE_BUDGET - 1);
            stream
        })
        .collect();
    // Every connection accepted and everything it sent read by the
    // receiver (rustls reads with recv, which /proc/PID/io does not count).
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let (connections, unread) = unread_on(port);
        if connections == HOSTILE && unread == 0 {
            break;
        }
        assert!(
            Instant::now() < until,
            "{connections} connections held, {unread} bytes unread after 60 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let cost = status_bytes(&receiver.child, "VmHWM:").saturating_sub(idle);
    drop(held);
    // 8 KiB past the budget (rustls alone would wait for the rest of its
    // 64 KiB): closed.
    let mut stream = connect_from(std::net::Ipv4Addr::LOCALHOST, port);
    client_hello_prefix(&mut stream, TLS_HANDSHAKE_BUDGET + 8 * 1024);
    // Well within the 60 s handshake deadline, which would close it too.
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut sink = [0u8; 4096];
    let closed = loop {
        match stream.read(&mut sink) {
            Ok(0) => break true,
            Ok(_) => {}
            Err(error) => {
                break !matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                );
            }
        }
    };
    assert!(closed, "a hello past the handshake budget was not refused");
    let mut receiver = receiver;
    receiver.child.kill().unwrap();
    receiver.child.wait().unwrap();
    let bound = HOSTILE as u64 * TLS_PRE_AUTH_PER_CONNECTION;
    eprintln!(
        "{HOSTILE} TLS connections, {} KiB - 1 byte of a ClientHello: receiver peak RSS +{} \
         KiB above idle, {} KiB each (bound {} KiB; load {})",
        TLS_HANDSHAKE_BUDGET / 1024,
        cost / KIB,
        cost / KIB / HOSTILE as u64,
        bound / KIB,
        load()
    );
    assert!(
        cost <= bound,
        "{cost} bytes above idle for {HOSTILE} TLS connections, more than {bound}"
    );
}

/// What one unauthenticated TLS connection may cost: the goal for
/// any unauthenticated input (docs/security.md, "Before authentication").
const TLS_PRE_AUTH_PER_CONNECTION: u64 = 64 * KIB;

/// An attacker that holds `HOSTILE` idle connections to `port` and opens a
/// new one for each the receiver closes, until `stop`.
fn hold_hostage(port: u16, stop: Arc<AtomicBool>, reopened: Arc<AtomicU64>) {
    let open = || TcpStream::connect(("127.0.0.1", port)).ok();
    let mut streams: Vec<Option<TcpStream>> = (0..HOSTILE).map(|_| open()).collect();
    while !stop.load(Ordering::Relaxed) {
        for slot in streams.iter_mut().filter(|slot| slot.is_none()) {
            *slot = open();
        }
        let slots: Vec<usize> = (0..streams.len())
            .filter(|&index| streams[index].is_some())
            .collect();
        let mut fds: Vec<libc::pollfd> = slots
            .iter()
            .map(|&index| libc::pollfd {
                fd: streams[index].as_ref().map_or(-1, AsRawFd::as_raw_fd),
                events: libc::POLLIN | libc::POLLRDHUP,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a valid array of pollfds for the call.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 50) };
        if ready <= 0 {
            continue;
        }
        for (&slot, fd) in slots.iter().zip(&fds) {
            if fd.revents != 0 {
                // Closed (or an abort before the close): reopen at once.
                streams[slot] = open();
                reopened.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Everything a child writes on stderr, read as it comes (a receiver
/// blocked on a full pipe would stall the test, not the attack).
fn drain_stderr(child: &mut std::process::Child) -> std::thread::JoinHandle<String> {
    let mut pipe = child.stderr.take().expect("stderr piped");
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    })
}

/// Migrates a 32 MiB guest over 4 channels with the key; its wall time.
fn authenticated_migration(address: &str, key: &str) -> Duration {
    let started = Instant::now();
    let output = tern()
        .args(["migrate", "--json", "--progress", "none", "--to", address])
        .args(["--memory", "32MiB", "--channels", "4", "--dirty-rate", "0"])
        .args(["--auth-key", key, "--connect-timeout", "30"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "the authenticated migration failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    started.elapsed()
}

/// Issue 23's hostage attack: 64 idle connections, each reopened as soon
/// as the receiver closes it, from the source's own host.
#[test]
fn an_authenticated_migration_gets_through_connections_held_hostage() {
    let key = key_file();
    let key_path = key.path().to_str().unwrap();
    let mut receiver = Receiver::spawn(
        &["receive"],
        &[
            "--keep-listening",
            "--auth-key",
            key_path,
            "--handshake-timeout",
            "300",
        ],
    );
    let stderr = drain_stderr(&mut receiver.child);
    let quiet = authenticated_migration(&receiver.address, key_path);
    let stop = Arc::new(AtomicBool::new(false));
    let reopened = Arc::new(AtomicU64::new(0));
    let attacker = {
        let (port, stop, reopened) = (receiver.port(), stop.clone(), reopened.clone());
        std::thread::spawn(move || hold_hostage(port, stop, reopened))
    };
    let mut flooded = Vec::new();
    for _ in 0..3 {
        flooded.push(authenticated_migration(&receiver.address, key_path));
    }
    stop.store(true, Ordering::Relaxed);
    join_within(attacker, "the hostage taker");
    eprintln!(
        "hostage attack: {HOSTILE} idle connections held, {} reopened; authenticated 32 MiB \
         migrations took {flooded:?} (without the attack {quiet:?}; load {})",
        reopened.load(Ordering::Relaxed),
        load()
    );
    receiver.child.kill().unwrap();
    receiver.child.wait().unwrap();
    let stderr = join_within(stderr, "the receiver's stderr reader");
    assert!(
        stderr.contains("to make room"),
        "the receiver must have dropped idle handshakes: {stderr}"
    );
}

/// The memory bound of docs/security.md ("Memory"), for a session of
/// `channels` page channels into a guest of `guest` bytes with the decoder
/// pool (four landings per receiver) and a userfaultfd (a bounce buffer
/// per landing).
fn documented_bound(guest: u64, channels: u64) -> u64 {
    let pages = guest / 4096;
    let per_channel = 4 * (512 * KIB + 512 * KIB) + 512 * KIB;
    let bookkeeping = pages * 8 + pages * (4 + channels) / 8;
    let fixed = 48 * MIB;
    guest + fixed + channels * per_channel + bookkeeping
}

/// The receiver's peak RSS for a migration of a 128 MiB guest of `mix`
/// pages over `channels` page channels with `compression`.
fn receiver_peak(channels: u16, compression: &str, mix: &str) -> u64 {
    let receiver = Receiver::spawn(&["receive"], &["--keep-listening"]);
    let output = tern()
        .args([
            "migrate",
            "--json",
            "--progress",
            "none",
            "--to",
            &receiver.address,
        ])
        .args(["--memory", "128MiB", "--mix", mix])
        .args(["--channels", &channels.to_string(), "--dirty-rate", "0"])
        .args(["--compression", compression])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let peak = status_bytes(&receiver.child, "VmHWM:");
    let mut receiver = receiver;
    receiver.child.kill().unwrap();
    receiver.child.wait().unwrap();
    peak
}

/// What one more page channel may cost the receiver with compression
/// `none`, resident: measured 544-549 KiB (one landing's 512 KiB bounce
/// buffer and the channel's bitmap and stack; 7 runs, load 5.8-14), so a
/// buffer of 256 KiB more per channel, touched, fails the test.
const PER_CHANNEL_RESIDENT: u64 = 768 * KIB;

/// 64 channels of full packets (random pages, which go raw, through the
/// userfaultfd bounce buffers) into a 128 MiB guest, compression `none`:
/// the receiver's peak RSS stays within guest + the documented bound, and
/// each channel beyond the first costs at most [`PER_CHANNEL_RESIDENT`]
/// (the tight check: the documented bound is the worst case of every
/// buffer filled, far above this session). Raw packets land on the
/// receiver's thread, so one landing of the four is used.
#[test]
fn sixty_four_channels_stay_within_the_documented_memory_bound() {
    let one = receiver_peak(1, "none", "0:100:0");
    let peak = receiver_peak(64, "none", "0:100:0");
    let bound = documented_bound(128 * MIB, 64);
    let per_channel = peak.saturating_sub(one) / 63;
    eprintln!(
        "128 MiB guest of random pages, compression none: receiver peak RSS {} MiB with 64 \
         channels, {} MiB with 1 ({} KiB per added channel); documented bound {} MiB (load {})",
        peak / MIB,
        one / MIB,
        per_channel / KIB,
        bound / MIB,
        load()
    );
    assert!(
        peak <= bound,
        "peak RSS {peak} bytes above the documented bound {bound}"
    );
    assert!(
        per_channel <= PER_CHANNEL_RESIDENT,
        "each added channel costs {per_channel} bytes resident, more than {PER_CHANNEL_RESIDENT}"
    );
}

/// What one more page channel may cost with the default compression
/// (`auto`) and random pages: auto's packets go to the decoder pool, so
/// all four landings of a receiver fill their 512 KiB bounce buffers
/// (measured 1,979 KiB per added channel: the "about 2 MiB per channel
/// with auto" of issue 23's last session), plus 256 KiB for the rest
/// (bitmap, stack, decompressor contexts). A buffer of 512 KiB more per
/// channel, touched, fails the test.
const POOL_PER_CHANNEL_RESIDENT: u64 = 4 * 512 * KIB + 256 * KIB;

/// The same 64 channels with `auto`: the receiver's peak stays within
/// guest + the documented bound (which counts four landings per receiver,
/// each with a payload and a bounce buffer), and each added channel
/// within [`POOL_PER_CHANNEL_RESIDENT`].
#[test]
fn sixty_four_channels_with_auto_compression_stay_within_the_documented_bound() {
    let mix = "0:100:0";
    let one = receiver_peak(1, "auto", mix);
    let peak = receiver_peak(64, "auto", mix);
    let bound = documented_bound(128 * MIB, 64);
    let per_channel = peak.saturating_sub(one) / 63;
    eprintln!(
        "128 MiB guest of random pages, compression auto: receiver peak RSS {} MiB with 64 \
         channels, {} MiB with 1 ({} KiB per added channel); documented bound {} MiB (load {})",
        peak / MIB,
        one / MIB,
        per_channel / KIB,
        bound / MIB,
        load()
    );
    assert!(
        peak <= bound,
        "peak RSS {peak} bytes above the documented bound {bound}"
    );
    assert!(
        per_channel <= POOL_PER_CHANNEL_RESIDENT,
        "each added channel costs {per_channel} bytes resident with auto, more than \
         {POOL_PER_CHANNEL_RESIDENT}"
    );
}

/// A `/proc/PID/status` count (`Threads`).
fn status_count(child: &std::process::Child, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/PID/status"))
}

/// Reads the receiver's welcome on `stream`; anything else fails the test
/// with what the receiver said on stderr.
fn welcomed(stream: &mut TcpStream, receiver: &mut Receiver) {
    let mut head = [0u8; FRAME_HEADER_LEN];
    let welcome = stream
        .read_exact(&mut head)
        .map_err(|e| e.to_string())
        .and_then(|()| {
            let header = FrameHeader::decode(&head).map_err(|e| e.to_string())?;
            let mut body = vec![0u8; header.body_len as usize];
            stream.read_exact(&mut body).map_err(|e| e.to_string())?;
            Message::decode(header.kind, &body).map_err(|e| e.to_string())
        });
    if let Ok(Message::Welcome(_)) = welcome {
        return;
    }
    let _ = receiver.child.kill();
    let mut stderr = String::new();
    if let Some(mut pipe) = receiver.child.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    panic!("no welcome ({welcome:?}); the receiver said: {stderr}");
}

/// Issue 23's declared guest: a hello announcing 16 GiB over 64 channels,
/// every channel welcomed, and not one page sent. What the receiver holds
/// then is its bookkeeping, which docs/security.md ("Memory") counts per
/// declared page, plus its receivers' threads; the guest's memory itself
/// is not touched.
#[test]
fn a_declared_guest_costs_its_documented_bookkeeping_before_any_page() {
    const GUEST: u64 = 16 << 30;
    const CHANNELS: u16 = 64;
    // A generous handshake deadline: in the full file on a loaded machine
    // one channel's handshake was once closed at the default 5 s (cause
    // not found; see the report of issue 23's session). The promise here
    // is memory, not that deadline.
    let receiver = Receiver::spawn(
        &["receive"],
        &["--max-memory", "17GiB", "--handshake-timeout", "60"],
    );
    let idle = status_bytes(&receiver.child, "VmRSS:");
    let idle_threads = status_count(&receiver.child, "Threads:");
    let session = 0x16_6164;
    let mut main = connect(receiver.port());
    let hello = Message::Hello(Hello {
        handshake: Handshake {
            session_id: session,
            channel_index: 0,
        },
        setup: SessionSetup {
            page_size: 4096,
            channel_count: CHANNELS,
            codecs: 0,
            digest: DigestAlgorithm::Xxh3Pages,
            regions: vec![RegionInfo {
                id: 0,
                guest_addr: 0,
                len: GUEST,
            }],
            guest_kind: "synthetic".into(),
            dictionaries: 0,
            vmm_config_len: 0,
        },
    });
    let mut receiver = receiver;
    let asked = Instant::now();
    main.write_all(&hello.to_bytes()).unwrap();
    welcomed(&mut main, &mut receiver);
    let main_welcome = asked.elapsed();
    let mut slowest = Duration::ZERO;
    let channels: Vec<TcpStream> = (1..=CHANNELS)
        .map(|channel_index| {
            let asked = Instant::now();
            let mut channel = connect(receiver.port());
            let hello = Message::ChannelHello(tern_wire::ChannelHello {
                handshake: Handshake {
                    session_id: session,
                    channel_index,
                },
            });
            channel.write_all(&hello.to_bytes()).unwrap();
            welcomed(&mut channel, &mut receiver);
            slowest = slowest.max(asked.elapsed());
            channel
        })
        .collect();
    // Every receiver started: the bookkeeping was allocated before them.
    wait_until("the receivers start", || {
        status_count(&receiver.child, "Threads:") >= idle_threads + u64::from(CHANNELS)
    });
    let cost = status_bytes(&receiver.child, "VmHWM:").saturating_sub(idle);
    drop(channels);
    drop(main);
    receiver.child.kill().unwrap();
    receiver.child.wait().unwrap();
    let pages = GUEST / 4096;
    let bookkeeping = pages * 8 + pages * (4 + u64::from(CHANNELS)) / 8;
    // Each receiver's thread and decoder state, as the formula counts them.
    let bound = bookkeeping + u64::from(CHANNELS) * 512 * KIB;
    eprintln!(
        "a hello declaring 16 GiB over {CHANNELS} channels, no page sent: receiver peak RSS \
         +{} MiB above idle (bookkeeping by the formula {} MiB, bound {} MiB); main channel \
         welcomed in {main_welcome:?}, slowest page channel in {slowest:?} (load {})",
        cost / MIB,
        bookkeeping / MIB,
        bound / MIB,
        load()
    );
    assert!(
        cost <= bound,
        "{cost} bytes above idle for a declared 16 GiB guest, more than {bound}"
    );
}

/// The state of process `pid` (`R`, `S`, `T` for stopped, ...).
fn process_state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name, which is in parentheses.
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next())
        .unwrap_or('?')
}

/// The system call the main thread of the stopped process `pid` is in.
fn main_thread_syscall(pid: u32) -> Option<i64> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/syscall"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn signal(pid: u32, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).unwrap();
    // SAFETY: kill has no memory effects; `pid` is our own child.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
}

/// Stops process `pid` (SIGSTOP) while its main thread waits in `poll`: a
/// stop that lands elsewhere is undone and tried again. For a source after
/// its completion, the only such wait is `await_answer`'s; for a
/// destination after its ready, `await_commit`'s: each with its
/// switch-over deadline running.
fn stop_in_poll(pid: u32) {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < until, "process {pid} never waited in poll");
        signal(pid, libc::SIGSTOP);
        while process_state(pid) != 'T' {
            assert!(Instant::now() < until, "process {pid} did not stop");
            std::thread::yield_now();
        }
        // poll, or ppoll where the C library uses it (x86-64 numbers).
        if matches!(main_thread_syscall(pid), Some(7 | 271)) {
            return;
        }
        signal(pid, libc::SIGCONT);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Issue 23's stalled source: a source stopped after its completion reads
/// the destination's `Ready` only after its switch-over deadline. It must
/// not commit (the destination may have given up waiting for the commit),
/// but resume its guest and tell the destination.
#[test]
fn a_ready_read_after_the_switch_over_deadline_is_not_committed() {
    use tern_engine::{Address, Listener};
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap();
    let address = listener.local_address().unwrap().to_string();
    let mut source = tern()
        .args(["migrate", "--json", "--progress", "none", "--to", &address])
        .args(["--memory", "8MiB", "--dirty-rate", "0", "--channels", "1"])
        .args(["--switch-over-timeout", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map(Reaped::new)
        .unwrap();
    let stderr = drain_stderr(&mut source);
    let accept = || listener.accept_timeout(Duration::from_secs(60)).unwrap();
    let mut main = accept();
    main.set_timeouts(Duration::from_secs(60)).unwrap();
    let Message::Hello(hello) = main.read_message().unwrap() else {
        panic!("no hello")
    };
    let session_id = hello.handshake.session_id;
    main.send_message(&Message::Welcome(Welcome {
        session_id,
        channel_index: 0,
    }))
    .unwrap();
    let mut channel = accept();
    let Message::ChannelHello(channel_hello) = channel.read_message().unwrap() else {
        panic!("no channel hello")
    };
    channel
        .send_message(&Message::Welcome(Welcome {
            session_id,
            channel_index: channel_hello.handshake.channel_index,
        }))
        .unwrap();
    // Ends when the source closes the channel, which it does when it
    // exits at the latest (waited for below).
    let drain = std::thread::spawn(move || {
        let mut sink = vec![0u8; 1 << 16];
        while channel.read_exact(&mut sink).is_ok() {}
    });
    let complete = loop {
        if !main.wait_readable(Duration::from_millis(500)).unwrap() {
            main.send_message(&Message::Heartbeat(Default::default()))
                .unwrap();
            continue;
        }
        match main.read_message().unwrap() {
            Message::Complete(complete) => break complete,
            Message::StateSection(_) | Message::Sync(_) | Message::Heartbeat(_) => {}
            other => panic!("before the completion: {other:?}"),
        }
    };
    stop_in_poll(source.id());
    main.send_message(&Message::Ready(Ready {
        digest: complete.digest,
    }))
    .unwrap();
    // The attack is the stall itself: the source stays stopped past its
    // 1 s switch-over deadline, with the ready waiting in its socket.
    let stopped = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    signal(source.id(), libc::SIGCONT);
    let mut seen = Vec::new();
    while let Ok(message) = main.read_message() {
        seen.push(message);
    }
    let status = exit_within(&mut source, "the stalled source");
    let stderr = join_within(stderr, "the source's stderr reader");
    join_within(drain, "the page channel's drain");
    eprintln!(
        "a ready read {} ms after the source stopped (1 s switch-over deadline): {seen:?}, \
         source exit {status}, load {}",
        stopped.elapsed().as_millis(),
        load()
    );
    assert!(
        !seen
            .iter()
            .any(|message| matches!(message, Message::Commit)),
        "the source committed on a late ready: {seen:?}"
    );
    assert!(
        matches!(seen.first(), Some(Message::Abort(_))),
        "the destination is told: {seen:?}"
    );
    // 1: failed, the guest resumed on the source (3 would be "outcome
    // unknown", the guest left paused).
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("switch-over"), "{stderr}");
}

/// Copies `from` to `to` until `from` ends, counting the bytes in
/// `copied`, then closes `to`'s writing half.
fn pipe_counting(mut from: TcpStream, mut to: TcpStream, copied: Arc<AtomicU64>) {
    let mut buffer = vec![0u8; 1 << 16];
    while let Ok(read) = from.read(&mut buffer) {
        if read == 0 || to.write_all(&buffer[..read]).is_err() {
            break;
        }
        copied.fetch_add(read as u64, Ordering::Release);
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// Forwards the destination's frames on the main channel to the source,
/// calling `before` with each frame's kind before it is passed on.
fn forward_frames(mut from: TcpStream, mut to: TcpStream, mut before: impl FnMut(FrameKind)) {
    let mut head = [0u8; FRAME_HEADER_LEN];
    while from.read_exact(&mut head).is_ok() {
        let header = FrameHeader::decode(&head).expect("a frame from the destination");
        let mut body = vec![0u8; header.body_len as usize];
        if from.read_exact(&mut body).is_err() {
            break;
        }
        before(header.kind);
        if to.write_all(&head).is_err() || to.write_all(&body).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// Issue 23's stalled destination, the mirror of the stalled source: a
/// destination stopped (SIGSTOP) once it has said ready and waits for the
/// commit, the commit delivered into its socket meanwhile, continued after
/// its switch-over deadline. It must not resume the guest (the source may
/// have given up on it by then), but tell the source, which then resumes
/// its own.
// long: one scenario in order: the proxy, the stop, the stall, both sides' verdicts.
#[test]
fn a_commit_read_after_the_destination_s_switch_over_deadline_is_not_taken() {
    let mut receiver = Receiver::spawn(&["receive"], &["--switch-over-timeout", "1"]);
    let destination_pid = receiver.child.id();
    let destination_port = receiver.port();
    let receiver_stderr = drain_stderr(&mut receiver.child);
    let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_address = proxy.local_addr().unwrap().to_string();
    let mut source = tern()
        .args(["migrate", "--json", "--progress", "none"])
        .args(["--to", &proxy_address])
        .args(["--memory", "8MiB", "--dirty-rate", "0", "--channels", "1"])
        .args(["--switch-over-timeout", "60"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map(Reaped::new)
        .unwrap();
    let source_stderr = drain_stderr(&mut source);
    // Bytes of the source's main channel passed to the destination, and
    // when the destination was stopped.
    let to_destination = Arc::new(AtomicU64::new(0));
    let stopped_at: Arc<std::sync::Mutex<Option<(Instant, u64)>>> = Arc::default();
    let mut pipes = Vec::new();
    proxy.set_nonblocking(true).unwrap();
    for index in 0..2 {
        let (from_source, _) = wait_for(&format!("the source opens channel {index}"), || {
            proxy.accept().ok()
        });
        from_source.set_nonblocking(false).unwrap();
        let to_receiver = connect(destination_port);
        let (source_in, receiver_in) = (
            from_source.try_clone().unwrap(),
            to_receiver.try_clone().unwrap(),
        );
        let copied = if index == 0 {
            to_destination.clone()
        } else {
            Arc::default()
        };
        pipes.push(std::thread::spawn(move || {
            pipe_counting(source_in, to_receiver, copied)
        }));
        if index == 0 {
            let (stopped_at, to_destination) = (stopped_at.clone(), to_destination.clone());
            pipes.push(std::thread::spawn(move || {
                forward_frames(receiver_in, from_source, |kind| {
                    if kind == FrameKind::Ready {
                        // Stopped in await_commit's poll, its deadline
                        // running; the ready then reaches the source.
                        stop_in_poll(destination_pid);
                        *stopped_at.lock().unwrap() =
                            Some((Instant::now(), to_destination.load(Ordering::Acquire)));
                    }
                })
            }));
        } else {
            pipes.push(std::thread::spawn(move || {
                pipe_counting(receiver_in, from_source, Arc::default())
            }));
        }
    }
    // The source commits: its commit waits in the stopped destination's
    // socket (it comes through the proxy, so it was read from the source).
    let stopped = wait_for("the destination says ready and the source commits", || {
        let (stopped, sent_before) = (*stopped_at.lock().unwrap())?;
        (to_destination.load(Ordering::Acquire) > sent_before).then_some(stopped)
    });
    // The attack is the stall itself: the destination stays stopped past
    // its 1 s switch-over deadline, with the commit waiting in its socket.
    std::thread::sleep(Duration::from_millis(1500).saturating_sub(stopped.elapsed()));
    let stall = stopped.elapsed();
    signal(destination_pid, libc::SIGCONT);
    let destination_status = exit_within(&mut receiver.child, "the stalled destination");
    let source_status = exit_within(&mut source, "the source");
    let (receiver_stderr, source_stderr) = (
        join_within(receiver_stderr, "the receiver's stderr reader"),
        join_within(source_stderr, "the source's stderr reader"),
    );
    for pipe in pipes {
        join_within(pipe, "a proxy pipe");
    }
    eprintln!(
        "a commit read {} ms after the destination stopped (1 s switch-over deadline): \
         destination {destination_status}, source {source_status}, load {}",
        stall.as_millis(),
        load()
    );
    // The destination did not resume: it failed, naming the commit.
    assert_eq!(destination_status.code(), Some(1), "{receiver_stderr}");
    assert!(
        receiver_stderr.contains("the source's commit"),
        "{receiver_stderr}"
    );
    // The source, told, resumed its guest (1: failed, the guest runs on
    // the source; 3 would be outcome-unknown).
    assert_eq!(source_status.code(), Some(1), "{source_stderr}");
    assert!(
        source_stderr.contains("the destination did not resume the guest"),
        "{source_stderr}"
    );
}

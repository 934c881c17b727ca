//! Same-host migration by memory hand-over, over real Unix sockets: the
//! source passes its memfd, the destination maps it, no page is copied;
//! and every refusal leaves the source guest running.

use crate::common;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

use common::{MIB, exit_after_deadline, join_within, migration_config, receive_config, wait_until};
use tern_engine::{
    Address, Destination, GuestError, GuestMemory, HandedFile, Listener, MigrationConfig,
    MigrationError, Received, Source,
};
use tern_synthetic::{ContentMix, SyntheticConfig, SyntheticGuest};
use tern_wire::{
    FRAME_HEADER_LEN, FrameHeader, HandedRegion, HandoverCoverage, Handshake, Hello,
    MemoryHandover, Message, RegionInfo, SessionSetup,
};

fn synthetic(memory: u64, regions: u32, dirty_rate: u64) -> SyntheticConfig {
    SyntheticConfig {
        memory_bytes: memory,
        regions,
        mix: ContentMix::default(),
        seed: 5,
        dirty_rate_bytes_per_sec: dirty_rate,
        working_set_bytes: 0,
        dirtier_threads: 1,
    }
}

fn handover_config() -> MigrationConfig {
    let mut config = migration_config(1);
    config.memory_handover = true;
    config
}

fn unix_listener(dir: &Path) -> (Listener, Address) {
    let address = Address::Unix(dir.join("main.sock"));
    (Listener::bind(&address).expect("bind"), address)
}

fn adopt(files: Vec<HandedFile>) -> Result<SyntheticGuest, GuestError> {
    SyntheticGuest::from_handed_files(files)
        .map_err(|error| GuestError::with_source("adopt", error))
}

type Handed = Result<Received<SyntheticGuest>, MigrationError>;

fn spawn_handover_destination(
    listener: Listener,
    keep_paused: bool,
) -> std::thread::JoinHandle<Handed> {
    std::thread::spawn(move || {
        let mut config = receive_config();
        config.keep_paused = keep_paused;
        Destination::new(config).receive_handover(&listener, |_, _, files| adopt(files))
    })
}

/// XXH3 of every byte of the source's memfd, read through a mapping of
/// its own: what the destination must see.
fn file_digest(guest: &SyntheticGuest) -> u128 {
    let files = guest.region_files().expect("memfd-backed");
    let len: u64 = guest.regions().iter().map(|region| region.len()).sum();
    let fd = files[0].file.as_raw_fd();
    let len = usize::try_from(len).expect("the guest fits this address space");
    // SAFETY: a read-only shared mapping of an open memfd of `len` bytes.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED);
    // SAFETY: the mapping is `len` readable bytes; nothing writes the file
    // (both guests are paused).
    let digest =
        xxhash_rust::xxh3::xxh3_128(unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) });
    // SAFETY: unmapping what was mapped above.
    unsafe { libc::munmap(addr, len) };
    digest
}

#[test]
fn hands_memory_over_while_a_writer_runs_and_copies_no_page() {
    let dir = tempfile::tempdir().unwrap();
    let (listener, address) = unix_listener(dir.path());
    let destination = spawn_handover_destination(listener, true);
    // Two regions, and a dirtier writing 64 MiB/s through the migration.
    let mut guest = SyntheticGuest::new_memfd(&synthetic(64 * MIB, 2, 64 * MIB)).unwrap();
    wait_until("the writer to run", || guest.dirtied_pages() > 0);
    let stats = Source::new(handover_config())
        .unwrap()
        .migrate(&mut guest, &address)
        .expect("hand-over");
    let received = join_within(destination, "the destination").expect("destination");
    assert!(stats.digest_verified, "the digest was not compared");
    let comparison = received.digest_comparison.expect("compared");
    assert!(comparison.matched());
    // Memory is the source's file: the destination reads what the file holds.
    assert_eq!(received.guest.digest(), file_digest(&guest));
    // State only: far less than one MiB went over the socket.
    assert_eq!(received.stats.normal_pages, 0);
    assert!(
        received.stats.received < MIB,
        "{} bytes received",
        received.stats.received
    );
    assert!(
        !guest.is_running(),
        "the source guest runs after the hand-over"
    );
    // The dirtier's state moved: the destination resumes writing.
    let mut destination_guest = received.guest;
    tern_engine::GuestControl::resume(&mut destination_guest).unwrap();
    let before = destination_guest.dirtied_pages();
    wait_until("the destination's writer to run", || {
        destination_guest.dirtied_pages() > before
    });
}

#[test]
fn refuses_tcp_before_connecting() {
    let mut guest = SyntheticGuest::new_memfd(&synthetic(4 * MIB, 1, MIB)).unwrap();
    let failure = Source::new(handover_config())
        .unwrap()
        .migrate(&mut guest, &Address::Tcp("127.0.0.1:9".into()))
        .unwrap_err();
    assert!(
        matches!(
            failure.error,
            MigrationError::UnsupportedTransport {
                field: "memory_handover",
                ..
            }
        ),
        "{}",
        failure.error
    );
    assert!(guest.is_running());
}

#[test]
fn refuses_memory_without_files_before_connecting() {
    let dir = tempfile::tempdir().unwrap();
    // Bound but never served: a refusal must come before any connection.
    let (_listener, address) = unix_listener(dir.path());
    let mut guest = SyntheticGuest::new(&synthetic(4 * MIB, 1, MIB)).unwrap();
    let failure = exit_after_deadline("the source's refused hand-over", || {
        Source::new(handover_config())
            .unwrap()
            .migrate(&mut guest, &address)
    })
    .unwrap_err();
    let text = failure.error.to_string();
    assert!(text.contains("not backed by files"), "{text}");
    assert!(guest.is_running());
}

#[test]
fn a_copying_destination_refuses_a_handover_and_the_source_runs_on() {
    let dir = tempfile::tempdir().unwrap();
    let (listener, address) = unix_listener(dir.path());
    let destination = common::spawn_destination(listener);
    let mut guest = SyntheticGuest::new_memfd(&synthetic(4 * MIB, 1, MIB)).unwrap();
    let failure = exit_after_deadline("the source's refused hand-over", || {
        Source::new(handover_config())
            .unwrap()
            .migrate(&mut guest, &address)
    })
    .unwrap_err();
    assert!(
        failure.error.to_string().contains("hands its memory over"),
        "{}",
        failure.error
    );
    assert!(join_within(destination, "the destination").is_err());
    assert!(guest.is_running());
}

// --- A hand-crafted source, for what a real one never sends. ---

fn memfd(len: u64) -> OwnedFd {
    // SAFETY: a NUL-terminated name; the result is checked.
    let raw = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0);
    // SAFETY: `raw` was just created and is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len = i64::try_from(len).unwrap();
    // SAFETY: sizing an open memfd.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len) }, 0);
    fd
}

fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[RawFd]) {
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut _,
        iov_len: bytes.len(),
    };
    // SAFETY: zeroed msghdr, then pointed at live buffers.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &raw mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG macros on a buffer large enough for a few descriptors.
    unsafe {
        let fd_bytes = u32::try_from(fds.len() * 4).unwrap();
        header.msg_controllen = libc::CMSG_SPACE(fd_bytes) as usize;
        let cmsg = libc::CMSG_FIRSTHDR(&header);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes) as usize;
        std::ptr::copy_nonoverlapping(
            fds.as_ptr().cast::<u8>(),
            libc::CMSG_DATA(cmsg),
            fds.len() * 4,
        );
        assert_eq!(
            libc::sendmsg(stream.as_raw_fd(), &header, 0),
            isize::try_from(bytes.len()).unwrap()
        );
    }
}

fn read_frame(stream: &mut UnixStream) -> Message {
    let mut head = [0u8; FRAME_HEADER_LEN];
    stream.read_exact(&mut head).expect("frame header");
    let header = FrameHeader::decode(&head).unwrap();
    let mut body = vec![0u8; header.body_len as usize];
    stream.read_exact(&mut body).unwrap();
    Message::decode(header.kind, &body).unwrap()
}

const REGION: u64 = 4 * MIB;

fn hello() -> Message {
    Message::Hello(Hello {
        handshake: Handshake {
            session_id: 7,
            channel_index: 0,
        },
        setup: SessionSetup {
            page_size: 4096,
            channel_count: 1,
            codecs: 0,
            digest: tern_wire::DigestAlgorithm::Xxh3Pages,
            regions: vec![RegionInfo {
                id: 0,
                guest_addr: 0,
                len: REGION,
            }],
            guest_kind: "synthetic".into(),
            dictionaries: 0,
            vmm_config_len: 0,
        },
    })
}

fn handover() -> Message {
    Message::MemoryHandover(MemoryHandover {
        coverage: HandoverCoverage::Sampled,
        regions: vec![HandedRegion {
            region_id: 0,
            offset: 0,
            len: REGION,
        }],
    })
}

/// Sends a hello and a hand-over with `fds`, returns the destination's
/// answer (its abort's message) and its result.
fn craft(fds: &[RawFd]) -> (String, Handed) {
    let dir = tempfile::tempdir().unwrap();
    let (listener, address) = unix_listener(dir.path());
    let destination = spawn_handover_destination(listener, false);
    let Address::Unix(path) = address else {
        unreachable!()
    };
    let mut stream = UnixStream::connect(path).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream.write_all(&hello().to_bytes()).unwrap();
    let bytes = handover().to_bytes();
    if fds.is_empty() {
        stream.write_all(&bytes).unwrap();
    } else {
        send_with_fds(&stream, &bytes, fds);
    }
    let answer = match read_frame(&mut stream) {
        Message::Abort(abort) => abort.message,
        other => format!("{other:?}"),
    };
    (answer, join_within(destination, "the destination"))
}

#[test]
fn refuses_a_file_smaller_than_its_region() {
    let small = memfd(REGION / 2);
    let (answer, result) = craft(&[small.as_raw_fd()]);
    assert!(
        answer.contains("cannot back it") && answer.contains("bytes"),
        "{answer}"
    );
    assert!(result.is_err());
}

#[test]
fn refuses_a_handover_without_descriptors() {
    let (answer, result) = craft(&[]);
    assert!(answer.contains("0 descriptors"), "{answer}");
    assert!(result.is_err());
}

#[test]
fn refuses_a_descriptor_that_is_not_a_file() {
    let (left, _right) = UnixStream::pair().unwrap();
    let (answer, result) = craft(&[left.as_raw_fd()]);
    assert!(answer.contains("not a regular file"), "{answer}");
    assert!(result.is_err());
}

#[test]
fn refuses_a_file_sealed_against_writes() {
    // SAFETY: as in `memfd`, with sealing allowed.
    let raw = unsafe {
        libc::memfd_create(
            c"sealed".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    // SAFETY: just created, owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: sizing and sealing an open memfd.
    unsafe {
        assert_eq!(
            libc::ftruncate(fd.as_raw_fd(), i64::try_from(REGION).unwrap()),
            0
        );
        assert_eq!(
            libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE),
            0
        );
    }
    let (answer, result) = craft(&[fd.as_raw_fd()]);
    assert!(answer.contains("sealed"), "{answer}");
    assert!(result.is_err());
}

/// A fake destination on `listener`: takes the source's hello and
/// hand-over (the kernel closes the descriptors, read as plain bytes),
/// welcomes it, confirms the hand-over `confirm` makes of it, then hands
/// the stream to `then`.
fn fake_handover_destination(
    listener: UnixListener,
    confirm: fn(MemoryHandover) -> MemoryHandover,
    then: fn(UnixStream),
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let Message::Hello(hello) = read_frame(&mut stream) else {
            panic!("hello")
        };
        let Message::MemoryHandover(handover) = read_frame(&mut stream) else {
            panic!("handover")
        };
        stream
            .write_all(
                &Message::Welcome(tern_wire::Welcome {
                    session_id: hello.handshake.session_id,
                    channel_index: 0,
                })
                .to_bytes(),
            )
            .unwrap();
        stream
            .write_all(&Message::MemoryHandover(confirm(handover)).to_bytes())
            .unwrap();
        then(stream);
    })
}

/// Migrates a hand-over guest to the fake destination at `path`; returns
/// the guest and the source's failure.
fn hand_over_to_a_fake(path: &Path, what: &str) -> (SyntheticGuest, MigrationError) {
    let mut guest = SyntheticGuest::new_memfd(&synthetic(8 * MIB, 1, 8 * MIB)).unwrap();
    let failure = exit_after_deadline(what, || {
        Source::new(handover_config())
            .unwrap()
            .migrate(&mut guest, &Address::Unix(path.to_path_buf()))
    })
    .unwrap_err();
    (guest, failure.error)
}

/// The source's guest must still be running on its own memory: its
/// writer goes on.
fn assert_runs_on(guest: &SyntheticGuest, error: &MigrationError) {
    assert!(
        guest.is_running(),
        "the source guest was not resumed: {error}"
    );
    let before = guest.dirtied_pages();
    wait_until("the source's writer to go on", || {
        guest.dirtied_pages() > before
    });
    assert!(guest.digest() != 0);
}

/// A destination that takes the hand-over, confirms it, reads the state
/// and the completion, and dies (closes) before its ready: the source
/// must resume its guest, which keeps running on its own memory.
#[test]
fn a_destination_that_dies_before_the_commit_leaves_the_source_running() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("main.sock");
    let fake = fake_handover_destination(
        UnixListener::bind(&path).unwrap(),
        |handover| handover,
        |mut stream| {
            while !matches!(read_frame(&mut stream), Message::Complete(_)) {}
        },
    );
    let (guest, error) =
        hand_over_to_a_fake(&path, "the source's hand-over to a dying destination");
    join_within(fake, "the fake peer");
    assert_runs_on(&guest, &error);
}

/// A destination confirming another hand-over than the one sent (here
/// its region starts one page further into the file) has mapped other
/// memory than the source's: the source refuses the confirmation for
/// what it is, before any page or state goes, and its guest runs on.
#[test]
fn a_hand_over_confirmed_for_other_memory_is_refused_and_the_source_runs_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("main.sock");
    let fake = fake_handover_destination(
        UnixListener::bind(&path).unwrap(),
        |mut handover| {
            handover.regions[0].offset += 4096;
            handover
        },
        drop,
    );
    let (guest, error) =
        hand_over_to_a_fake(&path, "the source's hand-over to a confused destination");
    join_within(fake, "the fake peer");
    assert!(
        error
            .to_string()
            .contains("expected the destination to confirm the memory hand-over"),
        "{error}"
    );
    assert_runs_on(&guest, &error);
}

/// The measurement behind docs/benchmarks.md, "Same-host hand-over": a
/// guest of `TERN_HANDOVER_BENCH_MIB` MiB (default 1024) with a 64 MiB/s
/// writer, migrated over a Unix socket by copy and by hand-over,
/// alternated, `TERN_HANDOVER_BENCH_RUNS` times each (default 5); prints
/// the medians. Run with `cargo test --release -p tern-engine --test
/// integration -- --ignored --nocapture handover::bench`.
#[test]
#[ignore = "a benchmark: run by hand"]
fn bench_handover_against_copy() {
    let env = |name, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|value| value.parse().ok())
            .unwrap_or(default)
    };
    let memory = env("TERN_HANDOVER_BENCH_MIB", 1024) * MIB;
    let runs = env("TERN_HANDOVER_BENCH_RUNS", 5);
    // Per mode: downtimes, total times, bytes sent.
    type Row = (&'static str, Vec<u64>, Vec<u64>, Vec<u64>);
    let mut rows: Vec<Row> = vec![
        ("copy", vec![], vec![], vec![]),
        ("hand-over", vec![], vec![], vec![]),
    ];
    let load = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load_before = load();
    for _ in 0..runs {
        for (mode, row) in rows.iter_mut().enumerate() {
            let handover = mode == 1;
            let dir = tempfile::tempdir().unwrap();
            let (listener, address) = unix_listener(dir.path());
            let destination = if handover {
                spawn_handover_destination(listener, false)
            } else {
                common::spawn_destination(listener)
            };
            let mut guest = SyntheticGuest::new_memfd(&synthetic(memory, 1, 64 * MIB)).unwrap();
            let mut config = migration_config(2);
            config.memory_handover = handover;
            let stats = Source::new(config)
                .unwrap()
                .migrate(&mut guest, &address)
                .expect("migrate");
            join_within(destination, "the destination").expect("destination");
            row.1.push(stats.downtime);
            row.2.push(stats.total_time);
            row.3.push(stats.ram.transferred);
        }
    }
    let median = |values: &mut Vec<u64>| {
        values.sort_unstable();
        values[values.len() / 2]
    };
    println!(
        "| {} MiB guest, 64 MiB/s writer, {runs} runs each | downtime (ms), median | total time (ms), median | bytes sent, median | downtime runs (ms) | total runs (ms) |",
        memory / MIB
    );
    println!("|---|---|---|---|---|---|");
    for (name, mut down, mut total, mut sent) in rows {
        let (d, t, s) = (down.clone(), total.clone(), median(&mut sent));
        println!(
            "| {name} | {} | {} | {s} | {d:?} | {t:?} |",
            median(&mut down),
            median(&mut total)
        );
    }
    println!(
        "load average before: {load_before}load average after: {}",
        load()
    );
}

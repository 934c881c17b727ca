//! Helpers for the tests of both zero-copy senders.

use std::time::Duration;

use super::{KERNEL_PAGE, ZeroCopyError, ZeroCopyStats, ZeroCopyTransport};
use crate::error::ChannelError;
use crate::transport::{Address, Channel, Listener, Segment};

/// A connected loopback TCP pair.
pub(crate) fn tcp_pair() -> (Channel, Channel) {
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap();
    let address = listener.local_address().unwrap();
    let mut client = Channel::connect(&address, Duration::from_secs(5)).unwrap();
    let mut server = listener.accept_timeout(Duration::from_secs(5)).unwrap();
    client.set_timeouts(Duration::from_secs(20)).unwrap();
    server.set_timeouts(Duration::from_secs(20)).unwrap();
    (client, server)
}

fn page_byte(page: usize, offset: usize) -> u8 {
    crate::numeric::low_byte((page.wrapping_mul(131) ^ offset.wrapping_mul(7)) as u64)
}

/// Sends `pages` scattered pages in batches of 48 with an 8-byte header
/// (the batch number, rewritten in one reused buffer, so a sender that
/// kept pointing at it would send the wrong number) through the sender
/// `enable` makes with `window` bytes; a reader checks every byte.
pub(crate) fn round_trip<S: ZeroCopyTransport>(
    enable: impl FnOnce(Channel) -> S,
    window: usize,
    pages: usize,
    slow_reader: bool,
) -> ZeroCopyStats {
    let (client, mut server) = tcp_pair();
    let memory: Vec<u8> = (0..pages * KERNEL_PAGE)
        .map(|i| page_byte(i / KERNEL_PAGE, i % KERNEL_PAGE))
        .collect();
    // Batch b holds pages b, b + stride, ... : scattered segments.
    let stride = 16;
    let order: Vec<usize> = (0..stride)
        .flat_map(|start| (start..pages).step_by(stride))
        .collect();
    let batches: Vec<Vec<usize>> = order.chunks(48).map(<[usize]>::to_vec).collect();
    let expected = batches.clone();
    let reader = std::thread::spawn(move || {
        let mut page = vec![0u8; KERNEL_PAGE];
        for (number, batch) in expected.iter().enumerate() {
            let mut header = [0u8; 8];
            server.read_exact(&mut header).unwrap();
            assert_eq!(u64::from_le_bytes(header), number as u64);
            for &index in batch {
                server.read_exact(&mut page).unwrap();
                assert!(
                    page.iter()
                        .enumerate()
                        .all(|(offset, &byte)| byte == page_byte(index, offset)),
                    "page {index} corrupted"
                );
            }
            if slow_reader && number % 8 == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let mut end = [0u8; 1];
        assert!(matches!(
            server.read_exact(&mut end),
            Err(ChannelError::Closed)
        ));
    });
    let mut sender = enable(client);
    let mut header = [0u8; 8];
    let mut max_seen = 0;
    for (number, batch) in batches.iter().enumerate() {
        let segments: Vec<Segment> = batch
            .iter()
            .map(|&index| Segment {
                ptr: memory[index * KERNEL_PAGE..].as_ptr(),
                len: KERNEL_PAGE,
            })
            .collect();
        header.copy_from_slice(&(number as u64).to_le_bytes());
        // SAFETY: `memory` outlives the sender (flushed below) and is
        // never written.
        unsafe { sender.send(&header, &segments) }.unwrap();
        max_seen = max_seen.max(sender.outstanding_charge());
        assert!(sender.outstanding_charge() <= window);
    }
    sender.flush().unwrap();
    assert_eq!(sender.outstanding_sends(), 0);
    let stats = sender.stats();
    sender.channel().shutdown();
    tern_test_skip::wait::join_within(reader, "the reader");
    assert!(usize::try_from(stats.max_outstanding_bytes).unwrap() >= max_seen);
    assert!(
        usize::try_from(stats.max_outstanding_bytes).unwrap() <= window,
        "{stats:?}"
    );
    assert!(stats.max_outstanding_bytes > 0);
    assert_eq!(stats.zero_copy_bytes, (pages * KERNEL_PAGE) as u64);
    assert_eq!(stats.header_bytes, 8 * batches.len() as u64);
    stats
}

/// How the connection goes away in [`flush_after_hang_up`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum HangUp {
    /// The peer shuts its socket down (a FIN, no reset, no socket error)
    /// and keeps it open without reading.
    PeerShutsDown,
    /// This side's socket is shut down (as the pipeline does to interrupt
    /// its senders).
    LocalShutdown,
}

/// Fills a peer that never reads until sends stay in flight, then hangs up
/// while `flush` waits (or just before it starts) and returns what `flush`
/// said. The sender is given a 120 s flush timeout; this panics unless
/// `flush` returns within 60 s, so a hang-up that is only noticed by the
/// timeout fails the test without any timing assertion on small numbers.
pub(crate) fn flush_after_hang_up<S: ZeroCopyTransport + 'static>(
    enable: impl FnOnce(Channel) -> S,
    hang_up: HangUp,
) -> Result<(), ZeroCopyError> {
    const PIECE: usize = 64 * 1024;
    const PIECES: usize = 6;
    let (client, server) = tcp_pair();
    // A send buffer that holds every piece (nothing blocks), a receive
    // buffer that holds few: most bytes stay unacknowledged.
    set_buffer(client.raw_fd(), libc::SO_SNDBUF, 4 << 20);
    set_buffer(server.raw_fd(), libc::SO_RCVBUF, 4096);
    let local = client.try_clone().unwrap();
    let memory: Vec<u8> = (0..PIECE * PIECES)
        .map(|i| crate::numeric::low_byte(i as u64 % 253))
        .collect();
    let mut sender = enable(client);
    for piece in memory.chunks(PIECE) {
        let segment = Segment {
            ptr: piece.as_ptr(),
            len: piece.len(),
        };
        // SAFETY: `memory` outlives the sender (both move into the flushing
        // thread, the sender is dropped first) and is never written.
        unsafe { sender.send(&[], &[segment]) }.unwrap();
    }
    assert!(
        sender.outstanding_sends() > 0,
        "the peer acknowledged everything: nothing to hang up on"
    );
    let (done, result) = std::sync::mpsc::channel();
    let flushing = std::thread::spawn(move || {
        let outcome = sender.flush();
        drop(sender);
        drop(memory);
        let _ = done.send(outcome);
    });
    match hang_up {
        HangUp::PeerShutsDown => server.shutdown(),
        HangUp::LocalShutdown => local.shutdown(),
    }
    let outcome = result
        .recv_timeout(Duration::from_secs(60))
        .expect("flush did not notice the hang-up before its timeout");
    tern_test_skip::wait::join_within(flushing, "the flushing thread");
    drop(server);
    outcome
}

fn set_buffer(fd: std::os::fd::RawFd, option: libc::c_int, bytes: libc::c_int) {
    // SAFETY: `bytes` is a valid c_int for the option's value.
    let result = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            (&bytes as *const libc::c_int).cast(),
            crate::numeric::socklen_of::<libc::c_int>(),
        )
    };
    assert_eq!(result, 0, "setsockopt: {}", std::io::Error::last_os_error());
}

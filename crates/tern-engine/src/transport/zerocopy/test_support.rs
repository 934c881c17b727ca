//! Helpers for the tests of both zero-copy senders.

use std::time::Duration;

use super::{KERNEL_PAGE, ZeroCopyStats, ZeroCopyTransport};
use crate::error::ChannelError;
use crate::transport::{Address, Channel, Listener, Segment};

/// A connected loopback TCP pair.
pub fn tcp_pair() -> (Channel, Channel) {
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap();
    let address = listener.local_address().unwrap();
    let mut client = Channel::connect(&address, Duration::from_secs(5)).unwrap();
    let mut server = listener.accept_timeout(Duration::from_secs(5)).unwrap();
    client.set_timeouts(Duration::from_secs(20)).unwrap();
    server.set_timeouts(Duration::from_secs(20)).unwrap();
    (client, server)
}

fn page_byte(page: usize, offset: usize) -> u8 {
    (page.wrapping_mul(131) ^ offset.wrapping_mul(7)) as u8
}

/// Sends `pages` scattered pages in batches of 48 with an 8-byte header
/// (the batch number, rewritten in one reused buffer, so a sender that
/// kept pointing at it would send the wrong number) through the sender
/// `enable` makes with `window` bytes; a reader checks every byte.
pub fn round_trip<S: ZeroCopyTransport>(
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
    reader.join().unwrap();
    assert!(stats.max_outstanding_bytes as usize >= max_seen);
    assert!(stats.max_outstanding_bytes as usize <= window, "{stats:?}");
    assert!(stats.max_outstanding_bytes > 0);
    assert_eq!(stats.zero_copy_bytes, (pages * KERNEL_PAGE) as u64);
    assert_eq!(stats.header_bytes, 8 * batches.len() as u64);
    stats
}

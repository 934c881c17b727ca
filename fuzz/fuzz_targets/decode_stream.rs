//! Feeds arbitrary bytes to the protocol decoder, as a destination's
//! receiver would see them from the network: first without a session (the
//! stream must start with a hello to carry pages), then against a fixed
//! two-region session through `FrameDecoder` exactly as the engine's
//! receivers drive it (framing into the decoder's buffer in the pieces it
//! asks for, payload consumed in place), with the input cut into reads of
//! varying sizes. The postcopy messages (protocol v8, recovery's v9) and the memory
//! hand-over (kind 19) are also decoded
//! from the raw input as bodies, and whatever decodes must encode back to
//! the same message. Any panic is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tern_wire::{
    DigestAlgorithm, Expect, FRAME_HEADER_LEN, FrameDecoder, FrameKind, Message, RegionInfo,
    SessionSetup, codec_id, decode_stream,
};

fuzz_target!(|data: &[u8]| {
    let _ = decode_stream(data, None);
    let setup = SessionSetup {
        page_size: tern_wire::PAGE_SIZE,
        channel_count: 4,
        codecs: 1 << codec_id::ZSTD
            | 1 << codec_id::DEFLATE
            | 1 << codec_id::LZ4
            | 1 << codec_id::ZSTD_PACKET,
        digest: DigestAlgorithm::Xxh3Pages,
        regions: vec![
            RegionInfo {
                id: 0,
                guest_addr: 0,
                len: 64 << 12,
            },
            RegionInfo {
                id: 1,
                guest_addr: 1 << 30,
                len: 8 << 12,
            },
        ],
        guest_kind: "synthetic".into(),
        dictionaries: 2,
        vmm_config_len: 0,
    };
    let _ = decode_stream(data, Some(&setup));
    drive_like_a_receiver(data, setup);
    postcopy_bodies_round_trip(data);
});

/// Decodes the input as the body of each postcopy kind and of the memory
/// hand-over: anything accepted
/// must survive an encode and decode unchanged.
fn postcopy_bodies_round_trip(data: &[u8]) {
    for kind in [
        FrameKind::PostcopySwitch,
        FrameKind::PageRequest,
        FrameKind::UrgentPages,
        FrameKind::PostcopyComplete,
        FrameKind::PostcopyResume,
        FrameKind::PostcopyMissing,
        FrameKind::MemoryHandover,
    ] {
        if let Ok(message) = Message::decode(kind, data) {
            let bytes = message.to_bytes();
            assert_eq!(
                Message::decode(kind, &bytes[FRAME_HEADER_LEN..]).as_ref(),
                Ok(&message)
            );
        }
    }
}

/// Reads as a socket receiver does: the first byte picks the largest read,
/// so short reads split every structure at every place.
fn drive_like_a_receiver(data: &[u8], setup: SessionSetup) {
    let Some((&read_size, mut input)) = data.split_first() else {
        return;
    };
    let read_size = usize::from(read_size).max(1);
    let mut decoder = FrameDecoder::with_setup(setup);
    while !input.is_empty() {
        match decoder.expect() {
            Expect::Payload { entry, len } => {
                assert!(entry < decoder.entries().len());
                let len = len.min(input.len()).min(read_size);
                decoder.consume_payload(len);
                input = &input[len..];
            }
            Expect::Framing { .. } => {
                let buf = decoder.buffer();
                let len = buf.len().min(input.len()).min(read_size);
                buf[..len].copy_from_slice(&input[..len]);
                input = &input[len..];
                if decoder.filled(len).is_err() {
                    return;
                }
            }
        }
    }
    let _ = decoder.finish();
}

//! Feeds arbitrary bytes to the protocol decoder, as a destination's
//! receiver would see them from the network: first without a session (the
//! stream must start with a hello to carry pages), then against a fixed
//! two-region session. Any panic is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tern_wire::{DigestAlgorithm, RegionInfo, SessionSetup, decode_stream};

fuzz_target!(|data: &[u8]| {
    let _ = decode_stream(data, None);
    let setup = SessionSetup {
        page_size: tern_wire::PAGE_SIZE,
        channel_count: 4,
        codecs: 0b1110,
        digest: DigestAlgorithm::Xxh3Pages,
        regions: vec![
            RegionInfo { id: 0, guest_addr: 0, len: 64 << 12 },
            RegionInfo { id: 1, guest_addr: 1 << 30, len: 8 << 12 },
        ],
        guest_kind: "synthetic".into(),
    };
    let _ = decode_stream(data, Some(&setup));
});

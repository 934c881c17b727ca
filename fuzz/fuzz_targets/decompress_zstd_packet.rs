//! Feeds arbitrary bytes to the destination's zstd packet-frame decoder
//! (see `tern_fuzz::decompress_packet` for the input's layout). It must
//! decode exactly the packet's pages or fail with a typed error, never
//! writing more; any panic is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tern_fuzz::decompress_packet(data);
});

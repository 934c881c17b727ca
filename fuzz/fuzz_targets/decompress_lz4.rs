//! Feeds arbitrary bytes to the destination's lz4 page decoder, as a
//! compressed page's payload arrives from the network. It must decode
//! exactly one page or fail with a typed error; any panic is a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tern_page::codec::CodecId;

fuzz_target!(|data: &[u8]| {
    tern_fuzz::decompress(CodecId::Lz4, data);
});

//! Feeds arbitrary bytes, cut into packets (see
//! `tern_fuzz::stream_packets`), to one channel's zstd stream decoder, in
//! order, as a receiver decodes codec 5. Each packet must decode exactly
//! its pages or fail with a typed error, never writing more; any panic is
//! a bug.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tern_fuzz::decompress_stream(data);
});

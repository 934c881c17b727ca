//! Runs a whole destination session from bytes: the input is split into the
//! main channel's and up to four page channels' streams
//! (`tern_engine::fuzzing::split_session_input`) and received into a small
//! guest in memory, through the same handshake checks, receivers, state
//! machines, page claims, decompressors, verification and restore as a
//! session over sockets. Any panic is a bug; so is a hang (libFuzzer's
//! `-timeout`), and replies that are not valid protocol.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tern_engine::fuzzing::destination_session(data);
});

//! A whole destination session built from the input read as choices
//! (`tern_engine::fuzzing::structured`): a valid session of every page kind,
//! codec and dictionary way, duplicates, deltas, a refresh, the switch-over
//! and its commit, then corrupted as the input's last choices say. Byte
//! mutations change the session's shape rather than its framing, so inputs
//! get past the handshake. Any panic is a bug; so is a hang (libFuzzer's
//! `-timeout`), and replies that are not valid protocol.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tern_engine::fuzzing::structured_destination_session(data);
});

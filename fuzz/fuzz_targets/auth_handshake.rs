//! Feeds arbitrary bytes, as a connecting peer would send them, to a
//! destination that requires the shared-key handshake
//! (`tern_engine::fuzzing::destination_auth`): the auth hello, the proof,
//! the hello that must name the same session and channel, over a real
//! socket pair. Any panic is a bug; so is a hang, and an input that gets
//! past the proof (it cannot know the destination's fresh nonce).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = tern_engine::fuzzing::destination_auth(data) {
        // Only an abort or a hello without authentication can come back,
        // and the destination refuses those before this point.
        assert!(
            matches!(message, tern_wire::Message::Abort(_)),
            "an input got past the auth handshake: {message:?}"
        );
    }
});

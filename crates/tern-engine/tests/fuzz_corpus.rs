//! Replays the `destination_session` fuzz target's kept inputs
//! (`fuzz/seeds/destination_session/`: its seeds and every input that once
//! found a bug) through the entry point the target calls, on stable, so the
//! suite keeps them fixed without a fuzzer.

use std::path::PathBuf;

use tern_engine::fuzzing::destination_session;

fn seeds() -> Vec<(String, Vec<u8>)> {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/destination_session");
    let mut inputs: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|error| panic!("{}: {error}", dir.display()))
        .map(|entry| {
            let path = entry.expect("a directory entry").path();
            let bytes = std::fs::read(&path).expect("a seed");
            (path.display().to_string(), bytes)
        })
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty(), "no seeds in {}", dir.display());
    inputs
}

#[test]
fn every_kept_input_ends_in_a_result_not_a_panic() {
    for (name, bytes) in seeds() {
        // A panic here names the input through the test's output.
        eprintln!("replaying {name}");
        let _ = destination_session(&bytes);
    }
}

#[test]
fn the_sample_seeds_are_valid_sessions() {
    for (name, bytes) in seeds() {
        let file = name.rsplit('/').next().unwrap_or_default();
        if ["sample", "swapped"].contains(&file) {
            destination_session(&bytes).unwrap_or_else(|error| panic!("{name}: {}", error.chain()));
        }
    }
}

#[test]
fn the_auth_handshake_refuses_every_kept_input() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/auth_handshake");
    let mut count = 0;
    for entry in
        std::fs::read_dir(&dir).unwrap_or_else(|error| panic!("{}: {error}", dir.display()))
    {
        let path = entry.expect("a directory entry").path();
        let bytes = std::fs::read(&path).expect("a seed");
        eprintln!("replaying {}", path.display());
        match tern_engine::fuzzing::destination_auth(&bytes) {
            Err(_) | Ok(tern_wire::Message::Abort(_)) => {}
            Ok(other) => panic!("{}: got past the auth handshake: {other:?}", path.display()),
        }
        count += 1;
    }
    assert!(count > 0, "no seeds in {}", dir.display());
    // The valid start fails at the proof, with the reason the peer hears.
    let error = tern_engine::fuzzing::destination_auth(&tern_engine::fuzzing::sample_auth_input())
        .expect_err("a proof without the key");
    assert!(
        error.to_string().contains("proof does not match"),
        "{error}"
    );
}

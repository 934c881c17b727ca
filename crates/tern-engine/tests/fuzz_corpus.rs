//! Replays the session fuzz targets' kept inputs
//! (`fuzz/seeds/destination_session/` and
//! `fuzz/seeds/destination_session_structured/`: their seeds and every
//! input that once found a bug) through the entry points the targets call,
//! on stable, so the suite keeps them fixed without a fuzzer; and shows
//! that the structured seeds reach the whole session.

use std::collections::BTreeSet;
use std::path::PathBuf;

use tern_engine::MigrationError;
use tern_engine::fuzzing::structured::structured_session;
use tern_engine::fuzzing::{destination_session, structured_destination_session};
use tern_wire::{Frame, Message, decode_stream};

fn seeds() -> Vec<(String, Vec<u8>)> {
    seeds_of("destination_session")
}

fn seeds_of(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds")
        .join(target);
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

#[test]
fn the_empty_structured_input_is_a_verified_session() {
    let end =
        structured_destination_session(&[]).unwrap_or_else(|error| panic!("{}", error.chain()));
    let comparison = end.digest_comparison.expect("the digests were compared");
    assert!(comparison.matched(), "{comparison:?}");
}

/// What the sessions built from the structured seeds hold: the frame kinds
/// of every stream (main channel first) and the kinds of their pages.
fn kinds_in(main: &[u8], pages: &[Vec<u8>]) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut frames = BTreeSet::new();
    let mut page_kinds = BTreeSet::new();
    let Ok(main_frames) = decode_stream(main, None) else {
        return (frames, page_kinds);
    };
    let setup = main_frames.iter().find_map(|frame| match frame {
        Frame::Message(Message::Hello(hello)) => Some(hello.setup.clone()),
        _ => None,
    });
    let mut all = main_frames;
    if let Some(setup) = &setup {
        for stream in pages {
            all.extend(decode_stream(stream, Some(setup)).unwrap_or_default());
        }
    }
    for frame in all {
        match frame {
            Frame::Message(message) => frames.insert(format!("{:?}", message.kind())),
            Frame::Pages(_, entries) => {
                page_kinds.extend(entries.iter().map(|entry| format!("{:?}", entry.kind)));
                frames.insert("Pages".into())
            }
        };
    }
    (frames, page_kinds)
}

/// The structured seeds build sessions with every message a source sends
/// and every page kind, and their sessions reach the switch-over: some are
/// verified and resumed after the commit, some refused there for their
/// digest.
#[test]
fn the_structured_seeds_reach_every_kind_and_the_switch_over() {
    let mut frames = BTreeSet::new();
    let mut page_kinds = BTreeSet::new();
    let (mut verified, mut mismatched, mut total) = (0, 0, 0);
    for (name, bytes) in seeds_of("destination_session_structured") {
        eprintln!("replaying {name}");
        let (main, pages) = structured_session(&bytes);
        let (seen_frames, seen_pages) = kinds_in(&main, &pages);
        frames.extend(seen_frames);
        page_kinds.extend(seen_pages);
        match structured_destination_session(&bytes) {
            Ok(end) if end.digest_comparison.is_some_and(|c| c.matched()) => verified += 1,
            Err(MigrationError::DigestMismatch { .. }) => mismatched += 1,
            _ => {}
        }
        total += 1;
    }
    for kind in [
        "Hello",
        "ChannelHello",
        "Dictionary",
        "Pages",
        "Sync",
        "StateSection",
        "Complete",
        "Commit",
        "Abort",
    ] {
        assert!(frames.contains(kind), "no seed sends {kind}: {frames:?}");
    }
    // `write_seeds` keeps a delta-carrying session per outcome besides the
    // one seed per outcome: deltas alone are too rare to be kept by chance.
    for kind in ["Zero", "Raw", "Compressed", "Duplicate", "Delta"] {
        assert!(
            page_kinds.contains(kind),
            "no seed sends a {kind} page: {page_kinds:?}"
        );
    }
    assert!(verified > 0, "none of {total} seeds verified");
    assert!(
        mismatched > 0,
        "none of {total} seeds was refused for its digest"
    );
}

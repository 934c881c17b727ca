//! `tern restore --lazy` with a working set spread across memory, as the
//! prefetch benchmark runs it: a recording run reads the set
//! (`--touch-spread`) with the loaders held back (`--load-after`), so
//! every chunk it read was faulted in and recorded; a second restore
//! prefetches that set; both verify by digest.

use crate::process;

use std::path::Path;

use process::{json, tern};
use tern_wire::snapshot::WorkingSet;

/// 16 MiB; `--touch-spread 1MiB` reads 16 runs of one 16-page chunk.
const PAGES: u32 = 4096;
const RUNS: u32 = 16;

fn lazy_restore(snapshot: &Path, extra: &[&str]) -> Option<serde_json::Value> {
    let output = tern()
        .args(["restore", "--json", "--lazy", "--run-after", "20"])
        .args(["--touch-spread", "1MiB", "--snapshot"])
        .arg(snapshot)
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    if stderr.contains("userfaultfd") {
        tern_test_skip::skip(tern_test_skip::Need::Userfaultfd, stderr.to_string());
        return None;
    }
    assert!(output.status.success(), "{stderr}");
    Some(json(&output))
}

#[test]
fn a_recording_run_with_loaders_held_back_records_every_chunk_of_a_spread_working_set() {
    let dir = tempfile::tempdir().unwrap();
    let snapshot = dir.path().join("guest.tern");
    let set = dir.path().join("ws");
    let output = tern()
        .args(["save", "--json", "--memory", "16MiB", "--dirty-rate", "0"])
        .args(["--warmup", "0", "--output"])
        .arg(&snapshot)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let saved = json(&output);
    let set_arg = set.to_str().unwrap();
    let Some(recorded) = lazy_restore(
        &snapshot,
        &[
            "--no-prefetch",
            "--load-after",
            "0",
            "--record-working-set",
            set_arg,
        ],
    ) else {
        return;
    };
    assert_eq!(recorded["touched"]["pages"], RUNS * 16, "{recorded}");
    assert_eq!(recorded["digest"], saved["digest"]);
    assert_eq!(recorded["digest-verified"], true);
    // Every chunk read was faulted in: one fault each, all recorded.
    let pages = WorkingSet::decode_file(&std::fs::read(&set).unwrap())
        .unwrap()
        .pages;
    let mut chunks: Vec<u32> = pages.iter().map(|&(_, page)| page / 16).collect();
    chunks.sort_unstable();
    chunks.dedup();
    let touched: Vec<u32> = (0..RUNS).map(|run| run * PAGES / RUNS / 16).collect();
    assert_eq!(chunks, touched, "{pages:?}");
    // Prefetched first, the same set restores to the same memory.
    let Some(prefetched) = lazy_restore(&snapshot, &["--working-set", set_arg]) else {
        return;
    };
    assert_eq!(prefetched["digest"], saved["digest"]);
    assert_eq!(prefetched["touched"]["pages"], RUNS * 16);
}

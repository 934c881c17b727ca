//! `tern save --track-dirty-pages --diff-output` (Firecracker's
//! `track_dirty_pages` + `snapshot_type: Diff`) as a user runs it: one
//! process saves a base and two tracked diffs, each holding exactly the
//! pages written since the file before it; a second process makes the
//! same changes and diffs them by content (whole chunks); the digests of
//! both agree, and the tracked chain restores, in other processes, to it.

use crate::process;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use process::{json, tern};
use tern_engine::snapshot::SnapshotFile;

/// 16 MiB in 4 KiB pages.
const PAGES: u64 = 4096;
const PAGE: u64 = 4096;
/// `--diff-dirty-spread 1`: 1 % of the pages, rounded up, one every 100
/// (no two in one 16-page chunk).
const DIRTIED: u64 = PAGES.div_ceil(100);

/// A base and two diffs, each after 1 % of the pages (spread across
/// memory) were written; with `tracked`, from the dirty log.
fn save_chain(dir: &Path, name: &str, tracked: bool) -> (serde_json::Value, [PathBuf; 3]) {
    let files = ["base", "d1", "d2"].map(|layer| dir.join(format!("{name}-{layer}.tern")));
    let mut command = tern();
    command.args(["save", "--json", "--memory", "16MiB", "--regions", "2"]);
    command.args(["--dirty-rate", "0", "--warmup", "0", "--diff-after", "0"]);
    command.args(["--diff-dirty-spread", "1", "--output"]);
    command.arg(&files[0]);
    for diff in &files[1..] {
        command.arg("--diff-output").arg(diff);
    }
    if tracked {
        command.arg("--track-dirty-pages");
    }
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    (json(&output), files)
}

/// Pages the top file of `layers` marks changed, over all regions.
fn changed_pages(layers: &[PathBuf]) -> u64 {
    let (top, bases) = layers.split_last().unwrap();
    let file = SnapshotFile::open_layers(bases, top).unwrap();
    file.metadata()
        .changed
        .iter()
        .flatten()
        .map(|word| u64::from(word.count_ones()))
        .sum()
}

fn restore(layers: &[PathBuf], lazy: bool) -> Option<serde_json::Value> {
    let (top, bases) = layers.split_last().unwrap();
    let mut command = tern();
    command.args(["restore", "--json", "--run-after", "20", "--snapshot"]);
    command.arg(top);
    for base in bases {
        command.arg("--base").arg(base);
    }
    if lazy {
        command.arg("--lazy");
    }
    let output = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    if lazy && stderr.contains("userfaultfd") {
        tern_test_skip::skip(tern_test_skip::Need::Userfaultfd, stderr.to_string());
        return None;
    }
    assert!(output.status.success(), "{stderr}");
    Some(json(&output))
}

#[test]
fn tracked_diffs_hold_exactly_the_dirtied_pages_and_restore_to_the_same_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (tracked, files) = save_chain(dir.path(), "tracked", true);
    let (by_content, content_files) = save_chain(dir.path(), "content", false);
    assert_eq!(tracked["tracked"], true, "{tracked}");
    assert_eq!(tracked["digest"], by_content["digest"]);
    let metadata_bytes =
        tracked["file-bytes"].as_u64().unwrap() - tracked["memory-bytes"].as_u64().unwrap();
    for (index, diff) in [&files[1], &files[2]].into_iter().enumerate() {
        let report = &tracked["diffs"][index];
        assert_eq!(report["pages-dirtied"], DIRTIED, "{report}");
        assert_eq!(report["tracked"], true, "{report}");
        // Every dirtied page is non-zero: each is one page written, and
        // every other page is left to the base.
        assert_eq!(report["normal"], DIRTIED, "{report}");
        assert_eq!(report["duplicate"], 0, "{report}");
        assert_eq!(report["unchanged-pages"], PAGES - DIRTIED, "{report}");
        assert_eq!(changed_pages(&files[..index + 2]), DIRTIED);
        // On disk: the dirtied pages and the metadata, nothing else.
        let on_disk = std::fs::metadata(diff).unwrap().blocks() * 512;
        let bound = (DIRTIED * PAGE + metadata_bytes).next_multiple_of(PAGE) + 4 * PAGE;
        assert!(on_disk <= bound, "{on_disk} bytes on disk, at most {bound}");
        // The same changes diffed by content: the same memory, in whole
        // chunks (16 pages for each page written).
        let content = &by_content["diffs"][index];
        assert_eq!(report["digest"], content["digest"], "{report}\n{content}");
        assert!(
            changed_pages(&content_files[..index + 2]) >= 15 * DIRTIED,
            "{content}"
        );
    }
    let top = &tracked["diffs"][1]["digest"];
    for lazy in [false, true] {
        let Some(restored) = restore(&files, lazy) else {
            continue;
        };
        assert_eq!(&restored["digest"], top, "{restored}");
        assert_eq!(restored["digest-verified"], true, "{restored}");
    }
    let restored = restore(&files[..2], false).unwrap();
    assert_eq!(restored["digest"], tracked["diffs"][0]["digest"]);
}

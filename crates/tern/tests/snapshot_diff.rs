//! `tern save --diff-base` and `tern restore --base`, as a user runs them:
//! separate processes, files on disk, the digest compared from the JSON
//! reports.

use crate::process;

use std::path::Path;

use process::{json, tern};

/// The same synthetic guest every time (same seed, same fill); the
/// dirtier runs for `warmup_ms` before the save, so two saves differ in
/// the pages it wrote.
fn save(output: &Path, diff_base: Option<&Path>, warmup_ms: u32) -> serde_json::Value {
    let mut command = tern();
    command.args(["save", "--memory", "16MiB", "--regions", "2"]);
    command.args(["--dirty-rate", "16MiB", "--working-set", "2MiB", "--json"]);
    command.arg("--warmup").arg(warmup_ms.to_string());
    command.arg("--output").arg(output);
    if let Some(base) = diff_base {
        command.arg("--diff-base").arg(base);
    }
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    json(&output)
}

fn restore(snapshot: &Path, bases: &[&Path], lazy: bool) -> std::process::Output {
    let mut command = tern();
    command.args(["restore", "--json", "--run-after", "50"]);
    command.arg("--snapshot").arg(snapshot);
    for base in bases {
        command.arg("--base").arg(base);
    }
    if lazy {
        command.arg("--lazy");
    }
    command.output().unwrap()
}

#[test]
fn a_diff_saved_by_one_process_restores_on_its_base_in_another() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.tern");
    let diff = dir.path().join("diff.tern");
    save(&base, None, 0);
    let saved = save(&diff, Some(&base), 300);
    let unchanged = saved["unchanged-pages"].as_u64().unwrap();
    assert!(unchanged >= 3 * 4096 / 4, "{saved}");
    assert!(saved["base-digest"].is_string(), "{saved}");
    for lazy in [false, true] {
        let output = restore(&diff, &[&base], lazy);
        let stderr = String::from_utf8_lossy(&output.stderr);
        if lazy && stderr.contains("userfaultfd") {
            tern_test_skip::skip(tern_test_skip::Need::Userfaultfd, stderr.to_string());
            continue;
        }
        assert!(output.status.success(), "{stderr}");
        let restored = json(&output);
        assert_eq!(restored["digest"], saved["digest"], "{restored}");
        assert_eq!(restored["digest-verified"], true);
    }
    // Merged into one full snapshot, it restores alone.
    let merged = dir.path().join("merged.tern");
    let output = tern()
        .args(["merge-snapshot", "--json", "--snapshot"])
        .arg(&diff)
        .arg("--base")
        .arg(&base)
        .arg("--output")
        .arg(&merged)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(json(&output)["digest"], saved["digest"]);
    let output = restore(&merged, &[], false);
    assert!(output.status.success());
    assert_eq!(json(&output)["digest"], saved["digest"]);
    // Alone, the diff is refused in one line and nothing runs.
    let output = restore(&diff, &[], false);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("is a diff snapshot"), "{stderr}");
}

//! One integration-test binary per crate, and no test file left out of it.
//!
//! Each tern crate compiles its integration tests as one binary whose root,
//! `tests/integration.rs`, names every other file in `tests/` as a module
//! (`autotests = false`): a binary per file compiled the engine's generic
//! pipeline again for each (docs/testing.md, "One test binary"). Cargo then
//! no longer finds test files by itself, so a file added to `tests/` and not
//! named in the root would never be compiled; each root runs
//! [`assert_every_test_file_is_compiled`] as a test of its own.

use std::path::Path;

/// The name of the root file of a crate's integration tests.
const ROOT: &str = "integration";

/// The modules of `tests_directory` (`name.rs` files and `name/mod.rs`
/// directories, the root aside) that `root_source` does not declare with a
/// `mod name;` line (attributes such as `#[cfg(feature = "tls")]` go on the
/// line before).
///
/// # Panics
/// When the directory cannot be listed.
pub fn undeclared_test_files(tests_directory: &Path, root_source: &str) -> Vec<String> {
    let declared: Vec<&str> = root_source
        .lines()
        .filter_map(|line| line.trim().strip_prefix("mod ")?.strip_suffix(';'))
        .collect();
    let entries = std::fs::read_dir(tests_directory)
        .unwrap_or_else(|error| panic!("cannot list {}: {error}", tests_directory.display()));
    let mut missing: Vec<String> = entries
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let name = path.file_stem()?.to_str()?.to_owned();
            let is_module = path.extension().is_some_and(|extension| extension == "rs")
                || path.join("mod.rs").is_file();
            (is_module && name != ROOT && !declared.contains(&name.as_str())).then_some(name)
        })
        .collect();
    missing.sort();
    missing
}

/// Fails, naming them, when files of `<manifest_directory>/tests` are not
/// modules of `tests/integration.rs`.
///
/// # Panics
/// When a file is left out, or the directory or root cannot be read.
pub fn assert_every_test_file_is_compiled(manifest_directory: &str) {
    let tests_directory = Path::new(manifest_directory).join("tests");
    let root_path = tests_directory.join(format!("{ROOT}.rs"));
    let root_source = std::fs::read_to_string(&root_path)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", root_path.display()));
    let missing = undeclared_test_files(&tests_directory, &root_source);
    assert!(
        missing.is_empty(),
        "files of {} not declared in {ROOT}.rs, so never compiled: {missing:?}",
        tests_directory.display()
    );
}

#[cfg(test)]
mod tests {
    use super::undeclared_test_files;

    #[test]
    fn a_test_file_missing_from_the_root_is_named() {
        let directory = std::env::temp_dir().join(format!("tern-layout-{}", std::process::id()));
        std::fs::create_dir_all(directory.join("common")).unwrap();
        for file in [
            "integration.rs",
            "declared.rs",
            "gated.rs",
            "forgotten.rs",
            "notes.md",
        ] {
            std::fs::write(directory.join(file), "").unwrap();
        }
        std::fs::write(directory.join("common/mod.rs"), "").unwrap();
        let root = "mod common;\nmod declared;\n#[cfg(feature = \"tls\")]\nmod gated;\n";
        let missing = undeclared_test_files(&directory, root);
        std::fs::remove_dir_all(&directory).unwrap();
        assert_eq!(missing, ["forgotten"]);
    }
}

//! Training the session's zstd dictionary on sampled guest pages.

use tern_wire::MAX_DICTIONARY_LEN;

use super::error::CodecError;
use super::id::CodecId;
use super::registry;
use super::sample::looks_incompressible_bytes;
use crate::PAGE_SIZE;

/// Trains a zstd dictionary of at most `max_len` bytes on the pages of
/// `sample` worth compressing (zero pages and pages the sample finds random
/// are left out: they never reach the codec).
///
/// # Errors
///
/// [`CodecError::Dictionary`] when too few pages are left or zstd's
/// trainer fails (it needs some repetition across samples);
/// [`CodecError::NotBuilt`] without the `zstd` feature.
pub fn train_dictionary(sample: &[[u8; PAGE_SIZE]], max_len: usize) -> Result<Vec<u8>, CodecError> {
    let max_len = max_len.clamp(256, MAX_DICTIONARY_LEN);
    let useful: Vec<&[u8; PAGE_SIZE]> = sample
        .iter()
        .filter(|page| page.iter().any(|&byte| byte != 0) && !looks_incompressible_bytes(page))
        .collect();
    // zstd's trainer refuses fewer than a handful of samples.
    if useful.len() < 8 {
        return Err(CodecError::Dictionary(format!(
            "{} compressible pages in the sample, too few to train on",
            useful.len()
        )));
    }
    registry::trainer(CodecId::Zstd)?(&useful, max_len)
}

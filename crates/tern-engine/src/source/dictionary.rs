//! Training the session's zstd dictionary at setup, on pages sampled across
//! guest memory, before the hello announces it.

use std::time::Instant;

use tern_page::codec::{CodecDictionary, CodecId, DICTIONARY_SAMPLE_PAGES, train_dictionary};

use crate::guest::MemoryRegion;
use crate::pipeline::{CompressionSetup, sample_pages};
use crate::stats::DictionaryReport;

/// `setup` with a dictionary of at most `max_len` bytes trained on this
/// guest's pages, when one is asked for and a zstd codec may be used.
/// Training that fails (a guest of zero or random pages has nothing to
/// learn) is logged, and the migration goes on without a dictionary.
pub(super) fn with_trained_dictionary(
    setup: &CompressionSetup,
    max_len: Option<usize>,
    regions: &[MemoryRegion],
) -> CompressionSetup {
    let mut setup = setup.clone();
    let Some(max_len) = max_len else {
        return setup;
    };
    if !setup.codecs().iter().any(|codec| codec.is_zstd()) {
        return setup;
    }
    let started = Instant::now();
    let sample = sample_pages(regions, DICTIONARY_SAMPLE_PAGES);
    let trained = train_dictionary(&sample, max_len)
        .and_then(|bytes| CodecDictionary::new(1, CodecId::Zstd, bytes));
    let training_ms = started.elapsed().as_secs_f64() * 1e3;
    match trained {
        Ok(dictionary) => {
            tracing::info!(
                bytes = dictionary.bytes().len(),
                training_ms,
                "trained a zstd dictionary on sampled guest pages"
            );
            setup.dictionary_report = Some(DictionaryReport {
                bytes: dictionary.bytes().len() as u64,
                sample_pages: sample.len() as u64,
                training_ms,
            });
            setup.dictionary = Some(dictionary);
        }
        Err(error) => {
            tracing::warn!(%error, "no zstd dictionary: compressing without one");
        }
    }
    setup
}

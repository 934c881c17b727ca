//! Training the session's zstd dictionary at setup, on pages sampled across
//! guest memory, before the hello announces it. Training it again during
//! the live phase is the pipeline's (`pipeline/refresher.rs`).

use std::time::Instant;

use tern_page::codec::{CodecDictionary, CodecId, DICTIONARY_SAMPLE_PAGES, train_dictionary};

use crate::config::{DictionaryRefresh, MigrationConfig};
use crate::guest::MemoryRegion;
use crate::pipeline::{CompressionSetup, sample_pages};
use crate::stats::{AutoDecisionReport, DictionaryReport};

/// `setup` with a dictionary of at most `max_len` bytes trained on this
/// guest's pages, when one is asked for and a zstd codec may be used.
/// Training that fails (a guest of zero or random pages has nothing to
/// learn) is logged, and the migration goes on without a dictionary.
pub(crate) fn with_trained_dictionary(
    setup: &CompressionSetup,
    max_len: Option<usize>,
    refresh: DictionaryRefresh,
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
                trained: 1,
                ..DictionaryReport::default()
            });
            setup.dictionary = Some(dictionary);
            setup.dictionary_refresh = Some((refresh, max_len));
        }
        Err(error) => {
            tracing::warn!(%error, "no zstd dictionary: compressing without one");
        }
    }
    setup
}

/// The dictionary `auto` trains when none is configured: 64 KiB, the size
/// measured against QEMU (docs/compression.md); a 4 KiB page finds most of
/// its matches in it and it costs 64 KiB once on the wire.
pub(crate) const AUTO_DICTIONARY_LEN: usize = 64 << 10;

/// `setup` with the session's dictionary: the configured one, or with
/// `auto` and none configured, the one auto decides on.
pub(crate) fn session_compression(
    setup: &CompressionSetup,
    config: &MigrationConfig,
    regions: &[MemoryRegion],
) -> CompressionSetup {
    if config.compression == tern_page::codec::CodecChoice::Auto
        && config.compression_dictionary.is_none()
        && config.auto_dictionary
    {
        with_auto_dictionary(setup, config)
    } else {
        with_trained_dictionary(
            setup,
            config.compression_dictionary,
            config.dictionary_refresh,
            regions,
        )
    }
}

/// Why `auto` trains no dictionary at setup.
const DEFERRED_REASON: &str = "decided once auto picks a codec on the measured link: trained in the \
     background when it keeps per-page zstd there, in use as soon as it is trained; not with \
     zstd-stream, whose window holds what each channel sent, nor on a link faster than zstd \
     (training at setup cost 164-315 ms for a dictionary raw never uses)";

/// Why `auto` trains none with its refresh off (the deferred training is
/// the refresher's).
const OFF_REASON: &str = "auto compresses whole packets as a zstd stream per channel, which \
     takes no dictionary, and with the dictionary refresh off it trains none for per-page zstd";

/// With `auto` and no dictionary configured: defers it to the migration
/// (the pipeline trains it once the measured link has it keep per-page
/// zstd, `pipeline/dictionary_refresh.rs`, and forgoes it with a channel
/// stream), or with the refresh off, trains none. Until protocol 14 a
/// configured link rate (`max_bandwidth`) had it trained at setup and kept
/// when it paid; `auto` then compressed whole packets in packet frames,
/// which took it, where its channel streams take none. The decision and
/// its reason go into the setup's `auto_decisions`.
fn with_auto_dictionary(setup: &CompressionSetup, config: &MigrationConfig) -> CompressionSetup {
    let mut setup = setup.clone();
    let (choice, reason) = if config.dictionary_refresh == DictionaryRefresh::Off {
        ("off", OFF_REASON)
    } else {
        setup.dictionary_refresh = Some((config.dictionary_refresh, AUTO_DICTIONARY_LEN));
        ("deferred", DEFERRED_REASON)
    };
    tracing::info!(subject = "dictionary", choice, reason, "auto decides");
    setup.auto_decisions.push(AutoDecisionReport {
        at_ms: 0,
        subject: "dictionary".to_string(),
        choice: choice.to_string(),
        reason: reason.to_string(),
    });
    setup
}

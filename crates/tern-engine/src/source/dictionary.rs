//! Training the session's zstd dictionary at setup, on pages sampled across
//! guest memory, before the hello announces it. Training it again during
//! the live phase is the pipeline's (`pipeline/refresher.rs`).

use std::time::Instant;

use tern_page::codec::{
    CodecDictionary, CodecId, DICTIONARY_SAMPLE_PAGES, calibrate_with_dictionary, train_dictionary,
};

use crate::config::{DictionaryRefresh, MigrationConfig};
use crate::guest::MemoryRegion;
use crate::pipeline::{CompressionSetup, SWITCH_MARGIN, calibration_sample, sample_pages};
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

/// zstd's ratio with the dictionary, over its ratio without, on pages the
/// training did not see, from which `auto` keeps a dictionary: below it a
/// dictionary saves less than the noise of the measurement.
pub(crate) const AUTO_DICTIONARY_GAIN: f64 = 1.03;

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
        with_auto_dictionary(setup, config, regions)
    } else {
        with_trained_dictionary(
            setup,
            config.compression_dictionary,
            config.dictionary_refresh,
            regions,
        )
    }
}

/// Why no dictionary pays, when the configured link is faster than zstd
/// measured as `zstd` with the configured workers (auto sends raw there).
fn link_faster_than_zstd(
    config: &MigrationConfig,
    zstd: &tern_page::codec::CodecMeasurement,
) -> Option<String> {
    let link = config.max_bandwidth? as f64;
    let workers = config.worker_count();
    let carried = zstd.effective_rate(link, workers);
    (carried <= link * (1.0 + SWITCH_MARGIN)).then(|| {
        format!(
            "the configured link ({:.0} MB/s) is faster than zstd with {workers} workers \
             ({:.0} MB/s of guest memory at ratio {:.2}): auto sends raw there",
            link / 1e6,
            carried / 1e6,
            zstd.ratio
        )
    })
}

/// Why `auto` trains no dictionary at setup when no link rate is
/// configured.
const DEFERRED_REASON: &str = "the link is not measured yet: trained in the background once auto \
     measures a link slower than zstd, in use as soon as it is trained (on a faster link, \
     training at setup cost 164-315 ms for a dictionary raw never uses)";

/// With `auto` and no dictionary configured: when no link rate is
/// configured, defers it to the migration (the pipeline trains it once the
/// measured link picks zstd, `pipeline/dictionary_refresh.rs`). Otherwise
/// trains one (unless the
/// configured link is faster than every codec, where `auto` sends raw) and
/// keeps it when zstd's ratio with it, on pages the training did not see,
/// beats its ratio without by [`AUTO_DICTIONARY_GAIN`]. The decision and
/// its reason go into the setup's `auto_decisions`.
fn with_auto_dictionary(
    setup: &CompressionSetup,
    config: &MigrationConfig,
    regions: &[MemoryRegion],
) -> CompressionSetup {
    let mut setup = setup.clone();
    let decide = |setup: &mut CompressionSetup, choice: String, reason: String| {
        tracing::info!(subject = "dictionary", choice, reason, "auto decides");
        setup.auto_decisions.push(AutoDecisionReport {
            at_ms: 0,
            subject: "dictionary".to_string(),
            choice,
            reason,
        });
    };
    if config.max_bandwidth.is_none() && config.dictionary_refresh != DictionaryRefresh::Off {
        setup.dictionary_refresh = Some((config.dictionary_refresh, AUTO_DICTIONARY_LEN));
        decide(&mut setup, "deferred".into(), DEFERRED_REASON.into());
        return setup;
    }
    let sample = calibration_sample(regions);
    let zstd = [(CodecId::Zstd, CodecId::Zstd.default_level())];
    let measure = |dictionary: Option<&CodecDictionary>| {
        calibrate_with_dictionary(&sample, &zstd, dictionary)
            .ok()
            .and_then(|measured| measured.first().copied())
    };
    let Some(plain) = measure(None) else {
        decide(
            &mut setup,
            "off".into(),
            "zstd could not be measured".into(),
        );
        return setup;
    };
    if let Some(reason) = link_faster_than_zstd(config, &plain) {
        decide(&mut setup, "off".into(), reason);
        return setup;
    }
    let trained = with_trained_dictionary(
        &setup,
        Some(AUTO_DICTIONARY_LEN),
        config.dictionary_refresh,
        regions,
    );
    let (Some(dictionary), Some(report)) = (&trained.dictionary, &trained.dictionary_report) else {
        let reason = "training found nothing to learn (the sampled pages are zero or random)";
        decide(&mut setup, "off".into(), reason.into());
        return setup;
    };
    let with = measure(Some(dictionary)).map_or(0.0, |measured| measured.ratio);
    let gain = with / plain.ratio.max(1e-9);
    let numbers = format!(
        "zstd's ratio on {} pages the training did not see: {:.3} without, {with:.3} with \
         ({:+.1} %; trained on {} pages in {:.0} ms)",
        sample.len(),
        plain.ratio,
        (gain - 1.0) * 100.0,
        report.sample_pages,
        report.training_ms
    );
    if gain >= AUTO_DICTIONARY_GAIN {
        let mut trained = trained.clone();
        decide(&mut trained, report.bytes.to_string(), numbers);
        trained
    } else {
        let reason = format!(
            "{numbers}: below the {:.0} % a dictionary must gain",
            (AUTO_DICTIONARY_GAIN - 1.0) * 100.0
        );
        decide(&mut setup, "off".into(), reason);
        setup
    }
}

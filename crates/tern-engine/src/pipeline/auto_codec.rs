//! Which codec a batch uses: the configured one, or `auto`, which
//! re-decides from the link rate and the codecs' measured speed and ratio.

use super::*;

/// What the workers compress with.
#[derive(Clone, Debug)]
pub(crate) struct CompressionSetup {
    pub choice: CodecChoice,
    pub level: Option<i32>,
    pub qpl_path: QplPath,
    /// With `auto`: deflate goes through QPL (calibration found it faster
    /// than libdeflate at a similar ratio, see [`tern_page::codec::prefer_offload`]).
    pub deflate_through_qpl: bool,
    /// zstd in packet frames ([`CodecId::ZstdPacket`]) rather than per page.
    pub packet_frames: bool,
    /// The session's zstd dictionary, once trained (see `dictionary.rs`).
    pub dictionary: Option<tern_page::codec::CodecDictionary>,
    /// How the dictionary was trained, for the statistics.
    pub dictionary_report: Option<crate::stats::DictionaryReport>,
    /// How it is refreshed during the live phase, and its size; `None`
    /// without a dictionary.
    pub dictionary_refresh: Option<(crate::config::DictionaryRefresh, usize)>,
}

impl CompressionSetup {
    /// Codecs the session may use (announced in the hello as a bitmask).
    pub(crate) fn codecs(&self) -> Vec<CodecId> {
        match self.choice.wire() {
            Some(CodecId::None) => Vec::new(),
            Some(CodecId::Zstd) if self.packet_frames => vec![CodecId::ZstdPacket],
            Some(codec) => vec![codec],
            // auto: the codecs this build has (see tern-page's features).
            None => [
                CodecId::Zstd,
                CodecId::Deflate,
                CodecId::Lz4,
                CodecId::ZstdPacket,
            ]
            .into_iter()
            .filter(|codec| codec.is_built())
            .collect(),
        }
    }

    /// A compressor for `codec`, as the user's choice asks (QPL for deflate
    /// when `qpl` was chosen, or when `auto` measured QPL the better deflate).
    pub(crate) fn compressor(
        &self,
        codec: CodecId,
    ) -> Result<PageCompressor, tern_page::CodecError> {
        self.compressor_at(codec, self.level_for(codec))
    }

    /// The level asked for `codec`: the configured one, or its default.
    pub(crate) fn level_for(&self, codec: CodecId) -> i32 {
        self.level.unwrap_or_else(|| codec.default_level())
    }

    /// [`compressor`](Self::compressor) at `level` (auto tunes it).
    pub(crate) fn compressor_at(
        &self,
        codec: CodecId,
        level: i32,
    ) -> Result<PageCompressor, tern_page::CodecError> {
        self.compressor_with(codec, level, self.dictionary.as_ref())
    }

    /// [`compressor_at`](Self::compressor_at) against `dictionary` (zstd
    /// only; other codecs ignore it): a refreshed one, in force since an
    /// iteration boundary.
    pub(crate) fn compressor_with(
        &self,
        codec: CodecId,
        level: i32,
        dictionary: Option<&tern_page::codec::CodecDictionary>,
    ) -> Result<PageCompressor, tern_page::CodecError> {
        let through_qpl = self.choice == CodecChoice::Qpl || self.deflate_through_qpl;
        if through_qpl && codec == CodecId::Deflate {
            PageCompressor::with_qpl(self.qpl_path, level)
        } else if codec.is_zstd() {
            PageCompressor::with_dictionary(codec, level, dictionary)
        } else {
            PageCompressor::new(codec, level)
        }
    }
}

/// Adaptive compression: the producer re-decides the codec every so many
/// batches from the link rate and the codecs' measured speed and ratio.
pub(super) struct AutoCodec {
    pub(super) selector: tern_page::AutoSelector,
    /// Calibrated at start, then updated from the workers' counters.
    pub(super) measurements: Vec<tern_page::codec::CodecMeasurement>,
    pub(super) batches_since: u64,
    pub(super) window_started: Instant,
    pub(super) wire_at_start: u64,
    pub(super) busy_at_start: u64,
    pub(super) switches: u64,
    /// The level in force for the current codec, tuned while it is kept.
    pub(super) level: i32,
    /// The current codec's counters when the window started: the window's
    /// measurement is the difference, at the window's level.
    pub(super) counters_at_start: CodecCounters,
    pub(super) level_changes: u64,
    /// The link estimates of the last windows.
    pub(super) links: LinkEstimates,
}

/// The link rate as auto decides on it: the (lower) median of the last
/// [`LinkEstimates::KEPT`] windows' estimates, once
/// [`LinkEstimates::NEEDED`] are in. One window's estimate (wire bytes per
/// second over the share of time the senders were busy) can be off by 10x
/// or more: while socket buffers fill, sends return at once and the link
/// looks as fast as memory (1-3.6 GB/s measured on a 1 Gbit/s link), and
/// a window of zero pages hardly uses it. Single windows like these made
/// auto leave a codec for raw or lz4 and come back a window later, sending
/// that window's pages with a worse ratio (docs/compression.md).
#[derive(Debug, Default)]
pub(super) struct LinkEstimates {
    recent: std::collections::VecDeque<f64>,
}

impl LinkEstimates {
    /// Windows the median is taken over.
    pub(super) const KEPT: usize = 5;
    /// Windows measured before the first decision.
    pub(super) const NEEDED: usize = 3;

    /// Adds a window's estimate; the rate to decide on, once enough are in.
    pub(super) fn push(&mut self, estimate: f64) -> Option<f64> {
        if self.recent.len() == Self::KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(estimate);
        if self.recent.len() < Self::NEEDED {
            return None;
        }
        let mut sorted: Vec<f64> = self.recent.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        // The lower median: in doubt, the slower link, on which a codec
        // costs least if wrong (raw on a slow link costs most).
        Some(sorted[(sorted.len() - 1) / 2])
    }
}

impl AutoCodec {
    /// Starts the next decision window.
    fn start_window(&mut self, counters: CodecCounters, wire: u64, busy: u64) {
        self.counters_at_start = counters;
        self.batches_since = 0;
        self.window_started = Instant::now();
        self.wire_at_start = wire;
        self.busy_at_start = busy;
    }
}

impl AutoCodec {
    /// Adaptive compression before its first window: the codec calibration
    /// finds best on a link of `max_bandwidth`, or without one, on a link
    /// slower than every codec (the best ratio that is worth it). The first
    /// window has no link measurement yet; starting raw there sent its
    /// pages uncompressed (about 20 MiB of data pages at 1 Gbit/s, see
    /// docs/compression.md), while a codec too slow for a fast link costs
    /// at most that one window's difference in speed.
    pub(super) fn start(
        workers: usize,
        measurements: Vec<tern_page::codec::CodecMeasurement>,
        max_bandwidth: Option<u64>,
        compression: &CompressionSetup,
    ) -> Self {
        let mut selector = tern_page::AutoSelector::new(workers);
        let link = max_bandwidth.map_or(SLOWER_THAN_ANY_CODEC, |rate| rate as f64);
        let first = selector.next(link, &measurements).codec;
        Self {
            selector,
            measurements,
            batches_since: 0,
            window_started: Instant::now(),
            wire_at_start: 0,
            busy_at_start: 0,
            switches: 0,
            level: compression.level_for(first),
            counters_at_start: CodecCounters::default(),
            level_changes: 0,
            links: LinkEstimates::default(),
        }
    }
}

/// A link rate (bytes per second) below any codec's speed: the selector
/// then ranks codecs by ratio alone.
const SLOWER_THAN_ANY_CODEC: f64 = 1.0;

/// Adaptive compression decides again after at least this many batches and
/// this much time: enough to measure the link, often enough to follow it.
pub(super) const AUTO_DECISION_BATCHES: u64 = 16;
pub(super) const AUTO_DECISION_INTERVAL: Duration = Duration::from_millis(50);

/// Pages calibration measures the codecs on.
const CALIBRATION_PAGES: usize = 64;

/// What calibration found: the candidates' measurements, and whether
/// deflate is to go through QPL.
pub(super) struct Calibration {
    pub measurements: Vec<tern_page::codec::CodecMeasurement>,
    pub deflate_through_qpl: bool,
}

/// Measures the candidate codecs on pages sampled across guest memory, so
/// adaptive compression starts from numbers of this guest and this machine.
/// When libqpl loads, deflate is measured through QPL (on `qpl_path`) too,
/// and the better of the two deflates is the candidate.
pub(super) fn calibrate_codecs(
    regions: &[MemoryRegion],
    qpl_path: QplPath,
    dictionary: Option<&tern_page::codec::CodecDictionary>,
) -> Calibration {
    let sample = sample_pages(regions, CALIBRATION_PAGES);
    let candidates = [
        (CodecId::Zstd, CodecId::Zstd.default_level()),
        (CodecId::Deflate, CodecId::Deflate.default_level()),
        (CodecId::Lz4, CodecId::Lz4.default_level()),
        (CodecId::ZstdPacket, CodecId::ZstdPacket.default_level()),
    ];
    let measurements =
        tern_page::codec::calibrate_with_dictionary(&sample, &candidates, dictionary)
            .unwrap_or_default();
    let qpl = tern_page::codec::qpl_available()
        .and_then(|()| {
            tern_page::codec::calibrate_qpl(&sample, qpl_path, CodecId::Deflate.default_level())
        })
        .inspect_err(|error| tracing::debug!(%error, "auto compression leaves QPL out"))
        .ok();
    with_qpl_candidate(measurements, qpl)
}

/// Replaces libdeflate's measurement with QPL's when QPL is the better
/// deflate ([`tern_page::codec::prefer_offload`]). Pure.
pub(super) fn with_qpl_candidate(
    mut measurements: Vec<tern_page::codec::CodecMeasurement>,
    qpl: Option<tern_page::codec::CodecMeasurement>,
) -> Calibration {
    let Some(qpl) = qpl else {
        return Calibration {
            measurements,
            deflate_through_qpl: false,
        };
    };
    let software = measurements
        .iter()
        .position(|measured| measured.codec == CodecId::Deflate);
    let through_qpl = match software {
        Some(index) => tern_page::codec::prefer_offload(&measurements[index], &qpl),
        None => true,
    };
    if through_qpl {
        measurements.retain(|measured| measured.codec != CodecId::Deflate);
        measurements.push(qpl);
    }
    Calibration {
        measurements,
        deflate_through_qpl: through_qpl,
    }
}

/// `count` pages spread evenly over guest memory.
pub(crate) fn sample_pages(regions: &[MemoryRegion], count: usize) -> Vec<[u8; PAGE_SIZE]> {
    let samples = count as u64;
    let total: u64 = regions.iter().map(MemoryRegion::pages).sum();
    let mut sample = Vec::with_capacity(count);
    for index in 0..samples {
        let mut global = index * total.max(1) / samples;
        for region in regions {
            if global < region.pages() {
                if let Some(ptr) = region.page_ptr(global) {
                    let mut page = [0u8; PAGE_SIZE];
                    // SAFETY: a whole page inside the region's mapping; the
                    // guest may write it meanwhile, which only makes the
                    // sample a little stale.
                    unsafe { std::ptr::copy_nonoverlapping(ptr, page.as_mut_ptr(), PAGE_SIZE) };
                    sample.push(page);
                }
                break;
            }
            global -= region.pages();
        }
    }
    sample
}

impl Pipeline<'_> {
    /// Adaptive compression: every [`AUTO_DECISION_INTERVAL`], picks
    /// the codec that moves guest memory fastest over the link as measured.
    pub(super) fn maybe_switch_codec(&mut self) {
        let Some(auto) = self.auto.as_mut() else {
            return;
        };
        auto.batches_since += 1;
        if auto.batches_since < AUTO_DECISION_BATCHES
            || auto.window_started.elapsed() < AUTO_DECISION_INTERVAL
        {
            return;
        }
        let elapsed = auto.window_started.elapsed().as_secs_f64().max(1e-6);
        let wire = self.shared.stats.transferred.load(Ordering::Relaxed);
        let busy = self.shared.sender_busy_ns.load(Ordering::Relaxed);
        let wire_rate = (wire - auto.wire_at_start) as f64 / elapsed;
        // The share of time the senders were busy: near 1 the link is the
        // bottleneck and the wire rate is its capacity; lower, the link
        // could carry proportionally more.
        let busy_share =
            ((busy - auto.busy_at_start) as f64 / 1e9 / (elapsed * self.channel_count as f64))
                .clamp(0.05, 1.0);
        let measured = self.measure_window();
        let Some(auto) = self.auto.as_mut() else {
            return;
        };
        let link = auto.links.push(wire_rate / busy_share);
        let Some(link) = link else {
            auto.start_window(current_counters(&self.codec_stats, self.codec), wire, busy);
            return;
        };
        let decision = auto.selector.next(link, &auto.measurements);
        if decision.codec != self.codec {
            auto.switches += 1;
            tracing::info!(
                from = self.codec.name(),
                to = decision.codec.name(),
                link_mb_s = link / 1e6,
                "adaptive compression switches codec"
            );
            self.codec = decision.codec;
            auto.level = self.shared.compression.level_for(decision.codec);
        } else if let Some(measured) = measured {
            let workers = self.shared.worker_rings.len();
            let level = tern_page::codec::tune_level(&measured, link, workers);
            if level != auto.level {
                auto.level_changes += 1;
                tracing::info!(
                    codec = self.codec.name(),
                    from = auto.level,
                    to = level,
                    link_mb_s = link / 1e6,
                    "adaptive compression changes level"
                );
                auto.level = level;
            }
        }
        auto.start_window(current_counters(&self.codec_stats, self.codec), wire, busy);
    }
}

impl Pipeline<'_> {
    /// The current codec as measured over the decision window (its
    /// counters since the window started, at the window's level), recorded
    /// among auto's measurements.
    fn measure_window(&mut self) -> Option<tern_page::codec::CodecMeasurement> {
        let auto = self.auto.as_mut()?;
        if self.codec == CodecId::None {
            return None;
        }
        let now = current_counters(&self.codec_stats, self.codec);
        let window = data_the_codec_ran_on(&counters_since(&now, &auto.counters_at_start))?;
        let measured =
            tern_page::codec::CodecMeasurement::from_counters(self.codec, auto.level, &window)?;
        auto.measurements.retain(|known| known.codec != self.codec);
        auto.measurements.push(measured);
        Some(measured)
    }

    /// The level the next batch is compressed at.
    pub(super) fn batch_level(&self) -> i32 {
        match &self.auto {
            Some(auto) => auto.level,
            None => self.shared.compression.level_for(self.codec),
        }
    }
}

/// The counters of the implementation that produces `codec`.
fn current_counters(stats: &CodecStats, codec: CodecId) -> CodecCounters {
    stats
        .used()
        .find(|(which, _)| which.wire() == codec)
        .map(|(_, counters)| *counters)
        .unwrap_or_default()
}

/// The counters without the pages sampling sent raw: those cost every codec
/// the same (nothing), so a window of random pages says nothing about the
/// codec and must not replace what is known of it (a run of random pages
/// would otherwise make the codec look useless for the rest of the
/// migration). `None` when the codec ran on no page.
pub(super) fn data_the_codec_ran_on(window: &CodecCounters) -> Option<CodecCounters> {
    let skipped_bytes = window.skipped_by_sampling * PAGE_SIZE as u64;
    let pages = window.pages.checked_sub(window.skipped_by_sampling)?;
    (pages > 0).then(|| CodecCounters {
        pages,
        skipped_by_sampling: 0,
        bytes_in: window.bytes_in.saturating_sub(skipped_bytes),
        bytes_out: window.bytes_out.saturating_sub(skipped_bytes),
        ..*window
    })
}

/// What was counted between `start` and `now` (the CPU rate and ratio of
/// a window, not of the whole migration).
fn counters_since(now: &CodecCounters, start: &CodecCounters) -> CodecCounters {
    CodecCounters {
        pages: now.pages.saturating_sub(start.pages),
        compressed: now.compressed.saturating_sub(start.compressed),
        raw_fallbacks: now.raw_fallbacks.saturating_sub(start.raw_fallbacks),
        skipped_by_sampling: now
            .skipped_by_sampling
            .saturating_sub(start.skipped_by_sampling),
        offload_fallbacks: now
            .offload_fallbacks
            .saturating_sub(start.offload_fallbacks),
        bytes_in: now.bytes_in.saturating_sub(start.bytes_in),
        bytes_out: now.bytes_out.saturating_sub(start.bytes_out),
        cpu_ns: now.cpu_ns.saturating_sub(start.cpu_ns),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tern_page::codec::CodecMeasurement;

    fn measured(codec: CodecId, rate: f64, ratio: f64) -> CodecMeasurement {
        CodecMeasurement {
            codec,
            level: 1,
            compress_bytes_per_sec: rate,
            decompress_bytes_per_sec: None,
            ratio,
        }
    }

    fn software() -> Vec<CodecMeasurement> {
        vec![
            measured(CodecId::Zstd, 170e6, 2.1),
            measured(CodecId::Deflate, 150e6, 2.0),
            measured(CodecId::Lz4, 320e6, 1.4),
        ]
    }

    #[test]
    fn without_qpl_the_software_candidates_stand() {
        let calibration = with_qpl_candidate(software(), None);
        assert!(!calibration.deflate_through_qpl);
        assert_eq!(calibration.measurements, software());
    }

    #[test]
    fn a_faster_qpl_takes_deflate_s_place_and_the_workers_follow() {
        // A stand-in for IAA's numbers: ten times libdeflate's rate.
        let iaa = measured(CodecId::Deflate, 1.5e9, 1.95);
        let calibration = with_qpl_candidate(software(), Some(iaa));
        assert!(calibration.deflate_through_qpl);
        let deflates: Vec<_> = calibration
            .measurements
            .iter()
            .filter(|m| m.codec == CodecId::Deflate)
            .collect();
        assert_eq!(deflates, [&iaa]);
        // At 200 MB/s with two workers libdeflate (2 × 150 MB/s) loses to
        // zstd, while QPL's deflate is link-bound at 390 MB/s and wins.
        let decide = |measurements: &[CodecMeasurement]| {
            tern_page::AutoSelector::new(2)
                .next(200e6, measurements)
                .codec
        };
        assert_eq!(decide(&software()), CodecId::Zstd);
        assert_eq!(decide(&calibration.measurements), CodecId::Deflate);
        let setup = CompressionSetup {
            choice: CodecChoice::Auto,
            level: None,
            qpl_path: QplPath::Software,
            deflate_through_qpl: calibration.deflate_through_qpl,
            packet_frames: false,
            dictionary: None,
            dictionary_report: None,
            dictionary_refresh: None,
        };
        // Without libqpl here the QPL compressor cannot be made: the error
        // shows the setup asked for it.
        if tern_page::codec::qpl_available().is_err() {
            assert!(setup.compressor(CodecId::Deflate).is_err());
            assert!(setup.compressor(CodecId::Zstd).is_ok());
        }
    }

    #[test]
    fn a_window_of_pages_sampling_sent_raw_measures_nothing() {
        let random = CodecCounters {
            pages: 128,
            skipped_by_sampling: 128,
            bytes_in: 128 * 4096,
            bytes_out: 128 * 4096,
            cpu_ns: 1000,
            ..CodecCounters::default()
        };
        assert_eq!(data_the_codec_ran_on(&random), None);
        let mixed = CodecCounters {
            pages: 4,
            compressed: 2,
            skipped_by_sampling: 2,
            bytes_in: 4 * 4096,
            bytes_out: 2 * 4096 + 1000,
            cpu_ns: 1000,
            ..CodecCounters::default()
        };
        let ran = data_the_codec_ran_on(&mixed).unwrap();
        assert_eq!(
            (ran.pages, ran.bytes_in, ran.bytes_out),
            (2, 2 * 4096, 1000)
        );
        assert!((ran.ratio() - 8.192).abs() < 1e-9);
    }

    #[test]
    fn auto_starts_with_the_best_ratio_unless_the_link_is_known_to_be_fast() {
        let setup = CompressionSetup {
            choice: CodecChoice::Auto,
            level: None,
            qpl_path: QplPath::Software,
            deflate_through_qpl: false,
            packet_frames: false,
            dictionary: None,
            dictionary_report: None,
            dictionary_refresh: None,
        };
        let mut candidates = software();
        candidates.push(measured(CodecId::ZstdPacket, 150e6, 2.3));
        let start = |max_bandwidth| {
            AutoCodec::start(2, candidates.clone(), max_bandwidth, &setup)
                .selector
                .current()
        };
        assert_eq!(start(None), CodecId::ZstdPacket);
        // 10 Gbit/s with two workers: no codec keeps up.
        assert_eq!(start(Some(1_250_000_000)), CodecId::None);
        // Without calibration there is nothing to choose from.
        let unknown = AutoCodec::start(2, Vec::new(), None, &setup);
        assert_eq!(unknown.selector.current(), CodecId::None);
    }

    #[test]
    fn one_window_s_wild_link_estimate_does_not_move_the_decision() {
        let mut links = LinkEstimates::default();
        // The first windows only measure.
        assert_eq!(links.push(1009e6), None);
        assert_eq!(links.push(142e6), None);
        // Then the median of what is kept: the outliers of a 1 Gbit/s link
        // measured in one migration (socket buffers filling, a window of
        // zero pages) do not show.
        assert_eq!(links.push(120e6), Some(142e6));
        assert_eq!(links.push(3631e6), Some(142e6));
        assert_eq!(links.push(26e6), Some(142e6));
        assert_eq!(links.push(118e6), Some(120e6));
        // A link that really changed wins after three windows.
        assert_eq!(links.push(1200e6), Some(120e6));
        assert_eq!(links.push(1180e6), Some(1180e6));
    }

    #[test]
    fn a_slower_qpl_is_left_out() {
        let qpl_software_path = measured(CodecId::Deflate, 90e6, 2.0);
        let calibration = with_qpl_candidate(software(), Some(qpl_software_path));
        assert!(!calibration.deflate_through_qpl);
        assert_eq!(calibration.measurements, software());
    }
}

//! Which codec a batch uses: the configured one, or `auto`, which
//! re-decides from the link rate and the codecs' measured speed and ratio.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tern_page::PageCompressor;
use tern_page::codec::{CodecChoice, CodecCounters, CodecId, CodecStats, QplPath};

use super::delta_cache::DeltaCache;
use super::rate::{
    LinkQueue, LinkWindow, QueueSamples, link_estimate, link_measured, written_rate,
};
use super::{Pipeline, delta_cache};
use crate::bitmap::DirtyBitmap;
use crate::guest::{MemoryRegion, PAGE_SIZE};

/// What compressing pages costs at the codec and level in force: the
/// workers' guest bytes per second together, each at its measured speed
/// per CPU second times the share of a CPU the workers got over the last
/// pass (`cpu_share.rs`), and the ratio, as last measured (with `auto`, at
/// the level it will use for the last pages).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CodecCost {
    pub guest_bytes_per_sec: f64,
    pub ratio: f64,
}

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
    /// zstd as one stream per channel ([`CodecId::ZstdStream`]).
    pub stream_frames: bool,
    /// The session's zstd dictionary, once trained (see `dictionary.rs`).
    pub dictionary: Option<tern_page::codec::CodecDictionary>,
    /// How the dictionary was trained, for the statistics.
    pub dictionary_report: Option<crate::stats::DictionaryReport>,
    /// How it is refreshed during the live phase, and its size; `None`
    /// without a dictionary.
    pub dictionary_refresh: Option<(crate::config::DictionaryRefresh, usize)>,
    /// What `auto` decided at setup (the dictionary), for its report.
    pub auto_decisions: Vec<crate::stats::AutoDecisionReport>,
}

impl CompressionSetup {
    /// Codecs the session may use (announced in the hello as a bitmask).
    pub(crate) fn codecs(&self) -> Vec<CodecId> {
        match self.choice.wire() {
            Some(CodecId::None) => Vec::new(),
            Some(CodecId::Zstd) if self.packet_frames => vec![CodecId::ZstdPacket],
            // The stream first (what the workers use); per-page zstd for
            // postcopy's push, whose packets go on no channel stream.
            Some(CodecId::Zstd) if self.stream_frames => vec![CodecId::ZstdStream, CodecId::Zstd],
            Some(codec) => vec![codec],
            // auto: the codecs this build has (see tern-page's features);
            // for whole packets, packet frames (its start) and a stream per
            // channel, whose window covers a packet frame's and more
            // (docs/compression.md, "A stream per channel").
            None => [
                CodecId::Zstd,
                CodecId::Deflate,
                CodecId::Lz4,
                CodecId::ZstdPacket,
                CodecId::ZstdStream,
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
    /// The link's queue as the senders sampled it when the window started.
    pub(super) queue_at_start: QueueSamples,
    /// The codec in force, with hysteresis.
    pub(super) codec_choice: tern_page::codec::SteadyChoice<CodecId>,
    /// The level in force for the current codec, tuned while it is kept,
    /// with hysteresis.
    pub(super) level_choice: tern_page::codec::SteadyChoice<i32>,
    /// The current codec's counters when the window started: the window's
    /// measurement is the difference, at the window's level.
    pub(super) counters_at_start: CodecCounters,
    /// The link estimates of the last windows.
    pub(super) links: LinkEstimates,
    /// Whether the guest's pages changed character (renews the switches).
    pub(super) content: tern_page::codec::ContentWatch,
    /// The decisions so far, with their reasons, for the statistics.
    pub(super) report: crate::stats::AutoReport,
    /// Data-page bytes per second each codec moved while in force.
    pub(super) achieved: AchievedRates,
    /// Data-page bytes completed when the window started.
    pub(super) data_at_start: u64,
}

/// A codec (or level) must win this many decision windows in a row to take
/// over: at 50 ms a window, 150 ms of evidence rather than one window's
/// noise.
pub(super) const CONFIRM_WINDOWS: u32 = 3;
/// One window's measurement of the shaped 1 Gbit/s link read 76-196 MB/s
/// (issue 31): a guess is corrected on one window only where the
/// correction would hold on a link this many times as fast.
pub(super) const GUESS_CORRECTION_NOISE: f64 = 2.0;
/// Codec switches allowed until the content changes.
pub(super) const CODEC_SWITCH_BUDGET: u32 = 3;
/// Level changes allowed per codec until the content changes.
pub(super) const LEVEL_CHANGE_BUDGET: u32 = 4;
/// Another codec must move this much more guest memory per second than the
/// one in force to be proposed (above the noise of a loaded machine's
/// measurements).
pub(crate) const SWITCH_MARGIN: f64 = 0.15;

/// What a codec decision rests on, for its hysteresis and its reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Evidence {
    /// The first reading of the migration: it replaces calibration's
    /// guess at once.
    FirstReading { measured: bool },
    /// The first window to measure the link after a decision on a bound
    /// ([`LinkReading::correction`]), decisively: taken at once.
    CorrectsGuess,
    /// Anything else: [`CONFIRM_WINDOWS`] in a row.
    Confirmed,
}

/// What one decision window changed, and the link rate it decided on (a
/// guess's correction where one was taken, else the reading's median).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct WindowOutcome {
    pub codec: Option<CodecId>,
    pub level: Option<i32>,
    pub link: f64,
}

impl AutoCodec {
    /// The codec in force.
    pub(super) fn codec(&self) -> CodecId {
        self.codec_choice.current()
    }

    /// The level in force.
    pub(super) fn level(&self) -> i32 {
        self.level_choice.current()
    }

    /// One decision window, pure apart from `self`: the codec and level for
    /// the next batches from the link's `reading` ([`Self::weigh`]) and the
    /// current codec's measurement over the window (`measured`, at the
    /// window's level), with `workers` compressing; `at_ms` stamps the
    /// recorded decisions. `level_for` is the level a newly chosen codec
    /// starts at.
    pub(super) fn decide(
        &mut self,
        reading: LinkReading,
        measured: Option<tern_page::codec::CodecMeasurement>,
        workers: usize,
        at_ms: u64,
        level_for: impl Fn(CodecId) -> i32,
    ) -> WindowOutcome {
        let first_reading = self.report.link_rate == 0;
        let (link, evidence) = self.weigh(reading, first_reading, workers);
        self.report.link_rate = crate::numeric::saturating_u64_from_f64(link);
        if let Some(measured) = measured {
            self.watch_content(&measured, at_ms);
        }
        let current = self.codec();
        let proposed = self.propose(link, workers);
        let mut outcome = WindowOutcome {
            link,
            ..WindowOutcome::default()
        };
        let (verdict, beyond_budget) = self.codec_verdict(current, proposed.codec, evidence);
        match verdict {
            tern_page::codec::Steadiness::Switched { from } => {
                let level = level_for(proposed.codec);
                self.level_choice = tern_page::codec::SteadyChoice::new(
                    level,
                    CONFIRM_WINDOWS,
                    LEVEL_CHANGE_BUDGET,
                );
                self.content.reset();
                self.report.codec_switches += 1;
                let mut reason = self.codec_reason(from, proposed, link, workers, evidence);
                if beyond_budget {
                    reason.push_str(
                        " (beyond the switches allowed: raw's windows measure the link, and \
                         raw is not held on a link a codec beats)",
                    );
                }
                self.note(at_ms, "codec", proposed.codec.name().to_string(), reason);
                outcome.codec = Some(proposed.codec);
                outcome.level = Some(level);
                return outcome;
            }
            tern_page::codec::Steadiness::OverBudget => {
                self.report.switches_held += 1;
                tracing::debug!(
                    kept = current.name(),
                    proposed = proposed.codec.name(),
                    "adaptive compression keeps its codec: the switches allowed are spent"
                );
            }
            tern_page::codec::Steadiness::Kept | tern_page::codec::Steadiness::Waiting(_) => {}
        }
        if let Some(measured) = measured.filter(|m| m.codec == current) {
            outcome.level = self.decide_level(&measured, link, workers, at_ms);
        }
        outcome
    }

    /// The codec to propose on a `link` (bytes per second): the model's
    /// choice, unless what the codecs achieved says otherwise.
    fn propose(&self, link: f64, workers: usize) -> tern_page::codec::AutoDecision {
        let current = self.codec();
        self.achieved.unless_achieved_less(
            current,
            tern_page::codec::choose_codec(link, workers, &self.deciding(), current, SWITCH_MARGIN),
        )
    }

    /// The codecs a decision on a measured link weighs: all measured, but
    /// packet frames where a channel stream is measured
    /// ([`without_packet_frames_beside_a_stream`]); packet frames are only
    /// the start's stand-in for it ([`start_candidates`]).
    fn deciding(&self) -> Vec<tern_page::codec::CodecMeasurement> {
        without_packet_frames_beside_a_stream(&self.measurements)
    }

    /// The link rate to decide on and what it rests on. A correction of a
    /// guess ([`LinkReading::correction`]) is taken, and the guess's bounds
    /// forgotten, only when it is decisive: it changes the codec, and the
    /// codec it proposes would win on a link [`GUESS_CORRECTION_NOISE`]
    /// times as fast too, since it rests on one window. On loopback one
    /// raw window read 629-1264 MB/s after a guess of 3171-7081, and lz4,
    /// 18-48 % ahead of raw there by the model, took over and held the run
    /// at 0.81-1.25 s against 0.55-0.72. Otherwise the median decides, the
    /// bounds in it, as before.
    fn weigh(
        &mut self,
        reading: LinkReading,
        first_reading: bool,
        workers: usize,
    ) -> (f64, Evidence) {
        if first_reading {
            let measured = reading.measured;
            return (reading.rate, Evidence::FirstReading { measured });
        }
        if let Some(rate) = reading.correction {
            let current = self.codec();
            let corrected = self.propose(rate, workers).codec;
            let on_a_faster_link = tern_page::codec::choose_codec(
                rate * GUESS_CORRECTION_NOISE,
                workers,
                &self.deciding(),
                current,
                SWITCH_MARGIN,
            );
            if corrected != current && on_a_faster_link.codec == corrected {
                self.links.forget_bounds();
                return (rate, Evidence::CorrectsGuess);
            }
        }
        (reading.rate, Evidence::Confirmed)
    }

    /// What the codec's hysteresis makes of `proposed` against `current`,
    /// and whether it takes over beyond the switches allowed.
    fn codec_verdict(
        &mut self,
        current: CodecId,
        proposed: CodecId,
        evidence: Evidence,
    ) -> (tern_page::codec::Steadiness<CodecId>, bool) {
        // The codec in force before the first reading is a guess
        // (calibration's, for a link of unknown speed), and so is one
        // chosen on a bound of the link: the first reading, and the first
        // measurement after a guess, replace it at once.
        if evidence != Evidence::Confirmed {
            return (self.settle_codec(proposed), false);
        }
        let verdict = self.codec_choice.offer(proposed);
        // Raw is not held by the spent budget. A raw window's estimate can
        // only overstate the link (what left the sockets where the link
        // pushed back, else what the busy share allows), so a codec it
        // proposes is measured, not noise. Issue 31: a postcopy run spent
        // its three switches on misread windows (the last to raw on a
        // 1889 MB/s reading of the shaped 1 Gbit/s link) and sent raw for
        // 47 s, 212 confirmed proposals held; under raw no ratio is
        // measured, so the content watch could never renew the budget.
        if matches!(verdict, tern_page::codec::Steadiness::OverBudget)
            && current == CodecId::None
            && proposed != CodecId::None
        {
            return (self.settle_codec(proposed), true);
        }
        (verdict, false)
    }

    /// Puts `proposed` in force past the hysteresis: switched from the
    /// codec before, or kept when it was already in force.
    fn settle_codec(&mut self, proposed: CodecId) -> tern_page::codec::Steadiness<CodecId> {
        self.codec_choice
            .settle(proposed)
            .map_or(tern_page::codec::Steadiness::Kept, |from| {
                tern_page::codec::Steadiness::Switched { from }
            })
    }

    /// The level for the codec in force, measured as `measured` over the
    /// window: [`tern_page::codec::tune_level`] through hysteresis. The new
    /// level, when it changed.
    fn decide_level(
        &mut self,
        measured: &tern_page::codec::CodecMeasurement,
        link: f64,
        workers: usize,
        at_ms: u64,
    ) -> Option<i32> {
        let current = measured.codec;
        let level = tern_page::codec::tune_level(measured, link, workers);
        match self.level_choice.offer(level) {
            tern_page::codec::Steadiness::Switched { from } => {
                self.content.reset();
                self.report.level_changes += 1;
                let cpu = measured.compress_bytes_per_sec * workers.max(1) as f64;
                let carried = link * measured.ratio.max(1.0);
                let why = if level > from {
                    "the link is the bottleneck and the workers compress at least twice what it \
                     carries: a better ratio costs no time"
                } else {
                    "the workers cannot keep up with the link"
                };
                self.note(
                    at_ms,
                    "level",
                    level.to_string(),
                    format!(
                        "{} {from} -> {level}: {why} (workers {:.0} MB/s, link carries {:.0} MB/s \
                         of guest memory at ratio {:.2})",
                        current.name(),
                        cpu / 1e6,
                        carried / 1e6,
                        measured.ratio
                    ),
                );
                Some(level)
            }
            tern_page::codec::Steadiness::OverBudget => {
                self.report.switches_held += 1;
                None
            }
            tern_page::codec::Steadiness::Kept | tern_page::codec::Steadiness::Waiting(_) => None,
        }
    }

    /// Renews the switches allowed when the window's ratio shows the
    /// guest's content changed ([`tern_page::codec::ContentWatch`]).
    fn watch_content(&mut self, measured: &tern_page::codec::CodecMeasurement, at_ms: u64) {
        if !self.content.observe(measured.ratio) {
            return;
        }
        self.codec_choice.content_changed();
        self.level_choice.content_changed();
        self.report.content_changes += 1;
        self.note(
            at_ms,
            "content",
            measured.codec.name().to_string(),
            format!(
                "the ratio of {} moved by more than {:.0} % for {} windows (now {:.2}): the \
                 switches allowed are renewed",
                measured.codec.name(),
                tern_page::codec::ContentWatch::CHANGE * 100.0,
                tern_page::codec::ContentWatch::WINDOWS,
                measured.ratio
            ),
        );
    }

    /// Why `proposed` replaced `from`, in numbers.
    fn codec_reason(
        &self,
        from: CodecId,
        proposed: tern_page::codec::AutoDecision,
        link: f64,
        workers: usize,
        evidence: Evidence,
    ) -> String {
        let rate_of = |codec: CodecId| {
            if codec == CodecId::None {
                return link;
            }
            self.measurements
                .iter()
                .find(|m| m.codec == codec)
                .map_or(0.0, |m| m.effective_rate(link, workers))
        };
        if link >= super::rate::PEER_BOUND_LINK_RATE {
            return format!(
                "the peer, not the link, set the pace (the channels waited for its receive \
                 window at least half of their busy time): a codec would only add to its \
                 work; {} replaces {}",
                proposed.codec.name(),
                from.name()
            );
        }
        let evidence = match evidence {
            Evidence::FirstReading { measured: true } => {
                "the first decision on the measured link".to_string()
            }
            Evidence::FirstReading { measured: false } => {
                "the first decision, on a link that has not pushed back yet: its rate is an \
                 upper bound (the senders' busy share), a guess the first window that measures \
                 the link corrects"
                    .to_string()
            }
            Evidence::CorrectsGuess => {
                "the first window that measured the link after a decision on an upper bound of \
                 it: the guess is corrected at once"
                    .to_string()
            }
            Evidence::Confirmed => format!("{CONFIRM_WINDOWS} windows in a row"),
        };
        format!(
            "{} moves {:.0} MB/s of guest memory against {:.0} MB/s for {} on a {:.0} MB/s link \
             with {workers} workers, {evidence}",
            proposed.codec.name(),
            proposed.effective_bytes_per_sec / 1e6,
            rate_of(from) / 1e6,
            from.name(),
            link / 1e6,
        )
    }

    /// Records a decision and logs it.
    pub(super) fn note(&mut self, at_ms: u64, subject: &str, choice: String, reason: String) {
        tracing::info!(subject, choice, reason, "auto decides");
        self.report.record(crate::stats::AutoDecisionReport {
            at_ms,
            subject: subject.to_string(),
            choice,
            reason,
        });
    }
}

/// What the migration achieved with each codec: data-page bytes per
/// second in the last [`AchievedRates::KEPT`] windows it was in force with
/// at least [`MEASURED_WINDOW_PAGES`] data pages. The model behind
/// `choose_codec` gives the workers cores of their own; where they share
/// them with the senders and the peer (loopback on a 2-core machine), a
/// codec predicted faster than raw moved less (issue 31: raw, lz4 and
/// zstd in turn within one loopback run). What was achieved overrules
/// the prediction.
#[derive(Debug, Default)]
pub(super) struct AchievedRates {
    /// Per codec, its last windows: (window number, rate).
    rates: Vec<(CodecId, std::collections::VecDeque<(u64, f64)>)>,
    /// Decision windows so far.
    window: u64,
}

impl AchievedRates {
    /// Windows kept per codec.
    pub(super) const KEPT: usize = 5;
    /// Windows a codec needs before its rate counts.
    pub(super) const NEEDED: usize = 2;
    /// Only windows this recent count (about a second): a codec refused
    /// on what it achieved is proposed again once that is stale, so an
    /// unlucky start (a loaded machine, the first windows) cannot keep
    /// raw on a slow link for the rest of the migration.
    pub(super) const FRESH_WINDOWS: u64 = 20;

    /// A decision window ended.
    pub(super) fn tick(&mut self) {
        self.window += 1;
    }

    /// Records a window of `codec` that moved `rate` data-page bytes per
    /// second.
    pub(super) fn record(&mut self, codec: CodecId, rate: f64) {
        let index = match self.rates.iter().position(|(known, _)| *known == codec) {
            Some(index) => index,
            None => {
                self.rates.push((codec, std::collections::VecDeque::new()));
                self.rates.len() - 1
            }
        };
        let recent = &mut self.rates[index].1;
        if recent.len() == Self::KEPT {
            recent.pop_front();
        }
        recent.push_back((self.window, rate));
    }

    /// The median of `codec`'s windows, once [`Self::NEEDED`] are in.
    pub(super) fn median(&self, codec: CodecId) -> Option<f64> {
        let recent = &self.rates.iter().find(|(known, _)| *known == codec)?.1;
        let mut sorted: Vec<f64> = recent
            .iter()
            .filter(|(window, _)| self.window.saturating_sub(*window) <= Self::FRESH_WINDOWS)
            .map(|&(_, rate)| rate)
            .collect();
        if sorted.len() < Self::NEEDED {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        Some(sorted[sorted.len() / 2])
    }

    /// `proposed`, unless both it and `current` were in force long enough
    /// to measure and `proposed` did not move [`SWITCH_MARGIN`] more
    /// data-page bytes per second: then `current` stays. A codec never
    /// tried is proposed as the model says (bounded by the switch
    /// budget). Pure.
    pub(super) fn unless_achieved_less(
        &self,
        current: CodecId,
        proposed: tern_page::codec::AutoDecision,
    ) -> tern_page::codec::AutoDecision {
        let mut decision = proposed;
        if let (Some(now), Some(then)) = (self.median(current), self.median(proposed.codec))
            && proposed.codec != current
            && then <= now * (1.0 + SWITCH_MARGIN)
        {
            decision.codec = current;
            decision.effective_bytes_per_sec = now;
        }
        decision
    }
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
///
/// Once the link has pushed back, a window that did not, and wrote no more
/// than that measured rate, gives no estimate at all: the link was not
/// loaded, so nothing says how much more it could carry. Its busy-share
/// estimate is then the written rate times up to 20 (the share's floor),
/// which is what, by its figure, made auto leave zstd for lz4 at 2.5 s on
/// the shaped 1 Gbit/s link in series J2 (rep 0: it decided on a 1268 MB/s
/// link, 20 times 63 MB/s, after windows that had measured 101 MB/s; lz4
/// for 1.4 s, the run 6.06 s against the series' median 4.40).
#[derive(Debug, Default)]
pub(super) struct LinkEstimates {
    /// The last windows' estimates, each with whether its window measured
    /// the link (pushed back) or only bounded it from above.
    recent: std::collections::VecDeque<(f64, bool)>,
    /// A rate was given from a bound: the decision on it was a guess,
    /// which the next window that measures the link corrects.
    guessed: bool,
    /// The windows of the last [`Self::MEASURED_FRESH_WINDOWS`] in which
    /// the link pushed back: each one's number and the rate it measured.
    measured: std::collections::VecDeque<(u64, f64)>,
    /// Windows seen so far.
    windows: u64,
}

impl LinkEstimates {
    /// Windows the median is taken over.
    pub(super) const KEPT: usize = 5;
    /// Windows measured before the first decision.
    pub(super) const NEEDED: usize = 3;
    /// A measured rate stands this many windows (about a second at
    /// [`AUTO_DECISION_INTERVAL`]): on a link that has stopped pushing back
    /// for that long, the link is not what limits, and windows count again
    /// as before it was measured.
    pub(super) const MEASURED_FRESH_WINDOWS: u64 = 20;

    /// Reads one window: the rate to decide on, as [`Self::push`], or
    /// `None` also when the window did not load a link measured before.
    ///
    /// "Measured before" is the highest rate of the fresh measured windows:
    /// single measurements of the shaped 1 Gbit/s link read 76-196 MB/s in
    /// one run (tbf's burst, the queue read a packet apart), and against
    /// the last one alone a window writing 90 MB/s after one reading 80
    /// would count, at 20 times its rate.
    ///
    /// A window that measures the link after a rate was given from a bound
    /// carries its own estimate as [`LinkReading::correction`]: the bound
    /// made a guess, which one measurement may correct at once where
    /// three windows more of it cost 10 MiB of raw pages at 1 Gbit/s
    /// (issue 31, item 2); whether it does is the decision's
    /// ([`AutoCodec::weigh`]).
    pub(super) fn push_window(&mut self, window: &LinkWindow) -> Option<LinkReading> {
        self.windows += 1;
        let estimate = link_estimate(window);
        let now = self.windows;
        self.measured
            .retain(|&(at, _)| now - at <= Self::MEASURED_FRESH_WINDOWS);
        let carried = self.measured.iter().map(|&(_, rate)| rate).reduce(f64::max);
        let (measured, written) = (link_measured(window), written_rate(window));
        tracing::trace!(
            estimate,
            written,
            busy_share = window.busy_share,
            measured,
            carried,
            raw = window.raw,
            "auto: link window"
        );
        let mut correction = None;
        if measured {
            self.measured.push_back((now, estimate));
            if std::mem::take(&mut self.guessed) {
                correction = Some(estimate);
            }
        } else if carried.is_some_and(|carried| written <= carried) {
            tracing::trace!("auto: a window that did not load the link measures nothing");
            return None;
        }
        self.push_estimate(estimate, measured)
            .map(|reading| LinkReading {
                correction,
                ..reading
            })
    }

    /// Forgets the estimates of windows that did not measure the link: a
    /// measurement corrected the guess they made.
    pub(super) fn forget_bounds(&mut self) {
        self.recent.retain(|&(_, measured)| measured);
    }

    /// Adds a window's estimate; the rate to decide on, once enough are in.
    #[cfg(test)]
    pub(super) fn push(&mut self, estimate: f64) -> Option<f64> {
        self.push_estimate(estimate, true)
            .map(|reading| reading.rate)
    }

    /// Adds a window's estimate, `measured` or a bound; the reading to
    /// decide on, once enough are in.
    fn push_estimate(&mut self, estimate: f64, measured: bool) -> Option<LinkReading> {
        if self.recent.len() == Self::KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back((estimate, measured));
        if self.recent.len() < Self::NEEDED {
            return None;
        }
        let mut sorted: Vec<(f64, bool)> = self.recent.iter().copied().collect();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        // The lower median: in doubt, the slower link, on which a codec
        // costs least if wrong (raw on a slow link costs most).
        let (rate, measured) = sorted[(sorted.len() - 1) / 2];
        self.guessed |= !measured;
        Some(LinkReading {
            rate,
            measured,
            correction: None,
        })
    }
}

/// The link rate one decision is taken on, and what it rests on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct LinkReading {
    /// The (lower) median of the kept windows, bytes per second.
    pub rate: f64,
    /// The window the rate is from measured the link (pushed back);
    /// otherwise the rate is an upper bound (the senders' busy share of a
    /// window in which sends returned at once), and a decision on it a
    /// guess.
    pub measured: bool,
    /// The first window to measure the link after a guess: its own
    /// estimate, bytes per second.
    pub correction: Option<f64>,
}

impl LinkReading {
    /// A reading of windows that measured the link.
    #[cfg(test)]
    pub(super) fn measured(rate: f64) -> Self {
        Self {
            rate,
            measured: true,
            correction: None,
        }
    }
}

impl AutoCodec {
    /// Starts the next decision window.
    fn start_window(&mut self, counters: CodecCounters, wire: u64, busy: u64, queue: QueueSamples) {
        self.counters_at_start = counters;
        self.batches_since = 0;
        self.window_started = Instant::now();
        self.wire_at_start = wire;
        self.busy_at_start = busy;
        self.queue_at_start = queue;
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
        let first = selector.next(link, &start_candidates(&measurements, max_bandwidth));
        let mut report = crate::stats::AutoReport::default();
        for decision in &compression.auto_decisions {
            report.record(decision.clone());
        }
        let mut auto = Self {
            selector,
            measurements,
            batches_since: 0,
            window_started: Instant::now(),
            wire_at_start: 0,
            busy_at_start: 0,
            queue_at_start: QueueSamples::default(),
            codec_choice: tern_page::codec::SteadyChoice::new(
                first.codec,
                CONFIRM_WINDOWS,
                CODEC_SWITCH_BUDGET,
            ),
            level_choice: tern_page::codec::SteadyChoice::new(
                compression.level_for(first.codec),
                CONFIRM_WINDOWS,
                LEVEL_CHANGE_BUDGET,
            ),
            counters_at_start: CodecCounters::default(),
            links: LinkEstimates::default(),
            content: tern_page::codec::ContentWatch::default(),
            report,
            achieved: AchievedRates::default(),
            data_at_start: 0,
        };
        let reason = match max_bandwidth {
            _ if auto.measurements.is_empty() => "calibration measured no codec".to_string(),
            Some(rate) => format!(
                "calibration on {CALIBRATION_PAGES} sampled pages: it moves {:.0} MB/s of guest \
                 memory on the configured {:.0} MB/s link with {workers} workers",
                first.effective_bytes_per_sec / 1e6,
                rate as f64 / 1e6
            ),
            None => format!(
                "calibration on {CALIBRATION_PAGES} sampled pages: the best ratio worth its \
                 CPU until the link is measured (no max-bandwidth configured)"
            ),
        };
        auto.note(0, "codec", first.codec.name().to_string(), reason);
        auto
    }
}

/// The codecs auto may start with: all, on a configured link; on a link
/// still to be measured, none of the channel streams (packet frames stand
/// in for them until the first decision, [`AutoCodec::deciding`]). A stream's packets
/// are decoded by their receiver, which stops reading its socket
/// meanwhile, so a first window under a stream can measure the receivers
/// instead of the link, and a link that looks slow keeps the stream: on
/// loopback (issue 31, series `stream46-loopback`) 3 of 8 migrations that
/// started with one measured a 609-641 MB/s "link" and kept it to the
/// end, 0.48-0.53 s against 0.42 for those that measured 6-8 GB/s and
/// went raw. Packet frames, decoded by the pool, measure the link.
fn start_candidates(
    measurements: &[tern_page::codec::CodecMeasurement],
    max_bandwidth: Option<u64>,
) -> Vec<tern_page::codec::CodecMeasurement> {
    match max_bandwidth {
        Some(_) => without_packet_frames_beside_a_stream(measurements),
        None => measurements
            .iter()
            .filter(|measured| !measured.codec.is_stream())
            .copied()
            .collect(),
    }
}

/// `measurements` without packet frames when a channel stream is among
/// them: the stream finds what a packet frame finds and what its channel
/// sent before, at the same speed, which calibration's 64 scattered pages
/// (one packet's worth) cannot show.
fn without_packet_frames_beside_a_stream(
    measurements: &[tern_page::codec::CodecMeasurement],
) -> Vec<tern_page::codec::CodecMeasurement> {
    let stream = measurements
        .iter()
        .any(|measured| measured.codec.is_stream());
    measurements
        .iter()
        .filter(|measured| !(stream && measured.codec == CodecId::ZstdPacket))
        .copied()
        .collect()
}

/// A link rate (bytes per second) below any codec's speed: the selector
/// then ranks codecs by ratio alone.
const SLOWER_THAN_ANY_CODEC: f64 = 1.0;

/// Adaptive compression decides again after at least this many batches and
/// this much time: enough to measure the link, often enough to follow it.
pub(super) const AUTO_DECISION_BATCHES: u64 = 16;
pub(super) const AUTO_DECISION_INTERVAL: Duration = Duration::from_millis(50);

/// Fewer pages than this through the codec in a window measure nothing:
/// a window of a few pages (deltas and duplicates took the rest, or the
/// iteration was ending) gave rates of 27 MB/s for a codec calibrated at
/// 150 and ratios far from the codec's, which moved the codec and made
/// the content look changed (issue 31's bench runs).
pub(super) const MEASURED_WINDOW_PAGES: u64 = 256;

/// Pages calibration measures the codecs on.
pub(crate) const CALIBRATION_PAGES: usize = 64;

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
    let sample = calibration_sample(regions);
    let candidates = [
        (CodecId::Zstd, CodecId::Zstd.default_level()),
        (CodecId::Deflate, CodecId::Deflate.default_level()),
        (CodecId::Lz4, CodecId::Lz4.default_level()),
        (CodecId::ZstdPacket, CodecId::ZstdPacket.default_level()),
        (CodecId::ZstdStream, CodecId::ZstdStream.default_level()),
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

/// The pages calibration measures codecs on: [`CALIBRATION_PAGES`] spread
/// over guest memory away from the dictionary's training pages, without
/// zero pages. Zero pages never reach a codec (the workers find them
/// first), and counted in they made a codec look several times faster
/// than it runs: 765 MB/s a thread for zstd in packet frames on the bench
/// image, 230 measured in the migration, which made raw and zstd look
/// alike on loopback (issue 31).
pub(crate) fn calibration_sample(regions: &[MemoryRegion]) -> Vec<[u8; PAGE_SIZE]> {
    let mut sample = sample_pages_at(regions, CALIBRATION_PAGES * 4, untrained_offset(regions));
    sample.retain(|page| page.iter().any(|&byte| byte != 0));
    let step = (sample.len() / CALIBRATION_PAGES).max(1);
    sample
        .into_iter()
        .step_by(step)
        .take(CALIBRATION_PAGES)
        .collect()
}

/// How far from the dictionary's training sample calibration samples, so
/// that it judges a dictionary on pages it was not trained on: half the
/// training sample's stride.
pub(crate) fn untrained_offset(regions: &[MemoryRegion]) -> u64 {
    let total: u64 = regions.iter().map(MemoryRegion::pages).sum();
    (total / (2 * tern_page::codec::DICTIONARY_SAMPLE_PAGES as u64)).max(1)
}

/// `count` pages spread evenly over guest memory.
pub(crate) fn sample_pages(regions: &[MemoryRegion], count: usize) -> Vec<[u8; PAGE_SIZE]> {
    sample_pages_at(regions, count, 0)
}

/// `count` pages spread evenly over guest memory, each `offset` pages after
/// the one [`sample_pages`] takes (pages another sample did not see).
pub(crate) fn sample_pages_at(
    regions: &[MemoryRegion],
    count: usize,
    offset: u64,
) -> Vec<[u8; PAGE_SIZE]> {
    let samples = count as u64;
    let total: u64 = regions.iter().map(MemoryRegion::pages).sum();
    (0..samples)
        .filter_map(|index| {
            copy_page(
                regions,
                (index * total.max(1) / samples + offset) % total.max(1),
            )
        })
        .collect()
}

/// `runs` runs of `run_pages` consecutive pages, spread evenly over guest
/// memory half a spacing from its start: what a packet of a pass holds,
/// neighbours together, where single sampled pages would each come from
/// elsewhere.
pub(crate) fn sample_runs(
    regions: &[MemoryRegion],
    runs: usize,
    run_pages: usize,
) -> Vec<[u8; PAGE_SIZE]> {
    let total: u64 = regions.iter().map(MemoryRegion::pages).sum();
    let (runs, run_pages) = (runs as u64, run_pages as u64);
    if total < runs * run_pages {
        return Vec::new();
    }
    let spacing = total / runs.max(1);
    (0..runs)
        .flat_map(|run| {
            let start = run * spacing + spacing.saturating_sub(run_pages) / 2;
            (start..start + run_pages).filter_map(|global| copy_page(regions, global))
        })
        .collect()
}

/// A copy of page `global`, counted across `regions` in order.
fn copy_page(regions: &[MemoryRegion], mut global: u64) -> Option<[u8; PAGE_SIZE]> {
    for region in regions {
        if global < region.pages() {
            let ptr = region.page_ptr(global)?;
            let mut page = [0u8; PAGE_SIZE];
            // SAFETY: a whole page inside the region's mapping; the guest
            // may write it meanwhile, which only makes the sample a little
            // stale.
            unsafe { std::ptr::copy_nonoverlapping(ptr, page.as_mut_ptr(), PAGE_SIZE) };
            return Some(page);
        }
        global -= region.pages();
    }
    None
}

impl Pipeline<'_> {
    /// Adaptive compression: every [`AUTO_DECISION_INTERVAL`], decides the
    /// codec and level from the link and the codecs as measured
    /// ([`AutoCodec::decide`]).
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
        let queue = self
            .shared
            .link_queue
            .as_ref()
            .map(LinkQueue::snapshot)
            .unwrap_or_default();
        // The share of time the senders were busy: near 1 the link is the
        // bottleneck and the wire rate is its capacity; lower, the link
        // could carry proportionally more.
        let busy_share =
            ((busy - auto.busy_at_start) as f64 / 1e9 / (elapsed * self.channel_count as f64))
                .clamp(0.05, 1.0);
        let window = LinkWindow {
            seconds: elapsed,
            written: wire - auto.wire_at_start,
            busy_share,
            queue_at_start: auto.queue_at_start,
            queue_at_end: queue,
            raw: self.codec == CodecId::None,
        };
        let measured = self.measure_window();
        let at_ms = self.elapsed_ms();
        let workers = self.shared.worker_rings.len();
        let compression = &self.shared.compression;
        let Some(auto) = self.auto.as_mut() else {
            return;
        };
        auto.achieved.tick();
        let data = self.shared.stats.normal_bytes.load(Ordering::Relaxed);
        let data_moved = data.saturating_sub(auto.data_at_start);
        if data_moved >= MEASURED_WINDOW_PAGES * PAGE_SIZE as u64 {
            auto.achieved
                .record(self.codec, data_moved as f64 / elapsed);
        }
        auto.data_at_start = data;
        let mut decided_link = None;
        if let Some(reading) = auto.links.push_window(&window) {
            let outcome = auto.decide(reading, measured, workers, at_ms, |codec| {
                compression.level_for(codec)
            });
            if let Some(codec) = outcome.codec {
                self.codec = codec;
            }
            decided_link = Some(outcome.link);
        }
        auto.start_window(
            current_counters(&self.codec_stats, self.codec),
            wire,
            busy,
            queue,
        );
        if let Some(link) = decided_link {
            self.start_deferred_dictionary(link);
        }
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
        let window = data_the_codec_ran_on(&counters_since(&now, &auto.counters_at_start))
            .filter(|window| window.pages >= MEASURED_WINDOW_PAGES)?;
        let measured =
            tern_page::codec::CodecMeasurement::from_counters(self.codec, auto.level(), &window)?;
        auto.measurements.retain(|known| known.codec != self.codec);
        auto.measurements.push(measured);
        Some(measured)
    }

    /// The level the next batch is compressed at.
    pub(super) fn batch_level(&self) -> i32 {
        match &self.auto {
            Some(auto) => auto.level(),
            None => self.shared.compression.level_for(self.codec),
        }
    }

    /// How many times auto has switched codecs so far (0 without auto):
    /// the source compares it across an iteration to tell a pass that
    /// moved at two codecs' rates.
    pub(crate) fn codec_switches(&self) -> u64 {
        self.auto
            .as_ref()
            .map_or(0, |auto| auto.report.codec_switches)
    }

    /// What encoding the last pages costs at the codec and level in
    /// force, for the downtime estimate: the workers' guest bytes per CPU
    /// second together (over the last pass's mix of pages, see
    /// `encode_cost.rs`, or at the codec's own speed), and the codec's
    /// ratio, as last measured. `None` without compression or before any
    /// measurement.
    /// The workers' share of a CPU is sampled each call (once a sync): a
    /// codec measured per CPU second compresses the last pages that much
    /// slower on a busy host.
    pub(crate) fn codec_cost(&self) -> Option<CodecCost> {
        let cpu_share = self.shared.worker_cpu.sample();
        if self.codec == CodecId::None {
            return None;
        }
        let workers = self.shared.worker_rings.len().max(1) as f64 * cpu_share;
        let measured = match &self.auto {
            Some(auto) => auto
                .measurements
                .iter()
                .find(|m| m.codec == self.codec)
                .copied(),
            None => {
                let counters =
                    data_the_codec_ran_on(&current_counters(&self.codec_stats, self.codec))?;
                tern_page::codec::CodecMeasurement::from_counters(
                    self.codec,
                    self.batch_level(),
                    &counters,
                )
            }
        }?;
        // The last pass's pages as they were encoded (zero, duplicate and
        // delta pages cheaper than compressed ones), when it had the codec
        // and level in force throughout; else the codec's own speed, as
        // though every page went through it.
        let per_cpu_sec = self
            .encode_cost
            .last_pass_bytes_per_cpu_sec(self.codec, self.batch_level())
            .unwrap_or(measured.compress_bytes_per_sec);
        Some(CodecCost {
            guest_bytes_per_sec: per_cpu_sec * workers,
            ratio: measured.ratio,
        })
    }
}

impl Pipeline<'_> {
    /// With `auto` and no delta cache configured, before a live iteration
    /// from the second on (no worker runs): decides whether a delta cache
    /// pays and how large, from the pages dirtied again (`bitmaps`: what
    /// this iteration sends) and the allowance, and sets it up. The first
    /// pass goes around the cache (`DeltaGate`), so an empty cache set up
    /// now misses nothing. Decided once.
    pub(super) fn size_delta_cache(&mut self, bitmaps: &[DirtyBitmap], iteration: u32) {
        if iteration == 0 || self.delta_auto.is_none() {
            return;
        }
        let redirtied: u64 = bitmaps.iter().map(DirtyBitmap::count).sum();
        let Some((allowance, offload)) = self.delta_auto.as_ref() else {
            return;
        };
        let decision = delta_cache::size_delta_cache(redirtied, *allowance);
        let (choice, reason) = match decision {
            delta_cache::DeltaCacheDecision::Wait => return,
            delta_cache::DeltaCacheDecision::Off(reason) => ("off".to_string(), reason),
            delta_cache::DeltaCacheDecision::On(bytes, reason) => {
                let _ = self
                    .shared
                    .delta_cache
                    .set(DeltaCache::new(bytes, offload.clone()));
                self.shared.stats.set_delta_cache_size(bytes);
                // Deltas now take the pages the codec saw: its ratios
                // from here on are of other pages, not of other content.
                if let Some(auto) = self.auto.as_mut() {
                    auto.content.reset();
                }
                (bytes.to_string(), reason)
            }
        };
        self.delta_auto = None;
        self.note_auto("delta-cache", choice, reason);
    }

    /// Milliseconds since the migration started: when auto decides.
    fn elapsed_ms(&self) -> u64 {
        crate::numeric::saturating_u64(self.shared.stats.started().elapsed().as_millis())
    }

    /// Records auto's decision on `subject`, stamped now (nothing without
    /// auto).
    pub(super) fn note_auto(&mut self, subject: &str, choice: String, reason: String) {
        let at_ms = self.elapsed_ms();
        if let Some(auto) = self.auto.as_mut() {
            auto.note(at_ms, subject, choice, reason);
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
            deflate_through_qpl: calibration.deflate_through_qpl,
            ..auto_setup()
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
        let setup = auto_setup();
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

    /// A 50 ms window that wrote `written` bytes, with every packet finding
    /// a standing queue (`pushed_back`) or none, the senders busy
    /// `busy_share` of the time.
    fn window(written: u64, pushed_back: bool, busy_share: f64) -> LinkWindow {
        let queue = QueueSamples {
            samples: 10,
            standing: if pushed_back { 10 } else { 0 },
            unsent: 4_000_000,
            ..QueueSamples::default()
        };
        LinkWindow {
            seconds: 0.05,
            written,
            busy_share,
            // As much queued at the start as at the end: what left the
            // sockets is what was written.
            queue_at_start: QueueSamples {
                unsent: 4_000_000,
                ..QueueSamples::default()
            },
            queue_at_end: queue,
            raw: false,
        }
    }

    /// Rates in whole MB/s, for exact comparisons.
    fn mb(readings: &[Option<LinkReading>]) -> Vec<Option<u64>> {
        readings
            .iter()
            .map(|reading| {
                reading.map(|r| crate::numeric::saturating_u64_from_f64((r.rate / 1e6).round()))
            })
            .collect()
    }

    #[test]
    fn a_window_that_did_not_load_a_measured_link_does_not_read_as_a_fast_one() {
        // The shaped 1 Gbit/s link with zstd in force: the queue stands.
        let loaded = window(6_250_000, true, 0.3);
        // A window at an iteration's end: 63 MB/s written, sends returning
        // at once, no queue; its estimate alone is 20 times that.
        let idle = window(3_170_000, false, 0.05);
        assert_eq!(
            mb(&[Some(LinkReading::measured(link_estimate(&idle)))]),
            [Some(1268)]
        );
        let mut links = LinkEstimates::default();
        let mut decided: Vec<_> = (0..3).map(|_| links.push_window(&loaded)).collect();
        decided.extend((0..3).map(|_| links.push_window(&idle)));
        decided.push(links.push_window(&loaded));
        assert_eq!(
            mb(&decided),
            [None, None, Some(125), None, None, None, Some(125)]
        );
        // Before the link ever pushed back, such windows count as they did
        // (loopback never pushes back: its first decision needs them).
        let mut unmeasured = LinkEstimates::default();
        let decided: Vec<_> = (0..3).map(|_| unmeasured.push_window(&idle)).collect();
        assert_eq!(mb(&decided), [None, None, Some(1268)]);
    }

    #[test]
    fn a_queue_the_peer_made_does_not_stand_for_the_link() {
        // Loopback with zstd in force and the destination still setting up:
        // the queue stands, but the channels waited on the peer's receive
        // window for 80 of their 90 ms busy.
        let mut slow_peer = window(6_250_000, true, 0.3);
        slow_peer.queue_at_end.busy_us = 90_000;
        slow_peer.queue_at_end.receiver_limited_us = 80_000;
        let idle = window(3_170_000, false, 0.05);
        let mut links = LinkEstimates::default();
        let mut decided: Vec<_> = (0..3).map(|_| links.push_window(&slow_peer)).collect();
        decided.extend((0..3).map(|_| links.push_window(&idle)));
        // The idle windows count: the lower median moves once three are in.
        assert_eq!(
            mb(&decided),
            [None, None, Some(125), Some(125), Some(125), Some(1268)]
        );
    }

    #[test]
    fn one_low_measurement_does_not_let_an_idle_window_count() {
        let mut links = LinkEstimates::default();
        links.push_window(&window(6_250_000, true, 0.3));
        links.push_window(&window(6_250_000, true, 0.3));
        // A measurement that came out low: 80 MB/s.
        assert_eq!(
            mb(&[links.push_window(&window(4_000_000, true, 0.3))]),
            [Some(125)]
        );
        // 90 MB/s written without a queue: less than the link carried.
        let idle = window(4_500_000, false, 0.05);
        let decided: Vec<_> = (0..3).map(|_| links.push_window(&idle)).collect();
        assert_eq!(decided, [None, None, None]);
    }

    /// Estimates after three windows in which the link pushed back at
    /// 125 MB/s.
    fn measured_at_125_mb_s() -> LinkEstimates {
        let mut links = LinkEstimates::default();
        for _ in 0..3 {
            links.push_window(&window(6_250_000, true, 0.3));
        }
        links
    }

    #[test]
    fn a_link_that_carries_more_than_it_measured_is_followed() {
        let mut links = measured_at_125_mb_s();
        // 400 MB/s written, no queue, senders half busy: faster than measured.
        let faster = window(20_000_000, false, 0.5);
        let decided: Vec<_> = (0..3).map(|_| links.push_window(&faster)).collect();
        // The median follows once three of the five kept windows say so.
        assert_eq!(mb(&decided), [Some(125), Some(125), Some(800)]);
    }

    #[test]
    fn a_measured_rate_stands_about_a_second() {
        let mut links = measured_at_125_mb_s();
        let idle = window(3_170_000, false, 0.05);
        let quiet = LinkEstimates::MEASURED_FRESH_WINDOWS;
        for _ in 0..quiet {
            assert_eq!(links.push_window(&idle), None);
        }
        // A link that has not pushed back for that long is not what limits.
        let decided: Vec<_> = (0..3).map(|_| links.push_window(&idle)).collect();
        assert_eq!(mb(&decided), [Some(125), Some(125), Some(1268)]);
    }

    /// Issue 31, item 2: under load the workers wrote 99 MB/s into the
    /// shaped 1 Gbit/s link, too little to make a queue stand, and the
    /// busy-share bound (20 times that) sent raw; the link pushed back in
    /// raw's first window, and zstd came back three windows later.
    #[test]
    fn the_first_measurement_after_a_guess_comes_with_the_reading() {
        let codec_bound = window(4_937_500, false, 0.05);
        let raw_pushed_back = window(6_250_000, true, 1.0);
        let mut links = LinkEstimates::default();
        let guessed: Vec<_> = (0..3).map(|_| links.push_window(&codec_bound)).collect();
        assert_eq!(mb(&guessed), [None, None, Some(1975)]);
        assert!(!guessed[2].unwrap().measured);
        // Raw's first window measures the link: the median still holds the
        // bounds, the correction is the window's own estimate.
        let reading = links.push_window(&raw_pushed_back).unwrap();
        assert_eq!(mb(&[Some(reading)]), [Some(1975)]);
        assert_eq!(reading.correction, Some(125e6));
        // Once taken, the bounds are gone: the median is of measurements.
        links.forget_bounds();
        let next: Vec<_> = (0..2)
            .map(|_| links.push_window(&raw_pushed_back))
            .collect();
        assert_eq!(mb(&next), [None, Some(125)]);
        assert!(next[1].is_some_and(|r| r.measured && r.correction.is_none()));
        // A link measured all along corrects nothing.
        let mut measured = measured_at_125_mb_s();
        let reading = measured.push_window(&raw_pushed_back).unwrap();
        assert_eq!(reading.correction, None);
    }

    /// Issue 31, item 2: zstd on one loaded core stopped loading the link
    /// for a second; the measured rate went stale, the bounds sent raw, and
    /// raw was held a second more.
    #[test]
    fn a_guess_after_a_measured_rate_went_stale_is_corrected_too() {
        let mut links = measured_at_125_mb_s();
        let idle = window(3_170_000, false, 0.05);
        for _ in 0..LinkEstimates::MEASURED_FRESH_WINDOWS {
            assert_eq!(links.push_window(&idle), None);
        }
        let guessed: Vec<_> = (0..3).map(|_| links.push_window(&idle)).collect();
        assert_eq!(mb(&guessed), [Some(125), Some(125), Some(1268)]);
        assert!(guessed[1].unwrap().measured && !guessed[2].unwrap().measured);
        let reading = links.push_window(&window(5_000_000, true, 1.0)).unwrap();
        assert_eq!(reading.correction, Some(100e6));
    }

    /// `auto`'s setup as the tests make it: no level, dictionary or QPL.
    fn auto_setup() -> CompressionSetup {
        CompressionSetup {
            choice: CodecChoice::Auto,
            level: None,
            qpl_path: QplPath::Software,
            deflate_through_qpl: false,
            packet_frames: false,
            stream_frames: false,
            dictionary: None,
            dictionary_report: None,
            dictionary_refresh: None,
            auto_decisions: Vec::new(),
        }
    }

    fn auto_unsettled(candidates: Vec<CodecMeasurement>) -> AutoCodec {
        let setup = auto_setup();
        AutoCodec::start(2, candidates, None, &setup)
    }

    /// Runs `windows` through the link estimates and the decision; the
    /// codecs in force after each.
    fn run_windows(auto: &mut AutoCodec, windows: &[LinkWindow]) -> Vec<CodecId> {
        windows
            .iter()
            .map(|window| {
                if let Some(reading) = auto.links.push_window(window) {
                    auto.decide(reading, None, 2, 0, |c| c.default_level());
                }
                auto.codec()
            })
            .collect()
    }

    #[test]
    fn a_codec_left_on_a_guess_comes_back_with_the_first_measurement() {
        let codec_bound = window(4_937_500, false, 0.05);
        // Raw pushed back at 100 MB/s: zstd wins there, and would on a
        // 200 MB/s link too.
        let mut raw_pushed_back = window(5_000_000, true, 1.0);
        raw_pushed_back.raw = true;
        let mut auto = auto_unsettled(software());
        assert_eq!(auto.codec(), CodecId::Zstd);
        let codecs = run_windows(&mut auto, &[codec_bound; 3]);
        assert_eq!(codecs, [CodecId::Zstd, CodecId::Zstd, CodecId::None]);
        let guess = auto.report.decisions.last().unwrap();
        assert!(guess.reason.contains("upper bound"), "{guess:?}");
        // zstd at once, not after three windows more of raw.
        let codecs = run_windows(&mut auto, &[raw_pushed_back; 3]);
        assert_eq!(codecs, [CodecId::Zstd; 3]);
        let last = auto.report.decisions.last().unwrap();
        assert!(last.reason.contains("corrected at once"), "{last:?}");
        assert_eq!(auto.report.codec_switches, 2);
    }

    /// A channel stream is never the start on a link still to be measured
    /// (its receivers' decoding can pass for the link); packet frames
    /// stand in for it, and a decision on a measured slow link takes the
    /// stream, never packet frames, even where calibration's one packet of
    /// scattered pages measured both alike.
    #[test]
    fn packet_frames_stand_in_for_the_stream_until_the_link_is_measured() {
        let mut candidates = software();
        candidates.push(measured(CodecId::ZstdPacket, 150e6, 2.3));
        candidates.push(measured(CodecId::ZstdStream, 150e6, 2.3));
        let mut auto = auto_unsettled(candidates.clone());
        assert_eq!(auto.codec(), CodecId::ZstdPacket);
        // The link pushed back at 100 MB/s: slower than zstd.
        let slow = window(5_000_000, true, 1.0);
        let codecs = run_windows(&mut auto, &[slow; 3]);
        assert_eq!(codecs[2], CodecId::ZstdStream, "{:?}", auto.report);
        // A configured link is known: the stream may start.
        let setup = auto_setup();
        let known = AutoCodec::start(2, candidates, Some(100_000_000), &setup);
        assert_eq!(known.codec(), CodecId::ZstdStream);
    }

    /// Loopback: one raw window after a guess read 1264 MB/s, and lz4,
    /// 18 % ahead of raw there, took over (0.81 s against the series'
    /// 0.55-0.62).
    #[test]
    fn a_correction_one_window_could_reverse_waits_for_its_windows() {
        let mut auto = auto_unsettled(vec![measured(CodecId::Lz4, 750e6, 2.0)]);
        // lz4 bound by its CPU at 354 MB/s written, sends returning at once.
        let codec_bound = window(17_700_000, false, 0.05);
        let codecs = run_windows(&mut auto, &[codec_bound; 3]);
        assert_eq!(codecs[2], CodecId::None);
        // Raw's windows read 1264 MB/s: lz4 moves 1500 there, but not on a
        // link twice as fast; the bounds stay in the median, raw stays.
        let mut raw_measured = window(63_200_000, true, 1.0);
        raw_measured.raw = true;
        let codecs = run_windows(&mut auto, &[raw_measured]);
        assert_eq!(codecs, [CodecId::None]);
        assert_eq!(auto.report.codec_switches, 1);
    }

    fn auto_on(candidates: Vec<CodecMeasurement>) -> AutoCodec {
        let mut auto = auto_unsettled(candidates);
        // The first measured link (1 Gbit/s) settles the start's guess.
        auto.decide(LinkReading::measured(125e6), None, 2, 0, |codec| {
            codec.default_level()
        });
        auto
    }

    /// Runs `links` (bytes per second) through the decision, one window
    /// each; the codecs in force after each window.
    fn follow(auto: &mut AutoCodec, links: &[f64]) -> Vec<CodecId> {
        links
            .iter()
            .enumerate()
            .map(|(window, &link)| {
                auto.decide(
                    LinkReading::measured(link),
                    None,
                    2,
                    window as u64 * 50,
                    |codec| codec.default_level(),
                );
                auto.codec()
            })
            .collect()
    }

    #[test]
    fn a_flapping_link_estimate_does_not_flap_the_codec() {
        // zstd wins on the slow link, lz4 on the 4x faster one.
        let mut auto = auto_on(software());
        assert_eq!(auto.codec(), CodecId::Zstd);
        let slow = 125e6;
        let fast = 500e6;
        // Each window says the opposite of the last one: nothing moves.
        let alternating: Vec<f64> = (0..60)
            .map(|w| if w % 2 == 0 { fast } else { slow })
            .collect();
        let codecs = follow(&mut auto, &alternating);
        assert!(codecs.iter().all(|&c| c == CodecId::Zstd), "{codecs:?}");
        // Two windows one way, one the other: still nothing.
        let bursts: Vec<f64> = (0..60)
            .map(|w| if w % 3 == 2 { slow } else { fast })
            .collect();
        let codecs = follow(&mut auto, &bursts);
        assert!(codecs.iter().all(|&c| c == CodecId::Zstd), "{codecs:?}");
        assert_eq!(auto.report.codec_switches, 0);
        // Runs of three windows each way, for a long time: at most the
        // budget of switches, then the codec stays.
        let runs: Vec<f64> = (0..120)
            .map(|w| if (w / 3) % 2 == 0 { fast } else { slow })
            .collect();
        let codecs = follow(&mut auto, &runs);
        let switches = codecs.windows(2).filter(|pair| pair[0] != pair[1]).count();
        assert_eq!(switches, CODEC_SWITCH_BUDGET as usize, "{codecs:?}");
        assert_eq!(auto.report.codec_switches, u64::from(CODEC_SWITCH_BUDGET));
        assert!(auto.report.switches_held > 0);
        // Every switch is in the report with its reason.
        let recorded: Vec<_> = auto
            .report
            .decisions
            .iter()
            .filter(|d| d.subject == "codec")
            .collect();
        assert_eq!(recorded.len(), 1 + CODEC_SWITCH_BUDGET as usize);
        assert!(recorded[1].reason.contains("MB/s"), "{:?}", recorded[1]);
    }

    /// Issue 31: a postcopy run spent the budget on misread windows, the
    /// last switch to raw, and sent raw on a 1 Gbit/s link for 47 s.
    #[test]
    fn the_spent_budget_does_not_hold_raw_on_a_slow_link() {
        let mut auto = auto_on(software());
        let slow = 125e6;
        let memory_speed = 5e9;
        // Runs of three windows: slow (zstd kept), then misread as fast
        // (raw), slow (zstd), fast (raw): the three switches allowed.
        let misread: Vec<f64> = (0..12)
            .map(|w| if (w / 3) % 2 == 0 { slow } else { memory_speed })
            .collect();
        follow(&mut auto, &misread);
        assert_eq!(auto.codec(), CodecId::None);
        assert_eq!(auto.report.codec_switches, u64::from(CODEC_SWITCH_BUDGET));
        // Raw's windows on the slow link: zstd again, beyond the budget.
        let codecs = follow(&mut auto, &[slow; 3]);
        assert_eq!(codecs.last(), Some(&CodecId::Zstd), "{codecs:?}");
        let last = auto
            .report
            .decisions
            .iter()
            .rev()
            .find(|d| d.subject == "codec")
            .unwrap();
        assert!(
            last.reason.contains("beyond the switches allowed"),
            "{last:?}"
        );
        // A codec is held as before: misread windows leave it in force.
        let codecs = follow(&mut auto, &[memory_speed; 9]);
        assert!(codecs.iter().all(|&c| c == CodecId::Zstd), "{codecs:?}");
        assert_eq!(
            auto.report.codec_switches,
            u64::from(CODEC_SWITCH_BUDGET) + 1
        );
    }

    #[test]
    fn what_a_codec_achieved_overrules_the_prediction() {
        let mut auto = auto_on(software());
        assert_eq!(auto.codec(), CodecId::Zstd);
        // zstd moved 600 MB/s of data pages (the peer shares the cores).
        for _ in 0..3 {
            auto.achieved.record(CodecId::Zstd, 600e6);
        }
        // A fast link: raw, never tried, takes over as predicted...
        let codecs = follow(&mut auto, &[4000e6, 4000e6, 4000e6]);
        assert_eq!(codecs[2], CodecId::None);
        // ...and moves 900 MB/s.
        for _ in 0..3 {
            auto.achieved.record(CodecId::None, 900e6);
        }
        // The link, pushing back, now reads 200 MB/s: the model predicts
        // 340 MB/s for zstd, but zstd achieved less than raw: raw stays.
        let codecs = follow(&mut auto, &[200e6; 6]);
        assert!(codecs.iter().all(|&c| c == CodecId::None), "{codecs:?}");
        // Had zstd achieved more, it would be back after three windows.
        let mut faster = AchievedRates::default();
        faster.record(CodecId::None, 900e6);
        faster.record(CodecId::None, 900e6);
        for _ in 0..AchievedRates::KEPT {
            faster.record(CodecId::Zstd, 1200e6);
        }
        let held = std::mem::replace(&mut auto.achieved, faster);
        let codecs = follow(&mut auto, &[200e6; 3]);
        assert_eq!(codecs, [CodecId::None, CodecId::None, CodecId::Zstd]);
        // What zstd achieved goes stale: after a second of raw windows it
        // is proposed as the model says again.
        auto.achieved = held;
        let mut back_to_raw = auto_on(software());
        follow(&mut back_to_raw, &[4000e6; 3]);
        back_to_raw.achieved = auto.achieved;
        assert_eq!(back_to_raw.codec(), CodecId::None);
        for _ in 0..=AchievedRates::FRESH_WINDOWS {
            back_to_raw.achieved.tick();
            back_to_raw.achieved.record(CodecId::None, 900e6);
        }
        let codecs = follow(&mut back_to_raw, &[200e6; 3]);
        assert_eq!(codecs, [CodecId::None, CodecId::None, CodecId::Zstd]);
    }

    #[test]
    fn a_link_that_really_changed_is_followed_after_three_windows() {
        let mut auto = auto_on(software());
        let codecs = follow(&mut auto, &[125e6, 125e6, 500e6, 500e6, 500e6, 500e6]);
        assert_eq!(
            codecs,
            [
                CodecId::Zstd,
                CodecId::Zstd,
                CodecId::Zstd,
                CodecId::Zstd,
                CodecId::Lz4,
                CodecId::Lz4
            ]
        );
    }

    #[test]
    fn changed_content_renews_the_switches_allowed() {
        let mut auto = auto_on(software());
        let runs: Vec<f64> = (0..60)
            .map(|w| if (w / 3) % 2 == 0 { 500e6 } else { 125e6 })
            .collect();
        follow(&mut auto, &runs);
        assert_eq!(auto.codec_choice.switches(), CODEC_SWITCH_BUDGET);
        // The codec in force now compresses 1.4, then 3.0 for two windows.
        let codec = auto.codec();
        let at = |ratio| CodecMeasurement {
            level: codec.default_level(),
            ..measured(codec, 300e6, ratio)
        };
        for ratio in [1.4, 1.4, 3.0, 3.0] {
            auto.decide(LinkReading::measured(125e6), Some(at(ratio)), 2, 0, |c| {
                c.default_level()
            });
        }
        assert_eq!(auto.report.content_changes, 1);
        assert_eq!(auto.codec_choice.switches(), 0);
    }

    #[test]
    fn the_level_does_not_flap_either() {
        let mut auto = auto_on(software());
        assert_eq!(auto.codec(), CodecId::Zstd);
        // Alternating windows: the CPU has room to spare (level up), then
        // cannot keep up (level down).
        for window in 0..40 {
            let rate = if window % 2 == 0 { 300e6 } else { 40e6 };
            let m = CodecMeasurement {
                level: auto.level(),
                ..measured(CodecId::Zstd, rate, 2.1)
            };
            auto.decide(LinkReading::measured(125e6), Some(m), 2, 0, |c| {
                c.default_level()
            });
        }
        assert_eq!(auto.report.level_changes, 0);
        // Steadily idle CPU: up one level after three windows.
        for _ in 0..3 {
            let m = CodecMeasurement {
                level: auto.level(),
                ..measured(CodecId::Zstd, 300e6, 2.1)
            };
            auto.decide(LinkReading::measured(125e6), Some(m), 2, 0, |c| {
                c.default_level()
            });
        }
        assert_eq!(auto.level(), 2);
        assert_eq!(auto.report.level_changes, 1);
    }

    #[test]
    fn a_slower_qpl_is_left_out() {
        let qpl_software_path = measured(CodecId::Deflate, 90e6, 2.0);
        let calibration = with_qpl_candidate(software(), Some(qpl_software_path));
        assert!(!calibration.deflate_through_qpl);
        assert_eq!(calibration.measurements, software());
    }
}

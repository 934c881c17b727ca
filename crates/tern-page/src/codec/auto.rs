//! Choosing the codec from what the link and the CPU can do.
//!
//! Compression pays only when the link, not the CPU, is the bottleneck. A
//! codec turns `r` bytes/s of CPU into `r` bytes/s of guest memory sent, as
//! long as the link can carry `r / ratio`; so the guest memory it moves per
//! second is `min(r · threads, link · ratio)`, while sending raw moves
//! `link`. [`choose_codec`] picks the option with the highest such rate, and
//! keeps the current one unless another beats it by a margin, so the choice
//! does not flap between iterations on measurement noise.

use super::batch::CompressedBatch;
use super::compressor::PageCompressor;
use super::decompressor::PageDecompressor;
use super::dictionary::CodecDictionary;
use super::error::CodecError;
use super::id::CodecId;
use super::stats::CodecCounters;
use crate::PAGE_SIZE;
use crate::cpu_time::thread_cpu_ns;

/// What a codec achieves on this machine and this guest's pages.
#[derive(Clone, Copy, Debug, PartialEq)]
// Not `#[non_exhaustive]`: callers build it from what they measured (the
// engine's calibration and its tests), as the input of `decide`.
pub struct CodecMeasurement {
    /// Wire codec.
    pub codec: CodecId,
    /// Level in force.
    pub level: i32,
    /// Input (guest) bytes compressed per CPU second on one thread, sampling
    /// included.
    pub compress_bytes_per_sec: f64,
    /// Guest bytes decoded per CPU second on one destination thread, if
    /// known.
    pub decompress_bytes_per_sec: Option<f64>,
    /// Guest bytes per wire byte (raw pages included).
    pub ratio: f64,
}

impl CodecMeasurement {
    /// From a worker's running counters (CPU rate and ratio). `None` until
    /// some CPU time was measured.
    pub fn from_counters(codec: CodecId, level: i32, c: &CodecCounters) -> Option<Self> {
        Some(Self {
            codec,
            level,
            compress_bytes_per_sec: c.bytes_per_cpu_second()?,
            decompress_bytes_per_sec: None,
            ratio: c.ratio(),
        })
    }

    /// Guest bytes per second this codec moves over `link_bytes_per_sec`
    /// with `threads` compressing (and as many decompressing).
    pub fn effective_rate(&self, link_bytes_per_sec: f64, threads: usize) -> f64 {
        let t = threads.max(1) as f64;
        let mut r = (self.compress_bytes_per_sec * t).min(link_bytes_per_sec * self.ratio.max(0.0));
        if let Some(d) = self.decompress_bytes_per_sec {
            r = r.min(d * t);
        }
        r
    }
}

/// The codec picked for the next iteration.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct AutoDecision {
    /// Wire codec (`None`: send raw).
    pub codec: CodecId,
    /// Level to use.
    pub level: i32,
    /// Predicted guest bytes per second.
    pub effective_bytes_per_sec: f64,
}

/// Picks the codec that moves the most guest memory per second. Pure.
///
/// * `link_bytes_per_sec`: measured link bandwidth.
/// * `threads`: compression workers (and receivers).
/// * `candidates`: measured codecs; entries with `codec == None` are
///   ignored (raw is always a candidate, at the link rate).
/// * `current`: the codec in use; it is kept unless another option is more
///   than `margin` (e.g. 0.1 = 10 %) better.
pub fn choose_codec(
    link_bytes_per_sec: f64,
    threads: usize,
    candidates: &[CodecMeasurement],
    current: CodecId,
    margin: f64,
) -> AutoDecision {
    let raw = AutoDecision {
        codec: CodecId::None,
        level: 0,
        effective_bytes_per_sec: link_bytes_per_sec,
    };
    let decide = |m: &CodecMeasurement| AutoDecision {
        codec: m.codec,
        level: m.level,
        effective_bytes_per_sec: m.effective_rate(link_bytes_per_sec, threads),
    };
    let options = std::iter::once(raw).chain(
        candidates
            .iter()
            .filter(|m| m.codec != CodecId::None)
            .map(decide),
    );
    let best = options.clone().fold(raw, |best, o| {
        if o.effective_bytes_per_sec > best.effective_bytes_per_sec {
            o
        } else {
            best
        }
    });
    // Hysteresis: stay with the current codec (if still measured) unless the
    // best is clearly better.
    let incumbent = options.clone().find(|o| o.codec == current);
    match incumbent {
        Some(inc)
            if best.effective_bytes_per_sec <= inc.effective_bytes_per_sec * (1.0 + margin) =>
        {
            inc
        }
        _ => best,
    }
}

/// The highest level `auto` raises a codec to: beyond it a level costs
/// several times the CPU for a few percent of ratio.
pub const AUTO_MAX_LEVEL: i32 = 9;

/// The level `auto` uses next for the codec it keeps, measured as
/// `measured` at `measured.level`: one up while the link is the bottleneck
/// and the workers could compress at least twice what it carries (CPU to
/// spare, so a better ratio is free), one down while they cannot keep up
/// with it, else the same (the gap between the two is the hysteresis).
/// Never below the codec's default level nor above [`AUTO_MAX_LEVEL`]; a
/// codec with one level (lz4) keeps it. Pure.
pub fn tune_level(measured: &CodecMeasurement, link_bytes_per_sec: f64, threads: usize) -> i32 {
    let (_, highest) = measured.codec.level_range();
    let lowest = measured.codec.default_level();
    let highest = highest.min(AUTO_MAX_LEVEL).max(lowest);
    let cpu = measured.compress_bytes_per_sec * threads.max(1) as f64;
    let link = link_bytes_per_sec * measured.ratio.max(1.0);
    let next = if cpu >= 2.0 * link {
        measured.level + 1
    } else if cpu < link {
        measured.level - 1
    } else {
        measured.level
    };
    next.clamp(lowest, highest)
}

/// Stateful wrapper around [`choose_codec`]: remembers the codec in force.
#[derive(Clone, Debug)]
pub struct AutoSelector {
    threads: usize,
    margin: f64,
    current: CodecId,
}

impl AutoSelector {
    /// Starts with no compression; `threads` compression workers; a 10 %
    /// switching margin.
    pub fn new(threads: usize) -> Self {
        Self {
            threads,
            margin: 0.10,
            current: CodecId::None,
        }
    }

    /// Changes the switching margin (fraction).
    pub fn with_margin(mut self, margin: f64) -> Self {
        self.margin = margin;
        self
    }

    /// The codec currently in force.
    pub fn current(&self) -> CodecId {
        self.current
    }

    /// Decides the codec for the next iteration.
    pub fn next(&mut self, link_bytes_per_sec: f64, measured: &[CodecMeasurement]) -> AutoDecision {
        let d = choose_codec(
            link_bytes_per_sec,
            self.threads,
            measured,
            self.current,
            self.margin,
        );
        self.current = d.codec;
        d
    }
}

/// Hysteresis for one of `auto`'s choices (codec, level, ...): a new value
/// takes over only after it was proposed [`SteadyChoice::confirm`] decisions
/// in a row, and at most [`SteadyChoice::budget`] times until the guest's
/// content changes ([`SteadyChoice::content_changed`]). Measurements of
/// a loaded machine swing 2-10x between windows (docs/compression.md); a
/// choice that followed each window switched codec 9 to 52 times in one
/// migration (issue 31), each switch sending a window of pages with a codec
/// measured on noise. Pure: fed one proposal per decision window.
#[derive(Clone, Debug, PartialEq)]
pub struct SteadyChoice<T> {
    current: T,
    /// The value proposed against the current one, and in how many
    /// decisions in a row.
    challenger: Option<(T, u32)>,
    switches: u32,
    confirm: u32,
    budget: u32,
    /// Proposals that were confirmed but refused for the budget.
    held: u64,
}

/// What [`SteadyChoice::offer`] did with a proposal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Steadiness<T> {
    /// The proposal is the value in force.
    Kept,
    /// A different value, not yet proposed often enough in a row: this many
    /// times so far.
    Waiting(u32),
    /// Confirmed, but the switches allowed until the content changes are
    /// spent: the value in force stays.
    OverBudget,
    /// The proposal takes over from the value before.
    Switched {
        /// The value before.
        from: T,
    },
}

impl<T: Copy + PartialEq> SteadyChoice<T> {
    /// Starts at `initial`; a value must be proposed `confirm` times in a
    /// row (at least once) to take over, at most `budget` times.
    pub fn new(initial: T, confirm: u32, budget: u32) -> Self {
        Self {
            current: initial,
            challenger: None,
            switches: 0,
            confirm: confirm.max(1),
            budget,
            held: 0,
        }
    }

    /// The value in force.
    pub fn current(&self) -> T {
        self.current
    }

    /// Switches made since the start or the last content change.
    pub fn switches(&self) -> u32 {
        self.switches
    }

    /// Confirmed proposals refused because the budget was spent.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// Decisions in a row a value needs to take over.
    pub fn confirm(&self) -> u32 {
        self.confirm
    }

    /// Switches allowed until the content changes.
    pub fn budget(&self) -> u32 {
        self.budget
    }

    /// Takes one decision's proposal.
    pub fn offer(&mut self, proposed: T) -> Steadiness<T> {
        if proposed == self.current {
            self.challenger = None;
            return Steadiness::Kept;
        }
        let streak = match self.challenger {
            Some((value, streak)) if value == proposed => streak + 1,
            _ => 1,
        };
        if streak < self.confirm {
            self.challenger = Some((proposed, streak));
            return Steadiness::Waiting(streak);
        }
        self.challenger = None;
        if self.switches >= self.budget {
            self.held += 1;
            return Steadiness::OverBudget;
        }
        let from = self.current;
        self.current = proposed;
        self.switches += 1;
        Steadiness::Switched { from }
    }

    /// Puts `value` in force at once, outside the budget: for a decision
    /// on the first real measurement, which replaces a guess rather than
    /// a measured choice. The value before, when it changed.
    pub fn settle(&mut self, value: T) -> Option<T> {
        self.challenger = None;
        let from = self.current;
        self.current = value;
        (from != value).then_some(from)
    }

    /// The guest's pages changed character: the budget is renewed, since
    /// what was measured before no longer holds.
    pub fn content_changed(&mut self) {
        self.switches = 0;
        self.challenger = None;
    }
}

/// Whether the guest's content changed character, from the ratio the codec
/// in force achieves window after window on the pages it ran on: a change
/// when the ratio stays more than [`ContentWatch::CHANGE`] away from the
/// reference (the first window after the reference was reset) for
/// [`ContentWatch::WINDOWS`] windows in a row. Noise between windows of the
/// same content moves the ratio by a few percent; text against binary or
/// random pages moves it by 2x. Pure.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ContentWatch {
    reference: Option<f64>,
    away: u32,
}

impl ContentWatch {
    /// The relative change of the ratio that counts as other content.
    pub const CHANGE: f64 = 0.30;
    /// Windows in a row the change must last.
    pub const WINDOWS: u32 = 2;

    /// Takes one window's ratio; true when the content changed (the window
    /// then becomes the new reference).
    pub fn observe(&mut self, ratio: f64) -> bool {
        let Some(reference) = self.reference else {
            self.reference = Some(ratio);
            return false;
        };
        if (ratio / reference - 1.0).abs() <= Self::CHANGE {
            self.away = 0;
            return false;
        }
        self.away += 1;
        if self.away < Self::WINDOWS {
            return false;
        }
        self.reference = Some(ratio);
        self.away = 0;
        true
    }

    /// Another codec or level is in force: its ratios are its own, so the
    /// next window is the new reference.
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

/// Measures codecs on a sample of the guest's pages (e.g. 64 pages picked
/// across memory before the first iteration): one-thread CPU rate for
/// compression (sampling on) and decompression, and the ratio. Codecs this
/// build lacks (see [`CodecId::is_built`]) are skipped, so `auto` never picks
/// one.
pub fn calibrate(
    sample: &[[u8; PAGE_SIZE]],
    candidates: &[(CodecId, i32)],
) -> Result<Vec<CodecMeasurement>, CodecError> {
    calibrate_with_dictionary(sample, candidates, None)
}

/// [`calibrate`], with zstd (per page and in packet frames) compressing
/// against `dictionary`. The sample goes through in packets, as the
/// workers compress it.
pub fn calibrate_with_dictionary(
    sample: &[[u8; PAGE_SIZE]],
    candidates: &[(CodecId, i32)],
    dictionary: Option<&CodecDictionary>,
) -> Result<Vec<CodecMeasurement>, CodecError> {
    let mut result = Vec::new();
    let pointers: Vec<*const u8> = sample.iter().map(|page| page.as_ptr()).collect();
    let mut batches: Vec<CompressedBatch> = pointers
        .chunks(tern_wire::MAX_PAGES_PER_PACKET)
        .map(|_| CompressedBatch::new())
        .collect();
    for &(codec, level) in candidates {
        if codec == CodecId::None || !codec.is_built() || sample.is_empty() {
            continue;
        }
        let dictionary = dictionary.filter(|_| codec.is_zstd());
        let mut c = PageCompressor::with_dictionary(codec, level, dictionary)?;
        let t0 = thread_cpu_ns();
        for (chunk, batch) in pointers
            .chunks(tern_wire::MAX_PAGES_PER_PACKET)
            .zip(&mut batches)
        {
            // SAFETY: every pointer is a whole page of `sample`, alive and
            // not written during the call.
            unsafe { c.compress_batch(chunk, batch) };
        }
        let ct = thread_cpu_ns().saturating_sub(t0).max(1);
        let wire: usize = batches
            .iter()
            .flat_map(|batch| &batch.outcomes)
            .map(|outcome| match outcome {
                super::PageOutcome::Compressed { len, .. } => *len,
                super::PageOutcome::Raw(_) => PAGE_SIZE,
            })
            .sum();
        let mut d = PageDecompressor::new(codec)?
            .with_dictionaries(dictionary.map(std::slice::from_ref).unwrap_or_default())?;
        let id = dictionary.map_or(0, CodecDictionary::id);
        let t1 = thread_cpu_ns();
        let decoded = super::bench_dictionary::decode_all(&mut d, &batches, id)?;
        let dt = thread_cpu_ns().saturating_sub(t1).max(1);
        let bytes = (sample.len() * PAGE_SIZE) as f64;
        result.push(CodecMeasurement {
            codec,
            level: c.level(),
            compress_bytes_per_sec: bytes / (ct as f64 / 1e9),
            decompress_bytes_per_sec: (decoded > 0).then(|| decoded as f64 / (dt as f64 / 1e9)),
            ratio: bytes / wire.max(1) as f64,
        });
    }
    Ok(result)
}

/// The most compression ratio an offloaded deflate may give up against
/// libdeflate and still be preferred for being faster (see
/// [`prefer_offload`]).
pub const OFFLOAD_RATIO_TOLERANCE: f64 = 0.05;

/// Whether `auto` should produce deflate through QPL (`offload`) rather
/// than libdeflate (`software`), both measured on the same sample: QPL when
/// it compresses faster and its ratio is at most
/// [`OFFLOAD_RATIO_TOLERANCE`] below libdeflate's. IAA's level 1 trades a
/// little ratio for speed; a QPL that is slower (its software path on a
/// machine without IAA, say) is not worth a second deflate. Pure.
pub fn prefer_offload(software: &CodecMeasurement, offload: &CodecMeasurement) -> bool {
    offload.compress_bytes_per_sec > software.compress_bytes_per_sec
        && offload.ratio >= software.ratio * (1.0 - OFFLOAD_RATIO_TOLERANCE)
}

/// Measures deflate through QPL on `path` over `sample`, as the workers
/// run it (one batch of up to 64 pages submitted before any is waited
/// for). The compression rate is per **wall-clock** second of the calling
/// thread, not per CPU second: an offload's rate is the device's, and the
/// thread may sleep while IAA works. Decompression is timed with libdeflate
/// (what a destination without IAA uses).
///
/// # Errors
///
/// Why QPL cannot run here ([`CodecError::QplUnavailable`] without libqpl,
/// [`CodecError::NotBuilt`] without the `qpl` feature), or a decoding error
/// if QPL produced a stream libdeflate rejects.
pub fn calibrate_qpl(
    sample: &[[u8; PAGE_SIZE]],
    path: super::QplPath,
    level: i32,
) -> Result<CodecMeasurement, CodecError> {
    let mut compressor = PageCompressor::with_qpl(path, level)?;
    let mut batch = super::CompressedBatch::new();
    let mut compressed: Vec<Option<Vec<u8>>> = Vec::with_capacity(sample.len());
    let started = std::time::Instant::now();
    for chunk in sample.chunks(64) {
        let pages: Vec<*const u8> = chunk.iter().map(|page| page.as_ptr()).collect();
        // SAFETY: every pointer is a whole page of `sample`, alive and not
        // written during the call.
        unsafe { compressor.compress_batch(&pages, &mut batch) };
        compressed.extend((0..chunk.len()).map(|i| batch.compressed(i).map(<[u8]>::to_vec)));
    }
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    let wire: usize = compressed
        .iter()
        .map(|page| page.as_ref().map_or(PAGE_SIZE, Vec::len))
        .sum();
    let mut decoder = PageDecompressor::new(CodecId::Deflate)?;
    let mut page = [0u8; PAGE_SIZE];
    let t1 = thread_cpu_ns();
    let mut decoded = 0usize;
    for bytes in compressed.iter().flatten() {
        decoder.decompress(bytes, &mut page)?;
        decoded += PAGE_SIZE;
    }
    let dt = thread_cpu_ns().saturating_sub(t1).max(1);
    let bytes = (sample.len() * PAGE_SIZE) as f64;
    Ok(CodecMeasurement {
        codec: CodecId::Deflate,
        level: compressor.level(),
        compress_bytes_per_sec: bytes / seconds,
        decompress_bytes_per_sec: (decoded > 0).then(|| decoded as f64 / (dt as f64 / 1e9)),
        ratio: bytes / wire.max(1) as f64,
    })
}

#[cfg(test)]
mod steady_tests {
    use super::{ContentWatch, Steadiness, SteadyChoice};

    #[test]
    fn a_flapping_proposal_never_takes_over() {
        let mut choice = SteadyChoice::new('a', 3, 2);
        for round in 0..50 {
            let proposed = if round % 2 == 0 { 'b' } else { 'a' };
            assert_ne!(
                choice.offer(proposed),
                Steadiness::Switched { from: 'a' },
                "round {round}"
            );
        }
        assert_eq!(choice.current(), 'a');
        // Two in a row then one back: still not.
        for round in 0..30 {
            choice.offer(if round % 3 == 2 { 'a' } else { 'b' });
        }
        assert_eq!((choice.current(), choice.switches()), ('a', 0));
    }

    #[test]
    fn three_in_a_row_switch_within_the_budget_renewed_by_content() {
        let mut choice = SteadyChoice::new(1, 3, 2);
        let offer_three = |choice: &mut SteadyChoice<i32>, value| {
            (0..3).map(|_| choice.offer(value)).last().unwrap()
        };
        assert_eq!(
            offer_three(&mut choice, 2),
            Steadiness::Switched { from: 1 }
        );
        assert_eq!(
            offer_three(&mut choice, 1),
            Steadiness::Switched { from: 2 }
        );
        assert_eq!(offer_three(&mut choice, 2), Steadiness::OverBudget);
        assert_eq!((choice.current(), choice.held()), (1, 1));
        choice.content_changed();
        assert_eq!(
            offer_three(&mut choice, 2),
            Steadiness::Switched { from: 1 }
        );
        // A first measurement replaces a guess at once, outside the budget.
        assert_eq!(choice.settle(5), Some(2));
        assert_eq!((choice.current(), choice.switches()), (5, 1));
    }

    #[test]
    fn content_changes_only_when_the_ratio_moves_for_two_windows() {
        let mut watch = ContentWatch::default();
        assert!(!watch.observe(2.0));
        // Noise, and one wild window: no change.
        for ratio in [2.1, 1.9, 3.5, 2.0, 2.2] {
            assert!(!watch.observe(ratio), "{ratio}");
        }
        assert!(!watch.observe(1.2));
        assert!(watch.observe(1.25));
        // The new content is the reference now.
        assert!(!watch.observe(1.2));
    }
}

#[cfg(test)]
mod level_tests {
    use super::*;

    fn zstd_at(level: i32, rate: f64, ratio: f64) -> CodecMeasurement {
        CodecMeasurement {
            codec: CodecId::Zstd,
            level,
            compress_bytes_per_sec: rate,
            decompress_bytes_per_sec: None,
            ratio,
        }
    }

    #[test]
    fn the_level_rises_while_the_link_is_the_bottleneck_and_cpu_is_idle() {
        // 1 Gbit/s at ratio 2 carries 250 MB/s of guest memory; two
        // workers at 300 MB/s each compress 600: more than twice that.
        assert_eq!(tune_level(&zstd_at(1, 300e6, 2.0), 125e6, 2), 2);
        // Between one and two times: kept.
        assert_eq!(tune_level(&zstd_at(3, 150e6, 2.0), 125e6, 2), 3);
        // The CPU cannot keep up: one down, never below the default.
        assert_eq!(tune_level(&zstd_at(3, 100e6, 2.0), 125e6, 2), 2);
        assert_eq!(tune_level(&zstd_at(1, 10e6, 2.0), 125e6, 2), 1);
        // Never above the cap, however idle the CPU.
        assert_eq!(
            tune_level(&zstd_at(AUTO_MAX_LEVEL, 1e12, 2.0), 1e6, 2),
            AUTO_MAX_LEVEL
        );
        // lz4 has one level.
        let lz4 = CodecMeasurement {
            codec: CodecId::Lz4,
            ..zstd_at(1, 1e12, 2.0)
        };
        assert_eq!(tune_level(&lz4, 1e6, 2), 1);
    }
}

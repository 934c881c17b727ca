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

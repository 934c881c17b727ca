//! Per-worker codec counters; the engine adds them up.

use std::fmt;

use super::id::CodecImpl;

/// Plain counters for one codec implementation.
///
/// `bytes_in` counts every page offered (4096 each) and `bytes_out` every
/// byte that goes on the wire for them (the compressed length, or 4096 for a
/// raw page), so [`ratio`](Self::ratio) is the real saving, raw pages
/// included.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
// Not `#[non_exhaustive]`: a plain value of counters that callers build to
// subtract and add windows of them (tern-engine's auto codec does).
pub struct CodecCounters {
    /// Pages offered to the compressor.
    pub pages: u64,
    /// Pages sent compressed.
    pub compressed: u64,
    /// Pages the codec ran on but that did not shrink below `PAGE_SIZE - 1`.
    pub raw_fallbacks: u64,
    /// Pages sent raw without running the codec, because the sample said
    /// they would not shrink.
    pub skipped_by_sampling: u64,
    /// Pages an offload engine (QPL) could not take (busy queue, error) and
    /// the software codec compressed instead.
    pub offload_fallbacks: u64,
    /// Bytes offered (pages × `PAGE_SIZE`).
    pub bytes_in: u64,
    /// Bytes produced for the wire (compressed lengths + raw pages).
    pub bytes_out: u64,
    /// Thread CPU time spent in batch compression, in nanoseconds
    /// (`CLOCK_THREAD_CPUTIME_ID` read around each batch, not per page).
    pub cpu_ns: u64,
}

impl CodecCounters {
    /// `bytes_in / bytes_out`; 1.0 when nothing was counted.
    pub fn ratio(&self) -> f64 {
        if self.bytes_out == 0 {
            1.0
        } else {
            self.bytes_in as f64 / self.bytes_out as f64
        }
    }

    /// CPU seconds.
    pub fn cpu_seconds(&self) -> f64 {
        self.cpu_ns as f64 / 1e9
    }

    /// Input bytes per CPU second, if any CPU time was measured.
    pub fn bytes_per_cpu_second(&self) -> Option<f64> {
        (self.cpu_ns > 0).then(|| self.bytes_in as f64 / self.cpu_seconds())
    }

    /// Adds `other` to `self`.
    pub fn add(&mut self, other: &CodecCounters) {
        self.pages += other.pages;
        self.compressed += other.compressed;
        self.raw_fallbacks += other.raw_fallbacks;
        self.skipped_by_sampling += other.skipped_by_sampling;
        self.offload_fallbacks += other.offload_fallbacks;
        self.bytes_in += other.bytes_in;
        self.bytes_out += other.bytes_out;
        self.cpu_ns += other.cpu_ns;
    }
}

/// Counters for every codec implementation; one per worker, merged by the
/// engine with [`merge`](Self::merge).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CodecStats {
    per_impl: [CodecCounters; 7],
}

impl CodecStats {
    /// Counters of one implementation.
    pub fn get(&self, which: CodecImpl) -> &CodecCounters {
        &self.per_impl[which as usize]
    }

    /// Mutable counters of one implementation.
    pub fn get_mut(&mut self, which: CodecImpl) -> &mut CodecCounters {
        &mut self.per_impl[which as usize]
    }

    /// Adds another worker's counters.
    pub fn merge(&mut self, other: &CodecStats) {
        for (a, b) in self.per_impl.iter_mut().zip(&other.per_impl) {
            a.add(b);
        }
    }

    /// Implementations that saw at least one page, with their counters.
    pub fn used(&self) -> impl Iterator<Item = (CodecImpl, &CodecCounters)> {
        CodecImpl::ALL
            .into_iter()
            .zip(&self.per_impl)
            .filter(|(_, c)| c.pages > 0)
    }

    /// All raw fallbacks (did not shrink) across implementations.
    pub fn raw_fallbacks(&self) -> u64 {
        self.per_impl.iter().map(|c| c.raw_fallbacks).sum()
    }
}

impl fmt::Display for CodecStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (which, c) in self.used() {
            writeln!(
                f,
                "{}: pages {} (compressed {}, raw {}, skipped {}, offload fallback {}), \
                 in {} B, out {} B, ratio {:.2}, cpu {:.3} s",
                which.name(),
                c.pages,
                c.compressed,
                c.raw_fallbacks,
                c.skipped_by_sampling,
                c.offload_fallbacks,
                c.bytes_in,
                c.bytes_out,
                c.ratio(),
                c.cpu_seconds()
            )?;
        }
        Ok(())
    }
}

//! Compression settings and adaptive compression: the producer re-decides
//! the codec from the link rate and the codecs' measured speed and ratio.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tern_page::PageCompressor;
use tern_page::codec::{CodecChoice, CodecId, QplPath};

use super::Pipeline;
use crate::guest::{MemoryRegion, PAGE_SIZE};

/// What the workers compress with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CompressionSetup {
    pub choice: CodecChoice,
    pub level: Option<i32>,
    pub qpl_path: QplPath,
}

impl CompressionSetup {
    /// Codecs the session may use (announced in the hello as a bitmask).
    pub fn codecs(&self) -> Vec<CodecId> {
        match self.choice.wire() {
            Some(CodecId::None) => Vec::new(),
            Some(codec) => vec![codec],
            // auto: the codecs this build has (see tern-page's features).
            None => [CodecId::Zstd, CodecId::Deflate, CodecId::Lz4]
                .into_iter()
                .filter(|codec| codec.is_built())
                .collect(),
        }
    }

    /// A compressor for `codec`, as the user's choice asks (QPL for deflate
    /// when `qpl` was chosen).
    pub fn compressor(&self, codec: CodecId) -> Result<PageCompressor, tern_page::CodecError> {
        let level = self.level.unwrap_or_else(|| codec.default_level());
        if self.choice == CodecChoice::Qpl && codec == CodecId::Deflate {
            PageCompressor::with_qpl(self.qpl_path, level)
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
}

/// Adaptive compression decides again after at least this many batches and
/// this much time: enough to measure the link, often enough to follow it.
const AUTO_DECISION_BATCHES: u64 = 16;
const AUTO_DECISION_INTERVAL: Duration = Duration::from_millis(50);

impl AutoCodec {
    pub(super) fn new(workers: usize, regions: &[MemoryRegion]) -> Self {
        Self {
            selector: tern_page::AutoSelector::new(workers),
            measurements: calibrate_codecs(regions),
            batches_since: 0,
            window_started: Instant::now(),
            wire_at_start: 0,
            busy_at_start: 0,
            switches: 0,
        }
    }
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
        let link = wire_rate / busy_share;
        if self.codec != CodecId::None {
            let level = self
                .shared
                .compression
                .level
                .unwrap_or_else(|| self.codec.default_level());
            let counters = self
                .codec_stats
                .used()
                .find(|(which, _)| which.wire() == self.codec)
                .map(|(_, counters)| *counters);
            if let Some(measured) = counters.and_then(|counters| {
                tern_page::codec::CodecMeasurement::from_counters(self.codec, level, &counters)
            }) {
                auto.measurements.retain(|known| known.codec != self.codec);
                auto.measurements.push(measured);
            }
        }
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
        }
        auto.batches_since = 0;
        auto.window_started = Instant::now();
        auto.wire_at_start = wire;
        auto.busy_at_start = busy;
    }
}

/// Measures the candidate codecs on pages sampled across guest memory, so
/// adaptive compression starts from numbers of this guest and this machine.
fn calibrate_codecs(regions: &[MemoryRegion]) -> Vec<tern_page::codec::CodecMeasurement> {
    const SAMPLES: u64 = 64;
    let total: u64 = regions.iter().map(MemoryRegion::pages).sum();
    let mut sample = Vec::with_capacity(SAMPLES as usize);
    for index in 0..SAMPLES {
        let mut global = index * total.max(1) / SAMPLES;
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
    let candidates = [
        (CodecId::Zstd, CodecId::Zstd.default_level()),
        (CodecId::Deflate, CodecId::Deflate.default_level()),
        (CodecId::Lz4, CodecId::Lz4.default_level()),
    ];
    tern_page::codec::calibrate(&sample, &candidates).unwrap_or_default()
}

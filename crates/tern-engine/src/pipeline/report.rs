//! Publishing the pipeline's codec and zero-detection reports into the
//! live statistics.

use tern_page::codec::CodecChoice;

use super::Pipeline;
use crate::config::ZeroPageDetection;
use crate::guest::PAGE_SIZE;
use crate::stats::{CodecReport, CompressionReport, OffloadReport, ZeroDetectionReport};

impl Pipeline<'_> {
    /// Publishes the compression and zero-page detection counters to the
    /// live statistics (once per iteration: not on the per-page path).
    pub(super) fn publish_reports(&self) {
        let shared = &self.shared;
        if shared.compression.choice != CodecChoice::None {
            shared.stats.set_compression(CompressionReport {
                choice: shared.compression.choice.name().to_string(),
                level: shared.compression.level,
                codec_switches: self
                    .auto
                    .as_ref()
                    .map_or(0, |auto| auto.report.codec_switches),
                codecs: self
                    .codec_stats
                    .used()
                    .map(|(which, counters)| {
                        (which.name().to_string(), CodecReport::from(counters))
                    })
                    .collect(),
                dictionary: self.dictionary_report(),
                auto: self.auto_report(),
            });
        }
        let offload = shared.zero_offload.as_ref().map(|offload| {
            let stats = offload.stats();
            let checked = stats.pages_device + stats.pages_cpu + stats.pages_fallback;
            let gib = (checked * PAGE_SIZE as u64) as f64 / (1u64 << 30) as f64;
            let cpu = stats.completion_thread_cpu.as_secs_f64();
            OffloadReport {
                pages_device: stats.pages_device,
                pages_cpu: stats.pages_cpu,
                cpu_fallbacks: stats.pages_fallback,
                page_faults: stats.page_faults,
                device_errors: stats.device_errors,
                batches: stats.batches,
                submit_retries: stats.submit_retries,
                submit_failures: stats.submit_failures,
                pages_queue_full: stats.pages_queue_full,
                queues_disabled: stats.queues_disabled,
                slots_retired: stats.slots_retired,
                completion_thread_cpu_seconds: cpu,
                cpu_seconds_per_gib: if gib > 0.0 { cpu / gib } else { 0.0 },
            }
        });
        shared.stats.set_zero_detection(ZeroDetectionReport {
            mode: shared.detection.as_str().to_string(),
            backend: match (&shared.zero_offload, shared.detection) {
                (Some(offload), _) => offload.describe(),
                (None, ZeroPageDetection::None) => "none".to_string(),
                (None, _) => shared.zero_checker.backend().name().to_string(),
            },
            offload,
        });
    }

    /// Auto's decisions so far (with `auto`).
    fn auto_report(&self) -> Option<crate::stats::AutoReport> {
        self.auto.as_ref().map(|auto| auto.report.clone())
    }
}

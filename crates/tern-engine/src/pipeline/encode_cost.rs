//! What the workers' encoding cost per page over a whole pass: the figure
//! the downtime estimate charges the last pages with.
//!
//! The codec's own speed is measured on the pages it compresses, but a
//! pass's pages are not all such pages: zero pages, duplicates and delta
//! pages never reach the compressor, and cost a fraction of it. Charging
//! every dirty page at the codec's speed overestimated the last pages'
//! time four to tenfold in the running case, where the re-dirtied working
//! set goes as deltas (issue 31, session 45: 199-269 ms expected, 19-64 ms
//! taken, in 6 of 6 runs of series `lag45-running-qemu`); the rules then
//! waited a pass or two longer than needed, and a first pass whose
//! expected time did not shrink counted towards the throttle. The link's
//! part of the estimate already takes the last pass's mix (its rate is in
//! guest bytes, after compression and deltas); this takes the same mix for
//! the workers.

use tern_page::codec::CodecId;

use crate::guest::PAGE_SIZE;

/// Fewer pages than this in a pass are too few to tell a per-page cost
/// (one batch's clock reads cover a few microseconds at best).
const ENOUGH_PAGES: u64 = 1024;

/// The workers' CPU time and pages over the pass being sent, and the
/// figure of the pass before.
#[derive(Debug, Default)]
pub(super) struct PassEncodeCost {
    current: PassTally,
    last: Option<PassTally>,
}

#[derive(Clone, Copy, Debug, Default)]
struct PassTally {
    pages: u64,
    cpu_ns: u64,
    /// The codec and level of the pass's batches, while all had the same;
    /// `None` before the first batch.
    setting: Option<(CodecId, i32)>,
    /// A batch had another codec or level than the first.
    mixed: bool,
}

impl PassEncodeCost {
    /// A batch of `pages` pages took a worker `cpu_ns` of CPU to encode
    /// with `codec` at `level`.
    pub(super) fn add(&mut self, pages: u64, cpu_ns: u64, codec: CodecId, level: i32) {
        let tally = &mut self.current;
        tally.pages += pages;
        tally.cpu_ns = tally.cpu_ns.saturating_add(cpu_ns);
        match tally.setting {
            None => tally.setting = Some((codec, level)),
            Some(setting) if setting != (codec, level) => tally.mixed = true,
            Some(_) => {}
        }
    }

    /// The pass ended (every batch of it came back): its figure replaces
    /// the one before.
    pub(super) fn end_pass(&mut self) {
        self.last = Some(std::mem::take(&mut self.current));
    }

    /// Guest bytes per CPU second one worker encoded in the last pass,
    /// when it had enough pages, all with `codec` at `level` (the setting
    /// the last pages will be sent with); `None` otherwise, for the codec's
    /// own speed to be used instead.
    pub(super) fn last_pass_bytes_per_cpu_sec(&self, codec: CodecId, level: i32) -> Option<f64> {
        let last = self.last?;
        if last.pages < ENOUGH_PAGES || last.mixed || last.setting != Some((codec, level)) {
            return None;
        }
        let seconds = last.cpu_ns.max(1) as f64 / 1e9;
        Some(last.pages as f64 * PAGE_SIZE as f64 / seconds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ZSTD: CodecId = CodecId::ZstdPacket;

    #[test]
    fn the_last_whole_pass_gives_the_cost_per_page() {
        let mut cost = PassEncodeCost::default();
        assert_eq!(cost.last_pass_bytes_per_cpu_sec(ZSTD, 1), None);
        // 2048 pages (8 MiB) in 10 ms of worker CPU: 838.9 MB/s.
        cost.add(1024, 4_000_000, ZSTD, 1);
        cost.add(1024, 6_000_000, ZSTD, 1);
        assert_eq!(
            cost.last_pass_bytes_per_cpu_sec(ZSTD, 1),
            None,
            "the pass is not over"
        );
        cost.end_pass();
        let speed = cost.last_pass_bytes_per_cpu_sec(ZSTD, 1).unwrap();
        assert!((speed - 2048.0 * 4096.0 / 0.01).abs() < 1.0, "{speed}");
        // Another setting for the last pages: the pass says nothing of it.
        assert_eq!(cost.last_pass_bytes_per_cpu_sec(ZSTD, 3), None);
        assert_eq!(cost.last_pass_bytes_per_cpu_sec(CodecId::Lz4, 1), None);
        // The next pass replaces it once over, not before.
        cost.add(2048, 40_000_000, ZSTD, 1);
        assert!(cost.last_pass_bytes_per_cpu_sec(ZSTD, 1).unwrap() > 8e8);
        cost.end_pass();
        assert!(cost.last_pass_bytes_per_cpu_sec(ZSTD, 1).unwrap() < 3e8);
    }

    #[test]
    fn a_short_or_mixed_pass_is_no_figure() {
        let mut cost = PassEncodeCost::default();
        cost.add(ENOUGH_PAGES - 1, 1_000_000, ZSTD, 1);
        cost.end_pass();
        assert_eq!(cost.last_pass_bytes_per_cpu_sec(ZSTD, 1), None);
        cost.add(ENOUGH_PAGES, 1_000_000, ZSTD, 1);
        cost.end_pass();
        assert!(
            cost.last_pass_bytes_per_cpu_sec(ZSTD, 1).is_some(),
            "just enough"
        );
        cost.add(1024, 1_000_000, ZSTD, 1);
        cost.add(1024, 1_000_000, ZSTD, 3);
        cost.end_pass();
        assert_eq!(cost.last_pass_bytes_per_cpu_sec(ZSTD, 1), None);
        assert_eq!(cost.last_pass_bytes_per_cpu_sec(ZSTD, 3), None);
        // A batch that took no measurable time still gives a finite figure.
        cost.add(4096, 0, ZSTD, 1);
        cost.end_pass();
        assert!(
            cost.last_pass_bytes_per_cpu_sec(ZSTD, 1)
                .unwrap()
                .is_finite()
        );
    }
}
